//! gpuhub-test-worker: a TEST-ONLY OpenAI-compatible model worker.
//!
//! It is not a model server. It answers the OpenAI routes gpuhub forwards with deterministic,
//! made-up content, so gpuhub's tests can start it exactly the way a site starts vLLM (the same
//! command template: `{model} {model_path} {version} {port} {host} {api_key_file}`, the key by
//! file or by `GPUHUB_TEST_WORKER_API_KEY`, never on the command line) and check every
//! lifecycle step without a GPU.
//!
//! Routes: `/health` (open, like vLLM; 503 until `--ready-delay-ms` has passed), and under `/v1`
//! (protected by the key, `--api-key-file`, `GPUHUB_TEST_WORKER_API_KEY` or `--api-key`, like
//! vLLM): `GET /v1/models`, `POST /v1/chat/completions` and
//! `/v1/completions` (plain, or SSE with a final usage chunk when
//! `stream_options.include_usage` is true), `/v1/responses` (the Responses API: plain, or
//! SSE events `response.created` ... `response.completed`, which carries the usage, and no
//! `[DONE]`), `/v1/embeddings`, `/v1/audio/speech` (binary WAV), `/v1/audio/transcriptions`
//! (multipart upload).
//!
//! `POST /tokenize` (vLLM's shape, behind the key) counts a prompt's words.
//!
//! Test knobs: `--no-stream-usage` (streams never carry usage, as llama.cpp's Python server),
//! `--startup-delay-ms` (before binding, like a server loading weights first),
//! `--ready-delay-ms` (bound, `/health` 503 meanwhile), `--token-delay-ms` (between streamed
//! chunks), `--stamp-chunks` (each chunk carries `x_sent_unix_ns`), `--crash-after N` (the process exits on the call after N answered `/v1` calls),
//! `--exit-at-start CODE` (fails during startup after printing a log line), `--break-stream-after N`
//! (a stream breaks off after N content events, without its last event), `--vram-gib`
//! (reported in `/health`), `--unhealthy-file PATH` (`/health` answers 503 while PATH exists),
//! `--port 0` (pick a free port; the address is printed on stdout and written to
//! `--report-file`).
//!
//! The CLI is used by other tests (gateway, models, lab): keep existing flags stable.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use serde_json::{Value, json};

/// TEST ONLY: a tiny OpenAI-compatible server with deterministic answers, for gpuhub's tests.
#[derive(Debug, Parser, Clone)]
#[command(name = "gpuhub-test-worker")]
struct Args {
    /// Name served (responses report it; other names get 404 like vLLM).
    #[arg(long)]
    model: String,
    /// Extra names served as the same model (like vLLM's `--served-model-name a b`).
    #[arg(long = "served-model-name")]
    served_model_name: Vec<String>,
    /// Weights path (reported only).
    #[arg(long, default_value = "")]
    model_path: String,
    /// Model version (reported in `/health`, `/v1/models` and `system_fingerprint`).
    #[arg(long, default_value = "")]
    version: String,
    /// Address to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to bind; 0 picks a free one (printed, and written to `--report-file`).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// Bearer key required on `/v1/*` (none: open). Also read from the environment, which is
    /// how gpuhub passes it without putting it on the command line.
    #[arg(long, env = "GPUHUB_TEST_WORKER_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Read the bearer key from this file (its first line), as gpuhub's `{api_key_file}`.
    #[arg(long, value_name = "PATH", conflicts_with = "api_key")]
    api_key_file: Option<PathBuf>,
    /// Write `HOST PORT` here (atomically) once bound.
    #[arg(long)]
    report_file: Option<PathBuf>,
    /// Sleep this long before binding (a server that loads weights before listening).
    #[arg(long, default_value_t = 0)]
    startup_delay_ms: u64,
    /// Bind with SO_REUSEPORT, as vLLM's server does: another socket of the same account may
    /// share the port, and the kernel spreads connections across them.
    #[arg(long)]
    reuse_port: bool,
    /// After binding, `/health` answers 503 for this long.
    #[arg(long, default_value_t = 0)]
    ready_delay_ms: u64,
    /// Delay between streamed chunks (and per token for plain calls).
    #[arg(long, default_value_t = 0)]
    token_delay_ms: u64,
    /// Stamp each streamed chunk with `x_sent_unix_ns`, the wall clock when it was made
    /// (benchmarks measure forwarding delay from it; clients ignore unknown fields).
    #[arg(long)]
    stamp_chunks: bool,
    /// Exit (status 3) on the call after this many answered `/v1` calls.
    #[arg(long)]
    crash_after: Option<u64>,
    /// Print a log line, then exit with this status during startup.
    #[arg(long)]
    exit_at_start: Option<i32>,
    /// VRAM this worker claims to use, GiB (reported in `/health`).
    #[arg(long, default_value_t = 0.0)]
    vram_gib: f64,
    /// Streams (chat, completions, responses) break off after this many content events: the
    /// connection is cut without the stream's last event.
    #[arg(long)]
    break_stream_after: Option<usize>,
    /// Streams carry no usage even when `stream_options.include_usage` asks for it (as
    /// llama.cpp's Python server): the gateway must count.
    #[arg(long)]
    no_stream_usage: bool,
    /// `/health` answers 503 while this file exists (a live server whose engine died: it still
    /// listens and answers calls, but its health check fails).
    #[arg(long, value_name = "PATH")]
    unhealthy_file: Option<PathBuf>,
}

