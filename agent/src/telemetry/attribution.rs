//! PID -> Slurm job: which job a GPU process belongs to.
//!
//! Order of evidence, first that answers wins:
//! 1. `/proc/<pid>/environ`: `SLURM_JOB_ID`, `SLURM_JOB_USER`, `SLURM_SHARDS_ON_NODE` (Slurm
//!    sets them in every task; children inherit them). This is what CEEMS does, and it is the
//!    only place a shard count is visible per process.
//! 2. `/proc/<pid>/cgroup`: `.../job_<id>/...` (task/cgroup, v1 and v2), for a process that
//!    cleared its environment. The user then comes from the process's uid.
//!
//! Results are cached per PID together with the process start time (field 22 of
//! `/proc/<pid>/stat`), so a reused PID is attributed afresh. A PID that vanished between
//! NVML's list and the read is "unattributed" for that sample, never an error.
//! Reading another user's `environ` needs root (the agent runs as root); as another user only
//! the user's own processes are attributed, the rest through their cgroup.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// The Slurm job a process belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobRef {
    pub job_id: u32,
    /// User name; empty when neither the environment nor the uid database tells.
    pub user: String,
    /// `SLURM_SHARDS_ON_NODE` of the process's step, for shard jobs.
    pub shards: Option<u32>,
}

/// Caching PID -> job resolver.
#[derive(Debug)]
pub struct Attributor {
    proc_root: PathBuf,
    cache: HashMap<u32, (u64, Option<JobRef>)>,
}

impl Default for Attributor {
    fn default() -> Self {
        Self::new("/proc")
    }
}

impl Attributor {
    pub fn new(proc_root: impl Into<PathBuf>) -> Self {
        Self { proc_root: proc_root.into(), cache: HashMap::new() }
    }

    /// The job of `pid`, or `None` (not a Slurm process, or gone).
    pub fn attribute(&mut self, pid: u32) -> Option<JobRef> {
        let dir = self.proc_root.join(pid.to_string());
        let start = start_time(&dir)?;
        if let Some((cached_start, job)) = self.cache.get(&pid)
            && *cached_start == start
        {
            return job.clone();
        }
        let (env_job, env_seen) = from_environ(&dir);
        let job = env_job.or_else(|| from_cgroup(&dir));
        // Cache only a settled answer: the same process after reading, and an environment
        // that was there. Right after execve the kernel shows an empty environ for a moment
        // (measured: most reads straight after spawn), which must not stick as "no job".
        if env_seen && start_time(&dir) == Some(start) {
            self.cache.insert(pid, (start, job.clone()));
        }
        job
    }

    /// Forgets PIDs that are no longer GPU processes, so the cache stays bounded.
    pub fn retain(&mut self, live: &HashSet<u32>) {
        self.cache.retain(|pid, _| live.contains(pid));
    }
}

/// Process start time in clock ticks since boot (field 22 of `stat`), `None` if gone.
fn start_time(dir: &Path) -> Option<u64> {
    let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
    // `comm` (field 2) is in parentheses and may contain spaces: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest starts at field 3 (state); starttime is field 22 -> index 19 here.
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// The job from the process environment, and whether an environment was readable at all.
fn from_environ(dir: &Path) -> (Option<JobRef>, bool) {
    match std::fs::read(dir.join("environ")) {
        Ok(env) if !env.is_empty() => (job_from_env(dir, &env), true),
        _ => (None, false),
    }
}

fn job_from_env(dir: &Path, env: &[u8]) -> Option<JobRef> {
    let mut job_id = None;
    let mut user = None;
    let mut shards = None;
    for var in env.split(|b| *b == 0) {
        if let Some(v) = var.strip_prefix(b"SLURM_JOB_ID=") {
            job_id = std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<u32>().ok());
        } else if let Some(v) = var.strip_prefix(b"SLURM_JOB_USER=") {
            user = std::str::from_utf8(v).ok().map(str::to_string);
        } else if let Some(v) = var.strip_prefix(b"SLURM_SHARDS_ON_NODE=") {
            shards = std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<u32>().ok());
        }
    }
    let job_id = job_id?;
    let user = match user.filter(|u| !u.is_empty()) {
        Some(u) => u,
        None => process_user(dir).unwrap_or_default(),
    };
    Some(JobRef { job_id, user, shards })
}

