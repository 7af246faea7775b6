//! Launchers start, watch and stop one model worker. The lifecycle (`lifecycle.rs`) is the same
//! for every launcher; only these four operations differ.
//!
//! - [`local`]: a child process of the agent (the embedded default without Slurm).
//! - [`slurm`]: an ordinary Slurm batch job (`sbatch`/`squeue`/`scancel`), named
//!   `gpuhub-worker-<model>`, visible in `squeue` and accounted like any job.
//!
//! The agent picks the worker's API key (and, for a local worker, its port) and fills the
//! catalog's command template (`{model} {model_path} {version} {port} {host}
//! {api_key_file}`, shell-quoted), exactly as a site would start vLLM. The key itself never
//! appears on a command line: it reaches the worker by environment or by a 0600 file
//! ([`secret`]). Workers run as the unprivileged `workers.user` ([`account`]) with an
//! environment of their own (never the agent's), and a worker is ready only once the kernel
//! shows its account owns the port it answers on ([`proof`]).

pub mod account;
pub mod job_watch;
pub mod local;
pub mod proof;
pub mod secret;
pub mod slurm;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::config::templates::KeyDelivery;
use crate::config::{LauncherKind, ResourceRequest};
use account::WorkerUser;
use secret::KeyFiles;

/// `PATH` of a worker unless its model's `env` sets one.
pub const WORKER_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Everything a launcher needs to start one worker.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub model: String,
    /// The command with every placeholder filled in (a `/bin/sh` command line). For a Slurm
    /// worker `{port}` is `${GPUHUB_WORKER_PORT}`, which the job picks when it starts.
    pub command: String,
    /// The template's and the model's environment (the key is added by the launcher).
    pub env: BTreeMap<String, String>,
    pub resources: ResourceRequest,
    pub workdir: Option<PathBuf>,
    /// Directory for scripts, logs, address and key files.
    pub dir: PathBuf,
    pub host: String,
    /// The port a local worker binds (a Slurm job picks its own).
    pub port: Option<u16>,
    pub api_key: String,
    pub key: KeyDelivery,
    pub key_files: KeyFiles,
    pub user: WorkerUser,
    pub version: Option<String>,
    /// A Slurm worker stops itself after this long without an agent heartbeat.
    pub orphan_after_s: u64,
    /// Slurm nodes the job must not run on (`sbatch --exclude`): where the model's other
    /// replicas run ([`crate::models::replicas::exclude_nodes`]).
    pub exclude: Vec<String>,
    /// How long a Slurm job waits for its worker to listen before it gives up proving the port
    /// (`gpuhub-agent worker-proof`): the model's load timeout.
    pub proof_timeout_s: u64,
    /// This agent's executable: a Slurm job runs `<agent> worker-port HOST` to pick its port.
    pub agent_exe: PathBuf,
}

impl LaunchSpec {
    /// The environment every worker starts with: nothing of the agent's, a minimal `PATH`,
    /// `HOME` and `LANG`, then the template's and model's `env`.
    pub fn base_env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::from([
            ("PATH".to_string(), WORKER_PATH.to_string()),
            ("HOME".to_string(), self.user.home.display().to_string()),
            ("USER".to_string(), self.user.name.clone()),
            ("LOGNAME".to_string(), self.user.name.clone()),
            ("LANG".to_string(), "C.UTF-8".to_string()),
        ]);
        env.extend(self.env.clone());
        env
    }
}

/// One started (or adopted) worker.
#[derive(Debug)]
pub struct Instance {
    pub launcher: LauncherKind,
    /// Slurm job id, or the local process id.
    pub id: String,
    /// `http://HOST:PORT` once known: at start for a local worker, from the job's `.addr`
    /// file for a Slurm worker.
    addr: OnceLock<String>,
    pub api_key: String,
    /// The key file (and shim) of this worker, removed when it stops.
    pub key_files: Option<KeyFiles>,
    /// The worker account's uid: the owner its port must have.
    pub uid: u32,
    pub version: Option<String>,
    pub log_path: PathBuf,
    pub started_us: i64,
    /// The child handle of a local worker started by this agent (`None` once adopted).
    pub(crate) child: Option<tokio::sync::Mutex<tokio::process::Child>>,
    /// Another agent's worker this agent routes calls to (`models::single_flight`): the
    /// agent that owns it. Never stopped here; its owner manages it.
    pub borrowed_from: Option<String>,
}

