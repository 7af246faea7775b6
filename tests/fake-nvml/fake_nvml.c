/*
 * fake_nvml.c: a small NVML-compatible shared library for gpuhub's tests.
 *
 * It implements exactly the NVML entry points gpuhub's telemetry calls through
 * nvml-wrapper 0.13 (see /work/shared/REFERENCE.md "NVML and dcgm-exporter
 * compatibility" and nvml-wrapper-sys `src/bindings.rs` for the struct layouts),
 * so the agent runs the same code path it runs against the real driver.
 *
 * Build:  cc -shared -fPIC -O2 -o libnvidia-ml.so.1 fake_nvml.c   (tests/fake-nvml/build.sh)
 *
 * Script: a text file, re-read whenever it changes (compare inode, size and mtime), so a test
 * can change values while the agent runs (write a temp file and rename it over the script).
 * Where: $GPUHUB_FAKE_NVML_CONFIG, else `fake-nvml.conf` next to this library (found with
 * dladdr), so parallel tests can each load their own copy with their own script.
 * No readable script: nvmlInit_v2 returns NVML_ERROR_DRIVER_NOT_LOADED (like a node without
 * a driver). Format, one item per line, `#` starts a comment, values may be "quoted":
 *
 *   driver version=550.54.15
 *   gpu index=0 uuid=GPU-... name="NVIDIA H200" pci=00000000:19:00.0 mem_total=150754820096
 *       mem_used=1073741824 util=37 mem_util=12 temp=41 power_mw=250000 energy_mj=1000
 *       sm_clock=1980 mem_clock=2619 ecc_sbe=0 ecc_dbe=0 fail=temp,power unsupported=ecc
 *       xid=79,48 mem_reserved=0 memory_temp=52 pcie_tx_kbs=1000 pcie_rx_kbs=2000
 *       pcie_replay=3 enc_util=4 dec_util=5 nvlink_tx_kibps=1000 nvlink_rx_kibps=3000
 *       remap_cor=6 remap_unc=7 remap_failed=0 gpm_gr_engine=61.5 gpm_sm_active=52.5
 *       gpm_sm_occupancy=33.25 gpm_tensor=24.5 gpm_dram=45.5 gpm_pcie_tx=1500 gpm_pcie_rx=2500
 *       gpm_nvlink_tx=3500 gpm_nvlink_rx=4500
 *   proc gpu=0 pid=1234 mem=1073741824 sm=30 mem_util=5
 *
 * (a `gpu` item is one line.) `fail=` fields return NVML_ERROR_UNKNOWN, `unsupported=` fields
 * NVML_ERROR_NOT_SUPPORTED; field names: name uuid util mem temp power energy clock ecc pci
 * procs proc_util xid memory_temp pcie_throughput pcie_replay enc_util dec_util
 * nvlink_bandwidth remapped_rows gpm gpm_gr_engine gpm_sm_active gpm_sm_occupancy gpm_tensor
 * gpm_dram gpm_pcie_tx gpm_pcie_rx gpm_nvlink_tx gpm_nvlink_rx. The energy counter grows at the
 * scripted power from library init: energy = energy_mj + power_mw * seconds since nvmlInit;
 * the NVLink data counters (nvmlDeviceGetFieldValues, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX/RX,
 * KiB) likewise grow at nvlink_tx_kibps / nvlink_rx_kibps, stamped with the same clock.
 *
 * GPM (Hopper's GPU Performance Monitoring: nvmlGpmSampleAlloc/Get/Free, nvmlGpmMetricsGet,
 * nvmlGpmQueryDeviceSupport): the metrics between two samples of one GPU are the scripted
 * gpm_* values (percent for the utilisations, MiB/s for PCIe and NVLink, as nvml.h says).
 * `unsupported=gpm` makes the GPU a pre-Hopper one (isSupportedDevice = 0, sampling refused);
 * `unsupported=gpm_tensor` refuses that one metric (its nvmlReturn, not the call's). Samples
 * are malloc'ed; fake_nvml_gpm_live_samples() says how many are not freed (a leak check).
 *
 * XID events: `xid=` lists every XID the GPU has had, oldest first (cumulative: to add one,
 * append it, e.g. `xid=79` then `xid=79,79`). An event set registered for the GPU (matched by
 * UUID) delivers each entry once, in order, from nvmlEventSetWait_v2; entries already listed
 * when the set was registered are not delivered, as with NVML ("events that occurred before
 * this call was made will not be recorded"). A shorter list rewinds the set's position.
 * `unsupported=xid`: nvmlDeviceGetSupportedEventTypes leaves out the XID bit and registering
 * for it returns NOT_SUPPORTED. `fail=xid`: both, and nvmlEventSetWait_v2 on a set holding the
 * GPU, return NVML_ERROR_UNKNOWN.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_UNKNOWN 999

#define MAX_GPUS 64
#define MAX_PROCS 4096
#define MAX_XIDS 1024
#define MAX_EVENT_SETS 128

/* nvmlEventType* bits. */
#define EV_SBE 1ull
#define EV_DBE 2ull
#define EV_PSTATE 4ull
#define EV_XID 8ull
#define EV_CLOCK 16ull
#define EV_SUPPORTED (EV_SBE | EV_DBE | EV_PSTATE | EV_XID | EV_CLOCK)

