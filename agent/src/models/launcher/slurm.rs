//! `launcher = "slurm"`: the worker is an ordinary batch job, `gpuhub-worker-<model>`, submitted
//! with `sbatch` (partition/account/QOS from `[slurm]`), watched with `squeue` and cancelled
//! with `scancel`. Jobs run as `workers.user` (root submits with `--uid`/`--gid`) with
//! `--export=NONE` and an environment the script builds. The job's output goes to
//! `<workers.dir>/<model>.<jobid>.log`; when the job starts it picks a free port and writes
//! `<host> <port> <jobid>` to `<model>.<jobid>.addr`, which the agent reads to learn where the
//! worker listens (the node's name when `workers.host` is not loopback; the node's Slurm
//! `NodeAddr` when it is `node`, so a worker on any node of the cluster is reachable there).
//!
//! Several agents (one per GPU node) may submit workers to one cluster: each job's comment names
//! its agent (`gpuhub-worker:<owner>:<dir>`), and an agent cancels as an orphan only a job with
//! its own comment that no other agent owns in the store (`lifecycle::adopt_all`).
//!
//! A worker on another node cannot be checked from the agent's node (the kernel table of
//! listeners is per network namespace). There the job proves its own port: once something
//! listens on it, `gpuhub-agent worker-proof` (run by the job as the worker account, on the
//! worker's node) writes `<model>.<jobid>.proof`, `JOBID PORT ok` when every listener on the
//! port that a call to the job's address reaches (`GPUHUB_PROOF_HOST`) is the worker account,
//! `JOBID PORT uid N` otherwise. The agent sends the worker's key
//! (health probe, calls) only after an `ok` proof of this job and port (`read_proof`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::job_watch::JobWatch;
use super::{Instance, LaunchError, LaunchSpec, RunState, safe_name, shell_quote};
use crate::config::{LauncherKind, SlurmConfig};

/// Every worker job carries this comment (plus the workers dir), so the agent can tell its
/// own jobs from anyone else's when it cleans up orphans.
const COMMENT_PREFIX: &str = "gpuhub-worker:";

/// Touched by the agent every few seconds (in the workers dir); worker jobs watch it.
pub const HEARTBEAT_FILE: &str = "agent.heartbeat";

#[derive(Debug, Clone)]
pub struct Slurm {
    pub cfg: SlurmConfig,
    pub dir: PathBuf,
    /// The agent that submits (its Slurm node name): named in every job's comment.
    pub owner: String,
    /// The supervisors' job states, one `squeue` for all ([`Slurm::poll`]).
    watch: Arc<JobWatch>,
    /// Worker jobs whose `scancel` failed, cancelled again by [`Slurm::cancel_again`]: the
    /// agent forgets a worker it stopped, and its heartbeat keeps the job's watchdog quiet.
    failed_cancels: Arc<std::sync::Mutex<std::collections::BTreeSet<String>>>,
}

/// `workers.host = "node"`: a Slurm worker binds its node's `NodeAddr` (from `scontrol show
/// node $SLURMD_NODENAME`), a local worker loopback.
pub const NODE_HOST: &str = "node";

/// What a worker job's `.proof` file says about its port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// Every listener on the port is the worker account.
    Worker,
    /// A socket of another uid listens on the port.
    Other { uid: u32 },
}

/// Job states of a job that has ended or is ending for good: a worker in one is gone, and
/// nothing is left to stop. (`PREEMPTED` and `NODE_FAIL` are not here: Slurm may requeue such
/// a job, which would then run again with no agent keeping it.)
const ENDING: &[&str] = &["COMPLETING", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED"];

/// One worker job as `squeue` lists it ([`SQUEUE_FORMAT`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    pub id: String,
    pub name: String,
    pub state: String,
    pub reason: String,
    /// The uid the job runs as (`None` when squeue printed none).
    pub uid: Option<u32>,
    /// The job's comment: `gpuhub-worker:<owner>:<dir>` for a worker job.
    pub comment: String,
}

/// How `squeue -o` prints a [`JobInfo`]: id, name, state, reason, uid, comment (last: the
/// only field that may hold a `|`).
const SQUEUE_FORMAT: &str = "%i|%j|%T|%r|%U|%k";

