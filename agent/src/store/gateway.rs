//! Gateway queries: API keys, the usage log (batched, idempotent inserts) and call rollups.

use std::collections::BTreeMap;

use serde::Serialize;
use sqlx::Row;

use super::{Store, StoreError};
use crate::gateway::usage_log::UsageRow;

/// How a column of `usage_log` is read from a [`UsageRow`]: the one place that says which
/// field goes to which column, for SQLite's binds and PostgreSQL's arrays alike.
#[derive(Clone, Copy)]
enum Column {
    Text(fn(&UsageRow) -> &str),
    Int(fn(&UsageRow) -> i64),
    OptInt(fn(&UsageRow) -> Option<i64>),
}

impl Column {
    /// The PostgreSQL array type of the column's batch parameter ([`pg_usage_batch_sql`]).
    fn pg_array(self) -> &'static str {
        match self {
            Column::Text(_) => "text[]",
            Column::Int(_) | Column::OptInt(_) => "bigint[]",
        }
    }
}

/// Columns of `usage_log`, in bind order.
const USAGE_COLUMNS: &[(&str, Column)] = &[
    ("request_id", Column::Text(|r| &r.request_id)),
    ("time_us", Column::Int(|r| r.time_us)),
    ("user_name", Column::Text(|r| &r.user)),
    ("app", Column::Text(|r| &r.app)),
    ("job_id", Column::OptInt(|r| r.job_id)),
    ("client_addr", Column::Text(|r| &r.client_addr)),
    ("user_agent", Column::Text(|r| &r.user_agent)),
    ("requested_name", Column::Text(|r| &r.requested_name)),
    ("resolved_model", Column::Text(|r| &r.resolved_model)),
    ("model_version", Column::Text(|r| &r.model_version)),
    ("name_state", Column::Text(|r| &r.name_state)),
    ("route", Column::Text(|r| &r.route)),
    ("status", Column::Int(|r| i64::from(r.status))),
    ("error_code", Column::Text(|r| &r.error_code)),
    ("prompt_tokens", Column::Int(|r| r.prompt_tokens)),
    ("completion_tokens", Column::Int(|r| r.completion_tokens)),
    ("streamed", Column::Int(|r| i64::from(r.streamed))),
    ("latency_us", Column::Int(|r| r.latency_us)),
    ("upstream_ttfb_us", Column::Int(|r| r.upstream_ttfb_us)),
    ("overhead_us", Column::Int(|r| r.overhead_us)),
    ("usage_source", Column::Text(|r| r.usage_source.as_str())),
    ("adapter", Column::Text(|r| &r.adapter)),
    ("calls", Column::Int(|r| r.calls.max(1))),
    ("key_id", Column::Text(|r| &r.key_id)),
];

/// SQLite: rows per INSERT statement of a batch. Every count up to 64 is one statement text
/// (few enough to stay prepared: sqlx keeps 100 per connection), at most 64 x 24 = 1536 of its
/// 32766 bind parameters; SQLite gets anonymous `?` placeholders (see
/// [`sqlite_usage_insert_sql`]): sqlx asks `sqlite3_bind_parameter_name` for every bind, which
/// scans the statement's list of *named* parameters, so `$N` placeholders made binding quadratic
/// in the parameters per statement (at 200 rows it took 40 % of the agent's CPU under load);
/// anonymous ones are not in that list. (PostgreSQL writes a batch with one statement,
/// [`pg_usage_batch_sql`].)
const SQLITE_ROWS_PER_STATEMENT: usize = 64;

/// One stored API key (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ApiKeyRecord {
    pub id: String,
    pub key_hash: String,
    pub prefix: String,
    pub user: String,
    pub app: String,
    /// Models this key may use; empty = every model.
    pub models: Vec<String>,
    pub created_us: i64,
    pub created_by: String,
    pub revoked_us: Option<i64>,
    /// The key's own requests per minute (`None`: only its user's limit applies).
    pub rpm: Option<u32>,
    /// The key's own tokens per UTC day (`None`: only its user's limit applies).
    pub tokens_per_day: Option<u64>,
}

/// One line of `gpuhub usage --calls`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct CallSummary {
    pub user: String,
    pub app: String,
    pub requested_name: String,
    pub model: String,
    pub calls: i64,
    pub errors: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub mean_latency_us: i64,
}

/// One (user, key) of [`Store::limit_usage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitUsage {
    pub user: String,
    /// "" for calls without an API key.
    pub key_id: String,
    pub tokens: i64,
    pub recent_calls: i64,
}

const HOUR_US: i64 = 3_600_000_000;

/// The hourly call rollup's upsert: its columns ([`CALL_ROLLUPS_INSERT`]) and how a bucket
/// that exists takes more calls ([`CALL_ROLLUPS_CONFLICT`]).
const CALL_ROLLUPS_INSERT: &str = "INSERT INTO call_rollups (hour_us, user_name, app, requested_name, resolved_model, calls, errors, prompt_tokens, completion_tokens, latency_us_sum, busy_us, max_latency_us)";
const CALL_ROLLUPS_CONFLICT: &str = " ON CONFLICT (hour_us, user_name, app, requested_name, resolved_model) DO UPDATE SET \
     calls = call_rollups.calls + excluded.calls, errors = call_rollups.errors + excluded.errors, \
     prompt_tokens = call_rollups.prompt_tokens + excluded.prompt_tokens, \
     completion_tokens = call_rollups.completion_tokens + excluded.completion_tokens, \
     latency_us_sum = call_rollups.latency_us_sum + excluded.latency_us_sum, busy_us = call_rollups.busy_us + excluded.busy_us, \
     max_latency_us = CASE WHEN excluded.max_latency_us > call_rollups.max_latency_us THEN excluded.max_latency_us ELSE call_rollups.max_latency_us END";

/// The connection the usage writer keeps from one batch to the next ([`Store::insert_usage_on`]).
/// sqlx checks a pooled connection with a round trip when it hands it out and again when it
/// takes it back: two round trips around every batch (every 10 ms under load on PostgreSQL)
/// that a kept connection does without. On PostgreSQL it is a native connection of its own,
/// outside the pool (one more than `store.max_connections`), so that a batch's columns go as
/// binary arrays (the `Any` driver binds no arrays).
#[derive(Default)]
pub struct UsageConnection(Option<(Kept, std::time::Instant)>);

enum Kept {
    Pool(sqlx::pool::PoolConnection<sqlx::Any>),
    Postgres(sqlx::PgConnection),
}

impl UsageConnection {
    /// A kept connection idle longer than this is checked (PostgreSQL: a ping) or goes back to
    /// the pool (SQLite) before the next batch.
    const IDLE: std::time::Duration = std::time::Duration::from_secs(1);
    /// One idle this long is let go ([`UsageConnection::release_if_idle`]): a gateway without
    /// calls holds no connection of its own.
    const RELEASE: std::time::Duration = std::time::Duration::from_secs(60);

    /// Keeps the writer's PostgreSQL connection after a statement that succeeded; closes it
    /// after one that failed (not reused: the writer's retry opens a new one).
    async fn keep_or_close(&mut self, conn: sqlx::PgConnection, succeeded: bool) {
        if succeeded {
            self.0 = Some((Kept::Postgres(conn), std::time::Instant::now()));
        } else {
            drop(sqlx::Connection::close_hard(conn).await);
        }
    }

