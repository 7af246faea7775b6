//! Streaming calls (`"stream": true`): SSE forwarded event by event as it arrives.
//!
//! One tracked task drives each stream from acquiring the model to the upstream's last byte,
//! so the usage row is written when the stream ends, not when the client leaves (a client
//! that disconnects still gets its tokens accounted). The handler waits for the task's first
//! word ([`Head`]): an error before anything was committed is an ordinary OpenAI error
//! response; once the stream is committed, failures become an error event followed by
//! `data: [DONE]`.
//!
//! - Each protocol's stream ends where it ends: chat and completions at `data: [DONE]`, the
//!   Responses API (`/v1/responses`) at its last event (`response.completed`,
//!   `response.incomplete` or `response.failed`), which carries its usage. A stream that
//!   ends before that broke off: the client gets an error event and the row says
//!   `stream_broken`.
//! - Chat and completions upstreams are asked for the final usage chunk
//!   (`stream_options.include_usage`); if the client did not ask for it, that chunk is taken
//!   out before it reaches the client.
//! - A worker that reports no usage in its streams (llama.cpp's server ignores
//!   `include_usage`) still leaves counts: the gateway counts the content deltas it forwards
//!   (one per token for llama.cpp's server) and, if the model has a `tokenize_path`, asks the
//!   worker to count the prompt. The row's `usage_source` says which (`reported`, `counted`,
//!   `tokenized`).
//! - While a model loads longer than a moment, the stream is committed and SSE comments say
//!   so every `gateway.keepalive_s` (with the model's state and why: Slurm's reason, what
//!   holds the GPU); the same comments keep a silent upstream's stream alive.
//! - The last event (`[DONE]`, `response.completed`) is held back until the row is journaled,
//!   so a client that saw the end of its stream always has its row.

use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use tokio::sync::{mpsc, oneshot};

use super::error::GatewayError;
use super::metrics::GaugeGuard;
use super::parse::{self, Parsed};
use super::proxy::{self, Call, Outgoing};
use super::us_since;
use super::usage_log::UsageSource;
use crate::AppState;
use crate::models::{Lease, ModelError};

/// How long a stream waits for its model before committing to SSE with loading comments.
const LOAD_GRACE: Duration = Duration::from_millis(500);
/// How long a stream waits for the end of the worker's body after `[DONE]`.
const DRAIN: Duration = Duration::from_millis(200);
/// Events buffered between the driving task and a slow client.
const CHANNEL: usize = 64;
/// Longest wait for the worker's tokenize endpoint after a stream without usage.
const TOKENIZE_TIMEOUT: Duration = Duration::from_secs(2);

/// How a stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Chat and text completions (and anything else): `data: [DONE]`.
    Done,
    /// The Responses API: `response.completed` (or `.incomplete`, `.failed`); no `[DONE]`.
    Responses,
}

impl Protocol {
    /// The protocol of a request path (`/v1/responses`, `/v1/responses?...`).
    pub fn of_path(path: &str) -> Protocol {
        let path = path.split('?').next().unwrap_or(path);
        if path == "/v1/responses" { Protocol::Responses } else { Protocol::Done }
    }

    fn end(self) -> &'static str {
        match self {
            Protocol::Done => "[DONE]",
            Protocol::Responses => "response.completed",
        }
    }
}

/// The task's first word to the handler.
enum Head {
    /// Failed before anything was committed (the row is already journaled).
    Error(Response),
    /// Stream the body from the channel.
    Stream,
}

/// Starts a streaming call and returns its response.
pub async fn start(state: AppState, call: Call, parsed: Parsed, out: Outgoing) -> Response {
    let (head_tx, head_rx) = oneshot::channel();
    let (body_tx, body_rx) = mpsc::channel::<Bytes>(CHANNEL);
    let extra = call.extra_headers.clone();
    let request_id = call.row.request_id.clone();
    let task_state = state.clone();
    state.tasks.spawn(async move {
        let protocol = Protocol::of_path(&out.path_and_query);
        let driver =
            Driver { state: task_state, call, head: Some(head_tx), body: body_tx, client_gone: false, protocol, reported: None, deltas: 0 };
        driver.run(parsed, out).await;
    });
    match head_rx.await {
        Ok(Head::Error(resp)) => resp,
        Ok(Head::Stream) => {
            let body = Body::from_stream(futures_util::stream::unfold(body_rx, |mut rx| async move {
                rx.recv().await.map(|b| (Ok::<Bytes, std::io::Error>(b), rx))
            }));
            let mut resp = Response::new(body);
            let h = resp.headers_mut();
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            h.insert("x-accel-buffering", HeaderValue::from_static("no"));
            proxy::with_headers(resp, &extra)
        }
        Err(_) => {
            tracing::error!(request_id = %request_id, "a stream task ended without answering");
            GatewayError::Internal { request_id }.into_response()
        }
    }
}

