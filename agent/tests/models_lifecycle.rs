//! Model worker lifecycle, in process, with the `local` launcher and the repo's TEST worker
//! (`tests/worker`, built by `cargo build --release -p gpuhub-test-worker`): the same
//! lifecycle code the Slurm launcher runs, minus Slurm.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuhub_agent::config::Config;
use gpuhub_agent::models::{Catalog, ManagerDeps, ModelError, ModelManager};
use gpuhub_agent::store::Store;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

fn worker_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/release/gpuhub-test-worker");
    assert!(p.exists(), "{} is missing: run `cargo build --release -p gpuhub-test-worker` first", p.display());
    p
}

struct Env {
    dir: tempfile::TempDir,
    store: Store,
}

impl Env {
    async fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}", dir.path().join("t.db").display()), None).await.unwrap();
        Env { dir, store }
    }

    /// A model entry running the test worker with `flags`.
    fn model(&self, name: &str, flags: &str, extra: &str) -> String {
        format!(
            "[[models]]\nname = \"{name}\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --version {{version}} --host {{host}} --port {{port}} --api-key {{api_key}} {flags}\"\n{extra}\n",
            worker_bin().display()
        )
    }

    async fn manager(&self, workers: &str, models: &str) -> (ModelManager, Registry, CancellationToken, TaskTracker) {
        let d = self.dir.path().display();
        let text = format!(
            "[paths]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\nspool_dir = \"{d}/spool\"\n[workers]\ndir = \"{d}/workers\"\nbackoff_s = 1\n{workers}\n{models}"
        );
        let config = Config::from_toml(&text).unwrap();
        let mut registry = Registry::default();
        let (token, tasks) = (CancellationToken::new(), TaskTracker::new());
        let catalog = Arc::new(Catalog::from_config(&config.file));
        let deps = ManagerDeps {
            config: &config,
            store: Some(self.store.clone()),
            registry: &mut registry,
            gpus: Box::new(Vec::new),
            tasks: tasks.clone(),
            shutdown: token.clone(),
        };
        let m = ModelManager::start(catalog, deps).await;
        (m, registry, token, tasks)
    }
}

fn metrics_text(r: &Registry) -> String {
    let mut s = String::new();
    prometheus_client::encoding::text::encode(&mut s, r).unwrap();
    s
}

fn pid_alive(pid: &str) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    !stat.rsplit_once(')').map(|(_, r)| r.trim_start().starts_with('Z')).unwrap_or(true)
}

