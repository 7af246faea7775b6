//! Model worker lifecycle, in process, with the `local` launcher and the repo's TEST worker
//! (`tests/worker`, built by `cargo build --release -p gpuhub-test-worker`): the same
//! lifecycle code the Slurm launcher runs, minus Slurm.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuhub_agent::config::Config;
use gpuhub_agent::models::{Catalog, ManagerDeps, ModelError, ModelManager};
use gpuhub_agent::store::Store;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

fn uid_of(name: &str) -> u32 {
    passwd_id(name, 0)
}

fn gid_of(name: &str) -> u32 {
    passwd_id(name, 1)
}

/// Field `i` after `name:x:` in /etc/passwd (0: uid, 1: gid).
fn passwd_id(name: &str, i: usize) -> u32 {
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap();
    passwd.lines().find_map(|l| l.strip_prefix(&format!("{name}:x:"))?.split(':').nth(i)?.parse().ok()).unwrap()
}

struct Env {
    dir: tempfile::TempDir,
    store: Store,
}

impl Drop for Env {
    fn drop(&mut self) {
        gateway_support::stop_workers_in(self.dir.path());
    }
}

impl Env {
    async fn new() -> Env {
        let dir = tempfile::tempdir().unwrap();
        // The worker account must reach its key file under the workers dir.
        std::fs::set_permissions(dir.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711)).unwrap();
        let store = Store::open(&format!("sqlite://{}", dir.path().join("t.db").display()), None).await.unwrap();
        Env { dir, store }
    }

    /// A model entry running the test worker with `flags`.
    fn model(&self, name: &str, flags: &str, extra: &str) -> String {
        format!(
            "[[models]]\nname = \"{name}\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --version {{version}} --host {{host}} --port {{port}} --api-key-file {{api_key_file}} {flags}\"\n{extra}\n",
            gateway_support::worker_bin().display()
        )
    }

    /// The test agent's config: its dirs, `[workers]` (with `workers`: more keys, or further
    /// sections) and `models`.
    fn config(&self, workers: &str, models: &str) -> Config {
        let d = self.dir.path().display();
        let text = format!(
            "[paths]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\nspool_dir = \"{d}/spool\"\n[workers]\ndir = \"{d}/workers\"\nuser = \"{}\"\nbackoff_s = 1\n{workers}\n{models}",
            gateway_support::worker_user()
        );
        Config::from_toml(&text).unwrap()
    }

    async fn manager(&self, workers: &str, models: &str) -> (ModelManager, Registry, CancellationToken, TaskTracker) {
        let config = self.config(workers, models);
        let catalog = Catalog::from_config(&config.file);
        self.manager_on(&config, catalog).await
    }

    /// A manager of `config` whose first catalog is `catalog`.
    async fn manager_on(&self, config: &Config, catalog: Catalog) -> (ModelManager, Registry, CancellationToken, TaskTracker) {
        let mut registry = Registry::default();
        let (token, tasks) = (CancellationToken::new(), TaskTracker::new());
        let catalog = Arc::new(catalog);
        let deps = ManagerDeps {
            config,
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
    // Probes every 10 ms at most (lifecycle's own test of the back-off); the bound leaves a
    // loaded host room and still fails a probe interval of a quarter second.
    assert!(lag_ms < 250.0, "from the worker listening to the lease took {lag_ms:.1} ms (polling back-off caps at 10 ms)");
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
async fn a_call_that_cannot_reach_its_only_worker_learns_at_once_whether_it_is_gone() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "", "")).await;
    let lease = m.acquire("a").await.unwrap();
    let first = m.status("a").unwrap().worker_id.unwrap();
    // Not asked: nothing to wait for.
    assert!(!m.worker_gone(&lease, Duration::from_secs(5)).await);
    // A worker that still holds its port: the supervisor's check says so, well within the bound.
    let t = Instant::now();
    lease.upstream_failed();
    assert!(!m.worker_gone(&lease, Duration::from_secs(5)).await, "the worker is alive");
    assert!(t.elapsed() < Duration::from_secs(2), "the verdict came from the check, not the bound: {:?}", t.elapsed());
    assert_eq!(m.status("a").unwrap().state, "ready");
    // Killed between calls: gone, and the next lease is a new worker that answers.
    // SAFETY: test-only; kills the worker we started.
    unsafe { libc::kill(first.parse().unwrap(), libc::SIGKILL) };
    // As a call finds it: its port closed. (Not "its pid is a zombie": a multi-threaded
    // process shows Z while its other threads still exit, holding its sockets.)
    let port = lease.base_url.rsplit_once(':').unwrap().1.parse::<u16>().unwrap();
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() && t.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    lease.upstream_failed();
    assert!(m.worker_gone(&lease, Duration::from_secs(5)).await, "the worker was killed");
    drop(lease);
    let lease = m.acquire("a").await.unwrap();
    assert_ne!(m.status("a").unwrap().worker_id.unwrap(), first, "a new worker");
    assert_eq!(chat(&lease, lease.api_key.as_deref()).await.status(), 200);
    drop(lease);
    m.unload("a", "test over").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_cannot_start_fails_with_its_last_log_lines() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "--exit-at-start 7", "")).await;
    match m.acquire("a").await {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(reason.contains("ended before it was ready"), "{reason}");
            // The caller gets the reason in one line; the log (which can hold other callers'
            // prompts) is for admins, through `gpuhub models`.
            assert!(!reason.contains("cannot load weights") && !reason.contains('\n'), "{reason}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    let st = m.status("a").unwrap();
    assert_eq!(st.state, "failed");
    assert!(st.log_tail.iter().any(|l| l.contains("cannot load weights")));
    match m.acquire("a").await {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(reason.contains("retries in") && !reason.contains("cannot load weights"), "{reason}")
        }
        other => panic!("expected the back-off refusal, got {other:?}"),
    }
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

/// Eviction picks the least recently used model counting calls through other gateways (a
/// borrowing gateway records them in the store): a model used there just now is not evicted
/// before one nobody has called for longer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_counts_use_through_other_gateways() {
    let env = Env::new().await;
    let vram = |g: f64| format!("resources = {{ vram_gib = {g} }}");
    let models = env.model("a", "", &vram(4.0)) + &env.model("b", "", &vram(4.0)) + &env.model("c", "", &vram(5.0));
    let (m, _reg, _t, _tasks) = env.manager("vram_gib = 10", &models).await;
    drop(m.acquire("a").await.unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(m.acquire("b").await.unwrap());
    // Here a was used before b; through another gateway, a was used after b.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let a = m.status("a").unwrap().worker_id.unwrap();
    env.store.touch_worker_use("local", &a, gpuhub_agent::util::now_us()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(m.acquire("c").await.unwrap());
    assert_eq!(m.status("b").unwrap().state, "unloaded", "b is the least recently used, counting a's use elsewhere");
    assert_eq!(m.status("a").unwrap().state, "ready");
    for n in ["a", "c"] {
        m.unload(n, "test over").await.unwrap();
    }
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
    assert!(
        env.store.workers(&gpuhub_agent::telemetry::TelemetryConfig::default().effective_node_name()).await.unwrap().is_empty(),
        "an unloaded worker is forgotten"
    );
}

/// A promotion's switch cut short by a restart leaves two remembered workers of one model on
/// two versions (replicas serve one). The restarted agent adopts the newer one and stops the
/// one it was replacing, as the drain would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_in_the_middle_of_a_switch_adopts_the_new_worker_and_stops_the_old_one() {
    let env = Env::new().await;
    let other = Env::new().await;
    let model = env.model("a", "", "");
    let owner = gpuhub_agent::telemetry::TelemetryConfig::default().effective_node_name();
    // Two live workers of `a`: the old one (version 1) by this agent, the new one (version 2)
    // started by a second manager on another store; both rows in this agent's store, as a
    // switch leaves them.
    let mut started = Vec::new();
    for e in [&env, &other] {
        let (m, _reg, token, _tasks) = e.manager("", &model).await;
        drop(m.acquire("a").await.unwrap());
        started.push((m.status("a").unwrap().worker_id.unwrap(), e.store.workers(&owner).await.unwrap().remove(0)));
        token.cancel();
        drop(m);
    }
    let (old_pid, mut old_row) = started.remove(0);
    let (new_pid, mut new_row) = started.remove(0);
    old_row.version = Some("1".into());
    new_row.version = Some("2".into());
    new_row.started_us = old_row.started_us + 1_000_000;
    env.store.put_worker(&old_row).await.unwrap();
    env.store.put_worker(&new_row).await.unwrap();
    assert!(pid_alive(&old_pid) && pid_alive(&new_pid));

    let (m2, _reg, _t, _tasks) = env.manager("", &model).await;
    wait_state(&m2, "a", "ready", Duration::from_secs(10)).await;
    assert_eq!(m2.status("a").unwrap().worker_id.as_deref(), Some(new_pid.as_str()), "the newer version's worker is adopted");
    let t = Instant::now();
    while pid_alive(&old_pid) && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!pid_alive(&old_pid), "the worker the switch was replacing must be stopped, not adopted");
    let rows: Vec<String> = env.store.workers(&owner).await.unwrap().into_iter().map(|r| r.instance_id).collect();
    assert_eq!(rows, vec![new_pid.clone()], "only the adopted worker is remembered");
    m2.unload("a", "test over").await.unwrap();
    assert!(!pid_alive(&new_pid));
}

