//! Queries of the name registry: name states and their history, role assignments, and the
//! callers rollup (`name_callers`, `name_totals`; migration 0004).
//!
//! Every change goes through [`Store::apply_name_changes`], which writes the new states and
//! their history rows in one transaction: a name never changes without a record of who
//! changed it, when, from what and to what.

use sqlx::{AnyConnection, FromRow};

use super::{Store, StoreError};

/// One UTC day in microseconds: the callers rollup's bucket.
pub const DAY_US: i64 = 86_400_000_000;

/// The start of the UTC day holding `time_us`.
pub fn day_of(time_us: i64) -> i64 {
    time_us - time_us.rem_euclid(DAY_US)
}

/// A row of `names`: a name whose state differs from what the catalog says.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize)]
pub struct NameRow {
    pub name: String,
    pub state: String,
    pub replacement: Option<String>,
    pub since_date: Option<String>,
    pub sunset_date: Option<String>,
    pub updated_us: i64,
    pub updated_by: String,
}

/// A row of `name_history`.
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize, serde::Deserialize)]
pub struct HistoryRow {
    pub id: i64,
    pub time_us: i64,
    pub actor: String,
    pub action: String,
    pub subject: String,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub from_target: Option<String>,
    pub to_target: Option<String>,
    pub sunset_date: Option<String>,
    pub note: String,
}

/// One change the registry applies; a list of them is applied in one transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NameOp {
    /// Insert or replace the registry row of a name.
    Put(NameRow),
    /// Remove the registry row (the name is back to what the catalog says).
    Delete { name: String },
    /// Set a role's model (`""`: no model assigned).
    Role { role: String, model: String, by: String },
    /// Forget a runtime role assignment (the catalog's value applies again).
    RoleReset { role: String },
    /// Remember that a config seed was applied (settings key, value).
    Marker { key: String, value: String },
}

/// A history entry to append with a change (`id` and `time_us` are set by the store).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NewHistory {
    pub actor: String,
    pub action: String,
    pub subject: String,
    pub from_state: Option<String>,
    pub to_state: Option<String>,
    pub from_target: Option<String>,
    pub to_target: Option<String>,
    pub sunset_date: Option<String>,
    pub note: String,
}

/// The rollup key of one caller of one name on one day.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallerKey {
    pub name: String,
    pub day_us: i64,
    pub user: String,
    pub app: String,
    pub job_id: String,
    pub client_addr: String,
    pub user_agent: String,
}

/// Counts for one [`CallerKey`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallerCounts {
    pub calls: i64,
    pub refused: i64,
    pub first_us: i64,
    pub last_us: i64,
}

impl CallerCounts {
    pub fn merge(&mut self, o: &CallerCounts) {
        self.calls += o.calls;
        self.refused += o.refused;
        self.first_us = self.first_us.min(o.first_us);
        self.last_us = self.last_us.max(o.last_us);
    }
}

/// One caller of a name over a window (days merged).
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize, serde::Deserialize)]
pub struct CallerRow {
    pub user_name: String,
    pub app: String,
    pub job_id: String,
    pub client_addr: String,
    pub user_agent: String,
    pub calls: i64,
    pub refused: i64,
    pub first_us: i64,
    pub last_us: i64,
}

/// All calls to one name (`name_totals`).
#[derive(Debug, Clone, PartialEq, Eq, FromRow, serde::Serialize)]
pub struct NameTotals {
    pub name: String,
    pub calls: i64,
    pub refused: i64,
    pub first_us: i64,
    pub last_us: i64,
}

/// Rows per multi-row INSERT: 9 parameters each stays far below SQLite's and PostgreSQL's
/// parameter limits.
const UPSERT_CHUNK: usize = 400;

/// The rollup upsert: adds counts to an existing bucket. `MIN`/`MAX` are written as `CASE`
/// because SQLite's scalar `MIN(a, b)` is PostgreSQL's `LEAST`.
const CALLERS_CONFLICT: &str = " ON CONFLICT (name, day_us, user_name, app, job_id, client_addr, user_agent) DO UPDATE SET \
     calls = name_callers.calls + excluded.calls, refused = name_callers.refused + excluded.refused, \
     first_us = CASE WHEN excluded.first_us < name_callers.first_us THEN excluded.first_us ELSE name_callers.first_us END, \
     last_us = CASE WHEN excluded.last_us > name_callers.last_us THEN excluded.last_us ELSE name_callers.last_us END";

