//! dcgm-exporter-compatible series: the names, units and labels of dcgm-exporter's default
//! counters (`etc/default-counters.csv`), so existing Grafana dashboards (e.g. NVIDIA's 12239)
//! work unchanged when the agent replaces dcgm-exporter.
//!
//! Labels: `gpu` (index), `UUID`, `pci_bus_id`, `device` (`nvidia<N>`), `modelName`,
//! `Hostname`, and `hpc_job`. Like dcgm-exporter with `--hpc-job-mapping-dir`, a GPU running
//! several jobs (shards) gets one copy of each series per job; a GPU without a job has
//! `hpc_job=""`, which Prometheus treats as no label.
//!
//! Differences, on purpose: registered at the registry root with no prefix; every series is a
//! gauge (prometheus-client appends `_total` to counters, which would rename
//! `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION`; `rate()` works on it all the same); no
//! `DCGM_FI_DRIVER_VERSION` label.
//!
//! `DCGM_FI_DEV_XID_ERRORS` is, as in DCGM, the code of the last XID the GPU reported (0 before
//! any). It exists only for GPUs watched for XID events ([`super::xid`]): a GPU without XID
//! support has no such series, rather than a 0 that would read as "no XID". A GPU whose watch
//! fails later keeps its last value. The count of XIDs is gpuhub's
//! `gpuhub_gpu_xid_errors_total{xid}`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::nvml::GpuSample;

/// dcgm-exporter's label set.
#[allow(non_snake_case)] // label names exactly as dcgm-exporter writes them
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DcgmLabels {
    pub gpu: String,
    pub UUID: Arc<String>,
    pub pci_bus_id: Arc<String>,
    pub device: String,
    pub modelName: Arc<String>,
    pub Hostname: Arc<String>,
    pub hpc_job: String,
}

type G = Family<DcgmLabels, Gauge>;
type GF = Family<DcgmLabels, Gauge<f64, AtomicU64>>;

/// Handles to the DCGM series and the label sets written last time.
#[derive(Debug, Default)]
pub struct DcgmMetrics {
    sm_clock: G,
    mem_clock: G,
    gpu_temp: G,
    power_usage: GF,
    total_energy: G,
    gpu_util: G,
    mem_copy_util: G,
    fb_free: G,
    fb_used: G,
    fb_total: G,
    ecc_sbe: G,
    ecc_dbe: G,
    xid: G,
    live: HashSet<DcgmLabels>,
    /// Last XID code per GPU UUID, for GPUs ever watched (0 until the first XID). Kept when a
    /// GPU leaves the sample so its value is back when the GPU is; bounded by the GPUs the
    /// node has had.
    last_xid: HashMap<String, u64>,
}

const MIB: u64 = 1024 * 1024;

impl DcgmMetrics {
    /// Registers the series at the root of `r` (no prefix: the names are dcgm-exporter's). The
    /// help texts are dcgm-exporter's without the final period, which prometheus-client adds.
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz)", m.sm_clock.clone());
        r.register("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz)", m.mem_clock.clone());
        r.register("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C)", m.gpu_temp.clone());
        r.register("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W)", m.power_usage.clone());
        r.register("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ)", m.total_energy.clone());
        r.register("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %)", m.gpu_util.clone());
        r.register("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %)", m.mem_copy_util.clone());
        r.register("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB)", m.fb_free.clone());
        r.register("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB)", m.fb_used.clone());
        r.register("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB)", m.fb_total.clone());
        r.register("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors", m.ecc_sbe.clone());
        r.register("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors", m.ecc_dbe.clone());
        r.register("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered", m.xid.clone());
        m
    }

    /// Writes one sample. `jobs` maps a GPU index to the job ids on it (sorted); series of
    /// GPUs or jobs no longer present, and of fields NVML refused this time, are removed.
    pub fn update(&mut self, samples: &[GpuSample], jobs: &BTreeMap<u32, Vec<u32>>, hostname: &Arc<String>) {
        let mut now = HashSet::new();
        for s in samples.iter().filter(|s| !s.uuid.is_empty()) {
            let uuid = Arc::new(s.uuid.clone());
            let pci = Arc::new(s.pci_bus_id.clone());
            let model = Arc::new(s.name.clone());
            if let Some(codes) = &s.xid_events {
                let last = self.last_xid.entry(s.uuid.clone()).or_insert(0);
                if let Some(code) = codes.last() {
                    *last = *code;
                }
            }
            let last_xid = self.last_xid.get(&s.uuid).copied();
            let job_labels: Vec<String> = match jobs.get(&s.index) {
                Some(ids) if !ids.is_empty() => ids.iter().map(u32::to_string).collect(),
                _ => vec![String::new()],
            };
            for job in job_labels {
                let l = DcgmLabels {
                    gpu: s.index.to_string(),
                    UUID: Arc::clone(&uuid),
                    pci_bus_id: Arc::clone(&pci),
                    device: format!("nvidia{}", s.index),
                    modelName: Arc::clone(&model),
                    Hostname: Arc::clone(hostname),
                    hpc_job: job,
                };
                set(&self.sm_clock, &l, s.sm_clock_mhz.map(u64::from));
                set(&self.mem_clock, &l, s.mem_clock_mhz.map(u64::from));
                set(&self.gpu_temp, &l, s.temperature_c.map(u64::from));
                match s.power_mw {
                    Some(mw) => {
                        self.power_usage.get_or_create(&l).set(f64::from(mw) / 1000.0);
                    }
                    None => {
                        self.power_usage.remove(&l);
                    }
                }
                set(&self.total_energy, &l, s.energy_mj);
                set(&self.gpu_util, &l, s.util_percent.map(u64::from));
                set(&self.mem_copy_util, &l, s.mem_copy_util_percent.map(u64::from));
                set(&self.fb_free, &l, s.memory_free_bytes.map(|b| b / MIB));
                set(&self.fb_used, &l, s.memory_used_bytes.map(|b| b / MIB));
                set(&self.fb_total, &l, s.memory_total_bytes.map(|b| b / MIB));
                set(&self.ecc_sbe, &l, s.ecc_corrected);
                set(&self.ecc_dbe, &l, s.ecc_uncorrected);
                set(&self.xid, &l, last_xid);
                now.insert(l);
            }
        }
        for gone in self.live.difference(&now) {
            for f in [
                &self.sm_clock,
                &self.mem_clock,
                &self.gpu_temp,
                &self.total_energy,
                &self.gpu_util,
                &self.mem_copy_util,
                &self.fb_free,
                &self.fb_used,
                &self.fb_total,
                &self.ecc_sbe,
                &self.ecc_dbe,
                &self.xid,
            ] {
                f.remove(gone);
            }
            self.power_usage.remove(gone);
        }
        self.live = now;
    }
}

fn set(f: &G, l: &DcgmLabels, v: Option<u64>) {
    match v {
        Some(v) => {
            f.get_or_create(l).set(i64::try_from(v).unwrap_or(i64::MAX));
        }
        None => {
            f.remove(l);
        }
    }
}
