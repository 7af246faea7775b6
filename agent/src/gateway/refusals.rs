//! Calls refused before anyone can be billed for them: unauthenticated calls (401, and 429
//! once a peer is over its rate), and calls refused while the usage log cannot take rows
//! (503 `usage_log_full`).
//!
//! A flood of such calls must not become a flood of rows (a row per 401 fills the state disk)
//! nor of log lines. So they are:
//! - counted per peer address in `gateway_refused_calls_total{peer,code}` (at most
//!   [`MAX_PEER_LABELS`] peers, then `peer="<other>"`);
//! - kept as **one usage row per peer, minute and kind**: the first refused call's row (its
//!   request id, its route cut at [`super::MAX_ROUTE`]), with `calls` = how many were refused.
//!   The row is recorded once its minute is over (or at shutdown); a `kill -9` loses at most
//!   the current minute's counts of refused calls (never a served call's row);
//! - logged once per peer, minute and kind;
//! - rate-limited per peer (a token bucket of `gateway.unauth_refusals_per_s`, five seconds'
//!   burst): past it an unauthenticated call is answered 429 and its connection closed.
//!
//! A caller with valid credentials is never throttled here, whatever its address: every local
//! user shares 127.0.0.1.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::usage_log::UsageRow;

/// Distinct peers labelled in the metric; more share `<other>`.
pub const MAX_PEER_LABELS: usize = 1000;
/// Peers with a rate bucket or a pending row (a minute); more share one entry.
const MAX_PEERS: usize = 10_000;
const MINUTE_US: i64 = 60_000_000;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    peer: String,
    code: String,
}

/// What a refusal is about, each kept in its own row per peer and minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// No valid credentials (401, or 429 past the rate).
    Unauthenticated,
    /// The usage log could not take the call's row (503).
    UsageBacklog,
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

struct Pending {
    row: UsageRow,
    calls: i64,
}

#[derive(Default)]
struct State {
    buckets: HashMap<String, Bucket>,
    pending: HashMap<(String, i64, Kind), Pending>,
    labelled: HashSet<String>,
}

/// The refusal counters, rate buckets and pending rows.
pub struct Refusals {
    rate: f64,
    burst: f64,
    state: Mutex<State>,
    counter: Family<RefusalLabels, Counter>,
}

