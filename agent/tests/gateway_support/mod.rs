//! Shared helpers for the gateway's integration tests: an in-process agent on port-0
//! listeners with a temp config, and a scriptable OpenAI-style upstream on 127.0.0.1:0.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use gpuhub_agent::control::client;
use serde_json::{Value, json};

/// What the upstream saw last (to check what the gateway forwarded).
#[derive(Default, Clone, Debug)]
pub struct Seen {
    pub authorization: Option<String>,
    pub body: Vec<u8>,
    pub path: String,
}

#[derive(Clone, Default)]
pub struct Upstream {
    pub seen: Arc<Mutex<Seen>>,
}

/// Modes, chosen by the first path segment of the model's URL (`url = http://UP/<mode>`):
/// `ok` answers; `fail` answers 500; `break` streams two chunks then drops the connection;
/// `nodone` ends a stream without [DONE]; `slow` streams a chunk every 200 ms (10 chunks);
/// `hang` waits 30 s before answering; `big` answers 200 KiB (plain: the whole answer; stream:
/// one event).
pub async fn upstream() -> (SocketAddr, Upstream) {
    let up = Upstream::default();
    let app = axum::Router::new().route("/{mode}/v1/{*rest}", post(handle)).with_state(up.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    (addr, up)
}

fn sse(events: Vec<String>, gap: Duration, then_break: bool) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    tokio::spawn(async move {
        for e in events {
            if tx.send(Ok(Bytes::from(e))).await.is_err() {
                return;
            }
            tokio::time::sleep(gap).await;
        }
        if then_break {
            let _ = tx.send(Err(std::io::Error::other("worker crashed"))).await;
        }
    });
    let body = Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (b, rx)) }));
    ([("content-type", "text/event-stream")], body).into_response()
}