/// MLflow slower than the first catalog after a restart: the first catalog lacks the
/// registry's models, and their remembered workers are kept aside (not stopped) until a
/// registry read says whether the model is still served: adopted if it is, stopped if not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remembered_worker_waits_for_the_first_registry_read() {
    let env = Env::new().await;
    let owner = gpuhub_agent::telemetry::TelemetryConfig::default().effective_node_name();
    let registry = "[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\nregistry_poll_s = 60\nlauncher = \"local\"\n";
    let tagged = env.model("a", "", "");
    for served_by_the_read in [true, false] {
        let (m1, _reg, token, _tasks) = env.manager("", &tagged).await;
        drop(m1.acquire("a").await.unwrap());
        let pid = m1.status("a").unwrap().worker_id.unwrap();
        token.cancel();
        drop(m1);
        // The restart: MLflow does not answer in time, so the first catalog has no `a`.
        let config = env.config("", registry);
        let (m2, _reg, token, _tasks) = env.manager_on(&config, Catalog::from_config(&config.file).registry_unread()).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(pid_alive(&pid), "a worker of a model the registry may still serve is not stopped before a read");
        assert_eq!(env.store.workers(&owner).await.unwrap().len(), 1, "nor forgotten");
        // A config reload before any read (still unread) keeps it aside too.
        m2.apply_catalog(Arc::new(Catalog::from_config(&config.file).registry_unread())).await;
        assert!(pid_alive(&pid));
        // The first read: `a` tagged (adopted, the same worker) or not (stopped, forgotten).
        let read = if served_by_the_read { env.config("", &format!("{registry}{tagged}")) } else { config.clone() };
        m2.apply_catalog(Arc::new(Catalog::from_config(&read.file))).await;
        if served_by_the_read {
            wait_state(&m2, "a", "ready", Duration::from_secs(10)).await;
            assert_eq!(m2.status("a").unwrap().worker_id.as_deref(), Some(pid.as_str()), "the remembered worker, adopted");
            m2.unload("a", "test over").await.unwrap();
        } else {
            assert!(!pid_alive(&pid), "a model the read does not serve: its worker is stopped");
        }
        assert!(!pid_alive(&pid));
        assert!(env.store.workers(&owner).await.unwrap().is_empty());
        token.cancel();
    }
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
    assert!(env.store.workers(&gpuhub_agent::telemetry::TelemetryConfig::default().effective_node_name()).await.unwrap().is_empty());
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

