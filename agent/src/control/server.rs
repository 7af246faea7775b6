//! Serves the control API on the Unix socket.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use tokio::net::UnixListener;

use super::{Caller, PeerCred};
use crate::AppState;

/// The control API routes. Each area adds its routes here.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/whoami", get(whoami))
        .merge(crate::accounting::api::routes())
        .merge(crate::quota::api::routes())
        .route("/v1/env", get(env))
        .merge(crate::names::api::routes())
        .merge(crate::gateway::api::routes())
        .merge(crate::models::api::routes())
        .route("/v1/status", get(super::status::status))
        .route("/v1/admin/backup", axum::routing::post(super::status::backup))
        .with_state(state)
}

/// Binds the socket (replacing a stale one) with mode 0666.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let l = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(l)
}

pub async fn serve(listener: UnixListener, state: AppState) -> std::io::Result<()> {
    let shutdown = state.shutdown.clone();
    axum::serve(listener, router(state).into_make_service_with_connect_info::<PeerCred>())
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

async fn whoami(caller: Caller) -> Json<serde_json::Value> {
    Json(serde_json::json!({"uid": caller.uid, "user": caller.user, "admin": caller.admin, "version": env!("CARGO_PKG_VERSION")}))
}

/// What `gpuhub env` prints: the same variables the SPANK plugin injects into jobs, for
/// services outside Slurm (a systemd unit's `EnvironmentFile`).
async fn env(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::to_value(crate::snapshot::env_for_services(&state)).unwrap_or_default())
}
