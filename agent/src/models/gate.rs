//! gpuhub's promotion gate, and the versions it promoted.
//!
//! `gpuhub models promote NAME VERSION` (admins) checks the version's eval metric against the
//! threshold (the catalog entry's eval_metric/eval_threshold, or `mlflow.gates` for a
//! registry-tagged model: never MLflow tags, which anyone can edit) and against the version
//! gpuhub serves now (no regression), unless `--force`; records the promotion in the store;
//! then moves MLflow's `@production`. gpuhub serves the version it promoted, whatever the alias
//! says later: an alias moved in MLflow behind gpuhub's back is shown as a mismatch
//! (`gpuhub models`, `gpuhub_model_alias_mismatch`), until `promote` adopts it through the gate.
//! Before a model's first promotion through gpuhub, `@production` is served as it is.

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::Serialize;

use super::mlflow::{ALIAS, Mlflow, MlflowError, VersionMetric};
use crate::config::ModelConfig;
use crate::store::{PromotionRow, Store};

/// What gpuhub knows of one registered model's versions.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Served {
    /// The version gpuhub promoted last (what it serves); `None`: never promoted through gpuhub.
    pub promoted: Option<String>,
    /// `@production` as last read from MLflow.
    pub production: Option<String>,
}

impl Served {
    /// `@production` points elsewhere than what gpuhub promoted.
    pub fn mismatch(&self) -> bool {
        matches!((&self.promoted, &self.production), (Some(p), Some(a)) if p != a)
    }
}

/// The promoted versions, by MLflow registered model (loaded from the store at start, and
/// followed there: `cluster_sync`).
#[derive(Debug, Default)]
pub struct Promoted {
    map: Mutex<BTreeMap<String, Served>>,
    /// Held while a promotion is recorded and applied here, and while the store's are read
    /// and applied (`cluster_sync`): a read from before a local promotion never undoes it.
    change: tokio::sync::Mutex<()>,
}

impl Promoted {
    pub async fn load(store: Option<&Store>) -> Promoted {
        let p = Promoted::default();
        if let Some(store) = store {
            match store.promoted_versions().await {
                Ok(rows) => {
                    let mut map = p.lock();
                    for r in rows {
                        map.entry(r.model).or_default().promoted = Some(r.version);
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot read gpuhub's promotions; serving MLflow's @production until the store answers and a model is promoted again")
                }
            }
        }
        p
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Served>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn get(&self, registered: &str) -> Served {
        self.lock().get(registered).cloned().unwrap_or_default()
    }

    /// The version gpuhub promoted last.
    pub fn version(&self, registered: &str) -> Option<String> {
        self.lock().get(registered).and_then(|s| s.promoted.clone())
    }

    pub fn change_lock(&self) -> &tokio::sync::Mutex<()> {
        &self.change
    }

    pub fn set_promoted(&self, registered: &str, version: &str) {
        self.lock().entry(registered.to_string()).or_default().promoted = Some(version.to_string());
    }

    /// Remembers `@production` as read; returns whether it changed.
    pub fn set_production(&self, registered: &str, production: Option<String>) -> bool {
        let mut map = self.lock();
        let s = map.entry(registered.to_string()).or_default();
        let changed = s.production != production;
        s.production = production;
        changed
    }
}

/// A gate: one metric and its threshold.
#[derive(Debug, Clone, PartialEq)]
pub struct Gate {
    pub metric: String,
    pub threshold: f64,
    pub lower_is_better: bool,
}

impl Gate {
    pub fn of(m: &ModelConfig) -> Option<Gate> {
        Some(Gate { metric: m.eval_metric.clone()?, threshold: m.eval_threshold?, lower_is_better: m.eval_lower_is_better })
    }

    fn passes(&self, value: f64) -> bool {
        if self.lower_is_better { value <= self.threshold } else { value >= self.threshold }
    }

    /// `value` is no worse than `previous`.
    fn no_worse(&self, value: f64, previous: f64) -> bool {
        if self.lower_is_better { value <= previous } else { value >= previous }
    }
}

/// The gate's verdict on one version.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Verdict {
    /// Why it may not be promoted (empty: it passes).
    pub refusals: Vec<String>,
    /// What was checked, for the record and the CLI.
    pub checks: Vec<String>,
    pub value: Option<f64>,
    pub previous_value: Option<f64>,
}

/// Checks version `version` of `registered` (served as `served_as`) against `gate` and against
/// `previous`, the version served now.
pub async fn evaluate(
    mlflow: &Mlflow,
    served_as: &str,
    registered: &str,
    version: &str,
    previous: Option<&str>,
    gate: Option<&Gate>,
    gate_source: &str,
) -> Result<Verdict, MlflowError> {
    let mut v = Verdict::default();
    if !mlflow.version_exists(registered, version).await? {
        return Err(MlflowError::NoSuchVersion(registered.into(), version.into()));
    }
    let Some(gate) = gate else {
        v.checks.push(format!("no eval gate is configured for `{served_as}` ({gate_source})"));
        return Ok(v);
    };
    let metric = &gate.metric;
    match mlflow.version_metric(registered, version, metric).await? {
        VersionMetric::Value(x) => {
            v.value = Some(x);
            let cmp = if gate.lower_is_better { "at most" } else { "at least" };
            if gate.passes(x) {
                v.checks.push(format!("{metric} = {x} passes the threshold {} ({cmp})", gate.threshold));
            } else {
                let side = if gate.lower_is_better { "above" } else { "below" };
                v.refusals.push(format!(
                    "version {version} of `{registered}` has {metric} = {x}, {side} the threshold {} ({gate_source})",
                    gate.threshold
                ));
            }
        }
        VersionMetric::NoRun => v.refusals.push(format!(
            "version {version} of `{registered}` has no run, so its `{metric}` cannot be checked; log the model from a run that logs `{metric}`"
        )),
        VersionMetric::NotLogged(run) => v.refusals.push(format!(
            "run {run} of version {version} of `{registered}` did not log `{metric}` (the gate's metric, {gate_source})"
        )),
    }
    if let (Some(prev), Some(x)) = (previous.filter(|p| *p != version), v.value) {
        match mlflow.version_metric(registered, prev, metric).await {
            Ok(VersionMetric::Value(p)) => {
                v.previous_value = Some(p);
                if gate.no_worse(x, p) {
                    v.checks.push(format!("no regression: {metric} = {x} against {p} of version {prev}, served now"));
                } else {
                    v.refusals.push(format!(
                        "version {version} of `{registered}` regresses against version {prev}, which gpuhub serves now: {metric} = {x} against {p}"
                    ));
                }
            }
            Ok(_) | Err(MlflowError::NoSuchVersion(..)) => {
                v.checks.push(format!("version {prev}, served now, has no `{metric}` to compare with"));
            }
            Err(e) => return Err(e),
        }
    }
    Ok(v)
}

/// What a promotion did, for the CLI.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    pub promoted: bool,
    pub forced: bool,
    pub message: String,
    pub verdict: Verdict,
    /// How the served version changes: `switched` (a new worker took over with no failed
    /// call), `next_start` (no worker ran, or no room for a second one), `unchanged`.
    pub switch: Option<String>,
    pub previous_version: Option<String>,
}

