//! The `gpuhub` command: admins' and users' view of the node.
//!
//! Every subcommand talks to the agent over the control socket (the agent knows who is
//! asking from the kernel, so users see their own jobs and admins see all). Exit codes:
//! 0 ok, 1 a clean "no" (e.g. a refused rename), 2 an error, 130 interrupted.

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
}

/// Runs the CLI; returns the process exit code.
pub async fn run(cli: Cli) -> ExitCode {
    let result = match cli.command {
        Command::Env { json } => env(&cli.socket, json).await,
        Command::Whoami => whoami(&cli.socket).await,
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
    }
}
