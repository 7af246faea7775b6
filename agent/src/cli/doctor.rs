//! `gpuhub doctor`: checks the node end to end and says what to fix.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use super::output;
use crate::control::client;
use crate::control::status::Check;

/// Where Slurm looks for plugstack configuration on RHEL and Debian.
const PLUGSTACK_DIRS: &[&str] = &["/etc/slurm/plugstack.conf.d", "/etc/slurm-llnl/plugstack.conf.d"];
const PLUGSTACK_FILES: &[&str] = &["/etc/slurm/plugstack.conf", "/etc/slurm-llnl/plugstack.conf"];

pub async fn run(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let mut checks = vec![plugin_check(), slurm_check().await];
    match client::request(socket, "GET", "/v1/status", None).await {
        Ok(v) => {
            checks.push(Check { name: "agent".into(), ok: true, detail: format!("reachable at {}", socket.display()), fix: None });
            let agent: Vec<Check> = serde_json::from_value(v).unwrap_or_default();
            checks.extend(agent);
        }
        Err(e) => checks.push(Check {
            name: "agent".into(),
            ok: false,
            detail: e.to_string(),
            fix: Some("start it: systemctl start gpuhub-agent (logs: journalctl -u gpuhub-agent)".into()),
        }),
    }
    let all_ok = checks.iter().all(|c| c.ok);
    if json {
        output::json(&serde_json::to_value(&checks).unwrap_or_default());
    } else {
        for c in &checks {
            output::line(&format!("{:<4} {:<9} {}", if c.ok { "ok" } else { "FAIL" }, c.name, crate::util::sanitize(&c.detail)));
            if let Some(fix) = &c.fix {
                output::line(&format!("               fix: {fix}"));
            }
        }
    }
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Is `spank_gpuhub.so` in the plugstack, and does the file it names exist?
fn plugin_check() -> Check {
    let mut files: Vec<std::path::PathBuf> = PLUGSTACK_FILES.iter().map(Into::into).collect();
    for d in PLUGSTACK_DIRS {
        if let Ok(rd) = std::fs::read_dir(d) {
            files.extend(rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "conf")));
        }
    }
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
            let mut words = line.split_whitespace();
            let (Some(_mode), Some(so)) = (words.next(), words.next()) else { continue };
            if !(so.contains("spank_gpuhub") || so.contains("libgpuhub_spank")) {
                continue;
            }
            let exists = if so.starts_with('/') { Path::new(so).exists() } else { true };
            return Check {
                name: "plugin".into(),
                ok: exists,
                detail: format!("{} in {}", so, f.display()),
                fix: (!exists)
                    .then(|| format!("{so} does not exist: reinstall gpuhub-spank (a Slurm major upgrade needs a rebuilt plugin)")),
            };
        }
    }
    Check {
        name: "plugin".into(),
        ok: false,
        detail: "spank_gpuhub.so is not in any plugstack file".into(),
        fix: Some("install gpuhub-spank (it ships /etc/slurm/plugstack.conf.d/gpuhub.conf) and restart slurmd".into()),
    }
}

async fn slurm_check() -> Check {
    let run =
        tokio::time::timeout(Duration::from_secs(5), tokio::process::Command::new("sinfo").args(["-h", "-o", "%n %T"]).output()).await;
    match run {
        Ok(Ok(out)) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let first = text.lines().next().unwrap_or("no nodes").to_string();
            Check { name: "slurm".into(), ok: true, detail: format!("sinfo: {first}"), fix: None }
        }
        Ok(Ok(out)) => Check {
            name: "slurm".into(),
            ok: false,
            detail: format!("sinfo failed: {}", String::from_utf8_lossy(&out.stderr).trim()),
            fix: Some("check slurmctld and munge (systemctl status slurmctld munge)".into()),
        },
        Ok(Err(e)) => Check {
            name: "slurm".into(),
            ok: false,
            detail: format!("cannot run sinfo: {e}"),
            fix: Some("install the Slurm client tools".into()),
        },
        Err(_) => {
            Check { name: "slurm".into(), ok: false, detail: "sinfo did not answer within 5 s".into(), fix: Some("check slurmctld".into()) }
        }
    }
}
