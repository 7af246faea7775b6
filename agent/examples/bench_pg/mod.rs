//! What the PostgreSQL benchmark examples share (`usage_batch_cost`, `live_callers_cost`): a
//! fresh database of the server for one run, migrated by the store, and CPU read from /proc (the
//! server must run on this host).

use gpuhub_agent::store::Store;

/// A database made for one run: `admin` on the URL given, `store` on the new database.
pub struct FreshDb {
    pub admin: sqlx::AnyPool,
    pub store: Store,
    pub name: String,
}

impl FreshDb {
    /// Makes `<prefix>_<pid>` on the server of `url` (a URL that names a database) and opens
    /// the store on it with two connections.
    pub async fn create(url: &str, prefix: &str) -> Result<Self, Box<dyn std::error::Error>> {
        let (server, _) = url.rsplit_once('/').ok_or("the URL names no database")?;
        let name = format!("{prefix}_{}", std::process::id());
        sqlx::any::install_default_drivers();
        let admin = sqlx::AnyPool::connect(url).await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await?;
        let store = Store::open(&format!("{server}/{name}"), Some(2)).await?;
        Ok(Self { admin, store, name })
    }

    /// Closes the store and drops the database.
    pub async fn drop(self) -> Result<(), Box<dyn std::error::Error>> {
        self.store.close().await;
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name)).execute(&self.admin).await?;
        Ok(())
    }
}

/// User plus system CPU of `pid` and, with `children`, of its children that have ended, in
/// clock ticks (0 once it is gone).
pub fn cpu_ticks(pid: i32, children: bool) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    let Some(end) = stat.rfind(')') else { return 0 };
    let fields: Vec<&str> = stat[end + 2..].split(' ').collect();
    let field = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    field(11) + field(12) + if children { field(13) + field(14) } else { 0 }
}

/// Milliseconds per clock tick.
pub fn tick_ms() -> f64 {
    // SAFETY: sysconf has no preconditions.
    1000.0 / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}
