//! Agents that share one PostgreSQL store see each other's changes: API keys (created, revoked,
//! edited), the name registry with its roles, and the versions promoted through gpuhub are read
//! again every [`INTERVAL`], and the gateways exchange what their limits counted. Without this,
//! a key revoked through one node's agent kept working at another node's gateway until that
//! agent restarted; a rename or a role moved on one node reached the other nodes' gateways and
//! jobs (`<ROLE>_MODEL`) only then; a promotion switched only the promoting agent's workers, the
//! others starting the old version; and a user could use their `[gateway.limits]` in full at
//! each gateway. Every [`policy::PUBLISH_EVERY`] passes, and on the pass after a reload changed
//! them, each gateway also publishes the settings all gateways must share; on every pass it
//! compares them with the others' ([`crate::gateway::policy`]), so a change at one gateway shows
//! at the others within a pass of its publication. And a worker of this agent that another
//! gateway found without its server (its job running on) is checked here and stopped.
//!
//! A store that cannot be read keeps the last view; one line says so, and one when it is read
//! again. With SQLite (one agent) there is nothing to follow and nothing runs.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::AppState;
use crate::gateway::policy;
use crate::store::{Backend, StoreError};

/// How long another agent's change takes to apply here, at most (plus one store read).
pub const INTERVAL: Duration = Duration::from_secs(2);

/// How long [`announce`] waits for the store before the gateway serves without it.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(2);

/// Publishes this gateway's policy once, before its listener serves (PostgreSQL, a gateway
/// node; else nothing): from its first call on, the other gateways count it as one of them.
/// The owner of a worker it borrows waits for its calls before a stop only while it is
/// ([`crate::models::single_flight::wait_for_borrowers`]); a gateway that published only at its
/// first pass, 2 s after its start, could have a call cut by a stop in those 2 s. A store that
/// does not answer within [`ANNOUNCE_TIMEOUT`] leaves the publication to the first pass (one
/// line says so). Returns the policy published, for [`run`].
pub async fn announce(state: &AppState) -> Option<policy::Policy> {
    let me = state.config.file.telemetry.effective_node_name();
    if state.store.backend() != Backend::Postgres || !state.config.file.cluster.is_gateway(&me) {
        return None;
    }
    let mine = policy::current(state);
    let json = mine.to_json();
    let publish = state.store.publish_gateway_policy(&me, &json, crate::util::now_us());
    match tokio::time::timeout(ANNOUNCE_TIMEOUT, publish).await {
        Ok(Ok(())) => Some(mine),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "gateway policy: cannot publish this gateway's policy before serving; the first cluster sync pass does (until then another gateway may stop a worker under this one's calls)");
            None
        }
        Err(_) => {
            tracing::warn!(
                timeout_s = ANNOUNCE_TIMEOUT.as_secs(),
                "gateway policy: the store did not take this gateway's policy before serving; the first cluster sync pass publishes it (until then another gateway may stop a worker under this one's calls)"
            );
            None
        }
    }
}

/// Follows the store until `stop` (a no-op on SQLite). `announced`: the policy [`announce`]
/// published at the start, if it did.
pub async fn run(state: AppState, stop: CancellationToken, announced: Option<policy::Policy>) {
    if state.store.backend() != Backend::Postgres {
        return;
    }
    let me = state.config.file.telemetry.effective_node_name();
    let gateway = state.config.file.cluster.is_gateway(&me);
    let mut failing = false;
    // Passes until this gateway's policy is published again (the first pass publishes unless
    // `announce` did, and so does the pass after a reload changed it).
    let mut policy_in: u64 = if announced.is_some() { policy::PUBLISH_EVERY } else { 0 };
    let mut published: Option<policy::Policy> = announced;
    // What differs from the other gateways' policies, as last logged.
    let mut differs = Vec::new();
    // A node without the gateway role removes a row it published before this start, once.
    let mut forgotten = false;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(INTERVAL) => {}
        }
        let mut result = once(&state).await;
        if result.is_ok() && gateway {
            let mine = policy::current(&state);
            let publish = policy_in == 0 || published.as_ref() != Some(&mine);
            result = policies(&state, &me, &mine, publish, &mut differs).await;
            if result.is_ok() && publish {
                policy_in = policy::PUBLISH_EVERY;
                published = Some(mine);
            }
        } else if result.is_ok() && !forgotten {
            // Its row goes at once, so the gateways stop comparing with it (else after
            // policy::FRESH_US).
            result = state.store.forget_gateway_policy(&me).await.map(|had| {
                if had {
                    tracing::info!("gateway policy: this node runs no gateway now; its published policy is removed from the store");
                }
            });
            forgotten = result.is_ok();
        }
        policy_in = policy_in.saturating_sub(1);
        match result {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("cluster sync: the store is read again; keys, names and limits follow other agents' changes");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "cluster sync: cannot read keys, names and the other gateways' limit counts from the store; this agent keeps its last view (other agents' revocations and renames wait)");
            }
            Err(_) => {}
        }
    }
}

