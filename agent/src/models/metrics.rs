//! Model lifecycle metrics, registered once under the `gpuhub` prefix:
//! `gpuhub_model_state{model,state}` (1 for the current state, 0 for the others),
//! `gpuhub_model_transitions_total{model,from,to}`, `gpuhub_model_load_duration_seconds{model}`
//! (first call to ready), `gpuhub_model_evictions_total{model}` and
//! `gpuhub_model_alias_mismatch{model}` (MLflow's @production moved outside gpuhub's gate),
//! `gpuhub_model_replicas{model,state}` (replicas `ready`, `starting`, and of the ready ones
//! `unhealthy`; models with `max_replicas` > 1).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

use super::lifecycle::State;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabels {
    pub model: String,
    pub state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TransitionLabels {
    pub model: String,
    pub from: &'static str,
    pub to: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

type LoadHistograms = Family<ModelLabel, Histogram, fn() -> Histogram>;

#[derive(Clone, Debug)]
pub struct ModelMetrics {
    state: Family<StateLabels, Gauge>,
    transitions: Family<TransitionLabels, Counter>,
    load: LoadHistograms,
    evictions: Family<ModelLabel, Counter>,
    alias_mismatch: Family<ModelLabel, Gauge>,
    replicas: Family<StateLabels, Gauge>,
}

fn load_buckets() -> Histogram {
    // 50 ms .. ~27 min: a warm local worker to a large model queued in Slurm.
    Histogram::new(exponential_buckets(0.05, 2.0, 16))
}

impl ModelMetrics {
    pub fn register(registry: &mut Registry) -> ModelMetrics {
        let m = ModelMetrics {
            state: Family::default(),
            transitions: Family::default(),
            load: Family::new_with_constructor(load_buckets as fn() -> Histogram),
            evictions: Family::default(),
            alias_mismatch: Family::default(),
            replicas: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("gpuhub");
        r.register(
            "model_state",
            "Model worker state (1 = current): unloaded, pending, starting, ready, draining, failed",
            m.state.clone(),
        );
        r.register("model_transitions", "Model worker state transitions", m.transitions.clone());
        r.register_with_unit("model_load_duration", "Time from the first call to a ready worker", Unit::Seconds, m.load.clone());
        r.register("model_evictions", "Idle workers unloaded to make room for another model", m.evictions.clone());
        r.register(
            "model_alias_mismatch",
            "1 when MLflow's @production points elsewhere than the version gpuhub promoted (moved outside gpuhub's gate); gpuhub keeps serving its promoted version",
            m.alias_mismatch.clone(),
        );
        r.register(
            "model_replicas",
            "Replicas of a model (max_replicas > 1) by state: ready, starting, and unhealthy (ready ones failing their health probes)",
            m.replicas.clone(),
        );
        m
    }

    /// A model's replica counts (see `gpuhub_model_replicas`).
    pub fn replicas(&self, model: &str, ready: u32, starting: u32, unhealthy: u32) {
        for (state, n) in [("ready", ready), ("starting", starting), ("unhealthy", unhealthy)] {
            self.replicas.get_or_create(&StateLabels { model: model.to_string(), state }).set(i64::from(n));
        }
    }

    pub fn alias_mismatch(&self, model: &str, mismatch: bool) {
        self.alias_mismatch.get_or_create(&ModelLabel { model: model.to_string() }).set(i64::from(mismatch));
    }

    pub fn set_state(&self, model: &str, from: Option<State>, to: State) {
        // The model's eviction counter exists from its first state, at 0 (dashboards and alerts
        // see the series before the first eviction).
        let _ = self.evictions.get_or_create(&ModelLabel { model: model.to_string() });
        for s in State::ALL {
            self.state.get_or_create(&StateLabels { model: model.to_string(), state: s.as_str() }).set(i64::from(s == to));
        }
        if let Some(from) = from {
            self.transitions.get_or_create(&TransitionLabels { model: model.to_string(), from: from.as_str(), to: to.as_str() }).inc();
        }
    }

    /// Forgets a model that left the catalog (no ghost series on dashboards).
    pub fn remove(&self, model: &str) {
        for s in State::ALL {
            self.state.remove(&StateLabels { model: model.to_string(), state: s.as_str() });
        }
        self.evictions.remove(&ModelLabel { model: model.to_string() });
        self.load.remove(&ModelLabel { model: model.to_string() });
        self.alias_mismatch.remove(&ModelLabel { model: model.to_string() });
        for state in ["ready", "starting", "unhealthy"] {
            self.replicas.remove(&StateLabels { model: model.to_string(), state });
        }
    }

    pub fn load_seconds(&self, model: &str, secs: f64) {
        self.load.get_or_create(&ModelLabel { model: model.to_string() }).observe(secs);
    }

    pub fn evicted(&self, model: &str) {
        self.evictions.get_or_create(&ModelLabel { model: model.to_string() }).inc();
    }
}
