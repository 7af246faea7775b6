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
//!
//! Several gateways on one PostgreSQL store count together: each publishes its counts of the
//! day per user and per key (`gateway_limit_counts`), and reads the others' every
//! `cluster_sync` pass (2 s). Their tokens add to this gateway's; the calls they admitted since
//! the last pass are charged to the rates here as if they had come now. So a user over a limit
//! at one gateway is over it at every gateway within two passes (one to publish, one to read),
//! and a rate holds across gateways up to the calls admitted elsewhere in that time. While no
//! limit applies at a gateway it reads nothing.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};

use super::auth::Identity;
use super::error::GatewayError;
use super::usage_log::UsageRow;
use crate::config::LimitsConfig;
use crate::store::LimitCount;
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
    /// The UTC day (its first µs) `counts` and `others` are about.
    day: i64,
    /// This gateway's counts of the day.
    counts: Counts,
    /// The other gateways' counts of the day as last read (their calls: only the calls they
    /// admitted since are charged here).
    others: Counts,
    /// `others` was not kept up to date (no limit applied here): the next read only takes
    /// their counts as they are, charging nothing.
    others_stale: bool,
}

/// What one gateway counted for one subject in a day.
#[derive(Debug, Default, Clone, Copy)]
struct Count {
    tokens: u64,
    /// Calls admitted against a requests-per-minute limit.
    calls: u64,
    /// Changed since this gateway last published its counts.
    dirty: bool,
}

/// Counts per user and per key, looked up by `&str` (counted on every call).
#[derive(Debug, Default)]
struct Counts {
    users: HashMap<String, Count>,
    keys: HashMap<String, Count>,
}

impl Counts {
    fn clear(&mut self) {
        self.users.clear();
        self.keys.clear();
    }

    fn get(&self, s: &Subject) -> Count {
        match s {
            Subject::User(u) => self.users.get(u),
            Subject::Key(k) => self.keys.get(k),
        }
        .copied()
        .unwrap_or_default()
    }

    /// Applies `f` to `who`'s count in `map` (no `String` allocated when it is counted already).
    fn update_in(map: &mut HashMap<String, Count>, who: &str, f: impl FnOnce(&mut Count)) {
        match map.get_mut(who) {
            Some(c) => f(c),
            None => {
                let mut c = Count::default();
                f(&mut c);
                map.insert(who.to_string(), c);
            }
        }
    }

    fn update(&mut self, s: &Subject, f: impl FnOnce(&mut Count)) {
        match s {
            Subject::User(u) => Self::update_in(&mut self.users, u, f),
            Subject::Key(k) => Self::update_in(&mut self.keys, k, f),
        }
    }
}

impl Subject {
    /// The subject of a `gateway_limit_counts` row (`user` or `key`).
    fn of_row(kind: &str, who: &str) -> Option<Subject> {
        match kind {
            "user" => Some(Subject::User(who.to_string())),
            "key" => Some(Subject::Key(who.to_string())),
            _ => None,
        }
    }
}

impl State {
    /// Starts a new UTC day's counts when `now_us` is in one.
    fn roll(&mut self, now_us: i64) {
        let today = day_of(now_us);
        if self.day != today {
            self.day = today;
            self.counts.clear();
            self.others.clear();
        }
    }

