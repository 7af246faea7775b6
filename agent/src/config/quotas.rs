//! `[[quotas]]`: GPU-equivalent hours per user, Slurm account or Unix group, per calendar
//! month or rolling window (docs/quotas.md).
//!
//! Each value is checked while it is deserialised (`deserialize_with`, in a raw form with
//! `deny_unknown_fields`), so a bad period, a negative number of hours, a bad name or an
//! unknown key is reported by `toml` with its line and column. Checks across keys and entries
//! (one target per entry, one entry per target) name the key path `quotas[i]`.

use serde::{Deserialize, Serialize};

/// Whom a quota covers.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuotaTarget {
    /// One Unix user: their association's limits are held in Slurm.
    User(String),
    /// A Slurm account: the account association's limits are held.
    Account(String),
    /// A Unix group: each member's user association is held when the group's total is over.
    Group(String),
}

impl QuotaTarget {
    pub fn kind(&self) -> &'static str {
        match self {
            QuotaTarget::User(_) => "user",
            QuotaTarget::Account(_) => "account",
            QuotaTarget::Group(_) => "group",
        }
    }

    pub fn name(&self) -> &str {
        match self {
            QuotaTarget::User(n) | QuotaTarget::Account(n) | QuotaTarget::Group(n) => n,
        }
    }

    /// `user:alice`, `account:lab`, `group:ml` (the store's key, the CLI's display).
    pub fn key(&self) -> String {
        format!("{}:{}", self.kind(), self.name())
    }

    /// Parses [`QuotaTarget::key`].
    pub fn parse_key(s: &str) -> Result<QuotaTarget, String> {
        let (kind, name) =
            s.split_once(':').ok_or_else(|| format!("`{s}` is not a quota target; write user:NAME, account:NAME or group:NAME"))?;
        check_name(name).map_err(|m| format!("`{s}`: {m}"))?;
        match kind {
            "user" => Ok(QuotaTarget::User(name.to_string())),
            "account" => Ok(QuotaTarget::Account(name.to_string())),
            "group" => Ok(QuotaTarget::Group(name.to_string())),
            other => Err(format!("`{other}` is not a quota target kind; use user, account or group")),
        }
    }
}

/// How far back a quota counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaPeriod {
    /// The calendar month (UTC): usage counts from the 1st, 00:00 UTC; resets on the next 1st.
    Month,
    /// The last N seconds, always: usage leaves the window as it ages.
    Rolling(i64),
}

impl QuotaPeriod {
    pub fn parse(s: &str) -> Result<QuotaPeriod, String> {
        if s == "month" {
            return Ok(QuotaPeriod::Month);
        }
        let secs = crate::util::parse_duration_s(s).map_err(|m| format!("period: {m}, or \"month\""))?;
        if !(3_600..=366 * 86_400).contains(&secs) {
            return Err(format!("period `{s}` is out of range; use \"month\" or a rolling window from 1h to 366d"));
        }
        Ok(QuotaPeriod::Rolling(secs))
    }

    pub fn as_string(&self) -> String {
        match self {
            QuotaPeriod::Month => "month".into(),
            QuotaPeriod::Rolling(s) if s % 86_400 == 0 => format!("{}d", s / 86_400),
            QuotaPeriod::Rolling(s) if s % 3_600 == 0 => format!("{}h", s / 3_600),
            QuotaPeriod::Rolling(s) => format!("{}m", s / 60),
        }
    }

    /// `this month`, `in the last 7d`: how messages name the period.
    pub fn phrase(&self) -> String {
        match self {
            QuotaPeriod::Month => "this month".into(),
            other => format!("in the last {}", other.as_string()),
        }
    }
}

/// One `[[quotas]]` entry, validated.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "RawQuota", into = "RawQuota")]
pub struct QuotaConfig {
    pub target: QuotaTarget,
    /// GPU-equivalent hours per period: whole GPUs x hours + shards / shards_per_gpu x hours,
    /// plus the caller's share of model workers (inference billed to callers).
    pub gpu_hours: f64,
    pub period: QuotaPeriod,
    /// How many of user, account, group the entry set (checked in [`validate`]).
    #[serde(skip)]
    targets: usize,
}

/// `[[quotas]]` as written.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct RawQuota {
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_name")]
    user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_name")]
    account: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none", deserialize_with = "de_name")]
    group: Option<String>,
    #[serde(deserialize_with = "de_hours")]
    gpu_hours: f64,
    #[serde(default = "default_period", deserialize_with = "de_period")]
    period: String,
}

fn default_period() -> String {
    "month".into()
}

fn de_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = String::deserialize(d)?;
    check_name(&s).map_err(serde::de::Error::custom)?;
    Ok(Some(s))
}

fn de_hours<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    let h = f64::deserialize(d)?;
    if h.is_finite() && h >= 0.0 {
        Ok(h)
    } else {
        Err(serde::de::Error::custom(format!("gpu_hours = {h} must be a number of GPU-hours, 0 or more (fractions allowed: 0.5)")))
    }
}

fn de_period<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let s = String::deserialize(d)?;
    QuotaPeriod::parse(&s).map_err(serde::de::Error::custom)?;
    Ok(s)
}

/// Names as Slurm and Unix accept them: no spaces, quotes, `=` or `,` (they would change the
/// sacctmgr command line's meaning).
fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !name.starts_with('-');
    if ok { Ok(()) } else { Err(format!("`{name}` is not a user, account or group name (letters, digits, - _ .; at most 64)")) }
}