/* The GPM metrics the fake scripts: NVML's metric ids and the script keys (= field names). */
#define GPM_METRICS 9
static const unsigned int gpm_ids[GPM_METRICS] = {1, 2, 3, 5, 10, 20, 21, 61, 60};
static const char *const gpm_names[GPM_METRICS] = {
    "gpm_gr_engine", "gpm_sm_active", "gpm_sm_occupancy", "gpm_tensor", "gpm_dram",
    "gpm_pcie_tx", "gpm_pcie_rx", "gpm_nvlink_tx", "gpm_nvlink_rx"};

/* Layouts from nvml-wrapper-sys 0.10 src/bindings.rs. */
typedef struct { unsigned int gpu; unsigned int memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* nvmlProcessInfo_v2_st: 24 bytes */
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

struct fake_gpu {
    unsigned int index;
    char uuid[96], name[96], pci[32];
    unsigned long long mem_total, mem_used, mem_reserved, energy_mj, ecc_sbe, ecc_dbe;
    unsigned int util, mem_util, temp, power_mw, sm_clock, mem_clock;
    unsigned int memory_temp, pcie_tx_kbs, pcie_rx_kbs, pcie_replay, enc_util, dec_util;
    unsigned int remap_cor, remap_unc, remap_failed;
    unsigned long long nvlink_tx_kibps, nvlink_rx_kibps;
    double gpm[9]; /* in gpm_ids order */
    char fail[256], unsupported[256];
    unsigned long long xid[MAX_XIDS];
    unsigned int xid_count;
};
struct fake_proc { unsigned int gpu, pid, sm, mem_util; unsigned long long mem; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialised;
static struct timespec init_time;
static char driver_version[80] = "550.54.15";
static struct fake_gpu gpus[MAX_GPUS];
static unsigned int gpu_count;
static struct fake_proc procs[MAX_PROCS];
static unsigned int proc_count;
static struct stat loaded_stat;
static int loaded;

/* The device handle is a pointer to its slot; nvml-wrapper only passes it back. */
typedef struct fake_gpu *nvmlDevice_t;

static int config_path(char *out, size_t len) {
    const char *env = getenv("GPUHUB_FAKE_NVML_CONFIG");
    if (env && *env) {
        snprintf(out, len, "%s", env);
        return 0;
    }
    Dl_info info;
    if (!dladdr((void *)config_path, &info) || !info.dli_fname) return -1;
    snprintf(out, len, "%s", info.dli_fname);
    char *slash = strrchr(out, '/');
    if (!slash) return -1;
    snprintf(slash + 1, len - (size_t)(slash + 1 - out), "fake-nvml.conf");
    return 0;
}

/* Splits `key=value` tokens, honouring double quotes. Returns the next token or NULL. */
static char *next_token(char **cursor) {
    char *p = *cursor;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p || *p == '\n' || *p == '#') return NULL;
    char *start = p, *w = p;
    int quoted = 0;
    while (*p && (quoted || (*p != ' ' && *p != '\t' && *p != '\n'))) {
        if (*p == '"') { quoted = !quoted; p++; continue; }
        *w++ = *p++;
    }
    if (*p) p++;
    *w = '\0';
    *cursor = p;
    return start;
}

static void parse_gpu(char *cur, struct fake_gpu *g) {
    char *tok;
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "NVIDIA H200");
    while ((tok = next_token(&cur))) {
        char *eq = strchr(tok, '=');
        if (!eq) continue;
        *eq = '\0';
        const char *k = tok, *v = eq + 1;
        unsigned long long n = strtoull(v, NULL, 10);
        if (!strcmp(k, "index")) g->index = (unsigned)n;
        else if (!strcmp(k, "uuid")) snprintf(g->uuid, sizeof g->uuid, "%s", v);
        else if (!strcmp(k, "name")) snprintf(g->name, sizeof g->name, "%s", v);
        else if (!strcmp(k, "pci")) snprintf(g->pci, sizeof g->pci, "%s", v);
        else if (!strcmp(k, "mem_total")) g->mem_total = n;
        else if (!strcmp(k, "mem_used")) g->mem_used = n;
        else if (!strcmp(k, "util")) g->util = (unsigned)n;
        else if (!strcmp(k, "mem_util")) g->mem_util = (unsigned)n;
        else if (!strcmp(k, "temp")) g->temp = (unsigned)n;
        else if (!strcmp(k, "power_mw")) g->power_mw = (unsigned)n;
        else if (!strcmp(k, "energy_mj")) g->energy_mj = n;
        else if (!strcmp(k, "sm_clock")) g->sm_clock = (unsigned)n;
        else if (!strcmp(k, "mem_clock")) g->mem_clock = (unsigned)n;
        else if (!strcmp(k, "ecc_sbe")) g->ecc_sbe = n;
        else if (!strcmp(k, "ecc_dbe")) g->ecc_dbe = n;
        else if (!strcmp(k, "mem_reserved")) g->mem_reserved = n;
        else if (!strcmp(k, "memory_temp")) g->memory_temp = (unsigned)n;
        else if (!strcmp(k, "pcie_tx_kbs")) g->pcie_tx_kbs = (unsigned)n;
        else if (!strcmp(k, "pcie_rx_kbs")) g->pcie_rx_kbs = (unsigned)n;
        else if (!strcmp(k, "pcie_replay")) g->pcie_replay = (unsigned)n;
        else if (!strcmp(k, "enc_util")) g->enc_util = (unsigned)n;
        else if (!strcmp(k, "dec_util")) g->dec_util = (unsigned)n;
        else if (!strcmp(k, "remap_cor")) g->remap_cor = (unsigned)n;
        else if (!strcmp(k, "remap_unc")) g->remap_unc = (unsigned)n;
        else if (!strcmp(k, "remap_failed")) g->remap_failed = (unsigned)n;
        else if (!strcmp(k, "nvlink_tx_kibps")) g->nvlink_tx_kibps = n;
        else if (!strcmp(k, "nvlink_rx_kibps")) g->nvlink_rx_kibps = n;
        else if (!strncmp(k, "gpm_", 4)) {
            for (unsigned int i = 0; i < GPM_METRICS; i++)
                if (!strcmp(k, gpm_names[i])) g->gpm[i] = strtod(v, NULL);
        }
        else if (!strcmp(k, "fail")) snprintf(g->fail, sizeof g->fail, ",%s,", v);
        else if (!strcmp(k, "unsupported")) snprintf(g->unsupported, sizeof g->unsupported, ",%s,", v);
        else if (!strcmp(k, "xid")) {
            const char *p = v;
            while (*p && g->xid_count < MAX_XIDS) {
                char *end;
                unsigned long long code = strtoull(p, &end, 10);
                if (end == p) break;
                g->xid[g->xid_count++] = code;
                p = *end == ',' ? end + 1 : end;
            }
        }
    }
}

