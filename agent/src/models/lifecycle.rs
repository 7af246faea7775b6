//! Turns a model name into a ready upstream, starting its worker on the first call and
//! stopping it when idle.
//!
//! One [`Worker`] per catalog entry holds the state machine
//! `unloaded → pending (Slurm's reason) → starting → ready → draining → unloaded`, plus
//! `failed` (with the last lines of the worker's log and a back-off). Every transition goes
//! through [`Shared::transition`], which logs it once and updates the metrics.
//!
//! - Single flight: the first `acquire` that finds a model unloaded flips it to pending/starting
//!   under the worker's lock and spawns the one load task; every other caller waits on the
//!   worker's watch channel (bounded by `max_concurrency + queue_len`; over it: 429).
//! - A load never holds a lock another model needs: each worker has its own mutex, and the
//!   placement mutex is held only while deciding what to evict.
//! - Readiness is polled from 2 ms, backing off to 10 ms (100 ms after 30 s), so a ready
//!   worker is noticed within a few ms instead of a fixed 5 s.
//! - A supervisor task per running worker detects crashes and idle time.
//! - Workers' jobs are recorded in the store and adopted after an agent restart.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::watch;

use super::fair_queue::{FairQueue, SlotPermit};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::artifacts::{ArtifactCache, Weights};
use super::gate::Promoted;
use super::launcher::account::WorkerUser;
use super::launcher::proof::{self, PortOwner};
use super::launcher::secret::KeyFiles;
use super::launcher::{self, Instance, LaunchSpec, Launchers, RunState};
use super::metrics::ModelMetrics;
use super::mlflow::Mlflow;
use super::single_flight;
use super::{Catalog, LiveCatalog};
use crate::config::{Config, LauncherKind, ModelConfig, WorkersConfig};
use crate::gateway::upstream::PortLost;
use crate::store::{Store, WorkerRow};
use crate::telemetry::{GpuInfo, GpuJob};

mod scale;
mod switchover;
pub use scale::ReplicaStatus;
pub use switchover::Switch;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
const LOG_TAIL_LINES: usize = 10;

/// Why a model cannot serve a call right now. Each message names the model and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model `{0}` is not in the catalog")]
    NotInCatalog(String),
    #[error("model `{model}` is busy: {in_flight} calls in flight and the queue of {queue} is full; retry in a few seconds")]
    Overloaded { model: String, in_flight: u32, queue: u32, retry_after_s: u64 },
    #[error("model `{model}` cannot start: {reason}")]
    Unavailable { model: String, reason: String },
    #[error("model `{model}` did not become ready within {seconds}s; see `gpuhub models` for its log")]
    LoadTimeout { model: String, seconds: u64 },
}

/// The states a model is in; the names are what `/v1/models`, the CLI and metrics show.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum State {
    Unloaded,
    Pending,
    Starting,
    Ready,
    Draining,
    Failed,
}

impl State {
    pub const ALL: [State; 6] = [State::Unloaded, State::Pending, State::Starting, State::Ready, State::Draining, State::Failed];

    pub fn as_str(self) -> &'static str {
        match self {
            State::Unloaded => "unloaded",
            State::Pending => "pending",
            State::Starting => "starting",
            State::Ready => "ready",
            State::Draining => "draining",
            State::Failed => "failed",
        }
    }

    /// Holds (or is about to hold) GPU memory.
    fn holds_gpu(self) -> bool {
        matches!(self, State::Pending | State::Starting | State::Ready | State::Draining)
    }
}

/// A permission to forward one call to a ready upstream. Dropping it ends the call (in-flight
/// counts, idle timers).
#[derive(Debug)]
pub struct Lease {
    pub model: String,
    /// Base URL without `/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub version: Option<String>,
    /// Held for its `Drop`: ends the call (in-flight count, queue permit, idle timer).
    _guard: InFlightGuard,
}

#[derive(Debug)]
struct InFlightGuard {
    worker: Arc<Worker>,
    _permit: Option<SlotPermit>,
    /// The instance the call goes to: a worker replaced by a promotion drains until no lease
    /// holds its instance ([`switchover`]).
    _instance: Option<Arc<Instance>>,
    /// The replica the call went to ([`scale`]).
    route: Option<scale::Route>,
    /// Its `found_alive` when [`Lease::upstream_failed`] asked for a check (`u64::MAX`: not
    /// asked): [`ModelManager::worker_gone`] waits for the verdict after that one.
    alive_before: AtomicU64,
}

impl Lease {
    /// The worker gpuhub started that this call goes to (`None` for a static URL): the gateway
    /// checks on each new connection that its port is held by it alone
    /// ([`crate::gateway::upstream::Target::owned_by`]).
    pub fn worker(&self) -> Option<&Instance> {
        self._guard._instance.as_deref()
    }

    /// The call could not reach its worker (refused, broken off): the replica gets no call
    /// until a health probe passes again, so the next call goes to another replica; and its
    /// supervisor checks now whether the worker still holds its port (a worker whose server
    /// died while its job runs on is stopped, and the next call starts another).
    pub fn upstream_failed(&self) {
        if let Some(r) = &self._guard.route {
            r.failed();
            self._guard.alive_before.store(r.target().found_alive.load(Ordering::Acquire), Ordering::Release);
            r.target().suspect.notify_one();
        }
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        let w = &self.worker;
        {
            let mut s = w.lock();
            s.last_used = Instant::now();
        }
        w.in_flight.fetch_sub(1, Ordering::AcqRel);
        w.bump();
    }
}

/// Counts a caller that waits for a load or a concurrency slot.
struct WaitGuard(Arc<Worker>);

impl Drop for WaitGuard {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A worker [`Shared::start_drain`] marked draining: its instance, and the receiver that wakes
/// the drain when its in-flight count changes.
struct Draining {
    inst: Arc<Instance>,
    changed: watch::Receiver<u64>,
}

/// What `/v1/models`, `gpuhub models` and metrics show per model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelStatus {
    pub name: String,
    pub state: &'static str,
    pub role: Option<String>,
    pub aliases: Vec<String>,
    /// LoRA adapters this model's worker serves (each called by its own name).
    pub adapters: Vec<String>,
    pub in_flight: u32,
    /// Slurm's pending reason, why it failed or was unloaded, what it evicted.
    pub detail: Option<String>,
    pub launcher: LauncherKind,
    /// The version being served (MLflow `@production` at the worker's start).
    pub version: Option<String>,
    /// Slurm job id or local pid of the current worker.
    pub worker_id: Option<String>,
    pub vram_gib: f64,
    /// Seconds since the last call ended (ready workers).
    pub idle_s: Option<u64>,
    pub idle_timeout_s: u64,
    /// The last lines of the worker's log (failed workers).
    pub log_tail: Vec<String>,
    pub waiting: u32,
    /// Each running worker of the model (more than one with `max_replicas` > 1).
    pub replicas: Vec<ReplicaStatus>,
}

#[derive(Debug)]
struct WState {
    state: State,
    instance: Option<Arc<Instance>>,
    last_used: Instant,
    /// Load attempts started so far; waiters remember the one they wait for.
    attempt: u64,
    /// The last attempt that failed, and the message its waiters get.
    outcome: Option<(u64, String)>,
    /// Failed starts and crashes in a row.
    failures: u32,
    retry_at: Option<Instant>,
    detail: Option<String>,
    log_tail: Vec<String>,
    /// The MLflow version's weights the current instance runs on (kept from eviction).
    weights: Option<Weights>,
    /// The Slurm job (local pid) of a load or adoption under way, while pending or starting
    /// (shown among the replicas before it is ready).
    loading_job: Option<String>,
}

impl WState {
    /// Whether this worker holds (or is loading into) GPU memory on this node, against its
    /// room and `workers.vram_gib`: not once it routes to another agent's worker, whose
    /// memory is that agent's node's.
    fn holds_gpu_here(&self) -> bool {
        self.state.holds_gpu() && self.instance.as_ref().is_none_or(|i| i.borrowed_from.is_none())
    }
}

#[derive(Debug)]
pub(crate) struct Worker {
    cfg: Arc<ModelConfig>,
    st: Mutex<WState>,
    changed: watch::Sender<u64>,
    /// Calls holding a lease or waiting for a concurrency slot of a ready worker.
    in_flight: AtomicU32,
    /// Calls waiting for a load.
    waiting: AtomicU32,
    /// Concurrency slots, handed out fairly across users.
    permits: Arc<FairQueue>,
    /// Left the catalog (or was replaced by a changed entry): draining out, no metrics.
    leaving: AtomicBool,
    /// Why this worker is no longer wanted (its model left the catalog or its entry changed;
    /// an extra replica taken off its model's list), once it is: its load is not waited for
    /// ([`Shared::wait_ready`]).
    given_up: std::sync::OnceLock<String>,
    /// Further replicas, routing and health ([`scale`]).
    rep: scale::Replicas,
    /// A call could not reach this worker: its supervisor checks its port now, not at its
    /// next period ([`Shared::supervise`]).
    suspect: tokio::sync::Notify,
    /// Such checks that found the worker still holding its port ([`ModelManager::worker_gone`]).
    found_alive: AtomicU64,
    /// The latest report of another gateway that this (own) worker could not be reached
    /// that was checked, Unix us ([`ModelManager::check_reported`]).
    reported_us: AtomicI64,
}

impl Worker {
    fn new(cfg: Arc<ModelConfig>) -> Worker {
        Worker::with_role(cfg, false)
    }

    /// A further replica of a model (started by scaling).
    fn new_replica(cfg: Arc<ModelConfig>) -> Worker {
        Worker::with_role(cfg, true)
    }

    fn with_role(cfg: Arc<ModelConfig>, is_extra: bool) -> Worker {
        Worker {
            rep: scale::Replicas::new(&cfg, is_extra),
            suspect: tokio::sync::Notify::new(),
            found_alive: AtomicU64::new(0),
            reported_us: AtomicI64::new(0),
            permits: FairQueue::new(cfg.max_concurrency as usize),
            cfg,
            st: Mutex::new(WState {
                state: State::Unloaded,
                instance: None,
                last_used: Instant::now(),
                attempt: 0,
                outcome: None,
                failures: 0,
                retry_at: None,
                detail: None,
                log_tail: Vec::new(),
                weights: None,
                loading_job: None,
            }),
            changed: watch::channel(0).0,
            in_flight: AtomicU32::new(0),
            waiting: AtomicU32::new(0),
            leaving: AtomicBool::new(false),
            given_up: std::sync::OnceLock::new(),
        }
    }

    /// This worker is no longer wanted, for `why`: a Slurm job of its that still waits in the
    /// queue (an extra replica's, also one that runs but is not ready) is cancelled at the
    /// next look instead of being waited for, only to be stopped once ready.
    fn give_up(&self, why: &str) {
        let _ = self.given_up.set(why.to_string());
    }

    fn lock(&self) -> MutexGuard<'_, WState> {
        // A poisoned lock only means a panic elsewhere; the state itself stays consistent.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0 || self.waiting.load(Ordering::Acquire) > 0
    }
}

/// What the on-demand machinery needs.
struct Runtime {
    launchers: Launchers,
    /// This agent, as the owner of the workers it starts (its Slurm node name): several agents
    /// share one store and one cluster, and each manages only its own workers.
    owner: String,
    store: Option<Store>,
    metrics: ModelMetrics,
    cfg: WorkersConfig,
    dir: std::path::PathBuf,
    /// `workers.user`, looked up and its workers dir prepared at start; the error otherwise
    /// (every start then fails with it).
    user: Result<WorkerUser, String>,
    /// This agent's executable (Slurm jobs run its `worker-port` to pick a port).
    agent_exe: std::path::PathBuf,
    gpus: Box<dyn Fn() -> Vec<GpuInfo> + Send + Sync>,
    mlflow: Option<Mlflow>,
    /// Where MLflow versions' weights are downloaded (the error when it cannot be used).
    artifacts: Result<ArtifactCache, String>,
    /// Last `@production` version seen per MLflow model (fallback when MLflow is down).
    versions: Mutex<BTreeMap<String, String>>,
    tasks: TaskTracker,
    shutdown: CancellationToken,
    /// One placement decision at a time (held while evicting, never while loading).
    placement: tokio::sync::Mutex<()>,
    /// This node runs the gateway (`[cluster] gateway_nodes`): only then does it start workers
    /// of its own accord (`min_replicas`); a node without the role serves no calls.
    gateway: bool,
}