struct Worker {
    args: Args,
    ready_at: std::time::Instant,
    calls: AtomicU64,
    crashing: AtomicBool,
}

type Shared = Arc<Worker>;

fn log(msg: &str) {
    // stderr: the worker's log (Slurm's job output or the local launcher's log file).
    // `at_us` (Unix microseconds) lets benchmarks split a cold start into its parts.
    let at_us = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros()).unwrap_or(0);
    let _ = writeln!(std::io::stderr(), "gpuhub-test-worker: at_us={at_us} {msg}");
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut args = Args::parse();
    log(&format!("TEST WORKER starting model={} version={} pid={}", args.model, args.version, std::process::id()));
    if let Some(path) = &args.api_key_file {
        match std::fs::read_to_string(path) {
            Ok(text) => args.api_key = text.lines().next().map(|l| l.trim().to_string()).filter(|k| !k.is_empty()),
            Err(e) => {
                log(&format!("error: cannot read --api-key-file {}: {e}", path.display()));
                return std::process::ExitCode::from(2);
            }
        }
        if args.api_key.is_none() {
            log(&format!("error: --api-key-file {} is empty", path.display()));
            return std::process::ExitCode::from(2);
        }
    }
    if let Some(code) = args.exit_at_start {
        log(&format!("error: cannot load weights for {} (simulated by --exit-at-start {code})", args.model));
        std::process::exit(code);
    }
    if args.startup_delay_ms > 0 {
        log(&format!("loading weights ({} ms)", args.startup_delay_ms));
        tokio::time::sleep(Duration::from_millis(args.startup_delay_ms)).await;
    }
    let listener = match bind(&args.host, args.port, args.reuse_port).await {
        Ok(l) => l,
        Err(e) => {
            log(&format!("error: cannot bind {}:{}: {e}", args.host, args.port));
            return std::process::ExitCode::from(2);
        }
    };
    let addr: SocketAddr = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            log(&format!("error: local_addr: {e}"));
            return std::process::ExitCode::from(2);
        }
    };
    if let Some(path) = &args.report_file {
        let tmp = path.with_extension("tmp");
        let written = std::fs::write(&tmp, format!("{} {}\n", addr.ip(), addr.port())).and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            log(&format!("error: cannot write --report-file {}: {e}", path.display()));
            return std::process::ExitCode::from(2);
        }
    }
    let _ = writeln!(std::io::stdout(), "gpuhub-test-worker: listening on http://{addr}");
    log(&format!("listening on http://{addr}"));

    let state: Shared = Arc::new(Worker {
        ready_at: std::time::Instant::now() + Duration::from_millis(args.ready_delay_ms),
        args,
        calls: AtomicU64::new(0),
        crashing: AtomicBool::new(false),
    });
    let v1 = Router::new()
        .route("/models", get(models))
        .route("/chat/completions", post(chat))
        .route("/completions", post(completions))
        .route("/responses", post(responses))
        .route("/embeddings", post(embeddings))
        .route("/audio/speech", post(speech))
        .route("/audio/transcriptions", post(transcriptions))
        .layer(middleware::from_fn_with_state(state.clone(), guard));
    let tokenize = Router::new().route("/tokenize", post(tokenize)).layer(middleware::from_fn_with_state(state.clone(), guard));
    let app = Router::new().route("/health", get(health)).nest("/v1", v1).merge(tokenize).with_state(state);
    let shutdown = async {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut s) = signal(SignalKind::terminate()) {
            s.recv().await;
        }
    };
    // TCP_NODELAY, as real servers set it: SSE chunks are small writes that Nagle would hold for
    // the client's delayed ACK (~40 ms), which would make every streaming measurement lie.
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    if let Err(e) = axum::serve(listener, app).with_graceful_shutdown(shutdown).await {
        log(&format!("error: server: {e}"));
        return std::process::ExitCode::from(2);
    }
    log("stopped (SIGTERM)");
    std::process::ExitCode::SUCCESS
}

