//! Several gateways on one store share the work ([`super::lifecycle`] calls in here).
//!
//! - One start at a time per model, cluster-wide: a load enters [`enter`] first. On
//!   PostgreSQL that is a session advisory lock keyed on the model (`pg_try_advisory_lock`,
//!   polled, so a waiter holds no connection), held until the worker is ready and its address
//!   is in the store, or its start failed; a gateway whose agent dies loses its session and so
//!   the lock. On SQLite (one node, one agent) there is nothing to take: the single flight is
//!   the in-process one of [`super::lifecycle`] (one load task per model's worker).
//! - Then [`borrow`]: a ready worker another agent owns (its row has an address; Slurm says its
//!   job runs as the worker account and the job's `.proof` says `ok` for its port; only then
//!   its health path is asked with the key from the store) is routed to instead of starting a
//!   second one. The borrowed [`Instance`] names its owner: this agent never stops or forgets
//!   it (`Launchers::stop` leaves it alone; the store deletes only own rows).
//! - [`UseTracker`]: a gateway using a borrowed worker writes when it last used it into the
//!   store; the owner's idle unload reads it, so a worker in use through another gateway is
//!   not unloaded.
//! - Stopping a worker others borrow: the owner [`withdraw`]s its row first (borrowers see it
//!   gone within a supervisor period and route new calls elsewhere, [`still_offered`]), then
//!   [`wait_for_borrowers`] while their calls in flight there finish ([`hold_while_in_flight`]
//!   records their use each second).

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::launcher::Instance;
use super::launcher::proof::{self, PortOwner};
use super::launcher::slurm::Slurm;
use super::lifecycle::launcher_name;
use crate::config::{LauncherKind, ModelConfig};
use crate::store::{ClusterLock, Store, WorkerRow};

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
    let unlocked = |e: crate::store::StoreError| {
        tracing::warn!(model, error = %e, "cannot take the cluster-wide start lock; starting without it");
        Ok(Flight { cluster: None })
    };
    let mut session = match store.lock_session().await {
        Ok(Some(s)) => s,
        Ok(None) => return Ok(Flight { cluster: None }),
        Err(e) => return unlocked(e),
    };
    loop {
        match session.try_lock(key).await {
            Ok(Ok(l)) => return Ok(Flight { cluster: Some(l) }),
            Ok(Err(back)) => {
                session = back;
                if !logged {
                    tracing::info!(model, "another gateway is starting this model's worker; waiting for it");
                    logged = true;
                }
            }
            Err(e) => return unlocked(e),
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

/// A ready worker of `m` that another agent than `owner` runs, vouched for and checked with
/// its key; `None` when there is none (or the store cannot be read: this agent then starts its
/// own). Only Slurm workers are shared: a local worker binds its own node's loopback.
///
/// The store's row alone is not trusted with the key: its worker may have died and another
/// user may have bound its port since. Before the key goes anywhere, Slurm and the job vouch
/// for the row ([`Slurm::vouch`]: the job is RUNNING as the worker account, its comment names
/// the row's owner, and its `.addr` and `.proof` in that owner's workers dir name this address
/// and say `ok` for this job and port); a worker on this node's loopback must also hold its
/// port in the kernel's table. Only then does the keyed health probe go out. A refused row is
/// logged once, with why.
pub async fn borrow(store: Option<&Store>, slurm: &Slurm, owner: &str, m: &ModelConfig, uid: u32) -> Option<Instance> {
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
        if let Err(why) = vouch(slurm, m, &row, uid).await {
            refused(m, &row, &why);
            continue;
        }
        let url = format!("{}{}", row.base_url.trim_end_matches('/'), m.worker.health_path);
        let healthy = http.get(&url).bearer_auth(&row.api_key).send().await.is_ok_and(|r| r.status().is_success());
        if !healthy {
            tracing::info!(model = %m.name, worker = %row.instance_id, owner = %row.owner, "another agent's worker does not answer its health check; not routing to it");
            continue;
        }
        // Recorded before the first call goes there, then the row asked for again: an owner
        // that withdrew it after that read sees this use and waits ([`wait_for_borrowers`]);
        // one that withdrew it before is not borrowed from.
        record_use(store, &row.launcher, &row.instance_id).await;
        if !still_offered(Some(store), owner, &m.name, &row.instance_id).await {
            tracing::info!(model = %m.name, worker = %row.instance_id, owner = %row.owner, "another agent's worker is being stopped by its owner; not routing to it");
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

/// Whether `row` may be sent its key: Slurm and the job's proof vouch for it, and on this
/// node's loopback the kernel shows the worker account on its port.
async fn vouch(slurm: &Slurm, m: &ModelConfig, row: &WorkerRow, uid: u32) -> Result<(), String> {
    slurm.vouch(&m.name, &row.instance_id, uid, &row.owner, &row.base_url).await?;
    if let Some((host, port)) = proof::host_port(&row.base_url)
        && proof::is_this_node(&host)
    {
        match proof::owner(port, uid, proof::targets_of(&host).as_deref()) {
            Ok(PortOwner::Worker) => {}
            Ok(PortOwner::Nobody) => return Err(format!("nothing listens on its port {port}")),
            Ok(PortOwner::Other { uid: other }) => {
                return Err(format!("a process of another user (uid {other}) listens on its port {port}"));
            }
            Err(e) => return Err(format!("cannot check who listens on its port {port}: {e}")),
        }
    }
    Ok(())
}

/// Logs a refused row once per worker (each load asks again; the reason rarely changes).
fn refused(m: &ModelConfig, row: &WorkerRow, why: &str) {
    static LOGGED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let key = format!("{}/{}/{}", row.owner, m.name, row.instance_id);
    let first = {
        let mut seen = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
        if seen.len() >= 1024 {
            seen.clear();
        }
        seen.insert(key)
    };
    if first {
        tracing::warn!(model = %m.name, worker = %row.instance_id, owner = %row.owner, url = %row.base_url, reason = %why, "not routing to another agent's worker: Slurm and its port proof do not vouch for it; its key is not sent");
    } else {
        tracing::debug!(model = %m.name, worker = %row.instance_id, owner = %row.owner, reason = %why, "another agent's worker still not vouched for");
    }
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

/// How long after a worker's last recorded use through another gateway its owner still waits
/// before it stops the worker: more than a borrowing gateway's supervisor period (1 s: it
/// records a use, or notices that the worker's row is gone) plus a store round trip.
pub const BORROWER_GRACE: Duration = Duration::from_secs(3);

/// How long after its withdrawal a worker other gateways may use is waited for, at least: a
/// borrowing gateway notices the withdrawal at its next supervisor period (1 s) and then
/// records the calls it still has in flight there ([`hold_while_in_flight`]); one it sent in
/// the second before is not in the store until then.
pub const SEE_WITHDRAWAL: Duration = Duration::from_secs(2);

/// The owner's first step in stopping its worker `inst` of `model`: its row leaves the store,
/// so no gateway borrows it from now on and those that do stop sending it new calls (they see
/// the row gone within a second). Then [`wait_for_borrowers`] with the instant this returns;
/// the stop's `forget` deletes the row again (harmless) with the worker's use.
pub async fn withdraw(store: Option<&Store>, owner: &str, model: &str, inst: &Instance) -> Instant {
    if let Some(store) = store
        && inst.borrowed_from.is_none()
        && let Err(e) = store.delete_worker(owner, model, &inst.id).await
    {
        tracing::warn!(model, worker = %inst.id, error = %e, "cannot withdraw a stopping worker from the store; other gateways notice when its job ends");
    }
    Instant::now()
}

/// The owner's second step: waits (until `deadline`) while another gateway has used `inst`
/// within [`BORROWER_GRACE`] (a borrower records `now` each second while a call of its own is
/// in flight there, [`hold_while_in_flight`]), so a switch or an unload does not break the
/// calls other gateways sent. While another gateway (`me` is this one) publishes its policy in
/// the store, the answer "nobody used it" counts only from [`SEE_WITHDRAWAL`] after `withdrawn`
/// (a call sent just before is recorded by then); with no other gateway it returns at once for
/// a worker nobody else used.
pub async fn wait_for_borrowers(
    store: Option<&Store>,
    me: &str,
    inst: &Instance,
    withdrawn: Instant,
    deadline: Instant,
    shutdown: &CancellationToken,
) {
    let Some(store) = store else { return };
    if inst.borrowed_from.is_some() {
        return;
    }
    let launcher = launcher_name(inst.launcher);
    let grace = i64::try_from(BORROWER_GRACE.as_micros()).unwrap_or(i64::MAX);
    let settled = match store.gateway_policies(crate::util::now_us() - crate::gateway::policy::FRESH_US).await {
        Ok(rows) if rows.iter().all(|(gateway, _)| gateway == me) => withdrawn,
        Ok(_) => withdrawn + SEE_WITHDRAWAL,
        Err(e) => {
            tracing::warn!(worker = %inst.id, error = %e, "cannot read which other gateways share the store; waiting for them to see the worker withdrawn");
            withdrawn + SEE_WITHDRAWAL
        }
    };
    let mut logged = false;
    loop {
        let recent = match store.worker_last_used(launcher, &inst.id).await {
            Ok(Some(us)) => crate::util::now_us().saturating_sub(us) < grace,
            Ok(None) => false,
            Err(e) => {
                tracing::warn!(worker = %inst.id, error = %e, "cannot read the worker's use through other gateways; stopping it without waiting for them");
                false
            }
        };
        if !recent && Instant::now() >= settled {
            return;
        }
        if Instant::now() >= deadline {
            if recent {
                tracing::warn!(worker = %inst.id, "drain timeout; stopping the worker while another gateway may still call it");
            }
            return;
        }
        if recent && !logged {
            tracing::info!(worker = %inst.id, "another gateway used this worker within the last few seconds; waiting for its calls before stopping it");
            logged = true;
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(250)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// A borrowing gateway's check, each supervisor period: whether the owner still offers the
/// borrowed worker `id` of `model` (its row is in the store). A store that cannot be read
/// counts as yes (the worker's end still shows as its job ending).
pub async fn still_offered(store: Option<&Store>, me: &str, model: &str, id: &str) -> bool {
    let Some(store) = store else { return true };
    match store.others_workers(me, model).await {
        Ok(rows) => rows.iter().any(|r| r.instance_id == id),
        Err(e) => {
            tracing::debug!(model, worker = id, error = %e, "cannot read other agents' workers; keeping the borrowed worker");
            true
        }
    }
}

/// A borrowed worker this gateway no longer routes new calls to (its owner withdrew it):
/// while calls still hold `inst` (a lease holds its instance), records their use each second,
/// so the owner's [`wait_for_borrowers`] lets them finish; at most until `deadline`.
pub async fn hold_while_in_flight(store: Option<Store>, inst: std::sync::Arc<Instance>, deadline: Instant, shutdown: CancellationToken) {
    let Some(store) = store else { return };
    let launcher = launcher_name(inst.launcher);
    // Left when no call holds it: this task's reference.
    while std::sync::Arc::strong_count(&inst) > 1 && Instant::now() < deadline {
        record_use(&store, launcher, &inst.id).await;
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            () = shutdown.cancelled() => return,
        }
    }
}

/// Records that this gateway uses another agent's worker now (a failure is logged: its owner
/// may then stop it under a call).
async fn record_use(store: &Store, launcher: &str, id: &str) {
    if let Err(e) = store.touch_worker_use(launcher, id, crate::util::now_us()).await {
        tracing::warn!(worker = id, error = %e, "cannot record the use of another agent's worker; its owner may stop it under a call");
    }
}

/// A borrowed worker whose server no longer holds its port while its job runs on (a wrapper
/// that outlives its server): its owner is told through the store, checks the worker itself
/// and stops the job ([`crate::models::ModelManager::check_reported`], within a cluster-sync
/// pass); else it would hold its GPU until its idle timeout. Own workers: nothing to do.
pub async fn report_unreachable(store: Option<&Store>, inst: &Instance) {
    let (Some(store), Some(owner)) = (store, inst.borrowed_from.as_deref()) else { return };
    match store.report_worker_unreachable(launcher_name(inst.launcher), &inst.id, crate::util::now_us()).await {
        Ok(()) => {
            tracing::info!(worker = %inst.id, owner, "another agent's worker does not hold its port while its job runs; its owner is told to check it and stop the job")
        }
        Err(e) => {
            tracing::warn!(worker = %inst.id, owner, error = %e, "cannot tell another agent that its worker does not hold its port; that worker keeps its GPU until its idle timeout")
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

    /// Another agent's worker (`gpu02`, job 4242) whose row is in the store and whose health
    /// path answers: it is borrowed only when Slurm says the job is RUNNING as the worker
    /// account under `gpu02`'s comment, and its `.addr` and `.proof` in `gpu02`'s workers dir
    /// name this job and port with `ok`. Otherwise its key is never sent (the server sees no
    /// request) and nothing is borrowed. `squeue` is a script printing what Slurm prints for
    /// `-o %i|%j|%T|%r|%U|%k` (real Slurm: tests/system/multinode-gateways.sh).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_agents_worker_is_borrowed_only_when_slurm_and_its_proof_vouch_for_it() {
        use std::os::unix::fs::PermissionsExt;
        // The "worker": answers every path, keeps the bearer tokens it was sent.
        let seen: std::sync::Arc<Mutex<Vec<String>>> = Default::default();
        let keys = seen.clone();
        let app = axum::Router::new().fallback(move |h: axum::http::HeaderMap| {
            let keys = keys.clone();
            async move {
                let auth = h.get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
                keys.lock().unwrap().push(auth);
                "ok"
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        let theirs = tempfile::tempdir().unwrap();
        let bin = tempfile::tempdir().unwrap();
        let out = bin.path().join("squeue.out");
        std::fs::write(
            bin.path().join("squeue"),
            format!(
                "#!/bin/sh\n[ \"$*\" = '-h -j 4242 -o %i|%j|%T|%r|%U|%k' ] || {{ echo \"bad args: $*\" >&2; exit 2; }}\ncat '{}'\n",
                out.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(bin.path().join("squeue"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let slurm = Slurm::new(
            crate::config::SlurmConfig { bin_dir: Some(bin.path().to_path_buf()), ..Default::default() },
            "/nonexistent/gpu01".into(),
            "gpu01".into(),
        );
        let cfg = crate::config::Config::from_toml(
            "[[models]]\nname = \"m\"\nlauncher = \"slurm\"\ncommand = \"srv --port {port} --key-file {api_key_file}\"\n",
        )
        .unwrap();
        let m = &cfg.file.models[0];
        let url = format!("http://127.0.0.1:{port}");
        let comment = format!("gpuhub-worker:gpu02:{}", theirs.path().display());
        let job = |state: &str, uid: u32, comment: &str| format!("4242|gpuhub-worker-m|{state}|None|{uid}|{comment}\n");
        let addr = format!("127.0.0.1 {port} 4242\n");
        let ok = format!("4242 {port} ok\n");
        // What, squeue's line, the .addr and .proof files, whether it is borrowed.
        type Case<'a> = (&'a str, String, Option<String>, Option<String>, bool);
        let cases: Vec<Case> = vec![
            ("vouched for", job("RUNNING", me, &comment), Some(addr.clone()), Some(ok.clone()), true),
            ("the job has ended", String::new(), Some(addr.clone()), Some(ok.clone()), false),
            ("the job is completing", job("COMPLETING", me, &comment), Some(addr.clone()), Some(ok.clone()), false),
            ("the job is another user's", job("RUNNING", me.wrapping_add(1), &comment), Some(addr.clone()), Some(ok.clone()), false),
            (
                "the job is another agent's",
                job("RUNNING", me, &comment.replace("gpu02", "gpu03")),
                Some(addr.clone()),
                Some(ok.clone()),
                false,
            ),
            ("no proof", job("RUNNING", me, &comment), Some(addr.clone()), None, false),
            (
                "the proof names another port",
                job("RUNNING", me, &comment),
                Some(addr.clone()),
                Some(format!("4242 {} ok\n", port ^ 1)),
                false,
            ),
            ("the proof names another job", job("RUNNING", me, &comment), Some(addr.clone()), Some(format!("4241 {port} ok\n")), false),
            (
                "the proof names a squatter",
                job("RUNNING", me, &comment),
                Some(addr.clone()),
                Some(format!("4242 {port} uid 1001\n")),
                false,
            ),
            (
                "the job wrote another address",
                job("RUNNING", me, &comment),
                Some(format!("127.0.0.1 {} 4242\n", port ^ 1)),
                Some(ok.clone()),
                false,
            ),
        ];
        for (store, _dir) in testing::stores().await {
            store
                .put_worker(&WorkerRow {
                    owner: "gpu02".into(),
                    model: "m".into(),
                    launcher: "slurm".into(),
                    instance_id: "4242".into(),
                    base_url: url.clone(),
                    api_key: "gpuhub-worker-secret".into(),
                    version: None,
                    log_path: "/tmp/m.4242.log".into(),
                    started_us: 1,
                })
                .await
                .unwrap();
            for (what, line, addr_file, proof_file, borrowed) in &cases {
                seen.lock().unwrap().clear();
                std::fs::write(&out, line).unwrap();
                for (ext, body) in [("addr", addr_file), ("proof", proof_file)] {
                    let path = theirs.path().join(format!("m.4242.{ext}"));
                    match body {
                        Some(b) => std::fs::write(&path, b).unwrap(),
                        None => drop(std::fs::remove_file(&path)),
                    }
                }
                let got = borrow(Some(&store), &slurm, "gpu01", m, me).await;
                let sent = seen.lock().unwrap().clone();
                if *borrowed {
                    let inst = got.unwrap_or_else(|| panic!("{:?}: {what}: not borrowed", store.backend()));
                    assert_eq!((inst.borrowed_from.as_deref(), inst.base_url()), (Some("gpu02"), Some(url.as_str())));
                    assert_eq!(sent, vec!["Bearer gpuhub-worker-secret".to_string()], "{what}: one keyed health probe");
                } else {
                    assert!(got.is_none(), "{:?}: {what}: borrowed all the same", store.backend());
                    assert!(sent.is_empty(), "{:?}: {what}: the worker's key was sent: {sent:?}", store.backend());
                }
            }
        }
        server.abort();
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

    /// An owner stopping its worker (a switch, an unload) withdraws its row first: a borrowing
    /// gateway sees it gone (and stops routing new calls there); the owner then waits while
    /// that gateway still has calls in flight on it (their use recorded each second), and no
    /// longer than [`BORROWER_GRACE`] after the last one; at once when nobody else used it, and
    /// at its deadline at the latest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_withdrawn_worker_is_stopped_only_after_the_calls_other_gateways_sent_it() {
        for (store, _dir) in testing::stores().await {
            let b = store.backend();
            let row = WorkerRow {
                owner: "gpu02".into(),
                model: "m".into(),
                launcher: "slurm".into(),
                instance_id: "601".into(),
                base_url: "http://10.77.0.12:9000".into(),
                api_key: "k".into(),
                version: None,
                log_path: "/tmp/l".into(),
                started_us: 1,
            };
            store.put_worker(&row).await.unwrap();
            let own = Instance::new(LauncherKind::Slurm, "601".into(), "k".into(), 0, "/tmp/l".into());
            let mut borrowed = Instance::new(LauncherKind::Slurm, "601".into(), "k".into(), 0, "/tmp/l".into());
            borrowed.borrowed_from = Some("gpu02".into());
            let borrowed = std::sync::Arc::new(borrowed);
            let token = CancellationToken::new();
            let far = Instant::now() + Duration::from_secs(30);

            // Nobody else used it: the owner's wait ends at once.
            let t = Instant::now();
            wait_for_borrowers(Some(&store), "gpu02", &own, t, far, &token).await;
            assert!(t.elapsed() < Duration::from_secs(1), "{b:?}: waited {:?} for nobody", t.elapsed());

            assert!(still_offered(Some(&store), "gpu01", "m", "601").await, "{b:?}");
            withdraw(Some(&store), "gpu02", "m", &own).await;
            assert!(!still_offered(Some(&store), "gpu01", "m", "601").await, "{b:?}: withdrawn, still offered");

            // gpu01 borrowed it (its use recorded) and still has a call on it (a lease holds
            // the instance) for 2 s.
            store.touch_worker_use("slurm", "601", crate::util::now_us()).await.unwrap();
            let lease = borrowed.clone();
            let hold = tokio::spawn(hold_while_in_flight(Some(store.clone()), borrowed, far, token.clone()));
            let (s2, t2) = (store.clone(), token.clone());
            let t = Instant::now();
            let owner = tokio::spawn(async move { wait_for_borrowers(Some(&s2), "gpu02", &own, t, far, &t2).await });
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(!owner.is_finished(), "{b:?}: the owner stopped the worker under gpu01's call");
            drop(lease);
            hold.await.unwrap();
            owner.await.unwrap();
            let waited = t.elapsed();
            assert!(
                waited >= Duration::from_secs(2) && waited < Duration::from_secs(2) + BORROWER_GRACE + Duration::from_secs(2),
                "{b:?}: the owner waited {waited:?} (the call ended after 2 s)"
            );

            // A deadline ends the wait while another gateway still uses it.
            store.touch_worker_use("slurm", "601", crate::util::now_us()).await.unwrap();
            let own = Instance::new(LauncherKind::Slurm, "601".into(), "k".into(), 0, "/tmp/l".into());
            let t = Instant::now();
            wait_for_borrowers(Some(&store), "gpu02", &own, t, Instant::now() + Duration::from_millis(300), &token).await;
            assert!(t.elapsed() < Duration::from_secs(2), "{b:?}: waited {:?} past its deadline", t.elapsed());
        }
    }

    /// A call another gateway sent to the worker in the second before its owner withdrew it is
    /// not in the store yet (that gateway records it when its supervisor notices the
    /// withdrawal): while another gateway shares the store, the owner does not take "nobody
    /// used it" for an answer before [`SEE_WITHDRAWAL`], so it does not stop the worker under
    /// that call; a worker nobody used waits that long and no longer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_another_gateway_sent_just_before_the_withdrawal_is_waited_for() {
        for (store, _dir) in testing::stores().await {
            let b = store.backend();
            let now = crate::util::now_us();
            store.publish_gateway_policy("gpu01", "{}", now).await.unwrap();
            store.publish_gateway_policy("gpu02", "{}", now).await.unwrap();
            let own = Instance::new(LauncherKind::Slurm, "701".into(), "k".into(), 0, "/tmp/l".into());
            let mut borrowed = Instance::new(LauncherKind::Slurm, "701".into(), "k".into(), 0, "/tmp/l".into());
            borrowed.borrowed_from = Some("gpu02".into());
            let borrowed = std::sync::Arc::new(borrowed);
            let token = CancellationToken::new();
            let far = Instant::now() + Duration::from_secs(30);

            // gpu01 sent a call just before gpu02 withdrew the worker (nothing recorded yet);
            // its supervisor notices the withdrawal 0.9 s later and records the call, which
            // ends 1.5 s after that.
            let lease = borrowed.clone();
            let withdrawn = Instant::now();
            let (s2, t2) = (store.clone(), token.clone());
            let borrower = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(900)).await;
                let hold = tokio::spawn(hold_while_in_flight(Some(s2), borrowed, far, t2));
                tokio::time::sleep(Duration::from_millis(1500)).await;
                drop(lease);
                hold.await.unwrap();
            });
            let (s3, t3) = (store.clone(), token.clone());
            let owner = tokio::spawn(async move { wait_for_borrowers(Some(&s3), "gpu02", &own, withdrawn, far, &t3).await });
            tokio::time::sleep(Duration::from_millis(2200)).await;
            assert!(!owner.is_finished(), "{b:?}: the owner stopped the worker under the call gpu01 sent before the withdrawal");
            borrower.await.unwrap();
            owner.await.unwrap();
            let waited = withdrawn.elapsed();
            assert!(waited >= Duration::from_millis(2400), "{b:?}: the owner waited {waited:?} (the call ended after 2.4 s)");

            // Nobody used it: "nobody" counts from SEE_WITHDRAWAL after the withdrawal.
            let quiet = Instance::new(LauncherKind::Slurm, "702".into(), "k".into(), 0, "/tmp/l".into());
            let withdrawn = Instant::now();
            wait_for_borrowers(Some(&store), "gpu02", &quiet, withdrawn, far, &token).await;
            let waited = withdrawn.elapsed();
            assert!(
                waited >= SEE_WITHDRAWAL && waited < SEE_WITHDRAWAL + Duration::from_secs(1),
                "{b:?}: waited {waited:?} for a worker nobody used, with another gateway on the store"
            );
        }
    }
}