fn chunk(content: &str) -> String {
    format!("data: {}\n\n", json!({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": content}}]}))
}

async fn handle(State(up): State<Upstream>, Path((mode, rest)): Path<(String, String)>, headers: HeaderMap, body: Bytes) -> Response {
    {
        let mut s = up.seen.lock().unwrap();
        s.authorization = headers.get("authorization").and_then(|v| v.to_str().ok()).map(str::to_string);
        s.body = body.to_vec();
        s.path = format!("/v1/{rest}");
    }
    let v: Value = serde_json::from_slice(&body).unwrap_or(json!({}));
    let stream = v["stream"].as_bool().unwrap_or(false);
    let usage_asked = v.pointer("/stream_options/include_usage").and_then(Value::as_bool).unwrap_or(false);
    match mode.as_str() {
        "fail" => return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"error": {"message": "CUDA out of memory"}}))).into_response(),
        "hang" => tokio::time::sleep(Duration::from_secs(30)).await,
        "bad" => {
            return (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": "max_tokens too large", "code": "bad_param"}})))
                .into_response();
        }
        "big" if stream => {
            let event = format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": "x".repeat(200 * 1024)}}]}));
            return sse(vec![chunk("small "), event, "data: [DONE]\n\n".into()], Duration::from_millis(1), false);
        }
        "big" => return Json(json!({"choices": [{"index": 0, "message": {"content": "x".repeat(200 * 1024)}}]})).into_response(),
        "flood" if !stream => return Json(json!({"choices": [{"index": 0, "message": {"content": "x".repeat(8 << 20)}}]})).into_response(),
        "flood" => {
            let event = format!("data: {}\n\n", json!({"choices": [{"index": 0, "delta": {"content": "x".repeat(200 * 1024)}}]}));
            return sse(vec![event; 100].into_iter().chain(["data: [DONE]\n\n".to_string()]).collect(), Duration::from_millis(1), false);
        }
        _ => {}
    }
    if rest == "audio/speech" {
        return ([("content-type", "audio/wav")], vec![0u8, 1, 2, 3, 255]).into_response();
    }
    if rest.starts_with("audio/transcriptions") {
        return Json(json!({"text": "transcribed", "bytes": body.len()})).into_response();
    }
    if !stream {
        return Json(json!({
            "id": "c1", "object": "chat.completion", "model": v["model"], "echo": v,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
        }))
        .into_response();
    }
    let n = if mode == "slow" { 10 } else { 3 };
    let mut events: Vec<String> = (0..n).map(|i| chunk(&format!("w{i} "))).collect();
    match mode.as_str() {
        "break" => return sse(events.into_iter().take(2).collect(), Duration::from_millis(10), true),
        "nodone" => return sse(events, Duration::from_millis(1), false),
        _ => {}
    }
    if usage_asked {
        events.push(format!("data: {}\n\n", json!({"object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}})));
    }
    events.push("data: [DONE]\n\n".into());
    sse(events, Duration::from_millis(if mode == "slow" { 200 } else { 1 }), false)
}

use axum::Json;

pub struct Agent {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub gateway: SocketAddr,
    pub metrics: SocketAddr,
    pub db_url: String,
    pub upstream: Upstream,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

/// Catalog: `chat` (ok), `fail`, `break`, `nodone`, `slow`, `hang`, `bad` (upstream answers 400),
/// `big` (answers 200 KiB), `flood` (streams 100 events of 200 KiB at once; plain: 8 MiB),
/// `down` (nothing listens), `one` (ok, max_concurrency 1, queue 0, slow); `svc-chat` is a
/// deprecated name of `chat`.
pub async fn start(extra: &str) -> Agent {
    let (up, upstream) = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    start_in(dir, up, upstream, extra).await
}

/// The repo's TEST worker, built by `cargo build --release` (tests/worker).
pub fn worker_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/gpuhub-test-worker");
    assert!(p.exists(), "{} is missing: run `cargo build --release -p gpuhub-test-worker` first", p.display());
    p
}

/// The account local workers run as in these tests: `nobody` under root (tests/run-all.sh),
/// else the test's own account.
pub fn worker_user() -> String {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if uid == 0 { "nobody".into() } else { gpuhub_agent::control::peer::user_name(uid).unwrap() }
}

pub async fn start_in(dir: tempfile::TempDir, up: SocketAddr, upstream: Upstream, extra: &str) -> Agent {
    // A local worker (running as `worker_user()`) must reach its key file under the workers dir.
    std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
    let d = dir.path().display();
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap(); // closed at once
    let mut models = String::new();
    for m in ["chat", "fail", "break", "nodone", "slow", "hang", "bad", "big", "flood"] {
        models.push_str(&format!(
            "[[models]]\nname = \"{m}\"\nlauncher = \"static\"\nurl = \"http://{up}/{}\"\napi_key = \"worker-secret\"\n",
            if m == "chat" { "ok" } else { m }
        ));
    }
    models.push_str(&format!("[[models]]\nname = \"down\"\nlauncher = \"static\"\nurl = \"http://{dead}/ok\"\n"));
    models.push_str(&format!(
        "[[models]]\nname = \"one\"\nlauncher = \"static\"\nurl = \"http://{up}/slow\"\nmax_concurrency = 1\nqueue_len = 0\n"
    ));
    let text = format!(
        r#"
[paths]
state_dir = "{d}/state"
runtime_dir = "{d}/run"
spool_dir = "{d}/spool"
[telemetry]
enable_nvml = false
enable_slurm = false
[roles]
chat = "chat"
tts = ""
{extra}
{models}
[[names.history]]
name = "svc-chat"
state = "deprecated"
replacement = "chat"
since = "2026-06-17"
sunset = "2026-12-31"
"#
    );
    let config = gpuhub_agent::config::Config::from_toml(&text).unwrap();
    let db_url = config.store_url.clone();
    let socket = dir.path().join("agent.sock");
    let listeners = gpuhub_agent::Listeners {
        gateway: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
        metrics: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        control: gpuhub_agent::control::server::bind(&socket).unwrap(),
    };
    let (gateway, metrics) = (listeners.gateway.as_ref().unwrap().local_addr().unwrap(), listeners.metrics.local_addr().unwrap());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(gpuhub_agent::run(config, listeners, async move {
        let _ = rx.await;
    }));
    let http = reqwest::Client::new();
    let t = Instant::now();
    while http.get(format!("http://{gateway}/healthz")).send().await.is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "agent did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Agent { dir, socket, gateway, metrics, db_url, upstream, stop: Some(stop), task: Some(task) }
}

impl Agent {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.gateway)
    }

    /// Creates an API key through the control socket (the test runs as root: an admin).
    pub async fn key(&self, user: &str, app: &str, models: &[&str]) -> (String, String) {
        let v = client::request(&self.socket, "POST", "/v1/keys", Some(json!({"user": user, "app": app, "models": models}))).await.unwrap();
        (v["key"].as_str().unwrap().to_string(), v["id"].as_str().unwrap().to_string())
    }

    pub async fn control(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, client::ClientError> {
        client::request(&self.socket, method, path, body).await
    }

    pub async fn scrape(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.metrics)).await.unwrap().text().await.unwrap()
    }

    /// Waits (bounded) until the usage log holds `n` rows and returns them, oldest first.
    pub async fn rows(&self, n: usize) -> Vec<Value> {
        let t = Instant::now();
        loop {
            let rows = read_rows(&self.db_url).await;
            if rows.len() >= n {
                return rows;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "expected {n} usage rows, found {}: {rows:#?}", rows.len());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn stop(mut self) -> tempfile::TempDir {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(30), t).await.expect("agent did not stop within 30 s").unwrap().unwrap();
        }
        stop_workers_in(self.dir.path());
        self.dir
    }
}

/// Stops the local workers started under `dir` (their command lines name it: the key file):
/// a local worker outlives its agent by design, so that a restarted agent adopts it, and a test
/// must not leave one running.
pub fn stop_workers_in(dir: &std::path::Path) {
    let needle = dir.to_string_lossy().into_owned();
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(p.path().join("cmdline")) else { continue };
        if pid != std::process::id() && String::from_utf8_lossy(&cmdline).contains(&needle) {
            let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
        }
    }
}

/// Every usage row, as JSON objects.
pub async fn read_rows(db_url: &str) -> Vec<Value> {
    use sqlx::{Column, Row};
    sqlx::any::install_default_drivers();
    let Ok(pool) = sqlx::AnyPool::connect(db_url).await else { return Vec::new() };
    let rows = sqlx::query("SELECT request_id, time_us, user_name, app, job_id, client_addr, user_agent, requested_name, resolved_model, name_state, route, status, error_code, prompt_tokens, completion_tokens, streamed, latency_us, upstream_ttfb_us, overhead_us FROM usage_log ORDER BY time_us")
        .fetch_all(&pool)
        .await
        .unwrap_or_default();
    let out = rows
        .iter()
        .map(|r| {
            let mut o = serde_json::Map::new();
            for (i, c) in r.columns().iter().enumerate() {
                let v = match r.try_get::<i64, _>(i) {
                    Ok(n) => json!(n),
                    Err(_) => match r.try_get::<String, _>(i) {
                        Ok(s) => json!(s),
                        Err(_) => Value::Null,
                    },
                };
                o.insert(c.name().to_string(), v);
            }
            Value::Object(o)
        })
        .collect();
    pool.close().await;
    out
}
