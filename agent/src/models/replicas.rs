//! Replicas of one model: when to start another worker, which replica takes a call, where a
//! new replica goes, and each replica's health. Pure decisions; the lifecycle
//! (`lifecycle/scale.rs`) acts on them.
//!
//! - Scale up while the calls in flight per ready replica stay above `target_in_flight` for
//!   `scale_up_after_s`, one replica at a time, up to `max_replicas` (and at once up to
//!   `min_replicas`).
//! - Scale down: a replica with no call for `idle_timeout_s` stops while more than
//!   `max(min_replicas, 1)` remain; the last one stops only when `min_replicas` is 0.
//!   Least-outstanding routing sends a quiet model's calls to the oldest replica, so the others
//!   go idle and stop one by one.
//! - Routing: least outstanding requests among ready, healthy replicas (ties: the oldest).
//! - Spread: a new replica excludes (`sbatch --exclude`) the nodes the model's replicas run on
//!   while the partition has another node that is up; with none, it may share a node.
//! - Health: a replica is `unhealthy` after `unhealthy_after` failed probes in a row (one each
//!   `probe_interval_s`) and gets no call; one passing probe makes it `ready` again.

use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::config::ModelConfig;

/// One model's replica settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub min: u32,
    pub max: u32,
    pub target_in_flight: u32,
    pub scale_up_after: Duration,
    pub probe_interval: Duration,
    pub unhealthy_after: u32,
}

impl Policy {
    pub fn of(m: &ModelConfig) -> Policy {
        Policy {
            min: m.min_replicas,
            max: m.max_replicas.max(1),
            target_in_flight: m.target_in_flight.max(1),
            scale_up_after: Duration::from_secs(m.scale_up_after_s),
            probe_interval: Duration::from_secs(m.probe_interval_s.max(1)),
            unhealthy_after: m.unhealthy_after.max(1),
        }
    }

    /// Whether an idle replica may stop when `live` replicas (ready or starting) run.
    pub fn may_retire(&self, live: u32) -> bool {
        live > self.min.max(1) || (live == 1 && self.min == 0)
    }
}

/// When load has stayed high long enough to start another replica.
#[derive(Debug, Default)]
pub struct Scaler {
    above_since: Option<Instant>,
    /// No new replica before this (a start just failed).
    hold_until: Option<Instant>,
}

impl Scaler {
    /// Whether to start one more replica now: `ready` and `starting` replicas, `in_flight`
    /// calls of the model (forwarded or waiting for a slot).
    pub fn scale_up(&mut self, p: &Policy, ready: u32, starting: u32, in_flight: u32, now: Instant) -> bool {
        let live = ready + starting;
        if live >= p.max || ready == 0 || starting > 0 || self.hold_until.is_some_and(|t| now < t) {
            self.above_since = None;
            return false;
        }
        if live < p.min {
            return true;
        }
        if in_flight <= p.target_in_flight.saturating_mul(ready) {
            self.above_since = None;
            return false;
        }
        let since = *self.above_since.get_or_insert(now);
        if now.saturating_duration_since(since) >= p.scale_up_after {
            self.above_since = None;
            return true;
        }
        false
    }

    /// A replica failed to start: no other start for `backoff`.
    pub fn failed(&mut self, now: Instant, backoff: Duration) {
        self.hold_until = Some(now + backoff);
    }
}

/// The replica that takes the next call: the fewest calls outstanding among the eligible
/// ones (ties: the first, the oldest). `None` when none is eligible.
pub fn least_outstanding(candidates: &[(u32, bool)]) -> Option<usize> {
    candidates.iter().enumerate().filter(|(_, (_, ok))| *ok).min_by_key(|(i, (n, _))| (*n, *i)).map(|(i, _)| i)
}

