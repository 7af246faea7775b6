//! Accounting SQL, shared by SQLite and PostgreSQL (`$n` placeholders, `BIGINT` decoded as
//! `i64`, no backend-specific functions: min/max folding happens in Rust inside the
//! transaction). Tables: `agent/migrations/*/0002_accounting.sql`.

use std::collections::BTreeMap;

use gpuhub_wire::spool::{GpuRef, Record};
use sqlx::{Any, AnyPool, Transaction};

use super::Anomaly;
use super::reconcile::{self, Disagreement};
use crate::telemetry::JobGpuStats;

/// One `acct_jobs` row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct JobRow {
    pub node: String,
    pub job_id: i64,
    /// Which run of the job on this node: 0, then one more each time Slurm requeues it and it
    /// starts here again (migration 0022).
    pub run: i64,
    pub uid: i64,
    pub user_name: String,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub start_us: Option<i64>,
    pub end_us: Option<i64>,
    pub first_seen_us: i64,
    pub last_seen_us: i64,
    pub exit_code: Option<i64>,
    pub end_reason: Option<String>,
    pub shards: i64,
    pub anomalies: String,
    /// `''`, `slurmctld`, `sacct` or `unverified` (migration 0006).
    pub verified: String,
    pub slurm_gpus: Option<i64>,
    pub slurm_start_us: Option<i64>,
    pub slurm_end_us: Option<i64>,
}

impl JobRow {
    /// An empty row for a job first seen at `t`.
    pub fn new(node: &str, job_id: i64, uid: i64, user: &str, t: i64) -> Self {
        JobRow {
            node: node.to_string(),
            job_id,
            run: 0,
            uid,
            user_name: user.to_string(),
            account: None,
            partition: None,
            start_us: None,
            end_us: None,
            first_seen_us: t,
            last_seen_us: t,
            exit_code: None,
            end_reason: None,
            shards: 0,
            anomalies: String::new(),
            verified: String::new(),
            slurm_gpus: None,
            slurm_start_us: None,
            slurm_end_us: None,
        }
    }

    /// Slurm's allocation stands for this job (claims in later records are only compared).
    pub fn is_verified(&self) -> bool {
        self.verified == "slurmctld" || self.verified == "sacct"
    }
}

/// One `acct_job_gpus` row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct JobGpuRow {
    pub node: String,
    pub job_id: i64,
    pub run: i64,
    pub gpu_index: i64,
    pub gpu_uuid: Option<String>,
    pub mean_util: Option<f64>,
    pub peak_vram_bytes: Option<i64>,
    pub energy_joules: Option<f64>,
    pub samples: Option<i64>,
    /// Shards held on this GPU (Slurm's, migration 0006); `None`: a whole GPU or unknown.
    pub shards: Option<i64>,
}

pub(crate) const JOB_COLS: &str = "node, job_id, run, uid, user_name, account, partition, start_us, end_us, first_seen_us, last_seen_us, exit_code, end_reason, shards, anomalies, verified, slurm_gpus, slurm_start_us, slurm_end_us";
pub(crate) const GPU_COLS: &str = "node, job_id, run, gpu_index, gpu_uuid, mean_util, peak_vram_bytes, energy_joules, samples, shards";

/// What folding one record found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Folded {
    pub anomalies: Vec<Anomaly>,
    /// Claims of the record that a verified job's Slurm allocation contradicts (new ones).
    pub disagreements: Vec<Disagreement>,
    /// The job was not verified against Slurm yet.
    pub unverified: bool,
}

/// Inserts the record and folds it into its job, in one transaction. Returns `None` when the
/// record was already ingested (a file re-read after a crash): nothing else is touched.
pub async fn ingest_record(
    pool: &AnyPool,
    rec: &Record,
    known_gpus: Option<&BTreeMap<u32, String>>,
    stats: &[JobGpuStats],
    now_us: i64,
) -> Result<Option<Folded>, sqlx::Error> {
    let mut tx = crate::store::begin_write(pool).await?;
    let job = rec.job();
    let inserted = sqlx::query(
        "INSERT INTO acct_records (record_id, kind, node, job_id, time_us, body, ingested_us) VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (record_id) DO NOTHING",
    )
    .bind(rec.record_id())
    .bind(rec.kind())
    .bind(&job.node)
    .bind(i64::from(job.job_id))
    .bind(rec.time_us())
    .bind(rec.to_json())
    .bind(now_us)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if inserted == 0 {
        tx.rollback().await?;
        return Ok(None);
    }
    let folded = fold(&mut tx, rec, known_gpus, stats, now_us).await?;
    tx.commit().await?;
    Ok(Some(folded))
}

