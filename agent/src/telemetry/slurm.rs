//! Slurm snapshot: one `squeue` and one `sinfo` per interval on the `gpuhub-slurm` thread,
//! shared by every collector, so a scrape never runs a command (a slow slurmctld must not
//! make `/metrics` slow).
//!
//! Both commands run with explicit `-o` formats and `|` separators, `LC_ALL=C`, and a timeout
//! (`telemetry.slurm_timeout_ms`) after which the command is killed, the snapshot skipped and
//! `gpuhub_slurm_up` set to 0. Formats:
//! - `squeue -h -a -t PD,R,CG,S,CF -o '%i|%T|%P|%u|%a|%r|%b|%N'`: id, state, partition, user,
//!   account, reason, GRES per node (`gres:gpu:2`, `gres/shard:7`, `gres:gpu:h200:1`), nodes.
//! - `sinfo -h -N -o '%N|%G'`: node and its configured GRES (`gpu:h200:2,shard:h200:28(S:0)`).
//!
//! GPUs and shards in use are those of running jobs on this node (`telemetry.slurm_node_name`);
//! GPU- and shard-seconds per user and account are integrated from these snapshots (an
//! estimate with one interval of resolution; `gpuhub usage` has the exact figures from the
//! plugin's records).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::metrics::{AllocState, CommandLabels, GpuhubMetrics, ReasonLabels, SlurmJobLabels, StateLabels, UserAccountLabels};
use super::{Published, Stop, TelemetryConfig, lock, unix_now};

pub const SQUEUE_FORMAT: &str = "%i|%T|%P|%u|%a|%r|%b|%N";
pub const SINFO_FORMAT: &str = "%N|%G";
/// Output beyond this is refused (a runaway command must not eat the agent's memory).
const MAX_OUTPUT: u64 = 64 * 1024 * 1024;

/// One job line of `squeue`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqueueJob {
    /// Numeric job id; `None` for a pending array (`123_[1-5]`), kept for the counts.
    pub job_id: Option<u32>,
    pub state: String,
    pub partition: String,
    pub user: String,
    pub account: String,
    pub reason: String,
    /// GPUs and shards per node the job holds (running) or asks for (pending).
    pub gpus: u32,
    pub shards: u32,
    pub nodes: String,
}

/// GRES configured on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeGres {
    pub gpus: u32,
    pub shards: u32,
}

/// A malformed line; the snapshot keeps the good lines and counts the bad.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{command}: line {line}: {problem}: {text:?}")]
pub struct ParseError {
    pub command: &'static str,
    pub line: usize,
    pub problem: &'static str,
    pub text: String,
}

/// Parses `squeue -o SQUEUE_FORMAT` output.
pub fn parse_squeue(text: &str) -> (Vec<SqueueJob>, Vec<ParseError>) {
    let mut jobs = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('|').collect();
        if f.len() != 8 {
            errors.push(ParseError { command: "squeue", line: i + 1, problem: "expected 8 |-separated fields", text: line.into() });
            continue;
        }
        let id = f[0].trim();
        let job_id = id.split('_').next().and_then(|s| s.parse().ok());
        if job_id.is_none() && !id.contains('_') {
            errors.push(ParseError { command: "squeue", line: i + 1, problem: "job id is not a number", text: line.into() });
            continue;
        }
        let (gpus, shards) = parse_gres_counts(f[6]);
        // Slurm prints `(null)` for an unset field (the account without slurmdbd).
        let field = |i: usize| match f[i].trim() {
            "(null)" => String::new(),
            v => v.to_string(),
        };
        jobs.push(SqueueJob {
            job_id: if id.contains('[') { None } else { job_id },
            state: field(1),
            partition: field(2),
            user: field(3),
            account: field(4),
            reason: field(5),
            gpus,
            shards,
            nodes: f[7].trim().to_string(),
        });
    }
    (jobs, errors)
}

