//! What a quota counts, and how it is worded: periods, GPU-equivalent microseconds per user
//! and account, and the line the plugin prints. Pure functions except [`usage_since`].

use std::collections::BTreeMap;

use sqlx::AnyPool;

use crate::accounting::db::{self, JobGpuRow, JobRow};
use crate::accounting::inference;
use crate::accounting::live_callers::LiveCallers;
use crate::accounting::usage::{billed, overlap_us};
use crate::config::{QuotaPeriod, QuotaTarget};

/// One GPU-hour in GPU-equivalent microseconds.
pub const HOUR_US: i64 = 3_600_000_000;

/// Percent at which srun/sbatch/salloc start to warn.
pub const WARN_PERCENT: f64 = 80.0;

/// The window a quota counts now: its start, and when it resets (a month's next 1st, 00:00
/// UTC; `None` for a rolling window, whose usage ages out gradually). Unix seconds.
pub fn period_bounds(period: QuotaPeriod, now_s: i64) -> (i64, Option<i64>) {
    match period {
        QuotaPeriod::Month => {
            let (y, m, _) = crate::util::civil_from_days(now_s.div_euclid(86_400));
            let start = days_from_ymd(y, m, 1) * 86_400;
            let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
            (start, Some(days_from_ymd(ny, nm, 1) * 86_400))
        }
        QuotaPeriod::Rolling(w) => (now_s - w, None),
    }
}

/// Days since 1970-01-01 of a civil date (H. Hinnant's days-from-civil).
fn days_from_ymd(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// When top-ups granted now expire: the end of the current month, or one window from now.
pub fn topup_expiry(period: QuotaPeriod, now_s: i64) -> i64 {
    match period_bounds(period, now_s) {
        (_, Some(reset)) => reset,
        (_, None) => match period {
            QuotaPeriod::Rolling(w) => now_s + w,
            QuotaPeriod::Month => now_s,
        },
    }
}

/// GPU-equivalent microseconds per user (jobs plus their share of model workers) and per
/// Slurm account (jobs only: a worker's callers are users, not accounts).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Usage {
    pub per_user: BTreeMap<String, i64>,
    pub per_account: BTreeMap<String, i64>,
}

/// Sums jobs' GPU-equivalent time inside `[since_us, now_us]`; `workers` are model worker jobs
/// (billed to their callers through `shares`, per user: GPU- and shard-microseconds).
pub fn sum_jobs(
    jobs: &[(JobRow, Vec<JobGpuRow>)],
    workers: &BTreeMap<(String, i64), String>,
    shares: &BTreeMap<String, (i64, i64)>,
    since_us: i64,
    now_us: i64,
    spg: u32,
) -> Usage {
    let spg = i128::from(spg.max(1));
    let mut u: BTreeMap<String, i128> = BTreeMap::new();
    let mut a: BTreeMap<String, i128> = BTreeMap::new();
    for (job, gpus) in jobs {
        if workers.contains_key(&(job.node.clone(), job.job_id)) {
            continue;
        }
        let t = i128::from(overlap_us(job, since_us, now_us));
        let (whole, shards) = billed(job, gpus);
        let eq = i128::from(whole) * t + i128::from(shards) * t / spg;
        let user = if job.user_name.is_empty() { job.uid.to_string() } else { job.user_name.clone() };
        *u.entry(user).or_default() += eq;
        if let Some(acct) = job.account.clone().filter(|s| !s.is_empty()) {
            *a.entry(acct).or_default() += eq;
        }
    }
    for (user, (g, s)) in shares {
        *u.entry(user.clone()).or_default() += i128::from(*g) + i128::from(*s) / spg;
    }
    let clamp = |m: BTreeMap<String, i128>| m.into_iter().map(|(k, v)| (k, i64::try_from(v).unwrap_or(i64::MAX))).collect();
    Usage { per_user: clamp(u), per_account: clamp(a) }
}

/// [`Usage`] from the store for `[since_us, now_us]`; live worker jobs' callers from `live`'s
/// kept sums (the quota pass).
pub async fn usage_since(pool: &AnyPool, since_us: i64, now_us: i64, spg: u32, live: Option<&LiveCallers>) -> Result<Usage, sqlx::Error> {
    let jobs = db::jobs_since(pool, since_us, None).await?;
    let workers = inference::worker_jobs(pool, since_us).await?;
    let mut shares: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    for w in inference::window(pool, &jobs, &workers, since_us, now_us, live).await? {
        for s in w.shares {
            let e = shares.entry(s.user).or_default();
            e.0 += s.gpu_us;
            e.1 += s.shard_us;
        }
    }
    Ok(sum_jobs(&jobs, &workers, &shares, since_us, now_us, spg))
}

/// Hours as people read them: whole hours for limits of 10 h and more, else enough decimals
/// to see a fraction of an hour move.
pub fn fmt_hours(us: i64, limit_us: i64) -> String {
    let h = us as f64 / HOUR_US as f64;
    if limit_us >= 10 * HOUR_US {
        format!("{h:.0}")
    } else if limit_us >= HOUR_US {
        format!("{h:.1}")
    } else {
        format!("{h:.3}")
    }
}