async fn fold(
    tx: &mut Transaction<'static, Any>,
    rec: &Record,
    known_gpus: Option<&BTreeMap<u32, String>>,
    stats: &[JobGpuStats],
    now_us: i64,
) -> Result<Folded, sqlx::Error> {
    let id = rec.job();
    let t = rec.time_us();
    let mut runs: Vec<JobRow> = sqlx::query_as(&format!("SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND job_id = $2 ORDER BY run"))
        .bind(&id.node)
        .bind(i64::from(id.job_id))
        .fetch_all(&mut **tx)
        .await?;
    let mut row = match run_of(&runs, rec) {
        Some(i) => runs.swap_remove(i),
        None => {
            let mut row = JobRow::new(&id.node, i64::from(id.job_id), i64::from(id.uid), &id.user, t);
            row.run = runs.last().map_or(0, |r| r.run + 1);
            row
        }
    };
    // A verified job keeps Slurm's values; the record's claims are only compared.
    let verified = row.is_verified();
    let mut disagreements = Vec::new();
    if verified {
        let slurm_gpus = reconcile::load_gpus(tx, &row).await?;
        disagreements = reconcile::check_claims(&row, &slurm_gpus, rec);
    } else {
        row.uid = i64::from(id.uid);
        if !id.user.is_empty() {
            row.user_name = id.user.clone();
        }
        if id.account.as_ref().is_some_and(|a| !a.is_empty()) {
            row.account = id.account.clone();
        }
        if id.partition.as_ref().is_some_and(|p| !p.is_empty()) {
            row.partition = id.partition.clone();
        }
    }
    row.first_seen_us = row.first_seen_us.min(t);
    row.last_seen_us = row.last_seen_us.max(t);
    let (lo, hi) = (row.slurm_start_us, row.slurm_end_us);

    let mut anomalies = Vec::new();
    let mut gpus: &[GpuRef] = &[];
    match rec {
        Record::JobStart { gpus: g, .. } => {
            let used = if verified { reconcile::bounded_time(t, lo, lo, hi) } else { t };
            disagreements.extend(time_disagreement("start", t, used));
            row.start_us = Some(used);
            gpus = g;
            // The end was ingested first (records out of order): the start is here now.
            remove_anomaly(&mut row.anomalies, Anomaly::EndWithoutStart.as_str());
            // A job filled in from Slurm whose start record turns up after all.
            remove_anomaly(&mut row.anomalies, Anomaly::StartFromSlurm.as_str());
            if let Some(end) = row.end_us
                && end < used
            {
                anomalies.push(Anomaly::ClockBackwards);
            }
        }
        Record::JobEnd { gpus: g, exit_code, .. } => {
            let used = if verified { reconcile::bounded_time(t, hi, lo, hi) } else { t };
            disagreements.extend(time_disagreement("end", t, used));
            row.end_us = Some(used);
            row.exit_code = exit_code.map(i64::from);
            row.end_reason = Some("ended".into());
            // A job closed as lost in a reboot, or from Slurm, whose real end record turns up after all.
            remove_anomaly(&mut row.anomalies, Anomaly::NeverEnded.as_str());
            remove_anomaly(&mut row.anomalies, Anomaly::EndFromSlurm.as_str());
            gpus = g;
            match row.start_us {
                Some(start) if used < start => anomalies.push(Anomaly::ClockBackwards),
                Some(_) => {}
                None => anomalies.push(Anomaly::EndWithoutStart),
            }
        }
        Record::StepStart { gpus: g, shards, .. } => {
            gpus = g;
            if !verified && let Some(n) = shards {
                row.shards = row.shards.max(i64::from(*n));
            }
        }
        Record::StepEnd { .. } => {}
    }
    if let Some(known) = known_gpus {
        for g in gpus {
            let ok = match (known.get(&g.index), &g.uuid) {
                (None, _) => false,
                (Some(k), Some(u)) => k == u,
                (Some(_), None) => true,
            };
            if !ok {
                anomalies.push(Anomaly::UnknownGpu);
                break;
            }
        }
    }
    let source = row.verified.clone();
    let disagreements = if disagreements.is_empty() {
        disagreements
    } else {
        reconcile::store_disagreements(tx, &mut row, &source, disagreements, now_us).await?
    };
    // Report each anomaly once per job (both records of a job may name the same unknown GPU).
    anomalies.retain(|a| add_anomaly(&mut row.anomalies, a.as_str()));
    upsert_job(tx, &row).await?;
    for g in gpus {
        // A verified job's GPUs are Slurm's: a record only adds the UUID of one of them.
        let sql = if verified {
            "UPDATE acct_job_gpus SET gpu_uuid = COALESCE($4, gpu_uuid) WHERE node = $1 AND job_id = $2 AND gpu_index = $3 AND run = $5"
        } else {
            "INSERT INTO acct_job_gpus (node, job_id, gpu_index, gpu_uuid, run) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node, job_id, run, gpu_index) DO UPDATE SET gpu_uuid = COALESCE(excluded.gpu_uuid, acct_job_gpus.gpu_uuid)"
        };
        sqlx::query(sql)
            .bind(&row.node)
            .bind(row.job_id)
            .bind(i64::from(g.index))
            .bind(g.uuid.clone().or_else(|| known_gpus.and_then(|k| k.get(&g.index).cloned())))
            .bind(row.run)
            .execute(&mut **tx)
            .await?;
    }
    if matches!(rec, Record::JobEnd { .. }) {
        store_job_stats(tx, &row, stats).await?;
    }
    Ok(Folded { anomalies, disagreements, unverified: row.verified.is_empty() })
}

