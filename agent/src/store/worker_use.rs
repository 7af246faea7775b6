//! Several gateways on one store (`models::single_flight`): the lock that lets one gateway at a
//! time start a model's worker, the workers other agents own (a gateway routes to them with
//! the key from their row), and when each worker was last used through any gateway (the
//! owner's idle unload reads it).

use sqlx::{Connection, Row};

use super::{Store, StoreError, WorkerRow};

/// A PostgreSQL session-level advisory lock, held on a connection of its own outside the pool:
/// a start holds its lock for a whole cold load, and locks taken from the pool would leave
/// the gateway's queries none once `store.max_connections` loads start at once. Release it with
/// [`ClusterLock::release`]; a lock dropped without it closes its connection, which ends the
/// session and so releases the lock too.
#[derive(Debug)]
pub struct ClusterLock {
    conn: Option<sqlx::PgConnection>,
    key: i64,
}

impl ClusterLock {
    pub async fn release(mut self) {
        if let Some(mut conn) = self.conn.take() {
            let unlocked = sqlx::query("SELECT pg_advisory_unlock($1)").bind(self.key).execute(&mut conn).await;
            if let Err(e) = unlocked {
                tracing::warn!(key = self.key, error = %e, "cannot release a worker start lock; closing its connection instead");
            }
            drop(conn.close_hard().await);
        }
    }
}

/// A connection of its own for taking a [`ClusterLock`]: a gateway waiting for another's start
/// asks again on it every poll instead of opening a connection each time.
#[derive(Debug)]
pub struct LockSession(sqlx::PgConnection);

impl LockSession {
    /// Takes the lock `key` on this session if nobody holds it; else gives the session back.
    pub async fn try_lock(mut self, key: i64) -> Result<Result<ClusterLock, LockSession>, StoreError> {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)").bind(key).fetch_one(&mut self.0).await?;
        Ok(if got { Ok(ClusterLock { conn: Some(self.0), key }) } else { Err(self) })
    }
}

impl Store {
    /// A session for [`ClusterLock`]s (PostgreSQL only; `None` on SQLite, which has no locks).
    pub async fn lock_session(&self) -> Result<Option<LockSession>, StoreError> {
        let Some(super::PgConnect(opts)) = &self.pg else {
            return Ok(None);
        };
        match tokio::time::timeout(super::ACQUIRE_TIMEOUT, sqlx::PgConnection::connect_with(opts)).await {
            Ok(conn) => Ok(Some(LockSession(conn?))),
            Err(_) => Err(StoreError::Query(sqlx::Error::PoolTimedOut)),
        }
    }

    /// Takes the cluster-wide advisory lock `key` if nobody holds it (PostgreSQL only;
    /// `Ok(None)` when another session holds it, and always on SQLite). For tests: the start
    /// path keeps one [`LockSession`] while it waits.
    #[cfg(test)]
    pub async fn try_cluster_lock(&self, key: i64) -> Result<Option<ClusterLock>, StoreError> {
        let Some(session) = self.lock_session().await? else { return Ok(None) };
        Ok(session.try_lock(key).await?.ok())
    }

