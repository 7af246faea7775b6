//! The agent's records reconciled with Slurm's, and Slurm wins.
//!
//! The plugin's step records carry what a job's environment says (GPUs, shards, account,
//! partition), which the user can pre-set; only the job id, the uid and the prolog/epilog's
//! JobStart/JobEnd times are trusted. So:
//!
//! 1. **Verification.** A job first seen in the spool is looked up in slurmctld (one
//!    `scontrol show job -d -o` per ingest pass, [`super::slurm`]), else in sacct (counts, no
//!    GPU indices), and its allocation on this node becomes what is billed: GPU indices and
//!    shards per GPU, user and uid, account, partition, Slurm's start/end. Each claim that
//!    differs is a [`Disagreement`] (stored, shown by `gpuhub job`, counted in
//!    `gpuhub_accounting_slurm_disagreements_total{field}`). A job neither knows stays on its
//!    records, marked `unverified`.
//! 2. **Reconciliation** ([`plan`], every `accounting.reconcile_interval_ms`, default
//!    `telemetry.slurm_interval_ms`): a job open in the store that slurmctld no longer lists as
//!    running on this node is closed (end from slurmctld's or sacct's EndTime, else the last
//!    snapshot that listed it); a job Slurm lists on this node since the agent started watching
//!    that the store lacks is created from Slurm. Slurm is looked at *before* the spool pass
//!    of the same tick, so a job missing from the look had finished its epilog (and written its
//!    end record) before the pass read the spool.
//! 3. **Late records** fold into the same row (idempotent); their times are used only within
//!    Slurm's `[start, end]` (± [`TIME_TOLERANCE_US`]), else Slurm's.
//!
//! [`plan`] is pure (a [`SlurmState`] in, actions out); the `apply_*` functions write them.

use std::collections::{BTreeMap, BTreeSet};

use gpuhub_wire::spool::Record;
use sqlx::{Any, AnyPool, Transaction};

use super::Anomaly;
use super::db::{self, GPU_COLS, JOB_COLS, JobGpuRow, JobRow};
use super::slurm::{Alloc, SlurmJob, SlurmState, Source, expand_hostlist, is_finished, is_live};
use crate::config::JobBoundaries;
use crate::telemetry::JobGpuStats;

/// Slurm keeps whole seconds and the prolog/epilog run just after its start/end: a record's
/// time within this of Slurm's bounds is the record's.
pub const TIME_TOLERANCE_US: i64 = 2_000_000;

/// A claim in the records that Slurm's allocation contradicts.
/// Every `field` a [`Disagreement`] names (the `field` label of
/// `gpuhub_accounting_slurm_disagreements_total`).
pub const DISAGREEMENT_FIELDS: &[&str] = &["uid", "user", "account", "partition", "gpus", "gpu_indices", "shards", "start", "end"];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement {
    /// `uid`, `user`, `account`, `partition`, `gpus`, `gpu_indices`, `shards`, `node`, `start`, `end`.
    pub field: &'static str,
    pub claimed: String,
    pub slurm: String,
    /// The value billed (Slurm's).
    pub used: String,
}

fn dis(field: &'static str, claimed: impl ToString, slurm: impl ToString) -> Disagreement {
    let slurm = slurm.to_string();
    Disagreement { field, claimed: claimed.to_string(), used: slurm.clone(), slurm }
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_else(|| "(none)".into())
}

