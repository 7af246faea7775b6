//! Streaming calls (`"stream": true`): SSE forwarded event by event as it arrives.
//!
//! One tracked task drives each stream from acquiring the model to the upstream's last byte,
//! so the usage row is written when the stream ends, not when the client leaves (a client
//! that disconnects still gets its tokens accounted). The handler waits for the task's first
//! word ([`Head`]): an error before anything was committed is an ordinary OpenAI error
//! response; once the stream is committed, failures become an error event followed by
//! `data: [DONE]`.
//!
//! - The upstream is asked for the final usage chunk (`stream_options.include_usage`); if the
//!   client did not ask for it, that chunk is taken out before it reaches the client.
//! - While a model loads longer than a moment, the stream is committed and SSE comments say
//!   so every `gateway.keepalive_s`; the same comments keep a silent upstream's stream alive.
//! - The `[DONE]` event is held back until the row is journaled, so a client that saw the
//!   end of its stream always has its row.

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
use crate::AppState;

/// How long a stream waits for its model before committing to SSE with loading comments.
const LOAD_GRACE: Duration = Duration::from_millis(500);
/// How long a stream waits for the end of the worker's body after `[DONE]`.
const DRAIN: Duration = Duration::from_millis(200);
/// Events buffered between the driving task and a slow client.
const CHANNEL: usize = 64;

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
        Driver { state: task_state, call, head: Some(head_tx), body: body_tx, client_gone: false }.run(parsed, out).await;
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
        if self.body.send(b).await.is_err() {
            self.client_gone = true;
            tracing::debug!(request_id = %self.call.row.request_id, "stream client went away; draining the upstream for usage");
        }
    }

    /// Ends the call with an error: an error response if nothing was committed yet, else an
    /// error event and `[DONE]`.
    async fn fail(mut self, e: GatewayError) {
        if let Some(h) = self.head.take() {
            let resp = self.call.fail(&self.state, e);
            let _ = h.send(Head::Error(resp));
            return;
        }
        self.call.row.error_code = e.code().to_string();
        let event = format!("data: {}\n\n", e.body());
        self.send(Bytes::from(event)).await;
        self.finish(true).await;
    }

    /// Journals the row, then sends `[DONE]` (held back until now).
    async fn finish(mut self, done: bool) {
        if self.client_gone && self.call.row.error_code.is_empty() {
            self.call.row.error_code = "client_closed".into();
        }
        let state = self.state.clone();
        let Driver { call, body, client_gone, .. } = &mut self;
        let call = std::mem::replace(call, Call::new(Default::default(), Instant::now()));
        call.record(&state);
        if done && !*client_gone {
            let _ = body.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        }
    }

    async fn run(mut self, parsed: Parsed, out: Outgoing) {
        self.call.row.streamed = true;
        // 1. The model, with loading comments if it takes more than a moment.
        let model = self.call.row.resolved_model.clone();
        let lease = {
            let state = self.state.clone();
            let t = Instant::now();
            let _queued = GaugeGuard::new(&state.gateway.metrics.queued, &model);
            let acquire = state.models.acquire(&model);
            tokio::pin!(acquire);
            let mut wait = LOAD_GRACE;
            let r = loop {
                tokio::select! {
                    r = &mut acquire => break r,
                    _ = tokio::time::sleep(wait) => {
                        wait = self.keepalive();
                        let note = format!(": gpuhub: model `{model}` is loading; waited {}s so far\n\n", t.elapsed().as_secs());
                        self.send(Bytes::from(note)).await;
                    }
                }
            };
            self.call.wait_us += us_since(t);
            r
        };
        let lease = match lease {
            Ok(l) => l,
            Err(e) => return self.fail(e.into()).await,
        };
        self.call.row.model_version = lease.version.clone().unwrap_or_default();
        let _in_flight = GaugeGuard::new(&self.state.gateway.metrics.in_flight, &lease.model);

        // 2. The upstream's answer: must be a 2xx event stream before anything is committed.
        let t0 = Instant::now();
        let limit = proxy::upstream_timeout(&self.state);
        let deadline = tokio::time::Instant::from_std(t0 + limit);
        let sent = tokio::time::timeout_at(deadline, proxy::send_upstream(&self.state, &lease, &out, &self.call.row.request_id)).await;
        let mut resp = match sent {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => {
                self.call.upstream_us += us_since(t0);
                return self.fail(e).await;
            }
            Err(_) => {
                self.call.upstream_us += us_since(t0);
                return self.fail(proxy::timed_out(&lease, limit)).await;
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

        // 3. Pump events.
        let strip_usage = !parsed.client_wants_usage;
        let mut buf = BytesMut::new();
        let mut saw_done = false;
        let keepalive = self.keepalive();
        let max_event = self.state.config.file.gateway.max_response_bytes;
        while !saw_done {
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
                    let err =
                        GatewayError::Upstream { model: lease.model.clone(), what: "its worker's stream broke off before the end".into() };
                    return self.fail(err).await;
                }
                Ok(Ok(Some(chunk))) => {
                    buf.extend_from_slice(&chunk);
                    while let Some(end) = event_end(&buf) {
                        if end > max_event {
                            break; // refused below, like an event that never ends
                        }
                        let event = buf.split_to(end).freeze();
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
                            Event::Done => saw_done = true,
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
        if !saw_done {
            let err = GatewayError::Upstream { model: lease.model.clone(), what: "its worker's stream ended without [DONE]".into() };
            return self.fail(err).await;
        }
        drop(_in_flight);
        drop(lease);
        self.finish(true).await;
        // What follows [DONE] is the end of the worker's body (usually in the same read):
        // read it, so the connection goes back to the pool instead of being reset.
        let _ = tokio::time::timeout(DRAIN, async { while let Ok(Some(_)) = resp.chunk().await {} }).await;
    }
}

impl Driver {
    fn note_usage(&mut self, usage: Option<(i64, i64)>) {
        if let Some((p, c)) = usage {
            self.call.row.prompt_tokens = p;
            self.call.row.completion_tokens = c;
        }
    }
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

/// Decides what to do with one upstream event (public for the fuzz loop).
pub fn classify(event: &[u8], strip_usage: bool) -> Event {
    let Some(data) = data_of(event) else { return Event::Forward(None) };
    if data.trim_ascii() == b"[DONE]" {
        return Event::Done;
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
