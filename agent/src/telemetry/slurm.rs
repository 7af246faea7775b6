//! Slurm snapshot: `scontrol show job -d -o` and `scontrol -d show node -o` once per interval on
//! the `gpuhub-slurm` thread, shared by every collector (the `gpuhub_slurm_*` series and the GPU
//! sampler's user lookup), so a scrape never runs a command (a slow slurmctld must not make
//! `/metrics` slow).
//!
//! Both come from slurmctld, whatever syntax a job was submitted with: `--gres=gpu:N`,
//! `--gres=gpu:h200:N`, `--gpus=N`, `--gpus-per-node`, `--gpus-per-task` and shards all end up
//! as the job's per-node `GRES=gpu:h200:N(IDX:..)` / `shard:..` and as the node's `GresUsed=`
//! (`squeue -o %b` shows `N/A` for `--gpus`, which is why this is not squeue). The job lines are
//! parsed by accounting's parser ([`crate::accounting::slurm::parse_scontrol`]), which refuses a
//! line whose free text imitates Slurm's fields; such a job is counted as a malformed line and
//! left out of the per-job series, while the node's totals (`CPUAlloc`, `AllocMem`, and GPUs
//! from `GresUsed`, which no user text reaches) stay exact.
//!
//! Commands run with `LC_ALL=C`, `SLURM_TIME_FORMAT=%s` and a timeout
//! (`telemetry.slurm_timeout_ms`) after which the command is killed, the snapshot skipped and
//! `gpuhub_slurm_up` set to 0.
//!
//! Series: GPUs and shards of this node (`telemetry.slurm_node_name`) allocated and idle; the
//! node's state (`idle`, `mixed`, `allocated`, `drained`, `draining`, `down`, ...) with the
//! admin's reason; its CPUs and memory allocated and idle; each live job's GPUs, shards, CPUs
//! and memory on it; jobs by state, partition and user; pending jobs by reason. GPU-seconds
//! per user and account come from the accounting store (`gpuhub_usage_*`), not from here.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::metrics::{
    AllocState, CommandLabels, GpuhubMetrics, NodeAllocLabels, NodeStateLabels, ReasonLabels, SlurmJobLabels, SlurmLiveJobLabels,
    StateLabels,
};
use super::{Published, Stop, TelemetryConfig, lock, unix_now};
use crate::accounting::slurm::{
    LastLook, LineError, SlurmJob, is_finished, is_live, listed_ids, parse_scontrol, parse_slurm_size, take_job_look, vouch,
};

/// Output beyond this is refused (a runaway command must not eat the agent's memory).
const MAX_OUTPUT: u64 = 64 * 1024 * 1024;

/// GRES configured on a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeGres {
    pub gpus: u32,
    pub shards: u32,
}

/// One node as `scontrol -d show node -o` prints it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SlurmNode {
    pub name: String,
    /// Slurm's own state word(s), e.g. `MIXED+DRAIN`, `DOWN*`.
    pub raw_state: String,
    /// What dashboards show: `idle`, `mixed`, `allocated`, `completing`, `drained`,
    /// `draining`, `down`, `fail`, `failing`, `maint`, `reserved`, `future`, `unknown`.
    pub state: String,
    /// The admin's reason (`scontrol update ... reason=`), without Slurm's `[user@time]`.
    pub reason: String,
    pub cpus_alloc: u32,
    pub cpus_total: u32,
    pub mem_alloc_bytes: u64,
    pub mem_total_bytes: u64,
    /// `Gres=`.
    pub configured: NodeGres,
    /// `GresUsed=`; `None` when the node line has none.
    pub used: Option<NodeGres>,
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