impl Instance {
    pub fn new(launcher: LauncherKind, id: String, api_key: String, uid: u32, log_path: PathBuf) -> Instance {
        Instance {
            launcher,
            id,
            addr: OnceLock::new(),
            api_key,
            key_files: None,
            uid,
            version: None,
            log_path,
            started_us: crate::util::now_us(),
            child: None,
            borrowed_from: None,
        }
    }

    /// The worker's base URL (without `/v1`), once known.
    pub fn base_url(&self) -> Option<&str> {
        self.addr.get().map(String::as_str)
    }

    /// Sets the base URL (the first value wins).
    pub fn set_base_url(&self, url: String) {
        let _ = self.addr.set(url);
    }
}

/// What the launcher sees of a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunState {
    /// Waiting in Slurm's queue, with Slurm's reason (`Resources`, `Priority`, ...).
    Pending(String),
    Running,
    /// Ended; the text says how (exit status, Slurm state).
    Gone(String),
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("cannot write {path}: {source} (check workers.dir)")]
    Io { path: String, source: std::io::Error },
    #[error("cannot run `{cmd}`: {source} (is Slurm installed? set slurm.bin_dir)")]
    Spawn { cmd: String, source: std::io::Error },
    #[error("`{cmd}` failed: {message}")]
    Command { cmd: String, message: String },
}

/// The launchers of one agent.
#[derive(Debug, Clone)]
pub struct Launchers {
    pub local: local::Local,
    pub slurm: slurm::Slurm,
}

impl Launchers {
    pub async fn start(&self, kind: LauncherKind, spec: &LaunchSpec) -> Result<Instance, LaunchError> {
        match kind {
            LauncherKind::Slurm => self.slurm.start(spec).await,
            LauncherKind::Local | LauncherKind::Static => self.local.start(spec).await,
        }
    }

    pub async fn poll(&self, inst: &Instance) -> RunState {
        match inst.launcher {
            LauncherKind::Slurm => self.slurm.poll(inst).await,
            LauncherKind::Local | LauncherKind::Static => local::Local::poll(inst).await,
        }
    }

    /// Stops the worker and removes its key file.
    pub async fn stop(&self, inst: &Instance) {
        if inst.borrowed_from.is_some() {
            return;
        }
        match inst.launcher {
            LauncherKind::Slurm => self.slurm.stop(inst).await,
            LauncherKind::Local | LauncherKind::Static => local::Local::stop(inst).await,
        }
        if let Some(k) = &inst.key_files {
            k.remove();
        }
    }
}

/// Quotes `s` for `/bin/sh`.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "._-/:=@+,".contains(c)) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Fills the command template. Values are shell-quoted, so a model path with spaces or quotes
/// stays one argument.
pub fn render(template: &str, values: &[(&str, &str)]) -> String {
    let mut out = template.to_string();
    for (k, v) in values {
        out = out.replace(&format!("{{{k}}}"), &shell_quote(v));
    }
    out
}

/// Expands `{adapters}` to the LoRA adapters, `NAME=PATH` each as one shell-quoted argument
/// (vLLM's `--lora-modules {adapters}`); run before [`render`].
pub fn render_adapters(template: &str, adapters: &[String]) -> String {
    if !template.contains("{adapters}") {
        return template.to_string();
    }
    let list: Vec<String> = adapters
        .iter()
        .map(|a| match a.split_once('=') {
            Some((n, p)) => shell_quote(&format!("{}={}", n.trim(), p.trim())),
            None => shell_quote(a.trim()),
        })
        .collect();
    template.replace("{adapters}", &list.join(" "))
}

/// A file-name-safe form of a model name (`Qwen/Qwen3-8B` → `Qwen_Qwen3-8B`).
pub fn safe_name(model: &str) -> String {
    model.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '_' }).collect()
}

