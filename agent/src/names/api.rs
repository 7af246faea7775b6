//! Control-socket routes behind `gpuhub names` and `gpuhub roles`.
//!
//! Reads are open to every local user (names are not secret), except that a non-admin sees
//! only their own calls in `callers`. Changes need an admin. Names travel in JSON bodies,
//! not in paths, because model names contain `/` (`Qwen/Qwen3-8B`).
//!
//! A change answers `{"applied", "dry_run", "refused", "plan", "callers"}`: `refused` is true
//! when the plan needs `--force` and it was not given (the CLI exits 1), so the caller always
//! sees who would be affected.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

use super::callers::CallersReport;
use super::lifecycle::{self, Ctx, LifecycleError, Plan};
use crate::AppState;
use crate::control::Caller;
use crate::store::names::day_of;

/// The routes; `control::server::router` merges them.
pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/names", get(list))
        .route("/v1/names/callers", post(callers))
        .route("/v1/names/history", post(history))
        .route("/v1/names/rename", post(rename))
        .route("/v1/names/deprecate", post(deprecate))
        .route("/v1/names/retire", post(retire))
        .route("/v1/names/restore", post(restore))
        .route("/v1/names/rebuild-callers", post(rebuild_callers))
        .route("/v1/roles", get(roles))
        .route("/v1/roles/set", post(role_set))
        .route("/v1/roles/unset", post(role_unset))
}

/// Most callers listed in one answer (the totals count them all).
const MAX_CALLERS: usize = 1000;
/// Most never-known names `list` shows (most recently called first).
const MAX_UNKNOWN_LISTED: usize = 100;

fn err(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": message.into()}))).into_response()
}

fn store_err(e: crate::store::StoreError) -> Response {
    tracing::error!(error = %e, "names: store query failed");
    err(StatusCode::SERVICE_UNAVAILABLE, format!("the store did not answer: {e} (see the agent's log; `gpuhub doctor`)"))
}

fn lifecycle_err(e: LifecycleError) -> Response {
    let status = StatusCode::from_u16(e.status_code()).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY);
    err(status, e.to_string())
}

/// `since_s` (seconds back from now) -> the start of the UTC day it falls in.
fn window_start(since_s: Option<i64>, default_days: u32) -> Result<i64, String> {
    let s = since_s.unwrap_or(i64::from(default_days) * 86_400);
    if s <= 0 || s > 3650 * 86_400 {
        return Err(format!("--since must be between 1s and 3650d (got {s}s)"));
    }
    Ok(day_of(crate::util::now_us() - s * 1_000_000))
}

