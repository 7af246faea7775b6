//! Promotion without a failed call. When a worker serves another version than the one just
//! promoted, and the GPUs have room for a second worker (the placement check, counting the
//! running one), a second worker (a second Slurm job) starts on the promoted version next to
//! it; once it is ready, new calls go to it, the old one finishes its in-flight calls (each
//! lease holds its instance) and its job ends. Without room, or with no worker running, the
//! promoted version serves from the next start. A model's further replicas follow its first
//! one: once it has switched, those on the old version drain and stop, and scaling starts their
//! successors on the promoted version ([`Shared::retire_other_versions`]).
//!
//! While it loads, the new worker is a shadow [`Worker`] among the leaving ones, so other
//! placements count its GPU memory; after the switch the shadow holds the old worker's memory
//! (state draining) until its job has ended.

use super::*;

/// What a promotion did to the running worker.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "how", content = "detail", rename_all = "snake_case")]
pub enum Switch {
    /// A new worker serves the new calls; the old one drains and stops.
    Switched(String),
    /// The promoted version serves from the next start (why).
    NextStart(String),
    /// The running worker already serves the promoted version.
    Unchanged(String),
}

impl Switch {
    pub fn kind(&self) -> &'static str {
        match self {
            Switch::Switched(_) => "switched",
            Switch::NextStart(_) => "next_start",
            Switch::Unchanged(_) => "unchanged",
        }
    }

    pub fn detail(&self) -> &str {
        match self {
            Switch::Switched(d) | Switch::NextStart(d) | Switch::Unchanged(d) => d,
        }
    }
}

