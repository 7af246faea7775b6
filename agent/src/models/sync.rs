//! Keeps the served catalog in step with its two sources, with no agent restart:
//! - `agent.toml`'s `[[models]]`, `[roles]` and `[templates]` (and `[gateway.limits]`, which
//!   the gateway's fair use takes at once), read again on SIGHUP and
//!   `gpuhub models reload`; a file that does not validate changes nothing and says why;
//! - the MLflow registry's models tagged `served_by=gateway` ([`super::registry`]), read every
//!   `mlflow.registry_poll_s`. A model whose tag is removed leaves the catalog through the
//!   names lifecycle: its name is retired (callers are told what happened), and restored if
//!   the tag comes back.
//!
//! Each change builds a whole new catalog and hands it to
//! [`super::ModelManager::apply_catalog`]; changes are serialised by one lock.
//!
//! Metrics: `gpuhub_mlflow_registry_up{registry="mlflow"}` (1 when the last read succeeded;
//! no series while the agent does not poll), `gpuhub_mlflow_registry_poll_errors_total` and
//! `gpuhub_mlflow_registry_unservable_models` (tagged models refused for a bad tag).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Serialize;

use super::mlflow::{Mlflow, RegisteredModel};
use super::registry::{self, TagError};
use super::{Catalog, CatalogChange};
use crate::AppState;
use crate::config::{Config, ConfigFile};

/// What the last registry poll found (for `gpuhub models registry`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RegistryView {
    /// When the registry was last read (µs), successfully or not.
    pub polled_us: Option<i64>,
    /// Why the last read failed (the catalog keeps the models of the last good one).
    pub error: Option<String>,
    /// Names served because of registry tags.
    pub served: Vec<String>,
    /// Tagged models that are not served, each with its tag and fix.
    pub errors: Vec<TagError>,
}

/// The outcome of a reload.
#[derive(Debug, Clone, Serialize)]
pub struct Reloaded {
    pub change: CatalogChange,
    /// Whether `[gateway.limits]` changed (it applies from the next call).
    pub limits: bool,
    /// Whether `[gateway.user_models]` or `gateway.keys_per_user` changed (from the next call).
    pub access: bool,
    /// Sections that changed in the file but only take effect at a restart.
    pub needs_restart: Vec<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RegistryLabel {
    registry: &'static str,
}

const MLFLOW: RegistryLabel = RegistryLabel { registry: "mlflow" };

/// The registry poll's health, for dashboards and the `GpuhubMlflowRegistry*` alerts.
#[derive(Clone, Debug, Default)]
struct RegistryMetrics {
    up: Family<RegistryLabel, Gauge>,
    errors: Family<RegistryLabel, Counter>,
    unservable: Family<RegistryLabel, Gauge>,
    unserved_roles: Gauge,
}

impl RegistryMetrics {
    fn register(registry: &mut Registry) -> RegistryMetrics {
        let m = RegistryMetrics::default();
        let r = registry.sub_registry_with_prefix("gpuhub");
        r.register("mlflow_registry_up", "1 when the last read of the MLflow registry succeeded, 0 when it failed", m.up.clone());
        r.register("mlflow_registry_poll_errors", "Reads of the MLflow registry that failed", m.errors.clone());
        r.register(
            "mlflow_registry_unservable_models",
            "Models tagged served_by=gateway that are not served because of a bad tag (gpuhub models registry says which)",
            m.unservable.clone(),
        );
        r.register(
            "roles_unserved",
            "Roles assigned a model this node does not serve: calls to them get 503 role_model_not_served (gpuhub names list and gpuhub doctor say which)",
            m.unserved_roles.clone(),
        );
        m
    }
}

pub struct CatalogSync {
    /// The file reloads read (`None`: the agent runs on embedded defaults).
    path: Option<PathBuf>,
    /// The configuration whose catalog is served.
    file: Mutex<ConfigFile>,
    /// Tagged models as of the last good poll (`None`: never read).
    found: Mutex<Option<Vec<RegisteredModel>>>,
    view: Mutex<RegistryView>,
    /// One change at a time (poll, reload).
    changing: tokio::sync::Mutex<()>,
    /// Roles whose model was not served, and `[gateway.user_models]` entries naming nothing
    /// served, as last logged ([`Self::report_unserved`]).
    unserved_roles: Mutex<Option<String>>,
    unserved_allowed: Mutex<Option<String>>,
    metrics: RegistryMetrics,
}

impl CatalogSync {
    pub fn new(config: &Config, registry: &mut Registry) -> CatalogSync {
        CatalogSync {
            path: config.source.clone().filter(|p| p.as_os_str() != "<inline>"),
            file: Mutex::new(config.file.clone()),
            found: Mutex::new(None),
            view: Mutex::new(RegistryView::default()),
            changing: tokio::sync::Mutex::new(()),
            unserved_roles: Mutex::new(None),
            unserved_allowed: Mutex::new(None),
            metrics: RegistryMetrics::register(registry),
        }
    }