async fn list(State(state): State<AppState>) -> Response {
    state.gateway.settle_usage().await;
    let totals = match state.store.name_totals().await {
        Ok(t) => t,
        Err(e) => return store_err(e),
    };
    let mut out = Vec::new();
    let entries = state.names.entries();
    for e in &entries {
        let t = totals.iter().find(|t| t.name == e.name);
        let mut v = serde_json::to_value(e).unwrap_or_default();
        v["calls"] = json!(t.map(|t| t.calls).unwrap_or(0));
        v["refused"] = json!(t.map(|t| t.refused).unwrap_or(0));
        v["last_call_us"] = json!(t.map(|t| t.last_us));
        out.push(v);
    }
    // Names nobody configured but clients call: the 404s an admin must see (the most recent
    // ones: client input is unbounded).
    let mut unknown: Vec<_> = totals.iter().filter(|t| !entries.iter().any(|e| e.name == t.name)).collect();
    unknown.sort_by_key(|t| std::cmp::Reverse(t.last_us));
    let more_unknown = unknown.len().saturating_sub(MAX_UNKNOWN_LISTED);
    for t in unknown.into_iter().take(MAX_UNKNOWN_LISTED) {
        out.push(json!({
            "name": t.name, "state": "unknown", "kind": "unknown", "serves": null, "replacement": null,
            "since": null, "sunset": null, "changed_by": null, "changed_us": null,
            "calls": t.calls, "refused": t.refused, "last_call_us": t.last_us,
        }));
    }
    Json(json!({"names": out, "today": super::today(), "more_unknown": more_unknown})).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CallersReq {
    name: String,
    since_s: Option<i64>,
    limit: Option<usize>,
}

async fn callers(State(state): State<AppState>, caller: Caller, Json(req): Json<CallersReq>) -> Response {
    let since_us = match window_start(req.since_s.or(Some(30 * 86_400)), 30) {
        Ok(s) => s,
        Err(m) => return err(StatusCode::UNPROCESSABLE_ENTITY, m),
    };
    state.gateway.settle_usage().await;
    let mut rows = match state.store.name_callers(&req.name, since_us).await {
        Ok(r) => r,
        Err(e) => return store_err(e),
    };
    if !caller.admin {
        rows.retain(|r| r.user_name == caller.user);
    }
    let report = CallersReport::build(&req.name, since_us, rows, req.limit.unwrap_or(100).min(MAX_CALLERS));
    let r = state.names.resolve(&req.name);
    Json(json!({"report": report, "state": r.state(), "serves": r.model(), "own_calls_only": !caller.admin})).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HistoryReq {
    name: Option<String>,
    limit: Option<i64>,
}

async fn history(State(state): State<AppState>, Json(req): Json<HistoryReq>) -> Response {
    match state.store.name_history(req.name.as_deref(), req.limit.unwrap_or(100).clamp(1, 10_000)).await {
        Ok(rows) => Json(json!({"history": rows})).into_response(),
        Err(e) => store_err(e),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeReq {
    name: String,
    /// rename: the new name; deprecate: the replacement; role set: the model.
    to: Option<String>,
    sunset: Option<String>,
    #[serde(default)]
    dry_run: bool,
    #[serde(default)]
    force: bool,
    since_s: Option<i64>,
}

#[derive(Clone, Copy)]
enum Change {
    Rename,
    Deprecate,
    Retire,
    Restore,
    RoleSet,
    RoleUnset,
}

impl Change {
    fn what(self) -> &'static str {
        match self {
            Change::Rename => "renaming a model name",
            Change::Deprecate => "deprecating a model name",
            Change::Retire => "retiring a model name",
            Change::Restore => "restoring a model name",
            Change::RoleSet | Change::RoleUnset => "changing a role's model",
        }
    }
}

/// Plans a change with the callers of the name in the window, then applies it unless it is
/// a dry run or needs `--force`.
async fn change(state: AppState, caller: Caller, req: ChangeReq, kind: Change) -> Response {
    if let Err((status, msg)) = caller.require_admin(kind.what()) {
        return err(status, msg);
    }
    let names = state.names.clone();
    let _guard = names.change_lock().lock().await;
    let inner = names.view();
    let since_us = match window_start(req.since_s, names.recent_caller_days().max(1)) {
        Ok(s) => s,
        Err(m) => return err(StatusCode::UNPROCESSABLE_ENTITY, m),
    };
    let report = match kind {
        Change::RoleSet | Change::RoleUnset => CallersReport::build(&req.name, since_us, Vec::new(), 0),
        _ => {
            state.gateway.settle_usage().await;
            match state.store.name_callers(&req.name, since_us).await {
                Ok(rows) => CallersReport::build(&req.name, since_us, rows, 50),
                Err(e) => return store_err(e),
            }
        }
    };
    let today = super::today();
    let catalog = names.catalog();
    let ctx = Ctx {
        catalog: &catalog,
        inner: &inner,
        today: &today,
        actor: &caller.user,
        callers: &report,
        retired_status: names.retired_status(),
    };
    let need = |o: &Option<String>, what: &str| o.clone().ok_or_else(|| LifecycleError::Invalid(format!("{what} is missing")));
    let planned: Result<Plan, LifecycleError> = match kind {
        Change::Rename => {
            need(&req.to, "the new name").and_then(|to| lifecycle::plan_rename(&ctx, &req.name, &to, req.sunset.as_deref(), "rename"))
        }
        Change::Deprecate => lifecycle::plan_deprecate(&ctx, &req.name, req.to.as_deref(), req.sunset.as_deref()),
        Change::Retire => lifecycle::plan_retire(&ctx, &req.name),
        Change::Restore => lifecycle::plan_restore(&ctx, &req.name),
        Change::RoleSet => need(&req.to, "the model").and_then(|m| lifecycle::plan_role(&ctx, &req.name, Some(&m))),
        Change::RoleUnset => lifecycle::plan_role(&ctx, &req.name, None),
    };
    let mut plan = match planned {
        Ok(p) => p,
        Err(e) => return lifecycle_err(e),
    };
    let refused = !plan.needs_force.is_empty() && !req.force;
    let applied = !req.dry_run && !refused;
    if applied {
        if !plan.needs_force.is_empty()
            && let Some(h) = plan.history.first_mut()
        {
            h.note = format!("forced: {}", plan.needs_force.join("; "));
        }
        if let Err(e) = state.store.apply_name_changes(&plan.ops, &plan.history).await {
            return store_err(e);
        }
        if let Err(e) = names.reload(&state.store).await {
            return store_err(e);
        }
        tracing::info!(action = plan.action, name = %plan.name, by = %caller.user, from = %plan.from_state, to = %plan.to_state, target = ?plan.to_target, "name registry changed");
        if !plan.roles_changed.is_empty()
            && let Err(e) = crate::snapshot::write(&state)
        {
            tracing::error!(error = %e, "cannot rewrite the snapshot after a role change");
            plan.warnings.push(format!(
                "the snapshot {} could not be rewritten ({e}); new jobs get the old roles until it is (restart the agent)",
                state.config.snapshot_path.display()
            ));
        }
    }
    Json(json!({"applied": applied, "dry_run": req.dry_run, "refused": refused, "plan": plan, "callers": report})).into_response()
}

async fn rename(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::Rename).await
}

async fn deprecate(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::Deprecate).await
}

async fn retire(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::Retire).await
}

