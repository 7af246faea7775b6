//! GPU-hour quotas (`[[quotas]]`, docs/quotas.md): counted by gpuhub, enforced by Slurm.
//!
//! Every `accounting.quota_interval_ms` (and at once after `gpuhub quota grant` or `set`) a
//! pass sums each quota's GPU-equivalent hours over its period from the store (jobs, plus the
//! caller's share of model workers), adds the admin's limit and top-ups, and then:
//! - holds in Slurm every association a used-up quota covers, and releases the ones that are
//!   no longer over ([`slurm`]: `GrpTRES` GPU limits, so Slurm keeps new jobs pending and
//!   never stops running ones); what it holds is kept in the store, so a restart releases
//!   exactly what gpuhub held;
//! - words a line per user at 80 % or more for the snapshot, which srun, sbatch and salloc
//!   print through the plugin (no network in the plugin).
//!
//! Parts: [`usage`] (periods, sums, wording), [`slurm`] (sacctmgr), [`api`] (control socket),
//! [`cli`] (`gpuhub quota`), [`metrics`] (Prometheus, from the last pass).

pub mod api;
pub mod cli;
pub mod metrics;
pub mod slurm;
pub mod usage;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use serde::Serialize;

use crate::AppState;
use crate::config::{QuotaConfig, QuotaTarget};
use crate::store::StoreError;

/// One quota as the last pass saw it (`GET /v1/quota`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QuotaStatus {
    pub quota: String,
    pub kind: String,
    pub name: String,
    pub period: String,
    pub period_start_s: i64,
    /// When a month's quota resets; `null` for a rolling window.
    pub resets_s: Option<i64>,
    pub used_gpu_hours: f64,
    /// The limit in force: the admin's (`gpuhub quota set`) or agent.toml's, plus top-ups.
    pub limit_gpu_hours: f64,
    pub config_gpu_hours: f64,
    pub admin_gpu_hours: Option<f64>,
    pub topup_gpu_hours: f64,
    pub percent: f64,
    /// Slurm holds its associations (new GPU jobs pend with `AssocGrpGRES`).
    pub held: bool,
    /// Users it covers (a group's members; an account's users seen in the period).
    pub users: Vec<String>,
    /// GPU-hours per day at the period's rate so far.
    pub rate_gpu_hours_per_day: f64,
    /// Hours used by the period's end at that rate (a month); for a rolling window, the
    /// window's usage at that rate.
    pub forecast_gpu_hours: f64,
    /// When the limit is reached at that rate, if before the reset (Unix seconds).
    pub exhausted_at_s: Option<i64>,
    /// The line srun/sbatch/salloc print for its users (`null` under 80 %).
    pub note: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum QuotaError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("store query failed: {0}")]
    Query(#[from] sqlx::Error),
}

/// The quota engine's state: one pass at a time, the last statuses, the lines for the
/// snapshot.
pub struct Quotas {
    sacctmgr: slurm::Sacctmgr,
    pass_lock: tokio::sync::Mutex<bool>,
    notes: Mutex<BTreeMap<u32, String>>,
    last: Arc<Mutex<metrics::LastPass>>,
    /// Live worker jobs' callers, kept between passes.
    live: crate::accounting::live_callers::LiveCallers,
}

impl Quotas {
    pub fn new(sacctmgr: slurm::Sacctmgr) -> Self {
        Quotas {
            sacctmgr,
            pass_lock: tokio::sync::Mutex::new(false),
            notes: Mutex::new(BTreeMap::new()),
            last: Arc::default(),
            live: Default::default(),
        }
    }

    /// The Prometheus collector of the last pass (register it once).
    pub fn metrics(&self) -> metrics::QuotaMetrics {
        metrics::QuotaMetrics::new(self.last.clone())
    }

    /// uid -> line for the snapshot.
    pub fn notes(&self) -> BTreeMap<u32, String> {
        self.notes.lock().map(|n| n.clone()).unwrap_or_default()
    }

    /// The last pass's statuses.
    pub fn statuses(&self) -> Vec<QuotaStatus> {
        self.last.lock().map(|l| l.statuses.clone()).unwrap_or_default()
    }

