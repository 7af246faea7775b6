//! GPU-seconds from job rows: pure functions, so the arithmetic is tested without a database.
//!
//! A job's time is `[start, end]` from its records (`start` falls back to its first record,
//! `end` to now for a running job), clipped to the query window. Per job:
//! - a shard job (a step reported `SLURM_SHARDS_ON_NODE`): shard-seconds = shards x time, on
//!   its GPU;
//! - otherwise: GPU-seconds = GPUs x time, each GPU its own time;
//! - GPU-equivalent seconds = GPU-seconds + shard-seconds / shards-per-GPU.
//!
//! A job verified against Slurm (`slurm_gpus` set, [`super::reconcile`]) is billed Slurm's
//! whole GPUs and shards instead, whatever its records claimed.
//!
//! Sums are kept in integer microseconds and converted once, so a table and its total agree.
//! An end before the start (a clock that went backwards) counts zero.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::db::{JobGpuRow, JobRow};

/// What `gpuhub usage --by` groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum UsageBy {
    User,
    Account,
    Gpu,
    Partition,
}

impl UsageBy {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageBy::User => "user",
            UsageBy::Account => "account",
            UsageBy::Gpu => "gpu",
            UsageBy::Partition => "partition",
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "user" => Ok(UsageBy::User),
            "account" => Ok(UsageBy::Account),
            "gpu" => Ok(UsageBy::Gpu),
            "partition" => Ok(UsageBy::Partition),
            other => Err(format!("--by `{other}` is not known; use user, account, gpu or partition")),
        }
    }
}

/// One row of `gpuhub usage`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    /// The group's value (user name, account, `gpu<index>`, partition; `-` when unknown).
    pub key: String,
    pub jobs: u64,
    pub gpu_seconds: f64,
    pub shard_seconds: f64,
    pub gpu_equivalent_seconds: f64,
}

#[derive(Default)]
struct Sum {
    jobs: u64,
    gpu_us: i128,
    shard_us: i128,
}

/// Microseconds of `job` inside `[since_us, now_us]`.
pub fn overlap_us(job: &JobRow, since_us: i64, now_us: i64) -> i64 {
    let start = job.start_us.unwrap_or(job.first_seen_us);
    let end = job.end_us.unwrap_or(now_us).min(now_us);
    if end < start {
        return 0;
    }
    (end - start.max(since_us)).max(0)
}

/// Whole GPUs and shards a job is billed for: Slurm's when verified, else its records'.
pub fn billed(job: &JobRow, gpus: &[JobGpuRow]) -> (i64, i64) {
    match job.slurm_gpus {
        Some(g) => (g.max(0), job.shards.max(0)),
        None => super::reconcile::claimed_billing(job, gpus),
    }
}

/// GPU- and shard-microseconds of each (user, account) over the jobs' whole lives up to
/// `now_us` (running jobs count until now), billed as [`aggregate`] bills them. The key is the
/// user's name (the uid when the name is unknown) and the account (`""` when none): the
/// `gpuhub_slurm_gpu_seconds_total` counters' labels.
pub fn totals_by_user_account(jobs: &[(JobRow, Vec<JobGpuRow>)], now_us: i64) -> BTreeMap<(String, String), (i128, i128)> {
    let mut out: BTreeMap<(String, String), (i128, i128)> = BTreeMap::new();
    for (job, gpus) in jobs {
        let t = i128::from(overlap_us(job, i64::MIN, now_us));
        let (whole, shards) = billed(job, gpus);
        let user = if job.user_name.is_empty() { job.uid.to_string() } else { job.user_name.clone() };
        let e = out.entry((user, job.account.clone().unwrap_or_default())).or_default();
        e.0 += i128::from(whole) * t;
        e.1 += i128::from(shards) * t;
    }
    out
}

