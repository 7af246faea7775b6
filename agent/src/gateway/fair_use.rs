//! Fair use of the gateway: requests per minute and tokens per UTC day, per user
//! (`[gateway.limits]`, with per-user overrides) and per API key (its own `--rpm`,
//! `--tokens-per-day`). The user is the identity the gateway authenticated, never a header.
//!
//! Requests per minute are a generic cell rate: a burst of up to `rpm` calls, then one every
//! `60/rpm` seconds. A call is checked before anything else is done for it (its body is not
//! even read) and counts when admitted. Tokens: a call is admitted while the day's count is
//! under the limit; its tokens (from the usage row, as the usage log records them) count when
//! it ends. Over a limit: 429 with `Retry-After`, the seconds until the limit frees.
//!
//! At start the day's tokens and the last minute's calls are reloaded from the usage log, so a
//! restart resets neither. `[gateway.limits]` is read again on SIGHUP (`gpuhub models reload`):
//! new limits apply to the next call, against the counts so far.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};

use super::auth::Identity;
use super::error::GatewayError;
use super::usage_log::UsageRow;
use crate::config::LimitsConfig;
use crate::store::gateway::LimitUsage;

const MINUTE_US: i64 = 60_000_000;
const DAY_US: i64 = 86_400 * 1_000_000;

/// Who a limit is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Subject {
    User(String),
    Key(String),
}

/// Which limit refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Rpm,
    TokensPerDay,
}

#[derive(Debug, Default)]
struct State {
    /// Theoretical arrival time (µs) per subject with a rate limit.
    tat: HashMap<Subject, i64>,
    /// The UTC day (its first µs) `tokens` counts.
    day: i64,
    tokens: Tokens,
}

/// The day's tokens per user and per key, looked up by `&str` (counted on every call).
#[derive(Debug, Default)]
struct Tokens {
    users: HashMap<String, u64>,
    keys: HashMap<String, u64>,
}

impl Tokens {
    fn clear(&mut self) {
        self.users.clear();
        self.keys.clear();
    }

    fn get(&self, s: &Subject) -> u64 {
        match s {
            Subject::User(u) => self.users.get(u),
            Subject::Key(k) => self.keys.get(k),
        }
        .copied()
        .unwrap_or(0)
    }

    fn add(map: &mut HashMap<String, u64>, who: &str, n: u64) {
        match map.get_mut(who) {
            Some(v) => *v += n,
            None => {
                map.insert(who.to_string(), n);
            }
        }
    }

    fn add_to(&mut self, s: &Subject, n: u64) {
        match s {
            Subject::User(u) => Self::add(&mut self.users, u, n),
            Subject::Key(k) => Self::add(&mut self.keys, k, n),
        }
    }
}

/// The gateway's limit state (in `Gateway::fair_use`).
#[derive(Debug, Default)]
pub struct FairUse {
    st: Mutex<State>,
    /// `[gateway.limits]` as last read.
    limits: RwLock<LimitsConfig>,
}

/// A limit that applies to one call: who, what, how much, and where it is set (for messages).
struct Applied {
    subject: Subject,
    who: String,
    value: u64,
    source: &'static str,
}

fn day_of(now_us: i64) -> i64 {
    now_us - now_us.rem_euclid(DAY_US)
}

/// `2026-12-01 20:50:12 UTC` (rounded up to the second).
fn utc(us: i64) -> String {
    crate::util::utc_time((us + 999_999).div_euclid(1_000_000))
}

impl FairUse {
    /// Limit state under `limits` (`[gateway.limits]`), nothing counted yet.
    pub fn new(limits: LimitsConfig) -> FairUse {
        FairUse { st: Mutex::default(), limits: RwLock::new(limits) }
    }

    /// Applies `[gateway.limits]` as read again; the calls and tokens counted so far stay.
    pub fn set_limits(&self, limits: LimitsConfig) {
        *self.limits.write().unwrap_or_else(PoisonError::into_inner) = limits;
    }

