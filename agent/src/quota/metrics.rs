//! Quota metrics, from the last pass (a [`Collector`]: read at scrape time, never stale):
//! - `gpuhub_quota_used_gpu_hours{quota,period}` and `gpuhub_quota_limit_gpu_hours{quota,period}`:
//!   GPU-equivalent hours used in the period and the limit in force (top-ups included);
//! - `gpuhub_quota_held{quota}`: 1 while Slurm holds the quota's associations;
//! - `gpuhub_quota_exhausted_timestamp_seconds{quota}`: when the limit is reached at the
//!   period's rate so far, if before the reset (no series otherwise);
//! - `gpuhub_quota_last_pass_timestamp_seconds`: when the last pass ended (no series before
//!   the first; the shipped alert fires when it stops advancing).
//!
//! `quota` is the quota's key (`user:NAME`, `group:NAME`, `account:NAME`): one series per
//! `[[quotas]]` entry, bounded by agent.toml.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;

use super::QuotaStatus;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeriodLabels {
    quota: String,
    period: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuotaLabels {
    quota: String,
}

/// What the last pass saw, shared with [`super::Quotas`].
#[derive(Debug, Default)]
pub struct LastPass {
    pub statuses: Vec<QuotaStatus>,
    pub ended_s: Option<i64>,
}

#[derive(Debug)]
pub struct QuotaMetrics {
    last: Arc<Mutex<LastPass>>,
}

impl QuotaMetrics {
    pub fn new(last: Arc<Mutex<LastPass>>) -> Self {
        Self { last }
    }
}

impl Collector for QuotaMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (statuses, ended_s) = match self.last.lock() {
            Ok(l) => (l.statuses.clone(), l.ended_s),
            Err(p) => (p.get_ref().statuses.clone(), p.get_ref().ended_s),
        };
        type Pick = fn(&QuotaStatus) -> f64;
        let per_period: [(&str, &str, Pick); 2] = [
            ("quota_used_gpu_hours", "GPU-equivalent hours a quota's users used in its period (jobs and inference)", |s| s.used_gpu_hours),
            ("quota_limit_gpu_hours", "A quota's limit in force in its period: agent.toml's or the admin's, plus top-ups", |s| {
                s.limit_gpu_hours
            }),
        ];
        for (name, help, pick) in per_period {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for s in &statuses {
                let labels = PeriodLabels { quota: s.quota.clone(), period: s.period.clone() };
                ConstGauge::new(pick(s)).encode(family.encode_family(&labels)?)?;
            }
        }
        let mut held = encoder.encode_descriptor(
            "quota_held",
            "1 while Slurm holds a used-up quota's associations (new GPU jobs pend with AssocGrpGRES)",
            None,
            MetricType::Gauge,
        )?;
        for s in &statuses {
            ConstGauge::new(i64::from(s.held)).encode(held.encode_family(&QuotaLabels { quota: s.quota.clone() })?)?;
        }
        let mut exhausted = encoder.encode_descriptor(
            "quota_exhausted_timestamp_seconds",
            "When a quota is used up at its period's rate so far, if before it resets",
            None,
            MetricType::Gauge,
        )?;
        for s in &statuses {
            if let Some(t) = s.exhausted_at_s {
                ConstGauge::new(t).encode(exhausted.encode_family(&QuotaLabels { quota: s.quota.clone() })?)?;
            }
        }
        // The descriptor always (the family is known), the sample from the first pass on.
        let family = encoder.encode_descriptor(
            "quota_last_pass_timestamp_seconds",
            "When the last quota pass ended (sums, Slurm holds and releases)",
            None,
            MetricType::Gauge,
        )?;
        if let Some(t) = ended_s {
            ConstGauge::new(t).encode(family)?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    fn status(quota: &str, used: f64, limit: f64, held: bool, exhausted_at_s: Option<i64>) -> QuotaStatus {
        QuotaStatus {
            quota: quota.into(),
            kind: "user".into(),
            name: quota.trim_start_matches("user:").into(),
            period: "month".into(),
            period_start_s: 0,
            resets_s: Some(100),
            used_gpu_hours: used,
            limit_gpu_hours: limit,
            config_gpu_hours: limit,
            admin_gpu_hours: None,
            topup_gpu_hours: 0.0,
            percent: used / limit * 100.0,
            held,
            users: vec![],
            rate_gpu_hours_per_day: 0.0,
            forecast_gpu_hours: 0.0,
            exhausted_at_s,
            note: None,
        }
    }

    #[test]
    fn each_quota_of_the_last_pass_and_nothing_before_it() {
        let last = Arc::new(Mutex::new(LastPass::default()));
        let mut r = Registry::default();
        r.sub_registry_with_prefix("gpuhub").register_collector(Box::new(QuotaMetrics::new(last.clone())));
        let text = |r: &Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, r).unwrap();
            out
        };
        let t = text(&r);
        assert!(!t.contains("gpuhub_quota_used_gpu_hours{"), "no series before the first pass: {t}");
        assert!(!t.lines().any(|l| l.starts_with("gpuhub_quota_last_pass_timestamp_seconds")), "no sample before the first pass: {t}");
        assert!(t.contains("# TYPE gpuhub_quota_last_pass_timestamp_seconds gauge"), "described before the first pass: {t}");

        *last.lock().unwrap() = LastPass {
            statuses: vec![status("user:alice", 12.5, 10.0, true, Some(50)), status("user:bob", 1.0, 10.0, false, None)],
            ended_s: Some(42),
        };
        let t = text(&r);
        for line in [
            "gpuhub_quota_used_gpu_hours{quota=\"user:alice\",period=\"month\"} 12.5",
            "gpuhub_quota_limit_gpu_hours{quota=\"user:alice\",period=\"month\"} 10.0",
            "gpuhub_quota_held{quota=\"user:alice\"} 1",
            "gpuhub_quota_held{quota=\"user:bob\"} 0",
            "gpuhub_quota_exhausted_timestamp_seconds{quota=\"user:alice\"} 50",
            "gpuhub_quota_last_pass_timestamp_seconds 42",
        ] {
            assert!(t.lines().any(|l| l == line), "missing `{line}` in:\n{t}");
        }
        assert!(!t.contains("gpuhub_quota_exhausted_timestamp_seconds{quota=\"user:bob\"}"), "bob is not running out: {t}");
    }
}