struct Shared {
    catalog: Arc<LiveCatalog>,
    /// One worker per catalog model, by canonical name.
    workers: RwLock<BTreeMap<String, Arc<Worker>>>,
    /// Workers whose model left the catalog or changed: draining, then dropped. Placement
    /// still counts their GPU memory.
    leaving: Mutex<Vec<Arc<Worker>>>,
    /// One catalog change at a time.
    applying: tokio::sync::Mutex<()>,
    /// `mlflow.launcher` when registry-tagged models may be added (polling is on).
    registry_launcher: Option<LauncherKind>,
    rt: Option<Runtime>,
    /// The versions gpuhub promoted (served instead of `@production`).
    promoted: Arc<Promoted>,
    /// Remembered workers of models the first catalog lacks because MLflow had not answered
    /// yet (with when they were set aside): adopted once a registry read serves their model,
    /// stopped once one does not, or after [`DEFERRED_MAX`].
    deferred: Mutex<Vec<(WorkerRow, Instant)>>,
}

/// How long a remembered worker waits for the registry read that says whether its model is
/// still served (its GPU is held meanwhile, and no call can reach it).
const DEFERRED_MAX: Duration = Duration::from_secs(600);

/// What adopting remembered workers kept.
#[derive(Default)]
struct Adopted {
    /// Slurm jobs kept (adopted or set aside): not orphans.
    jobs: Vec<String>,
    keys: Vec<KeyFiles>,
    /// A Slurm lookup failed: no job is taken for an orphan in this pass.
    unsure: bool,
}

/// What a catalog change did to the models.
#[derive(Debug, Clone, Default, Serialize)]
pub struct CatalogChange {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Entries that changed: their running worker drains and the next call starts a new one.
    pub changed: Vec<String>,
}

impl CatalogChange {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// Whether two entries start the same worker (a changed entry restarts its model).
fn same_entry(a: &ModelConfig, b: &ModelConfig) -> bool {
    serde_json::to_value(a).ok() == serde_json::to_value(b).ok() && format!("{:?}", a.worker) == format!("{:?}", b.worker)
}

/// The models of this agent and their workers.
pub struct ModelManager {
    shared: Arc<Shared>,
}

/// What [`ModelManager::start`] needs from the agent.
pub struct ManagerDeps<'a> {
    pub config: &'a Config,
    pub store: Option<Store>,
    pub registry: &'a mut prometheus_client::registry::Registry,
    pub gpus: Box<dyn Fn() -> Vec<GpuInfo> + Send + Sync>,
    pub tasks: TaskTracker,
    pub shutdown: CancellationToken,
}

impl ModelManager {
    /// The full manager: launchers, metrics, MLflow, and adoption of the workers a previous
    /// agent left running (done before this returns, so no call can start a duplicate).
    pub async fn start(catalog: Arc<Catalog>, deps: ManagerDeps<'_>) -> ModelManager {
        ModelManager::start_live(Arc::new(LiveCatalog::new(catalog)), deps).await
    }

    /// [`ModelManager::start`] on the agent's live catalog (swapped by
    /// [`ModelManager::apply_catalog`]).
    pub async fn start_live(live: Arc<LiveCatalog>, deps: ManagerDeps<'_>) -> ModelManager {
        let catalog = live.load();
        let workers: BTreeMap<String, Arc<Worker>> = catalog.models().map(|m| (m.name.clone(), Arc::new(Worker::new(m.clone())))).collect();
        let f = &deps.config.file;
        let dir = deps.config.workers_dir();
        let metrics = ModelMetrics::register(deps.registry);
        for name in workers.keys() {
            metrics.set_state(name, None, State::Unloaded);
        }
        // Models tagged in the MLflow registry may come at any poll.
        let registry = f.mlflow.tracking_uri.as_deref().is_some_and(|u| !u.is_empty()) && f.mlflow.registry_poll_s > 0;
        let on_demand = registry || workers.values().any(|w| matches!(w.cfg.launcher, LauncherKind::Local | LauncherKind::Slurm));
        let user = if on_demand {
            WorkerUser::lookup(&f.workers.user).and_then(|u| launcher::account::prepare_dir(&dir, &u).map(|()| u))
        } else {
            Err("no model of this catalog starts workers".to_string())
        };
        if on_demand && let Err(e) = &user {
            tracing::error!(error = %e, "model workers cannot start until this is fixed");
        }
        let agent_exe = std::env::current_exe()
            .map(|p| std::path::PathBuf::from(p.display().to_string().trim_end_matches(" (deleted)")))
            .unwrap_or_else(|_| std::path::PathBuf::from("/usr/bin/gpuhub-agent"));
        let worker_gid = user.as_ref().ok().filter(|u| !u.is_self).map(|u| u.gid);
        let promoted = Arc::new(Promoted::load(deps.store.as_ref()).await);
        // This agent in the store and in its jobs' comments: its Slurm node name.
        let owner = f.telemetry.effective_node_name();
        let rt = Runtime {
            launchers: Launchers {
                local: launcher::local::Local,
                slurm: launcher::slurm::Slurm::new(f.slurm.clone(), dir.clone(), owner.clone()),
            },
            owner,
            store: deps.store,
            metrics,
            cfg: f.workers.clone(),
            dir,
            user,
            agent_exe,
            gpus: deps.gpus,
            artifacts: if f.mlflow.tracking_uri.as_deref().is_some_and(|u| !u.is_empty()) {
                ArtifactCache::open(
                    deps.config.mlflow_cache_dir(),
                    f.mlflow.cache_max_gib,
                    f.mlflow.file_roots.clone(),
                    worker_gid,
                )
                .map_err(|e| {
                    tracing::error!(error = %e, "the MLflow artifact cache cannot be used; models whose weights come from MLflow cannot start");
                    e.to_string()
                })
            } else {
                Err("mlflow.tracking_uri is not set".to_string())
            },
            mlflow: f.mlflow.tracking_uri.as_deref().filter(|u| !u.is_empty()).map(Mlflow::new),
            versions: Mutex::new(BTreeMap::new()),
            tasks: deps.tasks,
            shutdown: deps.shutdown,
            placement: tokio::sync::Mutex::new(()),
            gateway: deps.config.is_gateway(),
        };
        let shared = Arc::new(Shared {
            catalog: live,
            workers: RwLock::new(workers),
            leaving: Mutex::new(Vec::new()),
            applying: tokio::sync::Mutex::new(()),
            registry_launcher: registry.then_some(f.mlflow.launcher),
            rt: Some(rt),
            promoted,
            deferred: Mutex::new(Vec::new()),
        });
        shared.heartbeat();
        shared.maintain();
        shared.adopt_all().await;
        shared.start_min_replicas();
        ModelManager { shared }
    }

    /// Waits until `model` can take a call and returns the lease for it.
    pub async fn acquire(&self, model: &str) -> Result<Lease, ModelError> {
        self.acquire_for(model, "").await
    }

    /// [`Self::acquire`] for a call of `user`: a busy worker's slots go to the least recently
    /// served user first ([`super::fair_queue`]).
    pub async fn acquire_for(&self, model: &str, user: &str) -> Result<Lease, ModelError> {
        let entry = self.shared.catalog.load().get(model).cloned().ok_or_else(|| ModelError::NotInCatalog(model.to_string()))?;
        let w = self.shared.worker(&entry.name).ok_or_else(|| ModelError::NotInCatalog(model.to_string()))?;
        self.shared.acquire(w, user).await
    }

    /// Another ready replica for a call of `user` whose replica could not be reached before
    /// anything was sent (`failed` has had [`Lease::upstream_failed`]); `None` when the model
    /// has no other one. The new lease is taken before `failed` is dropped.
    pub async fn reroute(&self, failed: &Lease, user: &str) -> Option<Lease> {
        self.shared.reroute(failed, user).await
    }

    /// After a call could reach none of its model's ready replicas (nothing was sent): waits
    /// up to `within` for the supervisor of the replica `failed` went to (woken by
    /// [`Lease::upstream_failed`]). `true` when that worker is no longer the ready one (it
    /// died, or its server stopped holding its port and its job was stopped; another replica
    /// took its place), so a new lease finds or starts another; `false` when it still holds
    /// its port, or is a static URL, which gpuhub does not restart.
    pub async fn worker_gone(&self, failed: &Lease, within: Duration) -> bool {
        let g = &failed._guard;
        let (Some(inst), Some(route)) = (g._instance.as_ref(), g.route.as_ref()) else { return false };
        let alive = g.alive_before.load(Ordering::Acquire);
        if inst.launcher == LauncherKind::Static || alive == u64::MAX {
            return false;
        }
        let w = route.target();
        let mut changed = w.changed.subscribe();
        let deadline = tokio::time::Instant::now() + within;
        loop {
            {
                let s = w.lock();
                if s.state != State::Ready || !s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, inst)) {
                    return true;
                }
            }
            if w.found_alive.load(Ordering::Acquire) != alive {
                return false;
            }
            if !matches!(tokio::time::timeout_at(deadline, changed.changed()).await, Ok(Ok(()))) {
                return false;
            }
        }
    }

    /// Other gateways' reports that a worker they borrowed could not be reached while its job
    /// ran (`(instance id, when)`, [`crate::store::Store::unreachable_workers`]). Each of this
    /// agent's ready Slurm workers named by a report newer than the last one it checked is
    /// checked now, as after a failed call here: its job is stopped if its server no longer
    /// holds its port ([`Shared::supervise`]; only the owner may stop it).
    pub fn check_reported(&self, reports: &[(String, i64)]) {
        for w in self.shared.all_workers() {
            let id = {
                let s = w.lock();
                match (&s.instance, s.state) {
                    (Some(i), State::Ready) if i.borrowed_from.is_none() && i.launcher == LauncherKind::Slurm => i.id.clone(),
                    _ => continue,
                }
            };
            let Some(&(_, at)) = reports.iter().find(|(r, _)| *r == id) else { continue };
            if w.reported_us.fetch_max(at, Ordering::AcqRel) < at {
                tracing::info!(model = %w.cfg.name, worker = %id, "another gateway could not reach this worker while its job runs; checking its port");
                w.suspect.notify_one();
            }
        }
    }

    pub fn statuses(&self) -> Vec<ModelStatus> {
        self.shared.current_workers().iter().map(|w| self.shared.status(w)).collect()
    }

    pub fn status(&self, model: &str) -> Option<ModelStatus> {
        let name = self.shared.catalog.load().get(model)?.name.clone();
        self.shared.worker(&name).map(|w| self.shared.status(&w))
    }

    /// Loads `model` now (as a first call would) and waits until it is ready.
    pub async fn load(&self, model: &str) -> Result<ModelStatus, ModelError> {
        let lease = self.acquire(model).await?;
        drop(lease);
        self.status(model).ok_or_else(|| ModelError::NotInCatalog(model.to_string()))
    }

    /// Drains and stops `model`'s worker. Returns false if it was not ready.
    pub async fn unload(&self, model: &str, reason: &str) -> Result<bool, ModelError> {
        let entry = self.shared.catalog.load().get(model).cloned().ok_or_else(|| ModelError::NotInCatalog(model.to_string()))?;
        let Some(w) = self.shared.worker(&entry.name) else { return Err(ModelError::NotInCatalog(model.to_string())) };
        Ok(self.shared.unload(&w, reason).await)
    }

    pub fn mlflow(&self) -> Option<&Mlflow> {
        self.shared.rt.as_ref().and_then(|rt| rt.mlflow.as_ref())
    }

    /// Remembers a version just promoted, so the next start uses it even if MLflow is down.
    pub fn note_version(&self, mlflow_model: &str, version: &str) {
        if let Some(rt) = &self.shared.rt {
            rt.versions.lock().unwrap_or_else(|p| p.into_inner()).insert(mlflow_model.to_string(), version.to_string());
        }
    }

    /// The versions gpuhub promoted, and `@production` as last read.
    pub fn promoted(&self) -> &Promoted {
        &self.shared.promoted
    }

    /// Sets `gpuhub_model_alias_mismatch` of catalog model `name`.
    pub fn set_alias_mismatch(&self, name: &str, mismatch: bool) {
        if let Some(rt) = &self.shared.rt {
            rt.metrics.alias_mismatch(name, mismatch);
        }
    }

    /// After a promotion of `model`'s version: a ready worker on another version is replaced
    /// with no failed call when there is room for a second one ([`switchover`]).
    pub async fn switch_to_promoted(&self, model: &str) -> Switch {
        let Some(w) = self.shared.worker(model) else { return Switch::NextStart("it is not in the catalog".into()) };
        self.shared.switch(w).await
    }

    /// A receiver that changes whenever `model`'s state or in-flight count changes (for SSE
    /// keep-alive comments while a load is under way).
    pub fn watch(&self, model: &str) -> Option<watch::Receiver<u64>> {
        let name = self.shared.catalog.load().get(model)?.name.clone();
        self.shared.worker(&name).map(|w| w.changed.subscribe())
    }

    /// The catalog being served now.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.shared.catalog.load()
    }

    /// Serves `new` from now on: new models get a worker (started on their first call, or at
    /// once with `min_replicas` >= 1); models that left drain their calls and stop; a changed
    /// entry's running worker drains while the next call starts the new one (at once with
    /// `min_replicas` >= 1). The catalog is swapped after the workers, so a call never finds a
    /// name without its worker.
    pub async fn apply_catalog(&self, new: Arc<Catalog>) -> CatalogChange {
        let sh = &self.shared;
        let _one = sh.applying.lock().await;
        let mut change = CatalogChange::default();
        let mut leaving = Vec::new();
        {
            let mut map = sh.workers.write().unwrap_or_else(|p| p.into_inner());
            for m in new.models() {
                match map.get(&m.name) {
                    Some(w) if same_entry(&w.cfg, m) => {}
                    Some(_) => {
                        change.changed.push(m.name.clone());
                        leaving.extend(map.insert(m.name.clone(), Arc::new(Worker::new(m.clone()))));
                    }
                    None => {
                        change.added.push(m.name.clone());
                        map.insert(m.name.clone(), Arc::new(Worker::new(m.clone())));
                    }
                }
            }
            let gone: Vec<String> = map.keys().filter(|n| new.model(n).is_none()).cloned().collect();
            for n in gone {
                leaving.extend(map.remove(&n));
                change.removed.push(n);
            }
        }
        if let Some(rt) = &sh.rt {
            for n in change.added.iter().chain(&change.changed) {
                rt.metrics.set_state(n, None, State::Unloaded);
            }
        }
        // Workers set aside at start for want of a registry read: adopted before a call can
        // find their model (and start a second worker), or stopped if the read does not serve it.
        sh.adopt_deferred(new.is_registry_unread(), false).await;
        sh.catalog.store(new);
        for w in leaving {
            w.leaving.store(true, Ordering::Release);
            sh.leaving.lock().unwrap_or_else(|p| p.into_inner()).push(w.clone());
            let removed = change.removed.contains(&w.cfg.name);
            let why = if removed { "its model left the catalog" } else { "its catalog entry changed" };
            w.give_up(why);
            let me = sh.clone();
            let task = async move {
                me.retire(&w, why).await;
                me.leaving.lock().unwrap_or_else(|p| p.into_inner()).retain(|o| !Arc::ptr_eq(o, &w));
                if removed && let Some(rt) = &me.rt {
                    rt.metrics.remove(&w.cfg.name);
                }
            };
            match &sh.rt {
                Some(rt) => {
                    rt.tasks.spawn(task);
                }
                None => {
                    tokio::spawn(task);
                }
            }
        }
        if !change.is_empty() {
            tracing::info!(added = ?change.added, removed = ?change.removed, changed = ?change.changed, "catalog changed");
        }
        // As at agent start: a model with `min_replicas` >= 1 (added, or its entry changed to
        // it) loads now, not on its first call.
        sh.start_min_replicas();
        change
    }
}

