//! dcgm-exporter-compatible series: every counter of dcgm-exporter's `etc/default-counters.csv`
//! that applies to a bare-metal node, with its name, Prometheus type, help text, unit and
//! labels, so existing Grafana dashboards (e.g. NVIDIA's 12239) and alert rules work unchanged
//! when the agent replaces dcgm-exporter. [`FAMILIES`] is the list, in the CSV's order.
//!
//! Labels, in dcgm-exporter's order: `gpu` (index), `UUID`, `pci_bus_id`, `device`
//! (`nvidia<N>`), `modelName`, `Hostname`, `DCGM_FI_DRIVER_VERSION` (the CSV's one `label`
//! entry), and `hpc_job`. Like dcgm-exporter with `--hpc-job-mapping-dir`, a GPU running several
//! jobs (shards) gets one copy of each series per job; a GPU without a job has `hpc_job=""`,
//! which Prometheus treats as no label. Dashboards must therefore not `sum` a DCGM series over
//! a GPU's copies (see `rpm/grafana/make-dashboards.py`: `max by (gpu, UUID)` first).
//!
//! Types are dcgm-exporter's, counters included: a counter is written as dcgm-exporter writes
//! it, `# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter` with samples of that very name (no
//! `_total`), in both exposition formats (Prometheus accepts such OpenMetrics counters; checked
//! with 2.42). Where dcgm-exporter calls a rate a counter (`PCIE_TX_THROUGHPUT`, KB/s;
//! `NVLINK_BANDWIDTH_TOTAL`, MB/s over the last interval, computed as DCGM does), the type is
//! still theirs, so a `rate()` someone already wrote behaves as it did.
//!
//! A field NVML refuses (or a GPU without GPM for `DCGM_FI_PROF_*`) is absent, never 0; the
//! sampler logs it once per GPU. `DCGM_FI_DEV_XID_ERRORS` is, as in DCGM, the code of the last
//! XID the GPU reported (0 before any); it exists only for GPUs watched for XID events
//! ([`super::xid`]). The count of XIDs is gpuhub's `gpuhub_gpu_xid_errors_total{xid}`.
//!
//! Why not prometheus-client families: with one copy per job the DCGM block is most of
//! `/metrics` (8 GPUs x 25 jobs x 32 series in `bench/agent-telemetry.sh`). The sampler builds
//! each GPU's label text once per pass and swaps in a new [`Snapshot`]; a scrape writes the
//! lines straight from it, and neither side hashes a label set per series.
//! Not exported: `DCGM_FI_DEV_VGPU_LICENSE_STATUS` (vGPU guests only).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use super::lock;
use super::nvml::GpuSample;

/// Prometheus type of a family, as dcgm-exporter declares it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Gauge => "gauge",
            Kind::Counter => "counter",
        }
    }
}

/// One value of one GPU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value {
    Int(u64),
    Float(f64),
}

/// What a family reads from a sample (plus the GPU's last XID code, which is state).
type Read = fn(&GpuSample, Option<u64>) -> Option<Value>;

/// One DCGM family: name, type, help (dcgm-exporter's text), how to read it.
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    pub help: &'static str,
    read: Read,
}

const MIB: u64 = 1024 * 1024;

fn int<T: Into<u64>>(v: Option<T>) -> Option<Value> {
    v.map(|v| Value::Int(v.into()))
}

fn float(v: Option<f64>) -> Option<Value> {
    v.filter(|v| v.is_finite()).map(Value::Float)
}

macro_rules! fam {
    ($name:literal, $kind:ident, $help:literal, $read:expr) => {
        Family { name: $name, kind: Kind::$kind, help: $help, read: $read }
    };
}