async fn wait_state(m: &ModelManager, model: &str, state: &str, within: Duration) {
    let t = Instant::now();
    while t.elapsed() < within {
        if m.status(model).unwrap().state == state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{model} did not become {state} within {within:?}; status: {:?}", m.status(model));
}

async fn chat(lease: &gpuhub_agent::models::Lease, key: Option<&str>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", lease.base_url))
        .json(&serde_json::json!({"model": lease.model, "messages": [{"role": "user", "content": "hi"}]}));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_first_calls_start_one_worker_that_answers_with_its_own_key() {
    let env = Env::new().await;
    let (m, reg, _t, _tasks) = env.manager("", &env.model("a", "--startup-delay-ms 300", "")).await;
    let m = Arc::new(m);
    let calls: Vec<_> = (0..50)
        .map(|_| {
            let m = m.clone();
            // Each call ends right away (max_concurrency 16 < 50: held leases would queue the rest).
            tokio::spawn(async move { m.acquire("a").await.map(|l| l.base_url.clone()) })
        })
        .collect();
    let mut urls = std::collections::BTreeSet::new();
    for c in calls {
        urls.insert(c.await.unwrap().expect("every first call gets the model"));
    }
    let leases = vec![m.acquire("a").await.unwrap()];
    assert_eq!(urls.len(), 1, "one worker for 50 first calls: {urls:?}");
    let st = m.status("a").unwrap();
    assert_eq!(st.state, "ready");
    let text = metrics_text(&reg);
    assert!(text.contains(r#"gpuhub_model_transitions_total{model="a",from="unloaded",to="starting"} 1"#), "{text}");
    assert!(text.contains(r#"gpuhub_model_state{model="a",state="ready"} 1"#), "{text}");
    assert!(text.contains(r#"gpuhub_model_load_duration_seconds_count{model="a"} 1"#), "{text}");

    // The worker answers with the per-worker key the agent generated, and only with it.
    let key = leases[0].api_key.clone().unwrap();
    assert!(key.len() >= 64, "a generated key: {key}");
    assert_eq!(chat(&leases[0], Some(&key)).await.status(), 200);
    assert_eq!(chat(&leases[0], None).await.status(), 401, "a caller without the key cannot bypass the gateway");
    drop(leases);
    assert!(m.unload("a", "test over").await.unwrap());
    assert_eq!(m.status("a").unwrap().state, "unloaded");
    assert!(!pid_alive(st.worker_id.as_deref().unwrap()), "the worker process is gone after unload");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_is_noticed_within_a_few_ms_of_the_worker_listening() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "--startup-delay-ms 400", "")).await;
    let lease = m.acquire("a").await.unwrap();
    let got_us = gpuhub_agent::util::now_us();
    let log = std::fs::read_dir(env.dir.path().join("workers"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "log"))
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let line = text.lines().find(|l| l.contains("listening on") && l.contains("at_us=")).expect("worker logged its address");
    let listen_us: i64 = line.split("at_us=").nth(1).unwrap().split_whitespace().next().unwrap().parse().unwrap();
    let lag_ms = (got_us - listen_us) as f64 / 1000.0;
    assert!(lag_ms < 40.0, "from the worker listening to the lease took {lag_ms:.1} ms (polling back-off caps at 10 ms)");
    drop(lease);
    m.unload("a", "test over").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_gets_overloaded_with_retry_after_and_other_models_are_not_blocked() {
    let env = Env::new().await;
    let models = env.model("slow", "--startup-delay-ms 1500", "max_concurrency = 1\nqueue_len = 2") + &env.model("fast", "", "");
    let (m, _reg, _t, _tasks) = env.manager("", &models).await;
    let m = Arc::new(m);
    let calls: Vec<_> = (0..5)
        .map(|_| {
            let m = m.clone();
            tokio::spawn(async move {
                let lease = m.acquire("slow").await?;
                tokio::time::sleep(Duration::from_millis(50)).await;
                drop(lease);
                Ok::<(), ModelError>(())
            })
        })
        .collect();
    // While `slow` loads, `fast` loads and answers.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t = Instant::now();
    let fast = m.acquire("fast").await.unwrap();
    assert!(t.elapsed() < Duration::from_millis(1200), "a loading model must not block another: {:?}", t.elapsed());
    drop(fast);
    let mut ok = 0;
    let mut overloaded = 0;
    for c in calls {
        match c.await.unwrap() {
            Ok(_) => ok += 1,
            Err(ModelError::Overloaded { retry_after_s, .. }) => {
                assert!(retry_after_s >= 1);
                overloaded += 1;
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!((ok, overloaded), (3, 2), "max_concurrency 1 + queue 2 admits 3 of 5");
    m.unload("slow", "test over").await.unwrap();
    m.unload("fast", "test over").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_workers_unload_after_idle_timeout_but_not_with_a_call_in_flight() {
    let env = Env::new().await;
    let (m, reg, _t, _tasks) = env.manager("", &env.model("a", "", "idle_timeout_s = 1")).await;
    let lease = m.acquire("a").await.unwrap();
    let pid = m.status("a").unwrap().worker_id.unwrap();
    tokio::time::sleep(Duration::from_millis(1800)).await;
    assert_eq!(m.status("a").unwrap().state, "ready", "a call in flight keeps the worker");
    drop(lease);
    wait_state(&m, "a", "unloaded", Duration::from_secs(4)).await;
    assert!(m.status("a").unwrap().detail.unwrap().contains("idle"), "says why");
    assert!(!pid_alive(&pid));
    let text = metrics_text(&reg);
    assert!(text.contains(r#"gpuhub_model_transitions_total{model="a",from="ready",to="draining"} 1"#), "{text}");
    assert!(text.contains(r#"gpuhub_model_transitions_total{model="a",from="draining",to="unloaded"} 1"#), "{text}");
    // The next call loads it again.
    let lease = m.acquire("a").await.unwrap();
    assert_ne!(m.status("a").unwrap().worker_id.unwrap(), pid);
    drop(lease);
    m.unload("a", "test over").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_restarts_on_the_next_call_and_repeated_crashes_surface_as_failed() {
    let env = Env::new().await;
    let (m, reg, _t, _tasks) = env.manager("max_restarts = 2", &env.model("a", "--crash-after 0", "")).await;
    let lease = m.acquire("a").await.unwrap();
    let key = lease.api_key.clone();
    let first = m.status("a").unwrap().worker_id.unwrap();
    assert!(
        reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", lease.base_url))
            .bearer_auth(key.unwrap())
            .json(&serde_json::json!({"model": "a"}))
            .send()
            .await
            .is_err(),
        "the in-flight call gets an error"
    );
    drop(lease);
    wait_state(&m, "a", "unloaded", Duration::from_secs(3)).await;
    assert!(m.status("a").unwrap().detail.unwrap().contains("crashed"));
    let lease = m.acquire("a").await.unwrap();
    assert_ne!(m.status("a").unwrap().worker_id.unwrap(), first, "restarted");
    let crash = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", lease.base_url))
        .bearer_auth(lease.api_key.clone().unwrap())
        .json(&serde_json::json!({"model": "a"}))
        .send()
        .await;
    assert!(crash.is_err(), "the restarted worker crashes on its first call too");
    drop(lease);
    wait_state(&m, "a", "failed", Duration::from_secs(3)).await;
    let st = m.status("a").unwrap();
    assert!(st.log_tail.iter().any(|l| l.contains("CRASH")), "failed shows the log: {:?}", st.log_tail);
    match m.acquire("a").await {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(reason.contains("crashed 2 times") && reason.contains("retries in"), "{reason}")
        }
        other => panic!("expected a back-off refusal, got {other:?}"),
    }
    assert!(metrics_text(&reg).contains(r#"gpuhub_model_state{model="a",state="failed"} 1"#));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_start_fails_with_its_last_log_lines() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "--exit-at-start 7", "")).await;
    match m.acquire("a").await {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(reason.contains("ended before it was ready") && reason.contains("cannot load weights"), "{reason}")
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let st = m.status("a").unwrap();
    assert_eq!(st.state, "failed");
    assert!(st.log_tail.iter().any(|l| l.contains("cannot load weights")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_gets_healthy_times_out_and_is_stopped() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "--ready-delay-ms 60000", "load_timeout_s = 1")).await;
    match m.acquire("a").await {
        Err(ModelError::LoadTimeout { seconds: 1, .. }) | Err(ModelError::Unavailable { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
    wait_state(&m, "a", "failed", Duration::from_secs(15)).await;
    assert!(m.status("a").unwrap().detail.unwrap().contains("load_timeout_s"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_evicts_idle_models_lru_first_then_refuses_naming_the_holder() {
    let env = Env::new().await;
    let vram = |g: f64| format!("resources = {{ vram_gib = {g} }}");
    let models = env.model("a", "", &vram(4.0))
        + &env.model("b", "", &vram(4.0))
        + &env.model("c", "", &vram(5.0))
        + &env.model("big", "", &vram(9.0));
    let (m, reg, _t, _tasks) = env.manager("vram_gib = 10", &models).await;
    drop(m.acquire("a").await.unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(m.acquire("b").await.unwrap());
    // c (5) does not fit next to a+b (8 of 10): a is least recently used, so a goes.
    let c = m.acquire("c").await.unwrap();
    assert_eq!(m.status("a").unwrap().state, "unloaded");
    assert!(m.status("a").unwrap().detail.unwrap().contains("evicted to make room for `c`"));
    assert_eq!(m.status("b").unwrap().state, "ready", "b was used more recently and c fits without evicting it");
    // big (9) cannot fit while c has a call in flight: b is evicted, then a clear refusal.
    match m.acquire("big").await {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(
                reason.contains("needs 9.0 GiB") && reason.contains("model `c` (pid ") && reason.contains("1 calls in flight"),
                "{reason}"
            )
        }
        other => panic!("expected a 503 naming the holder, got {other:?}"),
    }
    assert_eq!(m.status("b").unwrap().state, "unloaded");
    assert_eq!(m.status("big").unwrap().state, "unloaded", "no room is not a failure of big");
    let text = metrics_text(&reg);
    assert!(text.contains(r#"gpuhub_model_evictions_total{model="a"} 1"#), "{text}");
    drop(c);
    // Once c is idle, big evicts it and starts.
    drop(m.acquire("big").await.unwrap());
    assert_eq!(m.status("c").unwrap().state, "unloaded");
    m.unload("big", "test over").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_running_workers_instead_of_starting_new_ones() {
    let env = Env::new().await;
    let model = env.model("a", "", "");
    let (m1, _reg, token, _tasks) = env.manager("", &model).await;
    let lease = m1.acquire("a").await.unwrap();
    let (url, pid) = (lease.base_url.clone(), m1.status("a").unwrap().worker_id.unwrap());
    drop(lease);
    // The agent dies (its tasks stop; the worker keeps running, as after kill -9).
    token.cancel();
    drop(m1);
    assert!(pid_alive(&pid));
    let (m2, _reg, _t, _tasks) = env.manager("", &model).await;
    assert_ne!(m2.status("a").unwrap().state, "unloaded", "adoption is decided before the first call");
    let lease = m2.acquire("a").await.unwrap();
    assert_eq!(
        (lease.base_url.as_str(), m2.status("a").unwrap().worker_id.unwrap()),
        (url.as_str(), pid.clone()),
        "the same worker, adopted"
    );
    assert_eq!(chat(&lease, lease.api_key.as_deref()).await.status(), 200, "the adopted worker's key was remembered");
    drop(lease);
    m2.unload("a", "test over").await.unwrap();
    assert!(!pid_alive(&pid));
    assert!(env.store.workers().await.unwrap().is_empty(), "an unloaded worker is forgotten");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_worker_that_died_is_forgotten_not_adopted() {
    let env = Env::new().await;
    let model = env.model("a", "", "");
    let (m1, _reg, token, _tasks) = env.manager("", &model).await;
    drop(m1.acquire("a").await.unwrap());
    let pid = m1.status("a").unwrap().worker_id.unwrap();
    token.cancel();
    drop(m1);
    // SAFETY: test-only; kills the worker we started.
    unsafe { libc::kill(pid.parse().unwrap(), libc::SIGKILL) };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (m2, _reg, _t, _tasks) = env.manager("", &model).await;
    assert_eq!(m2.status("a").unwrap().state, "unloaded");
    assert!(env.store.workers().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquiring_a_ready_model_costs_microseconds() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "", "")).await;
    drop(m.acquire("a").await.unwrap());
    let n = 20_000u32;
    let t = Instant::now();
    for _ in 0..n {
        drop(m.acquire("a").await.unwrap());
    }
    let per = t.elapsed() / n;
    eprintln!("warm path: acquire + drop of a ready model takes {per:?}");
    assert!(per < Duration::from_micros(20), "the warm path must stay cheap: {per:?} per call");
    m.unload("a", "test over").await.unwrap();
}