const TOTALS_CONFLICT: &str = " ON CONFLICT (name) DO UPDATE SET \
     calls = name_totals.calls + excluded.calls, refused = name_totals.refused + excluded.refused, \
     first_us = CASE WHEN excluded.first_us < name_totals.first_us THEN excluded.first_us ELSE name_totals.first_us END, \
     last_us = CASE WHEN excluded.last_us > name_totals.last_us THEN excluded.last_us ELSE name_totals.last_us END";

/// The callers rollup of the usage rows in `from` (a table or a CTE with `usage_log`'s
/// columns), added to `name_callers`: the same buckets and key rules as the live path's
/// [`crate::names::callers::key_of`] (UTC day, job id as text, the user agent cut at
/// [`crate::names::callers::MAX_USER_AGENT`] characters, `calls` and the refused states;
/// usage rows store the client's address without a port, so `address_only` has nothing to
/// cut). Used by [`Store::rebuild_name_callers`] and by the PostgreSQL usage batch
/// (`store::gateway`); tests check both agree with the Rust rollup SQLite's writer uses.
pub fn callers_rollup_sql(from: &str) -> String {
    let refused = refused_calls_sql();
    let key = format!(
        "requested_name, time_us - (time_us % {DAY_US}), user_name, app, COALESCE(CAST(job_id AS TEXT), ''), client_addr, SUBSTR(user_agent, 1, {})",
        crate::names::callers::MAX_USER_AGENT
    );
    format!(
        "INSERT INTO name_callers (name, day_us, user_name, app, job_id, client_addr, user_agent, calls, refused, first_us, last_us) \
         SELECT {key}, CAST(SUM(calls) AS BIGINT), CAST(SUM({refused}) AS BIGINT), MIN(time_us), MAX(time_us) \
         FROM {from} WHERE requested_name <> '' GROUP BY {key}{CALLERS_CONFLICT}"
    )
}

/// A usage row's refused calls in SQL: `calls` if its name state is one of
/// [`crate::names::callers::REFUSED_STATES`], else 0.
fn refused_calls_sql() -> String {
    let states = crate::names::callers::REFUSED_STATES.iter().map(|s| format!("'{s}'")).collect::<Vec<_>>().join(", ");
    format!("CASE WHEN name_state IN ({states}) THEN calls ELSE 0 END")
}

/// The per-name totals of the usage rows in `from`, added to `name_totals` (see
/// [`callers_rollup_sql`]).
pub fn totals_rollup_sql(from: &str) -> String {
    let refused = refused_calls_sql();
    format!(
        "INSERT INTO name_totals (name, calls, refused, first_us, last_us) \
         SELECT requested_name, CAST(SUM(calls) AS BIGINT), CAST(SUM({refused}) AS BIGINT), MIN(time_us), MAX(time_us) \
         FROM {from} WHERE requested_name <> '' GROUP BY requested_name{TOTALS_CONFLICT}"
    )
}

