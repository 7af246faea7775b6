//! `/v1/status` (what `gpuhub doctor` checks) and `/v1/admin/backup`.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};

use super::Caller;
use crate::AppState;

/// One health check: what was checked, whether it is fine, and what to do if not.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
    pub fix: Option<String>,
}

fn check(name: &str, ok: bool, detail: String, fix: &str) -> Check {
    Check { name: name.into(), ok, detail, fix: if ok { None } else { Some(fix.into()) } }
}

/// The agent-side checks. Cheap and bounded (the MLflow probe has a 2 s timeout).
pub async fn status(State(state): State<AppState>) -> Json<Vec<Check>> {
    let cfg = &state.config;
    let mut checks = Vec::new();

    let store = state.store.ping().await;
    checks.push(check(
        "store",
        store.is_ok(),
        match &store {
            Ok(()) => format!("{} reachable", crate::config::redact_url(&cfg.store_url)),
            Err(e) => format!("{}: {e}", crate::config::redact_url(&cfg.store_url)),
        },
        "check store.url in agent.toml and that the database is running",
    ));

    let spool = &cfg.file.paths.spool_dir;
    let probe = spool.join(".gpuhub-doctor-probe");
    let writable = std::fs::create_dir_all(spool).and_then(|_| std::fs::write(&probe, b"x")).and_then(|_| std::fs::remove_file(&probe));
    checks.push(check(
        "spool",
        writable.is_ok(),
        match &writable {
            Ok(()) => format!("{} writable", spool.display()),
            Err(e) => format!("{}: {e}", spool.display()),
        },
        "create the spool directory (root, 0755) or fix paths.spool_dir; it must match the plugstack spool_dir",
    ));

    let snap_age = std::fs::metadata(&cfg.snapshot_path).and_then(|m| m.modified()).ok().and_then(|t| t.elapsed().ok());
    checks.push(check(
        "snapshot",
        snap_age.is_some(),
        match snap_age {
            Some(a) => format!("{} written {}s ago", cfg.snapshot_path.display(), a.as_secs()),
            None => format!("{} missing", cfg.snapshot_path.display()),
        },
        "the agent writes it at start; check that paths.runtime_dir is writable",
    ));

    let gpus = state.telemetry.gpus();
    checks.push(check(
        "nvml",
        state.telemetry.nvml_up(),
        if state.telemetry.nvml_up() { format!("{} GPU(s) visible", gpus.len()) } else { "NVML not available".into() },
        "install the NVIDIA driver (libnvidia-ml.so.1) or set telemetry.nvml_library; without it GPU metrics are off",
    ));

    checks.push(check(
        "job-key",
        state.job_key.is_some(),
        format!("{}", cfg.job_key_path.display()),
        "the agent creates it at start; check that paths.state_dir is writable by root",
    ));

    checks.push(usage_log_check(&state.gateway.usage.health()));

    let roles = state.names.roles();
    checks.push(match state.names.unserved_roles_line() {
        None => check("roles", true, format!("every assigned role's model is served ({} role(s))", roles.values().flatten().count()), ""),
        Some(line) => check("roles", false, format!("not served now: {line}"), crate::names::UNSERVED_ROLE_FIX),
    });

    let allowed = state.names.unserved_allowed(&state.gateway.access.get().user_models);
    checks.push(match crate::names::unserved_allowed_line(&allowed) {
        None => check("user-models", true, "every [gateway.user_models] entry names a served model".into(), ""),
        Some(line) => check(
            "user-models",
            false,
            format!("[gateway.user_models] names what is not served here (its user's calls to it are refused): {line}"),
            crate::names::UNSERVED_ALLOWED_FIX,
        ),
    });

    if let Some(c) = policy_check(&state).await {
        checks.push(c);
    }

    if let Some(uri) = &cfg.file.mlflow.tracking_uri {
        let url = format!("{}/health", uri.trim_end_matches('/'));
        let res = match reqwest::Client::builder().timeout(Duration::from_secs(2)).build() {
            Ok(c) => c.get(&url).send().await.map(|r| r.status().is_success()).unwrap_or(false),
            Err(_) => false,
        };
        checks.push(check("mlflow", res, uri.clone(), "start the MLflow server or fix mlflow.tracking_uri"));
    }
    Json(checks)
}

