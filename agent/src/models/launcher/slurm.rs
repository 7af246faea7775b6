//! `launcher = "slurm"`: the worker is an ordinary batch job, `gpuhub-worker-<model>`, submitted
//! with `sbatch` (partition/account/QOS from `[slurm]`), watched with `squeue` and cancelled
//! with `scancel`. The job's output goes to `<workers.dir>/<model>.<jobid>.log`; the job script
//! writes `<host> <port> <jobid>` to `<model>.<jobid>.addr` when it starts, so the agent knows
//! where the worker listens (the node's name when `workers.host` is not loopback).

use std::path::PathBuf;
use std::time::Duration;

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
}

/// One of this agent's worker jobs as `squeue` lists it.
#[derive(Debug, Clone)]
pub struct JobInfo {
    pub id: String,
    pub name: String,
    pub state: String,
    pub reason: String,
}

pub fn job_name(model: &str) -> String {
    format!("gpuhub-worker-{model}")
}

impl Slurm {
    fn bin(&self, tool: &str) -> PathBuf {
        match &self.cfg.bin_dir {
            Some(d) => d.join(tool),
            None => PathBuf::from(tool),
        }
    }

    fn comment(&self) -> String {
        format!("{COMMENT_PREFIX}{}", self.dir.display())
    }

    async fn run(&self, tool: &str, args: &[String]) -> Result<String, LaunchError> {
        let cmd = format!("{tool} {}", args.join(" "));
        let fut = tokio::process::Command::new(self.bin(tool)).args(args).kill_on_drop(true).output();
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

    /// Writes the job script and submits it.
    pub async fn start(&self, spec: &LaunchSpec) -> Result<Instance, LaunchError> {
        std::fs::create_dir_all(&spec.dir).map_err(|source| LaunchError::Io { path: spec.dir.display().to_string(), source })?;
        let safe = safe_name(&spec.model);
        let script_path = spec.dir.join(format!("{safe}.sbatch"));
        let mut s = String::from("#!/bin/sh\n# Written by gpuhub-agent: one model worker. Do not edit; it is rewritten at each start.\n");
        s.push_str(&format!("#SBATCH --job-name={}\n", shell_quote(&job_name(&spec.model))));
        s.push_str(&format!("#SBATCH --output={}\n", spec.dir.join(format!("{safe}.%j.log")).display()));
        s.push_str(&format!("#SBATCH --comment={}\n", shell_quote(&self.comment())));
        s.push_str("#SBATCH --nodes=1 --ntasks=1\n");
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
        if let Some(w) = &spec.workdir {
            s.push_str(&format!("#SBATCH --chdir={}\n", w.display()));
        }
        for (k, v) in &spec.env {
            s.push_str(&format!("export {k}={}\n", shell_quote(v)));
        }
        let addr = spec.dir.join(format!("{safe}.$SLURM_JOB_ID.addr"));
        let host = if spec.host == "0.0.0.0" || spec.host == "::" { "$(hostname)".to_string() } else { spec.host.clone() };
        s.push_str(&format!("echo \"{host} {} $SLURM_JOB_ID\" > \"{}\"\n", spec.port, addr.display()));
        // The worker runs under a watchdog: if no agent has touched the heartbeat file for
        // `orphan_after_s` (the model's idle timeout), the agent is gone and nobody will ever
        // unload this worker, so it stops itself instead of holding the GPU.
        let hb = spec.dir.join(HEARTBEAT_FILE);
        s.push_str(&format!("{} &\nW=$!\ntrap 'kill -TERM $W 2>/dev/null' TERM INT\n", spec.command));
        s.push_str(&format!(
            "while kill -0 $W 2>/dev/null; do\n  sleep 1 & wait $!\n  age=$(( $(date +%s) - $(stat -c %Y \"{hb}\" 2>/dev/null || echo 0) ))\n  if [ \"$age\" -gt {orphan} ]; then\n    echo \"gpuhub: no agent heartbeat for ${{age}}s (more than {orphan}s); stopping the orphaned worker\" >&2\n    kill -TERM $W 2>/dev/null\n    break\n  fi\ndone\nwait $W\n",
            hb = hb.display(),
            orphan = spec.orphan_after_s,
        ));
        std::fs::write(&script_path, s).map_err(|source| LaunchError::Io { path: script_path.display().to_string(), source })?;
        let out = self.run("sbatch", &["--parsable".into(), script_path.display().to_string()]).await?;
        let id = out.trim().split(';').next().unwrap_or("").to_string();
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_digit()) {
            return Err(LaunchError::Command { cmd: "sbatch --parsable".into(), message: format!("unexpected output `{}`", out.trim()) });
        }
        let url_host = if spec.host == "0.0.0.0" { "127.0.0.1" } else { spec.host.as_str() };
        Ok(Instance {
            launcher: LauncherKind::Slurm,
            log_path: spec.dir.join(format!("{safe}.{id}.log")),
            id,
            base_url: format!("http://{url_host}:{}", spec.port),
            api_key: spec.api_key.clone(),
            version: spec.version.clone(),
            started_us: crate::util::now_us(),
            child: None,
        })
    }

    /// One job's state. A job squeue no longer lists has ended.
    pub async fn poll(&self, inst: &Instance) -> RunState {
        match self.job(&inst.id).await {
            Ok(Some(j)) => match j.state.as_str() {
                "PENDING" | "CONFIGURING" | "REQUEUED" => RunState::Pending(j.reason),
                "RUNNING" => RunState::Running,
                other => RunState::Gone(format!("Slurm job {} is {other}", inst.id)),
            },
            Ok(None) => RunState::Gone(format!("Slurm job {} has ended", inst.id)),
            // squeue itself failed (slurmctld restarting?): say running, check again later.
            Err(e) => {
                tracing::warn!(job = %inst.id, error = %e, "cannot check a worker job; will retry");
                RunState::Running
            }
        }
    }

    pub async fn job(&self, id: &str) -> Result<Option<JobInfo>, LaunchError> {
        let out = match self.run("squeue", &["-h".into(), "-j".into(), id.into(), "-o".into(), "%i|%j|%T|%r".into()]).await {
            Ok(o) => o,
            // A job purged from slurmctld's memory: "Invalid job id specified".
            Err(LaunchError::Command { message, .. }) if message.contains("Invalid job id") => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(parse_squeue(&out).into_iter().find(|j| j.id == id))
    }

    /// Every job this agent's workers dir owns (pending or running).
    pub async fn own_jobs(&self) -> Result<Vec<JobInfo>, LaunchError> {
        let out = self.run("squeue", &["-h".into(), "-o".into(), "%i|%j|%T|%r|%k".into()]).await?;
        let comment = self.comment();
        Ok(out
            .lines()
            .filter(|l| l.rsplit('|').next().map(str::trim) == Some(comment.as_str()))
            .filter_map(|l| parse_squeue(l).into_iter().next())
            .collect())
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

    pub async fn cancel(&self, id: &str) {
        if let Err(e) = self.run("scancel", &[id.to_string()]).await {
            tracing::error!(job = %id, error = %e, "scancel failed; the worker job may still hold its GPU");
        }
    }
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

fn parse_squeue(out: &str) -> Vec<JobInfo> {
    out.lines()
        .filter_map(|l| {
            let mut f = l.trim().split('|');
            Some(JobInfo {
                id: f.next()?.to_string(),
                name: f.next()?.to_string(),
                state: f.next()?.to_string(),
                reason: f.next().unwrap_or("").to_string(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