/// Adds aggregated counts to the callers rollup and the per-name totals, on the caller's
/// connection or transaction (the gateway's usage writer calls this inside its batch
/// transaction, so the rollup and the log never disagree).
pub async fn upsert_callers(conn: &mut AnyConnection, rows: &[(CallerKey, CallerCounts)]) -> Result<(), sqlx::Error> {
    for chunk in rows.chunks(UPSERT_CHUNK) {
        let mut sql = String::from(
            "INSERT INTO name_callers (name, day_us, user_name, app, job_id, client_addr, user_agent, calls, refused, first_us, last_us) VALUES ",
        );
        for i in 0..chunk.len() {
            let b = i * 11;
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(&format!(
                "(${},${},${},${},${},${},${},${},${},${},${})",
                b + 1,
                b + 2,
                b + 3,
                b + 4,
                b + 5,
                b + 6,
                b + 7,
                b + 8,
                b + 9,
                b + 10,
                b + 11
            ));
        }
        sql.push_str(CALLERS_CONFLICT);
        let mut q = sqlx::query(&sql);
        for (k, c) in chunk {
            q = q
                .bind(k.name.as_str())
                .bind(k.day_us)
                .bind(k.user.as_str())
                .bind(k.app.as_str())
                .bind(k.job_id.as_str())
                .bind(k.client_addr.as_str())
                .bind(k.user_agent.as_str())
                .bind(c.calls)
                .bind(c.refused)
                .bind(c.first_us)
                .bind(c.last_us);
        }
        q.execute(&mut *conn).await?;
    }
    // Per-name totals: one row per name in the batch.
    let mut totals: std::collections::BTreeMap<&str, CallerCounts> = std::collections::BTreeMap::new();
    for (k, c) in rows {
        totals.entry(k.name.as_str()).and_modify(|t| t.merge(c)).or_insert(*c);
    }
    let totals: Vec<_> = totals.into_iter().collect();
    for chunk in totals.chunks(UPSERT_CHUNK) {
        let mut sql = String::from("INSERT INTO name_totals (name, calls, refused, first_us, last_us) VALUES ");
        for i in 0..chunk.len() {
            let b = i * 5;
            if i > 0 {
                sql.push(',');
            }
            sql.push_str(&format!("(${},${},${},${},${})", b + 1, b + 2, b + 3, b + 4, b + 5));
        }
        sql.push_str(TOTALS_CONFLICT);
        let mut q = sqlx::query(&sql);
        for (name, c) in chunk {
            q = q.bind(*name).bind(c.calls).bind(c.refused).bind(c.first_us).bind(c.last_us);
        }
        q.execute(&mut *conn).await?;
    }
    Ok(())
}

impl Store {
    /// Every registry row.
    pub async fn name_rows(&self) -> Result<Vec<NameRow>, StoreError> {
        Ok(sqlx::query_as("SELECT name, state, replacement, since_date, sunset_date, updated_us, updated_by FROM names ORDER BY name")
            .fetch_all(self.pool())
            .await?)
    }

