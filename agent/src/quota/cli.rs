//! `gpuhub quota`: usage, limit and forecast of the quotas that cover you (admins: all);
//! `gpuhub quota grant`, `set` and `revoke` for admins.

use std::path::Path;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use serde_json::{Value, json};

use crate::cli::output;
use crate::control::client;
use crate::util::sanitize;

#[derive(Debug, Subcommand)]
pub enum QuotaCmd {
    /// Grant a top-up: extra GPU-hours until the quota's current period ends (admins).
    /// Slurm releases held jobs before the command returns.
    Grant {
        #[command(flatten)]
        target: TargetArgs,
        /// GPU-hours to add (fractions allowed: 0.5).
        #[arg(long, value_name = "HOURS")]
        gpu_hours: f64,
        /// Why (kept with the top-up, shown in `gpuhub quota`).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Set a quota's limit in place of agent.toml's (admins); `--clear` goes back to it.
    Set {
        #[command(flatten)]
        target: TargetArgs,
        /// The new limit in GPU-hours per period.
        #[arg(long, value_name = "HOURS", required_unless_present = "clear", conflicts_with = "clear")]
        gpu_hours: Option<f64>,
        /// Use agent.toml's limit again.
        #[arg(long)]
        clear: bool,
    },
    /// End a top-up now, e.g. one granted by mistake (admins); its id is in `gpuhub quota`.
    /// Slurm holds the quota's jobs again before the command returns if it is used up.
    Revoke {
        /// The top-up's id (`top-up ID:` in `gpuhub quota`).
        #[arg(value_name = "TOPUP_ID")]
        topup_id: i64,
        /// Why (appended to the top-up's reason).
        #[arg(long, default_value = "")]
        reason: String,
    },
}

/// Whose quota: exactly one of `--user`, `--account`, `--group`.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct TargetArgs {
    #[arg(long, value_name = "USER")]
    user: Option<String>,
    #[arg(long, value_name = "ACCOUNT")]
    account: Option<String>,
    #[arg(long, value_name = "GROUP")]
    group: Option<String>,
}

impl TargetArgs {
    fn key(&self) -> String {
        match (&self.user, &self.account, &self.group) {
            (Some(u), _, _) => format!("user:{u}"),
            (_, Some(a), _) => format!("account:{a}"),
            (_, _, Some(g)) => format!("group:{g}"),
            _ => String::new(),
        }
    }
}

