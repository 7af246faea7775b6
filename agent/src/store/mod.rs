//! The store: usage records, the gateway's usage log and rollups, API keys, the name registry.
//!
//! One pool for both backends: `sqlx::AnyPool`, chosen by the URL scheme at start. SQLite
//! (`sqlite://PATH`, WAL) is the embedded default; PostgreSQL (`postgres://`) is production.
//! Each backend has its own append-only migrations (`agent/migrations/{sqlite,postgres}`,
//! embedded with `sqlx::migrate!`), because their DDL differs; queries are shared.
//!
//! Rules for SQL in this crate, so every query runs on both backends:
//! - placeholders are `$1, $2, ...` (SQLite accepts them too);
//! - integers are `BIGINT` in PostgreSQL (decode as `i64`), floats `DOUBLE PRECISION`/`REAL`
//!   (`f64`), text `TEXT`; times are Unix microseconds in `BIGINT` columns;
//! - `SUM()` of integers is `NUMERIC` in PostgreSQL, which `Any` cannot decode: write
//!   `CAST(SUM(x) AS BIGINT)`; `COUNT(*)` is fine;
//! - upserts use `INSERT ... ON CONFLICT (...) DO UPDATE/NOTHING` (both support it);
//! - each area keeps its queries in its own file (`store/<area>.rs`, `impl Store { .. }`).

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, Executor};

mod backup;
pub mod gateway;
mod jobs;
mod limit_counts;
mod models;
pub mod names;
mod policies;
mod promotions;
pub mod quotas;
mod worker_use;
pub use limit_counts::LimitCount;
pub use models::WorkerRow;
pub use promotions::PromotionRow;
pub use worker_use::{ClusterLock, LockSession};

/// Which database the URL selected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store URL `{0}` has an unsupported scheme; use sqlite:///PATH or postgres://USER:PASSWORD@HOST/DB")]
    Scheme(String),
    #[error("cannot create the store directory {path}: {source}")]
    Dir { path: String, source: std::io::Error },
    #[error("cannot open the store at {url}: {source} (check store.url and that the database is running)")]
    Connect { url: String, source: sqlx::Error },
    #[error("store migration failed: {}", explain_migrate(.0))]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("store query failed: {0}")]
    Query(#[from] sqlx::Error),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
}

/// Says what a migration failure means for an admin, and what to do.
fn explain_migrate(e: &sqlx::migrate::MigrateError) -> String {
    use sqlx::migrate::MigrateError as M;
    match e {
        M::VersionMissing(v) => {
            format!("this database was migrated by a newer gpuhub (migration {v} is unknown to this agent); upgrade gpuhub-agent")
        }
        M::VersionMismatch(v) => format!(
            "migration {v} in this database differs from the one built into this agent (a development build changed an applied migration); restore a backup made with this version or start from an empty store"
        ),
        other => other.to_string(),
    }
}

/// Begins a transaction that reads and then writes. On SQLite it takes the write lock at once
/// (`BEGIN IMMEDIATE`, waiting up to the busy timeout for another writer): a plain `BEGIN` reads
/// a snapshot first, and when another connection commits before the first write the upgrade
/// fails at once with SQLITE_BUSY_SNAPSHOT ("(code: 517) database is locked"), which the busy
/// timeout does not retry.
pub async fn begin_write(pool: &AnyPool) -> Result<sqlx::Transaction<'static, sqlx::Any>, sqlx::Error> {
    if pool.connect_options().database_url.scheme() == "sqlite" { pool.begin_with("BEGIN IMMEDIATE").await } else { pool.begin().await }
}

/// How long a query waits for a connection (from the pool, or a new one of its own).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(10);

/// A cheap-to-clone handle to the store.
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    /// PostgreSQL's connect options (`None`: SQLite), for a connection outside the pool (the
    /// usage writer's own, [`gateway::UsageConnection`]); they also say the backend.
    pg: Option<PgConnect>,
}

/// Connect options for a PostgreSQL connection of its own; its `Debug` shows no password.
#[derive(Clone)]
struct PgConnect(std::sync::Arc<sqlx::postgres::PgConnectOptions>);

impl std::fmt::Debug for PgConnect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PgConnectOptions { .. }")
    }
}