static void parse_proc(char *cur, struct fake_proc *p) {
    char *tok;
    memset(p, 0, sizeof *p);
    while ((tok = next_token(&cur))) {
        char *eq = strchr(tok, '=');
        if (!eq) continue;
        *eq = '\0';
        unsigned long long n = strtoull(eq + 1, NULL, 10);
        if (!strcmp(tok, "gpu")) p->gpu = (unsigned)n;
        else if (!strcmp(tok, "pid")) p->pid = (unsigned)n;
        else if (!strcmp(tok, "mem")) p->mem = n;
        else if (!strcmp(tok, "sm")) p->sm = (unsigned)n;
        else if (!strcmp(tok, "mem_util")) p->mem_util = (unsigned)n;
    }
}

/* (Re)loads the script when it changed. Caller holds `lock`. Returns 0 when a script is loaded. */
static int reload(void) {
    char path[4096];
    struct stat st;
    if (config_path(path, sizeof path) || stat(path, &st)) return loaded ? 0 : -1;
    if (loaded && st.st_ino == loaded_stat.st_ino && st.st_size == loaded_stat.st_size &&
        st.st_mtim.tv_sec == loaded_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == loaded_stat.st_mtim.tv_nsec)
        return 0;
    FILE *f = fopen(path, "r");
    if (!f) return loaded ? 0 : -1;
    gpu_count = 0;
    proc_count = 0;
    char line[4096];
    while (fgets(line, sizeof line, f)) {
        char *cur = line, *kind = next_token(&cur);
        if (!kind) continue;
        if (!strcmp(kind, "gpu") && gpu_count < MAX_GPUS) parse_gpu(cur, &gpus[gpu_count++]);
        else if (!strcmp(kind, "proc") && proc_count < MAX_PROCS) parse_proc(cur, &procs[proc_count++]);
        else if (!strcmp(kind, "driver")) {
            char *tok;
            while ((tok = next_token(&cur)))
                if (!strncmp(tok, "version=", 8)) snprintf(driver_version, sizeof driver_version, "%s", tok + 8);
        }
    }
    fclose(f);
    loaded_stat = st;
    loaded = 1;
    return 0;
}

