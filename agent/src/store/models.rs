//! Model worker jobs (adoption after an agent restart). Several agents may share one store (one
//! per GPU node): every row names its `owner`, the agent that started the worker and manages it,
//! and an agent reads, replaces and deletes only its own rows (and the owner-less rows from
//! before owners existed, which it takes over).

use sqlx::Row;

use super::{Store, StoreError};

/// The columns of `model_workers` that [`worker_rows`] reads, in its order.
pub(super) const WORKER_COLUMNS: &str = "owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us";

/// [`WorkerRow`]s from rows that selected [`WORKER_COLUMNS`].
pub(super) fn worker_rows(rows: &[sqlx::any::AnyRow]) -> Result<Vec<WorkerRow>, StoreError> {
    rows.iter()
        .map(|r| {
            Ok(WorkerRow {
                owner: r.try_get(0)?,
                model: r.try_get(1)?,
                launcher: r.try_get(2)?,
                instance_id: r.try_get(3)?,
                base_url: r.try_get(4)?,
                api_key: r.try_get(5)?,
                version: r.try_get(6)?,
                log_path: r.try_get(7)?,
                started_us: r.try_get(8)?,
            })
        })
        .collect::<Result<_, sqlx::Error>>()
        .map_err(StoreError::from)
}

/// One live worker as the store remembers it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRow {
    /// The agent that started the worker and manages it (its Slurm node name).
    pub owner: String,
    pub model: String,
    pub launcher: String,
    pub instance_id: String,
    pub base_url: String,
    pub api_key: String,
    pub version: Option<String>,
    pub log_path: String,
    pub started_us: i64,
}

impl Store {
    /// Records (or updates) one worker; a model's replicas are one row each.
    pub async fn put_worker(&self, w: &WorkerRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO model_workers (owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (owner, model, instance_id) DO UPDATE SET launcher = excluded.launcher, \
             base_url = excluded.base_url, api_key = excluded.api_key, version = excluded.version, \
             log_path = excluded.log_path, started_us = excluded.started_us",
        )
        .bind(&w.owner)
        .bind(&w.model)
        .bind(&w.launcher)
        .bind(&w.instance_id)
        .bind(&w.base_url)
        .bind(&w.api_key)
        .bind(&w.version)
        .bind(&w.log_path)
        .bind(w.started_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Keeps, for good, that Slurm job `job_id` is `model`'s worker, submitted by this agent as
    /// the worker account `uid`: accounting bills such a job to the callers it served
    /// (`accounting::inference`). A second call for the same job changes nothing.
    pub async fn record_worker_job(&self, job_id: i64, model: &str, uid: i64, submitted_us: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO inference_workers (job_id, model, uid, submitted_us) VALUES ($1, $2, $3, $4) ON CONFLICT (job_id) DO NOTHING",
        )
        .bind(job_id)
        .bind(model)
        .bind(uid)
        .bind(submitted_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Forgets `owner`'s worker of `model` (or an owner-less one), only if it is still
    /// `instance_id` (a newer one stays).
    pub async fn delete_worker(&self, owner: &str, model: &str, instance_id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM model_workers WHERE owner IN ($1, '') AND model = $2 AND instance_id = $3")
            .bind(owner)
            .bind(model)
            .bind(instance_id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// The workers `owner` manages: its own rows and the owner-less rows from before owners
    /// existed (it takes those over: they come from the one agent that ran then).
    pub async fn workers(&self, owner: &str) -> Result<Vec<WorkerRow>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {WORKER_COLUMNS} FROM model_workers WHERE owner IN ($1, '') ORDER BY model, owner DESC, started_us, instance_id"
        ))
        .bind(owner)
        .fetch_all(self.pool())
        .await?;
        worker_rows(&rows)
    }

    /// The agent that owns the worker whose Slurm job is `job_id`, if another agent than
    /// `owner` does: such a job is never cancelled by `owner`, whatever its comment says.
    pub async fn slurm_worker_owned_by_other(&self, owner: &str, job_id: &str) -> Result<Option<String>, StoreError> {
        let row = sqlx::query("SELECT owner FROM model_workers WHERE launcher = 'slurm' AND instance_id = $1 AND owner NOT IN ($2, '')")
            .bind(job_id)
            .bind(owner)
            .fetch_optional(self.pool())
            .await?;
        Ok(match row {
            Some(r) => Some(r.try_get(0)?),
            None => None,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[tokio::test]
    async fn worker_rows_round_trip_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            let mut w = WorkerRow {
                owner: "gpu01".into(),
                model: "demo-chat".into(),
                launcher: "slurm".into(),
                instance_id: "42".into(),
                base_url: "http://127.0.0.1:9000".into(),
                api_key: "k".into(),
                version: Some("3".into()),
                log_path: "/tmp/x.log".into(),
                started_us: 1_700_000_000_000_000,
            };
            store.put_worker(&w).await.unwrap();
            // A second replica of the same model on the same agent: a row of its own.
            let first = w.clone();
            w.instance_id = "43".into();
            w.version = None;
            w.started_us += 1;
            store.put_worker(&w).await.unwrap();
            assert_eq!(store.workers("gpu01").await.unwrap(), vec![first.clone(), w.clone()], "{:?}", store.backend());
            // Updating a replica (its address once known) keeps the other.
            w.base_url = "http://10.77.0.12:9001".into();
            store.put_worker(&w).await.unwrap();
            assert_eq!(store.workers("gpu01").await.unwrap(), vec![first.clone(), w.clone()]);
            store.delete_worker("gpu01", "demo-chat", "42").await.unwrap();
            assert_eq!(store.workers("gpu01").await.unwrap(), vec![w.clone()], "deleting one replica keeps the other");

            // A second agent's worker of the same model: its own row, invisible to the first.
            let other = WorkerRow { owner: "gpu02".into(), instance_id: "77".into(), ..w.clone() };
            store.put_worker(&other).await.unwrap();
            assert_eq!(store.workers("gpu01").await.unwrap(), vec![w.clone()], "gpu01 sees only its own worker");
            assert_eq!(store.workers("gpu02").await.unwrap(), vec![other.clone()], "gpu02 sees only its own worker");
            assert_eq!(store.slurm_worker_owned_by_other("gpu01", "77").await.unwrap().as_deref(), Some("gpu02"));
            assert_eq!(store.slurm_worker_owned_by_other("gpu01", "43").await.unwrap(), None, "its own job");
            assert_eq!(store.slurm_worker_owned_by_other("gpu02", "12345").await.unwrap(), None, "nobody's job");
            store.delete_worker("gpu01", "demo-chat", "77").await.unwrap();
            assert_eq!(store.workers("gpu02").await.unwrap().len(), 1, "gpu01 cannot delete gpu02's row");

            store.delete_worker("gpu01", "demo-chat", "43").await.unwrap();
            assert!(store.workers("gpu01").await.unwrap().is_empty());
            store.delete_worker("gpu02", "demo-chat", "77").await.unwrap();
            assert!(store.workers("gpu02").await.unwrap().is_empty());
        }
    }
}
