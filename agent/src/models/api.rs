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
    Json(json!({"models": models, "log_tail_visible": caller.admin}))
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
            let served_as: Vec<String> =
                catalog.models().filter(|m| m.mlflow_model.as_deref() == Some(r.name.as_str())).map(|m| m.name.clone()).collect();
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
}

/// `model` is a catalog name (its `mlflow_model` is promoted) or an MLflow registered model
/// name used by a catalog entry.
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
    let outcome = mlflow
        .promote(&registered, &req.version, entry.eval_metric.as_deref(), entry.eval_threshold, entry.eval_lower_is_better)
        .await
        .map_err(|e| err(StatusCode::BAD_GATEWAY, e.to_string()))?;
    if outcome.promoted {
        state.models.note_version(&registered, &req.version);
        tracing::info!(model = %entry.name, registered = %registered, version = %req.version, by = %caller.user, "promoted");
    } else {
        tracing::info!(model = %entry.name, registered = %registered, version = %req.version, by = %caller.user, reason = %outcome.message, "promotion refused");
    }
    Ok(Json(json!(outcome)))
}