/// Which of a job's runs on a node (`runs`, in run order) `rec` belongs to; `None`: a new run.
/// Runs' records arrive in time order (the spool is read in time order, and Slurm starts a
/// requeued job only after the last run's epilog wrote its end), so a start after the end of a
/// latest run that has its start opens the next run. (A latest run with an end and no start is
/// waiting for its own start: records out of order, or a clock that went backwards.) Anything
/// else belongs to the latest run that started by its time, else to the first.
pub(crate) fn run_of(runs: &[JobRow], rec: &Record) -> Option<usize> {
    let t = rec.time_us();
    let latest = runs.len().checked_sub(1)?;
    let last = &runs[latest];
    if matches!(rec, Record::JobStart { .. }) && last.start_us.is_some() && last.end_us.is_some_and(|e| t > e) {
        return None;
    }
    let started = |r: &JobRow| r.start_us.or(r.slurm_start_us).unwrap_or(r.first_seen_us);
    Some(runs.iter().rposition(|r| started(r) <= t + reconcile::TIME_TOLERANCE_US).unwrap_or(0))
}

/// What telemetry measured on each of a job's GPUs, stored on its GPU rows when the job ends.
pub(crate) async fn store_job_stats(tx: &mut Transaction<'static, Any>, row: &JobRow, stats: &[JobGpuStats]) -> Result<(), sqlx::Error> {
    for s in stats {
        sqlx::query(
            "UPDATE acct_job_gpus SET mean_util = $1, peak_vram_bytes = $2, energy_joules = $3, samples = $4 WHERE node = $5 AND job_id = $6 AND gpu_index = $7 AND run = $8",
        )
        .bind(s.mean_util)
        .bind(i64::try_from(s.peak_vram_bytes).unwrap_or(i64::MAX))
        .bind(s.energy_joules)
        .bind(i64::try_from(s.samples).unwrap_or(i64::MAX))
        .bind(&row.node)
        .bind(row.job_id)
        .bind(i64::from(s.gpu_index))
        .bind(row.run)
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

pub(crate) fn remove_anomaly(list: &mut String, a: &str) {
    *list = list.split(',').filter(|x| !x.is_empty() && *x != a).collect::<Vec<_>>().join(",");
}

/// Adds `a` to the comma list; `false` when it was already there.
pub(crate) fn add_anomaly(list: &mut String, a: &str) -> bool {
    if list.split(',').any(|x| x == a) {
        return false;
    }
    if !list.is_empty() {
        list.push(',');
    }
    list.push_str(a);
    true
}

pub(crate) async fn upsert_job(tx: &mut Transaction<'static, Any>, row: &JobRow) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "INSERT INTO acct_jobs ({JOB_COLS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19) \
         ON CONFLICT (node, job_id, run) DO UPDATE SET uid = excluded.uid, user_name = excluded.user_name, account = excluded.account, \
         partition = excluded.partition, start_us = excluded.start_us, end_us = excluded.end_us, first_seen_us = excluded.first_seen_us, \
         last_seen_us = excluded.last_seen_us, exit_code = excluded.exit_code, end_reason = excluded.end_reason, shards = excluded.shards, \
         anomalies = excluded.anomalies, verified = excluded.verified, slurm_gpus = excluded.slurm_gpus, \
         slurm_start_us = excluded.slurm_start_us, slurm_end_us = excluded.slurm_end_us"
    ))
    .bind(&row.node)
    .bind(row.job_id)
    .bind(row.run)
    .bind(row.uid)
    .bind(&row.user_name)
    .bind(&row.account)
    .bind(&row.partition)
    .bind(row.start_us)
    .bind(row.end_us)
    .bind(row.first_seen_us)
    .bind(row.last_seen_us)
    .bind(row.exit_code)
    .bind(&row.end_reason)
    .bind(row.shards)
    .bind(&row.anomalies)
    .bind(&row.verified)
    .bind(row.slurm_gpus)
    .bind(row.slurm_start_us)
    .bind(row.slurm_end_us)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Jobs of `nodes` still open that started before `before_us` (the boot): they cannot be
/// running, their end record was lost with the node. Closes each at `end_us` (the agent's last
/// heartbeat when it falls inside the job, else the boot time). Returns the closed job ids.
pub async fn close_jobs_lost_in_reboot(
    pool: &AnyPool,
    nodes: &[String],
    boot_us: i64,
    heartbeat_us: Option<i64>,
) -> Result<Vec<(String, i64)>, sqlx::Error> {
    let mut closed = Vec::new();
    for node in nodes {
        let open: Vec<JobRow> =
            sqlx::query_as(&format!("SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND end_us IS NULL AND first_seen_us < $2"))
                .bind(node)
                .bind(boot_us)
                .fetch_all(pool)
                .await?;
        for mut row in open {
            let start = row.start_us.unwrap_or(row.first_seen_us);
            let end = match heartbeat_us {
                Some(h) if h >= start && h <= boot_us => h,
                _ => boot_us,
            };
            row.end_us = Some(end.max(row.last_seen_us));
            row.end_reason = Some("closed_after_reboot".into());
            add_anomaly(&mut row.anomalies, Anomaly::NeverEnded.as_str());
            let mut tx = crate::store::begin_write(pool).await?;
            upsert_job(&mut tx, &row).await?;
            tx.commit().await?;
            closed.push((row.node.clone(), row.job_id));
        }
    }
    Ok(closed)
}

/// Jobs overlapping `[since_us, now]` (open or ended after `since_us`), optionally of one uid,
/// with their GPUs.
pub async fn jobs_since(pool: &AnyPool, since_us: i64, uid: Option<i64>) -> Result<Vec<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let filter = if uid.is_some() { " AND j.uid = $2" } else { "" };
    let cols: String = JOB_COLS.split(", ").map(|c| format!("j.{c}")).collect::<Vec<_>>().join(", ");
    let sql = format!("SELECT {cols} FROM acct_jobs j WHERE (j.end_us IS NULL OR j.end_us >= $1){filter} ORDER BY j.job_id, j.run");
    let mut q = sqlx::query_as::<_, JobRow>(&sql).bind(since_us);
    if let Some(u) = uid {
        q = q.bind(u);
    }
    let jobs = q.fetch_all(pool).await?;
    let gcols: String = GPU_COLS.split(", ").map(|c| format!("g.{c}")).collect::<Vec<_>>().join(", ");
    let sql = format!(
        "SELECT {gcols} FROM acct_job_gpus g JOIN acct_jobs j ON j.node = g.node AND j.job_id = g.job_id AND j.run = g.run \
         WHERE (j.end_us IS NULL OR j.end_us >= $1){filter} ORDER BY g.gpu_index"
    );
    let mut q = sqlx::query_as::<_, JobGpuRow>(&sql).bind(since_us);
    if let Some(u) = uid {
        q = q.bind(u);
    }
    let gpus = q.fetch_all(pool).await?;
    let mut by_job: BTreeMap<(String, i64, i64), Vec<JobGpuRow>> = BTreeMap::new();
    for g in gpus {
        by_job.entry((g.node.clone(), g.job_id, g.run)).or_default().push(g);
    }
    Ok(jobs
        .into_iter()
        .map(|j| {
            let g = by_job.remove(&(j.node.clone(), j.job_id, j.run)).unwrap_or_default();
            (j, g)
        })
        .collect())
}

