//! The spool ingest task (see the module docs of [`crate::accounting`] for the exactly-once
//! argument). One task, one file at a time, in name order (names start with the record time).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuhub_wire::spool::{QUARANTINE_DIR, RECORDS_DIR, Record};
use tokio_util::sync::CancellationToken;

use super::reconcile::{self, Action, Inputs};
use super::slurm::{SlurmSource, SlurmState, is_finished};
use super::{AccountingMetrics, Anomaly, FieldLabels, GpuView, KindLabels, db};
use crate::config::JobBoundaries;
use crate::store::Store;

/// A record file larger than this is not a record (the plugin writes < 2 KiB).
const MAX_RECORD_BYTES: u64 = 1024 * 1024;
/// How often the heartbeat (the "agent was alive at" time used to close jobs lost in a reboot)
/// is written.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);
const SETTING_HEARTBEAT: &str = "accounting.heartbeat_us";
const SETTING_NODES: &str = "accounting.local_nodes";
/// Since when the agent watches Slurm for jobs it has no records of (set at the first start
/// with Slurm reconciliation on): older jobs are not created from Slurm.
const SETTING_WATCH_SINCE: &str = "accounting.slurm_watch_since_us";
/// Unverified jobs that ended longer ago than this are not looked up any more.
const VERIFY_WINDOW_US: i64 = 7 * 86_400 * 1_000_000;
/// For this long after one of its steps ended, each ingest pass asks Slurm whether an open job
/// has ended (its last step may have been its last), so that the store, and the gateway that
/// refuses an ended job's token, learn of its end about a second after Slurm; later, the
/// reconciliation ticks.
const STEP_END_WATCH: Duration = Duration::from_secs(10);
/// A job slurmctld still lists running this long after one of its steps ended goes on (more
/// steps, or the rest of its batch script): it is no longer watched, and its end comes from a
/// reconciliation tick. Slurm marks a job COMPLETING within a moment of its last step's end.
const STEP_END_SETTLED: Duration = Duration::from_secs(3);

/// How the ingest talks to Slurm ([`super::reconcile`]).
pub struct SlurmLink {
    pub source: Arc<dyn SlurmSource>,
    /// This node's Slurm name (`telemetry.slurm_node_name`).
    pub node: String,
    /// Reconciliation interval.
    pub interval: Duration,
    /// Where job starts and ends come from (`accounting.job_boundaries`).
    pub boundaries: JobBoundaries,
    /// The dcgm job map to keep from Slurm's allocations (`telemetry.job_map_dir`; only with
    /// job boundaries from Slurm: the job-hooks build keeps it from the prolog otherwise).
    pub job_map_dir: Option<PathBuf>,
}

#[derive(Default)]
struct SlurmMemo {
    /// Job id -> the last look that listed it live here.
    last_listed: BTreeMap<u32, i64>,
    watch_since_us: i64,
    /// sacct backfill since this (the heartbeat before a restart), once.
    backfill_since_us: Option<i64>,
    /// Jobs whose records this pass folded before they were verified.
    touched: BTreeSet<u32>,
    /// Jobs a step of which ended, and when its record was ingested ([`STEP_END_WATCH`]).
    step_ended: BTreeMap<u32, tokio::time::Instant>,
    failed_at: Option<tokio::time::Instant>,
    last_error: Option<String>,
    last_reconcile: Option<tokio::time::Instant>,
    /// The last failure to write the dcgm job map (logged once until it changes or clears).
    job_map_error: Option<std::io::ErrorKind>,
}

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    pub ingested: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    /// Files left for the next pass (a store error stopped this one).
    pub left: u64,
}

/// Ingests the spool into the store.
pub struct Ingestor {
    store: Store,
    spool_dir: PathBuf,
    gpus: Arc<dyn GpuView>,
    metrics: AccountingMetrics,
    /// Nodes whose records this spool carried (persisted), for closing jobs after a reboot.
    nodes: BTreeSet<String>,
    /// Files whose quarantine failed; logged once.
    stuck: HashSet<String>,
    slurm: Option<SlurmLink>,
    memo: SlurmMemo,
    /// [`STEP_END_SETTLED`] (shorter in tests).
    step_end_settled: Duration,
}

