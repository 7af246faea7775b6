//! Control-socket routes for accounting (merged in `control/server.rs`):
//!
//! - `GET /v1/usage/gpu?since=30d&by=user|account|gpu|partition` → `{since, by, shards_per_gpu,
//!   rows: [{key, <by>, jobs, gpu_seconds, shard_seconds, gpu_equivalent_seconds}], total,
//!   inference, inference_jobs}`; with `by=user` the rows and total also carry
//!   `inference_worker_jobs`, `inference_gpu_seconds`, `inference_shard_seconds`,
//!   `inference_gpu_equivalent_seconds` and `total_gpu_equivalent_seconds` (see [`usage_json`])
//! - `GET /v1/jobs/{job_id}` → the job's summary per node, with per-GPU NVML measurements, where
//!   its allocation came from (`verified`: slurmctld, sacct, unverified, pending) and its
//!   `anomalies` (`{kind, explain}`; a disagreement with Slurm adds `field, claimed, slurm, used, source`).
//!   Each GPU of a running job on this node also carries `current`: the last NVML sample
//!   (`{util, vram_bytes, at}`, at most [`LIVE_MAX_AGE_S`] old; `null` without one), see [`add_live`].
//!
//! A user sees their own jobs (the caller's uid from SO_PEERCRED); root and `admin.group` see all.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use std::collections::BTreeMap;

use super::db::{self, JobGpuRow, JobRow};
use super::usage::{self, UsageBy};
use super::{Anomaly, GpuView};
use super::{inference, reconcile};
use crate::AppState;
use crate::control::Caller;

type ApiResult = Result<Json<Value>, (StatusCode, Json<Value>)>;

fn err(status: StatusCode, message: impl Into<String>) -> (StatusCode, Json<Value>) {
    (status, Json(json!({"error": message.into()})))
}

fn store_err(e: sqlx::Error) -> (StatusCode, Json<Value>) {
    tracing::error!(error = %e, "accounting control API: store failed");
    err(StatusCode::SERVICE_UNAVAILABLE, "the store is not available right now; see the agent's log")
}

pub fn routes() -> Router<AppState> {
    Router::new().route("/v1/usage/gpu", get(usage_gpu)).route("/v1/jobs/{job_id}", get(job))
}

#[derive(Debug, Deserialize)]
struct UsageQuery {
    since: Option<String>,
    by: Option<String>,
}

async fn usage_gpu(State(state): State<AppState>, caller: Caller, Query(q): Query<UsageQuery>) -> ApiResult {
    let since = q.since.unwrap_or_else(|| "30d".into());
    let since_s = crate::util::parse_duration_s(&since).map_err(|m| err(StatusCode::BAD_REQUEST, format!("since: {m}")))?;
    let by = UsageBy::parse(q.by.as_deref().unwrap_or("user")).map_err(|m| err(StatusCode::BAD_REQUEST, m))?;
    let spg = state.config.file.accounting.shards_per_gpu;
    let body = usage_json(state.store.pool(), &caller, &since, since_s, by, spg).await.map_err(store_err)?;
    Ok(Json(body))
}

