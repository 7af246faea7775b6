//! Several gateways on one store: what each gateway's limits counted today
//! (`gateway_limit_counts`), so that `[gateway.limits]` and the keys' own limits hold across
//! gateways ([`crate::gateway::fair_use`], read and written by `cluster_sync`).

use sqlx::Row;

use super::{Store, StoreError};

/// One subject's counts of one UTC day at one gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitCount {
    /// `user` or `key`.
    pub kind: String,
    /// The user name or the key id.
    pub who: String,
    /// Tokens of the calls that ended that day.
    pub tokens: i64,
    /// Calls admitted that day (against a requests-per-minute limit).
    pub calls: i64,
}

impl Store {
    /// Writes `gateway`'s counts of the day `day_us` (the rows given replace that gateway's
    /// rows of the same subjects) and drops its rows of earlier days.
    pub async fn publish_limit_counts(&self, gateway: &str, day_us: i64, rows: &[LimitCount], now_us: i64) -> Result<(), StoreError> {
        let mut tx = super::begin_write(self.pool()).await?;
        sqlx::query("DELETE FROM gateway_limit_counts WHERE gateway = $1 AND day_us < $2")
            .bind(gateway)
            .bind(day_us)
            .execute(&mut *tx)
            .await?;
        for r in rows {
            sqlx::query(
                "INSERT INTO gateway_limit_counts (gateway, day_us, kind, who, tokens, calls, updated_us) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) \
                 ON CONFLICT (gateway, day_us, kind, who) \
                 DO UPDATE SET tokens = excluded.tokens, calls = excluded.calls, updated_us = excluded.updated_us",
            )
            .bind(gateway)
            .bind(day_us)
            .bind(&r.kind)
            .bind(&r.who)
            .bind(r.tokens)
            .bind(r.calls)
            .bind(now_us)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// The counts of the day `day_us` at every gateway but `gateway`, summed per subject.
    pub async fn others_limit_counts(&self, gateway: &str, day_us: i64) -> Result<Vec<LimitCount>, StoreError> {
        let rows = sqlx::query(
            "SELECT kind, who, CAST(SUM(tokens) AS BIGINT) AS tokens, CAST(SUM(calls) AS BIGINT) AS calls \
             FROM gateway_limit_counts WHERE day_us = $1 AND gateway <> $2 GROUP BY kind, who",
        )
        .bind(day_us)
        .bind(gateway)
        .fetch_all(self.pool())
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            out.push(LimitCount {
                kind: r.try_get("kind")?,
                who: r.try_get("who")?,
                tokens: r.try_get::<Option<i64>, _>("tokens")?.unwrap_or(0),
                calls: r.try_get::<Option<i64>, _>("calls")?.unwrap_or(0),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::store::testing;

    fn count(kind: &str, who: &str, tokens: i64, calls: i64) -> LimitCount {
        LimitCount { kind: kind.into(), who: who.into(), tokens, calls }
    }

    #[tokio::test]
    async fn each_gateway_reads_the_others_counts_of_the_day() {
        for (store, _dir) in testing::stores().await {
            const DAY: i64 = 86_400_000_000;
            store.publish_limit_counts("gpu01", DAY, &[count("user", "alice", 10, 2), count("key", "k1", 10, 2)], 1).await.unwrap();
            store.publish_limit_counts("gpu02", DAY, &[count("user", "alice", 5, 1)], 2).await.unwrap();
            store.publish_limit_counts("gpu03", 0, &[count("user", "alice", 99, 9)], 3).await.unwrap();
            // A later publication replaces the gateway's row of that subject.
            store.publish_limit_counts("gpu02", DAY, &[count("user", "alice", 7, 3)], 4).await.unwrap();
            let mut seen = store.others_limit_counts("gpu01", DAY).await.unwrap();
            seen.sort_by(|a, b| a.who.cmp(&b.who));
            assert_eq!(seen, vec![count("user", "alice", 7, 3)], "{:?}", store.backend());
            let mut seen = store.others_limit_counts("gpu02", DAY).await.unwrap();
            seen.sort_by(|a, b| a.who.cmp(&b.who));
            assert_eq!(seen, vec![count("user", "alice", 10, 2), count("key", "k1", 10, 2)]);
            // A gateway's rows of earlier days go when it publishes a new day.
            store.publish_limit_counts("gpu03", DAY, &[], 5).await.unwrap();
            assert!(store.others_limit_counts("gpu01", 0).await.unwrap().is_empty());
        }
    }
}
