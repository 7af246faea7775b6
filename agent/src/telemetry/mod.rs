//! GPU and Slurm telemetry: the part of the agent that replaces dcgm-exporter, a Slurm
//! exporter and a usage exporter on the node.
//!
//! Parts:
//! - [`nvml`]: opens NVML through nvml-wrapper (the real driver, or the fake library under
//!   `tests/fake-nvml/`) and reads one [`nvml::GpuSample`] per GPU; a field NVML refuses is
//!   skipped and counted, never fatal.
//! - [`xid`]: XID errors through NVML's event API, one event set per GPU, drained without
//!   waiting on every sample (a GPU without XID events is skipped, logged once).
//! - [`attribution`]: maps a GPU process id to its Slurm job (`/proc/<pid>/environ`, then
//!   `/proc/<pid>/cgroup`), so two shard jobs on one GPU each get their own VRAM and utilisation.
//! - [`sampler`]: the GPU sampler thread: NVML -> attribution -> per-job accumulators -> gauges.
//! - [`slurm`]: one slurmctld snapshot (`scontrol show job`, `scontrol show node`) per interval on its own thread, shared by every
//!   collector (a scrape never runs a command).
//! - [`gpm`]: the profiling series through NVML's GPM API (Hopper and later).
//! - [`dcgm`]: the dcgm-exporter-compatible series (`DCGM_FI_DEV_*`, `DCGM_FI_PROF_*`: same
//!   names, types and labels), so existing Grafana dashboards work unchanged; encoded from a
//!   per-pass snapshot next to the registry ([`exposition::Exposition`]).
//! - [`metrics`]: gpuhub's own base-unit series under the `gpuhub_` prefix.
//! - [`disk`]: free space of the agent's state and spool directories (read at scrape time).
//!
//! Threads, not tasks: NVML and `fork`/`exec` of Slurm commands block, so they never run on a
//! tokio worker (STYLE.md §3). Both threads stop when [`Telemetry`] is dropped or
//! [`Telemetry::shutdown`] is called. A scrape only encodes the registry: the gauges hold the
//! last sample.

pub mod attribution;
pub mod dcgm;
pub mod disk;
pub mod exposition;
pub mod gpm;
pub mod metrics;
pub mod nvml;
pub mod sampler;
pub mod slurm;
pub mod xid;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

/// The `[telemetry]` section of `agent.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Sample the GPUs through NVML. `false`: no GPU series, `gpuhub_nvml_up 0`.
    pub enable_nvml: bool,
    /// NVML library to load; default: the driver's `libnvidia-ml.so.1` from the loader path.
    pub nvml_library: Option<PathBuf>,
    /// GPU sampling interval (milliseconds).
    pub interval_ms: u64,
    /// The `Hostname` label of the DCGM series; default: this machine's host name.
    pub hostname: Option<String>,
    /// Take Slurm snapshots (`scontrol show job -d`, `scontrol -d show node`).
    pub enable_slurm: bool,
    /// Directory holding `scontrol` (and `sacct` for accounting); default: found on `PATH`.
    pub slurm_bin_dir: Option<PathBuf>,
    /// Slurm snapshot interval (milliseconds).
    pub slurm_interval_ms: u64,
    /// A Slurm command running longer than this is killed and the snapshot skipped (ms).
    pub slurm_timeout_ms: u64,
    /// Slurm node name whose GPUs and shards are counted; default: `hostname`'s short name.
    pub slurm_node_name: Option<String>,
    /// dcgm-exporter job-map directory (one file per GPU index, one job id per line): the agent
    /// keeps it from slurmctld's allocations (`accounting.job_boundaries = "slurm"`), the
    /// plugin's job-hooks build from the prolog otherwise. Read for the `hpc_job` label of GPUs
    /// whose job runs no process yet. `""` turns the map off (jobs are then attributed to GPUs
    /// by their processes only); use [`TelemetryConfig::job_map`].
    pub job_map_dir: Option<PathBuf>,
    /// How long per-job GPU statistics stay available after the job's last process (seconds),
    /// so accounting can read them at job end.
    pub job_stats_retention_s: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            enable_nvml: true,
            nvml_library: None,
            interval_ms: 5_000,
            hostname: None,
            enable_slurm: true,
            slurm_bin_dir: None,
            slurm_interval_ms: 15_000,
            slurm_timeout_ms: 10_000,
            slurm_node_name: None,
            job_map_dir: Some(PathBuf::from(gpuhub_wire::paths::RUNTIME_DIR).join(gpuhub_wire::paths::DCGM_JOB_MAP_DIR_NAME)),
            job_stats_retention_s: 6 * 3600,
        }
    }
}

