//! Read-only job state for the gateway: has a job ended? Reads `acct_jobs`, which accounting
//! (`crate::accounting`) folds from the plugin's records and closes from Slurm's state; this
//! file never writes it.

use super::{Store, StoreError};

impl Store {
    /// Whether job `job_id` of `uid` has ended: some node's row of it is closed (its JobEnd
    /// record was ingested, or accounting closed it from Slurm's state). A job the store has
    /// not seen yet (its JobStart may still be in the spool) has not ended.
    pub async fn job_ended(&self, job_id: u32, uid: u32) -> Result<bool, StoreError> {
        let (closed,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM acct_jobs WHERE job_id = $1 AND uid = $2 AND end_us IS NOT NULL")
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
        sqlx::query(
            "INSERT INTO acct_jobs (node, job_id, uid, user_name, start_us, end_us, first_seen_us, last_seen_us) VALUES ($1, $2, $3, 'u', 1, $4, 1, 1)",
        )
        .bind(node)
        .bind(job_id)
        .bind(uid)
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
        }
    }
}