/// Parses `sinfo -N -o SINFO_FORMAT` output: node -> GRES (a node listed once per partition
/// is counted once).
pub fn parse_sinfo(text: &str) -> (BTreeMap<String, NodeGres>, Vec<ParseError>) {
    let mut nodes = BTreeMap::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let Some((node, gres)) = line.split_once('|') else {
            errors.push(ParseError { command: "sinfo", line: i + 1, problem: "expected node|gres", text: line.into() });
            continue;
        };
        let (gpus, shards) = parse_gres_counts(gres);
        nodes.insert(node.trim().to_string(), NodeGres { gpus, shards });
    }
    (nodes, errors)
}

/// Sums GPU and shard counts in a GRES string: `gres:gpu:2`, `gres/gpu:h200:1`,
/// `gpu:h200:2(S:0-1),shard:h200:28`, `gres:shard:7`, `N/A`, `(null)`.
pub fn parse_gres_counts(s: &str) -> (u32, u32) {
    let mut gpus = 0u32;
    let mut shards = 0u32;
    // Split on commas outside parentheses (`(S:0-1)` contains none, `(IDX:0,1)` might).
    for item in crate::util::split_outside(s, '(', ')') {
        let item = item.split('(').next().unwrap_or("").trim();
        let item = item.strip_prefix("gres:").or_else(|| item.strip_prefix("gres/")).unwrap_or(item);
        let mut parts = item.split(':');
        let name = parts.next().unwrap_or("");
        let rest: Vec<&str> = parts.collect();
        // name[:type][:count]; a missing count means 1.
        let count = match rest.last() {
            Some(last) => last.parse::<u32>().unwrap_or(if rest.len() == 1 { 1 } else { 0 }),
            None => 1,
        };
        match name {
            "gpu" => gpus = gpus.saturating_add(count),
            "shard" => shards = shards.saturating_add(count),
            _ => {}
        }
    }
    (gpus, shards)
}

/// Why a command produced no snapshot.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("cannot run {cmd}: {source}; install the Slurm client or set telemetry.slurm_bin_dir")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("{cmd} did not finish within {ms} ms (killed); raise telemetry.slurm_timeout_ms or check slurmctld")]
    Timeout { cmd: String, ms: u128 },
    #[error("{cmd} exited with {status}: {stderr}")]
    Failed { cmd: String, status: String, stderr: String },
}

/// Runs `bin args..` with a hard timeout; returns stdout.
pub fn run_command(bin: &std::path::Path, args: &[&str], timeout: Duration) -> Result<String, CommandError> {
    run_command_env(bin, args, &[], timeout)
}

