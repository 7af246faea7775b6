//! Usage records: what the plugin writes at job and step start/end, and the spool layout.
//!
//! Layout: one record per file under `<spool_dir>/records/`. The plugin writes
//! `.<name>.tmp`, `fsync`s it and renames it to `<name>.json` (see [`record_file_name`]), so
//! the agent never sees a partial record. The agent inserts each record keyed by
//! [`Record::record_id`] (a unique constraint makes a second insert a no-op), and only then
//! removes the file: a crash between the two re-ingests the file and the duplicate is ignored,
//! so each record counts exactly once. A file it cannot parse goes to `<spool_dir>/quarantine/`
//! with a `.reason` file beside it; nothing is deleted silently.
//!
//! Why both job and step records: the prolog/epilog (JOB_SCRIPT context) sees every job,
//! including allocations that never start a step, but sees a shard job as a one-GPU job (only
//! the GPU index). Steps (REMOTE context) see `SLURM_SHARDS_ON_NODE`. The agent joins them:
//! a job with any step record reporting shards is a shard job on that GPU.
//!
//! Trust: what a field is worth depends on the hook that wrote it.
//! - Job and step records alike: `job_id` and `uid` come from `spank_get_item` (`S_JOB_ID`,
//!   `S_JOB_UID`), `user` from the password database for that uid. Never from the environment.
//! - Job records (prolog/epilog): `account`, `partition`, `node`, `gpus` and `exit_code` come
//!   from the environment slurmd builds for the prolog as root, which users cannot write.
//! - Step records (slurmstepd): `account` and `partition` are `None` and `node` is the one
//!   slurmd gave slurmstepd (`""` when unknown): the step's environment is the user's. `gpus`
//!   and `shards` are what the step's environment *claims* (see the fields): hints only.
//!
//! Every string is bounded (`crate::bounds`): a value over its cap or with a control character
//! is recorded as unknown (`None`, `""` or an empty list), never raw.

use serde::{Deserialize, Serialize};

/// Directory (inside the spool dir) that holds committed records.
pub const RECORDS_DIR: &str = "records";
/// Directory (inside the spool dir) for records the agent could not parse.
pub const QUARANTINE_DIR: &str = "quarantine";
/// Current record schema version.
pub const RECORD_VERSION: u32 = 1;
/// Most GPUs one record may list (a node has far fewer).
pub const MAX_GPUS: usize = 64;

/// One GPU held by a job or step: its node-global index (from `SLURM_JOB_GPUS` /
/// `SLURM_STEP_GPUS`, never the renumbered `CUDA_VISIBLE_DEVICES`) and its UUID when known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRef {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

/// Who and where: the fields every record carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobIdentity {
    pub job_id: u32,
    pub uid: u32,
    /// The uid's name in the node's password database; empty when it has none (or the name
    /// breaks `crate::bounds`).
    pub user: String,
    /// Slurm account, from the prolog's environment; `None` in step records and when unknown
    /// (the agent fills it from slurmctld).
    pub account: Option<String>,
    /// Partition, from the prolog's environment; `None` in step records and when unknown
    /// (the agent fills it from slurmctld).
    pub partition: Option<String>,
    /// Slurm node name as slurmd knows it (`SLURMD_NODENAME` of the prolog or of slurmstepd's
    /// own environment, never the step's); `""` when unknown (the agent fills it).
    pub node: String,
}

/// A usage record. `time_us` is the wall-clock time (Unix microseconds) at the hook.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// `job_prolog`: the allocation started on this node with these GPUs.
    JobStart {
        v: u32,
        time_us: i64,
        #[serde(flatten)]
        job: JobIdentity,
        gpus: Vec<GpuRef>,
    },
    /// `job_epilog`: the allocation ended on this node (also after `scancel` or a time limit).
    JobEnd {
        v: u32,
        time_us: i64,
        #[serde(flatten)]
        job: JobIdentity,
        /// `SLURM_JOB_EXIT_CODE` (raw wait status) when Slurm set it.
        exit_code: Option<i32>,
        gpus: Vec<GpuRef>,
    },
    /// A step started (REMOTE `init_post_opt`, root): the only place the shard count is visible.
    StepStart {
        v: u32,
        time_us: i64,
        #[serde(flatten)]
        job: JobIdentity,
        step_id: u32,
        /// The GPUs the step's environment claims (`SLURM_STEP_GPUS`, else `SLURM_JOB_GPUS`).
        /// **Unverified**: a user can pre-set these variables before `srun`/`sbatch`, so this
        /// is a hint; the agent takes the GPUs from Slurm's allocation (job records, slurmctld)
        /// and counts a disagreement.
        gpus: Vec<GpuRef>,
        /// `SLURM_SHARDS_ON_NODE` as the step's environment claims it: shards of the GPU(s)
        /// above held by this step's job. **Unverified** for the same reason as `gpus`: a hint
        /// that Slurm's allocation overrides.
        shards: Option<u32>,
    },
    /// A step ended (REMOTE `exit`, root).
    StepEnd {
        v: u32,
        time_us: i64,
        #[serde(flatten)]
        job: JobIdentity,
        step_id: u32,
        /// Last task exit status seen (raw wait status).
        exit_status: Option<i32>,
    },
}

