//! Names as first-class objects: every name a client may call has a state (active,
//! deprecated, retired), a replacement and a history; unknown names get a "did you mean".
//!
//! The gateway asks [`NameRegistry::resolve`] for every call and gets a [`Resolution`] that
//! says what to serve and what to tell the caller.

pub mod suggest;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};

use crate::config::NamesConfig;
use crate::models::Catalog;

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

/// Days since 1970-01-01 for a `YYYY-MM-DD` date (civil calendar).
fn days_from_civil(date: &str) -> Option<i64> {
    if !crate::config::is_date(date) {
        return None;
    }
    let y: i64 = date.get(0..4)?.parse().ok()?;
    let m: i64 = date.get(5..7)?.parse().ok()?;
    let d: i64 = date.get(8..10)?.parse().ok()?;
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

/// `YYYY-MM-DD` -> Unix seconds at midnight UTC (RFC 9745 `Deprecation: @<seconds>`).
fn http_date(date: &str) -> Option<i64> {
    days_from_civil(date).map(|d| d * 86_400)
}

/// `YYYY-MM-DD` -> IMF-fixdate (RFC 8594 `Sunset`), e.g. `Thu, 31 Dec 2026 00:00:00 GMT`.
fn imf_date(date: &str) -> Option<String> {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
    let days = days_from_civil(date)?;
    let m: usize = date.get(5..7)?.parse().ok()?;
    Some(format!("{}, {} {} {} 00:00:00 GMT", DAYS[days.rem_euclid(7) as usize], date.get(8..10)?, MONTHS.get(m - 1)?, date.get(0..4)?))
}

#[derive(Debug, Clone)]
struct HistoricName {
    state: &'static str,
    replacement: Option<String>,
    since: Option<String>,
    sunset: Option<String>,
}

/// The in-memory view of every name. Reads are a short `RwLock` read (no await, no store
/// access on the request path); changes rebuild it.
pub struct NameRegistry {
    catalog: Arc<Catalog>,
    inner: RwLock<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    history: BTreeMap<String, HistoricName>,
    roles: BTreeMap<String, Option<String>>,
}

impl NameRegistry {
    pub fn new(catalog: Arc<Catalog>, cfg: &NamesConfig) -> NameRegistry {
        let history = cfg
            .history
            .iter()
            .map(|h| {
                let state = if h.state == "retired" { "retired" } else { "deprecated" };
                (h.name.clone(), HistoricName { state, replacement: h.replacement.clone(), since: h.since.clone(), sunset: h.sunset.clone() })
            })
            .collect();
        let roles = catalog.roles().clone();
        NameRegistry { catalog, inner: RwLock::new(Inner { history, roles }) }
    }

    /// Resolves a requested name.
    pub fn resolve(&self, asked: &str) -> Resolution {
        if let Some(m) = self.catalog.get(asked) {
            return Resolution::Active { model: m.name.clone() };
        }
        let inner = match self.inner.read() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        if let Some(h) = inner.history.get(asked) {
            let role = h.replacement.as_ref().and_then(|r| inner.roles.iter().find(|(_, m)| m.as_deref() == Some(r.as_str())).map(|(k, _)| k.clone()));
            return match (h.state, &h.replacement) {
                ("deprecated", Some(model)) => Resolution::Deprecated { model: model.clone(), since: h.since.clone(), sunset: h.sunset.clone() },
                _ => Resolution::Retired { replacement: h.replacement.clone(), since: h.since.clone(), role },
            };
        }
        if let Some(None) = inner.roles.get(asked) {
            return Resolution::RoleUnassigned { role: asked.to_string() };
        }
        let candidates = self.catalog.all_names().cloned().chain(inner.history.keys().cloned()).collect::<Vec<_>>();
        Resolution::Unknown { suggestions: suggest::closest(asked, &candidates, 3) }
    }

    /// What the gateway answers when `asked` is not served (`None`: it is served).
    pub fn refusal(&self, asked: &str, r: &Resolution) -> Option<Refusal> {
        let retired_status = 404; // names.retired_status: wired by the names registry
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
                message: format!("role `{role}` has no model assigned on this node; an admin must assign one (`[roles]` in agent.toml)"),
            }),
            Resolution::Unknown { suggestions } => {
                let mut message = format!("model `{}` does not exist", crate::util::sanitize(asked));
                if !suggestions.is_empty() {
                    message.push_str(&format!("; did you mean {}?", suggestions.iter().map(|s| format!("`{s}`")).collect::<Vec<_>>().join(" or ")));
                }
                message.push_str(" (see `GET /v1/models`)");
                Some(Refusal { status: 404, code: "model_not_found", message })
            }
        }
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

    /// Role -> current model, for the snapshot and `gpuhub env`.
    pub fn roles(&self) -> BTreeMap<String, Option<String>> {
        match self.inner.read() {
            Ok(g) => g.roles.clone(),
            Err(p) => p.into_inner().roles.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn registry() -> NameRegistry {
        let cfg = Config::from_toml(
            r#"
[roles]
ocr = "dots.ocr"
tts = ""
[[models]]
name = "dots.ocr"
launcher = "static"
url = "http://127.0.0.1:9"
[[names.history]]
name = "svc-ocr"
state = "deprecated"
replacement = "dots.ocr"
since = "2026-06-17"
sunset = "2026-12-31"
"#,
        )
        .unwrap();
        let cat = Arc::new(Catalog::from_config(&cfg.file));
        NameRegistry::new(cat, &cfg.file.names)
    }

    #[test]
    fn dates_for_headers() {
        assert_eq!(http_date("1970-01-02"), Some(86_400));
        assert_eq!(imf_date("2026-12-31").as_deref(), Some("Thu, 31 Dec 2026 00:00:00 GMT"));
        assert_eq!(imf_date("2026-13-01"), None);
    }

    #[test]
    fn refusals_explain_themselves() {
        let r = registry();
        assert!(r.refusal("dots.ocr", &r.resolve("dots.ocr")).is_none());
        let tts = r.refusal("tts", &r.resolve("tts")).unwrap();
        assert_eq!((tts.status, tts.code), (503, "role_unassigned"));
        let unk = r.refusal("dots-ocr", &r.resolve("dots-ocr")).unwrap();
        assert!(unk.message.contains("did you mean `dots.ocr`"), "{}", unk.message);
        let dep = r.deprecation_headers(&r.resolve("svc-ocr"));
        assert!(dep.iter().any(|(k, v)| *k == "sunset" && v.contains("31 Dec 2026")), "{dep:?}");
    }

    #[test]
    fn resolves_each_state() {
        let r = registry();
        assert_eq!(r.resolve("dots.ocr"), Resolution::Active { model: "dots.ocr".into() });
        assert_eq!(r.resolve("svc-ocr").state(), "deprecated");
        assert_eq!(r.resolve("svc-ocr").model(), Some("dots.ocr"));
        assert_eq!(r.resolve("tts"), Resolution::RoleUnassigned { role: "tts".into() });
        match r.resolve("dots-ocr") {
            Resolution::Unknown { suggestions } => assert_eq!(suggestions.first().map(String::as_str), Some("dots.ocr")),
            other => panic!("{other:?}"),
        }
    }
}
