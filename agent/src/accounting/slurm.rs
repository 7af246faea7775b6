//! What Slurm itself says about a job: the allocation the agent bills (see
//! [`crate::accounting::reconcile`]), read from slurmctld and slurmdbd, never from a job's
//! environment.
//!
//! - `scontrol show job -d -o` (all jobs slurmctld knows, one line each; running jobs carry one
//!   `Nodes=... GRES=gpu:h200:2(IDX:0-1)` section per node group, shard jobs
//!   `GRES=shard:h200:7(IDX:0)` on 22.05 or `shard:h200:7(7/14,0/14)` on later releases;
//!   finished jobs still listed (`MinJobAge`) keep only the job-wide `TRES=...,gres/gpu=2`, which
//!   23.02 and later print as `AllocTRES=` beside `ReqTRES=`).
//! - `sacct -n -P -X -o JobIDRaw,AllocTRES,Account,Partition,NodeList,Start,End,State,User,UID`
//!   for jobs slurmctld no longer knows: counts, no GPU indices.
//!
//! Both run with `SLURM_TIME_FORMAT=%s` (times as Unix seconds), `LC_ALL=C` and the telemetry
//! timeout (`telemetry.slurm_timeout_ms`), off the async runtime. One `scontrol` per call for
//! all jobs, and `sacct` only for the ids scontrol lacks, in chunks: a burst of 1,000 records
//! costs one or two commands, not 1,000.
//!
//! Free text a user controls (the job name, `--comment`, the command) is printed by `scontrol`
//! unquoted in the same line; a line in which a field the agent reads occurs twice, or a
//! per-node section lies outside its place, is refused as ambiguous and the job is looked up
//! in `sacct` (whose `-P` fields here are all Slurm's own) instead.
//!
//! The telemetry sampler runs the same `scontrol show job` and `squeue --json` every
//! `telemetry.slurm_interval_ms`; each look is kept ([`LastLook`]) and a reconciliation reuses
//! one younger than its interval instead of asking slurmctld again, so a node asks slurmctld
//! for every job once per interval, not twice. A new job's verification always looks anew.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::telemetry::slurm::{CommandError, run_command_env};

/// Where an allocation came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Slurmctld,
    Sacct,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Slurmctld => "slurmctld",
            Source::Sacct => "sacct",
        }
    }
}

/// GPUs of a job on one node, with indices (`scontrol -d` of a running job).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeAlloc {
    /// Whole GPUs (node-global indices).
    pub gpus: BTreeSet<u32>,
    /// GPU index -> shards the job holds on it.
    pub shards: BTreeMap<u32, u32>,
}

/// One job as Slurm knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmJob {
    pub job_id: u32,
    pub source: Source,
    /// `RUNNING`, `COMPLETING`, `COMPLETED`, `CANCELLED` (first word of sacct's `CANCELLED by 0`), ...
    pub state: String,
    pub user: String,
    pub uid: Option<u32>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub node_list: String,
    pub start_us: Option<i64>,
    pub end_us: Option<i64>,
    /// Job-wide totals (`TRES` / `AllocTRES`).
    pub gpus: u32,
    pub shards: u32,
    /// Job-wide CPUs and memory (`NumCPUs` and `TRES` `mem=` / `AllocTRES`); for a pending job
    /// what it asks for.
    pub cpus: u32,
    pub mem_bytes: u64,
    /// Why a pending job waits (`Reason=`, e.g. `Resources`); `None` when Slurm says none or
    /// (sacct) does not say.
    pub reason: Option<String>,
    /// Per-node allocation with indices (running jobs in `scontrol -d` only).
    pub per_node: BTreeMap<String, NodeAlloc>,
}

/// What a job holds on one node, as billed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alloc {
    pub gpus: u32,
    pub shards: u32,
    /// With GPU indices when slurmctld gave them.
    pub indices: Option<NodeAlloc>,
}

/// States in which a job holds its allocation (it started and has not ended).
pub fn is_live(state: &str) -> bool {
    matches!(state, "RUNNING" | "COMPLETING" | "SUSPENDED" | "CONFIGURING" | "STOPPED" | "RESIZING" | "SIGNALING" | "STAGE_OUT")
}

/// States after a job's end.
pub fn is_finished(state: &str) -> bool {
    matches!(
        state,
        "COMPLETED"
            | "CANCELLED"
            | "FAILED"
            | "TIMEOUT"
            | "NODE_FAIL"
            | "PREEMPTED"
            | "BOOT_FAIL"
            | "DEADLINE"
            | "OUT_OF_MEMORY"
            | "REVOKED"
            | "SPECIAL_EXIT"
    )
}

impl SlurmJob {
    /// True when the job ran (or runs) on one of `nodes`.
    pub fn on_any(&self, nodes: &BTreeSet<String>) -> bool {
        self.per_node.keys().chain(std::iter::once(&self.node_list)).any(|l| expand_hostlist(l).iter().any(|n| nodes.contains(n)))
    }

    /// The allocation on one of `nodes`, or `None` when the job did not run there.
    pub fn alloc_on(&self, nodes: &BTreeSet<String>) -> Option<Alloc> {
        for (group, na) in &self.per_node {
            if expand_hostlist(group).iter().any(|n| nodes.contains(n)) {
                let shards = na.shards.values().sum();
                return Some(Alloc { gpus: u32::try_from(na.gpus.len()).unwrap_or(u32::MAX), shards, indices: Some(na.clone()) });
            }
        }
        let all = expand_hostlist(&self.node_list);
        if !all.iter().any(|n| nodes.contains(n)) {
            return None;
        }
        // Job-wide totals: per node on a homogeneous multi-node job.
        let n = u32::try_from(all.len().max(1)).unwrap_or(1);
        Some(Alloc { gpus: self.gpus / n, shards: self.shards / n, indices: None })
    }
}

/// Expands a Slurm host list: `gpu01`, `gpu[01-03,05]`, `a1,b[1-2]`. At most 4096 names.
pub fn expand_hostlist(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    for item in crate::util::split_outside(s, '[', ']') {
        let (Some(open), Some(close)) = (item.find('['), item.rfind(']')) else {
            out.push(item.to_string());
            continue;
        };
        if close < open {
            continue;
        }
        let (prefix, suffix) = (&item[..open], &item[close + 1..]);
        for range in item[open + 1..close].split(',') {
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            let width = a.len();
            if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                for n in a..=b.min(a.saturating_add(4096)) {
                    out.push(format!("{prefix}{n:0width$}{suffix}"));
                    if out.len() >= 4096 {
                        return out;
                    }
                }
            }
        }
    }
    out
}

