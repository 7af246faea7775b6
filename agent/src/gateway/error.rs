//! The gateway's one error type, OpenAI-shaped on the wire:
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! `status()` and `code()` are `match`es without a `_` arm: a new variant must choose both.
//! Messages name the model and what happened; internal causes (I/O, reqwest, sqlx) are logged
//! where the error is created and never sent to clients.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::models::ModelError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("the request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("the request body must name a model: add \"model\": \"NAME\" (see `GET /v1/models`)")]
    MissingModel,
    #[error("`{field}` must be {expected}")]
    WrongType { field: &'static str, expected: &'static str },
    #[error("{0}")]
    BadRequest(String),
    #[error("the request body is larger than the limit of {limit} bytes (gateway.max_body_bytes)")]
    BodyTooLarge { limit: usize },
    #[error("the request body did not arrive within {seconds}s (gateway.body_timeout_s)")]
    BodyTimeout { seconds: u64 },
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    Forbidden(String),
    #[error("no route {method} {path} (the API is under /v1; see `GET /v1/models`)")]
    UnknownRoute { method: String, path: String },
    /// A `/v1/...` path that is no OpenAI inference route (a worker's management route).
    #[error(
        "{method} {path} is not forwarded: the gateway forwards only OpenAI inference routes ({routes}); a worker's own management routes are not reachable through it"
    )]
    RouteNotForwarded { method: String, path: String, routes: String },
    /// An inference route the model's catalog entry does not declare.
    #[error("model `{model}` does not serve {method} {path}; it serves {served} (`routes` in its catalog entry)")]
    RouteNotServed { model: String, method: String, path: String, served: String },
    /// A name the registry does not serve (unknown, retired, role without a model).
    #[error("{message}")]
    Refused { status: u16, code: &'static str, message: String },
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u64 },
    /// Over a `[gateway.limits]` or API-key limit ([`super::fair_use`]).
    #[error("{message}")]
    OverLimit { limit: super::fair_use::Limit, message: String, retry_after_s: u64 },
    #[error("{0}")]
    ModelUnavailable(String),
    #[error("{0}")]
    LoadTimeout(String),
    #[error("model `{model}`: {what}")]
    Upstream { model: String, what: String },
    /// A committed stream that ended before its protocol's last event.
    #[error("model `{model}`: {what}; the answer is incomplete, retry the call")]
    StreamBroken { model: String, what: String },
    #[error("model `{model}` did not answer within {seconds}s (gateway.upstream_timeout_s)")]
    UpstreamTimeout { model: String, seconds: u64 },
    #[error("the gateway failed to handle this request; the details are in the agent's log (request id {request_id})")]
    Internal { request_id: String },
    #[error("{0}")]
    InvalidModelName(String),
    #[error("the gateway already holds {limit} bytes of request bodies in memory (gateway.max_body_bytes_total); retry in a moment")]
    BodyBudget { limit: usize },
    #[error(
        "model `{model}`: the gateway already holds {limit} bytes of answers that callers have not taken yet (gateway.max_response_bytes_total); retry in a moment"
    )]
    AnswerBudget { model: String, limit: usize },
    #[error("model `{model}`: its worker's answer is larger than {limit} bytes (gateway.max_response_bytes){what}")]
    ResponseTooLarge { model: String, limit: usize, what: &'static str },
    #[error(
        "the gateway cannot record calls right now: its usage journal in {dir} cannot be written (is the disk full?) and {waiting} \
         usage rows wait in memory (gateway.usage_queue = {cap}); retry once an admin frees space there (paths.state_dir)"
    )]
    UsageBacklog { waiting: usize, cap: usize, dir: String },
    #[error(
        "too many unauthenticated requests from {peer}: more than {rate} a second are refused this way (gateway.unauth_refusals_per_s); \
         send `Authorization: Bearer <API key>` (jobs get one in OPENAI_API_KEY; others ask an admin for `gpuhub keys create`)"
    )]
    Throttled { peer: String, rate: u32 },
    #[error("the gateway has {limit} connections open (gateway.max_connections); retry in a moment")]
    ConnectionCap { limit: usize },
    #[error("the request's head (request line and headers) did not arrive within {seconds}s (gateway.header_timeout_s)")]
    HeaderTimeout { seconds: u64 },
}

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::MalformedJson(_)
            | GatewayError::MissingModel
            | GatewayError::WrongType { .. }
            | GatewayError::BadRequest(_)
            | GatewayError::InvalidModelName(_) => StatusCode::BAD_REQUEST,
            GatewayError::BodyBudget { .. }
            | GatewayError::AnswerBudget { .. }
            | GatewayError::UsageBacklog { .. }
            | GatewayError::ConnectionCap { .. } => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::ResponseTooLarge { .. } => StatusCode::BAD_GATEWAY,
            GatewayError::Throttled { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::HeaderTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            GatewayError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            GatewayError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            GatewayError::Forbidden(_) => StatusCode::FORBIDDEN,
            GatewayError::UnknownRoute { .. } | GatewayError::RouteNotForwarded { .. } | GatewayError::RouteNotServed { .. } => {
                StatusCode::NOT_FOUND
            }
            GatewayError::Refused { status, .. } => StatusCode::from_u16(*status).unwrap_or(StatusCode::NOT_FOUND),
            GatewayError::Overloaded { .. } | GatewayError::OverLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::ModelUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::LoadTimeout(_) | GatewayError::UpstreamTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::Upstream { .. } | GatewayError::StreamBroken { .. } => StatusCode::BAD_GATEWAY,
            GatewayError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `code` field (also the usage log's `error_code` and the metrics label).
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::MalformedJson(_) => "invalid_json",
            GatewayError::MissingModel => "missing_model",
            GatewayError::WrongType { .. } => "invalid_type",
            GatewayError::BadRequest(_) => "invalid_request",
            GatewayError::BodyTooLarge { .. } => "request_too_large",
            GatewayError::BodyTimeout { .. } => "request_timeout",
            GatewayError::Unauthenticated(_) => "invalid_api_key",
            GatewayError::Forbidden(_) => "model_not_allowed",
            GatewayError::UnknownRoute { .. } => "unknown_route",
            GatewayError::RouteNotForwarded { .. } | GatewayError::RouteNotServed { .. } => "route_not_served",
            GatewayError::Refused { code, .. } => code,
            GatewayError::Overloaded { .. } => "model_overloaded",
            GatewayError::OverLimit { limit: super::fair_use::Limit::Rpm, .. } => "rate_limit_exceeded",
            GatewayError::OverLimit { limit: super::fair_use::Limit::TokensPerDay, .. } => "token_limit_exceeded",
            GatewayError::ModelUnavailable(_) => "model_unavailable",
            GatewayError::LoadTimeout(_) => "model_load_timeout",
            GatewayError::Upstream { .. } => "upstream_error",
            GatewayError::StreamBroken { .. } => "stream_broken",
            GatewayError::UpstreamTimeout { .. } => "upstream_timeout",
            GatewayError::Internal { .. } => "internal_error",
            GatewayError::InvalidModelName(_) => "invalid_model_name",
            GatewayError::BodyBudget { .. } | GatewayError::AnswerBudget { .. } => "server_busy",
            GatewayError::ResponseTooLarge { .. } => "upstream_response_too_large",
            GatewayError::UsageBacklog { .. } => "usage_log_full",
            GatewayError::Throttled { .. } => "too_many_unauthenticated",
            GatewayError::ConnectionCap { .. } => "too_many_connections",
            GatewayError::HeaderTimeout { .. } => "header_timeout",
        }
    }

    /// OpenAI's `type` field.
    fn kind(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 | 410 => "invalid_request_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The request field at fault, if any (OpenAI's `param`).
    fn param(&self) -> Option<&'static str> {
        match self {
            GatewayError::MissingModel | GatewayError::Refused { .. } | GatewayError::Forbidden(_) | GatewayError::InvalidModelName(_) => {
                Some("model")
            }
            GatewayError::WrongType { field, .. } => Some(field),
            _ => None,
        }
    }

    /// The JSON body (also used as an SSE error event).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.to_string(), "type": self.kind(), "param": self.param(), "code": self.code()}})
    }
}