impl Record {
    pub fn job(&self) -> &JobIdentity {
        match self {
            Record::JobStart { job, .. } | Record::JobEnd { job, .. } | Record::StepStart { job, .. } | Record::StepEnd { job, .. } => job,
        }
    }

    pub fn time_us(&self) -> i64 {
        match self {
            Record::JobStart { time_us, .. }
            | Record::JobEnd { time_us, .. }
            | Record::StepStart { time_us, .. }
            | Record::StepEnd { time_us, .. } => *time_us,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Record::JobStart { .. } => "job_start",
            Record::JobEnd { .. } => "job_end",
            Record::StepStart { .. } => "step_start",
            Record::StepEnd { .. } => "step_end",
        }
    }

    /// What happened to which job or step on which node: `node:job:kind` or
    /// `node:job.step:kind`. A job Slurm requeues starts (and ends) again under the same event:
    /// its runs differ only in time, so this is not unique; [`Record::record_id`] is.
    pub fn event(&self) -> String {
        let job = self.job();
        match self {
            Record::JobStart { .. } | Record::JobEnd { .. } => format!("{}:{}:{}", job.node, job.job_id, self.kind()),
            Record::StepStart { step_id, .. } | Record::StepEnd { step_id, .. } => {
                format!("{}:{}.{}:{}", job.node, job.job_id, step_id, self.kind())
            }
        }
    }

    /// Identity of the record, stable across re-ingestion (a file re-read after a crash):
    /// the event and its time, since a requeued job's next run repeats the event.
    pub fn record_id(&self) -> String {
        format!("{}@{}", self.event(), self.time_us())
    }

    pub fn to_json(&self) -> String {
        // Serialising these plain structs cannot fail (no maps with non-string keys).
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let rec: Record = serde_json::from_slice(bytes).map_err(|e| format!("not a gpuhub usage record: {e}"))?;
        let v = match &rec {
            Record::JobStart { v, .. } | Record::JobEnd { v, .. } | Record::StepStart { v, .. } | Record::StepEnd { v, .. } => *v,
        };
        if v != RECORD_VERSION {
            return Err(format!("record version {v} is not supported (expected {RECORD_VERSION})"));
        }
        rec.check_bounds()?;
        Ok(rec)
    }

    /// Every string within `crate::bounds` and at most [`MAX_GPUS`] GPUs: what the plugin
    /// writes always is; a hand-made or corrupted file may not be, and must not reach a row, a
    /// label or an index (PostgreSQL refuses index entries over ~2.7 KB).
    pub fn check_bounds(&self) -> Result<(), String> {
        use crate::bounds::{MAX_FIELD_BYTES, MAX_USER_BYTES, check};
        let field = |name: &str, value: &str, cap: usize| check(value, cap).map_err(|r| format!("field `{name}` {r}"));
        let job = self.job();
        field("user", &job.user, MAX_USER_BYTES)?;
        field("node", &job.node, MAX_FIELD_BYTES)?;
        if let Some(a) = &job.account {
            field("account", a, MAX_FIELD_BYTES)?;
        }
        if let Some(p) = &job.partition {
            field("partition", p, MAX_FIELD_BYTES)?;
        }
        let gpus = match self {
            Record::JobStart { gpus, .. } | Record::JobEnd { gpus, .. } | Record::StepStart { gpus, .. } => gpus.as_slice(),
            Record::StepEnd { .. } => &[],
        };
        if gpus.len() > MAX_GPUS {
            return Err(format!("field `gpus` lists {} GPUs, over the limit of {MAX_GPUS}", gpus.len()));
        }
        for g in gpus {
            if let Some(u) = &g.uuid {
                field("gpus[].uuid", u, MAX_FIELD_BYTES)?;
            }
        }
        Ok(())
    }
}