/// The nodes a new replica must avoid: those the model's replicas run on, when the partition
/// has an up node outside them; nothing otherwise (it may then share a node).
pub fn exclude_nodes(used: &[String], up: &[String]) -> Vec<String> {
    let mut used: Vec<String> = used.iter().filter(|n| !n.is_empty()).cloned().collect();
    used.sort();
    used.dedup();
    if up.iter().any(|n| !used.contains(n)) { used } else { Vec::new() }
}

/// The nodes `sinfo -h -N -o '%N|%t'` lists as able to run a job (not down, drained, failed).
pub fn up_nodes(sinfo: &str) -> Vec<String> {
    let mut nodes: Vec<String> = sinfo
        .lines()
        .filter_map(|l| l.split_once('|'))
        .filter(|(_, st)| {
            let st = st.trim().trim_end_matches(['*', '~', '#', '!', '%', '$', '@', '^', '-']);
            !matches!(st, "down" | "drain" | "drng" | "drained" | "draining" | "fail" | "failing" | "maint" | "unk" | "unknown" | "")
        })
        .map(|(n, _)| n.trim().to_string())
        .filter(|n| !n.is_empty())
        .collect();
    nodes.sort();
    nodes.dedup();
    nodes
}

/// A replica's health as probes see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    Ready,
    Unhealthy,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ready => "ready",
            Health::Unhealthy => "unhealthy",
        }
    }
}

/// One replica's probe record.
#[derive(Debug, Clone)]
pub struct Probe {
    pub health: Health,
    pub failures: u32,
    pub next_at: Instant,
}

impl Probe {
    pub fn new(now: Instant, p: &Policy) -> Probe {
        Probe { health: Health::Ready, failures: 0, next_at: now + p.probe_interval }
    }