/// The `/v1/usage/gpu` body (also used by tests without HTTP).
///
/// Model worker jobs ([`inference`]) are billed to the callers they served: with `by=user`
/// they leave the jobs' columns (the worker account is no user) and each row carries its
/// user's `inference_*` seconds; with any `by`, `inference` lists the shares per (user, app,
/// model) and `inference_jobs` each worker job with its shares (a user sees their own).
pub async fn usage_json(
    pool: &sqlx::AnyPool,
    caller: &Caller,
    since: &str,
    since_s: i64,
    by: UsageBy,
    spg: u32,
) -> Result<Value, sqlx::Error> {
    let now = crate::util::now_us();
    let since_us = now.saturating_sub(since_s.saturating_mul(1_000_000));
    let all = db::jobs_since(pool, since_us, None).await?;
    let workers = inference::worker_jobs(pool, since_us).await?;
    let jobs: Vec<(JobRow, Vec<JobGpuRow>)> = all
        .iter()
        .filter(|(j, _)| caller.admin || j.uid == i64::from(caller.uid))
        .filter(|(j, _)| by != UsageBy::User || !workers.contains_key(&(j.node.clone(), j.job_id)))
        .cloned()
        .collect();
    let mut wjobs = inference::window(pool, &all, &workers, since_us, now, None).await?;
    if !caller.admin {
        for w in &mut wjobs {
            w.shares.retain(|s| s.user == caller.user);
        }
        wjobs.retain(|w| !w.shares.is_empty());
    }
    let spg_f = f64::from(spg.max(1));
    let secs = |us: i64| us as f64 / 1e6;
    let eq = |g: i64, s: i64| (g as f64 + s as f64 / spg_f) / 1e6;
    // Per (user, app, model), and per user.
    #[derive(Default)]
    struct Inf {
        jobs: u64,
        calls: i64,
        busy_us: i64,
        gpu_us: i64,
        shard_us: i64,
    }
    let mut per_caller: BTreeMap<(String, String, String), Inf> = BTreeMap::new();
    let mut per_user: BTreeMap<String, Inf> = BTreeMap::new();
    for w in &wjobs {
        for s in &w.shares {
            for e in [
                per_caller.entry((s.user.clone(), s.app.clone(), w.model.clone())).or_default(),
                per_user.entry(s.user.clone()).or_default(),
            ] {
                e.jobs += 1;
                e.calls += s.calls;
                e.busy_us += s.busy_us;
                e.gpu_us += s.gpu_us;
                e.shard_us += s.shard_us;
            }
        }
    }
    let mut rows = usage::aggregate(&jobs, by, since_us, now, spg);
    if by == UsageBy::User {
        for u in per_user.keys() {
            if !rows.iter().any(|r| &r.key == u) {
                rows.push(usage::UsageRow { key: u.clone(), jobs: 0, gpu_seconds: 0.0, shard_seconds: 0.0, gpu_equivalent_seconds: 0.0 });
            }
        }
    }
    let inf_of = |key: &str| per_user.get(key).filter(|_| by == UsageBy::User);
    let row_total = |r: &usage::UsageRow| r.gpu_equivalent_seconds + inf_of(&r.key).map_or(0.0, |i| eq(i.gpu_us, i.shard_us));
    rows.sort_by(|a, b| row_total(b).total_cmp(&row_total(a)).then(a.key.cmp(&b.key)));
    let total = rows
        .iter()
        .fold((0u64, 0.0, 0.0, 0.0), |t, r| (t.0 + r.jobs, t.1 + r.gpu_seconds, t.2 + r.shard_seconds, t.3 + r.gpu_equivalent_seconds));
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let mut v = json!({
                "key": r.key, by.as_str(): r.key, "jobs": r.jobs, "gpu_seconds": r.gpu_seconds,
                "shard_seconds": r.shard_seconds, "gpu_equivalent_seconds": r.gpu_equivalent_seconds,
            });
            if by == UsageBy::User {
                let (g, s, n) = inf_of(&r.key).map_or((0, 0, 0), |i| (i.gpu_us, i.shard_us, i.jobs));
                v["inference_worker_jobs"] = json!(n);
                v["inference_gpu_seconds"] = json!(secs(g));
                v["inference_shard_seconds"] = json!(secs(s));
                v["inference_gpu_equivalent_seconds"] = json!(eq(g, s));
                v["total_gpu_equivalent_seconds"] = json!(r.gpu_equivalent_seconds + eq(g, s));
            }
            v
        })
        .collect();
    let mut total = json!({"jobs": total.0, "gpu_seconds": total.1, "shard_seconds": total.2, "gpu_equivalent_seconds": total.3});
    if by == UsageBy::User {
        let (g, s) = per_user.values().fold((0i64, 0i64), |t, i| (t.0 + i.gpu_us, t.1 + i.shard_us));
        total["inference_gpu_seconds"] = json!(secs(g));
        total["inference_shard_seconds"] = json!(secs(s));
        total["inference_gpu_equivalent_seconds"] = json!(eq(g, s));
        total["total_gpu_equivalent_seconds"] = json!(total["gpu_equivalent_seconds"].as_f64().unwrap_or(0.0) + eq(g, s));
    }
    let mut inference_rows: Vec<(&(String, String, String), &Inf)> = per_caller.iter().collect();
    inference_rows.sort_by(|a, b| eq(b.1.gpu_us, b.1.shard_us).total_cmp(&eq(a.1.gpu_us, a.1.shard_us)).then(a.0.cmp(b.0)));
    let inference_rows: Vec<Value> = inference_rows
        .into_iter()
        .map(|((user, app, model), i)| {
            json!({
                "user": user, "app": app, "model": model, "worker_jobs": i.jobs, "calls": i.calls,
                "busy_seconds": secs(i.busy_us), "gpu_seconds": secs(i.gpu_us), "shard_seconds": secs(i.shard_us),
                "gpu_equivalent_seconds": eq(i.gpu_us, i.shard_us),
            })
        })
        .collect();
    let inference_jobs: Vec<Value> = wjobs
        .iter()
        .map(|w| {
            json!({
                "node": w.node, "job_id": w.job_id, "model": w.model, "settled": w.settled,
                "gpu_us": caller.admin.then_some(w.gpu_us), "shard_us": caller.admin.then_some(w.shard_us),
                "shares": w.shares,
            })
        })
        .collect();
    Ok(json!({
        "since": since, "since_us": since_us, "until_us": now, "by": by.as_str(), "shards_per_gpu": spg,
        "scope": if caller.admin { "all users" } else { "your jobs" },
        "rows": rows,
        "total": total,
        "inference": inference_rows,
        "inference_jobs": inference_jobs,
    }))
}