struct Driver {
    state: AppState,
    call: Call,
    head: Option<oneshot::Sender<Head>>,
    body: mpsc::Sender<Bytes>,
    client_gone: bool,
    protocol: Protocol,
    /// Usage the worker reported, if it did.
    reported: Option<(i64, i64)>,
    /// Content deltas forwarded (the completion tokens when the worker reports none).
    deltas: i64,
}

impl Driver {
    fn keepalive(&self) -> Duration {
        Duration::from_secs(self.state.config.file.gateway.keepalive_s.max(1))
    }

    /// Commits to SSE (once).
    fn commit(&mut self) {
        if let Some(h) = self.head.take() {
            let _ = h.send(Head::Stream);
        }
    }

    async fn send(&mut self, b: Bytes) {
        if self.client_gone {
            return;
        }
        self.commit();
        // A client that takes no event for `body_timeout_s` (it stopped reading but keeps the
        // connection) is gone too: it must not hold the model's slot and the row for ever.
        let stall = Duration::from_secs(self.state.config.file.gateway.body_timeout_s);
        match tokio::time::timeout(stall, self.body.send(b)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => {
                self.client_gone = true;
                tracing::debug!(request_id = %self.call.row.request_id, "stream client went away; draining the upstream for usage");
            }
            Err(_) => {
                self.client_gone = true;
                tracing::warn!(
                    request_id = %self.call.row.request_id,
                    user = %self.call.row.user,
                    stall_s = stall.as_secs(),
                    "stream client stopped reading (gateway.body_timeout_s); treated as gone, draining the upstream for usage"
                );
            }
        }
    }

    /// Ends the call with an error: an error response if nothing was committed yet, else an
    /// error event (and `[DONE]` for chat and completions: the Responses API has none).
    async fn fail(mut self, e: GatewayError) {
        if let Some(h) = self.head.take() {
            let resp = self.call.fail(&self.state, e);
            let _ = h.send(Head::Error(resp));
            return;
        }
        self.call.row.error_code = e.code().to_string();
        self.settle_usage();
        let event = format!("data: {}\n\n", e.body());
        self.send(Bytes::from(event)).await;
        let tail = (self.protocol == Protocol::Done).then(|| Bytes::from_static(b"data: [DONE]\n\n"));
        self.finish(tail).await;
    }

    /// Journals the row, then sends `tail`, the stream's last event (held back until now).
    async fn finish(mut self, tail: Option<Bytes>) {
        if self.client_gone && self.call.row.error_code.is_empty() {
            self.call.row.error_code = "client_closed".into();
        }
        let state = self.state.clone();
        let Driver { call, body, client_gone, .. } = &mut self;
        let call = std::mem::replace(call, Call::new(Default::default(), Instant::now()));
        call.record(&state);
        if let Some(tail) = tail
            && !*client_gone
        {
            let _ = body.send(tail).await;
        }
    }

    /// The row's token counts from what the stream showed: the worker's usage, else the
    /// deltas counted (a stream that never reached the worker has none).
    fn settle_usage(&mut self) {
        let row = &mut self.call.row;
        match self.reported {
            Some((p, c)) => {
                row.prompt_tokens = p;
                row.completion_tokens = c;
                row.usage_source = UsageSource::Reported;
            }
            None if self.deltas > 0 => {
                row.completion_tokens = self.deltas;
                row.usage_source = UsageSource::Counted;
            }
            None => row.usage_source = UsageSource::None,
        }
    }

