//! Control-socket routes behind `gpuhub models`: list (anyone; the log lines of failed workers
//! only for admins, since a worker's log can hold other callers' prompts), load/unload/promote
//! (admins).

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::ModelError;
use super::gate::{self, Gate, Outcome};
use super::mlflow::{ALIAS, MlflowError};
use crate::AppState;
use crate::control::Caller;

type ApiResult = Result<Json<Value>, (StatusCode, Json<Value>)>;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/models", get(list))
        .route("/v1/models/registry", get(registry))
        .route("/v1/models/load", post(load))
        .route("/v1/models/unload", post(unload))
        .route("/v1/models/promote", post(promote))
        .route("/v1/models/reload", post(reload))
}

fn err(status: StatusCode, msg: impl Into<String>) -> (StatusCode, Json<Value>) {
    (status, Json(json!({"error": msg.into()})))
}

fn model_err(e: ModelError) -> (StatusCode, Json<Value>) {
    let status = match &e {
        ModelError::NotInCatalog(_) => StatusCode::NOT_FOUND,
        ModelError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
        ModelError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
        ModelError::LoadTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
    };
    err(status, e.to_string())
}

fn admin(caller: &Caller, what: &str) -> Result<(), (StatusCode, Json<Value>)> {
    caller.require_admin(what).map_err(|(s, m)| err(s, m))
}

async fn list(State(state): State<AppState>, caller: Caller) -> Json<Value> {
    let mut models = state.models.statuses();
    if !caller.admin {
        for m in &mut models {
            m.log_tail.clear();
        }
    }
    let catalog = state.catalog.load();
    let promoted = state.models.promoted();
    let rows: Vec<Value> = models
        .into_iter()
        .map(|m| {
            let served = catalog.model(&m.name).and_then(|c| c.mlflow_model.as_deref()).map(|r| promoted.get(r)).unwrap_or_default();
            let mut v = json!(m);
            v["promoted_version"] = json!(served.promoted);
            v["production_alias"] = json!(served.production);
            v["alias_mismatch"] = json!(served.mismatch());
            v
        })
        .collect();
    Json(json!({"models": rows, "log_tail_visible": caller.admin}))
}

/// Every registered model in MLflow (all pages), served or not: latest version, aliases, tags,
/// and which catalog entry serves it or why a tagged one is not served.
async fn registry(State(state): State<AppState>) -> ApiResult {
    let Some(mlflow) = state.models.mlflow() else {
        return Err(err(StatusCode::CONFLICT, "no MLflow registry configured; set mlflow.tracking_uri in agent.toml"));
    };
    let catalog = state.catalog.load();
    let found = super::inventory::list_all(mlflow.tracking_uri()).await.map_err(|e| err(StatusCode::BAD_GATEWAY, e.to_string()))?;
    let view = state.catalog_sync.view();
    let rows: Vec<Value> = found
        .into_iter()
        .map(|r| {
            let served_as = catalog.serving(&r.name);
            let by = if served_as.iter().any(|n| catalog.is_from_registry(n)) {
                "tags"
            } else if served_as.is_empty() {
                ""
            } else {
                "agent.toml"
            };
            let errors: Vec<String> =
                view.errors.iter().filter(|e| e.model == crate::util::sanitize(&r.name)).map(ToString::to_string).collect();
            json!({
                "name": r.name,
                "latest_version": r.latest_version,
                "production": r.aliases.get(super::mlflow::ALIAS),
                "aliases": r.aliases,
                "gateway_tagged": super::registry::is_served(&r.tags),
                "served_as": served_as,
                "served_by": by,
                "tags": r.tags,
                "description": r.description,
                "errors": errors,
            })
        })
        .collect();
    Ok(Json(json!({"registered": rows, "polled_us": view.polled_us, "poll_error": view.error})))
}

/// `gpuhub models reload` (admins): agent.toml's catalog again, as SIGHUP does.
async fn reload(State(state): State<AppState>, caller: Caller) -> ApiResult {
    admin(&caller, "reloading the catalog")?;
    match state.catalog_sync.reload(&state).await {
        Ok(r) => {
            tracing::info!(by = %caller.user, "catalog reloaded on request");
            Ok(Json(json!(r)))
        }
        Err(e) => {
            tracing::error!(by = %caller.user, error = %e, "reload refused");
            Err(err(StatusCode::UNPROCESSABLE_ENTITY, e))
        }
    }
}

#[derive(Deserialize)]
struct ModelReq {
    model: String,
}

async fn load(State(state): State<AppState>, caller: Caller, Json(req): Json<ModelReq>) -> ApiResult {
    admin(&caller, "loading a model")?;
    if !state.config.is_gateway() {
        return Err(err(
            StatusCode::CONFLICT,
            format!(
                "this node ({}) runs no gateway (cluster.gateway_nodes = [{}]) and starts no workers; run `gpuhub models load` on a gateway node",
                state.config.file.telemetry.effective_node_name(),
                state.config.file.cluster.gateway_nodes.join(", ")
            ),
        ));
    }
    let st = state.models.load(&req.model).await.map_err(model_err)?;
    Ok(Json(json!(st)))
}

async fn unload(State(state): State<AppState>, caller: Caller, Json(req): Json<ModelReq>) -> ApiResult {
    admin(&caller, "unloading a model")?;
    let done = state.models.unload(&req.model, &format!("unloaded by {}", caller.user)).await.map_err(model_err)?;
    Ok(Json(json!({"unloaded": done, "status": state.models.status(&req.model)})))
}