/// Slurm's node state as one word: flags that matter win over the base state (`IDLE+DRAIN` is
/// `drained`, `MIXED+DRAIN` `draining`, `IDLE*` (not responding) `down`).
pub fn node_state(raw: &str) -> String {
    let raw = raw.trim();
    let not_responding = raw.contains('*');
    let mut parts = raw.split('+').map(|p| p.trim_end_matches(['*', '~', '#', '%', '$', '@', '^', '!', '-']).to_ascii_uppercase());
    let base = parts.next().unwrap_or_default();
    let flags: Vec<String> = parts.collect();
    let has = |f: &str| flags.iter().any(|x| x == f);
    let s = if has("DRAIN") {
        if matches!(base.as_str(), "IDLE" | "DOWN") { "drained" } else { "draining" }
    } else if has("FAIL") {
        if matches!(base.as_str(), "IDLE" | "DOWN") { "fail" } else { "failing" }
    } else if base == "DOWN" || not_responding {
        "down"
    } else if has("MAINT") {
        "maint"
    } else if has("RESERVED") {
        "reserved"
    } else if has("COMPLETING") || base == "COMPLETING" {
        "completing"
    } else {
        return match base.as_str() {
            "IDLE" | "MIXED" | "ALLOCATED" | "FUTURE" | "ERROR" => base.to_ascii_lowercase(),
            "ALLOC" => "allocated".into(),
            "MIX" => "mixed".into(),
            _ => "unknown".into(),
        };
    };
    s.to_string()
}

/// key=value tokens of an `-o` line; a token without `=` continues the previous value
/// (`OS=Linux 6.1 #1 SMP`, `Reason=maint [root@...]`).
fn fields(line: &str) -> Vec<(&str, String)> {
    let mut out: Vec<(&str, String)> = Vec::new();
    for tok in line.split_ascii_whitespace() {
        match tok.split_once('=') {
            Some((k, v)) if !k.is_empty() && !out.iter().any(|(seen, _)| *seen == k) => out.push((k, v.to_string())),
            _ => {
                if let Some(last) = out.last_mut() {
                    last.1.push(' ');
                    last.1.push_str(tok);
                }
            }
        }
    }
    out
}

/// Parses `scontrol -d show node -o`: node name -> node.
pub fn parse_nodes(text: &str) -> (BTreeMap<String, SlurmNode>, Vec<ParseError>) {
    let mut nodes = BTreeMap::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f = fields(line);
        let get = |k: &str| f.iter().find(|(key, _)| *key == k).map(|(_, v)| v.trim());
        let Some(name) = get("NodeName").filter(|n| !n.is_empty()) else {
            errors.push(ParseError { command: "scontrol show node", line: i + 1, problem: "no NodeName=", text: line.into() });
            continue;
        };
        let num = |k: &str| get(k).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let raw_state = get("State").unwrap_or("UNKNOWN").to_string();
        let reason = get("Reason").map(|r| r.split(" [").next().unwrap_or(r).trim().to_string()).unwrap_or_default();
        let (gpus, shards) = parse_gres_counts(get("Gres").unwrap_or(""));
        let used = get("GresUsed").map(|u| {
            let (gpus, shards) = parse_gres_counts(u);
            NodeGres { gpus, shards }
        });
        nodes.insert(
            name.to_string(),
            SlurmNode {
                name: name.to_string(),
                state: node_state(&raw_state),
                raw_state,
                reason: if reason == "(null)" { String::new() } else { reason },
                cpus_alloc: u32::try_from(num("CPUAlloc")).unwrap_or(u32::MAX),
                cpus_total: u32::try_from(num("CPUTot")).unwrap_or(u32::MAX),
                mem_alloc_bytes: get("AllocMem").map(parse_slurm_size).unwrap_or(0),
                mem_total_bytes: get("RealMemory").map(parse_slurm_size).unwrap_or(0),
                configured: NodeGres { gpus, shards },
                used,
            },
        );
    }
    (nodes, errors)
}

/// Sums GPU and shard counts in a GRES string: `gres:gpu:2`, `gres/gpu:h200:1`,
/// `gpu:h200:2(S:0-1),shard:h200:28`, `gres:shard:7`, `gpu:h200:1(IDX:0)`, `N/A`, `(null)`.
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

/// One look at Slurm, as every collector shares it.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Every job slurmctld lists (finished ones within `MinJobAge` included).
    pub jobs: BTreeMap<u32, SlurmJob>,
    pub nodes: BTreeMap<String, SlurmNode>,
    /// Lines that were refused (ambiguous job lines, malformed node lines).
    pub bad_lines: usize,
}

