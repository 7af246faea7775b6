//! Usage accounting: the plugin's spool into the store, exactly once; GPU-, shard- and
//! GPU-equivalent seconds per job, user, account, GPU and partition.
//!
//! Parts:
//! - [`ingest`]: the ingest task. Each pass reads `<spool_dir>/records/*.json` in name (=time)
//!   order. Per file, one transaction inserts the record under its stable id (a unique key, so
//!   a second insert is a no-op) and folds it into its job; only after the commit is the file
//!   removed. A crash between commit and removal re-reads the file, finds the id, and removes
//!   it: each record counts once. A file that does not parse moves to
//!   `<spool_dir>/quarantine/` with a `.reason` file beside it; nothing is deleted silently.
//! - [`db`]: the SQL (both backends; tables in `migrations/*/0002_accounting.sql`).
//! - [`usage`]: the arithmetic (pure, tested without a database).
//! - [`slurm`]: what Slurm says about a job (`scontrol show job -d -o`, `sacct`): parsers and
//!   the thin command layer.
//! - [`reconcile`]: the records checked against Slurm (Slurm wins), jobs created and closed
//!   from Slurm (the normal path with `accounting.job_boundaries = "slurm"`, an anomaly with
//!   `"prolog"`); a pure planner and the writes.
//! - [`job_map`]: the dcgm-exporter job map kept from slurmctld's allocations (`"slurm"`).
//! - [`api`]: control-socket routes `GET /v1/usage/gpu` and `GET /v1/jobs/{id}`; users see
//!   their own jobs (SO_PEERCRED uid), admins all.
//! - [`cli`]: `gpuhub usage` and `gpuhub job` output.
//! - [`inference`]: model worker jobs billed to the users and apps whose calls they served
//!   (split by the calls' busy time, stored once per job after it ended).
//! - [`usage_counters`]: the GPU-hours counters on `/metrics`, from the store (exact, monotone
//!   across restarts), and `gpuhub_store_up`.
//!
//! Bad input, each visible in the log and in `gpuhub_accounting_*` metrics: a corrupt record
//! (quarantined), a record naming a GPU NVML does not know (`unknown_gpu`, still accounted:
//! Slurm allocated it), an end before the start (`clock_backwards`, counted as zero time), an
//! end without a start (`end_without_start`, timed from the job's first record), a job whose
//! end record never came because the node rebooted (`never_ended`: closed at the agent's last
//! heartbeat before the boot, or at the boot time).

pub mod api;
pub mod cli;
pub mod db;
pub mod inference;
pub mod ingest;
pub mod job_map;
pub mod live_callers;
pub mod reconcile;
pub mod slurm;
pub mod usage;
pub mod usage_counters;

use std::collections::BTreeMap;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

use crate::telemetry::{JobGpuStats, Telemetry};

pub use ingest::Ingestor;
pub use usage::{UsageBy, UsageRow};

/// Something wrong with a job's records that accounting handled; stored in the job's
/// `anomalies` column, logged, and counted in `gpuhub_accounting_anomalies_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Anomaly {
    ClockBackwards,
    EndWithoutStart,
    UnknownGpu,
    NeverEnded,
    /// A record claimed GPUs, shards, user, account, partition or times Slurm contradicts.
    SlurmDisagrees,
    /// The job's end record never arrived; closed from Slurm.
    EndFromSlurm,
    /// The job's start record never arrived; filled in from Slurm.
    StartFromSlurm,
    /// Neither slurmctld nor sacct knows the job; its records stand unverified.
    Unverified,
    /// Slurm no longer knows when the job ended; closed at the last look that listed it.
    EndApproximate,
}

impl Anomaly {
    pub fn as_str(self) -> &'static str {
        match self {
            Anomaly::ClockBackwards => "clock_backwards",
            Anomaly::EndWithoutStart => "end_without_start",
            Anomaly::UnknownGpu => "unknown_gpu",
            Anomaly::NeverEnded => "never_ended",
            Anomaly::SlurmDisagrees => "slurm_disagrees",
            Anomaly::EndFromSlurm => "end_from_slurm",
            Anomaly::StartFromSlurm => "start_from_slurm",
            Anomaly::Unverified => "unverified",
            Anomaly::EndApproximate => "end_approximate",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Anomaly::ClockBackwards,
            Anomaly::EndWithoutStart,
            Anomaly::UnknownGpu,
            Anomaly::NeverEnded,
            Anomaly::SlurmDisagrees,
            Anomaly::EndFromSlurm,
            Anomaly::StartFromSlurm,
            Anomaly::Unverified,
            Anomaly::EndApproximate,
        ]
        .into_iter()
        .find(|a| a.as_str() == s)
    }

    /// What the admin reads in the log.
    pub fn explain(self) -> &'static str {
        match self {
            Anomaly::ClockBackwards => "its end is before its start (the clock went backwards); counted as zero time",
            Anomaly::EndWithoutStart => "an end record without a start record; timed from its first record",
            Anomaly::UnknownGpu => {
                "it names a GPU index/UUID NVML does not report; accounted as Slurm allocated it (check gres.conf against nvidia-smi)"
            }
            Anomaly::NeverEnded => "no end record before the node rebooted; closed at the agent's last heartbeat (or the boot time)",
            Anomaly::SlurmDisagrees => {
                "its records claim values Slurm's allocation contradicts; billed as Slurm allocated it (see the disagreements)"
            }
            Anomaly::EndFromSlurm => "end record never arrived; closed from Slurm (check that the epilog can write the spool)",
            Anomaly::StartFromSlurm => {
                "start record never arrived; filled in from Slurm (the spool was unwritable or the plugstack pointed elsewhere)"
            }
            Anomaly::Unverified => {
                "neither slurmctld nor sacct knows the job (MinJobAge passed and no slurmdbd?); billed from its records, unverified"
            }
            Anomaly::EndApproximate => {
                "Slurm no longer knows when it ended (slurmctld forgot it and sacct has no end: no slurmdbd?); closed at the last Slurm look that listed it"
            }
        }
    }
}