/// Parses one node's `GRES=` of `scontrol show job -d`: `gpu:h200:2(IDX:0-1)`,
/// `shard:h200:2(IDX:0)` (22.05), `shard:h200:7(7/14,0/14)` (per GPU: held/configured), or
/// several of them comma-separated. `None` when a GPU count has no indices.
pub fn parse_node_gres(s: &str) -> Option<NodeAlloc> {
    let mut na = NodeAlloc::default();
    for item in crate::util::split_outside(s, '(', ')') {
        let (head, inner) = match item.split_once('(') {
            Some((h, rest)) => (h, rest.trim_end_matches(')')),
            None => (item, ""),
        };
        let mut parts = head.split(':');
        let name = parts.next().unwrap_or("");
        let rest: Vec<&str> = parts.collect();
        let count = match rest.last() {
            Some(last) => last.parse::<u32>().unwrap_or(if rest.len() == 1 { 1 } else { 0 }),
            None => 1,
        };
        if count == 0 || (name != "gpu" && name != "shard") {
            continue;
        }
        let idx = inner.strip_prefix("IDX:").map(gpuhub_wire::spool::parse_index_list);
        match (name, idx) {
            ("gpu", Some(idx)) if !idx.is_empty() => na.gpus.extend(idx),
            ("gpu", _) => return None,
            ("shard", Some(idx)) if !idx.is_empty() => {
                // 22.05 names the GPU(s), not the split: all on the first (shards of one job
                // sit on one GPU unless MULTIPLE_SHARING_GRES_PJ).
                *na.shards.entry(idx[0]).or_default() += count;
            }
            _ if inner.contains('/') => {
                for (i, per) in inner.split(',').enumerate() {
                    let held = per.split('/').next().and_then(|h| h.trim().parse::<u32>().ok()).unwrap_or(0);
                    if held > 0 {
                        *na.shards.entry(u32::try_from(i).unwrap_or(u32::MAX)).or_default() += held;
                    }
                }
            }
            _ => return None,
        }
    }
    Some(na)
}

/// Memory of a TRES list (`mem=500M`, `mem=2G`; Slurm's units are binary, M = MiB), in bytes.
pub fn parse_tres_mem(s: &str) -> u64 {
    s.split(',').find_map(|kv| kv.trim().strip_prefix("mem=")).map(parse_slurm_size).unwrap_or(0)
}

/// A Slurm size: a number with an optional K/M/G/T/P suffix (binary; no suffix = MiB, as
/// Slurm's memory options read it). Unparseable: 0.
pub fn parse_slurm_size(v: &str) -> u64 {
    let v = v.trim();
    let (num, mult) = match v.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                'P' => 50,
                _ => return 0,
            };
            (&v[..i], 1u64 << shift)
        }
        _ => (v, 1u64 << 20),
    };
    match num.parse::<f64>() {
        Ok(n) if n.is_finite() && n >= 0.0 => (n * mult as f64) as u64,
        _ => 0,
    }
}

/// GPU and shard totals of a TRES list: `cpu=1,mem=500M,node=1,billing=1,gres/gpu=2`
/// (`gres/gpu:h200=2` counts when the untyped total is missing).
pub fn parse_tres(s: &str) -> (u32, u32) {
    let (mut g, mut s_, mut gt, mut st) = (None, None, 0u32, 0u32);
    for kv in s.split(',') {
        let Some((k, v)) = kv.split_once('=') else { continue };
        let Ok(n) = v.trim().parse::<u32>() else { continue };
        match k.trim() {
            "gres/gpu" => g = Some(n),
            "gres/shard" => s_ = Some(n),
            k if k.starts_with("gres/gpu:") => gt = gt.saturating_add(n),
            k if k.starts_with("gres/shard:") => st = st.saturating_add(n),
            _ => {}
        }
    }
    (g.unwrap_or(gt), s_.unwrap_or(st))
}

fn time_s(v: &str) -> Option<i64> {
    v.trim().parse::<i64>().ok().filter(|t| *t > 0).map(|t| t * 1_000_000)
}

fn null(v: &str) -> Option<String> {
    match v.trim() {
        "" | "(null)" | "N/A" | "None" => None,
        v => Some(v.to_string()),
    }
}

/// A line of Slurm output that was not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{command}: line {line}: {problem}")]
pub struct LineError {
    pub command: &'static str,
    pub line: usize,
    pub problem: String,
}

/// Parses `scontrol show job -d -o` (run with `SLURM_TIME_FORMAT=%s`). A job id printed on two
/// lines (a job name with a newline) is dropped on both.
pub fn parse_scontrol(text: &str) -> (BTreeMap<u32, SlurmJob>, Vec<LineError>) {
    let mut jobs = BTreeMap::new();
    let mut errors = Vec::new();
    let mut dup = BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line == "No jobs in the system" {
            continue;
        }
        match parse_scontrol_line(line) {
            Ok(j) => {
                if jobs.contains_key(&j.job_id) {
                    dup.insert(j.job_id);
                }
                jobs.insert(j.job_id, j);
            }
            Err(problem) => errors.push(LineError { command: "scontrol", line: i + 1, problem }),
        }
    }
    for id in dup {
        jobs.remove(&id);
        errors.push(LineError {
            command: "scontrol",
            line: 0,
            problem: format!("job {id} is printed twice (a job name with a newline?); looked up in sacct"),
        });
    }
    (jobs, errors)
}

/// What `squeue --json -t all` says of slurmctld's jobs: every id it has, and those with a line
/// break in any of their strings (a job name, a comment). JSON quotes them; `scontrol show job
/// -o` prints them raw, so what it prints for such a job is not one line of its own, and its
/// text can imitate whole lines of other jobs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SqueueIds {
    pub ids: BTreeSet<u32>,
    pub broken: BTreeSet<u32>,
}

/// Parses `squeue --json -t all` (Slurm 22.05's and 24.11's: `jobs[].job_id` is a number in both).
pub fn parse_squeue_json(text: &str) -> Result<SqueueIds, String> {
    fn has_line_break(v: &serde_json::Value) -> bool {
        match v {
            serde_json::Value::String(s) => s.contains('\n'),
            serde_json::Value::Array(a) => a.iter().any(has_line_break),
            serde_json::Value::Object(o) => o.values().any(has_line_break),
            _ => false,
        }
    }
    let v: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("squeue --json printed no JSON ({e})"))?;
    let jobs = v.get("jobs").and_then(|j| j.as_array()).ok_or("squeue --json printed no `jobs` array")?;
    let mut out = SqueueIds::default();
    for j in jobs {
        let id = j.get("job_id").and_then(|i| i.as_u64()).and_then(|i| u32::try_from(i).ok());
        let Some(id) = id else { return Err("squeue --json printed a job without a numeric `job_id`".into()) };
        out.ids.insert(id);
        if has_line_break(j) {
            out.broken.insert(id);
        }
    }
    Ok(out)
}

/// Runs `squeue --json -t all` and parses it ([`parse_squeue_json`]).
pub fn read_squeue(squeue: &std::path::Path, timeout: Duration) -> Result<SqueueIds, String> {
    run_command_env(squeue, &["--json", "-t", "all"], &[], timeout).map_err(|e| e.to_string()).and_then(|text| parse_squeue_json(&text))
}

/// One look at slurmctld's jobs: what `scontrol show job -d -o` printed and what the `squeue
/// --json` taken with it says ([`vouch`]).
#[derive(Debug)]
pub struct JobLook {
    pub at: Instant,
    /// When it was taken (Unix microseconds, before scontrol ran).
    pub taken_us: i64,
    /// The binaries that printed it: a look is reused only by a reader of the same ones.
    pub scontrol: PathBuf,
    pub squeue: PathBuf,
    pub text: String,
    pub squeue_ids: Result<SqueueIds, String>,
}

/// A node's latest [`JobLook`], shared by the telemetry sampler and the accounting ingest.
#[derive(Debug, Clone, Default)]
pub struct LastLook(Arc<Mutex<Option<Arc<JobLook>>>>);