fn set_str(s: &BTreeSet<u32>) -> String {
    if s.is_empty() {
        return "(none)".into();
    }
    s.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Whole GPUs and shards as the records alone would bill them (no Slurm): a job with a shard
/// count holds shards on its GPU, else its GPUs.
pub fn claimed_billing(row: &JobRow, gpus: &[JobGpuRow]) -> (i64, i64) {
    if row.shards > 0 { (0, if gpus.is_empty() { 0 } else { row.shards }) } else { (gpus.len() as i64, 0) }
}

/// The time a record's start/end is billed at on a verified job.
pub fn bounded_time(t: i64, slurm_own: Option<i64>, lo: Option<i64>, hi: Option<i64>) -> i64 {
    let within = lo.is_none_or(|l| t >= l - TIME_TOLERANCE_US) && hi.is_none_or(|h| t <= h + TIME_TOLERANCE_US);
    if within { t } else { slurm_own.unwrap_or(t) }
}

fn fmt_us(t: i64) -> String {
    format!("{:.3}", t as f64 / 1e6)
}

/// Applies Slurm's view of a job to its row and GPU rows; returns what the records claimed
/// differently. `alloc` is what the job holds on this node.
pub fn verify(row: &mut JobRow, gpus: &mut Vec<JobGpuRow>, sj: &SlurmJob, alloc: &Alloc) -> Vec<Disagreement> {
    let mut d = Vec::new();
    if let Some(uid) = sj.uid
        && i64::from(uid) != row.uid
    {
        d.push(dis("uid", row.uid, uid));
        row.uid = i64::from(uid);
    }
    if !sj.user.is_empty() {
        if !row.user_name.is_empty() && row.user_name != sj.user {
            d.push(dis("user", &row.user_name, &sj.user));
        }
        row.user_name = sj.user.clone();
    }
    let claimed = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if let Some(c) = claimed(&row.account)
        && Some(&c) != sj.account.as_ref()
    {
        d.push(dis("account", c, opt(&sj.account)));
    }
    row.account = sj.account.clone();
    if let Some(c) = claimed(&row.partition)
        && Some(&c) != sj.partition.as_ref()
    {
        d.push(dis("partition", c, opt(&sj.partition)));
    }
    row.partition = sj.partition.clone();

    let has_claims = !gpus.is_empty() || row.shards > 0;
    let (cg, cs) = claimed_billing(row, gpus);
    // Claims are compared once, when Slurm's allocation first replaces them (also for a job
    // marked `unverified` at a look that did not list it yet).
    if has_claims && !row.is_verified() {
        if cg != i64::from(alloc.gpus) {
            d.push(dis("gpus", cg, alloc.gpus));
        }
        if cs != i64::from(alloc.shards) {
            d.push(dis("shards", cs, alloc.shards));
        }
    }
    if let Some(na) = &alloc.indices {
        let slurm_set: BTreeSet<u32> = na.gpus.iter().copied().chain(na.shards.keys().copied()).collect();
        let claimed_set: BTreeSet<u32> = gpus.iter().filter_map(|g| u32::try_from(g.gpu_index).ok()).collect();
        if !claimed_set.is_empty() && claimed_set != slurm_set {
            d.push(dis("gpu_indices", set_str(&claimed_set), set_str(&slurm_set)));
        }
        let old: BTreeMap<i64, JobGpuRow> = gpus.drain(..).map(|g| (g.gpu_index, g)).collect();
        for i in slurm_set {
            let idx = i64::from(i);
            let mut g = old.get(&idx).cloned().unwrap_or(JobGpuRow {
                node: row.node.clone(),
                job_id: row.job_id,
                run: row.run,
                gpu_index: idx,
                gpu_uuid: None,
                mean_util: None,
                peak_vram_bytes: None,
                energy_joules: None,
                samples: None,
                shards: None,
            });
            g.shards = Some(i64::from(na.shards.get(&i).copied().unwrap_or(0)));
            gpus.push(g);
        }
    }
    row.slurm_gpus = Some(i64::from(alloc.gpus));
    row.shards = i64::from(alloc.shards);
    row.verified = sj.source.as_str().to_string();
    row.slurm_start_us = sj.start_us;
    row.slurm_end_us = if is_finished(&sj.state) { sj.end_us } else { None };
    let (lo, hi) = (row.slurm_start_us, row.slurm_end_us);
    match row.start_us {
        Some(s) => {
            let u = bounded_time(s, lo, lo, hi);
            if u != s {
                d.push(Disagreement { field: "start", claimed: fmt_us(s), slurm: opt(&lo.map(fmt_us)), used: fmt_us(u) });
                row.start_us = Some(u);
            }
        }
        None => row.start_us = lo,
    }
    if let Some(e) = row.end_us {
        let u = bounded_time(e, hi, lo, hi);
        if u != e {
            d.push(Disagreement { field: "end", claimed: fmt_us(e), slurm: opt(&hi.map(fmt_us)), used: fmt_us(u) });
            row.end_us = Some(u);
        }
    }
    d
}

/// Compares a new record's claims with a verified job (nothing of the record is applied but
/// its times, which the caller bounds).
pub fn check_claims(row: &JobRow, gpus: &[JobGpuRow], rec: &Record) -> Vec<Disagreement> {
    let mut d = Vec::new();
    let id = rec.job();
    if i64::from(id.uid) != row.uid {
        d.push(dis("uid", id.uid, row.uid));
    }
    if !id.user.is_empty() && id.user != row.user_name {
        d.push(dis("user", &id.user, &row.user_name));
    }
    if let Some(a) = id.account.as_ref().filter(|a| !a.is_empty())
        && Some(a) != row.account.as_ref()
    {
        d.push(dis("account", a, opt(&row.account)));
    }
    if let Some(p) = id.partition.as_ref().filter(|p| !p.is_empty())
        && Some(p) != row.partition.as_ref()
    {
        d.push(dis("partition", p, opt(&row.partition)));
    }
    let indexed = !gpus.is_empty() && gpus.iter().all(|g| g.shards.is_some());
    let slurm_set: BTreeSet<u32> = gpus.iter().filter_map(|g| u32::try_from(g.gpu_index).ok()).collect();
    let slurm_gpus = row.slurm_gpus.unwrap_or(0);
    let (claim, is_job_record) = match rec {
        Record::JobStart { gpus, .. } | Record::JobEnd { gpus, .. } => (gpus.as_slice(), true),
        Record::StepStart { gpus, .. } => (gpus.as_slice(), false),
        Record::StepEnd { .. } => (&[][..], false),
    };
    let claim_set: BTreeSet<u32> = claim.iter().map(|g| g.index).collect();
    if indexed {
        let bad = if is_job_record { !claim_set.is_empty() && claim_set != slurm_set } else { !claim_set.is_subset(&slurm_set) };
        if bad {
            d.push(dis("gpu_indices", set_str(&claim_set), set_str(&slurm_set)));
        }
    } else if row.shards == 0 {
        let n = claim_set.len() as i64;
        if (is_job_record && !claim_set.is_empty() && n != slurm_gpus) || (!is_job_record && n > slurm_gpus) {
            d.push(dis("gpus", n, slurm_gpus));
        }
    }
    if let Record::StepStart { shards: Some(n), .. } = rec
        && i64::from(*n) != row.shards
    {
        d.push(dis("shards", n, row.shards));
    }
    d
}

/// What to do after a look at Slurm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Apply Slurm's allocation to a job (run) not verified yet.
    Verify { node: String, job_id: u32, run: i64, job: SlurmJob, alloc: Alloc },
    /// Neither slurmctld nor sacct knows the job: its records stand.
    Unverified { node: String, job_id: u32, run: i64 },
    /// An open job Slurm no longer runs here: close it at `end_us` (`exact`: Slurm's own end
    /// time; else the last or first look with or without it).
    Close { node: String, job_id: u32, run: i64, end_us: i64, how: String, exact: bool, job: Option<(SlurmJob, Alloc)> },
    /// A job (or a requeued job's next run) Slurm ran here that the store lacks.
    Create { node: String, job: SlurmJob, alloc: Alloc },
}

