//! Names as first-class objects: every name a client may call has a state (active,
//! deprecated, retired), a replacement and a history; unknown names get a "did you mean".
//!
//! The gateway asks [`NameRegistry::resolve`] for every call and gets a [`Resolution`] that
//! says what to serve and what to tell the caller ([`NameRegistry::refusal`],
//! [`NameRegistry::deprecation_headers`]), then counts the call with
//! [`NameRegistry::count_call`] (`gpuhub_gateway_name_calls_total`).
//!
//! # Parts
//! - this file: the in-memory registry the request path reads (a short `RwLock` read, no
//!   store access), rebuilt from the store after every change;
//! - [`lifecycle`]: rename, deprecate, retire, restore and role changes, each planned (with the
//!   callers it affects) before it is applied, and refused with a message that says why;
//! - [`callers`]: the callers rollup the gateway's usage writer feeds;
//! - [`metrics`]: calls by name state, sunset dates;
//! - [`api`]: the control-socket routes behind `gpuhub names` and `gpuhub roles`;
//! - [`suggest`]: "did you mean".
//!
//! The store is the truth: the catalog (`[[models]]`, aliases, `[roles]`) says what is served,
//! the `names` table overrides single names (deprecated, retired, or an alias restored at run
//! time), `role_assignments` overrides roles. `[[names.history]]` and `[roles]` in the config
//! are seeds, applied once each (and again only when the config entry itself changes).

pub mod api;
pub mod callers;
pub mod lifecycle;
pub mod metrics;
pub mod suggest;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use prometheus_client::registry::Registry;

use crate::config::NamesConfig;
use crate::models::{Catalog, LiveCatalog};
use crate::store::names::{NameOp, NameRow, NewHistory};
use crate::store::{Store, StoreError};

pub use lifecycle::{LifecycleError, Plan};

/// What a requested model name means right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Served as `model`.
    Active { model: String },
    /// Still served as `model`, but the caller should move to it before `sunset`.
    Deprecated { model: String, since: Option<String>, sunset: Option<String> },
    /// Not served any more.
    Retired { replacement: Option<String>, since: Option<String>, role: Option<String> },
    /// The name is a role (or the model of a role) that has no model assigned.
    RoleUnassigned { role: String },
    /// The name is a role whose model is not served here now: in no catalog entry (a
    /// `[roles]` seed naming an MLflow-tagged model before the registry serves it, or a
    /// model untagged or removed since), or retired.
    RoleUnserved { role: String, model: String },
    /// Never known; the closest current and historical names.
    Unknown { suggestions: Vec<String> },
}

impl Resolution {
    /// The label used in metrics and the usage log.
    pub fn state(&self) -> &'static str {
        match self {
            Resolution::Active { .. } => "active",
            Resolution::Deprecated { .. } => "deprecated",
            Resolution::Retired { .. } => "retired",
            Resolution::RoleUnassigned { .. } => "unassigned",
            Resolution::RoleUnserved { .. } => "unserved",
            Resolution::Unknown { .. } => "unknown",
        }
    }

    /// The model that serves the call, if any.
    pub fn model(&self) -> Option<&str> {
        match self {
            Resolution::Active { model } | Resolution::Deprecated { model, .. } => Some(model),
            _ => None,
        }
    }
}

/// A refusal for a name that is not served: HTTP status, OpenAI error `code`, message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

/// The state of a name in the registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum NameState {
    Active,
    Deprecated,
    Retired,
}

impl NameState {
    pub fn as_str(self) -> &'static str {
        match self {
            NameState::Active => "active",
            NameState::Deprecated => "deprecated",
            NameState::Retired => "retired",
        }
    }

    pub fn parse(s: &str) -> Option<NameState> {
        match s {
            "active" => Some(NameState::Active),
            "deprecated" => Some(NameState::Deprecated),
            "retired" => Some(NameState::Retired),
            _ => None,
        }
    }
}

/// A registry entry: a name whose state differs from what the catalog says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NameRecord {
    pub state: NameState,
    /// Deprecated/retired: the name to use instead. Active: the name it is an alias of.
    pub replacement: Option<String>,
    pub since: Option<String>,
    pub sunset: Option<String>,
    pub updated_us: i64,
    pub updated_by: String,
}

/// Days since 1970-01-01 for a `YYYY-MM-DD` date (civil calendar).
pub fn days_from_civil(date: &str) -> Option<i64> {
    if !crate::config::is_date(date) {
        return None;
    }
    let y: i64 = date.get(0..4)?.parse().ok()?;
    let m: i64 = date.get(5..7)?.parse().ok()?;
    let d: i64 = date.get(8..10)?.parse().ok()?;
    // Reject 2026-02-30 and friends: the date must survive a round trip.
    let days = {
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y - era * 400;
        let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    };
    (civil_from_days(days) == date).then_some(days)
}

