//! Several gateways on one store share the work ([`super::lifecycle`] calls in here).
//!
//! - One start at a time per model, cluster-wide: a load enters [`enter`] first. On
//!   PostgreSQL that is a session advisory lock keyed on the model (`pg_try_advisory_lock`,
//!   polled, so a waiter holds no connection), held until the worker is ready and its address
//!   is in the store, or its start failed; a gateway whose agent dies loses its session and so
//!   the lock. On SQLite (one node, one agent) there is nothing to take: the single flight is
//!   the in-process one of [`super::lifecycle`] (one load task per model's worker).
//! - Then [`borrow`]: a ready worker another agent owns (its row has an address, and its health
//!   path answers the key from the store) is routed to instead of starting a second one. The
//!   borrowed [`Instance`] names its owner: this agent never stops or forgets it
//!   (`Launchers::stop` leaves it alone; the store deletes only own rows).
//! - [`UseTracker`]: a gateway using a borrowed worker writes when it last used it into the
//!   store; the owner's idle unload reads it, so a worker in use through another gateway is
//!   not unloaded.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::launcher::Instance;
use super::lifecycle::launcher_name;
use crate::config::{LauncherKind, ModelConfig};
use crate::store::{ClusterLock, Store};

/// How often a waiting gateway asks for the lock again.
const POLL: Duration = Duration::from_millis(100);

/// The advisory lock key of `model`'s worker start: FNV-1a of a gpuhub prefix and the name
/// (stable across agents and builds).
pub fn lock_key(model: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in "gpuhub.worker-start:".bytes().chain(model.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h as i64
}

/// A model's start, held: release it once the worker is ready (and recorded) or failed.
#[derive(Debug)]
pub struct Flight {
    cluster: Option<ClusterLock>,
}

impl Flight {
    pub async fn release(self) {
        if let Some(l) = self.cluster {
            l.release().await;
        }
    }
}

/// Waits until this agent may start `model`'s worker: cluster-wide on PostgreSQL (at once
/// without a store or on SQLite). Errors (for the waiting callers) when `deadline` passes first
/// or the agent shuts down. A store that cannot be asked is logged and the start goes on (the
/// store is then down for the other gateways too).
pub async fn enter(store: Option<&Store>, model: &str, deadline: Instant, shutdown: &CancellationToken) -> Result<Flight, String> {
    let Some(store) = store.filter(|s| s.backend() == crate::store::Backend::Postgres) else {
        return Ok(Flight { cluster: None });
    };
    let key = lock_key(model);
    let mut logged = false;
    loop {
        match store.try_cluster_lock(key).await {
            Ok(Some(l)) => return Ok(Flight { cluster: Some(l) }),
            Ok(None) => {
                if !logged {
                    tracing::info!(model, "another gateway is starting this model's worker; waiting for it");
                    logged = true;
                }
            }
            Err(e) => {
                tracing::warn!(model, error = %e, "cannot take the cluster-wide start lock; starting without it");
                return Ok(Flight { cluster: None });
            }
        }
        tokio::select! {
            () = tokio::time::sleep(POLL) => {}
            () = tokio::time::sleep_until(deadline) => {
                return Err(format!("another gateway has been starting `{model}`'s worker for longer than its load_timeout_s; retry, or see `gpuhub models` on the other gateway node"));
            }
            () = shutdown.cancelled() => return Err("the agent is shutting down".into()),
        }
    }
}

/// A ready worker of `m` that another agent than `owner` runs, checked with its key; `None`
/// when there is none (or the store cannot be read: this agent then starts its own).
/// Only Slurm workers are shared: a local worker binds its own node's loopback.
pub async fn borrow(store: Option<&Store>, owner: &str, m: &ModelConfig, uid: u32) -> Option<Instance> {
    let store = store?;
    if m.launcher != LauncherKind::Slurm {
        return None;
    }
    let rows = match store.others_workers(owner, &m.name).await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(model = %m.name, error = %e, "cannot read other agents' workers; starting one here");
            return None;
        }
    };
    let http = reqwest::Client::builder().timeout(Duration::from_secs(2)).pool_max_idle_per_host(0).build().unwrap_or_default();
    for row in rows.into_iter().filter(|r| r.launcher == launcher_name(m.launcher)) {
        let url = format!("{}{}", row.base_url.trim_end_matches('/'), m.worker.health_path);
        let healthy = http.get(&url).bearer_auth(&row.api_key).send().await.is_ok_and(|r| r.status().is_success());
        if !healthy {
            tracing::info!(model = %m.name, worker = %row.instance_id, owner = %row.owner, "another agent's worker does not answer its health check; not routing to it");
            continue;
        }
        let mut inst = Instance::new(LauncherKind::Slurm, row.instance_id.clone(), row.api_key.clone(), uid, row.log_path.clone().into());
        inst.set_base_url(row.base_url.clone());
        inst.version = row.version.clone();
        inst.started_us = row.started_us;
        inst.borrowed_from = Some(row.owner.clone());
        tracing::info!(model = %m.name, worker = %row.instance_id, owner = %row.owner, url = %row.base_url, "routing to another agent's ready worker");
        return Some(inst);
    }
    None
}

/// What a ready worker's supervisor tells the store, and asks it, each period.
#[derive(Debug, Default)]
pub struct UseTracker {
    written_us: i64,
}

