//! gpuhub's own telemetry series, in base units (bytes, watts, joules, seconds, ratios),
//! registered once under the `gpuhub` prefix. Components keep cloned handles (`Arc` inside).
//!
//! Labels are bounded: GPU (index + UUID), XID code, live job and its user, Slurm state/
//! partition/user/account/reason. Series of a job that left a GPU are removed at the next
//! sample. The XID counter is the exception to "no ghosts": it stays when its GPU leaves
//! NVML's list, because XID 79 (fallen off the bus) is exactly what makes a GPU leave it.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

pub type GaugeF = Gauge<f64, AtomicU64>;
pub type CounterF = Counter<f64, AtomicU64>;

/// One GPU.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct GpuLabels {
    pub gpu: String,
    pub uuid: String,
}

/// One XID code on one GPU (`xid` is NVML's number, e.g. `79`; `999` when NVML does not know).
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct GpuXidLabels {
    pub gpu: String,
    pub uuid: String,
    pub xid: String,
}

/// One job on one GPU. The job label is `jobid` (as Princeton jobstats' cgroup exporter
/// names it), not `job`: Prometheus owns `job` (the scrape job) and would rename ours to
/// `exported_job`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct JobGpuLabels {
    pub gpu: String,
    pub uuid: String,
    pub jobid: String,
    pub user: String,
}

/// The NVML field that failed (`temp`, `power`, `procs`, ...).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabels {
    pub field: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct SlurmJobLabels {
    pub state: String,
    pub partition: String,
    pub user: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub state: AllocState,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum AllocState {
    #[allow(non_camel_case_types)]
    allocated,
    #[allow(non_camel_case_types)]
    idle,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

/// A node's state, with the admin's reason (`""` when none).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeStateLabels {
    pub node: String,
    pub state: String,
    pub reason: String,
}

/// A node's CPUs or memory, allocated or idle.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeAllocLabels {
    pub node: String,
    pub state: AllocState,
}

/// A live Slurm job on this node (`jobid`, not `job`: see [`JobGpuLabels`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SlurmLiveJobLabels {
    pub jobid: String,
    pub user: String,
    pub account: String,
    pub partition: String,
}

/// A caller of model workers: `gpuhub_inference_*_seconds_total`.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct InferenceLabels {
    pub user: String,
    pub app: String,
    pub model: String,
}

#[derive(Clone, Debug, Default, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct UserAccountLabels {
    pub user: String,
    pub account: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CommandLabels {
    pub command: String,
}

/// Handles to every gpuhub telemetry series.
#[derive(Clone, Debug, Default)]
pub struct GpuhubMetrics {
    pub nvml_up: Gauge,
    pub gpu_memory_used: Family<GpuLabels, Gauge>,
    pub gpu_memory_free: Family<GpuLabels, Gauge>,
    pub gpu_memory_total: Family<GpuLabels, Gauge>,
    pub gpu_memory_unattributed: Family<GpuLabels, Gauge>,
    pub gpu_power: Family<GpuLabels, GaugeF>,
    pub gpu_energy: Family<GpuLabels, CounterF>,
    pub gpu_utilization: Family<GpuLabels, GaugeF>,
    pub gpu_temperature: Family<GpuLabels, Gauge>,
    pub gpu_xid_errors: Family<GpuXidLabels, Counter>,
    pub job_gpu_memory_used: Family<JobGpuLabels, Gauge>,
    pub job_gpu_utilization: Family<JobGpuLabels, GaugeF>,
    pub job_gpu_energy: Family<JobGpuLabels, CounterF>,
    pub job_gpu_processes: Family<JobGpuLabels, Gauge>,
    pub job_gpu_shards: Family<JobGpuLabels, Gauge>,
    pub nvml_errors: Family<FieldLabels, Counter>,
    pub last_sample: GaugeF,
    pub sample_duration: GaugeF,
    pub slurm_up: Gauge,
    pub slurm_jobs: Family<SlurmJobLabels, Gauge>,
    pub slurm_gpus: Family<StateLabels, Gauge>,
    pub slurm_shards: Family<StateLabels, Gauge>,
    pub slurm_pending: Family<ReasonLabels, Gauge>,
    pub slurm_node_state: Family<NodeStateLabels, Gauge>,
    pub slurm_node_cpus: Family<NodeAllocLabels, Gauge>,
    pub slurm_node_memory: Family<NodeAllocLabels, Gauge>,
    pub slurm_job_gpus: Family<SlurmLiveJobLabels, Gauge>,
    pub slurm_job_shards: Family<SlurmLiveJobLabels, Gauge>,
    pub slurm_job_cpus: Family<SlurmLiveJobLabels, Gauge>,
    pub slurm_job_memory: Family<SlurmLiveJobLabels, Gauge>,
    pub slurm_command_errors: Family<CommandLabels, Counter>,
    pub slurm_last_snapshot: GaugeF,
}

