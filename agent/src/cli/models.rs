//! `gpuhub models`: what each model is doing (state, Slurm job, version, why), and the admin
//! verbs `load`, `unload`, `promote`.

use std::path::Path;
use std::process::ExitCode;

use clap::Subcommand;
use serde_json::{Value, json};

use super::output;
use crate::control::client;

#[derive(Debug, Subcommand)]
pub enum ModelsCmd {
    /// List models with their state, worker, version and detail (the default).
    List {
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Start a model's worker now and wait until it is ready (admins).
    Load { model: String },
    /// Drain and stop a model's worker (admins).
    Unload { model: String },
    /// Serve VERSION if it passes gpuhub's gate (admins): its eval metric against the threshold
    /// and no regression against the version served now. Recorded, then MLflow's `@production`
    /// is moved; a running worker is replaced with no failed call when the GPUs have room for a
    /// second one, else the next start serves it (the output says which). Exit 1 if the gate
    /// refuses.
    Promote {
        model: String,
        version: String,
        /// Promote past a failed gate (logged and recorded with your uid).
        #[arg(long)]
        force: bool,
    },
    /// Every registered model in MLflow, served or not: latest version, aliases, tags, what
    /// serves it, and why a model tagged served_by=gateway is not served.
    Registry {
        #[arg(long)]
        json: bool,
    },
    /// Read agent.toml's [[models]], [roles], [templates] and [gateway.limits] again, as SIGHUP does (admins).
    /// A file that does not validate changes nothing; the error says why (exit 2).
    Reload,
}

pub async fn run(socket: &Path, cmd: Option<ModelsCmd>) -> anyhow::Result<ExitCode> {
    match cmd.unwrap_or(ModelsCmd::List { json: false }) {
        ModelsCmd::List { json } => list(socket, json).await,
        ModelsCmd::Load { model } => {
            let v = client::request(socket, "POST", "/v1/models/load", Some(json!({"model": model}))).await?;
            output::line(&format!("{}: {}{}", crate::util::sanitize(&model), v["state"].as_str().unwrap_or("?"), suffix(&v)));
            Ok(ExitCode::SUCCESS)
        }
        ModelsCmd::Unload { model } => {
            let v = client::request(socket, "POST", "/v1/models/unload", Some(json!({"model": model}))).await?;
            if v["unloaded"].as_bool() == Some(true) {
                output::line(&format!("{}: unloaded", crate::util::sanitize(&model)));
            } else {
                output::line(&format!(
                    "{}: was not loaded ({})",
                    crate::util::sanitize(&model),
                    v["status"]["state"].as_str().unwrap_or("?")
                ));
            }
            Ok(ExitCode::SUCCESS)
        }
        ModelsCmd::Promote { model, version, force } => {
            let v =
                client::request(socket, "POST", "/v1/models/promote", Some(json!({"model": model, "version": version, "force": force})))
                    .await?;
            output::line(&crate::util::sanitize(v["message"].as_str().unwrap_or("")));
            Ok(if v["promoted"].as_bool() == Some(true) { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        ModelsCmd::Reload => {
            let v = client::request(socket, "POST", "/v1/models/reload", None).await?;
            let list = |k: &str| -> String {
                let names: Vec<String> =
                    v["change"][k].as_array().into_iter().flatten().filter_map(|x| x.as_str()).map(crate::util::sanitize).collect();
                if names.is_empty() { "none".into() } else { names.join(", ") }
            };
            output::line(&format!("reloaded: added {}; removed {}; changed {}", list("added"), list("removed"), list("changed")));
            if v["limits"].as_bool() == Some(true) {
                output::line("[gateway.limits] apply from the next call (the calls and tokens counted so far stay)");
            }
            if v["access"].as_bool() == Some(true) {
                output::line("[gateway.user_models] and gateway.keys_per_user apply from the next call");
            }
            let later: Vec<String> =
                v["needs_restart"].as_array().into_iter().flatten().filter_map(|x| x.as_str()).map(str::to_string).collect();
            if !later.is_empty() {
                output::line(&format!("changed sections that take effect at the next restart: {}", later.join(", ")));
            }
            Ok(ExitCode::SUCCESS)
        }
        ModelsCmd::Registry { json } => {
            let v = client::request(socket, "GET", "/v1/models/registry", None).await?;
            if json {
                output::json(&v);
            } else {
                let rows: Vec<Vec<String>> = v["registered"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|r| {
                        let served: Vec<String> =
                            r["served_as"].as_array().into_iter().flatten().filter_map(|x| x.as_str().map(str::to_string)).collect();
                        let by = r["served_by"].as_str().filter(|b| !b.is_empty()).map(|b| format!(" (by {b})")).unwrap_or_default();
                        let pairs = |k: &str, pre: &str| -> String {
                            let v: Vec<String> = r[k]
                                .as_object()
                                .into_iter()
                                .flatten()
                                .map(|(k, v)| crate::util::sanitize(&format!("{pre}{k}={}", v.as_str().unwrap_or(""))))
                                .collect();
                            if v.is_empty() { "-".into() } else { v.join(",") }
                        };
                        vec![
                            crate::util::sanitize(&s(&r["name"])),
                            s(&r["latest_version"]),
                            pairs("aliases", "@"),
                            if served.is_empty() { "(not served)".into() } else { format!("{}{by}", served.join(",")) },
                            pairs("tags", ""),
                        ]
                    })
                    .collect();
                output::table(&["REGISTERED MODEL", "LATEST", "ALIASES", "SERVED AS", "TAGS"], &rows);
                output::line(&format!("{} registered models", rows.len()));
                for r in v["registered"].as_array().into_iter().flatten() {
                    for e in r["errors"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                        output::line(&format!("not served: {}", crate::util::sanitize(e)));
                    }
                }
                if let Some(e) = v["poll_error"].as_str() {
                    output::line(&format!("the agent's last registry read failed: {}", crate::util::sanitize(e)));
                }
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(x) => x.clone(),
        other => other.to_string(),
    }
}

fn suffix(v: &Value) -> String {
    let mut out = String::new();
    if let Some(id) = v["worker_id"].as_str() {
        out.push_str(&format!(" (worker {id})"));
    }
    if let Some(d) = v["detail"].as_str() {
        out.push_str(&format!(": {d}"));
    }
    out
}

async fn list(socket: &Path, as_json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "GET", "/v1/models", None).await?;
    if as_json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let models = v["models"].as_array().cloned().unwrap_or_default();
    let rows: Vec<Vec<String>> = models
        .iter()
        .map(|m| {
            vec![
                s(&m["name"]),
                s(&m["state"]),
                s(&m["launcher"]),
                s(&m["worker_id"]),
                s(&m["version"]),
                format!("{}", m["in_flight"].as_u64().unwrap_or(0)),
                m["idle_s"].as_u64().map(|i| format!("{i}s/{}s", m["idle_timeout_s"])).unwrap_or_else(|| "-".into()),
                s(&m["detail"]),
            ]
        })
        .collect();
    output::table(&["MODEL", "STATE", "LAUNCHER", "WORKER", "VERSION", "IN FLIGHT", "IDLE", "DETAIL"], &rows);
    for m in models.iter().filter(|m| m["alias_mismatch"] == true) {
        output::line(&format!(
            "\n{}: MISMATCH: gpuhub serves version {} (promoted through its gate) but MLflow's @production points at version {} (moved outside gpuhub); `gpuhub models promote {} {}` adopts it through the gate",
            s(&m["name"]),
            s(&m["promoted_version"]),
            s(&m["production_alias"]),
            s(&m["name"]),
            s(&m["production_alias"])
        ));
    }
    for m in models.iter().filter(|m| m["replicas"].as_array().is_some_and(|r| r.len() > 1)) {
        output::line(&format!("\n{} replicas:", s(&m["name"])));
        for r in m["replicas"].as_array().into_iter().flatten() {
            if r["base_url"].is_null() && r["node"].is_null() {
                // Loading: only its job is known yet.
                let how = if r["state"] == "pending" { "its Slurm job waits in the queue" } else { "loading" };
                output::line(&format!("  worker {}: {}, {how}", s(&r["job_id"]), s(&r["state"])));
                continue;
            }
            let version = if r["version"].is_string() { format!(", version {}", s(&r["version"])) } else { String::new() };
            output::line(&format!(
                "  worker {} on {} ({}): {}, {}, {} in flight{version}",
                s(&r["job_id"]),
                s(&r["node"]),
                s(&r["base_url"]),
                s(&r["state"]),
                s(&r["health"]),
                r["in_flight"].as_u64().unwrap_or(0)
            ));
        }
    }
    for m in &models {
        let tail: Vec<&str> = m["log_tail"].as_array().into_iter().flatten().filter_map(Value::as_str).collect();
        if m["state"] == "failed" && !tail.is_empty() {
            output::line(&format!("\n{} failed; last log lines:", s(&m["name"])));
            for l in tail {
                output::line(&format!("  {l}"));
            }
        } else if m["state"] == "failed" && v["log_tail_visible"] == false {
            output::line(&format!("\n{} failed; its worker's log lines are shown to admins only (root or admin.group)", s(&m["name"])));
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::cli::Cli;
    use clap::Parser;

    #[test]
    fn models_subcommands_parse() {
        assert!(Cli::try_parse_from(["gpuhub", "models"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "models", "list", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "models", "promote", "dots.ocr", "3"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "models", "promote", "dots.ocr"]).is_err(), "promote needs a version");
        assert!(Cli::try_parse_from(["gpuhub", "models", "promote", "dots.ocr", "3", "--force"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "models", "unload"]).is_err(), "unload needs a model");
        assert!(Cli::try_parse_from(["gpuhub", "models", "reload"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "models", "reload", "x"]).is_err(), "reload takes no argument");
    }
}