/// `YYYY-MM-DD` for days since 1970-01-01.
pub fn civil_from_days(days: i64) -> String {
    let (y, m, d) = crate::util::civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Today's date (UTC), `YYYY-MM-DD`.
pub fn today() -> String {
    civil_from_days(crate::util::now_s().div_euclid(86_400))
}

/// `YYYY-MM-DD` -> Unix seconds at midnight UTC (RFC 9745 `Deprecation: @<seconds>`).
pub(crate) fn http_date(date: &str) -> Option<i64> {
    days_from_civil(date).map(|d| d * 86_400)
}

/// `YYYY-MM-DD` -> IMF-fixdate (RFC 8594 `Sunset`), e.g. `Thu, 31 Dec 2026 00:00:00 GMT`.
fn imf_date(date: &str) -> Option<String> {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let days = days_from_civil(date)?;
    let m: usize = date.get(5..7)?.parse().ok()?;
    Some(format!(
        "{}, {} {} {} 00:00:00 GMT",
        DAYS[days.rem_euclid(7) as usize],
        date.get(8..10)?,
        MONTHS.get(m.checked_sub(1)?)?,
        date.get(0..4)?
    ))
}

/// One name as `gpuhub names list` and `/v1/models` show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NameEntry {
    pub name: String,
    /// `active`, `deprecated`, `retired`, `unassigned` (a role without a model).
    pub state: &'static str,
    /// `model` (a catalog entry), `alias` (of a catalog entry), `role`, or `renamed` (a name
    /// kept by the registry: deprecated, retired or restored).
    pub kind: &'static str,
    /// The model that serves calls to this name (none when refused).
    pub serves: Option<String>,
    /// The name callers should move to.
    pub replacement: Option<String>,
    pub since: Option<String>,
    pub sunset: Option<String>,
    pub changed_by: Option<String>,
    pub changed_us: Option<i64>,
}

/// The in-memory view of every name. Reads are a short `RwLock` read (no await, no store
/// access on the request path); changes go to the store first, then [`NameRegistry::reload`]
/// rebuilds the view.
pub struct NameRegistry {
    catalog: Arc<LiveCatalog>,
    retired_status: u16,
    recent_caller_days: u32,
    inner: RwLock<Inner>,
    metrics: metrics::NameMetrics,
    /// Serialises changes (plan + apply + reload), so two admins renaming at once cannot
    /// both plan against the same old state. Never taken on the request path.
    change_lock: tokio::sync::Mutex<()>,
}

/// The registry's state: what `resolve` reads and what lifecycle plans start from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inner {
    pub names: BTreeMap<String, NameRecord>,
    /// Effective roles: the catalog's, overridden by runtime assignments.
    pub roles: BTreeMap<String, Option<String>>,
}

impl NameRegistry {
    /// A registry from the config alone (no store, metrics not exported): tests and tools.
    /// The agent uses [`NameRegistry::open`].
    pub fn new(catalog: Arc<Catalog>, cfg: &NamesConfig) -> NameRegistry {
        NameRegistry::on(Arc::new(LiveCatalog::new(catalog)), cfg)
    }

    /// A registry that reads the catalog the agent serves now (swapped on registry polls and
    /// reloads).
    fn on(catalog: Arc<LiveCatalog>, cfg: &NamesConfig) -> NameRegistry {
        let names = cfg
            .history
            .iter()
            .map(|h| {
                let state = NameState::parse(&h.state).unwrap_or(NameState::Deprecated);
                let rec = NameRecord {
                    state,
                    replacement: h.replacement.clone(),
                    since: h.since.clone(),
                    sunset: h.sunset.clone(),
                    updated_us: 0,
                    updated_by: "agent.toml".into(),
                };
                (h.name.clone(), rec)
            })
            .collect();
        let roles = catalog.load().roles().clone();
        NameRegistry {
            catalog,
            retired_status: cfg.retired_status.into(),
            recent_caller_days: cfg.recent_caller_days,
            inner: RwLock::new(Inner { names, roles }),
            metrics: metrics::NameMetrics::default(),
            change_lock: tokio::sync::Mutex::new(()),
        }
    }

    /// The agent's registry: registers its metrics, applies the config seeds to the store
    /// (once each) and loads the store's state.
    pub async fn open(
        catalog: Arc<LiveCatalog>,
        cfg: &NamesConfig,
        roles: &BTreeMap<String, String>,
        store: &Store,
        registry: &mut Registry,
    ) -> Result<NameRegistry, StoreError> {
        let mut reg = NameRegistry::on(catalog, cfg);
        reg.metrics = metrics::NameMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
        reg.seed(store, cfg, roles).await?;
        reg.reload(store).await?;
        reg.warn_vanished(store).await;
        Ok(reg)
    }