impl std::fmt::Debug for Ingestor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingestor").field("spool_dir", &self.spool_dir).finish_non_exhaustive()
    }
}

impl Ingestor {
    pub fn new(store: Store, spool_dir: impl Into<PathBuf>, gpus: Arc<dyn GpuView>, metrics: AccountingMetrics) -> Self {
        Self {
            store,
            spool_dir: spool_dir.into(),
            gpus,
            metrics,
            nodes: BTreeSet::new(),
            stuck: HashSet::new(),
            slurm: None,
            memo: SlurmMemo::default(),
            step_end_settled: STEP_END_SETTLED,
        }
    }

    #[cfg(test)]
    pub(crate) fn with_step_end_settled(mut self, d: Duration) -> Self {
        self.step_end_settled = d;
        self
    }

    /// Verifies jobs against Slurm and reconciles with it ([`super::reconcile`]).
    pub fn with_slurm(mut self, link: SlurmLink) -> Self {
        self.slurm = Some(link);
        self
    }

    /// Runs until `shutdown`: drain the spool, close jobs lost in a reboot, then a pass every
    /// `interval`. Finishes the file in hand before returning (a pass never stops mid-file).
    pub async fn run(mut self, interval: Duration, shutdown: CancellationToken) {
        let heartbeat_before = match self.store.get_setting(SETTING_HEARTBEAT).await {
            Ok(v) => v.and_then(|s| s.parse::<i64>().ok()),
            Err(e) => {
                tracing::warn!("accounting: cannot read the heartbeat: {e}");
                None
            }
        };
        if let Ok(Some(nodes)) = self.store.get_setting(SETTING_NODES).await {
            self.nodes.extend(nodes.split(',').filter(|n| !n.is_empty()).map(str::to_string));
        }
        if self.slurm.is_some() {
            self.start_watching(heartbeat_before).await;
        }
        self.tick(true).await;
        match boot_time_us() {
            Some(boot) => self.close_after_reboot(boot, heartbeat_before).await,
            None => tracing::warn!("accounting: cannot read the boot time from /proc/stat; jobs lost in a reboot stay open"),
        }
        let mut last_heartbeat = None::<tokio::time::Instant>;
        loop {
            if last_heartbeat.is_none_or(|t| t.elapsed() >= HEARTBEAT_EVERY) {
                if let Err(e) = self.store.set_setting(SETTING_HEARTBEAT, &crate::util::now_us().to_string()).await {
                    tracing::warn!("accounting: cannot write the heartbeat: {e}");
                }
                last_heartbeat = Some(tokio::time::Instant::now());
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
            let due = match (&self.slurm, self.memo.last_reconcile) {
                (Some(link), Some(t)) => t.elapsed() >= link.interval,
                (Some(_), None) => true,
                (None, _) => false,
            };
            self.tick(due).await;
        }
        tracing::info!("accounting: ingest stopped");
    }

    /// Closes this spool's jobs that started before `boot_us` and never ended.
    pub async fn close_after_reboot(&mut self, boot_us: i64, heartbeat_us: Option<i64>) {
        let nodes: Vec<String> = self.nodes.iter().cloned().collect();
        match db::close_jobs_lost_in_reboot(self.store.pool(), &nodes, boot_us, heartbeat_us).await {
            Ok(closed) => {
                for (node, job) in closed {
                    tracing::warn!("accounting: job {job} on {node}: {}", super::Anomaly::NeverEnded.explain());
                    self.metrics.anomalies.get_or_create(&KindLabels { kind: super::Anomaly::NeverEnded.as_str().into() }).inc();
                }
            }
            Err(e) => {
                tracing::error!("accounting: closing jobs lost in a reboot failed: {e}; retried at the next start");
                self.metrics.ingest_errors.inc();
            }
        }
    }

    /// Reads (or sets, at the first start) since when Slurm is watched; after a restart, the
    /// next look also asks sacct for jobs that ran here since the last heartbeat.
    pub async fn start_watching(&mut self, heartbeat_before: Option<i64>) {
        let now = crate::util::now_us();
        let since = match self.store.get_setting(SETTING_WATCH_SINCE).await {
            Ok(Some(v)) => v.parse::<i64>().ok(),
            Ok(None) => None,
            Err(e) => {
                tracing::warn!("accounting: cannot read {SETTING_WATCH_SINCE}: {e}; watching Slurm from now");
                Some(now)
            }
        };
        let since = match since {
            Some(s) => s,
            None => {
                if let Err(e) = self.store.set_setting(SETTING_WATCH_SINCE, &now.to_string()).await {
                    tracing::warn!("accounting: cannot write {SETTING_WATCH_SINCE}: {e}");
                }
                now
            }
        };
        self.memo.watch_since_us = since;
        self.memo.backfill_since_us = heartbeat_before.map(|h| h.max(since)).filter(|h| *h < now);
    }

    /// This node's names: the configured Slurm name and those its records carry.
    fn local_nodes(&self) -> BTreeSet<String> {
        let mut n = self.nodes.clone();
        if let Some(link) = &self.slurm
            && !link.node.is_empty()
        {
            n.insert(link.node.clone());
        }
        n
    }

    /// Asks Slurm about `want`. `reuse`: a reconciliation, which takes a look at slurmctld
    /// younger than its interval (the telemetry sampler's) if there is one; a new job's
    /// verification looks anew (its job may have started after the last look).
    async fn look(&mut self, want: Vec<u32>, since: Option<i64>, reuse: bool) -> Option<SlurmState> {
        let link = self.slurm.as_ref()?;
        let (source, age) = (link.source.clone(), link.interval);
        let st = match tokio::task::spawn_blocking(
            move || {
                if reuse { source.query_reusing(&want, since, age) } else { source.query(&want, since) }
            },
        )
        .await
        {
            Ok(st) => st,
            Err(e) => {
                tracing::error!("accounting: the Slurm look failed: {e}");
                return None;
            }
        };
        if st.errors.is_empty() {
            if self.memo.last_error.take().is_some() {
                tracing::info!("accounting: Slurm answers again");
            }
        } else {
            let msg = st.errors.join("; ");
            if self.memo.last_error.as_deref() != Some(msg.as_str()) {
                tracing::warn!("accounting: Slurm: {msg}");
            }
            self.memo.last_error = Some(msg);
        }
        if st.ctld_ok && st.acct_ok {
            self.memo.failed_at = None;
        } else {
            self.metrics.slurm_errors.inc();
            self.memo.failed_at = Some(tokio::time::Instant::now());
        }
        Some(st)
    }

    /// One ingest pass, with Slurm when linked: each new job is verified (one look per pass
    /// for all of them), and on a reconciliation tick (`reconcile`) open jobs Slurm no longer
    /// runs are closed and jobs it ran that the store lacks are created. The look is taken
    /// before the pass (see [`super::reconcile`]).
    pub async fn tick(&mut self, reconcile: bool) -> PassReport {
        let Some(link) = &self.slurm else { return self.pass().await };
        let default_node = link.node.clone();
        let nodes = self.local_nodes();
        let node_list: Vec<String> = nodes.iter().cloned().collect();
        let pool = self.store.pool().clone();
        let now = crate::util::now_us();
        let mut before = None;
        if reconcile {
            self.memo.last_reconcile = Some(tokio::time::Instant::now());
            let open = reconcile::open_jobs(&pool, &node_list).await;
            let unverified = reconcile::unverified_jobs(&pool, &node_list, now - VERIFY_WINDOW_US).await;
            match (open, unverified) {
                (Ok(open), Ok(unverified)) => {
                    let want: BTreeSet<u32> = open.iter().chain(unverified.iter()).filter_map(|j| u32::try_from(j.job_id).ok()).collect();
                    let since = self.memo.backfill_since_us;
                    if let Some(st) = self.look(want.into_iter().collect(), since, true).await {
                        if st.acct_ok {
                            self.memo.backfill_since_us = None;
                        }
                        before = Some((st, open));
                    }
                }
                (Err(e), _) | (_, Err(e)) => {
                    tracing::error!("accounting: cannot read open jobs for reconciliation: {e}; retried next interval");
                    self.metrics.ingest_errors.inc();
                }
            }
        }
        let report = self.pass().await;
        let touched = std::mem::take(&mut self.memo.touched);
        let (st, open) = match before {
            Some(b) => b,
            None => {
                let backoff = self.slurm.as_ref().map_or(Duration::ZERO, |l| l.interval);
                if self.memo.failed_at.is_some_and(|t| t.elapsed() < backoff) {
                    return report;
                }
                let open = self.step_ended_open(&pool, &node_list).await;
                if touched.is_empty() && open.is_empty() {
                    return report;
                }
                let want = touched.iter().copied().chain(open.iter().filter_map(|r| u32::try_from(r.job_id).ok())).collect();
                match self.look(want, None, false).await {
                    Some(st) => {
                        self.settle_step_ends(&st);
                        (st, open)
                    }
                    None => return report,
                }
            }
        };
        let unverified: Vec<db::JobRow> = match reconcile::unverified_jobs(&pool, &node_list, now - VERIFY_WINDOW_US).await {
            Ok(u) => u.into_iter().filter(|j| reconcile || u32::try_from(j.job_id).is_ok_and(|id| touched.contains(&id))).collect(),
            Err(e) => {
                tracing::error!("accounting: cannot read unverified jobs: {e}; retried next interval");
                return report;
            }
        };
        let candidates: BTreeSet<u32> = st.ctld.keys().chain(st.acct.keys()).copied().collect();
        let known = if reconcile {
            match reconcile::known_ids(&pool, &nodes, &candidates).await {
                Ok(k) => k,
                Err(e) => {
                    tracing::error!("accounting: cannot read known jobs: {e}; retried next interval");
                    return report;
                }
            }
        } else {
            BTreeMap::new()
        };
        let boundaries = self.slurm.as_ref().map_or(JobBoundaries::Slurm, |l| l.boundaries);
        let grace =
            i64::try_from(self.slurm.as_ref().map_or(Duration::ZERO, |l| l.interval).as_micros()).unwrap_or(i64::MAX).max(5_000_000);
        let actions = reconcile::plan(
            &Inputs {
                nodes: &nodes,
                default_node: &default_node,
                unverified: &unverified,
                open: &open,
                known: &known,
                watch_since_us: self.memo.watch_since_us,
                last_listed: &self.memo.last_listed,
                reconcile,
                grace_us: grace,
                close_ended: boundaries == JobBoundaries::Slurm,
            },
            &st,
        );
        if st.ctld_ok {
            let listed: BTreeSet<u32> = reconcile::listed_live(&st, &nodes).into_iter().collect();
            if let Err(e) = reconcile::keep_listed(&pool, &open, &listed, st.taken_us).await {
                tracing::warn!("accounting: cannot keep when Slurm last listed running jobs: {e}; retried next interval");
            }
            for id in listed {
                self.memo.last_listed.insert(id, st.taken_us);
            }
            self.memo.last_listed.retain(|_, t| *t > st.taken_us - 86_400 * 1_000_000);
            self.write_job_map(&st, &nodes).await;
        }
        for action in &actions {
            let stats = match action {
                Action::Close { job_id, .. } => self.gpus.job_gpu_stats(*job_id),
                Action::Create { job, .. } if is_finished(&job.state) => self.gpus.job_gpu_stats(job.job_id),
                _ => Vec::new(),
            };
            match reconcile::apply(&pool, action, crate::util::now_us(), boundaries, &stats).await {
                Ok(applied) => self.report_applied(action, applied),
                Err(e) => {
                    tracing::error!("accounting: store error while reconciling with Slurm: {e}; retried next interval");
                    self.metrics.ingest_errors.inc();
                    break;
                }
            }
        }
        report
    }

    /// The open jobs of [`SlurmMemo::step_ended`] still watched; the others are forgotten
    /// (watched long enough, or closed: by a reconciliation, a JobEnd record).
    async fn step_ended_open(&mut self, pool: &sqlx::AnyPool, nodes: &[String]) -> Vec<db::JobRow> {
        self.memo.step_ended.retain(|_, at| at.elapsed() < STEP_END_WATCH);
        if self.memo.step_ended.is_empty() {
            return Vec::new();
        }
        let open = match reconcile::open_jobs(pool, nodes).await {
            Ok(open) => open,
            Err(e) => {
                tracing::warn!("accounting: cannot read open jobs to see whether a job whose step ended has ended: {e}; retried next pass");
                return Vec::new();
            }
        };
        let open: Vec<db::JobRow> =
            open.into_iter().filter(|r| u32::try_from(r.job_id).is_ok_and(|id| self.memo.step_ended.contains_key(&id))).collect();
        self.memo.step_ended.retain(|id, _| open.iter().any(|r| r.job_id == i64::from(*id)));
        open
    }

    /// Stops watching the jobs this look lists running [`STEP_END_SETTLED`] after their step
    /// ended.
    fn settle_step_ends(&mut self, st: &SlurmState) {
        if !st.ctld_ok {
            return;
        }
        let settled = self.step_end_settled;
        self.memo.step_ended.retain(|id, at| at.elapsed() < settled || st.ctld.get(id).is_none_or(|j| j.state != "RUNNING"));
    }

    /// Rewrites the dcgm job map from one look at slurmctld (job boundaries from Slurm only).
    async fn write_job_map(&mut self, st: &SlurmState, nodes: &BTreeSet<String>) {
        let Some(dir) = self.slurm.as_ref().and_then(|l| l.job_map_dir.clone()) else { return };
        let map = super::job_map::from_slurm(st, nodes);
        let shown = dir.display().to_string();
        match tokio::task::spawn_blocking(move || super::job_map::write(&dir, &map)).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::debug!("accounting: dcgm job map {shown}: {n} GPU files updated"),
            Ok(Err(e)) => {
                if self.memo.job_map_error.replace(e.kind()) != Some(e.kind()) {
                    tracing::error!(
                        "accounting: cannot write the dcgm job map {shown}: {e} (dcgm-exporter and GPU attribution miss jobs until it is writable; check telemetry.job_map_dir)"
                    );
                }
                return;
            }
            Err(e) => tracing::error!("accounting: the dcgm job map task failed: {e}"),
        }
        if self.memo.job_map_error.take().is_some() {
            tracing::info!("accounting: the dcgm job map {shown} is written again");
        }
    }