/// Every exported DCGM family, in the order of dcgm-exporter's default counters.
pub const FAMILIES: &[Family] = &[
    fam!("DCGM_FI_DEV_SM_CLOCK", Gauge, "SM clock frequency (in MHz).", |s, _| int(s.sm_clock_mhz)),
    fam!("DCGM_FI_DEV_MEM_CLOCK", Gauge, "Memory clock frequency (in MHz).", |s, _| int(s.mem_clock_mhz)),
    fam!("DCGM_FI_DEV_MEMORY_TEMP", Gauge, "Memory temperature (in C).", |s, _| int(s.memory_temp_c)),
    fam!("DCGM_FI_DEV_GPU_TEMP", Gauge, "GPU temperature (in C).", |s, _| int(s.temperature_c)),
    fam!("DCGM_FI_DEV_POWER_USAGE", Gauge, "Power draw (in W).", |s, _| float(s.power_mw.map(|mw| f64::from(mw) / 1000.0))),
    fam!("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", Counter, "Total energy consumption since boot (in mJ).", |s, _| int(s.energy_mj)),
    fam!("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", Counter, "Total number of bytes transmitted through PCIe TX (in KB) via NVML.", |s, _| int(
        s.pcie_tx_kbs
    )),
    fam!("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", Counter, "Total number of bytes received through PCIe RX (in KB) via NVML.", |s, _| int(
        s.pcie_rx_kbs
    )),
    fam!("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", Counter, "Total number of PCIe retries.", |s, _| int(s.pcie_replays)),
    fam!("DCGM_FI_DEV_GPU_UTIL", Gauge, "GPU utilization (in %).", |s, _| int(s.util_percent)),
    fam!("DCGM_FI_DEV_MEM_COPY_UTIL", Gauge, "Memory utilization (in %).", |s, _| int(s.mem_copy_util_percent)),
    fam!("DCGM_FI_DEV_ENC_UTIL", Gauge, "Encoder utilization (in %).", |s, _| int(s.enc_util_percent)),
    fam!("DCGM_FI_DEV_DEC_UTIL", Gauge, "Decoder utilization (in %).", |s, _| int(s.dec_util_percent)),
    fam!("DCGM_FI_DEV_XID_ERRORS", Gauge, "Value of the last XID error encountered.", |_, xid| int(xid)),
    fam!("DCGM_FI_DEV_FB_FREE", Gauge, "Framebuffer memory free (in MiB).", |s, _| int(s.memory_free_bytes.map(|b| b / MIB))),
    fam!("DCGM_FI_DEV_FB_USED", Gauge, "Framebuffer memory used (in MiB).", |s, _| int(s.memory_used_bytes.map(|b| b / MIB))),
    fam!("DCGM_FI_DEV_FB_RESERVED", Gauge, "Framebuffer memory reserved (in MiB).", |s, _| int(s.memory_reserved_bytes.map(|b| b / MIB))),
    // Not in the default CSV; kept because "VRAM in use" panels divide by it.
    fam!("DCGM_FI_DEV_FB_TOTAL", Gauge, "Framebuffer memory total (in MiB).", |s, _| int(s.memory_total_bytes.map(|b| b / MIB))),
    fam!("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", Counter, "Total number of single-bit volatile ECC errors.", |s, _| int(s.ecc_corrected)),
    fam!("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", Counter, "Total number of double-bit volatile ECC errors.", |s, _| int(s.ecc_uncorrected)),
    fam!("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", Counter, "Total number of NVLink bandwidth counters for all lanes.", |s, _| float(
        s.nvlink_bandwidth
    )),
    fam!("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", Counter, "Number of remapped rows for uncorrectable errors", |s, _| int(
        s.remapped_rows_uncorrectable
    )),
    fam!("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", Counter, "Number of remapped rows for correctable errors", |s, _| int(
        s.remapped_rows_correctable
    )),
    fam!("DCGM_FI_DEV_ROW_REMAP_FAILURE", Gauge, "Whether remapping of rows has failed", |s, _| int(s.row_remap_failure)),
    fam!("DCGM_FI_PROF_GR_ENGINE_ACTIVE", Gauge, "Ratio of time the graphics engine is active.", |s, _| float(s.prof.gr_engine_active)),
    fam!("DCGM_FI_PROF_SM_ACTIVE", Gauge, "The ratio of cycles an SM has at least 1 warp assigned.", |s, _| float(s.prof.sm_active)),
    fam!("DCGM_FI_PROF_SM_OCCUPANCY", Gauge, "The ratio of number of warps resident on an SM.", |s, _| float(s.prof.sm_occupancy)),
    fam!("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", Gauge, "Ratio of cycles the tensor (HMMA) pipe is active.", |s, _| float(
        s.prof.pipe_tensor_active
    )),
    fam!("DCGM_FI_PROF_DRAM_ACTIVE", Gauge, "Ratio of cycles the device memory interface is active sending or receiving data.", |s, _| {
        float(s.prof.dram_active)
    }),
    fam!(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        Gauge,
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        |s, _| float(s.prof.pcie_tx_bytes)
    ),
    fam!(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        Gauge,
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        |s, _| float(s.prof.pcie_rx_bytes)
    ),
    fam!(
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        Gauge,
        "The rate of data transmitted over NVLink - including both protocol headers and data payloads - in bytes per second.",
        |s, _| float(s.prof.nvlink_tx_bytes)
    ),
    fam!(
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        Gauge,
        "The rate of data received over NVLink - including both protocol headers and data payloads - in bytes per second.",
        |s, _| float(s.prof.nvlink_rx_bytes)
    ),
];

