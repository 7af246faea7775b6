//! `GET /v1/models` and `GET /v1/models/{name}`: OpenAI's list shape plus gpuhub's fields
//! (`state`, `role`, `aliases`, `in_flight`, `detail`). A caller with an allow-list (the key's
//! or the user's own) sees only the models it may use.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{Value, json};

use super::RequestMeta;
use super::auth::Identity;
use super::error::GatewayError;
use super::parse::check_name_of;
use super::proxy::with_headers;
use crate::AppState;
use crate::models::ModelStatus;

fn entry(s: &ModelStatus) -> Value {
    json!({
        "id": s.name,
        "object": "model",
        "created": 0,
        "owned_by": "gpuhub",
        "state": s.state,
        "role": s.role,
        "aliases": s.aliases,
        "adapters": s.adapters,
        "in_flight": s.in_flight,
        "detail": s.detail,
    })
}

/// A LoRA adapter, listed like vLLM lists one: its own id, `parent` the base model (whose
/// worker, state and detail it shares).
fn adapter_entry(name: &str, base: &ModelStatus) -> Value {
    json!({
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "gpuhub",
        "parent": base.name,
        "state": base.state,
        "in_flight": base.in_flight,
        "detail": base.detail,
    })
}

pub async fn list(State(state): State<AppState>, Extension(meta): Extension<RequestMeta>, Extension(id): Extension<Identity>) -> Response {
    let mut data: Vec<Value> = Vec::new();
    for s in state.models.statuses() {
        // An allow-list that names a catalog entry allows its adapters too (as calls do).
        let base = id.may_list(&s.name);
        if base {
            data.push(entry(&s));
        }
        data.extend(s.adapters.iter().filter(|a| base || id.may_list(a)).map(|a| adapter_entry(a, &s)));
    }
    let mut call = meta.call("/v1/models", &id);
    call.row.status = 200;
    call.record(&state);
    Json(json!({"object": "list", "data": data})).into_response()
}

pub async fn get(
    State(state): State<AppState>,
    Extension(meta): Extension<RequestMeta>,
    Extension(id): Extension<Identity>,
    name: Result<Path<String>, PathRejection>,
) -> Response {
    let mut call = meta.call("/v1/models/{name}", &id);
    // The same rules as a body's `model`; a refused name is not logged as a name (the usage
    // log stores every name it is given, and PostgreSQL refuses a NUL byte).
    let checked = match name {
        Ok(Path(name)) => check_name_of("the model name in the path", &name),
        Err(e) => Err(GatewayError::InvalidModelName(format!(
            "the model name in the path is not a percent-encoded UTF-8 name ({}); see `GET /v1/models`",
            e.body_text()
        ))),
    };
    let name = match checked {
        Ok(name) => name,
        Err(e) => return call.fail(&state, e),
    };
    call.row.requested_name = name.clone();
    let res = state.names.resolve(&name);
    call.row.name_state = res.state().to_string();
    call.extra_headers = state.names.deprecation_headers(&res);
    if let Some(r) = state.names.refusal(&name, &res) {
        return call.fail(&state, GatewayError::Refused { status: r.status, code: r.code, message: r.message });
    }
    let model = res.model().unwrap_or_default().to_string();
    call.row.resolved_model = model.clone();
    if let Err(e) = id.check_model(&name, Some(&model)) {
        return call.fail(&state, e);
    }
    let Some(s) = state.models.statuses().into_iter().find(|s| s.name == model) else {
        return call.fail(&state, GatewayError::ModelUnavailable(format!("model `{model}` is in no catalog entry")));
    };
    let adapter = state.names.adapter(&name);
    call.row.adapter = adapter.clone().unwrap_or_default();
    call.row.status = 200;
    let extra = std::mem::take(&mut call.extra_headers);
    call.record(&state);
    let body = match &adapter {
        Some(a) => adapter_entry(a, &s),
        None => entry(&s),
    };
    with_headers(Json(body).into_response(), &extra)
}