/// With gateways on several nodes (a PostgreSQL store): whether the other gateways enforce the
/// same policy as this one, from their rows as published now. None where it does not apply.
async fn policy_check(state: &AppState) -> Option<Check> {
    use crate::gateway::policy;
    let me = state.config.file.telemetry.effective_node_name();
    if state.store.backend() != crate::store::Backend::Postgres || !state.config.file.cluster.is_gateway(&me) {
        return None;
    }
    let rows = match state.store.gateway_policies(crate::util::now_us() - policy::FRESH_US).await {
        Ok(rows) => rows,
        Err(e) => {
            return Some(check("gateway-policy", false, format!("cannot read the other gateways' policies: {e}"), "see the store check"));
        }
    };
    let others: Vec<&str> = rows.iter().map(|(g, _)| g.as_str()).filter(|g| *g != me).collect();
    let diffs = policy::compare(&me, &policy::current(state), &rows);
    Some(if diffs.is_empty() {
        let detail = if others.is_empty() {
            "no other gateway has published its settings recently (this is the only gateway)".to_string()
        } else {
            format!("the same [gateway.limits], [gateway.user_models] and keys_per_user as {}", crate::util::sanitize(&others.join(", ")))
        };
        check("gateway-policy", true, detail, "")
    } else {
        check("gateway-policy", false, policy::describe(&diffs), policy::FIX)
    })
}

/// The usage log: rows the store refused (the dead-letter file), rows waiting in memory
/// because the journal cannot be written (a full state disk), and rows waiting for a store
/// that refuses the writer's batches.
pub fn usage_log_check(h: &crate::gateway::usage_log::UsageHealth) -> Check {
    let dead = h.dead_letter_path.display();
    if h.journal_failing {
        return check(
            "usage-log",
            false,
            format!(
                "cannot write the usage journal in {} (disk full?); {} of at most {} rows wait in memory, then calls get 503",
                h.journal_dir.display(),
                h.memory_only,
                h.memory_cap
            ),
            "free space on the filesystem of paths.state_dir (df -h); the waiting rows are written once there is room",
        );
    }
    if h.dead_letters > 0 {
        return check(
            "usage-log",
            false,
            format!(
                "{} usage row(s) the store refused are kept in {dead}{}",
                h.dead_letters,
                h.last_reason.as_deref().map(|r| format!(" (latest reason: {})", crate::util::sanitize(r))).unwrap_or_default()
            ),
            &format!("read the reason on each line of {dead}; once handled, move the file away (the agent appends to a new one)"),
        );
    }
    if let Some(since) = h.store_failing_since_us {
        let for_s = (crate::util::now_us() - since).max(0) / 1_000_000;
        return check(
            "usage-log",
            false,
            format!(
                "the store has refused usage writes for {for_s}s; {} row(s) wait in the journal in {} (nothing is lost)",
                h.waiting,
                h.journal_dir.display()
            ),
            "see the store check and the agent's log (`usage log: the store refused a batch`); the rows are written once the store takes them",
        );
    }
    check("usage-log", true, format!("journal writable, {} row(s) waiting for the store, no refused rows ({dead} absent)", h.waiting), "")
}

#[derive(Debug, Deserialize)]
pub struct BackupRequest {
    /// Directory for the backup (default `<state_dir>/backups`).
    pub dir: Option<std::path::PathBuf>,
    /// Keep this many newest backups (default 7).
    pub keep: Option<usize>,
}

/// Writes a backup of the store (admin only).
pub async fn backup(
    State(state): State<AppState>,
    caller: Caller,
    Json(req): Json<BackupRequest>,
) -> Result<Json<serde_json::Value>, (StatusCode, String)> {
    caller.require_admin("gpuhub backup")?;
    let dir = req.dir.unwrap_or_else(|| state.config.state_path("backups"));
    if !dir.is_absolute() {
        return Err((StatusCode::BAD_REQUEST, format!("backup directory `{}` must be an absolute path", dir.display())));
    }
    match state.store.backup_into(&dir, &state.config.store_url, req.keep.unwrap_or(7)).await {
        Ok(path) => Ok(Json(serde_json::json!({"path": path}))),
        Err(e) => {
            tracing::error!(error = %e, "backup failed");
            Err((StatusCode::INTERNAL_SERVER_ERROR, format!("backup failed: {e}")))
        }
    }
}