    /// The workers of `model` that agents other than `owner` own and whose address is known
    /// (ready, or adopted), newest first.
    pub async fn others_workers(&self, owner: &str, model: &str) -> Result<Vec<WorkerRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {} FROM model_workers WHERE model = $1 AND owner NOT IN ($2, '') AND base_url <> '' ORDER BY started_us DESC",
            super::models::WORKER_COLUMNS
        ))
        .bind(model)
        .bind(owner)
        .fetch_all(self.pool())
        .await?;
        super::models::worker_rows(&rows)
    }

    /// Records that worker `instance_id` was used at `used_us` (a later time only moves it on).
    pub async fn touch_worker_use(&self, launcher: &str, instance_id: &str, used_us: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO worker_use (launcher, instance_id, last_used_us) VALUES ($1, $2, $3) \
             ON CONFLICT (launcher, instance_id) DO UPDATE SET last_used_us = \
             CASE WHEN excluded.last_used_us > worker_use.last_used_us THEN excluded.last_used_us ELSE worker_use.last_used_us END",
        )
        .bind(launcher)
        .bind(instance_id)
        .bind(used_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Records that a gateway found worker `instance_id` unreachable at `at_us` while its job
    /// ran (its owner checks it: [`Store::unreachable_workers`]). It tried to use it then.
    pub async fn report_worker_unreachable(&self, launcher: &str, instance_id: &str, at_us: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO worker_use (launcher, instance_id, last_used_us, unreachable_us) VALUES ($1, $2, $3, $3) \
             ON CONFLICT (launcher, instance_id) DO UPDATE SET unreachable_us = excluded.unreachable_us",
        )
        .bind(launcher)
        .bind(instance_id)
        .bind(at_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// The workers of `launcher` another gateway found unreachable, with when (the latest report).
    pub async fn unreachable_workers(&self, launcher: &str) -> Result<Vec<(String, i64)>, StoreError> {
        let rows = sqlx::query("SELECT instance_id, unreachable_us FROM worker_use WHERE launcher = $1 AND unreachable_us > 0")
            .bind(launcher)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect()
    }

    /// When worker `instance_id` was last used through another gateway (`None`: never).
    pub async fn worker_last_used(&self, launcher: &str, instance_id: &str) -> Result<Option<i64>, StoreError> {
        let row = sqlx::query("SELECT last_used_us FROM worker_use WHERE launcher = $1 AND instance_id = $2")
            .bind(launcher)
            .bind(instance_id)
            .fetch_optional(self.pool())
            .await?;
        Ok(match row {
            Some(r) => Some(r.try_get(0)?),
            None => None,
        })
    }

    /// Forgets a stopped worker's use (and rows older than a week, whose workers are long gone).
    pub async fn forget_worker_use(&self, launcher: &str, instance_id: &str) -> Result<(), StoreError> {
        let week_ago = crate::util::now_us() - 7 * 86_400 * 1_000_000;
        sqlx::query("DELETE FROM worker_use WHERE (launcher = $1 AND instance_id = $2) OR last_used_us < $3")
            .bind(launcher)
            .bind(instance_id)
            .bind(week_ago)
            .execute(self.pool())
            .await?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::{Backend, testing};

    fn row(owner: &str, id: &str, url: &str) -> WorkerRow {
        WorkerRow {
            owner: owner.into(),
            model: "demo-chat".into(),
            launcher: "slurm".into(),
            instance_id: id.into(),
            base_url: url.into(),
            api_key: format!("key-{id}"),
            version: None,
            log_path: "/tmp/x.log".into(),
            started_us: 1_700_000_000_000_000,
        }
    }

    #[tokio::test]
    async fn others_workers_and_last_use_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            store.put_worker(&row("gpu01", "41", "http://10.77.0.11:9000")).await.unwrap();
            store.put_worker(&row("gpu02", "42", "")).await.unwrap();
            assert!(store.others_workers("gpu01", "demo-chat").await.unwrap().is_empty(), "gpu02's worker has no address yet");
            store.put_worker(&row("gpu02", "42", "http://10.77.0.12:9001")).await.unwrap();
            let seen = store.others_workers("gpu01", "demo-chat").await.unwrap();
            assert_eq!(seen, vec![row("gpu02", "42", "http://10.77.0.12:9001")], "{:?}", store.backend());
            assert_eq!(store.others_workers("gpu02", "demo-chat").await.unwrap()[0].instance_id, "41");
            assert!(store.others_workers("gpu01", "other-model").await.unwrap().is_empty());

            assert_eq!(store.worker_last_used("slurm", "42").await.unwrap(), None);
            store.touch_worker_use("slurm", "42", 2_000).await.unwrap();
            store.touch_worker_use("slurm", "42", 1_000).await.unwrap();
            assert_eq!(store.worker_last_used("slurm", "42").await.unwrap(), Some(2_000), "an older use does not move it back");
            store.touch_worker_use("slurm", "42", 3_000).await.unwrap();
            assert_eq!(store.worker_last_used("slurm", "42").await.unwrap(), Some(3_000));
            store.forget_worker_use("slurm", "42").await.unwrap();
            assert_eq!(store.worker_last_used("slurm", "42").await.unwrap(), None);

            // A worker another gateway could not reach: reported with when, a use at that time.
            let now = crate::util::now_us();
            store.touch_worker_use("slurm", "43", now - 2).await.unwrap();
            assert!(store.unreachable_workers("slurm").await.unwrap().is_empty(), "a use is not a report");
            store.report_worker_unreachable("slurm", "43", now - 1).await.unwrap();
            store.report_worker_unreachable("slurm", "44", now).await.unwrap();
            let mut seen = store.unreachable_workers("slurm").await.unwrap();
            seen.sort();
            assert_eq!(seen, vec![("43".to_string(), now - 1), ("44".to_string(), now)], "{:?}", store.backend());
            assert_eq!(store.worker_last_used("slurm", "44").await.unwrap(), Some(now), "a first report is a use");
            assert_eq!(store.worker_last_used("slurm", "43").await.unwrap(), Some(now - 2));
            assert!(store.unreachable_workers("local").await.unwrap().is_empty());
            store.forget_worker_use("slurm", "43").await.unwrap();
            assert_eq!(
                store.unreachable_workers("slurm").await.unwrap(),
                vec![("44".to_string(), now)],
                "a stopped worker's report goes with it"
            );
        }
    }

    #[tokio::test]
    async fn the_cluster_lock_is_exclusive_and_released() {
        for (store, _dir) in testing::stores().await {
            let first = store.try_cluster_lock(7).await.unwrap();
            if store.backend() == Backend::Sqlite {
                assert!(first.is_none(), "SQLite has no cluster lock");
                continue;
            }
            let first = first.unwrap();
            assert!(store.try_cluster_lock(7).await.unwrap().is_none(), "a held lock is refused to another session");
            let other = store.try_cluster_lock(8).await.unwrap();
            assert!(other.is_some(), "another key is independent");
            first.release().await;
            let again = store.try_cluster_lock(7).await.unwrap();
            assert!(again.is_some(), "a released lock can be taken");
            // Dropped without release: its session closes, so the lock is free again.
            drop(again);
            let mut freed = None;
            for _ in 0..50 {
                freed = store.try_cluster_lock(7).await.unwrap();
                if freed.is_some() {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            assert!(freed.is_some(), "a dropped lock's session ends and frees it");
            if let Some(l) = freed {
                l.release().await;
            }
            if let Some(l) = other {
                l.release().await;
            }
            // More loads at once than the pool has connections (8): each lock has its own, and
            // the gateway's queries still get one.
            let mut held = Vec::new();
            for key in 100..110 {
                held.push(store.try_cluster_lock(key).await.unwrap().expect("a free key"));
            }
            let answered = tokio::time::timeout(std::time::Duration::from_secs(2), sqlx::query("SELECT 1").execute(store.pool())).await;
            assert!(answered.is_ok_and(|r| r.is_ok()), "the pool is not used up by start locks");
            for l in held {
                l.release().await;
            }
        }
    }
}