/// The last `n` lines of a log file (reads at most the last 64 KiB), with the worker's key
/// redacted (a server may print its own settings).
pub fn log_tail(path: &Path, n: usize, key: &str) -> Vec<String> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return Vec::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut buf = Vec::new();
    if f.read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].iter().map(|l| crate::util::sanitize(&secret::redact(l, key))).collect()
}

/// Whether process `pid` is one of `inst`'s own (every worker runs as the one worker account,
/// so the account cannot tell): its environment carries `GPUHUB_WORKER_TAG=<tag of its key>`
/// (local) or `SLURM_JOB_ID=<job>` (set by slurmstepd); or, for a command that cleared its
/// environment, it is in the local worker's process group or in its job's cgroup. Never true
/// for a static URL (no process of ours).
pub fn is_its_process(inst: &Instance, pid: u32) -> bool {
    match inst.launcher {
        LauncherKind::Local => {
            local::has_env(pid, &local::marker(&inst.api_key))
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .ok()
                    .and_then(|st| st.rsplit_once(')')?.1.split_whitespace().nth(2)?.parse::<u32>().ok())
                    .is_some_and(|pgrp| pgrp.to_string() == inst.id)
        }
        LauncherKind::Slurm => {
            local::has_env(pid, &format!("SLURM_JOB_ID={}", inst.id))
                || std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|cg| in_job_cgroup(&cg, &inst.id))
        }
        LauncherKind::Static => false,
    }
}

/// A process of the worker account that holds one of the listening sockets `inodes` and is not
/// `inst`'s own ([`is_its_process`]): another worker's. Every holder must be the worker's:
/// servers that set `SO_REUSEPORT` (vLLM's does) share a port between sockets of one account,
/// and the kernel spreads connections across them. `ours`: sockets already found to be
/// `inst`'s (skipped, and extended with those found now), so each is looked up in `/proc` once.
/// `None` also where the holders cannot be seen (descriptors this agent cannot read, a process
/// that is not dumpable): that cannot be told, as before this check.
pub fn foreign_holder(inst: &Instance, inodes: &[u64], ours: &mut Vec<u64>) -> Option<u32> {
    if inodes.iter().all(|i| ours.contains(i)) {
        return None;
    }
    match proof::holders(inst.uid, inodes).into_iter().find(|pid| !is_its_process(inst, *pid)) {
        None => {
            for i in inodes {
                if !ours.contains(i) {
                    ours.push(*i);
                }
            }
            None
        }
        other => other,
    }
}

/// Whether a `/proc/PID/cgroup` text puts the process in Slurm job `job`'s cgroup
/// (`.../job_<job>/...`, cgroup v1 or v2).
fn in_job_cgroup(cgroup: &str, job: &str) -> bool {
    let dir = format!("/job_{job}");
    cgroup.lines().any(|l| l.match_indices(&dir).any(|(i, _)| l[i + dir.len()..].is_empty() || l[i + dir.len()..].starts_with('/')))
}

/// How long a port [`pick_port`] handed out is not handed out again by this process: longer
/// than a worker takes to bind it (a large model loads before its server listens).
const PICKED_FOR: std::time::Duration = std::time::Duration::from_secs(3600);

/// Ports this process picked, and when.
static PICKED: std::sync::Mutex<Vec<(u16, std::time::Instant)>> = std::sync::Mutex::new(Vec::new());

/// A free TCP port on `host` (bound and released; the worker binds it right after). Taken
/// below the kernel's ephemeral range when there is room (there only a listener can take it,
/// not any outgoing connection's source port), else from `bind(0)`; never one this process
/// picked in the last hour, so two workers an agent starts at once do not race for one port.
/// A process that takes it between this pick and the worker's bind is caught by the readiness
/// proof (another user's by its uid, another worker's by its process: [`is_its_process`]).
pub fn pick_port(host: &str) -> std::io::Result<u16> {
    use rand::Rng;
    let bind = if host == "0.0.0.0" || host == "::" { "127.0.0.1" } else { host };
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| t.split_whitespace().next().and_then(|v| v.parse::<u16>().ok()))
        .unwrap_or(32768);
    let mut picked = PICKED.lock().unwrap_or_else(|p| p.into_inner());
    picked.retain(|(_, at)| at.elapsed() < PICKED_FOR);
    let fresh = |port: u16, picked: &[(u16, std::time::Instant)]| {
        !picked.iter().any(|(p, _)| *p == port) && std::net::TcpListener::bind((bind, port)).is_ok()
    };
    let mut port = None;
    if low > 21_000 {
        let mut rng = rand::thread_rng();
        port = (0..64).map(|_| rng.gen_range(20_000..low)).find(|p| fresh(*p, &picked));
    }
    if port.is_none() {
        for _ in 0..16 {
            let l = std::net::TcpListener::bind((bind, 0))?;
            let p = l.local_addr()?.port();
            if !picked.iter().any(|(q, _)| *q == p) {
                port = Some(p);
                break;
            }
        }
    }
    let port =
        port.ok_or_else(|| std::io::Error::new(std::io::ErrorKind::AddrInUse, "every free port tried was picked for another worker"))?;
    picked.push((port, std::time::Instant::now()));
    Ok(port)
}