    pub fn view(&self) -> RegistryView {
        self.view.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The catalog to start with: `[[models]]` and, when the registry answers within
    /// `timeout`, its tagged models (so workers of those models are adopted after a restart).
    pub async fn initial(&self, mlflow: Option<&Mlflow>, timeout: std::time::Duration) -> Catalog {
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let polling = file.mlflow.registry_poll_s > 0;
        if let Some(mlflow) = mlflow.filter(|_| polling) {
            match tokio::time::timeout(timeout, mlflow.discover()).await {
                Ok(Ok(found)) => {
                    let built = self.record(&file, Ok(&found));
                    *self.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(found);
                    return Catalog::build(&file, &built);
                }
                Ok(Err(e)) => {
                    self.record(&file, Err(e.to_string()));
                }
                Err(_) => {
                    self.record(&file, Err(format!("MLflow did not answer within {}s", timeout.as_secs())));
                }
            }
            return Catalog::from_config(&file).registry_unread();
        }
        Catalog::from_config(&file)
    }

    /// Reads the registry and serves what it tags. A failed read keeps the catalog.
    pub async fn poll(&self, state: &AppState) -> Result<CatalogChange, String> {
        let Some(mlflow) = state.models.mlflow() else { return Ok(CatalogChange::default()) };
        let found = mlflow.discover().await;
        let _one = self.changing.lock().await;
        let file = self.file.lock().unwrap_or_else(|p| p.into_inner()).clone();
        match found {
            Ok(found) => {
                *self.found.lock().unwrap_or_else(|p| p.into_inner()) = Some(found.clone());
                let entries = self.record(&file, Ok(&found));
                Ok(self.apply_read(state, &file, entries, true).await)
            }
            Err(e) => {
                let message = e.to_string();
                self.record(&file, Err(message.clone()));
                Err(message)
            }
        }
    }

    /// Reads agent.toml again. A file that does not validate changes nothing: the error says
    /// what is wrong, and the running catalog stays.
    pub async fn reload(&self, state: &AppState) -> Result<Reloaded, String> {
        let Some(path) = self.path.clone() else {
            return Err("the agent runs on its embedded defaults (no agent.toml was read at start), so there is nothing to reload; restart it with --config PATH".into());
        };
        let _one = self.changing.lock().await;
        let config = Config::load(&path, false).map_err(|e| format!("{e}; the running catalog is unchanged"))?;
        let old = self.file.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let (file, limits, needs_restart) = reloaded(&old, &config.file);
        if limits {
            state.gateway.fair_use.set_limits(file.gateway.limits.clone());
            tracing::info!("agent.toml reloaded: [gateway.limits] apply from the next call (the counts so far stay)");
        }
        let access = state.gateway.access.set(&file.gateway);
        if access {
            tracing::info!("agent.toml reloaded: [gateway.user_models] and gateway.keys_per_user apply from the next call");
        }
        *self.file.lock().unwrap_or_else(|p| p.into_inner()) = file.clone();
        let found = self.found.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let unread = found.is_none() && state.models.mlflow().is_some() && file.mlflow.registry_poll_s > 0;
        let entries = match &found {
            Some(found) => self.record(&file, Ok(found)),
            None => Vec::new(),
        };
        let change = self.apply_read(state, &file, entries, !unread).await;
        if let Err(e) = crate::snapshot::write(state) {
            tracing::error!(error = %e, "cannot rewrite the snapshot after a reload; new jobs get the old roles until it is");
        }
        self.report_unserved(state);
        if !needs_restart.is_empty() {
            tracing::warn!(sections = %needs_restart.join(", "), "agent.toml reloaded: these sections changed and take effect at the next restart");
        }
        tracing::info!(path = %path.display(), added = ?change.added, removed = ?change.removed, changed = ?change.changed, "agent.toml reloaded");
        Ok(Reloaded { change, limits, access, needs_restart })
    }

    /// Logs the roles assigned a model this node does not serve (a `[roles]` seed naming a
    /// model no registry poll serves, a model untagged or removed since), and the
    /// `[gateway.user_models]` entries that name nothing served (with a polled registry such a
    /// name cannot be checked when agent.toml is read: a typo would show only as its user's
    /// 403), each once per change, and once when all is served again.
    pub fn report_unserved(&self, state: &AppState) {
        let names = &state.names;
        let unserved = names.unserved_roles();
        self.metrics.unserved_roles.set(i64::try_from(unserved.len()).unwrap_or(i64::MAX));
        once_per_change(
            &self.unserved_roles,
            crate::names::unserved_roles_line(&unserved),
            |line| {
                tracing::warn!(roles = %line, fix = crate::names::UNSERVED_ROLE_FIX,
                "roles: a role's model is not served on this node; calls to the role get 503 role_model_not_served")
            },
            || tracing::info!("roles: every assigned role's model is served again"),
        );
        once_per_change(
            &self.unserved_allowed,
            crate::names::unserved_allowed_line(&names.unserved_allowed(&state.gateway.access.get().user_models)),
            |line| {
                tracing::warn!(entries = %line, fix = crate::names::UNSERVED_ALLOWED_FIX,
                "gateway.user_models: an allow-list names a model that is not served here; that user's calls to it are refused")
            },
            || tracing::info!("gateway.user_models: every allow-list entry is served again"),
        );
    }

    /// Builds the registry's entries for `file` and remembers the outcome; tag errors are
    /// logged once each (again only after they were fixed and came back).
    fn record(&self, file: &ConfigFile, found: Result<&Vec<RegisteredModel>, String>) -> Vec<crate::config::ModelConfig> {
        let mut view = self.view.lock().unwrap_or_else(|p| p.into_inner());
        view.polled_us = Some(crate::util::now_us());
        match found {
            Ok(found) => {
                if let Some(e) = view.error.take() {
                    tracing::info!(was = %e, "the MLflow registry answers again");
                }
                let built = registry::build(found, file);
                for e in &built.errors {
                    if !view.errors.contains(e) {
                        tracing::error!(model = %e.model, tag = %e.tag, error = %e, "a registry-tagged model is not served");
                    }
                }
                self.metrics.up.get_or_create(&MLFLOW).set(1);
                self.metrics.unservable.get_or_create(&MLFLOW).set(i64::try_from(built.errors.len()).unwrap_or(i64::MAX));
                view.errors = built.errors;
                view.served = built.entries.iter().map(|m| m.name.clone()).collect();
                built.entries
            }
            Err(message) => {
                self.metrics.up.get_or_create(&MLFLOW).set(0);
                self.metrics.errors.get_or_create(&MLFLOW).inc();
                // The last good read's count stays (0 before any): the series exists from the
                // first poll, so dashboards and alerts see it.
                let _ = self.metrics.unservable.get_or_create(&MLFLOW);
                if view.error.as_deref() != Some(message.as_str()) {
                    tracing::warn!(error = %message, "cannot read the MLflow registry; serving the tagged models of the last good read");
                }
                view.error = Some(message);
                Vec::new()
            }
        }
    }

    /// Serves `file`'s catalog with `entries` from the registry. Names the registry stops
    /// serving are retired before the swap (so no call sees them unknown), names it serves
    /// again are restored after it.
    /// (`read`: `entries` come from a registry read; else none has succeeded yet.)
    async fn apply_read(&self, state: &AppState, file: &ConfigFile, entries: Vec<crate::config::ModelConfig>, read: bool) -> CatalogChange {
        let built = Catalog::build(file, &entries);
        let new = Arc::new(if read { built } else { built.registry_unread() });
        let old = state.catalog.load();
        let gone: Vec<(String, String)> = old
            .registry_names()
            .iter()
            .filter(|n| new.model(n).is_none())
            .map(|n| (n.clone(), old.model(n).and_then(|m| m.mlflow_model.clone()).unwrap_or_default()))
            .collect();
        let back: Vec<String> = new.registry_names().iter().cloned().collect();
        if !gone.is_empty()
            && let Err(e) = state.names.follow_registry(&state.store, &gone, &[]).await
        {
            tracing::error!(error = %e, "cannot retire the names of models untagged in MLflow; their callers get 404s until the next poll");
        }
        let change = state.models.apply_catalog(new).await;
        if let Err(e) = state.names.follow_registry(&state.store, &[], &back).await {
            tracing::error!(error = %e, "cannot restore the names of models tagged again in MLflow");
        }
        if let Err(e) = state.names.reload(&state.store).await {
            tracing::error!(error = %e, "cannot reload the name registry after a catalog change");
        }
        change
    }
}

/// `old` with what a reload applies taken from `new`: `[[models]]`, `[roles]`,
/// `[templates]`, `[gateway.limits]`, `[gateway.user_models]` and `gateway.keys_per_user`.
/// Also whether the limits changed, and the sections that still differ (they take effect at
/// the next restart).
fn reloaded(old: &ConfigFile, new: &ConfigFile) -> (ConfigFile, bool, Vec<String>) {
    let mut file = old.clone();
    file.models = new.models.clone();
    file.roles = new.roles.clone();
    file.templates = new.templates.clone();
    file.gateway.limits = new.gateway.limits.clone();
    file.gateway.user_models = new.gateway.user_models.clone();
    file.gateway.keys_per_user = new.gateway.keys_per_user;
    let limits = serde_json::to_value(&old.gateway.limits).ok() != serde_json::to_value(&new.gateway.limits).ok();
    let (Ok(serde_json::Value::Object(a)), Ok(serde_json::Value::Object(b))) = (serde_json::to_value(&file), serde_json::to_value(new))
    else {
        return (file, limits, Vec::new());
    };
    let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    let later = keys.into_iter().filter(|k| a.get(*k) != b.get(*k)).cloned().collect();
    (file, limits, later)
}

/// Calls `warn` with `now` when it differs from what `last` holds, or `ok` when it turned
/// `None`, and keeps `now`: a condition is logged once per change, not on every pass.
fn once_per_change(last: &Mutex<Option<String>>, now: Option<String>, warn: impl FnOnce(&str), ok: impl FnOnce()) {
    let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
    if *last == now {
        return;
    }
    match &now {
        Some(line) => warn(line),
        None => ok(),
    }
    *last = now;
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn reload_names_the_sections_that_need_a_restart() {
        let a = Config::from_toml("[gateway]\nlisten = \"127.0.0.1:8400\"\n").unwrap();
        let b = Config::from_toml(
            "[gateway]\nlisten = \"127.0.0.1:8401\"\n[roles]\nchat = \"\"\n[[models]]\nname = \"m\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n",
        )
        .unwrap();
        let (file, limits, later) = reloaded(&a.file, &b.file);
        assert_eq!((limits, later), (false, vec!["gateway".to_string()]));
        assert_eq!((file.models.len(), file.gateway.listen.as_str()), (1, "127.0.0.1:8400"), "the catalog applies, the listener waits");
        assert!(reloaded(&a.file, &a.file).2.is_empty());
        // [gateway.limits] applies at once: it needs no restart.
        let c = Config::from_toml("[gateway]\nlisten = \"127.0.0.1:8400\"\n[gateway.limits]\nrpm = 5\n").unwrap();
        let (file, limits, later) = reloaded(&a.file, &c.file);
        assert_eq!((limits, later, file.gateway.limits.rpm), (true, Vec::<String>::new(), 5));
        // So do the allow-lists and keys_per_user.
        let d = Config::from_toml(&format!(
            "[gateway]\nlisten = \"127.0.0.1:8400\"\nkeys_per_user = 0\n[gateway.user_models]\nalice = [\"m\"]\n{}",
            "[[models]]\nname = \"m\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n"
        ))
        .unwrap();
        let (file, limits, later) = reloaded(&a.file, &d.file);
        assert_eq!((limits, later, file.gateway.keys_per_user), (false, Vec::<String>::new(), 0));
        assert_eq!(file.gateway.user_models.len(), 1);
    }

    #[test]
    fn a_failed_registry_read_shows_in_the_metrics_until_a_good_one() {
        let config = Config::from_toml("[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\n").unwrap();
        let mut registry = Registry::default();
        let sync = CatalogSync::new(&config, &mut registry);
        let text = |registry: &Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, registry).unwrap();
            out
        };
        assert!(!text(&registry).contains("gpuhub_mlflow_registry_up{"), "no series before the first read");
        sync.record(&config.file, Err("connection refused".into()));
        let t = text(&registry);
        assert!(t.contains("gpuhub_mlflow_registry_up{registry=\"mlflow\"} 0"), "{t}");
        assert!(t.contains("gpuhub_mlflow_registry_poll_errors_total{registry=\"mlflow\"} 1"), "{t}");
        assert!(t.contains("gpuhub_mlflow_registry_unservable_models{registry=\"mlflow\"} 0"), "{t}");
        sync.record(&config.file, Ok(&Vec::new()));
        let t = text(&registry);
        assert!(t.contains("gpuhub_mlflow_registry_up{registry=\"mlflow\"} 1"), "{t}");
        assert!(t.contains("gpuhub_mlflow_registry_unservable_models{registry=\"mlflow\"} 0"), "{t}");
        assert_eq!(sync.view().error, None);
    }
}
