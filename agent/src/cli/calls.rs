//! `gpuhub usage --calls`: gateway calls per user, app, requested name and model, read from
//! the hourly rollups (fast however large the usage log grows).

use std::path::Path;
use std::process::ExitCode;

use super::output;
use crate::control::client;

/// Prints the call summary since `since` (e.g. `30d`), for `user` or (admins) everyone.
pub async fn run(socket: &Path, since: &str, user: Option<&str>, json: bool) -> anyhow::Result<ExitCode> {
    crate::util::parse_duration_s(since).map_err(|m| anyhow::anyhow!("--since: {m}"))?;
    let mut path = format!("/v1/usage/calls?since={}", super::keys::urlencode(since));
    if let Some(u) = user {
        path.push_str(&format!("&user={}", super::keys::urlencode(u)));
    }
    let v = client::request(socket, "GET", &path, None).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = v["calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| {
                    let n = |k: &str| c[k].as_i64().unwrap_or(0).to_string();
                    // "-": not known (e.g. a call refused before it named a user or model)
                    let t = |k: &str| c[k].as_str().filter(|s| !s.is_empty()).unwrap_or("-").to_string();
                    vec![
                        t("user"),
                        t("app"),
                        t("requested_name"),
                        t("model"),
                        n("calls"),
                        n("errors"),
                        n("prompt_tokens"),
                        n("completion_tokens"),
                        format!("{:.1}", c["mean_latency_us"].as_i64().unwrap_or(0) as f64 / 1000.0),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    if rows.is_empty() {
        output::line(&format!("no gateway calls in the last {since}"));
    } else {
        output::table(&["USER", "APP", "NAME", "MODEL", "CALLS", "ERRORS", "PROMPT_TOK", "COMPL_TOK", "MEAN_MS"], &rows);
    }
    Ok(ExitCode::SUCCESS)
}