impl LastLook {
    /// Keeps `look` unless a later one is kept already (a slow command finished last).
    pub fn put(&self, look: JobLook) -> Arc<JobLook> {
        let look = Arc::new(look);
        let mut last = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.as_ref().is_none_or(|l| l.taken_us <= look.taken_us) {
            *last = Some(Arc::clone(&look));
        }
        look
    }

    /// The latest look, if taken less than `age` ago by `scontrol` and `squeue`.
    pub fn within(&self, age: Duration, scontrol: &Path, squeue: &Path) -> Option<Arc<JobLook>> {
        let last = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.as_ref().filter(|l| l.at.elapsed() < age && l.scontrol == scontrol && l.squeue == squeue).cloned()
    }
}

/// Keeps in `jobs` (parsed from `scontrol show job -o`, whose lines carried the ids `listed`)
/// only what squeue vouches for: a line for a job id slurmctld does not have is free text (a job
/// name with a line break that imitates a line) and is dropped; a job with a line break in its
/// text is dropped (looked up in sacct). Answers the jobs slurmctld has but no line of which
/// was used (not closed from this look), and what was dropped, for the log.
pub fn vouch(jobs: &mut BTreeMap<u32, SlurmJob>, listed: &BTreeSet<u32>, sq: &SqueueIds) -> (BTreeSet<u32>, Vec<String>) {
    let mut problems = Vec::new();
    jobs.retain(|id, _| {
        if !sq.ids.contains(id) {
            problems
                .push(format!("scontrol printed a line for job {id}, which squeue does not list (a job name with a line break?); ignored"));
            false
        } else {
            !sq.broken.contains(id)
        }
    });
    for id in &sq.broken {
        problems
            .push(format!("job {id} has a line break in its name or comment; scontrol's lines for it are not used (looked up in sacct)"));
    }
    let unsure = listed.iter().chain(&sq.broken).filter(|id| sq.ids.contains(id) && !jobs.contains_key(id)).copied().collect();
    (unsure, problems)
}

/// The job id at the start of every line of `scontrol show job -o` that has one, used or not.
pub fn listed_ids(text: &str) -> BTreeSet<u32> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix("JobId="))
        .filter_map(|rest| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .collect()
}

/// Fields read from a line; each must occur once, before the per-node sections' end.
const ONCE: &[&str] =
    &["JobId", "UserId", "Account", "JobState", "Reason", "StartTime", "EndTime", "Partition", "NodeList", "NumCPUs", "MinCPUsNode"];

/// The job-wide allocation's key: `TRES=` up to Slurm 22.05, `AllocTRES=` (beside `ReqTRES=`)
/// since 23.02 (24.11 prints no `TRES=`). Exactly one of the two must occur, once: a line with
/// both (free text that imitates the other release's field) is as ambiguous as a doubled field.
fn tres_key(fields: &[(&str, String)]) -> Result<&'static str, String> {
    let count = |k: &str| fields.iter().filter(|f| f.0 == k).count();
    match (count("TRES"), count("AllocTRES")) {
        (1, 0) => Ok("TRES"),
        (0, 1) => Ok("AllocTRES"),
        (t, a) => Err(format!(
            "TRES= occurs {t} times and AllocTRES= {a} times, expected exactly one of them once (TRES= up to Slurm 22.05, AllocTRES= since 23.02; free text that imitates scontrol's fields?); looked up in sacct"
        )),
    }
}

fn parse_scontrol_line(line: &str) -> Result<SlurmJob, String> {
    // key=value tokens; a token without `=` continues the previous value (a name with spaces).
    let mut fields: Vec<(&str, String)> = Vec::new();
    for tok in line.split_ascii_whitespace() {
        match tok.split_once('=') {
            Some((k, v)) if !k.is_empty() => fields.push((k, v.to_string())),
            _ => {
                if let Some(last) = fields.last_mut() {
                    last.1.push(' ');
                    last.1.push_str(tok);
                }
            }
        }
    }
    if fields.first().map(|f| f.0) != Some("JobId") {
        return Err("does not start with JobId=".into());
    }
    let pos = |k: &str| fields.iter().position(|f| f.0 == k);
    for k in ONCE {
        let n = fields.iter().filter(|f| f.0 == *k).count();
        if n != 1 {
            return Err(format!("{k}= occurs {n} times (free text that imitates scontrol's fields?); looked up in sacct"));
        }
    }
    let tres = tres_key(&fields)?;
    let get = |k: &str| pos(k).map(|p| fields[p].1.as_str()).unwrap_or("");
    let (tres_at, min_at) = (pos(tres).unwrap_or(0), pos("MinCPUsNode").unwrap_or(0));
    let job_id: u32 = get("JobId").trim().parse().map_err(|_| format!("JobId={} is not a number", get("JobId")))?;
    let (user, uid) = match get("UserId").split_once('(') {
        Some((name, rest)) => (name.to_string(), rest.trim_end_matches(')').parse::<u32>().ok()),
        None => (get("UserId").to_string(), None),
    };
    let (gpus, shards) = parse_tres(get(tres));
    let mut per_node = BTreeMap::new();
    let mut current: Option<String> = None;
    for (i, (k, v)) in fields.iter().enumerate() {
        match *k {
            "Nodes" | "GRES" if i < tres_at || i > min_at => {
                return Err(format!("{k}= outside the per-node sections (free text that imitates scontrol's fields?); looked up in sacct"));
            }
            "Nodes" => current = Some(v.clone()),
            "GRES" => {
                let Some(node) = current.take() else {
                    return Err("GRES= without Nodes=".into());
                };
                // A finished job's sections have an empty GRES=: no indices, totals stand.
                if v.trim().is_empty() {
                    continue;
                }
                match parse_node_gres(v) {
                    Some(na) => {
                        per_node.insert(node, na);
                    }
                    None => return Err(format!("GRES={v} for {node}: GPUs without indices")),
                }
            }
            _ => {}
        }
    }
    Ok(SlurmJob {
        job_id,
        source: Source::Slurmctld,
        state: get("JobState").trim().to_string(),
        user,
        uid,
        account: null(get("Account")),
        partition: null(get("Partition")),
        node_list: null(get("NodeList")).unwrap_or_default(),
        start_us: time_s(get("StartTime")),
        end_us: time_s(get("EndTime")),
        gpus,
        shards,
        cpus: get("NumCPUs").trim().parse().unwrap_or(0),
        mem_bytes: parse_tres_mem(get(tres)),
        reason: null(get("Reason")),
        per_node,
    })
}

/// `sacct` fields, in this order. `JobIDRaw`: an array task's own job id (what slurmctld,
/// `SLURM_JOB_ID` and the records carry), where `JobID` prints `12_3`.
pub const SACCT_FIELDS: &str = "JobIDRaw,AllocTRES,Account,Partition,NodeList,Start,End,State,User,UID";

/// Parses `sacct -n -P -X -o SACCT_FIELDS` (with `SLURM_TIME_FORMAT=%s`); a line whose id is
/// not a number is skipped. A job listed more than once (`--duplicates`: a requeued job's
/// runs, oldest first) keeps its last line.
pub fn parse_sacct(text: &str) -> (BTreeMap<u32, SlurmJob>, Vec<LineError>) {
    let (lines, errors) = parse_sacct_lines(text);
    (by_id(lines), errors)
}

/// sacct's lines by job id: a job listed twice (its runs, with `-D`) keeps its last line.
fn by_id(lines: Vec<SlurmJob>) -> BTreeMap<u32, SlurmJob> {
    lines.into_iter().map(|j| (j.job_id, j)).collect()
}

