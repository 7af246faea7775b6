//! Route table and middleware order. Keep this file short: handlers live in their modules.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};

use crate::AppState;

/// The gateway's routes. `/healthz`, `/readyz` are the only routes without auth.
pub fn router(state: AppState) -> Router {
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).with_state(state)
}

/// Process up.
async fn healthz() -> &'static str {
    "ok\n"
}

/// Store reachable and catalog loaded.
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    match state.store.ping().await {
        Ok(()) => (StatusCode::OK, Json(serde_json::json!({"status": "ready", "models": state.catalog.models().count()}))),
        Err(e) => {
            tracing::warn!(error = %e, "readyz: store unreachable");
            (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "store unreachable"})))
        }
    }
}
