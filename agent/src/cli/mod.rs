//! The `gpuhub` command: admins' and users' view of the node.
//!
//! Every subcommand talks to the agent over the control socket (the agent knows who is
//! asking from the kernel, so users see their own jobs and admins see all). Exit codes:
//! 0 ok, 1 a clean "no" (e.g. a refused rename), 2 an error, 130 interrupted.

pub mod calls;
pub mod doctor;
pub mod keys;
pub mod models;
pub mod names;
pub mod output;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::control::client;

#[derive(Debug, Parser)]
#[command(name = "gpuhub", version, about = "gpuhub: GPU usage, models and names on this Slurm node")]
pub struct Cli {
    /// The agent's control socket.
    #[arg(long, global = true, env = "GPUHUB_SOCKET", value_name = "PATH", default_value = "/run/gpuhub/agent.sock")]
    pub socket: PathBuf,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the variables jobs get (gateway URL, MLflow, <ROLE>_MODEL) as KEY=value lines,
    /// for a systemd unit's EnvironmentFile.
    Env {
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Show who the agent thinks you are and whether you are an admin.
    Whoami,
    /// Models and their workers: state (unloaded, pending, starting, ready, draining, failed),
    /// Slurm job, version; `load`, `unload`, `promote` for admins.
    Models {
        #[command(subcommand)]
        cmd: Option<models::ModelsCmd>,
    },
    /// Model names: list, callers, history, rename, deprecate, retire, restore.
    Names {
        #[command(subcommand)]
        cmd: names::NamesCmd,
    },
    /// App roles (ocr, chat, tts, ...) and the model each one points at (<ROLE>_MODEL).
    Roles {
        #[command(subcommand)]
        cmd: Option<names::RolesCmd>,
        /// Print JSON instead (with no subcommand: the list).
        #[arg(long)]
        json: bool,
    },
    /// Gateway API keys: create, list, revoke your own (admins: anyone's).
    Keys {
        #[command(subcommand)]
        cmd: keys::KeysCommand,
    },
    /// Usage on this node. `--calls`: gateway calls per user, app, name and model.
    Usage {
        /// Show gateway calls (from the hourly rollups).
        #[arg(long)]
        calls: bool,
        /// How far back, e.g. 30d, 12h.
        #[arg(long, default_value = "30d", value_name = "DURATION")]
        since: String,
        /// Group GPU-hours by.
        #[arg(long, value_enum, default_value = "user")]
        by: crate::accounting::UsageBy,
        /// Only this user (admins; users always see their own).
        #[arg(long, value_name = "USER")]
        user: Option<String>,
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// One job's summary: GPUs, shards, GPU-seconds, and what NVML measured per GPU.
    Job {
        job_id: u32,
        #[arg(long)]
        json: bool,
    },
    /// GPU-hour quotas: your usage, limit and forecast (admins: everyone's); `grant` a
    /// top-up or `set` a limit (admins), which reaches Slurm before the command returns.
    Quota {
        #[command(subcommand)]
        cmd: Option<crate::quota::cli::QuotaCmd>,
        /// Print JSON instead.
        #[arg(long, global = true)]
        json: bool,
    },
    /// Check the node end to end (plugin, Slurm, agent, store, spool, NVML, MLflow) and say
    /// what to fix. Exit 1 if anything fails.
    Doctor {
        #[arg(long)]
        json: bool,
    },
    /// Write a backup of the store (SQLite online copy or pg_dump); admin only.
    Backup {
        /// Directory for the backup (default: <state_dir>/backups on the agent's side).
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Keep this many newest backups.
        #[arg(long, default_value_t = 7)]
        keep: usize,
    },
}

/// Runs the CLI; returns the process exit code.
pub async fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Env { json } => env(&cli.socket, json).await,
        Command::Whoami => whoami(&cli.socket).await,
        Command::Models { cmd } => models::run(&cli.socket, cmd).await,
        Command::Names { cmd } => names::names(&cli.socket, cmd).await,
        Command::Roles { cmd, json } => names::roles(&cli.socket, cmd.unwrap_or(names::RolesCmd::List { json })).await,
        Command::Keys { cmd } => keys::run(&cli.socket, cmd).await,
        Command::Usage { calls: true, since, user, json, .. } => calls::run(&cli.socket, &since, user.as_deref(), json).await,
        Command::Usage { calls: false, since, by, json, .. } => crate::accounting::cli::usage(&cli.socket, &since, by, json).await,
        Command::Job { job_id, json } => crate::accounting::cli::job(&cli.socket, job_id, json).await,
        Command::Quota { cmd, json } => crate::quota::cli::run(&cli.socket, cmd, json).await,
        Command::Doctor { json } => doctor::run(&cli.socket, json).await,
        Command::Backup { dir, keep } => backup(&cli.socket, dir, keep).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            output::error(&format!("{e:#}"));
            ExitCode::from(2)
        }
    }
}

async fn env(socket: &std::path::Path, json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "GET", "/v1/env", None).await?;
    if json {
        output::json(&v);
    } else if let Some(map) = v.as_object() {
        for (k, val) in map {
            output::line(&format!("{k}={}", val.as_str().unwrap_or_default()));
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn backup(socket: &std::path::Path, dir: Option<PathBuf>, keep: usize) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "POST", "/v1/admin/backup", Some(serde_json::json!({"dir": dir, "keep": keep}))).await?;
    output::line(&format!("backup written: {}", v["path"].as_str().unwrap_or("?")));
    Ok(ExitCode::SUCCESS)
}

async fn whoami(socket: &std::path::Path) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "GET", "/v1/whoami", None).await?;
    output::line(&format!(
        "{} (uid {}){}",
        crate::util::sanitize(v["user"].as_str().unwrap_or("?")),
        v["uid"],
        if v["admin"].as_bool() == Some(true) { ", admin" } else { "" }
    ));
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
        assert!(Cli::try_parse_from(["gpuhub", "env", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "bogus"]).is_err());
        assert!(Cli::try_parse_from(["gpuhub", "keys", "create", "--user", "alice", "--app", "ocr", "--models", "a,b"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "keys", "create", "--user", "alice"]).is_err());
        assert!(Cli::try_parse_from(["gpuhub", "keys", "revoke"]).is_err());
        assert!(Cli::try_parse_from(["gpuhub", "usage", "--calls", "--since", "12h"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "grant", "--user", "alice", "--gpu-hours", "0.5", "--reason", "x"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "grant", "--gpu-hours", "1"]).is_err(), "whose quota");
        assert!(Cli::try_parse_from(["gpuhub", "quota", "grant", "--user", "a", "--group", "g", "--gpu-hours", "1"]).is_err());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "set", "--account", "lab", "--gpu-hours", "10"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "set", "--account", "lab", "--clear"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "quota", "set", "--account", "lab"]).is_err(), "a limit or --clear");
    }
}