impl From<RawQuota> for QuotaConfig {
    fn from(r: RawQuota) -> Self {
        let targets = [&r.user, &r.account, &r.group].iter().filter(|t| t.is_some()).count();
        let target = match (r.user, r.account, r.group) {
            (Some(u), _, _) => QuotaTarget::User(u),
            (None, Some(a), _) => QuotaTarget::Account(a),
            (None, None, Some(g)) => QuotaTarget::Group(g),
            (None, None, None) => QuotaTarget::User(String::new()),
        };
        // Checked by de_period; a month if it could not parse (unreachable).
        let period = QuotaPeriod::parse(&r.period).unwrap_or(QuotaPeriod::Month);
        QuotaConfig { target, gpu_hours: r.gpu_hours, period, targets }
    }
}

impl QuotaConfig {
    pub fn new(target: QuotaTarget, gpu_hours: f64, period: QuotaPeriod) -> Self {
        QuotaConfig { target, gpu_hours, period, targets: 1 }
    }
}

impl From<QuotaConfig> for RawQuota {
    fn from(q: QuotaConfig) -> Self {
        let mut r = RawQuota { gpu_hours: q.gpu_hours, period: q.period.as_string(), ..RawQuota::default() };
        match q.target {
            QuotaTarget::User(n) => r.user = Some(n),
            QuotaTarget::Account(n) => r.account = Some(n),
            QuotaTarget::Group(n) => r.group = Some(n),
        }
        r
    }
}

/// Checks across entries: one quota per target.
pub fn validate(quotas: &[QuotaConfig]) -> Result<(), (String, String)> {
    for (i, q) in quotas.iter().enumerate() {
        match q.targets {
            1 => {}
            0 => return Err((format!("quotas[{i}]"), "needs one of user, account or group (whom the quota covers)".into())),
            _ => {
                return Err((
                    format!("quotas[{i}]"),
                    "covers one target: set exactly one of user, account or group (one [[quotas]] entry each)".into(),
                ));
            }
        }
        if let Some(j) = quotas[..i].iter().position(|p| p.target == q.target) {
            return Err((
                format!("quotas[{i}]"),
                format!("{} already has a quota (quotas[{j}]); keep one entry per target", q.target.key()),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn entries_parse_with_defaults() {
        let c = Config::from_toml(
            "[[quotas]]\nuser = \"alice\"\ngpu_hours = 200\n\n[[quotas]]\ngroup = \"ml\"\ngpu_hours = 0.25\nperiod = \"7d\"\n",
        )
        .unwrap();
        let q = &c.file.quotas;
        assert_eq!(q[0].target, super::QuotaTarget::User("alice".into()));
        assert_eq!(q[0].period, super::QuotaPeriod::Month);
        assert_eq!(q[1].period, super::QuotaPeriod::Rolling(7 * 86_400));
        assert_eq!(q[1].period.phrase(), "in the last 7d");
        // The effective config renders back into the same entries.
        let again: crate::config::ConfigFile = toml::from_str(&toml::to_string(&c.file).unwrap()).unwrap();
        assert_eq!(again.quotas, c.file.quotas);
    }

    #[test]
    fn mistakes_name_the_line() {
        let cases = [
            (
                "[[quotas]]\nuser = \"x\"\ngpu_hours = 1\n\n[[quotas]]\nuser = \"a\"\ngroup = \"b\"\ngpu_hours = 1\n",
                "quotas[1]",
                "exactly one of user",
            ),
            ("[[quotas]]\nuser = \"x\"\ngpu_hours = 1\n[[quotas]]\nuser = \"a\"\ngpu_hours = -1\n", "line 6", "0 or more"),
            ("[[quotas]]\n\nuser = \"a\"\ngpu_hours = 1\nperiod = \"3w\"\n", "line 5", "unknown unit"),
            ("[[quotas]]\nuser = \"a\"\ngpu_hours = 1\nperiod = \"10m\"\n", "line 4", "1h to 366d"),
            ("[[quotas]]\nuser = \"a b\"\ngpu_hours = 1\n", "line 2", "not a user"),
            ("[[quotas]]\nuser = \"a\"\ngpu_hour = 1\n", "line 3", "unknown field `gpu_hour`"),
            ("[[quotas]]\ngpu_hours = 1\n", "quotas[0]", "needs one of user"),
        ];
        for (text, line, what) in cases {
            let err = Config::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(line) && err.contains(what), "{text:?}: {err}");
        }
    }

    #[test]
    fn one_quota_per_target() {
        let err = Config::from_toml("[[quotas]]\nuser = \"a\"\ngpu_hours = 1\n[[quotas]]\nuser = \"a\"\ngpu_hours = 2\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("quotas[1]") && err.contains("user:a already has a quota (quotas[0])"), "{err}");
    }

    #[test]
    fn target_keys_round_trip() {
        for k in ["user:alice", "account:lab", "group:ml-team"] {
            assert_eq!(super::QuotaTarget::parse_key(k).unwrap().key(), k);
        }
        assert!(super::QuotaTarget::parse_key("alice").unwrap_err().contains("user:NAME"));
        assert!(super::QuotaTarget::parse_key("host:x").unwrap_err().contains("user, account or group"));
        assert!(super::QuotaTarget::parse_key("user:a,b").is_err());
    }
}