/// The GPUs as NVML sees them and what it measured per job; [`Telemetry`] in the agent, a
/// fixed table in tests.
pub trait GpuView: Send + Sync {
    /// GPU index -> UUID, or `None` when NVML is not available (then no GPU is "unknown").
    fn known_gpus(&self) -> Option<BTreeMap<u32, String>>;
    /// Per-GPU statistics of a job (empty when NVML never saw it).
    fn job_gpu_stats(&self, job_id: u32) -> Vec<JobGpuStats>;
}

impl GpuView for Telemetry {
    fn known_gpus(&self) -> Option<BTreeMap<u32, String>> {
        if !self.nvml_up() {
            return None;
        }
        Some(self.gpus().into_iter().map(|g| (g.index, g.uuid)).collect())
    }

    fn job_gpu_stats(&self, job_id: u32) -> Vec<JobGpuStats> {
        Telemetry::job_gpu_stats(self, job_id)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FieldLabels {
    pub field: String,
}

/// Accounting's series (register in the `gpuhub`-prefixed registry).
#[derive(Clone, Debug, Default)]
pub struct AccountingMetrics {
    pub ingested: Family<KindLabels, Counter>,
    pub duplicates: Counter,
    pub quarantined: Counter,
    pub anomalies: Family<KindLabels, Counter>,
    pub ingest_errors: Counter,
    pub backlog: Gauge,
    pub last_pass: Gauge<f64, std::sync::atomic::AtomicU64>,
    pub disagreements: Family<FieldLabels, Counter>,
    pub slurm_errors: Counter,
    pub usage: usage_counters::UsageCounterMetrics,
}

impl AccountingMetrics {
    pub fn register(r: &mut Registry) -> Self {
        let m = Self::default();
        r.register("accounting_records_ingested", "Usage records ingested from the spool, by kind", m.ingested.clone());
        r.register(
            "accounting_records_duplicate",
            "Spool files whose record was already stored (re-read after a crash); removed, not counted twice",
            m.duplicates.clone(),
        );
        r.register(
            "accounting_records_quarantined",
            "Spool files that could not be parsed, moved to <spool>/quarantine with a .reason file",
            m.quarantined.clone(),
        );
        r.register("accounting_anomalies", "Jobs with inconsistent records, by kind (see docs/accounting.md)", m.anomalies.clone());
        r.register(
            "accounting_slurm_disagreements",
            "Claims in usage records that Slurm's allocation contradicts, by field (billed as Slurm says; see gpuhub job)",
            m.disagreements.clone(),
        );
        // Every field a disagreement can name, at 0, so the series (and the alert on it) exist
        // before the first one.
        for field in reconcile::DISAGREEMENT_FIELDS {
            let _ = m.disagreements.get_or_create(&FieldLabels { field: (*field).to_string() });
        }
        r.register(
            "accounting_slurm_errors",
            "Looks at Slurm (scontrol/sacct) for accounting that failed or timed out (retried next interval)",
            m.slurm_errors.clone(),
        );
        r.register_with_unit(
            "slurm_gpu",
            "Whole-GPU seconds this node's jobs were allocated (Slurm's allocation, from the accounting store; running jobs up to now), by user and account",
            Unit::Seconds,
            m.usage.gpu_seconds.clone(),
        );
        r.register_with_unit(
            "slurm_shard",
            "GPU-shard seconds this node's jobs were allocated (from the accounting store), by user and account",
            Unit::Seconds,
            m.usage.shard_seconds.clone(),
        );
        r.register_with_unit(
            "inference_gpu",
            "Whole-GPU seconds of this node's model worker jobs, split among the users and apps whose calls they served (after each job ended)",
            Unit::Seconds,
            m.usage.inference_gpu_seconds.clone(),
        );
        r.register_with_unit(
            "inference_shard",
            "GPU-shard seconds of this node's model worker jobs, split among the users and apps whose calls they served (after each job ended)",
            Unit::Seconds,
            m.usage.inference_shard_seconds.clone(),
        );
        r.register("store_up", "1 when the last query of the store (every usage counter pass) answered", m.usage.store_up.clone());
        r.register("accounting_ingest_errors", "Ingest passes stopped by a store error (retried)", m.ingest_errors.clone());
        r.register("accounting_spool_backlog", "Record files waiting in the spool after the last pass", m.backlog.clone());
        r.register_with_unit(
            "accounting_last_pass_timestamp",
            "Unix time of the last completed ingest pass",
            Unit::Seconds,
            m.last_pass.clone(),
        );
        m
    }
}

#[cfg(test)]
mod tests;
