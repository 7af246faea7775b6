//! `launcher = "local"`: the worker is a child process of the agent, in its own process group,
//! with stdout and stderr in `<workers.dir>/<model>.<pid>.log`.

use std::process::Stdio;
use std::time::Duration;

use super::{Instance, LaunchError, LaunchSpec, RunState, safe_name};
use crate::config::LauncherKind;

#[derive(Debug, Clone, Default)]
pub struct Local;

impl Local {
    pub async fn start(&self, spec: &LaunchSpec) -> Result<Instance, LaunchError> {
        std::fs::create_dir_all(&spec.dir).map_err(|source| LaunchError::Io { path: spec.dir.display().to_string(), source })?;
        let log_path = spec.dir.join(format!("{}.{}.log", safe_name(&spec.model), crate::util::now_us()));
        let log = std::fs::File::create(&log_path).map_err(|source| LaunchError::Io { path: log_path.display().to_string(), source })?;
        let err = log.try_clone().map_err(|source| LaunchError::Io { path: log_path.display().to_string(), source })?;
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c").arg(format!("exec {}", spec.command)).envs(&spec.env).stdin(Stdio::null()).stdout(log).stderr(err).process_group(0);
        if let Some(dir) = &spec.workdir {
            cmd.current_dir(dir);
        }
        let child = cmd.spawn().map_err(|source| LaunchError::Spawn { cmd: spec.command.clone(), source })?;
        let pid = child.id().map(|p| p.to_string()).unwrap_or_default();
        let host = if spec.host == "0.0.0.0" { "127.0.0.1" } else { spec.host.as_str() };
        Ok(Instance {
            launcher: LauncherKind::Local,
            id: pid,
            base_url: format!("http://{host}:{}", spec.port),
            api_key: spec.api_key.clone(),
            version: spec.version.clone(),
            log_path,
            started_us: crate::util::now_us(),
            child: Some(tokio::sync::Mutex::new(child)),
        })
    }

    pub async fn poll(inst: &Instance) -> RunState {
        if let Some(child) = &inst.child {
            return match child.lock().await.try_wait() {
                Ok(None) => RunState::Running,
                Ok(Some(status)) => RunState::Gone(format!("process {} exited ({status})", inst.id)),
                Err(e) => RunState::Gone(format!("process {}: {e}", inst.id)),
            };
        }
        if pid_alive(&inst.id) { RunState::Running } else { RunState::Gone(format!("process {} is gone", inst.id)) }
    }

    /// SIGTERM to the worker's process group, SIGKILL after 10 s.
    pub async fn stop(inst: &Instance) {
        let Ok(pid) = inst.id.parse::<i32>() else { return };
        signal_group(pid, libc::SIGTERM);
        for _ in 0..200 {
            if matches!(Self::poll(inst).await, RunState::Gone(_)) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tracing::warn!(pid, "worker did not stop within 10 s of SIGTERM; sending SIGKILL");
        signal_group(pid, libc::SIGKILL);
        if let Some(child) = &inst.child {
            let _ = child.lock().await.wait().await;
        }
    }

    /// Finds a worker this agent started before a restart: the process must still run the
    /// command that holds the worker's API key (so a reused pid is never mistaken for it).
    pub fn adopt(pid: &str, api_key: &str) -> bool {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
        let cmdline = String::from_utf8_lossy(&cmdline);
        pid_alive(pid) && cmdline.contains(api_key)
    }
}

fn signal_group(pid: i32, sig: i32) {
    // SAFETY: plain syscall; a negative pid addresses the process group created at spawn.
    let rc = unsafe { libc::kill(-pid, sig) };
    if rc != 0 {
        // SAFETY: as above, the process itself (group already gone or not a leader).
        unsafe { libc::kill(pid, sig) };
    }
}

fn pid_alive(pid: &str) -> bool {
    let Ok(pid) = pid.parse::<i32>() else { return false };
    // Zombies count as gone.
    if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        && stat.rsplit_once(')').is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
    {
        return false;
    }
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}