async fn job(State(state): State<AppState>, caller: Caller, Path(job_id): Path<String>) -> ApiResult {
    let id: u32 =
        job_id.parse().map_err(|_| err(StatusCode::BAD_REQUEST, format!("`{job_id}` is not a Slurm job id (a number, e.g. 4242)")))?;
    let spg = state.config.file.accounting.shards_per_gpu;
    match job_json(state.store.pool(), &caller, id, spg).await.map_err(store_err)? {
        Some(mut v) => {
            let node = state.config.file.telemetry.effective_node_name();
            add_live(&mut v, state.telemetry.as_ref(), &node, crate::util::now_us() / 1_000_000);
            Ok(Json(v))
        }
        None if caller.admin => Err(err(StatusCode::NOT_FOUND, format!("no job {id} in the accounting records of this node"))),
        None => Err(err(
            StatusCode::NOT_FOUND,
            format!("no job {id} of yours in the accounting records of this node (you see your own jobs; admins see all)"),
        )),
    }
}

/// How old a running job's last NVML sample may be to be shown as `current` (older: the job's
/// processes left the GPU, or telemetry stopped sampling).
pub const LIVE_MAX_AGE_S: i64 = 60;

/// Adds `current` to each GPU of the running jobs on `node` (this node: the only one whose
/// samples the agent has) in a `/v1/jobs/{id}` body: `{util, vram_bytes, at}` from the last
/// NVML sample of the job's processes on that GPU (unix seconds `at`, at most
/// [`LIVE_MAX_AGE_S`] before `now_s`), or `null` when there is none (no NVML, no process on
/// the GPU yet). Ended jobs keep only their means and peaks.
pub fn add_live(body: &mut Value, gpus: &dyn GpuView, node: &str, now_s: i64) {
    let Some(job_id) = body["job_id"].as_u64().and_then(|j| u32::try_from(j).ok()) else {
        return;
    };
    let stats = gpus.job_gpu_stats(job_id);
    let Some(nodes) = body["nodes"].as_array_mut() else {
        return;
    };
    for n in nodes.iter_mut().filter(|n| n["state"] == "running" && n["node"] == node) {
        for g in n["gpus"].as_array_mut().into_iter().flatten() {
            let current = stats
                .iter()
                .find(|s| g["index"].as_u64() == Some(u64::from(s.gpu_index)) && now_s - s.last_seen <= LIVE_MAX_AGE_S)
                .map_or(Value::Null, |s| json!({"util": s.last_util, "vram_bytes": s.last_vram_bytes, "at": s.last_seen}));
            g["current"] = current;
        }
    }
}