fn error(status: StatusCode, kind: &str, code: &str, message: &str) -> Response {
    (status, Json(json!({"error": {"message": message, "type": kind, "param": null, "code": code}}))).into_response()
}

/// API key and crash knob for every `/v1` call.
async fn guard(State(w): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &w.args.api_key {
        let got = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        if got != Some(key.as_str()) {
            return error(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "invalid_api_key",
                "invalid or missing API key for this test worker",
            );
        }
    }
    let n = w.calls.fetch_add(1, Ordering::AcqRel);
    if let Some(limit) = w.args.crash_after
        && n >= limit
    {
        w.crashing.store(true, Ordering::Release);
        log(&format!("CRASH: simulated crash after {limit} calls (--crash-after)"));
        std::process::exit(3);
    }
    next.run(req).await
}

async fn health(State(w): State<Shared>) -> Response {
    let body = json!({"status": "ok", "model": w.args.model, "version": w.args.version, "pid": std::process::id(), "vram_gib": w.args.vram_gib, "test_worker": true});
    if std::time::Instant::now() < w.ready_at {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response();
    }
    if w.args.unhealthy_file.as_ref().is_some_and(|p| p.exists()) {
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "unhealthy"}))).into_response();
    }
    Json(body).into_response()
}

fn names(w: &Worker) -> impl Iterator<Item = &String> {
    std::iter::once(&w.args.model).chain(w.args.served_model_name.iter())
}

async fn models(State(w): State<Shared>) -> Json<Value> {
    let data: Vec<Value> = names(&w)
        .map(|n| json!({"id": n, "object": "model", "created": now_s(), "owned_by": "gpuhub-test-worker", "version": w.args.version}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Parses the JSON body and checks `model`, with vLLM-like errors.
#[allow(clippy::result_large_err)] // a test server: the error is the response to send
fn parse(w: &Worker, body: &Bytes) -> Result<Value, Response> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_json", &format!("invalid JSON body: {e}")))?;
    let model = v.get("model").and_then(Value::as_str).unwrap_or("");
    if !names(w).any(|n| n == model) {
        return Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            &format!("The model `{model}` does not exist (this worker serves `{}`).", w.args.model),
        ));
    }
    Ok(v)
}

fn words(s: &str) -> u64 {
    s.split_whitespace().count() as u64
}

fn fingerprint(w: &Worker) -> String {
    format!("gpuhub-test-worker:{}", w.args.version)
}

async fn chat(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let msgs = v.get("messages").and_then(Value::as_array).cloned().unwrap_or_default();
    let prompt: String = msgs.iter().filter_map(|m| m.get("content").and_then(Value::as_str)).collect::<Vec<_>>().join(" ");
    let last = msgs.last().and_then(|m| m.get("content")).and_then(Value::as_str).unwrap_or("");
    let answer =
        format!("Hello from {} version {}: you said: {last}", w.args.model, if w.args.version.is_empty() { "-" } else { &w.args.version });
    respond(&w, &v, "chat.completion", &answer, words(&prompt).max(1)).await
}

async fn completions(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let prompt = v.get("prompt").and_then(Value::as_str).unwrap_or("");
    let answer = format!(" completion of: {prompt}");
    respond(&w, &v, "text_completion", &answer, words(prompt).max(1)).await
}