/// A `[telemetry]` value that cannot work; the message names the key and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("telemetry.{key}: {problem}")]
pub struct ConfigError {
    pub key: &'static str,
    pub problem: String,
}

impl TelemetryConfig {
    /// Cross-field checks; each error names the full key (`telemetry.interval_ms`).
    /// The dcgm job map directory, unless turned off with `job_map_dir = ""`.
    pub fn job_map(&self) -> Option<&std::path::Path> {
        self.job_map_dir.as_deref().filter(|d| !d.as_os_str().is_empty())
    }

    pub fn validate(&self) -> Result<(), Vec<ConfigError>> {
        let mut errors = Vec::new();
        let mut bad = |key: &'static str, problem: String| errors.push(ConfigError { key, problem });
        if !(100..=3_600_000).contains(&self.interval_ms) {
            bad("interval_ms", format!("{} is out of range; use 100..=3600000 (default 5000)", self.interval_ms));
        }
        if !(1_000..=3_600_000).contains(&self.slurm_interval_ms) {
            bad("slurm_interval_ms", format!("{} is out of range; use 1000..=3600000 (default 15000)", self.slurm_interval_ms));
        }
        if !(100..=600_000).contains(&self.slurm_timeout_ms) {
            bad("slurm_timeout_ms", format!("{} is out of range; use 100..=600000 (default 10000)", self.slurm_timeout_ms));
        }
        if let Some(lib) = &self.nvml_library
            && !lib.is_absolute()
        {
            bad("nvml_library", format!("{} is not an absolute path; give the full path or remove the key", lib.display()));
        }
        if let Some(dir) = self.job_map()
            && !dir.is_absolute()
        {
            bad("job_map_dir", format!("{} is not an absolute path; give the full path, or \"\" to turn the job map off", dir.display()));
        }
        if let Some(dir) = &self.slurm_bin_dir
            && !dir.is_absolute()
        {
            bad("slurm_bin_dir", format!("{} is not an absolute path; e.g. \"/usr/bin\"", dir.display()));
        }
        if let Some(h) = &self.hostname
            && (h.is_empty() || h.chars().any(|c| c.is_control() || c.is_whitespace()))
        {
            bad("hostname", format!("{h:?} is not a host name; remove the key to use this machine's name"));
        }
        if let Some(n) = &self.slurm_node_name
            && (n.is_empty() || n.chars().any(|c| c.is_control() || c.is_whitespace() || c == ','))
        {
            bad("slurm_node_name", format!("{n:?} is not a Slurm node name (e.g. \"gpu01\")"));
        }
        if self.job_stats_retention_s > 30 * 24 * 3600 {
            bad(
                "job_stats_retention_s",
                format!("{} is longer than 30 days; accounting reads stats at job end", self.job_stats_retention_s),
            );
        }
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    /// The `Hostname` label: the configured one, else the machine's host name.
    pub fn effective_hostname(&self) -> String {
        self.hostname.clone().unwrap_or_else(machine_hostname)
    }

    /// The Slurm node to count GPUs and shards for: configured, else the short host name.
    pub fn effective_node_name(&self) -> String {
        match &self.slurm_node_name {
            Some(n) => n.clone(),
            None => {
                let h = self.effective_hostname();
                h.split('.').next().unwrap_or(&h).to_string()
            }
        }
    }
}

fn machine_hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// A GPU as the rest of the agent sees it (role snapshot, model placement).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_total_bytes: u64,
    pub memory_free_bytes: u64,
    /// The Slurm jobs on this GPU (by their processes, or by the plugin's records of the
    /// job's GPUs), for placement messages that say what holds a GPU.
    #[serde(default)]
    pub jobs: Vec<GpuJob>,
}