/// The latest run the store has of a job on this node, for [`plan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatestRun {
    /// When it started (Slurm's start when verified, else its record's or first sighting).
    pub start_us: i64,
    pub ended: bool,
}

impl LatestRun {
    pub(crate) fn of(row: &JobRow) -> Self {
        Self::from_times(row.slurm_start_us, row.start_us, row.first_seen_us, row.end_us)
    }

    fn from_times(slurm_start_us: Option<i64>, start_us: Option<i64>, first_seen_us: i64, end_us: Option<i64>) -> Self {
        LatestRun { start_us: slurm_start_us.or(start_us).unwrap_or(first_seen_us), ended: end_us.is_some() }
    }

    /// Slurm's job (started at `start_us`) is a later run than this one: Slurm requeued it
    /// after this run ended (each run has its own StartTime).
    pub fn is_before(&self, start_us: i64) -> bool {
        self.ended && start_us > self.start_us + TIME_TOLERANCE_US
    }
}

/// What [`plan`] looks at besides Slurm.
#[derive(Debug, Clone)]
pub struct Inputs<'a> {
    /// This node's names (configured, and those its records carry).
    pub nodes: &'a BTreeSet<String>,
    /// The node column of jobs created from Slurm, unless the job ran on another of `nodes`
    /// (the name this node's records carry).
    pub default_node: &'a str,
    /// Jobs not verified yet (`verified = ''`).
    pub unverified: &'a [JobRow],
    /// Jobs of this node with no end.
    pub open: &'a [JobRow],
    /// The latest run the store has of each job of this node (among Slurm's candidates).
    pub known: &'a BTreeMap<u32, LatestRun>,
    /// Jobs that started before this are not created from Slurm (the agent was not watching).
    pub watch_since_us: i64,
    /// Job id -> the last look that listed it live on this node.
    pub last_listed: &'a BTreeMap<u32, i64>,
    /// Close and create (a reconciliation tick), or verify only (an ingest pass).
    pub reconcile: bool,
    /// A job must have started this long before the look to be closed or created (its records
    /// may still be on the way).
    pub grace_us: i64,
    /// Job ends come from Slurm (`accounting.job_boundaries = "slurm"`): a verified job of
    /// `open` that Slurm says has ended (slurmctld's EndTime or sacct's End of this run) is
    /// closed at once, within the grace and on an ingest pass too. With the job-hooks build its
    /// JobEnd record closes it.
    pub close_ended: bool,
}

