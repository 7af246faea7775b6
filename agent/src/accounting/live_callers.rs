//! The callers of worker jobs not split yet, kept between quota passes.
//!
//! A quota pass bills each live worker job to its callers ([`super::inference::window`]): the
//! usage rows of its model that overlap the job. Read from the rows on every pass (each
//! `quota_interval_ms`, on every agent), that scan grows with the job's calls: at 2,000 calls/s
//! one model has 1.2 M rows in 10 minutes, which PostgreSQL took ~0.35 s to sum (`EXPLAIN
//! ANALYZE`, 2026-12-05), and a job's whole life was read again hourly (BENCHMARKS.md, "Quota
//! pass").
//!
//! A job's window is read in parts, each kept per (user, app) between passes:
//! - its *hours*, from the hourly rollup (`call_rollups.busy_us`, migration 0021) from the hour
//!   it started in: a pass reads the hours not kept yet, a few rollup rows per caller however
//!   busy the model (while the job runs, the current hour's calls that started after now count
//!   too: only a node whose clock is ahead stores such calls, which a read of the rows leaves
//!   out);
//! - less the calls of that first hour that started before the job, which the rollup counts,
//!   plus those that started before the job and ran into it (a call that waited for the worker
//!   to load started before it), in one read of the rows before its start, from the hour it
//!   started in or an earlier one whose longest call reaches it
//!   ([`super::inference::callers_before`], [`super::inference::earliest_start`]);
//! - and an ended job's *last hour*, up to its end, from the rows.
//!
//! Rows (and hours) that started before a horizon, [`LATE_US`] ago, are taken as all there (a
//! row is written when its call ends) and kept; each pass reads only what comes after: once a
//! job is [`LATE_US`] old, no row before its start is read again. A call longer than
//! [`LATE_US`], or rows replayed from a journal after a store outage, may land behind the
//! horizon: in the hours they count from the next read of the job's hours, every
//! [`REFRESH_US`] (a rollup read, cheap); before the job's start they are not seen here.
//! Nothing is billed from here: a job's split, once it ended, is computed from every row
//! ([`super::inference::settle`]), and `gpuhub usage` reads the rows whole. PostgreSQL: the
//! rollup counts a row once it is folded in; the quota pass folds before it reads.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sqlx::AnyPool;

use super::inference::{Busy, callers_before, callers_between, callers_in_hours, earliest_start};

/// Rows that started this long ago are taken as written.
pub const LATE_US: i64 = 10 * 60 * 1_000_000;
/// A job's hours are read again after this long.
pub const REFRESH_US: i64 = 3600 * 1_000_000;
const HOUR_US: i64 = 3_600_000_000;

type Callers = BTreeMap<(String, String), Busy>;

/// Sums of one part of a job's window: everything before `upto_us` is in `busy`.
#[derive(Debug, Clone)]
struct Part {
    upto_us: i64,
    busy: Callers,
}

impl Part {
    fn new(upto_us: i64) -> Self {
        Self { upto_us, busy: BTreeMap::new() }
    }

    /// This part's sums over `[upto_us, end_us)`, keeping what lies before `horizon_us`:
    /// `read(a, b)` answers the callers of `[a, b)`.
    async fn read<F, Fut>(&mut self, end_us: i64, horizon_us: i64, read: F) -> Result<Callers, sqlx::Error>
    where
        F: Fn(i64, i64) -> Fut,
        Fut: std::future::Future<Output = Result<Callers, sqlx::Error>>,
    {
        let keep = horizon_us.min(end_us);
        if keep > self.upto_us {
            add(&mut self.busy, read(self.upto_us, keep).await?);
            self.upto_us = keep;
        }
        let mut out = self.busy.clone();
        if end_us > self.upto_us {
            add(&mut out, read(self.upto_us, end_us).await?);
        }
        Ok(out)
    }
}

#[derive(Debug, Clone)]
struct Kept {
    model: String,
    from_us: i64,
    /// Rows of the calls that started before the job: those that ran into it, less those of
    /// its first hour ([`callers_before`]).
    before: Part,
    /// The rollup's hours from the job's first (`upto_us`: an hour's start).
    hours: Part,
    hours_read_us: i64,
    /// Rows of an ended job's last hour: where they start, and the sums.
    last: Option<(i64, Part)>,
    /// Asked for since the last [`LiveCallers::sweep`].
    used: bool,
}