/// Groups the jobs' usage by `by`; rows sorted by GPU-equivalent seconds, largest first.
pub fn aggregate(jobs: &[(JobRow, Vec<JobGpuRow>)], by: UsageBy, since_us: i64, now_us: i64, shards_per_gpu: u32) -> Vec<UsageRow> {
    let mut sums: BTreeMap<String, Sum> = BTreeMap::new();
    let dash = |s: &Option<String>| s.clone().filter(|v| !v.is_empty()).unwrap_or_else(|| "-".into());
    for (job, gpus) in jobs {
        let t = i128::from(overlap_us(job, since_us, now_us));
        let shard_job = job.shards > 0;
        match by {
            UsageBy::Gpu if job.slurm_gpus.is_some() => {
                let (whole, shards) = billed(job, gpus);
                if gpus.iter().any(|g| g.shards.is_some()) {
                    // Slurm's GPU indices, with the shards held on each.
                    for g in gpus {
                        let s = sums.entry(format!("gpu{}", g.gpu_index)).or_default();
                        s.jobs += 1;
                        match g.shards {
                            Some(n) if n > 0 => s.shard_us += i128::from(n) * t,
                            _ => s.gpu_us += t,
                        }
                    }
                } else {
                    // Counts without indices (sacct): shards on the first GPU the records name,
                    // whole GPUs on the others; what no record names is `gpu?`.
                    let mut rows = gpus.iter();
                    if shards > 0 {
                        let key = rows.next().map_or_else(|| "gpu?".to_string(), |g| format!("gpu{}", g.gpu_index));
                        let s = sums.entry(key).or_default();
                        s.jobs += 1;
                        s.shard_us += i128::from(shards) * t;
                    }
                    let mut left = whole;
                    for g in rows.take(usize::try_from(whole).unwrap_or(0)) {
                        let s = sums.entry(format!("gpu{}", g.gpu_index)).or_default();
                        s.jobs += 1;
                        s.gpu_us += t;
                        left -= 1;
                    }
                    if left > 0 {
                        let s = sums.entry("gpu?".into()).or_default();
                        s.jobs += 1;
                        s.gpu_us += i128::from(left) * t;
                    }
                }
            }
            UsageBy::Gpu => {
                for (i, g) in gpus.iter().enumerate() {
                    let s = sums.entry(format!("gpu{}", g.gpu_index)).or_default();
                    s.jobs += 1;
                    if shard_job {
                        // A job's shards sit on one GPU: count them once, on its first GPU.
                        if i == 0 {
                            s.shard_us += i128::from(job.shards) * t;
                        }
                    } else {
                        s.gpu_us += t;
                    }
                }
            }
            _ => {
                let key = match by {
                    UsageBy::User => {
                        if job.user_name.is_empty() {
                            job.uid.to_string()
                        } else {
                            job.user_name.clone()
                        }
                    }
                    UsageBy::Account => dash(&job.account),
                    UsageBy::Partition => dash(&job.partition),
                    UsageBy::Gpu => String::new(),
                };
                let s = sums.entry(key).or_default();
                s.jobs += 1;
                let (whole, shards) = billed(job, gpus);
                s.gpu_us += i128::from(whole) * t;
                s.shard_us += i128::from(shards) * t;
            }
        }
    }
    let spg = i128::from(shards_per_gpu.max(1));
    let mut rows: Vec<UsageRow> = sums
        .into_iter()
        .map(|(key, s)| UsageRow {
            key,
            jobs: s.jobs,
            gpu_seconds: s.gpu_us as f64 / 1e6,
            shard_seconds: s.shard_us as f64 / 1e6,
            gpu_equivalent_seconds: (s.gpu_us as f64 + s.shard_us as f64 / spg as f64) / 1e6,
        })
        .collect();
    rows.sort_by(|a, b| b.gpu_equivalent_seconds.total_cmp(&a.gpu_equivalent_seconds).then(a.key.cmp(&b.key)));
    rows
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn job(id: i64, user: &str, start: Option<i64>, end: Option<i64>, shards: i64) -> JobRow {
        JobRow {
            node: "gpu01".into(),
            job_id: id,
            run: 0,
            uid: 1000,
            user_name: user.into(),
            account: Some("acct".into()),
            partition: Some("gpu".into()),
            start_us: start,
            end_us: end,
            first_seen_us: start.unwrap_or(0),
            last_seen_us: end.unwrap_or(0),
            exit_code: None,
            end_reason: None,
            shards,
            anomalies: String::new(),
            verified: String::new(),
            slurm_gpus: None,
            slurm_start_us: None,
            slurm_end_us: None,
        }
    }

    fn gpus(id: i64, idx: &[i64]) -> Vec<JobGpuRow> {
        idx.iter()
            .map(|i| JobGpuRow {
                node: "gpu01".into(),
                job_id: id,
                run: 0,
                gpu_index: *i,
                gpu_uuid: None,
                mean_util: None,
                peak_vram_bytes: None,
                energy_joules: None,
                samples: None,
                shards: None,
            })
            .collect()
    }

    #[test]
    fn whole_gpus_shards_and_cpu_jobs() {
        let s = 1_000_000;
        let jobs = vec![
            (job(1, "alice", Some(0), Some(10 * s), 0), gpus(1, &[0])),
            (job(2, "alice", Some(0), Some(5 * s), 0), gpus(2, &[0, 1])),
            (job(3, "bob", Some(0), Some(4 * s), 7), gpus(3, &[1])),
            (job(4, "bob", Some(0), Some(100 * s), 0), vec![]),
        ];
        let rows = aggregate(&jobs, UsageBy::User, 0, 1000 * s, 14);
        let alice = rows.iter().find(|r| r.key == "alice").unwrap();
        assert_eq!((alice.jobs, alice.gpu_seconds, alice.shard_seconds), (2, 20.0, 0.0));
        let bob = rows.iter().find(|r| r.key == "bob").unwrap();
        assert_eq!((bob.jobs, bob.gpu_seconds, bob.shard_seconds, bob.gpu_equivalent_seconds), (2, 0.0, 28.0, 2.0));
        let by_gpu = aggregate(&jobs, UsageBy::Gpu, 0, 1000 * s, 14);
        let g0 = by_gpu.iter().find(|r| r.key == "gpu0").unwrap();
        let g1 = by_gpu.iter().find(|r| r.key == "gpu1").unwrap();
        assert_eq!((g0.gpu_seconds, g1.gpu_seconds, g1.shard_seconds), (15.0, 5.0, 28.0));
    }

    #[test]
    fn window_clipping_running_jobs_and_backwards_clocks() {
        let s = 1_000_000;
        let jobs = vec![
            (job(1, "a", Some(0), Some(10 * s), 0), gpus(1, &[0])),
            (job(2, "a", Some(8 * s), None, 0), gpus(2, &[1])),
            (job(3, "a", Some(10 * s), Some(2 * s), 0), gpus(3, &[0])),
        ];
        let rows = aggregate(&jobs, UsageBy::Account, 5 * s, 20 * s, 14);
        assert_eq!(rows[0].gpu_seconds, 5.0 + 12.0, "job 1 clipped to 5 s, job 2 running 12 s, job 3 zero");
        assert_eq!(rows[0].jobs, 3);
    }

    #[test]
    fn verified_jobs_bill_slurms_allocation() {
        let s = 1_000_000;
        // The records claim 1 shard on a gpu:2 job (SLURM_SHARDS_ON_NODE pre-set); Slurm: 2 GPUs.
        let mut j = job(1, "a", Some(0), Some(3 * s), 1);
        let claimed = vec![(j.clone(), gpus(1, &[0, 1]))];
        let rows = aggregate(&claimed, UsageBy::User, 0, 10 * s, 14);
        assert_eq!((rows[0].gpu_seconds, rows[0].shard_seconds), (0.0, 3.0), "unverified: the claim");
        j.slurm_gpus = Some(2);
        j.shards = 0;
        let verified = vec![(j.clone(), gpus(1, &[0]))];
        let rows = aggregate(&verified, UsageBy::User, 0, 10 * s, 14);
        assert_eq!((rows[0].gpu_seconds, rows[0].shard_seconds), (6.0, 0.0), "verified: Slurm's 2 GPUs");
        let by_gpu = aggregate(&verified, UsageBy::Gpu, 0, 10 * s, 14);
        let total: f64 = by_gpu.iter().map(|r| r.gpu_seconds).sum();
        assert_eq!(total, 6.0, "sacct counts without indices: the unnamed GPU is gpu? ({by_gpu:?})");
        // With indices and shards per GPU.
        j.slurm_gpus = Some(0);
        j.shards = 7;
        let mut g = gpus(1, &[1]);
        g[0].shards = Some(7);
        let rows = aggregate(&[(j.clone(), g.clone())], UsageBy::Gpu, 0, 10 * s, 14);
        assert_eq!((rows[0].key.as_str(), rows[0].shard_seconds), ("gpu1", 21.0));
        let rows = aggregate(&[(j, Vec::new())], UsageBy::Account, 0, 10 * s, 14);
        assert_eq!(rows[0].shard_seconds, 21.0, "a verified shard job without GPU rows still bills its shards");
    }

    #[test]
    fn totals_per_user_and_account_over_whole_lives() {
        let s = 1_000_000;
        let mut running = job(3, "alice", Some(90 * s), None, 0);
        running.account = None;
        let jobs = vec![
            (job(1, "alice", Some(0), Some(10 * s), 0), gpus(1, &[0, 1])),
            (job(2, "bob", Some(0), Some(4 * s), 7), gpus(2, &[1])),
            (running, gpus(3, &[0])),
        ];
        let t = totals_by_user_account(&jobs, 100 * s);
        assert_eq!(t[&("alice".to_string(), "acct".to_string())], (20 * s as i128, 0));
        assert_eq!(t[&("bob".to_string(), "acct".to_string())], (0, 28 * s as i128));
        assert_eq!(t[&("alice".to_string(), String::new())], (10 * s as i128, 0), "a running job counts until now");
        // The same as `gpuhub usage` over all time.
        let by_user = aggregate(&jobs, UsageBy::User, 0, 100 * s, 14);
        let alice: i128 = t.iter().filter(|((u, _), _)| u == "alice").map(|(_, v)| v.0).sum();
        assert_eq!(alice as f64 / 1e6, by_user.iter().find(|r| r.key == "alice").unwrap().gpu_seconds);
    }

    #[test]
    fn by_parses_and_says_what_is_known() {
        assert_eq!(UsageBy::parse("gpu"), Ok(UsageBy::Gpu));
        assert!(UsageBy::parse("node").unwrap_err().contains("user, account, gpu or partition"));
    }
}