impl Store {
    /// Connects, creating the SQLite file (and its directory) if needed, and applies migrations.
    pub async fn open(url: &str, max_connections: Option<u32>) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let redacted = crate::config::redact_url(url);
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(StoreError::Scheme(redacted));
        };
        let mut url = url.to_string();
        if backend == Backend::Sqlite {
            let path = url.trim_start_matches("sqlite://").trim_start_matches("sqlite:");
            let path = path.split('?').next().unwrap_or("");
            if !path.is_empty()
                && path != ":memory:"
                && let Some(dir) = Path::new(path).parent()
            {
                std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir { path: dir.display().to_string(), source })?;
            }
            if !url.contains('?') {
                url.push_str("?mode=rwc");
            }
        }
        let opts = AnyConnectOptions::from_str(&url).map_err(|source| StoreError::Connect { url: redacted.clone(), source })?;
        let pg = match backend {
            Backend::Postgres => Some(PgConnect(std::sync::Arc::new(
                sqlx::postgres::PgConnectOptions::from_str(&url).map_err(|source| StoreError::Connect { url: redacted.clone(), source })?,
            ))),
            Backend::Sqlite => None,
        };
        let pool = AnyPoolOptions::new()
            .max_connections(max_connections.unwrap_or(match backend {
                Backend::Sqlite => 4,
                Backend::Postgres => 8,
            }))
            .acquire_timeout(ACQUIRE_TIMEOUT)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        // WAL: readers (CLI queries) never block the ingest and usage-log writers.
                        conn.execute(
                            "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=5000; PRAGMA foreign_keys=ON;",
                        )
                        .await?;
                    }
                    Ok(())
                })
            })
            .connect_with(opts)
            .await
            .map_err(|source| StoreError::Connect { url: redacted.clone(), source })?;
        let store = Store { pool, pg };
        store.migrate().await?;
        Ok(store)
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        match self.backend() {
            Backend::Sqlite => sqlx::migrate!("./migrations/sqlite").run(&self.pool).await?,
            Backend::Postgres => sqlx::migrate!("./migrations/postgres").run(&self.pool).await?,
        }
        Ok(())
    }

    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    pub fn backend(&self) -> Backend {
        if self.pg.is_some() { Backend::Postgres } else { Backend::Sqlite }
    }

    /// Readiness probe (`/readyz`).
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Reads a value from the small key/value table.
    pub async fn get_setting(&self, key: &str) -> Result<Option<String>, StoreError> {
        let row: Option<(String,)> =
            sqlx::query_as("SELECT value FROM settings WHERE key = $1").bind(key).fetch_optional(&self.pool).await?;
        Ok(row.map(|r| r.0))
    }

    /// Writes a value to the small key/value table.
    pub async fn set_setting(&self, key: &str, value: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO settings (key, value, updated_us) VALUES ($1, $2, $3) ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_us = excluded.updated_us")
            .bind(key)
            .bind(value)
            .bind(crate::util::now_us())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! The storage story runs on both backends: SQLite always, PostgreSQL when
    //! `GPUHUB_TEST_PG_URL` points at a server (tests/run-all.sh starts one). Each call gets a
    //! fresh database; `GPUHUB_TEST_KEEP_DB=1` keeps it for inspection.
    use super::*;

    /// The PostgreSQL server the tests may use: `GPUHUB_TEST_PG_URL`. Without it the
    /// PostgreSQL half of a test is left out, except under `GPUHUB_TEST_STRICT=1` (set by
    /// tests/run-all.sh), where a missing server fails the test instead of passing it on
    /// SQLite alone.
    #[allow(clippy::panic)]
    pub fn pg_url(test: &str) -> Option<String> {
        match std::env::var("GPUHUB_TEST_PG_URL").ok().filter(|u| !u.is_empty()) {
            Some(url) => Some(url),
            None if std::env::var("GPUHUB_TEST_STRICT").as_deref() == Ok("1") => panic!(
                "{test}: GPUHUB_TEST_PG_URL is not set but GPUHUB_TEST_STRICT=1 requires the PostgreSQL half; \
                 start a server with tests/lib/pg.sh and export its URL"
            ),
            None => {
                eprintln!("{test}: GPUHUB_TEST_PG_URL not set; PostgreSQL half skipped (tests/lib/pg.sh starts one)");
                None
            }
        }
    }

    /// Returns one store per backend, each on a fresh database: SQLite, and PostgreSQL when
    /// [`pg_url`] has a server.
    pub async fn stores() -> Vec<(Store, Option<tempfile::TempDir>)> {
        let mut out = Vec::new();
        #[allow(clippy::unwrap_used)]
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("t.db").display());
        #[allow(clippy::unwrap_used)]
        out.push((Store::open(&url, None).await.unwrap(), Some(dir)));
        if let Some(pg) = pg_url("every-backend store test") {
            out.push((fresh_pg(&pg).await, None));
        }
        out
    }

    #[allow(clippy::unwrap_used)]
    async fn fresh_pg(base: &str) -> Store {
        Store::open(&fresh_pg_url(base).await, Some(4)).await.unwrap()
    }

    /// The URL of a new, empty database on the server at `base` (for a test that opens its
    /// store through the agent's config).
    #[allow(clippy::unwrap_used, clippy::expect_used)]
    pub async fn fresh_pg_url(base: &str) -> String {
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        sqlx::any::install_default_drivers();
        let name = format!("gpuhub_t_{}_{}_{}", std::process::id(), crate::util::now_us() % 1_000_000, N.fetch_add(1, Ordering::Relaxed));
        let admin = sqlx::AnyPool::connect(base).await.expect("GPUHUB_TEST_PG_URL must reach a PostgreSQL server");
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
        admin.close().await;
        let (prefix, _) = base.rsplit_once('/').unwrap();
        format!("{prefix}/{name}")
    }

    /// Makes the store refuse usage rows whose user agent is `value`, the way a site's own
    /// constraint would: a CHECK constraint on PostgreSQL, a trigger on SQLite. Only the
    /// database knows the rule, so only the database refuses such a row.
    #[allow(clippy::unwrap_used)]
    pub async fn refuse_user_agent(store: &Store, value: &str) {
        let sql = match store.backend() {
            Backend::Postgres => format!("ALTER TABLE usage_log ADD CONSTRAINT refuse_ua CHECK (user_agent <> '{value}')"),
            Backend::Sqlite => format!(
                "CREATE TRIGGER refuse_ua BEFORE INSERT ON usage_log WHEN NEW.user_agent = '{value}' BEGIN SELECT RAISE(ABORT, 'refused by a test trigger'); END"
            ),
        };
        sqlx::query(&sql).execute(store.pool()).await.unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn opens_migrates_and_round_trips_settings_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            store.ping().await.unwrap();
            assert_eq!(store.get_setting("x").await.unwrap(), None);
            store.set_setting("x", "1").await.unwrap();
            store.set_setting("x", "2").await.unwrap();
            assert_eq!(store.get_setting("x").await.unwrap().as_deref(), Some("2"), "{:?}", store.backend());
        }
    }

    /// A transaction that reads, then writes, while another connection commits a write in
    /// between: with a plain `BEGIN` on SQLite its write failed at once with "(code: 517)
    /// database is locked" (a reconciliation that closed an ended job was lost until the next
    /// interval); `begin_write` holds the write lock from its start, so the other writer waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_read_then_write_transaction_outlasts_a_writer_in_between_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            let mut tx = begin_write(store.pool()).await.unwrap();
            let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM settings").fetch_one(&mut *tx).await.unwrap();
            let other = {
                let store = store.clone();
                tokio::spawn(async move { store.set_setting("other", "1").await })
            };
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            let wrote = sqlx::query("INSERT INTO settings (key, value, updated_us) VALUES ('mine', $1, 0)")
                .bind(n.to_string())
                .execute(&mut *tx)
                .await;
            assert!(wrote.is_ok(), "{:?}: the write after another connection's commit failed: {:?}", store.backend(), wrote.err());
            tx.commit().await.unwrap();
            other.await.unwrap().unwrap();
            assert_eq!(store.get_setting("other").await.unwrap().as_deref(), Some("1"));
        }
    }

    #[tokio::test]
    async fn unknown_scheme_names_the_accepted_ones() {
        let err = Store::open("mysql://x/y", None).await.unwrap_err().to_string();
        assert!(err.contains("sqlite:///PATH or postgres://"), "{err}");
    }
}
