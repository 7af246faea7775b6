//! Telemetry against the fake NVML library (`tests/fake-nvml/`): two fake H200s, real child
//! processes standing in for GPU processes, the real encoder, and `promtool check metrics`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;

use super::*;

const GIB: u64 = 1024 * 1024 * 1024;
const H200_BYTES: u64 = 150_754_820_096;
pub(crate) const UUID0: &str = "GPU-11111111-2222-3333-4444-555555555500";
pub(crate) const UUID1: &str = "GPU-11111111-2222-3333-4444-555555555501";

/// Compiles the fake library once per test process, into the build directory (not /tmp, where
/// it would outlive the tests): built under a name of this process's own, then renamed over the
/// shared name, so test processes running at once never see a half-written library.
fn fake_lib_master() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let src = std::env::var_os("GPUHUB_FAKE_NVML_SRC")
            .map(PathBuf::from)
            .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fake-nvml/fake_nvml.c"));
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/fake-nvml-unit");
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("libnvidia-ml.so.1");
        let tmp = dir.join(format!(".libnvidia-ml.so.1.{}", std::process::id()));
        let st = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
            .arg(&tmp)
            .arg(&src)
            .args(["-ldl", "-lpthread"])
            .status()
            .expect("run cc");
        assert!(st.success(), "building {} failed", src.display());
        std::fs::rename(&tmp, &out).unwrap();
        out
    })
}

/// A private copy of the fake library (own dlopen handle, own globals) and its script.
pub(crate) struct FakeNvml {
    pub dir: tempfile::TempDir,
    pub lib: PathBuf,
}

impl FakeNvml {
    pub(crate) fn new(script: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let lib = dir.path().join("libnvidia-ml.so.1");
        std::fs::copy(fake_lib_master(), &lib).unwrap();
        let f = Self { dir, lib };
        f.write(script);
        f
    }

    /// Replaces the script atomically (the library reloads it on the next device query).
    pub(crate) fn write(&self, script: &str) {
        let tmp = self.dir.path().join(".fake-nvml.conf.tmp");
        std::fs::write(&tmp, script).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("fake-nvml.conf")).unwrap();
    }
}

pub(crate) fn gpu_line(index: u32, uuid: &str, used: u64, util: u32, extra: &str) -> String {
    format!(
        "gpu index={index} uuid={uuid} name=\"NVIDIA H200\" pci=00000000:{:02X}:00.0 mem_total={H200_BYTES} mem_used={used} util={util} mem_util=11 temp={} power_mw=300000 energy_mj=5000000 sm_clock=1980 mem_clock=2619 ecc_sbe=0 ecc_dbe=0 {extra}\n",
        0x19 + index,
        40 + index
    )
}

fn cfg_for(lib: &Path) -> TelemetryConfig {
    TelemetryConfig {
        nvml_library: Some(lib.to_path_buf()),
        interval_ms: 100,
        hostname: Some("gpu01".into()),
        enable_slurm: false,
        job_map_dir: None,
        ..TelemetryConfig::default()
    }
}

/// A stand-in GPU process: a real child with the Slurm environment of a job task (no Slurm
/// cgroup here, so attribution falls back to that environment; the user is always the uid's).
struct JobProc(Child);

/// The user the test's processes run as: what attribution reports for them.
fn me() -> String {
    // SAFETY: getuid has no preconditions.
    super::attribution::user_name(unsafe { libc::getuid() }).unwrap()
}