    /// A stream that ended without usage: counts the prompt with the worker's tokenize
    /// endpoint, if the model has one (`tokenize_path`). Bounded by [`TOKENIZE_TIMEOUT`].
    async fn tokenize_prompt(&mut self, lease: &crate::models::Lease, out: &Outgoing) {
        let Some(path) = self.state.catalog.load().get(&lease.model).and_then(|m| m.tokenize_path.clone()) else { return };
        let Some(text) = prompt_text(&out.body) else { return };
        let upstream_name = serde_json::from_slice::<serde_json::Value>(&out.body)
            .ok()
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(str::to_string))
            .unwrap_or_else(|| lease.model.clone());
        // The field names of llama-cpp-python (`input`), vLLM (`prompt`) and llama.cpp's
        // server (`content`): each ignores the others.
        let body = serde_json::json!({"model": upstream_name, "input": text, "prompt": text, "content": text, "add_special": true});
        let mut headers = axum::http::HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        // The prompt is a part of the call's own body, still held under `out.budget`.
        let req = Outgoing {
            method: axum::http::Method::POST,
            path_and_query: path.clone(),
            headers,
            body: Bytes::from(body.to_string()),
            budget: Default::default(),
        };
        let t0 = Instant::now();
        let counted = tokio::time::timeout(TOKENIZE_TIMEOUT, async {
            let resp = proxy::send_upstream(&self.state, lease, &req, &self.call.row.request_id).await.ok()?;
            if !resp.status.is_success() {
                return None;
            }
            let bytes = resp.bytes().await.ok()?;
            token_count(&bytes)
        })
        .await;
        self.call.upstream_us += us_since(t0);
        match counted {
            Ok(Some(n)) => {
                self.call.row.prompt_tokens = n;
                self.call.row.usage_source = UsageSource::Tokenized;
            }
            _ => {
                tracing::warn!(model = %lease.model, path = %path, "the worker's tokenize endpoint did not count the prompt; the row has no prompt tokens")
            }
        }
    }

    /// Waits for `model` (counted as queued), sending loading comments while it loads.
    async fn lease(&mut self, model: &str) -> Result<Lease, ModelError> {
        let state = self.state.clone();
        let t = Instant::now();
        let _queued = GaugeGuard::new(&state.gateway.metrics.queued, model);
        let user = self.call.row.user.clone();
        let acquire = state.models.acquire_for(model, &user);
        tokio::pin!(acquire);
        let mut wait = LOAD_GRACE;
        let r = loop {
            tokio::select! {
                r = &mut acquire => break r,
                _ = tokio::time::sleep(wait) => {
                    wait = self.keepalive();
                    let note = loading_comment(model, state.models.status(model).as_ref(), t.elapsed().as_secs());
                    self.send(Bytes::from(note)).await;
                }
            }
        };
        self.call.wait_us += us_since(t);
        let lease = r?;
        self.call.row.model_version = lease.version.clone().unwrap_or_default();
        Ok(lease)
    }

    async fn run(mut self, parsed: Parsed, out: Outgoing) {
        self.call.row.streamed = true;
        // 1. The model, with loading comments if it takes more than a moment.
        let model = self.call.row.resolved_model.clone();
        let mut lease = match self.lease(&model).await {
            Ok(l) => l,
            Err(e) => return self.fail(e.into()).await,
        };
        let _in_flight = GaugeGuard::new(&self.state.gateway.metrics.in_flight, &lease.model);

        // 2. The upstream's answer: must be a 2xx event stream before anything is committed.
        let limit = proxy::upstream_timeout(&self.state);
        let mut again = true;
        let (mut resp, t0, deadline) = loop {
            let t0 = Instant::now();
            let deadline = tokio::time::Instant::from_std(t0 + limit);
            let sent = tokio::time::timeout_at(deadline, proxy::send_failover(&self.state, &mut lease, &out, &mut self.call.row)).await;
            if !matches!(sent, Ok(Ok(_))) {
                self.call.upstream_us += us_since(t0);
            }
            match sent {
                Ok(Ok(r)) => break (r, t0, deadline),
                Ok(Err(proxy::NoAnswer::Unreachable(_))) if again && proxy::worker_gone(&self.state, &lease, &mut self.call).await => {
                    again = false;
                    drop(lease);
                    lease = match self.lease(&model).await {
                        Ok(l) => l,
                        Err(e) => return self.fail(e.into()).await,
                    };
                }
                Ok(Err(e)) => return self.fail(e.into()).await,
                Err(_) => return self.fail(proxy::timed_out(&lease, limit)).await,
            }
        };
        self.call.row.upstream_ttfb_us = us_since(t0);
        let status = resp.status;
        let is_sse =
            resp.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|v| v.starts_with("text/event-stream"));
        if !status.is_success() || !is_sse {
            let headers = std::mem::take(&mut resp.headers);
            let limit = self.state.config.file.gateway.max_response_bytes;
            let bytes = tokio::time::timeout_at(deadline, resp.bytes_limited(limit)).await.ok().and_then(Result::ok).unwrap_or_default();
            self.call.upstream_us += us_since(t0);
            if status.is_server_error() || (status.is_success() && !is_sse) {
                let what = if status.is_success() {
                    "its worker answered a streaming request without an event stream".to_string()
                } else {
                    format!("its worker answered {}: {}", status.as_u16(), proxy::snippet(&bytes))
                };
                return self.fail(GatewayError::Upstream { model: lease.model.clone(), what }).await;
            }
            // A 4xx from the model (bad parameters): passed through as is.
            if let Some(h) = self.head.take() {
                self.call.row.status = status.as_u16();
                self.call.row.error_code = proxy::upstream_code(status, &bytes);
                let extra = std::mem::take(&mut self.call.extra_headers);
                let mut r = Response::new(Body::from(bytes));
                *r.status_mut() = status;
                proxy::copy_headers(&headers, r.headers_mut());
                let r = proxy::with_headers(r, &extra);
                let call = std::mem::replace(&mut self.call, Call::new(Default::default(), Instant::now()));
                call.record(&self.state);
                let _ = h.send(Head::Error(r));
                return;
            }
            let what = format!("its worker answered {}: {}", status.as_u16(), proxy::snippet(&bytes));
            return self.fail(GatewayError::Upstream { model: lease.model.clone(), what }).await;
        }
        self.call.row.status = StatusCode::OK.as_u16();
        self.commit();

        // 3. Pump events until the protocol's last event (held back in `tail`).
        let strip_usage = !parsed.client_wants_usage && self.protocol == Protocol::Done;
        let mut buf = BytesMut::new();
        let mut tail: Option<Bytes> = None;
        let keepalive = self.keepalive();
        let max_event = self.state.config.file.gateway.max_response_bytes;
        while tail.is_none() {
            let silence = keepalive.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
            match tokio::time::timeout(silence, resp.chunk()).await {
                Err(_) if tokio::time::Instant::now() >= deadline => {
                    self.call.upstream_us += us_since(t0);
                    return self.fail(proxy::timed_out(&lease, limit)).await;
                }
                Err(_) => self.send(Bytes::from_static(b": keep-alive\n\n")).await,
                Ok(Ok(None)) => break,
                Ok(Err(e)) => {
                    self.call.upstream_us += us_since(t0);
                    tracing::warn!(model = %lease.model, error = %e, "upstream stream broke off");
                    let err = GatewayError::StreamBroken {
                        model: lease.model.clone(),
                        what: format!("its worker's stream broke off before {}", self.protocol.end()),
                    };
                    return self.fail(err).await;
                }
                Ok(Ok(Some(chunk))) => {
                    buf.extend_from_slice(&chunk);
                    while let Some(end) = event_end(&buf) {
                        if end > max_event {
                            break; // refused below, like an event that never ends
                        }
                        let event = buf.split_to(end).freeze();
                        self.deltas += content_deltas(&event);
                        match classify(&event, strip_usage) {
                            Event::Forward(usage) => {
                                self.note_usage(usage);
                                self.send(event).await;
                            }
                            Event::Rewritten(usage, ev) => {
                                self.note_usage(Some(usage));
                                self.send(ev).await;
                            }
                            Event::Drop(usage) => self.note_usage(Some(usage)),
                            Event::Done => tail = Some(event),
                            Event::End { usage, failed } => {
                                self.note_usage(usage);
                                if failed {
                                    self.call.row.error_code = "response_failed".into();
                                }
                                tail = Some(event);
                            }
                        }
                        if tail.is_some() {
                            break;
                        }
                    }
                    if buf.len() > max_event {
                        // One event that never ends would grow this buffer without bound.
                        self.call.upstream_us += us_since(t0);
                        tracing::warn!(model = %lease.model, limit = max_event, "a worker's stream event is over gateway.max_response_bytes");
                        let err = GatewayError::ResponseTooLarge {
                            model: lease.model.clone(),
                            limit: max_event,
                            what: " (one event of its stream)",
                        };
                        return self.fail(err).await;
                    }
                }
            }
        }
        self.call.upstream_us += us_since(t0);
        let Some(tail) = tail else {
            let err = GatewayError::StreamBroken {
                model: lease.model.clone(),
                what: format!("its worker's stream ended without {}", self.protocol.end()),
            };
            return self.fail(err).await;
        };
        self.settle_usage();
        if self.reported.is_none() {
            self.tokenize_prompt(&lease, &out).await;
        }
        drop(_in_flight);
        drop(lease);
        self.finish(Some(tail)).await;
        // What follows [DONE] is the end of the worker's body (usually in the same read):
        // read it, so the connection goes back to the pool instead of being reset.
        let _ = tokio::time::timeout(DRAIN, async { while let Ok(Some(_)) = resp.chunk().await {} }).await;
    }
}

