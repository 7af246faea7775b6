//! Replicas of a model: the lifecycle side of [`crate::models::replicas`].
//!
//! The catalog's [`Worker`] is the model's first replica and keeps its state machine (first
//! load, idle unload, eviction, adoption). Each further replica is a [`Worker`] of its own
//! (`rep.is_extra`), listed in the first one's `rep.extras`: started by [`Shared::tick_replicas`]
//! under load, launched, supervised and stopped like the first one, never in placement (Slurm
//! places it, away from the nodes of the others) nor in the per-model state metrics.
//! A call holds the first replica's in-flight count (queue, idle, drain of the model) and, once
//! routed, the chosen replica's ([`Route`]).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use super::{LoadFailure, Runtime, Shared, State, Worker};
use crate::config::{LauncherKind, ModelConfig};
use crate::models::launcher::Instance;
use crate::models::replicas::{self, Health, Policy, Probe, Scaler};

/// How long a stopping first replica waits for the replicas it gave up to cancel their jobs
/// ([`Shared::give_up_loading_replicas`]; a load looks at least every 100 ms).
const GIVE_UP_WAIT: Duration = Duration::from_secs(5);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker's replica bookkeeping.
#[derive(Debug)]
pub(super) struct Replicas {
    /// A replica started by scaling (not the catalog's worker).
    pub(super) is_extra: bool,
    /// The first replica's further replicas (empty on an extra one).
    extras: Mutex<Vec<Arc<Worker>>>,
    /// Calls forwarded to this replica's instance now (least-outstanding routing).
    routed: AtomicU32,
    probe: Mutex<Probe>,
    scaler: Mutex<Scaler>,
    /// The Slurm node the replica runs on, once known: (worker id, node), so a node learned for
    /// an earlier worker of this replica (before a restart) is not taken for the current one's.
    node: Mutex<Option<(String, String)>>,
    /// Nodes its job must avoid (`sbatch --exclude`).
    exclude: Mutex<Vec<String>>,
}

impl Replicas {
    pub(super) fn new(cfg: &ModelConfig, is_extra: bool) -> Replicas {
        Replicas {
            is_extra,
            extras: Mutex::new(Vec::new()),
            routed: AtomicU32::new(0),
            probe: Mutex::new(Probe::new(Instant::now(), &Policy::of(cfg))),
            scaler: Mutex::new(Scaler::default()),
            node: Mutex::new(None),
            exclude: Mutex::new(Vec::new()),
        }
    }

    /// The further replicas of a model's first replica (none on an extra one).
    pub(super) fn extras(&self) -> Vec<Arc<Worker>> {
        lock(&self.extras).clone()
    }

    /// The node of worker `id`, if known.
    fn node_of(&self, id: &str) -> Option<String> {
        lock(&self.node).as_ref().filter(|(i, _)| i == id).map(|(_, n)| n.clone())
    }

    pub(super) fn exclude(&self) -> Vec<String> {
        lock(&self.exclude).clone()
    }

    fn healthy(&self) -> bool {
        lock(&self.probe).health == Health::Ready
    }
}

/// One replica in `gpuhub models --json` (`replicas`).
#[derive(Debug, Clone, Serialize)]
pub struct ReplicaStatus {
    /// `pending`, `starting`, `ready`, `draining`.
    pub state: &'static str,
    /// `ready` or `unhealthy` (probes; see `unhealthy_after`); `starting` while it loads.
    pub health: &'static str,
    pub node: Option<String>,
    /// The model version it serves (MLflow-driven models; replicas of one model serve one).
    pub version: Option<String>,
    pub base_url: Option<String>,
    /// Calls forwarded to this replica now.
    pub in_flight: u32,
    /// Its Slurm job id (local pid).
    pub job_id: Option<String>,
}

/// A call routed to one replica; dropping it ends the call there.
#[derive(Debug)]
pub(super) struct Route {
    target: Arc<Worker>,
}

impl Route {
    /// Whether the call went to the replica `w`.
    pub(super) fn goes_to(&self, w: &Arc<Worker>) -> bool {
        Arc::ptr_eq(&self.target, w)
    }

    /// The replica the call went to.
    pub(super) fn target(&self) -> &Worker {
        &self.target
    }

