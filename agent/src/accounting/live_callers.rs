//! The callers of worker jobs not split yet, kept between quota passes.
//!
//! A quota pass bills each live worker job to its callers ([`super::inference::window`]): the
//! usage rows of its model from a day before its start ([`MAX_CALL_US`]) to now. Read whole on
//! every pass (each `quota_interval_ms`, on every agent), that scan grows with the job's calls:
//! a busy worker that has served millions of calls was read in full every minute.
//!
//! Here a job's sums are kept per (user, app) for the rows that started before a horizon,
//! [`LATE_US`] ago: a row is written when its call ends, so rows older than that are taken as
//! all there. Each pass reads only the rows after the kept horizon. A call longer than
//! [`LATE_US`], or rows replayed from a journal after a store outage, may land behind the
//! horizon: they count from the next full read, every [`REFRESH_US`]. Nothing is billed from
//! here: a job's split, once it ended, is computed from every row ([`super::inference::settle`]),
//! and `gpuhub usage` reads the rows whole.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sqlx::AnyPool;

use super::inference::{Busy, MAX_CALL_US, callers_between};

/// Rows that started this long ago are taken as written.
pub const LATE_US: i64 = 10 * 60 * 1_000_000;
/// A job's kept sums are read whole again after this long.
pub const REFRESH_US: i64 = 3600 * 1_000_000;

#[derive(Debug, Clone)]
struct Kept {
    model: String,
    from_us: i64,
    /// Rows with `time_us` below this are in `busy`.
    upto_us: i64,
    busy: BTreeMap<(String, String), Busy>,
    read_whole_us: i64,
    /// Asked for since the last [`LiveCallers::sweep`].
    used: bool,
}

/// Kept sums per worker job (node, job id).
#[derive(Debug, Default)]
pub struct LiveCallers {
    jobs: Mutex<HashMap<(String, i64), Kept>>,
}

fn add(into: &mut BTreeMap<(String, String), Busy>, from: BTreeMap<(String, String), Busy>) {
    for (k, b) in from {
        let e = into.entry(k).or_default();
        e.busy_us += b.busy_us;
        e.calls += b.calls;
    }
}

impl LiveCallers {
    /// The callers of `model`'s calls overlapping `[from_us, to_us]` for job `key`, as
    /// [`super::inference::callers`] answers, reading only the rows after the kept horizon.
    pub async fn callers(
        &self,
        pool: &AnyPool,
        key: &(String, i64),
        model: &str,
        from_us: i64,
        to_us: i64,
        now_us: i64,
    ) -> Result<BTreeMap<(String, String), Busy>, sqlx::Error> {
        let kept = self.lock().remove(key);
        let mut k = match kept {
            Some(k) if k.model == model && k.from_us == from_us && now_us - k.read_whole_us < REFRESH_US && k.upto_us <= to_us + 1 => k,
            _ => Kept {
                model: model.to_string(),
                from_us,
                upto_us: from_us.saturating_sub(MAX_CALL_US),
                busy: BTreeMap::new(),
                read_whole_us: now_us,
                used: true,
            },
        };
        let horizon = now_us.saturating_sub(LATE_US).min(to_us + 1);
        if horizon > k.upto_us {
            add(&mut k.busy, callers_between(pool, model, from_us, k.upto_us, horizon).await?);
            k.upto_us = horizon;
        }
        let mut out = k.busy.clone();
        if to_us + 1 > k.upto_us {
            add(&mut out, callers_between(pool, model, from_us, k.upto_us, to_us + 1).await?);
        }
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

    async fn story(store: Store) {
        let now = crate::util::now_us();
        let pool = store.pool();
        let job = ("gpu01".to_string(), 7);
        let from = now - 2 * 3600 * S;
        // Before the job (one still running into it), old enough to be kept, recent, and
        // another model's.
        call(&store, "r1", "alice", "m", from - 10 * S, 15 * S).await;
        call(&store, "r2", "alice", "m", from - 20 * S, 5 * S).await;
        call(&store, "r3", "bob", "m", now - 3600 * S, 2 * S).await;
        call(&store, "r4", "alice", "m", now - 60 * S, S).await;
        call(&store, "r5", "carol", "other", now - 60 * S, S).await;
        let live = LiveCallers::default();
        let exact = |to: i64| callers(pool, "m", from, to);
        assert_eq!(live.callers(pool, &job, "m", from, now + S, now).await.unwrap(), exact(now + S).await.unwrap());
        assert_eq!(live.lock()[&job].upto_us, now - LATE_US, "rows from LATE_US ago on are read each pass");

        // A later pass: new rows count, the kept ones are not read again (a row changed
        // behind the horizon is not seen until the next whole read).
        call(&store, "r6", "bob", "m", now + S, S).await;
        sqlx::query("UPDATE usage_log SET latency_us = latency_us + $1 WHERE request_id = 'r3'").bind(S).execute(pool).await.unwrap();
        let later = now + 2 * S;
        let got = live.callers(pool, &job, "m", from, later + S, later).await.unwrap();
        let mut want = exact(later + S).await.unwrap();
        assert_ne!(got, want, "the kept sums hold r3 as first read");
        want.get_mut(&("bob".to_string(), "app".to_string())).unwrap().busy_us -= S;
        assert_eq!(got, want);
        // After REFRESH_US everything is read again.
        let refresh = now + REFRESH_US;
        assert_eq!(live.callers(pool, &job, "m", from, refresh + S, refresh).await.unwrap(), exact(refresh + S).await.unwrap());

        // A job that ended: its calls stop at its end.
        let ended = ("gpu01".to_string(), 8);
        assert_eq!(live.callers(pool, &ended, "m", from, now - 30 * S, now).await.unwrap(), exact(now - 30 * S).await.unwrap());
        // Jobs not asked for in a pass are forgotten at its sweep.
        live.sweep();
        assert!(live.callers(pool, &job, "m", from, refresh + S, refresh).await.is_ok());
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