/// The Slurm sampler; runs on its own thread.
#[derive(Debug)]
pub struct SlurmSampler {
    scontrol: PathBuf,
    /// `squeue --json`: which of scontrol's job lines are slurmctld's own.
    squeue: PathBuf,
    warned_squeue: bool,
    /// Each job look is kept here for the accounting ingest ([`LastLook`]).
    last_look: LastLook,
    /// The job lines skipped at the last snapshot, as logged.
    last_job_errors: Vec<String>,
    timeout: Duration,
    node: String,
    own: GpuhubMetrics,
    published: Arc<Mutex<Published>>,
    was_up: Option<bool>,
    live_jobs: HashSet<SlurmJobLabels>,
    live_reasons: HashSet<ReasonLabels>,
    live_nodes: HashSet<NodeStateLabels>,
    live_node_alloc: HashSet<NodeAllocLabels>,
    live_job_alloc: HashSet<SlurmLiveJobLabels>,
    warned_node: bool,
}

const JOB_CMD: &str = "scontrol show job";
const NODE_CMD: &str = "scontrol show node";

impl SlurmSampler {
    pub(crate) fn new(cfg: &TelemetryConfig, own: GpuhubMetrics, published: Arc<Mutex<Published>>, last_look: LastLook) -> Self {
        Self {
            scontrol: match &cfg.slurm_bin_dir {
                Some(dir) => dir.join("scontrol"),
                None => PathBuf::from("scontrol"),
            },
            squeue: match &cfg.slurm_bin_dir {
                Some(dir) => dir.join("squeue"),
                None => PathBuf::from("squeue"),
            },
            warned_squeue: false,
            last_look,
            last_job_errors: Vec::new(),
            timeout: Duration::from_millis(cfg.slurm_timeout_ms.clamp(100, 600_000)),
            node: cfg.effective_node_name(),
            own,
            published,
            was_up: None,
            live_jobs: HashSet::new(),
            live_reasons: HashSet::new(),
            live_nodes: HashSet::new(),
            live_node_alloc: HashSet::new(),
            live_job_alloc: HashSet::new(),
            warned_node: false,
        }
    }