/// The record of a promotion about to be made.
pub fn record(
    registered: &str,
    version: &str,
    previous: Option<String>,
    gate: Option<&Gate>,
    verdict: &Verdict,
    forced: bool,
    caller: &crate::control::Caller,
) -> PromotionRow {
    PromotionRow {
        model: registered.to_string(),
        version: version.to_string(),
        previous_version: previous,
        metric: gate.map(|g| g.metric.clone()),
        value: verdict.value,
        previous_value: verdict.previous_value,
        threshold: gate.map(|g| g.threshold),
        forced,
        uid: i64::from(caller.uid),
        user_name: caller.user.clone(),
        at_us: crate::util::now_us(),
    }
}

/// Reads `@production` of every registered model the catalog serves and records it; sets
/// `gpuhub_model_alias_mismatch`. Logs a mismatch when it appears or changes.
pub async fn check_aliases(mgr: &super::ModelManager) {
    let Some(mlflow) = mgr.mlflow() else { return };
    let catalog = mgr.catalog();
    let mut seen: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in catalog.models() {
        if let Some(r) = &m.mlflow_model {
            seen.entry(r.clone()).or_default().push(m.name.clone());
        }
    }
    for (registered, names) in seen {
        let production = match mlflow.production_version(&registered).await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(model = %registered, error = %e, "cannot read @production");
                continue;
            }
        };
        let promoted = mgr.promoted();
        let changed = promoted.set_production(&registered, production.clone());
        let served = promoted.get(&registered);
        let mismatch = served.mismatch();
        for n in &names {
            mgr.set_alias_mismatch(n, mismatch);
        }
        if changed && mismatch {
            tracing::warn!(
                model = %registered,
                served = served.promoted.as_deref().unwrap_or(""),
                production = production.as_deref().unwrap_or(""),
                "MLflow's @{ALIAS} was moved outside gpuhub; gpuhub keeps serving the version it promoted (`gpuhub models promote` adopts the new one through the gate)"
            );
        }
    }
}