static int has(const char *list, const char *field) {
    char needle[64];
    snprintf(needle, sizeof needle, ",%s,", field);
    return strstr(list, needle) != NULL;
}

/* The common prologue of a device query: checks init and the handle, applies fail=/unsupported=. */
static nvmlReturn_t enter(nvmlDevice_t d, const char *field) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || d < gpus || d >= gpus + gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
    if (field && has(d->fail, field)) return NVML_ERROR_UNKNOWN;
    if (field && has(d->unsupported, field)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

#define LOCKED(expr) do { pthread_mutex_lock(&lock); nvmlReturn_t r_ = (expr); pthread_mutex_unlock(&lock); return r_; } while (0)

static nvmlReturn_t do_init(void) {
    if (reload()) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (!initialised) clock_gettime(CLOCK_MONOTONIC, &init_time);
    initialised++;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { LOCKED(do_init()); }
nvmlReturn_t nvmlInit(void) { LOCKED(do_init()); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; LOCKED(do_init()); }

static nvmlReturn_t do_shutdown(void) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    initialised--;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlShutdown(void) { LOCKED(do_shutdown()); }

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

static nvmlReturn_t do_driver(char *v, unsigned int len) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    return copy_str(v, len, driver_version);
}
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int len) { LOCKED(do_driver(v, len)); }

static nvmlReturn_t do_count(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    reload();
    *count = gpu_count;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { LOCKED(do_count(count)); }
nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { LOCKED(do_count(count)); }

static nvmlReturn_t do_handle(unsigned int index, nvmlDevice_t *dev) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!dev) return NVML_ERROR_INVALID_ARGUMENT;
    reload();
    for (unsigned int i = 0; i < gpu_count; i++)
        if (gpus[i].index == index) { *dev = &gpus[i]; return NVML_SUCCESS; }
    return NVML_ERROR_INVALID_ARGUMENT;
}
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *dev) { LOCKED(do_handle(index, dev)); }
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *dev) { LOCKED(do_handle(index, dev)); }

static nvmlReturn_t do_index(nvmlDevice_t d, unsigned int *index) {
    nvmlReturn_t r = enter(d, NULL);
    if (r) return r;
    *index = d->index;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t d, unsigned int *index) { LOCKED(do_index(d, index)); }

static nvmlReturn_t do_name(nvmlDevice_t d, char *name, unsigned int len) {
    nvmlReturn_t r = enter(d, "name");
    return r ? r : copy_str(name, len, d->name);
}
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int len) { LOCKED(do_name(d, name, len)); }

static nvmlReturn_t do_uuid(nvmlDevice_t d, char *uuid, unsigned int len) {
    nvmlReturn_t r = enter(d, "uuid");
    return r ? r : copy_str(uuid, len, d->uuid);
}
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int len) { LOCKED(do_uuid(d, uuid, len)); }

static nvmlReturn_t do_pci(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    nvmlReturn_t r = enter(d, "pci");
    if (r) return r;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->pci[0] ? d->pci : "00000000:00:00.0");
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%.15s", pci->busId + 4);
    pci->bus = 0x19 + d->index;
    pci->pciDeviceId = 0x233510de;
    pci->pciSubSystemId = 0x18be10de;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) { LOCKED(do_pci(d, pci)); }

static nvmlReturn_t do_util(nvmlDevice_t d, nvmlUtilization_t *u) {
    nvmlReturn_t r = enter(d, "util");
    if (r) return r;
    u->gpu = d->util;
    u->memory = d->mem_util;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *u) { LOCKED(do_util(d, u)); }

static nvmlReturn_t do_mem2(nvmlDevice_t d, nvmlMemory_v2_t *m) {
    nvmlReturn_t r = enter(d, "mem");
    if (r) return r;
    if (!m || m->version != (unsigned)(sizeof(nvmlMemory_v2_t) | (2u << 24))) return NVML_ERROR_INVALID_ARGUMENT;
    m->total = d->mem_total;
    m->reserved = d->mem_reserved;
    m->used = d->mem_used;
    m->free = d->mem_total > d->mem_used ? d->mem_total - d->mem_used : 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t d, nvmlMemory_v2_t *m) { LOCKED(do_mem2(d, m)); }

