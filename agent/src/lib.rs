//! gpuhub node agent.
//!
//! The privileged daemon on a Slurm GPU node. It turns what the SPANK plugin records and what
//! the GPUs and Slurm report into GPU-hours per user and Prometheus metrics, and serves one
//! OpenAI-compatible API for every model on the node, with every call accounted for.
//!
//! # Layout
//! - [`config`]: `agent.toml` → typed, validated [`config::Config`].
//! - [`store`]: SQLite (default) or PostgreSQL, one `AnyPool`, per-backend migrations.
//! - [`telemetry`]: NVML + Slurm sampling threads, dcgm-exporter-compatible metrics.
//! - [`gateway`]: the OpenAI-compatible HTTP API (`router.rs` has the route table).
//! - [`models`]: the catalog and the worker lifecycle behind each model name.
//! - [`mlflow_runs`]: ended jobs' measured GPU use logged on their MLflow runs (the run page).
//! - [`names`]: name states (active, deprecated, retired), resolution, "did you mean".
//! - [`snapshot`]: the file the plugin reads to inject `<ROLE>_MODEL` and URLs into jobs.
//! - [`control`]: the Unix-socket API the `gpuhub` CLI talks to (callers identified by
//!   SO_PEERCRED).
//! - [`cli`]: the `gpuhub` command's subcommands.
//!
//! The binaries in `src/bin/` only parse arguments and call [`run`].

pub mod accounting;
pub mod cli;
pub mod cluster_sync;
pub mod config;
pub mod control;
pub mod gateway;
pub mod metrics_http;
pub mod mlflow_runs;
pub mod models;
pub mod names;
pub mod quota;
pub mod snapshot;
pub mod store;
pub mod telemetry;
pub mod util;

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use config::Config;
use models::{Catalog, LiveCatalog, ModelManager};
use names::NameRegistry;
use store::Store;

/// Shared state of the running agent: one `Arc`, so that the clone every handler and
/// middleware takes per call is one reference count, not one per part.
#[derive(Clone)]
pub struct AppState(Arc<AppParts>);

impl std::ops::Deref for AppState {
    type Target = AppParts;

    fn deref(&self) -> &AppParts {
        &self.0
    }
}

/// What [`AppState`] holds.
pub struct AppParts {
    pub config: Arc<Config>,
    pub store: Store,
    /// The catalog served now (`[[models]]` and the MLflow registry's tagged models).
    pub catalog: Arc<LiveCatalog>,
    pub names: Arc<NameRegistry>,
    pub models: Arc<ModelManager>,
    pub telemetry: Arc<telemetry::Telemetry>,
    /// Follows agent.toml reloads and the MLflow registry's tagged models.
    pub catalog_sync: Arc<models::sync::CatalogSync>,
    /// The gateway's metrics, usage log, API keys and upstream client.
    pub gateway: Arc<gateway::Gateway>,
    /// `[[quotas]]`: usage, Slurm holds, the snapshot's quota lines.
    pub quotas: Arc<quota::Quotas>,
    /// Key that verifies per-job tokens (`None` if it could not be read: job tokens are then
    /// refused with a message that says so).
    pub job_key: Option<Arc<Vec<u8>>>,
    /// Cancelled once when shutdown starts.
    pub shutdown: CancellationToken,
    /// Deferred work (usage rows, stream drains) that shutdown waits for.
    pub tasks: TaskTracker,
}

impl AppParts {
    /// GPU index -> UUID, as NVML reports it (empty without NVML).
    pub fn gpu_uuids(&self) -> std::collections::BTreeMap<u32, String> {
        self.telemetry.gpus().into_iter().map(|g| (g.index, g.uuid)).collect()
    }
}

/// The sockets the agent serves on; `main` binds them, tests pass port-0 listeners.
pub struct Listeners {
    /// `None` on a node without the gateway role (`[cluster] gateway_nodes`).
    pub gateway: Option<TcpListener>,
    pub metrics: TcpListener,
    pub control: UnixListener,
}

impl Listeners {
    /// Binds the configured addresses, with errors that name the key to change.
    pub async fn bind(config: &Config) -> anyhow::Result<Listeners> {
        let f = &config.file;
        let gateway = if config.is_gateway() {
            Some(
                TcpListener::bind(&f.gateway.listen)
                    .await
                    .with_context(|| format!("cannot listen on gateway.listen = {} (in use? change gateway.listen)", f.gateway.listen))?,
            )
        } else {
            None
        };
        let metrics = TcpListener::bind(&f.metrics.listen)
            .await
            .with_context(|| format!("cannot listen on metrics.listen = {} (in use? change metrics.listen)", f.metrics.listen))?;
        let control = control::server::bind(&config.control_socket).with_context(|| {
            format!("cannot create the control socket {} (set admin.socket or paths.runtime_dir)", config.control_socket.display())
        })?;
        Ok(Listeners { gateway, metrics, control })
    }
}