/// Decides, from one look at Slurm, what to change in the store. Pure.
pub fn plan(inp: &Inputs<'_>, st: &SlurmState) -> Vec<Action> {
    let mut out = Vec::new();
    let nodes_of = |row: &JobRow| {
        let mut n = inp.nodes.clone();
        n.insert(row.node.clone());
        n
    };
    let mut handled = BTreeSet::new();
    if (inp.reconcile || inp.close_ended) && st.ctld_ok {
        for row in inp.open {
            let Ok(id) = u32::try_from(row.job_id) else { continue };
            let start = row.start_us.unwrap_or(row.first_seen_us);
            let nodes = nodes_of(row);
            let ctld = st.ctld.get(&id);
            // A finished job's EndTime is this run's only if that run is this one (requeued, the
            // job may have run again, here or on another node).
            let ended_here = |j: &&SlurmJob| is_finished(&j.state) && is_this_run(j, row, &nodes);
            let acct_end = st.acct.get(&id).filter(ended_here).and_then(|j| j.end_us);
            // Listed on a line not used (a job name or comment that imitates scontrol's fields):
            // slurmctld still knows the job, and only sacct can say it ended.
            if ctld.is_some_and(|j| is_live(&j.state) && j.on_any(&nodes)) || (st.ctld_unsure.contains(&id) && acct_end.is_none()) {
                continue;
            }
            let said = if let Some(e) = ctld.filter(ended_here).and_then(|j| j.end_us) {
                Some((e, "slurmctld's EndTime"))
            } else if let Some(e) = acct_end {
                Some((e, "sacct's End"))
            } else {
                ended_run(st, id, row, &nodes).and_then(|r| r.end_us).map(|e| (e, "sacct's End of this run (Slurm requeued the job)"))
            };
            // Slurm's word that it ended closes a job at once when it is this run's: the job is
            // verified (its run pinned to Slurm's start: a requeued job's earlier end is not its
            // end), or slurmctld's record, from a look taken after this run began, started no
            // later than it (then it is this run: slurmctld describes a job's latest run). Else
            // a job is closed on a reconciliation tick only, once older than the grace (a look
            // may predate it).
            let pinned = row.slurm_start_us.is_some() || (st.taken_us > run_start(row) && ctld.is_some_and(|j| describes_run(j, row)));
            let at_once = inp.close_ended && said.is_some() && pinned;
            if !at_once && (!inp.reconcile || start >= st.taken_us - inp.grace_us) {
                continue;
            }
            let (end, how, exact) = if let Some((e, how)) = said {
                (e, how, true)
            } else if let Some(t) = inp.last_listed.get(&id) {
                (*t, "the last Slurm snapshot that listed it", false)
            } else if row.last_seen_us > start {
                // Listed before this agent started (the listing is kept on the row), or a
                // record after its start: not the time the agent was down.
                (row.last_seen_us, "the last Slurm snapshot or record that showed it running, before the agent restarted", false)
            } else {
                (st.taken_us, "the first Slurm snapshot without it (the agent never saw it running)", false)
            };
            let record = st.job(id).filter(|j| is_this_run(j, row, &nodes)).or_else(|| ended_run(st, id, row, &nodes));
            let job = record.and_then(|j| j.alloc_on(&nodes).map(|a| (j.clone(), a)));
            handled.insert(id);
            out.push(Action::Close {
                node: row.node.clone(),
                job_id: id,
                run: row.run,
                end_us: end.max(start),
                how: how.into(),
                exact,
                job,
            });
        }
    }
    for row in inp.unverified {
        let Ok(id) = u32::try_from(row.job_id) else { continue };
        if handled.contains(&id) {
            continue;
        }
        match st.job(id) {
            Some(j) if j.node_list.is_empty() => {}
            // slurmdbd's record of a job that just started can lack its allocation (an empty
            // partition, no TRES, uid 0 seen on the lab): a live job slurmctld knows but whose
            // line was not used is verified from sacct once it has ended.
            Some(j) if st.ctld_unsure.contains(&id) && !is_finished(&j.state) => {}
            Some(j) if j.source == Source::Sacct && (j.partition.is_none() || j.cpus == 0) => {}
            // Slurm describes a later run of a requeued job: nothing to verify this run by.
            Some(j) if j.start_us.is_some_and(|s| LatestRun::of(row).is_before(s)) => {}
            Some(j) => {
                // Slurm describes another run (requeued: running or ended on another node):
                // this run is verified by its own line of sacct --duplicates when it has one.
                let nodes = nodes_of(row);
                let j = if is_this_run(j, row, &nodes) {
                    j
                } else if let Some(run) = ended_run(st, id, row, &nodes) {
                    run
                } else if st.acct_ok && !j.on_any(&nodes) {
                    // A run on other nodes, and sacct answers: this run's own line is awaited
                    // (slurmdbd may list it a look after the requeue). Taking the later run's
                    // record for it would close this run at the later run's end when the two
                    // started within TIME_TOLERANCE_US of each other.
                    continue;
                } else {
                    j
                };
                let alloc = j.alloc_on(&nodes).unwrap_or(Alloc { gpus: 0, shards: 0, indices: None });
                out.push(Action::Verify { node: row.node.clone(), job_id: id, run: row.run, job: j.clone(), alloc });
            }
            // A job scontrol listed on a line not used is known to slurmctld: not unverified;
            // nor is a job a look older than its first record could not know (a reconciliation's
            // look is taken before the pass, or is the telemetry sampler's): the next look tells.
            None if st.ctld_ok && st.acct_ok && !st.ctld_unsure.contains(&id) && st.taken_us > run_start(row) => {
                out.push(Action::Unverified { node: row.node.clone(), job_id: id, run: row.run })
            }
            None => {}
        }
    }
    if inp.reconcile && st.ctld_ok {
        let mut seen = BTreeSet::new();
        for j in st.ctld.values().chain(st.acct.values()) {
            if !seen.insert(j.job_id) || !(is_live(&j.state) || is_finished(&j.state)) {
                continue;
            }
            let Some(start) = j.start_us else { continue };
            if inp.known.get(&j.job_id).is_some_and(|run| !run.is_before(start)) {
                continue;
            }
            // Slurm's times are whole seconds: a job that started in the second the agent began
            // watching has a StartTime before that instant, and it is still this agent's.
            let watch_since = inp.watch_since_us - inp.watch_since_us.rem_euclid(1_000_000);
            if start < watch_since || start >= st.taken_us - inp.grace_us {
                continue;
            }
            if let Some(alloc) = j.alloc_on(inp.nodes) {
                // Under the name its records would carry (the spool's), so a late record
                // folds into this row.
                let ran_on: BTreeSet<String> =
                    j.per_node.keys().chain(std::iter::once(&j.node_list)).flat_map(|l| expand_hostlist(l)).collect();
                let node = inp
                    .nodes
                    .iter()
                    .filter(|n| ran_on.contains(*n))
                    .find(|n| n.as_str() != inp.default_node)
                    .map_or(inp.default_node, String::as_str);
                out.push(Action::Create { node: node.to_string(), job: j.clone(), alloc });
            }
        }
    }
    out
}

