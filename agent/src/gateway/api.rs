//! Control-socket routes for the gateway: API keys and call summaries.
//!
//! Keys are self-service ([`super::key_policy`]): a user creates, lists and revokes their own
//! (named by SO_PEERCRED); admins manage everyone's.
//! - `POST /v1/keys` `{user?, app, models?, rpm?, tokens_per_day?}` → the new key, shown once
//!   (`user` defaults to the caller; only admins name another user).
//! - `GET /v1/keys` → the caller's keys, every key for admins (hash never included).
//! - `POST /v1/keys/{id}/revoke` → the revoked key (the caller's own, any for admins).
//! - `POST /v1/keys/{id}/set` `{models?, rpm?, no_rpm?, tokens_per_day?, no_tokens_per_day?}` →
//!   the key with its new allow-list and own limits (what is left out stays); the key itself
//!   does not change, so its app keeps working.
//! - `GET /v1/usage/calls?since=30d[&user=U]` → calls per user/app/name/model from the
//!   rollups; users see their own calls, admins everyone's.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::access::AccessLists;
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
        .route("/v1/keys/{id}/set", post(set_key))
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

/// What `gpuhub keys set` changes; a field left out stays as it is.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetKey {
    /// The new allow-list (`[]`: every model the key's user may use).
    #[serde(default)]
    pub models: Option<Vec<String>>,
    #[serde(default)]
    pub rpm: Option<u32>,
    /// Drop the key's own requests-per-minute limit.
    #[serde(default)]
    pub no_rpm: bool,
    #[serde(default)]
    pub tokens_per_day: Option<u64>,
    /// Drop the key's own tokens-per-day limit.
    #[serde(default)]
    pub no_tokens_per_day: bool,
}

const ZERO_LIMIT: &str = "--rpm and --tokens-per-day must be at least 1; leave one out for no limit of the key's own (its user's limits in [gateway.limits] still apply)";

/// A key's allow-list: catalog names, within its user's `[gateway.user_models]` (as in `access`).
fn check_key_models(state: &AppState, access: &AccessLists, user: &str, models: &[String]) -> Result<(), (StatusCode, Json<Value>)> {
    let catalog = state.catalog.load();
    for m in models {
        if catalog.get(m).is_none() {
            let known = catalog.models().map(|c| c.name.clone()).collect::<Vec<_>>().join(", ");
            return Err(err(
                StatusCode::BAD_REQUEST,
                format!("--models: `{}` is not in the catalog; known models: {known}", crate::util::sanitize(m)),
            ));
        }
    }
    key_policy::check_models(user, models, access.user_models_of(user), |m| catalog.get(m).map(|c| c.name.clone())).map_err(policy)
}

fn public(k: &ApiKeyRecord) -> Value {
    json!({"id": k.id, "prefix": k.prefix, "user": k.user, "app": k.app, "models": k.models, "created_us": k.created_us, "created_by": k.created_by, "revoked_us": k.revoked_us, "rpm": k.rpm, "tokens_per_day": k.tokens_per_day})
}