impl Shared {
    /// The worker of a canonical catalog name.
    fn worker(&self, name: &str) -> Option<Arc<Worker>> {
        self.workers.read().unwrap_or_else(|p| p.into_inner()).get(name).cloned()
    }

    /// The workers of the catalog's models.
    fn current_workers(&self) -> Vec<Arc<Worker>> {
        self.workers.read().unwrap_or_else(|p| p.into_inner()).values().cloned().collect()
    }

    /// Every worker that may hold GPU memory: the catalog's and those draining out of it, and
    /// the extra replicas of each.
    fn all_workers(&self) -> Vec<Arc<Worker>> {
        let mut all = self.current_workers();
        all.extend(self.leaving.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned());
        let extras: Vec<Arc<Worker>> = all.iter().flat_map(|w| w.rep.extras()).collect();
        all.extend(extras);
        all
    }

    /// A worker that left the catalog: waits for a load under way to end, then drains and
    /// stops it.
    async fn retire(&self, w: &Arc<Worker>, why: &str) {
        let mut rx = w.changed.subscribe();
        loop {
            let state = w.lock().state;
            match state {
                State::Ready => {
                    self.unload(w, why).await;
                    return;
                }
                State::Unloaded | State::Failed => {
                    // Its further replicas may still run (started while it served, or starting
                    // when it died): out of the list, a ready one is stopped here and one still
                    // starting is given up (its job cancelled at the next look).
                    self.stop_replicas(w, why).await;
                    return;
                }
                State::Pending | State::Starting | State::Draining => {}
            }
            let shutdown = async {
                match &self.rt {
                    Some(rt) => rt.shutdown.cancelled().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = rx.changed() => if r.is_err() { return },
                () = shutdown => return,
            }
        }
    }

    fn status(&self, w: &Worker) -> ModelStatus {
        let m = &w.cfg;
        let replicas = self.replica_statuses(w);
        let s = w.lock();
        let catalog = self.catalog.load();
        ModelStatus {
            name: m.name.clone(),
            state: if m.launcher == LauncherKind::Static { "ready" } else { s.state.as_str() },
            role: catalog.roles().iter().find(|(_, v)| v.as_deref() == Some(m.name.as_str())).map(|(r, _)| r.clone()),
            aliases: catalog.aliases_of(&m.name),
            adapters: catalog.adapters_of(&m.name),
            in_flight: w.in_flight.load(Ordering::Relaxed),
            detail: s.detail.clone(),
            launcher: m.launcher,
            version: s.instance.as_ref().and_then(|i| i.version.clone()),
            worker_id: s.instance.as_ref().map(|i| i.id.clone()),
            vram_gib: m.resources.vram_gib,
            idle_s: (s.state == State::Ready).then(|| s.last_used.elapsed().as_secs()),
            idle_timeout_s: m.idle_timeout_s,
            log_tail: s.log_tail.clone(),
            waiting: w.waiting.load(Ordering::Relaxed),
            replicas,
        }
    }

    /// The one place a state changes: logged once, counted, published.
    fn transition(&self, w: &Worker, s: &mut WState, to: State, detail: Option<String>) {
        let from = s.state;
        s.state = to;
        s.detail = detail;
        if !matches!(to, State::Pending | State::Starting) {
            s.loading_job = None;
        }
        if from != to {
            match to {
                State::Failed => {
                    tracing::error!(model = %w.cfg.name, from = from.as_str(), to = to.as_str(), detail = s.detail.as_deref().unwrap_or(""), "model state")
                }
                _ => {
                    tracing::info!(model = %w.cfg.name, from = from.as_str(), to = to.as_str(), detail = s.detail.as_deref().unwrap_or(""), "model state")
                }
            }
            if let Some(rt) = &self.rt
                && !w.leaving.load(Ordering::Acquire)
                && !w.rep.is_extra
            {
                rt.metrics.set_state(&w.cfg.name, Some(from), to);
            }
        }
        w.bump();
    }

    async fn acquire(self: &Arc<Self>, w: Arc<Worker>, user: &str) -> Result<Lease, ModelError> {
        let m = w.cfg.clone();
        let total = w.in_flight.load(Ordering::Acquire) + w.waiting.fetch_add(1, Ordering::AcqRel);
        let waiting = WaitGuard(w.clone());
        if total >= m.max_concurrency.saturating_mul(self.ready_replicas(&w).max(1)) + m.queue_len {
            let retry_after_s = if w.lock().state == State::Ready { 1 } else { 5 };
            return Err(ModelError::Overloaded {
                model: m.name.clone(),
                in_flight: w.in_flight.load(Ordering::Relaxed),
                queue: m.queue_len,
                retry_after_s,
            });
        }
        if m.launcher == LauncherKind::Static {
            w.in_flight.fetch_add(1, Ordering::AcqRel);
            drop(waiting);
            let permit = Some(w.permits.acquire(user).await);
            return Ok(Lease {
                model: m.name.clone(),
                base_url: m.url.clone().unwrap_or_default().trim_end_matches('/').to_string(),
                api_key: m.api_key.clone(),
                version: None,
                _guard: InFlightGuard { worker: w, _permit: permit, _instance: None, route: None, alive_before: AtomicU64::new(u64::MAX) },
            });
        }
        let Some(rt) = &self.rt else {
            return Err(ModelError::Unavailable {
                model: m.name.clone(),
                reason: "on-demand workers are not running in this process".into(),
            });
        };
        let deadline = Instant::now() + Duration::from_secs(m.load_timeout_s);
        let mut rx = w.changed.subscribe();
        let mut mine: Option<u64> = None;
        let instance = loop {
            rx.borrow_and_update();
            {
                let mut s = w.lock();
                if let (Some(a), Some((failed, msg))) = (mine, &s.outcome)
                    && *failed == a
                {
                    return Err(ModelError::Unavailable { model: m.name.clone(), reason: msg.clone() });
                }
                match s.state {
                    State::Ready => {
                        if let Some(i) = s.instance.clone() {
                            // Counted under the lock, so a drain that starts now waits for us.
                            w.in_flight.fetch_add(1, Ordering::AcqRel);
                            s.last_used = Instant::now();
                            break i;
                        }
                    }
                    State::Failed if s.retry_at.is_some_and(|t| t > Instant::now()) => {
                        let secs = s.retry_at.map(|t| t.saturating_duration_since(Instant::now()).as_secs() + 1).unwrap_or(0);
                        // One line for the caller; the worker's log lines are for admins
                        // (`gpuhub models`): they can hold other callers' prompts.
                        let reason = format!(
                            "{}; gpuhub retries in {secs}s (or an admin runs `gpuhub models load {}`; `gpuhub models` shows admins the worker's log)",
                            s.detail.clone().unwrap_or_else(|| "it failed".into()),
                            m.name
                        );
                        return Err(ModelError::Unavailable { model: m.name.clone(), reason });
                    }
                    State::Unloaded | State::Failed => {
                        s.attempt += 1;
                        mine = Some(s.attempt);
                        let first = if m.launcher == LauncherKind::Slurm { State::Pending } else { State::Starting };
                        self.transition(&w, &mut s, first, Some("placing: checking GPU memory".into()));
                        let (me, w2, attempt) = (self.clone(), w.clone(), s.attempt);
                        rt.tasks.spawn(async move { me.load(w2, attempt).await });
                    }
                    State::Pending | State::Starting | State::Draining => {
                        if mine.is_none() && s.state != State::Draining {
                            mine = Some(s.attempt);
                        }
                    }
                }
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(ModelError::Unavailable { model: m.name.clone(), reason: "the agent is shutting down".into() }) },
                () = tokio::time::sleep_until(deadline) => return Err(ModelError::LoadTimeout { model: m.name.clone(), seconds: m.load_timeout_s }),
            }
        };
        drop(waiting);
        // Least outstanding among the model's ready replicas; its own concurrency slots.
        let (target, instance, route) = self.route(&w, instance);
        let permit =
            match tokio::time::timeout_at(deadline.max(Instant::now() + Duration::from_secs(60)), target.permits.acquire(user)).await {
                Ok(p) => Some(p),
                _ => {
                    // Give back the count taken above; the guard below would do it, but no lease.
                    w.in_flight.fetch_sub(1, Ordering::AcqRel);
                    w.bump();
                    return Err(ModelError::Overloaded {
                        model: m.name.clone(),
                        in_flight: m.max_concurrency,
                        queue: m.queue_len,
                        retry_after_s: 1,
                    });
                }
            };
        Ok(Lease {
            model: m.name.clone(),
            base_url: instance.base_url().unwrap_or_default().to_string(),
            api_key: Some(instance.api_key.clone()),
            version: instance.version.clone(),
            _guard: InFlightGuard {
                worker: w,
                _permit: permit,
                _instance: Some(instance),
                route: Some(route),
                alive_before: AtomicU64::new(u64::MAX),
            },
        })
    }

    /// [`ModelManager::reroute`]: the least outstanding of the model's ready, healthy replicas,
    /// unless that is the one `failed` went to.
    async fn reroute(self: &Arc<Self>, failed: &Lease, user: &str) -> Option<Lease> {
        let failed_route = failed._guard.route.as_ref()?;
        let w = failed._guard.worker.clone();
        let instance = {
            let mut s = w.lock();
            let i = s.instance.clone().filter(|_| s.state == State::Ready)?;
            // Counted under the lock, as in `acquire`; the guard below gives it back.
            w.in_flight.fetch_add(1, Ordering::AcqRel);
            s.last_used = Instant::now();
            i
        };
        let mut guard =
            InFlightGuard { worker: w.clone(), _permit: None, _instance: None, route: None, alive_before: AtomicU64::new(u64::MAX) };
        let (target, instance, route) = self.route(&w, instance);
        if failed_route.goes_to(&target) {
            drop(route);
            return None;
        }
        guard.route = Some(route);
        guard._instance = Some(instance.clone());
        // The caller bounds the wait (`gateway.upstream_timeout_s`).
        guard._permit = Some(target.permits.acquire(user).await);
        Some(Lease {
            model: w.cfg.name.clone(),
            base_url: instance.base_url().unwrap_or_default().to_string(),
            api_key: Some(instance.api_key.clone()),
            version: instance.version.clone(),
            _guard: guard,
        })
    }