impl GpuhubMetrics {
    /// Registers every series in `r` (the caller passes the `gpuhub`-prefixed sub-registry).
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        let watts = || Unit::Other("watts".into());
        r.register("nvml_up", "1 when the last GPU sample reached NVML, 0 without NVML or GPUs", m.nvml_up.clone());
        r.register_with_unit("gpu_memory_used", "VRAM in use on the GPU", Unit::Bytes, m.gpu_memory_used.clone());
        r.register_with_unit("gpu_memory_free", "VRAM free on the GPU", Unit::Bytes, m.gpu_memory_free.clone());
        r.register_with_unit("gpu_memory_total", "VRAM installed on the GPU", Unit::Bytes, m.gpu_memory_total.clone());
        r.register_with_unit(
            "gpu_memory_unattributed",
            "VRAM held by GPU processes that belong to no Slurm job (or vanished before attribution)",
            Unit::Bytes,
            m.gpu_memory_unattributed.clone(),
        );
        r.register_with_unit("gpu_power", "GPU power draw", watts(), m.gpu_power.clone());
        r.register_with_unit("gpu_energy", "GPU energy used since the agent started", Unit::Joules, m.gpu_energy.clone());
        r.register_with_unit("gpu_utilization", "GPU utilisation (0-1)", Unit::Other("ratio".into()), m.gpu_utilization.clone());
        r.register_with_unit("gpu_temperature", "GPU die temperature", Unit::Celsius, m.gpu_temperature.clone());
        r.register(
            "gpu_xid_errors",
            "XID error events NVML reported for the GPU, by XID code (kept after the GPU leaves NVML's list)",
            m.gpu_xid_errors.clone(),
        );
        r.register_with_unit(
            "job_gpu_memory_used",
            "VRAM held by the job's processes on the GPU",
            Unit::Bytes,
            m.job_gpu_memory_used.clone(),
        );
        r.register_with_unit(
            "job_gpu_utilization",
            "SM utilisation of the job's processes on the GPU (0-1); the GPU's own when the job is alone on it",
            Unit::Other("ratio".into()),
            m.job_gpu_utilization.clone(),
        );
        r.register_with_unit(
            "job_gpu_energy",
            "GPU energy attributed to the job (whole when alone on the GPU, split by utilisation when shared)",
            Unit::Joules,
            m.job_gpu_energy.clone(),
        );
        r.register("job_gpu_processes", "GPU processes of the job on the GPU", m.job_gpu_processes.clone());
        r.register("job_gpu_shards", "Slurm shards the job holds on the GPU (SLURM_SHARDS_ON_NODE)", m.job_gpu_shards.clone());
        r.register("telemetry_nvml_errors", "NVML field reads that failed (the field is skipped for that sample)", m.nvml_errors.clone());
        r.register_with_unit("telemetry_last_sample_timestamp", "Unix time of the last GPU sample", Unit::Seconds, m.last_sample.clone());
        r.register_with_unit("telemetry_sample_duration", "Time the last GPU sample took", Unit::Seconds, m.sample_duration.clone());
        r.register("slurm_up", "1 when the last Slurm snapshot succeeded", m.slurm_up.clone());
        r.register("slurm_jobs", "Slurm jobs by state, partition and user", m.slurm_jobs.clone());
        r.register("slurm_gpus", "Whole GPUs of this node allocated to jobs or idle", m.slurm_gpus.clone());
        r.register("slurm_shards", "GPU shards of this node allocated to jobs or idle", m.slurm_shards.clone());
        r.register("slurm_pending_jobs", "Pending Slurm jobs by reason", m.slurm_pending.clone());
        r.register(
            "slurm_node_state",
            "1 for the node's current state (idle, mixed, allocated, drained, draining, down, ...) and the admin's reason",
            m.slurm_node_state.clone(),
        );
        r.register("slurm_node_cpus", "CPUs of the node allocated to jobs or idle", m.slurm_node_cpus.clone());
        r.register_with_unit("slurm_node_memory", "Memory of the node allocated to jobs or idle", Unit::Bytes, m.slurm_node_memory.clone());
        r.register(
            "slurm_job_gpus",
            "Whole GPUs a running job holds on this node, from slurmctld (any request syntax: --gres, --gpus, --gpus-per-node, --gpus-per-task)",
            m.slurm_job_gpus.clone(),
        );
        r.register("slurm_job_shards", "GPU shards a running job holds on this node, from slurmctld", m.slurm_job_shards.clone());
        r.register("slurm_job_cpus", "CPUs allocated to a running job on this node (job-wide)", m.slurm_job_cpus.clone());
        r.register_with_unit(
            "slurm_job_memory",
            "Memory allocated to a running job on this node (job-wide)",
            Unit::Bytes,
            m.slurm_job_memory.clone(),
        );
        r.register("slurm_command_errors", "Slurm commands that failed or timed out", m.slurm_command_errors.clone());
        r.register_with_unit(
            "slurm_last_snapshot_timestamp",
            "Unix time of the last successful Slurm snapshot",
            Unit::Seconds,
            m.slurm_last_snapshot.clone(),
        );
        m
    }
}

/// Removes from `family` every label set in `before` that is not in `now` (no ghost series).
pub fn remove_stale<L, M, C>(family: &Family<L, M, C>, before: &HashSet<L>, now: &HashSet<L>)
where
    L: Clone + Hash + Eq,
    C: prometheus_client::metrics::family::MetricConstructor<M>,
{
    for gone in before.difference(now) {
        family.remove(gone);
    }
}
