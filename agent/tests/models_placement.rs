//! Placement per GPU: free memory is checked on each GPU, never summed; a model that fits no
//! single GPU (and does not ask for several) is refused with the numbers per GPU and what
//! holds each GPU. In process, with a scripted NVML view (`ManagerDeps::gpus`), the `local`
//! launcher and the repo's TEST worker (`tests/worker`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::sync::{Arc, Mutex};

use gpuhub_agent::config::Config;
use gpuhub_agent::models::{Catalog, ManagerDeps, ModelError, ModelManager};
use gpuhub_agent::store::Store;
use gpuhub_agent::telemetry::{GpuInfo, GpuJob};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const GIB: u64 = 1024 * 1024 * 1024;

fn gpu(index: u32, total_gib: u64, free_gib: u64, jobs: Vec<GpuJob>) -> GpuInfo {
    GpuInfo {
        index,
        uuid: format!("GPU-{index}"),
        name: "NVIDIA H200".into(),
        memory_total_bytes: total_gib * GIB,
        memory_free_bytes: free_gib * GIB,
        jobs,
    }
}

type Gpus = Arc<Mutex<Vec<GpuInfo>>>;

struct Env {
    dir: tempfile::TempDir,
    gpus: Gpus,
    manager: ModelManager,
    _registry: Registry,
    token: CancellationToken,
    tasks: TaskTracker,
}

impl Env {
    /// A manager over `models` (name, vram GiB, extra TOML), with the scripted `gpus`.
    async fn new(gpus: Vec<GpuInfo>, models: &[(&str, f64, &str)]) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&format!("sqlite://{}", dir.path().join("t.db").display()), None).await.unwrap();
        let d = dir.path().display();
        let mut text = format!(
            "[paths]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\nspool_dir = \"{d}/spool\"\n[workers]\ndir = \"{d}/workers\"\nuser = \"{}\"\n",
            gateway_support::worker_user()
        );
        for (name, vram, extra) in models {
            text.push_str(&format!(
                "[[models]]\nname = \"{name}\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --host {{host}} --port {{port}} --api-key-file {{api_key_file}}\"\nresources = {{ vram_gib = {vram}{extra} }}\nload_timeout_s = 30\n",
                gateway_support::worker_bin().display()
            ));
        }
        let config = Config::from_toml(&text).unwrap();
        let gpus: Gpus = Arc::new(Mutex::new(gpus));
        let mut registry = Registry::default();
        let (token, tasks) = (CancellationToken::new(), TaskTracker::new());
        let g = gpus.clone();
        let deps = ManagerDeps {
            config: &config,
            store: Some(store),
            registry: &mut registry,
            gpus: Box::new(move || g.lock().unwrap().clone()),
            tasks: tasks.clone(),
            shutdown: token.clone(),
        };
        let manager = ModelManager::start(Arc::new(Catalog::from_config(&config.file)), deps).await;
        Env { dir, gpus, manager, _registry: registry, token, tasks }
    }

    async fn refusal(&self, model: &str) -> String {
        match self.manager.acquire(model).await {
            Err(ModelError::Unavailable { reason, .. }) => reason,
            Err(e) => panic!("{model}: expected a refusal, got {e}"),
            Ok(_) => panic!("{model}: expected a refusal, but it started"),
        }
    }

    async fn stop(self) {
        for s in self.manager.statuses() {
            let _ = self.manager.unload(&s.name, "test over").await;
        }
        self.token.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        drop(self.dir);
    }
}

#[tokio::test]
async fn a_model_that_fits_the_sum_of_free_memory_but_no_single_gpu_is_refused_with_the_numbers_per_gpu() {
    let alice = GpuJob { job_id: 4242, user: "alice".into(), vram_bytes: 71 * GIB };
    let env = Env::new(
        vec![gpu(0, 141, 70, vec![alice]), gpu(1, 141, 70, vec![])],
        &[("huge", 100.0, ""), ("split", 100.0, ", gpus = 2"), ("giant", 150.0, ""), ("small", 60.0, "")],
    )
    .await;
    // 140 GiB free in all, 70 on each GPU: a 100 GiB model fits the sum and no GPU.
    let why = env.refusal("huge").await;
    assert!(
        why.starts_with("it needs 100.0 GiB of GPU memory on one GPU and no GPU has that much free: GPU 0 has 70.0 of 141.0 GiB free, GPU 1 has 70.0 of 141.0 GiB free (140.0 GiB free in all, but a model runs on one GPU unless it asks for several with resources.gpus)"),
        "{why}"
    );
    assert!(why.contains("GPU 0 is held by Slurm job 4242") && why.contains("alice"), "what holds GPU 0: {why}");
    assert!(why.contains("gpuhub models unload NAME"), "what to do: {why}");
    let st = env.manager.status("huge").unwrap();
    assert_eq!(st.state, "unloaded", "a refusal is not a failure (no back-off)");
    assert!(st.detail.as_deref().unwrap_or("").contains("GPU 1 has 70.0 of 141.0 GiB free"), "`gpuhub models` shows it: {st:?}");
    // Bigger than any GPU: no eviction could help, and the message says so.
    let why = env.refusal("giant").await;
    assert!(why.contains("the largest GPU here has 141.0 GiB in all") && why.contains("resources.gpus"), "{why}");
    // Asking for two GPUs: 50 GiB on each fits.
    let lease = env.manager.acquire("split").await.unwrap_or_else(|e| panic!("split over two GPUs must start: {e}"));
    drop(lease);
    // A model that fits one GPU starts.
    drop(env.manager.acquire("small").await.unwrap_or_else(|e| panic!("{e}")));
    env.stop().await;
}

#[tokio::test]
async fn a_displaced_model_is_told_which_model_holds_the_gpu_since_when_and_until_when() {
    let env = Env::new(vec![gpu(0, 141, 100, vec![]), gpu(1, 141, 20, vec![])], &[("large", 80.0, ""), ("other", 90.0, "")]).await;
    // `large` starts on GPU 0 and a call holds it (so it cannot be evicted).
    let lease = env.manager.acquire("large").await.unwrap_or_else(|e| panic!("{e}"));
    *env.gpus.lock().unwrap() = vec![gpu(0, 141, 20, vec![]), gpu(1, 141, 20, vec![])];
    let why = env.refusal("other").await;
    assert!(
        why.starts_with("it needs 90.0 GiB of GPU memory on one GPU and no GPU has that much free: GPU 0 has 20.0 of 141.0 GiB free"),
        "{why}"
    );
    assert!(!why.contains("free in all"), "the sum does not fit either: {why}");
    assert!(why.contains("model `large` (pid "), "names the model that holds the GPU: {why}");
    assert!(why.contains(" UTC, 1 calls in flight; frees 600s after its last call (idle_timeout_s)"), "since when, until when: {why}");
    drop(lease);
    env.stop().await;
}
