use serde::{Deserialize, Serialize};

/// `[store]`: where usage, names and keys are kept.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// `sqlite:///var/lib/gpuhub/gpuhub.db` (the default, derived from `paths.state_dir`) or
    /// `postgres://user:password@host/db` for production. `GPUHUB_STORE_URL` overrides.
    pub url: Option<String>,
    /// Connection pool size (on PostgreSQL the usage writer holds one more of its own).
    pub max_connections: Option<u32>,
}

pub(super) fn validate_url(url: &str) -> Result<(), String> {
    if url.starts_with("sqlite:") || url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(())
    } else {
        Err(format!("`{}` has an unsupported scheme; use sqlite:///PATH or postgres://USER:PASSWORD@HOST/DB", super::redact_url(url)))
    }
}
