//! GPU use on the MLflow run page: when a Slurm job has ended and accounting has stored what
//! NVML measured for it (`acct_job_gpus`: per GPU, the job's own processes, so a shard job on
//! a shared GPU gets its own share), the figures are logged as metrics of the MLflow run(s)
//! tagged with that job's `slurm.job_id` (the SPANK plugin puts the tag in
//! `MLFLOW_RUN_CONTEXT`, which plain mlflow merges into every run the job starts).
//!
//! Metric names (`N` is the GPU's NVML index; docs/mlflow.md):
//! `gpuhub.gpuN.utilization_mean_pct`, `gpuhub.gpuN.vram_peak_gib`, `gpuhub.gpuN.energy_wh`,
//! `gpuhub.gpuN.samples`, `gpuhub.gpuN.shards` (shard jobs), and the totals
//! `gpuhub.total.utilization_mean_pct` (sample-weighted), `gpuhub.total.vram_peak_gib` (sum of
//! the per-GPU peaks), `gpuhub.total.energy_wh`, `gpuhub.gpu_count`, `gpuhub.shards`,
//! `gpuhub.job_duration_s`.
//!
//! The tag is hostile input (MLflow has no login: anyone can tag any run with any job id). A
//! run gets a job's figures only if it started within the job's time (Slurm's start and end
//! when verified) and its MLflow user is the job's user; at most [`MAX_RUNS`] runs per job.
//! The residual risk is in docs/security.md.
//!
//! Nothing is lost when MLflow is down: the figures stay in the store and the job stays
//! `pending` in `mlflow_job_reports`; it is tried again with a doubling delay, at most
//! [`MAX_ATTEMPTS`] times, and one line per pass says how many jobs wait.

pub mod rest;
pub mod site_experiment;

use std::time::Duration;

use sqlx::AnyPool;
use tokio_util::sync::CancellationToken;

use crate::accounting::db::{JOB_COLS, JobGpuRow, JobRow};
use crate::store::Store;
pub use rest::{Metric, RestError, RunInfo, Tracking};

/// Runs per job that get its figures at most (a job that starts more is unusual; a flood of
/// runs tagged with someone's job id is cut here).
pub const MAX_RUNS: usize = 20;
/// Tries per job before it is given up (delays 5 s, 10 s, 20 s, ... capped at 30 min: ~4 h).
pub const MAX_ATTEMPTS: i64 = 14;
const FIRST_DELAY_US: i64 = 5_000_000;
const MAX_DELAY_US: i64 = 1_800_000_000;
/// Jobs that ended longer ago than this are not reported any more (a fresh store fed with old
/// jobs, or an agent that was down for days).
const LOOKBACK_US: i64 = 24 * 3600 * 1_000_000;
/// A job is reported this long after its end at the earliest: Slurm's close may still rewrite
/// its GPUs (Slurm wins) right after the end record.
const SETTLE_US: i64 = 2_000_000;
/// Slack on the run's start time against the job's start (Slurm's times are whole seconds).
const START_SLACK_MS: i64 = 2_000;
/// Jobs handled per pass.
const BATCH: i64 = 50;

const GIB: f64 = (1u64 << 30) as f64;

/// Why a run tagged with a job does not get its figures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The run's start time is outside the job's time.
    OutsideJob,
    /// The run's MLflow user is not the job's user.
    OtherUser,
}

/// The job's time window, Unix microseconds: Slurm's when it vouched for the job, else the
/// records'.
pub fn job_window(job: &JobRow) -> Option<(i64, i64)> {
    let start = job.slurm_start_us.or(job.start_us).unwrap_or(job.first_seen_us);
    let end = job.slurm_end_us.or(job.end_us)?;
    Some((start, end.max(start)))
}

/// Whether `run` may carry `job`'s figures (see the module doc).
pub fn check_run(run: &RunInfo, job: &JobRow) -> Result<(), Refusal> {
    let Some((start_us, end_us)) = job_window(job) else {
        return Err(Refusal::OutsideJob);
    };
    let t = run.start_time_ms;
    if t < start_us / 1000 - START_SLACK_MS || t > end_us / 1000 + START_SLACK_MS {
        return Err(Refusal::OutsideJob);
    }
    if !job.user_name.is_empty() && run.user_id != job.user_name {
        return Err(Refusal::OtherUser);
    }
    Ok(())
}

