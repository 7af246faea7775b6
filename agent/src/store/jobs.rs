//! Read-only job state for the gateway: has a job ended? Reads `acct_jobs`, which accounting
//! (`crate::accounting`) folds from the plugin's records and closes from Slurm's state; this
//! file never writes it.

use super::{Store, StoreError};

impl Store {
    /// Whether job `job_id` of `uid` has ended: some node's row of it is closed (its JobEnd
    /// record was ingested, or accounting closed it from Slurm's state) and no run of it started
    /// after that (Slurm requeued it and it runs again). A job the store has not seen yet (its
    /// JobStart may still be in the spool) has not ended.
    pub async fn job_ended(&self, job_id: u32, uid: u32) -> Result<bool, StoreError> {
        let (closed,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM acct_jobs j WHERE j.job_id = $1 AND j.uid = $2 AND j.end_us IS NOT NULL \
             AND NOT EXISTS (SELECT 1 FROM acct_jobs k WHERE k.job_id = j.job_id AND k.uid = j.uid AND COALESCE(k.start_us, k.first_seen_us) > j.end_us)",
        )
            .bind(i64::from(job_id))
            .bind(i64::from(uid))
            .fetch_one(self.pool())
            .await?;
        Ok(closed > 0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::testing;

    async fn put(store: &super::Store, node: &str, job_id: i64, uid: i64, end_us: Option<i64>) {
        put_run(store, node, job_id, uid, (0, 1), end_us).await;
    }

    /// Run `run.0` of a job, started at `run.1`.
    async fn put_run(store: &super::Store, node: &str, job_id: i64, uid: i64, run: (i64, i64), end_us: Option<i64>) {
        sqlx::query(
            "INSERT INTO acct_jobs (node, job_id, run, uid, user_name, start_us, end_us, first_seen_us, last_seen_us) VALUES ($1, $2, $3, $4, 'u', $5, $6, $5, $5)",
        )
        .bind(node)
        .bind(job_id)
        .bind(run.0)
        .bind(uid)
        .bind(run.1)
        .bind(end_us)
        .execute(store.pool())
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn unknown_running_and_ended_jobs_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            assert!(!store.job_ended(7, 1000).await.unwrap(), "unknown job");
            put(&store, "n1", 7, 1000, None).await;
            assert!(!store.job_ended(7, 1000).await.unwrap(), "running job");
            put(&store, "n2", 7, 1000, Some(5)).await;
            assert!(store.job_ended(7, 1000).await.unwrap(), "ended on one node: {:?}", store.backend());
            assert!(!store.job_ended(7, 1001).await.unwrap(), "another uid's job 7 is another job");
            // Requeued: the first run ended, the next runs (here or on another node).
            put_run(&store, "n1", 8, 1000, (0, 1), Some(5)).await;
            put_run(&store, "n1", 8, 1000, (1, 9), None).await;
            assert!(!store.job_ended(8, 1000).await.unwrap(), "a requeued job's next run has not ended");
            put_run(&store, "n2", 9, 1000, (0, 1), Some(5)).await;
            put_run(&store, "n1", 9, 1000, (0, 9), None).await;
            assert!(!store.job_ended(9, 1000).await.unwrap(), "its next run on another node has not ended");
            sqlx::query("UPDATE acct_jobs SET end_us = 12 WHERE job_id = 8 AND run = 1").execute(store.pool()).await.unwrap();
            assert!(store.job_ended(8, 1000).await.unwrap(), "its last run ended");
        }
    }
}