    /// Closes the kept connection (PostgreSQL) or gives it back to the pool (SQLite) once it
    /// has been idle for [`UsageConnection::RELEASE`]; the usage writer calls this between
    /// batches.
    pub async fn release_if_idle(&mut self) {
        if self.0.as_ref().is_some_and(|(_, used)| used.elapsed() >= Self::RELEASE)
            && let Some((Kept::Postgres(conn), _)) = self.0.take()
        {
            drop(sqlx::Connection::close(conn).await);
        }
    }
}

/// Columns of `api_keys` that [`key_record`] reads.
const KEY_COLUMNS: &str = "id, key_hash, prefix, user_name, app, models, created_us, created_by, revoked_us, rpm, tokens_per_day";

fn key_record(r: &sqlx::any::AnyRow) -> Result<ApiKeyRecord, StoreError> {
    let models: String = r.try_get("models")?;
    Ok(ApiKeyRecord {
        id: r.try_get("id")?,
        key_hash: r.try_get("key_hash")?,
        prefix: r.try_get("prefix")?,
        user: r.try_get("user_name")?,
        app: r.try_get("app")?,
        models: models.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect(),
        created_us: r.try_get("created_us")?,
        created_by: r.try_get("created_by")?,
        revoked_us: r.try_get("revoked_us")?,
        rpm: r.try_get::<Option<i64>, _>("rpm")?.map(|v| u32::try_from(v.max(0)).unwrap_or(u32::MAX)),
        tokens_per_day: r.try_get::<Option<i64>, _>("tokens_per_day")?.map(|v| v.max(0) as u64),
    })
}