impl Driver {
    fn note_usage(&mut self, usage: Option<(i64, i64)>) {
        if let Some(u) = usage {
            self.reported = Some(u);
        }
    }
}

/// The SSE comment a stream waiting for its model gets: the model's state and why (Slurm's
/// reason, what holds the GPU and until when), and how long it has waited.
fn loading_comment(model: &str, status: Option<&crate::models::ModelStatus>, waited_s: u64) -> String {
    let what = match status {
        Some(s) => match s.detail.as_deref().filter(|d| !d.is_empty()) {
            Some(d) => format!("is loading ({}: {})", s.state, d),
            None => format!("is loading ({})", s.state),
        },
        None => "is loading".to_string(),
    };
    // One comment line: no newline from a detail may end it early.
    let what = what.replace(['\r', '\n'], " ");
    format!(": gpuhub: model `{model}` {what}; waited {waited_s}s so far\n\n")
}

/// The end of the first complete SSE event in `buf` (after its blank line), if any.
pub fn event_end(buf: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buf.len() {
        if buf[i] == b'\n' {
            if buf[i + 1] == b'\n' {
                return Some(i + 2);
            }
            if buf[i + 1] == b'\r' && buf.get(i + 2) == Some(&b'\n') {
                return Some(i + 3);
            }
        }
        i += 1;
    }
    None
}