/// Kept sums per worker job (node, job id).
#[derive(Debug, Default)]
pub struct LiveCallers {
    jobs: Mutex<HashMap<(String, i64), Kept>>,
}

fn add(into: &mut Callers, from: Callers) {
    for (k, b) in from {
        let e = into.entry(k).or_default();
        e.busy_us += b.busy_us;
        e.calls += b.calls;
    }
}

fn hour_floor(us: i64) -> i64 {
    us - us.rem_euclid(HOUR_US)
}

impl LiveCallers {
    /// The callers of `model`'s calls overlapping `[from_us, to_us]` for job `key`, as
    /// [`super::inference::callers`] answers (PostgreSQL: with every folded row), reading only
    /// what the kept sums lack.
    pub async fn callers(
        &self,
        pool: &AnyPool,
        key: &(String, i64),
        model: &str,
        from_us: i64,
        to_us: i64,
        now_us: i64,
    ) -> Result<Callers, sqlx::Error> {
        let end = to_us.saturating_add(1);
        if end <= from_us {
            // A window that ends before it starts (a job's records out of order): read whole.
            return callers_between(pool, model, from_us, earliest_start(pool, model, from_us).await?, end).await;
        }
        // An ended job's window (`end` not after now) stops at its end; a running job's takes
        // every hour to come.
        let first_hour = hour_floor(from_us);
        let ended = end <= now_us;
        let hours_end = if ended { hour_floor(end).max(first_hour) } else { i64::MAX };
        let kept = self.lock().remove(key);
        let mut k = match kept {
            Some(k) if k.model == model && k.from_us == from_us => k,
            _ => Kept {
                model: model.to_string(),
                from_us,
                before: Part::new(earliest_start(pool, model, from_us).await?),
                hours: Part::new(first_hour),
                hours_read_us: now_us,
                last: None,
                used: true,
            },
        };
        if now_us - k.hours_read_us >= REFRESH_US || k.hours.upto_us > hours_end {
            k.hours = Part::new(first_hour);
            k.hours_read_us = now_us;
        }
        let horizon = now_us.saturating_sub(LATE_US);
        let mut out = k.before.read(from_us, horizon, |a, b| callers_before(pool, model, from_us, first_hour, a, b)).await?;
        add(&mut out, k.hours.read(hours_end, hour_floor(horizon), |a, b| callers_in_hours(pool, model, a, b)).await?);
        if ended && end > hours_end {
            let mut last = match k.last.take() {
                Some((start, part)) if start == hours_end && part.upto_us <= end => part,
                _ => Part::new(hours_end),
            };
            // Every call from the hour's start: in the hour the job started, `before` took the
            // ones before it off again.
            add(&mut out, last.read(end, horizon, |a, b| callers_between(pool, model, i64::MIN, a, b)).await?);
            k.last = Some((hours_end, last));
        }
        // A caller whose calls of the first hour all started before the job.
        out.retain(|_, b| b.calls != 0);
        k.used = true;
        self.lock().insert(key.clone(), k);
        Ok(out)
    }