impl UseTracker {
    /// A borrowed worker: records its last use here (when it moved on). An own worker that
    /// is idle here past `idle`: whether another gateway used it within `idle` (then it stays).
    pub async fn used_elsewhere(&mut self, store: Option<&Store>, inst: &Instance, idle_for: Duration, busy: bool, idle: Duration) -> bool {
        let Some(store) = store else { return false };
        let launcher = launcher_name(inst.launcher);
        let now = crate::util::now_us();
        if inst.borrowed_from.is_some() {
            let used = if busy { now } else { now - i64::try_from(idle_for.as_micros()).unwrap_or(i64::MAX) };
            if used > self.written_us + 500_000 {
                match store.touch_worker_use(launcher, &inst.id, used).await {
                    Ok(()) => self.written_us = used,
                    Err(e) => {
                        tracing::warn!(worker = %inst.id, error = %e, "cannot record the use of another agent's worker; its owner may unload it while in use here")
                    }
                }
            }
            return false;
        }
        if busy || idle_for < idle {
            return false;
        }
        match store.worker_last_used(launcher, &inst.id).await {
            Ok(Some(us)) => now.saturating_sub(us) < i64::try_from(idle.as_micros()).unwrap_or(i64::MAX),
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(worker = %inst.id, error = %e, "cannot read the worker's use through other gateways; keeping it for now");
                true
            }
        }
    }
}

/// A stopped worker's use rows go with it.
pub async fn forget(store: Option<&Store>, inst: &Instance) {
    if let Some(store) = store
        && inst.borrowed_from.is_none()
        && let Err(e) = store.forget_worker_use(launcher_name(inst.launcher), &inst.id).await
    {
        tracing::warn!(worker = %inst.id, error = %e, "cannot forget a stopped worker's use");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::store::testing;

    #[test]
    fn lock_keys_are_stable_and_per_model() {
        assert_eq!(lock_key("demo-chat"), lock_key("demo-chat"));
        assert_ne!(lock_key("demo-chat"), lock_key("demo-chat2"));
    }

    /// Two starts of one model on one PostgreSQL store: the second waits until the first
    /// releases; another model is not held up. On SQLite nothing is taken (one agent: the
    /// lifecycle's own single flight).
    #[tokio::test]
    async fn one_start_per_model_at_a_time_on_every_backend() {
        for (store, _dir) in testing::stores().await {
            if store.backend() == crate::store::Backend::Sqlite {
                let token = CancellationToken::new();
                let soon = Instant::now() + Duration::from_millis(100);
                let a = enter(Some(&store), "m", soon, &token).await.unwrap();
                let b = enter(Some(&store), "m", soon, &token).await.unwrap();
                assert!(a.cluster.is_none() && b.cluster.is_none());
                continue;
            }
            let model = format!("m-{:?}-{}", store.backend(), crate::util::now_us());
            let token = CancellationToken::new();
            let far = Instant::now() + Duration::from_secs(30);
            let first = enter(Some(&store), &model, far, &token).await.unwrap();
            let (s2, m2, t2) = (store.clone(), model.clone(), token.clone());
            let second = tokio::spawn(async move {
                let f = enter(Some(&s2), &m2, far, &t2).await.unwrap();
                let at = Instant::now();
                f.release().await;
                at
            });
            // Another model starts meanwhile.
            enter(Some(&store), &format!("{model}-other"), far, &token).await.unwrap().release().await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!second.is_finished(), "{:?}: the second start must wait for the first", store.backend());
            let released = Instant::now();
            first.release().await;
            let entered = second.await.unwrap();
            assert!(entered >= released, "{:?}: entered before the release", store.backend());

            // A deadline ends the wait with a message that says what to do.
            let held = enter(Some(&store), &model, far, &token).await.unwrap();
            let err = enter(Some(&store), &model, Instant::now() + Duration::from_millis(200), &token).await.unwrap_err();
            assert!(err.contains("retry"), "{err}");
            held.release().await;
        }
    }

    /// The cluster half alone: a second agent (another pool, so another session) is refused
    /// the lock while the first holds it, and gets it once it is released.
    #[tokio::test]
    async fn the_lock_is_cluster_wide_on_postgres() {
        for (store, _dir) in testing::stores().await {
            if store.backend() != crate::store::Backend::Postgres {
                continue;
            }
            let key = lock_key("cluster-wide");
            let held = store.try_cluster_lock(key).await.unwrap().unwrap();
            assert!(store.try_cluster_lock(key).await.unwrap().is_none());
            held.release().await;
            store.try_cluster_lock(key).await.unwrap().unwrap().release().await;
        }
    }

    #[tokio::test]
    async fn a_borrowed_worker_keeps_the_owners_worker_from_idling_out() {
        for (store, _dir) in testing::stores().await {
            let own = Instance::new(LauncherKind::Slurm, "501".into(), "k".into(), 0, "/tmp/l".into());
            own.set_base_url("http://10.77.0.12:9000".into());
            let mut borrowed = Instance::new(LauncherKind::Slurm, "501".into(), "k".into(), 0, "/tmp/l".into());
            borrowed.borrowed_from = Some("gpu02".into());
            let idle = Duration::from_secs(5);
            let mut owner = UseTracker::default();
            assert!(!owner.used_elsewhere(Some(&store), &own, Duration::from_secs(6), false, idle).await, "nobody else used it");
            let mut other = UseTracker::default();
            assert!(!other.used_elsewhere(Some(&store), &borrowed, Duration::ZERO, true, idle).await);
            assert!(
                owner.used_elsewhere(Some(&store), &own, Duration::from_secs(6), false, idle).await,
                "used through the other gateway just now"
            );
            assert!(!owner.used_elsewhere(Some(&store), &own, Duration::from_secs(1), false, idle).await, "not idle here: nothing to ask");
            // A use longer ago than the idle timeout does not keep it.
            store.forget_worker_use("slurm", "501").await.unwrap();
            let mut late = UseTracker::default();
            late.used_elsewhere(Some(&store), &borrowed, Duration::from_secs(8), false, idle).await;
            assert!(!owner.used_elsewhere(Some(&store), &own, Duration::from_secs(6), false, idle).await);
        }
    }
}
