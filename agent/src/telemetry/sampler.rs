//! The GPU sampler thread: NVML sample -> per-process job attribution -> per-job accumulators
//! -> gauges. A scrape only encodes what the last pass wrote.
//!
//! Per GPU and sample, the jobs "on" the GPU are those with an attributed process there, plus
//! those the plugin's dcgm job map lists for it (a whole-GPU job that has not opened CUDA yet).
//! For each such job:
//! - VRAM: the sum of its processes' `usedGpuMemory`;
//! - utilisation: the GPU's own when the job is alone on the GPU (NVML's per-process samples
//!   can miss short kernels), otherwise the sum of its processes' SM utilisation (capped at 100);
//! - energy: the GPU energy counter's delta since the previous sample, whole when the job is
//!   alone, otherwise split by utilisation share (equal shares when all are idle). Processes
//!   that belong to no job take their share too, so jobs are not charged for them.
//!
//! A counter that goes backwards (driver reload) contributes nothing for that interval.
//!
//! XID events NVML delivered since the previous pass are counted per GPU and code
//! (`gpuhub_gpu_xid_errors_total`) and logged at warn level: XIDs are what admins page on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::attribution::Attributor;
use super::dcgm::DcgmWriter;
use super::metrics::{FieldLabels, GpuLabels, GpuXidLabels, GpuhubMetrics, JobGpuLabels, remove_stale};
use super::nvml::{GpuSample, NvmlSource};
use super::xid;
use super::{GpuInfo, JobGpuStats, Published, Stop, TelemetryConfig, lock, unix_now};

/// How often to retry opening NVML after it failed (a driver can load after the agent).
const NVML_RETRY: Duration = Duration::from_secs(60);
/// Upper bound on (job, GPU) accumulators kept; the oldest go first beyond it.
const MAX_JOB_STATS: usize = 100_000;

#[derive(Debug, Clone)]
struct Acc {
    gpu_index: u32,
    util_sum: f64,
    samples: u64,
    peak_vram: u64,
    energy_j: f64,
    first_seen: i64,
    last_seen: i64,
    last_seen_mono: Instant,
    last_util: f64,
    last_vram: u64,
}

/// Per (job, GPU UUID) accumulators, kept `retention` after the job's last sample.
#[derive(Debug)]
pub struct JobStatsStore {
    retention: Duration,
    accs: HashMap<(u32, String), Acc>,
}

impl JobStatsStore {
    pub fn new(retention: Duration) -> Self {
        Self { retention, accs: HashMap::new() }
    }

    #[allow(clippy::too_many_arguments)] // one flat call per (job, GPU) sample; a struct adds nothing
    fn record(&mut self, job: u32, uuid: &str, gpu_index: u32, util: f64, vram: u64, energy_j: f64, now: i64) {
        let key = (job, uuid.to_string());
        let acc = self.accs.entry(key).or_insert_with(|| Acc {
            gpu_index,
            util_sum: 0.0,
            samples: 0,
            peak_vram: 0,
            energy_j: 0.0,
            first_seen: now,
            last_seen: now,
            last_seen_mono: Instant::now(),
            last_util: util,
            last_vram: vram,
        });
        acc.util_sum += util;
        acc.samples += 1;
        acc.peak_vram = acc.peak_vram.max(vram);
        acc.energy_j += energy_j;
        acc.last_seen = now;
        acc.last_seen_mono = Instant::now();
        acc.last_util = util;
        acc.last_vram = vram;
    }

    /// The job's statistics, one entry per GPU, by GPU index.
    pub fn get(&self, job: u32) -> Vec<JobGpuStats> {
        let mut out: Vec<JobGpuStats> = self
            .accs
            .iter()
            .filter(|((j, _), _)| *j == job)
            .map(|((_, uuid), a)| JobGpuStats {
                gpu_uuid: uuid.clone(),
                gpu_index: a.gpu_index,
                mean_util: if a.samples == 0 { 0.0 } else { a.util_sum / a.samples as f64 },
                peak_vram_bytes: a.peak_vram,
                energy_joules: a.energy_j,
                samples: a.samples,
                first_seen: a.first_seen,
                last_seen: a.last_seen,
                last_util: a.last_util,
                last_vram_bytes: a.last_vram,
            })
            .collect();
        out.sort_by_key(|s| s.gpu_index);
        out
    }