    /// The call could not reach the replica (connection refused or broken): no call goes
    /// there until a probe passes again.
    pub(super) fn failed(&self) {
        let p = Policy::of(&self.target.cfg);
        if p.max <= 1 {
            return; // one worker: nothing to route around (and no probe to clear it)
        }
        let mut pr = lock(&self.target.rep.probe);
        pr.failures = pr.failures.max(p.unhealthy_after);
        pr.health = Health::Unhealthy;
        pr.next_at = Instant::now();
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        let t = &self.target;
        t.rep.routed.fetch_sub(1, Ordering::AcqRel);
        if t.rep.is_extra {
            t.lock().last_used = Instant::now();
            t.in_flight.fetch_sub(1, Ordering::AcqRel);
            t.bump();
        }
    }
}

fn live(s: State) -> bool {
    matches!(s, State::Pending | State::Starting | State::Ready)
}

impl Shared {
    /// Ready replicas of the model whose first replica is `w` (itself counted when ready).
    pub(super) fn ready_replicas(&self, w: &Worker) -> u32 {
        let first = u32::from(w.lock().state == State::Ready);
        first + lock(&w.rep.extras).iter().filter(|e| e.lock().state == State::Ready).count() as u32
    }

    /// Picks the replica for a call that already holds `w`'s count and `w`'s ready `inst`:
    /// least outstanding among ready, healthy replicas (all ready ones when none is healthy).
    pub(super) fn route(&self, w: &Arc<Worker>, inst: Arc<Instance>) -> (Arc<Worker>, Arc<Instance>, Route) {
        let extras: Vec<Arc<Worker>> = lock(&w.rep.extras).clone();
        let mut cands: Vec<(Arc<Worker>, Arc<Instance>)> = vec![(w.clone(), inst.clone())];
        for e in extras {
            let i = {
                let s = e.lock();
                if s.state != State::Ready { None } else { s.instance.clone() }
            };
            if let Some(i) = i {
                cands.push((e, i));
            }
        }
        if cands.len() > 1 {
            let healthy: Vec<(u32, bool)> = cands.iter().map(|(r, _)| (r.rep.routed.load(Ordering::Acquire), r.rep.healthy())).collect();
            let all: Vec<(u32, bool)> = healthy.iter().map(|(n, _)| (*n, true)).collect();
            let pick = replicas::least_outstanding(&healthy).or_else(|| replicas::least_outstanding(&all)).unwrap_or(0);
            if pick > 0 {
                let (t, i) = cands.swap_remove(pick);
                // Counted under its lock, as for the first replica: a drain starting now waits.
                let mut s = t.lock();
                if s.state == State::Ready && s.instance.as_ref().is_some_and(|x| Arc::ptr_eq(x, &i)) {
                    t.in_flight.fetch_add(1, Ordering::AcqRel);
                    t.rep.routed.fetch_add(1, Ordering::AcqRel);
                    s.last_used = Instant::now();
                    drop(s);
                    return (t.clone(), i, Route { target: t });
                }
            }
        }
        w.rep.routed.fetch_add(1, Ordering::AcqRel);
        (w.clone(), inst, Route { target: w.clone() })
    }

    /// The replicas for `gpuhub models` (the first one included), each with its state.
    pub(super) fn replica_statuses(&self, w: &Worker) -> Vec<ReplicaStatus> {
        let one = |r: &Worker| -> Option<ReplicaStatus> {
            let s = r.lock();
            let Some(inst) = s.instance.as_ref() else {
                // Loading: its job, before anything else about it is known.
                let job = s.loading_job.clone().filter(|_| matches!(s.state, State::Pending | State::Starting))?;
                return Some(ReplicaStatus {
                    state: s.state.as_str(),
                    health: "starting",
                    node: None,
                    version: None,
                    base_url: None,
                    in_flight: 0,
                    job_id: Some(job),
                });
            };
            Some(ReplicaStatus {
                state: s.state.as_str(),
                health: lock(&r.rep.probe).health.as_str(),
                node: r.rep.node_of(&inst.id),
                version: inst.version.clone(),
                base_url: inst.base_url().map(str::to_string),
                in_flight: r.rep.routed.load(Ordering::Relaxed),
                job_id: Some(inst.id.clone()),
            })
        };
        let extras = lock(&w.rep.extras).clone();
        std::iter::once(w).chain(extras.iter().map(|e| e.as_ref())).filter_map(one).collect()
    }