    /// Logs names that clients called recently but that nothing serves any more: a model
    /// renamed in `agent.toml` without `gpuhub names rename`, the silent 404 of the incident.
    async fn warn_vanished(&self, store: &Store) {
        let since = crate::util::now_us() - i64::from(self.recent_caller_days.max(1)) * 86_400_000_000;
        let totals = match store.name_totals().await {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "name registry: cannot read call totals");
                return;
            }
        };
        for t in totals.iter().filter(|t| t.last_us >= since && t.refused < t.calls) {
            if let Resolution::Unknown { suggestions } = self.resolve(&t.name) {
                tracing::warn!(
                    name = %crate::util::sanitize(&t.name),
                    calls = t.calls,
                    did_you_mean = ?suggestions,
                    "model name `{}` was served and called recently, but no longer exists: its callers now get 404s; \
                     map it to its new name with `gpuhub names rename {} NEW` (see `gpuhub names callers {}`)",
                    crate::util::sanitize(&t.name),
                    crate::util::sanitize(&t.name),
                    crate::util::sanitize(&t.name)
                );
            }
        }
    }

    /// The catalog as served now.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.load()
    }

    pub fn retired_status(&self) -> u16 {
        self.retired_status
    }

    pub fn recent_caller_days(&self) -> u32 {
        self.recent_caller_days
    }

    pub fn metrics(&self) -> &metrics::NameMetrics {
        &self.metrics
    }

    pub(crate) fn change_lock(&self) -> &tokio::sync::Mutex<()> {
        &self.change_lock
    }

    /// A copy of the current state (for planning a change).
    pub fn view(&self) -> Inner {
        match self.inner.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Applies `[[names.history]]` and `[roles]` seeds that the store has not seen (or that
    /// changed in the config since they were applied). A seed applied once is not applied
    /// again, so `gpuhub names restore svc-ocr` survives a restart.
    async fn seed(&self, store: &Store, cfg: &NamesConfig, roles: &BTreeMap<String, String>) -> Result<(), StoreError> {
        let mut ops = Vec::new();
        let mut history = Vec::new();
        for h in &cfg.history {
            let key = format!("names.seed.{}", h.name);
            let value = serde_json::to_string(h).unwrap_or_default();
            if store.get_setting(&key).await?.as_deref() == Some(value.as_str()) {
                continue;
            }
            ops.push(NameOp::Put(NameRow {
                name: h.name.clone(),
                state: h.state.clone(),
                replacement: h.replacement.clone(),
                since_date: h.since.clone(),
                sunset_date: h.sunset.clone(),
                updated_us: 0,
                updated_by: "agent.toml".into(),
            }));
            ops.push(NameOp::Marker { key, value });
            history.push(NewHistory {
                actor: "agent.toml".into(),
                action: "seed".into(),
                subject: h.name.clone(),
                to_state: Some(h.state.clone()),
                to_target: h.replacement.clone(),
                sunset_date: h.sunset.clone(),
                note: "from [[names.history]]".into(),
                ..Default::default()
            });
        }
        for (role, model) in roles {
            let key = format!("roles.seed.{role}");
            match store.get_setting(&key).await? {
                Some(v) if v == *model => {}
                Some(_) => {
                    // The config's value changed since it was seeded: the config wins over an
                    // earlier `gpuhub roles set`.
                    ops.push(NameOp::RoleReset { role: role.clone() });
                    ops.push(NameOp::Marker { key, value: model.clone() });
                    history.push(NewHistory {
                        actor: "agent.toml".into(),
                        action: "role-set".into(),
                        subject: role.clone(),
                        to_target: Some(model.clone()),
                        note: "[roles] changed in agent.toml".into(),
                        ..Default::default()
                    });
                }
                None => ops.push(NameOp::Marker { key, value: model.clone() }),
            }
        }
        if !ops.is_empty() {
            store.apply_name_changes(&ops, &history).await?;
            tracing::info!(names = history.len(), "name registry: applied config seeds");
        }
        Ok(())
    }

    /// What another agent changed in the shared store (`cluster_sync`): the view read again,
    /// under the change lock so that it never replaces a newer local change. Returns
    /// `(names changed, roles changed)`.
    pub async fn follow(&self, store: &Store) -> Result<(bool, bool), StoreError> {
        let _guard = self.change_lock.lock().await;
        let before = self.view();
        self.reload(store).await?;
        let after = self.view();
        Ok((before.names != after.names, before.roles != after.roles))
    }

    /// Rebuilds the in-memory view from the store (after a change, or at start).
    pub async fn reload(&self, store: &Store) -> Result<(), StoreError> {
        let rows = store.name_rows().await?;
        let role_rows = store.role_rows().await?;
        let mut names = BTreeMap::new();
        for r in rows {
            let Some(state) = NameState::parse(&r.state) else {
                tracing::error!(name = %r.name, state = %r.state, "name registry: unknown state in the store; treating the name as retired");
                names.insert(
                    r.name,
                    NameRecord {
                        state: NameState::Retired,
                        replacement: r.replacement,
                        since: r.since_date,
                        sunset: r.sunset_date,
                        updated_us: r.updated_us,
                        updated_by: r.updated_by,
                    },
                );
                continue;
            };
            names.insert(
                r.name,
                NameRecord {
                    state,
                    replacement: r.replacement,
                    since: r.since_date,
                    sunset: r.sunset_date,
                    updated_us: r.updated_us,
                    updated_by: r.updated_by,
                },
            );
        }
        let mut roles = self.catalog.load().roles().clone();
        for (role, model) in role_rows {
            roles.insert(role, if model.is_empty() { None } else { Some(model) });
        }
        let inner = Inner { names, roles };
        self.metrics.set_sunsets(&inner);
        match self.inner.write() {
            Ok(mut g) => *g = inner,
            Err(p) => *p.into_inner() = inner,
        }
        Ok(())
    }

    /// Resolves a requested name.
    pub fn resolve(&self, asked: &str) -> Resolution {
        let inner = match self.inner.read() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        resolve_in(&self.catalog.load(), &inner, asked)
    }

    /// The LoRA adapter a served name ends at (directly, or through a deprecated name or a
    /// role), if any: the gateway forwards the call under that name to its base model's
    /// worker, which [`resolve`](Self::resolve) returns.
    pub fn adapter(&self, asked: &str) -> Option<String> {
        let inner = match self.inner.read() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        adapter_in(&self.catalog.load(), &inner, asked)
    }

    /// What the gateway answers when `asked` is not served (`None`: it is served).
    /// Retired names get `names.retired_status` (404 or 410).
    pub fn refusal(&self, asked: &str, r: &Resolution) -> Option<Refusal> {
        let mut refusal = refusal_for(asked, r, self.retired_status)?;
        // A name retired because its MLflow registered model lost its tag says so.
        let by_registry =
            matches!(r, Resolution::Retired { .. }) && self.view().names.get(asked).is_some_and(|rec| rec.updated_by == REGISTRY_ACTOR);
        if by_registry && let Some(i) = refusal.message.find("; ") {
            refusal.message.insert_str(i, ": its MLflow registered model is no longer tagged served_by=gateway");
        }
        Some(refusal)
    }

    /// Follows the MLflow registry: `gone` (served name, registered model) were served because
    /// of registry tags and no longer are: each is retired (callers get the names
    /// lifecycle's answer, never a silent 404); `back` are served by the registry again: a
    /// retirement the registry made is undone. Names an admin changed are left alone.
    pub async fn follow_registry(&self, store: &Store, gone: &[(String, String)], back: &[String]) -> Result<(), StoreError> {
        let _guard = self.change_lock.lock().await;
        let inner = self.view();
        let today = today();
        let mut ops = Vec::new();
        let mut history = Vec::new();
        for (name, registered) in gone {
            if inner.names.contains_key(name) {
                continue; // the registry already knows it (retired, renamed, restored by an admin)
            }
            ops.push(NameOp::Put(NameRow {
                name: name.clone(),
                state: "retired".into(),
                replacement: None,
                since_date: Some(today.clone()),
                sunset_date: None,
                updated_us: crate::util::now_us(),
                updated_by: REGISTRY_ACTOR.into(),
            }));
            history.push(NewHistory {
                actor: REGISTRY_ACTOR.into(),
                action: "retire".into(),
                subject: name.clone(),
                from_state: Some("active".into()),
                to_state: Some("retired".into()),
                note: format!("MLflow registered model `{}` is no longer tagged served_by=gateway", crate::util::sanitize(registered)),
                ..Default::default()
            });
        }
        for name in back {
            if inner.names.get(name).is_some_and(|r| r.updated_by == REGISTRY_ACTOR && r.state == NameState::Retired) {
                ops.push(NameOp::Delete { name: name.clone() });
                history.push(NewHistory {
                    actor: REGISTRY_ACTOR.into(),
                    action: "restore".into(),
                    subject: name.clone(),
                    from_state: Some("retired".into()),
                    to_state: Some("active".into()),
                    note: "tagged served_by=gateway in MLflow again".into(),
                    ..Default::default()
                });
            }
        }
        if ops.is_empty() {
            return Ok(());
        }
        store.apply_name_changes(&ops, &history).await?;
        for h in &history {
            tracing::info!(name = %crate::util::sanitize(&h.subject), action = %h.action, note = %h.note, "name registry follows the MLflow registry");
        }
        self.reload(store).await
    }

    /// Headers for a call to a deprecated name: `Deprecation` (RFC 9745), `Sunset` (RFC 8594)
    /// and a `Link` to the replacement.
    pub fn deprecation_headers(&self, r: &Resolution) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Resolution::Deprecated { model, since, sunset } = r {
            h.push(("deprecation", since.as_deref().and_then(http_date).map(|d| format!("@{d}")).unwrap_or_else(|| "true".into())));
            if let Some(s) = sunset.as_deref().and_then(imf_date) {
                h.push(("sunset", s));
            }
            h.push(("link", format!("</v1/models/{model}>; rel=\"successor-version\"")));
        }
        h
    }

    /// Counts one gateway call in `gpuhub_gateway_name_calls_total{state,name,user,app}`.
    /// The gateway calls this once per call, after authentication, with the resolution it
    /// acted on.
    pub fn count_call(&self, asked: &str, r: &Resolution, user: &str, app: &str) {
        self.metrics.count_call(asked, r, user, app);
    }

    /// The same from a finished usage row (`name_state` is `Resolution::state()`); rows of
    /// calls refused before a name was read (no credentials, bad JSON) are not name calls.
    pub fn count_row(&self, row: &crate::gateway::usage_log::UsageRow) {
        if row.requested_name.is_empty() || row.name_state.is_empty() {
            return;
        }
        self.metrics.count_state(&row.name_state, &row.requested_name, &row.user, &row.app);
    }

    /// Role -> current model, for the snapshot and `gpuhub env`.
    pub fn roles(&self) -> BTreeMap<String, Option<String>> {
        match self.inner.read() {
            Ok(g) => g.roles.clone(),
            Err(p) => p.into_inner().roles.clone(),
        }
    }

    /// Roles assigned a model this node does not serve now, as one line (`chat -> smol-chat;
    /// ...`), or `None` when every assigned role is served.
    pub fn unserved_roles_line(&self) -> Option<String> {
        unserved_roles_line(&self.unserved_roles())
    }

    /// `[gateway.user_models]` entries that name nothing served now (a typo, a registry model
    /// not tagged yet or any more): (user, name), by user. A user who calls the name gets its
    /// 404; one who calls the model meant gets the allow-list's 403.
    pub fn unserved_allowed(&self, lists: &BTreeMap<crate::config::UserName, Vec<String>>) -> Vec<(String, String)> {
        let inner = self.view();
        let catalog = self.catalog.load();
        lists
            .iter()
            .flat_map(|(user, names)| names.iter().map(move |n| (user, n)))
            .filter(|(_, n)| resolve_in(&catalog, &inner, n).model().is_none())
            .map(|(user, n)| (user.0.clone(), n.clone()))
            .collect()
    }

    /// Roles assigned a model this node does not serve now: (role, model), by role.
    pub fn unserved_roles(&self) -> Vec<(String, String)> {
        let inner = self.view();
        let catalog = self.catalog.load();
        inner
            .roles
            .iter()
            .filter_map(|(role, m)| m.as_ref().filter(|m| served_model(&catalog, &inner, m).is_none()).map(|m| (role.clone(), m.clone())))
            .collect()
    }

    /// Every name: catalog models and aliases, registry names and roles, sorted by name.
    pub fn entries(&self) -> Vec<NameEntry> {
        let inner = self.view();
        entries_in(&self.catalog.load(), &inner)
    }
}