/// What to do with one upstream event.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// Send as is (with the usage it carried, if any).
    Forward(Option<(i64, i64)>),
    /// Send this rewritten event instead (usage removed; the client did not ask for it).
    Rewritten((i64, i64), Bytes),
    /// The usage-only chunk the client did not ask for.
    Drop((i64, i64)),
    /// `data: [DONE]`: held back until the row is journaled.
    Done,
    /// The Responses API's last event (`response.completed`, `response.incomplete`,
    /// `response.failed`), with the usage of its `response`: held back until the row is
    /// journaled, then forwarded.
    End { usage: Option<(i64, i64)>, failed: bool },
}

/// The `data:` payload of an event (multi-line data joined with newlines).
fn data_of(event: &[u8]) -> Option<Vec<u8>> {
    let mut data: Option<Vec<u8>> = None;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let d = data.get_or_insert_with(Vec::new);
            if !d.is_empty() {
                d.push(b'\n');
            }
            d.extend_from_slice(rest);
        }
    }
    data
}

/// The `event:` field of an SSE event, if any.
fn event_name(event: &[u8]) -> Option<&[u8]> {
    event.split(|b| *b == b'\n').find_map(|line| {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        line.strip_prefix(b"event:").map(|r| r.trim_ascii())
    })
}

/// The Responses API's last events.
const RESPONSE_ENDS: [&str; 3] = ["response.completed", "response.incomplete", "response.failed"];

