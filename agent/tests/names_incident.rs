//! The incident gpuhub exists to prevent, replayed in process: an app calls `svc-ocr`
//! through the gateway; an admin renames it to `dots.ocr` with a sunset; the app keeps
//! working and gets Deprecation/Sunset/Link headers; `callers` names the app and its user;
//! retiring is refused while the app still calls, then forced; the app gets an error that
//! says what happened; the OCR role (and so the snapshot jobs read) moves to `dots.ocr`; the
//! metrics show every step. The upstream is a static axum server on 127.0.0.1:0, so this runs
//! without Slurm (tests/system/names-incident.sh replays it on the lab with real jobs).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use axum::Json;
use axum::routing::post;
use gpuhub_agent::control::client::{self, ClientError};
use serde_json::{Value, json};

/// A fake OpenAI upstream that, like vLLM with `--served-model-name dots.ocr`, answers only
/// to its own name: the gateway must send the resolved model, not the name the client used.
async fn upstream() -> SocketAddr {
    let app = axum::Router::new().route(
        "/v1/chat/completions",
        post(|Json(body): Json<Value>| async move {
            if body["model"] != "dots.ocr" {
                let msg = format!("The model `{}` does not exist (this worker serves `dots.ocr`).", body["model"].as_str().unwrap_or("?"));
                return (
                    axum::http::StatusCode::NOT_FOUND,
                    Json(json!({"error": {"message": msg, "type": "invalid_request_error", "code": "model_not_found"}})),
                );
            }
            (
                axum::http::StatusCode::OK,
                Json(json!({
                    "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ocr text"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
                })),
            )
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    addr
}

struct Agent {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    snapshot: PathBuf,
    gateway: SocketAddr,
    metrics: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Agent {
    async fn start(extra: &str) -> Agent {
        let up = upstream().await;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
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
ocr = "svc-ocr"
tts = ""
[[models]]
name = "dots.ocr"
aliases = ["svc-ocr"]
launcher = "static"
url = "http://{up}"
{extra}
"#
        );
        let config = gpuhub_agent::config::Config::from_toml(&text).unwrap();
        let socket = dir.path().join("agent.sock");
        let snapshot = config.snapshot_path.clone();
        let listeners = gpuhub_agent::Listeners {
            gateway: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
            metrics: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            control: gpuhub_agent::control::server::bind(&socket).unwrap(),
        };
        let (gateway, metrics) = (listeners.gateway.as_ref().unwrap().local_addr().unwrap(), listeners.metrics.local_addr().unwrap());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gpuhub_agent::run(config, listeners, async move {
            let _ = rx.await;
        }));
        let agent = Agent { _dir: dir, socket, snapshot, gateway, metrics, stop: Some(tx), task };
        let t = Instant::now();
        while client::request(&agent.socket, "GET", "/v1/whoami", None).await.is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "the agent did not start within 20 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        agent
    }

    async fn api(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, ClientError> {
        client::request(&self.socket, method, path, body).await
    }

    async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        tokio::time::timeout(Duration::from_secs(20), self.task).await.expect("agent stops within 20 s").unwrap().unwrap();
    }

    async fn metrics_text(&self) -> String {
        reqwest::get(format!("http://{}/metrics", self.metrics)).await.unwrap().text().await.unwrap()
    }

    fn snapshot_roles(&self) -> Value {
        let snap: Value = serde_json::from_slice(&std::fs::read(&self.snapshot).unwrap()).unwrap();
        snap["roles"].clone()
    }

    /// `callers` of `name`, read once: a report counts every call the gateway has answered
    /// (it waits for the usage writer), so none of these polls.
    async fn callers(&self, name: &str) -> Value {
        self.api("POST", "/v1/names/callers", Some(json!({"name": name, "since_s": 86_400}))).await.unwrap()
    }
}

async fn call(gw: SocketAddr, key: &str, model: &str) -> (u16, reqwest::header::HeaderMap, Value) {
    let resp = reqwest::Client::new()
        .post(format!("http://{gw}/v1/chat/completions"))
        .bearer_auth(key)
        .header("user-agent", "ocr-app/1.0")
        .json(&json!({"model": model, "messages": [{"role": "user", "content": "scan"}]}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    (status, headers, body)
}

fn date_in(days: i64) -> String {
    let today = gpuhub_agent::names::days_from_civil(&gpuhub_agent::names::today()).unwrap();
    gpuhub_agent::names::civil_from_days(today + days)
}

fn series(text: &str, state: &str, name: &str) -> u64 {
    let prefix = format!("gpuhub_gateway_name_calls_total{{state=\"{state}\",name=\"{name}\",user=\"alice\",app=\"ocr-app\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.trim().parse().unwrap()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_incident_replayed_through_the_gateway() {
    let agent = Agent::start("").await;
    let key =
        agent.api("POST", "/v1/keys", Some(json!({"user": "alice", "app": "ocr-app"}))).await.unwrap()["key"].as_str().unwrap().to_string();

    // 1. Before: the app calls svc-ocr, an active alias; jobs get OCR_MODEL=svc-ocr.
    let (status, headers, body) = call(agent.gateway, &key, "svc-ocr").await;
    assert_eq!(status, 200, "{body}");
    assert!(headers.get("deprecation").is_none());
    assert_eq!(agent.snapshot_roles()["ocr"], "svc-ocr");

    // 2. Preflight, right after that call: a dry run names the app and its user and changes
    // nothing.
    let sunset = date_in(30);
    let dry = agent
        .api("POST", "/v1/names/rename", Some(json!({"name": "svc-ocr", "to": "dots.ocr", "sunset": sunset, "dry_run": true})))
        .await
        .unwrap();
    assert_eq!((dry["applied"].as_bool(), dry["refused"].as_bool()), (Some(false), Some(false)), "{dry}");
    assert_eq!(dry["callers"]["users"], json!(["alice"]), "{dry}");
    assert_eq!(dry["callers"]["apps"], json!(["ocr-app"]), "{dry}");
    let (_, headers, _) = call(agent.gateway, &key, "svc-ocr").await;
    assert!(headers.get("deprecation").is_none(), "a dry run changed nothing");

    // 3. The rename: the app keeps working, with Deprecation, Sunset and Link headers.
    let done = agent.api("POST", "/v1/names/rename", Some(json!({"name": "svc-ocr", "to": "dots.ocr", "sunset": sunset}))).await.unwrap();
    assert_eq!(done["applied"], true, "{done}");
    let (status, headers, body) = call(agent.gateway, &key, "svc-ocr").await;
    assert_eq!(status, 200, "{body}");
    let h = |k: &str| headers.get(k).map(|v| v.to_str().unwrap().to_string()).unwrap_or_default();
    assert!(h("deprecation").starts_with('@'), "{headers:?}");
    assert!(h("sunset").ends_with("00:00:00 GMT") && h("sunset").contains(&sunset[0..4]), "{headers:?}");
    assert!(h("link").contains("</v1/models/dots.ocr>"), "{headers:?}");
    // The role moved: a job started now gets OCR_MODEL=dots.ocr.
    assert_eq!(agent.snapshot_roles()["ocr"], "dots.ocr");
    let env = agent.api("GET", "/v1/env", None).await.unwrap();
    assert_eq!(env["OCR_MODEL"], "dots.ocr", "{env}");

    // 4. Who still calls the old name: the app and its user, with the user agent.
    let callers = agent.callers("svc-ocr").await;
    assert_eq!(callers["report"]["calls"], 3, "every call so far, the last one a moment ago: {callers}");
    let first = &callers["report"]["callers"][0];
    assert_eq!(
        (first["user_name"].as_str(), first["app"].as_str(), first["user_agent"].as_str()),
        (Some("alice"), Some("ocr-app"), Some("ocr-app/1.0")),
        "{callers}"
    );
    assert_eq!(callers["state"], "deprecated");

    // 5. Retiring is refused while the app calls (and before the sunset), then forced.
    let refused = agent.api("POST", "/v1/names/retire", Some(json!({"name": "svc-ocr"}))).await.unwrap();
    assert_eq!((refused["applied"].as_bool(), refused["refused"].as_bool()), (Some(false), Some(true)), "{refused}");
    assert!(refused["plan"]["needs_force"][0].as_str().unwrap().contains("alice"), "{refused}");
    let (status, _, _) = call(agent.gateway, &key, "svc-ocr").await;
    assert_eq!(status, 200, "a refused retire changed nothing");
    let forced = agent.api("POST", "/v1/names/retire", Some(json!({"name": "svc-ocr", "force": true}))).await.unwrap();
    assert_eq!(forced["applied"], true, "{forced}");

    // 6. After: the app gets the self-explaining error.
    let (status, _, body) = call(agent.gateway, &key, "svc-ocr").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    let today = gpuhub_agent::names::today();
    assert_eq!(
        body["error"]["message"],
        format!("model `svc-ocr` was renamed to `dots.ocr` on {today}; set OCR_MODEL or use `dots.ocr`"),
        "{body}"
    );
    let (status, _, _) = call(agent.gateway, &key, "dots.ocr").await;
    assert_eq!(status, 200);

    // 7. The history says who did what (the metrics: `every_step_shows_in_the_name_metrics`).
    let hist = agent.api("POST", "/v1/names/history", Some(json!({"name": "svc-ocr"}))).await.unwrap();
    let actions: Vec<&str> = hist["history"].as_array().unwrap().iter().map(|h| h["action"].as_str().unwrap()).collect();
    assert_eq!(actions, vec!["retire", "rename"], "{hist}");
    assert!(hist["history"][0]["note"].as_str().unwrap().starts_with("forced: "), "{hist}");

    // 8. Undo: restore serves the name again without headers.
    let restored = agent.api("POST", "/v1/names/restore", Some(json!({"name": "svc-ocr"}))).await.unwrap();
    assert_eq!(restored["applied"], true, "{restored}");
    let (status, headers, _) = call(agent.gateway, &key, "svc-ocr").await;
    assert_eq!(status, 200);
    assert!(headers.get("deprecation").is_none());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_step_shows_in_the_name_metrics() {
    let agent = Agent::start("").await;
    let key =
        agent.api("POST", "/v1/keys", Some(json!({"user": "alice", "app": "ocr-app"}))).await.unwrap()["key"].as_str().unwrap().to_string();
    assert_eq!(call(agent.gateway, &key, "svc-ocr").await.0, 200);
    let r = agent.api("POST", "/v1/names/rename", Some(json!({"name": "svc-ocr", "to": "dots.ocr", "sunset": date_in(30)}))).await.unwrap();
    assert_eq!(r["applied"], true, "{r}");
    let text = agent.metrics_text().await;
    assert!(
        text.contains(&format!(
            "gpuhub_name_sunset_timestamp_seconds{{name=\"svc-ocr\",replacement=\"dots.ocr\"}} {}",
            gpuhub_agent::names::days_from_civil(&date_in(30)).unwrap() * 86_400
        )),
        "{text}"
    );
    assert_eq!(call(agent.gateway, &key, "svc-ocr").await.0, 200);
    agent.api("POST", "/v1/names/retire", Some(json!({"name": "svc-ocr", "force": true}))).await.unwrap();
    assert_eq!(call(agent.gateway, &key, "svc-ocr").await.0, 404);
    assert_eq!(call(agent.gateway, &key, "svc-ocrr").await.0, 404);
    assert_eq!(call(agent.gateway, &key, "tts").await.0, 503);
    let text = agent.metrics_text().await;
    assert!(!text.contains("gpuhub_name_sunset_timestamp_seconds{name=\"svc-ocr\""), "a retired name keeps no sunset series");
    let got = [("active", "svc-ocr"), ("deprecated", "svc-ocr"), ("retired", "svc-ocr"), ("unknown", "svc-ocrr"), ("unassigned", "tts")]
        .map(|(st, n)| series(&text, st, n));
    assert_eq!(
        got,
        [1, 1, 1, 1, 1],
        "gpuhub_gateway_name_calls_total per state; all zero means the gateway does not count name calls \
         (it must call `state.names.count_row(&row)` once per call, e.g. in `gateway::proxy::Call::record`):\n{}",
        text.lines().filter(|l| l.contains("name_calls")).collect::<Vec<_>>().join("\n")
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_with_a_clear_message() {
    let agent = Agent::start("[[models]]\nname = \"demo-chat\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n").await;
    let expect_err = |r: Result<Value, ClientError>, status: u16, want: &str| match r {
        Err(ClientError::Api { status: s, message }) => {
            assert_eq!(s, status, "{message}");
            assert!(message.contains(want), "{message:?} should contain {want:?}");
        }
        other => panic!("expected HTTP {status} containing {want:?}, got {other:?}"),
    };
    let rename = |name: &str, to: &str, sunset: Option<&str>| json!({"name": name, "to": to, "sunset": sunset});
    // Renaming onto a name that serves another model.
    let r = agent.api("POST", "/v1/names/rename", Some(rename("svc-ocr", "demo-chat", None))).await.unwrap();
    assert_eq!(r["refused"], true, "{r}");
    assert!(r["plan"]["needs_force"][0].as_str().unwrap().contains("already exists and serves model `demo-chat`"), "{r}");
    // A cycle: a -> b, then b -> a.
    agent.api("POST", "/v1/names/rename", Some(rename("svc-ocr", "dots.ocr", None))).await.unwrap();
    expect_err(agent.api("POST", "/v1/names/rename", Some(rename("dots.ocr", "svc-ocr", None))).await, 422, "would make a cycle");
    // Odd characters.
    expect_err(agent.api("POST", "/v1/names/rename", Some(rename("svc ocr", "dots.ocr", None))).await, 422, "contains a space");
    expect_err(agent.api("POST", "/v1/names/rename", Some(rename("dots.ocr", "dоts.ocr", None))).await, 422, "not ASCII");
    // A sunset in the past, and a date that is not one.
    expect_err(
        agent.api("POST", "/v1/names/rename", Some(rename("demo-chat", "dots.ocr", Some("2020-01-01")))).await,
        422,
        "not in the future",
    );
    expect_err(
        agent.api("POST", "/v1/names/deprecate", Some(json!({"name": "svc-ocr", "sunset": "31/12/2026"}))).await,
        422,
        "use YYYY-MM-DD",
    );
    // Unknown names get "did you mean".
    expect_err(agent.api("POST", "/v1/names/retire", Some(json!({"name": "dots-ocr"}))).await, 404, "did you mean `dots.ocr`");
    // Roles: only served, current names.
    expect_err(agent.api("POST", "/v1/roles/set", Some(json!({"name": "ocr", "to": "svc-ocr"}))).await, 422, "assign `dots.ocr`");
    // Nothing above changed the registry except the one rename.
    let hist = agent.api("POST", "/v1/names/history", Some(json!({}))).await.unwrap();
    let changes: Vec<_> = hist["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|h| h["actor"] != "agent.toml")
        .map(|h| h["action"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(changes, vec!["role-set", "rename"], "{hist}");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_a_model_answers_503_and_role_changes_rewrite_the_snapshot() {
    let agent = Agent::start("").await;
    let key =
        agent.api("POST", "/v1/keys", Some(json!({"user": "alice", "app": "ocr-app"}))).await.unwrap()["key"].as_str().unwrap().to_string();
    let (status, _, body) = call(agent.gateway, &key, "tts").await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "role_unassigned", "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("role `tts` has no model assigned"), "{body}");
    assert_eq!(agent.snapshot_roles()["tts"], Value::Null);
    let before = std::fs::metadata(&agent.snapshot).unwrap().modified().unwrap();
    let set = agent.api("POST", "/v1/roles/set", Some(json!({"name": "tts", "to": "dots.ocr"}))).await.unwrap();
    assert_eq!(set["applied"], true, "{set}");
    assert_eq!(agent.snapshot_roles()["tts"], "dots.ocr");
    assert!(std::fs::metadata(&agent.snapshot).unwrap().modified().unwrap() >= before);
    let (status, _, _) = call(agent.gateway, &key, "tts").await;
    assert_eq!(status, 200, "a role name serves the role's model");
    agent.api("POST", "/v1/roles/unset", Some(json!({"name": "tts"}))).await.unwrap();
    assert_eq!(agent.snapshot_roles()["tts"], Value::Null);
    // A name nobody configured but a client calls shows in `names list` as unknown, with its
    // calls: the silent 404 made visible.
    let (status, _, body) = call(agent.gateway, &key, "svc-tts").await;
    assert_eq!(status, 404, "{body}");
    let list = agent.api("GET", "/v1/names", None).await.unwrap();
    let e = list["names"].as_array().unwrap().iter().find(|n| n["name"] == "svc-tts").cloned().unwrap_or_default();
    assert_eq!((e["state"].as_str(), e["calls"].as_i64(), e["refused"].as_i64()), (Some("unknown"), Some(1), Some(1)), "{list}");
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_apply_once_and_the_store_stays_the_truth_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("names.db");
    let seed = format!(
        "[store]\nurl = \"sqlite://{}\"\n[[names.history]]\nname = \"old-ocr\"\nstate = \"deprecated\"\nreplacement = \"dots.ocr\"\nsince = \"2026-06-17\"\nsunset = \"2099-12-31\"\n",
        db.display()
    );
    let a = Agent::start(&seed).await;
    let list = a.api("GET", "/v1/names", None).await.unwrap();
    let old = list["names"].as_array().unwrap().iter().find(|n| n["name"] == "old-ocr").unwrap().clone();
    assert_eq!(old["state"], "deprecated", "{list}");
    a.api("POST", "/v1/names/restore", Some(json!({"name": "old-ocr"}))).await.unwrap();
    a.stop().await;
    // Restart on the same store: the seed is not applied again; the restore stands.
    let b = Agent::start(&seed).await;
    let list = b.api("GET", "/v1/names", None).await.unwrap();
    let old = list["names"].as_array().unwrap().iter().find(|n| n["name"] == "old-ocr").unwrap().clone();
    assert_eq!(old["state"], "active", "{list}");
    let hist = b.api("POST", "/v1/names/history", Some(json!({"name": "old-ocr"}))).await.unwrap();
    assert_eq!(hist["history"].as_array().unwrap().len(), 2, "one seed, one restore: {hist}");
    b.stop().await;
    let _ = Path::new(&db);
}