    /// Charges `n` calls to `s`'s rate of `rpm` requests per minute, as if they came at `now_us`.
    fn charge(&mut self, s: Subject, n: u64, rpm: u32, now_us: i64) {
        if rpm == 0 || n == 0 {
            return;
        }
        let interval = MINUTE_US / i64::from(rpm);
        let tat = self.tat.get(&s).copied().unwrap_or(now_us).max(now_us);
        let charged = i64::try_from(n).unwrap_or(i64::MAX).saturating_mul(interval);
        self.tat.insert(s, tat.saturating_add(charged).min(now_us + MINUTE_US));
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

/// The first µs of the UTC day of `now_us`.
pub fn day_of(now_us: i64) -> i64 {
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

    /// `[gateway.limits]` as last read.
    pub fn limits(&self) -> LimitsConfig {
        self.limits.read().unwrap_or_else(PoisonError::into_inner).clone()
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
        st.roll(now_us);
        let mut calls: HashMap<Subject, i64> = HashMap::new();
        for r in rows {
            let tokens = u64::try_from(r.tokens).unwrap_or(0);
            let mut subjects = vec![Subject::User(r.user.clone())];
            if !r.key_id.is_empty() {
                subjects.push(Subject::Key(r.key_id.clone()));
            }
            for s in subjects {
                st.counts.update(&s, |c| {
                    c.tokens += tokens;
                    c.dirty = true;
                });
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

    /// At start, after [`FairUse::reload`] (PostgreSQL): the other gateways' counts of the day
    /// `day_us`. The usage log reloaded holds their calls too: their tokens move from this
    /// gateway's counts to theirs, and their calls so far are not charged again.
    pub fn start_with_others(&self, day_us: i64, rows: &[LimitCount], now_us: i64) {
        let mut st = self.lock();
        st.roll(now_us);
        if st.day != day_us {
            return;
        }
        st.others.clear();
        for r in rows {
            let Some(s) = Subject::of_row(&r.kind, &r.who) else { continue };
            let (tokens, calls) = (u64::try_from(r.tokens).unwrap_or(0), u64::try_from(r.calls).unwrap_or(0));
            st.counts.update(&s, |c| c.tokens = c.tokens.saturating_sub(tokens));
            st.others.update(&s, |c| *c = Count { tokens, calls, dirty: false });
        }
    }

    /// Whether `[gateway.limits]` sets any limit.
    pub fn any_limit(&self) -> bool {
        self.limits.read().unwrap_or_else(PoisonError::into_inner).any()
    }

    /// The other gateways' counts are not read while no limit applies here (`cluster_sync`):
    /// the first read after that charges none of the calls they admitted meanwhile.
    pub fn others_not_followed(&self) {
        self.lock().others_stale = true;
    }

    /// The other gateways' counts of the day `day_us` as read now (`cluster_sync`): their
    /// tokens replace the last read; the calls they admitted since it are charged to the rates
    /// here (`key_rpm`: a key's own `--rpm`, by key id).
    pub fn follow_others(&self, day_us: i64, rows: &[LimitCount], key_rpm: impl Fn(&str) -> Option<u32>, now_us: i64) {
        let cfg = self.limits.read().unwrap_or_else(PoisonError::into_inner);
        let mut st = self.lock();
        st.roll(now_us);
        if st.day != day_us {
            return; // read before midnight
        }
        let stale = std::mem::take(&mut st.others_stale);
        let mut seen = Counts::default();
        for r in rows {
            let Some(s) = Subject::of_row(&r.kind, &r.who) else { continue };
            let (tokens, calls) = (u64::try_from(r.tokens).unwrap_or(0), u64::try_from(r.calls).unwrap_or(0));
            // Fewer than last read: a gateway restarted and counts again from its own start.
            let new_calls = if stale { 0 } else { calls.saturating_sub(st.others.get(&s).calls) };
            let rpm = match &s {
                Subject::User(u) => cfg.for_user(u).0,
                Subject::Key(k) => key_rpm(k).unwrap_or(0),
            };
            seen.update(&s, |c| *c = Count { tokens, calls, dirty: false });
            st.charge(s, new_calls, rpm, now_us);
        }
        st.others = seen;
    }

    /// This gateway's counts that changed since the last call (for `gateway_limit_counts`),
    /// with their day; `None` when nothing changed. A publication that fails is handed back
    /// with [`FairUse::unpublished`].
    pub fn to_publish(&self) -> Option<(i64, Vec<LimitCount>)> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let day = st.day;
        let mut rows = Vec::new();
        for (kind, map) in [("user", &mut st.counts.users), ("key", &mut st.counts.keys)] {
            for (who, c) in map.iter_mut().filter(|(_, c)| c.dirty) {
                c.dirty = false;
                rows.push(LimitCount {
                    kind: kind.to_string(),
                    who: who.clone(),
                    tokens: i64::try_from(c.tokens).unwrap_or(i64::MAX),
                    calls: i64::try_from(c.calls).unwrap_or(i64::MAX),
                });
            }
        }
        (!rows.is_empty()).then_some((day, rows))
    }

    /// Counts from [`FairUse::to_publish`] that the store did not take: published next time.
    pub fn unpublished(&self, day_us: i64, rows: &[LimitCount]) {
        let mut st = self.lock();
        if st.day != day_us {
            return;
        }
        for r in rows {
            if let Some(s) = Subject::of_row(&r.kind, &r.who) {
                st.counts.update(&s, |c| c.dirty = true);
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
        st.roll(now_us);
        let today = st.day;
        for a in &tokens {
            let used = st.counts.get(&a.subject).tokens + st.others.get(&a.subject).tokens;
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
            st.counts.update(&s, |c| {
                c.calls += 1;
                c.dirty = true;
            });
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
        st.roll(now_us);
        let add = |c: &mut Count| {
            c.tokens += n;
            c.dirty = true;
        };
        Counts::update_in(&mut st.counts.users, &row.user, add);
        if !row.key_id.is_empty() {
            Counts::update_in(&mut st.counts.keys, &row.key_id, add);
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

    fn counted(kind: &str, who: &str, tokens: i64, calls: i64) -> LimitCount {
        LimitCount { kind: kind.into(), who: who.into(), tokens, calls }
    }

    #[test]
    fn calls_admitted_at_another_gateway_count_against_the_rate_here() {
        let f = FairUse::new(LimitsConfig { rpm: 3, ..LimitsConfig::default() });
        let alice = Identity { user: "alice".into(), ..Identity::default() };
        f.admit(&alice, T0).unwrap();
        // Another gateway admitted two of alice's calls: her minute is used up here too.
        f.follow_others(day_of(T0), &[counted("user", "alice", 0, 2)], |_| None, T0);
        let e = f.admit(&alice, T0).unwrap_err();
        assert!(e.to_string().contains("user `alice` may make 3 requests per minute"), "{e}");
        // The same two calls read again are not charged again: a minute later she has room.
        f.follow_others(day_of(T0), &[counted("user", "alice", 0, 2)], |_| None, T0 + MINUTE_US);
        f.admit(&alice, T0 + MINUTE_US).unwrap();
        // A key's own rpm is charged by key id.
        let k = key("k1", "bob", Some(1), None);
        f.follow_others(day_of(T0), &[counted("key", "k1", 0, 1)], |id| (id == "k1").then_some(1), T0 + MINUTE_US);
        assert!(f.admit(&k, T0 + MINUTE_US).unwrap_err().to_string().contains("API key k1"));
    }

    #[test]
    fn calls_made_elsewhere_while_not_followed_are_not_charged_at_once() {
        let f = FairUse::new(LimitsConfig::default());
        assert!(!f.any_limit());
        f.others_not_followed();
        // A limit is set later: the day's calls at the other gateway so far are taken as they
        // are, not charged as if they had all come now.
        f.set_limits(LimitsConfig { rpm: 2, ..LimitsConfig::default() });
        assert!(f.any_limit());
        f.follow_others(day_of(T0), &[counted("user", "alice", 0, 500)], |_| None, T0);
        let alice = Identity { user: "alice".into(), ..Identity::default() };
        f.admit(&alice, T0).unwrap();
        // From then on their new calls count.
        f.follow_others(day_of(T0), &[counted("user", "alice", 0, 501)], |_| None, T0);
        assert!(f.admit(&alice, T0).is_err());
    }

    #[test]
    fn tokens_used_at_other_gateways_add_to_the_days_count() {
        let f = FairUse::new(LimitsConfig { tokens_per_day: 100, ..LimitsConfig::default() });
        let alice = Identity { user: "alice".into(), ..Identity::default() };
        f.count(&used("alice", "", 40), T0);
        f.follow_others(day_of(T0), &[counted("user", "alice", 59, 0)], |_| None, T0);
        f.admit(&alice, T0).unwrap();
        f.follow_others(day_of(T0), &[counted("user", "alice", 60, 0)], |_| None, T0);
        let e = f.admit(&alice, T0).unwrap_err();
        assert!(e.to_string().contains("has used 100 today"), "{e}");
        // A read of yesterday's counts (before midnight) changes nothing.
        f.follow_others(day_of(T0) - DAY_US, &[counted("user", "alice", 0, 0)], |_| None, T0);
        assert!(f.admit(&alice, T0).is_err());
    }

    #[test]
    fn at_start_the_other_gateways_calls_in_the_usage_log_count_once() {
        let f = FairUse::new(LimitsConfig { rpm: 10, tokens_per_day: 100, ..LimitsConfig::default() });
        // The usage log holds every gateway's calls: 100 tokens today, 60 of them elsewhere.
        f.reload(&[], &[LimitUsage { user: "alice".into(), key_id: "".into(), tokens: 100, recent_calls: 0 }], T0);
        f.start_with_others(day_of(T0), &[counted("user", "alice", 60, 5)], T0);
        let alice = Identity { user: "alice".into(), ..Identity::default() };
        assert!(f.admit(&alice, T0).unwrap_err().to_string().contains("has used 100 today"));
        // Their five calls so far are in the reload already: read again, they charge nothing.
        f.set_limits(LimitsConfig { rpm: 1, tokens_per_day: 0, ..LimitsConfig::default() });
        f.follow_others(day_of(T0), &[counted("user", "alice", 60, 5)], |_| None, T0);
        f.admit(&alice, T0).unwrap();
    }

    #[test]
    fn this_gateways_counts_are_published_once_per_change() {
        let f = FairUse::new(LimitsConfig { rpm: 10, ..LimitsConfig::default() });
        assert!(f.to_publish().is_none());
        f.admit(&key("k1", "alice", Some(5), None), T0).unwrap();
        f.count(&used("alice", "k1", 7), T0);
        let (day, mut rows) = f.to_publish().unwrap();
        rows.sort_by(|a, b| a.kind.cmp(&b.kind));
        assert_eq!(day, day_of(T0));
        assert_eq!(rows, vec![counted("key", "k1", 7, 1), counted("user", "alice", 7, 1)]);
        assert!(f.to_publish().is_none(), "nothing changed since");
        // The store did not take them: they go out with the next publication.
        f.unpublished(day, &rows);
        assert_eq!(f.to_publish().unwrap().1.len(), 2);
    }
}
