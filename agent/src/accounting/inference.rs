//! Inference billed to its callers: a model worker's Slurm job runs as the worker account, but
//! its GPU time belongs to the users and apps whose calls it served (docs/accounting.md,
//! "Inference").
//!
//! - Which jobs: those the agent itself submitted as workers (`inference_workers`, written by
//!   `models::lifecycle` when sbatch answered), of the worker account's uid, started after
//!   the submission (less [`START_SLACK_US`]). A job's name or comment, which anyone can set,
//!   play no part.
//! - What is split: the job's GPU- and shard-microseconds, billed as for any job
//!   ([`super::usage::billed`] x its time from Slurm).
//! - How: among (user, app) by the busy time of their calls that the job served: the usage
//!   rows of the job's model whose interval `[time_us, time_us + latency_us]` overlaps the
//!   job's `[start, end + 1 s]` (Slurm keeps whole seconds), each weighing its
//!   `latency_us - overhead_us` (the time it waited for the worker: loading, upstream).
//!   Overlapping calls count each. The job's idle time (loading before the first call,
//!   the idle timeout) is split in the same proportion, so the shares sum to the job exactly;
//!   integer microseconds, the remainder given one by one to the largest fractional parts
//!   (ties: user, then app, in byte order). If no call had busy time, each call weighs the
//!   same; a job that served no call at all is one share of [`IDLE_USER`].
//! - When: [`settle`] splits each worker job of this node once, [`SETTLE_US`] after Slurm's
//!   end was recorded, in one transaction (`inference_jobs` then `inference_shares`; a job
//!   already there is skipped, so a re-run changes nothing). Until then `gpuhub usage`
//!   computes the split live with the same function ([`window`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use sqlx::AnyPool;

use super::db::{self, JobGpuRow, JobRow};
use super::live_callers::LiveCallers;
use super::usage::{billed, overlap_us};

/// The caller of a worker job that served no call (its loading and idle time).
pub const IDLE_USER: &str = "(idle)";
/// A worker job is split this long after its end (its last calls' usage rows are stored by then).
pub const SETTLE_US: i64 = 30_000_000;
/// A worker job's Slurm start may precede the agent's record of its submission by this much
/// (Slurm's whole seconds, sbatch's answer after the job started).
pub const START_SLACK_US: i64 = 60_000_000;
/// Calls that ran into a job are looked for at most this long before its start ([`earliest_start`]
/// narrows it to the hours whose longest call reaches the start).
pub const MAX_CALL_US: i64 = 24 * 3600 * 1_000_000;
/// Slurm's end is whole seconds: calls up to one second after it still belong to the job.
pub const END_SLACK_US: i64 = 1_000_000;

/// One caller's calls on a worker job.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Busy {
    pub busy_us: i64,
    pub calls: i64,
}

/// A (user, app)'s share of a worker job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Share {
    pub user: String,
    pub app: String,
    pub busy_us: i64,
    pub calls: i64,
    pub gpu_us: i64,
    pub shard_us: i64,
}

/// Splits `total` in proportion to `weights` (not all zero) in integers: each gets the floor of
/// its exact part, then the remainder goes one by one to the largest fractional parts, the
/// earlier index first on a tie. The parts sum to `total`.
pub fn apportion(total: i64, weights: &[i128]) -> Vec<i64> {
    let sum: i128 = weights.iter().map(|w| (*w).max(0)).sum();
    if sum <= 0 || weights.is_empty() {
        return vec![0; weights.len()];
    }
    let total_i = i128::from(total);
    let mut parts: Vec<i128> = weights.iter().map(|w| total_i * (*w).max(0) / sum).collect();
    let mut order: Vec<(i128, usize)> = weights.iter().enumerate().map(|(i, w)| (total_i * (*w).max(0) % sum, i)).collect();
    order.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut left = total_i - parts.iter().sum::<i128>();
    for (_, i) in order.iter().cycle() {
        if left <= 0 {
            break;
        }
        parts[*i] += 1;
        left -= 1;
    }
    parts.into_iter().map(|p| i64::try_from(p).unwrap_or(i64::MAX)).collect()
}