    fn expire(&mut self) {
        let retention = self.retention;
        self.accs.retain(|_, a| a.last_seen_mono.elapsed() <= retention);
        if self.accs.len() > MAX_JOB_STATS {
            let mut by_age: Vec<(Instant, (u32, String))> = self.accs.iter().map(|(k, a)| (a.last_seen_mono, k.clone())).collect();
            by_age.sort_by_key(|(t, _)| *t);
            let excess = self.accs.len() - MAX_JOB_STATS;
            for (_, k) in by_age.into_iter().take(excess) {
                self.accs.remove(&k);
            }
            tracing::warn!(
                "telemetry: more than {MAX_JOB_STATS} job/GPU statistics kept; dropped the {excess} oldest (lower telemetry.job_stats_retention_s)"
            );
        }
    }
}

/// What one job does on one GPU in one sample.
#[derive(Debug, Default, Clone)]
struct JobOnGpu {
    user: String,
    vram: u64,
    proc_util: u32,
    procs: i64,
    shards: Option<u32>,
}

/// The GPU sampler; lives on its own thread after the first sample.
pub struct GpuSampler {
    enable_nvml: bool,
    nvml_library: Option<PathBuf>,
    nvml: Option<NvmlSource>,
    next_open: Instant,
    logged_no_nvml: bool,
    hostname: String,
    /// The open driver's version (`DCGM_FI_DRIVER_VERSION` label); empty without NVML.
    driver_version: String,
    job_map_dir: Option<PathBuf>,
    attributor: Attributor,
    dcgm: DcgmWriter,
    own: GpuhubMetrics,
    published: Arc<Mutex<Published>>,
    stats: Arc<Mutex<JobStatsStore>>,
    prev_energy_mj: HashMap<String, u64>,
    /// (GPU index, field) pairs whose failure was logged; cleared when the field recovers.
    logged_fields: HashSet<(u32, &'static str)>,
    live_gpu: HashSet<GpuLabels>,
    live_job: HashSet<JobGpuLabels>,
    live_unattributed: HashSet<GpuLabels>,
}

impl std::fmt::Debug for GpuSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuSampler").field("nvml", &self.nvml).finish_non_exhaustive()
    }
}

impl GpuSampler {
    pub(crate) fn new(
        cfg: &TelemetryConfig,
        dcgm: DcgmWriter,
        own: GpuhubMetrics,
        published: Arc<Mutex<Published>>,
        stats: Arc<Mutex<JobStatsStore>>,
    ) -> Self {
        Self {
            enable_nvml: cfg.enable_nvml,
            nvml_library: cfg.nvml_library.clone(),
            nvml: None,
            next_open: Instant::now(),
            logged_no_nvml: false,
            hostname: cfg.effective_hostname(),
            driver_version: String::new(),
            job_map_dir: cfg.job_map().map(std::path::Path::to_path_buf),
            attributor: Attributor::default(),
            dcgm,
            own,
            published,
            stats,
            prev_energy_mj: HashMap::new(),
            logged_fields: HashSet::new(),
            live_gpu: HashSet::new(),
            live_job: HashSet::new(),
            live_unattributed: HashSet::new(),
        }
    }

    pub(crate) fn run(mut self, interval: Duration, stop: &Stop) {
        let mut next = Instant::now() + interval;
        loop {
            let wait = next.saturating_duration_since(Instant::now());
            if stop.wait(wait) {
                return;
            }
            self.sample_once();
            next += interval;
            // Fell behind (a slow driver call): restart the cadence instead of bursting.
            if next < Instant::now() {
                next = Instant::now() + interval;
            }
        }
    }

    fn ensure_open(&mut self) {
        if self.nvml.is_some() || !self.enable_nvml || Instant::now() < self.next_open {
            return;
        }
        self.next_open = Instant::now() + NVML_RETRY;
        match NvmlSource::open(self.nvml_library.as_deref()) {
            Ok(src) => {
                self.driver_version = src.driver_version().unwrap_or_default();
                tracing::info!(
                    "telemetry: NVML opened ({}), driver {}",
                    self.nvml_library.as_ref().map_or("libnvidia-ml.so.1".to_string(), |p| p.display().to_string()),
                    if self.driver_version.is_empty() { "unknown" } else { &self.driver_version }
                );
                self.nvml = Some(src);
                self.logged_no_nvml = false;
            }
            Err(e) => {
                if !self.logged_no_nvml {
                    tracing::warn!(
                        "telemetry: no NVML ({e}); GPU telemetry off, exporting gpuhub_nvml_up 0 (retrying every {}s; set telemetry.nvml_library if the driver's library is elsewhere)",
                        NVML_RETRY.as_secs()
                    );
                    self.logged_no_nvml = true;
                } else {
                    tracing::debug!("telemetry: NVML still unavailable: {e}");
                }
            }
        }
    }