    /// Records one probe; returns the new health when it changed.
    pub fn record(&mut self, ok: bool, p: &Policy, now: Instant) -> Option<Health> {
        self.next_at = now + p.probe_interval;
        let before = self.health;
        if ok {
            self.failures = 0;
            self.health = Health::Ready;
        } else {
            self.failures = self.failures.saturating_add(1);
            if self.failures >= p.unhealthy_after {
                self.health = Health::Unhealthy;
            }
        }
        (self.health != before).then_some(self.health)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(min: u32, max: u32) -> Policy {
        Policy {
            min,
            max,
            target_in_flight: 2,
            scale_up_after: Duration::from_secs(5),
            probe_interval: Duration::from_secs(1),
            unhealthy_after: 3,
        }
    }

    #[test]
    fn scales_up_only_after_the_load_stays_above_the_target() {
        let p = policy(0, 2);
        let mut s = Scaler::default();
        let t0 = Instant::now();
        assert!(!s.scale_up(&p, 1, 0, 3, t0), "above the target, but not for long yet");
        assert!(!s.scale_up(&p, 1, 0, 3, t0 + Duration::from_secs(4)));
        assert!(s.scale_up(&p, 1, 0, 3, t0 + Duration::from_secs(5)), "above for scale_up_after");
        // A dip below the target restarts the clock.
        let mut s = Scaler::default();
        assert!(!s.scale_up(&p, 1, 0, 3, t0));
        assert!(!s.scale_up(&p, 1, 0, 2, t0 + Duration::from_secs(3)), "at the target is not above it");
        assert!(!s.scale_up(&p, 1, 0, 3, t0 + Duration::from_secs(6)));
        assert!(s.scale_up(&p, 1, 0, 3, t0 + Duration::from_secs(11)));
    }

    #[test]
    fn never_above_max_nor_two_starts_at_once() {
        let p = policy(0, 2);
        let t0 = Instant::now();
        let mut s = Scaler::default();
        s.scale_up(&p, 2, 0, 100, t0);
        assert!(!s.scale_up(&p, 2, 0, 100, t0 + Duration::from_secs(60)), "max_replicas reached");
        let p3 = policy(0, 3);
        s.scale_up(&p3, 1, 1, 100, t0);
        assert!(!s.scale_up(&p3, 1, 1, 100, t0 + Duration::from_secs(60)), "one replica starting already");
        assert!(!s.scale_up(&p3, 0, 0, 100, t0 + Duration::from_secs(60)), "nothing ready: the first load is the lifecycle's");
        s.failed(t0, Duration::from_secs(30));
        s.scale_up(&p3, 1, 0, 100, t0);
        assert!(!s.scale_up(&p3, 1, 0, 100, t0 + Duration::from_secs(10)), "held after a failed start");
        assert!(!s.scale_up(&p3, 1, 0, 100, t0 + Duration::from_secs(40)), "the clock starts when the hold ends");
        assert!(s.scale_up(&p3, 1, 0, 100, t0 + Duration::from_secs(45)));
    }

    #[test]
    fn starts_up_to_min_replicas_without_load() {
        let p = policy(2, 3);
        let mut s = Scaler::default();
        assert!(s.scale_up(&p, 1, 0, 0, Instant::now()));
        assert!(!s.scale_up(&p, 2, 0, 0, Instant::now()));
    }

    #[test]
    fn retires_down_to_min_replicas_and_to_zero_only_with_min_zero() {
        assert!(policy(0, 2).may_retire(2));
        assert!(policy(0, 2).may_retire(1), "min 0: the last one unloads when idle");
        assert!(policy(1, 2).may_retire(2));
        assert!(!policy(1, 2).may_retire(1), "min 1 keeps one");
        assert!(!policy(2, 3).may_retire(2));
        assert!(policy(2, 3).may_retire(3));
    }

    #[test]
    fn least_outstanding_skips_unhealthy_and_prefers_the_oldest_on_ties() {
        assert_eq!(least_outstanding(&[(3, true), (1, true), (2, true)]), Some(1));
        assert_eq!(least_outstanding(&[(3, true), (0, false), (2, true)]), Some(2), "an unhealthy replica gets no call");
        assert_eq!(least_outstanding(&[(0, true), (0, true)]), Some(0), "ties go to the oldest");
        assert_eq!(least_outstanding(&[(0, false)]), None);
        assert_eq!(least_outstanding(&[]), None);
    }

    #[test]
    fn spread_excludes_used_nodes_only_while_another_is_up() {
        let up = vec!["gpu01".to_string(), "gpu02".to_string()];
        assert_eq!(exclude_nodes(&["gpu01".into()], &up), vec!["gpu01".to_string()]);
        assert_eq!(exclude_nodes(&["gpu02".into(), "gpu02".into(), String::new()], &up), vec!["gpu02".to_string()]);
        assert!(exclude_nodes(&["gpu01".into(), "gpu02".into()], &up).is_empty(), "every node used: share one");
        assert!(exclude_nodes(&["gpu01".into()], &["gpu01".into()]).is_empty(), "a one-node partition");
        assert!(exclude_nodes(&[], &up).is_empty());
    }

    #[test]
    fn up_nodes_leaves_out_down_and_drained_nodes() {
        let out = "gpu01|idle\ngpu02|mix\ngpu03|drain\ngpu04|down*\ngpu01|idle\ngpu05|alloc\n";
        assert_eq!(up_nodes(out), vec!["gpu01", "gpu02", "gpu05"]);
    }

    #[test]
    fn health_turns_unhealthy_after_n_failures_and_back_on_one_pass() {
        let p = policy(0, 2);
        let t = Instant::now();
        let mut pr = Probe::new(t, &p);
        assert_eq!(pr.record(false, &p, t), None);
        assert_eq!(pr.record(false, &p, t), None);
        assert_eq!(pr.record(false, &p, t), Some(Health::Unhealthy));
        assert_eq!(pr.record(false, &p, t), None);
        assert_eq!(pr.record(true, &p, t), Some(Health::Ready));
        assert_eq!(pr.failures, 0);
        assert_eq!(pr.next_at, t + p.probe_interval);
    }
}
