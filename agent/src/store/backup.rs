//! Online backups of the store (`gpuhub backup`, the daily timer).
//!
//! SQLite: `VACUUM INTO` writes a consistent copy while the agent keeps writing (WAL readers
//! are not blocked). PostgreSQL: `pg_dump --format=custom`. Restore is documented in
//! docs/admin-guide.md and exercised by the backup test.

use std::path::{Path, PathBuf};

use super::{Backend, Store, StoreError};

impl Store {
    /// Writes a backup into `dir` and returns its path. Keeps the newest `keep` backups.
    pub async fn backup_into(&self, dir: &Path, url: &str, keep: usize) -> Result<PathBuf, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir { path: dir.display().to_string(), source })?;
        // Sortable UTC stamp plus microseconds, so two backups in one second do not collide.
        let now = crate::util::now_us();
        let stamp = format!("{}-{:06}", crate::util::utc_stamp(now / 1_000_000), now % 1_000_000);
        let path = match self.backend {
            Backend::Sqlite => {
                let path = dir.join(format!("gpuhub-{stamp}.db"));
                sqlx::query("VACUUM INTO $1").bind(path.display().to_string()).execute(&self.pool).await?;
                path
            }
            Backend::Postgres => {
                let path = dir.join(format!("gpuhub-{stamp}.pgdump"));
                let out = tokio::process::Command::new("pg_dump")
                    .arg("--format=custom")
                    .arg("--file")
                    .arg(&path)
                    .arg(url)
                    .output()
                    .await
                    .map_err(|e| StoreError::Conflict(format!("cannot run pg_dump: {e} (install the PostgreSQL client tools)")))?;
                if !out.status.success() {
                    return Err(StoreError::Conflict(format!("pg_dump failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
                }
                path
            }
        };
        prune(dir, keep);
        tracing::info!(path = %path.display(), "store backup written");
        Ok(path)
    }
}

/// Removes all but the newest `keep` `gpuhub-*` backups in `dir` (names sort by time).
fn prune(dir: &Path, keep: usize) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("gpuhub-") && (n.ends_with(".db") || n.ends_with(".pgdump")))
        })
        .collect();
    files.sort();
    let excess = files.len().saturating_sub(keep.max(1));
    for f in files.into_iter().take(excess) {
        if let Err(e) = std::fs::remove_file(&f) {
            tracing::warn!(path = %f.display(), error = %e, "cannot remove an old backup");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing;

    #[tokio::test]
    async fn backup_restores_the_data_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            store.set_setting("marker", "before-backup").await.unwrap();
            let out = tempfile::tempdir().unwrap();
            let url = match store.backend() {
                super::Backend::Sqlite => String::new(),
                super::Backend::Postgres => {
                    let row: (String,) = sqlx::query_as("SELECT CAST(current_database() AS TEXT)").fetch_one(store.pool()).await.unwrap();
                    let base = std::env::var("GPUHUB_TEST_PG_URL").unwrap();
                    format!("{}/{}", base.rsplit_once('/').unwrap().0, row.0)
                }
            };
            for _ in 0..3 {
                store.backup_into(out.path(), &url, 2).await.unwrap();
            }
            let files: Vec<_> = std::fs::read_dir(out.path()).unwrap().collect();
            assert_eq!(files.len(), 2, "keeps the newest two");
            if store.backend() == super::Backend::Sqlite {
                let newest = std::fs::read_dir(out.path()).unwrap().map(|e| e.unwrap().path()).max().unwrap();
                let restored = super::Store::open(&format!("sqlite://{}", newest.display()), None).await.unwrap();
                assert_eq!(restored.get_setting("marker").await.unwrap().as_deref(), Some("before-backup"));
            }
        }
    }
}
