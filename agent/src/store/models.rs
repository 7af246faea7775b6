//! Model worker jobs (adoption after an agent restart).

use sqlx::Row;

use super::{Store, StoreError};

/// One live worker as the store remembers it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRow {
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
    pub async fn put_worker(&self, w: &WorkerRow) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO model_workers (model, launcher, instance_id, base_url, api_key, version, log_path, started_us) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8) \
             ON CONFLICT (model) DO UPDATE SET launcher = excluded.launcher, instance_id = excluded.instance_id, \
             base_url = excluded.base_url, api_key = excluded.api_key, version = excluded.version, \
             log_path = excluded.log_path, started_us = excluded.started_us",
        )
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

    /// Forgets `model`'s worker, only if it is still `instance_id` (a newer one stays).
    pub async fn delete_worker(&self, model: &str, instance_id: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM model_workers WHERE model = $1 AND instance_id = $2")
            .bind(model)
            .bind(instance_id)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    pub async fn workers(&self) -> Result<Vec<WorkerRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT model, launcher, instance_id, base_url, api_key, version, log_path, started_us FROM model_workers ORDER BY model",
        )
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|r| {
                Ok(WorkerRow {
                    model: r.try_get(0)?,
                    launcher: r.try_get(1)?,
                    instance_id: r.try_get(2)?,
                    base_url: r.try_get(3)?,
                    api_key: r.try_get(4)?,
                    version: r.try_get(5)?,
                    log_path: r.try_get(6)?,
                    started_us: r.try_get(7)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(StoreError::from)
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
            w.instance_id = "43".into();
            w.version = None;
            store.put_worker(&w).await.unwrap();
            assert_eq!(store.workers().await.unwrap(), vec![w.clone()], "{:?}", store.backend());
            store.delete_worker("demo-chat", "42").await.unwrap();
            assert_eq!(store.workers().await.unwrap().len(), 1, "an older instance id must not delete the newer row");
            store.delete_worker("demo-chat", "43").await.unwrap();
            assert!(store.workers().await.unwrap().is_empty());
        }
    }
}