    /// The load task: place, launch, wait for health, then supervise.
    async fn load(self: Arc<Self>, w: Arc<Worker>, attempt: u64) {
        let Some(rt) = &self.rt else { return };
        let started = Instant::now();
        // One start per model across gateways on one store; another agent's ready worker is
        // routed to instead of starting a second one ([`super::single_flight`]).
        let deadline = started + Duration::from_secs(w.cfg.load_timeout_s);
        let result = match single_flight::enter(rt.store.as_ref(), &w.cfg.name, deadline, &rt.shutdown).await {
            Err(message) => Err(LoadFailure { message, tail: Vec::new(), counts: false, instance: None }),
            Ok(flight) => {
                let uid = rt.user.as_ref().map(|u| u.uid).unwrap_or(u32::MAX);
                // An extra replica is a new job of this agent's by definition: never borrowed.
                let borrowed = if w.rep.is_extra {
                    None
                } else {
                    single_flight::borrow(rt.store.as_ref(), &rt.launchers.slurm, &rt.owner, &w.cfg, uid).await
                };
                let r = match borrowed {
                    Some(inst) => Ok((inst, None)),
                    None => self.load_inner(rt, &w).await,
                };
                flight.release().await;
                r
            }
        };
        match result {
            Ok((inst, weights)) => {
                let inst = Arc::new(inst);
                {
                    let mut s = w.lock();
                    s.instance = Some(inst.clone());
                    s.weights = weights;
                    s.last_used = Instant::now();
                    s.log_tail.clear();
                    let detail = inst.version.as_ref().map(|v| format!("version {v}"));
                    self.transition(&w, &mut s, State::Ready, detail);
                }
                rt.metrics.load_seconds(&w.cfg.name, started.elapsed().as_secs_f64());
                self.supervise(w, inst).await;
            }
            Err(LoadFailure { message, tail, counts, instance }) => {
                if let Some(inst) = &instance {
                    rt.launchers.stop(inst).await;
                    self.forget(&w.cfg.name, inst).await;
                }
                let mut s = w.lock();
                s.instance = None;
                s.weights = None;
                s.log_tail = tail;
                // Waiters get the reason in one line; the log tail stays with admins.
                s.outcome = Some((attempt, message.clone()));
                if counts {
                    s.failures += 1;
                    let backoff = rt.cfg.backoff_s.saturating_mul(1 << s.failures.saturating_sub(1).min(7)).min(600);
                    s.retry_at = Some(Instant::now() + Duration::from_secs(backoff));
                    self.transition(&w, &mut s, State::Failed, Some(message));
                } else {
                    self.transition(&w, &mut s, State::Unloaded, Some(message));
                }
            }
        }
    }

    async fn load_inner(&self, rt: &Runtime, w: &Arc<Worker>) -> Result<(Instance, Option<Weights>), LoadFailure> {
        let m = &w.cfg;
        if let Some(why) = w.given_up.get() {
            let message = format!("{why} before its worker was started; nothing was started");
            return Err(LoadFailure { message, tail: Vec::new(), counts: false, instance: None });
        }
        let user = rt.user.clone().map_err(|e| LoadFailure::new(format!("workers.user: {e}")))?;
        let evicted =
            self.place(rt, w).await.map_err(|message| LoadFailure { message, tail: Vec::new(), counts: false, instance: None })?;
        let version = self.resolve_version(rt, m).await;
        self.launch(rt, w, user, evicted, version).await
    }

    /// Starts `w`'s worker on `version` (placed already) and waits until it is ready.
    async fn launch(
        &self,
        rt: &Runtime,
        w: &Arc<Worker>,
        user: WorkerUser,
        evicted: Vec<String>,
        version: Option<String>,
    ) -> Result<(Instance, Option<Weights>), LoadFailure> {
        let m = &w.cfg;
        if let (Some(reg), Some(v)) = (weights_from_mlflow(m), version.as_deref()) {
            let mut s = w.lock();
            let now = s.state;
            let detail =
                format!("fetching the weights of `{}` version {v} from MLflow (or the artifact cache)", crate::util::sanitize(reg));
            self.transition(w, &mut s, now, Some(detail));
        }
        let weights = self.weights(rt, m, version.as_deref()).await.map_err(LoadFailure::new)?;
        // `node`: a Slurm worker binds its node's address (the job finds it), a local one loopback.
        let node_host = rt.cfg.host == launcher::slurm::NODE_HOST;
        let host = if node_host && m.launcher != LauncherKind::Slurm { "127.0.0.1".to_string() } else { rt.cfg.host.clone() };
        let port = match m.launcher {
            // A Slurm job picks its port when it starts: one picked now could be taken by
            // anyone while the job pends.
            LauncherKind::Slurm => None,
            _ => Some(launcher::pick_port(&host).map_err(|e| LoadFailure::new(format!("cannot find a free port on {host}: {e}")))?),
        };
        let api_key = launcher::new_api_key();
        let key_files = KeyFiles::locate(&rt.dir, &launcher::safe_name(&m.name), &api_key, &m.worker.key);
        key_files
            .write(&api_key, &m.worker.key, &user)
            .map_err(|e| LoadFailure::new(format!("cannot write the worker's key file {}: {e}", key_files.file.display())))?;
        let (model_path, model_file) = match &weights {
            Some(wt) => (wt.dir.display().to_string(), wt.model_file.as_ref().map(|f| f.display().to_string()).unwrap_or_default()),
            None => {
                let p = m.model_path.clone().unwrap_or_default().replace("{version}", version.as_deref().unwrap_or(""));
                (p.clone(), p)
            }
        };
        let port_s = port.map(|p| p.to_string()).unwrap_or_default();
        let key_file_s = key_files.file.display().to_string();
        let mut template = match port {
            Some(_) => m.worker.command.clone(),
            None => m.worker.command.replace("{port}", "${GPUHUB_WORKER_PORT}"),
        };
        if node_host && m.launcher == LauncherKind::Slurm {
            template = template.replace("{host}", "${GPUHUB_WORKER_HOST}");
        }
        let command = launcher::render(
            &launcher::render_adapters(&template, &m.adapters),
            &[
                ("model", &m.name),
                ("model_path", &model_path),
                ("model_file", &model_file),
                ("version", version.as_deref().unwrap_or("")),
                ("port", &port_s),
                ("host", &host),
                ("api_key_file", &key_file_s),
            ],
        );
        // A program the worker account cannot run fails here, with the directory or mode that
        // stops it, not as an exit status 126 in the worker's log.
        if let Some(program) = command.split_whitespace().next().filter(|p| p.starts_with('/'))
            && let Err(e) = user.check_exec(std::path::Path::new(program))
        {
            key_files.remove();
            return Err(LoadFailure::new(format!("the worker cannot start: {e}")));
        }
        let spec = LaunchSpec {
            model: m.name.clone(),
            command,
            env: m.worker.env.clone(),
            resources: m.resources.clone(),
            workdir: m.workdir.clone(),
            dir: rt.dir.clone(),
            host,
            port,
            api_key,
            key: m.worker.key.clone(),
            key_files: key_files.clone(),
            user,
            version,
            orphan_after_s: m.idle_timeout_s.max(15),
            exclude: w.rep.exclude(),
            proof_timeout_s: m.load_timeout_s,
            agent_exe: rt.agent_exe.clone(),
        };
        let launch_us = crate::util::now_us();
        let inst = match rt.launchers.start(m.launcher, &spec).await {
            Ok(i) => i,
            Err(e) => {
                key_files.remove();
                return Err(LoadFailure::new(launcher::secret::redact(&format!("cannot launch the worker: {e}"), &spec.api_key)));
            }
        };
        // launch_us: when sbatch (or the child) was started, for bench/models-coldstart.sh.
        tracing::info!(model = %m.name, worker = %inst.id, url = inst.base_url().unwrap_or("(from the job's .addr file)"), version = inst.version.as_deref().unwrap_or(""), launch_us, "worker launched");
        self.remember(rt, &m.name, &inst).await;
        {
            let mut s = w.lock();
            let detail = if evicted.is_empty() { None } else { Some(format!("unloaded idle {} to make room", evicted.join(", "))) };
            let to = if m.launcher == LauncherKind::Slurm { State::Pending } else { State::Starting };
            let detail = detail.or_else(|| (to == State::Pending).then(|| format!("Slurm job {} submitted", inst.id)));
            self.transition(w, &mut s, to, detail);
            s.loading_job = Some(inst.id.clone());
        }
        match self.wait_ready(rt, w, &inst, Instant::now() + Duration::from_secs(m.load_timeout_s)).await {
            Ok(()) => {
                // The address is known now (a Slurm job's .addr file): remember it for adoption.
                self.remember(rt, &m.name, &inst).await;
                Ok((inst, weights))
            }
            Err((message, counts)) => Err(LoadFailure {
                message: launcher::secret::redact(&message, &inst.api_key),
                tail: launcher::log_tail(&inst.log_path, LOG_TAIL_LINES, &inst.api_key),
                counts,
                instance: Some(inst),
            }),
        }
    }

