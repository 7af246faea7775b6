use serde::{Deserialize, Serialize};

/// `[names]`: how renamed and retired model names answer.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NamesConfig {
    /// Status for calls to a retired name: 404 (OpenAI's `model_not_found`) or 410 (Gone).
    pub retired_status: RetiredStatus,
    /// A rename refuses to retire a name called within this many days (unless `--force`).
    pub recent_caller_days: u32,
    /// Seeds for the name registry (applied once; the store keeps the history afterwards).
    pub history: Vec<NameHistoryEntry>,
}

impl Default for NamesConfig {
    fn default() -> Self {
        Self { retired_status: RetiredStatus::NotFound, recent_caller_days: 7, history: Vec::new() }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(into = "u16", try_from = "u16")]
pub enum RetiredStatus {
    NotFound,
    Gone,
}

impl From<RetiredStatus> for u16 {
    fn from(s: RetiredStatus) -> u16 {
        match s {
            RetiredStatus::NotFound => 404,
            RetiredStatus::Gone => 410,
        }
    }
}

impl TryFrom<u16> for RetiredStatus {
    type Error = String;
    fn try_from(v: u16) -> Result<Self, String> {
        match v {
            404 => Ok(RetiredStatus::NotFound),
            410 => Ok(RetiredStatus::Gone),
            other => Err(format!("names.retired_status = {other}: use 404 or 410")),
        }
    }
}

/// `[[names.history]]`: a name that was renamed (deprecated, still served) or retired.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NameHistoryEntry {
    pub name: String,
    /// `deprecated` or `retired`.
    pub state: String,
    /// The current name it maps to.
    pub replacement: Option<String>,
    /// When it was renamed (YYYY-MM-DD).
    pub since: Option<String>,
    /// When it stops being served (YYYY-MM-DD).
    pub sunset: Option<String>,
}

impl NamesConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for (i, h) in self.history.iter().enumerate() {
            let key = format!("names.history[{i}]");
            if !matches!(h.state.as_str(), "deprecated" | "retired") {
                return Err((format!("{key}.state"), format!("`{}` is not a state; use `deprecated` or `retired`", h.state)));
            }
            for (k, d) in [("since", &h.since), ("sunset", &h.sunset)] {
                if let Some(d) = d {
                    if !is_date(d) {
                        return Err((format!("{key}.{k}"), format!("`{d}` is not a date; use YYYY-MM-DD")));
                    }
                }
            }
        }
        Ok(())
    }
}

/// `YYYY-MM-DD` with plausible ranges.
pub fn is_date(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return false;
    }
    let num = |r: std::ops::Range<usize>| s.get(r).and_then(|x| x.parse::<u32>().ok());
    matches!((num(0..4), num(5..7), num(8..10)), (Some(y), Some(m), Some(d)) if (1970..=9999).contains(&y) && (1..=12).contains(&m) && (1..=31).contains(&d))
}