    /// Runtime role assignments (role, model; `""` = no model).
    pub async fn role_rows(&self) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as("SELECT role, model FROM role_assignments ORDER BY role").fetch_all(self.pool()).await?)
    }

    /// Applies registry changes and appends their history in one transaction.
    pub async fn apply_name_changes(&self, ops: &[NameOp], history: &[NewHistory]) -> Result<(), StoreError> {
        let now = crate::util::now_us();
        let mut tx = super::begin_write(self.pool()).await?;
        for op in ops {
            match op {
                NameOp::Put(r) => {
                    sqlx::query(
                        "INSERT INTO names (name, state, replacement, since_date, sunset_date, updated_us, updated_by) VALUES ($1, $2, $3, $4, $5, $6, $7) \
                         ON CONFLICT (name) DO UPDATE SET state = excluded.state, replacement = excluded.replacement, since_date = excluded.since_date, \
                         sunset_date = excluded.sunset_date, updated_us = excluded.updated_us, updated_by = excluded.updated_by",
                    )
                    .bind(&r.name)
                    .bind(&r.state)
                    .bind(&r.replacement)
                    .bind(&r.since_date)
                    .bind(&r.sunset_date)
                    .bind(now)
                    .bind(&r.updated_by)
                    .execute(&mut *tx)
                    .await?;
                }
                NameOp::Delete { name } => {
                    sqlx::query("DELETE FROM names WHERE name = $1").bind(name).execute(&mut *tx).await?;
                }
                NameOp::Role { role, model, by } => {
                    sqlx::query(
                        "INSERT INTO role_assignments (role, model, updated_us, updated_by) VALUES ($1, $2, $3, $4) \
                         ON CONFLICT (role) DO UPDATE SET model = excluded.model, updated_us = excluded.updated_us, updated_by = excluded.updated_by",
                    )
                    .bind(role)
                    .bind(model)
                    .bind(now)
                    .bind(by)
                    .execute(&mut *tx)
                    .await?;
                }
                NameOp::RoleReset { role } => {
                    sqlx::query("DELETE FROM role_assignments WHERE role = $1").bind(role).execute(&mut *tx).await?;
                }
                NameOp::Marker { key, value } => {
                    sqlx::query("INSERT INTO settings (key, value, updated_us) VALUES ($1, $2, $3) ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_us = excluded.updated_us")
                        .bind(key)
                        .bind(value)
                        .bind(now)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        for h in history {
            sqlx::query(
                "INSERT INTO name_history (time_us, actor, action, subject, from_state, to_state, from_target, to_target, sunset_date, note) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            )
            .bind(now)
            .bind(&h.actor)
            .bind(&h.action)
            .bind(&h.subject)
            .bind(&h.from_state)
            .bind(&h.to_state)
            .bind(&h.from_target)
            .bind(&h.to_target)
            .bind(&h.sunset_date)
            .bind(&h.note)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// History of one name or role (or of everything), newest first.
    pub async fn name_history(&self, subject: Option<&str>, limit: i64) -> Result<Vec<HistoryRow>, StoreError> {
        const COLS: &str = "id, time_us, actor, action, subject, from_state, to_state, from_target, to_target, sunset_date, note";
        Ok(match subject {
            Some(s) => {
                sqlx::query_as(&format!("SELECT {COLS} FROM name_history WHERE subject = $1 ORDER BY id DESC LIMIT $2"))
                    .bind(s)
                    .bind(limit)
                    .fetch_all(self.pool())
                    .await?
            }
            None => {
                sqlx::query_as(&format!("SELECT {COLS} FROM name_history ORDER BY id DESC LIMIT $1"))
                    .bind(limit)
                    .fetch_all(self.pool())
                    .await?
            }
        })
    }

    /// The callers of `name` on UTC days starting at or after `since_day_us`, most calls first.
    /// Reads the rollup only (primary-key range scan), never the usage log.
    pub async fn name_callers(&self, name: &str, since_day_us: i64) -> Result<Vec<CallerRow>, StoreError> {
        self.fold_rollups().await?;
        Ok(sqlx::query_as(
            "SELECT user_name, app, job_id, client_addr, user_agent, CAST(SUM(calls) AS BIGINT) AS calls, CAST(SUM(refused) AS BIGINT) AS refused, \
             MIN(first_us) AS first_us, MAX(last_us) AS last_us FROM name_callers WHERE name = $1 AND day_us >= $2 \
             GROUP BY user_name, app, job_id, client_addr, user_agent ORDER BY calls DESC, last_us DESC",
        )
        .bind(name)
        .bind(since_day_us)
        .fetch_all(self.pool())
        .await?)
    }

    /// Totals of every name ever called.
    pub async fn name_totals(&self) -> Result<Vec<NameTotals>, StoreError> {
        self.fold_rollups().await?;
        Ok(sqlx::query_as("SELECT name, calls, refused, first_us, last_us FROM name_totals ORDER BY name").fetch_all(self.pool()).await?)
    }

    /// Adds counts to the rollup in a transaction of its own (tests, tools).
    pub async fn add_name_callers(&self, rows: &[(CallerKey, CallerCounts)]) -> Result<(), StoreError> {
        let mut tx = super::begin_write(self.pool()).await?;
        upsert_callers(&mut tx, rows).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replaces the callers rollup with one computed from the whole usage log (after a
    /// restore from backup, or to fill the rollup for a log written before it existed).
    ///
    /// PostgreSQL: rows that wait for the rollups (`usage_rollup_pending`) are folded in first,
    /// and the rebuild reads the log as of that fold (one snapshot: `REPEATABLE READ`), under
    /// the fold lock, so a row stored meanwhile is neither counted by the rebuild and folded
    /// again later, nor missed.
    pub async fn rebuild_name_callers(&self) -> Result<(), StoreError> {
        if self.backend() == super::Backend::Postgres {
            let mut conn = self.pool().acquire().await?;
            sqlx::query("SELECT pg_advisory_lock($1)").bind(super::gateway::FOLD_LOCK).execute(&mut *conn).await?;
            let rebuilt = async {
                let mut tx = sqlx::Connection::begin(&mut *conn).await?;
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ").execute(&mut *tx).await?;
                sqlx::query(super::gateway::fold_rollups_sql()).execute(&mut *tx).await?;
                sqlx::query("DELETE FROM name_callers").execute(&mut *tx).await?;
                sqlx::query("DELETE FROM name_totals").execute(&mut *tx).await?;
                sqlx::query(&callers_rollup_sql("usage_log")).execute(&mut *tx).await?;
                sqlx::query(&totals_rollup_sql("usage_log")).execute(&mut *tx).await?;
                tx.commit().await
            }
            .await;
            let unlocked = rebuilt.is_ok()
                && sqlx::query("SELECT pg_advisory_unlock($1)").bind(super::gateway::FOLD_LOCK).execute(&mut *conn).await.is_ok();
            if !unlocked {
                // Not reused: closing it releases the session's lock, which would otherwise
                // hold every fold back.
                conn.close_on_drop();
            }
            return Ok(rebuilt?);
        }
        let mut tx = super::begin_write(self.pool()).await?;
        sqlx::query("DELETE FROM name_callers").execute(&mut *tx).await?;
        sqlx::query("DELETE FROM name_totals").execute(&mut *tx).await?;
        sqlx::query(&callers_rollup_sql("usage_log")).execute(&mut *tx).await?;
        sqlx::query(&totals_rollup_sql("usage_log")).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing;

    fn key(name: &str, day: i64, user: &str) -> CallerKey {
        CallerKey {
            name: name.into(),
            day_us: day,
            user: user.into(),
            app: "ocr-svc".into(),
            job_id: String::new(),
            client_addr: "10.0.0.1".into(),
            user_agent: "ua".into(),
        }
    }

    #[tokio::test]
    async fn rollup_adds_up_and_windows_by_day_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            let c = |calls, first, last| CallerCounts { calls, refused: 0, first_us: first, last_us: last };
            store
                .add_name_callers(&[
                    (key("svc-ocr", 0, "alice"), c(2, 10, 20)),
                    (key("svc-ocr", DAY_US, "alice"), c(3, DAY_US + 5, DAY_US + 9)),
                ])
                .await
                .unwrap();
            store
                .add_name_callers(&[
                    (key("svc-ocr", DAY_US, "alice"), c(1, DAY_US + 1, DAY_US + 50)),
                    (key("svc-ocr", DAY_US, "bob"), c(1, DAY_US, DAY_US)),
                ])
                .await
                .unwrap();
            let all = store.name_callers("svc-ocr", 0).await.unwrap();
            assert_eq!(all.len(), 2, "{:?}", store.backend());
            assert_eq!((all[0].user_name.as_str(), all[0].calls, all[0].first_us, all[0].last_us), ("alice", 6, 10, DAY_US + 50));
            let recent = store.name_callers("svc-ocr", DAY_US).await.unwrap();
            assert_eq!(recent[0].calls, 4);
            assert_eq!(recent[0].first_us, DAY_US + 1);
            let totals = store.name_totals().await.unwrap();
            assert_eq!((totals[0].calls, totals[0].first_us, totals[0].last_us), (7, 10, DAY_US + 50));
            assert!(store.name_callers("dots.ocr", 0).await.unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn changes_and_history_are_one_transaction() {
        for (store, _dir) in testing::stores().await {
            let row = NameRow {
                name: "svc-ocr".into(),
                state: "deprecated".into(),
                replacement: Some("dots.ocr".into()),
                since_date: Some("2026-06-17".into()),
                sunset_date: None,
                updated_us: 0,
                updated_by: "root".into(),
            };
            let h = NewHistory {
                actor: "root".into(),
                action: "rename".into(),
                subject: "svc-ocr".into(),
                to_state: Some("deprecated".into()),
                ..Default::default()
            };
            store
                .apply_name_changes(
                    &[NameOp::Put(row.clone()), NameOp::Role { role: "ocr".into(), model: "dots.ocr".into(), by: "root".into() }],
                    &[h],
                )
                .await
                .unwrap();
            let rows = store.name_rows().await.unwrap();
            assert_eq!(rows.len(), 1);
            assert_eq!(rows[0].replacement.as_deref(), Some("dots.ocr"));
            assert_eq!(store.role_rows().await.unwrap(), vec![("ocr".to_string(), "dots.ocr".to_string())]);
            let hist = store.name_history(Some("svc-ocr"), 10).await.unwrap();
            assert_eq!((hist.len(), hist[0].action.as_str(), hist[0].actor.as_str()), (1, "rename", "root"));
            store
                .apply_name_changes(&[NameOp::Delete { name: "svc-ocr".into() }, NameOp::RoleReset { role: "ocr".into() }], &[])
                .await
                .unwrap();
            assert!(store.name_rows().await.unwrap().is_empty());
            assert!(store.role_rows().await.unwrap().is_empty());
        }
    }
}