/// One pass: keys, names and roles (the snapshot is rewritten when a role moved), promotions.
pub async fn once(state: &AppState) -> Result<(), StoreError> {
    let keys = &state.gateway.keys;
    let read_at = keys.generation();
    let records = state.store.api_keys().await?;
    let n = records.len();
    if keys.replace_if_newer(records, read_at) {
        tracing::info!(keys = n, "cluster sync: API keys changed in the store (another agent); applied");
    }
    let (names, roles) = state.names.follow(&state.store).await?;
    if names || roles {
        tracing::info!(names, roles, "cluster sync: the name registry changed in the store (another agent); applied");
    }
    if roles {
        if let Err(e) = crate::snapshot::write(state) {
            tracing::error!(error = %e, "cannot rewrite the snapshot after another agent moved a role; new jobs get the old roles until it is");
        }
        // Another agent may serve a model this one does not.
        state.catalog_sync.report_unserved(state);
    }
    promotions(state).await?;
    unreachable(state).await?;
    limits(state).await
}

/// Workers of this agent that another gateway could not reach while their jobs ran: each is
/// checked here, and its job stopped if its server is gone ([`crate::models::single_flight::report_unreachable`]).
async fn unreachable(state: &AppState) -> Result<(), StoreError> {
    let reports = state.store.unreachable_workers(crate::models::lifecycle::launcher_name(crate::config::LauncherKind::Slurm)).await?;
    if !reports.is_empty() {
        state.models.check_reported(&reports);
    }
    Ok(())
}

/// `[gateway.limits]` and the keys' own limits across gateways: this gateway's counts of the
/// day are published, the others' read while any limit applies here
/// ([`crate::gateway::fair_use`]). Nodes without a gateway count nothing.
async fn limits(state: &AppState) -> Result<(), StoreError> {
    let me = state.config.file.telemetry.effective_node_name();
    if !state.config.file.cluster.is_gateway(&me) {
        return Ok(());
    }
    let fair_use = &state.gateway.fair_use;
    let now = crate::util::now_us();
    if let Some((day, rows)) = fair_use.to_publish()
        && let Err(e) = state.store.publish_limit_counts(&me, day, &rows, now).await
    {
        fair_use.unpublished(day, &rows);
        return Err(e);
    }
    if !fair_use.any_limit() && !state.gateway.keys.any_own_limit() {
        // Nothing to refuse here: no read (an idle agent makes one query fewer per pass).
        fair_use.others_not_followed();
        return Ok(());
    }
    let day = crate::gateway::fair_use::day_of(now);
    let others = state.store.others_limit_counts(&me, day).await?;
    fair_use.follow_others(day, &others, |id| state.gateway.keys.rpm_of(id), now);
    Ok(())
}