/// A Responses API event's `type` and its `response.usage`, if the data is one.
fn response_event(data: &[u8]) -> Option<(String, Option<(i64, i64)>)> {
    #[derive(serde::Deserialize)]
    struct Head {
        #[serde(rename = "type")]
        kind: Option<String>,
        response: Option<serde_json::Map<String, serde_json::Value>>,
    }
    parse::find_bytes(data, b"\"response.")?;
    let h = serde_json::from_slice::<Head>(data).ok()?;
    let usage = h.response.as_ref().and_then(|r| r.get("usage")).and_then(|u| u.as_object()).map(parse::token_counts);
    Some((h.kind?, usage))
}

/// Decides what to do with one upstream event (public for the fuzz loop).
pub fn classify(event: &[u8], strip_usage: bool) -> Event {
    let Some(data) = data_of(event) else { return Event::Forward(None) };
    if data.trim_ascii() == b"[DONE]" {
        return Event::Done;
    }
    let named_end = event_name(event).and_then(|n| std::str::from_utf8(n).ok()).is_some_and(|n| RESPONSE_ENDS.contains(&n));
    if (named_end || parse::find_bytes(&data, b"\"response.").is_some())
        && let Some((kind, usage)) = response_event(&data)
    {
        if RESPONSE_ENDS.contains(&kind.as_str()) {
            return Event::End { usage, failed: kind == "response.failed" };
        }
        return Event::Forward(None);
    }
    let Some(usage) = parse::usage_of(&data) else { return Event::Forward(None) };
    if !strip_usage {
        return Event::Forward(Some(usage));
    }
    let Ok(serde_json::Value::Object(mut chunk)) = serde_json::from_slice::<serde_json::Value>(&data) else {
        return Event::Forward(Some(usage));
    };
    let no_choices = match chunk.get("choices") {
        None | Some(serde_json::Value::Null) => true,
        Some(serde_json::Value::Array(a)) => a.is_empty(),
        Some(_) => false,
    };
    if no_choices {
        return Event::Drop(usage);
    }
    chunk.remove("usage");
    match serde_json::to_string(&chunk) {
        Ok(s) => Event::Rewritten(usage, Bytes::from(format!("data: {s}\n\n"))),
        Err(_) => Event::Forward(Some(usage)),
    }
}

/// Content deltas in one event: 1 for a chat chunk whose `choices[].delta` has non-empty
/// `content` (or `reasoning_content`), a completion chunk with non-empty `choices[].text`,
/// or a Responses API `response.output_text.delta`; else 0. llama.cpp's server sends one
/// token per delta, so for it this counts the completion tokens; servers that send several
/// tokens per delta are undercounted (they report usage anyway).
pub fn content_deltas(event: &[u8]) -> i64 {
    #[derive(serde::Deserialize)]
    struct Delta<'a> {
        #[serde(borrow)]
        content: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        reasoning_content: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Choice<'a> {
        #[serde(borrow)]
        delta: Option<Delta<'a>>,
        #[serde(borrow)]
        text: Option<std::borrow::Cow<'a, str>>,
    }
    #[derive(serde::Deserialize)]
    struct Chunk<'a> {
        #[serde(borrow)]
        choices: Option<Vec<Choice<'a>>>,
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow)]
        delta: Option<std::borrow::Cow<'a, str>>,
    }
    let Some(data) = data_of(event) else { return 0 };
    // Cheap test first: most events of a stream are deltas, but comments and the usage and
    // end events are not.
    if parse::find_bytes(&data, b"\"delta\"").is_none() && parse::find_bytes(&data, b"\"text\"").is_none() {
        return 0;
    }
    let Ok(c) = serde_json::from_slice::<Chunk>(&data) else { return 0 };
    if c.kind.as_deref() == Some("response.output_text.delta") {
        return i64::from(c.delta.as_deref().is_some_and(|d| !d.is_empty()));
    }
    let non_empty = |s: &Option<std::borrow::Cow<'_, str>>| s.as_deref().is_some_and(|t| !t.is_empty());
    let produced = c
        .choices
        .unwrap_or_default()
        .iter()
        .any(|ch| non_empty(&ch.text) || ch.delta.as_ref().is_some_and(|d| non_empty(&d.content) || non_empty(&d.reasoning_content)));
    i64::from(produced)
}