/// The `/v1/jobs/{id}` body, or `None` when the caller may see no such job.
pub async fn job_json(pool: &sqlx::AnyPool, caller: &Caller, job_id: u32, spg: u32) -> Result<Option<Value>, sqlx::Error> {
    let now = crate::util::now_us();
    let rows: Vec<(JobRow, Vec<JobGpuRow>)> =
        db::job(pool, i64::from(job_id)).await?.into_iter().filter(|(j, _)| caller.admin || j.uid == i64::from(caller.uid)).collect();
    if rows.is_empty() {
        return Ok(None);
    }
    let mut nodes: Vec<Value> = Vec::new();
    for (j, gpus) in &rows {
        let u = usage::aggregate(std::slice::from_ref(&(j.clone(), gpus.clone())), UsageBy::User, i64::MIN, now, spg);
        let (g, s, e) = u.first().map_or((0.0, 0.0, 0.0), |r| (r.gpu_seconds, r.shard_seconds, r.gpu_equivalent_seconds));
        let state = match (j.end_us, j.end_reason.as_deref()) {
            (None, _) => "running",
            (Some(_), Some("closed_after_reboot")) => "closed_after_reboot",
            (Some(_), Some("closed_from_slurm")) => "closed_from_slurm",
            (Some(_), Some("filled_from_slurm")) => "filled_from_slurm",
            (Some(_), _) => "ended",
        };
        let (billed_gpus, _) = usage::billed(j, gpus);
        let disagreements = reconcile::disagreements(pool, &j.node, j.job_id).await?;
        // Each anomaly with what it means; a disagreement once per field, with both values.
        let mut anomalies: Vec<Value> = Vec::new();
        for kind in j.anomalies.split(',').filter(|a| !a.is_empty()) {
            if kind == Anomaly::SlurmDisagrees.as_str() && !disagreements.is_empty() {
                continue;
            }
            anomalies.push(json!({"kind": kind, "explain": Anomaly::parse(kind).map(Anomaly::explain)}));
        }
        for d in &disagreements {
            anomalies.push(json!({
                "kind": Anomaly::SlurmDisagrees.as_str(), "field": d.field, "claimed": d.claimed, "slurm": d.slurm,
                "used": d.used, "source": d.source,
                "explain": format!("the records claimed {} {}, Slurm ({}) says {}; billed {}", d.field, d.claimed, d.source, d.slurm, d.used),
            }));
        }
        let verified = if j.verified.is_empty() { "pending" } else { j.verified.as_str() };
        nodes.push(json!({
            "node": j.node, "job_id": j.job_id, "run": j.run, "user": j.user_name, "uid": j.uid, "account": j.account,
            "partition": j.partition, "start_us": j.start_us.unwrap_or(j.first_seen_us), "end_us": j.end_us,
            "state": state, "exit_code": j.exit_code, "shards": j.shards, "gpu_count": billed_gpus,
            "verified": verified, "slurm_start_us": j.slurm_start_us, "slurm_end_us": j.slurm_end_us,
            "anomalies": anomalies,
            "seconds": usage::overlap_us(j, i64::MIN, now) as f64 / 1e6,
            "gpu_seconds": g, "shard_seconds": s, "gpu_equivalent_seconds": e,
            "gpus": gpus.iter().map(|g| json!({
                "index": g.gpu_index, "uuid": g.gpu_uuid, "shards": g.shards, "mean_util": g.mean_util,
                "peak_vram_bytes": g.peak_vram_bytes, "energy_joules": g.energy_joules, "samples": g.samples,
            })).collect::<Vec<_>>(),
        }));
    }
    Ok(Some(json!({"job_id": job_id, "nodes": nodes})))
}
