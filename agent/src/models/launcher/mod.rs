//! Launchers start, watch and stop one model worker. The lifecycle (`lifecycle.rs`) is the same
//! for every launcher; only these four operations differ.
//!
//! - [`local`]: a child process of the agent (the embedded default without Slurm).
//! - [`slurm`]: an ordinary Slurm batch job (`sbatch`/`squeue`/`scancel`), named
//!   `gpuhub-worker-<model>`, visible in `squeue` and accounted like any job.
//!
//! The agent picks the worker's port and API key and fills them into the catalog's command
//! template (`{model} {model_path} {version} {port} {host} {api_key}`, shell-quoted), exactly
//! as a site would start vLLM.

pub mod local;
pub mod slurm;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::config::{LauncherKind, ResourceRequest};

/// Everything a launcher needs to start one worker.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub model: String,
    /// The command with every placeholder filled in (a `/bin/sh` command line).
    pub command: String,
    pub env: BTreeMap<String, String>,
    pub resources: ResourceRequest,
    pub workdir: Option<PathBuf>,
    /// Directory for scripts and logs.
    pub dir: PathBuf,
    pub host: String,
    pub port: u16,
    pub api_key: String,
    pub version: Option<String>,
    /// A Slurm worker stops itself after this long without an agent heartbeat.
    pub orphan_after_s: u64,
}

/// One started (or adopted) worker.
#[derive(Debug)]
pub struct Instance {
    pub launcher: LauncherKind,
    /// Slurm job id, or the local process id.
    pub id: String,
    pub base_url: String,
    pub api_key: String,
    pub version: Option<String>,
    pub log_path: PathBuf,
    pub started_us: i64,
    /// The child handle of a local worker started by this agent (`None` once adopted).
    pub(crate) child: Option<tokio::sync::Mutex<tokio::process::Child>>,
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

    pub async fn stop(&self, inst: &Instance) {
        match inst.launcher {
            LauncherKind::Slurm => self.slurm.stop(inst).await,
            LauncherKind::Local | LauncherKind::Static => local::Local::stop(inst).await,
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

/// The last `n` lines of a log file (reads at most the last 64 KiB).
pub fn log_tail(path: &Path, n: usize) -> Vec<String> {
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
    lines[lines.len().saturating_sub(n)..].iter().map(|l| crate::util::sanitize(l)).collect()
}

/// A free TCP port on `host` (bound and released; the worker binds it right after).
pub fn pick_port(host: &str) -> std::io::Result<u16> {
    let bind = if host == "0.0.0.0" || host == "::" { "127.0.0.1" } else { host };
    let l = std::net::TcpListener::bind((bind, 0))?;
    Ok(l.local_addr()?.port())
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