/// Runs the agent until `shutdown` resolves, then shuts down in phases: stop accepting,
/// drain in-flight requests, wait for deferred writes, close the store.
pub async fn run(config: Config, listeners: Listeners, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let config = Arc::new(config);
    let store = Store::open(&config.store_url, config.file.store.max_connections).await?;
    tracing::info!(store = %config::redact_url(&config.store_url), "store ready");

    let mut registry = Registry::default();
    let telemetry = Arc::new(telemetry::Telemetry::start(&config.file.telemetry, &mut registry));

    let acct_metrics = accounting::AccountingMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
    registry.sub_registry_with_prefix("gpuhub").register_collector(Box::new(telemetry::disk::DirSpace::new(vec![
        ("state", config.file.paths.state_dir.clone()),
        ("spool", config.file.paths.spool_dir.clone()),
    ])));
    let gateway = Arc::new(gateway::Gateway::start(&config, &store, registry.sub_registry_with_prefix("gpuhub")).await?);

    // The registry's tagged models are in the first catalog when MLflow answers quickly, so
    // their workers are adopted after a restart.
    let catalog_sync = Arc::new(models::sync::CatalogSync::new(&config, &mut registry));
    let first_mlflow = config.file.mlflow.tracking_uri.as_deref().filter(|u| !u.is_empty()).map(models::mlflow::Mlflow::new);
    let first: Catalog = catalog_sync.initial(first_mlflow.as_ref(), std::time::Duration::from_secs(5)).await;
    let catalog = Arc::new(LiveCatalog::new(Arc::new(first)));
    let names = Arc::new(NameRegistry::open(catalog.clone(), &config.file.names, &config.file.roles, &store, &mut registry).await?);
    let (shutdown_token, tasks) = (CancellationToken::new(), TaskTracker::new());
    let models = Arc::new(
        ModelManager::start_live(
            catalog.clone(),
            models::ManagerDeps {
                config: &config,
                store: Some(store.clone()),
                registry: &mut registry,
                gpus: {
                    let t = telemetry.clone();
                    Box::new(move || t.gpus())
                },
                tasks: tasks.clone(),
                shutdown: shutdown_token.clone(),
            },
        )
        .await,
    );

    if let Err(e) = snapshot::ensure_job_key(&config.job_key_path) {
        tracing::error!(path = %config.job_key_path.display(), error = %e, "cannot create the job-credential key; jobs get no gateway token");
    }
    let job_key = match snapshot::read_job_key(&config.job_key_path) {
        Ok(k) => Some(Arc::new(k)),
        Err(e) => {
            tracing::error!(path = %config.job_key_path.display(), error = %e, "cannot read the job-credential key; job tokens will be refused");
            None
        }
    };

    let quotas = Arc::new(quota::Quotas::new(quota::slurm::Sacctmgr {
        bin: config.file.slurm.bin_dir.as_ref().map_or_else(|| std::path::PathBuf::from("sacctmgr"), |d| d.join("sacctmgr")),
        timeout: std::time::Duration::from_secs(20),
    }));
    registry.sub_registry_with_prefix("gpuhub").register_collector(Box::new(quotas.metrics()));
    let state = AppState(Arc::new(AppParts {
        config: config.clone(),
        store: store.clone(),
        catalog,
        catalog_sync,
        names,
        models,
        telemetry,
        gateway,
        quotas,
        job_key,
        shutdown: shutdown_token,
        tasks,
    }));
    if let Err(e) = snapshot::write(&state) {
        tracing::error!(path = %config.snapshot_path.display(), error = %e, "cannot write the snapshot; jobs fall back to the plugstack arguments");
    }

    let exposition = Arc::new(telemetry::exposition::Exposition::new(registry, Some(state.telemetry.dcgm())));
    let token = state.shutdown.clone();
    let gw_addr = listeners.gateway.as_ref().map(TcpListener::local_addr).transpose()?;
    let m_addr = listeners.metrics.local_addr()?;
    match gw_addr {
        Some(gw) => tracing::info!(gateway = %gw, metrics = %m_addr, control = %config.control_socket.display(), "gpuhub-agent listening"),
        None => tracing::info!(
            metrics = %m_addr,
            control = %config.control_socket.display(),
            node = %config.file.telemetry.effective_node_name(),
            gateway_nodes = %config.file.cluster.gateway_nodes.join(","),
            jobs_told = %config.file.gateway.public_url(),
            "gpuhub-agent listening; this node runs no gateway (cluster.gateway_nodes): telemetry, ingest and the control socket only"
        ),
    }

    gateway::server::raise_fd_limit(config.file.gateway.max_connections);
    // The SSO socket (`[gateway.sso] socket`): the same gateway, for a proxy that proves
    // itself by its uid.
    let sso_listener = match config.file.gateway.sso.socket.as_deref().filter(|_| config.file.gateway.sso.enabled && gw_addr.is_some()) {
        Some(path) => Some(control::server::bind(path).with_context(|| {
            format!("cannot create the SSO socket {} (set gateway.sso.socket to a path in a directory root can write)", path.display())
        })?),
        None => None,
    };
    // Before the first call: other gateways count this one from it on.
    let announced = cluster_sync::announce(&state).await;
    let gateway = {
        let app = gateway::router(state.clone());
        let (token, conns) = (token.clone(), state.gateway.connections.clone());
        let sso = sso_listener.map(|l| tokio::spawn(gateway::server::serve(l, app.clone(), conns.clone(), token.clone())));
        let tcp_listener = listeners.gateway;
        tokio::spawn(async move {
            let tcp = match tcp_listener {
                Some(l) => gateway::server::serve(l, app, conns, token).await,
                None => Ok(()),
            };
            if let Some(sso) = sso {
                match sso.await {
                    Ok(Err(e)) => tracing::error!(error = %e, "the SSO socket's server ended with an error"),
                    Err(e) => tracing::error!(error = %e, "the SSO socket's server failed"),
                    Ok(Ok(())) => {}
                }
            }
            tcp
        })
    };
    // Refused calls are kept as one usage row per peer and minute: recorded once the minute
    // is over.
    {
        let (state, token) = (state.clone(), token.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => state.gateway.flush_refusals(false),
                    _ = token.cancelled() => return,
                }
            }
        });
    }
    // The MLflow registry, every mlflow.registry_poll_s, and `@production` against what gpuhub
    // promoted (every 30 s when the registry is not polled); agent.toml's catalog on SIGHUP.
    let poll_s = config.file.mlflow.registry_poll_s;
    if state.models.mlflow().is_some() {
        let (state, token) = (state.clone(), token.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_secs(if poll_s > 0 { poll_s } else { 30 }));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        if poll_s > 0 {
                            // Errors are logged by the poll, once per change.
                            let _ = state.catalog_sync.poll(&state).await;
                        }
                        state.catalog_sync.report_unserved(&state);
                        models::gate::check_aliases(&state.models).await;
                    }
                    _ = token.cancelled() => return,
                }
            }
        });
    }
    {
        let (state, token) = (state.clone(), token.clone());
        tokio::spawn(async move {
            use tokio::signal::unix::{SignalKind, signal};
            let mut hup = match signal(SignalKind::hangup()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot install the SIGHUP handler; reload with `gpuhub models reload`");
                    return;
                }
            };
            loop {
                tokio::select! {
                    _ = hup.recv() => {
                        tracing::info!("SIGHUP received: reloading the catalog and [gateway.limits] of agent.toml");
                        if let Err(e) = state.catalog_sync.reload(&state).await {
                            tracing::error!(error = %e, "reload refused");
                        }
                    }
                    _ = token.cancelled() => return,
                }
            }
        });
    }
    let usage_metrics = acct_metrics.usage.clone();
    let mut ingestor = accounting::Ingestor::new(store.clone(), config.file.paths.spool_dir.clone(), state.telemetry.clone(), acct_metrics);
    let tcfg = &config.file.telemetry;
    if tcfg.enable_slurm && config.file.accounting.slurm_reconcile {
        let dir = tcfg.slurm_bin_dir.clone().or_else(|| config.file.slurm.bin_dir.clone());
        let bin = |name: &str| dir.as_ref().map_or_else(|| std::path::PathBuf::from(name), |d| d.join(name));
        let node = tcfg.effective_node_name();
        ingestor = ingestor.with_slurm(accounting::ingest::SlurmLink {
            source: Arc::new(accounting::slurm::CommandSlurm {
                scontrol: bin("scontrol"),
                squeue: bin("squeue"),
                sacct: bin("sacct"),
                timeout: std::time::Duration::from_millis(tcfg.slurm_timeout_ms.clamp(100, 600_000)),
                node: node.clone(),
                last_look: state.telemetry.last_look(),
            }),
            node,
            interval: std::time::Duration::from_millis(
                config.file.accounting.reconcile_interval_ms.unwrap_or(tcfg.slurm_interval_ms).max(1_000),
            ),
            boundaries: config.file.accounting.job_boundaries,
            job_map_dir: (config.file.accounting.job_boundaries == config::JobBoundaries::Slurm)
                .then(|| tcfg.job_map().map(std::path::Path::to_path_buf))
                .flatten(),
        });
    } else if config.file.accounting.job_boundaries == config::JobBoundaries::Slurm {
        tracing::warn!(
            "accounting: job boundaries come from Slurm (accounting.job_boundaries = \"slurm\") but telemetry.enable_slurm or accounting.slurm_reconcile is off: \
             jobs known from step records never end; turn Slurm back on, or use the plugin build with job hooks and job_boundaries = \"prolog\""
        );
    } else {
        tracing::info!(
            "accounting: not reconciled with Slurm (telemetry.enable_slurm or accounting.slurm_reconcile is off); job records are billed as they claim"
        );
    }
    let usage_counters = accounting::usage_counters::UsageCounters::new(store.clone(), tcfg.effective_node_name(), usage_metrics);
    let usage_task = tokio::spawn(
        usage_counters.run(std::time::Duration::from_millis(config.file.accounting.usage_counters_interval_ms), token.clone()),
    );
    // GPU use on the MLflow run page: ended jobs' measured figures onto their runs.
    let run_page = config
        .file
        .mlflow
        .tracking_uri
        .as_deref()
        .filter(|u| !u.is_empty())
        .map(|uri| tokio::spawn(mlflow_runs::Reporter::new(store.clone(), uri).run(std::time::Duration::from_secs(5), token.clone())));
    // The site's default experiment exists before jobs race to create it.
    let site_experiment = match (config.file.mlflow.tracking_uri.as_deref(), config.file.mlflow.default_experiment.as_deref()) {
        (Some(uri), Some(name)) if !uri.is_empty() && !name.is_empty() => {
            Some(tokio::spawn(mlflow_runs::site_experiment::keep(mlflow_runs::Tracking::new(uri), name.to_string(), token.clone())))
        }
        _ => None,
    };
    let sync_task = tokio::spawn(cluster_sync::run(state.clone(), token.clone(), announced));
    let quota_task = tokio::spawn(quota::Quotas::run(
        state.clone(),
        std::time::Duration::from_millis(config.file.accounting.quota_interval_ms),
        token.clone(),
    ));
    let ingest = tokio::spawn(ingestor.run(std::time::Duration::from_millis(config.file.accounting.ingest_interval_ms), token.clone()));
    let metrics = tokio::spawn(metrics_http::serve(listeners.metrics, exposition, token.clone()));
    let control = tokio::spawn(control::serve(listeners.control, state.clone()));

    shutdown.await;
    tracing::info!("shutdown: no new connections; draining in-flight requests");
    token.cancel();
    if ingest.await.is_err() {
        tracing::error!("accounting: the ingest task failed");
    }
    if let Some(t) = run_page
        && t.await.is_err()
    {
        tracing::error!("mlflow run page: the reporter task failed");
    }
    if let Some(t) = site_experiment
        && t.await.is_err()
    {
        tracing::error!("mlflow: the site experiment task failed");
    }
    if sync_task.await.is_err() {
        tracing::error!("cluster sync: the task failed");
    }
    if quota_task.await.is_err() {
        tracing::error!("quotas: the quota task failed");
    }
    if usage_task.await.is_err() {
        tracing::error!("accounting: the usage counter task failed");
    }
    for (name, task) in [("gateway", gateway), ("metrics", metrics), ("control", control)] {
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(server = name, error = %e, "server ended with an error"),
            Err(e) => tracing::error!(server = name, error = %e, "server task failed"),
        }
    }
    state.tasks.close();
    tracing::info!(pending = state.tasks.len(), "shutdown: waiting for deferred writes");
    state.tasks.wait().await;
    state.gateway.flush_refusals(true);
    tracing::info!("shutdown: writing the usage log");
    state.gateway.usage.close().await;
    store.close().await;
    tracing::info!("shutdown complete");
    Ok(())
}

/// Resolves on SIGTERM (systemd) or SIGINT (Ctrl-C).
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot install the SIGTERM handler");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = term => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}