/// A Slurm job on a GPU, as the last sample saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuJob {
    pub job_id: u32,
    /// Its user ("" if neither its processes nor Slurm said).
    pub user: String,
    /// GPU memory its processes hold on this GPU.
    pub vram_bytes: u64,
}

/// What NVML measured for one job on one GPU, accumulated over the job's lifetime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobGpuStats {
    pub gpu_uuid: String,
    pub gpu_index: u32,
    /// Mean SM utilisation (percent, 0-100) of the job's processes over the samples taken.
    pub mean_util: f64,
    /// Highest VRAM the job's processes held at once on this GPU (bytes).
    pub peak_vram_bytes: u64,
    /// Energy attributed to the job on this GPU (joules): the GPU's energy counter delta,
    /// whole when the job is alone on the GPU, split by utilisation when it shares it.
    pub energy_joules: f64,
    /// Number of samples the statistics are made of.
    pub samples: u64,
    /// Unix seconds of the first and last sample that saw the job on this GPU.
    pub first_seen: i64,
    pub last_seen: i64,
    /// The last sample (at `last_seen`): SM utilisation (percent) and VRAM (bytes) of the
    /// job's processes on this GPU, for live views of running jobs.
    #[serde(default)]
    pub last_util: f64,
    #[serde(default)]
    pub last_vram_bytes: u64,
}

/// State the sampler threads publish and the accessors read. Short critical sections only.
#[derive(Debug, Default)]
pub(crate) struct Published {
    pub gpus: Vec<GpuInfo>,
    pub nvml_up: bool,
    pub samples: u64,
    pub slurm_snapshots: u64,
    /// Job id -> (user, account) from the last Slurm snapshot: the user label for a GPU job
    /// whose processes do not say.
    pub slurm_jobs: HashMap<u32, (String, String)>,
}