/// The shares of a worker job of `gpu_us` GPU- and `shard_us` shard-microseconds among its
/// callers (see the module's rule). They sum to both totals exactly.
pub fn split(gpu_us: i64, shard_us: i64, callers: &BTreeMap<(String, String), Busy>) -> Vec<Share> {
    let busy: i128 = callers.values().map(|b| i128::from(b.busy_us.max(0))).sum();
    let calls: i128 = callers.values().map(|b| i128::from(b.calls.max(0))).sum();
    let weights: Vec<i128> = if busy > 0 {
        callers.values().map(|b| i128::from(b.busy_us.max(0))).collect()
    } else if calls > 0 {
        callers.values().map(|b| i128::from(b.calls.max(0))).collect()
    } else {
        return vec![Share { user: IDLE_USER.into(), app: String::new(), busy_us: 0, calls: 0, gpu_us, shard_us }];
    };
    let g = apportion(gpu_us, &weights);
    let s = apportion(shard_us, &weights);
    callers
        .iter()
        .zip(g.into_iter().zip(s))
        .map(|(((user, app), b), (gpu_us, shard_us))| Share {
            user: user.clone(),
            app: app.clone(),
            busy_us: b.busy_us.max(0),
            calls: b.calls,
            gpu_us,
            shard_us,
        })
        .collect()
}

/// A worker job's totals over its whole life up to `now_us`: (GPU-us, shard-us).
pub fn job_totals(job: &JobRow, gpus: &[JobGpuRow], now_us: i64) -> (i64, i64) {
    let t = overlap_us(job, i64::MIN, now_us);
    let (whole, shards) = billed(job, gpus);
    (whole.saturating_mul(t), shards.saturating_mul(t))
}

/// `[from, to]` of the calls a job served.
fn call_window(job: &JobRow, now_us: i64) -> (i64, i64) {
    let start = job.start_us.unwrap_or(job.first_seen_us);
    (start, job.end_us.unwrap_or(now_us).min(now_us).saturating_add(END_SLACK_US))
}

/// `v` for the `part` of `whole` microseconds that lies in a window (exactly `v` when all of it).
pub fn prorate(v: i64, part: i64, whole: i64) -> i64 {
    if whole <= 0 || part >= whole {
        return v;
    }
    i64::try_from(i128::from(v) * i128::from(part.max(0)) / i128::from(whole)).unwrap_or(0)
}

/// The worker jobs among the jobs overlapping `[since_us, now]`: (node, job id) -> model.
pub async fn worker_jobs(pool: &AnyPool, since_us: i64) -> Result<BTreeMap<(String, i64), String>, sqlx::Error> {
    let rows: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT j.node, j.job_id, w.model FROM inference_workers w JOIN acct_jobs j ON j.job_id = w.job_id AND j.uid = w.uid \
         WHERE COALESCE(j.start_us, j.first_seen_us) >= w.submitted_us - $1 AND (j.end_us IS NULL OR j.end_us >= $2)",
    )
    .bind(START_SLACK_US)
    .bind(since_us)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(n, j, m)| ((n, j), m)).collect())
}

/// Rows of (user, app, busy-us, calls) as callers.
fn by_caller(rows: Vec<(String, String, i64, i64)>) -> BTreeMap<(String, String), Busy> {
    rows.into_iter().map(|(u, a, busy_us, calls)| ((u, a), Busy { busy_us, calls })).collect()
}

/// The calls of `model` whose interval overlaps `[from_us, to_us]`, per (user, app).
pub async fn callers(pool: &AnyPool, model: &str, from_us: i64, to_us: i64) -> Result<BTreeMap<(String, String), Busy>, sqlx::Error> {
    callers_between(pool, model, from_us, earliest_start(pool, model, from_us).await?, to_us.saturating_add(1)).await
}