/// Job runs of `node` that ended before `before_us`, in (job id, run) order after `after`, at
/// most `limit`, with their GPUs: the settled part of the usage counters, read in pages so a
/// store with years of jobs is never loaded at once.
pub async fn node_jobs_ended_before(
    pool: &AnyPool,
    node: &str,
    before_us: i64,
    after: (i64, i64),
    limit: i64,
) -> Result<Vec<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let jobs: Vec<JobRow> = sqlx::query_as(&format!(
        "SELECT {JOB_COLS} FROM acct_jobs WHERE node = $1 AND end_us IS NOT NULL AND end_us < $2 \
         AND (job_id > $3 OR (job_id = $3 AND run > $5)) ORDER BY job_id, run LIMIT $4"
    ))
    .bind(node)
    .bind(before_us)
    .bind(after.0)
    .bind(limit)
    .bind(after.1)
    .fetch_all(pool)
    .await?;
    let (Some(first), Some(last)) = (jobs.first().map(|j| j.job_id), jobs.last().map(|j| j.job_id)) else { return Ok(Vec::new()) };
    let rows: Vec<JobGpuRow> =
        sqlx::query_as(&format!("SELECT {GPU_COLS} FROM acct_job_gpus WHERE node = $1 AND job_id >= $2 AND job_id <= $3 ORDER BY job_id"))
            .bind(node)
            .bind(first)
            .bind(last)
            .fetch_all(pool)
            .await?;
    let mut by_job: BTreeMap<(i64, i64), Vec<JobGpuRow>> = BTreeMap::new();
    for g in rows {
        by_job.entry((g.job_id, g.run)).or_default().push(g);
    }
    Ok(jobs
        .into_iter()
        .map(|j| {
            let g = by_job.remove(&(j.job_id, j.run)).unwrap_or_default();
            (j, g)
        })
        .collect())
}

