//! `gpuhub names ...` and `gpuhub roles ...`: the name registry from the command line.
//!
//! Every change prints its plan first (what happens, who still calls the name), so
//! `--dry-run` shows exactly what the real run would do. A change that needs `--force`
//! (retiring a name with recent callers, say) prints the plan and exits 1.

use std::path::Path;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use super::output;
use crate::control::client;

#[derive(Debug, Subcommand)]
pub enum NamesCmd {
    /// Every name with its state, replacement, sunset and last call (names clients call
    /// that nobody configured show as `unknown`).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Who called NAME: users, apps (API keys), jobs, client addresses and user agents,
    /// with first/last seen and counts. Non-admins see their own calls only.
    Callers {
        /// The model name as clients send it.
        name: String,
        /// Window, e.g. 30d, 12h (whole UTC days: the window starts at midnight).
        #[arg(long, value_name = "DURATION", default_value = "30d")]
        since: String,
        /// Most callers to list (totals count them all).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        #[arg(long)]
        json: bool,
    },
    /// Every change of a name or role: who, when, from, to.
    History {
        /// One name or role (default: all).
        name: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Rename OLD to NEW: OLD stays served, as a deprecated name of NEW with Deprecation,
    /// Sunset and Link headers; roles that named OLD move to NEW. NEW must be served.
    Rename {
        old: String,
        new: String,
        #[command(flatten)]
        opts: ChangeOpts,
        /// When OLD stops being served (YYYY-MM-DD, after today), announced in `Sunset`.
        #[arg(long, value_name = "DATE")]
        sunset: Option<String>,
    },
    /// Mark NAME deprecated (still served) in favour of its replacement.
    Deprecate {
        name: String,
        /// The name callers should move to (default: the model NAME is an alias of).
        #[arg(long, value_name = "NAME")]
        replacement: Option<String>,
        #[arg(long, value_name = "DATE")]
        sunset: Option<String>,
        #[command(flatten)]
        opts: ChangeOpts,
    },
    /// Stop serving NAME: callers get an error that says what it was renamed to. Refused
    /// while NAME had callers in the window or before its sunset, unless --force.
    Retire {
        name: String,
        #[command(flatten)]
        opts: ChangeOpts,
    },
    /// Undo a deprecation or retirement: NAME is served again without deprecation headers.
    Restore {
        name: String,
        #[command(flatten)]
        opts: ChangeOpts,
    },
    /// Recompute the callers registry from the whole usage log (after restoring a backup);
    /// admin only, reads every usage row once.
    RebuildCallers,
}

/// Flags every change takes.
#[derive(Debug, Args)]
pub struct ChangeOpts {
    /// Show what would happen, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Do it even though the plan says it breaks callers.
    #[arg(long)]
    pub force: bool,
    /// Preflight window for callers (default: names.recent_caller_days).
    #[arg(long, value_name = "DURATION")]
    pub since: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum RolesCmd {
    /// Roles and their current models (the default).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Point ROLE at MODEL: jobs started from now on get <ROLE>_MODEL=MODEL.
    Set {
        role: String,
        model: String,
        #[command(flatten)]
        opts: ChangeOpts,
    },
    /// Leave ROLE without a model: calls to it get a 503 that says so.
    Unset {
        role: String,
        #[command(flatten)]
        opts: ChangeOpts,
    },
}

fn since_s(s: &Option<String>) -> anyhow::Result<Option<i64>> {
    s.as_deref().map(crate::util::parse_duration_s).transpose().map_err(|e| anyhow::anyhow!("--since: {e}"))
}

/// `YYYY-MM-DD HH:MM` (UTC) for Unix microseconds.
pub fn fmt_time(us: i64) -> String {
    let s = us.div_euclid(1_000_000);
    let day = crate::names::civil_from_days(s.div_euclid(86_400));
    let sod = s.rem_euclid(86_400);
    format!("{day} {:02}:{:02}", sod / 3600, (sod % 3600) / 60)
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

pub async fn names(socket: &Path, cmd: NamesCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        NamesCmd::List { json } => list(socket, json).await,
        NamesCmd::Callers { name, since, limit, json } => {
            let since_s = crate::util::parse_duration_s(&since).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
            callers(socket, &name, since_s, limit, json).await
        }
        NamesCmd::History { name, limit, json } => history(socket, name, limit, json).await,
        NamesCmd::Rename { old, new, opts, sunset } => {
            change(socket, "/v1/names/rename", json!({"name": old, "to": new, "sunset": sunset}), &opts).await
        }
        NamesCmd::Deprecate { name, replacement, sunset, opts } => {
            change(socket, "/v1/names/deprecate", json!({"name": name, "to": replacement, "sunset": sunset}), &opts).await
        }
        NamesCmd::Retire { name, opts } => change(socket, "/v1/names/retire", json!({"name": name}), &opts).await,
        NamesCmd::Restore { name, opts } => change(socket, "/v1/names/restore", json!({"name": name}), &opts).await,
        NamesCmd::RebuildCallers => {
            let v = client::request(socket, "POST", "/v1/names/rebuild-callers", None).await?;
            output::line(&format!(
                "callers registry rebuilt: {} names, {} calls, in {:.1} s",
                s(&v["names"]),
                s(&v["calls"]),
                v["seconds"].as_f64().unwrap_or(0.0)
            ));
            Ok(ExitCode::SUCCESS)
        }
    }
}

pub async fn roles(socket: &Path, cmd: RolesCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        RolesCmd::List { json } => {
            let v = client::request(socket, "GET", "/v1/roles", None).await?;
            if json {
                output::json(&v);
                return Ok(ExitCode::SUCCESS);
            }
            let rows: Vec<Vec<String>> = v["roles"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|r| {
                            vec![
                                s(&r["role"]),
                                if r["model"].is_null() { "(no model)".into() } else { s(&r["model"]) },
                                s(&r["serves"]),
                                s(&r["variable"]),
                            ]
                        })
                        .collect()
                })
                .unwrap_or_default();
            output::table(&["ROLE", "MODEL", "SERVED BY", "VARIABLE"], &rows);
            Ok(ExitCode::SUCCESS)
        }
        RolesCmd::Set { role, model, opts } => change(socket, "/v1/roles/set", json!({"name": role, "to": model}), &opts).await,
        RolesCmd::Unset { role, opts } => change(socket, "/v1/roles/unset", json!({"name": role}), &opts).await,
    }
}