/// Publishes gateway `me`'s policy (`mine`) when `publish`, and compares it with the other
/// gateways'; a difference is logged when it appears or changes, and once when it is gone.
async fn policies(
    state: &AppState,
    me: &str,
    mine: &policy::Policy,
    publish: bool,
    logged: &mut Vec<policy::Difference>,
) -> Result<(), StoreError> {
    let now = crate::util::now_us();
    if publish {
        state.store.publish_gateway_policy(me, &mine.to_json(), now).await?;
    }
    let rows = state.store.gateway_policies(now - policy::FRESH_US).await?;
    let found = policy::compare(me, mine, &rows);
    state.gateway.metrics.policy_differences.set(i64::try_from(found.len()).unwrap_or(i64::MAX));
    if found != *logged {
        if found.is_empty() {
            tracing::info!("gateway policy: every gateway now has the same [gateway.limits], [gateway.user_models] and keys_per_user");
        } else {
            let gateways: Vec<&str> = found.iter().map(|d| d.gateway.as_str()).collect();
            tracing::warn!(gateways = %gateways.join(","), differs = %policy::describe(&found), fix = policy::FIX,
                "gateway policy: another gateway enforces other settings than this one");
        }
        *logged = found;
    }
    Ok(())
}

/// Versions promoted through another agent: served from this agent's next start of the model,
/// and its own ready workers are switched (one borrowed from another agent is that agent's).
async fn promotions(state: &AppState) -> Result<(), StoreError> {
    let promoted = state.models.promoted();
    let mut changed = Vec::new();
    {
        let _change = promoted.change_lock().lock().await;
        for row in state.store.promoted_versions().await? {
            if promoted.version(&row.model).as_deref() != Some(row.version.as_str()) {
                promoted.set_promoted(&row.model, &row.version);
                state.models.note_version(&row.model, &row.version);
                changed.push(row);
            }
        }
    }
    let catalog = state.catalog.load();
    for row in changed {
        for name in catalog.serving(&row.model) {
            state.models.set_alias_mismatch(&name, promoted.get(&row.model).mismatch());
            tracing::info!(model = %name, registered = %row.model, version = %row.version, by = %row.user_name,
                "cluster sync: a version promoted through another agent; serving it here");
            // A switch waits for the new worker: not on this loop (nor on shutdown's wait).
            let st = state.clone();
            tokio::spawn(async move {
                let switch = st.models.switch_to_promoted(&name).await;
                tracing::info!(model = %name, switch = switch.kind(), detail = %switch.detail(), "cluster sync: promotion applied");
            });
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::store::Store;

    /// A gateway on a shared store is one of the gateways from its first call on: its policy
    /// row is in the store when its listener first answers (the owner of a worker it borrows
    /// reads these rows before a stop, `single_flight::wait_for_borrowers`). Without
    /// `announce` the row came with the first sync pass, 2 s after the start.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_publishes_its_policy_before_it_answers_its_first_call() {
        let Some(base) = crate::store::testing::pg_url("a_gateway_publishes_its_policy_before_it_answers_its_first_call") else {
            return;
        };
        let url = crate::store::testing::fresh_pg_url(&base).await;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display();
        let text = format!(
            "[paths]\nstate_dir = \"{d}/state\"\nruntime_dir = \"{d}/run\"\nspool_dir = \"{d}/spool\"\n\
             [store]\nurl = \"{url}\"\n[telemetry]\nenable_nvml = false\nenable_slurm = false\nslurm_node_name = \"gpu07\"\n\
             [cluster]\ngateway_nodes = [\"gpu07\"]\n"
        );
        let config = crate::config::Config::from_toml(&text).unwrap();
        let listeners = crate::Listeners {
            gateway: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap()),
            metrics: tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
            control: crate::control::server::bind(&dir.path().join("agent.sock")).unwrap(),
        };
        let gateway = listeners.gateway.as_ref().unwrap().local_addr().unwrap();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(crate::run(config, listeners, async move {
            let _ = rx.await;
        }));
        // The listener is bound before the agent starts: the first request waits for it to serve.
        let http = reqwest::Client::new();
        let t = Instant::now();
        while http.get(format!("http://{gateway}/healthz")).send().await.is_err() {
            assert!(t.elapsed() < Duration::from_secs(20), "the agent did not start");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let store = Store::open(&url, Some(1)).await.unwrap();
        let rows = store.gateway_policies(0).await.unwrap();
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        assert_eq!(
            rows.iter().map(|(g, _)| g.as_str()).collect::<Vec<_>>(),
            vec!["gpu07"],
            "the gateway answered its first call {:?} after its start without its policy in the store",
            t.elapsed()
        );
    }
}