/// `(role, model)` pairs as one line (`chat -> smol-chat; ...`), `None` for none.
pub fn unserved_roles_line(list: &[(String, String)]) -> Option<String> {
    (!list.is_empty()).then(|| list.iter().map(|(r, m)| format!("{r} -> {}", crate::util::sanitize(m))).collect::<Vec<_>>().join("; "))
}

/// [`NameRegistry::unserved_allowed`] as one line: `alice: nope; bob: chat-x`.
pub fn unserved_allowed_line(list: &[(String, String)]) -> Option<String> {
    (!list.is_empty()).then(|| list.iter().map(|(u, m)| format!("{u}: {}", crate::util::sanitize(m))).collect::<Vec<_>>().join("; "))
}

/// What to do about a `[gateway.user_models]` entry that names nothing served.
pub const UNSERVED_ALLOWED_FIX: &str = "correct the name in [gateway.user_models] (it must be a served model, alias or role: `gpuhub names list`) and run `gpuhub models reload`, or serve that model";

/// What to do about a role whose model is not served.
pub const UNSERVED_ROLE_FIX: &str = "serve the model (a [[models]] entry, or tag its MLflow registered model served_by=gateway with gpuhub.name, gpuhub.template and gpuhub.resources) or assign a served one: `gpuhub roles set ROLE MODEL`";

