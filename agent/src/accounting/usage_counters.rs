//! GPU-hours counters from the store: `gpuhub_slurm_gpu_seconds_total{user,account}` and
//! `gpuhub_slurm_shard_seconds_total{user,account}`, the whole-GPU and shard seconds this node's
//! jobs were billed (Slurm's allocation when verified, [`super::usage::billed`]), over every
//! job the store holds, running jobs up to now. The same arithmetic as `gpuhub usage`, so the
//! counters and the table agree; nothing is sampled.
//!
//! Monotone across restarts: each pass exports `max(what was exported before, the store's
//! total)` per user and account, and keeps those high-water marks in the store's settings
//! (`usage_counters`), so a restarted agent goes on from where it stopped instead of making
//! Prometheus see a counter reset. A total can only fall when the store corrects itself (a
//! running job's end recorded a few seconds before the pass that had counted up to "now", or a
//! job's claim replaced by Slurm's smaller allocation); the counter then holds until the total
//! passes it again.
//!
//! Cost: jobs that ended more than [`WINDOW`] before are summed once an hour ("settled"), read
//! in pages of [`PAGE`] jobs; every pass reads only the open and recently ended ones. A job
//! closed with an end older than the window between two full passes is counted at the next
//! one. Only jobs of this node (`telemetry.slurm_node_name`) count, so several agents sharing
//! one PostgreSQL store each export their own node's.
//!
//! Each pass first splits the worker jobs that ended among their callers
//! ([`super::inference::settle`]), then exports `gpuhub_inference_gpu_seconds_total{user,app,model}`
//! and `gpuhub_inference_shard_seconds_total{user,app,model}`: this node's stored shares, which
//! never change once stored, so their sums only grow (restarts included).
//!
//! Every pass is also a store health probe: `gpuhub_store_up` is 1 when its queries answered.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use super::db;
use super::usage::totals_by_user_account;
use crate::store::Store;
use crate::telemetry::metrics::{InferenceLabels, UserAccountLabels};

/// Jobs that ended longer ago than this are summed only in the hourly full pass.
pub const WINDOW: Duration = Duration::from_secs(2 * 24 * 3600);
/// How often the settled part is summed again.
pub const FULL_EVERY: Duration = Duration::from_secs(3600);
/// Jobs read per query in the full pass.
pub const PAGE: i64 = 2000;
/// The store setting holding the high-water marks.
pub const SETTING: &str = "usage_counters";

type Key = (String, String);
/// Microseconds per (user, account): (whole GPUs, shards).
type Totals = BTreeMap<Key, (i128, i128)>;

/// The counters' handles (registered by [`super::AccountingMetrics`]).
#[derive(Clone, Debug, Default)]
pub struct UsageCounterMetrics {
    pub gpu_seconds: Family<UserAccountLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub shard_seconds: Family<UserAccountLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub inference_gpu_seconds: Family<InferenceLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub inference_shard_seconds: Family<InferenceLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub store_up: Gauge,
}

/// The task's state.
#[derive(Debug)]
pub struct UsageCounters {
    store: Store,
    node: String,
    metrics: UsageCounterMetrics,
    /// What has been exported (and persisted), microseconds.
    exported: Totals,
    settled: Totals,
    cutoff_us: i64,
    last_full: Option<Instant>,
    was_up: Option<bool>,
}

impl UsageCounters {
    pub fn new(store: Store, node: impl Into<String>, metrics: UsageCounterMetrics) -> Self {
        Self {
            store,
            node: node.into(),
            metrics,
            exported: Totals::new(),
            settled: Totals::new(),
            cutoff_us: 0,
            last_full: None,
            was_up: None,
        }
    }