/// A plain or streamed answer with `answer` split into one chunk per word.
async fn respond(w: &Worker, req: &Value, object: &str, answer: &str, prompt_tokens: u64) -> Response {
    let model = req.get("model").and_then(Value::as_str).unwrap_or("").to_string();
    let pieces: Vec<String> = answer.split_inclusive(' ').map(str::to_string).collect();
    let completion_tokens = pieces.len() as u64;
    let usage =
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
    let id = format!("test-{}", w.calls.load(Ordering::Relaxed));
    let chat = object == "chat.completion";
    let stream = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let delay = Duration::from_millis(w.args.token_delay_ms);
    if !stream {
        if !delay.is_zero() {
            tokio::time::sleep(delay * completion_tokens as u32).await;
        }
        let choice = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"})
        } else {
            json!({"index": 0, "text": answer, "finish_reason": "stop"})
        };
        return Json(json!({"id": id, "object": object, "created": now_s(), "model": model, "system_fingerprint": fingerprint(w), "choices": [choice], "usage": usage})).into_response();
    }
    let include_usage = !w.args.no_stream_usage && req.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    let chunk_object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let fp = fingerprint(w);
    let stamp = w.args.stamp_chunks;
    let break_after = w.args.break_stream_after;
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        let usage_null = if include_usage { json!({"usage": null}) } else { json!({}) };
        let n = pieces.len();
        for (i, p) in pieces.into_iter().enumerate() {
            if break_after == Some(i) {
                log(&format!("BREAK: stream cut after {i} chunks (--break-stream-after)"));
                // Let the chunks already sent reach the client before the connection is cut.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = tx.send(Err(std::io::Error::other("stream cut by --break-stream-after"))).await;
                return;
            }
            if i > 0 && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let finish = if i + 1 == n { json!("stop") } else { Value::Null };
            let choice = if chat {
                let mut delta = json!({"content": p});
                if i == 0 {
                    delta["role"] = json!("assistant");
                }
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": p, "finish_reason": finish})
            };
            let mut chunk = json!({"id": id, "object": chunk_object, "created": now_s(), "model": model, "system_fingerprint": fp, "choices": [choice]});
            if let (Some(c), Some(u)) = (chunk.as_object_mut(), usage_null.as_object()) {
                c.extend(u.clone());
                if stamp {
                    let ns = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
                    c.insert("x_sent_unix_ns".into(), json!(ns as u64));
                }
            }
            if tx.send(Ok(Bytes::from(format!("data: {chunk}\n\n")))).await.is_err() {
                return;
            }
        }
        if include_usage {
            let chunk = json!({"id": id, "object": chunk_object, "created": now_s(), "model": model, "system_fingerprint": fp, "choices": [], "usage": usage});
            if tx.send(Ok(Bytes::from(format!("data: {chunk}\n\n")))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
    });
    let body = Body::from_stream(tokio_stream_from(rx));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", "cannot build the stream"))
}