/// A Slurm node name as squeue/sinfo print it (letters, digits, `-`, `_`, `.`): anything else
/// never reaches a job script.
fn valid_node_name(n: &str) -> bool {
    !n.is_empty() && n.len() <= 64 && n.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

pub fn job_name(model: &str) -> String {
    format!("gpuhub-worker-{model}")
}

impl Slurm {
    pub fn new(cfg: SlurmConfig, dir: PathBuf, owner: String) -> Slurm {
        Slurm { cfg, dir, owner, watch: Arc::default(), failed_cancels: Default::default() }
    }

    fn bin(&self, tool: &str) -> PathBuf {
        match &self.cfg.bin_dir {
            Some(d) => d.join(tool),
            None => PathBuf::from(tool),
        }
    }

    fn comment(&self) -> String {
        format!("{COMMENT_PREFIX}{}:{}", self.owner, self.dir.display())
    }

    async fn run(&self, tool: &str, args: &[String]) -> Result<String, LaunchError> {
        self.run_with(tool, args, false).await
    }

    /// `run` with an environment of sbatch's own: `PATH` and `SLURM_CONF` only, so no variable
    /// of the agent's (SBATCH_*, credentials in the unit's environment) shapes the job.
    async fn run_clean(&self, tool: &str, args: &[String]) -> Result<String, LaunchError> {
        self.run_with(tool, args, true).await
    }

    async fn run_with(&self, tool: &str, args: &[String], clean_env: bool) -> Result<String, LaunchError> {
        let cmd = format!("{tool} {}", args.join(" "));
        let mut command = tokio::process::Command::new(self.bin(tool));
        if clean_env {
            command.env_clear().env("PATH", std::env::var("PATH").unwrap_or_else(|_| super::WORKER_PATH.to_string()));
            if let Ok(conf) = std::env::var("SLURM_CONF") {
                command.env("SLURM_CONF", conf);
            }
        }
        let fut = command.args(args).kill_on_drop(true).output();
        let out = match tokio::time::timeout(Duration::from_secs(30), fut).await {
            Ok(Ok(o)) => o,
            Ok(Err(source)) => return Err(LaunchError::Spawn { cmd, source }),
            Err(_) => return Err(LaunchError::Command { cmd, message: "no answer within 30 s (is slurmctld up?)".into() }),
        };
        if !out.status.success() {
            let message = String::from_utf8_lossy(&out.stderr).trim().to_string();
            return Err(LaunchError::Command { cmd, message: if message.is_empty() { out.status.to_string() } else { message } });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Writes the job script and submits it as the worker account.
    pub async fn start(&self, spec: &LaunchSpec) -> Result<Instance, LaunchError> {
        std::fs::create_dir_all(&spec.dir).map_err(|source| LaunchError::Io { path: spec.dir.display().to_string(), source })?;
        let safe = safe_name(&spec.model);
        let script_path = spec.dir.join(format!("{safe}.sbatch"));
        let script = self.script(spec);
        crate::util::write_atomic(&script_path, script.as_bytes(), 0o600)
            .map_err(|source| LaunchError::Io { path: script_path.display().to_string(), source })?;
        let mut args = vec!["--parsable".to_string()];
        if !spec.user.is_self {
            // Root submits on the account's behalf; the job runs as it (sbatch(1) --uid/--gid).
            args.push(format!("--uid={}", spec.user.uid));
            args.push(format!("--gid={}", spec.user.gid));
        }
        args.push(script_path.display().to_string());
        let out = self.run_clean("sbatch", &args).await?;
        let id = out.trim().split(';').next().unwrap_or("").to_string();
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
            return Err(LaunchError::Command { cmd: "sbatch --parsable".into(), message: format!("unexpected output `{}`", out.trim()) });
        }
        let mut inst =
            Instance::new(LauncherKind::Slurm, id.clone(), spec.api_key.clone(), spec.user.uid, spec.dir.join(format!("{safe}.{id}.log")));
        inst.key_files = Some(spec.key_files.clone());
        inst.version = spec.version.clone();
        Ok(inst)
    }

    /// The job script. The job's environment is built here and nowhere else: sbatch gets
    /// `--export=NONE` (nothing from the agent's or sbatch's environment but Slurm's own
    /// SLURM_* variables), then the script exports a minimal PATH/HOME/LANG, the template's
    /// and model's `env`, and the key variable read from the 0600 key file with the shell's
    /// `read` builtin. The port is picked when the job starts (a port chosen at submission
    /// could be taken by anyone while the job pends) and written with the host to
    /// `<model>.<jobid>.addr`, which the agent reads.
    pub fn script(&self, spec: &LaunchSpec) -> String {
        let safe = safe_name(&spec.model);
        let mut s = String::from("#!/bin/sh\n# Written by gpuhub-agent: one model worker. Do not edit; it is rewritten at each start.\n");
        s.push_str(&format!("#SBATCH --job-name={}\n", shell_quote(&job_name(&spec.model))));
        s.push_str(&format!("#SBATCH --output={}\n", spec.dir.join(format!("{safe}.%j.log")).display()));
        s.push_str(&format!("#SBATCH --comment={}\n", shell_quote(&self.comment())));
        // Never requeued (a node failure, a preemption, `scontrol requeue`): the agent starts a
        // new worker when one is needed, and a worker job's one run is what its callers are billed.
        s.push_str("#SBATCH --nodes=1 --ntasks=1\n#SBATCH --export=NONE\n#SBATCH --no-requeue\n");
        if spec.resources.gpus > 0 {
            s.push_str(&format!("#SBATCH --gres=gpu:{}\n", spec.resources.gpus));
        } else if spec.resources.shards > 0 {
            s.push_str(&format!("#SBATCH --gres=shard:{}\n", spec.resources.shards));
        }
        for (flag, v) in [("partition", &self.cfg.worker_partition), ("account", &self.cfg.worker_account), ("qos", &self.cfg.worker_qos)] {
            if let Some(v) = v {
                s.push_str(&format!("#SBATCH --{flag}={v}\n"));
            }
        }
        let exclude: Vec<&str> = spec.exclude.iter().map(String::as_str).filter(|n| valid_node_name(n)).collect();
        if !exclude.is_empty() {
            s.push_str(&format!("#SBATCH --exclude={}\n", exclude.join(",")));
        }
        s.push_str(&format!("#SBATCH --chdir={}\n", spec.workdir.as_deref().unwrap_or(&spec.dir).display()));
        s.push_str("umask 027\n");
        for (k, v) in spec.base_env() {
            s.push_str(&format!("export {k}={}\n", shell_quote(&v)));
        }
        let key_file = shell_quote(&spec.key_files.file.display().to_string());
        match (&spec.key.env, &spec.key.env_for, &spec.key_files.shim_dir) {
            (Some(_), Some(program), Some(shim)) => {
                s.push_str(&format!(
                    "# only {program} gets the key (a shim first on PATH reads it)\nexport PATH={}:\"$PATH\"\n",
                    shell_quote(&shim.display().to_string())
                ));
            }
            (Some(var), None, _) => s.push_str(&format!(
                "IFS= read -r {var} < {key_file} || {{ echo \"gpuhub: cannot read the worker key file\" >&2; exit 1; }}\nexport {var}\n"
            )),
            _ => {}
        }
        let agent = shell_quote(&spec.agent_exe.display().to_string());
        let host = if spec.host == NODE_HOST {
            // The node's address as Slurm knows it: what the agent on any other node reaches.
            s.push_str(&format!(
                "GPUHUB_WORKER_HOST=$({} show node \"$SLURMD_NODENAME\" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\) .*/\\1/p')\n[ -n \"$GPUHUB_WORKER_HOST\" ] || {{ echo \"gpuhub: cannot find the NodeAddr of node $SLURMD_NODENAME (scontrol show node)\" >&2; exit 1; }}\nexport GPUHUB_WORKER_HOST\n",
                shell_quote(&self.bin("scontrol").display().to_string())
            ));
            s.push_str(&format!(
                "GPUHUB_WORKER_PORT=$({agent} worker-port \"$GPUHUB_WORKER_HOST\") || {{ echo \"gpuhub: cannot pick a free port on $GPUHUB_WORKER_HOST\" >&2; exit 1; }}\n"
            ));
            "$GPUHUB_WORKER_HOST".to_string()
        } else {
            let bind = if spec.host == "0.0.0.0" || spec.host == "::" { "127.0.0.1" } else { spec.host.as_str() };
            s.push_str(&format!(
                "GPUHUB_WORKER_PORT=$({agent} worker-port {}) || {{ echo \"gpuhub: cannot pick a free port on {bind}\" >&2; exit 1; }}\n",
                shell_quote(bind)
            ));
            if spec.host == "0.0.0.0" || spec.host == "::" { "$(hostname)".to_string() } else { shell_quote(&spec.host) }
        };
        let addr = spec.dir.join(format!("{safe}.$SLURM_JOB_ID.addr"));
        s.push_str(&format!(
            "printf '%s %s %s\\n' \"{host}\" \"$GPUHUB_WORKER_PORT\" \"$SLURM_JOB_ID\" > \"{addr}.tmp\" && mv -f \"{addr}.tmp\" \"{addr}\" || {{ echo \"gpuhub: cannot write {addr}\" >&2; exit 1; }}\n",
            addr = addr.display()
        ));
        // The worker runs under a watchdog: if no agent has touched the heartbeat file for
        // `orphan_after_s` (the model's idle timeout), the agent is gone and nobody will ever
        // unload this worker, so it stops itself instead of holding the GPU.
        let hb = spec.dir.join(HEARTBEAT_FILE);
        s.push_str(&format!("{} &\nW=$!\ntrap 'kill -TERM $W 2>/dev/null' TERM INT\n", spec.command));
        // The proof of the port, from the worker's own node (see the module doc): in the
        // background, it ends once something listens (or after the load timeout).
        let proof = self.proof_path(&spec.model, "$SLURM_JOB_ID");
        s.push_str(&format!(
            "GPUHUB_PROOF_HOST=\"{host}\" {agent} worker-proof \"$GPUHUB_WORKER_PORT\" \"$SLURM_JOB_ID\" \"{proof}\" {secs} &\n",
            proof = proof.display(),
            secs = spec.proof_timeout_s
        ));
        s.push_str(&format!(
            "while kill -0 $W 2>/dev/null; do\n  sleep 1 & wait $!\n  age=$(( $(date +%s) - $(stat -c %Y \"{hb}\" 2>/dev/null || echo 0) ))\n  if [ \"$age\" -gt {orphan} ]; then\n    echo \"gpuhub: no agent heartbeat for ${{age}}s (more than {orphan}s); stopping the orphaned worker\" >&2\n    kill -TERM $W 2>/dev/null\n    break\n  fi\ndone\nwait $W\n",
            hb = hb.display(),
            orphan = spec.orphan_after_s,
        ));
        s
    }

    /// Where job `id` of `model` writes the proof of its port.
    pub fn proof_path(&self, model: &str, id: &str) -> PathBuf {
        self.dir.join(format!("{}.{id}.proof", safe_name(model)))
    }

    /// What job `id` proved about `port`: `Ok(None)` until it has. The file is checked like the
    /// `.addr` file (a regular file of the worker account or root, not writable by others) and
    /// must name this job and this port.
    pub fn read_proof(&self, model: &str, id: &str, uid: u32, port: u16) -> Result<Option<Proof>, String> {
        let path = self.proof_path(model, id);
        let Some(text) = read_worker_file(&path, uid)? else { return Ok(None) };
        parse_proof(&text, id, port).map(Some).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Where job `id` of `model` writes its address.
    pub fn addr_path(&self, model: &str, id: &str) -> PathBuf {
        self.dir.join(format!("{}.{id}.addr", safe_name(model)))
    }

    /// The `http://HOST:PORT` job `id` wrote, once it has: `Ok(None)` until the file exists.
    /// The file must be a regular file of the worker account (or root), not writable by
    /// others, and name this job; anything else is refused with what was wrong.
    pub fn read_addr(&self, model: &str, id: &str, uid: u32) -> Result<Option<String>, String> {
        let path = self.addr_path(model, id);
        let Some(text) = read_worker_file(&path, uid)? else { return Ok(None) };
        parse_addr(&text, id).map(Some).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Whether Slurm and the job itself vouch that job `id` is `model`'s worker, run by another
    /// agent (`owner`) at `base_url`: the job is RUNNING as the worker account (`uid`), named
    /// for `model`, with a comment that names `owner` and its workers dir; in that dir the
    /// job's `.addr` names `base_url` and its `.proof` says `ok` for this job and port. `Err`
    /// says what is wrong; the caller then never sends the worker's key. The owner's workers
    /// dir comes from the job's comment (Slurm's word, set at submission): a worker job writes
    /// there from whatever node it runs on, so it is on a filesystem every node sees.
    pub async fn vouch(&self, model: &str, id: &str, uid: u32, owner: &str, base_url: &str) -> Result<(), String> {
        let port = super::proof::host_port(base_url)
            .map(|(_, p)| p)
            .ok_or_else(|| format!("`{}` is not an http://HOST:PORT address", crate::util::sanitize(base_url)))?;
        let job = self.job(id).await.map_err(|e| format!("cannot ask Slurm about job {id}: {e}"))?;
        let dir = vouched_dir(job.as_ref(), model, id, uid, owner)?;
        let theirs = Slurm::new(self.cfg.clone(), dir, owner.to_string());
        match theirs.read_addr(model, id, uid)? {
            Some(url) if url == base_url => {}
            Some(url) => return Err(format!("job {id} wrote the address {url}, not {}", crate::util::sanitize(base_url))),
            None => return Err(format!("job {id} wrote no address file ({})", theirs.addr_path(model, id).display())),
        }
        // A worker on its owner's own node is ready once the kernel there shows its port,
        // which may be a moment before the job's proof lands: wait a second for it.
        let mut tries = 10;
        loop {
            match theirs.read_proof(model, id, uid, port)? {
                Some(Proof::Worker) => return Ok(()),
                Some(Proof::Other { uid: other }) => {
                    return Err(format!("job {id}'s proof says a process of another user (uid {other}) listens on its port {port}"));
                }
                None if tries > 0 => {
                    tries -= 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                None => return Err(format!("job {id} has not proved its port {port} (no {})", theirs.proof_path(model, id).display())),
            }
        }
    }

    /// One job's state, at most [`super::job_watch::MAX_AGE`] old. A job squeue no longer lists has
    /// ended.
    pub async fn poll(&self, inst: &Instance) -> RunState {
        match self.watched_job(&inst.id).await {
            Ok(Some(j)) => match j.state.as_str() {
                "PENDING" | "CONFIGURING" | "REQUEUED" => RunState::Pending(j.reason),
                "RUNNING" => RunState::Running,
                other if ENDING.contains(&other) => RunState::Gone(format!("Slurm job {} is {other}", inst.id)),
                // Suspended, stopped, preempted, held after a requeue, ...: not serving, and it
                // could run again later with no agent keeping it. Cancelled, so that it never does.
                other => {
                    tracing::warn!(job = %inst.id, state = other, "a worker job is neither running nor ending; cancelling it");
                    self.cancel(&inst.id).await;
                    RunState::Gone(format!("Slurm job {} was {other}; it was cancelled", inst.id))
                }
            },
            Ok(None) => RunState::Gone(format!("Slurm job {} has ended", inst.id)),
            // squeue itself failed (slurmctld restarting?): say running, check again later.
            Err(e) => {
                tracing::warn!(job = %inst.id, error = %e, "cannot check a worker job; will retry");
                RunState::Running
            }
        }
    }

    /// Job `id` as the last `squeue` of every watched job saw it ([`JobWatch`]), running one
    /// when that answer is stale or did not ask about `id`.
    async fn watched_job(&self, id: &str) -> Result<Option<JobInfo>, LaunchError> {
        self.watch.note(id, Instant::now());
        if let Some(j) = self.watch.fresh(id, Instant::now()) {
            return Ok(j);
        }
        let _one = self.watch.refresh.lock().await;
        // Another caller's squeue may have answered while this one waited.
        if let Some(j) = self.watch.fresh(id, Instant::now()) {
            return Ok(j);
        }
        let at = Instant::now();
        let ids = self.watch.ids(at);
        let jobs = self.jobs(&ids).await?;
        let found = jobs.iter().find(|j| j.id == id).cloned();
        self.watch.store(at, ids, jobs);
        Ok(found)
    }

    pub async fn job(&self, id: &str) -> Result<Option<JobInfo>, LaunchError> {
        Ok(self.jobs(&[id.to_string()]).await?.into_iter().find(|j| j.id == id))
    }

    /// The jobs among `ids` that squeue lists (pending, running, completing).
    async fn jobs(&self, ids: &[String]) -> Result<Vec<JobInfo>, LaunchError> {
        match self.run("squeue", &["-h".into(), "-j".into(), ids.join(","), "-o".into(), SQUEUE_FORMAT.into()]).await {
            Ok(out) => Ok(parse_squeue(&out)),
            // One id that slurmctld purged from its memory: "Invalid job id specified" (of
            // several ids, squeue lists those it knows and says nothing of the others).
            Err(LaunchError::Command { message, .. }) if message.contains("Invalid job id") => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    /// The node a running job runs on (`None` while it pends or once it ended).
    pub async fn node_of(&self, id: &str) -> Result<Option<String>, LaunchError> {
        let out = self.run("squeue", &["-h".into(), "-j".into(), id.into(), "-o".into(), "%N".into()]).await?;
        Ok(out.lines().map(str::trim).find(|n| !n.is_empty() && valid_node_name(n)).map(str::to_string))
    }

    /// The nodes of `slurm.worker_partition` (all nodes without one) that can run a job.
    pub async fn up_nodes(&self) -> Result<Vec<String>, LaunchError> {
        let mut args: Vec<String> = vec!["-h".into(), "-N".into(), "-o".into(), "%N|%t".into()];
        if let Some(p) = &self.cfg.worker_partition {
            args.extend(["-p".to_string(), p.clone()]);
        }
        Ok(crate::models::replicas::up_nodes(&self.run("sinfo", &args).await?))
    }

    /// Every job this agent's workers dir owns (pending or running).
    pub async fn own_jobs(&self) -> Result<Vec<JobInfo>, LaunchError> {
        let out = self.run("squeue", &["-h".into(), "-o".into(), SQUEUE_FORMAT.into()]).await?;
        let comment = self.comment();
        Ok(parse_squeue(&out).into_iter().filter(|j| j.comment == comment).collect())
    }

    /// Running jobs that hold GPUs or shards (`ids`: just those jobs, whatever they hold), with
    /// user, name, start and end (its time limit) as Slurm prints them: what placement
    /// messages name as the holders of the GPUs. Limited to `slurm.worker_partition` if set.
    pub async fn holder_jobs(&self, ids: Option<&[String]>) -> Result<Vec<HolderJob>, LaunchError> {
        let mut args: Vec<String> = vec!["-h".into(), "-t".into(), "RUNNING".into(), "-o".into(), "%i|%u|%S|%e|%b|%j".into()];
        match ids {
            Some([]) => return Ok(Vec::new()),
            Some(ids) => args.extend(["-j".to_string(), ids.join(",")]),
            None => {
                if let Some(p) = &self.cfg.worker_partition {
                    args.extend(["-p".to_string(), p.clone()]);
                }
            }
        }
        let out = self.run("squeue", &args).await?;
        Ok(out.lines().filter_map(parse_holder).filter(|j| ids.is_some() || j.gpus > 0 || j.shards > 0).collect())
    }

    /// scancel, then wait (at most 30 s) until squeue no longer lists the job.
    pub async fn stop(&self, inst: &Instance) {
        self.cancel(&inst.id).await;
        for _ in 0..300 {
            if matches!(self.poll(inst).await, RunState::Gone(_)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tracing::warn!(job = %inst.id, "worker job still listed 30 s after scancel");
    }

    /// Makes worker job `id` one that Slurm never requeues (what `--no-requeue` does at
    /// submission; a job submitted before that flag existed, adopted after an upgrade). A
    /// failure is logged: the job runs on as it is.
    pub async fn no_requeue(&self, id: &str) {
        if let Err(e) = self.run("scontrol", &["update".into(), format!("JobId={id}"), "Requeue=0".into()]).await {
            tracing::warn!(job = %id, error = %e, "cannot mark an adopted worker job non-requeueable (scontrol update Requeue=0); a requeue would run it again under the same id");
        }
    }

    pub async fn cancel(&self, id: &str) {
        if let Err(e) = self.run("scancel", &[id.to_string()]).await {
            tracing::error!(job = %id, error = %e, "scancel failed; the worker job may still hold its GPU; cancelled again every 30 s until Slurm takes it");
            self.failed_cancels.lock().unwrap_or_else(|p| p.into_inner()).insert(id.to_string());
        }
    }

    /// Cancels again the jobs whose `scancel` failed; a job squeue no longer lists is done.
    pub async fn cancel_again(&self) {
        let ids: Vec<String> = self.failed_cancels.lock().unwrap_or_else(|p| p.into_inner()).iter().cloned().collect();
        for id in ids {
            let done = match self.run("scancel", std::slice::from_ref(&id)).await {
                Ok(_) => {
                    tracing::info!(job = %id, "worker job cancelled after an earlier scancel failed");
                    true
                }
                Err(e) => match self.job(&id).await {
                    Ok(None) => true,
                    Ok(Some(j)) if ENDING.contains(&j.state.as_str()) => true,
                    _ => {
                        tracing::debug!(job = %id, error = %e, "scancel failed again; retried in 30 s");
                        false
                    }
                },
            };
            if done {
                self.failed_cancels.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
            }
        }
    }

    /// Jobs whose `scancel` failed and that are not cancelled yet.
    #[cfg(test)]
    pub fn cancels_pending(&self) -> usize {
        self.failed_cancels.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// The workers dir of agent `owner`, from job `id`'s squeue line, when Slurm vouches that the
/// job is a running worker of `model` that `owner` submitted as the worker account `uid`.
fn vouched_dir(job: Option<&JobInfo>, model: &str, id: &str, uid: u32, owner: &str) -> Result<PathBuf, String> {
    let Some(j) = job.filter(|j| j.id == id) else { return Err(format!("Slurm job {id} has ended")) };
    if j.state != "RUNNING" {
        return Err(format!("Slurm job {id} is {}, not RUNNING", crate::util::sanitize(&j.state)));
    }
    if j.uid != Some(uid) {
        let runs_as = j.uid.map_or_else(|| "an unknown uid".to_string(), |u| format!("uid {u}"));
        return Err(format!("Slurm job {id} runs as {runs_as}, not as the worker account (uid {uid})"));
    }
    if j.name != job_name(model) {
        return Err(format!("Slurm job {id} is named `{}`, not `{}`", crate::util::sanitize(&j.name), job_name(model)));
    }
    match j.comment.strip_prefix(COMMENT_PREFIX).and_then(|r| r.split_once(':')) {
        Some((o, dir)) if o == owner && dir.starts_with('/') => Ok(PathBuf::from(dir)),
        _ => {
            Err(format!("Slurm job {id}'s comment `{}` is not `{COMMENT_PREFIX}{owner}:<workers dir>`", crate::util::sanitize(&j.comment)))
        }
    }
}

/// A file a worker job wrote in the workers dir: `Ok(None)` until it exists. It must be a
/// regular file of the worker account (or root), not writable by others; anything else is
/// refused with what was wrong.
fn read_worker_file(path: &std::path::Path, uid: u32) -> Result<Option<String>, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    if !meta.file_type().is_file() || (meta.uid() != uid && meta.uid() != 0) || meta.mode() & 0o002 != 0 {
        return Err(format!(
            "{} is not a file written by the worker (owner uid {}, mode {:o}; expected a regular file of uid {uid}, not writable by other users); the workers dir must be root:<worker group> 0770",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    std::fs::read_to_string(path).map(Some).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Parses a `.proof` file: `JOBID PORT ok` or `JOBID PORT uid N`, for this job and port.
fn parse_proof(text: &str, id: &str, port: u16) -> Result<Proof, String> {
    let f: Vec<&str> = text.split_whitespace().collect();
    let (job, p) = match f.as_slice() {
        [job, p, ..] => (*job, *p),
        _ => return Err(format!("expected `JOBID PORT ok`, found `{}`", crate::util::sanitize(text.trim()))),
    };
    if job != id {
        return Err(format!("names job {}, not {id}", crate::util::sanitize(job)));
    }
    if p != port.to_string() {
        return Err(format!("proves port {}, not the worker's port {port}", crate::util::sanitize(p)));
    }
    match &f[2..] {
        ["ok"] => Ok(Proof::Worker),
        ["uid", n] => n.parse().map(|uid| Proof::Other { uid }).map_err(|_| format!("`{}` is not a uid", crate::util::sanitize(n))),
        _ => Err(format!("expected `ok` or `uid N` after the port, found `{}`", crate::util::sanitize(text.trim()))),
    }
}

/// Parses an `.addr` file: `HOST PORT JOBID`, the job id this job's.
fn parse_addr(text: &str, id: &str) -> Result<String, String> {
    let mut f = text.split_whitespace();
    let (Some(host), Some(port), Some(job), None) = (f.next(), f.next(), f.next(), f.next()) else {
        return Err(format!("expected `HOST PORT JOBID`, found `{}`", crate::util::sanitize(text.trim())));
    };
    if job != id {
        return Err(format!("names job {}, not {id}", crate::util::sanitize(job)));
    }
    let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(|| format!("`{}` is not a port", crate::util::sanitize(port)))?;
    if host.is_empty() || !host.chars().all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c)) {
        return Err(format!("`{}` is not a host name or address", crate::util::sanitize(host)));
    }
    let host = if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_string() };
    Ok(format!("http://{host}:{port}"))
}

/// A running job that holds GPUs or shards (see [`Slurm::holder_jobs`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderJob {
    pub id: String,
    pub user: String,
    pub name: String,
    /// Slurm's start time (`2026-12-01T13:02:11`, the cluster's local time).
    pub start: String,
    /// When its time limit ends it (`Unknown`/`NONE`: no limit).
    pub end: String,
    pub gpus: u32,
    pub shards: u32,
}

impl HolderJob {
    /// `Slurm job 57 `train.sh` of alice (1 GPU) since 2026-12-01T11:00:00, until its time
    /// limit at 2026-12-01T15:00:00`.
    pub fn describe(&self) -> String {
        let what = match (self.gpus, self.shards) {
            (0, 0) => String::new(),
            (g, 0) => format!(", {g} GPU{}", if g == 1 { "" } else { "s" }),
            (_, s) => format!(", {s} shard{}", if s == 1 { "" } else { "s" }),
        };
        let until = match self.end.as_str() {
            "" | "Unknown" | "NONE" | "N/A" => "with no time limit".to_string(),
            end => format!("until its time limit at {end}"),
        };
        format!(
            "Slurm job {} `{}` of {}{what} since {}, {until}",
            self.id,
            crate::util::sanitize(&self.name),
            crate::util::sanitize(&self.user),
            self.start
        )
    }
}

fn parse_holder(line: &str) -> Option<HolderJob> {
    let mut f = line.trim().splitn(6, '|');
    let (id, user, start, end, gres, name) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let (gpus, shards) = crate::telemetry::slurm::parse_gres_counts(gres);
    Some(HolderJob {
        id: id.trim().to_string(),
        user: user.trim().to_string(),
        name: name.trim().to_string(),
        start: start.trim().to_string(),
        end: end.trim().to_string(),
        gpus,
        shards,
    })
}

/// Parses `squeue -h -o` [`SQUEUE_FORMAT`] output, one job a line.
fn parse_squeue(out: &str) -> Vec<JobInfo> {
    out.lines()
        .filter_map(|l| {
            let mut f = l.trim().splitn(6, '|');
            Some(JobInfo {
                id: f.next()?.to_string(),
                name: f.next()?.to_string(),
                state: f.next()?.to_string(),
                reason: f.next().unwrap_or("").to_string(),
                uid: f.next().and_then(|u| u.trim().parse().ok()),
                comment: f.next().unwrap_or("").trim().to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::templates::KeyDelivery;
    use crate::models::launcher::account::WorkerUser;
    use crate::models::launcher::secret::KeyFiles;

    fn spec(dir: &std::path::Path, key: KeyDelivery) -> LaunchSpec {
        let api_key = "gpuhub-worker-00112233445566778899aabbccddeeff".to_string();
        LaunchSpec {
            model: "m/x".into(),
            command: "srv --port ${GPUHUB_WORKER_PORT}".into(),
            env: std::collections::BTreeMap::from([("HF_HOME".to_string(), "/models/hf".to_string())]),
            resources: Default::default(),
            workdir: None,
            dir: dir.to_path_buf(),
            host: "127.0.0.1".into(),
            port: None,
            key_files: KeyFiles::locate(dir, "m_x", &api_key, &key),
            api_key,
            key,
            user: WorkerUser {
                name: "gpuhub-worker".into(),
                uid: 990,
                gid: 990,
                home: "/var/lib/gpuhub-worker".into(),
                groups: vec![990],
                is_self: false,
            },
            version: None,
            orphan_after_s: 60,
            exclude: Vec::new(),
            proof_timeout_s: 90,
            agent_exe: "/usr/bin/gpuhub-agent".into(),
        }
    }

    #[test]
    fn the_job_script_builds_its_own_environment_and_never_holds_the_key() {
        let slurm = Slurm::new(SlurmConfig::default(), "/w".into(), "gpu01".into());
        let sp = spec(std::path::Path::new("/w"), KeyDelivery { env: Some("VLLM_API_KEY".into()), ..KeyDelivery::default() });
        let s = slurm.script(&sp);
        assert!(!s.contains(&sp.api_key), "the key is in the job script:\n{s}");
        for want in [
            "#SBATCH --export=NONE\n",
            "#SBATCH --no-requeue\n",
            "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n",
            "export HOME=/var/lib/gpuhub-worker\n",
            "export HF_HOME=/models/hf\n",
            "IFS= read -r VLLM_API_KEY < /w/keys/m_x.",
            "export VLLM_API_KEY\n",
            "GPUHUB_WORKER_PORT=$(/usr/bin/gpuhub-agent worker-port 127.0.0.1)",
            "/w/m_x.$SLURM_JOB_ID.addr.tmp",
            "srv --port ${GPUHUB_WORKER_PORT} &\n",
            "#SBATCH --chdir=/w\n",
            "#SBATCH --comment=gpuhub-worker:gpu01:/w\n",
            "GPUHUB_PROOF_HOST=\"127.0.0.1\" /usr/bin/gpuhub-agent worker-proof \"$GPUHUB_WORKER_PORT\" \"$SLURM_JOB_ID\" \"/w/m_x.$SLURM_JOB_ID.proof\" 90 &\n",
        ] {
            assert!(s.contains(want), "missing `{want}` in:\n{s}");
        }
        let file_only = slurm.script(&spec(std::path::Path::new("/w"), KeyDelivery::default()));
        assert!(!file_only.contains("read -r"), "a file-only template reads no variable");
        let shim = slurm.script(&spec(
            std::path::Path::new("/w"),
            KeyDelivery { env: Some("API_KEY".into()), env_for: Some("text-generation-router".into()), ..KeyDelivery::default() },
        ));
        assert!(
            shim.contains("export PATH=/w/keys/m_x.") && shim.contains(".bin:\"$PATH\"") && !shim.contains("read -r API_KEY"),
            "{shim}"
        );
    }

    #[test]
    fn a_replica_excludes_the_nodes_of_the_others_and_nothing_odd_reaches_the_script() {
        let slurm = Slurm::new(SlurmConfig::default(), "/w".into(), "gpu01".into());
        let mut sp = spec(std::path::Path::new("/w"), KeyDelivery::default());
        assert!(!slurm.script(&sp).contains("--exclude"), "no replica elsewhere: no exclusion");
        sp.exclude = vec!["gpu01".into(), "gpu02".into(), "x;rm -rf /".into()];
        let s = slurm.script(&sp);
        assert!(s.contains("#SBATCH --exclude=gpu01,gpu02\n"), "{s}");
        assert!(!s.contains("rm -rf"), "{s}");
    }

    #[test]
    fn a_node_worker_binds_its_nodes_slurm_address() {
        let slurm = Slurm::new(SlurmConfig::default(), "/w".into(), "gpu02".into());
        let mut sp = spec(std::path::Path::new("/w"), KeyDelivery::default());
        sp.host = NODE_HOST.into();
        let s = slurm.script(&sp);
        for want in [
            "GPUHUB_WORKER_HOST=$(scontrol show node \"$SLURMD_NODENAME\" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\) .*/\\1/p')\n",
            "GPUHUB_WORKER_PORT=$(/usr/bin/gpuhub-agent worker-port \"$GPUHUB_WORKER_HOST\")",
            "printf '%s %s %s\\n' \"$GPUHUB_WORKER_HOST\" \"$GPUHUB_WORKER_PORT\"",
            "#SBATCH --comment=gpuhub-worker:gpu02:/w\n",
            // The job proves only the sockets a call to its address could reach.
            "GPUHUB_PROOF_HOST=\"$GPUHUB_WORKER_HOST\" /usr/bin/gpuhub-agent worker-proof ",
        ] {
            assert!(s.contains(want), "missing `{want}` in:\n{s}");
        }
    }

    #[test]
    fn the_proof_file_must_name_the_job_and_port() {
        assert_eq!(parse_proof("42 20123 ok\n", "42", 20123).unwrap(), Proof::Worker);
        assert_eq!(parse_proof("42 20123 uid 1001", "42", 20123).unwrap(), Proof::Other { uid: 1001 });
        assert!(parse_proof("43 20123 ok", "42", 20123).unwrap_err().contains("not 42"));
        assert!(parse_proof("42 20124 ok", "42", 20123).unwrap_err().contains("not the worker's port"));
        assert!(parse_proof("42 20123 maybe", "42", 20123).is_err());
        assert!(parse_proof("42", "42", 20123).is_err());

        let dir = tempfile::tempdir().unwrap();
        let slurm = Slurm::new(SlurmConfig::default(), dir.path().to_path_buf(), "gpu01".into());
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        assert_eq!(slurm.read_proof("m", "42", me, 20123).unwrap(), None, "no proof yet");
        let path = slurm.proof_path("m", "42");
        std::fs::write(&path, "42 20123 ok\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        assert_eq!(slurm.read_proof("m", "42", me, 20123).unwrap(), Some(Proof::Worker));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(slurm.read_proof("m", "42", me, 20123).unwrap_err().contains("not a file written by the worker"));
    }

    #[test]
    fn the_address_file_is_checked_before_it_is_used() {
        assert_eq!(parse_addr("gpu01 20123 42\n", "42").unwrap(), "http://gpu01:20123");
        assert_eq!(parse_addr("::1 20123 42", "42").unwrap(), "http://[::1]:20123");
        assert!(parse_addr("gpu01 20123 43", "42").unwrap_err().contains("not 42"));
        assert!(parse_addr("gpu01 0 42", "42").unwrap_err().contains("not a port"));
        assert!(parse_addr("evil/host 1 42", "42").is_err());
        assert!(parse_addr("a b", "42").is_err());

        let dir = tempfile::tempdir().unwrap();
        let slurm = Slurm::new(SlurmConfig::default(), dir.path().to_path_buf(), "gpu01".into());
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        assert_eq!(slurm.read_addr("m", "42", me).unwrap(), None, "no file yet");
        let path = slurm.addr_path("m", "42");
        std::fs::write(&path, "127.0.0.1 20001 42\n").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(slurm.read_addr("m", "42", me).unwrap().as_deref(), Some("http://127.0.0.1:20001"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert!(slurm.read_addr("m", "42", me).unwrap_err().contains("not a file written by the worker"));
        std::fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", &path).unwrap();
        assert!(slurm.read_addr("m", "42", me).is_err(), "a link is never followed");
    }

    #[test]
    fn squeue_lines_carry_the_jobs_uid_and_comment() {
        let jobs = parse_squeue("41|gpuhub-worker-m|RUNNING|None|990|gpuhub-worker:gpu02:/w/a|b\n42|x|PENDING|Priority||\n");
        assert_eq!(jobs.len(), 2);
        assert_eq!((jobs[0].uid, jobs[0].comment.as_str()), (Some(990), "gpuhub-worker:gpu02:/w/a|b"));
        assert_eq!((jobs[1].uid, jobs[1].reason.as_str(), jobs[1].comment.as_str()), (None, "Priority", ""));
        let dir = |j: &JobInfo, owner: &str| vouched_dir(Some(j), "m", "41", 990, owner);
        assert_eq!(dir(&jobs[0], "gpu02").unwrap(), PathBuf::from("/w/a|b"));
        assert!(dir(&jobs[0], "gpu03").unwrap_err().contains("is not `gpuhub-worker:gpu03:<workers dir>`"));
        assert!(vouched_dir(Some(&jobs[0]), "m", "41", 991, "gpu02").unwrap_err().contains("not as the worker account (uid 991)"));
        assert!(vouched_dir(Some(&jobs[0]), "other", "41", 990, "gpu02").unwrap_err().contains("not `gpuhub-worker-other`"));
        assert!(vouched_dir(Some(&jobs[1]), "m", "42", 990, "gpu02").unwrap_err().contains("PENDING, not RUNNING"));
        assert!(vouched_dir(None, "m", "41", 990, "gpu02").unwrap_err().contains("has ended"));
        assert!(vouched_dir(Some(&jobs[0]), "m", "4", 990, "gpu02").unwrap_err().contains("has ended"), "another job's line");
    }

    #[test]
    fn holder_jobs_say_who_since_when_and_until_when() {
        let j = parse_holder("57|alice|2026-12-01T11:00:00|2026-12-01T15:00:00|gres/gpu:1|train|x.sh").unwrap_or_else(|| unreachable!());
        assert_eq!((j.gpus, j.shards, j.name.as_str()), (1, 0, "train|x.sh"));
        assert_eq!(
            j.describe(),
            "Slurm job 57 `train|x.sh` of alice, 1 GPU since 2026-12-01T11:00:00, until its time limit at 2026-12-01T15:00:00"
        );
        let j = parse_holder("9|bob|2026-12-01T11:00:00|NONE|gres/shard:7|nb").unwrap_or_else(|| unreachable!());
        assert!(j.describe().ends_with("7 shards since 2026-12-01T11:00:00, with no time limit"), "{}", j.describe());
        assert!(parse_holder("garbage").is_none());
    }

    #[tokio::test]
    async fn a_failed_scancel_is_tried_again_until_slurm_takes_it() {
        use std::os::unix::fs::PermissionsExt;
        let bin = tempfile::tempdir().unwrap();
        let d = bin.path().display();
        // scancel fails until `ok` exists; squeue cannot reach slurmctld, except for job 43,
        // which it no longer knows.
        let scripts = [
            (
                "scancel",
                format!(
                    "#!/bin/sh\n[ -e {d}/ok ] || {{ echo 'scancel: error: Unable to contact slurm controller' >&2; exit 1; }}\necho \"$@\" >> {d}/cancelled\n"
                ),
            ),
            (
                "squeue",
                "#!/bin/sh\ncase \"$*\" in *43*) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1;; esac\necho 'slurm_load_jobs error: Unable to contact slurm controller' >&2\nexit 1\n"
                    .to_string(),
            ),
        ];
        for (name, text) in scripts {
            let p = bin.path().join(name);
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let cfg = SlurmConfig { bin_dir: Some(bin.path().to_path_buf()), ..Default::default() };
        let slurm = Slurm::new(cfg, bin.path().to_path_buf(), "gpu01".into());
        slurm.cancel("42").await;
        slurm.cancel("43").await;
        assert_eq!(slurm.cancels_pending(), 2);
        slurm.cancel_again().await;
        assert_eq!(slurm.cancels_pending(), 1, "job 43 is gone; job 42 is still to cancel");
        std::fs::write(bin.path().join("ok"), "").unwrap();
        slurm.cancel_again().await;
        assert_eq!(slurm.cancels_pending(), 0);
        assert_eq!(std::fs::read_to_string(bin.path().join("cancelled")).unwrap(), "42\n");
    }
}