impl JobProc {
    fn spawn(job: u32, shards: Option<u32>) -> Self {
        let mut c = Command::new("sleep");
        c.arg("60").env("SLURM_JOB_ID", job.to_string()).env("SLURM_JOB_USER", "someone-else");
        match shards {
            Some(n) => c.env("SLURM_SHARDS_ON_NODE", n.to_string()),
            None => c.env_remove("SLURM_SHARDS_ON_NODE"),
        };
        JobProc(c.spawn().unwrap())
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for JobProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_samples(t: &Telemetry, n: u64) {
    let target = t.samples_taken() + n;
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.samples_taken() < target {
        assert!(Instant::now() < deadline, "sampler stalled at {} samples", t.samples_taken());
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `/metrics` as Prometheus gets it (OpenMetrics): the registry and the DCGM block.
fn render(r: &Registry, t: &Telemetry) -> String {
    super::exposition::render(r, Some(&t.dcgm()), true, 0)
}

/// The value of the one sample line starting with `prefix` (metric name + labels).
fn value(text: &str, prefix: &str) -> Option<f64> {
    let mut found = text.lines().filter(|l| l.starts_with(prefix));
    let line = found.next()?;
    assert!(found.next().is_none(), "more than one line matches {prefix}");
    line.rsplit(' ').next()?.parse().ok()
}

fn dcgm_prefix(name: &str, gpu: u32, uuid: &str, job: &str) -> String {
    format!(
        "{name}{{gpu=\"{gpu}\",UUID=\"{uuid}\",pci_bus_id=\"00000000:{:02X}:00.0\",device=\"nvidia{gpu}\",modelName=\"NVIDIA H200\",Hostname=\"gpu01\",DCGM_FI_DRIVER_VERSION=\"550.54.15\",hpc_job=\"{job}\"}}",
        0x19 + gpu
    )
}

/// Runs `promtool check metrics` (Debian's prometheus package, 2.42) on the Prometheus-text
/// form of the encoded registry, as `curl /metrics | promtool check metrics` sees it.
///
/// Exit 0 passes. Exit 3 (lint problems only) passes when every problem is one dcgm-exporter's
/// own output has on a `DCGM_FI_*` series ([`DCGM_EXPORTER_LINT`]), kept on purpose so existing
/// dashboards work. Anything else fails.
/// promtool's findings on dcgm-exporter's names, labels and types, which gpuhub keeps: the
/// camelCase label `modelName`, counters without `_total` (`DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`)
/// and the word "counter" in `DCGM_FI_DEV_PCIE_REPLAY_COUNTER`.
pub(crate) const DCGM_EXPORTER_LINT: [&str; 3] = [
    "label names should be written in 'snake_case' not 'camelCase'",
    "counter metrics should have \"_total\" suffix",
    "metric name should not include type 'counter'",
];

pub(crate) fn promtool_check(openmetrics: &str) {
    use std::io::Write;
    let text = super::exposition::to_prometheus_text(openmetrics);
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("promtool (Debian package `prometheus`) must be installed: tests/setup/deps.sh");
    child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let only_dcgm_exporter_names = report
        .lines()
        .filter(|l| !l.trim().is_empty())
        .all(|l| l.starts_with("DCGM_FI_") && DCGM_EXPORTER_LINT.iter().any(|finding| l.ends_with(finding)));
    let ok = out.status.success() || (out.status.code() == Some(3) && only_dcgm_exporter_names);
    assert!(ok, "promtool check metrics failed ({}):\n{report}\n--- text ---\n{text}", out.status);
}

#[test]
fn two_shard_jobs_on_one_gpu_each_get_their_own_vram_and_util() {
    let alice = JobProc::spawn(101, Some(7));
    let bob = JobProc::spawn(102, Some(7));
    let carol = JobProc::spawn(103, None);
    // PID that does not exist: a process that vanished between NVML's list and /proc.
    let ghost = 4_000_000 + std::process::id() % 100_000;
    let script = format!(
        "driver version=550.54.15\n{}{}proc gpu=0 pid={} mem={} sm=30\nproc gpu=0 pid={} mem={} sm=50\nproc gpu=1 pid={} mem={} sm=90\nproc gpu=1 pid={ghost} mem={} sm=0\n",
        gpu_line(0, UUID0, 31 * GIB, 80, ""),
        gpu_line(1, UUID1, 45 * GIB, 90, ""),
        alice.pid(),
        10 * GIB,
        bob.pid(),
        20 * GIB,
        carol.pid(),
        40 * GIB,
        GIB,
    );
    let fake = FakeNvml::new(&script);
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    assert!(t.nvml_up(), "the fake NVML must be up after start");
    wait_samples(&t, 3);

    let gpus = t.gpus();
    assert_eq!(gpus.len(), 2, "{gpus:?}");
    assert_eq!(gpus[0].uuid, UUID0);
    assert_eq!(gpus[0].name, "NVIDIA H200");
    assert_eq!(gpus[0].memory_total_bytes, H200_BYTES);
    assert_eq!(gpus[0].memory_free_bytes, H200_BYTES - 31 * GIB);

    let text = render(&registry, &t);
    let job = |j: &str, u: &str, gpu: u32, uuid: &str| format!("{{gpu=\"{gpu}\",uuid=\"{uuid}\",jobid=\"{j}\",user=\"{u}\"}}");
    let got = |name: &str, labels: &str| value(&text, &format!("{name}{labels}")).unwrap_or_else(|| panic!("no {name}{labels} in\n{text}"));
    assert_eq!(got("gpuhub_job_gpu_memory_used_bytes", &job("101", &me(), 0, UUID0)), (10 * GIB) as f64);
    assert_eq!(got("gpuhub_job_gpu_memory_used_bytes", &job("102", &me(), 0, UUID0)), (20 * GIB) as f64);
    assert_eq!(got("gpuhub_job_gpu_utilization_ratio", &job("101", &me(), 0, UUID0)), 0.3);
    assert_eq!(got("gpuhub_job_gpu_utilization_ratio", &job("102", &me(), 0, UUID0)), 0.5);
    assert_eq!(got("gpuhub_job_gpu_shards", &job("101", &me(), 0, UUID0)), 7.0);
    assert_eq!(got("gpuhub_job_gpu_memory_used_bytes", &job("103", &me(), 1, UUID1)), (40 * GIB) as f64);
    // The ghost PID shares GPU 1, so carol's utilisation is her processes', not the GPU's.
    assert_eq!(got("gpuhub_job_gpu_utilization_ratio", &job("103", &me(), 1, UUID1)), 0.9);
    assert_eq!(got("gpuhub_gpu_memory_unattributed_bytes", &format!("{{gpu=\"1\",uuid=\"{UUID1}\"}}")), GIB as f64);
    assert_eq!(got("gpuhub_gpu_memory_total_bytes", &format!("{{gpu=\"0\",uuid=\"{UUID0}\"}}")), H200_BYTES as f64);
    assert_eq!(got("gpuhub_gpu_power_watts", &format!("{{gpu=\"0\",uuid=\"{UUID0}\"}}")), 300.0);
    assert_eq!(got("gpuhub_nvml_up", ""), 1.0);
    // dcgm-exporter names, one copy per job on the GPU.
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 0, UUID0, "101")), Some(80.0), "{text}");
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 0, UUID0, "102")), Some(80.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_FB_USED", 1, UUID1, "103")), Some((45 * 1024) as f64));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_POWER_USAGE", 1, UUID1, "103")), Some(300.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_TEMP", 1, UUID1, "103")), Some(41.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_SM_CLOCK", 0, UUID0, "101")), Some(1980.0));
    promtool_check(&text);

    // Per-job statistics: mean utilisation, peak VRAM, energy split by utilisation.
    let a = t.job_gpu_stats(101);
    let b = t.job_gpu_stats(102);
    let c = t.job_gpu_stats(103);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].gpu_uuid, UUID0);
    assert!((a[0].mean_util - 30.0).abs() < 1e-9, "{a:?}");
    assert_eq!(a[0].peak_vram_bytes, 10 * GIB);
    // The last sample, for live views: the job's processes' utilisation and VRAM now.
    assert!((a[0].last_util - 30.0).abs() < 1e-9 && a[0].last_vram_bytes == 10 * GIB, "{a:?}");
    assert!((c[0].last_util - 90.0).abs() < 1e-9 && c[0].last_vram_bytes == 40 * GIB, "{c:?}");
    assert!(a[0].samples >= 3, "{a:?}");
    assert!(a[0].energy_joules > 0.0 && b[0].energy_joules > 0.0, "{a:?} {b:?}");
    let ratio = b[0].energy_joules / a[0].energy_joules;
    assert!((ratio - 50.0 / 30.0).abs() < 0.01, "bob used 50/30 of alice's share: {ratio}");
    // GPU 1 at 300 W shared with an idle ghost: carol gets all of it (the ghost's weight is 0).
    assert!(c[0].energy_joules > 0.0, "{c:?}");
    assert!(t.job_gpu_stats(999).is_empty());

    // Alice's job ends: her series go, her statistics stay for accounting.
    let alice_pid = alice.pid();
    drop(alice);
    fake.write(&script.replace(&format!("pid={alice_pid} "), "pid=1 ").replace("proc gpu=0 pid=1 ", "#"));
    wait_samples(&t, 3);
    let text = render(&registry, &t);
    assert!(!text.contains("jobid=\"101\""), "series of an ended job must be removed:\n{text}");
    assert!(!text.contains("hpc_job=\"101\""), "DCGM copy of an ended job must be removed");
    assert!(text.contains("jobid=\"102\""));
    assert_eq!(t.job_gpu_stats(101).len(), 1, "stats of an ended job stay for accounting");
    t.shutdown();
}

