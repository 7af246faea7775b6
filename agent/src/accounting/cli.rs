//! `gpuhub usage` (GPU-hours) and `gpuhub job JOBID`: requests to the control socket, then a
//! table (hours, whole GPUs and shards apart and summed) or the JSON as the agent sent it.

use std::path::Path;
use std::process::ExitCode;

use serde_json::Value;

use super::usage::UsageBy;
use crate::cli::output;
use crate::control::client;
use crate::util::sanitize;

/// `gpuhub usage [--since 30d] [--by user|account|gpu|partition] [--json]`.
pub async fn usage(socket: &Path, since: &str, by: UsageBy, json: bool) -> anyhow::Result<ExitCode> {
    crate::util::parse_duration_s(since).map_err(|m| anyhow::anyhow!("--since: {m}"))?;
    let path = format!("/v1/usage/gpu?since={}&by={}", crate::cli::keys::urlencode(since), by.as_str());
    let v = client::request(socket, "GET", &path, None).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    output::line(&usage_table(&v, since, by));
    Ok(ExitCode::SUCCESS)
}

fn hours(v: &Value, k: &str) -> String {
    format!("{:.2}", v[k].as_f64().unwrap_or(0.0) / 3600.0)
}

/// Lays out `table` (first column left-aligned, the others right-aligned).
fn render(table: &[Vec<String>]) -> String {
    let cols = table.first().map_or(0, Vec::len);
    let widths: Vec<usize> = (0..cols).map(|c| table.iter().map(|row| row[c].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::new();
    for row in table {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, s)| if c == 0 { format!("{s:<w$}", w = widths[c]) } else { format!("{s:>w$}", w = widths[c]) })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// The human table (kept apart from `--json`, STYLE.md §9): jobs per group, with `--by user`
/// each user's share of model worker jobs beside them (`INF_*`); then the inference shares
/// per user, app and model.
pub fn usage_table(v: &Value, since: &str, by: UsageBy) -> String {
    let rows: Vec<&Value> = v["rows"].as_array().map(|a| a.iter().collect()).unwrap_or_default();
    let inference: Vec<&Value> = v["inference"].as_array().map(|a| a.iter().collect()).unwrap_or_default();
    if rows.is_empty() && inference.is_empty() {
        return format!("no GPU usage in the last {since} ({})", v["scope"].as_str().unwrap_or(""));
    }
    let with_inf = by == UsageBy::User;
    let mut header: Vec<String> = vec![by.as_str().to_uppercase(), "JOBS".into(), "GPU_H".into(), "SHARD_H".into(), "GPU_EQ_H".into()];
    if with_inf {
        header.extend(["INF_GPU_H", "INF_SHARD_H", "INF_EQ_H", "TOTAL_EQ_H"].map(String::from));
    }
    let mut table: Vec<Vec<String>> = vec![header];
    for r in rows.iter().copied().chain(std::iter::once(&v["total"])) {
        let key = if std::ptr::eq(r, &v["total"]) { "TOTAL".to_string() } else { sanitize(r["key"].as_str().unwrap_or("-")) };
        let mut row = vec![
            key,
            r["jobs"].as_u64().unwrap_or(0).to_string(),
            hours(r, "gpu_seconds"),
            hours(r, "shard_seconds"),
            hours(r, "gpu_equivalent_seconds"),
        ];
        if with_inf {
            row.extend([
                hours(r, "inference_gpu_seconds"),
                hours(r, "inference_shard_seconds"),
                hours(r, "inference_gpu_equivalent_seconds"),
                hours(r, "total_gpu_equivalent_seconds"),
            ]);
        }
        table.push(row);
    }
    let mut out = render(&table);
    out.push_str(&format!(
        "GPU-hours in the last {since}, {}; shard-hours count 1/{} GPU each in GPU_EQ_H",
        v["scope"].as_str().unwrap_or(""),
        v["shards_per_gpu"].as_u64().unwrap_or(14)
    ));
    if with_inf {
        out.push_str("; INF_*: model worker jobs billed to the callers they served (not in JOBS)");
    }
    if !inference.is_empty() {
        let mut t: Vec<Vec<String>> =
            vec![["USER", "APP", "MODEL", "WORKER_JOBS", "CALLS", "BUSY_H", "GPU_H", "SHARD_H", "GPU_EQ_H"].map(String::from).to_vec()];
        for r in inference {
            t.push(vec![
                sanitize(r["user"].as_str().unwrap_or("-")),
                sanitize(r["app"].as_str().filter(|a| !a.is_empty()).unwrap_or("-")),
                sanitize(r["model"].as_str().unwrap_or("-")),
                r["worker_jobs"].as_u64().unwrap_or(0).to_string(),
                r["calls"].as_i64().unwrap_or(0).to_string(),
                hours(r, "busy_seconds"),
                hours(r, "gpu_seconds"),
                hours(r, "shard_seconds"),
                hours(r, "gpu_equivalent_seconds"),
            ]);
        }
        out.push_str("\n\ninference: model worker jobs split among their callers by the busy time of their calls\n");
        out.push_str(render(&t).trim_end());
    }
    out
}

/// Where a job's billed allocation came from, for people.
fn allocation_source(v: &str) -> &'static str {
    match v {
        "slurmctld" => "as slurmctld allocated it (scontrol show job -d)",
        "sacct" => "as Slurm's accounting recorded it (sacct AllocTRES: counts, no GPU indices)",
        "unverified" => "from the plugin's records only: slurmctld and sacct did not know the job (unverified)",
        _ => "from the plugin's records; not checked against Slurm yet",
    }
}

/// `gpuhub job JOBID [--json]`.
pub async fn job(socket: &Path, job_id: u32, json: bool) -> anyhow::Result<ExitCode> {
    let v = client::request(socket, "GET", &format!("/v1/jobs/{job_id}"), None).await?;
    if json {
        output::json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    for n in v["nodes"].as_array().into_iter().flatten() {
        let s = |k: &str| sanitize(n[k].as_str().unwrap_or("-"));
        // A requeued job's later runs (the first is run 0).
        let run = n["run"].as_i64().filter(|r| *r > 0).map(|r| format!(" (run {})", r + 1)).unwrap_or_default();
        output::line(&format!(
            "job {}{run} on {}: user {} (uid {}), account {}, partition {}, {}{}",
            job_id,
            s("node"),
            s("user"),
            n["uid"],
            s("account"),
            s("partition"),
            s("state"),
            n["exit_code"].as_i64().map(|c| format!(" (exit {c})")).unwrap_or_default()
        ));
        output::line(&format!(
            "  time {:.0} s; GPU-seconds {:.0}, shard-seconds {:.0} ({} shards), GPU-equivalent {:.0}",
            n["seconds"].as_f64().unwrap_or(0.0),
            n["gpu_seconds"].as_f64().unwrap_or(0.0),
            n["shard_seconds"].as_f64().unwrap_or(0.0),
            n["shards"],
            n["gpu_equivalent_seconds"].as_f64().unwrap_or(0.0)
        ));
        for g in n["gpus"].as_array().into_iter().flatten() {
            let measured = match g["samples"].as_i64() {
                Some(samples) if samples > 0 => format!(
                    "mean util {:.1} %, peak VRAM {:.2} GiB, energy {:.0} J ({samples} samples)",
                    g["mean_util"].as_f64().unwrap_or(0.0),
                    g["peak_vram_bytes"].as_f64().unwrap_or(0.0) / 1073741824.0,
                    g["energy_joules"].as_f64().unwrap_or(0.0)
                ),
                _ => "no NVML measurements".to_string(),
            };
            // A running job's last sample (the agent's `current`).
            let measured = match g["current"].as_object() {
                Some(c) => format!(
                    "{measured}; now util {:.0} %, VRAM {:.2} GiB",
                    c.get("util").and_then(Value::as_f64).unwrap_or(0.0),
                    c.get("vram_bytes").and_then(Value::as_f64).unwrap_or(0.0) / 1073741824.0
                ),
                None => measured,
            };
            output::line(&format!("  GPU {} {}: {measured}", g["index"], sanitize(g["uuid"].as_str().unwrap_or(""))));
        }
        output::line(&format!("  allocation: {}", allocation_source(n["verified"].as_str().unwrap_or("pending"))));
        for a in n["anomalies"].as_array().into_iter().flatten() {
            let kind = sanitize(a["kind"].as_str().unwrap_or("?"));
            match a["field"].as_str() {
                Some(field) => output::line(&format!(
                    "  Slurm disagrees on {}: the records claimed {}, Slurm ({}) says {}; billed {}",
                    sanitize(field),
                    sanitize(a["claimed"].as_str().unwrap_or("?")),
                    sanitize(a["source"].as_str().unwrap_or("?")),
                    sanitize(a["slurm"].as_str().unwrap_or("?")),
                    sanitize(a["used"].as_str().unwrap_or("?")),
                )),
                None => output::line(&format!(
                    "  note: {kind}: {} (see docs/accounting.md)",
                    sanitize(a["explain"].as_str().unwrap_or("see docs/accounting.md"))
                )),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_table_shows_inference_beside_jobs() {
        let v = serde_json::json!({
            "scope": "all users", "shards_per_gpu": 14,
            "rows": [{"key": "alice", "jobs": 1, "gpu_seconds": 3600.0, "shard_seconds": 0.0, "gpu_equivalent_seconds": 3600.0,
                      "inference_gpu_seconds": 0.0, "inference_shard_seconds": 50400.0, "inference_gpu_equivalent_seconds": 3600.0,
                      "total_gpu_equivalent_seconds": 7200.0}],
            "total": {"jobs": 1, "gpu_seconds": 3600.0, "shard_seconds": 0.0, "gpu_equivalent_seconds": 3600.0,
                      "inference_gpu_seconds": 0.0, "inference_shard_seconds": 50400.0, "inference_gpu_equivalent_seconds": 3600.0,
                      "total_gpu_equivalent_seconds": 7200.0},
            "inference": [{"user": "alice", "app": "nb", "model": "chat", "worker_jobs": 2, "calls": 7, "busy_seconds": 360.0,
                           "gpu_seconds": 0.0, "shard_seconds": 50400.0, "gpu_equivalent_seconds": 3600.0}],
        });
        let t = usage_table(&v, "30d", UsageBy::User);
        let lines: Vec<&str> = t.lines().collect();
        assert!(
            lines[0].split_whitespace().eq([
                "USER",
                "JOBS",
                "GPU_H",
                "SHARD_H",
                "GPU_EQ_H",
                "INF_GPU_H",
                "INF_SHARD_H",
                "INF_EQ_H",
                "TOTAL_EQ_H"
            ]),
            "{t}"
        );
        assert!(lines[1].split_whitespace().eq(["alice", "1", "1.00", "0.00", "1.00", "0.00", "14.00", "1.00", "2.00"]), "{t}");
        assert!(t.contains("\ninference: "), "{t}");
        assert!(t.lines().any(|l| l.split_whitespace().eq(["alice", "nb", "chat", "2", "7", "0.10", "0.00", "14.00", "1.00"])), "{t}");
        // Other groupings keep their columns; the inference section still says whom workers served.
        let t = usage_table(&v, "30d", UsageBy::Account);
        assert!(!t.contains("INF_EQ_H") && t.contains("\ninference: "), "{t}");
    }
}
