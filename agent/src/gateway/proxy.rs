//! Forwards an OpenAI inference call (`/v1/chat/completions`, ... : [`Route`]) whose body names
//! a model, without understanding the route further: auth (middleware) → a route the gateway
//! forwards → read the body (bounded, timed) → find the model → resolve the name → check the
//! key's allow-list → a route the model serves → acquire the model → forward with the
//! worker's key (never the client's) → answer, with deprecation headers for renamed names →
//! one usage row.

use std::time::{Duration, Instant};

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::auth::Identity;
use super::error::GatewayError;
use super::metrics::GaugeGuard;
use super::parse::{self, Parsed};
use super::usage_log::UsageRow;
use super::{RequestMeta, stream, upstream, us_since};
use crate::AppState;
use crate::models::routes::Route;

/// One call on its way through the gateway: the row it will leave and its timings.
pub struct Call {
    pub row: UsageRow,
    pub started: Instant,
    /// Time spent waiting for the model (loading, queue): not gateway overhead.
    pub wait_us: i64,
    /// Time spent waiting for the upstream: not gateway overhead.
    pub upstream_us: i64,
    /// Headers every answer to this call carries (deprecation signals).
    pub extra_headers: Vec<(&'static str, String)>,
    /// Set while a call dropped unrecorded must still leave its row ([`Call::arm`]).
    armed: Option<AppState>,
}

impl Call {
    /// A call that started at `started`, with nothing waited for yet.
    pub fn new(row: UsageRow, started: Instant) -> Call {
        Call { row, started, wait_us: 0, upstream_us: 0, extra_headers: Vec::new(), armed: None }
    }

    /// From now on a call dropped before it is recorded still leaves its row, with status 499
    /// and `client_closed`: hyper drops a handler's future when its client goes away (a model
    /// that loads for minutes, an SDK's timeout), and every call must leave one row.
    pub fn arm(&mut self, state: &AppState) {
        self.armed = Some(state.clone());
    }

    /// The call's row is someone else's to record now (a stream's task).
    pub fn disarm(&mut self) {
        self.armed = None;
    }

    /// Fills the timings and records the row (journaled before the response leaves).
    pub fn record(mut self, state: &AppState) {
        self.write(state);
    }

    fn write(&mut self, state: &AppState) {
        self.armed = None;
        self.row.latency_us = us_since(self.started);
        self.row.overhead_us = (self.row.latency_us - self.wait_us - self.upstream_us).max(0);
        state.names.count_row(&self.row);
        state.gateway.finish(std::mem::take(&mut self.row));
    }