/// [`run_command`] with extra environment variables (e.g. `SLURM_TIME_FORMAT=%s`).
pub fn run_command_env(bin: &std::path::Path, args: &[&str], env: &[(&str, &str)], timeout: Duration) -> Result<String, CommandError> {
    let cmd = bin.display().to_string();
    // Own process group, so a timeout kills the command's children too (a wrapper script's
    // `sleep` would otherwise hold the pipes open).
    let mut child = Command::new(bin)
        .process_group(0)
        .args(args)
        .env("LC_ALL", "C")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| CommandError::Spawn { cmd: cmd.clone(), source })?;
    // Read both pipes on helper threads so a large output cannot block the child while we wait.
    let readers = [
        child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>),
        child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>),
    ]
    .map(|r| {
        r.map(|r| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = r.take(MAX_OUTPUT).read_to_end(&mut buf);
                buf
            })
        })
    });
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) | Err(_) => {
                kill_group(&mut child);
                break None;
            }
        }
    };
    let Some(status) = status else {
        // The readers end when the last holder of the pipes dies; they are not waited for, so
        // a grandchild that escaped the group cannot stall the sampler.
        return Err(CommandError::Timeout { cmd, ms: timeout.as_millis() });
    };
    let [out, err] = readers.map(|h| h.and_then(|h| h.join().ok()).unwrap_or_default());
    if !status.success() {
        let stderr = String::from_utf8_lossy(&err);
        let stderr = stderr.lines().last().unwrap_or("").trim().to_string();
        return Err(CommandError::Failed { cmd, status: status.to_string(), stderr });
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// SIGKILLs the child's process group, then reaps the child.
fn kill_group(child: &mut std::process::Child) {
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: kill(2) with a negative pid signals the process group we created for this
        // child (`process_group(0)`); the child is not reaped yet, so its pid (= pgid) is ours.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The Slurm sampler; runs on its own thread.
#[derive(Debug)]
pub struct SlurmSampler {
    squeue: PathBuf,
    sinfo: PathBuf,
    timeout: Duration,
    node: String,
    own: GpuhubMetrics,
    published: Arc<Mutex<Published>>,
    last_ok: Option<Instant>,
    interval: Duration,
    was_up: Option<bool>,
    live_jobs: HashSet<SlurmJobLabels>,
    live_reasons: HashSet<ReasonLabels>,
    warned_node: bool,
}

impl SlurmSampler {
    pub(crate) fn new(cfg: &TelemetryConfig, own: GpuhubMetrics, published: Arc<Mutex<Published>>) -> Self {
        let bin = |name: &str| match &cfg.slurm_bin_dir {
            Some(dir) => dir.join(name),
            None => PathBuf::from(name),
        };
        Self {
            squeue: bin("squeue"),
            sinfo: bin("sinfo"),
            timeout: Duration::from_millis(cfg.slurm_timeout_ms.clamp(100, 600_000)),
            node: cfg.effective_node_name(),
            own,
            published,
            last_ok: None,
            interval: Duration::from_millis(cfg.slurm_interval_ms),
            was_up: None,
            live_jobs: HashSet::new(),
            live_reasons: HashSet::new(),
            warned_node: false,
        }
    }

    pub(crate) fn run(mut self, interval: Duration, stop: &Stop) {
        self.interval = interval;
        loop {
            if stop.is_stopped() {
                return;
            }
            let t0 = Instant::now();
            self.snapshot_once();
            if stop.wait(interval.saturating_sub(t0.elapsed())) {
                return;
            }
        }
    }

    /// Runs both commands and updates the Slurm series; a failure sets `gpuhub_slurm_up 0`.
    pub(crate) fn snapshot_once(&mut self) {
        let result = self.take();
        lock(&self.published).slurm_snapshots += 1;
        match result {
            Ok((jobs, nodes)) => {
                if self.was_up != Some(true) {
                    tracing::info!("telemetry: Slurm snapshot ok ({} jobs, node {})", jobs.len(), self.node);
                }
                self.was_up = Some(true);
                self.apply(&jobs, &nodes);
            }
            Err(e) => {
                if self.was_up != Some(false) {
                    tracing::warn!("telemetry: Slurm snapshot failed: {e}; Slurm series keep their last values, gpuhub_slurm_up 0");
                } else {
                    tracing::debug!("telemetry: Slurm snapshot failed again: {e}");
                }
                self.was_up = Some(false);
                self.own.slurm_up.set(0);
                self.last_ok = None;
            }
        }
    }

    fn take(&mut self) -> Result<(Vec<SqueueJob>, BTreeMap<String, NodeGres>), CommandError> {
        let fail = |own: &GpuhubMetrics, command: &str| {
            own.slurm_command_errors.get_or_create(&CommandLabels { command: command.into() }).inc();
        };
        let sq = run_command(&self.squeue, &["-h", "-a", "-t", "PD,R,CG,S,CF", "-o", SQUEUE_FORMAT], self.timeout)
            .inspect_err(|_| fail(&self.own, "squeue"))?;
        let si = run_command(&self.sinfo, &["-h", "-N", "-o", SINFO_FORMAT], self.timeout).inspect_err(|_| fail(&self.own, "sinfo"))?;
        let (jobs, errs_q) = parse_squeue(&sq);
        let (nodes, errs_i) = parse_sinfo(&si);
        for e in errs_q.iter().chain(errs_i.iter()) {
            tracing::warn!("telemetry: skipped a Slurm output line: {e}");
            fail(&self.own, e.command);
        }
        Ok((jobs, nodes))
    }

    fn apply(&mut self, jobs: &[SqueueJob], nodes: &BTreeMap<String, NodeGres>) {
        let m = &self.own;
        // Which node's GRES: ours if sinfo knows it, else all nodes (single-node clusters
        // under another name), said once.
        let ours = nodes.get(&self.node).copied();
        if ours.is_none() && !self.warned_node && !nodes.is_empty() {
            tracing::warn!(
                "telemetry: Slurm node `{}` not in sinfo (nodes: {}); counting GPUs of all nodes (set telemetry.slurm_node_name)",
                self.node,
                nodes.keys().cloned().collect::<Vec<_>>().join(",")
            );
            self.warned_node = true;
        }
        let total = ours.unwrap_or_else(|| {
            nodes.values().fold(NodeGres::default(), |a, n| NodeGres { gpus: a.gpus + n.gpus, shards: a.shards + n.shards })
        });
        let on_node = |j: &SqueueJob| ours.is_none() || j.nodes == self.node;
        let running: Vec<&SqueueJob> = jobs.iter().filter(|j| j.state == "RUNNING" && on_node(j)).collect();
        let gpus_alloc: u32 = running.iter().map(|j| j.gpus).sum();
        let shards_alloc: u32 = running.iter().map(|j| j.shards).sum();
        m.slurm_gpus.get_or_create(&StateLabels { state: AllocState::allocated }).set(i64::from(gpus_alloc));
        m.slurm_gpus.get_or_create(&StateLabels { state: AllocState::idle }).set(i64::from(total.gpus.saturating_sub(gpus_alloc)));
        m.slurm_shards.get_or_create(&StateLabels { state: AllocState::allocated }).set(i64::from(shards_alloc));
        m.slurm_shards.get_or_create(&StateLabels { state: AllocState::idle }).set(i64::from(total.shards.saturating_sub(shards_alloc)));

        let mut by_state: HashMap<SlurmJobLabels, i64> = HashMap::new();
        let mut by_reason: HashMap<ReasonLabels, i64> = HashMap::new();
        for j in jobs {
            *by_state
                .entry(SlurmJobLabels { state: j.state.to_lowercase(), partition: j.partition.clone(), user: j.user.clone() })
                .or_default() += 1;
            if j.state == "PENDING" {
                *by_reason.entry(ReasonLabels { reason: j.reason.clone() }).or_default() += 1;
            }
        }
        for (l, n) in &by_state {
            m.slurm_jobs.get_or_create(l).set(*n);
        }
        for (l, n) in &by_reason {
            m.slurm_pending.get_or_create(l).set(*n);
        }
        let jobs_now: HashSet<SlurmJobLabels> = by_state.into_keys().collect();
        let reasons_now: HashSet<ReasonLabels> = by_reason.into_keys().collect();
        super::metrics::remove_stale(&m.slurm_jobs, &self.live_jobs, &jobs_now);
        super::metrics::remove_stale(&m.slurm_pending, &self.live_reasons, &reasons_now);
        self.live_jobs = jobs_now;
        self.live_reasons = reasons_now;

        // Integrate allocated GPU/shard time since the previous good snapshot (bounded to two
        // intervals, so an outage is not invented as usage).
        let now = Instant::now();
        if let Some(prev) = self.last_ok {
            let dt = now.duration_since(prev).min(self.interval * 2).as_secs_f64();
            for j in &running {
                let l = UserAccountLabels { user: j.user.clone(), account: j.account.clone() };
                if j.gpus > 0 {
                    m.slurm_gpu_seconds.get_or_create(&l).inc_by(f64::from(j.gpus) * dt);
                }
                if j.shards > 0 {
                    m.slurm_shard_seconds.get_or_create(&l).inc_by(f64::from(j.shards) * dt);
                }
            }
        }
        self.last_ok = Some(now);
        m.slurm_up.set(1);
        m.slurm_last_snapshot.set(unix_now());

        let map = jobs.iter().filter_map(|j| j.job_id.map(|id| (id, (j.user.clone(), j.account.clone())))).collect();
        lock(&self.published).slurm_jobs = map;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn gres_strings_of_22_05_and_later() {
        assert_eq!(parse_gres_counts("gres:gpu:1"), (1, 0));
        assert_eq!(parse_gres_counts("gres/gpu:2"), (2, 0));
        assert_eq!(parse_gres_counts("gres:gpu:h200:2"), (2, 0));
        assert_eq!(parse_gres_counts("gres:shard:7"), (0, 7));
        assert_eq!(parse_gres_counts("gpu:h200:2(S:0-1),shard:h200:28"), (2, 28));
        assert_eq!(parse_gres_counts("gpu:h200:2(IDX:0,1),shard:h200:0(IDX:N/A)"), (2, 0));
        assert_eq!(parse_gres_counts("gres:gpu"), (1, 0));
        assert_eq!(parse_gres_counts("N/A"), (0, 0));
        assert_eq!(parse_gres_counts("(null)"), (0, 0));
        assert_eq!(parse_gres_counts(""), (0, 0));
    }

    #[test]
    fn squeue_lines_and_bad_lines() {
        let text = "\
12|RUNNING|gpu|alice|physics|None|gres:gpu:2|gpu01
13|RUNNING|gpu|bob|bio|None|gres:shard:7|gpu01
14|PENDING|gpu|bob|bio|Resources|gres:gpu:2|
15_[1-3]|PENDING|cpu|carol|(null)|Priority|N/A|
garbage line
x|RUNNING|gpu|a|b|None||gpu01
";
        let (jobs, errs) = parse_squeue(text);
        assert_eq!(jobs.len(), 4, "{jobs:?}");
        assert_eq!(errs.len(), 2, "{errs:?}");
        assert_eq!(errs[0].line, 5);
        assert!(errs[1].to_string().contains("job id is not a number"), "{}", errs[1]);
        assert_eq!(jobs[0].job_id, Some(12));
        assert_eq!((jobs[0].gpus, jobs[0].shards), (2, 0));
        assert_eq!((jobs[1].gpus, jobs[1].shards), (0, 7));
        assert_eq!(jobs[2].reason, "Resources");
        assert_eq!(jobs[3].job_id, None);
        assert_eq!(jobs[3].account, "", "(null) is no account");
    }

    #[test]
    fn sinfo_counts_a_node_once() {
        let (nodes, errs) = parse_sinfo("gpu01|gpu:h200:2,shard:h200:28\ngpu01|gpu:h200:2,shard:h200:28\ncpu01|(null)\nbad\n");
        assert_eq!(errs.len(), 1);
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes["gpu01"], NodeGres { gpus: 2, shards: 28 });
        assert_eq!(nodes["cpu01"], NodeGres { gpus: 0, shards: 0 });
    }

    #[test]
    fn a_hanging_command_is_killed_at_the_timeout() {
        let t0 = Instant::now();
        let err = run_command(std::path::Path::new("sleep"), &["30"], Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, CommandError::Timeout { .. }), "{err}");
        // A wrapper script whose child holds the pipes: the whole group goes.
        let err = run_command(std::path::Path::new("sh"), &["-c", "sleep 30; echo done"], Duration::from_millis(200)).unwrap_err();
        assert!(matches!(err, CommandError::Timeout { .. }), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(5), "took {:?}", t0.elapsed());
        assert!(err.to_string().contains("telemetry.slurm_timeout_ms"), "{err}");
    }

    #[test]
    fn a_missing_or_failing_command_says_what_to_do() {
        let err = run_command(std::path::Path::new("/nonexistent/squeue"), &[], Duration::from_secs(1)).unwrap_err();
        assert!(err.to_string().contains("telemetry.slurm_bin_dir"), "{err}");
        let err = run_command(std::path::Path::new("sh"), &["-c", "echo boom >&2; exit 3"], Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
    }

    #[test]
    fn large_output_does_not_block() {
        let out =
            run_command(std::path::Path::new("sh"), &["-c", "head -c 1000000 /dev/zero | tr '\\0' x"], Duration::from_secs(10)).unwrap();
        assert_eq!(out.len(), 1_000_000);
    }
}