    /// Polls health from 2 ms, backing off to 10 ms (100 ms after 30 s); checks the launcher
    /// every 250 ms. The probe carries the worker's key, and a worker is ready only when its
    /// health path answers 2xx with it and, on this node, every socket listening on its port
    /// belongs to the worker account: a process of another user there (a squatter) fails the
    /// load at once with its uid, and is never forwarded a call.
    async fn wait_ready(&self, rt: &Runtime, w: &Worker, inst: &Instance, deadline: Instant) -> Result<(), (String, bool)> {
        let m = &w.cfg;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build().unwrap_or_default();
        let mut delay = Duration::from_millis(2);
        let started = Instant::now();
        let mut next_poll = Instant::now();
        let mut last: Option<RunState> = None;
        let mut warned_remote = false;
        // Whose processes hold the port's sockets, once looked up; `sibling`: another worker's
        // process found there (two workers picked one free port).
        let mut holders = PortHolders::default();
        let mut sibling: Option<u32> = None;
        loop {
            if rt.shutdown.is_cancelled() {
                return Err(("the agent is shutting down".into(), false));
            }
            // Given up while it waits (checked against the last look at the job): a queued job
            // would hold its place in the queue (and later a GPU) only to be stopped once
            // ready; an extra replica nobody routes to is not waited for while it loads either.
            // A primary that runs already finishes its load for the calls that wait for it.
            if let Some(why) = w.given_up.get() {
                let queued = matches!(last, Some(RunState::Pending(_)));
                if queued || (w.rep.is_extra && last == Some(RunState::Running)) {
                    let what = if w.rep.is_extra { format!("the replica was not needed any more ({why})") } else { why.clone() };
                    let how = if queued { "still queued" } else { "still starting" };
                    return Err((format!("{what} while its Slurm job {} was {how}; the job is cancelled", inst.id), false));
                }
            }
            if Instant::now() >= next_poll {
                next_poll = Instant::now() + Duration::from_millis(250);
                let run = rt.launchers.poll(inst).await;
                if last.as_ref() != Some(&run) {
                    match &run {
                        RunState::Pending(reason) => {
                            // Waiting for GPUs or shards: say who holds them and until when.
                            let held = if reason == "Resources" {
                                format!("; {}", self.holders(rt, w, &self.room(rt, Some(w), &[])).await)
                            } else {
                                String::new()
                            };
                            let mut s = w.lock();
                            self.transition(w, &mut s, State::Pending, Some(format!("Slurm job {} pending: {reason}{held}", inst.id)));
                        }
                        RunState::Running => {
                            let mut s = w.lock();
                            if s.state != State::Starting {
                                self.transition(
                                    w,
                                    &mut s,
                                    State::Starting,
                                    Some(format!("worker {} running; waiting for {}", inst.id, m.worker.health_path)),
                                );
                            }
                        }
                        RunState::Gone(how) => {
                            if let (Some(pid), Some(base)) = (sibling, inst.base_url()) {
                                // Not the model's fault: no back-off, the next call starts another.
                                return Err((
                                    format!(
                                        "the worker ended before it was ready: {how}; its port ({base}) was taken by another worker's process (pid {pid}) of the worker account first; the next call starts it on another port"
                                    ),
                                    false,
                                ));
                            }
                            let squatter =
                                inst.base_url().and_then(|u| squatter(u, inst.uid)).map(|s| format!("; {s}")).unwrap_or_default();
                            return Err((format!("the worker ended before it was ready: {how}{squatter}"), true));
                        }
                    }
                    last = Some(run);
                }
            }
            if inst.base_url().is_none() && inst.launcher == LauncherKind::Slurm {
                // The job writes its address when it starts (one stat per poll until then).
                match rt.launchers.slurm.read_addr(&m.name, &inst.id, inst.uid) {
                    Ok(Some(url)) => inst.set_base_url(url),
                    Ok(None) => {}
                    Err(e) => return Err((format!("the worker's address file is not trustworthy: {e}"), true)),
                }
            }
            if let Some(base) = inst.base_url() {
                // Polled even while Slurm still says pending: squeue is checked only every
                // 250 ms, and a refused connection costs microseconds. Only once something
                // listens is its owner checked, and only the worker account's listener is
                // sent the key: a squatter never sees it.
                let addr = proof::host_port(base);
                let listening = match &addr {
                    Some((host, port)) => {
                        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect((host.as_str(), *port)))
                            .await
                            .is_ok_and(|c| c.is_ok())
                    }
                    None => true,
                };
                // One look at the port's sockets serves both checks: whose they are, and whose
                // processes hold them.
                let (mut owner, listeners) = match if listening { port_listeners(base) } else { None } {
                    Some(Ok(l)) => (Some(Ok(proof::owner_of(&l, inst.uid))), l),
                    Some(Err(e)) => (Some(Err(e)), Vec::new()),
                    None => (None, Vec::new()),
                };
                if listening && owner.is_none() && inst.launcher == LauncherKind::Slurm {
                    // On another node: the job's own proof of its port, from that node.
                    owner = match addr.as_ref().map(|(_, port)| rt.launchers.slurm.read_proof(&m.name, &inst.id, inst.uid, *port)) {
                        Some(Ok(None)) | None => Some(Ok(PortOwner::Nobody)),
                        Some(Ok(Some(launcher::slurm::Proof::Worker))) => Some(Ok(PortOwner::Worker)),
                        Some(Ok(Some(launcher::slurm::Proof::Other { uid }))) => Some(Ok(PortOwner::Other { uid })),
                        Some(Err(e)) => return Err((format!("the worker's port proof is not trustworthy: {e}"), true)),
                    };
                }
                match owner {
                    Some(Ok(PortOwner::Other { uid })) => {
                        let user = crate::control::peer::user_name(uid).map(|n| format!(" `{n}`")).unwrap_or_default();
                        return Err((
                            format!(
                                "the port of worker {} ({base}) is held by another user's process (uid {uid}{user}), not by the worker's account (uid {}); it was never marked ready and got no call; the next start picks another port",
                                inst.id, inst.uid
                            ),
                            true,
                        ));
                    }
                    Some(Err(e)) => {
                        return Err((
                            format!("cannot check who listens on the worker's port ({base}): {e}; /proc/net/tcp must be readable"),
                            true,
                        ));
                    }
                    Some(Ok(PortOwner::Nobody)) => {}
                    // The worker account's socket, but another worker's: never this model's.
                    Some(Ok(PortOwner::Worker)) if let Some(pid) = other_workers_port(inst, &listeners, &mut holders) => {
                        if sibling.is_none() {
                            tracing::warn!(model = %m.name, worker = %inst.id, url = %base, pid, "another worker's process listens on this worker's port; waiting for this worker to bind it or end");
                        }
                        sibling = Some(pid);
                    }
                    Some(Ok(PortOwner::Worker)) | None if listening => {
                        if owner.is_none() && !warned_remote {
                            tracing::warn!(model = %m.name, url = %base, "worker on another host: the owner of its port cannot be checked; trusting its key");
                            warned_remote = true;
                        }
                        let url = format!("{base}{}", m.worker.health_path);
                        if let Ok(r) = http.get(&url).bearer_auth(&inst.api_key).send().await
                            && r.status().is_success()
                        {
                            return Ok(());
                        }
                    }
                    _ => {}
                }
            }
            if Instant::now() >= deadline {
                let squatter = match sibling {
                    Some(pid) => format!("; a process of the worker account that is not this worker's (pid {pid}) held its port"),
                    None => inst.base_url().and_then(|u| squatter(u, inst.uid)).map(|s| format!("; {s}")).unwrap_or_default(),
                };
                return Err((
                    format!(
                        "the worker did not answer {} within {}s (load_timeout_s); it was stopped{squatter}",
                        m.worker.health_path, m.load_timeout_s
                    ),
                    // Another worker on its port is not the model's fault: no back-off.
                    sibling.is_none(),
                ));
            }
            tokio::time::sleep(delay.min(deadline.saturating_duration_since(Instant::now()))).await;
            delay = next_readiness_delay(delay, started.elapsed());
        }
    }

    /// Watches a ready worker: crash → restart on the next call (or failed after repeated
    /// crashes); idle past `idle_timeout_s` with nothing in flight → unload.
    async fn supervise(self: &Arc<Self>, w: Arc<Worker>, mut inst: Arc<Instance>) {
        let Some(rt) = &self.rt else { return };
        let period = if inst.launcher == LauncherKind::Slurm { Duration::from_millis(1000) } else { Duration::from_millis(200) };
        let idle = Duration::from_secs(w.cfg.idle_timeout_s);
        let stable_after = Duration::from_secs(60);
        let mut ready_at = Instant::now();
        let mut uses = single_flight::UseTracker::default();
        loop {
            let suspect = tokio::select! {
                () = rt.shutdown.cancelled() => return,
                () = tokio::time::sleep(period) => false,
                () = w.suspect.notified() => true,
            };
            {
                let s = w.lock();
                let current = s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, &inst));
                if !current || !matches!(s.state, State::Ready) {
                    return; // unloaded or draining by someone else; they stop the worker
                }
            }
            let run = rt.launchers.poll(&inst).await;
            // A call could not reach it: gone if its port is closed, or no longer its own alone,
            // while its job runs on (a wrapper that outlives its server); the job is stopped.
            let lost = match &run {
                RunState::Gone(_) => None,
                _ if suspect => still_holds_port(&inst).await.err(),
                _ => None,
            };
            // A stop that is not the worker's own failure does not count toward the back-off.
            let worker_failed = lost.as_ref().is_none_or(PortLost::worker_failed);
            let gone = match (run, lost) {
                (RunState::Gone(how), _) => Some(how),
                (_, Some(why)) => {
                    // Another agent's worker is its owner's to stop (`stop` leaves it alone):
                    // the owner is told, and checks it itself.
                    rt.launchers.stop(&inst).await;
                    single_flight::report_unreachable(rt.store.as_ref(), &inst).await;
                    Some(match inst.borrowed_from {
                        None => format!("its server stopped holding its port while the job ran; the job was stopped ({why})"),
                        Some(_) => format!("its server stopped holding its port while the job ran ({why})"),
                    })
                }
                _ => {
                    if suspect {
                        // The call that could not reach it is told to give up (`worker_gone`).
                        w.found_alive.fetch_add(1, Ordering::AcqRel);
                        w.bump();
                    }
                    None
                }
            };
            if let Some(how) = gone {
                let tail = launcher::log_tail(&inst.log_path, LOG_TAIL_LINES, &inst.api_key);
                self.forget(&w.cfg.name, &inst).await;
                let mut s = w.lock();
                if !s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, &inst)) || s.state != State::Ready {
                    return;
                }
                if let Some(owner) = &inst.borrowed_from {
                    s.instance = None;
                    let detail = Some(format!("the worker of agent {owner} stopped ({how}); the next call finds or starts another"));
                    self.transition(&w, &mut s, State::Unloaded, detail);
                    return;
                }
                if !w.rep.is_extra
                    && let Some((next, node)) = self.promote_replica(&w)
                {
                    // Another replica serves on: the model stays ready.
                    s.instance = Some(next.clone());
                    s.log_tail = tail;
                    let detail = format!(
                        "worker {} died ({how}); replica {} on {} serves on",
                        inst.id,
                        next.id,
                        node.as_deref().unwrap_or("its node")
                    );
                    self.transition(&w, &mut s, State::Ready, Some(detail));
                    drop(s);
                    inst = next;
                    ready_at = Instant::now();
                    continue;
                }
                if ready_at.elapsed() > stable_after {
                    s.failures = 0;
                }
                s.instance = None;
                s.weights = None;
                s.log_tail = tail;
                if !worker_failed {
                    let detail = format!("worker stopped ({how}); not counted toward max_restarts; it restarts on the next call");
                    self.transition(&w, &mut s, State::Unloaded, Some(detail));
                    return;
                }
                s.failures += 1;
                if s.failures >= rt.cfg.max_restarts.max(1) {
                    let backoff = rt.cfg.backoff_s.saturating_mul(1 << s.failures.saturating_sub(1).min(7)).min(600);
                    s.retry_at = Some(Instant::now() + Duration::from_secs(backoff));
                    let failures = s.failures;
                    self.transition(&w, &mut s, State::Failed, Some(format!("worker crashed {failures} times in a row (last: {how})")));
                } else {
                    self.transition(&w, &mut s, State::Unloaded, Some(format!("worker crashed ({how}); it restarts on the next call")));
                }
                return;
            }
            if let Some(owner) = &inst.borrowed_from
                && !single_flight::still_offered(rt.store.as_ref(), &rt.owner, &w.cfg.name, &inst.id).await
            {
                // Its owner is stopping it (a switch, an unload): new calls go elsewhere, the
                // calls in flight finish there, their use recorded so the owner waits for them.
                {
                    let mut s = w.lock();
                    if s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, &inst)) && s.state == State::Ready {
                        s.instance = None;
                        let detail = format!(
                            "agent {owner} withdrew worker {} (it drains); the next call finds its newer worker or starts one",
                            inst.id
                        );
                        self.transition(&w, &mut s, State::Unloaded, Some(detail));
                    }
                }
                let deadline = Instant::now() + Duration::from_secs(rt.cfg.drain_timeout_s);
                single_flight::hold_while_in_flight(rt.store.clone(), inst, deadline, rt.shutdown.clone()).await;
                return;
            }
            self.tick_replicas(rt, &w).await;
            let (idle_for, busy) = (w.lock().last_used.elapsed(), w.busy());
            // Calls through other gateways count too (a borrowed worker records its own here).
            let elsewhere = uses.used_elsewhere(rt.store.as_ref(), &inst, idle_for, busy, idle).await;
            if !busy && idle_for >= idle && !elsewhere && self.may_idle_unload(&w) {
                self.unload(&w, &format!("idle for {}s (idle_timeout_s)", idle.as_secs())).await;
                return;
            }
        }
    }

    /// Drains (waits for in-flight calls, at most `workers.drain_timeout_s`) and stops.
    async fn unload(&self, w: &Arc<Worker>, reason: &str) -> bool {
        let Some(draining) = self.start_drain(w, reason) else { return false };
        self.drain_and_stop(w, draining, reason).await;
        true
    }

    /// A ready worker takes no new call from now on (state draining): the first half of
    /// [`Shared::unload`], for a caller that must know no call is routed there once it returns.
    fn start_drain(&self, w: &Arc<Worker>, reason: &str) -> Option<Draining> {
        self.rt.as_ref()?;
        let changed = w.changed.subscribe();
        let mut s = w.lock();
        let inst = s.instance.clone()?;
        if s.state != State::Ready {
            return None;
        }
        self.transition(w, &mut s, State::Draining, Some(format!("{reason}; draining")));
        Some(Draining { inst, changed })
    }

    /// The second half of [`Shared::unload`]: waits for the calls in flight, then stops.
    async fn drain_and_stop(&self, w: &Arc<Worker>, draining: Draining, reason: &str) {
        let Some(rt) = &self.rt else { return };
        if !w.rep.is_extra {
            // Before this worker frees its GPU: Slurm would give it to a queued replica.
            self.give_up_loading_replicas(w, reason).await;
        }
        let Draining { inst, changed: mut rx } = draining;
        let withdrawn = single_flight::withdraw(rt.store.as_ref(), &rt.owner, &w.cfg.name, &inst).await;
        let deadline = Instant::now() + Duration::from_secs(rt.cfg.drain_timeout_s);
        while w.in_flight.load(Ordering::Acquire) > 0 {
            tokio::select! {
                _ = rx.changed() => {}
                () = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(model = %w.cfg.name, in_flight = w.in_flight.load(Ordering::Relaxed), "drain timeout; stopping the worker with calls in flight");
                    break;
                }
            }
        }
        single_flight::wait_for_borrowers(rt.store.as_ref(), &rt.owner, &inst, withdrawn, deadline, &rt.shutdown).await;
        rt.launchers.stop(&inst).await;
        self.forget(&w.cfg.name, &inst).await;
        if !w.rep.is_extra {
            Box::pin(self.stop_replicas(w, reason)).await;
        }
        let mut s = w.lock();
        if s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, &inst)) {
            s.instance = None;
            s.weights = None;
            s.failures = 0;
            self.transition(w, &mut s, State::Unloaded, Some(reason.to_string()));
        }
    }

    /// Makes room for `w` on the GPUs: evicts idle workers, least recently used first, until
    /// it fits on one GPU (or on `resources.gpus` GPUs), never on the sum of several.
    /// Returns the evicted names, or the message for the caller's 503.
    async fn place(&self, rt: &Runtime, w: &Arc<Worker>) -> Result<Vec<String>, String> {
        let need = w.cfg.resources.vram_gib;
        if need <= 0.0 {
            return Ok(Vec::new());
        }
        let gpus_wanted = w.cfg.resources.gpus;
        let _one_at_a_time = rt.placement.lock().await;
        let mut evicted = Vec::new();
        let mut evicted_jobs: Vec<String> = Vec::new();
        loop {
            let room = self.room(rt, Some(w), &evicted_jobs);
            if room.fits(need, gpus_wanted) {
                if !evicted.is_empty() {
                    tracing::info!(model = %w.cfg.name, evicted = %evicted.join(", "), "unloaded idle models to make room");
                }
                return Ok(evicted);
            }
            if let Some(message) = room.never_fits(need, gpus_wanted) {
                return Err(message);
            }
            let mut candidates: Vec<(Instant, Arc<Worker>, Option<Arc<Instance>>)> = self
                .all_workers()
                .into_iter()
                // An extra replica's calls are counted on its model's first one: never a victim.
                .filter(|o| o.cfg.name != w.cfg.name && !o.rep.is_extra && o.cfg.resources.vram_gib > 0.0 && !o.busy())
                .filter_map(|o| {
                    let s = o.lock();
                    // Another agent's worker holds nothing here: unloading it frees no room.
                    (s.state == State::Ready && s.holds_gpu_here()).then(|| (s.last_used, o.clone(), s.instance.clone()))
                })
                .collect();
            // Calls through other gateways count as use too (they record it in the store).
            if let Some(store) = &rt.store {
                let now_us = crate::util::now_us();
                for (t, _, inst) in &mut candidates {
                    let Some(inst) = inst else { continue };
                    if let Ok(Some(us)) = store.worker_last_used(launcher_name(inst.launcher), &inst.id).await
                        && let Some(there) = Instant::now().checked_sub(Duration::from_micros(u64::try_from(now_us - us).unwrap_or(0)))
                    {
                        *t = (*t).max(there);
                    }
                }
            }
            let victim = candidates.into_iter().min_by_key(|(t, _, _)| *t).map(|(_, o, _)| o);
            let Some(victim) = victim else {
                return Err(self.no_room_message(rt, w, need, &room).await);
            };
            tracing::info!(model = %w.cfg.name, victim = %victim.cfg.name, need_gib = need, room = %room.summary(), "evicting the least recently used idle model");
            rt.metrics.evicted(&victim.cfg.name);
            let job = victim.lock().instance.as_ref().map(|i| i.id.clone());
            if self.unload(&victim, &format!("evicted to make room for `{}`", w.cfg.name)).await {
                evicted.push(format!("`{}`", victim.cfg.name));
                evicted_jobs.extend(job);
            }
        }
    }

    /// The GPU memory (GiB, by the catalog's `vram_gib`) that the workers counting against
    /// `w`'s room hold or are loading into (`w` `None`: every worker counts).
    fn held_gib(&self, w: Option<&Worker>) -> f64 {
        self.all_workers()
            .iter()
            .filter(|o| w.is_none_or(|w| counts_against(o, w)) && o.lock().holds_gpu_here())
            .map(|o| o.cfg.resources.vram_gib)
            .sum()
    }

    /// The room for a new worker: the `workers.vram_gib` budget left, and each GPU's free
    /// memory (NVML's, less what workers still loading will take; plus what the jobs in
    /// `evicted` still hold, which NVML's last sample may not have seen leave).
    fn room(&self, rt: &Runtime, w: Option<&Worker>, evicted: &[String]) -> Room {
        let budget_gib = rt.cfg.vram_gib.map(|b| b - self.held_gib(w));
        // An extra replica Slurm keeps off this node: this node's GPUs are not its room, only
        // the budget is.
        if w.is_some_and(|w| kept_off(w, &rt.owner)) {
            return Room { budget_gib, gpus: Vec::new() };
        }
        let mut gpus: Vec<GpuRoom> = (rt.gpus)()
            .into_iter()
            .map(|g| {
                let (gone, jobs): (Vec<GpuJob>, Vec<GpuJob>) = g.jobs.into_iter().partition(|j| evicted.contains(&j.job_id.to_string()));
                let back: u64 = gone.iter().map(|j| j.vram_bytes).sum();
                let total_gib = g.memory_total_bytes as f64 / GIB;
                let nvml_free_gib = g.memory_free_bytes as f64 / GIB;
                GpuRoom {
                    index: g.index,
                    total_gib,
                    nvml_free_gib,
                    free_gib: ((g.memory_free_bytes + back) as f64 / GIB).min(total_gib),
                    jobs,
                }
            })
            .collect();
        // Workers still loading are not in NVML's numbers yet: each takes its share on the
        // GPUs with the most room (where Slurm's first fit is likely to put it).
        if !gpus.is_empty() {
            for o in self.all_workers().iter().filter(|o| w.is_none_or(|w| counts_against(o, w)) && o.cfg.resources.vram_gib > 0.0) {
                if !matches!(o.lock().state, State::Pending | State::Starting) {
                    continue;
                }
                let n = (o.cfg.resources.gpus.max(1) as usize).min(gpus.len());
                let per = o.cfg.resources.vram_gib / n as f64;
                gpus.sort_by(|a, b| b.free_gib.total_cmp(&a.free_gib));
                for g in gpus.iter_mut().take(n) {
                    g.free_gib -= per;
                }
            }
            gpus.sort_by_key(|g| g.index);
        }
        Room { budget_gib, gpus }
    }

    /// The 503 for a model that does not fit: the numbers per GPU, what holds each GPU (model
    /// or Slurm job, user, since when, until when), and what to do.
    async fn no_room_message(&self, rt: &Runtime, w: &Worker, need: f64, room: &Room) -> String {
        let n = w.cfg.resources.gpus.max(1);
        let numbers = if let Some(b) = room.budget_gib.filter(|b| need > b + 1e-9) {
            format!("it needs {need:.1} GiB of GPU memory but only {:.1} GiB of workers.vram_gib is free", b.max(0.0))
        } else if n == 1 {
            let sum: f64 = room.gpus.iter().map(|g| g.free_gib.max(0.0)).sum();
            let all = if sum + 1e-9 >= need {
                format!(" ({sum:.1} GiB free in all, but a model runs on one GPU unless it asks for several with resources.gpus)")
            } else {
                String::new()
            };
            format!("it needs {need:.1} GiB of GPU memory on one GPU and no GPU has that much free: {}{all}", room.per_gpu())
        } else {
            format!(
                "it needs {need:.1} GiB of GPU memory on {n} GPUs ({:.1} GiB each) and fewer GPUs have that much free: {}",
                need / f64::from(n),
                room.per_gpu()
            )
        };
        let held = self.holders(rt, w, room).await;
        format!(
            "{numbers}; no idle model can be unloaded; {held}; retry when they free it, or free memory with `gpuhub models unload NAME`"
        )
    }

    /// What holds the GPUs, for messages: per GPU (from NVML's per-job view) gpuhub's own
    /// workers by model and other Slurm jobs by id, user, since when and until when (the
    /// model's idle timeout, the job's time limit); without NVML, gpuhub's workers and the
    /// running Slurm jobs that hold GPUs or shards.
    async fn holders(&self, rt: &Runtime, w: &Worker, room: &Room) -> String {
        let mine: Vec<(Arc<Worker>, Arc<Instance>)> = self
            .all_workers()
            .into_iter()
            .filter(|o| counts_against(o, w))
            .filter_map(|o| {
                let s = o.lock();
                s.holds_gpu_here().then(|| s.instance.clone().map(|i| (o.clone(), i))).flatten()
            })
            .collect();
        let on_gpus: Vec<String> = room.gpus.iter().flat_map(|g| g.jobs.iter().map(|j| j.job_id.to_string())).collect();
        let uses_slurm = self.all_workers().iter().any(|o| o.cfg.launcher == LauncherKind::Slurm);
        let slurm = if !on_gpus.is_empty() {
            let mut ids = on_gpus.clone();
            ids.sort();
            ids.dedup();
            rt.launchers.slurm.holder_jobs(Some(&ids)).await.unwrap_or_default()
        } else if room.gpus.is_empty() && uses_slurm {
            rt.launchers.slurm.holder_jobs(None).await.unwrap_or_default()
        } else {
            Vec::new()
        };
        let describe_mine = |o: &Worker, inst: &Instance| -> String {
            let s = o.lock();
            let in_flight = o.in_flight.load(Ordering::Relaxed) + o.waiting.load(Ordering::Relaxed);
            let job = slurm.iter().find(|j| j.id == inst.id);
            let who = match (inst.launcher, job) {
                (LauncherKind::Slurm, Some(j)) => format!("Slurm job {} of {}", inst.id, crate::util::sanitize(&j.user)),
                (LauncherKind::Slurm, None) => format!("Slurm job {}", inst.id),
                _ => format!("pid {}", inst.id),
            };
            let since = crate::util::utc_time(inst.started_us / 1_000_000);
            let idle = o.cfg.idle_timeout_s;
            let until = match s.state {
                State::Ready if in_flight == 0 => {
                    let left = idle.saturating_sub(s.last_used.elapsed().as_secs());
                    format!(
                        "frees when idle for {idle}s (idle_timeout_s), at {} if no call comes",
                        crate::util::utc_time(crate::util::now_s() + left as i64)
                    )
                }
                State::Ready => format!("{in_flight} calls in flight; frees {idle}s after its last call (idle_timeout_s)"),
                other => format!("{}; frees {idle}s after its last call (idle_timeout_s)", other.as_str()),
            };
            let limit = job
                .filter(|j| !matches!(j.end.as_str(), "" | "Unknown" | "NONE" | "N/A"))
                .map(|j| format!(", or at its Slurm time limit at {}", j.end))
                .unwrap_or_default();
            format!("model `{}` ({who}, {:.1} GiB) since {since}, {until}{limit}", o.cfg.name, o.cfg.resources.vram_gib)
        };
        let mut parts = Vec::new();
        let mut placed: Vec<String> = Vec::new();
        for g in &room.gpus {
            let mut on = Vec::new();
            let mut attributed = 0u64;
            for j in &g.jobs {
                let id = j.job_id.to_string();
                attributed += j.vram_bytes;
                if let Some((o, inst)) = mine.iter().find(|(_, i)| i.launcher == LauncherKind::Slurm && i.id == id) {
                    on.push(describe_mine(o, inst));
                    placed.push(id);
                } else if let Some(h) = slurm.iter().find(|h| h.id == id) {
                    on.push(h.describe());
                } else {
                    let user = if j.user.is_empty() { "an unknown user".to_string() } else { crate::util::sanitize(&j.user) };
                    on.push(format!("Slurm job {id} of {user} ({:.1} GiB)", j.vram_bytes as f64 / GIB));
                }
            }
            let used = g.total_gib - g.nvml_free_gib;
            let other = used - attributed as f64 / GIB;
            if other > 0.5 {
                on.push(format!("processes outside Slurm jobs ({other:.1} GiB)"));
            }
            if !on.is_empty() {
                parts.push(format!("GPU {} is held by {}", g.index, on.join(" and ")));
            }
        }
        let rest: Vec<String> = mine.iter().filter(|(_, i)| !placed.contains(&i.id)).map(|(o, i)| describe_mine(o, i)).collect();
        if !rest.is_empty() {
            parts.push(format!("gpuhub's workers: {}", rest.join("; ")));
        }
        if room.gpus.is_empty() {
            let others: Vec<String> = slurm.iter().filter(|h| !mine.iter().any(|(_, i)| i.id == h.id)).map(|h| h.describe()).collect();
            if !others.is_empty() {
                parts.push(format!("Slurm jobs holding GPUs: {}", others.join("; ")));
            }
        }
        if parts.is_empty() { "nothing gpuhub can see holds the GPUs".to_string() } else { parts.join("; ") }
    }

    /// The weights of the version about to start, when they come from MLflow: an entry with
    /// `mlflow_model` and no `model_path` whose command starts on `{model_path}` or
    /// `{model_file}` (every registry-tagged model). `None`: the entry names its own weights.
    async fn weights(&self, rt: &Runtime, m: &ModelConfig, version: Option<&str>) -> Result<Option<Weights>, String> {
        let cmd = &m.worker.command;
        let Some(registered) = weights_from_mlflow(m) else { return Ok(None) };
        let reg = crate::util::sanitize(registered);
        let Some(mlflow) = &rt.mlflow else {
            return Err(format!("its weights come from MLflow (`{reg}`) and mlflow.tracking_uri is not set"));
        };
        let Some(version) = version else {
            return Err(format!(
                "MLflow registered model `{reg}` has no @production version to serve; set one (`gpuhub models promote {} VERSION`)",
                m.name
            ));
        };
        let cache =
            rt.artifacts.as_ref().map_err(|e| format!("its weights come from MLflow and the artifact cache cannot be used: {e}"))?;
        let w = cache.fetch(mlflow, registered, version).await.map_err(|e| e.to_string())?;
        if cmd.contains("{model_file}") && w.model_file.is_none() {
            let found = if w.weight_files.is_empty() { "none".to_string() } else { w.weight_files.join(", ") };
            return Err(format!(
                "its command starts on {{model_file}}, one weights file, and version {version} of `{reg}` has {} ({found}); log exactly one weights file (.gguf, .safetensors, ...) with the version",
                w.weight_files.len()
            ));
        }
        Ok(Some(w))
    }

    /// The version gpuhub promoted; before any promotion, `@production` for the worker about to
    /// start (the last known version when MLflow is down).
    async fn resolve_version(&self, rt: &Runtime, m: &ModelConfig) -> Option<String> {
        let name = m.mlflow_model.as_deref()?;
        // The version gpuhub promoted wins over whatever the alias says now.
        if let Some(v) = self.promoted.version(name) {
            return Some(v);
        }
        let Some(mlflow) = &rt.mlflow else {
            tracing::warn!(model = %m.name, "mlflow_model is set but mlflow.tracking_uri is not; starting without a version");
            return None;
        };
        let cached = || rt.versions.lock().unwrap_or_else(|p| p.into_inner()).get(name).cloned();
        match mlflow.production_version(name).await {
            Ok(Some(v)) => {
                rt.versions.lock().unwrap_or_else(|p| p.into_inner()).insert(name.to_string(), v.clone());
                Some(v)
            }
            Ok(None) => {
                tracing::warn!(model = %m.name, mlflow_model = name, "no @production alias in MLflow; starting the last known version");
                cached()
            }
            Err(e) => {
                tracing::warn!(model = %m.name, error = %e, "cannot resolve @production; starting the last known version");
                cached()
            }
        }
    }

    async fn remember(&self, rt: &Runtime, model: &str, inst: &Instance) {
        let Some(store) = &rt.store else { return };
        let row = WorkerRow {
            owner: rt.owner.clone(),
            model: model.to_string(),
            launcher: launcher_name(inst.launcher).into(),
            instance_id: inst.id.clone(),
            base_url: inst.base_url().unwrap_or_default().to_string(),
            api_key: inst.api_key.clone(),
            version: inst.version.clone(),
            log_path: inst.log_path.display().to_string(),
            started_us: inst.started_us,
        };
        if let Err(e) = store.put_worker(&row).await {
            tracing::error!(model, worker = %inst.id, error = %e, "cannot record the worker; after an agent restart it will be cancelled instead of adopted");
        }
        // A Slurm worker's job is billed to the callers it serves (docs/accounting.md,
        // "Inference"): accounting knows it by this row, not by the job's name.
        if inst.launcher == LauncherKind::Slurm
            && let Ok(job_id) = inst.id.parse::<i64>()
            && let Err(e) = store.record_worker_job(job_id, model, i64::from(inst.uid), inst.started_us).await
        {
            tracing::error!(model, worker = %inst.id, error = %e, "cannot record the worker's Slurm job; its GPU time will be billed to the worker account, not to its callers");
        }
    }

    /// The worker is gone: its key file goes, and the store forgets it.
    async fn forget(&self, model: &str, inst: &Instance) {
        if let Some(k) = &inst.key_files {
            k.remove();
        }
        let Some(rt) = self.rt.as_ref() else { return };
        let Some(store) = rt.store.as_ref() else { return };
        single_flight::forget(Some(store), inst).await;
        if let Err(e) = store.delete_worker(&rt.owner, model, &inst.id).await {
            tracing::error!(model, worker = %inst.id, error = %e, "cannot forget a stopped worker");
        }
    }

    /// Every 30 s, apart from the heartbeat (which nothing may delay): cancels again the worker
    /// jobs whose `scancel` failed, and stops the workers set aside at start that no registry
    /// read has settled within [`DEFERRED_MAX`].
    fn maintain(self: &Arc<Self>) {
        let Some(rt) = &self.rt else { return };
        let (me, token) = (self.clone(), rt.shutdown.clone());
        rt.tasks.spawn(async move {
            loop {
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(30)) => {}
                }
                if let Some(rt) = &me.rt {
                    rt.launchers.slurm.cancel_again().await;
                }
                let _one = me.applying.lock().await;
                me.adopt_deferred(true, true).await;
            }
        });
    }

    /// Touches `<workers dir>/agent.heartbeat` every 5 s while the agent runs; Slurm worker
    /// jobs stop themselves when it goes stale (an agent that never came back).
    fn heartbeat(&self) {
        let Some(rt) = &self.rt else { return };
        let registry_slurm = self.registry_launcher == Some(LauncherKind::Slurm);
        if !registry_slurm && !self.current_workers().iter().any(|w| w.cfg.launcher == LauncherKind::Slurm) {
            return;
        }
        let path = rt.dir.join(launcher::slurm::HEARTBEAT_FILE);
        let token = rt.shutdown.clone();
        rt.tasks.spawn(async move {
            let mut warned = false;
            loop {
                let touched = std::fs::create_dir_all(path.parent().unwrap_or(std::path::Path::new("/"))).and_then(|()| std::fs::write(&path, crate::util::now_s().to_string()));
                if let Err(e) = touched
                    && !warned
                {
                    tracing::error!(path = %path.display(), error = %e, "cannot touch the worker heartbeat; Slurm workers will stop themselves after their idle timeout");
                    warned = true;
                }
                tokio::select! {
                    () = token.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        });
    }

    /// Adopts remembered workers `rows` that still run; stops those whose model is gone or
    /// whose version is no longer served, and forgets them. With `defer` (since when), a live
    /// worker of a model the catalog lacks is set aside instead ([`Shared::deferred`]).
    async fn adopt_rows(self: &Arc<Self>, rows: Vec<WorkerRow>, defer: Option<Instant>) -> Adopted {
        let Some(rt) = &self.rt else { return Adopted::default() };
        let mut out = Adopted::default();
        let mut adopting: Vec<String> = Vec::new();
        let uid = rt.user.as_ref().map(|u| u.uid).ok();
        let serves = self.versions_to_adopt(&rows);
        for row in rows {
            let w = self.worker(&row.model).filter(|w| launcher_name(w.cfg.launcher) == row.launcher);
            let kind = if row.launcher == "slurm" { LauncherKind::Slurm } else { LauncherKind::Local };
            let mut inst =
                Instance::new(kind, row.instance_id.clone(), row.api_key.clone(), uid.unwrap_or(u32::MAX), row.log_path.clone().into());
            if !row.base_url.is_empty() {
                inst.set_base_url(row.base_url.clone());
            }
            inst.version = row.version.clone();
            inst.started_us = row.started_us;
            if let Some(w) = &w {
                inst.key_files = Some(KeyFiles::locate(&rt.dir, &launcher::safe_name(&row.model), &row.api_key, &w.cfg.worker.key));
            }
            // Without the worker account (workers.user is broken) no worker can be proven ours.
            let alive = uid.is_some()
                && match inst.launcher {
                    LauncherKind::Slurm => match rt.launchers.slurm.job(&inst.id).await {
                        Ok(Some(j)) => {
                            j.name == launcher::slurm::job_name(&row.model)
                                && matches!(j.state.as_str(), "PENDING" | "RUNNING" | "CONFIGURING")
                        }
                        Ok(None) => false,
                        // Slurm did not answer (slurmctld restarting with the agent): adopted,
                        // and its readiness with its key (then its supervisor) decides, rather
                        // than forgetting a live worker that would then be cancelled or leak.
                        Err(e) => {
                            tracing::warn!(model = %row.model, worker = %row.instance_id, error = %e, "cannot ask Slurm about a remembered worker; adopting it and checking its readiness");
                            out.unsure = true;
                            true
                        }
                    },
                    _ => uid.is_some_and(|uid| launcher::local::Local::adopt(&inst.id, &inst.api_key, uid)),
                };
            if let Some(since) = defer.filter(|_| alive && w.is_none()) {
                tracing::warn!(model = %row.model, worker = %row.instance_id, "a remembered worker's model is not in the catalog before the first MLflow registry read; keeping it until a read says whether the model is still served");
                if kind == LauncherKind::Slurm {
                    out.jobs.push(inst.id.clone());
                }
                self.deferred.lock().unwrap_or_else(|p| p.into_inner()).push((row, since));
                continue;
            }
            let Some(w) = w.filter(|_| alive) else {
                if alive {
                    tracing::warn!(model = %row.model, worker = %row.instance_id, "a remembered worker's model left the catalog; stopping it");
                    rt.launchers.stop(&inst).await;
                }
                self.forget(&row.model, &inst).await;
                continue;
            };
            if let Some(version) = serves.get(&row.model)
                && row.version.as_ref() != Some(version)
            {
                // What a promotion's drain would have done had the agent not restarted: a switch
                // under way, or an extra replica still on the old version (a switch replaces the
                // first worker only; the others idle out).
                tracing::warn!(
                    model = %row.model,
                    worker = %row.instance_id,
                    version = row.version.as_deref().unwrap_or("none"),
                    serving = %version,
                    "a worker of a version this model no longer serves (a promotion happened); stopping it, the serving version's worker is adopted"
                );
                rt.launchers.stop(&inst).await;
                self.forget(&row.model, &inst).await;
                continue;
            }
            tracing::info!(model = %row.model, worker = %row.instance_id, "adopting a worker started before the agent restarted");
            if kind == LauncherKind::Slurm {
                // Submitted by an agent before --no-requeue, perhaps: one run per worker job.
                rt.launchers.slurm.no_requeue(&inst.id).await;
            }
            if inst.launcher == LauncherKind::Slurm {
                out.jobs.push(inst.id.clone());
            }
            if let Some(k) = &inst.key_files {
                out.keys.push(k.clone());
            }
            let inst = Arc::new(inst);
            if adopting.contains(&row.model) {
                // A further replica of a model whose first one is adopted just above.
                self.adopt_replica(rt, &w, inst);
                continue;
            }
            adopting.push(row.model.clone());
            {
                let mut s = w.lock();
                s.attempt += 1;
                self.transition(&w, &mut s, State::Starting, Some(format!("adopting worker {} after an agent restart", inst.id)));
                s.loading_job = Some(inst.id.clone());
            }
            let (me, attempt) = (self.clone(), w.lock().attempt);
            rt.tasks.spawn(async move { me.finish_adoption(w, inst, attempt).await });
        }
        out
    }

    /// The workers set aside at start ([`Shared::deferred`]), once a catalog is served: those
    /// whose model it serves are adopted; the others are stopped when it comes from a registry
    /// read (`unread` false), else kept aside. With `expired_only`, only those set aside for
    /// [`DEFERRED_MAX`] are taken, and stopped.
    async fn adopt_deferred(self: &Arc<Self>, unread: bool, expired_only: bool) {
        let rows: Vec<(WorkerRow, Instant)> = {
            let mut d = self.deferred.lock().unwrap_or_else(|p| p.into_inner());
            let (take, keep) = std::mem::take(&mut *d).into_iter().partition(|(_, t)| !expired_only || t.elapsed() >= DEFERRED_MAX);
            *d = keep;
            take
        };
        let Some(since) = rows.iter().map(|(_, t)| *t).min() else { return };
        if expired_only {
            tracing::warn!(
                workers = rows.len(),
                "no MLflow registry read for 10 minutes after the restart; stopping the remembered workers of models it would serve"
            );
        }
        let defer = (unread && !expired_only).then_some(since);
        self.adopt_rows(rows.into_iter().map(|(r, _)| r).collect(), defer).await;
    }

    /// After an agent restart: adopt the workers the store remembers and that still run; cancel
    /// this agent's Slurm worker jobs nobody remembers (no orphan holds a GPU).
    async fn adopt_all(self: &Arc<Self>) {
        let Some(rt) = &self.rt else { return };
        let rows = match &rt.store {
            Some(store) => store.workers(&rt.owner).await.unwrap_or_else(|e| {
                tracing::error!(error = %e, "cannot read remembered workers; none adopted");
                Vec::new()
            }),
            None => Vec::new(),
        };
        let unread = self.registry_launcher.is_some() && self.catalog.load().is_registry_unread();
        let Adopted { jobs: adopted_jobs, keys: kept_keys, unsure } = self.adopt_rows(rows, unread.then(Instant::now)).await;
        remove_stale_keys(&rt.dir.join("keys"), &kept_keys);
        if unsure {
            tracing::warn!(
                "not cancelling orphan worker jobs after a restart in which Slurm did not answer (their watchdogs stop them if no agent keeps them)"
            );
        } else if self.registry_launcher == Some(LauncherKind::Slurm)
            || self.current_workers().iter().any(|w| w.cfg.launcher == LauncherKind::Slurm)
        {
            match rt.launchers.slurm.own_jobs().await {
                Ok(jobs) => {
                    for j in jobs.into_iter().filter(|j| !adopted_jobs.contains(&j.id)) {
                        // Ownership is the store's: a job another agent records as its worker is
                        // never cancelled here, whatever its comment says.
                        if let Some(store) = &rt.store {
                            match store.slurm_worker_owned_by_other(&rt.owner, &j.id).await {
                                Ok(None) => {}
                                Ok(Some(other)) => {
                                    tracing::info!(job = %j.id, name = %j.name, owner = %other, "a worker job of another agent; leaving it alone");
                                    continue;
                                }
                                Err(e) => {
                                    tracing::warn!(job = %j.id, error = %e, "cannot check who owns a worker job; leaving it alone (its watchdog stops it if no agent does)");
                                    continue;
                                }
                            }
                        }
                        tracing::warn!(job = %j.id, name = %j.name, "cancelling a worker job no agent remembers (orphan)");
                        rt.launchers.slurm.cancel(&j.id).await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot list worker jobs to cancel orphans"),
            }
        }
    }

    /// For each model whose remembered workers run more than one version (replicas serve one:
    /// only a promotion's switch, cut short by a restart, leaves two), the version to adopt:
    /// the one gpuhub promoted, else the newest worker's. The others are stopped.
    fn versions_to_adopt(&self, rows: &[WorkerRow]) -> BTreeMap<String, String> {
        let mut by_model: BTreeMap<&str, Vec<&WorkerRow>> = BTreeMap::new();
        for r in rows {
            by_model.entry(r.model.as_str()).or_default().push(r);
        }
        by_model
            .into_iter()
            .filter(|(_, rs)| rs.iter().any(|r| r.version != rs[0].version))
            .filter_map(|(model, rs)| {
                let promoted = self
                    .worker(model)
                    .and_then(|w| w.cfg.mlflow_model.clone())
                    .and_then(|r| self.promoted.version(&r))
                    .filter(|v| rs.iter().any(|r| r.version.as_ref() == Some(v)));
                let newest = || rs.iter().max_by_key(|r| r.started_us).and_then(|r| r.version.clone());
                Some((model.to_string(), promoted.or_else(newest)?))
            })
            .collect()
    }

    async fn finish_adoption(self: Arc<Self>, w: Arc<Worker>, inst: Arc<Instance>, attempt: u64) {
        let Some(rt) = &self.rt else { return };
        match self.wait_ready(rt, &w, &inst, Instant::now() + Duration::from_secs(w.cfg.load_timeout_s)).await {
            Ok(()) => {
                {
                    let mut s = w.lock();
                    s.instance = Some(inst.clone());
                    s.last_used = Instant::now();
                    let detail = Some(format!("adopted worker {}", inst.id));
                    self.transition(&w, &mut s, State::Ready, detail);
                }
                self.supervise(w, inst).await;
            }
            Err((message, _)) => {
                rt.launchers.stop(&inst).await;
                self.forget(&w.cfg.name, &inst).await;
                let mut s = w.lock();
                s.outcome = Some((attempt, message.clone()));
                self.transition(&w, &mut s, State::Unloaded, Some(format!("could not adopt worker {}: {message}", inst.id)));
            }
        }
    }
}

/// Removes key files and shims no adopted worker uses (their workers stopped while no agent
/// ran, or were cancelled as orphans).
fn remove_stale_keys(keys: &std::path::Path, kept: &[KeyFiles]) {
    let Ok(entries) = std::fs::read_dir(keys) else { return };
    for e in entries.flatten() {
        let path = e.path();
        if kept.iter().any(|k| k.file == path || k.shim_dir.as_deref() == Some(path.as_path())) {
            continue;
        }
        let removed = if e.file_type().is_ok_and(|t| t.is_dir()) { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
        if let Err(err) = removed {
            tracing::warn!(path = %path.display(), error = %err, "cannot remove a stale worker key file");
        }
    }
}

/// Who listens on the port of `base_url`, against the worker's `uid` (`None`: the worker is
/// on another host, where the owner cannot be seen).
fn port_owner(base_url: &str, uid: u32) -> Option<std::io::Result<PortOwner>> {
    port_listeners(base_url).map(|l| l.map(|l| proof::owner_of(&l, uid)))
}

/// The sockets listening on `base_url`'s port that a call to it could reach; `None` when the
/// port is not on this node.
fn port_listeners(base_url: &str) -> Option<std::io::Result<Vec<proof::Listener>>> {
    let (host, port) = proof::host_port(base_url)?;
    proof::is_this_node(&host).then(|| proof::reachable(port, proof::targets_of(&host).as_deref()))
}

/// A process of the worker account that is not `inst`'s ([`launcher::is_its_process`]) and
/// holds one of `listeners` (the sockets on its port on this node, [`port_listeners`]):
/// another worker's. `None` also where that cannot be seen (another node: no listeners, a
/// static URL, descriptors this agent cannot read). `seen`: what earlier looks found.
fn other_workers_port(inst: &Instance, listeners: &[proof::Listener], seen: &mut PortHolders) -> Option<u32> {
    if inst.launcher == LauncherKind::Static || listeners.is_empty() {
        return None;
    }
    let inodes: Vec<u64> = listeners.iter().map(|l| l.inode).collect();
    if let Some((at, pid)) = &seen.other
        && *at == inodes
    {
        return Some(*pid);
    }
    let other = launcher::foreign_holder(inst, &inodes, &mut seen.ours)?;
    seen.other = Some((inodes, other));
    Some(other)
}

/// The sockets on a starting worker's port found to be its own, and the last ones found to be
/// another worker's process's ([`other_workers_port`]): each is looked up in `/proc` once.
#[derive(Default)]
struct PortHolders {
    ours: Vec<u64>,
    other: Option<(Vec<u64>, u32)>,
}

/// "port P is held by another user's process (uid N)", when it is.
fn squatter(base_url: &str, uid: u32) -> Option<String> {
    match port_owner(base_url, uid)? {
        Ok(PortOwner::Other { uid: other }) => {
            let user = crate::control::peer::user_name(other).map(|n| format!(" `{n}`")).unwrap_or_default();
            Some(format!("its port ({base_url}) is held by another user's process (uid {other}{user})"))
        }
        _ => None,
    }
}

struct LoadFailure {
    message: String,
    tail: Vec<String>,
    /// A real failure (counts toward back-off), not "no room on the GPU".
    counts: bool,
    instance: Option<Instance>,
}

impl LoadFailure {
    fn new(message: String) -> LoadFailure {
        LoadFailure { message, tail: Vec::new(), counts: true, instance: None }
    }
}

/// Whether `o`'s GPU memory counts against the room for `w`: every other worker, except, for a
/// model's first replica, the workers of its own model (a changed entry's old worker draining
/// while the new one loads); an extra replica counts its model's other replicas.
fn counts_against(o: &Worker, w: &Worker) -> bool {
    !std::ptr::eq(o, w) && (w.rep.is_extra || o.cfg.name != w.cfg.name)
}

/// Whether `w` is an extra replica that Slurm is told to keep off `node` (`--exclude`: a
/// replica of its model runs there), so that `node`'s GPUs are not its room.
fn kept_off(w: &Worker, node: &str) -> bool {
    w.rep.is_extra && w.rep.exclude().iter().any(|n| n == node)
}

/// One GPU as placement sees it.
#[derive(Debug, Clone)]
struct GpuRoom {
    index: u32,
    total_gib: f64,
    /// NVML's free memory, as sampled.
    nvml_free_gib: f64,
    /// Free for a new worker: NVML's, less what loading workers will take, plus what evicted
    /// jobs still hold in NVML's last sample.
    free_gib: f64,
    /// The Slurm jobs on it (evicted ones left out).
    jobs: Vec<GpuJob>,
}

/// The room for a new worker.
#[derive(Debug, Clone)]
struct Room {
    /// `workers.vram_gib` less what other workers hold (`None`: no budget set).
    budget_gib: Option<f64>,
    /// Per GPU (empty: NVML unknown, so the GPUs do not limit placement).
    gpus: Vec<GpuRoom>,
}

impl Room {
    /// Whether `need` GiB fits: within the budget, and on one GPU (or `gpus` GPUs, an equal
    /// share on each). Free memory of several GPUs is never added up.
    fn fits(&self, need: f64, gpus: u32) -> bool {
        if self.budget_gib.is_some_and(|b| need > b + 1e-9) {
            return false;
        }
        if self.gpus.is_empty() {
            return true;
        }
        let n = gpus.max(1) as usize;
        let per = need / n as f64;
        self.gpus.iter().filter(|g| g.free_gib + 1e-9 >= per).count() >= n
    }

    /// The refusal for a model no eviction can make fit: bigger than the GPUs themselves.
    fn never_fits(&self, need: f64, gpus: u32) -> Option<String> {
        if self.gpus.is_empty() {
            return None;
        }
        let n = gpus.max(1) as usize;
        let per = need / n as f64;
        if self.gpus.iter().filter(|g| g.total_gib + 1e-9 >= per).count() >= n {
            return None;
        }
        let largest = self.gpus.iter().map(|g| g.total_gib).fold(0.0, f64::max);
        Some(if n == 1 {
            format!(
                "it needs {need:.1} GiB of GPU memory on one GPU and the largest GPU here has {largest:.1} GiB in all; ask for several GPUs with resources.gpus (the server must split the model), or use a smaller model"
            )
        } else {
            format!(
                "it needs {per:.1} GiB on each of {n} GPUs and this node has {} GPUs with that much memory in all; lower resources.gpus or vram_gib",
                self.gpus.iter().filter(|g| g.total_gib + 1e-9 >= per).count()
            )
        })
    }

    /// `GPU 0 has 70.0 of 141.0 GiB free, GPU 1 has 62.0 of 141.0 GiB free`.
    fn per_gpu(&self) -> String {
        self.gpus
            .iter()
            .map(|g| format!("GPU {} has {:.1} of {:.1} GiB free", g.index, g.free_gib.max(0.0), g.total_gib))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// For logs: `budget 3.0 GiB; GPU 0 70.0 GiB free, ...`.
    fn summary(&self) -> String {
        let mut s = self.budget_gib.map(|b| format!("budget {b:.1} GiB free")).unwrap_or_default();
        for g in &self.gpus {
            if !s.is_empty() {
                s.push_str(", ");
            }
            s.push_str(&format!("GPU {} {:.1} GiB free", g.index, g.free_gib));
        }
        s
    }
}

/// The registered model whose `@production` artifacts an entry starts on: it has
/// `mlflow_model` and no `model_path`, and its command takes `{model_path}` or `{model_file}`.
fn weights_from_mlflow(m: &ModelConfig) -> Option<&str> {
    let cmd = &m.worker.command;
    m.mlflow_model
        .as_deref()
        .filter(|_| m.model_path.as_deref().is_none_or(str::is_empty) && (cmd.contains("{model_path}") || cmd.contains("{model_file}")))
}

pub fn launcher_name(k: LauncherKind) -> &'static str {
    match k {
        LauncherKind::Static => "static",
        LauncherKind::Local => "local",
        LauncherKind::Slurm => "slurm",
    }
}

/// Whether `inst` still holds its port (a connection accepted there, by the worker account and
/// by `inst`'s own processes where this host can tell: not another worker's process that took
/// the port after this one's server died, or shares it), tried twice 100 ms apart so a
/// momentary refusal is not a death; else what was found the second time.
async fn still_holds_port(inst: &Instance) -> Result<(), PortLost> {
    let Some(url) = inst.base_url() else { return Ok(()) };
    let look = || crate::gateway::upstream::holds_port(url, Some(inst), Duration::from_secs(2));
    if look().await.is_ok() {
        return Ok(());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    look().await
}

/// The wait before the next readiness probe, after waiting `delay`, `loading` into a load: from
/// 2 ms up to 10 ms during the first 30 s (small models, warm caches: every ms shows in the
/// cold start), then up to 100 ms (a long load does not need ms).
fn next_readiness_delay(delay: Duration, loading: Duration) -> Duration {
    let cap = if loading < Duration::from_secs(30) { Duration::from_millis(10) } else { Duration::from_millis(100) };
    (delay * 3 / 2).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_is_probed_at_least_every_10_ms_in_a_loads_first_30_s() {
        let us = Duration::from_micros;
        // (time into the load, the wait chosen then)
        let (mut delay, mut loading, mut waits) = (us(2_000), us(2_000), Vec::new());
        while loading < Duration::from_secs(40) {
            delay = next_readiness_delay(delay, loading);
            waits.push((loading, delay));
            loading += delay;
        }
        let first: Vec<Duration> = waits.iter().take(4).map(|w| w.1).collect();
        assert_eq!(first, [us(3_000), us(4_500), us(6_750), us(10_000)], "backs off from 2 ms");
        assert!(waits.iter().filter(|w| w.0 < Duration::from_secs(30)).all(|w| w.1 <= us(10_000)), "{waits:?}");
        assert_eq!(waits.last().map(|w| w.1), Some(us(100_000)), "a long load is probed every 100 ms");
    }
}