/// The Responses API (`POST /v1/responses`): `input` (a string, or items with text), answered
/// with one output message; streamed as the Responses API streams (typed events, the usage in
/// `response.completed`, no `[DONE]`).
async fn responses(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    fn text_of(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::String(s) => out.push(s.clone()),
            Value::Array(a) => a.iter().for_each(|x| text_of(x, out)),
            Value::Object(o) => {
                for k in ["text", "content"] {
                    if let Some(x) = o.get(k) {
                        text_of(x, out);
                    }
                }
            }
            _ => {}
        }
    }
    let mut parts = Vec::new();
    if let Some(i) = v.get("input") {
        text_of(i, &mut parts);
    }
    let prompt = parts.join(" ");
    let last = parts.last().cloned().unwrap_or_default();
    let answer =
        format!("Hello from {} version {}: you said: {last}", w.args.model, if w.args.version.is_empty() { "-" } else { &w.args.version });
    let model = v.get("model").and_then(Value::as_str).unwrap_or("").to_string();
    let pieces: Vec<String> = answer.split_inclusive(' ').map(str::to_string).collect();
    let (input_tokens, output_tokens) = (words(&prompt).max(1), pieces.len() as u64);
    let n = w.calls.load(Ordering::Relaxed);
    let (resp_id, msg_id) = (format!("resp_test{n}"), format!("msg_test{n}"));
    let created = now_s();
    let message = |status: &str, text: Option<&str>| {
        let content = match text {
            Some(t) => json!([{"type": "output_text", "text": t, "annotations": []}]),
            None => json!([]),
        };
        json!({"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": content})
    };
    let response = |status: &str, output: Value, usage: Value| {
        json!({
            "id": resp_id, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "usage": usage, "error": null, "incomplete_details": null, "instructions": null,
            "metadata": {}, "parallel_tool_calls": true, "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
        })
    };
    let usage = json!({
        "input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
    });
    let done = response("completed", json!([message("completed", Some(&answer))]), usage);
    if !v.get("stream").and_then(Value::as_bool).unwrap_or(false) {
        return Json(done).into_response();
    }
    let mut events: Vec<(String, Value)> = vec![
        ("response.created".into(), json!({"response": response("in_progress", json!([]), Value::Null)})),
        ("response.in_progress".into(), json!({"response": response("in_progress", json!([]), Value::Null)})),
        ("response.output_item.added".into(), json!({"output_index": 0, "item": message("in_progress", None)})),
        (
            "response.content_part.added".into(),
            json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
    ];
    let first_delta = events.len();
    for p in &pieces {
        events.push((
            "response.output_text.delta".into(),
            json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "delta": p, "logprobs": []}),
        ));
    }
    events.push((
        "response.output_text.done".into(),
        json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "text": answer, "logprobs": []}),
    ));
    events.push((
        "response.content_part.done".into(),
        json!({"item_id": msg_id, "output_index": 0, "content_index": 0, "part": {"type": "output_text", "text": answer, "annotations": []}}),
    ));
    events.push(("response.output_item.done".into(), json!({"output_index": 0, "item": message("completed", Some(&answer))})));
    events.push(("response.completed".into(), json!({"response": done})));
    let delay = Duration::from_millis(w.args.token_delay_ms);
    let break_at = w.args.break_stream_after.map(|k| first_delta + k);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
    tokio::spawn(async move {
        for (seq, (kind, mut data)) in events.into_iter().enumerate() {
            if break_at == Some(seq) {
                log(&format!("BREAK: responses stream cut before event {seq} (--break-stream-after)"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                let _ = tx.send(Err(std::io::Error::other("stream cut by --break-stream-after"))).await;
                return;
            }
            if seq > first_delta && !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            if let Some(o) = data.as_object_mut() {
                o.insert("type".into(), json!(kind));
                o.insert("sequence_number".into(), json!(seq));
            }
            if tx.send(Ok(Bytes::from(format!("event: {kind}\ndata: {data}\n\n")))).await.is_err() {
                return;
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(tokio_stream_from(rx)))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", "internal", "cannot build the stream"))
}

fn tokio_stream_from(
    rx: tokio::sync::mpsc::Receiver<Result<Bytes, std::io::Error>>,
) -> impl futures_util::Stream<Item = Result<Bytes, std::io::Error>> {
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}

/// `POST /tokenize` (vLLM's shape): `{"model", "prompt"}` → `{"count": N, "tokens": [...]}`,
/// one token per word, as the other routes count them.
async fn tokenize(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let text = ["prompt", "input", "content"].iter().find_map(|k| v.get(*k).and_then(Value::as_str)).unwrap_or("");
    let n = words(text);
    Json(json!({"count": n, "max_model_len": 4096, "tokens": (0..n).collect::<Vec<u64>>()})).into_response()
}

async fn embeddings(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let inputs: Vec<String> = match v.get("input") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a.iter().map(|x| x.as_str().map(str::to_string).unwrap_or_else(|| x.to_string())).collect(),
        _ => return error(StatusCode::BAD_REQUEST, "invalid_request_error", "invalid_input", "`input` must be a string or an array"),
    };
    let mut tokens = 0;
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, s)| {
            tokens += words(s).max(1);
            // Deterministic 8-dimensional vector from the bytes.
            let mut e = [0f64; 8];
            for (j, b) in s.bytes().enumerate() {
                e[j % 8] += f64::from(b) / 255.0;
            }
            json!({"object": "embedding", "index": i, "embedding": e})
        })
        .collect();
    Json(json!({"object": "list", "model": v["model"], "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}))
        .into_response()
}

async fn speech(State(w): State<Shared>, body: Bytes) -> Response {
    let v = match parse(&w, &body) {
        Ok(v) => v,
        Err(r) => return r,
    };
    let input = v.get("input").and_then(Value::as_str).unwrap_or("");
    // A valid, silent 8 kHz mono 8-bit WAV: 100 samples per input byte.
    let samples = (input.len().max(1) * 100) as u32;
    let mut wav = Vec::with_capacity(44 + samples as usize);
    wav.extend_from_slice(b"RIFF");
    wav.extend_from_slice(&(36 + samples).to_le_bytes());
    wav.extend_from_slice(b"WAVEfmt ");
    wav.extend_from_slice(&16u32.to_le_bytes());
    wav.extend_from_slice(&1u16.to_le_bytes());
    wav.extend_from_slice(&1u16.to_le_bytes());
    wav.extend_from_slice(&8000u32.to_le_bytes());
    wav.extend_from_slice(&8000u32.to_le_bytes());
    wav.extend_from_slice(&1u16.to_le_bytes());
    wav.extend_from_slice(&8u16.to_le_bytes());
    wav.extend_from_slice(b"data");
    wav.extend_from_slice(&samples.to_le_bytes());
    wav.resize(44 + samples as usize, 128);
    ([(header::CONTENT_TYPE, "audio/wav")], wav).into_response()
}

/// Multipart upload: needs a `model` field naming this worker and a `file` part; answers with
/// the file's size so tests can check the upload arrived whole.
async fn transcriptions(State(w): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let ctype = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let Some(boundary) = ctype.split(';').filter_map(|p| p.trim().strip_prefix("boundary=")).next() else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_multipart",
            "expected multipart/form-data with a boundary",
        );
    };
    let boundary = boundary.trim_matches('"');
    let delim = format!("--{boundary}");
    let mut model = None;
    let mut file_len = None;
    for part in split_bytes(&body, delim.as_bytes()) {
        let Some(split) = find(part, b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&part[..split]);
        let mut content = &part[split + 4..];
        if content.ends_with(b"\r\n") {
            content = &content[..content.len() - 2];
        }
        if head.contains("name=\"model\"") {
            model = Some(String::from_utf8_lossy(content).trim().to_string());
        } else if head.contains("name=\"file\"") {
            file_len = Some(content.len());
        }
    }
    let model = model.unwrap_or_default();
    if !names(&w).any(|n| *n == model) {
        return error(StatusCode::NOT_FOUND, "invalid_request_error", "model_not_found", &format!("The model `{model}` does not exist."));
    }
    let Some(len) = file_len else {
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", "missing_file", "the multipart body has no `file` part");
    };
    Json(json!({"text": format!("transcribed {len} bytes with {model}")})).into_response()
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn split_bytes<'a>(mut hay: &'a [u8], delim: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    while let Some(i) = find(hay, delim) {
        out.push(&hay[..i]);
        hay = &hay[i + delim.len()..];
    }
    out.push(hay);
    out
}

/// A listener on `host:port`, with SO_REUSEPORT when `reuse_port`.
async fn bind(host: &str, port: u16, reuse_port: bool) -> std::io::Result<tokio::net::TcpListener> {
    if !reuse_port {
        return tokio::net::TcpListener::bind((host, port)).await;
    }
    let addr = tokio::net::lookup_host((host, port))
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, format!("{host} has no address")))?;
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent_and_stable() {
        Args::command().debug_assert();
        let a = Args::try_parse_from(["w", "--model", "m", "--version", "3", "--port", "0", "--api-key", "k", "--crash-after", "2"])
            .unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!((a.model.as_str(), a.version.as_str(), a.port, a.crash_after), ("m", "3", 0, Some(2)));
        assert!(Args::try_parse_from(["w"]).is_err(), "--model is required");
        let a = Args::try_parse_from(["w", "--model", "m", "--api-key-file", "/run/k"]).unwrap_or_else(|e| unreachable!("{e}"));
        assert_eq!(a.api_key_file.as_deref(), Some(std::path::Path::new("/run/k")));
        assert!(Args::try_parse_from(["w", "--model", "m", "--api-key", "k", "--api-key-file", "/run/k"]).is_err(), "one key source");
    }
}