#[derive(Deserialize)]
struct PromoteReq {
    model: String,
    version: String,
    /// Promote past a failed gate (logged and recorded).
    #[serde(default)]
    force: bool,
}

/// `model` is a catalog name (its `mlflow_model` is promoted) or an MLflow registered model
/// name used by a catalog entry. The gate ([`super::gate`]) checks the threshold and that the
/// version does not regress against the one served now; the promotion is recorded in the
/// store (who: the control socket's peer), then MLflow's `@production` is moved, then a
/// running worker switches over ([`super::Switch`]).
async fn promote(State(state): State<AppState>, caller: Caller, Json(req): Json<PromoteReq>) -> ApiResult {
    admin(&caller, "promoting a model version")?;
    let Some(mlflow) = state.models.mlflow() else {
        return Err(err(StatusCode::CONFLICT, "no MLflow registry configured; set mlflow.tracking_uri in agent.toml"));
    };
    let catalog = state.catalog.load();
    let entry = catalog
        .get(&req.model)
        .cloned()
        .or_else(|| catalog.models().find(|m| m.mlflow_model.as_deref() == Some(req.model.as_str())).cloned());
    let Some(entry) = entry else {
        return Err(err(
            StatusCode::NOT_FOUND,
            format!("`{}` is neither a catalog model nor the mlflow_model of one; see `gpuhub models`", req.model),
        ));
    };
    let Some(registered) = entry.mlflow_model.clone() else {
        return Err(err(
            StatusCode::CONFLICT,
            format!("model `{}` has no mlflow_model in the catalog, so it has no versions to promote", entry.name),
        ));
    };
    let store = &state.store;
    let gate = Gate::of(&entry);
    let gate_source = if catalog.is_from_registry(&entry.name) {
        format!("mlflow.gates.{registered} in agent.toml")
    } else {
        format!("eval_metric/eval_threshold of [[models]] `{}` in agent.toml", entry.name)
    };
    let promoted = state.models.promoted();
    let previous = match promoted.version(&registered) {
        Some(v) => Some(v),
        None => mlflow.production_version(&registered).await.map_err(|e| err(StatusCode::BAD_GATEWAY, e.to_string()))?,
    };
    let verdict = gate::evaluate(mlflow, &entry.name, &registered, &req.version, previous.as_deref(), gate.as_ref(), &gate_source)
        .await
        .map_err(|e| match e {
            MlflowError::NoSuchVersion(..) => err(StatusCode::NOT_FOUND, e.to_string()),
            e => err(StatusCode::BAD_GATEWAY, e.to_string()),
        })?;
    let who = format!("{} (uid {})", caller.user, caller.uid);
    if !verdict.refusals.is_empty() && !req.force {
        let message =
            format!("not promoted: {}; an admin may promote past the gate with --force (logged and recorded)", verdict.refusals.join("; "));
        tracing::info!(model = %entry.name, registered = %registered, version = %req.version, by = %who, reason = %message, "promotion refused by the gate");
        return Ok(Json(json!(Outcome { promoted: false, forced: false, message, verdict, switch: None, previous_version: previous })));
    }
    let forced = !verdict.refusals.is_empty();
    if forced {
        tracing::warn!(model = %entry.name, registered = %registered, version = %req.version, by = %who, gate = %verdict.refusals.join("; "), "promotion forced past the gate");
    }
    let row = gate::record(&registered, &req.version, previous.clone(), gate.as_ref(), &verdict, forced, &caller);
    {
        let _change = promoted.change_lock().lock().await;
        store.record_promotion(&row).await.map_err(|e| {
            err(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not promoted: the promotion cannot be recorded in the store ({e}); retry when it answers"),
            )
        })?;
        promoted.set_promoted(&registered, &req.version);
        state.models.note_version(&registered, &req.version);
    }
    tracing::info!(model = %entry.name, registered = %registered, version = %req.version, previous = previous.as_deref().unwrap_or(""), forced, by = %who, "promoted");
    let alias = match mlflow.set_production(&registered, &req.version).await {
        Ok(()) => {
            promoted.set_production(&registered, Some(req.version.clone()));
            format!("`{registered}@{ALIAS}` now points at version {}", req.version)
        }
        Err(e) => {
            tracing::error!(registered = %registered, version = %req.version, error = %e, "promotion recorded but MLflow's alias was not moved");
            format!(
                "recorded; gpuhub serves version {}, but MLflow's @{ALIAS} was not moved ({e}): `gpuhub models` shows the mismatch until it is",
                req.version
            )
        }
    };
    let serving = catalog.serving(&registered);
    for n in &serving {
        state.models.set_alias_mismatch(n, promoted.get(&registered).mismatch());
    }
    let switch = state.models.switch_to_promoted(&entry.name).await;
    // Other catalog entries that serve the same registered model move with it.
    let mut also = String::new();
    for n in serving.iter().filter(|n| **n != entry.name) {
        let s = state.models.switch_to_promoted(n).await;
        also.push_str(&format!("; `{n}` (the same registered model) {}: {}", s.kind().replace('_', " "), s.detail()));
    }
    let checks = if verdict.checks.is_empty() { String::new() } else { format!(" ({})", verdict.checks.join("; ")) };
    let forced_note = if forced { format!("; FORCED past the gate: {}", verdict.refusals.join("; ")) } else { String::new() };
    let message = format!("promoted{checks}{forced_note}; {alias}; {}: {}{also}", switch.kind().replace('_', " "), switch.detail());
    Ok(Json(json!(Outcome {
        promoted: true,
        forced,
        message,
        verdict,
        switch: Some(switch.kind().to_string()),
        previous_version: previous
    })))
}