static nvmlReturn_t do_mem(nvmlDevice_t d, nvmlMemory_t *m) {
    nvmlReturn_t r = enter(d, "mem");
    if (r) return r;
    m->total = d->mem_total;
    m->used = d->mem_used;
    m->free = d->mem_total > d->mem_used ? d->mem_total - d->mem_used : 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) { LOCKED(do_mem(d, m)); }

static nvmlReturn_t do_temp(nvmlDevice_t d, int sensor, unsigned int *t) {
    nvmlReturn_t r = enter(d, "temp");
    if (r) return r;
    if (sensor != 0) return NVML_ERROR_NOT_SUPPORTED;
    *t = d->temp;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *t) { LOCKED(do_temp(d, sensor, t)); }

static nvmlReturn_t do_power(nvmlDevice_t d, unsigned int *mw) {
    nvmlReturn_t r = enter(d, "power");
    if (r) return r;
    *mw = d->power_mw;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) { LOCKED(do_power(d, mw)); }

static nvmlReturn_t do_energy(nvmlDevice_t d, unsigned long long *mj) {
    nvmlReturn_t r = enter(d, "energy");
    if (r) return r;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double secs = (double)(now.tv_sec - init_time.tv_sec) + (double)(now.tv_nsec - init_time.tv_nsec) / 1e9;
    *mj = d->energy_mj + (unsigned long long)((double)d->power_mw * secs);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEnergyConsumption(nvmlDevice_t d, unsigned long long *mj) { LOCKED(do_energy(d, mj)); }

static nvmlReturn_t do_clock(nvmlDevice_t d, int type, unsigned int *mhz) {
    nvmlReturn_t r = enter(d, "clock");
    if (r) return r;
    switch (type) {
    case 0: case 1: *mhz = d->sm_clock; return NVML_SUCCESS; /* graphics, SM */
    case 2: *mhz = d->mem_clock; return NVML_SUCCESS;        /* memory */
    default: return NVML_ERROR_NOT_SUPPORTED;
    }
}
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned int *mhz) { LOCKED(do_clock(d, type, mhz)); }

static nvmlReturn_t do_ecc(nvmlDevice_t d, int error_type, int counter_type, unsigned long long *n) {
    nvmlReturn_t r = enter(d, "ecc");
    if (r) return r;
    (void)counter_type;
    *n = error_type == 0 ? d->ecc_sbe : d->ecc_dbe;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int e, int c, unsigned long long *n) { LOCKED(do_ecc(d, e, c, n)); }

/* NVML semantics: with *count too small (0 on the first call) return INSUFFICIENT_SIZE and the count. */
static nvmlReturn_t do_procs(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    nvmlReturn_t r = enter(d, "procs");
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int n = 0;
    for (unsigned int i = 0; i < proc_count; i++)
        if (procs[i].gpu == d->index) n++;
    if (*count < n || !infos) {
        *count = n;
        return n == 0 ? NVML_SUCCESS : NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (unsigned int i = 0; i < proc_count; i++) {
        if (procs[i].gpu != d->index) continue;
        infos[k].pid = procs[i].pid;
        infos[k].usedGpuMemory = procs[i].mem;
        infos[k].gpuInstanceId = 0xFFFFFFFFu;
        infos[k].computeInstanceId = 0xFFFFFFFFu;
        k++;
    }
    *count = k;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    LOCKED(do_procs(d, count, infos));
}

/* One sample per scripted process, stamped now (microseconds), newer than lastSeen. */
static nvmlReturn_t do_proc_util(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s, unsigned int *count,
                                 unsigned long long last_seen) {
    nvmlReturn_t r = enter(d, "proc_util");
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    unsigned long long ts = (unsigned long long)now.tv_sec * 1000000ull + (unsigned long long)now.tv_nsec / 1000ull;
    unsigned int n = 0;
    for (unsigned int i = 0; i < proc_count; i++)
        if (procs[i].gpu == d->index) n++;
    if (n == 0 || ts <= last_seen) return NVML_ERROR_NOT_FOUND;
    if (!s || *count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int k = 0;
    for (unsigned int i = 0; i < proc_count; i++) {
        if (procs[i].gpu != d->index) continue;
        s[k].pid = procs[i].pid;
        s[k].timeStamp = ts;
        s[k].smUtil = procs[i].sm;
        s[k].memUtil = procs[i].mem_util;
        s[k].encUtil = 0;
        s[k].decUtil = 0;
        k++;
    }
    *count = k;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t d, nvmlProcessUtilizationSample_t *s, unsigned int *count,
                                             unsigned long long last_seen) {
    LOCKED(do_proc_util(d, s, count, last_seen));
}

/* ---- Events: nvmlEventSetCreate/Free, nvmlDeviceGetSupportedEventTypes,
 * nvmlDeviceRegisterEvents, nvmlEventSetWait_v2. A set is a slot in `event_sets`; it remembers
 * per GPU UUID which event types it wants and how many of the GPU's scripted XIDs it has
 * delivered. Keyed by UUID, not by slot, so a reloaded script keeps the positions. */
struct fake_watch { char uuid[96]; unsigned long long types; unsigned int delivered; };
struct fake_event_set { int in_use; unsigned int n; struct fake_watch w[MAX_GPUS]; };
typedef struct fake_event_set *nvmlEventSet_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t; /* nvmlEventData_st */

static struct fake_event_set event_sets[MAX_EVENT_SETS];

static int valid_set(nvmlEventSet_t set) {
    return set && set >= event_sets && set < event_sets + MAX_EVENT_SETS && set->in_use;
}

static struct fake_gpu *gpu_by_uuid(const char *uuid) {
    for (unsigned int i = 0; i < gpu_count; i++)
        if (!strcmp(gpus[i].uuid, uuid)) return &gpus[i];
    return NULL;
}

static nvmlReturn_t do_set_create(nvmlEventSet_t *set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned int i = 0; i < MAX_EVENT_SETS; i++) {
        if (event_sets[i].in_use) continue;
        memset(&event_sets[i], 0, sizeof event_sets[i]);
        event_sets[i].in_use = 1;
        *set = &event_sets[i];
        return NVML_SUCCESS;
    }
    return NVML_ERROR_UNKNOWN;
}
nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) { LOCKED(do_set_create(set)); }