/// When the run `row` started: Slurm's start once verified, else its records' (which follow
/// Slurm's), else its first sighting.
fn run_start(row: &JobRow) -> i64 {
    row.slurm_start_us.or(row.start_us).unwrap_or(row.first_seen_us)
}

/// Slurm's record `j` is of the run `row` on `nodes`: it ran there and, once the run has
/// Slurm's own start to compare with (the node's clock is not slurmctld's), did not start
/// after it (a requeued job's later run has its own, later StartTime).
fn is_this_run(j: &SlurmJob, row: &JobRow, nodes: &BTreeSet<String>) -> bool {
    j.on_any(nodes) && row.slurm_start_us.zip(j.start_us).is_none_or(|(run, s)| s <= run + TIME_TOLERANCE_US)
}

/// Slurm's record `j` did not start after the run `row` (by its own start, or its first
/// record's time): a requeued job's later run starts after it.
fn describes_run(j: &SlurmJob, row: &JobRow) -> bool {
    j.start_us.is_some_and(|s| s <= run_start(row) + TIME_TOLERANCE_US)
}

/// The run `row` of a job Slurm requeued, as sacct --duplicates lists it ended: the latest
/// ended run on `nodes` that started by the time `row` did.
fn ended_run<'a>(st: &'a SlurmState, id: u32, row: &JobRow, nodes: &BTreeSet<String>) -> Option<&'a SlurmJob> {
    let start = run_start(row);
    st.ended_runs
        .get(&id)?
        .iter()
        .filter(|r| r.on_any(nodes) && r.start_us.is_some_and(|s| s <= start + TIME_TOLERANCE_US))
        .max_by_key(|r| r.start_us)
}

