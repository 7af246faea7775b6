//! `gpuhub-agent`: the node daemon. Argument parsing and startup only; the service is
//! `gpuhub_agent::run`.
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpuhub_agent::config::Config;

/// mimalloc, not glibc's malloc: the gateway allocates and frees small buffers on every call
/// (headers, bodies, usage rows); glibc's allocator was ~8 % of its CPU per call, mimalloc's
/// is about half that (BENCHMARKS.md). Built without transparent huge pages (Cargo.toml).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(name = "gpuhub-agent", version, about = "gpuhub node agent: usage accounting, GPU telemetry, model gateway")]
struct Args {
    /// Configuration file. Without it, /etc/gpuhub/agent.toml if it exists, else the embedded defaults.
    #[arg(long, global = true, env = "GPUHUB_CONFIG", value_name = "PATH")]
    config: Option<PathBuf>,
    /// Log format: `text` (default on a terminal) or `json` (one object per line).
    #[arg(long, global = true, env = "GPUHUB_LOG_FORMAT", value_name = "FORMAT", default_value = "text")]
    log_format: String,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the agent (the default).
    Run,
    /// Load and validate the configuration, print the effective config (secrets redacted),
    /// exit non-zero on error. Use it as the unit's ExecStartPre.
    CheckConfig,
    /// Print a free TCP port on HOST (below the ephemeral range when there is room). Model
    /// worker jobs run it as they start, as the worker account; it reads no configuration.
    #[command(hide = true)]
    WorkerPort {
        /// The address the worker will bind.
        host: String,
    },
    /// Prove who listens on PORT, from the worker's node: writes `JOBID PORT ok` (or `JOBID
    /// PORT uid N`) to FILE once something listens, waiting at most SECS. Slurm worker jobs
    /// run it as the worker account; it reads no configuration.
    #[command(hide = true)]
    WorkerProof {
        port: u16,
        job: String,
        file: PathBuf,
        secs: u64,
        /// The worker's address: only the sockets a call there could reach count (without it,
        /// every socket on the port). An environment variable, not an argument, so that a job
        /// script of a newer agent still runs an older `gpuhub-agent` on a node not yet
        /// upgraded (which ignores it).
        #[arg(long, env = "GPUHUB_PROOF_HOST")]
        host: Option<String>,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::WorkerPort { host }) = &args.command {
        use std::io::Write;
        return match gpuhub_agent::models::launcher::pick_port(host) {
            Ok(port) => match writeln!(std::io::stdout().lock(), "{port}") {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::from(2),
            },
            Err(e) => {
                eprintln!("gpuhub-agent: error: no free port on {host}: {e}");
                ExitCode::from(2)
            }
        };
    }
    if let Some(Command::WorkerProof { port, job, file, secs, host }) = &args.command {
        return match gpuhub_agent::models::launcher::proof::prove_port(*port, job, file, *secs, host.as_deref()) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => {
                eprintln!("gpuhub-agent: error: nothing listened on port {port} within {secs} s; no proof written to {}", file.display());
                ExitCode::from(1)
            }
            Err(e) => {
                eprintln!("gpuhub-agent: error: cannot prove who listens on port {port} (writing {}): {e}", file.display());
                ExitCode::from(2)
            }
        };
    }
    init_logging(&args.log_format);
    let (path, is_default) = match &args.config {
        Some(p) => (p.clone(), false),
        None => (PathBuf::from(gpuhub_wire::paths::CONFIG_FILE), true),
    };
    let config = match Config::load(&path, is_default) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpuhub-agent: error: {e}");
            return ExitCode::from(2);
        }
    };
    match args.command.unwrap_or(Command::Run) {
        Command::CheckConfig => {
            use std::io::Write;
            let text = format!("{}{}", config.render_redacted(), config.render_worker_commands());
            match std::io::stdout().lock().write_all(text.as_bytes()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(_) => ExitCode::from(2),
            }
        }
        Command::Run => run(config),
        Command::WorkerPort { .. } | Command::WorkerProof { .. } => ExitCode::from(2),
    }
}

fn run(config: Config) -> ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("gpuhub-agent: error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    rt.block_on(async move {
        if config.source.is_none() {
            tracing::info!("no config file at {}; running on the embedded defaults", gpuhub_wire::paths::CONFIG_FILE);
        }
        let listeners = match gpuhub_agent::Listeners::bind(&config).await {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("{e:#}");
                eprintln!("gpuhub-agent: error: {e:#}");
                return ExitCode::from(2);
            }
        };
        match gpuhub_agent::run(config, listeners, gpuhub_agent::shutdown_signal()).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e:#}");
                eprintln!("gpuhub-agent: error: {e:#}");
                ExitCode::from(2)
            }
        }
    })
}

fn init_logging(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("GPUHUB_LOG").unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    if format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
