//! `launcher = "local"`: the worker is a child process of the agent, in its own process group,
//! with stdout and stderr in `<workers.dir>/<model>.<time>.log`.
//!
//! The child drops to `workers.user` before exec and starts from an empty environment (a
//! minimal `PATH`/`HOME`/`LANG`, the template's and model's `env`, the key variable if the
//! template takes the key that way, and `GPUHUB_WORKER_TAG`, the marker an agent that
//! restarts finds the worker by). Nothing of the agent's environment reaches it.

use std::process::Stdio;
use std::time::Duration;

use super::{Instance, LaunchError, LaunchSpec, RunState, safe_name, secret};
use crate::config::LauncherKind;

#[derive(Debug, Clone, Default)]
pub struct Local;

impl Local {
    pub async fn start(&self, spec: &LaunchSpec) -> Result<Instance, LaunchError> {
        use std::os::unix::fs::OpenOptionsExt;
        let port = spec.port.ok_or_else(|| LaunchError::Command { cmd: "local worker".into(), message: "no port was picked".into() })?;
        std::fs::create_dir_all(&spec.dir).map_err(|source| LaunchError::Io { path: spec.dir.display().to_string(), source })?;
        let log_path = spec.dir.join(format!("{}.{}.log", safe_name(&spec.model), crate::util::now_us()));
        let log = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o640)
            .open(&log_path)
            .map_err(|source| LaunchError::Io { path: log_path.display().to_string(), source })?;
        let err = log.try_clone().map_err(|source| LaunchError::Io { path: log_path.display().to_string(), source })?;
        let mut env = spec.base_env();
        match (&spec.key.env, &spec.key.env_for, &spec.key_files.shim_dir) {
            (Some(_), Some(_), Some(shim)) => {
                let path = env.get("PATH").cloned().unwrap_or_default();
                env.insert("PATH".into(), format!("{}:{path}", shim.display()));
            }
            (Some(var), None, _) => {
                env.insert(var.clone(), spec.api_key.clone());
            }
            _ => {}
        }
        env.insert(secret::TAG_ENV.into(), secret::tag(&spec.api_key));
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(format!("exec {}", spec.command))
            .env_clear()
            .envs(&env)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .process_group(0)
            .current_dir(spec.workdir.as_deref().unwrap_or(&spec.dir));
        let user = spec.user.clone();
        // SAFETY: the closure runs in the forked child before exec and only makes
        // async-signal-safe syscalls (setgroups, setgid, setuid, getuid) on data prepared
        // before the fork.
        unsafe {
            cmd.pre_exec(move || user.drop_privileges());
        }
        let child = cmd.spawn().map_err(|source| LaunchError::Spawn { cmd: spec.command.clone(), source })?;
        let pid = child.id().map(|p| p.to_string()).unwrap_or_default();
        let host = if spec.host == "0.0.0.0" { "127.0.0.1" } else { spec.host.as_str() };
        let mut inst = Instance::new(LauncherKind::Local, pid, spec.api_key.clone(), spec.user.uid, log_path);
        inst.set_base_url(format!("http://{host}:{port}"));
        inst.key_files = Some(spec.key_files.clone());
        inst.version = spec.version.clone();
        inst.child = Some(tokio::sync::Mutex::new(child));
        Ok(inst)
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

    /// Finds a worker this agent started before a restart: the process must run as the worker
    /// account and carry the marker derived from the worker's key in its environment (read
    /// from `/proc/PID/environ`, which only its owner and root can read), so a reused pid is
    /// never mistaken for it and the key is never looked for on a command line.
    pub fn adopt(pid: &str, api_key: &str, uid: u32) -> bool {
        let Ok(n) = pid.parse::<u32>() else { return false };
        pid_alive(pid) && process_uid(pid) == Some(uid) && has_env(n, &marker(api_key))
    }
}

fn process_uid(pid: &str) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    // Uid: real effective saved fs; the effective uid is what the worker acts as.
    line.split_whitespace().nth(2)?.parse().ok()
}

/// `GPUHUB_WORKER_TAG=<tag of the key>`: in the environment of a local worker (and of what it
/// starts), nowhere else.
pub fn marker(api_key: &str) -> String {
    format!("{}={}", secret::TAG_ENV, secret::tag(api_key))
}

/// Whether process `pid`'s environment holds the entry `entry` (`NAME=value`), read from
/// `/proc/PID/environ` (only its owner and root can read it).
pub fn has_env(pid: u32, entry: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/environ")).is_ok_and(|e| e.split(|b| *b == 0).any(|v| v == entry.as_bytes()))
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
    // SAFETY: signal 0 only checks that the process exists (EPERM: it exists, another uid's).
    unsafe { libc::kill(pid, 0) == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) }
}