/// Where the calls of `model` that ran into `from_us` can have started: from the hour that
/// holds `from_us`, or from an hour before it, up to [`MAX_CALL_US`] before, whose longest call
/// (`call_rollups.max_latency_us`) reaches `from_us`. A read of the rows from there is a range
/// of the time index over every model's rows: an hour or two of them, not the day that
/// [`MAX_CALL_US`] allows. PostgreSQL: a row of such an hour counts here once folded.
pub async fn earliest_start(pool: &AnyPool, model: &str, from_us: i64) -> Result<i64, sqlx::Error> {
    const HOUR_US: i64 = 3_600_000_000;
    let floor = from_us.saturating_sub(MAX_CALL_US);
    let hour = from_us - from_us.rem_euclid(HOUR_US);
    let first: Option<i64> = sqlx::query_scalar(
        "SELECT MIN(hour_us) FROM call_rollups WHERE resolved_model = $1 AND hour_us >= $2 AND hour_us < $3 AND hour_us + $4 + max_latency_us >= $5",
    )
    .bind(model)
    .bind(floor - floor.rem_euclid(HOUR_US))
    .bind(hour)
    .bind(HOUR_US)
    .bind(from_us)
    .fetch_one(pool)
    .await?;
    Ok(first.unwrap_or(hour).min(hour).max(floor))
}

/// The calls of `model` that started in `[start_us, before_us)` and ran into `from_us` or
/// later, per (user, app) (a range of [`callers`]' rows: ranges add up).
pub async fn callers_between(
    pool: &AnyPool,
    model: &str,
    from_us: i64,
    start_us: i64,
    before_us: i64,
) -> Result<BTreeMap<(String, String), Busy>, sqlx::Error> {
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT user_name, app, CAST(SUM(CASE WHEN latency_us > overhead_us THEN latency_us - overhead_us ELSE 0 END) AS BIGINT), \
         CAST(SUM(calls) AS BIGINT) FROM usage_log \
         WHERE resolved_model = $1 AND time_us >= $2 AND time_us < $3 AND time_us + latency_us >= $4 GROUP BY user_name, app",
    )
    .bind(model)
    .bind(start_us)
    .bind(before_us)
    .bind(from_us)
    .fetch_all(pool)
    .await?;
    Ok(by_caller(rows))
}

/// What the calls of `model` that started in `[start_us, before_us)`, before `from_us`, add to
/// the callers of a window that starts at `from_us` and whose hours come from the rollup from
/// `hour_us` (the hour that holds `from_us`, [`callers_in_hours`]): a call that ran into
/// `from_us` counts, and one that started in `[hour_us, from_us)`, which the rollup's first
/// hour counts, is taken off again (a call that is both nets out). Per (user, app); a caller can
/// come out with no calls.
pub async fn callers_before(
    pool: &AnyPool,
    model: &str,
    from_us: i64,
    hour_us: i64,
    start_us: i64,
    before_us: i64,
) -> Result<BTreeMap<(String, String), Busy>, sqlx::Error> {
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT user_name, app, CAST(SUM(w * busy) AS BIGINT), CAST(SUM(w * calls) AS BIGINT) FROM ( \
           SELECT user_name, app, calls, CASE WHEN latency_us > overhead_us THEN latency_us - overhead_us ELSE 0 END AS busy, \
             (CASE WHEN time_us + latency_us >= $4 THEN 1 ELSE 0 END) - (CASE WHEN time_us >= $5 THEN 1 ELSE 0 END) AS w \
           FROM usage_log WHERE resolved_model = $1 AND time_us >= $2 AND time_us < $3 \
           AND (time_us + latency_us >= $6 OR time_us >= $7)) r \
         GROUP BY user_name, app",
    )
    .bind(model)
    .bind(start_us)
    .bind(before_us.min(from_us))
    .bind(from_us)
    .bind(hour_us)
    .bind(from_us)
    .bind(hour_us)
    .fetch_all(pool)
    .await?;
    Ok(by_caller(rows))
}