static nvmlReturn_t do_set_free(nvmlEventSet_t set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    set->in_use = 0;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { LOCKED(do_set_free(set)); }

static nvmlReturn_t do_supported_events(nvmlDevice_t d, unsigned long long *types) {
    nvmlReturn_t r = enter(d, NULL);
    if (r) return r;
    if (!types) return NVML_ERROR_INVALID_ARGUMENT;
    if (has(d->fail, "xid")) return NVML_ERROR_UNKNOWN;
    *types = has(d->unsupported, "xid") ? EV_SUPPORTED & ~EV_XID : EV_SUPPORTED;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t d, unsigned long long *types) {
    LOCKED(do_supported_events(d, types));
}

static nvmlReturn_t do_register(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    nvmlReturn_t r = enter(d, NULL);
    if (r) return r;
    if (!valid_set(set)) return NVML_ERROR_INVALID_ARGUMENT;
    if (has(d->fail, "xid")) return NVML_ERROR_UNKNOWN;
    if ((types & ~EV_SUPPORTED) || ((types & EV_XID) && has(d->unsupported, "xid"))) return NVML_ERROR_NOT_SUPPORTED;
    struct fake_watch *w = NULL;
    for (unsigned int i = 0; i < set->n; i++)
        if (!strcmp(set->w[i].uuid, d->uuid)) w = &set->w[i];
    if (!w) {
        if (set->n >= MAX_GPUS) return NVML_ERROR_UNKNOWN;
        w = &set->w[set->n++];
        snprintf(w->uuid, sizeof w->uuid, "%s", d->uuid);
        w->delivered = d->xid_count; /* earlier events are not recorded */
    }
    w->types |= types;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t d, unsigned long long types, nvmlEventSet_t set) {
    LOCKED(do_register(d, types, set));
}

/* One pending event into *data, or NVML_ERROR_TIMEOUT when there is none. Caller holds `lock`. */
static nvmlReturn_t take_event(nvmlEventSet_t set, nvmlEventData_t *data) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!valid_set(set) || !data) return NVML_ERROR_INVALID_ARGUMENT;
    reload();
    for (unsigned int i = 0; i < set->n; i++) {
        struct fake_watch *w = &set->w[i];
        struct fake_gpu *g = gpu_by_uuid(w->uuid);
        if (!g || !(w->types & EV_XID)) continue;
        if (has(g->fail, "xid")) return NVML_ERROR_UNKNOWN;
        if (w->delivered > g->xid_count) w->delivered = g->xid_count;
        if (w->delivered == g->xid_count) continue;
        memset(data, 0, sizeof *data);
        data->device = g;
        data->eventType = EV_XID;
        data->eventData = g->xid[w->delivered++];
        data->gpuInstanceId = 0xFFFFFFFFu;
        data->computeInstanceId = 0xFFFFFFFFu;
        return NVML_SUCCESS;
    }
    return NVML_ERROR_TIMEOUT;
}