/// One GPU in a snapshot: the label text of each copy (one per job) and its values, indexed
/// like [`FAMILIES`].
#[derive(Debug, Clone, Default)]
struct GpuRow {
    labels: Vec<String>,
    values: Vec<Option<Value>>,
}

/// The DCGM series of one sampler pass, and their text once a scrape asked for it (encoded
/// once per pass however many scrapes come: an HA pair of Prometheus servers, or `curl`).
#[derive(Debug, Default)]
pub struct Snapshot {
    gpus: Vec<GpuRow>,
    text: std::sync::OnceLock<String>,
}

/// The DCGM block of `/metrics`: written by the sampler once per pass, encoded by scrapes.
#[derive(Debug, Default)]
pub struct DcgmExposition {
    current: Mutex<Arc<Snapshot>>,
}

impl DcgmExposition {
    /// Appends the DCGM families to `out`, in the text both exposition formats share (HELP,
    /// TYPE, samples; no `# EOF`). A family no GPU has a value for has its HELP and TYPE lines
    /// only (as prometheus-client writes an empty family), so the names are always listed.
    pub fn encode(&self, out: &mut String) {
        let snap = Arc::clone(&lock(&self.current));
        out.push_str(snap.text.get_or_init(|| snap.render()));
    }

    fn publish(&self, snap: Snapshot) {
        *lock(&self.current) = Arc::new(snap);
    }
}

impl Snapshot {
    fn render(&self) -> String {
        let lines: usize = self.gpus.iter().map(|g| g.labels.len()).sum::<usize>() * FAMILIES.len();
        let mut out = String::with_capacity(lines * 256 + FAMILIES.len() * 160);
        let mut value = String::with_capacity(32);
        for (i, fam) in FAMILIES.iter().enumerate() {
            let _ = write!(out, "# HELP {} {}\n# TYPE {} {}\n", fam.name, fam.help, fam.name, fam.kind.as_str());
            for g in &self.gpus {
                let Some(v) = g.values.get(i).copied().flatten() else { continue };
                value.clear();
                let _ = match v {
                    Value::Int(n) => write!(value, "{n}"),
                    Value::Float(f) => write!(value, "{f}"),
                };
                for l in &g.labels {
                    out.push_str(fam.name);
                    out.push('{');
                    out.push_str(l);
                    out.push_str("} ");
                    out.push_str(&value);
                    out.push('\n');
                }
            }
        }
        out
    }
}