    /// `user`'s requests per minute and tokens per day under `[gateway.limits]` (0: none).
    pub fn user_limits(&self, user: &str) -> (u32, u64) {
        self.limits.read().unwrap_or_else(PoisonError::into_inner).for_user(user)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; every update is complete.
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seeds the state from the usage log at start (`rows` from
    /// [`crate::store::Store::limit_usage`] with this day's start and now - 60 s): the day's
    /// tokens, and the last minute's calls as if they had just come.
    pub fn reload(&self, keys: &[crate::store::gateway::ApiKeyRecord], rows: &[LimitUsage], now_us: i64) {
        let cfg = self.limits.read().unwrap_or_else(PoisonError::into_inner);
        let mut st = self.lock();
        st.day = day_of(now_us);
        let mut calls: HashMap<Subject, i64> = HashMap::new();
        for r in rows {
            let tokens = u64::try_from(r.tokens).unwrap_or(0);
            let mut subjects = vec![Subject::User(r.user.clone())];
            if !r.key_id.is_empty() {
                subjects.push(Subject::Key(r.key_id.clone()));
            }
            for s in subjects {
                st.tokens.add_to(&s, tokens);
                *calls.entry(s).or_default() += r.recent_calls;
            }
        }
        for (s, n) in calls {
            let rpm = match &s {
                Subject::User(u) => cfg.for_user(u).0,
                Subject::Key(k) => keys.iter().find(|r| &r.id == k).and_then(|r| r.rpm).unwrap_or(0),
            };
            if rpm > 0 && n > 0 {
                st.tat.insert(s, now_us + n.min(i64::from(rpm)) * (MINUTE_US / i64::from(rpm)));
            }
        }
    }

    fn applied(cfg: &LimitsConfig, id: &Identity) -> (Vec<Applied>, Vec<Applied>) {
        let (rpm, tpd) = cfg.for_user(&id.user);
        if rpm == 0 && tpd == 0 && id.key_rpm.is_none_or(|r| r == 0) && id.key_tokens_per_day.is_none_or(|t| t == 0) {
            // No limit applies: nothing to name (this runs on every call).
            return (Vec::new(), Vec::new());
        }
        let user = Subject::User(id.user.clone());
        let who = format!("user `{}`", id.user);
        let key_who = |k: &str| format!("API key {k} ({}/{})", id.user, id.app);
        let mut rate = Vec::new();
        let mut tokens = Vec::new();
        if let (Some(k), Some(r)) = (&id.key_id, id.key_rpm.filter(|r| *r > 0)) {
            rate.push(Applied { subject: Subject::Key(k.clone()), who: key_who(k), value: u64::from(r), source: "the key's own --rpm" });
        }
        if rpm > 0 {
            rate.push(Applied { subject: user.clone(), who: who.clone(), value: u64::from(rpm), source: "gateway.limits" });
        }
        if let (Some(k), Some(t)) = (&id.key_id, id.key_tokens_per_day.filter(|t| *t > 0)) {
            tokens.push(Applied { subject: Subject::Key(k.clone()), who: key_who(k), value: t, source: "the key's own --tokens-per-day" });
        }
        if tpd > 0 {
            tokens.push(Applied { subject: user, who, value: tpd, source: "gateway.limits" });
        }
        (rate, tokens)
    }

    /// Admits a call of `id` at `now_us` (counting it against its rate limits), or says which
    /// limit it is over and for how long.
    pub fn admit(&self, id: &Identity, now_us: i64) -> Result<(), GatewayError> {
        if id.user.is_empty() {
            return Ok(());
        }
        let (rate, tokens) = Self::applied(&self.limits.read().unwrap_or_else(PoisonError::into_inner), id);
        if rate.is_empty() && tokens.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        let today = day_of(now_us);
        if st.day != today {
            st.day = today;
            st.tokens.clear();
        }
        for a in &tokens {
            let used = st.tokens.get(&a.subject);
            if used >= a.value {
                let reset = today + DAY_US;
                return Err(GatewayError::OverLimit {
                    limit: Limit::TokensPerDay,
                    retry_after_s: u64::try_from((reset - now_us + 999_999) / 1_000_000).unwrap_or(1).max(1),
                    message: format!(
                        "token limit reached: {} may use {} tokens per day (tokens_per_day, {}) and has used {used} today; \
                         it resets at 00:00 UTC ({}, Retry-After); retry then, or ask an admin to raise the limit",
                        a.who,
                        a.value,
                        a.source,
                        utc(reset)
                    ),
                });
            }
        }
        let mut next = Vec::with_capacity(rate.len());
        for a in &rate {
            let interval = MINUTE_US / i64::try_from(a.value).unwrap_or(i64::MAX).max(1);
            let tat = st.tat.get(&a.subject).copied().unwrap_or(now_us).max(now_us);
            if tat + interval - now_us > MINUTE_US {
                let free_at = tat + interval - MINUTE_US;
                return Err(GatewayError::OverLimit {
                    limit: Limit::Rpm,
                    retry_after_s: u64::try_from((free_at - now_us + 999_999) / 1_000_000).unwrap_or(1).max(1),
                    message: format!(
                        "rate limit reached: {} may make {} requests per minute (rpm, {}); the next call is admitted at {} \
                         (Retry-After); slow down, or ask an admin to raise the limit",
                        a.who,
                        a.value,
                        a.source,
                        utc(free_at)
                    ),
                });
            }
            next.push((a.subject.clone(), tat + interval));
        }
        for (s, t) in next {
            st.tat.insert(s, t);
        }
        // Forget subjects whose rate state has run out (bounded memory).
        if st.tat.len() > 4096 {
            st.tat.retain(|_, t| *t > now_us);
        }
        Ok(())
    }

    /// Counts the tokens of a call that ended.
    pub fn count(&self, row: &UsageRow, now_us: i64) {
        let n = u64::try_from(row.prompt_tokens.max(0) + row.completion_tokens.max(0)).unwrap_or(0);
        if n == 0 || row.user.is_empty() {
            return;
        }
        let mut st = self.lock();
        let today = day_of(now_us);
        if st.day != today {
            st.day = today;
            st.tokens.clear();
        }
        Tokens::add(&mut st.tokens.users, &row.user, n);
        if !row.key_id.is_empty() {
            Tokens::add(&mut st.tokens.keys, &row.key_id, n);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::config::{LimitUser, UserLimits};

    const T0: i64 = 1_800_000_000_000_000 - 1_800_000_000_000_000 % DAY_US + 3_600_000_000;

    fn key(id: &str, user: &str, rpm: Option<u32>, tpd: Option<u64>) -> Identity {
        Identity {
            user: user.into(),
            app: "app".into(),
            key_id: Some(id.into()),
            key_rpm: rpm,
            key_tokens_per_day: tpd,
            ..Identity::default()
        }
    }

    fn used(user: &str, key_id: &str, tokens: i64) -> UsageRow {
        UsageRow { user: user.into(), key_id: key_id.into(), prompt_tokens: tokens, ..UsageRow::default() }
    }

    #[test]
    fn rpm_admits_a_burst_then_one_per_interval_and_says_when() {
        let cfg = LimitsConfig { rpm: 3, ..LimitsConfig::default() };
        let f = FairUse::new(cfg);
        let alice = Identity { user: "alice".into(), app: "job".into(), ..Identity::default() };
        for _ in 0..3 {
            f.admit(&alice, T0).unwrap();
        }
        let e = f.admit(&alice, T0 + 1_000_000).unwrap_err();
        let GatewayError::OverLimit { limit, retry_after_s, ref message } = e else { panic!("{e:?}") };
        assert_eq!((limit, retry_after_s), (Limit::Rpm, 19));
        assert!(message.contains("user `alice` may make 3 requests per minute (rpm, gateway.limits)"), "{message}");
        assert_eq!(e.status().as_u16(), 429);
        assert_eq!(e.code(), "rate_limit_exceeded");
        // 20 s later one more is admitted; other users are not affected.
        f.admit(&alice, T0 + 20_000_000).unwrap();
        f.admit(&Identity { user: "bob".into(), ..Identity::default() }, T0 + 1).unwrap();
        // A per-user override (0 exempts), applied by a reload to the next call.
        f.set_limits(LimitsConfig {
            rpm: 3,
            users: vec![UserLimits { user: LimitUser("alice".into()), rpm: Some(0), tokens_per_day: None }],
            ..LimitsConfig::default()
        });
        for _ in 0..10 {
            f.admit(&alice, T0 + 21_000_000).unwrap();
        }
    }

    #[test]
    fn a_keys_own_rpm_applies_on_top_of_its_users() {
        let cfg = LimitsConfig { rpm: 100, ..LimitsConfig::default() };
        let f = FairUse::new(cfg);
        let k = key("k1", "alice", Some(1), None);
        f.admit(&k, T0).unwrap();
        let e = f.admit(&k, T0).unwrap_err();
        assert!(e.to_string().contains("API key k1 (alice/app) may make 1 requests per minute (rpm, the key's own --rpm)"), "{e}");
        // The user's other credentials still have room.
        f.admit(&key("k2", "alice", None, None), T0).unwrap();
    }

    #[test]
    fn tokens_admit_while_under_and_count_when_the_call_ends() {
        let cfg = LimitsConfig { tokens_per_day: 100, ..LimitsConfig::default() };
        let f = FairUse::new(cfg);
        let k = key("k1", "alice", None, Some(50));
        f.admit(&k, T0).unwrap();
        f.count(&used("alice", "k1", 49), T0);
        f.admit(&k, T0).unwrap();
        f.count(&used("alice", "k1", 10), T0);
        let e = f.admit(&k, T0 + 1_000_000).unwrap_err();
        let GatewayError::OverLimit { limit, retry_after_s, ref message } = e else { panic!("{e:?}") };
        assert_eq!(limit, Limit::TokensPerDay);
        assert_eq!(retry_after_s, 23 * 3600 - 1, "until 00:00 UTC");
        assert!(message.contains("API key k1 (alice/app) may use 50 tokens per day") && message.contains("has used 59 today"), "{message}");
        assert!(message.contains("resets at 00:00 UTC"), "{message}");
        // The user's own limit counts every key of hers.
        f.count(&used("alice", "", 41), T0);
        let e = f.admit(&key("k2", "alice", None, None), T0).unwrap_err();
        assert!(e.to_string().contains("user `alice` may use 100 tokens per day") && e.to_string().contains("has used 100"), "{e}");
        // A new day starts from zero.
        f.admit(&k, T0 + DAY_US).unwrap();
    }

    #[test]
    fn reload_keeps_the_days_tokens_and_the_last_minutes_calls() {
        let cfg = LimitsConfig { rpm: 2, tokens_per_day: 100, ..LimitsConfig::default() };
        let keys = vec![crate::store::gateway::ApiKeyRecord {
            id: "k1".into(),
            key_hash: String::new(),
            prefix: String::new(),
            user: "bob".into(),
            app: "app".into(),
            models: vec![],
            created_us: 0,
            created_by: String::new(),
            revoked_us: None,
            rpm: Some(1),
            tokens_per_day: None,
        }];
        let rows = vec![
            LimitUsage { user: "alice".into(), key_id: "".into(), tokens: 100, recent_calls: 0 },
            LimitUsage { user: "bob".into(), key_id: "k1".into(), tokens: 5, recent_calls: 1 },
        ];
        let f = FairUse::new(cfg);
        f.reload(&keys, &rows, T0);
        let alice = Identity { user: "alice".into(), ..Identity::default() };
        assert!(f.admit(&alice, T0).unwrap_err().to_string().contains("has used 100 today"));
        // bob's key made its one call of the minute before the restart.
        let e = f.admit(&key("k1", "bob", Some(1), None), T0).unwrap_err();
        assert!(e.to_string().contains("API key k1"), "{e}");
        // bob himself (rpm 2) has one left.
        f.admit(&Identity { user: "bob".into(), ..Identity::default() }, T0).unwrap();
    }
}