/// File name of a committed record: sortable by time, unique per event and writer.
pub fn record_file_name(rec: &Record, pid: u32) -> String {
    let id = rec.event().replace([':', '/'], "_");
    format!("{:020}-{id}-{pid}.json", rec.time_us().max(0))
}

/// Parses Slurm's GPU index lists: `0`, `0,1`, `0-3`, `0-1,3`. Unparseable parts are skipped.
pub fn parse_index_list(s: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>())
                    && a <= b
                    && b - a < 1024
                {
                    out.extend(a..=b);
                }
            }
            None => {
                if let Ok(i) = part.parse() {
                    out.push(i);
                }
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident() -> JobIdentity {
        JobIdentity { job_id: 42, uid: 1000, user: "alice".into(), account: None, partition: Some("gpu".into()), node: "gpu01".into() }
    }

    #[test]
    fn records_round_trip_and_have_stable_ids() {
        let rec =
            Record::StepStart { v: 1, time_us: 5, job: ident(), step_id: 0, gpus: vec![GpuRef { index: 1, uuid: None }], shards: Some(7) };
        let json = rec.to_json();
        assert!(json.contains(r#""kind":"step_start""#), "{json}");
        assert_eq!(Record::parse(json.as_bytes()).unwrap(), rec);
        assert_eq!(rec.record_id(), "gpu01:42.0:step_start@5");
        // A requeued job's next run repeats the event at another time: another record.
        let Record::StepStart { v, job, step_id, gpus, shards, .. } = rec.clone() else { unreachable!() };
        let again = Record::StepStart { v, time_us: 6, job, step_id, gpus, shards };
        assert_eq!(again.event(), rec.event());
        assert_ne!(again.record_id(), rec.record_id());
        assert!(record_file_name(&rec, 9).ends_with("-gpu01_42.0_step_start-9.json"));
    }

    #[test]
    fn out_of_bounds_fields_are_refused_naming_the_field_not_the_value() {
        let with = |f: &dyn Fn(&mut JobIdentity)| {
            let mut job = ident();
            f(&mut job);
            Record::StepEnd { v: 1, time_us: 5, job, step_id: 0, exit_status: None }.to_json()
        };
        let e = Record::parse(with(&|j| j.user = "u".repeat(3 * 1024)).as_bytes()).unwrap_err();
        assert_eq!(e, "field `user` is 3072 bytes long, over the 64-byte limit");
        let e = Record::parse(with(&|j| j.account = Some("evil\nroot".into())).as_bytes()).unwrap_err();
        assert_eq!(e, "field `account` holds a control character at byte 4");
        assert!(Record::parse(with(&|j| j.node = "n".repeat(257)).as_bytes()).unwrap_err().starts_with("field `node`"));
        let many: Vec<GpuRef> = (0..65).map(|index| GpuRef { index, uuid: None }).collect();
        let rec = Record::StepStart { v: 1, time_us: 5, job: ident(), step_id: 0, gpus: many, shards: None };
        assert!(Record::parse(rec.to_json().as_bytes()).unwrap_err().contains("65 GPUs"));
        let rec = Record::JobStart { v: 1, time_us: 5, job: ident(), gpus: vec![GpuRef { index: 0, uuid: Some("G\u{1b}".into()) }] };
        assert!(Record::parse(rec.to_json().as_bytes()).unwrap_err().starts_with("field `gpus[].uuid`"));
        assert!(Record::parse(with(&|j| j.user = "john.doe".into()).as_bytes()).is_ok());
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(Record::parse(b"{\"kind\":\"job_start\"").is_err());
        assert!(Record::parse(b"\xff\xfe").is_err());
    }

    #[test]
    fn index_lists() {
        assert_eq!(parse_index_list("0"), vec![0]);
        assert_eq!(parse_index_list("0,1"), vec![0, 1]);
        assert_eq!(parse_index_list("0-3"), vec![0, 1, 2, 3]);
        assert_eq!(parse_index_list("1,0-1,x"), vec![0, 1]);
        assert_eq!(parse_index_list(""), Vec::<u32>::new());
    }
}