/// One job (every node it ran on), with its GPUs.
pub async fn job(pool: &AnyPool, job_id: i64) -> Result<Vec<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let jobs: Vec<JobRow> = sqlx::query_as(&format!("SELECT {JOB_COLS} FROM acct_jobs WHERE job_id = $1 ORDER BY node, run"))
        .bind(job_id)
        .fetch_all(pool)
        .await?;
    with_gpus(pool, jobs).await
}

/// Each job with its per-GPU rows.
pub(crate) async fn with_gpus(pool: &AnyPool, jobs: Vec<JobRow>) -> Result<Vec<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let mut out = Vec::with_capacity(jobs.len());
    for j in jobs {
        let gpus: Vec<JobGpuRow> = sqlx::query_as(&format!(
            "SELECT {GPU_COLS} FROM acct_job_gpus WHERE node = $1 AND job_id = $2 AND run = $3 ORDER BY gpu_index"
        ))
        .bind(&j.node)
        .bind(j.job_id)
        .bind(j.run)
        .fetch_all(pool)
        .await?;
        out.push((j, gpus));
    }
    Ok(out)
}

/// The node (one of `nodes`) whose store already has `job_id`, if any.
pub async fn node_of_job(pool: &AnyPool, job_id: u32, nodes: &[String]) -> Result<Option<String>, sqlx::Error> {
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT node FROM acct_jobs WHERE job_id = $1 ORDER BY node").bind(i64::from(job_id)).fetch_all(pool).await?;
    Ok(rows.into_iter().map(|r| r.0).find(|n| nodes.contains(n)))
}

/// Number of ingested records (tests, `gpuhub doctor`).
pub async fn record_count(pool: &AnyPool) -> Result<i64, sqlx::Error> {
    let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM acct_records").fetch_one(pool).await?;
    Ok(n)
}

/// A record's time that Slurm's bounds replaced, as a disagreement (seconds, 3 decimals).
fn time_disagreement(field: &'static str, claimed_us: i64, used_us: i64) -> Option<Disagreement> {
    let secs = |us: i64| format!("{:.3}", us as f64 / 1e6);
    (claimed_us != used_us).then(|| Disagreement { field, claimed: secs(claimed_us), slurm: secs(used_us), used: secs(used_us) })
}
