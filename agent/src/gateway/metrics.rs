//! Gateway metrics, registered once at start under the `gpuhub_` prefix.
//!
//! Labels are bounded: models come from the catalog, users and apps from keys and jobs, and
//! a name nobody knows is counted only in `gateway_unknown_model_requests` (its label set is
//! capped at [`MAX_UNKNOWN_NAMES`]; beyond that they share `name="<other>"`), so a client
//! sending random names cannot grow the scrape without bound.

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::usage_log::UsageRow;

pub const MAX_UNKNOWN_NAMES: usize = 1000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub model: String,
    pub requested: String,
    pub user: String,
    pub app: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub model: String,
    pub requested: String,
    pub user: String,
    pub app: String,
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TokenLabels {
    pub model: String,
    pub user: String,
    pub app: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModelLabel {
    pub model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NameLabel {
    pub name: String,
}

fn latency_histogram() -> Histogram {
    // 100 us .. ~100 s
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.0001, 2.5, 16))
}

fn overhead_histogram() -> Histogram {
    // 20 us .. ~60 ms: the gateway's own share of a call
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(0.00002, 2.0, 12))
}

pub struct GatewayMetrics {
    requests: Family<CallLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    latency: Family<ModelLabel, Histogram, fn() -> Histogram>,
    overhead: Family<ModelLabel, Histogram, fn() -> Histogram>,
    pub in_flight: Family<ModelLabel, Gauge>,
    pub queued: Family<ModelLabel, Gauge>,
    /// Other gateways on the store whose policy differs from this one's ([`super::policy`]).
    pub policy_differences: Gauge,
    unknown: Family<NameLabel, Counter>,
    unknown_seen: Mutex<HashSet<String>>,
}

impl GatewayMetrics {
    /// Registers every gateway series in `r` (the `gpuhub`-prefixed sub-registry).
    pub fn register(r: &mut Registry) -> GatewayMetrics {
        let m = GatewayMetrics {
            requests: Family::default(),
            errors: Family::default(),
            tokens: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            overhead: Family::new_with_constructor(overhead_histogram),
            in_flight: Family::default(),
            queued: Family::default(),
            policy_differences: Gauge::default(),
            unknown: Family::default(),
            unknown_seen: Mutex::new(HashSet::new()),
        };
        r.register("gateway_requests", "Gateway calls by model, requested name, user and app", m.requests.clone());
        r.register("gateway_errors", "Gateway calls answered with an error, by OpenAI error code", m.errors.clone());
        r.register("gateway_tokens", "Tokens reported by upstreams (kind = prompt or completion)", m.tokens.clone());
        r.register_with_unit("gateway_request_duration", "Call latency, arrival to last byte", Unit::Seconds, m.latency.clone());
        r.register_with_unit(
            "gateway_overhead",
            "Time a call spent in the gateway itself (latency minus upstream time)",
            Unit::Seconds,
            m.overhead.clone(),
        );
        r.register("gateway_in_flight", "Calls being forwarded to the model now", m.in_flight.clone());
        r.register("gateway_queued", "Calls waiting for the model (loading, or at its concurrency limit)", m.queued.clone());
        r.register(
            "gateway_policy_differences",
            "Other gateways on this store whose [gateway.limits], [gateway.user_models] or keys_per_user differ from this gateway's (gpuhub doctor names them)",
            m.policy_differences.clone(),
        );
        r.register("gateway_unknown_model_requests", "Calls to names that were never known, by the name asked for", m.unknown.clone());
        m
    }

    /// Counts one finished call.
    pub fn observe(&self, row: &UsageRow) {
        let model = if row.resolved_model.is_empty() { "<none>".to_string() } else { row.resolved_model.clone() };
        let requested = if row.name_state == "unknown" {
            self.count_unknown(&row.requested_name);
            "<unknown>".to_string()
        } else {
            row.requested_name.clone()
        };
        // One label set per call, moved from family to family (lookups take a reference).
        let labels = CallLabels { model, requested, user: row.user.clone(), app: row.app.clone() };
        self.requests.get_or_create(&labels).inc();
        if row.status >= 400 {
            self.errors
                .get_or_create(&ErrorLabels {
                    model: labels.model.clone(),
                    requested: labels.requested.clone(),
                    user: labels.user.clone(),
                    app: labels.app.clone(),
                    code: row.error_code.clone(),
                })
                .inc();
        }
        let CallLabels { model, user, app, .. } = labels;
        let mut tl = TokenLabels { model, user, app, kind: "prompt" };
        for (kind, n) in [("prompt", row.prompt_tokens), ("completion", row.completion_tokens)] {
            if n > 0 {
                tl.kind = kind;
                self.tokens.get_or_create(&tl).inc_by(n as u64);
            }
        }
        let ml = ModelLabel { model: tl.model };
        self.latency.get_or_create(&ml).observe(row.latency_us as f64 / 1e6);
        self.overhead.get_or_create(&ml).observe(row.overhead_us as f64 / 1e6);
    }

    fn count_unknown(&self, asked: &str) {
        let mut name: String = crate::util::sanitize(asked).chars().take(64).collect();
        {
            let mut seen = match self.unknown_seen.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if !seen.contains(&name) {
                if seen.len() >= MAX_UNKNOWN_NAMES {
                    name = "<other>".into();
                } else {
                    seen.insert(name.clone());
                }
            }
        }
        self.unknown.get_or_create(&NameLabel { name }).inc();
    }
}

/// Keeps a per-model gauge raised while alive.
pub struct GaugeGuard(Gauge);

impl GaugeGuard {
    pub fn new(family: &Family<ModelLabel, Gauge>, model: &str) -> GaugeGuard {
        let g = family.get_or_create(&ModelLabel { model: model.to_string() }).clone();
        g.inc();
        GaugeGuard(g)
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_are_capped() {
        let mut r = Registry::default();
        let m = GatewayMetrics::register(&mut r);
        for i in 0..(MAX_UNKNOWN_NAMES + 50) {
            m.observe(&UsageRow {
                requested_name: format!("n{i}"),
                name_state: "unknown".into(),
                status: 404,
                error_code: "model_not_found".into(),
                ..UsageRow::default()
            });
        }
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &r).unwrap();
        assert!(s.contains("gateway_unknown_model_requests_total{name=\"<other>\"} 50"), "{}", &s[..500.min(s.len())]);
        assert_eq!(s.matches("gateway_unknown_model_requests_total{").count(), MAX_UNKNOWN_NAMES + 1);
        assert!(s.contains("requested=\"<unknown>\""));
    }
}