impl Shared {
    /// Moves `w` to the promoted version of its registered model (see the module docs).
    pub(super) async fn switch(self: &Arc<Self>, w: Arc<Worker>) -> Switch {
        let name = w.cfg.name.clone();
        let Some(rt) = &self.rt else { return Switch::NextStart("on-demand workers do not run in this process".into()) };
        let Some(version) = w.cfg.mlflow_model.as_deref().and_then(|r| self.promoted.version(r)) else {
            return Switch::NextStart(format!("`{name}` has no version promoted through gpuhub"));
        };
        let old = {
            let s = w.lock();
            match (&s.instance, s.state) {
                (Some(i), State::Ready) if i.borrowed_from.is_some() => {
                    // The owner switches it (it follows promotions through the store).
                    return Switch::NextStart(format!(
                        "worker {} belongs to agent {}, which moves it to version {version}",
                        i.id,
                        i.borrowed_from.as_deref().unwrap_or("?")
                    ));
                }
                (Some(i), State::Ready) => i.clone(),
                _ => {
                    return Switch::NextStart(format!(
                        "no worker of `{name}` is ready ({}); its next start serves version {version}",
                        s.state.as_str()
                    ));
                }
            }
        };
        let old_version = old.version.clone().unwrap_or_else(|| "?".into());
        if old.version.as_deref() == Some(version.as_str()) {
            return Switch::Unchanged(format!("worker {} already serves version {version}", old.id));
        }
        if w.cfg.launcher == LauncherKind::Static {
            return Switch::NextStart(format!("`{name}` is a static server gpuhub does not start"));
        }
        let user = match rt.user.clone() {
            Ok(u) => u,
            Err(e) => return Switch::NextStart(format!("workers.user: {e}")),
        };
        let later = |why: String| {
            Switch::NextStart(format!(
                "{why}; worker {} keeps serving version {old_version} and version {version} serves from its next start (when it idles out, or after `gpuhub models unload {name}`)",
                old.id
            ))
        };
        let shadow = Arc::new(Worker::new(w.cfg.clone()));
        shadow.leaving.store(true, Ordering::Release);
        {
            // The room for a second worker, the running one counted (no eviction for a switch).
            let _one = rt.placement.lock().await;
            let need = w.cfg.resources.vram_gib;
            let room = self.room(rt, None, &[]);
            if need > 0.0 && !room.fits(need, w.cfg.resources.gpus) {
                let numbers = match room.budget_gib {
                    Some(b) if need > b + 1e-9 => format!("{:.1} GiB of workers.vram_gib free", b.max(0.0)),
                    _ => room.per_gpu(),
                };
                return later(format!("no room for a second worker ({need:.1} GiB) next to the running one: {numbers}"));
            }
            let mut s = shadow.lock();
            s.attempt += 1;
            self.transition(&shadow, &mut s, State::Starting, Some(format!("version {version}, replacing worker {}", old.id)));
            self.leaving.lock().unwrap_or_else(|p| p.into_inner()).push(shadow.clone());
        }
        {
            let mut s = w.lock();
            let state = s.state;
            let detail = format!("version {old_version}; version {version} is starting next to it (promotion)");
            self.transition(&w, &mut s, state, Some(detail));
        }
        tracing::info!(model = %name, from = %old_version, to = %version, old_worker = %old.id, "promotion: starting a second worker");
        let unshadow = || self.leaving.lock().unwrap_or_else(|p| p.into_inner()).retain(|o| !Arc::ptr_eq(o, &shadow));
        let (inst, weights) = match self.launch(rt, &shadow, user, Vec::new(), Some(version.clone())).await {
            Ok(x) => x,
            Err(f) => {
                if let Some(i) = &f.instance {
                    rt.launchers.stop(i).await;
                    self.forget(&name, i).await;
                }
                // The new worker's row replaced the old one's: the old one is remembered again.
                self.remember(rt, &name, &old).await;
                unshadow();
                let mut s = shadow.lock();
                self.transition(&shadow, &mut s, State::Unloaded, None);
                return later(format!("the worker for version {version} did not start: {}", f.message));
            }
        };
        let inst = Arc::new(inst);
        let old_weights = {
            let mut s = w.lock();
            let still = s.state == State::Ready && s.instance.as_ref().is_some_and(|i| Arc::ptr_eq(i, &old));
            if still {
                s.instance = Some(inst.clone());
                let old_weights = std::mem::replace(&mut s.weights, weights);
                s.last_used = Instant::now();
                let detail = format!("version {version} (switched from worker {}, version {old_version})", old.id);
                self.transition(&w, &mut s, State::Ready, Some(detail));
                Some(old_weights)
            } else {
                None
            }
        };
        let Some(old_weights) = old_weights else {
            // The old worker stopped meanwhile (idle, crash, unload): the next start serves it.
            rt.launchers.stop(&inst).await;
            self.forget(&name, &inst).await;
            unshadow();
            let mut s = shadow.lock();
            self.transition(&shadow, &mut s, State::Unloaded, None);
            return Switch::NextStart(format!("worker {} stopped during the switch; the next start serves version {version}", old.id));
        };
        {
            let me = self.clone();
            let (w2, i2) = (w.clone(), inst.clone());
            rt.tasks.spawn(async move { me.supervise(w2, i2).await });
        }
        // The model's other replicas are still on the old version: they drain too.
        let replicas = match self.retire_other_versions(rt, &w) {
            0 => String::new(),
            n => format!(
                "; {n} further replica(s) on version {old_version} drain and stop, and new ones start on version {version} as min_replicas and the load ask"
            ),
        };
        {
            let mut s = shadow.lock();
            s.weights = old_weights;
            self.transition(&shadow, &mut s, State::Draining, Some(format!("worker {} (version {old_version}) draining", old.id)));
        }
        let in_flight = Arc::strong_count(&old).saturating_sub(2);
        let me = self.clone();
        let (old_id, new_id) = (old.id.clone(), inst.id.clone());
        rt.tasks.spawn(async move {
            me.drain_replaced(&name, shadow, old).await;
        });
        tracing::info!(model = %w.cfg.name, from = %old_version, to = %version, old_worker = %old_id, new_worker = %new_id, "promotion: new calls go to the new worker");
        Switch::Switched(format!(
            "worker {new_id} (version {version}) takes the new calls; worker {old_id} (version {old_version}) finishes its {in_flight} in-flight call(s) and stops{replicas}"
        ))
    }

    /// Waits until no lease holds `old` (at most `workers.drain_timeout_s`), then ends it.
    async fn drain_replaced(&self, name: &str, shadow: Arc<Worker>, old: Arc<Instance>) {
        let Some(rt) = &self.rt else { return };
        let withdrawn = single_flight::withdraw(rt.store.as_ref(), &rt.owner, name, &old).await;
        let deadline = Instant::now() + Duration::from_secs(rt.cfg.drain_timeout_s);
        // Left: this task's reference, and the old supervisor's until its next tick.
        while Arc::strong_count(&old) > 1 {
            if Instant::now() >= deadline {
                tracing::warn!(model = %name, worker = %old.id, "drain timeout; stopping the replaced worker with calls in flight");
                break;
            }
            tokio::select! {
                () = rt.shutdown.cancelled() => break,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        single_flight::wait_for_borrowers(rt.store.as_ref(), &rt.owner, &old, withdrawn, deadline, &rt.shutdown).await;
        rt.launchers.stop(&old).await;
        self.forget(name, &old).await;
        {
            let mut s = shadow.lock();
            s.weights = None;
            self.transition(&shadow, &mut s, State::Unloaded, Some(format!("worker {} replaced by a promotion", old.id)));
        }
        self.leaving.lock().unwrap_or_else(|p| p.into_inner()).retain(|o| !Arc::ptr_eq(o, &shadow));
        tracing::info!(model = %name, worker = %old.id, "the replaced worker drained and stopped");
    }
}