    /// One pass: sample, attribute, accumulate, publish. Never panics on bad data.
    pub(crate) fn sample_once(&mut self) {
        let t0 = Instant::now();
        if !self.enable_nvml && !self.logged_no_nvml {
            tracing::info!("telemetry: NVML disabled (telemetry.enable_nvml = false); exporting gpuhub_nvml_up 0");
            self.logged_no_nvml = true;
        }
        self.ensure_open();
        let samples = match self.nvml.as_mut().map(NvmlSource::sample) {
            Some(Ok(s)) => Some(s),
            Some(Err(e)) => {
                tracing::warn!("telemetry: NVML stopped answering ({e}); GPU series removed until it is back");
                self.nvml = None;
                self.next_open = Instant::now() + NVML_RETRY;
                None
            }
            None => None,
        };
        let up = samples.is_some();
        let samples = samples.unwrap_or_default();
        self.account_errors(&samples);
        let slurm_users: HashMap<u32, String> =
            lock(&self.published).slurm_jobs.iter().map(|(id, (user, _))| (*id, user.clone())).collect();

        let now = unix_now();
        let now_s = now as i64;
        let mut live_pids = HashSet::new();
        let mut jobs_per_gpu: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let mut holders: BTreeMap<u32, Vec<super::GpuJob>> = BTreeMap::new();
        let mut gpu_now = HashSet::new();
        let mut job_now = HashSet::new();
        let mut unattributed_now = HashSet::new();
        let mut records = Vec::new();

        for s in samples.iter().filter(|s| !s.uuid.is_empty()) {
            let gl = GpuLabels { gpu: s.index.to_string(), uuid: s.uuid.clone() };
            self.write_gpu_series(s, &gl);
            self.record_xids(s);
            gpu_now.insert(gl.clone());

            // Who is on this GPU.
            let mut jobs: BTreeMap<u32, JobOnGpu> = BTreeMap::new();
            let mut unattributed_vram = 0u64;
            let mut unattributed_util = 0u32;
            for p in s.processes.iter().flatten() {
                live_pids.insert(p.pid);
                match self.attributor.attribute(p.pid) {
                    Some(j) => {
                        let e = jobs.entry(j.job_id).or_default();
                        if e.user.is_empty() {
                            e.user = j.user;
                        }
                        e.vram += p.used_bytes.unwrap_or(0);
                        e.proc_util += p.sm_util.unwrap_or(0);
                        e.procs += 1;
                        e.shards = e.shards.or(j.shards);
                    }
                    None => {
                        unattributed_vram += p.used_bytes.unwrap_or(0);
                        unattributed_util += p.sm_util.unwrap_or(0);
                    }
                }
            }
            for job in self.job_map(s.index) {
                jobs.entry(job).or_default();
            }
            for (id, j) in jobs.iter_mut() {
                if j.user.is_empty() {
                    j.user = slurm_users.get(id).cloned().unwrap_or_default();
                }
            }
            if s.processes.is_some() {
                let l = gl.clone();
                self.own.gpu_memory_unattributed.get_or_create(&l).set(to_i64(unattributed_vram));
                unattributed_now.insert(l);
            }

            // Energy since the previous sample.
            let energy_j = match (s.energy_mj, self.prev_energy_mj.get(&s.uuid)) {
                (Some(new), Some(old)) if new >= *old => (new - old) as f64 / 1000.0,
                _ => 0.0,
            };
            if let Some(e) = s.energy_mj {
                self.prev_energy_mj.insert(s.uuid.clone(), e);
            }
            if energy_j > 0.0 {
                self.own.gpu_energy.get_or_create(&gl).inc_by(energy_j);
            }

            let alone = jobs.len() == 1 && unattributed_util == 0 && unattributed_vram == 0;
            let utils: Vec<f64> = jobs
                .values()
                .map(|j| if alone { f64::from(s.util_percent.unwrap_or(j.proc_util)) } else { f64::from(j.proc_util.min(100)) })
                .collect();
            let weight_total: f64 = utils.iter().sum::<f64>() + f64::from(unattributed_util.min(100));
            let participants = jobs.len() + usize::from(unattributed_util > 0 || unattributed_vram > 0);
            for ((id, j), util) in jobs.iter().zip(utils) {
                let share = if alone {
                    1.0
                } else if weight_total > 0.0 {
                    util / weight_total
                } else {
                    1.0 / participants.max(1) as f64
                };
                let jl = JobGpuLabels { gpu: gl.gpu.clone(), uuid: s.uuid.clone(), jobid: id.to_string(), user: j.user.clone() };
                self.own.job_gpu_memory_used.get_or_create(&jl).set(to_i64(j.vram));
                self.own.job_gpu_utilization.get_or_create(&jl).set(util / 100.0);
                self.own.job_gpu_processes.get_or_create(&jl).set(j.procs);
                match j.shards {
                    Some(n) => {
                        self.own.job_gpu_shards.get_or_create(&jl).set(i64::from(n));
                    }
                    None => {
                        self.own.job_gpu_shards.remove(&jl);
                    }
                }
                let job_energy = energy_j * share;
                // Create the counter even at 0 so the series exists from the job's first sample.
                self.own.job_gpu_energy.get_or_create(&jl).inc_by(job_energy);
                job_now.insert(jl);
                records.push((*id, s.uuid.clone(), s.index, util, j.vram, job_energy));
            }
            jobs_per_gpu.insert(s.index, jobs.keys().copied().collect());
            holders.insert(
                s.index,
                jobs.iter().map(|(id, j)| super::GpuJob { job_id: *id, user: j.user.clone(), vram_bytes: j.vram }).collect(),
            );
        }

        {
            let mut stats = lock(&self.stats);
            for (job, uuid, index, util, vram, energy) in records {
                stats.record(job, &uuid, index, util, vram, energy, now_s);
            }
            stats.expire();
        }
        self.remove_stale(&gpu_now, &job_now, &unattributed_now);
        self.dcgm.update(&samples, &jobs_per_gpu, &self.hostname, &self.driver_version);
        self.attributor.retain(&live_pids);
        let gone: Vec<String> = self.prev_energy_mj.keys().filter(|u| !samples.iter().any(|s| &s.uuid == *u)).cloned().collect();
        for u in gone {
            self.prev_energy_mj.remove(&u);
        }

        self.own.nvml_up.set(i64::from(up && !gpu_now.is_empty()));
        self.own.last_sample.set(now);
        self.own.sample_duration.set(t0.elapsed().as_secs_f64());
        let gpus = samples
            .iter()
            .filter(|s| !s.uuid.is_empty())
            .map(|s| GpuInfo {
                index: s.index,
                uuid: s.uuid.clone(),
                name: s.name.clone(),
                memory_total_bytes: s.memory_total_bytes.unwrap_or(0),
                memory_free_bytes: s.memory_free_bytes.unwrap_or(0),
                jobs: holders.remove(&s.index).unwrap_or_default(),
            })
            .collect::<Vec<_>>();
        if up && gpus.is_empty() && !self.logged_no_nvml {
            tracing::warn!("telemetry: NVML reports no usable GPU; exporting gpuhub_nvml_up 0");
            self.logged_no_nvml = true;
        }
        let mut p = lock(&self.published);
        p.nvml_up = up && !gpus.is_empty();
        p.gpus = gpus;
        p.samples += 1;
    }