/// Stop flag shared with the threads; a condvar so they wake at once on shutdown.
#[derive(Debug, Default)]
pub(crate) struct Stop {
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl Stop {
    /// Sleeps up to `d`; returns `true` when telemetry is stopping.
    pub(crate) fn wait(&self, d: Duration) -> bool {
        let guard = lock(&self.stopped);
        if *guard {
            return true;
        }
        match self.cv.wait_timeout_while(guard, d, |stopped| !*stopped) {
            Ok((g, _)) => *g,
            Err(poisoned) => *poisoned.into_inner().0,
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        *lock(&self.stopped)
    }

    fn stop(&self) {
        *lock(&self.stopped) = true;
        self.cv.notify_all();
    }
}

/// Locks a std mutex, recovering the data if a thread panicked while holding it (the data are
/// plain statistics; a poisoned lock must not take the agent down).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Running telemetry. Dropping it stops the sampler threads.
#[derive(Debug)]
pub struct Telemetry {
    published: Arc<Mutex<Published>>,
    stats: Arc<Mutex<sampler::JobStatsStore>>,
    stop: Arc<Stop>,
    threads: Vec<JoinHandle<()>>,
    dcgm: Arc<dcgm::DcgmExposition>,
    last_look: crate::accounting::slurm::LastLook,
}

impl Telemetry {
    /// Registers gpuhub's series in `registry` (under the `gpuhub` prefix; the DCGM series are
    /// encoded from [`Telemetry::dcgm`] next to it, see [`exposition::Exposition`]), opens NVML, takes a first GPU sample and starts the sampler threads.
    ///
    /// Blocks for NVML initialisation and one sample (milliseconds with the fake library, up to
    /// a few seconds on a real node): call it at startup, or inside `spawn_blocking`. Never
    /// fails: without NVML or GPUs it logs once and exports `gpuhub_nvml_up 0`. `cfg` should
    /// have passed [`TelemetryConfig::validate`]; out-of-range intervals are clamped.
    pub fn start(cfg: &TelemetryConfig, registry: &mut Registry) -> Telemetry {
        let dcgm_out = Arc::new(dcgm::DcgmExposition::default());
        let dcgm = dcgm::DcgmWriter::new(Arc::clone(&dcgm_out));
        let own = metrics::GpuhubMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
        let published = Arc::new(Mutex::new(Published::default()));
        let stats = Arc::new(Mutex::new(sampler::JobStatsStore::new(Duration::from_secs(cfg.job_stats_retention_s))));
        let stop = Arc::new(Stop::default());
        let mut threads = Vec::new();

        let mut gpu_sampler = sampler::GpuSampler::new(cfg, dcgm, own.clone(), Arc::clone(&published), Arc::clone(&stats));
        gpu_sampler.sample_once();
        let interval = Duration::from_millis(cfg.interval_ms.clamp(100, 3_600_000));
        let stop_gpu = Arc::clone(&stop);
        match std::thread::Builder::new().name("gpuhub-nvml".into()).spawn(move || gpu_sampler.run(interval, &stop_gpu)) {
            Ok(h) => threads.push(h),
            Err(e) => tracing::error!("telemetry: cannot start the GPU sampler thread: {e}; GPU series stay at their first sample"),
        }

        let last_look = crate::accounting::slurm::LastLook::default();
        if cfg.enable_slurm {
            let slurm_sampler = slurm::SlurmSampler::new(cfg, own, Arc::clone(&published), last_look.clone());
            let interval = Duration::from_millis(cfg.slurm_interval_ms.clamp(1_000, 3_600_000));
            let stop_slurm = Arc::clone(&stop);
            match std::thread::Builder::new().name("gpuhub-slurm".into()).spawn(move || slurm_sampler.run(interval, &stop_slurm)) {
                Ok(h) => threads.push(h),
                Err(e) => tracing::error!("telemetry: cannot start the Slurm sampler thread: {e}; Slurm series stay empty"),
            }
        } else {
            own.slurm_up.set(0);
        }
        Telemetry { published, stats, stop, threads, dcgm: dcgm_out, last_look }
    }

    /// The Slurm sampler's latest look at slurmctld's jobs, for the accounting ingest.
    pub fn last_look(&self) -> crate::accounting::slurm::LastLook {
        self.last_look.clone()
    }

    /// The DCGM block of `/metrics`, for [`exposition::Exposition`].
    pub fn dcgm(&self) -> Arc<dcgm::DcgmExposition> {
        Arc::clone(&self.dcgm)
    }

    /// The GPUs of the last sample (empty without NVML).
    pub fn gpus(&self) -> Vec<GpuInfo> {
        lock(&self.published).gpus.clone()
    }

    /// Whether the last GPU sample reached NVML.
    pub fn nvml_up(&self) -> bool {
        lock(&self.published).nvml_up
    }

    /// Per-GPU statistics of a job, one entry per GPU it was seen on (empty when NVML never saw
    /// it). Kept `job_stats_retention_s` after the job's last sample.
    pub fn job_gpu_stats(&self, job_id: u32) -> Vec<JobGpuStats> {
        lock(&self.stats).get(job_id)
    }

    /// GPU samples taken since start (the first one is taken inside [`Telemetry::start`]).
    pub fn samples_taken(&self) -> u64 {
        lock(&self.published).samples
    }

    /// Slurm snapshots taken since start (successful or not).
    pub fn slurm_snapshots_taken(&self) -> u64 {
        lock(&self.published).slurm_snapshots
    }

    /// Stops the sampler threads and waits for them (at most one NVML sample or one Slurm
    /// command, which is bounded by `slurm_timeout_ms`).
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.stop();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                tracing::error!("telemetry: a sampler thread panicked before shutdown");
            }
        }
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Unix time in seconds (fractional).
pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

#[cfg(test)]
mod tests;