    /// Runs passes until shutdown.
    pub async fn run(state: AppState, interval: std::time::Duration, shutdown: tokio_util::sync::CancellationToken) {
        if state.config.file.quotas.is_empty() && state.store.quota_holds().await.map(|h| h.is_empty()).unwrap_or(false) {
            tracing::info!("quotas: none in agent.toml and none held in Slurm; the quota pass is off");
            return;
        }
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if let Err(e) = state.quotas.pass(&state).await {
                        tracing::error!(error = %e, "quotas: pass failed; Slurm's limits stay as they were");
                    }
                }
                _ = shutdown.cancelled() => return,
            }
        }
    }

    /// One pass: sums, holds/releases in Slurm, notes, snapshot.
    pub async fn pass(&self, state: &AppState) -> Result<Vec<QuotaStatus>, QuotaError> {
        let mut first = self.pass_lock.lock().await;
        let cfg = &state.config.file;
        let now_us = crate::util::now_us();
        let now_s = now_us / 1_000_000;
        let spg = cfg.accounting.shards_per_gpu;
        let admin_limits = state.store.quota_limits().await?;
        let topups = state.store.quota_topups(now_us).await?;
        // Live worker jobs' callers are read from the hourly rollup (accounting::live_callers).
        state.store.fold_rollups().await?;
        let mut by_since: BTreeMap<i64, usage::Usage> = BTreeMap::new();
        let mut statuses = Vec::new();
        let mut want: BTreeMap<(String, String), String> = BTreeMap::new();
        let mut notes: BTreeMap<u32, (f64, String)> = BTreeMap::new();
        for q in &cfg.quotas {
            let (start_s, resets_s) = usage::period_bounds(q.period, now_s);
            let since_us = start_s * 1_000_000;
            let u = match by_since.get(&since_us) {
                Some(u) => u.clone(),
                None => {
                    let u = usage::usage_since(state.store.pool(), since_us, now_us, spg, Some(&self.live)).await?;
                    by_since.insert(since_us, u.clone());
                    u
                }
            };
            let key = q.target.key();
            let users = covered_users(&q.target, &u);
            let used_us = match &q.target {
                QuotaTarget::Account(a) => u.per_account.get(a).copied().unwrap_or(0),
                _ => users.iter().map(|n| u.per_user.get(n).copied().unwrap_or(0)).sum(),
            };
            let config_us = (q.gpu_hours * usage::HOUR_US as f64).round() as i64;
            let admin_us = admin_limits.get(&key).copied();
            let topup_us: i64 = topups.iter().filter(|t| t.target == key).map(|t| t.amount_us).sum();
            let limit_us = admin_us.unwrap_or(config_us).saturating_add(topup_us);
            let held = used_us >= limit_us;
            if held {
                match &q.target {
                    QuotaTarget::Account(a) => {
                        want.insert(("account".into(), a.clone()), key.clone());
                    }
                    _ => {
                        for n in &users {
                            want.insert(("user".into(), n.clone()), key.clone());
                        }
                    }
                }
            }
            let note = usage::note(&q.target, q.period, used_us, limit_us, resets_s);
            let pct = usage::percent(used_us, limit_us);
            if let Some(n) = &note {
                for user in &users {
                    if let Some(uid) = crate::control::peer::uid_of(user) {
                        let e = notes.entry(uid).or_insert((-1.0, String::new()));
                        if pct > e.0 {
                            *e = (pct, n.clone());
                        }
                    }
                }
            }
            statuses.push(status(q, &key, start_s, resets_s, now_s, used_us, limit_us, config_us, admin_us, topup_us, held, users, note));
        }
        self.live.sweep();
        self.apply(state, &want, *first).await;
        *first = false;
        let notes: BTreeMap<u32, String> = notes.into_iter().map(|(k, (_, n))| (k, n)).collect();
        let changed = self.notes.lock().map(|mut n| std::mem::replace(&mut *n, notes.clone()) != notes).unwrap_or(false);
        if let Ok(mut l) = self.last.lock() {
            *l = metrics::LastPass { statuses: statuses.clone(), ended_s: Some(crate::util::now_us() / 1_000_000) };
        }
        if changed && let Err(e) = crate::snapshot::write(state) {
            tracing::error!(error = %e, "quotas: cannot write the snapshot; srun/sbatch show the previous quota lines");
        }
        Ok(statuses)
    }

    /// Brings Slurm in step with `want` ((kind, name) -> quota): holds what is wanted and not
    /// held, releases what is held and no longer wanted; after a restart (`reassert`) it
    /// sets every wanted hold again, in case someone changed it in slurmdbd meanwhile.
    async fn apply(&self, state: &AppState, want: &BTreeMap<(String, String), String>, reassert: bool) {
        let held: BTreeMap<(String, String), String> = match state.store.quota_holds().await {
            Ok(h) => h.into_iter().map(|h| ((h.kind, h.name), h.quota)).collect(),
            Err(e) => {
                tracing::error!(error = %e, "quotas: cannot read the holds from the store; Slurm's limits stay as they were");
                return;
            }
        };
        for ((kind, name), quota) in want {
            if held.contains_key(&(kind.clone(), name.clone())) && !reassert {
                continue;
            }
            // Recorded first: a hold Slurm has must be one the store lists, or no later pass
            // would release it (the releases go by the store's list).
            if let Err(e) = state.store.add_quota_hold(kind, name, quota, crate::util::now_us()).await {
                tracing::error!(error = %e, kind = %kind, name = %name, "quotas: cannot record a hold in the store; not holding in Slurm (the next pass tries again)");
                continue;
            }
            match self.sacctmgr.set(kind, name, true).await {
                Ok(()) => {
                    tracing::info!(kind = %kind, name = %name, quota = %quota, "quotas: held in Slurm (GrpTRES {}); new GPU jobs pend with {}", slurm::HOLD_TRES, slurm::HELD_REASON);
                }
                Err(e) => {
                    tracing::error!(kind = %kind, name = %name, quota = %quota, error = %e, "quotas: cannot hold the association");
                    if !held.contains_key(&(kind.clone(), name.clone()))
                        && let Err(e) = state.store.remove_quota_hold(kind, name).await
                    {
                        tracing::error!(error = %e, kind = %kind, name = %name, "quotas: the store lists a hold Slurm does not have; the agent's next restart sets it");
                    }
                }
            }
        }
        for (kind, name) in held.keys() {
            if want.contains_key(&(kind.clone(), name.clone())) {
                continue;
            }
            match self.sacctmgr.set(kind, name, false).await {
                Ok(()) => {
                    tracing::info!(kind = %kind, name = %name, "quotas: released in Slurm (GrpTRES {}); pending GPU jobs may start", slurm::RELEASE_TRES);
                    if let Err(e) = state.store.remove_quota_hold(kind, name).await {
                        tracing::error!(error = %e, "quotas: released in Slurm but the store still lists the hold; the next pass releases it again");
                    }
                }
                Err(e) => tracing::error!(kind = %kind, name = %name, error = %e, "quotas: cannot release the association"),
            }
        }
    }
}

