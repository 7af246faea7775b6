//! Control-socket routes for the gateway: API keys and call summaries.
//!
//! Keys are self-service ([`super::key_policy`]): a user creates, lists and revokes their own
//! (named by SO_PEERCRED); admins manage everyone's.
//! - `POST /v1/keys` `{user?, app, models?, rpm?, tokens_per_day?}` → the new key, shown once
//!   (`user` defaults to the caller; only admins name another user).
//! - `GET /v1/keys` → the caller's keys, every key for admins (hash never included).
//! - `POST /v1/keys/{id}/revoke` → the revoked key (the caller's own, any for admins).
//! - `GET /v1/usage/calls?since=30d[&user=U]` → calls per user/app/name/model from the
//!   rollups; users see their own calls, admins everyone's.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::auth;
use super::key_policy::{self, KeyPolicyError};
use crate::AppState;
use crate::control::Caller;
use crate::store::gateway::ApiKeyRecord;

type ApiResult = Result<Json<Value>, (StatusCode, Json<Value>)>;

fn err(status: StatusCode, message: impl Into<String>) -> (StatusCode, Json<Value>) {
    (status, Json(json!({"error": message.into()})))
}

fn policy(e: KeyPolicyError) -> (StatusCode, Json<Value>) {
    err(e.status(), e.to_string())
}

fn store_err(e: crate::store::StoreError) -> (StatusCode, Json<Value>) {
    match e {
        crate::store::StoreError::NotFound(what) => err(StatusCode::NOT_FOUND, format!("no {what}")),
        other => {
            tracing::error!(error = %other, "gateway control API: store failed");
            err(StatusCode::SERVICE_UNAVAILABLE, "the store is not available right now; see the agent's log")
        }
    }
}

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/keys", get(list_keys).post(create_key))
        .route("/v1/keys/{id}/revoke", post(revoke_key))
        .route("/v1/usage/calls", get(calls))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateKey {
    /// Whose key (default: the caller; only admins name another user).
    #[serde(default)]
    pub user: Option<String>,
    pub app: String,
    #[serde(default)]
    pub models: Vec<String>,
    /// The key's own requests per minute (none: only the user's limit).
    #[serde(default)]
    pub rpm: Option<u32>,
    /// The key's own tokens per UTC day (none: only the user's limit).
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
}

/// User and app names: letters, digits, `.`, `_`, `-`, `@`, 1 to 64 characters.
pub fn check_label(what: &str, s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 64 || !s.chars().all(|c| c.is_ascii_alphanumeric() || "._-@".contains(c)) {
        return Err(format!("{what} `{}` must be 1 to 64 letters, digits, . _ - or @", crate::util::sanitize(s)));
    }
    Ok(())
}

fn public(k: &ApiKeyRecord) -> Value {
    json!({"id": k.id, "prefix": k.prefix, "user": k.user, "app": k.app, "models": k.models, "created_us": k.created_us, "created_by": k.created_by, "revoked_us": k.revoked_us, "rpm": k.rpm, "tokens_per_day": k.tokens_per_day})
}