/// The metrics a job's runs get, stamped at the job's end.
pub fn job_metrics(job: &JobRow, gpus: &[JobGpuRow]) -> Vec<Metric> {
    let (start_us, end_us) = job_window(job).unwrap_or((job.first_seen_us, job.last_seen_us));
    let ts = end_us / 1000;
    let m = |key: String, value: f64| Metric { key, value, timestamp: ts, step: 0 };
    let mut out = Vec::new();
    let (mut util_weighted, mut samples_total, mut vram_total, mut energy_total, mut count) = (0.0, 0i64, 0.0, 0.0, 0u32);
    for g in gpus.iter().filter(|g| g.samples.unwrap_or(0) > 0) {
        let i = g.gpu_index;
        let samples = g.samples.unwrap_or(0);
        let util = g.mean_util.unwrap_or(0.0);
        let vram = g.peak_vram_bytes.unwrap_or(0) as f64 / GIB;
        let wh = g.energy_joules.unwrap_or(0.0) / 3600.0;
        out.push(m(format!("gpuhub.gpu{i}.utilization_mean_pct"), util));
        out.push(m(format!("gpuhub.gpu{i}.vram_peak_gib"), vram));
        out.push(m(format!("gpuhub.gpu{i}.energy_wh"), wh));
        out.push(m(format!("gpuhub.gpu{i}.samples"), samples as f64));
        if let Some(s) = g.shards.filter(|s| *s > 0) {
            out.push(m(format!("gpuhub.gpu{i}.shards"), s as f64));
        }
        util_weighted += util * samples as f64;
        samples_total += samples;
        vram_total += vram;
        energy_total += wh;
        count += 1;
    }
    if count == 0 {
        return out;
    }
    out.push(m("gpuhub.total.utilization_mean_pct".into(), util_weighted / samples_total as f64));
    out.push(m("gpuhub.total.vram_peak_gib".into(), vram_total));
    out.push(m("gpuhub.total.energy_wh".into(), energy_total));
    out.push(m("gpuhub.gpu_count".into(), f64::from(count)));
    out.push(m("gpuhub.shards".into(), job.shards as f64));
    out.push(m("gpuhub.job_duration_s".into(), (end_us - start_us).max(0) as f64 / 1e6));
    out
}

/// The tags that go with the metrics: which job and node they are for, and the GPUs' UUIDs.
fn job_tags(job: &JobRow, gpus: &[JobGpuRow]) -> Vec<(String, String)> {
    let mut t = vec![("gpuhub.measured_job".to_string(), format!("{} on {}", job.job_id, job.node))];
    for g in gpus.iter().filter(|g| g.samples.unwrap_or(0) > 0) {
        if let Some(u) = &g.gpu_uuid {
            t.push((format!("gpuhub.gpu{}.uuid", g.gpu_index), u.clone()));
        }
    }
    t
}

/// The delay before try `attempts + 1`.
pub fn retry_delay_us(attempts: i64) -> i64 {
    let shift = attempts.clamp(0, 20) as u32;
    FIRST_DELAY_US.saturating_mul(1i64 << shift).min(MAX_DELAY_US)
}

/// What one job's report did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Logged on this many runs (`0`: no run of the job; `skipped`: runs refused).
    Logged { runs: usize, skipped: usize },
    /// MLflow could not be reached or refused; tried again later.
    Failed(String),
}

/// Jobs whose figures are due: ended (and settled), measured, not reported, not given up.
pub async fn due_jobs(pool: &AnyPool, now_us: i64) -> Result<Vec<(JobRow, Vec<JobGpuRow>)>, sqlx::Error> {
    let cols: String = JOB_COLS.split(", ").map(|c| format!("j.{c}")).collect::<Vec<_>>().join(", ");
    let jobs: Vec<JobRow> = sqlx::query_as(&format!(
        "SELECT {cols} FROM acct_jobs j LEFT JOIN mlflow_job_reports r ON r.node = j.node AND r.job_id = j.job_id \
         WHERE j.end_us IS NOT NULL AND j.end_us >= $1 AND j.end_us <= $2 \
         AND (r.job_id IS NULL OR (r.state = 'pending' AND r.next_try_us <= $3)) \
         AND EXISTS (SELECT 1 FROM acct_job_gpus g WHERE g.node = j.node AND g.job_id = j.job_id AND g.samples > 0) \
         ORDER BY j.end_us LIMIT {BATCH}"
    ))
    .bind(now_us - LOOKBACK_US)
    .bind(now_us - SETTLE_US)
    .bind(now_us)
    .fetch_all(pool)
    .await?;
    crate::accounting::db::with_gpus(pool, jobs).await
}