/// The worker process of a ready local model, as the kernel shows it.
struct Proc {
    uid: u32,
    cmdline: String,
    environ: Vec<String>,
}

fn proc_of(pid: &str) -> Proc {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap().split_whitespace().nth(2).unwrap().parse().unwrap();
    let cmdline = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap()).replace('\0', " ");
    let environ = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).unwrap())
        .split('\0')
        .filter(|v| !v.is_empty())
        .map(str::to_string)
        .collect();
    Proc { uid, cmdline, environ }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_unprivileged_with_its_own_environment_and_no_key_on_its_command_line() {
    let env = Env::new().await;
    for (name, how) in [("file", "--api-key-file {api_key_file}"), ("envkey", "")] {
        let model = format!(
            "[[models]]\nname = \"{name}\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --host {{host}} --port {{port}} {how}\"\n{}env = {{ GPUHUB_TEST_MODEL_ENV = \"from-the-catalog\" }}\n",
            gateway_support::worker_bin().display(),
            if how.is_empty() { "api_key_env = \"GPUHUB_TEST_WORKER_API_KEY\"\n" } else { "" }
        );
        let (m, _reg, _t, _tasks) = env.manager("", &model).await;
        let lease = m.acquire(name).await.unwrap();
        let key = lease.api_key.clone().unwrap();
        let pid = m.status(name).unwrap().worker_id.unwrap();
        let p = proc_of(&pid);
        assert_eq!(p.uid, uid_of(&gateway_support::worker_user()), "{name}: the worker runs as workers.user, never as the agent's root");
        assert!(!p.cmdline.contains(&key), "{name}: the key is on the command line: {}", p.cmdline);
        // Exactly the worker's own environment: nothing of the agent's (this test process's).
        let mut names: Vec<&str> = p.environ.iter().map(|v| v.split('=').next().unwrap()).collect();
        names.sort();
        // PWD: set by the shell that execs the worker.
        let mut want = vec!["GPUHUB_TEST_MODEL_ENV", "GPUHUB_WORKER_TAG", "HOME", "LANG", "LOGNAME", "PATH", "PWD", "USER"];
        if how.is_empty() {
            want.push("GPUHUB_TEST_WORKER_API_KEY");
            want.sort();
        }
        assert_eq!(names, want, "{name}: {:?}", p.environ);
        assert!(
            !p.environ.iter().any(|v| v.contains(&key)) || how.is_empty(),
            "{name}: the key is in the environment of a file-only worker"
        );
        // The key file: 0600, the worker's, gone once the worker stops.
        let keys: Vec<_> = std::fs::read_dir(env.dir.path().join("workers/keys")).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(keys.len(), 1, "{keys:?}");
        let meta = std::fs::metadata(&keys[0]).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!((meta.mode() & 0o777, meta.uid()), (0o600, uid_of(&gateway_support::worker_user())));
        assert!(!keys[0].display().to_string().contains(&key));
        assert_eq!(chat(&lease, Some(&key)).await.status(), 200, "{name}: the worker took its key");
        assert_eq!(chat(&lease, None).await.status(), 401, "{name}");
        drop(lease);
        m.unload(name, "test over").await.unwrap();
        assert!(!keys[0].exists(), "{name}: the key file outlived its worker");
        let workers = std::fs::metadata(env.dir.path().join("workers")).unwrap();
        assert_eq!(
            workers.mode() & 0o777,
            if gateway_support::worker_user() == "nobody" { 0o770 } else { 0o700 },
            "no other user looks into the workers dir"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_of_another_user_on_the_workers_port_is_never_marked_ready() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        // As an unprivileged user the worker runs as that same user: no other uid to squat with.
        assert!(std::env::var("GPUHUB_TEST_STRICT").is_err(), "this test needs root (the worker runs as nobody, the squatter as root)");
        eprintln!("skipped: needs root");
        return;
    }
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "--startup-delay-ms 1500", "")).await;
    let m = Arc::new(m);
    let call = {
        let m = m.clone();
        tokio::spawn(async move { m.acquire("a").await.map(|l| l.base_url.clone()) })
    };
    // The worker is started but sleeps before it binds: a squatter (root here, not the worker
    // account) takes its port and answers everything with 200.
    let port = started_worker_port(&env).await;
    let squatter = match tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
        Ok(l) => l,
        Err(e) => {
            let ss = std::process::Command::new("ss").args(["-tanp"]).output().unwrap();
            panic!(
                "{port}: {e}\n{}",
                String::from_utf8_lossy(&ss.stdout).lines().filter(|l| l.contains(&port.to_string())).collect::<Vec<_>>().join("\n")
            );
        }
    };
    let served = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let received = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let (served2, received2) = (served.clone(), received.clone());
    let squat = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((mut c, _)) = squatter.accept().await else { return };
            served2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await.ok().and_then(Result::ok).unwrap_or(0);
            received2.lock().unwrap().extend_from_slice(&buf[..n]);
            let _ =
                c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{\"status\":\"ok\"}").await;
        }
    });
    match call.await.unwrap() {
        Err(ModelError::Unavailable { reason, .. }) => {
            assert!(reason.contains("held by another user's process (uid 0") && reason.contains("never marked ready"), "{reason}")
        }
        other => panic!("a squatter must never be taken for the worker, got {other:?}"),
    }
    assert!(served.load(std::sync::atomic::Ordering::Relaxed) >= 1, "the agent did find the squatter listening");
    let got = String::from_utf8_lossy(&received.lock().unwrap()).into_owned();
    assert!(!got.contains("Bearer") && !got.contains("gpuhub-worker-"), "the squatter was sent the worker's key: {got}");
    let st = m.status("a").unwrap();
    assert_eq!(st.state, "failed");
    squat.abort();
}