async fn create_key(State(state): State<AppState>, caller: Caller, Json(req): Json<CreateKey>) -> ApiResult {
    let user = key_policy::owner(&caller, req.user.as_deref()).map_err(policy)?;
    check_label("user", &user).map_err(|m| err(StatusCode::BAD_REQUEST, m))?;
    check_label("app", &req.app).map_err(|m| err(StatusCode::BAD_REQUEST, m))?;
    let gateway = &state.config.file.gateway;
    let catalog = state.catalog.load();
    for m in &req.models {
        if catalog.get(m).is_none() {
            let known = catalog.models().map(|c| c.name.clone()).collect::<Vec<_>>().join(", ");
            return Err(err(
                StatusCode::BAD_REQUEST,
                format!("--models: `{}` is not in the catalog; known models: {known}", crate::util::sanitize(m)),
            ));
        }
    }
    key_policy::check_models(&user, &req.models, gateway.user_models_of(&user), |m| catalog.get(m).map(|c| c.name.clone()))
        .map_err(policy)?;
    if req.rpm == Some(0) || req.tokens_per_day == Some(0) {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "--rpm and --tokens-per-day must be at least 1; leave one out for no limit of the key's own (its user's limits in [gateway.limits] still apply)".to_string(),
        ));
    }
    key_policy::check_limits(&user, req.rpm, req.tokens_per_day, state.gateway.fair_use.user_limits(&user)).map_err(policy)?;
    if !caller.admin {
        let mine = state.store.api_keys_of(&user).await.map_err(store_err)?;
        key_policy::check_count(&caller, &mine, gateway.keys_per_user).map_err(policy)?;
    }
    let key = auth::new_key();
    let record = ApiKeyRecord {
        id: format!("k{}", hex::encode(rand::random::<[u8; 4]>())),
        key_hash: auth::hash_key(&key),
        prefix: key.chars().take(12).collect(),
        user,
        app: req.app,
        models: req.models,
        created_us: crate::util::now_us(),
        created_by: caller.user.clone(),
        revoked_us: None,
        rpm: req.rpm,
        tokens_per_day: req.tokens_per_day,
    };
    state.store.insert_api_key(&record).await.map_err(store_err)?;
    state.gateway.keys.upsert(record.clone());
    tracing::info!(id = %record.id, user = %record.user, app = %record.app, by = %caller.user, "API key created");
    let mut v = public(&record);
    v["key"] = json!(key);
    Ok(Json(v))
}

async fn list_keys(State(state): State<AppState>, caller: Caller) -> ApiResult {
    let keys = if caller.admin { state.store.api_keys().await } else { state.store.api_keys_of(&caller.user).await }.map_err(store_err)?;
    Ok(Json(json!({"keys": keys.iter().map(public).collect::<Vec<_>>()})))
}

async fn revoke_key(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> ApiResult {
    let Some(existing) = state.store.api_key(&id).await.map_err(store_err)? else {
        return Err(store_err(crate::store::StoreError::NotFound(format!(
            "API key `{}` (see `gpuhub keys list`)",
            crate::util::sanitize(&id)
        ))));
    };
    key_policy::check_owner(&caller, &existing).map_err(|e| {
        tracing::info!(id = %existing.id, by = %caller.user, "API key revocation refused: not the caller's key");
        policy(e)
    })?;
    let record = state.store.revoke_api_key(&id, crate::util::now_us()).await.map_err(store_err)?;
    state.gateway.keys.upsert(record.clone());
    tracing::info!(id = %record.id, user = %record.user, app = %record.app, by = %caller.user, "API key revoked");
    Ok(Json(public(&record)))
}

#[derive(Debug, Deserialize)]
pub struct CallsQuery {
    pub since: Option<String>,
    pub user: Option<String>,
}

async fn calls(State(state): State<AppState>, caller: Caller, Query(q): Query<CallsQuery>) -> ApiResult {
    let since_s = crate::util::parse_duration_s(q.since.as_deref().unwrap_or("30d"))
        .map_err(|m| err(StatusCode::BAD_REQUEST, format!("--since: {m}")))?;
    let user = match (q.user, caller.admin) {
        (Some(u), true) => Some(u),
        (None, true) => None,
        (Some(u), false) if u != caller.user => {
            return Err(err(
                StatusCode::FORBIDDEN,
                format!("you can see your own calls only (you are `{}`); admins see everyone's", caller.user),
            ));
        }
        (_, false) => Some(caller.user.clone()),
    };
    let since_us = crate::util::now_us() - since_s.saturating_mul(1_000_000);
    let rows = state.store.call_summary(since_us, user.as_deref()).await.map_err(store_err)?;
    Ok(Json(json!({"since_us": since_us, "user": user, "calls": rows})))
}