async fn create_key(State(state): State<AppState>, caller: Caller, Json(req): Json<CreateKey>) -> ApiResult {
    let user = key_policy::owner(&caller, req.user.as_deref()).map_err(policy)?;
    check_label("user", &user).map_err(|m| err(StatusCode::BAD_REQUEST, m))?;
    check_label("app", &req.app).map_err(|m| err(StatusCode::BAD_REQUEST, m))?;
    // One snapshot of the access lists for the whole creation: a reload in between cannot
    // check the models against one version and the key count against another.
    let access = state.gateway.access.get();
    check_key_models(&state, &access, &user, &req.models)?;
    if req.rpm == Some(0) || req.tokens_per_day == Some(0) {
        return Err(err(StatusCode::BAD_REQUEST, ZERO_LIMIT));
    }
    key_policy::check_limits(&user, req.rpm, req.tokens_per_day, state.gateway.fair_use.user_limits(&user)).map_err(policy)?;
    if !caller.admin {
        let mine = state.store.api_keys_of(&user).await.map_err(store_err)?;
        key_policy::check_count(&caller, &mine, access.keys_per_user).map_err(policy)?;
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

/// The key `id`, if the caller may manage it (`doing` names the refused action in the log).
async fn own_key(state: &AppState, caller: &Caller, id: &str, doing: &str) -> Result<ApiKeyRecord, (StatusCode, Json<Value>)> {
    let Some(existing) = state.store.api_key(id).await.map_err(store_err)? else {
        return Err(store_err(crate::store::StoreError::NotFound(format!(
            "API key `{}` (see `gpuhub keys list`)",
            crate::util::sanitize(id)
        ))));
    };
    key_policy::check_owner(caller, &existing).map_err(|e| {
        tracing::info!(id = %existing.id, by = %caller.user, "API key {doing} refused: not the caller's key");
        policy(e)
    })?;
    Ok(existing)
}

async fn set_key(State(state): State<AppState>, caller: Caller, Path(id): Path<String>, Json(req): Json<SetKey>) -> ApiResult {
    let existing = own_key(&state, &caller, &id, "change").await?;
    if existing.revoked_us.is_some() {
        return Err(err(
            StatusCode::CONFLICT,
            format!("API key {} ({}/{}) is revoked; create a new one (`gpuhub keys create`)", existing.id, existing.user, existing.app),
        ));
    }
    if req.models.is_none() && req.rpm.is_none() && !req.no_rpm && req.tokens_per_day.is_none() && !req.no_tokens_per_day {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "nothing to change: give --models A,B, --all-models, --rpm N, --no-rpm, --tokens-per-day N or --no-tokens-per-day",
        ));
    }
    if (req.rpm.is_some() && req.no_rpm) || (req.tokens_per_day.is_some() && req.no_tokens_per_day) {
        return Err(err(
            StatusCode::BAD_REQUEST,
            "give a limit or drop it (--rpm or --no-rpm, --tokens-per-day or --no-tokens-per-day), not both",
        ));
    }
    if req.rpm == Some(0) || req.tokens_per_day == Some(0) {
        return Err(err(StatusCode::BAD_REQUEST, ZERO_LIMIT));
    }
    let user = existing.user.clone();
    let models = req.models.unwrap_or_else(|| existing.models.clone());
    check_key_models(&state, &state.gateway.access.get(), &user, &models)?;
    let rpm = if req.no_rpm { None } else { req.rpm.or(existing.rpm) };
    let tokens_per_day = if req.no_tokens_per_day { None } else { req.tokens_per_day.or(existing.tokens_per_day) };
    key_policy::check_limits(&user, rpm, tokens_per_day, state.gateway.fair_use.user_limits(&user)).map_err(policy)?;
    let record = state.store.update_api_key(&id, &models, rpm, tokens_per_day).await.map_err(store_err)?;
    state.gateway.keys.upsert(record.clone());
    if record.revoked_us.is_some() {
        return Err(err(StatusCode::CONFLICT, format!("API key {} was revoked while it was being changed; nothing changed", record.id)));
    }
    tracing::info!(id = %record.id, user = %record.user, app = %record.app, by = %caller.user,
        models = ?record.models, rpm = ?record.rpm, tokens_per_day = ?record.tokens_per_day,
        was_models = ?existing.models, was_rpm = ?existing.rpm, was_tokens_per_day = ?existing.tokens_per_day, "API key changed");
    Ok(Json(public(&record)))
}

async fn revoke_key(State(state): State<AppState>, caller: Caller, Path(id): Path<String>) -> ApiResult {
    own_key(&state, &caller, &id, "revocation").await?;
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
    state.gateway.settle_usage().await;
    let rows = state.store.call_summary(since_us, user.as_deref()).await.map_err(store_err)?;
    Ok(Json(json!({"since_us": since_us, "user": user, "calls": rows})))
}
