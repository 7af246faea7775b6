//! Several gateways on one store: the policy each gateway enforces (`gateway_policies`), so that
//! gateways whose settings differ are found ([`crate::gateway::policy`]).

use sqlx::Row;

use super::{Store, StoreError};

impl Store {
    /// Writes (or replaces) `gateway`'s policy.
    pub async fn publish_gateway_policy(&self, gateway: &str, policy: &str, now_us: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO gateway_policies (gateway, policy, updated_us) VALUES ($1, $2, $3) \
             ON CONFLICT (gateway) DO UPDATE SET policy = excluded.policy, updated_us = excluded.updated_us",
        )
        .bind(gateway)
        .bind(policy)
        .bind(now_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Removes `gateway`'s policy (a node that no longer runs the gateway); whether it had one.
    pub async fn forget_gateway_policy(&self, gateway: &str) -> Result<bool, StoreError> {
        let done = sqlx::query("DELETE FROM gateway_policies WHERE gateway = $1").bind(gateway).execute(self.pool()).await?;
        Ok(done.rows_affected() > 0)
    }

    /// Every gateway's policy published since `since_us`: (gateway, policy), by gateway.
    pub async fn gateway_policies(&self, since_us: i64) -> Result<Vec<(String, String)>, StoreError> {
        let rows = sqlx::query("SELECT gateway, policy FROM gateway_policies WHERE updated_us >= $1 ORDER BY gateway")
            .bind(since_us)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(|r| Ok((r.try_get("gateway")?, r.try_get("policy")?))).collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use crate::store::testing;

    #[tokio::test]
    async fn a_gateway_policy_is_replaced_and_old_ones_are_left_out() {
        for (store, _dir) in testing::stores().await {
            store.publish_gateway_policy("gpu02", "{\"a\":1}", 10).await.unwrap();
            store.publish_gateway_policy("gpu01", "{\"a\":1}", 5).await.unwrap();
            store.publish_gateway_policy("gpu02", "{\"a\":2}", 20).await.unwrap();
            let all = store.gateway_policies(0).await.unwrap();
            assert_eq!(all, vec![("gpu01".into(), "{\"a\":1}".into()), ("gpu02".into(), "{\"a\":2}".into())], "{:?}", store.backend());
            assert_eq!(store.gateway_policies(6).await.unwrap(), vec![("gpu02".to_string(), "{\"a\":2}".to_string())]);
            assert!(store.forget_gateway_policy("gpu02").await.unwrap());
            assert!(!store.forget_gateway_policy("gpu02").await.unwrap(), "gone already");
            assert_eq!(store.gateway_policies(0).await.unwrap(), vec![("gpu01".to_string(), "{\"a\":1}".to_string())]);
        }
    }
}