#[test]
fn a_field_nvml_refuses_is_skipped_and_counted_not_fatal() {
    let script = format!("{}{}", gpu_line(0, UUID0, GIB, 10, "fail=temp,power unsupported=ecc"), gpu_line(1, UUID1, GIB, 20, "fail=procs"));
    let fake = FakeNvml::new(&script);
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    wait_samples(&t, 2);
    assert!(t.nvml_up());
    let text = render(&registry, &t);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_TEMP", 0, UUID0, "")), None, "{text}");
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_POWER_USAGE", 0, UUID0, "")), None);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 0, UUID0, "")), None);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 0, UUID0, "")), Some(10.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_TEMP", 1, UUID1, "")), Some(41.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", 1, UUID1, "")), Some(0.0));
    assert!(value(&text, "gpuhub_telemetry_nvml_errors_total{field=\"temp\"}").unwrap() >= 2.0, "{text}");
    assert!(value(&text, "gpuhub_telemetry_nvml_errors_total{field=\"procs\"}").unwrap() >= 2.0);
    assert_eq!(value(&text, "gpuhub_telemetry_nvml_errors_total{field=\"ecc\"}"), None, "NotSupported is no error");
    promtool_check(&text);

    // The fields come back: the series reappear.
    fake.write(&format!("{}{}", gpu_line(0, UUID0, GIB, 10, ""), gpu_line(1, UUID1, GIB, 20, "")));
    wait_samples(&t, 2);
    let text = render(&registry, &t);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_TEMP", 0, UUID0, "")), Some(40.0), "{text}");
}

#[test]
fn an_xid_event_sets_the_dcgm_gauge_of_its_gpu_and_counts_once_per_event() {
    let gpus = |xid1: &str| format!("{}{}", gpu_line(0, UUID0, GIB, 10, ""), gpu_line(1, UUID1, GIB, 20, xid1));
    let fake = FakeNvml::new(&gpus(""));
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    wait_samples(&t, 1);
    let xid_gauge = |text: &str, gpu: u32, uuid: &str| value(text, &dcgm_prefix("DCGM_FI_DEV_XID_ERRORS", gpu, uuid, ""));
    let xid_count = |text: &str, gpu: u32, uuid: &str, code: u32| {
        value(text, &format!("gpuhub_gpu_xid_errors_total{{gpu=\"{gpu}\",uuid=\"{uuid}\",xid=\"{code}\"}}"))
    };
    // Watched GPUs export 0 before any XID, and no counter series yet.
    let text = render(&registry, &t);
    assert_eq!(xid_gauge(&text, 0, UUID0), Some(0.0), "{text}");
    assert_eq!(xid_gauge(&text, 1, UUID1), Some(0.0));
    assert!(!text.contains("gpuhub_gpu_xid_errors_total{"), "{text}");

    // GPU 1 reports XID 79 (fell off the bus): its gauge says 79, GPU 0's stays 0.
    fake.write(&gpus("xid=79"));
    wait_samples(&t, 2);
    let text = render(&registry, &t);
    assert_eq!(xid_gauge(&text, 1, UUID1), Some(79.0), "{text}");
    assert_eq!(xid_gauge(&text, 0, UUID0), Some(0.0));
    assert_eq!(xid_count(&text, 1, UUID1, 79), Some(1.0));
    assert!(!text.contains("gpuhub_gpu_xid_errors_total{gpu=\"0\""), "no XID on GPU 0:\n{text}");
    promtool_check(&text);

    // More samples and scrapes count nothing new: once per event, not per sample or scrape.
    wait_samples(&t, 3);
    let _ = render(&registry, &t);
    let text = render(&registry, &t);
    assert_eq!(xid_count(&text, 1, UUID1, 79), Some(1.0), "{text}");
    assert_eq!(xid_gauge(&text, 1, UUID1), Some(79.0));

    // Three more events (48, then 79 twice): each counted; the gauge holds the last code.
    fake.write(&gpus("xid=79,48,79,79"));
    wait_samples(&t, 2);
    let text = render(&registry, &t);
    assert_eq!(xid_count(&text, 1, UUID1, 79), Some(3.0), "{text}");
    assert_eq!(xid_count(&text, 1, UUID1, 48), Some(1.0));
    assert_eq!(xid_gauge(&text, 1, UUID1), Some(79.0));
    assert_eq!(xid_gauge(&text, 0, UUID0), Some(0.0));

    // A job on the GPU: the gauge is on the job's copy of the DCGM series too.
    let map = tempfile::tempdir().unwrap();
    std::fs::write(map.path().join("1"), "777\n").unwrap();
    drop(t);
    let mut registry = Registry::default();
    let t = Telemetry::start(&TelemetryConfig { job_map_dir: Some(map.path().to_path_buf()), ..cfg_for(&fake.lib) }, &mut registry);
    fake.write(&gpus("xid=79,48,79,79,31"));
    wait_samples(&t, 2);
    let text = render(&registry, &t);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_XID_ERRORS", 1, UUID1, "777")), Some(31.0), "{text}");
    assert_eq!(xid_count(&text, 1, UUID1, 31), Some(1.0), "a new registration delivers only new XIDs");
    assert_eq!(xid_count(&text, 1, UUID1, 79), None, "XIDs from before the registration are not replayed");
    promtool_check(&text);
}