/// Job ids slurmctld lists live on `nodes` (for `last_listed`), and those it lists on lines
/// not used (taken as live: one closed without sacct ends at its last listing, not earlier).
pub fn listed_live(st: &SlurmState, nodes: &BTreeSet<String>) -> Vec<u32> {
    st.ctld.values().filter(|j| is_live(&j.state) && j.on_any(nodes)).map(|j| j.job_id).chain(st.ctld_unsure.iter().copied()).collect()
}

/// What applying an action changed, for the log and the metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub anomalies: Vec<Anomaly>,
    /// Disagreements stored for the first time (per job and field).
    pub disagreements: Vec<Disagreement>,
}

/// A run of a job with its GPUs; `run: None`, its latest run.
async fn load(
    tx: &mut Transaction<'static, Any>,
    node: &str,
    job_id: i64,
    run: Option<i64>,
) -> Result<Option<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let row: Option<JobRow> = sqlx::query_as(&format!(
        "SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND job_id = $2 AND ($3 < 0 OR run = $3) ORDER BY run DESC LIMIT 1"
    ))
    .bind(node)
    .bind(job_id)
    .bind(run.unwrap_or(-1))
    .fetch_optional(&mut **tx)
    .await?;
    let Some(row) = row else { return Ok(None) };
    let gpus = load_gpus(tx, &row).await?;
    Ok(Some((row, gpus)))
}

pub(crate) async fn load_gpus(tx: &mut Transaction<'static, Any>, row: &JobRow) -> Result<Vec<JobGpuRow>, sqlx::Error> {
    sqlx::query_as(&format!("SELECT {GPU_COLS} FROM acct_job_gpus WHERE node = $1 AND job_id = $2 AND run = $3 ORDER BY gpu_index"))
        .bind(&row.node)
        .bind(row.job_id)
        .bind(row.run)
        .fetch_all(&mut **tx)
        .await
}