/// Percent of the limit used (a zero limit counts as 100 % used once anything is, 0 % else).
pub fn percent(used_us: i64, limit_us: i64) -> f64 {
    if limit_us <= 0 {
        return if used_us > 0 { 100.0 } else { 0.0 };
    }
    used_us as f64 * 100.0 / limit_us as f64
}

/// Who a quota's line speaks to: `you have`, `your group ml has`, `your account lab has`.
fn subject(target: &QuotaTarget) -> String {
    match target {
        QuotaTarget::User(_) => "you have".into(),
        QuotaTarget::Group(g) => format!("your group {g} has"),
        QuotaTarget::Account(a) => format!("your account {a} has"),
    }
}

/// The line srun, sbatch and salloc print (through the snapshot), or `None` under 80 %.
/// Over the limit it says which quota, how much is used, Slurm's reason and when it resets.
pub fn note(target: &QuotaTarget, period: QuotaPeriod, used_us: i64, limit_us: i64, resets_s: Option<i64>) -> Option<String> {
    let pct = percent(used_us, limit_us);
    if pct < WARN_PERCENT {
        return None;
    }
    let (used, limit) = (fmt_hours(used_us, limit_us), fmt_hours(limit_us, limit_us));
    let period_phrase = period.phrase();
    if used_us < limit_us {
        return Some(format!("gpuhub: {} used {used} of {limit} GPU-hours {period_phrase} ({pct:.0} %)", subject(target)));
    }
    let reset = match resets_s {
        Some(t) => format!("it resets on {}", crate::util::utc_time(t)),
        None => format!("usage older than {} no longer counts", period.as_string()),
    };
    let reason = super::slurm::HELD_REASON;
    Some(format!(
        "gpuhub: quota {} is used up: {used} of {limit} GPU-hours {period_phrase} ({pct:.0} %); new GPU jobs stay pending \
         (squeue reason {reason}) until {reset} or an admin grants a top-up (gpuhub quota grant); running jobs are not stopped",
        target.key()
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn months_start_on_the_first_and_reset_on_the_next() {
        // 2026-12-01 20:35:00 UTC
        let now = 1_796_157_300;
        let (start, reset) = period_bounds(QuotaPeriod::Month, now);
        assert_eq!(crate::util::utc_time(start), "2026-12-01 00:00:00 UTC");
        assert_eq!(crate::util::utc_time(reset.unwrap()), "2027-01-01 00:00:00 UTC");
        let (start, reset) = period_bounds(QuotaPeriod::Month, 1_771_000_000); // 2026-02-13
        assert_eq!(crate::util::utc_time(start), "2026-02-01 00:00:00 UTC");
        assert_eq!(crate::util::utc_time(reset.unwrap()), "2026-03-01 00:00:00 UTC");
        assert_eq!(period_bounds(QuotaPeriod::Rolling(7 * 86_400), now), (now - 7 * 86_400, None));
        assert_eq!(topup_expiry(QuotaPeriod::Month, now), reset_of(now));
        assert_eq!(topup_expiry(QuotaPeriod::Rolling(3_600), now), now + 3_600);
    }

    fn reset_of(now: i64) -> i64 {
        period_bounds(QuotaPeriod::Month, now).1.unwrap()
    }

    #[test]
    fn the_issue_s_line_and_the_held_line() {
        let alice = QuotaTarget::User("alice".into());
        assert_eq!(note(&alice, QuotaPeriod::Month, 159 * HOUR_US, 200 * HOUR_US, None), None, "79.5 % does not warn");
        assert!(note(&alice, QuotaPeriod::Month, 160 * HOUR_US, 200 * HOUR_US, None).is_some(), "80 % does");
        let n = note(&alice, QuotaPeriod::Month, 172 * HOUR_US, 200 * HOUR_US, Some(0)).unwrap();
        assert_eq!(n, "gpuhub: you have used 172 of 200 GPU-hours this month (86 %)");
        let n = note(&QuotaTarget::Group("ml".into()), QuotaPeriod::Rolling(86_400), 96 * HOUR_US / 1000, HOUR_US / 10, None).unwrap();
        assert_eq!(n, "gpuhub: your group ml has used 0.096 of 0.100 GPU-hours in the last 1d (96 %)");
        let n = note(&alice, QuotaPeriod::Month, 212 * HOUR_US, 200 * HOUR_US, Some(1_798_761_600)).unwrap();
        assert!(n.starts_with("gpuhub: quota user:alice is used up: 212 of 200 GPU-hours this month (106 %)"), "{n}");
        assert!(n.contains("AssocGrpGRES") && n.contains("resets on 2027-01-01 00:00:00 UTC") && n.contains("gpuhub quota grant"), "{n}");
    }

    #[test]
    fn jobs_shards_and_inference_sum_per_user_and_account() {
        let mut a = JobRow::new("n", 1, 1000, "alice", 0);
        a.start_us = Some(0);
        a.end_us = Some(10 * HOUR_US);
        a.slurm_gpus = Some(2);
        a.account = Some("lab".into());
        let mut b = JobRow::new("n", 2, 1001, "bob", 0);
        b.start_us = Some(0);
        b.end_us = Some(14 * HOUR_US);
        b.slurm_gpus = Some(0);
        b.shards = 7;
        b.account = Some("lab".into());
        let mut w = JobRow::new("n", 3, 999, "gpuhub-worker", 0);
        w.start_us = Some(0);
        w.slurm_gpus = Some(1);
        let jobs = vec![(a, vec![]), (b, vec![]), (w, vec![])];
        let workers = BTreeMap::from([(("n".to_string(), 3), "m".to_string())]);
        let shares = BTreeMap::from([("alice".to_string(), (HOUR_US, 14 * HOUR_US))]);
        let u = sum_jobs(&jobs, &workers, &shares, 0, 20 * HOUR_US, 14);
        assert_eq!(u.per_user["alice"], 20 * HOUR_US + HOUR_US + HOUR_US, "2 GPUs x 10 h, plus 1 GPU-h and 14 shard-h of inference");
        assert_eq!(u.per_user["bob"], 7 * HOUR_US, "7 shards x 14 h / 14 per GPU");
        assert!(!u.per_user.contains_key("gpuhub-worker"), "a worker job is billed to its callers");
        assert_eq!(u.per_account["lab"], 27 * HOUR_US);
        // Half the window: half the time.
        let u = sum_jobs(&jobs, &workers, &BTreeMap::new(), 5 * HOUR_US, 20 * HOUR_US, 14);
        assert_eq!(u.per_user["alice"], 10 * HOUR_US);
    }

    /// The quota pass's usage with a running worker job's callers from the kept sums (whole
    /// hours from the rollup) is the usage read from every row, pass after pass, and bills the
    /// job to its callers, not to the worker account. On SQLite and PostgreSQL.
    #[tokio::test]
    async fn a_running_worker_job_is_billed_to_its_callers_from_the_kept_sums_on_every_backend() {
        use crate::gateway::usage_log::UsageRow;
        const S: i64 = 1_000_000;
        for (store, _dir) in crate::store::testing::stores().await {
            let pool = store.pool();
            let now = (crate::util::now_us() / S) * S;
            let start = now - 3 * HOUR_US - 20 * 60 * S;
            sqlx::query(
                "INSERT INTO acct_jobs (node, job_id, uid, user_name, account, partition, start_us, end_us, first_seen_us, last_seen_us, \
                 shards, anomalies, verified, slurm_gpus, slurm_start_us, slurm_end_us) \
                 VALUES ('gpu01', 900, 990, 'gpuhub-worker', 'lab', 'gpu', $1, NULL, $1, $1, 0, '', 'slurmctld', 1, $1, NULL)",
            )
            .bind(start)
            .execute(pool)
            .await
            .unwrap();
            store.record_worker_job(900, "chat", 990, start - S).await.unwrap();
            let row = |id: String, user: &str, time_us: i64, latency_us: i64| UsageRow {
                request_id: id,
                time_us,
                user: user.into(),
                app: "nb".into(),
                requested_name: "chat".into(),
                resolved_model: "chat".into(),
                status: 200,
                latency_us,
                overhead_us: 2_000,
                ..Default::default()
            };
            // Every 7 minutes alice, every 11 bob (longer calls), over the job's life so far.
            let mut rows: Vec<UsageRow> = (0..29).map(|i| row(format!("a{i}"), "alice", start + i * 7 * 60 * S, 3 * S)).collect();
            rows.extend((0..19).map(|i| row(format!("b{i}"), "bob", start - 5 * S + i * 11 * 60 * S, 8 * S)));
            store.insert_usage(&rows).await.unwrap();
            let live = crate::accounting::live_callers::LiveCallers::default();
            let since = now - 24 * HOUR_US;
            for pass in 0..3 {
                let at = now + pass * 60 * S;
                if pass == 2 {
                    store.insert_usage(&[row("late".into(), "carol", at - 30 * S, 20 * S)]).await.unwrap();
                }
                store.fold_rollups().await.unwrap();
                let kept = usage_since(pool, since, at, 28, Some(&live)).await.unwrap();
                let whole = usage_since(pool, since, at, 28, None).await.unwrap();
                assert_eq!(kept, whole, "{:?}, pass {pass}", store.backend());
                assert!(!kept.per_user.contains_key("gpuhub-worker"), "{kept:?}");
                let (a, b) = (kept.per_user["alice"], kept.per_user["bob"]);
                assert!(a > 0 && b > 0 && a + b + kept.per_user.get("carol").copied().unwrap_or(0) == at - start, "{kept:?}");
                assert_eq!(kept.per_user.contains_key("carol"), pass == 2);
            }
        }
    }
}