/* Returns at once when an event is pending; otherwise polls every millisecond (without holding
 * the lock) until one is or `timeoutms` passed. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    struct timespec start, now, tick = {0, 1000000};
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pthread_mutex_lock(&lock);
        nvmlReturn_t r = take_event(set, data);
        pthread_mutex_unlock(&lock);
        if (r != NVML_ERROR_TIMEOUT) return r;
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long waited_ms = (long long)(now.tv_sec - start.tv_sec) * 1000 + (now.tv_nsec - start.tv_nsec) / 1000000;
        if (waited_ms >= (long long)timeoutms) return NVML_ERROR_TIMEOUT;
        nanosleep(&tick, NULL);
    }
}

/* ---- dcgm-exporter's other default counters. */
static double secs_since_init(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - init_time.tv_sec) + (double)(now.tv_nsec - init_time.tv_nsec) / 1e9;
}

static nvmlReturn_t do_pcie_tp(nvmlDevice_t d, int counter, unsigned int *kbs) {
    nvmlReturn_t r = enter(d, "pcie_throughput");
    if (r) return r;
    if (!kbs || counter < 0 || counter > 1) return NVML_ERROR_INVALID_ARGUMENT;
    *kbs = counter == 0 ? d->pcie_tx_kbs : d->pcie_rx_kbs;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int counter, unsigned int *kbs) { LOCKED(do_pcie_tp(d, counter, kbs)); }

static nvmlReturn_t do_replay(nvmlDevice_t d, unsigned int *n) {
    nvmlReturn_t r = enter(d, "pcie_replay");
    if (r) return r;
    if (!n) return NVML_ERROR_INVALID_ARGUMENT;
    *n = d->pcie_replay;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned int *n) { LOCKED(do_replay(d, n)); }

static nvmlReturn_t do_codec(nvmlDevice_t d, int enc, unsigned int *util, unsigned int *period_us) {
    nvmlReturn_t r = enter(d, enc ? "enc_util" : "dec_util");
    if (r) return r;
    if (!util || !period_us) return NVML_ERROR_INVALID_ARGUMENT;
    *util = enc ? d->enc_util : d->dec_util;
    *period_us = 167000;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetEncoderUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p) {
    LOCKED(do_codec(d, 1, u, p));
}
nvmlReturn_t nvmlDeviceGetDecoderUtilization(nvmlDevice_t d, unsigned int *u, unsigned int *p) {
    LOCKED(do_codec(d, 0, u, p));
}

/* nvmlDeviceGetFieldValues: the fields gpuhub asks for; any other id is NOT_SUPPORTED in its slot. */
typedef union { double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal; long long sllVal; } nvmlValue_t;
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t; /* 40 bytes */
#define FI_MEMORY_TEMP 82
#define FI_NVLINK_DATA_TX 138
#define FI_NVLINK_DATA_RX 139
#define FI_REMAPPED_COR 142
#define FI_REMAPPED_UNC 143
#define FI_REMAPPED_FAILURE 145
#define VT_UINT 1
#define VT_ULL 3