/// The actor of name changes made because MLflow registry tags changed.
pub const REGISTRY_ACTOR: &str = "mlflow-registry";

/// The refusal for a name that is not served, with `retired_status` for retired names.
pub fn refusal_for(asked: &str, r: &Resolution, retired_status: u16) -> Option<Refusal> {
    let asked = crate::util::sanitize(asked);
    match r {
        Resolution::Active { .. } | Resolution::Deprecated { .. } => None,
        Resolution::Retired { replacement, since, role } => {
            let mut message = match (replacement, since) {
                (Some(new), Some(d)) => format!("model `{asked}` was renamed to `{new}` on {d}"),
                (Some(new), None) => format!("model `{asked}` was renamed to `{new}`"),
                (None, Some(d)) => format!("model `{asked}` was retired on {d}"),
                (None, None) => format!("model `{asked}` was retired"),
            };
            match (replacement, role.as_deref().and_then(gpuhub_wire::snapshot::role_env_var)) {
                (Some(new), Some(var)) => message.push_str(&format!("; set {var} or use `{new}`")),
                (Some(new), None) => message.push_str(&format!("; use `{new}`")),
                (None, _) => message.push_str("; see `GET /v1/models` for the models served here"),
            }
            Some(Refusal { status: retired_status, code: "model_not_found", message })
        }
        Resolution::RoleUnassigned { role } => Some(Refusal {
            status: 503,
            code: "role_unassigned",
            message: format!(
                "role `{role}` has no model assigned on this node; an admin must assign one (`gpuhub roles set {role} MODEL`)"
            ),
        }),
        Resolution::RoleUnserved { role, model } => Some(Refusal {
            status: 503,
            code: "role_model_not_served",
            message: format!(
                "role `{role}` is assigned `{}`, which this node does not serve now (no [[models]] entry and no model tagged served_by=gateway in the MLflow registry serves it, or it was retired); an admin can assign a served model (`gpuhub roles set {role} MODEL`; `GET /v1/models` lists them)",
                crate::util::sanitize(model)
            ),
        }),
        Resolution::Unknown { suggestions } => {
            let mut message = format!("model `{asked}` does not exist");
            if !suggestions.is_empty() {
                message.push_str(&format!(
                    "; did you mean {}?",
                    suggestions.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(" or ")
                ));
            }
            message.push_str(" (see `GET /v1/models`)");
            Some(Refusal { status: 404, code: "model_not_found", message })
        }
    }
}

/// The adapter `name` is served as, following registry names and roles as
/// [`resolve_in`] does (at most a few steps).
pub(crate) fn adapter_in(catalog: &Catalog, inner: &Inner, name: &str) -> Option<String> {
    let mut name = name.to_string();
    for _ in 0..6 {
        if let Some(rec) = inner.names.get(&name) {
            if rec.state == NameState::Retired {
                return None;
            }
            if catalog.get(&name).is_none() {
                name = rec.replacement.clone()?;
                continue;
            }
        }
        if catalog.get(&name).is_some() {
            return catalog.is_adapter(&name).then_some(name);
        }
        match inner.roles.get(&name) {
            Some(Some(m)) => name = m.clone(),
            _ => return None,
        }
    }
    None
}

/// The model that serves `name` (following at most a few registry aliases), if any.
pub(crate) fn served_model(catalog: &Catalog, inner: &Inner, name: &str) -> Option<String> {
    let mut name = name.to_string();
    for _ in 0..4 {
        match inner.names.get(&name) {
            Some(rec) if rec.state == NameState::Retired => return None,
            Some(rec) => {
                if let Some(m) = catalog.get(&name) {
                    return Some(m.name.clone());
                }
                name = rec.replacement.clone()?;
            }
            None => return catalog.get(&name).map(|m| m.name.clone()),
        }
    }
    None
}

