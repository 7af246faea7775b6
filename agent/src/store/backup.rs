//! Online backups of the store (`gpuhub backup`, the daily timer).
//!
//! SQLite: `VACUUM INTO` writes a consistent copy while the agent keeps writing (WAL readers
//! are not blocked). PostgreSQL: `pg_dump --format=custom`, with the password in `PGPASSWORD`
//! (its environment is readable only by root), never in its command line (which every user
//! on the node can read in `/proc`). Restore is documented in docs/admin-guide.md and
//! exercised by the backup test.

use std::path::{Path, PathBuf};

use super::{Backend, Store, StoreError};

impl Store {
    /// Writes a backup into `dir` and returns its path. Keeps the newest `keep` backups.
    pub async fn backup_into(&self, dir: &Path, url: &str, keep: usize) -> Result<PathBuf, StoreError> {
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Dir { path: dir.display().to_string(), source })?;
        // Sortable UTC stamp plus microseconds, so two backups in one second do not collide.
        let now = crate::util::now_us();
        let stamp = format!("{}-{:06}", crate::util::utc_stamp(now / 1_000_000), now % 1_000_000);
        let path = match self.backend() {
            Backend::Sqlite => {
                let path = dir.join(format!("gpuhub-{stamp}.db"));
                sqlx::query("VACUUM INTO $1").bind(path.display().to_string()).execute(&self.pool).await?;
                path
            }
            Backend::Postgres => {
                let path = dir.join(format!("gpuhub-{stamp}.pgdump"));
                let (url, password) = split_password(url);
                let mut cmd = tokio::process::Command::new("pg_dump");
                cmd.arg("--format=custom").arg("--file").arg(&path).arg(&url);
                if let Some(p) = password {
                    cmd.env("PGPASSWORD", p);
                }
                let out = cmd
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

/// Splits a PostgreSQL URL into one without its password (for a command line) and the
/// password (percent-decoded, for `PGPASSWORD`), from `user:password@` or `?password=`.
pub fn split_password(url: &str) -> (String, Option<String>) {
    let Some(s) = url.find("://") else { return (url.to_string(), None) };
    let rest = &url[s + 3..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let mut password = None;
    let authority = match authority.rfind('@') {
        Some(at) => match authority[..at].split_once(':') {
            Some((user, pw)) => {
                password = Some(percent_decode(pw));
                format!("{user}{}", &authority[at..])
            }
            None => authority.to_string(),
        },
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let mut kept = Vec::new();
            for kv in query.split('&') {
                match kv.split_once('=') {
                    Some(("password", v)) => password = Some(percent_decode(v)),
                    _ => kept.push(kv),
                }
            }
            if kept.is_empty() { path.to_string() } else { format!("{path}?{}", kept.join("&")) }
        }
        None => tail.to_string(),
    };
    (format!("{}{authority}{tail}", &url[..s + 3]), password)
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
    use super::split_password;

    #[test]
    fn the_password_leaves_the_command_line() {
        assert_eq!(
            split_password("postgres://gpuhub:s3cr%40t@db:5432/gpuhub"),
            ("postgres://gpuhub@db:5432/gpuhub".to_string(), Some("s3cr@t".to_string()))
        );
        assert_eq!(
            split_password("postgresql://u@h/db?sslmode=require&password=p%2Fw"),
            ("postgresql://u@h/db?sslmode=require".to_string(), Some("p/w".to_string()))
        );
        assert_eq!(split_password("postgres://h/db"), ("postgres://h/db".to_string(), None));
    }

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