#[test]
fn a_gpu_without_xid_events_exports_everything_else() {
    // GPU 0 has no XID events; GPU 1's event registration fails outright.
    let script = format!("{}{}", gpu_line(0, UUID0, GIB, 10, "unsupported=xid"), gpu_line(1, UUID1, GIB, 20, "fail=xid"));
    let fake = FakeNvml::new(&script);
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    wait_samples(&t, 3);
    assert!(t.nvml_up());
    let text = render(&registry, &t);
    for (gpu, uuid, util) in [(0, UUID0, 10.0), (1, UUID1, 20.0)] {
        assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", gpu, uuid, "")), Some(util), "{text}");
        assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_TEMP", gpu, uuid, "")), Some(40.0 + f64::from(gpu)));
        assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", gpu, uuid, "")), Some(0.0));
        assert_eq!(value(&text, &format!("gpuhub_gpu_power_watts{{gpu=\"{gpu}\",uuid=\"{uuid}\"}}")), Some(300.0));
        // No XID watch: no gauge, rather than a 0 that would claim "no XID".
        assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_XID_ERRORS", gpu, uuid, "")), None, "{text}");
    }
    // Unsupported is a property of the GPU (not counted); a failed registration is an error.
    assert!(value(&text, "gpuhub_telemetry_nvml_errors_total{field=\"xid\"}").unwrap() >= 3.0, "{text}");
    promtool_check(&text);

    // Scripted XIDs on such GPUs are not delivered, and nothing else changes.
    fake.write(&script.replace("fail=xid", "fail=xid xid=79").replace("unsupported=xid", "unsupported=xid xid=48"));
    wait_samples(&t, 2);
    let text = render(&registry, &t);
    assert!(!text.contains("gpuhub_gpu_xid_errors_total{"), "{text}");
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 1, UUID1, "")), Some(20.0));
}

#[test]
fn without_nvml_the_agent_starts_and_exports_nvml_up_0() {
    for lib in [PathBuf::from("/nonexistent/libnvidia-ml.so.1"), PathBuf::from("/bin/true")] {
        let mut registry = Registry::default();
        let t = Telemetry::start(&cfg_for(&lib), &mut registry);
        assert!(!t.nvml_up());
        assert!(t.gpus().is_empty());
        let text = render(&registry, &t);
        assert_eq!(value(&text, "gpuhub_nvml_up "), Some(0.0), "{text}");
        assert!(!text.lines().any(|l| l.starts_with("DCGM_FI_DEV_GPU_UTIL{")));
        promtool_check(&text);
    }
    // A "driver" without a script: nvmlInit_v2 says DRIVER_NOT_LOADED.
    let fake = FakeNvml::new("");
    std::fs::remove_file(fake.dir.path().join("fake-nvml.conf")).unwrap();
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    assert!(!t.nvml_up());
    assert_eq!(value(&render(&registry, &t), "gpuhub_nvml_up "), Some(0.0));
    // A driver with no GPU.
    let fake = FakeNvml::new("driver version=550.54.15\n");
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    assert!(!t.nvml_up());
    assert!(t.gpus().is_empty());
    // Disabled by config.
    let mut registry = Registry::default();
    let t = Telemetry::start(&TelemetryConfig { enable_nvml: false, enable_slurm: false, ..TelemetryConfig::default() }, &mut registry);
    assert!(!t.nvml_up());
    assert_eq!(value(&render(&registry, &t), "gpuhub_nvml_up "), Some(0.0));
}

#[test]
fn a_gpu_that_disappears_takes_its_series_with_it() {
    let fake = FakeNvml::new(&format!("{}{}", gpu_line(0, UUID0, GIB, 10, ""), gpu_line(1, UUID1, GIB, 20, "")));
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    assert_eq!(t.gpus().len(), 2);
    fake.write(&gpu_line(0, UUID0, GIB, 10, ""));
    wait_samples(&t, 2);
    assert_eq!(t.gpus().len(), 1);
    let text = render(&registry, &t);
    assert!(!text.contains(UUID1), "{text}");
    assert!(text.contains(UUID0));
}

#[test]
fn the_job_map_names_the_job_of_a_gpu_without_processes() {
    let fake = FakeNvml::new(&format!("{}{}", gpu_line(0, UUID0, GIB, 10, ""), gpu_line(1, UUID1, GIB, 20, "")));
    let map = tempfile::tempdir().unwrap();
    std::fs::write(map.path().join("1"), "555\n556\n").unwrap();
    std::fs::write(map.path().join("0"), "not a job id\n").unwrap();
    let mut registry = Registry::default();
    let cfg = TelemetryConfig { job_map_dir: Some(map.path().to_path_buf()), ..cfg_for(&fake.lib) };
    let t = Telemetry::start(&cfg, &mut registry);
    wait_samples(&t, 1);
    let text = render(&registry, &t);
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 1, UUID1, "555")), Some(20.0), "{text}");
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 1, UUID1, "556")), Some(20.0));
    assert_eq!(value(&text, &dcgm_prefix("DCGM_FI_DEV_GPU_UTIL", 0, UUID0, "")), Some(10.0));
    assert_eq!(t.job_gpu_stats(555).len(), 1);
}

/// A `scontrol show job -d -o` line as Slurm 22.05 prints it (from one captured on the lab),
/// with the fields a test varies. `node_gres` is the per-node section's `GRES=` (empty for a
/// pending job, which has no section's indices).
#[allow(clippy::too_many_arguments)] // one flat template; a struct would only rename the arguments
fn job_line(id: u32, user: &str, account: &str, state: &str, reason: &str, tres: &str, node_gres: &str, per: &str) -> String {
    let nodes = if state == "PENDING" { "(null)" } else { "gpu01" };
    format!(
        "JobId={id} JobName=job{id} UserId={user}(1001) GroupId={user}(1001) MCS_label=N/A Priority=4294901683 Nice=0 Account={account} QOS=normal \
         JobState={state} Reason={reason} Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 \
         RunTime=00:00:00 TimeLimit=00:02:00 TimeMin=N/A SubmitTime=1796121759 EligibleTime=1796121759 AccrueTime=1796121759 \
         StartTime=1796121759 EndTime=1796121879 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796121759 Scheduler=Main \
         Partition=gpu AllocNode:Sid=localhost:1132 ReqNodeList=(null) ExcNodeList=(null) NodeList={nodes} BatchHost=gpu01 NumNodes=1 \
         NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES={tres} Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* \
         JOB_GRES=gpu:h200:2   Nodes=gpu01 CPU_IDs=0-1 Mem=1024 GRES={node_gres} MinCPUsNode=1 MinMemoryCPU=512M MinTmpDiskNode=0 \
         Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=sh WorkDir=/tmp Power= {per}"
    )
}