    /// Forgets the jobs not asked for since the last sweep (split, or out of every quota
    /// window): call it once per pass.
    pub fn sweep(&self) {
        self.lock().retain(|_, k| std::mem::take(&mut k.used));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, i64), Kept>> {
        self.jobs.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::accounting::inference::callers;
    use crate::gateway::usage_log::UsageRow;
    use crate::store::{Store, testing};

    const S: i64 = 1_000_000;

    async fn call(store: &Store, id: &str, user: &str, model: &str, time_us: i64, latency_us: i64) {
        let row = UsageRow {
            request_id: id.into(),
            time_us,
            user: user.into(),
            app: "app".into(),
            resolved_model: model.into(),
            status: 200,
            latency_us,
            overhead_us: 1_000,
            ..UsageRow::default()
        };
        assert_eq!(store.insert_usage(&[row]).await.unwrap(), 1);
    }

    /// The callers of a window read from every row from a day before it (the definition,
    /// without [`earliest_start`]'s bound); PostgreSQL: after the waiting rows are folded into
    /// the rollups, as the quota pass does before it reads. [`callers`] answers the same.
    async fn exact(store: &Store, from: i64, to: i64) -> BTreeMap<(String, String), Busy> {
        store.fold_rollups().await.unwrap();
        let all = callers_between(store.pool(), "m", from, from - crate::accounting::inference::MAX_CALL_US, to + 1).await.unwrap();
        assert_eq!(callers(store.pool(), "m", from, to).await.unwrap(), all, "callers() from earliest_start");
        all
    }

    async fn story(store: Store) {
        let pool = store.pool();
        // A job that started at 10:20, read at 12:30.
        let h = hour_floor(1_800_000_000 * S);
        let from = h - 2 * HOUR_US + 20 * 60 * S;
        let now = h + 30 * 60 * S;
        let job = ("gpu01".to_string(), 7);
        // Before the job: a call that ran into it, one that ended before it, and a caller
        // whose only call of its first hour ended before it; then a call after its start, a
        // whole hour, the current hour, another model's.
        call(&store, "r1", "alice", "m", from - 10 * S, 15 * S).await;
        call(&store, "r2", "alice", "m", from - 20 * S, 5 * S).await;
        call(&store, "r0", "gina", "m", from - 15 * 60 * S, S).await;
        // Three hours before it, a call that ran into it, and an hour later a short one.
        call(&store, "r9", "hank", "m", from - 3 * HOUR_US, 3 * HOUR_US + 60 * S).await;
        call(&store, "r10", "hank", "m", from - 2 * HOUR_US, S).await;
        call(&store, "r3", "dave", "m", from + 60 * S, 3 * S).await;
        call(&store, "r4", "bob", "m", h - 30 * 60 * S, 2 * S).await;
        call(&store, "r5", "alice", "m", now - 60 * S, S).await;
        call(&store, "r6", "carol", "other", now - 60 * S, S).await;
        let live = LiveCallers::default();
        let want = exact(&store, from, now + S).await;
        assert_eq!(want.len(), 4, "alice, bob, dave and hank: {want:?}");
        assert_eq!(want[&("hank".to_string(), "app".to_string())].calls, 1);
        assert_eq!(live.callers(pool, &job, "m", from, now + S, now).await.unwrap(), want);
        {
            let jobs = live.lock();
            let k = &jobs[&job];
            assert_eq!(k.before.upto_us, from, "nothing before the job is read again");
            assert_eq!(k.hours.upto_us, h, "the closed hours are kept, the current one read each pass");
            assert!(k.last.is_none(), "a running job has no last hour");
        }

        // A later pass: a new call counts; one written late into the kept hour does not until
        // the hours are read again (REFRESH_US).
        call(&store, "r7", "bob", "m", now + S, S).await;
        call(&store, "r8", "erin", "m", h - 10 * 60 * S, 2 * S).await;
        let later = now + 2 * S;
        let mut want = exact(&store, from, later + S).await;
        let got = live.callers(pool, &job, "m", from, later + S, later).await.unwrap();
        assert_ne!(got, want, "r8 landed behind the horizon");
        want.remove(&("erin".to_string(), "app".to_string()));
        assert_eq!(got, want);
        let refresh = now + REFRESH_US;
        assert_eq!(live.callers(pool, &job, "m", from, refresh + S, refresh).await.unwrap(), exact(&store, from, refresh + S).await);

        // The job ends (its window stops at its end: r5 in, r7 out), read in the same pass and
        // again past LATE_US; a job that ended in the hour it started.
        let end = now - 30 * S;
        for at in [refresh, refresh + LATE_US] {
            assert_eq!(live.callers(pool, &job, "m", from, end, at).await.unwrap(), exact(&store, from, end).await, "at {at}");
        }
        assert!(live.lock()[&job].last.is_some());
        let short = ("gpu01".to_string(), 8);
        assert_eq!(live.callers(pool, &short, "m", from, from + 120 * S, now).await.unwrap(), exact(&store, from, from + 120 * S).await);

        // A job younger than LATE_US: its first hour's calls before it are read each pass.
        let young = ("gpu02".to_string(), 9);
        let born = now - 5 * 60 * S;
        for at in [now, later] {
            assert_eq!(live.callers(pool, &young, "m", born, at + S, at).await.unwrap(), exact(&store, born, at + S).await);
        }

        // Jobs not asked for in a pass are forgotten at its sweep.
        live.sweep();
        assert!(live.callers(pool, &job, "m", from, end, refresh).await.is_ok());
        live.sweep();
        assert_eq!(live.lock().keys().cloned().collect::<Vec<_>>(), vec![job]);
    }

    #[tokio::test]
    async fn kept_sums_match_a_whole_read_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            story(store).await;
        }
    }
}