    /// Whether an idle replica may stop now (scale down, one at a time, to `min_replicas`).
    pub(super) fn may_idle_unload(&self, w: &Arc<Worker>) -> bool {
        let p = Policy::of(&w.cfg);
        let first = if w.rep.is_extra { self.worker(&w.cfg.name) } else { Some(w.clone()) };
        let Some(first) = first else { return true };
        if w.rep.is_extra {
            let extras = lock(&first.rep.extras).iter().filter(|e| live(e.lock().state)).count() as u32;
            1 + extras > p.min.max(1)
        } else {
            // The first replica goes last: not while another is still draining (one at a time).
            let others = lock(&first.rep.extras)
                .iter()
                .filter(|e| {
                    let st = e.lock().state;
                    live(st) || st == State::Draining
                })
                .count();
            others == 0 && p.may_retire(1)
        }
    }

    /// The first replica died: a ready replica takes its place (the model stays ready).
    /// Returns the new first instance, with the first replica's lock still held by the caller.
    pub(super) fn promote_replica(&self, w: &Worker) -> Option<(Arc<Instance>, Option<String>)> {
        let mut extras = lock(&w.rep.extras);
        let pos = extras.iter().position(|e| e.lock().state == State::Ready)?;
        let e = extras.remove(pos);
        drop(extras);
        let mut s = e.lock();
        let inst = s.instance.take()?;
        // Its supervisor ends (no longer ready); the job keeps running as the first replica.
        self.transition(&e, &mut s, State::Unloaded, Some(format!("replica {} is now the model's first", inst.id)));
        *lock(&w.rep.probe) = Probe::new(Instant::now(), &Policy::of(&w.cfg));
        let node = e.rep.node_of(&inst.id);
        *lock(&w.rep.node) = node.clone().map(|n| (inst.id.clone(), n));
        Some((inst, node))
    }