    /// Runs until `shutdown`: one pass at once, then every `interval`.
    pub async fn run(mut self, interval: Duration, shutdown: CancellationToken) {
        self.load().await;
        loop {
            self.pass().await;
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
    }

    /// Restores the high-water marks of the previous run (a missing or unreadable setting:
    /// start from the store's totals, logged).
    pub async fn load(&mut self) {
        match self.store.get_setting(SETTING).await {
            Ok(Some(text)) => match parse(&text) {
                Some(t) => {
                    self.exported = t;
                    self.publish();
                }
                None => tracing::warn!("accounting: the stored usage counters ({SETTING}) do not parse; starting from the store's totals"),
            },
            Ok(None) => {}
            Err(e) => tracing::warn!("accounting: cannot read the usage counters from the store: {e}; starting from the store's totals"),
        }
    }

    /// One pass: sum, raise the counters, persist. A store error leaves the counters as they
    /// are and sets `gpuhub_store_up 0`.
    pub async fn pass(&mut self) {
        let inference_ok = self.inference().await;
        let ok = self.slurm().await && inference_ok;
        if ok && self.was_up == Some(false) {
            tracing::info!("accounting: the store answers again");
        }
        self.was_up = Some(ok);
        self.metrics.store_up.set(i64::from(ok));
    }

    /// Splits the worker jobs that ended, then raises the inference counters to the stored
    /// shares' sums. `false` when the store failed.
    async fn inference(&mut self) -> bool {
        let pool = self.store.pool();
        let r = async {
            super::inference::settle(pool, &self.node, crate::util::now_us()).await?;
            super::inference::node_totals(pool, &self.node).await
        }
        .await;
        match r {
            Ok(totals) => {
                for ((user, app, model), (g, s)) in totals {
                    let l = InferenceLabels { user, app, model };
                    raise(&self.metrics.inference_gpu_seconds.get_or_create(&l), i128::from(g));
                    raise(&self.metrics.inference_shard_seconds.get_or_create(&l), i128::from(s));
                }
                true
            }
            Err(e) => {
                if self.was_up != Some(false) {
                    tracing::error!(
                        "accounting: cannot split worker jobs among their callers, the store does not answer ({e}); retried next pass"
                    );
                }
                false
            }
        }
    }

    /// The Slurm GPU-hours counters; `false` when the store failed.
    async fn slurm(&mut self) -> bool {
        match self.totals().await {
            Ok(totals) => {
                let mut changed = false;
                for (k, (g, s)) in totals {
                    let e = self.exported.entry(k).or_default();
                    if g > e.0 || s > e.1 {
                        *e = (e.0.max(g), e.1.max(s));
                        changed = true;
                    }
                }
                self.publish();
                if changed && let Err(e) = self.store.set_setting(SETTING, &render(&self.exported)).await {
                    tracing::warn!("accounting: cannot keep the usage counters in the store: {e} (retried next pass)");
                }
                true
            }
            Err(e) => {
                if self.was_up != Some(false) {
                    tracing::error!(
                        "accounting: the store does not answer ({e}); GPU-hours counters hold their values, gpuhub_store_up 0 (`gpuhub doctor`)"
                    );
                }
                false
            }
        }
    }

    /// The store's totals per (user, account) now.
    async fn totals(&mut self) -> Result<Totals, sqlx::Error> {
        let pool = self.store.pool();
        let now = crate::util::now_us();
        if self.last_full.is_none_or(|t| t.elapsed() >= FULL_EVERY) {
            let cutoff = now.saturating_sub(i64::try_from(WINDOW.as_micros()).unwrap_or(i64::MAX));
            let mut settled = Totals::new();
            let mut after = (i64::MIN, i64::MIN);
            loop {
                let page = db::node_jobs_ended_before(pool, &self.node, cutoff, after, PAGE).await?;
                let Some(last) = page.last().map(|(j, _)| (j.job_id, j.run)) else { break };
                add(&mut settled, totals_by_user_account(&page, now));
                after = last;
                if (page.len() as i64) < PAGE {
                    break;
                }
            }
            (self.settled, self.cutoff_us, self.last_full) = (settled, cutoff, Some(Instant::now()));
        }
        let recent: Vec<_> = db::jobs_since(pool, self.cutoff_us, None).await?.into_iter().filter(|(j, _)| j.node == self.node).collect();
        let mut totals = self.settled.clone();
        add(&mut totals, totals_by_user_account(&recent, now));
        Ok(totals)
    }

    /// Sets every counter to its exported value (they only ever go up).
    fn publish(&self) {
        for ((user, account), (g, s)) in &self.exported {
            let l = UserAccountLabels { user: user.clone(), account: account.clone() };
            raise(&self.metrics.gpu_seconds.get_or_create(&l), *g);
            raise(&self.metrics.shard_seconds.get_or_create(&l), *s);
        }
    }
}

fn add(into: &mut Totals, more: Totals) {
    for (k, (g, s)) in more {
        let e = into.entry(k).or_default();
        e.0 += g;
        e.1 += s;
    }
}

/// Raises a counter to `us` microseconds (as seconds) if it is below.
fn raise(c: &Counter<f64, std::sync::atomic::AtomicU64>, us: i128) {
    let want = us as f64 / 1e6;
    let have = c.get();
    if want > have {
        c.inc_by(want - have);
    }
}

/// The setting's text: one JSON array of `[user, account, gpu_us, shard_us]`.
fn render(t: &Totals) -> String {
    let rows: Vec<serde_json::Value> = t.iter().map(|((u, a), (g, s))| serde_json::json!([u, a, g.to_string(), s.to_string()])).collect();
    serde_json::Value::Array(rows).to_string()
}

fn parse(text: &str) -> Option<Totals> {
    let rows: Vec<(String, String, String, String)> = serde_json::from_str(text).ok()?;
    rows.into_iter().map(|(u, a, g, s)| Some(((u, a), (g.parse().ok()?, s.parse().ok()?)))).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_setting_round_trips() {
        let t = Totals::from([(("alice".into(), "".into()), (12, 0)), (("b \"q\"".into(), "x".into()), (i128::from(i64::MAX) * 4, 7))]);
        assert_eq!(parse(&render(&t)), Some(t));
        assert_eq!(parse("{not json"), None);
        assert_eq!(parse("[[\"a\",\"b\",\"x\",\"1\"]]"), None);
    }
}