/// Every line of [`parse_sacct`]'s input, in order.
pub fn parse_sacct_lines(text: &str) -> (Vec<SlurmJob>, Vec<LineError>) {
    let mut jobs = Vec::new();
    let mut errors = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split('|').collect();
        if f.len() != 10 {
            errors.push(LineError { command: "sacct", line: i + 1, problem: format!("expected 10 |-separated fields, got {}", f.len()) });
            continue;
        }
        let Ok(job_id) = f[0].trim().parse::<u32>() else { continue };
        let (gpus, shards) = parse_tres(f[1]);
        jobs.push(SlurmJob {
            job_id,
            source: Source::Sacct,
            state: f[7].split_whitespace().next().unwrap_or("").to_string(),
            user: f[8].trim().to_string(),
            uid: f[9].trim().parse().ok(),
            account: null(f[2]),
            partition: null(f[3]),
            node_list: null(f[4]).filter(|n| n != "None assigned").unwrap_or_default(),
            start_us: time_s(f[5]),
            end_us: time_s(f[6]),
            gpus,
            shards,
            cpus: f[1].split(',').find_map(|kv| kv.trim().strip_prefix("cpu=")).and_then(|v| v.parse().ok()).unwrap_or(0),
            mem_bytes: parse_tres_mem(f[1]),
            reason: None,
            per_node: BTreeMap::new(),
        });
    }
    (jobs, errors)
}

/// One look at Slurm.
#[derive(Debug, Clone, Default)]
pub struct SlurmState {
    /// When the look started (Unix microseconds).
    pub taken_us: i64,
    /// slurmctld answered (then a job missing from `ctld` is not running).
    pub ctld_ok: bool,
    /// Every job slurmctld listed.
    pub ctld: BTreeMap<u32, SlurmJob>,
    /// Jobs slurmctld listed on a line that was not used (free text that imitates its fields,
    /// a job printed twice): it still knows them, so they are not closed from this look.
    pub ctld_unsure: BTreeSet<u32>,
    /// sacct answered for the ids asked.
    pub acct_ok: bool,
    /// Jobs sacct listed (asked by id, or ran on this node since a time).
    pub acct: BTreeMap<u32, SlurmJob>,
    /// The runs that ended of the jobs asked for that slurmctld lists pending again, or running
    /// or ended on another node (Slurm requeued them; `sacct --duplicates`): each earlier run.
    pub ended_runs: BTreeMap<u32, Vec<SlurmJob>>,
    /// What failed, for the log.
    pub errors: Vec<String>,
}

impl SlurmState {
    /// The best record of a job: slurmctld's, else sacct's.
    pub fn job(&self, id: u32) -> Option<&SlurmJob> {
        self.ctld.get(&id).or_else(|| self.acct.get(&id))
    }
}

/// Asks Slurm. [`CommandSlurm`] in the agent, a fixed state in tests. Blocking.
pub trait SlurmSource: Send + Sync {
    /// slurmctld's jobs, and sacct's for the ids of `want` slurmctld does not list; with
    /// `since_us`, also every job sacct saw on `node` since then.
    fn query(&self, want: &[u32], since_us: Option<i64>) -> SlurmState;

    /// As [`SlurmSource::query`], from a look at slurmctld taken less than `age` ago if there
    /// is one (a reconciliation: its `taken_us` is then that look's).
    fn query_reusing(&self, want: &[u32], since_us: Option<i64>, age: Duration) -> SlurmState {
        let _ = age;
        self.query(want, since_us)
    }
}

/// The commands.
#[derive(Debug, Clone)]
pub struct CommandSlurm {
    pub scontrol: PathBuf,
    /// `squeue --json`: which of scontrol's lines are slurmctld's own ([`vouch`]).
    pub squeue: PathBuf,
    pub sacct: PathBuf,
    pub timeout: Duration,
    /// The Slurm node name (`telemetry.slurm_node_name`), for `sacct -N`.
    pub node: String,
    /// The node's latest look at slurmctld's jobs, the telemetry sampler's or this source's.
    pub last_look: LastLook,
}

const SACCT_CHUNK: usize = 500;

impl CommandSlurm {
    /// `sacct -n -P -X -o SACCT_FIELDS ARGS`, every line parsed (line errors go to `st`).
    fn sacct_lines(&self, args: &[&str], st: &mut SlurmState) -> Result<Vec<SlurmJob>, String> {
        let mut all = vec!["-n", "-P", "-X", "-o", SACCT_FIELDS];
        all.extend_from_slice(args);
        let out = run_command_env(&self.sacct, &all, &[("SLURM_TIME_FORMAT", "%s")], self.timeout).map_err(|e| e.to_string())?;
        let (lines, errs) = parse_sacct_lines(&out);
        st.errors.extend(errs.iter().map(ToString::to_string));
        Ok(lines)
    }

    fn sacct(&self, args: &[&str], st: &mut SlurmState) {
        match self.sacct_lines(args, st) {
            Ok(lines) => {
                for (id, j) in by_id(lines) {
                    st.acct.entry(id).or_insert(j);
                }
            }
            Err(e) => {
                st.acct_ok = false;
                st.errors.push(format!("{e} (accounting falls back to the plugin's records for jobs slurmctld no longer lists)"));
            }
        }
    }
}

impl CommandSlurm {
    /// Every run sacct has of `ids` (`--duplicates`), those that ended into `st.ended_runs`.
    fn ended_runs(&self, ids: &str, st: &mut SlurmState) {
        match self.sacct_lines(&["-D", "-j", ids], st) {
            Ok(runs) => {
                for run in runs.into_iter().filter(|r| r.start_us.is_some() && r.end_us.is_some()) {
                    st.ended_runs.entry(run.job_id).or_default().push(run);
                }
            }
            Err(e) => st.errors.push(format!("{e} (a requeued job's earlier run is closed at the last look that listed it running)")),
        }
    }
}

/// Takes a [`JobLook`] with `scontrol` and `squeue` and keeps it in `last`; `Err` when
/// scontrol fails (slurmctld down).
pub fn take_job_look(scontrol: &Path, squeue: &Path, timeout: Duration, last: &LastLook) -> Result<Arc<JobLook>, CommandError> {
    let (at, taken_us) = (Instant::now(), crate::util::now_us());
    let text = run_command_env(scontrol, &["show", "job", "-d", "-o"], &[("SLURM_TIME_FORMAT", "%s")], timeout)?;
    let squeue_ids = read_squeue(squeue, timeout);
    Ok(last.put(JobLook { at, taken_us, scontrol: scontrol.to_path_buf(), squeue: squeue.to_path_buf(), text, squeue_ids }))
}