static nvmlReturn_t field_status(nvmlDevice_t d, const char *field) {
    if (has(d->fail, field)) return NVML_ERROR_UNKNOWN;
    if (has(d->unsupported, field)) return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

static nvmlReturn_t do_field_values(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    nvmlReturn_t r = enter(d, NULL);
    if (r) return r;
    if (count <= 0 || !values) return NVML_ERROR_INVALID_ARGUMENT;
    struct timespec wall;
    clock_gettime(CLOCK_REALTIME, &wall);
    long long now_us = (long long)wall.tv_sec * 1000000ll + wall.tv_nsec / 1000;
    double secs = secs_since_init();
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = now_us;
        v->latencyUsec = 0;
        v->value.ullVal = 0;
        switch (v->fieldId) {
        case FI_MEMORY_TEMP:
            /* Like r545 (nvbugs/4300930): the type says double, the value is in uiVal. */
            v->nvmlReturn = field_status(d, "memory_temp");
            v->valueType = 0;
            v->value.uiVal = d->memory_temp;
            break;
        case FI_NVLINK_DATA_TX:
        case FI_NVLINK_DATA_RX:
            v->nvmlReturn = field_status(d, "nvlink_bandwidth");
            v->valueType = VT_ULL;
            v->value.ullVal = (unsigned long long)((double)(v->fieldId == FI_NVLINK_DATA_TX ? d->nvlink_tx_kibps : d->nvlink_rx_kibps) * secs);
            break;
        case FI_REMAPPED_COR:
        case FI_REMAPPED_UNC:
        case FI_REMAPPED_FAILURE:
            v->nvmlReturn = field_status(d, "remapped_rows");
            v->valueType = VT_UINT;
            v->value.uiVal = v->fieldId == FI_REMAPPED_COR ? d->remap_cor : v->fieldId == FI_REMAPPED_UNC ? d->remap_unc : d->remap_failed;
            break;
        default:
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) { LOCKED(do_field_values(d, count, values)); }

/* ---- GPM. */
#define GPM_MAGIC 0x67706d31u
struct nvmlGpmSample_st { unsigned int magic; int filled; char uuid[96]; struct timespec at; };
typedef struct nvmlGpmSample_st *nvmlGpmSample_t;
typedef struct {
    unsigned int metricId;
    nvmlReturn_t nvmlReturn;
    double value;
    struct { char *shortName, *longName, *unit; } metricInfo;
} nvmlGpmMetric_t;
typedef struct {
    unsigned int version, numMetrics;
    nvmlGpmSample_t sample1, sample2;
    nvmlGpmMetric_t metrics[98];
} nvmlGpmMetricsGet_t;
typedef struct { unsigned int version, isSupportedDevice; } nvmlGpmSupport_t;
static long gpm_live;

long fake_nvml_gpm_live_samples(void) {
    pthread_mutex_lock(&lock);
    long n = gpm_live;
    pthread_mutex_unlock(&lock);
    return n;
}

static nvmlReturn_t do_gpm_support(nvmlDevice_t d, nvmlGpmSupport_t *s) {
    nvmlReturn_t r = enter(d, NULL);
    if (r) return r;
    if (!s || s->version != 1) return NVML_ERROR_INVALID_ARGUMENT;
    if (has(d->fail, "gpm")) return NVML_ERROR_UNKNOWN;
    s->isSupportedDevice = !has(d->unsupported, "gpm");
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmQueryDeviceSupport(nvmlDevice_t d, nvmlGpmSupport_t *s) { LOCKED(do_gpm_support(d, s)); }

static nvmlReturn_t do_gpm_alloc(nvmlGpmSample_t *out) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlGpmSample_t s = calloc(1, sizeof *s);
    if (!s) return NVML_ERROR_UNKNOWN;
    s->magic = GPM_MAGIC;
    gpm_live++;
    *out = s;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmSampleAlloc(nvmlGpmSample_t *out) { LOCKED(do_gpm_alloc(out)); }

static nvmlReturn_t do_gpm_free(nvmlGpmSample_t s) {
    if (!s || s->magic != GPM_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    s->magic = 0;
    free(s);
    gpm_live--;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmSampleFree(nvmlGpmSample_t s) { LOCKED(do_gpm_free(s)); }

static nvmlReturn_t do_gpm_get(nvmlDevice_t d, nvmlGpmSample_t s) {
    nvmlReturn_t r = enter(d, "gpm");
    if (r) return r;
    if (!s || s->magic != GPM_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    snprintf(s->uuid, sizeof s->uuid, "%s", d->uuid);
    clock_gettime(CLOCK_MONOTONIC, &s->at);
    s->filled = 1;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmSampleGet(nvmlDevice_t d, nvmlGpmSample_t s) { LOCKED(do_gpm_get(d, s)); }

static nvmlReturn_t do_gpm_metrics(nvmlGpmMetricsGet_t *m) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!m || m->version != 1 || m->numMetrics > 98) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlGpmSample_t a = m->sample1, b = m->sample2;
    if (!a || !b || a->magic != GPM_MAGIC || b->magic != GPM_MAGIC || !a->filled || !b->filled) return NVML_ERROR_INVALID_ARGUMENT;
    /* Two samples of one GPU, the second one later. */
    if (strcmp(a->uuid, b->uuid)) return NVML_ERROR_INVALID_ARGUMENT;
    if (b->at.tv_sec < a->at.tv_sec || (b->at.tv_sec == a->at.tv_sec && b->at.tv_nsec <= a->at.tv_nsec)) return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *g = gpu_by_uuid(a->uuid);
    for (unsigned int i = 0; i < m->numMetrics; i++) {
        nvmlGpmMetric_t *x = &m->metrics[i];
        x->metricInfo.shortName = x->metricInfo.longName = x->metricInfo.unit = NULL;
        x->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        x->value = 0;
        if (!g) { x->nvmlReturn = NVML_ERROR_NOT_FOUND; continue; }
        for (unsigned int k = 0; k < GPM_METRICS; k++) {
            if (gpm_ids[k] != x->metricId) continue;
            x->nvmlReturn = field_status(g, gpm_names[k]);
            if (!x->nvmlReturn) x->value = g->gpm[k];
        }
    }
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlGpmMetricsGet(nvmlGpmMetricsGet_t *m) { LOCKED(do_gpm_metrics(m)); }
