//! Quota state that must survive a restart: admins' limits, top-ups, and the Slurm
//! associations the agent holds (`agent/src/quota`). Amounts are GPU-equivalent microseconds.

use super::{Store, StoreError};

/// One top-up (`gpuhub quota grant`).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct TopupRow {
    pub id: i64,
    pub target: String,
    pub amount_us: i64,
    pub granted_by: String,
    pub reason: String,
    pub granted_us: i64,
    pub expires_us: i64,
}

/// One association the agent holds in Slurm.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, sqlx::FromRow)]
pub struct HoldRow {
    pub kind: String,
    pub name: String,
    pub quota: String,
    pub held_us: i64,
}

impl Store {
    /// Admins' limits: target -> GPU-equivalent microseconds.
    pub async fn quota_limits(&self) -> Result<std::collections::BTreeMap<String, i64>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as("SELECT target, limit_us FROM quota_limits").fetch_all(self.pool()).await?;
        Ok(rows.into_iter().collect())
    }

    /// Sets (or with `None` removes) an admin's limit for `target`.
    pub async fn set_quota_limit(&self, target: &str, limit_us: Option<i64>, by: &str, now_us: i64) -> Result<(), StoreError> {
        match limit_us {
            Some(v) => {
                sqlx::query(
                    "INSERT INTO quota_limits (target, limit_us, set_by, set_us) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (target) DO UPDATE SET limit_us = excluded.limit_us, set_by = excluded.set_by, set_us = excluded.set_us",
                )
                .bind(target)
                .bind(v)
                .bind(by)
                .bind(now_us)
                .execute(self.pool())
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM quota_limits WHERE target = $1").bind(target).execute(self.pool()).await?;
            }
        }
        Ok(())
    }

    /// Records a top-up; returns its id.
    pub async fn add_quota_topup(
        &self,
        target: &str,
        amount_us: i64,
        by: &str,
        reason: &str,
        now_us: i64,
        expires_us: i64,
    ) -> Result<i64, StoreError> {
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO quota_topups (target, amount_us, granted_by, reason, granted_us, expires_us) VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
        )
        .bind(target)
        .bind(amount_us)
        .bind(by)
        .bind(reason)
        .bind(now_us)
        .bind(expires_us)
        .fetch_one(self.pool())
        .await?;
        Ok(id)
    }

    /// Ends top-up `id` at `now_us` (`gpuhub quota revoke`): it stops counting at once and
    /// its row stays, with who revoked it and why appended to its reason. Returns its target,
    /// or `None` when no top-up `id` is in force.
    pub async fn revoke_quota_topup(&self, id: i64, by: &str, why: &str, now_us: i64) -> Result<Option<String>, StoreError> {
        let note = format!(
            " [revoked by {by} at {}{}]",
            crate::util::utc_time(now_us / 1_000_000),
            if why.is_empty() { String::new() } else { format!(": {why}") }
        );
        let row: Option<(String,)> = sqlx::query_as(
            "UPDATE quota_topups SET expires_us = $1, reason = reason || $2 WHERE id = $3 AND expires_us > $4 RETURNING target",
        )
        .bind(now_us)
        .bind(note)
        .bind(id)
        .bind(now_us)
        .fetch_optional(self.pool())
        .await?;
        Ok(row.map(|(t,)| t))
    }

    /// Top-ups still in force at `now_us`, oldest first.
    pub async fn quota_topups(&self, now_us: i64) -> Result<Vec<TopupRow>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, target, amount_us, granted_by, reason, granted_us, expires_us FROM quota_topups WHERE expires_us > $1 ORDER BY id",
        )
        .bind(now_us)
        .fetch_all(self.pool())
        .await?)
    }

    /// The associations the agent holds.
    pub async fn quota_holds(&self) -> Result<Vec<HoldRow>, StoreError> {
        Ok(sqlx::query_as("SELECT kind, name, quota, held_us FROM quota_holds ORDER BY kind, name").fetch_all(self.pool()).await?)
    }

    /// Records that the agent holds `kind`/`name` because of `quota` (after Slurm took it).
    pub async fn add_quota_hold(&self, kind: &str, name: &str, quota: &str, now_us: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO quota_holds (kind, name, quota, held_us) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (kind, name) DO UPDATE SET quota = excluded.quota",
        )
        .bind(kind)
        .bind(name)
        .bind(quota)
        .bind(now_us)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Forgets a hold (after Slurm released it).
    pub async fn remove_quota_hold(&self, kind: &str, name: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM quota_holds WHERE kind = $1 AND name = $2").bind(kind).bind(name).execute(self.pool()).await?;
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{Store, testing};

    /// Reopens a store (a restart of the agent): SQLite by its file, PostgreSQL by its URL.
    async fn reopen(store: &Store, dir: &Option<tempfile::TempDir>) -> Store {
        match dir {
            Some(d) => Store::open(&format!("sqlite://{}", d.path().join("t.db").display()), None).await.unwrap(),
            None => store.clone(),
        }
    }

    #[tokio::test]
    async fn limits_topups_and_holds_survive_a_restart_on_every_backend() {
        for (store, dir) in testing::stores().await {
            let b = store.backend();
            store.set_quota_limit("user:alice", Some(7_200_000_000), "root", 10).await.unwrap();
            store.set_quota_limit("user:alice", Some(9_000_000_000), "admin", 11).await.unwrap();
            store.set_quota_limit("group:ml", Some(1), "root", 12).await.unwrap();
            store.set_quota_limit("group:ml", None, "root", 13).await.unwrap();
            let a = store.add_quota_topup("user:alice", 3_600_000_000, "root", "deadline", 100, 1_000).await.unwrap();
            let c = store.add_quota_topup("user:alice", 5, "root", "", 100, 200).await.unwrap();
            assert!(c > a, "{b:?}");
            store.add_quota_hold("user", "alice", "user:alice", 50).await.unwrap();
            store.add_quota_hold("account", "lab", "account:lab", 51).await.unwrap();
            store.add_quota_hold("account", "lab", "group:ml", 52).await.unwrap();
            store.remove_quota_hold("user", "nobody").await.unwrap();

            let store = reopen(&store, &dir).await;
            let limits = store.quota_limits().await.unwrap();
            assert_eq!(limits.into_iter().collect::<Vec<_>>(), vec![("user:alice".to_string(), 9_000_000_000)], "{b:?}");
            let t = store.quota_topups(150).await.unwrap();
            assert_eq!(t.iter().map(|t| (t.id, t.amount_us)).collect::<Vec<_>>(), vec![(a, 3_600_000_000), (c, 5)], "{b:?}");
            assert_eq!(t[0].reason, "deadline");
            assert_eq!(store.quota_topups(200).await.unwrap().len(), 1, "an expired top-up no longer counts ({b:?})");
            let h = store.quota_holds().await.unwrap();
            assert_eq!(
                h.iter().map(|h| (h.kind.as_str(), h.name.as_str(), h.quota.as_str())).collect::<Vec<_>>(),
                vec![("account", "lab", "group:ml"), ("user", "alice", "user:alice")],
                "{b:?}"
            );
            store.remove_quota_hold("user", "alice").await.unwrap();
            assert_eq!(store.quota_holds().await.unwrap().len(), 1);

            assert_eq!(store.revoke_quota_topup(a, "root", "granted by mistake", 160).await.unwrap().as_deref(), Some("user:alice"));
            let t = store.quota_topups(160).await.unwrap();
            assert_eq!(t.iter().map(|t| t.id).collect::<Vec<_>>(), vec![c], "a revoked top-up no longer counts ({b:?})");
            assert_eq!(store.revoke_quota_topup(a, "root", "", 170).await.unwrap(), None, "revoked twice ({b:?})");
            assert_eq!(store.revoke_quota_topup(c, "root", "", 250).await.unwrap(), None, "an expired one cannot be revoked ({b:?})");
            assert_eq!(store.revoke_quota_topup(9_999, "root", "", 160).await.unwrap(), None, "{b:?}");
            let reason: (String,) =
                sqlx::query_as("SELECT reason FROM quota_topups WHERE id = $1").bind(a).fetch_one(store.pool()).await.unwrap();
            assert!(
                reason.0.starts_with("deadline [revoked by root at 1970-01-01") && reason.0.ends_with(": granted by mistake]"),
                "{reason:?}"
            );
        }
    }
}