impl CommandSlurm {
    fn answer(&self, want: &[u32], since_us: Option<i64>, reuse: Option<Duration>) -> SlurmState {
        let mut st = SlurmState { taken_us: crate::util::now_us(), acct_ok: true, ..SlurmState::default() };
        let look = match reuse.and_then(|age| self.last_look.within(age, &self.scontrol, &self.squeue)) {
            Some(look) => Ok(look),
            None => take_job_look(&self.scontrol, &self.squeue, self.timeout, &self.last_look),
        };
        match look {
            Ok(look) => {
                st.taken_us = look.taken_us;
                let (mut jobs, errs) = parse_scontrol(&look.text);
                st.ctld_ok = true;
                st.errors.extend(errs.iter().map(ToString::to_string));
                let listed = listed_ids(&look.text);
                match &look.squeue_ids {
                    Ok(sq) => {
                        let (unsure, problems) = vouch(&mut jobs, &listed, sq);
                        st.ctld_unsure = unsure;
                        st.errors.extend(problems);
                    }
                    Err(e) => {
                        st.ctld_unsure = listed.into_iter().filter(|id| !jobs.contains_key(id)).collect();
                        st.errors.push(format!(
                            "{e} (without it, lines scontrol prints for a job name with a line break cannot be told from slurmctld's own)"
                        ));
                    }
                }
                st.ctld = jobs;
            }
            // `scontrol show job` with no jobs at all exits 0; a failure is slurmctld down.
            Err(e) => st.errors.push(format!("{e} (check that slurmctld answers `scontrol ping`)")),
        }
        let missing: Vec<String> = want.iter().filter(|id| !st.ctld.contains_key(id)).map(u32::to_string).collect();
        for chunk in missing.chunks(SACCT_CHUNK) {
            let ids = chunk.join(",");
            self.sacct(&["-j", &ids], &mut st);
        }
        // Requeued: pending again, or running or ended on another node (then its run here
        // ended before, and sacct knows when).
        let here = BTreeSet::from([self.node.clone()]);
        let rerun: Vec<String> = want
            .iter()
            .filter(|id| st.ctld.get(id).is_some_and(|j| !j.on_any(&here) || !(is_live(&j.state) || is_finished(&j.state))))
            .map(u32::to_string)
            .collect();
        for chunk in rerun.chunks(SACCT_CHUNK) {
            self.ended_runs(&chunk.join(","), &mut st);
        }
        if let Some(since) = since_us {
            let ago = format!("now-{}", ((st.taken_us - since) / 1_000_000).max(1) + 60);
            let node = self.node.clone();
            self.sacct(&["-a", "-N", &node, "-S", &ago, "-E", "now", "-s", "R,CD,CA,F,TO,NF,PR,OOM,DL,BF,RQ,S"], &mut st);
        }
        st
    }
}

impl SlurmSource for CommandSlurm {
    fn query(&self, want: &[u32], since_us: Option<i64>) -> SlurmState {
        self.answer(want, since_us, None)
    }