async fn replace_gpus(tx: &mut Transaction<'static, Any>, row: &JobRow, gpus: &[JobGpuRow]) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM acct_job_gpus WHERE node = $1 AND job_id = $2 AND run = $3")
        .bind(&row.node)
        .bind(row.job_id)
        .bind(row.run)
        .execute(&mut **tx)
        .await?;
    for g in gpus {
        sqlx::query(
            "INSERT INTO acct_job_gpus (node, job_id, gpu_index, gpu_uuid, mean_util, peak_vram_bytes, energy_joules, samples, shards, run) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(&row.node)
        .bind(row.job_id)
        .bind(g.gpu_index)
        .bind(&g.gpu_uuid)
        .bind(g.mean_util)
        .bind(g.peak_vram_bytes)
        .bind(g.energy_joules)
        .bind(g.samples)
        .bind(g.shards)
        .bind(row.run)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Stores disagreements (the first per job and field); returns those that were new and marks
/// the row `slurm_disagrees`.
pub(crate) async fn store_disagreements(
    tx: &mut Transaction<'static, Any>,
    row: &mut JobRow,
    source: &str,
    list: Vec<Disagreement>,
    now_us: i64,
) -> Result<Vec<Disagreement>, sqlx::Error> {
    let mut new = Vec::new();
    for d in list {
        let n = sqlx::query(
            "INSERT INTO acct_disagreements (node, job_id, field, claimed, slurm, used, source, detected_us) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (node, job_id, field) DO NOTHING",
        )
        .bind(&row.node)
        .bind(row.job_id)
        .bind(d.field)
        .bind(&d.claimed)
        .bind(&d.slurm)
        .bind(&d.used)
        .bind(source)
        .bind(now_us)
        .execute(&mut **tx)
        .await?
        .rows_affected();
        if n > 0 {
            new.push(d);
        }
    }
    if !new.is_empty() {
        db::add_anomaly(&mut row.anomalies, Anomaly::SlurmDisagrees.as_str());
    }
    Ok(new)
}

/// One stored disagreement.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DisagreementRow {
    pub field: String,
    pub claimed: String,
    pub slurm: String,
    pub used: String,
    pub source: String,
}

/// A job's disagreements on a node.
pub async fn disagreements(pool: &AnyPool, node: &str, job_id: i64) -> Result<Vec<DisagreementRow>, sqlx::Error> {
    sqlx::query_as("SELECT field, claimed, slurm, used, source FROM acct_disagreements WHERE node = $1 AND job_id = $2 ORDER BY field")
        .bind(node)
        .bind(job_id)
        .fetch_all(pool)
        .await
}

/// Writes one action. A job that changed in between (verified, closed, created by a record)
/// is left as it is. `boundaries`: whether Slurm is the source of job starts and ends (then
/// creating and closing from Slurm is the normal path) or the prolog's records are (then each
/// is an anomaly). `stats`: what telemetry measured on the job's GPUs, stored when it ends.
pub async fn apply(
    pool: &AnyPool,
    action: &Action,
    now_us: i64,
    boundaries: JobBoundaries,
    stats: &[JobGpuStats],
) -> Result<Applied, sqlx::Error> {
    let from_slurm = boundaries == JobBoundaries::Slurm;
    let mut out = Applied::default();
    let mut tx = crate::store::begin_write(pool).await?;
    match action {
        Action::Verify { node, job_id, run, job, alloc } => {
            let Some((mut row, mut gpus)) = load(&mut tx, node, i64::from(*job_id), Some(*run)).await? else { return Ok(out) };
            if row.is_verified() {
                return Ok(out);
            }
            let d = verify(&mut row, &mut gpus, job, alloc);
            out.disagreements = store_disagreements(&mut tx, &mut row, job.source.as_str(), d, now_us).await?;
            remove_unverified(&mut row);
            db::upsert_job(&mut tx, &row).await?;
            replace_gpus(&mut tx, &row, &gpus).await?;
        }
        Action::Unverified { node, job_id, run } => {
            let Some((mut row, _)) = load(&mut tx, node, i64::from(*job_id), Some(*run)).await? else { return Ok(out) };
            if !row.verified.is_empty() {
                return Ok(out);
            }
            row.verified = "unverified".into();
            if db::add_anomaly(&mut row.anomalies, Anomaly::Unverified.as_str()) {
                out.anomalies.push(Anomaly::Unverified);
            }
            db::upsert_job(&mut tx, &row).await?;
        }
        Action::Close { node, job_id, run, end_us, exact, job, .. } => {
            let Some((mut row, mut gpus)) = load(&mut tx, node, i64::from(*job_id), Some(*run)).await? else { return Ok(out) };
            if row.end_us.is_some() {
                return Ok(out);
            }
            if let Some((sj, alloc)) = job
                && !row.is_verified()
            {
                let d = verify(&mut row, &mut gpus, sj, alloc);
                out.disagreements = store_disagreements(&mut tx, &mut row, sj.source.as_str(), d, now_us).await?;
                remove_unverified(&mut row);
                replace_gpus(&mut tx, &row, &gpus).await?;
            }
            row.end_us = Some((*end_us).max(row.start_us.unwrap_or(row.first_seen_us)));
            if row.slurm_end_us.is_none() && *exact {
                row.slurm_end_us = Some(*end_us);
            }
            row.end_reason = Some(if from_slurm { "ended" } else { "closed_from_slurm" }.into());
            let anomaly = match (from_slurm, *exact) {
                (true, true) => None,
                (true, false) => Some(Anomaly::EndApproximate),
                (false, _) => Some(Anomaly::EndFromSlurm),
            };
            if let Some(a) = anomaly
                && db::add_anomaly(&mut row.anomalies, a.as_str())
            {
                out.anomalies.push(a);
            }
            db::upsert_job(&mut tx, &row).await?;
            db::store_job_stats(&mut tx, &row, stats).await?;
        }
        Action::Create { node, job, alloc } => {
            let start = job.start_us.unwrap_or(now_us);
            let latest = load(&mut tx, node, i64::from(job.job_id), None).await?.map(|(r, _)| r);
            if latest.as_ref().is_some_and(|r| !LatestRun::of(r).is_before(start)) {
                return Ok(out);
            }
            let mut row = JobRow::new(node, i64::from(job.job_id), i64::from(job.uid.unwrap_or(u32::MAX)), &job.user, start);
            row.run = latest.map_or(0, |r| r.run + 1);
            let mut gpus = Vec::new();
            verify(&mut row, &mut gpus, job, alloc);
            row.start_us = job.start_us;
            if !from_slurm {
                out.anomalies.push(Anomaly::StartFromSlurm);
                db::add_anomaly(&mut row.anomalies, Anomaly::StartFromSlurm.as_str());
            }
            let ended = is_finished(&job.state);
            if ended {
                row.end_us = job.end_us.or(Some(now_us));
                row.last_seen_us = row.end_us.unwrap_or(start);
                row.end_reason = Some(if from_slurm { "ended" } else { "filled_from_slurm" }.into());
                let a = if !from_slurm {
                    Some(Anomaly::EndFromSlurm)
                } else if job.end_us.is_none() {
                    Some(Anomaly::EndApproximate)
                } else {
                    None
                };
                if let Some(a) = a {
                    db::add_anomaly(&mut row.anomalies, a.as_str());
                    out.anomalies.push(a);
                }
            }
            db::upsert_job(&mut tx, &row).await?;
            replace_gpus(&mut tx, &row, &gpus).await?;
            if ended {
                db::store_job_stats(&mut tx, &row, stats).await?;
            }
        }
    }
    tx.commit().await?;
    Ok(out)
}

fn remove_unverified(row: &mut JobRow) {
    db::remove_anomaly(&mut row.anomalies, Anomaly::Unverified.as_str());
}

/// Jobs of `nodes` not verified yet, ended after `since_us` or open.
pub async fn unverified_jobs(pool: &AnyPool, nodes: &[String], since_us: i64) -> Result<Vec<JobRow>, sqlx::Error> {
    let mut out = Vec::new();
    for node in nodes {
        let rows: Vec<JobRow> = sqlx::query_as(&format!(
            "SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND verified = '' AND (end_us IS NULL OR end_us >= $2) ORDER BY job_id"
        ))
        .bind(node)
        .bind(since_us)
        .fetch_all(pool)
        .await?;
        out.extend(rows);
    }
    Ok(out)
}

/// Jobs of `nodes` with no end.
pub async fn open_jobs(pool: &AnyPool, nodes: &[String]) -> Result<Vec<JobRow>, sqlx::Error> {
    let mut out = Vec::new();
    for node in nodes {
        let rows: Vec<JobRow> =
            sqlx::query_as(&format!("SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND end_us IS NULL ORDER BY job_id"))
                .bind(node)
                .fetch_all(pool)
                .await?;
        out.extend(rows);
    }
    Ok(out)
}

/// Which of `ids` the store has on one of `nodes`.
/// Keeps on the open rows of `open` that slurmctld lists live now (`listed`) the time of this
/// look (`last_seen_us`), so that a job that ends while the agent is down, and that Slurm cannot
/// date after the restart, is closed at its last listing rather than at the restart.
pub async fn keep_listed(pool: &AnyPool, open: &[JobRow], listed: &BTreeSet<u32>, taken_us: i64) -> Result<(), sqlx::Error> {
    let mut by_node: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for row in open.iter().filter(|r| r.last_seen_us < taken_us && u32::try_from(r.job_id).is_ok_and(|id| listed.contains(&id))) {
        by_node.entry(row.node.as_str()).or_default().push(row.job_id);
    }
    for (node, ids) in by_node {
        for chunk in ids.chunks(500) {
            let marks: Vec<String> = (0..chunk.len()).map(|i| format!("${}", i + 3)).collect();
            let sql = format!(
                "UPDATE acct_jobs SET last_seen_us = $1 WHERE node = $2 AND end_us IS NULL AND last_seen_us < $1 AND job_id IN ({})",
                marks.join(", ")
            );
            let mut q = sqlx::query(&sql).bind(taken_us).bind(node);
            for id in chunk {
                q = q.bind(*id);
            }
            q.execute(pool).await?;
        }
    }
    Ok(())
}

/// The latest run the store has on one of `nodes` of each of `ids` it has.
pub async fn known_ids(pool: &AnyPool, nodes: &BTreeSet<String>, ids: &BTreeSet<u32>) -> Result<BTreeMap<u32, LatestRun>, sqlx::Error> {
    let (Some(lo), Some(hi)) = (ids.first(), ids.last()) else { return Ok(BTreeMap::new()) };
    type Run = (String, i64, Option<i64>, Option<i64>, i64, Option<i64>);
    let rows: Vec<Run> = sqlx::query_as(
        "SELECT node, job_id, slurm_start_us, start_us, first_seen_us, end_us FROM acct_jobs WHERE job_id >= $1 AND job_id <= $2 ORDER BY run",
    )
    .bind(i64::from(*lo))
    .bind(i64::from(*hi))
    .fetch_all(pool)
    .await?;
    let mut out = BTreeMap::new();
    for (node, job_id, slurm_start, start, first_seen, end) in rows {
        if let Ok(id) = u32::try_from(job_id)
            && ids.contains(&id)
            && nodes.contains(&node)
        {
            // Later runs come later: the last one stays.
            out.insert(id, LatestRun::from_times(slurm_start, start, first_seen, end));
        }
    }
    Ok(out)
}