pub(crate) fn resolve_in(catalog: &Catalog, inner: &Inner, asked: &str) -> Resolution {
    if let Some(rec) = inner.names.get(asked) {
        let role_of = |target: &Option<String>| {
            target.as_ref().and_then(|r| {
                let model = served_model(catalog, inner, r);
                inner
                    .roles
                    .iter()
                    .find(|(_, m)| {
                        m.as_deref() == Some(r.as_str())
                            || (model.is_some() && m.as_deref().and_then(|m| served_model(catalog, inner, m)) == model)
                    })
                    .map(|(k, _)| k.clone())
            })
        };
        return match rec.state {
            NameState::Retired => {
                Resolution::Retired { replacement: rec.replacement.clone(), since: rec.since.clone(), role: role_of(&rec.replacement) }
            }
            NameState::Active | NameState::Deprecated => match served_model(catalog, inner, asked) {
                Some(model) if rec.state == NameState::Active => Resolution::Active { model },
                Some(model) => Resolution::Deprecated { model, since: rec.since.clone(), sunset: rec.sunset.clone() },
                // Its target is gone from the catalog: refuse it as retired, pointing at the
                // target (the message still tells the caller what happened).
                None => {
                    Resolution::Retired { replacement: rec.replacement.clone(), since: rec.since.clone(), role: role_of(&rec.replacement) }
                }
            },
        };
    }
    if let Some(m) = catalog.get(asked) {
        return Resolution::Active { model: m.name.clone() };
    }
    match inner.roles.get(asked) {
        Some(None) => return Resolution::RoleUnassigned { role: asked.to_string() },
        Some(Some(m)) => {
            return match served_model(catalog, inner, m) {
                Some(model) => Resolution::Active { model },
                None => Resolution::RoleUnserved { role: asked.to_string(), model: m.clone() },
            };
        }
        None => {}
    }
    let candidates = catalog.all_names().cloned().chain(inner.names.keys().cloned()).chain(inner.roles.keys().cloned()).collect::<Vec<_>>();
    Resolution::Unknown { suggestions: suggest::closest(asked, &candidates, 3) }
}

pub(crate) fn entries_in(catalog: &Catalog, inner: &Inner) -> Vec<NameEntry> {
    let mut out: BTreeMap<String, NameEntry> = BTreeMap::new();
    let plain = |name: &str, kind: &'static str, serves: Option<String>| NameEntry {
        name: name.to_string(),
        state: "active",
        kind,
        serves,
        replacement: None,
        since: None,
        sunset: None,
        changed_by: None,
        changed_us: None,
    };
    for m in catalog.models() {
        out.insert(m.name.clone(), plain(&m.name, "model", Some(m.name.clone())));
        for a in catalog.aliases_of(&m.name) {
            out.insert(a.clone(), plain(&a, "alias", Some(m.name.clone())));
        }
        for a in catalog.adapters_of(&m.name) {
            out.insert(a.clone(), plain(&a, "adapter", Some(m.name.clone())));
        }
    }
    for (role, model) in &inner.roles {
        if out.contains_key(role) || inner.names.contains_key(role) {
            continue;
        }
        let serves = model.as_deref().and_then(|m| served_model(catalog, inner, m));
        let mut e = plain(role, "role", serves.clone());
        if model.is_none() {
            e.state = "unassigned";
        } else if serves.is_none() {
            e.state = "unserved";
        }
        out.insert(role.clone(), e);
    }
    for (name, rec) in &inner.names {
        let r = resolve_in(catalog, inner, name);
        let kind = out.get(name).map(|e| e.kind).unwrap_or("renamed");
        out.insert(
            name.clone(),
            NameEntry {
                name: name.clone(),
                state: rec.state.as_str(),
                kind,
                serves: r.model().map(str::to_string),
                replacement: rec.replacement.clone(),
                since: rec.since.clone(),
                sunset: rec.sunset.clone(),
                changed_by: Some(rec.updated_by.clone()),
                changed_us: Some(rec.updated_us),
            },
        );
    }
    out.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    pub(crate) const LAB: &str = r#"