impl Refusals {
    /// Registers `gateway_refused_calls` in `registry` (the `gpuhub` sub-registry).
    pub fn register(per_s: u32, registry: &mut Registry) -> Refusals {
        let r = Refusals {
            rate: f64::from(per_s.max(1)),
            burst: f64::from(per_s.max(1)) * 5.0,
            state: Mutex::new(State::default()),
            counter: Family::default(),
        };
        registry.register(
            "gateway_refused_calls",
            "Calls refused before anyone could be billed (code = invalid_api_key, too_many_unauthenticated, usage_log_full), by peer address",
            r.counter.clone(),
        );
        r
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether an unauthenticated call of `peer` is answered as such (true) or throttled
    /// (false: the peer is over `gateway.unauth_refusals_per_s`). Takes one token.
    pub fn admit(&self, peer: &str) -> bool {
        let now = Instant::now();
        let mut s = self.lock();
        if s.buckets.len() >= MAX_PEERS && !s.buckets.contains_key(peer) {
            // Forget peers whose bucket has refilled: they have been quiet for a while.
            let (rate, burst) = (self.rate, self.burst);
            s.buckets.retain(|_, b| b.tokens + now.duration_since(b.at).as_secs_f64() * rate < burst);
        }
        let key = if s.buckets.len() >= MAX_PEERS && !s.buckets.contains_key(peer) { "<other>" } else { peer };
        let b = s.buckets.entry(key.to_string()).or_insert(Bucket { tokens: self.burst, at: now });
        b.tokens = (b.tokens + now.duration_since(b.at).as_secs_f64() * self.rate).min(self.burst);
        b.at = now;
        if b.tokens >= 1.0 {
            b.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Counts one refused call whose row would have been `row` (status and code set). Returns
    /// true for the first of its peer, minute and kind (the caller logs that one).
    pub fn count(&self, peer: &str, kind: Kind, row: UsageRow) -> bool {
        let mut s = self.lock();
        let label = if s.labelled.contains(peer) || s.labelled.len() < MAX_PEER_LABELS {
            s.labelled.insert(peer.to_string());
            peer.to_string()
        } else {
            "<other>".to_string()
        };
        self.counter.get_or_create(&RefusalLabels { peer: label, code: row.error_code.clone() }).inc();
        let minute = row.time_us.div_euclid(MINUTE_US);
        let mut key = (peer.to_string(), minute, kind);
        if s.pending.len() >= MAX_PEERS && !s.pending.contains_key(&key) {
            key.0 = "<other>".into();
        }
        match s.pending.get_mut(&key) {
            Some(p) => {
                p.calls += 1;
                false
            }
            None => {
                s.pending.insert(key, Pending { row, calls: 1 });
                true
            }
        }
    }

    /// The rows of minutes that are over (every pending row with `all`, at shutdown).
    pub fn take(&self, now_us: i64, all: bool) -> Vec<UsageRow> {
        let current = now_us.div_euclid(MINUTE_US);
        let mut s = self.lock();
        let done: Vec<_> = s.pending.keys().filter(|(_, m, _)| all || *m < current).cloned().collect();
        let mut out = Vec::with_capacity(done.len());
        for k in done {
            if let Some(p) = s.pending.remove(&k) {
                out.push(UsageRow { calls: p.calls, ..p.row });
            }
        }
        out.sort_by_key(|r| r.time_us);
        out
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn refused(id: &str, t: i64) -> UsageRow {
        UsageRow { request_id: id.into(), time_us: t, status: 401, error_code: "invalid_api_key".into(), ..UsageRow::default() }
    }

    #[test]
    fn one_row_per_peer_minute_and_kind() {
        let mut reg = Registry::default();
        let r = Refusals::register(10, &mut reg);
        let t0 = 1_800_000_000 * 1_000_000 - 1_800_000_000 * 1_000_000 % MINUTE_US;
        assert!(r.count("10.0.0.1", Kind::Unauthenticated, refused("a", t0)));
        for i in 0..999 {
            assert!(!r.count("10.0.0.1", Kind::Unauthenticated, refused(&format!("a{i}"), t0 + i)));
        }
        assert!(r.count("10.0.0.2", Kind::Unauthenticated, refused("b", t0 + 5)));
        assert!(r.count("10.0.0.1", Kind::UsageBacklog, refused("c", t0 + 6)));
        assert!(r.count("10.0.0.1", Kind::Unauthenticated, refused("d", t0 + MINUTE_US)), "a new minute, a new row");
        assert!(r.take(t0 + 10, false).is_empty(), "nothing while the minute lasts");
        let rows = r.take(t0 + MINUTE_US, false);
        assert_eq!(rows.iter().map(|r| (r.request_id.as_str(), r.calls)).collect::<Vec<_>>(), [("a", 1000), ("b", 1), ("c", 1)]);
        let rest = r.take(t0 + MINUTE_US, true);
        assert_eq!(rest.iter().map(|r| (r.request_id.as_str(), r.calls)).collect::<Vec<_>>(), [("d", 1)]);
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &reg).unwrap();
        assert!(s.contains("gateway_refused_calls_total{peer=\"10.0.0.1\",code=\"invalid_api_key\"} 1002"), "{s}");
    }

    #[test]
    fn a_peer_over_its_rate_is_throttled_and_others_are_not() {
        let r = Refusals::register(10, &mut Registry::default());
        let admitted = (0..200).filter(|_| r.admit("127.0.0.1")).count();
        assert!((50..=52).contains(&admitted), "burst of five seconds at 10/s, got {admitted}");
        assert!(r.admit("127.0.0.2"), "another peer has its own bucket");
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert!(r.admit("127.0.0.1"), "the bucket refills at the rate");
    }

    #[test]
    fn peer_labels_are_capped() {
        let mut reg = Registry::default();
        let r = Refusals::register(10, &mut reg);
        for i in 0..(MAX_PEER_LABELS + 20) {
            r.count(&format!("10.1.{}.{}", i / 256, i % 256), Kind::Unauthenticated, refused("x", 0));
        }
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &reg).unwrap();
        assert!(s.contains("peer=\"<other>\",code=\"invalid_api_key\"} 20"), "{}", &s[..300.min(s.len())]);
    }
}