const NODE_LINE: &str = "NodeName=gpu01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=11 CPUEfctv=16 CPUTot=16 CPULoad=0.5 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h200:2,shard:h200:28 GresDrain=N/A GresUsed=gpu:h200:2(IDX:0-1),shard:h200:0(IDX:N/A) NodeAddr=127.0.0.1 NodeHostName=localhost Version=22.05.8 OS=Linux 6.1 #1 SMP RealMemory=16000 AllocMem=5632 FreeMem=4312 Sockets=16 Boards=1 State=MIXED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu CfgTRES=cpu=16,mem=16000M,billing=16,gres/gpu=2,gres/shard=28 AllocTRES=cpu=11,mem=5632M,gres/gpu=2 CapWatts=n/a CurrentWatts=0 AveWatts=0 Reason=fan check [root@2026-12-01T15:00:00]";

#[test]
fn slurm_snapshot_counts_gpus_and_shards_whatever_the_request_syntax() {
    let bin = tempfile::tempdir().unwrap();
    let write = |name: &str, body: &str| {
        let p = bin.path().join(name);
        std::fs::write(&p, body).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    };
    // One running job per request syntax (as slurmctld prints each: the per-node GRES carries
    // the indices whatever the syntax), a pending one, a finished one still listed, a job
    // whose name imitates Slurm's fields, and a line that is not a job.
    let m500 = "cpu=2,mem=1G,node=1,billing=2";
    let jobs = [
        job_line(11, "alice", "physics", "RUNNING", "None", &format!("{m500},gres/gpu=1"), "gpu:h200:1(IDX:0)", "TresPerNode=gres:gpu:1"),
        job_line(12, "bob", "bio", "RUNNING", "None", &format!("{m500},gres/gpu=1"), "gpu:h200:1(IDX:1)", "TresPerJob=gres:gpu:1"),
        job_line(
            13,
            "carol",
            "chem",
            "RUNNING",
            "None",
            &format!("{m500},gres/shard=7"),
            "shard:h200:7(IDX:0)",
            "TresPerNode=gres:shard:7",
        ),
        job_line(
            14,
            "dave",
            "chem",
            "RUNNING",
            "None",
            &format!("{m500},gres/shard=3"),
            "shard:h200:3(3/14,0/14)",
            "TresPerNode=gres:shard:3",
        ),
        job_line(15, "erin", "bio", "PENDING", "Resources", &format!("{m500},gres/gpu=2"), "", "TresPerTask=gres:gpu:1"),
        job_line(16, "erin", "bio", "PENDING", "QOSMaxGRESPerUser", &format!("{m500},gres/gpu=1"), "", "TresPerNode=gres:gpu:1"),
        job_line(17, "frank", "bio", "COMPLETED", "None", &format!("{m500},gres/gpu=2"), "", "TresPerNode=gres:gpu:2"),
        job_line(18, "mallory", "x", "RUNNING", "None", &format!("{m500},gres/gpu=1"), "gpu:h200:1(IDX:1)", "")
            .replace("JobName=job18", "JobName=x UserId=alice(1000)"),
        "this line is not a job".to_string(),
    ]
    .join("\n");
    std::fs::write(bin.path().join("jobs.txt"), format!("{jobs}\n")).unwrap();
    std::fs::write(bin.path().join("nodes.txt"), format!("{NODE_LINE}\n")).unwrap();
    // The fake scontrol checks that it is called as the agent must call it.
    let dir = bin.path().display();
    write(
        "scontrol",
        &format!(
            "#!/bin/sh\n[ \"$SLURM_TIME_FORMAT\" = %s ] || {{ echo 'SLURM_TIME_FORMAT not %s' >&2; exit 3; }}\n\
             case \"$*\" in\n  'show job -d -o') cat {dir}/jobs.txt ;;\n  '-d show node -o') cat {dir}/nodes.txt ;;\n  *) echo \"bad args: $*\" >&2; exit 2 ;;\nesac\n"
        ),
    );
    let cfg = TelemetryConfig {
        enable_nvml: false,
        enable_slurm: true,
        slurm_bin_dir: Some(bin.path().to_path_buf()),
        slurm_interval_ms: 1_000,
        slurm_node_name: Some("gpu01".into()),
        ..TelemetryConfig::default()
    };
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg, &mut registry);
    let deadline = Instant::now() + Duration::from_secs(20);
    while t.slurm_snapshots_taken() < 2 {
        assert!(Instant::now() < deadline, "no Slurm snapshot");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = render(&registry, &t);
    // Each look at the jobs is kept for the accounting ingest's reconciliation.
    let look = t.last_look().within(Duration::from_secs(60), &bin.path().join("scontrol"), &bin.path().join("squeue"));
    assert!(look.is_some_and(|l| l.text.contains("JobId=15 ")), "the sampler's look is not kept for the accounting ingest");
    let v = |p: &str| value(&text, p).unwrap_or_else(|| panic!("no {p} in\n{text}"));
    let job = |id: u32, user: &str, account: &str| format!("{{jobid=\"{id}\",user=\"{user}\",account=\"{account}\",partition=\"gpu\"}}");
    assert_eq!(v("gpuhub_slurm_up "), 1.0);
    // Per job, from the per-node GRES whatever the syntax.
    assert_eq!(v(&format!("gpuhub_slurm_job_gpus{}", job(11, "alice", "physics"))), 1.0, "--gres=gpu:1");
    assert_eq!(v(&format!("gpuhub_slurm_job_gpus{}", job(12, "bob", "bio"))), 1.0, "--gpus=1 (squeue %b says N/A)");
    assert_eq!(v(&format!("gpuhub_slurm_job_shards{}", job(13, "carol", "chem"))), 7.0, "22.05 shard form");
    assert_eq!(v(&format!("gpuhub_slurm_job_shards{}", job(14, "dave", "chem"))), 3.0, "23.x shard form");
    assert_eq!(v(&format!("gpuhub_slurm_job_gpus{}", job(13, "carol", "chem"))), 0.0);
    assert_eq!(v(&format!("gpuhub_slurm_job_cpus{}", job(11, "alice", "physics"))), 2.0);
    assert_eq!(v(&format!("gpuhub_slurm_job_memory_bytes{}", job(11, "alice", "physics"))), (1u64 << 30) as f64);
    assert!(!text.contains("jobid=\"15\"") && !text.contains("jobid=\"17\""), "pending and finished jobs hold nothing:\n{text}");
    assert!(!text.contains("jobid=\"18\""), "an ambiguous line is left out, not believed:\n{text}");
    assert!(!text.contains("user=\"alice\",account=\"x\""), "{text}");
    // The node: GPUs/shards from GresUsed, state with the reason, CPUs and memory.
    assert_eq!(v("gpuhub_slurm_gpus{state=\"allocated\"}"), 2.0);
    assert_eq!(v("gpuhub_slurm_gpus{state=\"idle\"}"), 0.0);
    assert_eq!(v("gpuhub_slurm_shards{state=\"allocated\"}"), 10.0, "the jobs' shards: 22.05's GresUsed undercounts them");
    assert_eq!(v("gpuhub_slurm_shards{state=\"idle\"}"), 18.0);
    assert_eq!(v("gpuhub_slurm_node_state{node=\"gpu01\",state=\"draining\",reason=\"fan check\"}"), 1.0);
    assert_eq!(v("gpuhub_slurm_node_cpus{node=\"gpu01\",state=\"allocated\"}"), 11.0);
    assert_eq!(v("gpuhub_slurm_node_cpus{node=\"gpu01\",state=\"idle\"}"), 5.0);
    assert_eq!(v("gpuhub_slurm_node_memory_bytes{node=\"gpu01\",state=\"allocated\"}"), (5632u64 << 20) as f64);
    assert_eq!(v("gpuhub_slurm_node_memory_bytes{node=\"gpu01\",state=\"idle\"}"), ((16000u64 - 5632) << 20) as f64);
    // Jobs by state, pending by reason; finished jobs are not counted.
    assert_eq!(v("gpuhub_slurm_jobs{state=\"running\",partition=\"gpu\",user=\"alice\"}"), 1.0);
    assert_eq!(v("gpuhub_slurm_jobs{state=\"pending\",partition=\"gpu\",user=\"erin\"}"), 2.0);
    assert!(!text.contains("state=\"completed\""), "{text}");
    assert_eq!(v("gpuhub_slurm_pending_jobs{reason=\"Resources\"}"), 1.0);
    assert_eq!(v("gpuhub_slurm_pending_jobs{reason=\"QOSMaxGRESPerUser\"}"), 1.0);
    assert!(v("gpuhub_slurm_command_errors_total{command=\"scontrol show job\"}") >= 4.0, "2 bad lines per snapshot:\n{text}");
    promtool_check(&text);

    // Jobs end and the node is back: their series go, the node's state and GPUs follow.
    std::fs::write(bin.path().join("jobs.txt"), "No jobs in the system\n").unwrap();
    let idle = NODE_LINE
        .replace("State=MIXED+DRAIN", "State=IDLE")
        .replace(" Reason=fan check [root@2026-12-01T15:00:00]", "")
        .replace("GresUsed=gpu:h200:2(IDX:0-1)", "GresUsed=gpu:h200:0(IDX:N/A)");
    std::fs::write(bin.path().join("nodes.txt"), format!("{idle}\n")).unwrap();
    let n = t.slurm_snapshots_taken();
    while t.slurm_snapshots_taken() < n + 2 {
        assert!(Instant::now() < deadline + Duration::from_secs(10), "no Slurm snapshot");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = render(&registry, &t);
    assert!(!text.contains("gpuhub_slurm_job_gpus{"), "no ghosts:\n{text}");
    assert!(!text.contains("state=\"draining\""), "{text}");
    assert_eq!(value(&text, "gpuhub_slurm_node_state{node=\"gpu01\",state=\"idle\",reason=\"\"}"), Some(1.0), "{text}");
    assert_eq!(value(&text, "gpuhub_slurm_gpus{state=\"idle\"}"), Some(2.0));
    assert!(!text.contains("gpuhub_slurm_pending_jobs{"), "{text}");

    // slurmctld stops answering: the command times out, slurm_up goes 0, nothing hangs.
    write("scontrol", "#!/bin/sh\nsleep 30\n");
    let t0 = Instant::now();
    drop(t);
    assert!(t0.elapsed() < Duration::from_secs(12), "shutdown waited too long: {:?}", t0.elapsed());
    let mut registry = Registry::default();
    let t = Telemetry::start(&TelemetryConfig { slurm_timeout_ms: 300, ..cfg.clone() }, &mut registry);
    while t.slurm_snapshots_taken() < 1 {
        assert!(Instant::now() < deadline + Duration::from_secs(20), "no Slurm snapshot");
        std::thread::sleep(Duration::from_millis(20));
    }
    let text = render(&registry, &t);
    assert_eq!(value(&text, "gpuhub_slurm_up "), Some(0.0), "{text}");
    assert_eq!(value(&text, "gpuhub_slurm_command_errors_total{command=\"scontrol show job\"}"), Some(1.0));
}

#[test]
fn config_defaults_validate_and_errors_name_the_key() {
    let cfg = TelemetryConfig::default();
    assert_eq!(cfg.validate(), Ok(()));
    let parsed: TelemetryConfig = toml::from_str("interval_ms = 1000\nnvml_library = \"/usr/lib/x.so\"").unwrap();
    assert_eq!(parsed.interval_ms, 1000);
    assert_eq!(parsed.slurm_interval_ms, 15_000, "unset keys keep their defaults");
    let err = toml::from_str::<TelemetryConfig>("interval_msec = 1000").unwrap_err().to_string();
    assert!(err.contains("unknown field `interval_msec`") && err.contains("interval_ms"), "{err}");
    let bad = TelemetryConfig {
        interval_ms: 5,
        nvml_library: Some("libnvidia-ml.so.1".into()),
        slurm_bin_dir: Some("bin".into()),
        hostname: Some("two words".into()),
        ..TelemetryConfig::default()
    };
    let errs = bad.validate().unwrap_err();
    let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert_eq!(errs.len(), 4, "{msgs:?}");
    assert!(msgs[0].starts_with("telemetry.interval_ms: 5 is out of range"), "{msgs:?}");
    assert!(msgs.iter().any(|m| m.starts_with("telemetry.nvml_library:")), "{msgs:?}");
    assert!(msgs.iter().any(|m| m.starts_with("telemetry.slurm_bin_dir:")), "{msgs:?}");
    assert!(msgs.iter().any(|m| m.starts_with("telemetry.hostname:")), "{msgs:?}");
    let named = TelemetryConfig { hostname: Some("gpu01.cluster.example".into()), ..TelemetryConfig::default() };
    assert_eq!(named.effective_node_name(), "gpu01");
}

/// Every dcgm-exporter default counter that applies to bare metal, plus the GPM profiling
/// series: `(family, type, scripted value)` for a GPU scripted with all of them.
const FULL_GPU: &str = "mem_reserved=536870912 memory_temp=52 pcie_tx_kbs=1000 pcie_rx_kbs=2000 pcie_replay=3 enc_util=4 dec_util=5 \
    nvlink_tx_kibps=1000 nvlink_rx_kibps=3000 remap_cor=6 remap_unc=7 remap_failed=1 gpm_gr_engine=61.5 gpm_sm_active=52.5 \
    gpm_sm_occupancy=33.25 gpm_tensor=24.5 gpm_dram=45.5 gpm_pcie_tx=1.5 gpm_pcie_rx=2.5 gpm_nvlink_tx=3.5 gpm_nvlink_rx=4.5 ecc_sbe=8 ecc_dbe=9";

fn expected_dcgm(gpu: u32) -> Vec<(&'static str, &'static str, f64)> {
    let mib = 1024.0 * 1024.0;
    vec![
        ("DCGM_FI_DEV_SM_CLOCK", "gauge", 1980.0),
        ("DCGM_FI_DEV_MEM_CLOCK", "gauge", 2619.0),
        ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", 52.0),
        ("DCGM_FI_DEV_GPU_TEMP", "gauge", 40.0 + f64::from(gpu)),
        ("DCGM_FI_DEV_POWER_USAGE", "gauge", 300.0),
        ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "counter", 1000.0),
        ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "counter", 2000.0),
        ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", 3.0),
        ("DCGM_FI_DEV_GPU_UTIL", "gauge", 10.0),
        ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", 11.0),
        ("DCGM_FI_DEV_ENC_UTIL", "gauge", 4.0),
        ("DCGM_FI_DEV_DEC_UTIL", "gauge", 5.0),
        ("DCGM_FI_DEV_XID_ERRORS", "gauge", 0.0),
        ("DCGM_FI_DEV_FB_FREE", "gauge", ((H200_BYTES - GIB) / (1024 * 1024)) as f64),
        ("DCGM_FI_DEV_FB_USED", "gauge", 1024.0),
        ("DCGM_FI_DEV_FB_RESERVED", "gauge", 512.0),
        ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", 8.0),
        ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", 9.0),
        // (1000 + 3000) KiB/s of NVLink data, in DCGM's unit (KiB/s / 1000).
        ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter", 4.0),
        ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", 7.0),
        ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", 6.0),
        ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", 1.0),
        ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", 0.615),
        ("DCGM_FI_PROF_SM_ACTIVE", "gauge", 0.525),
        ("DCGM_FI_PROF_SM_OCCUPANCY", "gauge", 0.3325),
        ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", 0.245),
        ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", 0.455),
        ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", 1.5 * mib),
        ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", 2.5 * mib),
        ("DCGM_FI_PROF_NVLINK_TX_BYTES", "gauge", 3.5 * mib),
        ("DCGM_FI_PROF_NVLINK_RX_BYTES", "gauge", 4.5 * mib),
    ]
}

