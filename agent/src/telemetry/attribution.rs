//! PID -> Slurm job: which job a GPU process belongs to.
//!
//! Order of evidence:
//! 1. `/proc/<pid>/cgroup`: `.../job_<id>/...`, where slurmstepd put the task
//!    (`proctrack/cgroup` or `task/cgroup`, cgroup v1 and v2). Only root can move a process
//!    between Slurm's cgroups, so this is what Slurm vouches for: it wins.
//! 2. `/proc/<pid>/environ`: `SLURM_JOB_ID` (and `SLURM_SHARDS_ON_NODE`), which Slurm sets in
//!    every task and children inherit. Any process can claim any `SLURM_JOB_ID`, so this is only
//!    a fallback, for nodes whose Slurm keeps no per-job cgroup (`proctrack/linuxproc`), and the
//!    only place a shard count is visible per process (taken only when its `SLURM_JOB_ID` agrees
//!    with the cgroup's job).
//!
//! The user is always the name of the process's real uid, never `SLURM_JOB_USER` (the user
//! writes their environment).
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
        let cgroup_job = from_cgroup(&dir);
        let (env_job, env_seen) = from_environ(&dir);
        let settled = env_seen || cgroup_job.is_some();
        let job = match (cgroup_job, env_job) {
            (Some(c), Some(e)) if e.job_id == c.job_id => Some(JobRef { shards: e.shards, ..c }),
            (Some(c), _) => Some(c),
            (None, e) => e,
        };
        // Cache only a settled answer: the same process after reading, and a cgroup or an
        // environment that was there. Right after execve the kernel shows an empty environ for a
        // moment (measured: most reads straight after spawn), which must not stick as "no job".
        if settled && start_time(&dir) == Some(start) {
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
    let mut shards = None;
    for var in env.split(|b| *b == 0) {
        if let Some(v) = var.strip_prefix(b"SLURM_JOB_ID=") {
            job_id = std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<u32>().ok());
        } else if let Some(v) = var.strip_prefix(b"SLURM_SHARDS_ON_NODE=") {
            shards = std::str::from_utf8(v).ok().and_then(|s| s.trim().parse::<u32>().ok());
        }
    }
    Some(JobRef { job_id: job_id?, user: process_user(dir).unwrap_or_default(), shards })
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

    /// A fake `/proc/<pid>` with the given cgroup and environment (and this process's stat and
    /// status, so it looks alive and owned by our uid).
    fn fake_proc(root: &Path, pid: u32, cgroup: &str, environ: &[&str]) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup"), cgroup).unwrap();
        std::fs::write(dir.join("environ"), environ.iter().map(|v| format!("{v}\0")).collect::<String>()).unwrap();
        let me = format!("/proc/{}", std::process::id());
        std::fs::copy(format!("{me}/stat"), dir.join("stat")).unwrap();
        std::fs::copy(format!("{me}/status"), dir.join("status")).unwrap();
    }

    #[test]
    fn the_cgroup_wins_over_a_claimed_environment() {
        let root = tempfile::tempdir().unwrap();
        // SAFETY: getuid has no preconditions.
        let me = user_name(unsafe { libc::getuid() }).unwrap();
        // Slurm put the process in job 42's cgroup; its environment claims job 7, user bob.
        let v1 = "4:freezer:/slurm/uid_1001/job_42/step_0\n";
        fake_proc(root.path(), 100, v1, &["SLURM_JOB_ID=7", "SLURM_JOB_USER=bob", "SLURM_SHARDS_ON_NODE=1"]);
        // The environment agrees with the cgroup: its shard count is taken.
        fake_proc(root.path(), 101, v1, &["SLURM_JOB_ID=42", "SLURM_SHARDS_ON_NODE=7"]);
        // No Slurm cgroup (proctrack/linuxproc): the environment is all there is.
        fake_proc(root.path(), 102, "0::/user.slice/session-3.scope\n", &["SLURM_JOB_ID=9", "SLURM_JOB_USER=bob"]);
        // A job's cgroup and an emptied environment.
        fake_proc(root.path(), 103, "0::/system.slice/slurmstepd.scope/job_55/step_batch/user/task_0\n", &[]);
        let mut a = Attributor::new(root.path());
        assert_eq!(a.attribute(100), Some(JobRef { job_id: 42, user: me.clone(), shards: None }));
        assert_eq!(a.attribute(101), Some(JobRef { job_id: 42, user: me.clone(), shards: Some(7) }));
        assert_eq!(
            a.attribute(102),
            Some(JobRef { job_id: 9, user: me.clone(), shards: None }),
            "the user is the uid's, not SLURM_JOB_USER"
        );
        assert_eq!(a.attribute(103), Some(JobRef { job_id: 55, user: me, shards: None }));
    }

    #[test]
    fn environ_is_the_fallback_and_is_cached_until_the_pid_is_reused() {
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
        // SAFETY: getuid has no preconditions.
        let me = user_name(unsafe { libc::getuid() }).unwrap();
        assert_eq!(got, Some(JobRef { job_id: 31337, user: me, shards: Some(7) }), "SLURM_JOB_USER is not believed");
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