    /// Records a failed call and builds its OpenAI-shaped answer.
    pub fn fail(mut self, state: &AppState, e: GatewayError) -> Response {
        self.row.status = e.status().as_u16();
        self.row.error_code = e.code().to_string();
        let extra = std::mem::take(&mut self.extra_headers);
        self.record(state);
        with_headers(e.into_response(), &extra)
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if let Some(state) = self.armed.take() {
            self.row.status = 499;
            self.row.error_code = "client_closed".into();
            // What it had waited for so far is not known (the wait was cut off): counted as the
            // worker's time, not the gateway's overhead.
            self.upstream_us = us_since(self.started) - self.wait_us;
            self.write(&state);
        }
    }
}

/// Adds `extra` headers to a response.
pub fn with_headers(mut resp: Response, extra: &[(&'static str, String)]) -> Response {
    for (k, v) in extra {
        if let Ok(v) = HeaderValue::from_str(v) {
            resp.headers_mut().append(HeaderName::from_static(k), v);
        }
    }
    resp
}

/// What the upstream request needs from the client's request.
pub struct Outgoing {
    pub method: Method,
    pub path_and_query: String,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// Keeps the body's bytes counted in `gateway.max_body_bytes_total` until the call ends.
    pub budget: super::limits::BodyPermit,
}

/// The fallback handler: every `/v1/*` route not handled elsewhere.
pub async fn forward(State(state): State<AppState>, mut req: Request) -> Response {
    // The auth middleware's per-call facts, taken rather than cloned (as `Extension` would).
    let (Some(meta), Some(id)) = (req.extensions_mut().remove::<RequestMeta>(), req.extensions_mut().remove::<Identity>()) else {
        tracing::error!(path = %crate::util::sanitize(req.uri().path()), "a forwarded call reached the proxy without the auth middleware's facts");
        return GatewayError::Internal { request_id: String::new() }.into_response();
    };
    let mut call = meta.call(req.uri().path(), &id);
    // Limits first: a call over one costs nothing more (its body is not read).
    if let Err(e) = state.gateway.fair_use.admit(&id, crate::util::now_us()) {
        return call.fail(&state, e);
    }
    call.arm(&state);
    match prepare(&state, &mut call, &id, req).await {
        Ok((parsed, out)) => {
            if parsed.stream {
                call.disarm(); // the stream's task records it, whatever the client does
                stream::start(state, call, parsed, out).await
            } else {
                plain(&state, call, out).await
            }
        }
        Err(e) => call.fail(&state, e),
    }
}

/// Answers a method/path the gateway does not serve.
pub async fn unknown_route(
    State(state): State<AppState>,
    Extension(meta): Extension<RequestMeta>,
    Extension(id): Extension<Identity>,
    req: Request,
) -> Response {
    let call = meta.call(req.uri().path(), &id);
    call.fail(&state, GatewayError::UnknownRoute { method: req.method().to_string(), path: crate::util::sanitize(req.uri().path()) })
}

/// Reads and checks the request up to the point where the model is known and allowed.
async fn prepare(state: &AppState, call: &mut Call, id: &Identity, req: Request) -> Result<(Parsed, Outgoing), GatewayError> {
    let cfg = &state.config.file.gateway;
    let (parts, body) = req.into_parts();
    if !parts.uri.path().starts_with("/v1/") {
        return Err(GatewayError::UnknownRoute { method: parts.method.to_string(), path: crate::util::sanitize(parts.uri.path()) });
    }
    // Only inference routes are forwarded, decided before the body is read: a worker's
    // management routes (vLLM's /v1/load_lora_adapter, ...) are never reachable from here.
    let Some(route) = Route::for_path(parts.uri.path()) else {
        return Err(GatewayError::RouteNotForwarded {
            method: parts.method.to_string(),
            path: crate::util::sanitize(parts.uri.path()),
            routes: crate::models::routes::describe(&Route::ALL),
        });
    };
    let declared = parts.headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if matches!(parts.method, Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS) && declared.unwrap_or(0) == 0 {
        return Err(GatewayError::UnknownRoute { method: parts.method.to_string(), path: crate::util::sanitize(parts.uri.path()) });
    }
    if declared.is_some_and(|n| n > cfg.max_body_bytes as u64) {
        return Err(GatewayError::BodyTooLarge { limit: cfg.max_body_bytes });
    }
    let (bytes, budget) = state.gateway.budget.read(body, declared, cfg.max_body_bytes, Duration::from_secs(cfg.body_timeout_s)).await?;
    let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let parsed = parse::parse(content_type, &bytes)?;
    call.row.requested_name = parsed.model.clone();
    call.row.streamed = parsed.stream;
    let res = state.names.resolve(&parsed.model);
    call.row.name_state = res.state().to_string();
    call.extra_headers = state.names.deprecation_headers(&res);
    if let Some(r) = state.names.refusal(&parsed.model, &res) {
        return Err(GatewayError::Refused { status: r.status, code: r.code, message: r.message });
    }
    let Some(model) = res.model() else {
        return Err(GatewayError::Refused {
            status: 404,
            code: "model_not_found",
            message: format!("model `{}` is not served here (see `GET /v1/models`)", crate::util::sanitize(&parsed.model)),
        });
    };
    call.row.resolved_model = model.to_string();
    id.check_model(&parsed.model, Some(model))?;
    if let Some(entry) = state.catalog.load().get(model).cloned()
        && !entry.worker.routes.contains(&route)
    {
        return Err(GatewayError::RouteNotServed {
            model: model.to_string(),
            method: parts.method.to_string(),
            path: parts.uri.path().to_string(),
            served: crate::models::routes::describe(&entry.worker.routes),
        });
    }
    // A LoRA adapter is served by its base model's worker under its own name.
    let adapter = state.names.adapter(&parsed.model);
    let upstream_name = adapter.as_deref().unwrap_or(model);
    call.row.adapter = adapter.clone().unwrap_or_default();
    let path_and_query = parts.uri.path_and_query().map(|p| p.as_str().to_string()).unwrap_or_else(|| parts.uri.path().to_string());
    let ask_usage = parse::asks_usage_chunk(parts.uri.path());
    let body = parse::upstream_body(&parsed, &bytes, upstream_name, ask_usage).map(Bytes::from).unwrap_or(bytes);
    Ok((parsed, Outgoing { method: parts.method, path_and_query, headers: parts.headers, body, budget }))
}

/// Waits for the model (counted as queued), then returns its lease.
pub async fn acquire(state: &AppState, call: &mut Call) -> Result<crate::models::Lease, GatewayError> {
    let model = call.row.resolved_model.clone();
    let t = Instant::now();
    let lease = {
        let _queued = GaugeGuard::new(&state.gateway.metrics.queued, &model);
        state.models.acquire_for(&model, &call.row.user).await
    };
    call.wait_us += us_since(t);
    let lease = lease?;
    call.row.model_version = lease.version.clone().unwrap_or_default();
    Ok(lease)
}

/// Sends the call to its worker and reads the answer's head: the client's method, path,
/// body, content type and accept header; the worker's key, never the client's credential.
/// The caller bounds the time (`gateway.upstream_timeout_s`).
pub async fn send_upstream(
    state: &AppState,
    lease: &crate::models::Lease,
    out: &Outgoing,
    request_id: &str,
) -> Result<upstream::Response, GatewayError> {
    attempt(state, lease, out, request_id).await?.map_err(|e| upstream_error(lease, e))
}

/// [`send_upstream`], and once more to another replica when no connection could be made to
/// the one the lease chose: nothing was sent, so the call is not lost to a replica that died
/// or stopped since its last probe. That replica gets no call until a probe passes again;
/// the lease (and the row's model version) becomes the new replica's.
pub async fn send_failover(
    state: &AppState,
    lease: &mut crate::models::Lease,
    out: &Outgoing,
    row: &mut UsageRow,
) -> Result<upstream::Response, NoAnswer> {
    let first = match attempt(state, lease, out, &row.request_id).await? {
        Ok(resp) => return Ok(resp),
        Err(e) => unsent(lease, e)?,
    };
    let Some(next) = state.models.reroute(lease, &row.user).await else { return Err(NoAnswer::Unreachable(first)) };
    tracing::info!(model = %lease.model, from = %lease.base_url, to = %next.base_url, request_id = %row.request_id, "a replica could not be reached; the call goes to another one");
    *lease = next;
    row.model_version = lease.version.clone().unwrap_or_default();
    match attempt(state, lease, out, &row.request_id).await? {
        Ok(resp) => Ok(resp),
        Err(e) => Err(NoAnswer::Unreachable(unsent(lease, e)?)),
    }
}

/// Why [`send_failover`] has no answer for the client.
pub enum NoAnswer {
    /// No connection could be made to the replica the call went to, so nothing was sent:
    /// [`worker_gone`] tells whether the call may wait for the model's next worker.
    Unreachable(GatewayError),
    Failed(GatewayError),
}

impl From<GatewayError> for NoAnswer {
    fn from(e: GatewayError) -> Self {
        NoAnswer::Failed(e)
    }
}

impl From<NoAnswer> for GatewayError {
    fn from(e: NoAnswer) -> Self {
        match e {
            NoAnswer::Unreachable(e) | NoAnswer::Failed(e) => e,
        }
    }
}

/// A failed try's error for the client: `Ok` when nothing reached the worker (no connection
/// could be made), `Err` when the request may have.
fn unsent(lease: &crate::models::Lease, e: upstream::UpstreamError) -> Result<GatewayError, NoAnswer> {
    let nothing_sent = e.is_connect() && !matches!(e, upstream::UpstreamError::Url { .. });
    let e = upstream_error(lease, e);
    if nothing_sent { Ok(e) } else { Err(NoAnswer::Failed(e)) }
}

/// How long a call that could reach none of its model's replicas waits for the worker's
/// supervisor to tell a dead worker (which it stops) from one that refused this connection.
const GONE_VERDICT: Duration = Duration::from_secs(10);

/// After [`NoAnswer::Unreachable`]: whether the worker the call went to is gone (its
/// supervisor found it dead or not holding its port, and stopped it). The call then waits for
/// the model again, as a first call does, instead of failing: nothing was sent, and the
/// model's next worker (or another replica) serves it. Counted as the call's wait.
pub async fn worker_gone(state: &AppState, lease: &crate::models::Lease, call: &mut Call) -> bool {
    let t = Instant::now();
    let gone = state.models.worker_gone(lease, GONE_VERDICT).await;
    call.wait_us += us_since(t);
    if gone {
        tracing::info!(model = %lease.model, upstream = %lease.base_url, request_id = %call.row.request_id, "the model's worker is gone; the call, sent nowhere yet, waits for the model again");
    }
    gone
}

/// One try: `Err` when the request cannot be built for this worker, `Ok(Err)` when it
/// failed on the way.
async fn attempt(
    state: &AppState,
    lease: &crate::models::Lease,
    out: &Outgoing,
    request_id: &str,
) -> Result<Result<upstream::Response, upstream::UpstreamError>, GatewayError> {
    let target = match upstream::Target::parse(&lease.base_url) {
        Ok(t) => t.owned_by(lease.worker()),
        Err(e) => return Ok(Err(e)),
    };
    let mut headers = Vec::with_capacity(4);
    for h in [header::CONTENT_TYPE, header::ACCEPT] {
        if let Some(v) = out.headers.get(&h) {
            headers.push((h, v.clone()));
        }
    }
    if let Some(k) = &lease.api_key {
        let Ok(mut v) = HeaderValue::from_str(&format!("Bearer {k}")) else {
            tracing::error!(model = %lease.model, "the worker's api_key cannot be sent in a header (control characters)");
            return Err(GatewayError::Upstream {
                model: lease.model.clone(),
                what: "its worker's api_key is not a valid header value".into(),
            });
        };
        v.set_sensitive(true);
        headers.push((header::AUTHORIZATION, v));
    }
    if let Ok(v) = HeaderValue::from_str(request_id) {
        headers.push((HeaderName::from_static("x-request-id"), v));
    }
    let req = upstream::Request { method: &out.method, path_and_query: &out.path_and_query, headers, body: &out.body };
    Ok(state.gateway.upstream.send(target, &req).await)
}

/// The time a whole upstream call may take.
pub fn upstream_timeout(state: &AppState) -> Duration {
    Duration::from_secs(state.config.file.gateway.upstream_timeout_s)
}

/// What the client is told when the upstream took longer than [`upstream_timeout`].
pub fn timed_out(lease: &crate::models::Lease, limit: Duration) -> GatewayError {
    tracing::warn!(model = %lease.model, seconds = limit.as_secs(), "upstream timed out");
    GatewayError::UpstreamTimeout { model: lease.model.clone(), seconds: limit.as_secs() }
}

/// Maps a failed upstream request to what the client is told (the cause is logged).
pub fn upstream_error(lease: &crate::models::Lease, e: upstream::UpstreamError) -> GatewayError {
    if let upstream::UpstreamError::TooLarge { limit } = e {
        tracing::warn!(model = %lease.model, upstream = %lease.base_url, limit, "a worker's answer is over gateway.max_response_bytes");
        return GatewayError::ResponseTooLarge { model: lease.model.clone(), limit, what: "" };
    }
    if let upstream::UpstreamError::NotTheWorker { what, .. } = &e {
        tracing::error!(model = %lease.model, upstream = %lease.base_url, reason = %what, "a worker's port is not held by that worker alone (its worker gone, another process on the port?); nothing was sent there");
        lease.upstream_failed();
        return GatewayError::Upstream {
            model: lease.model.clone(),
            what: "its worker's port is no longer held by that worker alone (the worker died or stopped, or another process listens there); nothing was sent there; retry: the next call goes to another replica or restarts it".into(),
        };
    }
    let what = if e.is_connect() {
        "cannot connect to its worker (the worker died or stopped; retry: the next call goes to another replica or restarts it)"
    } else if matches!(e, upstream::UpstreamError::Protocol(_)) {
        "its worker's answer was not valid HTTP/1.1"
    } else {
        "the connection to its worker broke off (the worker died or was stopped mid-call); retry: the next call goes to another replica or restarts it"
    };
    if !matches!(e, upstream::UpstreamError::Protocol(_)) {
        lease.upstream_failed();
    }
    tracing::warn!(model = %lease.model, upstream = %lease.base_url, error = %e, "upstream request failed");
    GatewayError::Upstream { model: lease.model.clone(), what: what.into() }
}

/// The upstream's own error body, shortened, for messages.
pub fn snippet(body: &[u8]) -> String {
    let text = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            v.pointer("/error/message")
                .or_else(|| v.get("detail"))
                .or_else(|| v.get("message"))
                .and_then(|m| m.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    let text = crate::util::sanitize(text.trim());
    if text.chars().count() > 200 { format!("{}...", text.chars().take(200).collect::<String>()) } else { text }
}

/// The upstream's error code for the usage log (`upstream_<status>` when it sent none).
pub fn upstream_code(status: StatusCode, body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/code").and_then(|c| c.as_str()).map(|c| c.chars().take(64).collect()))
        .unwrap_or_else(|| format!("upstream_{}", status.as_u16()))
}

const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "date",
];

/// Copies upstream response headers except hop-by-hop ones.
pub fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    for (k, v) in from {
        if !HOP_BY_HOP.contains(&k.as_str()) && k != header::SERVER {
            to.append(k.clone(), v.clone());
        }
    }
}

/// A call answered in one piece (JSON, audio bytes, ...).
async fn plain(state: &AppState, mut call: Call, out: Outgoing) -> Response {
    let mut lease = match acquire(state, &mut call).await {
        Ok(l) => l,
        Err(e) => return call.fail(state, e),
    };
    let _in_flight = GaugeGuard::new(&state.gateway.metrics.in_flight, &lease.model);
    let limit = upstream_timeout(state);
    let mut again = true;
    let (status, headers, body) = loop {
        let t0 = Instant::now();
        let answer = tokio::time::timeout(limit, async {
            let mut resp = send_failover(state, &mut lease, &out, &mut call.row).await?;
            let ttfb = us_since(t0);
            let (status, headers) = (resp.status, std::mem::take(&mut resp.headers));
            let body = resp.bytes_limited(state.config.file.gateway.max_response_bytes).await.map_err(|e| upstream_error(&lease, e))?;
            Ok::<_, NoAnswer>((ttfb, (status, headers, body)))
        })
        .await;
        call.upstream_us += us_since(t0);
        match answer {
            Err(_) => return call.fail(state, timed_out(&lease, limit)),
            Ok(Err(NoAnswer::Unreachable(_))) if again && worker_gone(state, &lease, &mut call).await => {
                again = false;
                drop(lease);
                lease = match acquire(state, &mut call).await {
                    Ok(l) => l,
                    Err(e) => return call.fail(state, e),
                };
            }
            Ok(Err(e)) => return call.fail(state, e.into()),
            Ok(Ok((ttfb, answer))) => {
                call.row.upstream_ttfb_us = ttfb;
                break answer;
            }
        }
    };
    if status.is_server_error() {
        tracing::warn!(model = %lease.model, status = %status, body = %snippet(&body), "upstream answered with a server error");
        let what = format!("its worker answered {}: {}", status.as_u16(), snippet(&body));
        return call.fail(state, GatewayError::Upstream { model: lease.model.clone(), what });
    }
    if let Some((p, c)) = parse::usage_of(&body) {
        call.row.prompt_tokens = p;
        call.row.completion_tokens = c;
        call.row.usage_source = super::usage_log::UsageSource::Reported;
    }
    let Some(held) = state.gateway.answers.hold(body.len()) else {
        let limit = state.config.file.gateway.max_response_bytes_total;
        return call.fail(state, GatewayError::AnswerBudget { model: lease.model.clone(), limit });
    };
    call.row.status = status.as_u16();
    if !status.is_success() {
        call.row.error_code = upstream_code(status, &body);
    }
    let extra = std::mem::take(&mut call.extra_headers);
    let mut response = Response::new(Body::new(super::limits::HeldBody::new(body, held)));
    *response.status_mut() = status;
    copy_headers(&headers, response.headers_mut());
    call.record(state);
    drop(lease);
    with_headers(response.into_response(), &extra)
}