async fn list(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "GET", "/v1/names", None).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let today = v["today"].as_str().unwrap_or("");
    let rows: Vec<Vec<String>> = v["names"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|n| {
                    let mut state = s(&n["state"]);
                    if state == "deprecated" && n["sunset"].as_str().is_some_and(|d| d <= today) {
                        state.push_str(" (past sunset)");
                    }
                    vec![
                        s(&n["name"]),
                        state,
                        s(&n["kind"]),
                        s(&n["serves"]),
                        s(&n["replacement"]),
                        s(&n["sunset"]),
                        n["last_call_us"].as_i64().map(fmt_time).unwrap_or_else(|| "never".into()),
                        s(&n["calls"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    output::table(&["NAME", "STATE", "KIND", "SERVED BY", "REPLACEMENT", "SUNSET", "LAST CALL (UTC)", "CALLS"], &rows);
    if let Some(n) = v["more_unknown"].as_u64().filter(|n| *n > 0) {
        output::line(&format!("... and {n} more unknown names that clients called (older ones; see --json for the listed ones)"));
    }
    Ok(ExitCode::SUCCESS)
}

async fn callers(socket: &Path, name: &str, since_s: i64, limit: usize, json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "POST", "/v1/names/callers", Some(json!({"name": name, "since_s": since_s, "limit": limit}))).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let r = &v["report"];
    let since = r["since_us"].as_i64().map(|u| crate::names::civil_from_days(u.div_euclid(86_400_000_000))).unwrap_or_default();
    output::line(&format!(
        "`{}` ({}{}): {} calls ({} refused) from {} caller{} since {since}{}",
        crate::util::sanitize(name),
        s(&v["state"]),
        v["serves"].as_str().map(|m| format!(", served by `{m}`")).unwrap_or_default(),
        s(&r["calls"]),
        s(&r["refused"]),
        s(&r["total_callers"]),
        if r["total_callers"].as_u64() == Some(1) { "" } else { "s" },
        if v["own_calls_only"].as_bool() == Some(true) { " (your calls only; admins see everyone's)" } else { "" },
    ));
    print_callers(r);
    Ok(ExitCode::SUCCESS)
}

fn print_callers(r: &Value) {
    let rows: Vec<Vec<String>> = r["callers"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    vec![
                        s(&c["user_name"]),
                        s(&c["app"]),
                        s(&c["job_id"]),
                        s(&c["client_addr"]),
                        s(&c["user_agent"]),
                        s(&c["calls"]),
                        s(&c["refused"]),
                        c["first_us"].as_i64().map(fmt_time).unwrap_or_default(),
                        c["last_us"].as_i64().map(fmt_time).unwrap_or_default(),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        return;
    }
    output::table(&["USER", "APP", "JOB", "CLIENT", "USER AGENT", "CALLS", "REFUSED", "FIRST (UTC)", "LAST (UTC)"], &rows);
    let total = r["total_callers"].as_u64().unwrap_or(0);
    if total > rows.len() as u64 {
        output::line(&format!("... and {} more callers (--limit N, or --json)", total - rows.len() as u64));
    }
}

async fn history(socket: &Path, name: Option<String>, limit: i64, json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "POST", "/v1/names/history", Some(json!({"name": name, "limit": limit}))).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = v["history"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|h| {
                    let from =
                        format!("{} {}", s(&h["from_state"]), h["from_target"].as_str().map(|t| format!("-> {t}")).unwrap_or_default());
                    let to = format!("{} {}", s(&h["to_state"]), h["to_target"].as_str().map(|t| format!("-> {t}")).unwrap_or_default());
                    vec![
                        h["time_us"].as_i64().map(fmt_time).unwrap_or_default(),
                        s(&h["actor"]),
                        s(&h["action"]),
                        s(&h["subject"]),
                        from.trim().into(),
                        to.trim().into(),
                        s(&h["sunset_date"]),
                        s(&h["note"]),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    output::table(&["WHEN (UTC)", "WHO", "ACTION", "NAME", "FROM", "TO", "SUNSET", "NOTE"], &rows);
    Ok(ExitCode::SUCCESS)
}

async fn change(socket: &Path, path: &str, mut body: Value, opts: &ChangeOpts) -> anyhow::Result<ExitCode> {
    body["dry_run"] = json!(opts.dry_run);
    body["force"] = json!(opts.force);
    body["since_s"] = json!(since_s(&opts.since)?);
    let v = client::request(socket, "POST", path, Some(body)).await?;
    let refused = v["refused"].as_bool() == Some(true);
    if opts.json {
        output::json(&v);
        return Ok(if refused { ExitCode::from(1) } else { ExitCode::SUCCESS });
    }
    let p = &v["plan"];
    let target = |t: &Value| t.as_str().map(|t| format!(" -> {t}")).unwrap_or_default();
    output::line(&format!(
        "{} `{}`: {}{} => {}{}{}",
        s(&p["action"]),
        s(&p["name"]),
        s(&p["from_state"]),
        target(&p["from_target"]),
        s(&p["to_state"]),
        target(&p["to_target"]),
        p["sunset"].as_str().map(|d| format!(" (sunset {d})")).unwrap_or_default()
    ));
    for e in p["effects"].as_array().into_iter().flatten() {
        output::line(&format!("  - {}", s(e)));
    }
    for w in p["warnings"].as_array().into_iter().flatten() {
        output::line(&format!("  warning: {}", s(w)));
    }
    print_callers(&v["callers"]);
    let reasons: Vec<String> = p["needs_force"].as_array().into_iter().flatten().map(s).collect();
    if refused {
        for r in &reasons {
            output::line(&format!("refused: {r}"));
        }
        output::line("nothing changed; pass --force to do it anyway");
        return Ok(ExitCode::from(1));
    }
    if v["applied"].as_bool() == Some(true) {
        output::line(if reasons.is_empty() { "applied." } else { "applied (forced)." });
    } else {
        output::line("dry run: nothing changed.");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::super::{Cli, Command};
    use super::*;

    #[test]
    fn flags_parse_and_conflict_as_documented() {
        let c = Cli::try_parse_from(["gpuhub", "names", "rename", "svc-ocr", "dots.ocr", "--sunset", "2026-12-31", "--dry-run"]).unwrap();
        match c.command {
            Command::Names { cmd: NamesCmd::Rename { old, new, sunset, opts } } => {
                assert_eq!(
                    (old.as_str(), new.as_str(), sunset.as_deref(), opts.dry_run, opts.force),
                    ("svc-ocr", "dots.ocr", Some("2026-12-31"), true, false)
                );
            }
            other => panic!("{other:?}"),
        }
        let c = Cli::try_parse_from(["gpuhub", "names", "callers", "svc-ocr"]).unwrap();
        assert!(matches!(c.command, Command::Names { cmd: NamesCmd::Callers { ref since, limit: 100, .. } } if since == "30d"));
        assert!(Cli::try_parse_from(["gpuhub", "names", "rename", "only-one"]).is_err());
        assert!(Cli::try_parse_from(["gpuhub", "names", "retire", "x", "--force"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "roles"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "roles", "--json"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "roles", "set", "ocr", "dots.ocr"]).is_ok());
        assert!(Cli::try_parse_from(["gpuhub", "roles", "unset", "tts", "--dry-run"]).is_ok());
    }

    #[test]
    fn times_print_in_utc() {
        assert_eq!(fmt_time(0), "1970-01-01 00:00");
        assert_eq!(fmt_time(86_400_000_000 + 3_723_000_000), "1970-01-02 01:02");
    }
}