impl Store {
    pub async fn insert_api_key(&self, k: &ApiKeyRecord) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO api_keys (id, key_hash, prefix, user_name, app, models, created_us, created_by, revoked_us, rpm, tokens_per_day) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, NULL, $9, $10)")
            .bind(&k.id)
            .bind(&k.key_hash)
            .bind(&k.prefix)
            .bind(&k.user)
            .bind(&k.app)
            .bind(k.models.join(","))
            .bind(k.created_us)
            .bind(&k.created_by)
            .bind(k.rpm.map(i64::from))
            .bind(k.tokens_per_day.map(|t| i64::try_from(t).unwrap_or(i64::MAX)))
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Every key, revoked ones included (the gateway tells a revoked key from an unknown one).
    pub async fn api_keys(&self) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys ORDER BY created_us, id")).fetch_all(self.pool()).await?;
        rows.iter().map(key_record).collect()
    }

    /// The keys of one user, revoked ones included, oldest first.
    pub async fn api_keys_of(&self, user: &str) -> Result<Vec<ApiKeyRecord>, StoreError> {
        let rows = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE user_name = $1 ORDER BY created_us, id"))
            .bind(user)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(key_record).collect()
    }

    /// One key by id, if there is one.
    pub async fn api_key(&self, id: &str) -> Result<Option<ApiKeyRecord>, StoreError> {
        let row = sqlx::query(&format!("SELECT {KEY_COLUMNS} FROM api_keys WHERE id = $1")).bind(id).fetch_optional(self.pool()).await?;
        row.as_ref().map(key_record).transpose()
    }

    /// Revokes a key by id; returns the revoked record. Revoking twice is a no-op that still
    /// answers with the record.
    pub async fn revoke_api_key(&self, id: &str, now_us: i64) -> Result<ApiKeyRecord, StoreError> {
        sqlx::query("UPDATE api_keys SET revoked_us = $1 WHERE id = $2 AND revoked_us IS NULL")
            .bind(now_us)
            .bind(id)
            .execute(self.pool())
            .await?;
        self.api_key(id).await?.ok_or_else(|| StoreError::NotFound(format!("API key `{id}` (see `gpuhub keys list`)")))
    }

    /// Sets a key's allow-list and own limits (`gpuhub keys set`); a revoked key is left as it
    /// is. Returns the key as stored.
    pub async fn update_api_key(
        &self,
        id: &str,
        models: &[String],
        rpm: Option<u32>,
        tokens_per_day: Option<u64>,
    ) -> Result<ApiKeyRecord, StoreError> {
        sqlx::query("UPDATE api_keys SET models = $1, rpm = $2, tokens_per_day = $3 WHERE id = $4 AND revoked_us IS NULL")
            .bind(models.join(","))
            .bind(rpm.map(i64::from))
            .bind(tokens_per_day.map(|t| i64::try_from(t).unwrap_or(i64::MAX)))
            .bind(id)
            .execute(self.pool())
            .await?;
        self.api_key(id).await?.ok_or_else(|| StoreError::NotFound(format!("API key `{id}` (see `gpuhub keys list`)")))
    }

    /// Inserts a batch of usage rows in one transaction. Rows already stored (same request id,
    /// e.g. replayed from the journal after a crash) are skipped, and only the rows inserted now
    /// are added to the rollups (SQLite: in the same transaction; PostgreSQL: at the next fold,
    /// [`Store::fold_rollups`]), so replaying is exact. Returns how many rows were new.
    pub async fn insert_usage(&self, rows: &[UsageRow]) -> Result<usize, StoreError> {
        self.insert_usage_on(&mut UsageConnection::default(), rows).await
    }

    /// [`Store::insert_usage`] on the connection the caller keeps between batches (the usage
    /// writer's): taken from the pool when there is none or it was idle too long, kept after a
    /// batch that succeeded, closed after one that failed.
    pub async fn insert_usage_on(&self, held: &mut UsageConnection, rows: &[UsageRow]) -> Result<usize, StoreError> {
        if rows.is_empty() {
            return Ok(0);
        }
        let unique = without_repeated_ids(rows);
        let rows = unique.as_deref().unwrap_or(rows);
        let kept = held.0.take();
        match self.backend() {
            super::Backend::Postgres => {
                let mut conn = self.usage_pg_connection(kept).await?;
                // One statement (so one transaction by itself): a round trip per batch instead
                // of six (BEGIN, the rows, three rollups, COMMIT), whose cost made small batches
                // dear.
                let inserted = pg_insert_usage(&mut conn, rows).await;
                held.keep_or_close(conn, inserted.is_ok()).await;
                inserted
            }
            super::Backend::Sqlite => {
                // One that waited longer goes back to the pool, which hands out one it checked.
                let mut conn = match kept {
                    Some((Kept::Pool(conn), used)) if used.elapsed() < UsageConnection::IDLE => conn,
                    _ => self.pool().acquire().await?,
                };
                // Usually every row is new, and the insert needs no ids back (with SQLite each
                // returned id is a message from the database thread). If some were stored before
                // (a replayed journal, a commit retried after an ambiguous failure), that
                // transaction is rolled back and the batch inserted again, learning which rows
                // are new.
                let inserted = match self.insert_usage_with(&mut conn, rows, false).await {
                    Ok(Some(n)) => Ok(n),
                    Ok(None) => self.insert_usage_with(&mut conn, rows, true).await.map(|n| n.unwrap_or(0)),
                    Err(e) => Err(e),
                };
                match inserted {
                    Ok(_) => held.0 = Some((Kept::Pool(conn), std::time::Instant::now())),
                    // On some errors (a full disk) SQLite rolls the transaction back by itself;
                    // sqlx does not know, and the connection can end up inside a later
                    // transaction that holds the write lock, so that every other writer gets
                    // "database is locked" (seen with the state directory full). A connection
                    // that failed is not reused.
                    Err(_) => conn.close_on_drop(),
                }
                inserted
            }
        }
    }

    /// Adds the usage rows that wait for the rollups (PostgreSQL: `usage_rollup_pending`, see
    /// [`fold_rollups_sql`]) to them, on a pooled connection. Every reader of a rollup calls
    /// this first, so what it reads counts every stored row. SQLite: nothing waits (a batch
    /// adds to the rollups in its own transaction). Answers how many rows were added.
    pub async fn fold_rollups(&self) -> Result<i64, StoreError> {
        match self.backend() {
            super::Backend::Sqlite => Ok(0),
            super::Backend::Postgres => Ok(fold_rollups_on::<sqlx::Any>(&mut *self.pool().acquire().await?).await?),
        }
    }

    /// [`Store::fold_rollups`] on the usage writer's kept connection (PostgreSQL), which it
    /// calls about once a second while it stores rows. Like a batch, a fold that fails closes
    /// the connection.
    pub async fn fold_rollups_on(&self, held: &mut UsageConnection) -> Result<i64, StoreError> {
        if self.backend() == super::Backend::Sqlite {
            return Ok(0);
        }
        let mut conn = self.usage_pg_connection(held.0.take()).await?;
        let folded = fold_rollups_on::<sqlx::Postgres>(&mut conn).await;
        held.keep_or_close(conn, folded.is_ok()).await;
        Ok(folded?)
    }

    /// The usage writer's PostgreSQL connection: the kept one, pinged first if it was idle
    /// past [`UsageConnection::IDLE`], else a new one.
    async fn usage_pg_connection(&self, kept: Option<(Kept, std::time::Instant)>) -> Result<sqlx::PgConnection, StoreError> {
        use sqlx::Connection;
        // Outside the pool, but closed with it ([`Store::close`]).
        if self.pool().is_closed() {
            return Err(StoreError::Query(sqlx::Error::PoolClosed));
        }
        if let Some((Kept::Postgres(mut conn), used)) = kept {
            if used.elapsed() < UsageConnection::IDLE || conn.ping().await.is_ok() {
                return Ok(conn);
            }
            drop(conn.close_hard().await);
        }
        let Some(super::PgConnect(opts)) = &self.pg else {
            return Err(StoreError::Query(sqlx::Error::Configuration("the store has no PostgreSQL connect options".into())));
        };
        match tokio::time::timeout(super::ACQUIRE_TIMEOUT, sqlx::PgConnection::connect_with(opts)).await {
            Ok(conn) => Ok(conn?),
            Err(_) => Err(StoreError::Query(sqlx::Error::PoolTimedOut)),
        }
    }

    /// SQLite: one transaction on `conn`, the rows and the rollups of those that are new.
    /// Without `learn_ids`, gives up (rolls back, `None`) unless every row is new.
    async fn insert_usage_with(
        &self,
        conn: &mut sqlx::AnyConnection,
        rows: &[UsageRow],
        learn_ids: bool,
    ) -> Result<Option<usize>, StoreError> {
        use sqlx::Connection;
        let mut tx = conn.begin().await?;
        let mut learned: Vec<UsageRow> = Vec::new();
        for chunk in rows.chunks(SQLITE_ROWS_PER_STATEMENT) {
            let sql = sqlite_usage_insert_sql(chunk.len(), learn_ids);
            let q = bind_usage(sqlx::query(&sql), chunk);
            if learn_ids {
                let ids: Vec<String> =
                    q.fetch_all(&mut *tx).await?.iter().map(|row| row.try_get::<String, _>(0)).collect::<Result<_, _>>()?;
                let ids: std::collections::HashSet<String> = ids.into_iter().collect();
                learned.extend(chunk.iter().filter(|r| ids.contains(&r.request_id)).cloned());
            } else if q.execute(&mut *tx).await?.rows_affected() != chunk.len() as u64 {
                tx.rollback().await?;
                return Ok(None);
            }
        }
        let inserted = if learn_ids { &learned[..] } else { rows };
        // Hourly call rollups of the new rows.
        let mut sums: BTreeMap<(i64, &str, &str, &str, &str), [i64; 7]> = BTreeMap::new();
        for r in inserted {
            let k = (
                r.time_us - r.time_us.rem_euclid(HOUR_US),
                r.user.as_str(),
                r.app.as_str(),
                r.requested_name.as_str(),
                r.resolved_model.as_str(),
            );
            let s = sums.entry(k).or_insert([0; 7]);
            let calls = r.calls.max(1);
            s[0] += calls;
            s[1] += if r.status >= 400 { calls } else { 0 };
            s[2] += r.prompt_tokens;
            s[3] += r.completion_tokens;
            s[4] += r.latency_us.saturating_mul(calls);
            s[5] += (r.latency_us - r.overhead_us).max(0);
            s[6] = s[6].max(r.latency_us);
        }
        for ((hour, user, app, name, model), s) in &sums {
            sqlx::query(sqlite_call_rollup_sql())
                .bind(*hour)
                .bind(*user)
                .bind(*app)
                .bind(*name)
                .bind(*model)
                .bind(s[0])
                .bind(s[1])
                .bind(s[2])
                .bind(s[3])
                .bind(s[4])
                .bind(s[5])
                .bind(s[6])
                .execute(&mut *tx)
                .await?;
        }
        crate::names::callers::roll_up(&mut tx, inserted).await?;
        tx.commit().await?;
        Ok(Some(inserted.len()))
    }

    /// Calls per user, app, requested name and model since `since_us`, from the hourly
    /// rollups (whole hours: the hour that contains `since_us` counts whole). `user` limits
    /// it to one user.
    pub async fn call_summary(&self, since_us: i64, user: Option<&str>) -> Result<Vec<CallSummary>, StoreError> {
        self.fold_rollups().await?;
        let hour = since_us - since_us.rem_euclid(HOUR_US);
        let sql = format!(
            "SELECT user_name, app, requested_name, resolved_model, CAST(SUM(calls) AS BIGINT) AS calls, CAST(SUM(errors) AS BIGINT) AS errors, \
             CAST(SUM(prompt_tokens) AS BIGINT) AS pt, CAST(SUM(completion_tokens) AS BIGINT) AS ct, CAST(SUM(latency_us_sum) AS BIGINT) AS lat \
             FROM call_rollups WHERE hour_us >= $1 {} GROUP BY user_name, app, requested_name, resolved_model ORDER BY calls DESC, user_name, app, requested_name",
            if user.is_some() { "AND user_name = $2" } else { "" }
        );
        let mut q = sqlx::query(&sql).bind(hour);
        if let Some(u) = user {
            q = q.bind(u);
        }
        let rows = q.fetch_all(self.pool()).await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            let calls: i64 = r.try_get("calls")?;
            let lat: i64 = r.try_get("lat")?;
            out.push(CallSummary {
                user: r.try_get("user_name")?,
                app: r.try_get("app")?,
                requested_name: r.try_get("requested_name")?,
                model: r.try_get("resolved_model")?,
                calls,
                errors: r.try_get("errors")?,
                prompt_tokens: r.try_get("pt")?,
                completion_tokens: r.try_get("ct")?,
                mean_latency_us: if calls > 0 { lat / calls } else { 0 },
            });
        }
        Ok(out)
    }

    /// What the gateway's limits count, reloaded at start ([`crate::gateway::fair_use`]):
    /// per (user, key id), the tokens of calls since `day_us` and the calls admitted since
    /// `minute_us` (calls refused by a limit and unauthenticated refusals left out).
    pub async fn limit_usage(&self, day_us: i64, minute_us: i64) -> Result<Vec<LimitUsage>, StoreError> {
        let rows = sqlx::query(
            "SELECT user_name, key_id, CAST(SUM(prompt_tokens + completion_tokens) AS BIGINT) AS tokens, \
             CAST(SUM(CASE WHEN time_us >= $2 AND error_code NOT IN ('rate_limit_exceeded', 'token_limit_exceeded') THEN calls ELSE 0 END) AS BIGINT) AS recent \
             FROM usage_log WHERE time_us >= $1 AND user_name <> '' GROUP BY user_name, key_id",
        )
        .bind(day_us.min(minute_us))
        .bind(minute_us)
        .fetch_all(self.pool())
        .await?;
        let mut out = Vec::with_capacity(rows.len());
        for r in rows {
            out.push(LimitUsage {
                user: r.try_get("user_name")?,
                key_id: r.try_get("key_id")?,
                tokens: r.try_get::<Option<i64>, _>("tokens")?.unwrap_or(0),
                recent_calls: r.try_get::<Option<i64>, _>("recent")?.unwrap_or(0),
            });
        }
        Ok(out)
    }

    /// Number of usage rows (tests, `doctor`).
    pub async fn usage_row_count(&self) -> Result<i64, StoreError> {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM usage_log").fetch_one(self.pool()).await?;
        Ok(n)
    }
}

