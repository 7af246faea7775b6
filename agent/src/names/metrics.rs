//! Name metrics: calls by name state, and the sunset dates of deprecated names.
//!
//! - `gpuhub_gateway_name_calls_total{state,name,user,app}`: every gateway call, by the state
//!   of the name it asked for (`active`, `deprecated`, `retired`, `unknown`, `unassigned`).
//!   The shipped alert rules and dashboards use exactly this name: do not rename it.
//! - `gpuhub_name_sunset_timestamp_seconds{name,replacement}`: when a deprecated name stops
//!   being served (alerts: "callers close to the sunset").
//!
//! Label values are bounded: unknown names are whatever a client sends, so at most
//! [`MAX_UNKNOWN_SERIES`] distinct unknown names get a series of their own; later ones are
//! counted under `name="(other)"` (the usage log and `gpuhub names callers` keep the detail).

use std::collections::HashSet;
use std::sync::Mutex;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Inner, NameState, Resolution, http_date};

/// Distinct unknown names that get their own series.
pub const MAX_UNKNOWN_SERIES: usize = 200;
/// Longest label value kept (longer ones are cut).
const MAX_LABEL: usize = 128;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub state: String,
    pub name: String,
    pub user: String,
    pub app: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SunsetLabels {
    pub name: String,
    pub replacement: String,
}

#[derive(Debug, Default)]
pub struct NameMetrics {
    calls: Family<CallLabels, Counter>,
    sunsets: Family<SunsetLabels, Gauge>,
    unknown_seen: Mutex<HashSet<String>>,
}

/// A label value safe to export: control characters replaced, length capped.
fn label(s: &str) -> String {
    let mut out: String = s.chars().take(MAX_LABEL).map(|c| if c.is_control() { '?' } else { c }).collect();
    if out.is_empty() {
        out.push('-');
    }
    out
}

impl NameMetrics {
    /// Registers the families under `r` (the agent passes its `gpuhub` sub-registry).
    pub fn register(r: &mut Registry) -> NameMetrics {
        let m = NameMetrics::default();
        r.register(
            "gateway_name_calls",
            "Gateway calls by the state of the model name asked for (active, deprecated, retired, unknown, unassigned)",
            m.calls.clone(),
        );
        r.register("name_sunset_timestamp_seconds", "When a deprecated model name stops being served (Unix seconds)", m.sunsets.clone());
        m
    }

    pub fn count_call(&self, asked: &str, r: &Resolution, user: &str, app: &str) {
        self.count_state(r.state(), asked, user, app);
    }

    /// Counts one call whose name resolved to `state` (`Resolution::state()`).
    pub fn count_state(&self, state: &str, asked: &str, user: &str, app: &str) {
        let mut name = label(asked);
        if state == "unknown" {
            let mut seen = match self.unknown_seen.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if !seen.contains(&name) {
                if seen.len() >= MAX_UNKNOWN_SERIES {
                    name = "(other)".to_string();
                } else {
                    seen.insert(name.clone());
                }
            }
        }
        self.calls.get_or_create(&CallLabels { state: label(state), name, user: label(user), app: label(app) }).inc();
    }

    /// Replaces the sunset gauges with the deprecated names of `inner` (a name that is
    /// restored or retired loses its series: no ghosts on dashboards).
    pub fn set_sunsets(&self, inner: &Inner) {
        self.sunsets.clear();
        for (name, rec) in &inner.names {
            if rec.state != NameState::Deprecated {
                continue;
            }
            if let Some(ts) = rec.sunset.as_deref().and_then(http_date) {
                self.sunsets
                    .get_or_create(&SunsetLabels { name: label(name), replacement: label(rec.replacement.as_deref().unwrap_or("")) })
                    .set(ts);
            }
        }
    }

    /// The current count for one series (tests).
    pub fn calls(&self, state: &str, name: &str, user: &str, app: &str) -> u64 {
        self.calls
            .get(&CallLabels { state: state.into(), name: name.into(), user: user.into(), app: app.into() })
            .map(|c| c.get())
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exports_the_documented_names_and_bounds_unknown_names() {
        let mut reg = Registry::default();
        let m = NameMetrics::register(reg.sub_registry_with_prefix("gpuhub"));
        let unknown = Resolution::Unknown { suggestions: vec![] };
        m.count_call("svc-ocr", &Resolution::Deprecated { model: "dots.ocr".into(), since: None, sunset: None }, "alice", "ocr-app");
        for i in 0..(MAX_UNKNOWN_SERIES + 10) {
            m.count_call(&format!("junk-{i}"), &unknown, "mallory", "x");
        }
        m.count_call("junk-0", &unknown, "mallory", "x");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        assert!(
            text.contains(r#"gpuhub_gateway_name_calls_total{state="deprecated",name="svc-ocr",user="alice",app="ocr-app"} 1"#),
            "{text}"
        );
        assert!(text.contains(r#"name="(other)""#));
        assert_eq!(m.calls("unknown", "junk-0", "mallory", "x"), 2, "a name with a series keeps it");
        assert_eq!(m.calls("unknown", "(other)", "mallory", "x"), 10);
        let series = text.lines().filter(|l| l.starts_with("gpuhub_gateway_name_calls_total{state=\"unknown\"")).count();
        assert_eq!(series, MAX_UNKNOWN_SERIES + 1);
    }
}