    /// Gives up `w`'s further replicas that are still queued or starting, and waits (at most
    /// [`GIVE_UP_WAIT`]) until their loads have cancelled their jobs. Called before `w` itself
    /// stops: its GPU, once free, would go to a queued replica, which would load only to be
    /// stopped.
    pub(super) async fn give_up_loading_replicas(&self, w: &Arc<Worker>, reason: &str) {
        let loading = |e: &Worker| matches!(e.lock().state, State::Pending | State::Starting);
        let deadline = Instant::now() + GIVE_UP_WAIT;
        for e in w.rep.extras().into_iter().filter(|e| loading(e)) {
            let mut rx = e.changed.subscribe();
            e.give_up(reason);
            while loading(&e) {
                if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                    tracing::warn!(model = %w.cfg.name, "a replica given up is still loading; stopping the first replica anyway");
                    return;
                }
            }
        }
    }

    /// Stops every further replica of `w` (the model unloads).
    pub(super) async fn stop_replicas(&self, w: &Arc<Worker>, reason: &str) {
        let extras: Vec<Arc<Worker>> = std::mem::take(&mut *lock(&w.rep.extras));
        if let Some(rt) = &self.rt
            && Policy::of(&w.cfg).max > 1
        {
            rt.metrics.replicas(&w.cfg.name, 0, 0, 0);
        }
        for e in extras {
            // A replica still queued or starting is given up: its load cancels its job.
            e.give_up(reason);
            self.unload(&e, reason).await;
        }
    }

    /// Each supervision period of the first replica (models with `max_replicas` > 1): drop
    /// stopped replicas, learn nodes, probe health, and start one more replica when the load
    /// has stayed above the target.
    pub(super) async fn tick_replicas(self: &Arc<Self>, rt: &Runtime, w: &Arc<Worker>) {
        let p = Policy::of(&w.cfg);
        if w.rep.is_extra || p.max <= 1 || w.cfg.launcher != LauncherKind::Slurm {
            return;
        }
        let extras: Vec<Arc<Worker>> = {
            let mut e = lock(&w.rep.extras);
            e.retain(|x| matches!(x.lock().state, State::Pending | State::Starting | State::Ready | State::Draining));
            e.clone()
        };
        self.retire_other_versions(rt, w);
        let now = Instant::now();
        let mut used = Vec::new();
        let (mut ready, mut starting, mut unhealthy) = (0u32, 0u32, 0u32);
        for r in std::iter::once(w).chain(extras.iter()) {
            let (state, inst) = {
                let s = r.lock();
                (s.state, s.instance.clone())
            };
            match state {
                State::Ready => ready += 1,
                State::Pending | State::Starting => starting += 1,
                _ => {}
            }
            let Some(inst) = inst.filter(|_| state == State::Ready) else { continue };
            used.extend(learn_node(rt, r, &inst).await);
            if now >= lock(&r.rep.probe).next_at {
                let ok = probe(r, &inst).await;
                let changed = lock(&r.rep.probe).record(ok, &p, Instant::now());
                if let Some(h) = changed {
                    tracing::warn!(model = %w.cfg.name, worker = %inst.id, health = h.as_str(), "replica health");
                }
            }
            if !r.rep.healthy() {
                unhealthy += 1;
            }
        }
        rt.metrics.replicas(&w.cfg.name, ready, starting, unhealthy);
        let in_flight = w.in_flight.load(Ordering::Acquire);
        if lock(&w.rep.scaler).scale_up(&p, ready, starting, in_flight, now) {
            tracing::info!(model = %w.cfg.name, ready, in_flight, target = p.target_in_flight, "scaling up: starting another replica");
            self.start_replica(rt, w, used);
        }
    }

    /// Replicas of one model serve one version: once a promotion has switched the first
    /// replica ([`super::switchover`]), a ready replica still on the old version drains (new
    /// calls go to the others) and stops, and scaling starts its successors on the new one.
    /// A replica that was starting on the old version is retired once ready. Returns how many
    /// replicas it retired now.
    pub(super) fn retire_other_versions(self: &Arc<Self>, rt: &Runtime, w: &Arc<Worker>) -> usize {
        let version = {
            let s = w.lock();
            match (&s.instance, s.state) {
                (Some(i), State::Ready) => i.version.clone(),
                _ => return 0,
            }
        };
        let mut retired = 0;
        for e in lock(&w.rep.extras).clone() {
            let stale = {
                let s = e.lock();
                s.instance.as_ref().filter(|i| s.state == State::Ready && i.version != version).map(|i| (i.id.clone(), i.version.clone()))
            };
            let Some((id, old)) = stale else { continue };
            let (old, new) = (old.unwrap_or_else(|| "?".into()), version.clone().unwrap_or_else(|| "?".into()));
            tracing::info!(model = %w.cfg.name, worker = %id, from = %old, to = %new, "promotion: a replica on the old version drains and stops");
            let reason = format!("replica {id} serves version {old}, the model now serves version {new} (promotion)");
            // Draining from now on (route() skips it); its calls in flight finish in the task.
            let Some(draining) = self.start_drain(&e, &reason) else { continue };
            let me = self.clone();
            rt.tasks.spawn(async move { me.drain_and_stop(&e, draining, &reason).await });
            retired += 1;
        }
        retired
    }

    fn start_replica(self: &Arc<Self>, rt: &Runtime, w: &Arc<Worker>, used: Vec<String>) {
        let e = Arc::new(Worker::new_replica(w.cfg.clone()));
        {
            let mut s = e.lock();
            s.attempt += 1;
            self.transition(&e, &mut s, State::Pending, Some("scaling up: another replica".into()));
        }
        lock(&w.rep.extras).push(e.clone());
        let (me, w) = (self.clone(), w.clone());
        rt.tasks.spawn(async move { me.run_replica(w, e, used).await });
    }

    async fn run_replica(self: Arc<Self>, w: Arc<Worker>, e: Arc<Worker>, used: Vec<String>) {
        let Some(rt) = &self.rt else { return };
        let up = rt.launchers.slurm.up_nodes().await.unwrap_or_default();
        *lock(&e.rep.exclude) = replicas::exclude_nodes(&used, &up);
        // The same version as the first replica: replicas of one model serve one version.
        let version = w.lock().instance.as_ref().and_then(|i| i.version.clone());
        // Room for it, as for the first replica: the workers.vram_gib budget and the GPUs,
        // counting the model's other replicas (idle models are evicted to make room).
        let result = match rt.user.clone() {
            Ok(user) => match self.place(rt, &e).await {
                Ok(evicted) => self.launch(rt, &e, user, evicted, version).await,
                Err(message) => Err(LoadFailure { message, tail: Vec::new(), counts: false, instance: None }),
            },
            Err(err) => Err(LoadFailure::new(format!("workers.user: {err}"))),
        };
        match result {
            Ok((inst, weights)) => {
                let inst = Arc::new(inst);
                // Known before it is listed ready (`gpuhub models`, the next replica's spread).
                learn_node(rt, &e, &inst).await;
                let listed = {
                    // The lock order everywhere: the first replica, its `extras`, an extra's own
                    // (`ready_replicas` on every call takes `extras`, then each extra's).
                    let extras = lock(&w.rep.extras);
                    let mut s = e.lock();
                    s.instance = Some(inst.clone());
                    s.weights = weights;
                    s.last_used = Instant::now();
                    self.transition(&e, &mut s, State::Ready, Some(format!("replica {}", inst.id)));
                    extras.iter().any(|x| Arc::ptr_eq(x, &e))
                };
                if !listed {
                    // The model unloaded while this replica started.
                    self.unload(&e, "the model unloaded while this replica started").await;
                    return;
                }
                tracing::info!(model = %w.cfg.name, worker = %inst.id, exclude = ?e.rep.exclude(), "replica ready");
                self.supervise(e, inst).await;
            }
            Err(f) => {
                if let Some(i) = &f.instance {
                    rt.launchers.stop(i).await;
                    self.forget(&w.cfg.name, i).await;
                }
                lock(&w.rep.scaler).failed(Instant::now(), Duration::from_secs(rt.cfg.backoff_s.max(5)));
                tracing::warn!(model = %w.cfg.name, error = %f.message, "a replica did not start");
                let mut s = e.lock();
                self.transition(&e, &mut s, State::Failed, Some(f.message));
            }
        }
    }

    /// At agent start and after a catalog change: a model with `min_replicas` >= 1 that is
    /// unloaded loads now, not on its first call (scaling then starts the others up to
    /// `min_replicas`). Not on a node without the gateway role: nothing there would call them.
    pub(super) fn start_min_replicas(self: &Arc<Self>) {
        let Some(rt) = self.rt.as_ref().filter(|rt| rt.gateway) else { return };
        for w in self.current_workers() {
            if w.cfg.min_replicas == 0 || w.cfg.launcher == LauncherKind::Static || w.lock().state != State::Unloaded {
                continue;
            }
            let me = self.clone();
            rt.tasks.spawn(async move {
                let name = w.cfg.name.clone();
                if let Err(e) = me.acquire(w, "").await {
                    tracing::warn!(model = %name, error = %e, "min_replicas: the model did not load; it loads on its first call");
                }
            });
        }
    }

    /// After an agent restart: a further remembered worker of a model whose first replica is
    /// being adopted becomes one of its replicas.
    pub(super) fn adopt_replica(self: &Arc<Self>, rt: &Runtime, w: &Arc<Worker>, inst: Arc<Instance>) {
        let e = Arc::new(Worker::new_replica(w.cfg.clone()));
        {
            let mut s = e.lock();
            s.attempt += 1;
            self.transition(&e, &mut s, State::Starting, Some(format!("adopting replica {} after an agent restart", inst.id)));
            s.loading_job = Some(inst.id.clone());
        }
        lock(&w.rep.extras).push(e.clone());
        let me = self.clone();
        rt.tasks.spawn(async move {
            let attempt = e.lock().attempt;
            me.finish_adoption(e, inst, attempt).await
        });
    }
}