/// Whether the store refused a batch because of what some row holds (a value the database
/// will never take, however often it is retried), as opposed to the store being unreachable,
/// busy or out of space. PostgreSQL: SQLSTATE classes 22 (data exception, e.g. a NUL byte in
/// a text value), 23 (integrity constraint) and 54 (program limit exceeded). SQLite: TOOBIG,
/// CONSTRAINT and MISMATCH. An encoding error of a bound value counts too.
pub fn refuses_rows(e: &StoreError) -> bool {
    let StoreError::Query(q) = e else { return false };
    match q {
        sqlx::Error::Encode(_) => true,
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            if db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().is_some() {
                code.starts_with("22") || code.starts_with("23") || code.starts_with("54")
            } else {
                // SQLite's (extended) result code: the primary code is the low byte.
                code.parse::<u32>().is_ok_and(|n| matches!(n & 0xff, 18..=20))
            }
        }
        _ => false,
    }
}

type AnyQuery<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>;

/// Binds `rows` to a SQLite usage INSERT of as many rows, row by row.
fn bind_usage<'q>(mut q: AnyQuery<'q>, rows: &'q [UsageRow]) -> AnyQuery<'q> {
    for r in rows {
        for (_, column) in USAGE_COLUMNS {
            q = match *column {
                Column::Text(f) => q.bind(f(r)),
                Column::Int(f) => q.bind(f(r)),
                Column::OptInt(f) => q.bind(f(r)),
            };
        }
    }
    q
}

/// PostgreSQL: a batch as [`pg_usage_batch_sql`] takes it, one binary array per column
/// (PostgreSQL spent 8 % more CPU per batch parsing the same rows as one JSON parameter,
/// `bench/usage-batch.sh`). Answers how many rows were new.
async fn pg_insert_usage(conn: &mut sqlx::PgConnection, rows: &[UsageRow]) -> Result<usize, StoreError> {
    let mut q = sqlx::query_scalar::<_, i64>(pg_usage_batch_sql());
    for (_, column) in USAGE_COLUMNS {
        q = match *column {
            Column::Text(f) => q.bind(rows.iter().map(f).collect::<Vec<&str>>()),
            Column::Int(f) => q.bind(rows.iter().map(f).collect::<Vec<i64>>()),
            Column::OptInt(f) => q.bind(rows.iter().map(f).collect::<Vec<Option<i64>>>()),
        };
    }
    Ok(usize::try_from(q.fetch_one(conn).await?).unwrap_or(0))
}

/// SQLite: one bucket of the hourly call rollup, upserted (built once: it runs per bucket and
/// batch).
fn sqlite_call_rollup_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| format!("{CALL_ROLLUPS_INSERT} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12){CALL_ROLLUPS_CONFLICT}"))
}

/// A request id twice in one batch (a row replayed from the journal beside its own delivery)
/// is one call: the insert would skip the second and the rollups count it. `None` when every
/// id is new (the usual batch, no copy), else the rows without the repeats.
fn without_repeated_ids(rows: &[UsageRow]) -> Option<Vec<UsageRow>> {
    let mut seen = std::collections::HashSet::with_capacity(rows.len());
    let first = rows.iter().position(|r| !seen.insert(r.request_id.as_str()))?;
    let mut out = rows[..first].to_vec();
    out.extend(rows[first..].iter().filter(|r| seen.insert(r.request_id.as_str())).cloned());
    Some(out)
}

/// SQLite: the INSERT of `rows` usage rows (`rows` x 24 anonymous `?` placeholders) that
/// skips request ids already stored (`returning`: and answers with the ids it inserted).
fn sqlite_usage_insert_sql(rows: usize, returning: bool) -> String {
    let names = USAGE_COLUMNS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
    let one = format!("({})", vec!["?"; USAGE_COLUMNS.len()].join(", "));
    let mut sql = format!("INSERT INTO usage_log ({names}) VALUES {} ON CONFLICT (request_id) DO NOTHING", vec![one; rows].join(", "));
    if returning {
        sql.push_str(" RETURNING request_id");
    }
    sql
}

/// PostgreSQL: a whole batch in one statement, so in one transaction of its own. The rows are
/// one array per column ([`pg_insert_usage`]: 24 binds per batch instead of 24 per row; encoding
/// those binds was most of the usage writer's 7.4 % of the agent's CPU at ~1,900 calls/s); those
/// whose request id is stored already are skipped (`ON CONFLICT DO NOTHING`), and the rollup
/// columns of the rows inserted now (`RETURNING`) are copied to `usage_rollup_pending`, so a
/// replayed row is never counted twice. The rollups themselves are added later, many batches
/// at once ([`fold_rollups_sql`]). Answers how many rows were new.
fn pg_usage_batch_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        let names = USAGE_COLUMNS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ");
        let arrays =
            USAGE_COLUMNS.iter().enumerate().map(|(i, (_, c))| format!("${}::{}", i + 1, c.pg_array())).collect::<Vec<_>>().join(", ");
        format!(
            "WITH batch AS (SELECT * FROM unnest({arrays}) AS r({names})), \
             ins AS (INSERT INTO usage_log ({names}) SELECT {names} FROM batch ON CONFLICT (request_id) DO NOTHING RETURNING {ROLLUP_COLUMNS}), \
             pending AS (INSERT INTO usage_rollup_pending ({ROLLUP_COLUMNS}) SELECT {ROLLUP_COLUMNS} FROM ins) \
             SELECT COUNT(*) FROM ins"
        )
    })
}

/// The usage columns the rollups read: what a row waiting in `usage_rollup_pending` holds
/// (migrations 0020, 0021).
const ROLLUP_COLUMNS: &str = "time_us, user_name, app, requested_name, resolved_model, calls, status, prompt_tokens, \
     completion_tokens, latency_us, job_id, client_addr, user_agent, name_state, overhead_us";

/// The advisory lock a fold holds for its transaction: folds from several agents (and their
/// readers) take turns, so two never upsert the same rollup rows in opposite orders.
pub(super) const FOLD_LOCK: i64 = 0x6770_7568_7562_0001; // "gpuhub" + 1

