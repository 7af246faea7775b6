//! Route table and middleware order. Keep this file short: handlers live in their modules.
//!
//! Authentication is on by default: every route added to `authed` (and the `/v1/*` fallback
//! that forwards calls) passes [`authenticate`] first. Only the explicit allow-list below
//! (`/healthz`, `/readyz`; `/metrics` is on its own listener) skips it, so a new route cannot
//! forget auth.

use std::time::Instant;

use axum::Extension;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use super::server::Peer;
use super::{GatewayError, RequestMeta, auth, models_list, proxy};
use crate::AppState;

/// The gateway's routes.
pub fn router(state: AppState) -> Router {
    let authed = Router::new()
        .route("/v1/models", get(models_list::list).fallback(proxy::unknown_route))
        .route("/v1/models/{*name}", get(models_list::get).fallback(proxy::unknown_route))
        .fallback(proxy::forward)
        .layer(middleware::from_fn_with_state(state.clone(), authenticate));
    Router::new().route("/healthz", get(healthz)).route("/readyz", get(readyz)).merge(authed).with_state(state)
}

/// Stamps the request (id, arrival time, peer) and authenticates it. A refused call (no valid
/// credentials, or a usage log that cannot take its row) is answered OpenAI-shaped and
/// counted per peer, with one usage row per peer and minute (`refusals.rs`).
async fn authenticate(State(state): State<AppState>, Extension(peer): Extension<Peer>, mut req: Request, next: Next) -> Response {
    let meta = RequestMeta {
        request_id: super::new_request_id(),
        started: Instant::now(),
        time_us: crate::util::now_us(),
        client_addr: peer.address(),
        user_agent: req
            .headers()
            .get(axum::http::header::USER_AGENT)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .chars()
            .take(256)
            .collect(),
    };
    let request_id = HeaderValue::from_str(&meta.request_id).ok();
    let gw = &state.gateway;
    let rate = state.config.file.gateway.unauth_refusals_per_s;
    let mut resp = if !gw.usage.accepting() {
        // No call may start that could not be accounted for.
        let h = gw.usage.health();
        let e = GatewayError::UsageBacklog { waiting: h.memory_only, cap: h.memory_cap, dir: h.journal_dir.display().to_string() };
        gw.refuse(&meta, &peer, req.uri().path(), e, rate)
    } else {
        match auth::authenticate(&state, req.headers(), &peer).await {
            Ok(id) => {
                req.extensions_mut().insert(meta);
                req.extensions_mut().insert(id);
                next.run(req).await
            }
            Err(e) => gw.refuse(&meta, &peer, req.uri().path(), e, rate),
        }
    };
    if let Some(id) = request_id {
        resp.headers_mut().insert("x-request-id", id);
    }
    resp
}

/// Process up.
async fn healthz() -> &'static str {
    "ok\n"
}

/// Store reachable, catalog loaded, and the usage log takes rows (calls are not refused
/// with `usage_log_full`).
async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    if !state.gateway.usage.accepting() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(serde_json::json!({"status": "usage log full: the state directory cannot be written"})),
        );
    }
    match state.store.ping().await {
        Ok(()) => (StatusCode::OK, Json(serde_json::json!({"status": "ready", "models": state.catalog.load().models().count()}))),
        Err(e) => {
            tracing::warn!(error = %e, "readyz: store unreachable");
            (StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": "store unreachable"})))
        }
    }
}