/// The loaded fake library's GPM leak counter (samples allocated and not freed), through a
/// handle of its own that keeps the library loaded after NVML is shut down and closed.
struct GpmLeakCounter(*mut libc::c_void);

impl GpmLeakCounter {
    fn attach(lib: &Path) -> Self {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(lib.as_os_str().as_bytes()).unwrap();
        // SAFETY: RTLD_NOLOAD only returns a handle when NVML's loader has the library loaded
        // in this process already; the handle adds a reference until `drop`.
        let h = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        assert!(!h.is_null(), "the fake NVML is not loaded");
        Self(h)
    }

    fn live(&self) -> i64 {
        // SAFETY: the symbol is the fake library's `long fake_nvml_gpm_live_samples(void)`, and
        // `self.0` keeps the library loaded.
        unsafe {
            let f = libc::dlsym(self.0, c"fake_nvml_gpm_live_samples".as_ptr());
            assert!(!f.is_null());
            let f: extern "C" fn() -> std::os::raw::c_long = std::mem::transmute(f);
            f()
        }
    }
}

impl Drop for GpmLeakCounter {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and is closed once.
        unsafe { libc::dlclose(self.0) };
    }
}

#[test]
fn every_dcgm_default_counter_and_profiling_series_with_dcgm_exporter_types_and_labels() {
    let script = format!("driver version=550.54.15\n{}{}", gpu_line(0, UUID0, GIB, 10, FULL_GPU), gpu_line(1, UUID1, GIB, 10, FULL_GPU));
    let fake = FakeNvml::new(&script);
    let map = tempfile::tempdir().unwrap();
    std::fs::write(map.path().join("1"), "4242\n4243\n").unwrap();
    let mut registry = Registry::default();
    let t = Telemetry::start(&TelemetryConfig { job_map_dir: Some(map.path().to_path_buf()), ..cfg_for(&fake.lib) }, &mut registry);
    // Rates (NVLink bandwidth, GPM) need two samples.
    wait_samples(&t, 3);
    let text = render(&registry, &t);
    for gpu in [0, 1] {
        let (uuid, jobs) = if gpu == 0 { (UUID0, vec![""]) } else { (UUID1, vec!["4242", "4243"]) };
        for (name, kind, want) in expected_dcgm(gpu) {
            assert!(text.contains(&format!("\n# TYPE {name} {kind}\n")), "{name} must be a {kind}:\n{text}");
            for job in &jobs {
                let got = value(&text, &dcgm_prefix(name, gpu, uuid, job))
                    .unwrap_or_else(|| panic!("no {name} for GPU {gpu} job {job:?}:\n{text}"));
                let tolerance = if name == "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL" { 0.01 } else { 1e-9 };
                assert!((got - want).abs() <= tolerance * want.abs().max(1.0), "{name} GPU {gpu} job {job:?}: got {got}, want {want}");
            }
        }
        let energy = value(&text, &dcgm_prefix("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu, uuid, jobs[0])).unwrap();
        assert!(energy >= 5_000_000.0, "{energy}");
    }
    assert!(text.contains("\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n"));
    assert!(!text.contains("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"), "dcgm-exporter's counters keep their names");
    assert!(text.ends_with("# EOF\n"), "OpenMetrics ends with # EOF");
    promtool_check(&text);
    // One GPM sample per GPU is kept between passes, none leak.
    // (A pass briefly holds a third while it swaps one GPU's sample: read between passes.)
    let leaks = GpmLeakCounter::attach(&fake.lib);
    let settles_at_two = || (0..100).any(|_| leaks.live() == 2 || (std::thread::sleep(Duration::from_millis(7)), false).1);
    assert!(settles_at_two(), "{} GPM samples live", leaks.live());
    wait_samples(&t, 5);
    assert!(settles_at_two(), "{} GPM samples live after 5 more passes", leaks.live());
    t.shutdown();
    assert_eq!(leaks.live(), 0, "GPM samples are freed with NVML");
}

#[test]
fn a_field_the_gpu_does_not_support_is_absent_not_zero_and_logged_once() {
    // GPU 0: no GPM at all (pre-Hopper), no memory temperature, no NVLink; GPU 1: one GPM
    // metric refused, remapped rows failing.
    let script = format!(
        "{}{}",
        gpu_line(0, UUID0, GIB, 10, &format!("{FULL_GPU} unsupported=gpm,memory_temp,nvlink_bandwidth,enc_util")),
        gpu_line(1, UUID1, GIB, 10, &format!("{FULL_GPU} unsupported=gpm_sm_occupancy fail=remapped_rows")),
    );
    let fake = FakeNvml::new(&script);
    let mut registry = Registry::default();
    let t = Telemetry::start(&cfg_for(&fake.lib), &mut registry);
    wait_samples(&t, 3);
    let text = render(&registry, &t);
    let has = |name: &str, gpu: u32, uuid: &str| value(&text, &dcgm_prefix(name, gpu, uuid, "")).is_some();
    for name in [
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_SM_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "DCGM_FI_DEV_ENC_UTIL",
    ] {
        assert!(!has(name, 0, UUID0), "{name} must be absent on GPU 0:\n{text}");
        assert!(has(name, 1, UUID1), "{name} must be there on GPU 1:\n{text}");
    }
    assert!(!has("DCGM_FI_PROF_SM_OCCUPANCY", 1, UUID1), "{text}");
    assert!(!has("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 1, UUID1) && has("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 0, UUID0));
    assert!(has("DCGM_FI_DEV_DEC_UTIL", 0, UUID0) && !has("DCGM_FI_PROF_SM_OCCUPANCY", 0, UUID0));
    // Unsupported is a property of the GPU, not counted; the failure is.
    assert!(value(&text, "gpuhub_telemetry_nvml_errors_total{field=\"remapped_rows\"}").unwrap() >= 3.0, "{text}");
    for f in ["gpm", "memory_temp", "nvlink_bandwidth", "gpm_sm_occupancy"] {
        assert_eq!(value(&text, &format!("gpuhub_telemetry_nvml_errors_total{{field=\"{f}\"}}")), None, "{f}: {text}");
    }
    promtool_check(&text);
    t.shutdown();
}

/// Log lines written while `f` runs on this thread.
fn captured_log(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let w = buf.clone();
    let subscriber = tracing_subscriber::fmt().with_ansi(false).with_writer(move || w.clone()).finish();
    tracing::subscriber::with_default(subscriber, f);
    String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
}

#[test]
fn an_unsupported_field_is_said_once_in_the_log_not_every_sample() {
    let fake = FakeNvml::new(&gpu_line(0, UUID0, GIB, 10, &format!("{FULL_GPU} unsupported=gpm,memory_temp")));
    let cfg = cfg_for(&fake.lib);
    let out = Arc::new(dcgm::DcgmExposition::default());
    let mut registry = Registry::default();
    let own = metrics::GpuhubMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
    let log = captured_log(|| {
        let mut s = sampler::GpuSampler::new(
            &cfg,
            dcgm::DcgmWriter::new(Arc::clone(&out)),
            own,
            Arc::new(Mutex::new(Published::default())),
            Arc::new(Mutex::new(sampler::JobStatsStore::new(Duration::from_secs(60)))),
        );
        for _ in 0..5 {
            s.sample_once();
        }
    });
    for field in ["gpm", "memory_temp"] {
        let lines = log.lines().filter(|l| l.contains(&format!("does not support `{field}`"))).count();
        assert_eq!(lines, 1, "{field} said once over 5 samples:\n{log}");
    }
    let mut text = String::new();
    out.encode(&mut text);
    assert!(!text.contains("DCGM_FI_DEV_MEMORY_TEMP{") && !text.contains("DCGM_FI_PROF_GR_ENGINE_ACTIVE{"), "{text}");
    assert!(text.contains("DCGM_FI_DEV_ENC_UTIL{"), "{text}");
}