fn from_cgroup(dir: &Path) -> Option<JobRef> {
    let cgroup = std::fs::read_to_string(dir.join("cgroup")).ok()?;
    let job_id = job_id_from_cgroup(&cgroup)?;
    Some(JobRef { job_id, user: process_user(dir).unwrap_or_default(), shards: None })
}

/// Finds `job_<digits>` as a path component in `/proc/<pid>/cgroup` text.
pub fn job_id_from_cgroup(text: &str) -> Option<u32> {
    text.lines()
        .filter_map(|line| line.splitn(3, ':').nth(2))
        .flat_map(|path| path.split('/'))
        .find_map(|comp| comp.strip_prefix("job_").and_then(|id| id.parse().ok()))
}

/// The user name of the process's real uid.
fn process_user(dir: &Path) -> Option<String> {
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let uid: u32 = status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()?;
    user_name(uid)
}

/// Looks up a uid with `getpwuid_r` (so LDAP/sssd users resolve too).
pub fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `passwd` is plain data; getpwuid_r writes it and the strings into `buf` (whose
    // length we pass) and sets `result` to `&passwd` on success or null when not found. We
    // read `pw_name` only on success, while `buf` is alive.
    unsafe {
        let mut pwd: libc::passwd = std::mem::zeroed();
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        let rc = libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result);
        if rc != 0 || result.is_null() || pwd.pw_name.is_null() {
            return None;
        }
        Some(std::ffi::CStr::from_ptr(pwd.pw_name).to_string_lossy().into_owned())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn cgroup_v1_and_v2_paths() {
        let v2 = "0::/system.slice/slurmstepd.scope/job_4242/step_0/user/task_0\n";
        assert_eq!(job_id_from_cgroup(v2), Some(4242));
        let v1 = "12:memory:/slurm/uid_1000/job_77/step_batch\n4:devices:/slurm/uid_1000/job_77/step_batch\n";
        assert_eq!(job_id_from_cgroup(v1), Some(77));
        assert_eq!(job_id_from_cgroup("0::/user.slice/user-1000.slice/session-1.scope\n"), None);
        assert_eq!(job_id_from_cgroup("0::/x/job_abc/\n"), None);
    }

    #[test]
    fn own_process_has_a_start_time_and_a_vanished_pid_is_none() {
        let me = std::process::id();
        assert!(start_time(&PathBuf::from(format!("/proc/{me}"))).is_some());
        let mut a = Attributor::default();
        // PID beyond pid_max: never exists.
        assert_eq!(a.attribute(u32::MAX - 1), None);
    }

    #[test]
    fn environ_wins_and_is_cached_until_the_pid_is_reused() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("SLURM_JOB_ID", "31337")
            .env("SLURM_JOB_USER", "carol")
            .env("SLURM_SHARDS_ON_NODE", "7")
            .spawn()
            .unwrap();
        let pid = child.id();
        let mut a = Attributor::default();
        // Straight after spawn the kernel may still show an empty environ: that answer must
        // not be cached, so asking again a moment later finds the job.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut got = a.attribute(pid);
        while got.is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            got = a.attribute(pid);
        }
        assert_eq!(got, Some(JobRef { job_id: 31337, user: "carol".into(), shards: Some(7) }));
        assert!(a.cache.contains_key(&pid));
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(a.attribute(pid), None, "a reaped process is not attributed");
        a.retain(&HashSet::new());
        assert!(a.cache.is_empty());
    }

    #[test]
    fn root_resolves_to_a_name() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
    }
}
