//! Control-socket routes for quotas (merged in `control/server.rs`):
//!
//! - `GET /v1/quota` → `{scope, quotas: [QuotaStatus], topups: [...]}`: a fresh pass; a user
//!   sees the quotas that cover them, admins see all;
//! - `POST /v1/quota/grant {target, gpu_hours, reason}` (admins): a top-up until the current
//!   period ends; Slurm is brought in step before the answer;
//! - `POST /v1/quota/set {target, gpu_hours | null}` (admins): the limit in place of
//!   agent.toml's (`null`: back to agent.toml's); Slurm in step before the answer;
//! - `POST /v1/quota/revoke {topup_id, reason}` (admins): ends a top-up now (one granted by
//!   mistake); Slurm in step before the answer.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::usage::{self, HOUR_US};
use crate::AppState;
use crate::config::{QuotaConfig, QuotaTarget};
use crate::control::Caller;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/quota", get(show))
        .route("/v1/quota/grant", post(grant))
        .route("/v1/quota/set", post(set))
        .route("/v1/quota/revoke", post(revoke))
}

fn err(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into()}))).into_response()
}

fn failed(e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "quota control API failed");
    err(StatusCode::SERVICE_UNAVAILABLE, format!("the quota pass failed: {e} (see the agent's log; `gpuhub doctor`)"))
}

async fn show(State(state): State<AppState>, caller: Caller) -> Response {
    let statuses = match state.quotas.pass(&state).await {
        Ok(s) => s,
        Err(e) => return failed(e),
    };
    let mine: Vec<_> = statuses.into_iter().filter(|s| caller.admin || s.users.contains(&caller.user)).collect();
    let topups = match state.store.quota_topups(crate::util::now_us()).await {
        Ok(t) => t,
        Err(e) => return failed(e),
    };
    let topups: Vec<_> = topups
        .into_iter()
        .filter(|t| caller.admin || mine.iter().any(|s| s.quota == t.target))
        .map(|t| {
            json!({"id": t.id, "quota": t.target, "gpu_hours": t.amount_us as f64 / HOUR_US as f64, "granted_by": t.granted_by,
                   "reason": t.reason, "granted_s": t.granted_us / 1_000_000, "expires_s": t.expires_us / 1_000_000})
        })
        .collect();
    Json(json!({
        "scope": if caller.admin { "all quotas" } else { "quotas that cover you" },
        "user": caller.user,
        "quotas": mine,
        "topups": topups,
    }))
    .into_response()
}

/// The configured quota `target` names, or an answer that lists the ones there are.
fn quota_of<'a>(state: &'a AppState, target: &str) -> Result<&'a QuotaConfig, (StatusCode, String)> {
    let t = QuotaTarget::parse_key(target).map_err(|m| (StatusCode::BAD_REQUEST, m))?;
    state.config.file.quotas.iter().find(|q| q.target == t).ok_or_else(|| {
        let known: Vec<String> = state.config.file.quotas.iter().map(|q| q.target.key()).collect();
        (
            StatusCode::NOT_FOUND,
            format!(
                "{target} has no quota in agent.toml (known: {}); add a [[quotas]] entry and reload the agent",
                if known.is_empty() { "none".into() } else { known.join(", ") }
            ),
        )
    })
}

fn hours_us(h: f64, what: &str) -> Result<i64, (StatusCode, String)> {
    if h.is_finite() && (0.0..=1.0e6).contains(&h) {
        Ok((h * HOUR_US as f64).round() as i64)
    } else {
        Err((StatusCode::BAD_REQUEST, format!("{what} {h} is not a number of GPU-hours from 0 to 1000000 (fractions allowed: 0.5)")))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantReq {
    target: String,
    gpu_hours: f64,
    #[serde(default)]
    reason: String,
}

async fn grant(State(state): State<AppState>, caller: Caller, Json(req): Json<GrantReq>) -> Response {
    if let Err((status, msg)) = caller.require_admin("granting a quota top-up") {
        return err(status, msg);
    }
    let q = match quota_of(&state, &req.target) {
        Ok(q) => q.clone(),
        Err((status, m)) => return err(status, m),
    };
    let amount = match hours_us(req.gpu_hours, "a top-up of") {
        Ok(0) => return err(StatusCode::BAD_REQUEST, "a top-up of 0 GPU-hours changes nothing; give a positive number"),
        Ok(a) => a,
        Err((status, m)) => return err(status, m),
    };
    let now = crate::util::now_us();
    let expires_s = usage::topup_expiry(q.period, now / 1_000_000);
    let id = match state.store.add_quota_topup(&q.target.key(), amount, &caller.user, &req.reason, now, expires_s * 1_000_000).await {
        Ok(id) => id,
        Err(e) => return failed(e),
    };
    tracing::info!(quota = %q.target.key(), gpu_hours = req.gpu_hours, by = %caller.user, id, "quotas: top-up granted");
    after_change(&state, &q.target.key(), json!({"topup_id": id, "expires_s": expires_s})).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SetReq {
    target: String,
    gpu_hours: Option<f64>,
}

async fn set(State(state): State<AppState>, caller: Caller, Json(req): Json<SetReq>) -> Response {
    if let Err((status, msg)) = caller.require_admin("setting a quota's limit") {
        return err(status, msg);
    }
    let q = match quota_of(&state, &req.target) {
        Ok(q) => q.clone(),
        Err((status, m)) => return err(status, m),
    };
    let limit = match req.gpu_hours.map(|h| hours_us(h, "a limit of")).transpose() {
        Ok(l) => l,
        Err((status, m)) => return err(status, m),
    };
    if let Err(e) = state.store.set_quota_limit(&q.target.key(), limit, &caller.user, crate::util::now_us()).await {
        return failed(e);
    }
    tracing::info!(quota = %q.target.key(), gpu_hours = ?req.gpu_hours, by = %caller.user, "quotas: limit set");
    after_change(&state, &q.target.key(), json!({})).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RevokeReq {
    topup_id: i64,
    #[serde(default)]
    reason: String,
}

async fn revoke(State(state): State<AppState>, caller: Caller, Json(req): Json<RevokeReq>) -> Response {
    if let Err((status, msg)) = caller.require_admin("revoking a quota top-up") {
        return err(status, msg);
    }
    match state.store.revoke_quota_topup(req.topup_id, &caller.user, &req.reason, crate::util::now_us()).await {
        Ok(Some(target)) => {
            tracing::info!(quota = %target, id = req.topup_id, by = %caller.user, "quotas: top-up revoked");
            after_change(&state, &target, json!({"revoked_topup_id": req.topup_id})).await
        }
        Ok(None) => err(
            StatusCode::NOT_FOUND,
            format!(
                "no top-up {} is in force (revoked already, expired, or never granted); `gpuhub quota` lists the top-ups in force with their ids",
                req.topup_id
            ),
        ),
        Err(e) => failed(e),
    }
}

/// Runs a pass at once (so Slurm holds or releases before the answer) and answers with the
/// quota's new status.
async fn after_change(state: &AppState, key: &str, mut extra: serde_json::Value) -> Response {
    match state.quotas.pass(state).await {
        Ok(statuses) => {
            extra["quota"] = json!(statuses.into_iter().find(|s| s.quota == key));
            Json(extra).into_response()
        }
        Err(e) => failed(e),
    }
}