/// PostgreSQL: adds every row waiting in `usage_rollup_pending` to the hourly rollup, the
/// callers rollup and the per-name totals, deleting them in the same statement, so a row is
/// added once whoever folds it. A usage batch under load is ~20 rows of a few callers: the
/// same rollup rows were upserted on every batch, 100 times a second, which was a third of
/// PostgreSQL's work for the usage log (`bench/gateway-replicas.sh`, BENCHMARKS.md). The rollup
/// rules are those of SQLite's path in Rust ([`Store::insert_usage`]); a test holds both
/// backends to the same rollups.
pub(super) fn fold_rollups_sql() -> &'static str {
    static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        format!(
            "WITH p AS (DELETE FROM usage_rollup_pending RETURNING {ROLLUP_COLUMNS}), \
             hourly AS ({}), callers AS ({}), totals AS ({}) \
             SELECT COUNT(*) FROM p",
            hourly_rollup_sql("p"),
            super::names::callers_rollup_sql("p"),
            super::names::totals_rollup_sql("p"),
        )
    })
}

/// The usage rows in `from`, added to the hourly call rollup (SQLite's batches sum the same in
/// Rust, [`Store::insert_usage`]).
fn hourly_rollup_sql(from: &str) -> String {
    let hour = format!("time_us - (time_us % {HOUR_US})");
    format!(
        "{CALL_ROLLUPS_INSERT} \
         SELECT {hour}, user_name, app, requested_name, resolved_model, CAST(SUM(calls) AS BIGINT), \
         CAST(SUM(CASE WHEN status >= 400 THEN calls ELSE 0 END) AS BIGINT), CAST(SUM(prompt_tokens) AS BIGINT), \
         CAST(SUM(completion_tokens) AS BIGINT), CAST(SUM(latency_us * calls) AS BIGINT), \
         CAST(SUM(CASE WHEN latency_us > overhead_us THEN latency_us - overhead_us ELSE 0 END) AS BIGINT), CAST(MAX(latency_us) AS BIGINT) \
         FROM {from} GROUP BY {hour}, user_name, app, requested_name, resolved_model{CALL_ROLLUPS_CONFLICT}"
    )
}