/// The users a quota covers: the user; a group's members (listed in the group, or with it as
/// their primary group among the users with usage); an account's users with usage.
fn covered_users(target: &QuotaTarget, u: &usage::Usage) -> Vec<String> {
    match target {
        QuotaTarget::User(n) => vec![n.clone()],
        QuotaTarget::Group(g) => {
            let mut out: BTreeSet<String> = BTreeSet::new();
            if let Some((gid, members)) = group_of(g) {
                out.extend(members);
                out.extend(u.per_user.keys().filter(|n| primary_gid(n) == Some(gid)).cloned());
            }
            out.into_iter().collect()
        }
        QuotaTarget::Account(_) => Vec::new(),
    }
}

#[allow(clippy::too_many_arguments)]
fn status(
    q: &QuotaConfig,
    key: &str,
    start_s: i64,
    resets_s: Option<i64>,
    now_s: i64,
    used_us: i64,
    limit_us: i64,
    config_us: i64,
    admin_us: Option<i64>,
    topup_us: i64,
    held: bool,
    users: Vec<String>,
    note: Option<String>,
) -> QuotaStatus {
    let h = |us: i64| us as f64 / usage::HOUR_US as f64;
    let elapsed_s = (now_s - start_s).max(1);
    let rate_per_s = h(used_us) / elapsed_s as f64;
    let horizon_s = resets_s.map_or(elapsed_s, |r| r - start_s);
    let forecast = rate_per_s * horizon_s as f64;
    let exhausted_at_s = if used_us >= limit_us {
        Some(now_s)
    } else if rate_per_s > 0.0 {
        let t = now_s + ((h(limit_us) - h(used_us)) / rate_per_s) as i64;
        if resets_s.is_none_or(|r| t < r) && forecast >= h(limit_us) { Some(t) } else { None }
    } else {
        None
    };
    QuotaStatus {
        quota: key.to_string(),
        kind: q.target.kind().into(),
        name: q.target.name().into(),
        period: q.period.as_string(),
        period_start_s: start_s,
        resets_s,
        used_gpu_hours: h(used_us),
        limit_gpu_hours: h(limit_us),
        config_gpu_hours: h(config_us),
        admin_gpu_hours: admin_us.map(h),
        topup_gpu_hours: h(topup_us),
        percent: usage::percent(used_us, limit_us),
        held,
        users,
        rate_gpu_hours_per_day: rate_per_s * 86_400.0,
        forecast_gpu_hours: forecast,
        exhausted_at_s,
        note,
    }
}