/// Runs `gpuhub quota [grant|set]`.
pub async fn run(socket: &Path, cmd: Option<QuotaCmd>, json_out: bool) -> anyhow::Result<ExitCode> {
    let v = match &cmd {
        None => client::request(socket, "GET", "/v1/quota", None).await?,
        Some(QuotaCmd::Grant { target, gpu_hours, reason }) => {
            client::request(
                socket,
                "POST",
                "/v1/quota/grant",
                Some(json!({"target": target.key(), "gpu_hours": gpu_hours, "reason": reason})),
            )
            .await?
        }
        Some(QuotaCmd::Set { target, gpu_hours, .. }) => {
            client::request(socket, "POST", "/v1/quota/set", Some(json!({"target": target.key(), "gpu_hours": gpu_hours}))).await?
        }
        Some(QuotaCmd::Revoke { topup_id, reason }) => {
            client::request(socket, "POST", "/v1/quota/revoke", Some(json!({"topup_id": topup_id, "reason": reason}))).await?
        }
    };
    if json_out {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    match cmd {
        None => output::line(&table(&v)),
        Some(_) => output::line(&table(&json!({"quotas": [v["quota"].clone()], "topups": []}))),
    }
    Ok(ExitCode::SUCCESS)
}

fn hours(v: &Value) -> String {
    let h = v.as_f64().unwrap_or(0.0);
    if h >= 10.0 { format!("{h:.0}") } else { format!("{h:.3}") }
}

/// The human table: one row per quota, then the line users see and the top-ups.
pub fn table(v: &Value) -> String {
    let mut rows: Vec<Vec<String>> =
        vec![["QUOTA", "PERIOD", "USED", "LIMIT", "%", "STATE", "RESETS", "FORECAST"].iter().map(|s| s.to_string()).collect()];
    let empty = Vec::new();
    let quotas = v["quotas"].as_array().unwrap_or(&empty);
    for q in quotas {
        let resets = q["resets_s"].as_i64().map_or_else(|| "rolling".to_string(), crate::util::utc_time);
        let forecast = match q["exhausted_at_s"].as_i64() {
            Some(_) if q["held"].as_bool() == Some(true) => "used up".to_string(),
            Some(t) => format!("{} (limit {})", hours(&q["forecast_gpu_hours"]), crate::util::utc_time(t)),
            None => hours(&q["forecast_gpu_hours"]),
        };
        rows.push(vec![
            sanitize(q["quota"].as_str().unwrap_or("?")),
            sanitize(q["period"].as_str().unwrap_or("?")),
            hours(&q["used_gpu_hours"]),
            hours(&q["limit_gpu_hours"]),
            format!("{:.0}", q["percent"].as_f64().unwrap_or(0.0)),
            if q["held"].as_bool() == Some(true) { "held in Slurm".into() } else { "ok".into() },
            resets,
            forecast,
        ]);
    }
    if quotas.is_empty() {
        return "no quota covers you (or none is set in agent.toml)\n".into();
    }
    let mut out = render(&rows);
    for q in quotas {
        if let Some(n) = q["note"].as_str() {
            out.push_str(&format!("{}\n", sanitize(n)));
        }
    }
    for t in v["topups"].as_array().unwrap_or(&empty) {
        out.push_str(&format!(
            "top-up {}: +{} GPU-hours for {} by {} until {}{}\n",
            t["id"],
            hours(&t["gpu_hours"]),
            sanitize(t["quota"].as_str().unwrap_or("?")),
            sanitize(t["granted_by"].as_str().unwrap_or("?")),
            crate::util::utc_time(t["expires_s"].as_i64().unwrap_or(0)),
            t["reason"].as_str().filter(|r| !r.is_empty()).map(|r| format!(" ({})", sanitize(r))).unwrap_or_default(),
        ));
    }
    out
}

fn render(table: &[Vec<String>]) -> String {
    let cols = table.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols).map(|c| table.iter().map(|row| row[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in table {
        let cells: Vec<String> = row.iter().enumerate().map(|(c, s)| format!("{s:<w$}", w = widths[c])).collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_shows_usage_limit_state_and_forecast() {
        let v = json!({"quotas": [{
            "quota": "user:alice", "period": "month", "used_gpu_hours": 172.0, "limit_gpu_hours": 200.0, "percent": 86.0,
            "held": false, "resets_s": 1_798_761_600i64, "forecast_gpu_hours": 260.0, "exhausted_at_s": 1_798_000_000i64,
            "note": "gpuhub: you have used 172 of 200 GPU-hours this month (86 %)"
        }], "topups": [{"id": 3, "quota": "user:alice", "gpu_hours": 5.0, "granted_by": "root", "reason": "deadline", "expires_s": 1_798_761_600i64}]});
        let t = table(&v);
        assert!(t.contains("user:alice") && t.contains("172") && t.contains("200") && t.contains("86") && t.contains("ok"), "{t}");
        assert!(t.contains("2027-01-01 00:00:00 UTC") && t.contains("260 (limit"), "{t}");
        assert!(t.contains("gpuhub: you have used 172 of 200 GPU-hours this month (86 %)"), "{t}");
        assert!(t.contains("top-up 3: +5.000 GPU-hours for user:alice by root") && t.contains("(deadline)"), "{t}");
        assert!(table(&json!({"quotas": []})).contains("no quota covers you"));
    }
}