/// The Slurm node of replica `r`'s worker `inst`, asked of Slurm (squeue) once per worker.
async fn learn_node(rt: &Runtime, r: &Worker, inst: &Instance) -> Option<String> {
    if let Some(n) = r.rep.node_of(&inst.id) {
        return Some(n);
    }
    if inst.launcher != LauncherKind::Slurm {
        return None;
    }
    let n = rt.launchers.slurm.node_of(&inst.id).await.ok().flatten()?;
    *lock(&r.rep.node) = Some((inst.id.clone(), n.clone()));
    Some(n)
}

/// One health probe of a ready replica: its health path with its key, 2 s at most.
async fn probe(r: &Worker, inst: &Instance) -> bool {
    let Some(base) = inst.base_url() else { return false };
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build().unwrap_or_default();
    http.get(format!("{base}{}", r.cfg.worker.health_path))
        .bearer_auth(&inst.api_key)
        .send()
        .await
        .is_ok_and(|resp| resp.status().is_success())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::RwLock;

    use super::super::{counts_against, kept_off};
    use super::*;
    use crate::config::Config;
    use crate::models::catalog::{Catalog, LiveCatalog};
    use crate::models::gate::Promoted;

    /// An extra replica's placement counts what the model's other replicas hold (the first one
    /// and the extras ready or starting) against the `workers.vram_gib` budget, as it counts
    /// other models; the first replica's own placement leaves its model's workers out, as
    /// before (a changed entry's old worker drains while the new one loads).
    #[tokio::test]
    async fn an_extra_replica_counts_the_models_other_replicas_against_the_room() {
        let cfg = Config::from_toml(
            "[[models]]\nname = \"r\"\nlauncher = \"slurm\"\ncommand = \"srv --port {port} --key-file {api_key_file}\"\nresources = { shards = 2, vram_gib = 8.0 }\nmax_replicas = 3\n\
             [[models]]\nname = \"o\"\nlauncher = \"slurm\"\ncommand = \"srv --port {port} --key-file {api_key_file}\"\nresources = { shards = 1, vram_gib = 2.0 }\n",
        )
        .unwrap();
        let catalog = Arc::new(Catalog::from_config(&cfg.file));
        let workers: BTreeMap<String, Arc<Worker>> = catalog.models().map(|m| (m.name.clone(), Arc::new(Worker::new(m.clone())))).collect();
        let shared = Shared {
            catalog: Arc::new(LiveCatalog::new(catalog)),
            workers: RwLock::new(workers),
            leaving: Mutex::new(Vec::new()),
            applying: tokio::sync::Mutex::new(()),
            registry_launcher: None,
            rt: None,
            promoted: Arc::new(Promoted::load(None).await),
            deferred: Mutex::new(Vec::new()),
        };
        let first = shared.worker("r").unwrap();
        let other = shared.worker("o").unwrap();
        first.lock().state = State::Ready;
        other.lock().state = State::Ready;
        let ready = Arc::new(Worker::new_replica(first.cfg.clone()));
        ready.lock().state = State::Ready;
        let starting = Arc::new(Worker::new_replica(first.cfg.clone()));
        starting.lock().state = State::Pending;
        lock(&first.rep.extras).extend([ready.clone(), starting.clone()]);

        let all = shared.all_workers();
        assert!(all.iter().any(|w| Arc::ptr_eq(w, &ready)) && all.iter().any(|w| Arc::ptr_eq(w, &starting)), "extras hold GPU memory too");
        // The starting replica's room: the first (8) and the ready extra (8) of its model, and `o` (2).
        assert_eq!(shared.held_gib(Some(&starting)), 18.0);
        assert!(!counts_against(&starting, &starting), "not itself");
        // The first replica's room leaves its own model out; `o`'s counts every replica of `r`.
        assert_eq!(shared.held_gib(Some(&first)), 2.0);
        assert_eq!(shared.held_gib(Some(&other)), 24.0);
        // A stopped extra holds nothing.
        ready.lock().state = State::Unloaded;
        assert_eq!(shared.held_gib(Some(&starting)), 10.0);
        // The model's entry is replaced while its first replica is down: its extras are
        // stopped with it, not left running where nothing counts or idles them out.
        first.lock().state = State::Failed;
        shared.retire(&first, "its catalog entry changed").await;
        assert!(first.rep.extras().is_empty(), "the extras leave with the first replica");
        assert_eq!(shared.held_gib(Some(&other)), 0.0);
    }

    /// An extra replica that Slurm keeps off a node (`--exclude`, where another replica runs)
    /// is not placed by that node's GPUs: on a node whose GPUs the first replica fills, the
    /// second one, bound for another node, must not be refused.
    #[test]
    fn an_extra_replica_kept_off_this_node_is_not_placed_by_its_gpus() {
        let cfg = Config::from_toml(
            "[[models]]\nname = \"r\"\nlauncher = \"slurm\"\ncommand = \"srv --port {port} --key-file {api_key_file}\"\nresources = { gpus = 1, vram_gib = 120.0 }\nmax_replicas = 2\n",
        )
        .unwrap();
        let m = Arc::new(cfg.file.models[0].clone());
        let (first, extra) = (Worker::new(m.clone()), Worker::new_replica(m));
        *lock(&extra.rep.exclude) = vec!["gpu01".to_string()];
        assert!(kept_off(&extra, "gpu01"), "the first replica's node");
        assert!(!kept_off(&extra, "gpu02"), "a node it may land on: its GPUs are its room");
        *lock(&first.rep.exclude) = vec!["gpu01".to_string()];
        assert!(!kept_off(&first, "gpu01"), "a first replica is placed as before");
    }
}