    fn query_reusing(&self, want: &[u32], since_us: Option<i64>, age: Duration) -> SlurmState {
        self.answer(want, since_us, Some(age))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    // Captured on the lab (Slurm 22.05, `SLURM_TIME_FORMAT=%s scontrol show job -d -o`); long
    // tails cut after MinMemoryCPU where they do not matter.
    const RUNNING_SHARD: &str = "JobId=22 JobName=gpuhub-worker-mt-chat UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901738 Nice=0 Account=root QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=1796120479 EligibleTime=1796120479 AccrueTime=1796120479 StartTime=1796120479 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796120479 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:1132 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=500M,node=1,billing=1,gres/shard=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=shard:h200:2   Nodes=gpu01 CPU_IDs=15 Mem=500 GRES=shard:h200:2(IDX:0) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=/var/tmp/gpuhub-models-test.JM5wGz/workers/mt-chat.sbatch WorkDir=/work/main Comment=gpuhub-worker:/var/tmp/gpuhub-models-test.JM5wGz/workers  StdErr=/var/tmp/x.log StdIn=/dev/null StdOut=/var/tmp/x.log Power= TresPerNode=gres:shard:2 ";
    const DONE_GPU2: &str = "JobId=15 JobName=acct-gpu2 UserId=gpuhublab(1001) GroupId=gpuhublab(1001) MCS_label=N/A Priority=4294901745 Nice=0 Account=(null) QOS=normal JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:02 TimeLimit=00:02:00 TimeMin=N/A SubmitTime=1796120410 EligibleTime=1796120410 AccrueTime=1796120410 StartTime=1796120410 EndTime=1796120412 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796120410 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:1132 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=500M,node=1,billing=1,gres/gpu=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:h200:2   Nodes=gpu01 CPU_IDs=0 Mem=500 GRES= MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=sh WorkDir=/tmp Power= TresPerNode=gres:gpu:2 ";

    const RUNNING_GPU2: &str = "JobId=77 JobName=acct-gpu2 UserId=gpuhublab(1001) GroupId=gpuhublab(1001) MCS_label=N/A Priority=4294901683 Nice=0 Account=(null) QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:00 TimeLimit=00:02:00 TimeMin=N/A SubmitTime=1796121759 EligibleTime=1796121759 AccrueTime=1796121759 StartTime=1796121759 EndTime=1796121879 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796121759 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:1132 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=1,mem=500M,node=1,billing=1,gres/gpu=2 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:h200:2   Nodes=gpu01 CPU_IDs=0 Mem=500 GRES=gpu:h200:2(IDX:0-1) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=sh WorkDir=/tmp Power= TresPerNode=gres:gpu:2";

    // Captured on the lab's Slurm 24.11 leg (tests/lab/slurm24.sh: Debian 13's 24.11.5, no
    // AccountingStorageTRES then, so AllocTRES carries no gres): no `TRES=`, but `ReqTRES=` and
    // `AllocTRES=`; shards per GPU as held/configured.
    const RUNNING_SHARD7_2411: &str = "JobId=5 JobName=acct-shard7 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:04 TimeLimit=00:01:00 TimeMin=N/A SubmitTime=1796158847 EligibleTime=1796158847 AccrueTime=Unknown StartTime=1796158847 EndTime=1796158907 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796158847 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:26710 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=500M,node=1,billing=1 AllocTRES=cpu=1,mem=500M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=shard:h200:7   Nodes=gpu01 CPU_IDs=0 Mem=500 GRES=shard:h200:7(7/14,0/14) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=sleep WorkDir=/tmp TresPerNode=gres/shard:7";
    const RUNNING_GPU1_2411: &str = "JobId=6 JobName=acct-gpu1 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 Account=(null) QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=0 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:04 TimeLimit=00:01:00 TimeMin=N/A SubmitTime=1796158847 EligibleTime=1796158847 AccrueTime=Unknown StartTime=1796158847 EndTime=1796158907 Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796158847 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:26710 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=500M,node=1,billing=1 AllocTRES=cpu=1,mem=500M,node=1,billing=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:h200:1   Nodes=gpu01 CPU_IDs=1 Mem=500 GRES=gpu:h200:1(IDX:1) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=sleep WorkDir=/tmp TresPerNode=gres/gpu:1";

    // Captured on the lab's Slurm 24.11 leg with slurmdbd (tests/lab/slurm24.sh: Debian 13's 24.11.5
    // on the host, AccountingStorageTRES=gres/gpu,gres/shard as on 22.05): AllocTRES carries the gres.
    const RUNNING_SHARD7_2411_DBD: &str = "JobId=24000002 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 Account=lab QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=1796171187 EligibleTime=1796171187 AccrueTime=1796171187 StartTime=1796171188 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796171188 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:607 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=500M,node=1,billing=1,gres/shard=7 AllocTRES=cpu=1,mem=500M,node=1,billing=1,gres/shard=7 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=shard:h200:7   Nodes=gpu01 CPU_IDs=0 Mem=500 GRES=shard:h200:7(7/14,0/14) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp StdErr=/tmp/slurm-24000002.out StdIn=/dev/null StdOut=/tmp/slurm-24000002.out TresPerNode=gres/shard:7 ";
    const RUNNING_GPU1_2411_DBD: &str = "JobId=24000003 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=1 Nice=0 Account=lab QOS=normal JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0 DerivedExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=1796171187 EligibleTime=1796171187 AccrueTime=1796171187 StartTime=1796171188 EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 LastSchedEval=1796171188 Scheduler=Main Partition=gpu AllocNode:Sid=localhost:607 ReqNodeList=(null) ExcNodeList=(null) NodeList=gpu01 BatchHost=gpu01 NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:* ReqTRES=cpu=1,mem=500M,node=1,billing=1,gres/gpu=1 AllocTRES=cpu=1,mem=500M,node=1,billing=1,gres/gpu=1 Socks/Node=* NtasksPerN:B:S:C=0:0:*:* CoreSpec=* JOB_GRES=gpu:h200:1   Nodes=gpu01 CPU_IDs=1 Mem=500 GRES=gpu:h200:1(IDX:1) MinCPUsNode=1 MinMemoryCPU=500M MinTmpDiskNode=0 Features=(null) DelayBoot=00:00:00 OverSubscribe=OK Contiguous=0 Licenses=(null) Network=(null) Command=(null) WorkDir=/tmp StdErr=/tmp/slurm-24000003.out StdIn=/dev/null StdOut=/tmp/slurm-24000003.out TresPerNode=gres/gpu:1 ";

    fn nodes(n: &[&str]) -> BTreeSet<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn scontrol_running_shard_job_and_finished_gpu_job() {
        let (jobs, errs) = parse_scontrol(&format!("{RUNNING_SHARD}\n{DONE_GPU2}\n"));
        assert!(errs.is_empty(), "{errs:?}");
        let j = &jobs[&22];
        assert_eq!((j.user.as_str(), j.uid, j.account.as_deref(), j.partition.as_deref()), ("root", Some(0), Some("root"), Some("gpu")));
        assert_eq!((j.state.as_str(), j.start_us, j.end_us), ("RUNNING", Some(1_796_120_479_000_000), None));
        assert_eq!((j.gpus, j.shards), (0, 2));
        assert_eq!((j.cpus, j.mem_bytes, j.reason.as_deref()), (1, 500 << 20, None), "Reason=None is no reason");
        let a = j.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!((a.gpus, a.shards), (0, 2));
        assert_eq!(a.indices.unwrap().shards, BTreeMap::from([(0, 2)]));
        assert!(j.alloc_on(&nodes(&["gpu02"])).is_none());
        let d = &jobs[&15];
        assert_eq!((d.user.as_str(), d.uid, d.account.clone()), ("gpuhublab", Some(1001), None), "Account=(null) is no account");
        assert_eq!((d.end_us, d.gpus, d.state.as_str()), (Some(1_796_120_412_000_000), 2, "COMPLETED"));
        let a = d.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!((a.gpus, a.shards, a.indices), (2, 0, None), "a finished job keeps counts, not indices");
    }

    #[test]
    fn scontrol_24_11_lines_without_tres() {
        let (jobs, errs) = parse_scontrol(&format!("{RUNNING_SHARD7_2411}\n{RUNNING_GPU1_2411}\n"));
        assert!(errs.is_empty(), "{errs:?}");
        let s = &jobs[&5];
        assert_eq!((s.user.as_str(), s.uid, s.state.as_str(), s.partition.as_deref()), ("root", Some(0), "RUNNING", Some("gpu")));
        assert_eq!((s.start_us, s.cpus, s.mem_bytes), (Some(1_796_158_847_000_000), 1, 500 << 20), "memory from AllocTRES");
        let a = s.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!((a.gpus, a.shards), (0, 7));
        assert_eq!(a.indices.unwrap().shards, BTreeMap::from([(0, 7)]));
        let g = &jobs[&6];
        let a = g.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!((a.gpus, a.shards), (1, 0));
        assert_eq!(a.indices.unwrap().gpus, BTreeSet::from([1]));
    }

    #[test]
    fn scontrol_24_11_with_slurmdbd_counts_from_alloc_tres() {
        let (jobs, errs) = parse_scontrol(&format!("{RUNNING_SHARD7_2411_DBD}\n{RUNNING_GPU1_2411_DBD}\n"));
        assert!(errs.is_empty(), "{errs:?}");
        let s = &jobs[&24_000_002];
        assert_eq!((s.gpus, s.shards, s.account.as_deref(), s.end_us), (0, 7, Some("lab"), None), "EndTime=Unknown is no end");
        assert_eq!((s.start_us, s.cpus, s.mem_bytes), (Some(1_796_171_188_000_000), 1, 500 << 20));
        let a = s.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!(a.indices.unwrap().shards, BTreeMap::from([(0, 7)]), "7/14 on GPU 0, 0/14 on GPU 1");
        let g = &jobs[&24_000_003];
        assert_eq!((g.gpus, g.shards), (1, 0));
        assert_eq!(g.alloc_on(&nodes(&["gpu01"])).unwrap().indices.unwrap().gpus, BTreeSet::from([1]));
    }

    #[test]
    fn sacct_lines_24_11() {
        // Captured on the 24.11 leg: SLURM_TIME_FORMAT=%s sacct -n -P -X -o SACCT_FIELDS (a gpu:1 and
        // a shard:7 srun of root and gpuhublab, then two running sbatch jobs).
        let text = "\
24000000|billing=1,cpu=1,gres/gpu=1,mem=500M,node=1|lab|gpu|gpu01|1796171187|1796171187|COMPLETED|root|0
24000001|billing=1,cpu=1,gres/shard=7,mem=500M,node=1|lab|gpu|gpu01|1796171187|1796171187|COMPLETED|gpuhublab|1001
24000002|billing=1,cpu=1,gres/shard=7,mem=500M,node=1|lab|gpu|gpu01|1796171188|Unknown|RUNNING|root|0
24000003|billing=1,cpu=1,gres/gpu=1,mem=500M,node=1|lab|gpu|gpu01|1796171188|Unknown|RUNNING|root|0
";
        let (jobs, errs) = parse_sacct(text);
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(jobs.len(), 4);
        assert_eq!((jobs[&24_000_000].gpus, jobs[&24_000_000].state.as_str()), (1, "COMPLETED"));
        let u = &jobs[&24_000_001];
        assert_eq!((u.shards, u.user.as_str(), u.uid, u.account.as_deref()), (7, "gpuhublab", Some(1001), Some("lab")));
        assert_eq!((jobs[&24_000_002].end_us, jobs[&24_000_002].state.as_str()), (None, "RUNNING"));
        assert_eq!(jobs[&24_000_003].alloc_on(&nodes(&["gpu01"])).unwrap().gpus, 1);
    }

    #[test]
    fn scontrol_tres_and_alloc_tres_together_are_refused() {
        // A job name that imitates the other release's field on either release: ambiguous.
        let fake_old = RUNNING_GPU1_2411.replace("JobName=acct-gpu1", "JobName=x TRES=cpu=1,gres/gpu=0");
        let fake_new = RUNNING_GPU2.replace("JobName=acct-gpu2", "JobName=x AllocTRES=cpu=1,gres/gpu=0");
        for line in [fake_old, fake_new] {
            let (jobs, errs) = parse_scontrol(&line);
            assert!(jobs.is_empty(), "{jobs:?}");
            assert!(errs[0].problem.contains("TRES= occurs 1 times and AllocTRES= 1 times"), "{errs:?}");
        }
        let (jobs, errs) = parse_scontrol(&RUNNING_GPU2.replace("TRES=", "XTRES="));
        assert!(jobs.is_empty() && errs[0].problem.contains("TRES= occurs 0 times and AllocTRES= 0 times"), "{errs:?}");
    }

    #[test]
    fn per_node_gres_forms() {
        let na = parse_node_gres("gpu:h200:2(IDX:0-1)").unwrap();
        assert_eq!(na.gpus, BTreeSet::from([0, 1]));
        let na = parse_node_gres("shard:h200:7(7/14,0/14)").unwrap();
        assert_eq!(na.shards, BTreeMap::from([(0, 7)]));
        let na = parse_node_gres("shard:h200:7(0/14,7/14)").unwrap();
        assert_eq!(na.shards, BTreeMap::from([(1, 7)]));
        let na = parse_node_gres("gpu:1(IDX:1),shard:h200:3(IDX:0)").unwrap();
        assert_eq!((na.gpus.clone(), na.shards.clone()), (BTreeSet::from([1]), BTreeMap::from([(0, 3)])));
        assert_eq!(parse_node_gres("gpu:h200:0(IDX:N/A)").unwrap(), NodeAlloc::default());
        assert!(parse_node_gres("gpu:h200:2").is_none(), "GPUs without indices are not an allocation with indices");
        assert_eq!(parse_tres("cpu=1,mem=500M,node=1,billing=1,gres/gpu=2"), (2, 0));
        assert_eq!(parse_tres("billing=1,cpu=1,gres/gpu:h200=1,gres/shard=7"), (1, 7));
        assert_eq!(parse_tres(""), (0, 0));
        assert_eq!(parse_tres_mem("cpu=2,mem=2G,node=1"), 2 << 30);
        assert_eq!(parse_tres_mem("cpu=2,mem=1.5G"), 3 << 29);
        assert_eq!(parse_tres_mem("cpu=2"), 0);
        assert_eq!(parse_slurm_size("16000"), 16000 << 20, "no suffix: MiB");
        assert_eq!(parse_slurm_size("x"), 0);
    }

    #[test]
    fn running_gpu_job_with_indices() {
        // Captured on the lab: `srun --gres=gpu:2` while it ran.
        let (jobs, errs) = parse_scontrol(RUNNING_GPU2);
        assert!(errs.is_empty(), "{errs:?}");
        let j = jobs.values().next().unwrap();
        assert_eq!((j.state.as_str(), j.user.as_str(), j.uid, j.gpus), ("RUNNING", "gpuhublab", Some(1001), 2));
        assert!(j.end_us.is_some(), "a running job's EndTime is its time limit, not an end");
        let a = j.alloc_on(&nodes(&["gpu01"])).unwrap();
        assert_eq!(a.indices.unwrap().gpus, BTreeSet::from([0, 1]));
    }

    #[test]
    fn imitated_fields_make_the_line_ambiguous() {
        // A job name that imitates a per-node section or the owner.
        for fake in ["x Nodes=gpu01 CPU_IDs=0 Mem=1 GRES=gpu:h200:0(IDX:N/A)", "x UserId=bob(1002)"] {
            let line = DONE_GPU2.replace("JobName=acct-gpu2", &format!("JobName={fake}"));
            let (jobs, errs) = parse_scontrol(&line);
            assert!(jobs.is_empty(), "{fake}: {jobs:?}");
            assert!(errs[0].problem.contains("sacct"), "{errs:?}");
        }
        let line = RUNNING_SHARD.replace("Comment=gpuhub-worker", "Comment=a Nodes=gpu01 GRES=gpu:h200:2(IDX:0-1)");
        assert!(parse_scontrol(&line).0.is_empty());
        // Its id is still known to be listed (the reconciliation does not close it).
        assert_eq!(listed_ids(&format!("{line}\n{DONE_GPU2}\nNo jobs in the system\n")), BTreeSet::from([15, 22]));
        // A job name with a newline that prints a second line for job 22.
        let (jobs, errs) = parse_scontrol(&format!("{RUNNING_SHARD}\n{}", RUNNING_SHARD.replace("JobState=RUNNING", "JobState=COMPLETED")));
        assert!(jobs.is_empty() && errs.iter().any(|e| e.problem.contains("twice")), "{jobs:?} {errs:?}");
        assert!(parse_scontrol("No jobs in the system\n").0.is_empty());
    }

    /// A job name with a line break that prints a whole imitated line, for job 22 itself (the
    /// head with the fields the name imitates) and for a job slurmctld does not have (the tail,
    /// with job 22's real fields): squeue's JSON vouches for neither.
    #[test]
    fn squeue_vouches_for_scontrols_lines() {
        let forged = RUNNING_GPU2.replace("JobId=77", "JobId=22").replace("gres/gpu=2", "gres/gpu=0");
        let head_and_tail = RUNNING_SHARD.replace("JobName=gpuhub-worker-mt-chat", &format!("JobName=x\n{forged}\nJobId=4242 JobName=y"));
        let text = format!("{head_and_tail}\n{DONE_GPU2}\n");
        let (mut jobs, _) = parse_scontrol(&text);
        assert!(jobs.contains_key(&22) && jobs.contains_key(&4242), "the forged lines parse: {:?}", jobs.keys());
        let json = r#"{"meta": {}, "errors": [], "jobs": [
            {"job_id": 22, "name": "x\nJobId=22 ...\nJobId=4242 JobName=y", "job_state": "RUNNING"},
            {"job_id": 15, "name": "acct-gpu2", "job_state": ["COMPLETED"], "start_time": {"set": true, "number": 1}}]}"#;
        let sq = parse_squeue_json(json).unwrap();
        assert_eq!((sq.ids.clone(), sq.broken.clone()), (BTreeSet::from([15, 22]), BTreeSet::from([22])));
        let (unsure, problems) = vouch(&mut jobs, &listed_ids(&text), &sq);
        assert_eq!(jobs.keys().copied().collect::<Vec<_>>(), [15], "only job 15's own line is used");
        assert_eq!(unsure, BTreeSet::from([22]), "job 22 is known to slurmctld: not closed");
        assert!(
            problems.iter().any(|p| p.contains("4242")) && problems.iter().any(|p| p.contains("job 22 has a line break")),
            "{problems:?}"
        );
        assert!(parse_squeue_json("{\"jobs\": [{\"job_id\": \"x\"}]}").is_err());
        assert!(parse_squeue_json("squeue: error").is_err());
    }

    #[test]
    fn sacct_lines() {
        // Captured: SLURM_TIME_FORMAT=%s sacct -n -P -X -o JobID,AllocTRES,Account,Partition,NodeList,Start,End,State,User,UID
        let text = "\
21|billing=1,cpu=1,gres/shard=1,mem=500M,node=1|root|gpu|gpu01|1796120464|1796120478|COMPLETED|root|0
22|billing=1,cpu=1,gres/shard=2,mem=500M,node=1|root|gpu|gpu01|1796120479|1796120483|CANCELLED by 0|root|0
15|billing=1,cpu=1,gres/gpu=2,mem=500M,node=1||gpu|gpu01|1796120410|1796120412|COMPLETED|gpuhublab|1001
23||root|gpu|None assigned|Unknown|Unknown|PENDING|root|0
24_1|billing=1|root|gpu|gpu01|1|2|COMPLETED|root|0
short|line
";
        let (jobs, errs) = parse_sacct(text);
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(jobs.len(), 4);
        assert_eq!((jobs[&22].state.as_str(), jobs[&22].shards, jobs[&22].end_us), ("CANCELLED", 2, Some(1_796_120_483_000_000)));
        assert_eq!((jobs[&15].gpus, jobs[&15].account.clone(), jobs[&15].uid), (2, None, Some(1001)));
        assert_eq!((jobs[&23].node_list.as_str(), jobs[&23].start_us), ("", None));
        assert_eq!(jobs[&15].alloc_on(&nodes(&["gpu01"])).unwrap().gpus, 2);
        // Captured: an array job's two tasks (`sbatch -a 1-2`), `JobID` 1346_1 and 1346_2: their
        // raw ids, as slurmctld and the records know them.
        let (jobs, errs) = parse_sacct(
            "1347|billing=1,cpu=1,gres/gpu=1,mem=500M,node=1|lab|gpu|gpu01|1796488080|1796488082|COMPLETED|gpuhublab|1001\n\
             1346|billing=1,cpu=1,gres/gpu=1,mem=500M,node=1|lab|gpu|gpu01|1796488080|1796488082|COMPLETED|gpuhublab|1001\n",
        );
        assert!(errs.is_empty() && jobs.len() == 2 && jobs[&1347].gpus == 1, "{errs:?} {jobs:?}");
    }

    #[test]
    fn hostlists() {
        assert_eq!(expand_hostlist("gpu01"), vec!["gpu01"]);
        assert_eq!(expand_hostlist("gpu[01-03,05],cpu1"), vec!["gpu01", "gpu02", "gpu03", "gpu05", "cpu1"]);
        assert!(expand_hostlist("").is_empty());
        assert_eq!(expand_hostlist("n[0-99999999]").len(), 4096, "bounded");
    }

    #[test]
    fn live_and_finished_states() {
        assert!(is_live("RUNNING") && is_live("COMPLETING") && !is_live("PENDING") && !is_live("COMPLETED"));
        assert!(is_finished("CANCELLED") && is_finished("TIMEOUT") && !is_finished("RUNNING"));
    }

    /// A reconciliation reuses a look at slurmctld younger than its interval (the telemetry
    /// sampler's, kept in [`LastLook`]) with that look's time; a verification, an older look or
    /// one printed by other binaries asks slurmctld again; a slow look that finishes after a
    /// newer one does not replace it.
    /// Scripts that print job 77 running on gpu01 (scontrol, squeue) and nothing (sacct), each
    /// call logged with its arguments in `calls`; a [`CommandSlurm`] of them for `node`.
    fn fake_slurm(node: &str) -> (tempfile::TempDir, CommandSlurm) {
        use std::os::unix::fs::PermissionsExt;
        let bin = tempfile::tempdir().unwrap();
        let dir = bin.path().display().to_string();
        std::fs::write(bin.path().join("jobs.txt"), format!("{RUNNING_GPU2}\n")).unwrap();
        let json = r#"{"jobs": [{"job_id": 77, "name": "acct-gpu2", "job_state": ["RUNNING"]}]}"#;
        std::fs::write(bin.path().join("squeue.json"), json).unwrap();
        for (name, body) in [
            ("scontrol", format!("echo scontrol \"$*\" >> {dir}/calls\ncat {dir}/jobs.txt")),
            ("squeue", format!("echo squeue \"$*\" >> {dir}/calls\ncat {dir}/squeue.json")),
            ("sacct", format!("echo sacct \"$*\" >> {dir}/calls")),
        ] {
            let path = bin.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let src = CommandSlurm {
            scontrol: bin.path().join("scontrol"),
            squeue: bin.path().join("squeue"),
            sacct: bin.path().join("sacct"),
            timeout: Duration::from_secs(10),
            node: node.into(),
            last_look: LastLook::default(),
        };
        (bin, src)
    }

    /// The calls to `command` the fake Slurm logged, with their arguments.
    fn fake_calls(bin: &tempfile::TempDir, command: &str) -> Vec<String> {
        let log = std::fs::read_to_string(bin.path().join("calls")).unwrap_or_default();
        log.lines().filter_map(|l| l.strip_prefix(command)?.strip_prefix(' ').map(str::to_string)).collect()
    }

    #[test]
    fn a_reconciliation_reuses_a_recent_look_and_a_verification_looks_anew() {
        let (bin, src) = fake_slurm("gpu01");
        let calls = || fake_calls(&bin, "scontrol").len();
        let first = src.query_reusing(&[77], None, Duration::from_secs(60));
        assert!(first.ctld_ok && first.ctld.contains_key(&77), "{:?}", first.errors);
        assert_eq!(calls(), 1, "nothing to reuse yet");
        std::thread::sleep(Duration::from_millis(20));
        let again = src.query_reusing(&[77], None, Duration::from_secs(60));
        assert_eq!(calls(), 1, "a look 20 ms old is reused");
        assert!(again.ctld.contains_key(&77) && again.ctld_unsure.is_empty(), "{:?}", again.errors);
        assert_eq!(again.taken_us, first.taken_us, "a reused look keeps its own time");
        let fresh = src.query(&[77], None);
        assert_eq!(calls(), 2, "a verification looks anew");
        assert!(fresh.taken_us > first.taken_us);
        src.query_reusing(&[77], None, Duration::from_millis(1));
        assert_eq!(calls(), 3, "a look older than the reconciliation interval is not reused");
        // The look another sampler kept with other binaries is not this source's.
        let other = CommandSlurm { scontrol: "/nonexistent/scontrol".into(), last_look: src.last_look.clone(), ..src.clone() };
        let st = other.query_reusing(&[], None, Duration::from_secs(60));
        assert!(!st.ctld_ok, "reused a look printed by another scontrol");
        // A slow look taken before the kept one finishes last: the newer one stays.
        let kept = src.last_look.within(Duration::from_secs(60), &src.scontrol, &src.squeue).unwrap();
        let stale = JobLook {
            at: Instant::now(),
            taken_us: kept.taken_us - 1,
            scontrol: src.scontrol.clone(),
            squeue: src.squeue.clone(),
            text: String::new(),
            squeue_ids: Err("x".into()),
        };
        src.last_look.put(stale);
        let now = src.last_look.within(Duration::from_secs(60), &src.scontrol, &src.squeue).unwrap();
        assert_eq!(now.taken_us, kept.taken_us);
    }

    /// A job asked about that slurmctld lists running on another node was requeued from this
    /// one: its runs that ended are asked of sacct (`--duplicates`), so its run here closes at
    /// its real end; a job running here asks nothing more.
    #[test]
    fn a_job_running_again_on_another_node_asks_sacct_for_its_ended_runs() {
        let (bin, elsewhere) = fake_slurm("gpu02");
        let st = elsewhere.query(&[77], None);
        assert!(st.ctld.contains_key(&77), "{:?}", st.errors);
        assert_eq!(fake_calls(&bin, "sacct"), [format!("-n -P -X -o {SACCT_FIELDS} -D -j 77")]);
        let (bin, here) = fake_slurm("gpu01");
        here.query(&[77], None);
        assert!(fake_calls(&bin, "sacct").is_empty(), "job 77 runs here: {:?}", fake_calls(&bin, "sacct"));
    }
}