/// The calls of `model` that started in the whole hours `[from_hour_us, before_hour_us)`, per
/// (user, app), from the hourly rollup (`call_rollups.busy_us` holds what [`callers_between`]
/// sums from the rows). PostgreSQL: what the rollup counts lags the rows until a fold
/// (`Store::fold_rollups`); a reader that needs every stored row folds first.
pub async fn callers_in_hours(
    pool: &AnyPool,
    model: &str,
    from_hour_us: i64,
    before_hour_us: i64,
) -> Result<BTreeMap<(String, String), Busy>, sqlx::Error> {
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT user_name, app, CAST(SUM(busy_us) AS BIGINT), CAST(SUM(calls) AS BIGINT) FROM call_rollups \
         WHERE resolved_model = $1 AND hour_us >= $2 AND hour_us < $3 GROUP BY user_name, app",
    )
    .bind(model)
    .bind(from_hour_us)
    .bind(before_hour_us)
    .fetch_all(pool)
    .await?;
    Ok(by_caller(rows))
}

/// A worker job's split, computed now from the usage log (live, or to be stored); with
/// `live`, from its kept sums and the rows after them.
pub async fn compute(
    pool: &AnyPool,
    job: &JobRow,
    gpus: &[JobGpuRow],
    model: &str,
    now_us: i64,
    live: Option<&LiveCallers>,
) -> Result<(i64, i64, Vec<Share>), sqlx::Error> {
    let (g, s) = job_totals(job, gpus, now_us);
    let (from, to) = call_window(job, now_us);
    let c = match live {
        Some(live) => live.callers(pool, &(job.node.clone(), job.job_id), model, from, to, now_us).await?,
        None => callers(pool, model, from, to).await?,
    };
    Ok((g, s, split(g, s, &c)))
}

/// Splits every worker job of `node` that ended at least [`SETTLE_US`] before `now_us` and is
/// not split yet, each in one transaction. Returns how many it split.
pub async fn settle(pool: &AnyPool, node: &str, now_us: i64) -> Result<usize, sqlx::Error> {
    let due: Vec<(i64, String)> = sqlx::query_as(
        "SELECT j.job_id, w.model FROM inference_workers w JOIN acct_jobs j ON j.job_id = w.job_id AND j.uid = w.uid \
         WHERE j.node = $1 AND j.end_us IS NOT NULL AND j.end_us < $2 AND COALESCE(j.start_us, j.first_seen_us) >= w.submitted_us - $3 \
         AND NOT EXISTS (SELECT 1 FROM inference_jobs i WHERE i.node = j.node AND i.job_id = j.job_id) ORDER BY j.job_id",
    )
    .bind(node)
    .bind(now_us.saturating_sub(SETTLE_US))
    .bind(START_SLACK_US)
    .fetch_all(pool)
    .await?;
    let mut done = 0;
    for (job_id, model) in due {
        let Some((job, gpus)) = db::job(pool, job_id).await?.into_iter().find(|(j, _)| j.node == node) else { continue };
        let (g, s, shares) = compute(pool, &job, &gpus, &model, now_us, None).await?;
        if store_split(pool, &job, &model, g, s, &shares, now_us).await? {
            done += 1;
            tracing::info!(
                job = job_id,
                model,
                gpu_seconds = g as f64 / 1e6,
                shard_seconds = s as f64 / 1e6,
                callers = shares.len(),
                "accounting: worker job split among its callers"
            );
        }
    }
    Ok(done)
}