/// Records a try's outcome; returns the state written (`done`, `pending`, `gave_up`).
pub async fn record_outcome(pool: &AnyPool, job: &JobRow, outcome: &Outcome, now_us: i64) -> Result<&'static str, sqlx::Error> {
    let prev: Option<(i64,)> = sqlx::query_as("SELECT attempts FROM mlflow_job_reports WHERE node = $1 AND job_id = $2")
        .bind(&job.node)
        .bind(job.job_id)
        .fetch_optional(pool)
        .await?;
    let attempts = prev.map_or(0, |p| p.0) + 1;
    let (state, runs, error, next) = match outcome {
        Outcome::Logged { runs, .. } => ("done", *runs as i64, None, now_us),
        Outcome::Failed(e) if attempts >= MAX_ATTEMPTS => ("gave_up", 0, Some(e.clone()), now_us),
        Outcome::Failed(e) => ("pending", 0, Some(e.clone()), now_us + retry_delay_us(attempts - 1)),
    };
    sqlx::query(
        "INSERT INTO mlflow_job_reports (node, job_id, state, attempts, next_try_us, runs, last_error, updated_us) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (node, job_id) DO UPDATE SET state = excluded.state, \
         attempts = excluded.attempts, next_try_us = excluded.next_try_us, runs = excluded.runs, \
         last_error = excluded.last_error, updated_us = excluded.updated_us",
    )
    .bind(&job.node)
    .bind(job.job_id)
    .bind(state)
    .bind(attempts)
    .bind(next)
    .bind(runs)
    .bind(error)
    .bind(now_us)
    .execute(pool)
    .await?;
    Ok(state)
}

/// Logs one job's figures on its runs.
pub async fn report_job(mlflow: &Tracking, job: &JobRow, gpus: &[JobGpuRow]) -> Outcome {
    let runs = match mlflow.runs_of_job(job.job_id, MAX_RUNS).await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    if runs.len() > MAX_RUNS {
        tracing::warn!(
            job = job.job_id,
            "mlflow run page: more than {MAX_RUNS} runs are tagged with this job; only the first {MAX_RUNS} are checked"
        );
    }
    let metrics = job_metrics(job, gpus);
    let tags = job_tags(job, gpus);
    let (mut logged, mut skipped) = (0, 0);
    for run in runs.iter().take(MAX_RUNS) {
        match check_run(run, job) {
            Ok(()) => {
                if let Err(e) = mlflow.log_batch(&run.run_id, &metrics, &tags).await {
                    return Outcome::Failed(e.to_string());
                }
                logged += 1;
            }
            Err(why) => {
                skipped += 1;
                let why = match why {
                    Refusal::OutsideJob => "it started outside the job's time",
                    Refusal::OtherUser => "its MLflow user is not the job's user",
                };
                tracing::warn!(
                    job = job.job_id,
                    run = %crate::util::sanitize(&run.run_id),
                    experiment = %crate::util::sanitize(&run.experiment_id),
                    run_user = %crate::util::sanitize(&run.user_id),
                    "mlflow run page: a run tagged slurm.job_id={} does not get the job's GPU figures: {why} (a tag anyone can set)",
                    job.job_id
                );
            }
        }
    }
    Outcome::Logged { runs: logged, skipped }
}

/// The reporter task: every `interval`, the due jobs' figures onto their runs.
pub struct Reporter {
    store: Store,
    mlflow: Tracking,
}

impl Reporter {
    pub fn new(store: Store, tracking_uri: &str) -> Reporter {
        Reporter { store, mlflow: Tracking::new(tracking_uri) }
    }

    /// One pass; returns the number of jobs tried.
    pub async fn pass(&self) -> usize {
        let now = crate::util::now_us();
        let due = match due_jobs(self.store.pool(), now).await {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "mlflow run page: cannot read the ended jobs from the store; tried again at the next pass");
                return 0;
            }
        };
        let (mut failed, mut first_error) = (0usize, None);
        for (job, gpus) in &due {
            let outcome = report_job(&self.mlflow, job, gpus).await;
            let state = match record_outcome(self.store.pool(), job, &outcome, crate::util::now_us()).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(job = job.job_id, error = %e, "mlflow run page: cannot record the report's outcome; the job is tried again");
                    continue;
                }
            };
            match (&outcome, state) {
                (Outcome::Logged { runs, skipped }, _) => {
                    tracing::info!(job = job.job_id, runs, skipped, "mlflow run page: the job's GPU use is logged on its MLflow runs")
                }
                (Outcome::Failed(e), "gave_up") => tracing::error!(
                    job = job.job_id,
                    error = %e,
                    "mlflow run page: giving up after {MAX_ATTEMPTS} tries; the figures stay in `gpuhub job {}`",
                    job.job_id
                ),
                (Outcome::Failed(e), _) => {
                    failed += 1;
                    first_error.get_or_insert_with(|| e.clone());
                }
            }
            if matches!(outcome, Outcome::Failed(_)) && first_error.as_deref().is_some_and(|e| e.starts_with("cannot reach")) {
                break; // MLflow is down: the other jobs wait for the next pass without a try
            }
        }
        if let Some(e) = first_error {
            tracing::warn!(
                failed,
                error = %e,
                "mlflow run page: GPU figures of {failed} ended job(s) could not be logged; they are kept and tried again later"
            );
        }
        due.len()
    }

    pub async fn run(self, interval: Duration, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.cancelled() => return,
            }
            self.pass().await;
        }
    }
}

#[cfg(test)]
mod tests;