/// One fold ([`fold_rollups_sql`]) in a transaction of its own on `conn`, under [`FOLD_LOCK`].
/// Answers how many rows it added.
async fn fold_rollups_on<DB>(conn: &mut DB::Connection) -> Result<i64, sqlx::Error>
where
    DB: sqlx::Database,
    for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
    i64: sqlx::Type<DB> + for<'q> sqlx::Encode<'q, DB> + for<'r> sqlx::Decode<'r, DB>,
    for<'q> DB::Arguments<'q>: sqlx::IntoArguments<'q, DB>,
    usize: sqlx::ColumnIndex<DB::Row>,
{
    use sqlx::Connection;
    let mut tx = conn.begin().await?;
    sqlx::query::<DB>("SELECT pg_advisory_xact_lock($1)").bind(FOLD_LOCK).execute(&mut *tx).await?;
    let folded = sqlx::query_scalar::<DB, i64>(fold_rollups_sql()).fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(folded)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[test]
    fn sqlite_binds_anonymous_placeholders_and_a_repeated_id_is_one_call() {
        assert_eq!(sqlite_usage_insert_sql(2, true).matches('?').count(), 2 * USAGE_COLUMNS.len());
        let rows: Vec<UsageRow> = ["a", "b", "a", "c", "b"].iter().map(|id| row(id, 1, "alice", 200, 1)).collect();
        assert!(without_repeated_ids(&rows[..2]).is_none(), "no copy of a batch without repeats");
        let ids: Vec<String> = without_repeated_ids(&rows).unwrap().into_iter().map(|r| r.request_id).collect();
        assert_eq!(ids, ["a", "b", "c"]);
    }

    /// Every rollup a batch feeds (hourly calls, callers, per-name totals) holds the same
    /// counts on both backends (PostgreSQL sums them in SQL, SQLite in Rust), and the same as
    /// a rebuild from the usage log: refused states, aggregated refusals (`calls` > 1), calls
    /// without a name, long user agents, replays and repeats within a batch.
    #[tokio::test]
    async fn rollups_are_the_same_on_every_backend_and_after_a_rebuild() {
        use crate::names::callers;
        let t = 1_800_000_000_000_000;
        let states = ["active", "deprecated", "retired", "unknown", "unassigned", "unserved", ""];
        let rows: Vec<UsageRow> = (0..200i64)
            .map(|i| {
                let mut r = row(
                    &format!("q{i}"),
                    t + i * 997_000_000,
                    ["alice", "bob", ""][i as usize % 3],
                    [200, 429, 500, 401][i as usize % 4],
                    i % 5,
                );
                r.app = ["ocr-service", "batch"][i as usize % 2].into();
                r.requested_name = ["svc-ocr", "dots.ocr", ""][i as usize / 2 % 3].into();
                r.resolved_model = if r.status == 200 { "dots.ocr".into() } else { String::new() };
                r.name_state = states[i as usize % states.len()].into();
                r.job_id = if i % 4 == 0 { None } else { Some(i % 3) };
                r.client_addr = ["10.0.0.1", "unix:uid=1000", "::1"][i as usize % 3].into();
                r.user_agent = if i % 6 == 0 { "ü".repeat(250) } else { "OpenAI/Python 1.0".into() };
                r.calls = if i % 9 == 0 { 40 } else { 1 };
                r.latency_us = 500 + i;
                // Some longer than the call: its busy time is 0, not negative.
                r.overhead_us = i % 7 * 100;
                r
            })
            .collect();
        let mut results = Vec::new();
        for (store, _d) in testing::stores().await {
            assert_eq!(store.insert_usage(&rows[..120]).await.unwrap(), 120);
            // A replay of stored rows, new rows, and a new row twice in one batch.
            let mut again = rows[60..].to_vec();
            again.push(rows[150].clone());
            assert_eq!(store.insert_usage(&again).await.unwrap(), 80, "{:?}", store.backend());
            let summary = store.call_summary(0, None).await.unwrap();
            let mut summary = summary;
            summary.sort_by(|a, b| (&a.user, &a.app, &a.requested_name, &a.model).cmp(&(&b.user, &b.app, &b.requested_name, &b.model)));
            let hourly: Vec<(i64, i64, i64, i64)> = sqlx::query_as(
                "SELECT hour_us, CAST(SUM(calls) AS BIGINT), CAST(SUM(busy_us) AS BIGINT), CAST(MAX(max_latency_us) AS BIGINT) \
                 FROM call_rollups GROUP BY hour_us ORDER BY hour_us",
            )
            .fetch_all(store.pool())
            .await
            .unwrap();
            let mut want_hourly: BTreeMap<i64, (i64, i64, i64)> = BTreeMap::new();
            for r in &rows {
                let h = want_hourly.entry(r.time_us - r.time_us.rem_euclid(HOUR_US)).or_default();
                h.0 += r.calls;
                h.1 += (r.latency_us - r.overhead_us).max(0);
                h.2 = h.2.max(r.latency_us);
            }
            let want_hourly: Vec<(i64, i64, i64, i64)> = want_hourly.into_iter().map(|(h, (c, b, m))| (h, c, b, m)).collect();
            assert_eq!(hourly, want_hourly, "{:?}: hourly calls, busy time and longest call", store.backend());
            // Sorted here: PostgreSQL's text order follows its locale.
            let raw =
                "SELECT name, day_us, user_name, app, job_id, client_addr, user_agent, calls, refused, first_us, last_us FROM name_callers";
            type Raw = (String, i64, String, String, String, String, String, i64, i64, i64, i64);
            let mut live: Vec<Raw> = sqlx::query_as(raw).fetch_all(store.pool()).await.unwrap();
            live.sort();
            let totals = store.name_totals().await.unwrap();
            // What the Rust rollup makes of the same rows.
            let want: Vec<Raw> = callers::aggregate(&rows)
                .into_iter()
                .map(|(k, c)| {
                    (k.name, k.day_us, k.user, k.app, k.job_id, k.client_addr, k.user_agent, c.calls, c.refused, c.first_us, c.last_us)
                })
                .collect();
            assert_eq!(live, want, "{:?}: the callers rollup", store.backend());
            assert_eq!(
                totals.iter().map(|t| t.calls).sum::<i64>(),
                rows.iter().filter(|r| !r.requested_name.is_empty()).map(|r| r.calls).sum::<i64>()
            );
            assert!(live.iter().any(|r| r.6.chars().count() == callers::MAX_USER_AGENT && r.6.starts_with('ü')));
            store.rebuild_name_callers().await.unwrap();
            let mut rebuilt: Vec<Raw> = sqlx::query_as(raw).fetch_all(store.pool()).await.unwrap();
            rebuilt.sort();
            assert_eq!(rebuilt, live, "{:?}: the rebuild from the usage log", store.backend());
            assert_eq!(store.name_totals().await.unwrap(), totals, "{:?}: totals after the rebuild", store.backend());
            results.push((summary, hourly, live, totals));
        }
        let all_calls: i64 = rows.iter().map(|r| r.calls).sum();
        assert_eq!(results[0].0.iter().map(|c| c.calls).sum::<i64>(), all_calls);
        if let [sqlite, pg] = &results[..] {
            assert_eq!(sqlite, pg, "the rollups differ between SQLite and PostgreSQL");
        }
    }

    /// Migration 0021 fills in the busy time and the longest call of the hours stored before
    /// it, on PostgreSQL with rows still waiting for a fold (they come to it without an
    /// overhead): run again on a database put back as it was before it, the rollup holds what
    /// the rows say.
    #[tokio::test]
    async fn migration_0021_fills_in_the_busy_time_of_stored_hours_on_every_backend() {
        use crate::accounting::inference::{callers_between, callers_in_hours};
        let t = 1_800_000_000_000_000;
        let rows: Vec<UsageRow> = (0..90i64)
            .map(|i| {
                let mut r = row(&format!("m{i}"), t + i * 120_000_000, ["alice", "bob"][i as usize % 2], 200, 1);
                r.latency_us = 1_000 + i * 10;
                r.overhead_us = [100, 2_000, 0][i as usize % 3];
                r
            })
            .collect();
        for (store, _d) in testing::stores().await {
            let pool = store.pool();
            // Two hours folded, the second in part, and one only waiting (PostgreSQL).
            assert_eq!(store.insert_usage(&rows[..45]).await.unwrap(), 45);
            store.fold_rollups().await.unwrap();
            assert_eq!(store.insert_usage(&rows[45..]).await.unwrap(), 45);
            for sql in match store.backend() {
                super::super::Backend::Postgres => &[
                    "ALTER TABLE call_rollups DROP COLUMN busy_us, DROP COLUMN max_latency_us",
                    "ALTER TABLE usage_rollup_pending DROP COLUMN overhead_us",
                ][..],
                super::super::Backend::Sqlite => {
                    &["ALTER TABLE call_rollups DROP COLUMN busy_us", "ALTER TABLE call_rollups DROP COLUMN max_latency_us"][..]
                }
            } {
                sqlx::query(sql).execute(pool).await.unwrap();
            }
            sqlx::query("DELETE FROM _sqlx_migrations WHERE version = 21").execute(pool).await.unwrap();
            store.migrate().await.unwrap();
            store.fold_rollups().await.unwrap();
            let first = t - t.rem_euclid(HOUR_US);
            for h in (0..4).map(|n| first + n * HOUR_US) {
                let got = callers_in_hours(pool, "dots.ocr", h, h + HOUR_US).await.unwrap();
                assert_eq!(got, callers_between(pool, "dots.ocr", 0, h, h + HOUR_US).await.unwrap(), "{:?}, hour {h}", store.backend());
                assert_eq!(got.values().map(|b| b.calls).sum::<i64>() > 0, h < t + 90 * 120_000_000);
                let longest: Option<i64> =
                    sqlx::query_scalar("SELECT CAST(MAX(max_latency_us) AS BIGINT) FROM call_rollups WHERE hour_us = $1")
                        .bind(h)
                        .fetch_one(pool)
                        .await
                        .unwrap();
                let want = rows.iter().filter(|r| r.time_us - r.time_us.rem_euclid(HOUR_US) == h).map(|r| r.latency_us).max();
                assert_eq!(longest, want, "{:?}, hour {h}", store.backend());
            }
        }
    }

    /// Every field of a usage row lands in its own column on both backends (PostgreSQL takes
    /// a batch as one array per column, matched to the columns by position: two text fields
    /// swapped would go unnoticed by the rollups), and a row without a job stores NULL.
    #[tokio::test]
    async fn every_field_lands_in_its_column_on_every_backend() {
        use crate::gateway::usage_log::UsageSource;
        let full = UsageRow {
            request_id: "req-1".into(),
            time_us: 1_800_000_000_000_001,
            user: "alice".into(),
            app: "ocr-service".into(),
            job_id: Some(4242),
            client_addr: "10.0.0.9".into(),
            user_agent: "OpenAI/Python 1.2".into(),
            requested_name: "svc-ocr".into(),
            resolved_model: "dots.ocr".into(),
            model_version: "3".into(),
            name_state: "deprecated".into(),
            route: "/v1/chat/completions".into(),
            status: 429,
            error_code: "rate_limited".into(),
            prompt_tokens: 11,
            completion_tokens: 12,
            streamed: true,
            latency_us: 13,
            upstream_ttfb_us: 14,
            overhead_us: 15,
            usage_source: UsageSource::Tokenized,
            adapter: "lora-a".into(),
            calls: 16,
            key_id: "key-7".into(),
        };
        let want = [
            ("request_id", "req-1"),
            ("time_us", "1800000000000001"),
            ("user_name", "alice"),
            ("app", "ocr-service"),
            ("job_id", "4242"),
            ("client_addr", "10.0.0.9"),
            ("user_agent", "OpenAI/Python 1.2"),
            ("requested_name", "svc-ocr"),
            ("resolved_model", "dots.ocr"),
            ("model_version", "3"),
            ("name_state", "deprecated"),
            ("route", "/v1/chat/completions"),
            ("status", "429"),
            ("error_code", "rate_limited"),
            ("prompt_tokens", "11"),
            ("completion_tokens", "12"),
            ("streamed", "1"),
            ("latency_us", "13"),
            ("upstream_ttfb_us", "14"),
            ("overhead_us", "15"),
            ("usage_source", "tokenized"),
            ("adapter", "lora-a"),
            ("calls", "16"),
            ("key_id", "key-7"),
        ];
        assert_eq!(
            want.map(|(c, _)| c)[..],
            USAGE_COLUMNS.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
            "the test names every column, in order"
        );
        let select = want.map(|(c, _)| format!("CAST({c} AS TEXT)")).join(", ");
        let no_job = UsageRow { request_id: "req-2".into(), job_id: None, ..full.clone() };
        for (store, _d) in testing::stores().await {
            let mut conn = UsageConnection::default();
            assert_eq!(store.insert_usage_on(&mut conn, &[full.clone(), no_job.clone()]).await.unwrap(), 2);
            let got =
                sqlx::query(&format!("SELECT {select} FROM usage_log WHERE request_id = 'req-1'")).fetch_one(store.pool()).await.unwrap();
            for (i, (column, value)) in want.iter().enumerate() {
                assert_eq!(got.try_get::<String, _>(i).unwrap(), *value, "{:?}: column {column}", store.backend());
            }
            let (nulls,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM usage_log WHERE request_id = 'req-2' AND job_id IS NULL")
                .fetch_one(store.pool())
                .await
                .unwrap();
            assert_eq!(nulls, 1, "{:?}: a row without a job stores NULL", store.backend());
            // The kept connection takes the next batch, and a replay adds nothing.
            assert_eq!(store.insert_usage_on(&mut conn, std::slice::from_ref(&full)).await.unwrap(), 0);
        }
    }

    /// The usage writer's kept connection is let go once idle for a while: on PostgreSQL it is
    /// closed (it is not the pool's), so a gateway without calls holds none of its own.
    #[tokio::test]
    async fn an_idle_usage_connection_is_let_go() {
        for (store, _d) in testing::stores().await {
            let mut conn = UsageConnection::default();
            store.insert_usage_on(&mut conn, &[row("a", 1, "alice", 200, 1)]).await.unwrap();
            conn.release_if_idle().await;
            assert!(conn.0.is_some(), "{:?}: kept while in use", store.backend());
            // The PostgreSQL backend serving the writer's own connection.
            let pid = match conn.0.as_mut() {
                Some((Kept::Postgres(c), _)) => Some(sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()").fetch_one(c).await.unwrap()),
                _ => None,
            };
            let idle = std::time::Instant::now().checked_sub(UsageConnection::RELEASE).unwrap();
            conn.0.as_mut().unwrap().1 = idle;
            conn.release_if_idle().await;
            assert!(conn.0.is_none(), "{:?}: let go after {:?} idle", store.backend(), UsageConnection::RELEASE);
            if let Some(pid) = pid {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                let alive = "SELECT COUNT(*) FROM pg_stat_activity WHERE pid = $1";
                while sqlx::query_scalar::<_, i64>(alive).bind(pid).fetch_one(store.pool()).await.unwrap() > 0 {
                    assert!(std::time::Instant::now() < deadline, "the writer's own PostgreSQL connection was not closed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
            // The next batch opens one again.
            assert_eq!(store.insert_usage_on(&mut conn, &[row("b", 2, "alice", 200, 1)]).await.unwrap(), 1);
            assert!(conn.0.is_some());
        }
    }

    fn row(id: &str, t: i64, user: &str, status: u16, pt: i64) -> UsageRow {
        UsageRow {
            request_id: id.into(),
            time_us: t,
            user: user.into(),
            app: "ocr-service".into(),
            requested_name: "svc-ocr".into(),
            resolved_model: "dots.ocr".into(),
            status,
            prompt_tokens: pt,
            completion_tokens: 2,
            latency_us: 1000,
            job_id: Some(42),
            ..UsageRow::default()
        }
    }

    #[tokio::test]
    async fn usage_inserts_are_idempotent_and_rolled_up_once_on_every_backend() {
        for (store, _d) in testing::stores().await {
            let t = 1_800_000_000_000_000;
            let rows: Vec<UsageRow> = (0..450)
                .map(|i| row(&format!("r{i}"), t + i, if i % 2 == 0 { "alice" } else { "bob" }, if i % 10 == 0 { 500 } else { 200 }, 3))
                .collect();
            assert_eq!(store.insert_usage(&rows).await.unwrap(), 450);
            // Replaying the same rows (a journal after kill -9) adds nothing.
            assert_eq!(store.insert_usage(&rows[100..300]).await.unwrap(), 0);
            let mut mixed = rows[0..10].to_vec();
            mixed.push(row("new", t, "alice", 200, 5));
            assert_eq!(store.insert_usage(&mixed).await.unwrap(), 1);
            assert_eq!(store.usage_row_count().await.unwrap(), 451);
            let all = store.call_summary(t, None).await.unwrap();
            assert_eq!(all.iter().map(|c| c.calls).sum::<i64>(), 451, "{:?}", store.backend());
            let alice = store.call_summary(t, Some("alice")).await.unwrap();
            assert_eq!(alice.len(), 1);
            assert_eq!(alice[0].calls, 226);
            assert_eq!(alice[0].errors, 45);
            assert_eq!(alice[0].prompt_tokens, 225 * 3 + 5);
            assert_eq!(alice[0].mean_latency_us, 1000);
            assert!(store.call_summary(t + 2 * HOUR_US, None).await.unwrap().is_empty());
        }
    }

    /// PostgreSQL: a batch's rows wait in `usage_rollup_pending` until a fold adds them to the
    /// rollups; folds running at once add each row once, every reader folds first, and a
    /// rebuild of the callers rollup neither loses nor doubles rows that wait. SQLite: a batch
    /// is in the rollups when it is stored, and the same reads give the same answers.
    #[tokio::test]
    async fn stored_rows_reach_the_rollups_once_whoever_folds_them_on_every_backend() {
        let raw_calls = "SELECT CAST(COALESCE(SUM(calls), 0) AS BIGINT) FROM call_rollups";
        for (store, _d) in testing::stores().await {
            let pg = store.backend() == super::super::Backend::Postgres;
            let waiting = || async {
                if !pg {
                    return 0;
                }
                sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM usage_rollup_pending").fetch_one(store.pool()).await.unwrap()
            };
            let t = 1_800_000_000_000_000;
            let rows: Vec<UsageRow> =
                (0..60).map(|i| row(&format!("f{i}"), t + i, ["alice", "bob", "carol"][i as usize % 3], 200, 1)).collect();
            assert_eq!(store.insert_usage(&rows[..30]).await.unwrap(), 30);
            let rolled: i64 = sqlx::query_scalar(raw_calls).fetch_one(store.pool()).await.unwrap();
            assert_eq!((waiting().await, rolled), if pg { (30, 0) } else { (0, 30) }, "{:?}: before a fold", store.backend());
            // Folds at once (two agents, a reader): each row is added once.
            let (a, b, c) = tokio::join!(store.fold_rollups(), store.fold_rollups(), store.fold_rollups());
            assert_eq!(a.unwrap() + b.unwrap() + c.unwrap(), if pg { 30 } else { 0 });
            let rolled: i64 = sqlx::query_scalar(raw_calls).fetch_one(store.pool()).await.unwrap();
            assert_eq!((waiting().await, rolled), (0, 30), "{:?}: after the folds", store.backend());
            // A replay of stored rows waits for nothing; the new rows do, and a reader folds them.
            assert_eq!(store.insert_usage(&rows[20..40]).await.unwrap(), 10);
            assert_eq!(waiting().await, if pg { 10 } else { 0 });
            assert_eq!(store.name_totals().await.unwrap().iter().map(|n| n.calls).sum::<i64>(), 40, "{:?}", store.backend());
            assert_eq!(waiting().await, 0);
            // A rebuild with rows waiting: the hourly rollup gets them, the callers rollup
            // counts them once.
            assert_eq!(store.insert_usage(&rows[40..]).await.unwrap(), 20);
            store.rebuild_name_callers().await.unwrap();
            assert_eq!(waiting().await, 0);
            assert_eq!(store.name_totals().await.unwrap().iter().map(|n| n.calls).sum::<i64>(), 60, "{:?}: totals", store.backend());
            let callers = store.name_callers("svc-ocr", 0).await.unwrap();
            assert_eq!(callers.iter().map(|c| c.calls).sum::<i64>(), 60, "{:?}: callers", store.backend());
            assert_eq!(store.call_summary(t, None).await.unwrap().iter().map(|c| c.calls).sum::<i64>(), 60);
        }
    }

    #[tokio::test]
    async fn aggregated_rows_count_their_calls_and_refused_rows_are_told_apart_on_every_backend() {
        for (store, _d) in testing::stores().await {
            let t = 1_800_000_000_000_000;
            let mut agg = row("agg", t, "", 401, 0);
            agg.calls = 250;
            agg.requested_name = String::new();
            store.insert_usage(&[agg, row("one", t, "alice", 200, 1)]).await.unwrap();
            assert_eq!(store.usage_row_count().await.unwrap(), 2);
            let all = store.call_summary(t, None).await.unwrap();
            assert_eq!(all.iter().map(|c| c.calls).sum::<i64>(), 251);
            assert_eq!(all.iter().map(|c| c.errors).sum::<i64>(), 250);
            // A value only the database refuses (a site's constraint); on PostgreSQL also a NUL
            // byte in text. A store that is closed is not a refusal.
            testing::refuse_user_agent(&store, "reject-me").await;
            if store.backend() == crate::store::Backend::Postgres {
                let mut nul = row("nul", t, "alice", 200, 1);
                nul.requested_name = "bad\0name".into();
                let e = store.insert_usage(&[nul]).await.unwrap_err();
                assert!(refuses_rows(&e), "a NUL byte in a text value: {e:?}");
            }
            let mut bad = row("bad", t, "alice", 200, 1);
            bad.user_agent = "reject-me".into();
            let e = store.insert_usage(&[row("fine", t, "alice", 200, 1), bad]).await.unwrap_err();
            assert!(refuses_rows(&e), "{:?}: {e}", store.backend());
            assert_eq!(store.usage_row_count().await.unwrap(), 2, "the batch was rolled back");
            store.close().await;
            let e = store.insert_usage(&[row("late", t, "alice", 200, 1)]).await.unwrap_err();
            assert!(!refuses_rows(&e), "a closed store is retried, not dead-lettered: {e}");
        }
    }

    #[tokio::test]
    async fn limit_usage_sums_the_day_and_counts_the_last_minute_on_every_backend() {
        for (store, _d) in testing::stores().await {
            let day = 1_800_000_000_000_000;
            let minute = day + 3_600_000_000;
            let mut rows = vec![
                row("old", day - 1, "alice", 200, 100), // yesterday: not counted
                row("a1", day + 5, "alice", 200, 10),   // today, not in the last minute
                row("a2", minute + 5, "alice", 200, 20),
                row("a3", minute + 6, "alice", 429, 0),
                row("b1", minute + 7, "bob", 200, 1),
            ];
            rows[2].key_id = "k1".into();
            rows[3].key_id = "k1".into();
            rows[3].error_code = "rate_limit_exceeded".into();
            let mut anon = row("anon", minute + 8, "", 401, 0);
            anon.calls = 7;
            rows.push(anon);
            store.insert_usage(&rows).await.unwrap();
            let mut got = store.limit_usage(day, minute).await.unwrap();
            got.sort_by(|a, b| (&a.user, &a.key_id).cmp(&(&b.user, &b.key_id)));
            let want = vec![
                LimitUsage { user: "alice".into(), key_id: "".into(), tokens: 12, recent_calls: 0 },
                LimitUsage { user: "alice".into(), key_id: "k1".into(), tokens: 24, recent_calls: 1 },
                LimitUsage { user: "bob".into(), key_id: "".into(), tokens: 3, recent_calls: 1 },
            ];
            assert_eq!(got, want, "{:?}", store.backend());
        }
    }

    #[tokio::test]
    async fn keys_round_trip_and_revoke_on_every_backend() {
        for (store, _d) in testing::stores().await {
            let k = ApiKeyRecord {
                id: "k1".into(),
                key_hash: "h".into(),
                prefix: "ghk_ab".into(),
                user: "alice".into(),
                app: "ocr".into(),
                models: vec!["a".into(), "b".into()],
                created_us: 1,
                created_by: "root".into(),
                revoked_us: None,
                rpm: Some(30),
                tokens_per_day: Some(5_000_000_000),
            };
            store.insert_api_key(&k).await.unwrap();
            store
                .insert_api_key(&ApiKeyRecord { id: "k2".into(), key_hash: "h2".into(), rpm: None, tokens_per_day: None, ..k.clone() })
                .await
                .unwrap();
            let keys = store.api_keys().await.unwrap();
            assert_eq!(keys[0].models, vec!["a", "b"]);
            assert_eq!((keys[0].rpm, keys[0].tokens_per_day), (Some(30), Some(5_000_000_000)));
            assert_eq!((keys[1].rpm, keys[1].tokens_per_day), (None, None));
            let set = store.update_api_key("k2", &["c".into()], Some(7), None).await.unwrap();
            assert_eq!((set.models, set.rpm, set.tokens_per_day), (vec!["c".to_string()], Some(7), None));
            let set = store.update_api_key("k2", &[], None, Some(9)).await.unwrap();
            assert_eq!((set.models, set.rpm, set.tokens_per_day), (Vec::<String>::new(), None, Some(9)));
            assert!(store.update_api_key("nope", &[], None, None).await.unwrap_err().to_string().contains("gpuhub keys list"));
            assert_eq!(store.revoke_api_key("k1", 5).await.unwrap().revoked_us, Some(5));
            let revoked = store.update_api_key("k1", &[], Some(1), None).await.unwrap();
            assert_eq!((revoked.rpm, revoked.models.len()), (Some(30), 2), "a revoked key is not changed");
            assert_eq!(store.revoke_api_key("k1", 9).await.unwrap().revoked_us, Some(5));
            assert!(store.revoke_api_key("nope", 9).await.unwrap_err().to_string().contains("gpuhub keys list"));
            store
                .insert_api_key(&ApiKeyRecord { id: "k3".into(), key_hash: "h3".into(), user: "bob".into(), created_us: 2, ..k.clone() })
                .await
                .unwrap();
            let ids = |v: Vec<ApiKeyRecord>| v.into_iter().map(|k| k.id).collect::<Vec<_>>();
            assert_eq!(ids(store.api_keys_of("alice").await.unwrap()), vec!["k1", "k2"], "revoked keys are listed too");
            assert_eq!(ids(store.api_keys_of("bob").await.unwrap()), vec!["k3"]);
            assert!(store.api_keys_of("carol").await.unwrap().is_empty());
            let k3 = store.api_key("k3").await.unwrap().unwrap();
            assert_eq!((k3.user.as_str(), k3.revoked_us, k3.models.len()), ("bob", None, 2));
            assert!(store.api_key("nope").await.unwrap().is_none());
        }
    }
}
