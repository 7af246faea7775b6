//! `gpuhub`: the admin and user CLI. Argument parsing only; the work is in `gpuhub_agent::cli`.
use std::process::ExitCode;

use clap::Parser;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = gpuhub_agent::cli::Cli::parse();
    tokio::select! {
        code = gpuhub_agent::cli::run(cli) => code,
        _ = tokio::signal::ctrl_c() => ExitCode::from(130),
    }
}
