//! The snapshot the SPANK plugin reads, and the job-credential key it signs with.
//!
//! The snapshot is rewritten atomically whenever a role's model changes, so a job that starts
//! a microsecond later gets the new `<ROLE>_MODEL`. `gpuhub env` prints the same variables
//! for services outside Slurm.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use gpuhub_wire::snapshot::{SNAPSHOT_VERSION, Snapshot, role_env_var};

use crate::AppState;

/// Builds the snapshot from the current state.
pub fn build(state: &AppState) -> Snapshot {
    let cfg = &state.config.file;
    Snapshot {
        version: SNAPSHOT_VERSION,
        generated_at: crate::util::now_s(),
        gateway_url: Some(cfg.gateway.public_url()),
        mlflow_tracking_uri: cfg.mlflow.tracking_uri.clone(),
        mlflow_experiment: cfg.mlflow.default_experiment.clone(),
        roles: state.names.roles(),
        gpus: state.gpu_uuids(),
        quota_notes: state.quotas.notes(),
    }
}

/// Writes the snapshot (0644: every job reads it through the plugin running as root, and
/// users may read it too; it holds no secrets).
pub fn write(state: &AppState) -> std::io::Result<()> {
    let snap = build(state);
    let json = serde_json::to_vec_pretty(&snap).map_err(std::io::Error::other)?;
    crate::util::write_atomic(&state.config.snapshot_path, &json, 0o644)?;
    tracing::info!(path = %state.config.snapshot_path.display(), roles = snap.roles.len(), "snapshot written");
    Ok(())
}

/// The variables a service outside Slurm should set (`gpuhub env`), in the plugin's names.
pub fn env_for_services(state: &AppState) -> BTreeMap<String, String> {
    let snap = build(state);
    let mut env = BTreeMap::new();
    if let Some(u) = &snap.gateway_url {
        env.insert("GPUHUB_URL".to_string(), u.clone());
        env.insert("OPENAI_BASE_URL".to_string(), format!("{}/v1", u.trim_end_matches('/')));
    }
    if let Some(u) = &snap.mlflow_tracking_uri {
        env.insert("MLFLOW_TRACKING_URI".to_string(), u.clone());
    }
    for (role, model) in &snap.roles {
        if let (Some(var), Some(model)) = (role_env_var(role), model) {
            env.insert(var, model.clone());
        }
    }
    env
}

/// Creates the job-credential key (32 random bytes, hex, mode 0600) if it does not exist.
pub fn ensure_job_key(path: &Path) -> std::io::Result<()> {
    if path.exists() {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let key: [u8; 32] = rand::random();
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path)?;
    f.write_all(hex::encode(key).as_bytes())?;
    f.sync_all()?;
    tracing::info!(path = %path.display(), "created the job-credential key");
    Ok(())
}

/// Reads the job-credential key (the gateway verifies job tokens with it) with
/// `gpuhub_wire::token::parse_key`, the function the plugin signs with: whitespace at both
/// ends trimmed, at least 16 bytes.
pub fn read_job_key(path: &Path) -> std::io::Result<Vec<u8>> {
    let raw = std::fs::read(path)?;
    gpuhub_wire::token::parse_key(&raw).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{} {e}", path.display())))
}