/// A group's gid and listed members (getgrnam_r).
fn group_of(name: &str) -> Option<(u32, Vec<String>)> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 65536];
    // SAFETY: an all-zero `group` is a valid value for getgrnam_r to fill.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: buffers are valid for the given lengths.
    let rc = unsafe { libc::getgrnam_r(cname.as_ptr(), &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        return None;
    }
    let mut members = Vec::new();
    let mut p = grp.gr_mem;
    // SAFETY: gr_mem is a NULL-terminated array of C strings inside buf.
    unsafe {
        while !p.is_null() && !(*p).is_null() {
            members.push(std::ffi::CStr::from_ptr(*p).to_string_lossy().into_owned());
            p = p.add(1);
        }
    }
    Some((grp.gr_gid, members))
}

/// A user's primary gid.
fn primary_gid(name: &str) -> Option<u32> {
    crate::control::peer::ids_of(name).map(|(_, gid)| gid)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::QuotaPeriod;

    #[test]
    fn forecast_at_the_current_rate() {
        let q = QuotaConfig::new(QuotaTarget::User("a".into()), 300.0, QuotaPeriod::Month);
        // 10 days into a 30-day month, 100 GPU-h used: 10 a day, 300 by the end, reached on day 30.
        let day = 86_400;
        let s = status(
            &q,
            "user:a",
            0,
            Some(30 * day),
            10 * day,
            100 * usage::HOUR_US,
            250 * usage::HOUR_US,
            300 * usage::HOUR_US,
            Some(250 * usage::HOUR_US),
            0,
            false,
            vec![],
            None,
        );
        assert!((s.rate_gpu_hours_per_day - 10.0).abs() < 1e-9, "{s:?}");
        assert!((s.forecast_gpu_hours - 300.0).abs() < 1e-9);
        assert_eq!(s.exhausted_at_s, Some(25 * day), "250 h at 10 a day");
        assert_eq!(s.admin_gpu_hours, Some(250.0));
        let s =
            status(&q, "user:a", 0, Some(30 * day), 10 * day, 10 * usage::HOUR_US, 250 * usage::HOUR_US, 0, None, 0, false, vec![], None);
        assert_eq!(s.exhausted_at_s, None, "1 a day never reaches 250 this month");
    }

    #[test]
    fn root_is_in_its_own_group() {
        let (gid, _) = group_of("root").unwrap();
        assert_eq!(gid, 0);
        assert_eq!(primary_gid("root"), Some(0));
        let u = usage::Usage { per_user: BTreeMap::from([("root".into(), 1)]), ..Default::default() };
        assert_eq!(covered_users(&QuotaTarget::Group("root".into()), &u), vec!["root".to_string()]);
        assert!(covered_users(&QuotaTarget::Group("no-such-group-xyz".into()), &u).is_empty());
    }
}
