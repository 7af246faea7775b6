//! The gateway settings every gateway of a cluster must share: `[gateway.limits]`,
//! `[gateway.user_models]` and `gateway.keys_per_user`. Each is read from the agent.toml of the
//! node the call reaches, so a node that differs is a way around them: a user limited to one
//! model at gpu01 calls any model at gpu02; with a lower rpm at one gateway, a user's calls count
//! against the limits of whichever gateway they reach.
//!
//! Each gateway on a PostgreSQL store publishes its policy (`gateway_policies`, one row per
//! gateway node, refreshed by `cluster_sync` every [`PUBLISH_EVERY`] passes and on the pass after
//! a reload changed any of them) and compares it with the others' recent rows on every pass: a
//! difference is logged once when it appears (and once when it is gone), and `gpuhub doctor`
//! reads the rows afresh (`gateway-policy`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::config::LimitsConfig;
use crate::gateway::access::AccessLists;

/// Passes of `cluster_sync` between two publications of a gateway's unchanged policy.
pub const PUBLISH_EVERY: u64 = 15;

/// A row older than this is a gateway that stopped (or stopped being one): not compared.
pub const FRESH_US: i64 = 3 * PUBLISH_EVERY as i64 * crate::cluster_sync::INTERVAL.as_micros() as i64;

/// One gateway's policy, normalised so that two configs that act alike compare equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// `[gateway.limits]`: requests per minute and tokens per day per user (0: none).
    pub rpm: u32,
    pub tokens_per_day: u64,
    /// `[[gateway.limits.users]]`, one per user (the last entry wins, as in the gateway):
    /// (rpm, tokens_per_day), `None` for the default.
    pub users: BTreeMap<String, (Option<u32>, Option<u64>)>,
    /// `[gateway.user_models]`, each list sorted.
    pub user_models: BTreeMap<String, Vec<String>>,
    pub keys_per_user: u32,
}

/// This agent's policy now (as last reloaded).
pub fn current(state: &crate::AppState) -> Policy {
    Policy::of(&state.gateway.access.get(), &state.gateway.fair_use.limits())
}

/// Another gateway whose policy is not this one's: which settings differ, each with both values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub gateway: String,
    /// `[gateway.limits]: here rpm 60, tokens_per_day none; at gpu02 rpm none, ...`, one per
    /// setting (sanitised, as is the gateway's name).
    pub settings: Vec<String>,
}

impl Policy {
    /// The policy of `access` with `limits` (as last read: both can be reloaded).
    pub fn of(access: &AccessLists, limits: &LimitsConfig) -> Policy {
        let users = limits.users.iter().map(|u| (u.user.0.clone(), (u.rpm, u.tokens_per_day))).collect();
        let user_models = access
            .user_models
            .iter()
            .map(|(u, m)| {
                let mut m = m.clone();
                m.sort();
                m.dedup();
                (u.0.clone(), m)
            })
            .collect();
        Policy { rpm: limits.rpm, tokens_per_day: limits.tokens_per_day, users, user_models, keys_per_user: access.keys_per_user }
    }

    /// What is published (JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    fn limits(&self) -> String {
        let n = |v: u64| if v == 0 { "none".to_string() } else { v.to_string() };
        let mut s = format!("rpm {}, tokens_per_day {}", n(self.rpm.into()), n(self.tokens_per_day));
        for (user, (rpm, tpd)) in &self.users {
            let own = |v: Option<u64>| v.map(n).unwrap_or_else(|| "default".into());
            s.push_str(&format!("; {user}: rpm {}, tokens_per_day {}", own(rpm.map(u64::from)), own(*tpd)));
        }
        s
    }

    fn user_models(&self) -> String {
        if self.user_models.is_empty() {
            return "none".into();
        }
        let lists: Vec<String> = self.user_models.iter().map(|(u, m)| format!("{u} = [{}]", m.join(", "))).collect();
        lists.join("; ")
    }

    /// The settings where `other` (the policy of `at`) differs from this gateway's.
    fn differences(&self, other: &Policy, at: &str) -> Vec<String> {
        let mut out = Vec::new();
        if (self.rpm, self.tokens_per_day, &self.users) != (other.rpm, other.tokens_per_day, &other.users) {
            out.push(format!("[gateway.limits]: here {}; at {at} {}", self.limits(), other.limits()));
        }
        if self.user_models != other.user_models {
            out.push(format!("[gateway.user_models]: here {}; at {at} {}", self.user_models(), other.user_models()));
        }
        if self.keys_per_user != other.keys_per_user {
            out.push(format!("gateway.keys_per_user: here {}; at {at} {}", self.keys_per_user, other.keys_per_user));
        }
        out
    }
}