impl From<ModelError> for GatewayError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Overloaded { retry_after_s, .. } => GatewayError::Overloaded { message: e.to_string(), retry_after_s },
            ModelError::NotInCatalog(_) | ModelError::Unavailable { .. } => GatewayError::ModelUnavailable(e.to_string()),
            ModelError::LoadTimeout { .. } => GatewayError::LoadTimeout(e.to_string()),
        }
    }
}

impl GatewayError {
    /// The whole HTTP/1.1 answer as bytes, for refusals written straight to a connection
    /// (connection cap, header timeout): the same JSON body, then the connection closes.
    pub fn raw_response(&self) -> Vec<u8> {
        let body = self.body().to_string();
        let status = self.status();
        let mut out = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        );
        if status == StatusCode::SERVICE_UNAVAILABLE {
            out.push_str("retry-after: 1\r\n");
        }
        out.push_str("\r\n");
        out.push_str(&body);
        out.into_bytes()
    }
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let GatewayError::Overloaded { retry_after_s, .. } | GatewayError::OverLimit { retry_after_s, .. } = &self
            && let Ok(v) = HeaderValue::from_str(&retry_after_s.max(&1).to_string())
        {
            resp.headers_mut().insert(header::RETRY_AFTER, v);
        }
        if let GatewayError::Unauthenticated(_) | GatewayError::Throttled { .. } = &self {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if let GatewayError::BodyBudget { .. }
        | GatewayError::AnswerBudget { .. }
        | GatewayError::UsageBacklog { .. }
        | GatewayError::Throttled { .. } = &self
        {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let GatewayError::Throttled { .. } = &self {
            // The peer reconnects for its next try: it pays a handshake, and its connection
            // slot is free meanwhile.
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn openai_shape_and_statuses() {
        let e = GatewayError::Refused { status: 404, code: "model_not_found", message: "model `x` does not exist".into() };
        let b = e.body();
        assert_eq!(b["error"]["code"], "model_not_found");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["param"], "model");
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        let o = GatewayError::from(ModelError::Overloaded { model: "m".into(), in_flight: 3, queue: 1, retry_after_s: 2 });
        let r = o.into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        assert_eq!(GatewayError::from(ModelError::LoadTimeout { model: "m".into(), seconds: 3 }).status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(GatewayError::Upstream { model: "m".into(), what: "x".into() }.body()["error"]["type"], "server_error");
    }
}