/// A fresh per-worker API key (256 bits, hex).
pub fn new_api_key() -> String {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut b);
    format!("gpuhub-worker-{}", hex::encode(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_a_workers_by_its_marker_group_or_job_cgroup() {
        use std::os::unix::process::CommandExt;
        let v2 = "0::/system.slice/slurmstepd.scope/job_123/step_batch/user/task_0\n";
        let v1 = "4:memory:/slurm/uid_990/job_123/step_batch\n1:cpu:/\n";
        for text in [v2, v1] {
            assert!(in_job_cgroup(text, "123"), "{text}");
            assert!(!in_job_cgroup(text, "12") && !in_job_cgroup(text, "1234") && !in_job_cgroup(text, "23"), "{text}");
        }
        assert!(in_job_cgroup("0::/slurm/job_77\n", "77"));
        // A local worker's command that cleared its environment is still in the worker's group.
        let mut child = std::process::Command::new("sleep").arg("30").env_clear().process_group(0).spawn().unwrap();
        let pid = child.id();
        let mut inst = Instance::new(LauncherKind::Local, pid.to_string(), "k1".into(), 0, PathBuf::new());
        assert!(is_its_process(&inst, pid), "the group leader");
        assert!(!is_its_process(&inst, std::process::id()), "another process");
        inst.id = "1".into();
        assert!(!is_its_process(&inst, pid), "another group, no marker");
        // Its marker, in any group.
        let mut marked = std::process::Command::new("sleep").arg("30").env_clear().env(secret::TAG_ENV, secret::tag("k1")).spawn().unwrap();
        assert!(is_its_process(&inst, marked.id()));
        inst.api_key = "k2".into();
        assert!(!is_its_process(&inst, marked.id()), "another worker's marker");
        for c in [&mut child, &mut marked] {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    #[test]
    fn pick_port_stays_below_the_ephemeral_range() {
        let p = pick_port("127.0.0.1").unwrap();
        assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok(), "port {p} is free");
        let low: u16 =
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap().split_whitespace().next().unwrap().parse().unwrap();
        if low > 21_000 {
            assert!((20_000..low).contains(&p), "{p} is in the ephemeral range");
        }
        // Picks never repeat while the workers they were for may still be binding them.
        let many: Vec<u16> = (0..300).map(|_| pick_port("127.0.0.1").unwrap()).collect();
        let distinct: std::collections::BTreeSet<u16> = many.iter().copied().chain([p]).collect();
        assert_eq!(distinct.len(), 301, "a port was handed out twice");
    }

    #[test]
    fn render_quotes_values() {
        let r = render(
            "srv --model {model} --path {model_path} --port {port}",
            &[("model", "a/b"), ("model_path", "/x y/it's"), ("port", "8000")],
        );
        assert_eq!(r, "srv --model a/b --path '/x y/it'\\''s' --port 8000");
        let a = render_adapters("vllm --lora-modules {adapters} --port {port}", &["sql = /w/sql".into(), "b=/w/my b".into()]);
        assert_eq!(a, "vllm --lora-modules sql=/w/sql 'b=/w/my b' --port {port}");
        assert_eq!(safe_name("Qwen/Qwen3-8B:v1"), "Qwen_Qwen3-8B_v1");
    }
}