    fn write_gpu_series(&self, s: &GpuSample, gl: &GpuLabels) {
        let m = &self.own;
        opt_set(&m.gpu_memory_used, gl, s.memory_used_bytes);
        opt_set(&m.gpu_memory_free, gl, s.memory_free_bytes);
        opt_set(&m.gpu_memory_total, gl, s.memory_total_bytes);
        opt_set(&m.gpu_temperature, gl, s.temperature_c.map(u64::from));
        match s.power_mw {
            Some(mw) => {
                m.gpu_power.get_or_create(gl).set(f64::from(mw) / 1000.0);
            }
            None => {
                m.gpu_power.remove(gl);
            }
        }
        match s.util_percent {
            Some(u) => {
                m.gpu_utilization.get_or_create(gl).set(f64::from(u) / 100.0);
            }
            None => {
                m.gpu_utilization.remove(gl);
            }
        }
    }

    /// Counts every XID event of this pass and logs them: one warn line per GPU and XID code
    /// per pass (a burst of one code is one line with its count, not hundreds).
    fn record_xids(&self, s: &GpuSample) {
        let Some(codes) = &s.xid_events else { return };
        let mut seen: Vec<(u64, u64)> = Vec::new(); // (code, events), in order of arrival
        for &code in codes {
            let l = GpuXidLabels { gpu: s.index.to_string(), uuid: s.uuid.clone(), xid: code.to_string() };
            self.own.gpu_xid_errors.get_or_create(&l).inc();
            match seen.iter_mut().find(|(c, _)| *c == code) {
                Some((_, n)) => *n += 1,
                None => seen.push((code, 1)),
            }
        }
        for (code, n) in seen {
            let what = xid::hint(code).map(|h| format!(": {h}")).unwrap_or_default();
            let times = if n > 1 { format!(" ({n} events since the last sample)") } else { String::new() };
            tracing::warn!(
                gpu = s.index,
                uuid = %s.uuid,
                xid = code,
                "telemetry: GPU {} ({}) reported XID {code}{times}{what}; see NVIDIA's XID catalog for the action (counted in gpuhub_gpu_xid_errors_total)",
                s.index,
                s.uuid
            );
        }
    }

