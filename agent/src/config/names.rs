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
        let mut seen = std::collections::BTreeSet::new();
        for (i, h) in self.history.iter().enumerate() {
            let key = format!("names.history[{i}]");
            crate::names::lifecycle::validate_name(&h.name).map_err(|e| (format!("{key}.name"), e.to_string()))?;
            if !seen.insert(h.name.as_str()) {
                return Err((format!("{key}.name"), format!("`{}` appears twice in [[names.history]]; keep one entry per name", h.name)));
            }
            if !matches!(h.state.as_str(), "deprecated" | "retired") {
                return Err((format!("{key}.state"), format!("`{}` is not a state; use `deprecated` or `retired`", h.state)));
            }
            match &h.replacement {
                Some(r) if r == &h.name => return Err((format!("{key}.replacement"), format!("`{r}` cannot replace itself"))),
                Some(r) => crate::names::lifecycle::validate_name(r).map_err(|e| (format!("{key}.replacement"), e.to_string()))?,
                None if h.state == "deprecated" => {
                    return Err((
                        format!("{key}.replacement"),
                        format!(
                            "a deprecated name is still served, so `{}` needs the name that serves it (replacement = \"MODEL\")",
                            h.name
                        ),
                    ));
                }
                None => {}
            }
            for (k, d) in [("since", &h.since), ("sunset", &h.sunset)] {
                if let Some(d) = d
                    && (!is_date(d) || crate::names::days_from_civil(d).is_none())
                {
                    return Err((format!("{key}.{k}"), format!("`{d}` is not a date; use YYYY-MM-DD")));
                }
            }
            if let (Some(since), Some(sunset)) = (&h.since, &h.sunset)
                && sunset < since
            {
                return Err((
                    format!("{key}.sunset"),
                    format!("{sunset} is before since = {since}; a name stops being served after it was renamed"),
                ));
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

#[cfg(test)]
mod tests {
    use crate::config::Config;

    fn err(history: &str) -> String {
        let text =
            format!("[[models]]\nname = \"dots.ocr\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n[[names.history]]\n{history}");
        Config::from_toml(&text).unwrap_err().to_string()
    }

    #[test]
    fn history_seeds_are_checked_with_key_paths() {
        let e = err("name = \"svc ocr\"\nstate = \"retired\"\n");
        assert!(e.contains("names.history[0].name") && e.contains("a space"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"deprecated\"\n");
        assert!(e.contains("names.history[0].replacement") && e.contains("needs the name that serves it"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"retired\"\nreplacement = \"svc-ocr\"\n");
        assert!(e.contains("cannot replace itself"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"gone\"\n");
        assert!(e.contains("names.history[0].state"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"retired\"\nsince = \"2026-06-17\"\nsunset = \"2026-01-01\"\n");
        assert!(e.contains("names.history[0].sunset") && e.contains("before since"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"retired\"\nsunset = \"2026-02-30\"\n");
        assert!(e.contains("not a date"), "{e}");
        let e = err("name = \"a\"\nstate = \"retired\"\n[[names.history]]\nname = \"a\"\nstate = \"retired\"\n");
        assert!(e.contains("names.history[1].name") && e.contains("twice"), "{e}");
        let e = err("name = \"svc-ocr\"\nstate = \"deprecated\"\nreplacement = \"nope\"\n");
        assert!(e.contains("names.history[0].replacement") && e.contains("not a model in the catalog"), "{e}");
        let e = Config::from_toml("[names]\nretired_status = 500\n").unwrap_err().to_string();
        assert!(e.contains("use 404 or 410"), "{e}");
    }
}
