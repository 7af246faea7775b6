//! The snapshot: what the agent tells every new job, as a small JSON file.
//!
//! The agent writes it (temp file + `rename`, so a reader never sees half a file) whenever a
//! role's model or a URL changes. The plugin reads it in the job's REMOTE context with a
//! size cap ([`MAX_SNAPSHOT_BYTES`]); a missing, huge or corrupt snapshot means "fall back to
//! the plugstack arguments", never a failed job.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Snapshots larger than this are ignored by the plugin (a corrupt or hostile file must not
/// make every job start slowly).
pub const MAX_SNAPSHOT_BYTES: u64 = 64 * 1024;

/// Current snapshot format version.
pub const SNAPSHOT_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Snapshot {
    /// Format version; the plugin ignores a snapshot with a version it does not know.
    pub version: u32,
    /// Unix seconds when the agent wrote it.
    pub generated_at: i64,
    /// Base URL of the gateway (`GPUHUB_URL`; `OPENAI_BASE_URL` is this + `/v1`).
    pub gateway_url: Option<String>,
    /// `MLFLOW_TRACKING_URI` for jobs.
    pub mlflow_tracking_uri: Option<String>,
    /// Site default for `MLFLOW_EXPERIMENT_NAME` when the job did not choose one.
    pub mlflow_experiment: Option<String>,
    /// App role -> current model name. `None`: the role exists but has no model assigned
    /// (the plugin then injects nothing for it).
    pub roles: BTreeMap<String, Option<String>>,
    /// GPU index -> UUID, so usage records carry UUIDs when the agent has seen NVML.
    #[serde(default)]
    pub gpus: BTreeMap<u32, String>,
    /// uid -> the quota line srun, sbatch and salloc print for that user (only users at 80 %
    /// of a `[[quotas]]` limit or more; docs/quotas.md). The agent words it; the plugin prints
    /// it as it is, so the plugin holds no quota logic.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub quota_notes: BTreeMap<u32, String>,
}

impl Snapshot {
    /// Parses a snapshot, refusing unknown versions.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let snap: Snapshot = serde_json::from_slice(bytes).map_err(|e| format!("corrupt snapshot: {e}"))?;
        if snap.version != SNAPSHOT_VERSION {
            return Err(format!(
                "snapshot version {} is not supported (expected {SNAPSHOT_VERSION}); upgrade gpuhub-spank to match gpuhub-agent",
                snap.version
            ));
        }
        Ok(snap)
    }
}

/// The environment variable for a role: `ocr` -> `OCR_MODEL`, `chat-small` -> `CHAT_SMALL_MODEL`.
/// Returns `None` for a role name that cannot form a portable variable name.
pub fn role_env_var(role: &str) -> Option<String> {
    if role.is_empty() || role.len() > 64 {
        return None;
    }
    let mut out = String::with_capacity(role.len() + 6);
    for c in role.chars() {
        match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' => out.push(c.to_ascii_uppercase()),
            '-' | '_' | '.' => out.push('_'),
            _ => return None,
        }
    }
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    out.push_str("_MODEL");
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_map_to_env_vars() {
        assert_eq!(role_env_var("ocr").as_deref(), Some("OCR_MODEL"));
        assert_eq!(role_env_var("chat-small").as_deref(), Some("CHAT_SMALL_MODEL"));
        assert_eq!(role_env_var("9x"), None);
        assert_eq!(role_env_var("a b"), None);
        assert_eq!(role_env_var(""), None);
    }

    #[test]
    fn unknown_version_is_refused() {
        let raw = br#"{"version":99,"generated_at":0,"gateway_url":null,"mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{}}"#;
        let err = Snapshot::parse(raw).unwrap_err();
        assert!(err.contains("version 99"), "{err}");
    }
}