[roles]
ocr = "dots.ocr"
tts = ""
[[models]]
name = "dots.ocr"
launcher = "static"
url = "http://127.0.0.1:9"
[[models]]
name = "demo-chat"
aliases = ["chat-latest"]
launcher = "static"
url = "http://127.0.0.1:9"
[[names.history]]
name = "svc-ocr"
state = "deprecated"
replacement = "dots.ocr"
since = "2026-06-17"
sunset = "2026-12-31"
"#;

    fn registry() -> NameRegistry {
        let cfg = Config::from_toml(LAB).unwrap();
        let cat = Arc::new(Catalog::from_config(&cfg.file));
        NameRegistry::new(cat, &cfg.file.names)
    }

    #[test]
    fn dates_for_headers() {
        assert_eq!(http_date("1970-01-02"), Some(86_400));
        assert_eq!(imf_date("2026-12-31").as_deref(), Some("Thu, 31 Dec 2026 00:00:00 GMT"));
        assert_eq!(imf_date("2026-13-01"), None);
        assert_eq!(days_from_civil("2026-02-30"), None, "an impossible day is not a date");
        assert_eq!(civil_from_days(days_from_civil("2024-02-29").unwrap()), "2024-02-29");
        assert_eq!(today().len(), 10);
    }

    #[test]
    fn refusals_explain_themselves() {
        let r = registry();
        assert!(r.refusal("dots.ocr", &r.resolve("dots.ocr")).is_none());
        let tts = r.refusal("tts", &r.resolve("tts")).unwrap();
        assert_eq!((tts.status, tts.code), (503, "role_unassigned"));
        assert!(tts.message.contains("role `tts` has no model assigned"), "{}", tts.message);
        let unk = r.refusal("dots-ocr", &r.resolve("dots-ocr")).unwrap();
        assert!(unk.message.contains("did you mean `dots.ocr`"), "{}", unk.message);
        let dep = r.deprecation_headers(&r.resolve("svc-ocr"));
        assert!(dep.iter().any(|(k, v)| *k == "sunset" && v.contains("31 Dec 2026")), "{dep:?}");
        assert!(dep.iter().any(|(k, v)| *k == "deprecation" && v == "@1781654400"), "{dep:?}");
        assert!(dep.iter().any(|(k, v)| *k == "link" && v.contains("/v1/models/dots.ocr")), "{dep:?}");
    }

    #[test]
    fn retired_message_names_the_replacement_date_and_role_variable() {
        let r = registry();
        r.inner.write().unwrap().names.get_mut("svc-ocr").unwrap().state = NameState::Retired;
        let res = r.resolve("svc-ocr");
        let refusal = r.refusal("svc-ocr", &res).unwrap();
        assert_eq!(refusal.message, "model `svc-ocr` was renamed to `dots.ocr` on 2026-06-17; set OCR_MODEL or use `dots.ocr`");
        assert_eq!((refusal.status, refusal.code), (404, "model_not_found"));
    }

    /// A model served because of MLflow tags whose tag is removed: its name is retired with a
    /// message that says why (not a bare 404), restored when the tag comes back, and a
    /// retirement an admin made is not undone by the registry.
    #[tokio::test]
    async fn untagged_registry_models_are_retired_and_restored_through_the_lifecycle() {
        for (store, _dir) in crate::store::testing::stores().await {
            let cfg = Config::from_toml(LAB).unwrap();
            let tags: BTreeMap<String, String> =
                [("gpuhub.template", "vllm"), ("gpuhub.resources", "gpus=1,vram_gib=2"), ("gpuhub.name", "smol")]
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect();
            let entry = crate::models::registry::entry_from_tags("smol-reg", &tags, &cfg.file).unwrap();
            let tagged = Arc::new(Catalog::build(&cfg.file, &[entry]));
            let r = NameRegistry::new(tagged.clone(), &cfg.file.names);
            r.reload(&store).await.unwrap();
            assert_eq!(r.resolve("smol"), Resolution::Active { model: "smol".into() });

            // The tag is removed: retired first, then the catalog loses it.
            r.follow_registry(&store, &[("smol".into(), "smol-reg".into())], &[]).await.unwrap();
            r.catalog.store(Arc::new(Catalog::from_config(&cfg.file)));
            let res = r.resolve("smol");
            assert!(matches!(res, Resolution::Retired { .. }), "{res:?}");
            let refusal = r.refusal("smol", &res).unwrap();
            assert_eq!(
                refusal.message,
                format!(
                    "model `smol` was retired on {}: its MLflow registered model is no longer tagged served_by=gateway; see `GET /v1/models` for the models served here",
                    today()
                )
            );
            assert_eq!(r.view().names["smol"].updated_by, REGISTRY_ACTOR);
            // Following again changes nothing (one retirement, not one per poll).
            r.follow_registry(&store, &[("smol".into(), "smol-reg".into())], &[]).await.unwrap();
            assert_eq!(store.name_rows().await.unwrap().iter().filter(|n| n.name == "smol").count(), 1);

            // Tagged again: restored after the catalog has it.
            r.catalog.store(tagged.clone());
            r.follow_registry(&store, &[], &["smol".into()]).await.unwrap();
            assert_eq!(r.resolve("smol"), Resolution::Active { model: "smol".into() });

            // An admin's retirement stays.
            store
                .apply_name_changes(
                    &[NameOp::Put(NameRow {
                        name: "smol".into(),
                        state: "retired".into(),
                        replacement: None,
                        since_date: None,
                        sunset_date: None,
                        updated_us: 1,
                        updated_by: "alice".into(),
                    })],
                    &[],
                )
                .await
                .unwrap();
            r.reload(&store).await.unwrap();
            r.follow_registry(&store, &[], &["smol".into()]).await.unwrap();
            assert!(matches!(r.resolve("smol"), Resolution::Retired { .. }), "the registry undid an admin's retirement");
            let plain = r.refusal("smol", &r.resolve("smol")).unwrap();
            assert!(!plain.message.contains("MLflow"), "{}", plain.message);
        }
    }

    #[test]
    fn retired_status_410_is_honoured() {
        let cfg = Config::from_toml(&format!("[names]\nretired_status = 410\n{LAB}")).unwrap();
        let r = NameRegistry::new(Arc::new(Catalog::from_config(&cfg.file)), &cfg.file.names);
        r.inner.write().unwrap().names.get_mut("svc-ocr").unwrap().state = NameState::Retired;
        assert_eq!(r.refusal("svc-ocr", &r.resolve("svc-ocr")).unwrap().status, 410);
        // Unknown names stay 404: only a name that existed is Gone.
        assert_eq!(r.refusal("nope", &r.resolve("nope")).unwrap().status, 404);
    }

    #[test]
    fn adapters_resolve_to_their_base_model_and_keep_their_name() {
        let toml = format!(
            "{LAB}\n[[models]]\nname = \"base\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\nadapters = [\"sql-lora\"]\n[[names.history]]\nname = \"old-sql\"\nstate = \"deprecated\"\nreplacement = \"sql-lora\"\n"
        );
        let cfg = Config::from_toml(&toml).unwrap();
        let r = NameRegistry::new(Arc::new(Catalog::from_config(&cfg.file)), &cfg.file.names);
        r.inner.write().unwrap().roles.insert("sql".into(), Some("sql-lora".into()));
        assert_eq!(r.resolve("sql-lora"), Resolution::Active { model: "base".into() });
        assert_eq!(r.adapter("sql-lora").as_deref(), Some("sql-lora"));
        assert_eq!(r.adapter("sql").as_deref(), Some("sql-lora"), "a role whose model is an adapter");
        assert_eq!(r.adapter("old-sql").as_deref(), Some("sql-lora"), "a deprecated name of an adapter");
        assert_eq!(r.resolve("old-sql").model(), Some("base"));
        assert_eq!(r.adapter("base"), None);
        assert_eq!(r.adapter("nope"), None);
        let e = r.entries().into_iter().find(|e| e.name == "sql-lora").unwrap();
        assert_eq!((e.kind, e.serves.as_deref()), ("adapter", Some("base")));
    }

    #[test]
    fn resolves_each_state() {
        let r = registry();
        assert_eq!(r.resolve("dots.ocr"), Resolution::Active { model: "dots.ocr".into() });
        assert_eq!(r.resolve("chat-latest"), Resolution::Active { model: "demo-chat".into() });
        assert_eq!(r.resolve("svc-ocr").state(), "deprecated");
        assert_eq!(r.resolve("svc-ocr").model(), Some("dots.ocr"));
        assert_eq!(r.resolve("tts"), Resolution::RoleUnassigned { role: "tts".into() });
        assert_eq!(r.resolve("ocr"), Resolution::Active { model: "dots.ocr".into() }, "a role name serves the role's model");
        match r.resolve("dots-ocr") {
            Resolution::Unknown { suggestions } => assert_eq!(suggestions.first().map(String::as_str), Some("dots.ocr")),
            other => panic!("{other:?}"),
        }
        match r.resolve("svc-ocrr") {
            Resolution::Unknown { suggestions } => {
                assert!(suggestions.contains(&"svc-ocr".to_string()), "historical names are suggested: {suggestions:?}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn control_characters_in_asked_names_are_not_echoed() {
        let r = registry();
        let msg = r.refusal("x\x1b[2J", &r.resolve("x\x1b[2J")).unwrap().message;
        assert!(!msg.contains('\x1b'), "{msg:?}");
    }

    #[test]
    fn usage_rows_count_by_state_and_rows_without_a_name_do_not() {
        let r = registry();
        let row = |name: &str, state: &str| crate::gateway::usage_log::UsageRow {
            user: "alice".into(),
            app: "ocr-app".into(),
            requested_name: name.into(),
            name_state: state.into(),
            ..Default::default()
        };
        r.count_row(&row("svc-ocr", "deprecated"));
        r.count_row(&row("svc-ocr", "deprecated"));
        r.count_row(&row("", ""));
        r.count_row(&row("x", ""));
        assert_eq!(r.metrics().calls("deprecated", "svc-ocr", "alice", "ocr-app"), 2);
        assert_eq!(r.metrics().calls("", "x", "alice", "ocr-app"), 0);
    }

    #[test]
    fn entries_show_every_kind() {
        let r = registry();
        let e = r.entries();
        let get = |n: &str| e.iter().find(|x| x.name == n).unwrap().clone();
        assert_eq!((get("dots.ocr").state, get("dots.ocr").kind), ("active", "model"));
        assert_eq!((get("chat-latest").kind, get("chat-latest").serves.as_deref()), ("alias", Some("demo-chat")));
        assert_eq!(
            (get("svc-ocr").state, get("svc-ocr").kind, get("svc-ocr").sunset.as_deref()),
            ("deprecated", "renamed", Some("2026-12-31"))
        );
        assert_eq!((get("tts").state, get("tts").kind), ("unassigned", "role"));
    }

    #[test]
    fn a_role_whose_model_is_not_served_says_so() {
        // [roles] may name a model the MLflow registry serves (with [mlflow]): before a poll
        // serves it, the role is unserved, not an unknown name.
        let toml = format!("[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\n{}", LAB.replace("tts = \"\"", "chat = \"smol-chat\""));
        let cfg = Config::from_toml(&toml).unwrap();
        let r = NameRegistry::new(Arc::new(Catalog::from_config(&cfg.file)), &cfg.file.names);
        assert_eq!(r.resolve("chat"), Resolution::RoleUnserved { role: "chat".into(), model: "smol-chat".into() });
        let refusal = r.refusal("chat", &r.resolve("chat")).unwrap();
        assert_eq!((refusal.status, refusal.code), (503, "role_model_not_served"));
        assert!(refusal.message.contains("role `chat` is assigned `smol-chat`, which this node does not serve now"), "{}", refusal.message);
        assert!(refusal.message.contains("gpuhub roles set chat MODEL"), "{}", refusal.message);
        assert_eq!(r.unserved_roles(), vec![("chat".to_string(), "smol-chat".to_string())]);
        assert_eq!(r.unserved_roles_line().as_deref(), Some("chat -> smol-chat"));
        let e = r.entries();
        let chat = e.iter().find(|x| x.name == "chat").unwrap();
        assert_eq!((chat.state, chat.kind, chat.serves.as_deref()), ("unserved", "role", None));
        assert!(crate::names::callers::is_refused(r.resolve("chat").state()));
        // Served roles are not listed.
        assert!(!r.unserved_roles().iter().any(|(role, _)| role == "ocr"));
        assert_eq!(registry().unserved_roles_line(), None);
    }

    #[test]
    fn an_allow_list_entry_that_names_nothing_served_is_listed() {
        // With [mlflow] registry polling, agent.toml's [gateway.user_models] may name models the
        // registry serves later, so a typo passes the config check: the agent lists it.
        let toml = format!(
            "[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\nregistry_poll_s = 30\n[gateway.user_models]\nalice = [\"dots.ocr\", \"dots-ocrr\"]\nbob = [\"chat-latest\", \"svc-ocr\", \"ocr\"]\n{LAB}"
        );
        let cfg = Config::from_toml(&toml).unwrap();
        let r = NameRegistry::new(Arc::new(Catalog::from_config(&cfg.file)), &cfg.file.names);
        // A served model, an alias, a deprecated name and a role are served; the typo is not.
        let unserved = r.unserved_allowed(&cfg.file.gateway.user_models);
        assert_eq!(unserved, vec![("alice".to_string(), "dots-ocrr".to_string())]);
        assert_eq!(unserved_allowed_line(&unserved).as_deref(), Some("alice: dots-ocrr"));
        assert_eq!(unserved_allowed_line(&[]), None);
    }
}