/// Stores a worker job's split once; `false` when it was already stored (nothing changes).
pub async fn store_split(
    pool: &AnyPool,
    job: &JobRow,
    model: &str,
    gpu_us: i64,
    shard_us: i64,
    shares: &[Share],
    now_us: i64,
) -> Result<bool, sqlx::Error> {
    let mut tx = crate::store::begin_write(pool).await?;
    let busy: i64 = shares.iter().map(|s| s.busy_us).sum();
    let calls: i64 = shares.iter().map(|s| s.calls).sum();
    let n = sqlx::query(
        "INSERT INTO inference_jobs (node, job_id, model, gpu_us, shard_us, busy_us, calls, computed_us) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (node, job_id) DO NOTHING",
    )
    .bind(&job.node)
    .bind(job.job_id)
    .bind(model)
    .bind(gpu_us)
    .bind(shard_us)
    .bind(busy)
    .bind(calls)
    .bind(now_us)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if n == 0 {
        tx.rollback().await?;
        return Ok(false);
    }
    for s in shares {
        sqlx::query(
            "INSERT INTO inference_shares (node, job_id, model, user_name, app, busy_us, calls, gpu_us, shard_us) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&job.node)
        .bind(job.job_id)
        .bind(model)
        .bind(&s.user)
        .bind(&s.app)
        .bind(s.busy_us)
        .bind(s.calls)
        .bind(s.gpu_us)
        .bind(s.shard_us)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(true)
}

/// An `inference_shares` row: node, job id, user, app, busy, calls, GPU-us, shard-us.
type StoredShare = (String, i64, String, String, i64, i64, i64, i64);

/// The worker jobs overlapping the window that were split, and their stored shares.
async fn stored(pool: &AnyPool, since_us: i64) -> Result<(BTreeSet<(String, i64)>, BTreeMap<(String, i64), Vec<Share>>), sqlx::Error> {
    let jobs: Vec<(String, i64)> = sqlx::query_as(
        "SELECT i.node, i.job_id FROM inference_jobs i WHERE EXISTS (SELECT 1 FROM acct_jobs j WHERE j.node = i.node AND j.job_id = i.job_id \
         AND (j.end_us IS NULL OR j.end_us >= $1))",
    )
    .bind(since_us)
    .fetch_all(pool)
    .await?;
    let rows: Vec<StoredShare> = sqlx::query_as(
        "SELECT s.node, s.job_id, s.user_name, s.app, s.busy_us, s.calls, s.gpu_us, s.shard_us FROM inference_shares s \
         WHERE EXISTS (SELECT 1 FROM acct_jobs j WHERE j.node = s.node AND j.job_id = s.job_id AND (j.end_us IS NULL OR j.end_us >= $1)) \
         ORDER BY s.node, s.job_id, s.user_name, s.app",
    )
    .bind(since_us)
    .fetch_all(pool)
    .await?;
    let mut shares: BTreeMap<(String, i64), Vec<Share>> = BTreeMap::new();
    for (node, job_id, user, app, busy_us, calls, gpu_us, shard_us) in rows {
        shares.entry((node, job_id)).or_default().push(Share { user, app, busy_us, calls, gpu_us, shard_us });
    }
    Ok((jobs.into_iter().collect(), shares))
}

/// A worker job in a `gpuhub usage` window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WindowJob {
    pub node: String,
    pub job_id: i64,
    pub model: String,
    /// Split and stored ([`settle`]); else computed live from the usage log.
    pub settled: bool,
    /// The job's GPU- and shard-microseconds inside the window (the shares' sums).
    pub gpu_us: i64,
    pub shard_us: i64,
    /// The shares inside the window (prorated when the job lies partly outside it).
    pub shares: Vec<Share>,
}

/// The worker jobs among `jobs` (every job overlapping the window) with their shares inside
/// `[since_us, now_us]`: stored ones as stored, the others computed live.
pub async fn window(
    pool: &AnyPool,
    jobs: &[(JobRow, Vec<JobGpuRow>)],
    workers: &BTreeMap<(String, i64), String>,
    since_us: i64,
    now_us: i64,
    live: Option<&LiveCallers>,
) -> Result<Vec<WindowJob>, sqlx::Error> {
    let (settled, mut stored_shares) = stored(pool, since_us).await?;
    let mut out = Vec::new();
    for (job, gpus) in jobs {
        let key = (job.node.clone(), job.job_id);
        let Some(model) = workers.get(&key) else { continue };
        let is_settled = settled.contains(&key);
        let shares = if is_settled {
            stored_shares.remove(&key).unwrap_or_default()
        } else {
            compute(pool, job, gpus, model, now_us, live).await?.2
        };
        let whole = overlap_us(job, i64::MIN, now_us);
        let part = overlap_us(job, since_us, now_us);
        let shares: Vec<Share> = shares
            .into_iter()
            .map(|s| Share { gpu_us: prorate(s.gpu_us, part, whole), shard_us: prorate(s.shard_us, part, whole), ..s })
            .collect();
        out.push(WindowJob {
            node: job.node.clone(),
            job_id: job.job_id,
            model: model.clone(),
            settled: is_settled,
            gpu_us: shares.iter().map(|s| s.gpu_us).sum(),
            shard_us: shares.iter().map(|s| s.shard_us).sum(),
            shares,
        });
    }
    Ok(out)
}

/// Settled totals of `node` per (user, app, model), microseconds: (GPU, shard). Stored
/// shares never change, so these only grow (the `gpuhub_inference_*_seconds_total` counters).
pub async fn node_totals(pool: &AnyPool, node: &str) -> Result<BTreeMap<(String, String, String), (i64, i64)>, sqlx::Error> {
    let rows: Vec<(String, String, String, i64, i64)> = sqlx::query_as(
        "SELECT user_name, app, model, CAST(SUM(gpu_us) AS BIGINT), CAST(SUM(shard_us) AS BIGINT) FROM inference_shares \
         WHERE node = $1 GROUP BY user_name, app, model",
    )
    .bind(node)
    .fetch_all(pool)
    .await?;
    Ok(rows.into_iter().map(|(u, a, m, g, s)| ((u, a, m), (g, s))).collect())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn callers(v: &[(&str, &str, i64, i64)]) -> BTreeMap<(String, String), Busy> {
        v.iter().map(|(u, a, b, c)| ((u.to_string(), a.to_string()), Busy { busy_us: *b, calls: *c })).collect()
    }

    #[test]
    fn apportion_sums_exactly_and_breaks_ties_in_order() {
        assert_eq!(apportion(10, &[1, 1, 1]), vec![4, 3, 3]);
        assert_eq!(apportion(100, &[1, 3]), vec![25, 75]);
        assert_eq!(apportion(7, &[0, 5]), vec![0, 7]);
        assert_eq!(apportion(0, &[2, 3]), vec![0, 0]);
        assert_eq!(apportion(5, &[0, 0]), vec![0, 0]);
        // The largest fractional part first: 2/3 of 10 = 6.67 -> 7, 1/3 -> 3.33 -> 3.
        assert_eq!(apportion(10, &[2, 1]), vec![7, 3]);
        assert_eq!(apportion(10, &[1, 2]), vec![3, 7], "the remainder to the largest fraction, not the first");
        for total in [0i64, 1, 999_999, 7_200_000_000, i64::MAX / 4] {
            let w = [3i128, 7, 11, 0, 1];
            assert_eq!(apportion(total, &w).iter().map(|p| i128::from(*p)).sum::<i128>(), i128::from(total));
        }
    }

    #[test]
    fn split_by_busy_time_with_idle_in_proportion() {
        // A 2-GPU worker job of 100 s; alice's calls kept it busy 30 s, bob's 10 s.
        let c = callers(&[("alice", "nb", 30_000_000, 3), ("bob", "cli", 10_000_000, 1)]);
        let s = split(200_000_000, 0, &c);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].user.as_str(), s[0].gpu_us), ("alice", 150_000_000));
        assert_eq!((s[1].user.as_str(), s[1].gpu_us), ("bob", 50_000_000));
        assert_eq!(s.iter().map(|x| x.gpu_us).sum::<i64>(), 200_000_000);
        // Shards too, and an odd total: the remainder goes to the largest fraction.
        let c = callers(&[("a", "x", 1, 1), ("b", "y", 1, 1), ("c", "z", 1, 1)]);
        let s = split(0, 100, &c);
        assert_eq!(s.iter().map(|x| x.shard_us).collect::<Vec<_>>(), vec![34, 33, 33]);
    }

    #[test]
    fn no_busy_time_or_no_calls() {
        // Calls that never reached the worker (busy 0): split per call.
        let s = split(90, 0, &callers(&[("a", "x", 0, 2), ("b", "y", 0, 1)]));
        assert_eq!(s.iter().map(|x| x.gpu_us).collect::<Vec<_>>(), vec![60, 30]);
        // No call at all: one share of (idle), never the worker account.
        let s = split(90, 14, &BTreeMap::new());
        assert_eq!(s, vec![Share { user: IDLE_USER.into(), app: String::new(), busy_us: 0, calls: 0, gpu_us: 90, shard_us: 14 }]);
    }

    #[test]
    fn prorate_is_exact_for_a_whole_job() {
        assert_eq!(prorate(123_456_789, 10, 10), 123_456_789);
        assert_eq!(prorate(100, 5, 10), 50);
        assert_eq!(prorate(100, 0, 10), 0);
        assert_eq!(prorate(100, 5, 0), 100);
    }

    async fn job(pool: &AnyPool, job_id: i64, uid: i64, user: &str, (start, end): (i64, i64), (gpus, shards): (i64, i64)) {
        sqlx::query(
            "INSERT INTO acct_jobs (node, job_id, uid, user_name, account, partition, start_us, end_us, first_seen_us, last_seen_us, \
             shards, anomalies, verified, slurm_gpus, slurm_start_us, slurm_end_us) \
             VALUES ('gpu01', $1, $2, $3, 'lab', 'gpu', $4, $5, $4, $4, $6, '', 'slurmctld', $7, $4, $5)",
        )
        .bind(job_id)
        .bind(uid)
        .bind(user)
        .bind(start)
        .bind(end)
        .bind(shards)
        .bind(gpus)
        .execute(pool)
        .await
        .unwrap();
    }

    fn call(
        id: &str,
        user: &str,
        app: &str,
        model: &str,
        time_us: i64,
        latency_us: i64,
        overhead_us: i64,
    ) -> crate::gateway::usage_log::UsageRow {
        crate::gateway::usage_log::UsageRow {
            request_id: id.into(),
            time_us,
            user: user.into(),
            app: app.into(),
            requested_name: model.into(),
            resolved_model: model.into(),
            status: 200,
            latency_us,
            overhead_us,
            ..Default::default()
        }
    }

    /// A shard worker job of 100 s served alice (20 s busy) and bob (10 s busy): stored once
    /// after it ended, its shares sum to the job, `gpuhub usage` bills them and not the
    /// worker account, and the counters' sums agree. On SQLite and PostgreSQL.
    #[tokio::test]
    async fn worker_jobs_split_stored_once_and_shown_on_every_backend() {
        use crate::control::Caller;
        const S: i64 = 1_000_000;
        for (store, _dir) in crate::store::testing::stores().await {
            let pool = store.pool();
            let t = (crate::util::now_us() / S - 1000) * S;
            job(pool, 900, 990, "gpuhub-worker", (t, t + 100 * S), (0, 2)).await;
            job(pool, 901, 1000, "alice", (t, t + 50 * S), (1, 0)).await;
            // A job of the worker account the agent did not submit as a worker, and a recorded
            // worker id that Slurm ran as another uid (ids reused): neither is a worker job.
            job(pool, 902, 990, "gpuhub-worker", (t, t + 10 * S), (1, 0)).await;
            job(pool, 903, 1001, "bob", (t, t + 10 * S), (1, 0)).await;
            store.record_worker_job(900, "chat", 990, t - S).await.unwrap();
            store.record_worker_job(900, "other", 990, t).await.unwrap();
            store.record_worker_job(903, "chat", 990, t - S).await.unwrap();
            store
                .insert_usage(&[
                    call("a1", "alice", "nb", "chat", t + 10 * S, 12 * S, 2 * S),
                    call("a2", "alice", "nb", "chat", t + 30 * S, 10 * S, 0),
                    call("b1", "bob", "cli", "chat", t + 99 * S, 10 * S, 0),
                    // Another model, a call long before the job, a call after it ended.
                    call("x1", "carol", "nb", "ocr", t + 10 * S, 50 * S, 0),
                    call("x2", "carol", "nb", "chat", t - 3000 * S, 10 * S, 0),
                    call("x3", "carol", "nb", "chat", t + 102 * S, 10 * S, 0),
                ])
                .await
                .unwrap();
            let workers = worker_jobs(pool, 0).await.unwrap();
            assert_eq!(
                workers.into_iter().collect::<Vec<_>>(),
                vec![(("gpu01".to_string(), 900), "chat".to_string())],
                "{:?}",
                store.backend()
            );

            // Live, before it settled: the same split.
            let admin = Caller { uid: 0, user: "root".into(), admin: true };
            let v = super::super::api::usage_json(pool, &admin, "1d", 86_400, super::super::UsageBy::User, 14).await.unwrap();
            assert_eq!(v["inference_jobs"][0]["settled"], false, "{v}");
            assert_eq!(v["inference_jobs"][0]["shard_us"], 200 * S, "{v}");

            assert_eq!(settle(pool, "gpu01", t + 110 * S).await.unwrap(), 0, "not before SETTLE_US after the end");
            assert_eq!(settle(pool, "gpu01", t + 131 * S).await.unwrap(), 1);
            // Calls stored later change nothing: the split is stored once.
            store.insert_usage(&[call("c1", "carol", "late", "chat", t + 20 * S, 50 * S, 0)]).await.unwrap();
            assert_eq!(settle(pool, "gpu01", t + 200 * S).await.unwrap(), 0, "a re-run splits nothing again");
            let totals = node_totals(pool, "gpu01").await.unwrap();
            // 200 shard-s by busy time 20 : 10 (alice: 10 s + 10 s; bob 10 s, clipped to the
            // job by whole calls): 133.33.. and 66.66..; the remainder microsecond to bob's
            // larger fraction.
            assert_eq!(
                totals,
                BTreeMap::from([
                    (("alice".to_string(), "nb".to_string(), "chat".to_string()), (0, 133_333_333)),
                    (("bob".to_string(), "cli".to_string(), "chat".to_string()), (0, 66_666_667)),
                ]),
                "{:?}",
                store.backend()
            );
            assert_eq!(totals.values().map(|v| v.1).sum::<i64>(), 2 * 100 * S, "the shares sum to the job's shard-seconds");

            let v = super::super::api::usage_json(pool, &admin, "1d", 86_400, super::super::UsageBy::User, 14).await.unwrap();
            let rows = v["rows"].as_array().unwrap();
            assert!(rows.iter().all(|r| r["user"] != "gpuhub-worker" || r["jobs"] == 1), "only job 902 stays the worker account's: {v}");
            let row = |u: &str| rows.iter().find(|r| r["user"] == u).unwrap().clone();
            assert_eq!((row("alice")["jobs"].as_u64(), row("alice")["gpu_seconds"].as_f64()), (Some(1), Some(50.0)));
            assert_eq!(row("alice")["inference_shard_seconds"].as_f64(), Some(133.333333));
            assert_eq!((row("bob")["jobs"].as_u64(), row("bob")["inference_shard_seconds"].as_f64()), (Some(1), Some(66.666667)));
            assert_eq!(v["total"]["inference_shard_seconds"].as_f64(), Some(200.0), "{v}");
            assert_eq!(v["inference_jobs"][0]["settled"], true);
            assert!(rows.iter().all(|r| r["user"] != "carol"), "carol's calls were outside the job or after its split: {v}");
            // By account, the worker jobs stay jobs (what Slurm allocated), and the inference
            // section says whom they served.
            let v = super::super::api::usage_json(pool, &admin, "1d", 86_400, super::super::UsageBy::Account, 14).await.unwrap();
            assert_eq!(v["total"]["jobs"], 4);
            assert_eq!(v["inference"].as_array().unwrap().len(), 2);
            // A user sees their own share only.
            let bob = Caller { uid: 1001, user: "bob".into(), admin: false };
            let v = super::super::api::usage_json(pool, &bob, "1d", 86_400, super::super::UsageBy::User, 14).await.unwrap();
            let shares = v["inference_jobs"][0]["shares"].as_array().unwrap();
            assert_eq!((shares.len(), shares[0]["user"].as_str()), (1, Some("bob")), "{v}");
            assert!(v["inference_jobs"][0]["shard_us"].is_null(), "the job's total is for admins: {v}");
        }
    }
}