    fn report_applied(&self, action: &Action, applied: reconcile::Applied) {
        let (node, job, source) = match action {
            Action::Verify { node, job_id, job, .. } => (node.as_str(), *job_id, job.source.as_str()),
            Action::Unverified { node, job_id, .. } => (node.as_str(), *job_id, "slurm"),
            Action::Close { node, job_id, job, how, end_us, .. } => {
                for a in applied.anomalies.iter().filter(|a| matches!(a, Anomaly::EndFromSlurm | Anomaly::EndApproximate)) {
                    tracing::warn!("accounting: job {job_id} on {node}: {}; closed at {:.0} ({how})", a.explain(), *end_us as f64 / 1e6);
                }
                (node.as_str(), *job_id, job.as_ref().map_or("slurm", |(j, _)| j.source.as_str()))
            }
            Action::Create { node, job, .. } => (node.as_str(), job.job_id, job.source.as_str()),
        };
        for a in &applied.anomalies {
            self.metrics.anomalies.get_or_create(&KindLabels { kind: a.as_str().into() }).inc();
            if !matches!(action, Action::Close { .. }) {
                tracing::warn!("accounting: job {job} on {node}: {}", a.explain());
            }
        }
        self.report_disagreements(job, node, source, &applied.disagreements);
    }

    fn report_disagreements(&self, job: u32, node: &str, source: &str, list: &[reconcile::Disagreement]) {
        for d in list {
            self.metrics.disagreements.get_or_create(&FieldLabels { field: d.field.into() }).inc();
            tracing::warn!(
                "accounting: job {job} on {node}: its records claim {} {}, Slurm ({source}) says {}; billed {} (Slurm wins)",
                d.field,
                d.claimed,
                d.slurm,
                d.used
            );
        }
    }