/// The prompt's text from a request body, for the worker's tokenize endpoint: a completion's
/// `prompt` (string or strings), a chat's messages' text, a Responses API `input`.
pub fn prompt_text(body: &[u8]) -> Option<String> {
    use serde_json::Value;
    fn text_of(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(a) => a.iter().for_each(|x| text_of(x, out)),
            Value::Object(o) => {
                // Message parts: {"type":"text","text":..}, {"role":..,"content":..},
                // Responses items: {"type":"input_text","text":..}.
                if let Some(t) = o.get("text") {
                    text_of(t, out);
                }
                if let Some(c) = o.get("content") {
                    text_of(c, out);
                }
            }
            _ => {}
        }
    }
    let v: Value = serde_json::from_slice(body).ok()?;
    let mut parts = Vec::new();
    for k in ["prompt", "messages", "input", "instructions"] {
        if let Some(x) = v.get(k) {
            text_of(x, &mut parts);
        }
    }
    (!parts.is_empty()).then(|| parts.join("\n"))
}

/// A tokenize endpoint's answer: `{"count": N}` or `{"tokens": [...]}`.
pub fn token_count(body: &[u8]) -> Option<i64> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    if let Some(n) = v.get("count").and_then(serde_json::Value::as_i64) {
        return Some(n);
    }
    v.get("tokens").and_then(serde_json::Value::as_array).map(|t| t.len() as i64)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn events_split_on_blank_lines() {
        assert_eq!(event_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(event_end(b"data: a\r\n\r\n"), Some(11));
        assert_eq!(event_end(b"data: a\n"), None);
    }

    #[test]
    fn each_protocol_ends_where_it_ends() {
        assert_eq!(Protocol::of_path("/v1/responses"), Protocol::Responses);
        assert_eq!(Protocol::of_path("/v1/responses?stream=true"), Protocol::Responses);
        assert_eq!(Protocol::of_path("/v1/chat/completions"), Protocol::Done);
        assert_eq!(Protocol::of_path("/v1/responses/abc/cancel"), Protocol::Done);
        let completed = b"event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":9,\"response\":{\"status\":\"completed\",\"usage\":{\"input_tokens\":11,\"output_tokens\":5,\"total_tokens\":16}}}\n\n";
        assert_eq!(classify(completed, true), Event::End { usage: Some((11, 5)), failed: false });
        assert_eq!(classify(completed, false), Event::End { usage: Some((11, 5)), failed: false });
        // Without the `event:` line (some servers send only data), and the other ends.
        let incomplete = b"data: {\"type\":\"response.incomplete\",\"response\":{\"usage\":{\"input_tokens\":2,\"output_tokens\":9}}}\n\n";
        assert_eq!(classify(incomplete, true), Event::End { usage: Some((2, 9)), failed: false });
        let failed = b"event: response.failed\ndata: {\"type\":\"response.failed\",\"response\":{\"usage\":null}}\n\n";
        assert_eq!(classify(failed, true), Event::End { usage: None, failed: true });
        // Events on the way are forwarded, never ends, even when they carry a usage: null.
        let created = b"event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"usage\":null}}\n\n";
        assert_eq!(classify(created, true), Event::Forward(None));
        let delta = b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Par\"}\n\n";
        assert_eq!(classify(delta, true), Event::Forward(None));
        // A chat chunk that mentions the words is still a chat chunk.
        let chat = b"data: {\"choices\":[{\"delta\":{\"content\":\"the \\\"response.completed\\\" event\"}}]}\n\n";
        assert_eq!(classify(chat, true), Event::Forward(None));
    }

    #[test]
    fn content_deltas_count_one_per_token_event() {
        let chat = |c: &str| format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{c}}},\"finish_reason\":null}}]}}\n\n");
        assert_eq!(content_deltas(chat("\" Paris\"").as_bytes()), 1);
        assert_eq!(content_deltas(chat("\"\"").as_bytes()), 0, "an empty delta is no token");
        assert_eq!(content_deltas(chat("null").as_bytes()), 0);
        // llama.cpp's first chunk (role only) and last (finish_reason, empty delta).
        assert_eq!(content_deltas(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n"), 0);
        assert_eq!(content_deltas(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n"), 0);
        assert_eq!(content_deltas(b"data: {\"choices\":[{\"index\":0,\"text\":\" de\"}]}\n\n"), 1, "completions");
        assert_eq!(content_deltas(b"data: {\"choices\":[{\"delta\":{\"reasoning_content\":\"hm\"}}]}\n\n"), 1);
        assert_eq!(
            content_deltas(b"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"Par\"}\n\n"),
            1
        );
        assert_eq!(
            content_deltas(b"data: {\"type\":\"response.output_text.done\",\"text\":\"Paris\"}\n\n"),
            0,
            "the done event repeats the text"
        );
        assert_eq!(content_deltas(b"data: [DONE]\n\n"), 0);
        assert_eq!(content_deltas(b": keep-alive\n\n"), 0);
        assert_eq!(content_deltas(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1}}\n\n"), 0);
        assert_eq!(content_deltas(b"data: {not json \"delta\"\n\n"), 0);
    }

    #[test]
    fn the_prompt_text_and_the_tokenize_answer() {
        assert_eq!(prompt_text(br#"{"model":"m","prompt":"one two"}"#).as_deref(), Some("one two"));
        assert_eq!(prompt_text(br#"{"prompt":["a","b"]}"#).as_deref(), Some("a\nb"));
        let chat = br#"{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#;
        assert_eq!(prompt_text(chat).as_deref(), Some("be brief\nhi"));
        assert_eq!(
            prompt_text(br#"{"input":[{"role":"user","content":[{"type":"input_text","text":"q"}]}],"instructions":"sys"}"#).as_deref(),
            Some("q\nsys")
        );
        assert_eq!(prompt_text(br#"{"model":"m"}"#), None);
        assert_eq!(prompt_text(b"not json"), None);
        assert_eq!(token_count(br#"{"count":12}"#), Some(12));
        assert_eq!(token_count(br#"{"tokens":[1,2,3]}"#), Some(3));
        assert_eq!(token_count(br#"{"detail":"Not Found"}"#), None);
    }

    #[test]
    fn loading_comments_say_why_on_one_line() {
        let mut st = crate::models::ModelStatus {
            name: "big".into(),
            state: "pending",
            role: None,
            aliases: vec![],
            adapters: vec![],
            in_flight: 0,
            detail: Some("Slurm job 7 pending: Resources; GPU 0 is held by Slurm job 3 `train`\nof alice".into()),
            launcher: crate::config::LauncherKind::Slurm,
            version: None,
            worker_id: Some("7".into()),
            vram_gib: 100.0,
            idle_s: None,
            idle_timeout_s: 600,
            log_tail: vec![],
            waiting: 1,
            replicas: vec![],
        };
        let c = loading_comment("big", Some(&st), 12);
        assert_eq!(
            c,
            ": gpuhub: model `big` is loading (pending: Slurm job 7 pending: Resources; GPU 0 is held by Slurm job 3 `train` of alice); waited 12s so far\n\n"
        );
        assert_eq!(event_end(c.as_bytes()), Some(c.len()), "one SSE comment event");
        st.detail = None;
        assert_eq!(loading_comment("big", Some(&st), 0), ": gpuhub: model `big` is loading (pending); waited 0s so far\n\n");
    }

    #[test]
    fn usage_chunk_is_captured_and_stripped_only_if_unasked() {
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\n";
        assert_eq!(classify(usage, true), Event::Drop((7, 3)));
        assert_eq!(classify(usage, false), Event::Forward(Some((7, 3))));
        let with_choices = b"data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\n";
        match classify(with_choices, true) {
            Event::Rewritten(u, ev) => {
                assert_eq!(u, (1, 2));
                assert!(!String::from_utf8_lossy(&ev).contains("usage"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(classify(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n", true), Event::Forward(None));
        assert_eq!(classify(b"data: [DONE]\n\n", true), Event::Done);
        assert_eq!(classify(b": comment\n\n", true), Event::Forward(None));
    }
}