    fn remove_stale(&mut self, gpu_now: &HashSet<GpuLabels>, job_now: &HashSet<JobGpuLabels>, un_now: &HashSet<GpuLabels>) {
        let m = &self.own;
        remove_stale(&m.gpu_memory_used, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_memory_free, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_memory_total, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_temperature, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_power, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_utilization, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_energy, &self.live_gpu, gpu_now);
        remove_stale(&m.gpu_memory_unattributed, &self.live_unattributed, un_now);
        remove_stale(&m.job_gpu_memory_used, &self.live_job, job_now);
        remove_stale(&m.job_gpu_utilization, &self.live_job, job_now);
        remove_stale(&m.job_gpu_processes, &self.live_job, job_now);
        remove_stale(&m.job_gpu_shards, &self.live_job, job_now);
        remove_stale(&m.job_gpu_energy, &self.live_job, job_now);
        self.live_gpu = gpu_now.clone();
        self.live_job = job_now.clone();
        self.live_unattributed = un_now.clone();
    }

    /// Counts and logs NVML field errors: once per GPU and field until it recovers.
    fn account_errors(&mut self, samples: &[GpuSample]) {
        let mut failing = HashSet::new();
        for s in samples {
            for e in &s.errors {
                failing.insert((s.index, e.field));
                if !e.unsupported {
                    self.own.nvml_errors.get_or_create(&FieldLabels { field: e.field.to_string() }).inc();
                }
                if self.logged_fields.insert((s.index, e.field)) {
                    if e.unsupported {
                        tracing::info!("telemetry: GPU {} does not support `{}`; that series is left out", s.index, e.field);
                    } else {
                        tracing::warn!(
                            "telemetry: GPU {}: reading `{}` failed: {}; skipped (counted in gpuhub_telemetry_nvml_errors_total)",
                            s.index,
                            e.field,
                            e.error
                        );
                    }
                }
            }
        }
        let recovered: Vec<(u32, &'static str)> = self.logged_fields.difference(&failing).copied().collect();
        for (index, field) in recovered {
            if samples.iter().any(|s| s.index == index) {
                tracing::info!("telemetry: GPU {index}: `{field}` readable again");
            }
            self.logged_fields.remove(&(index, field));
        }
    }

    /// Jobs the plugin's dcgm job map lists for GPU `index` (missing file or dir: none).
    fn job_map(&self, index: u32) -> Vec<u32> {
        let Some(dir) = &self.job_map_dir else { return Vec::new() };
        match std::fs::read_to_string(dir.join(index.to_string())) {
            Ok(text) => text.lines().filter_map(|l| l.trim().parse().ok()).collect(),
            Err(_) => Vec::new(),
        }
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn opt_set(
    f: &prometheus_client::metrics::family::Family<GpuLabels, prometheus_client::metrics::gauge::Gauge>,
    l: &GpuLabels,
    v: Option<u64>,
) {
    match v {
        Some(v) => {
            f.get_or_create(l).set(to_i64(v));
        }
        None => {
            f.remove(l);
        }
    }
}