    /// One pass over the spool.
    pub async fn pass(&mut self) -> PassReport {
        let mut report = PassReport::default();
        let dir = self.spool_dir.join(RECORDS_DIR);
        let mut names = match list_records(&dir) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::error!("accounting: cannot read the spool {}: {e} (check spool_dir and its permissions)", dir.display());
                self.metrics.ingest_errors.inc();
                return report;
            }
        };
        names.sort();
        let total = names.len() as u64;
        for (i, name) in names.iter().enumerate() {
            let path = dir.join(name);
            match self.ingest_file(&path, name).await {
                Ok(Outcome::Ingested) => report.ingested += 1,
                Ok(Outcome::Duplicate) => report.duplicates += 1,
                Ok(Outcome::Quarantined) => report.quarantined += 1,
                Ok(Outcome::Gone) => {}
                Err(e) => {
                    tracing::error!("accounting: store error while ingesting {}: {e}; the file stays and is retried", path.display());
                    self.metrics.ingest_errors.inc();
                    report.left = total - i as u64;
                    break;
                }
            }
        }
        self.metrics.backlog.set(i64::try_from(report.left).unwrap_or(i64::MAX));
        self.metrics.last_pass.set(crate::util::now_us() as f64 / 1e6);
        if report != PassReport::default() {
            tracing::debug!(?report, "accounting: ingest pass");
        }
        report
    }

    async fn ingest_file(&mut self, path: &Path, name: &str) -> Result<Outcome, sqlx::Error> {
        let bytes = match read_capped(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Outcome::Gone),
            Err(e) => return Ok(self.quarantine(path, name, &format!("cannot read: {e}"))),
        };
        let mut rec = match Record::parse(&bytes) {
            Ok(r) => r,
            Err(reason) => return Ok(self.quarantine(path, name, &reason)),
        };
        // A record that does not know its node (a step record) is this node's: the node its
        // job's other records name, else the configured Slurm node, else the only node seen.
        let (Record::JobStart { job, .. } | Record::JobEnd { job, .. } | Record::StepStart { job, .. } | Record::StepEnd { job, .. }) =
            &mut rec;
        if job.node.is_empty() {
            let nodes: Vec<String> = self.nodes.iter().cloned().collect();
            let fallback = match &self.slurm {
                Some(link) if !link.node.is_empty() => Some(link.node.clone()),
                _ if nodes.len() == 1 => nodes.first().cloned(),
                _ => None,
            };
            if let Some(n) = db::node_of_job(self.store.pool(), job.job_id, &nodes).await?.or(fallback) {
                job.node = n;
            }
        }
        let stats = match &rec {
            Record::JobEnd { job, .. } => self.gpus.job_gpu_stats(job.job_id),
            _ => Vec::new(),
        };
        let known = self.gpus.known_gpus();
        let outcome = match db::ingest_record(self.store.pool(), &rec, known.as_ref(), &stats, crate::util::now_us()).await? {
            None => {
                self.metrics.duplicates.inc();
                tracing::debug!("accounting: {name} was already ingested (re-read after a restart); removing it");
                Outcome::Duplicate
            }
            Some(folded) => {
                self.metrics.ingested.get_or_create(&KindLabels { kind: rec.kind().into() }).inc();
                if folded.unverified {
                    self.memo.touched.insert(rec.job().job_id);
                }
                if self.slurm.as_ref().is_some_and(|l| l.boundaries == JobBoundaries::Slurm) {
                    match &rec {
                        Record::StepEnd { .. } => {
                            self.memo.step_ended.insert(rec.job().job_id, tokio::time::Instant::now());
                        }
                        // A step started after it: the job goes on.
                        Record::StepStart { .. } => {
                            self.memo.step_ended.remove(&rec.job().job_id);
                        }
                        _ => {}
                    }
                }
                let source = if folded.disagreements.is_empty() { "" } else { "stored allocation" };
                self.report_disagreements(rec.job().job_id, &rec.job().node, source, &folded.disagreements);
                for a in folded.anomalies {
                    self.metrics.anomalies.get_or_create(&KindLabels { kind: a.as_str().into() }).inc();
                    tracing::warn!("accounting: job {} on {} ({}): {}", rec.job().job_id, rec.job().node, rec.kind(), a.explain());
                }
                Outcome::Ingested
            }
        };
        self.remember_node(&rec.job().node).await;
        // Only now, after the commit: a crash before this line re-reads the file as a duplicate.
        if let Err(e) = std::fs::remove_file(path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("accounting: ingested {} but cannot remove it: {e}; it will be skipped as a duplicate", path.display());
        }
        Ok(outcome)
    }

    async fn remember_node(&mut self, node: &str) {
        if node.is_empty() || self.nodes.contains(node) {
            return;
        }
        self.nodes.insert(node.to_string());
        let list = self.nodes.iter().cloned().collect::<Vec<_>>().join(",");
        if let Err(e) = self.store.set_setting(SETTING_NODES, &list).await {
            tracing::warn!("accounting: cannot remember node {node}: {e}");
        }
    }

    /// Moves a file that is not a record to `<spool>/quarantine/` with a `.reason` beside it.
    fn quarantine(&mut self, path: &Path, name: &str, reason: &str) -> Outcome {
        let qdir = self.spool_dir.join(QUARANTINE_DIR);
        let moved = std::fs::create_dir_all(&qdir).and_then(|()| {
            std::fs::write(
                qdir.join(format!("{name}.reason")),
                format!("{reason}\nquarantined at unix time {} by gpuhub-agent\n", crate::util::now_s()),
            )?;
            std::fs::rename(path, qdir.join(name))
        });
        match moved {
            Ok(()) => {
                self.metrics.quarantined.inc();
                tracing::warn!(
                    "accounting: spool file {name} is not a usage record ({reason}); moved to {} (inspect it, then delete it or fix and move it back)",
                    qdir.display()
                );
                Outcome::Quarantined
            }
            Err(e) => {
                if self.stuck.insert(name.to_string()) {
                    tracing::error!(
                        "accounting: spool file {name} is not a usage record ({reason}) and cannot be moved to {}: {e}; it stays in place",
                        qdir.display()
                    );
                }
                Outcome::Gone
            }
        }
    }
}

enum Outcome {
    Ingested,
    Duplicate,
    Quarantined,
    /// Vanished or could not be quarantined: nothing changed.
    Gone,
}

/// Committed record files: `*.json`, not the plugin's `.tmp` files in flight.
fn list_records(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            out.push(name);
        }
    }
    Ok(out)
}

fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    if meta.len() > MAX_RECORD_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} bytes is larger than any record ({MAX_RECORD_BYTES} max)", meta.len()),
        ));
    }
    std::fs::read(path)
}

/// Boot time (Unix microseconds) from `/proc/stat`'s `btime`.
pub fn boot_time_us() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: i64 = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    Some(secs * 1_000_000)
}