/// The gateways among `rows` (gateway, published policy JSON) whose policy differs from `mine`,
/// in the order given. `me`'s own row is skipped; a row that does not parse (another version of
/// gpuhub) is reported as such.
pub fn compare(me: &str, mine: &Policy, rows: &[(String, String)]) -> Vec<Difference> {
    let mut out = Vec::new();
    for (gateway, json) in rows {
        if gateway == me {
            continue;
        }
        let gw = crate::util::sanitize(gateway);
        let settings = match serde_json::from_str::<Policy>(json) {
            Ok(theirs) => mine.differences(&theirs, &gw).iter().map(|s| crate::util::sanitize(s)).collect(),
            Err(_) => vec![format!("its policy cannot be read here (another version of gpuhub at {gw}?)")],
        };
        if !settings.is_empty() {
            out.push(Difference { gateway: gw, settings });
        }
    }
    out
}

/// One line for a log or `gpuhub doctor`: a gateway's settings `; `-separated, gateways ` | `.
pub fn describe(diffs: &[Difference]) -> String {
    let parts: Vec<String> = diffs.iter().map(|d| d.settings.join("; ")).collect();
    parts.join(" | ")
}

/// What to do about a difference.
pub const FIX: &str = "give every gateway node the same [gateway.limits], [gateway.user_models] and gateway.keys_per_user in its agent.toml, then `gpuhub models reload` there: each gateway enforces its own file";

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::config::{LimitUser, UserLimits, UserName};

    fn gateway(models: &[(&str, &[&str])], keys_per_user: u32) -> AccessLists {
        AccessLists {
            user_models: models.iter().map(|(u, m)| (UserName((*u).into()), m.iter().map(|s| (*s).to_string()).collect())).collect(),
            keys_per_user,
        }
    }

    fn limits(rpm: u32, users: &[(&str, Option<u32>)]) -> LimitsConfig {
        LimitsConfig {
            rpm,
            tokens_per_day: 0,
            users: users.iter().map(|(u, r)| UserLimits { user: LimitUser((*u).into()), rpm: *r, tokens_per_day: None }).collect(),
        }
    }

    #[test]
    fn configs_that_act_alike_agree() {
        // Order of a user's models and a user's entry overridden by a later one do not matter.
        let a = Policy::of(&gateway(&[("alice", &["b", "a"])], 5), &limits(60, &[("bob", Some(1)), ("bob", Some(10))]));
        let b = Policy::of(&gateway(&[("alice", &["a", "b", "a"])], 5), &limits(60, &[("bob", Some(10))]));
        assert_eq!(a, b);
        let rows = vec![("gpu01".to_string(), a.to_json()), ("gpu02".to_string(), b.to_json())];
        assert!(compare("gpu01", &a, &rows).is_empty());
    }

    #[test]
    fn each_differing_setting_is_named_with_both_values() {
        let mine = Policy::of(&gateway(&[("alice", &["ocr"])], 5), &limits(60, &[]));
        let theirs = Policy::of(&gateway(&[], 7), &limits(0, &[("bob", Some(10))]));
        // Its own row (even with another policy) is not compared.
        let rows =
            vec![("gpu01".to_string(), theirs.to_json()), ("gpu02".to_string(), theirs.to_json()), ("gpu03".to_string(), mine.to_json())];
        let d = compare("gpu01", &mine, &rows);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].gateway, "gpu02");
        assert_eq!(
            d[0].settings,
            vec![
                "[gateway.limits]: here rpm 60, tokens_per_day none; at gpu02 rpm none, tokens_per_day none; bob: rpm 10, tokens_per_day default",
                "[gateway.user_models]: here alice = [ocr]; at gpu02 none",
                "gateway.keys_per_user: here 5; at gpu02 7",
            ]
        );
        assert!(describe(&d).contains("here 5; at gpu02 7"));
    }

    #[test]
    fn a_row_that_does_not_parse_is_reported() {
        let mine = Policy::of(&gateway(&[], 5), &limits(0, &[]));
        let d = compare("gpu01", &mine, &[("gpu02\u{1b}".to_string(), "{\"rpm\":".to_string())]);
        assert_eq!(d.len(), 1);
        assert!(d[0].settings[0].contains("cannot be read here"), "{d:?}");
        assert!(!d[0].settings[0].contains('\u{1b}') && !d[0].gateway.contains('\u{1b}'), "the gateway name is sanitized: {d:?}");
    }
}