/// The sampler's side: turns each pass into a [`Snapshot`] and keeps the last XID per GPU.
#[derive(Debug)]
pub struct DcgmWriter {
    out: Arc<DcgmExposition>,
    /// Last XID code per GPU UUID, for GPUs ever watched (0 until the first XID). Kept when a
    /// GPU leaves the sample so its value is back when the GPU is; bounded by the GPUs the
    /// node has had.
    last_xid: HashMap<String, u64>,
}

impl DcgmWriter {
    pub fn new(out: Arc<DcgmExposition>) -> Self {
        Self { out, last_xid: HashMap::new() }
    }

    /// Publishes one pass. `jobs` maps a GPU index to the job ids on it (sorted); GPUs or jobs
    /// no longer present, and fields NVML refused this time, are simply not in the snapshot.
    pub fn update(&mut self, samples: &[GpuSample], jobs: &BTreeMap<u32, Vec<u32>>, hostname: &str, driver: &str) {
        let mut snap = Snapshot { gpus: Vec::with_capacity(samples.len()), ..Snapshot::default() };
        let (hostname, driver) = (escape(hostname), escape(driver));
        for s in samples.iter().filter(|s| !s.uuid.is_empty()) {
            if let Some(codes) = &s.xid_events {
                let last = self.last_xid.entry(s.uuid.clone()).or_insert(0);
                if let Some(code) = codes.last() {
                    *last = *code;
                }
            }
            let last_xid = self.last_xid.get(&s.uuid).copied();
            let base = format!(
                "gpu=\"{}\",UUID=\"{}\",pci_bus_id=\"{}\",device=\"nvidia{}\",modelName=\"{}\",Hostname=\"{hostname}\",DCGM_FI_DRIVER_VERSION=\"{driver}\",hpc_job=\"",
                s.index,
                escape(&s.uuid),
                escape(&s.pci_bus_id),
                s.index,
                escape(&s.name),
            );
            let labels = match jobs.get(&s.index) {
                Some(ids) if !ids.is_empty() => ids.iter().map(|id| format!("{base}{id}\"")).collect(),
                _ => vec![format!("{base}\"")],
            };
            let values = FAMILIES.iter().map(|f| (f.read)(s, last_xid)).collect();
            snap.gpus.push(GpuRow { labels, values });
        }
        self.out.publish(snap);
    }
}

/// A label value as the text formats want it (`\`, `"` and newlines escaped).
fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return std::borrow::Cow::Borrowed(v);
    }
    std::borrow::Cow::Owned(v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn family_names_are_unique_and_dcgm_shaped() {
        let mut names: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len());
        assert!(FAMILIES.iter().all(|f| f.name.starts_with("DCGM_FI_") && !f.name.ends_with("_total")));
    }

    #[test]
    fn absent_fields_have_no_line_and_labels_are_escaped() {
        let out = Arc::new(DcgmExposition::default());
        let mut w = DcgmWriter::new(Arc::clone(&out));
        let s = GpuSample {
            index: 3,
            uuid: "GPU-x".into(),
            name: "odd \"name\"".into(),
            pci_bus_id: "0000:1b:00.0".into(),
            temperature_c: Some(40),
            ..GpuSample::default()
        };
        w.update(&[s], &BTreeMap::from([(3, vec![7, 8])]), "h1", "550.1");
        let mut text = String::new();
        out.encode(&mut text);
        assert!(text.contains("# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"), "{text}");
        assert!(text.contains("modelName=\"odd \\\"name\\\"\""), "{text}");
        assert!(text.contains("DCGM_FI_DRIVER_VERSION=\"550.1\",hpc_job=\"7\"} 40\n"), "{text}");
        assert!(text.contains("hpc_job=\"8\"} 40\n"), "{text}");
        assert!(!text.contains("DCGM_FI_DEV_MEMORY_TEMP{"), "no value, no sample: {text}");
        assert!(text.contains("# TYPE DCGM_FI_DEV_MEMORY_TEMP gauge\n"), "the family is listed: {text}");
        assert_eq!(text.lines().filter(|l| !l.starts_with('#')).count(), 2, "{text}");
    }
}