async fn restore(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::Restore).await
}

async fn role_set(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::RoleSet).await
}

async fn role_unset(State(state): State<AppState>, caller: Caller, Json(req): Json<ChangeReq>) -> Response {
    change(state, caller, req, Change::RoleUnset).await
}

/// Recomputes the callers rollup from the whole usage log (admin; slow on big logs: it reads
/// every row once).
async fn rebuild_callers(State(state): State<AppState>, caller: Caller) -> Response {
    if let Err((status, msg)) = caller.require_admin("rebuilding the callers registry") {
        return err(status, msg);
    }
    let t = std::time::Instant::now();
    if let Err(e) = state.store.rebuild_name_callers().await {
        return store_err(e);
    }
    let totals = match state.store.name_totals().await {
        Ok(t) => t,
        Err(e) => return store_err(e),
    };
    tracing::info!(by = %caller.user, names = totals.len(), seconds = t.elapsed().as_secs_f64(), "callers registry rebuilt from the usage log");
    Json(json!({"names": totals.len(), "calls": totals.iter().map(|t| t.calls).sum::<i64>(), "seconds": t.elapsed().as_secs_f64()}))
        .into_response()
}

async fn roles(State(state): State<AppState>) -> Response {
    let roles = state.names.roles();
    let rows: Vec<_> = roles
        .iter()
        .map(|(role, model)| {
            json!({
                "role": role,
                "model": model,
                "variable": gpuhub_wire::snapshot::role_env_var(role),
                "serves": model.as_deref().and_then(|m| state.names.resolve(m).model().map(str::to_string)),
            })
        })
        .collect();
    Json(json!({"roles": rows})).into_response()
}