    pub(crate) fn run(mut self, interval: Duration, stop: &Stop) {
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
            Ok(snap) => {
                if self.was_up != Some(true) {
                    tracing::info!(
                        "telemetry: Slurm snapshot ok ({} jobs, {} nodes; counting node {})",
                        snap.jobs.len(),
                        snap.nodes.len(),
                        self.node
                    );
                }
                self.was_up = Some(true);
                self.apply(&snap);
            }
            Err(e) => {
                if self.was_up != Some(false) {
                    tracing::warn!("telemetry: Slurm snapshot failed: {e}; Slurm series keep their last values, gpuhub_slurm_up 0");
                } else {
                    tracing::debug!("telemetry: Slurm snapshot failed again: {e}");
                }
                self.was_up = Some(false);
                self.own.slurm_up.set(0);
            }
        }
    }

    fn take(&mut self) -> Result<Snapshot, CommandError> {
        let fail = |own: &GpuhubMetrics, command: &str| {
            own.slurm_command_errors.get_or_create(&CommandLabels { command: command.into() }).inc();
        };
        let env = [("SLURM_TIME_FORMAT", "%s")];
        // Kept for the accounting ingest's next reconciliation, which then asks slurmctld nothing.
        let look = take_job_look(&self.scontrol, &self.squeue, self.timeout, &self.last_look).inspect_err(|_| fail(&self.own, JOB_CMD))?;
        let nodes_text = run_command_env(&self.scontrol, &["-d", "show", "node", "-o"], &env, self.timeout)
            .inspect_err(|_| fail(&self.own, NODE_CMD))?;
        let (mut jobs, mut job_errors) = parse_scontrol(&look.text);
        // A job name with a line break can print lines that imitate other jobs' (a user's GPUs
        // shown as another's): only the lines squeue's JSON vouches for are used.
        match &look.squeue_ids {
            Ok(sq) => {
                let (_, problems) = vouch(&mut jobs, &listed_ids(&look.text), sq);
                job_errors.extend(problems.into_iter().map(|problem| LineError { command: "squeue --json", line: 0, problem }));
                self.warned_squeue = false;
            }
            Err(e) if !std::mem::replace(&mut self.warned_squeue, true) => {
                tracing::warn!(
                    "telemetry: {e}; scontrol's job lines are used unchecked (a job name with a line break can imitate other jobs' lines)"
                );
            }
            Err(_) => {}
        }
        let (nodes, node_errors) = parse_nodes(&nodes_text);
        // Logged when they change (a job whose name imitates lines stays listed for its whole
        // life and MinJobAge after); counted on every snapshot.
        let said: Vec<String> = job_errors.iter().map(ToString::to_string).collect();
        let new = said != self.last_job_errors;
        for e in &said {
            if new {
                tracing::warn!("telemetry: skipped a Slurm job line: {e}");
            }
            fail(&self.own, JOB_CMD);
        }
        self.last_job_errors = said;
        for e in &node_errors {
            tracing::warn!("telemetry: skipped a Slurm node line: {e}");
            fail(&self.own, NODE_CMD);
        }
        Ok(Snapshot { jobs, nodes, bad_lines: job_errors.len() + node_errors.len() })
    }

    pub(crate) fn apply(&mut self, snap: &Snapshot) {
        let m = &self.own;
        let ours = snap.nodes.get(&self.node);
        if ours.is_none() && !self.warned_node && !snap.nodes.is_empty() {
            tracing::warn!(
                "telemetry: Slurm node `{}` not in `scontrol show node` (nodes: {}); counting GPUs of all nodes (set telemetry.slurm_node_name)",
                self.node,
                snap.nodes.keys().cloned().collect::<Vec<_>>().join(",")
            );
            self.warned_node = true;
        }
        let counted: Vec<&SlurmNode> = match ours {
            Some(n) => vec![n],
            None => snap.nodes.values().collect(),
        };
        let names: BTreeSet<String> = counted.iter().map(|n| n.name.clone()).collect();

        // Each live job's allocation on the counted node(s): GPUs and shards per node from its
        // GRES indices (any request syntax), CPUs and memory job-wide.
        let mut job_alloc_now = HashSet::new();
        let (mut job_gpus, mut job_shards) = (0u32, 0u32);
        for j in snap.jobs.values().filter(|j| is_live(&j.state)) {
            let Some(a) = j.alloc_on(&names) else { continue };
            job_gpus = job_gpus.saturating_add(a.gpus);
            job_shards = job_shards.saturating_add(a.shards);
            let l = SlurmLiveJobLabels {
                jobid: j.job_id.to_string(),
                user: j.user.clone(),
                account: j.account.clone().unwrap_or_default(),
                partition: j.partition.clone().unwrap_or_default(),
            };
            m.slurm_job_gpus.get_or_create(&l).set(i64::from(a.gpus));
            m.slurm_job_shards.get_or_create(&l).set(i64::from(a.shards));
            m.slurm_job_cpus.get_or_create(&l).set(i64::from(j.cpus));
            m.slurm_job_memory.get_or_create(&l).set(i64::try_from(j.mem_bytes).unwrap_or(i64::MAX));
            job_alloc_now.insert(l);
        }
        for f in [&m.slurm_job_gpus, &m.slurm_job_shards, &m.slurm_job_cpus, &m.slurm_job_memory] {
            super::metrics::remove_stale(f, &self.live_job_alloc, &job_alloc_now);
        }
        self.live_job_alloc = job_alloc_now;

        // GPUs and shards of the node in use: what the live jobs hold, or the node's GresUsed
        // if that says more (it also counts a job whose line was refused as ambiguous). Slurm
        // 22.05's GresUsed counts shards wrongly (`shard:h200:1(IDX:0)` while 8 shards are held
        // on GPU 0), so there the jobs' sum is the figure.
        let sum = |f: fn(&SlurmNode) -> u32| counted.iter().map(|n| f(n)).fold(0u32, u32::saturating_add);
        let (cfg_gpus, cfg_shards) = (sum(|n| n.configured.gpus), sum(|n| n.configured.shards));
        let (used_gpus, used_shards) = (sum(|n| n.used.map_or(0, |u| u.gpus)), sum(|n| n.used.map_or(0, |u| u.shards)));
        let (gpus_alloc, shards_alloc) = (job_gpus.max(used_gpus), job_shards.max(used_shards));
        m.slurm_gpus.get_or_create(&StateLabels { state: AllocState::allocated }).set(i64::from(gpus_alloc));
        m.slurm_gpus.get_or_create(&StateLabels { state: AllocState::idle }).set(i64::from(cfg_gpus.saturating_sub(gpus_alloc)));
        m.slurm_shards.get_or_create(&StateLabels { state: AllocState::allocated }).set(i64::from(shards_alloc));
        m.slurm_shards.get_or_create(&StateLabels { state: AllocState::idle }).set(i64::from(cfg_shards.saturating_sub(shards_alloc)));

        // Node state with the reason, CPUs and memory.
        let mut nodes_now = HashSet::new();
        let mut node_alloc_now = HashSet::new();
        for n in &counted {
            let l = NodeStateLabels { node: n.name.clone(), state: n.state.clone(), reason: n.reason.clone() };
            m.slurm_node_state.get_or_create(&l).set(1);
            nodes_now.insert(l);
            let pairs = [
                (&m.slurm_node_cpus, AllocState::allocated, u64::from(n.cpus_alloc)),
                (&m.slurm_node_cpus, AllocState::idle, u64::from(n.cpus_total.saturating_sub(n.cpus_alloc))),
                (&m.slurm_node_memory, AllocState::allocated, n.mem_alloc_bytes),
                (&m.slurm_node_memory, AllocState::idle, n.mem_total_bytes.saturating_sub(n.mem_alloc_bytes)),
            ];
            for (family, state, v) in pairs {
                let l = NodeAllocLabels { node: n.name.clone(), state };
                family.get_or_create(&l).set(i64::try_from(v).unwrap_or(i64::MAX));
                node_alloc_now.insert(l);
            }
        }
        super::metrics::remove_stale(&m.slurm_node_state, &self.live_nodes, &nodes_now);
        super::metrics::remove_stale(&m.slurm_node_cpus, &self.live_node_alloc, &node_alloc_now);
        super::metrics::remove_stale(&m.slurm_node_memory, &self.live_node_alloc, &node_alloc_now);
        self.live_nodes = nodes_now;
        self.live_node_alloc = node_alloc_now;

        // Jobs by state (not finished: what squeue lists by default), pending by reason.
        let mut by_state: HashMap<SlurmJobLabels, i64> = HashMap::new();
        let mut by_reason: HashMap<ReasonLabels, i64> = HashMap::new();
        for j in snap.jobs.values().filter(|j| !is_finished(&j.state)) {
            *by_state
                .entry(SlurmJobLabels {
                    state: j.state.to_lowercase(),
                    partition: j.partition.clone().unwrap_or_default(),
                    user: j.user.clone(),
                })
                .or_default() += 1;
            if j.state == "PENDING" {
                *by_reason.entry(ReasonLabels { reason: j.reason.clone().unwrap_or_else(|| "None".into()) }).or_default() += 1;
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

        m.slurm_up.set(1);
        m.slurm_last_snapshot.set(unix_now());
        let map = snap.jobs.values().map(|j| (j.job_id, (j.user.clone(), j.account.clone().unwrap_or_default()))).collect();
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

    // Captured on the lab (Slurm 22.05, `scontrol -d show node -o`), the OS field cut.
    const NODE_IDLE: &str = "NodeName=gpu01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=16 CPUTot=16 CPULoad=6.55 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h200:2,shard:h200:28 GresDrain=N/A GresUsed=gpu:h200:0(IDX:N/A),shard:h200:0(IDX:N/A) NodeAddr=127.0.0.1 NodeHostName=localhost Version=22.05.8 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=16000 AllocMem=0 FreeMem=4312 Sockets=16 Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,interactive,cpu  BootTime=2026-12-01T13:25:51 SlurmdStartTime=2026-12-01T15:01:19 LastBusyTime=2026-12-01T15:29:39 CfgTRES=cpu=16,mem=16000M,billing=16,gres/gpu=2,gres/shard=28 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s";

    #[test]
    fn node_lines_state_reason_cpus_memory_gres() {
        let busy = NODE_IDLE
            .replace("CPUAlloc=0", "CPUAlloc=3")
            .replace("AllocMem=0", "AllocMem=1500")
            .replace("State=IDLE", "State=MIXED+DRAIN")
            .replace("GresUsed=gpu:h200:0(IDX:N/A),shard:h200:0(IDX:N/A)", "GresUsed=gpu:h200:1(IDX:1),shard:h200:7(IDX:0)")
            .replace("NodeName=gpu01", "NodeName=gpu02")
            + " Reason=bad fan [root@2026-12-01T15:00:00]";
        let (nodes, errs) = parse_nodes(&format!("{NODE_IDLE}\n{busy}\nno node name here\n"));
        assert_eq!(errs.len(), 1, "{errs:?}");
        let a = &nodes["gpu01"];
        assert_eq!((a.state.as_str(), a.reason.as_str(), a.cpus_alloc, a.cpus_total), ("idle", "", 0, 16));
        assert_eq!((a.mem_total_bytes, a.mem_alloc_bytes), (16000 << 20, 0));
        assert_eq!((a.configured, a.used), (NodeGres { gpus: 2, shards: 28 }, Some(NodeGres { gpus: 0, shards: 0 })));
        let b = &nodes["gpu02"];
        assert_eq!((b.state.as_str(), b.reason.as_str(), b.raw_state.as_str()), ("draining", "bad fan", "MIXED+DRAIN"));
        assert_eq!((b.cpus_alloc, b.mem_alloc_bytes, b.used), (3, 1500 << 20, Some(NodeGres { gpus: 1, shards: 7 })));
    }

    // Captured on the lab's Slurm 24.11 leg (tests/lab/slurm24.sh), a gpu:1 and a shard:7 job
    // running: shards in use per GPU as held/configured.
    const NODE_MIXED_2411: &str = "NodeName=gpu01 Arch=x86_64 CoresPerSocket=1  CPUAlloc=2 CPUEfctv=16 CPUTot=16 CPULoad=1.80 AvailableFeatures=(null) ActiveFeatures=(null) Gres=gpu:h200:2,shard:h200:28 GresDrain=N/A GresUsed=gpu:h200:1(IDX:1),shard:h200:7(7/14,0/14) NodeAddr=127.0.0.1 NodeHostName=localhost Version=24.11.5 OS=Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=16000 AllocMem=1000 FreeMem=12096 Sockets=16 Boards=1 State=MIXED ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=gpu,interactive,cpu  BootTime=1796131551 SlurmdStartTime=1796171185 LastBusyTime=1796171187 ResumeAfterTime=None CfgTRES=cpu=16,mem=16000M,billing=16,gres/gpu=2,gres/shard=28 AllocTRES=cpu=2,mem=1000M,gres/gpu=1,gres/shard=7 CurrentWatts=0 AveWatts=0 ";

    #[test]
    fn node_line_24_11() {
        let (nodes, errs) = parse_nodes(NODE_MIXED_2411);
        assert!(errs.is_empty(), "{errs:?}");
        let n = &nodes["gpu01"];
        assert_eq!((n.state.as_str(), n.reason.as_str(), n.cpus_alloc, n.cpus_total), ("mixed", "", 2, 16));
        assert_eq!((n.mem_total_bytes, n.mem_alloc_bytes), (16000 << 20, 1000 << 20));
        assert_eq!((n.configured, n.used), (NodeGres { gpus: 2, shards: 28 }, Some(NodeGres { gpus: 1, shards: 7 })));
    }

    #[test]
    fn node_states_as_dashboards_show_them() {
        for (raw, want) in [
            ("IDLE", "idle"),
            ("MIXED", "mixed"),
            ("ALLOCATED", "allocated"),
            ("IDLE+DRAIN", "drained"),
            ("DOWN+DRAIN", "drained"),
            ("ALLOCATED+DRAIN", "draining"),
            ("DOWN*", "down"),
            ("IDLE*", "down"),
            ("DOWN+NOT_RESPONDING", "down"),
            ("IDLE+COMPLETING", "completing"),
            ("MIXED+FAIL", "failing"),
            ("IDLE+MAINT", "maint"),
            ("IDLE+RESERVED", "reserved"),
            ("FUTURE", "future"),
            ("WHATEVER", "unknown"),
        ] {
            assert_eq!(node_state(raw), want, "{raw}");
        }
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