/// The port the agent gave the worker it started for this test, once the worker's process
/// exists: its command line says so (its key file lies under this test's dir).
async fn started_worker_port(env: &Env) -> u16 {
    let t = Instant::now();
    let marker = env.dir.path().display().to_string();
    loop {
        for pid in std::fs::read_dir("/proc").unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()) {
            let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            if cmd.contains(&marker)
                && let Some(p) = cmd.split("--port ").nth(1).and_then(|r| r.split_whitespace().next())
            {
                return p.parse::<u16>().unwrap();
            }
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the worker did not start");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workers_process_on_the_workers_port_is_never_taken_for_it() {
    // Every worker runs as the worker account, so the port's owner cannot tell two workers
    // apart. Another worker's server (the test worker, as the worker account, without this
    // worker's marker) takes the port while this worker sleeps before binding; it answers
    // /health with 200 to anyone. This worker then cannot bind, and ends.
    let reason = taken_port(false).await;
    assert!(reason.contains("was taken by another worker's process") && reason.contains("on another port"), "{reason}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workers_process_sharing_the_port_by_so_reuseport_is_never_taken_for_it() {
    // Both bind with SO_REUSEPORT (as vLLM's server does): the kernel lets one account's sockets
    // share the port and spreads connections across them, so this worker listens too, but
    // half its calls would reach the other model. It is never marked ready.
    let reason = taken_port(true).await;
    assert!(reason.contains("within 3s (load_timeout_s)") && reason.contains("not this worker's"), "{reason}");
}

/// Another worker's server on `port`: the test worker as the worker account (when the test
/// runs as root), with an environment of its own (no marker of any worker of this test).
fn other_worker(port: u16, reuse_port: bool) -> std::process::Child {
    let mut other = std::process::Command::new(gateway_support::worker_bin());
    other
        .args(["--model", "b", "--port", &port.to_string()])
        .env_clear()
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    if reuse_port {
        other.arg("--reuse-port");
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let user = gateway_support::worker_user();
        std::os::unix::process::CommandExt::uid(std::os::unix::process::CommandExt::gid(&mut other, gid_of(&user)), uid_of(&user));
    }
    other.spawn().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workers_process_that_starts_sharing_a_ready_workers_port_gets_no_call() {
    use gpuhub_agent::gateway::upstream::{Client, Request, Target, UpstreamError};
    // The worker is ready, its server bound with SO_REUSEPORT (as vLLM's is); then another
    // worker's process of the worker account binds the same port the same way. The kernel
    // would hand it some of the new connections, so some calls for `a` would reach model `b`:
    // the gateway's client uses no new connection there, naming the process, and the worker
    // is replaced on another port. Not the model's fault: with `max_restarts = 1` a stop that
    // counted would fail the model.
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("max_restarts = 1", &env.model("a", "--reuse-port", "")).await;
    let lease = m.acquire("a").await.unwrap();
    let port: u16 = lease.base_url.rsplit(':').next().unwrap().parse().unwrap();
    let other = other_worker(port, true);
    let t = Instant::now();
    while gpuhub_agent::models::launcher::proof::listeners_on(port).unwrap().len() < 2 {
        assert!(t.elapsed() < Duration::from_secs(5), "the other worker did not listen on {port} beside this one");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let auth = format!("Bearer {}", lease.api_key.as_deref().unwrap());
    let headers = vec![
        (http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json")),
        (http::header::AUTHORIZATION, http::HeaderValue::from_str(&auth).unwrap()),
    ];
    let body = br#"{"model": "a", "messages": [{"role": "user", "content": "hi"}]}"#;
    let req = Request { method: &http::Method::POST, path_and_query: "/v1/chat/completions", headers, body };
    let client = Client::new(8, Duration::from_secs(60), Duration::from_secs(2));
    match client.send(Target::parse(&lease.base_url).unwrap().owned_by(lease.worker()), &req).await {
        Err(UpstreamError::NotTheWorker { what, .. }) => {
            assert!(what.to_string().contains(&format!("another worker's process (pid {})", other.id())), "{what}");
        }
        Err(e) => panic!("expected the other worker's process named, got {e}"),
        Ok(r) => panic!("a connection to a port another worker's process shares was used (HTTP {})", r.status),
    }
    // What the gateway does then: the worker's supervisor finds its port not its own alone
    // and stops it; the next call serves on another port.
    lease.upstream_failed();
    assert!(m.worker_gone(&lease, Duration::from_secs(5)).await, "the worker sharing its port with another's is stopped");
    let status = m.status("a").unwrap();
    let detail = status.detail.unwrap_or_default();
    assert!(detail.contains(&format!("another worker's process (pid {})", other.id())), "the model's state says why: {detail}");
    assert_eq!(status.state, "unloaded", "not counted toward max_restarts: {detail}");
    assert!(detail.contains("not counted toward max_restarts"), "{detail}");
    drop(lease);
    serves_on_another_port(&m, port, other).await;
}

/// The next call for model `a` is served by a worker on a port other than `port`; then `a` is
/// unloaded and `other` (the worker that had that port) stopped.
async fn serves_on_another_port(m: &ModelManager, port: u16, mut other: std::process::Child) {
    let lease = m.acquire("a").await.unwrap();
    assert!(!lease.base_url.ends_with(&format!(":{port}")), "{} again", lease.base_url);
    assert_eq!(chat(&lease, lease.api_key.as_deref()).await.status(), 200);
    drop(lease);
    m.unload("a", "test over").await.unwrap();
    other.kill().unwrap();
    other.wait().unwrap();
}

/// Starts model `a`, and another worker's process on the port the agent gave it before it
/// binds (with SO_REUSEPORT on both when `reuse_port`); the load fails naming that process,
/// and the next call serves on another port. The reason the load failed.
async fn taken_port(reuse_port: bool) -> String {
    let env = Env::new().await;
    let flags = if reuse_port { "--startup-delay-ms 1500 --reuse-port" } else { "--startup-delay-ms 1500" };
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", flags, "load_timeout_s = 3")).await;
    let m = Arc::new(m);
    let call = {
        let m = m.clone();
        tokio::spawn(async move { m.acquire("a").await.map(|l| l.base_url.clone()) })
    };
    let port = started_worker_port(&env).await;
    let other = other_worker(port, reuse_port);
    let t = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t.elapsed() < Duration::from_secs(5), "the other worker did not listen on {port}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let reason = match call.await.unwrap() {
        Err(ModelError::Unavailable { reason, .. }) => reason,
        // The caller's wait ends with the load timeout too; the load's reason is the model's detail.
        Err(ModelError::LoadTimeout { .. }) => {
            let t = Instant::now();
            loop {
                let detail = m.status("a").unwrap().detail.unwrap_or_default();
                if detail.contains("(pid ") || t.elapsed() > Duration::from_secs(5) {
                    break detail;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        other => panic!("another worker must never be taken for this one, got {other:?}"),
    };
    assert!(reason.contains(&format!("(pid {})", other.id())), "the other worker's process is named: {reason}");
    // Not the model's fault, so no back-off: the next call starts it on another port, and it
    // answers.
    serves_on_another_port(&m, port, other).await;
    reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_program_the_worker_account_cannot_run_is_refused_with_the_directory_that_stops_it() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        assert!(std::env::var("GPUHUB_TEST_STRICT").is_err(), "this test needs root (the worker runs as nobody)");
        eprintln!("skipped: needs root");
        return;
    }
    let env = Env::new().await;
    let private = env.dir.path().join("private");
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let bin = private.join("worker");
    std::fs::copy(gateway_support::worker_bin(), &bin).unwrap();
    let model = format!(
        "[[models]]\nname = \"a\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --host {{host}} --port {{port}} --api-key-file {{api_key_file}}\"\n",
        bin.display()
    );
    let (m, _reg, _t, _tasks) = env.manager("", &model).await;
    match m.acquire("a").await {
        Err(ModelError::Unavailable { reason, .. }) => assert!(
            reason.contains(&format!("{} (mode 700", private.display())) && reason.contains("does not let workers.user `nobody` through"),
            "{reason}"
        ),
        other => panic!("expected a refusal naming the directory, got {other:?}"),
    }
    assert!(std::fs::read_dir(env.dir.path().join("workers/keys")).unwrap().next().is_none(), "no key file left behind");
}

/// A catalog change with no restart (a registry poll or a reload): a model that left drains
/// the call in flight and then stops, a changed entry gets a new worker while the old one
/// drains, an added one serves, and the metrics forget the one that left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_change_drains_models_that_left_and_serves_new_ones_without_a_restart() {
    let env = Env::new().await;
    let (m, reg, _t, _tasks) = env.manager("", &format!("{}{}", env.model("a", "", ""), env.model("b", "", ""))).await;
    let lease_a = m.acquire("a").await.unwrap();
    let pid_a = m.status("a").unwrap().worker_id.unwrap();
    let lease_b = m.acquire("b").await.unwrap();
    let pid_b = m.status("b").unwrap().worker_id.unwrap();
    drop(lease_b);

    let d = env.dir.path().display();
    let text = format!(
        "[paths]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\nspool_dir = \"{d}/spool\"\n[workers]\ndir = \"{d}/workers\"\nuser = \"{}\"\nbackoff_s = 1\n{}{}",
        gateway_support::worker_user(),
        env.model("b", "--startup-delay-ms 10", ""),
        env.model("c", "", "")
    );
    let new = Config::from_toml(&text).unwrap();
    let change = m.apply_catalog(Arc::new(Catalog::from_config(&new.file))).await;
    assert_eq!((change.added, change.removed, change.changed), (vec!["c".to_string()], vec!["a".to_string()], vec!["b".to_string()]));

    assert!(m.status("a").is_none(), "`a` left the catalog");
    assert!(matches!(m.acquire("a").await, Err(ModelError::NotInCatalog(_))));
    // The call in flight to `a` is not cut: its worker waits for it.
    assert_eq!(chat(&lease_a, lease_a.api_key.as_deref()).await.status(), 200);
    assert!(pid_alive(&pid_a), "`a` stopped with a call in flight");
    drop(lease_a);
    let t = Instant::now();
    while (pid_alive(&pid_a) || pid_alive(&pid_b)) && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!pid_alive(&pid_a), "the worker of `a` still runs after its model left and its call ended");
    assert!(!pid_alive(&pid_b), "the old worker of the changed `b` still runs");

    // The changed and the added model start new workers on their first call.
    let b = m.acquire("b").await.unwrap();
    assert_ne!(m.status("b").unwrap().worker_id.unwrap(), pid_b);
    assert_eq!(chat(&b, b.api_key.as_deref()).await.status(), 200);
    let c = m.acquire("c").await.unwrap();
    assert_eq!(chat(&c, c.api_key.as_deref()).await.status(), 200);
    // `a`'s series go when its retirement ends, which is after its worker's process (a busy
    // host can take longer than the two starts above).
    let t = Instant::now();
    let mut text = metrics_text(&reg);
    while text.contains(r#"gpuhub_model_state{model="a""#) && t.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        text = metrics_text(&reg);
    }
    assert!(!text.contains(r#"gpuhub_model_state{model="a""#), "series of a model that left remain 10 s after its worker stopped: {text}");
    assert!(text.contains(r#"gpuhub_model_state{model="b",state="ready"} 1"#), "{text}");
    // Applying the same catalog again changes nothing.
    let again = m.apply_catalog(Arc::new(Catalog::from_config(&new.file))).await;
    assert!(again.is_empty(), "{again:?}");
    drop((b, c));
}

/// `min_replicas` >= 1 after a catalog change (`gpuhub models reload`, SIGHUP, a registry poll)
/// loads the model at once, as at agent start, not on its first call: a model added with it,
/// and one whose entry is raised to it from 0. A model without it still waits for a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_to_min_replicas_one_loads_the_model_without_waiting_for_a_call() {
    let env = Env::new().await;
    let (m, _reg, _t, _tasks) = env.manager("", &env.model("a", "", "")).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(m.status("a").unwrap().state, "unloaded", "min_replicas = 0: nothing loads without a call");

    let new =
        env.config("", &[env.model("a", "", "min_replicas = 1"), env.model("b", "", "min_replicas = 1"), env.model("c", "", "")].concat());
    let change = m.apply_catalog(Arc::new(Catalog::from_config(&new.file))).await;
    assert_eq!((change.added, change.changed), (vec!["b".to_string(), "c".to_string()], vec!["a".to_string()]));
    wait_state(&m, "a", "ready", Duration::from_secs(20)).await;
    wait_state(&m, "b", "ready", Duration::from_secs(20)).await;
    assert_eq!(m.status("c").unwrap().state, "unloaded", "min_replicas = 0 still loads on the first call");
    let (pa, pb) = (m.status("a").unwrap().worker_id.unwrap(), m.status("b").unwrap().worker_id.unwrap());
    assert!(pid_alive(&pa) && pid_alive(&pb));
    let lease = m.acquire("b").await.unwrap();
    assert_eq!(chat(&lease, lease.api_key.as_deref()).await.status(), 200);
    assert_eq!(m.status("b").unwrap().worker_id.unwrap(), pb, "the call went to the worker the reload started");
    drop(lease);
    m.unload("a", "test over").await.unwrap();
    m.unload("b", "test over").await.unwrap();
    assert!(!pid_alive(&pa) && !pid_alive(&pb));
}

/// A node without the gateway role (`[cluster] gateway_nodes`) starts no `min_replicas`
/// worker, at start or after a reload: no call reaches it there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_the_gateway_role_starts_no_min_replicas() {
    let env = Env::new().await;
    let role = "[gateway]\npublic_url = \"http://gpu99:8400\"\n[cluster]\ngateway_nodes = [\"gpu99\"]\n";
    let (m, _reg, _t, _tasks) = env.manager(role, &env.model("a", "", "min_replicas = 1")).await;
    let new = env.config(role, &[env.model("a", "", "min_replicas = 1"), env.model("b", "", "min_replicas = 1")].concat());
    m.apply_catalog(Arc::new(Catalog::from_config(&new.file))).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(m.status("a").unwrap().state, "unloaded", "not a gateway node: min_replicas starts nothing");
    assert_eq!(m.status("b").unwrap().state, "unloaded", "nor after a reload");
}
