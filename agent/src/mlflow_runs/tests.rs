#![allow(clippy::unwrap_used, clippy::panic)]

use std::collections::BTreeMap;

use super::*;
use crate::store::testing::stores;

const S: i64 = 1_000_000;

fn job(id: i64, start_s: i64, end_s: Option<i64>) -> JobRow {
    let mut j = JobRow::new("gpu01", id, 1001, "alice", start_s * S);
    j.start_us = Some(start_s * S);
    j.end_us = end_s.map(|e| e * S);
    j.shards = 7;
    j
}

fn gpu(id: i64, index: i64, util: f64, vram_gib: i64, joules: f64, samples: i64, shards: Option<i64>) -> JobGpuRow {
    JobGpuRow {
        node: "gpu01".into(),
        job_id: id,
        run: 0,
        gpu_index: index,
        gpu_uuid: Some(format!("GPU-{index}")),
        mean_util: Some(util),
        peak_vram_bytes: Some(vram_gib << 30),
        energy_joules: Some(joules),
        samples: Some(samples),
        shards,
    }
}

fn run(start_ms: i64, user: &str) -> RunInfo {
    RunInfo { run_id: "r1".into(), experiment_id: "1".into(), start_time_ms: start_ms, user_id: user.into(), tags: BTreeMap::new() }
}

#[test]
fn metrics_per_gpu_and_totals() {
    let j = job(42, 1000, Some(1100));
    let gpus = [gpu(42, 0, 60.0, 10, 7200.0, 300, Some(7)), gpu(42, 1, 20.0, 4, 3600.0, 100, None), gpu(42, 2, 99.0, 1, 1.0, 0, None)];
    let m: BTreeMap<String, f64> = job_metrics(&j, &gpus).into_iter().map(|m| (m.key, m.value)).collect();
    assert_eq!(m["gpuhub.gpu0.utilization_mean_pct"], 60.0);
    assert_eq!(m["gpuhub.gpu0.vram_peak_gib"], 10.0);
    assert_eq!(m["gpuhub.gpu0.energy_wh"], 2.0);
    assert_eq!(m["gpuhub.gpu0.samples"], 300.0);
    assert_eq!(m["gpuhub.gpu0.shards"], 7.0);
    assert!(!m.contains_key("gpuhub.gpu1.shards"), "a whole GPU has no shards metric");
    assert!(!m.keys().any(|k| k.starts_with("gpuhub.gpu2.")), "a GPU never sampled is left out");
    assert_eq!(m["gpuhub.total.utilization_mean_pct"], (60.0 * 300.0 + 20.0 * 100.0) / 400.0);
    assert_eq!(m["gpuhub.total.vram_peak_gib"], 14.0);
    assert_eq!(m["gpuhub.total.energy_wh"], 3.0);
    assert_eq!(m["gpuhub.gpu_count"], 2.0);
    assert_eq!(m["gpuhub.shards"], 7.0);
    assert_eq!(m["gpuhub.job_duration_s"], 100.0);
    assert!(job_metrics(&j, &gpus).iter().all(|m| m.timestamp == 1_100_000 && m.step == 0), "stamped at the job's end");
    assert!(job_metrics(&j, &[]).is_empty());
}

#[test]
fn a_run_gets_the_figures_only_inside_the_job_and_for_its_user() {
    let mut j = job(42, 1000, Some(1100));
    assert_eq!(check_run(&run(1_000_500, "alice"), &j), Ok(()));
    assert_eq!(check_run(&run(999_000, "alice"), &j), Ok(()), "within the slack of a whole-second start");
    assert_eq!(check_run(&run(990_000, "alice"), &j), Err(Refusal::OutsideJob), "before the job");
    assert_eq!(check_run(&run(1_200_000, "alice"), &j), Err(Refusal::OutsideJob), "after the job");
    assert_eq!(check_run(&run(0, "alice"), &j), Err(Refusal::OutsideJob), "no start time");
    assert_eq!(check_run(&run(1_050_000, "mallory"), &j), Err(Refusal::OtherUser));
    // Slurm's times win over the records' once Slurm vouched for the job.
    j.slurm_start_us = Some(1050 * S);
    assert_eq!(check_run(&run(1_010_000, "alice"), &j), Err(Refusal::OutsideJob));
    assert_eq!(check_run(&run(1_060_000, "alice"), &j), Ok(()));
    j.end_us = None;
    j.slurm_end_us = None;
    assert_eq!(check_run(&run(1_060_000, "alice"), &j), Err(Refusal::OutsideJob), "a job still running has no window");
}

#[test]
fn retries_back_off_and_are_bounded() {
    assert_eq!(retry_delay_us(0), 5 * S);
    assert_eq!(retry_delay_us(1), 10 * S);
    assert_eq!(retry_delay_us(3), 40 * S);
    assert_eq!(retry_delay_us(30), 1800 * S);
    let total: i64 = (0..MAX_ATTEMPTS - 1).map(retry_delay_us).sum();
    assert!(total > 3600 * S && total < 12 * 3600 * S, "an MLflow outage of an hour loses nothing; total {total}");
}

async fn insert(pool: &AnyPool, j: &JobRow, gpus: &[JobGpuRow]) {
    sqlx::query(
        "INSERT INTO acct_jobs (node, job_id, uid, user_name, start_us, end_us, first_seen_us, last_seen_us, shards) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(&j.node)
    .bind(j.job_id)
    .bind(j.uid)
    .bind(&j.user_name)
    .bind(j.start_us)
    .bind(j.end_us)
    .bind(j.first_seen_us)
    .bind(j.last_seen_us)
    .bind(j.shards)
    .execute(pool)
    .await
    .unwrap();
    for g in gpus {
        sqlx::query(
            "INSERT INTO acct_job_gpus (node, job_id, gpu_index, gpu_uuid, mean_util, peak_vram_bytes, energy_joules, samples, shards) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&g.node)
        .bind(g.job_id)
        .bind(g.gpu_index)
        .bind(&g.gpu_uuid)
        .bind(g.mean_util)
        .bind(g.peak_vram_bytes)
        .bind(g.energy_joules)
        .bind(g.samples)
        .bind(g.shards)
        .execute(pool)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn due_jobs_are_ended_measured_and_not_yet_reported_on_both_backends() {
    for (store, _dir) in stores().await {
        let pool = store.pool();
        let now = 100_000 * S;
        insert(pool, &job(1, 99_000, Some(99_900)), &[gpu(1, 0, 50.0, 2, 10.0, 5, Some(7))]).await;
        insert(pool, &job(2, 99_000, None), &[gpu(2, 0, 50.0, 2, 10.0, 5, None)]).await; // running
        insert(pool, &job(3, 99_000, Some(99_900)), &[gpu(3, 0, 0.0, 0, 0.0, 0, None)]).await; // never measured
        insert(pool, &job(4, 1_000, Some(2_000)), &[gpu(4, 0, 50.0, 2, 10.0, 5, None)]).await; // too old
        insert(pool, &job(5, 99_000, Some(99_999)), &[gpu(5, 1, 50.0, 2, 10.0, 5, None)]).await; // not settled
        let ids = |d: Vec<(JobRow, Vec<JobGpuRow>)>| d.into_iter().map(|(j, g)| (j.job_id, g.len())).collect::<Vec<_>>();
        assert_eq!(ids(due_jobs(pool, now).await.unwrap()), [(1, 1)]);
        assert_eq!(ids(due_jobs(pool, now + 5 * S).await.unwrap()), [(1, 1), (5, 1)]);

        // A failed try waits its delay; the attempts are bounded; a success is final.
        let j1 = job(1, 99_000, Some(99_900));
        let failed = Outcome::Failed("cannot reach MLflow".into());
        assert_eq!(record_outcome(pool, &j1, &failed, now).await.unwrap(), "pending");
        assert_eq!(ids(due_jobs(pool, now + S).await.unwrap()), [(5, 1)], "job 1 waits its delay");
        assert_eq!(ids(due_jobs(pool, now + 5 * S).await.unwrap()), [(1, 1), (5, 1)]);
        for _ in 1..MAX_ATTEMPTS - 1 {
            assert_eq!(record_outcome(pool, &j1, &failed, now).await.unwrap(), "pending");
        }
        assert_eq!(record_outcome(pool, &j1, &failed, now).await.unwrap(), "gave_up");
        assert_eq!(ids(due_jobs(pool, now + 100_000 * S).await.unwrap()).iter().filter(|(j, _)| *j == 1).count(), 0);
        let j5 = job(5, 99_000, Some(99_999));
        assert_eq!(record_outcome(pool, &j5, &Outcome::Logged { runs: 2, skipped: 1 }, now).await.unwrap(), "done");
        assert_eq!(ids(due_jobs(pool, now + 5 * S).await.unwrap()), Vec::<(i64, usize)>::new());
        let (state, runs): (String, i64) =
            sqlx::query_as("SELECT state, runs FROM mlflow_job_reports WHERE job_id = 5").fetch_one(pool).await.unwrap();
        assert_eq!((state.as_str(), runs), ("done", 2));
    }
}

#[tokio::test]
async fn an_unreachable_mlflow_is_a_failure_to_retry() {
    // A port nothing listens on (bound, then dropped).
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let t = Tracking::new(&format!("http://127.0.0.1:{port}"));
    let j = job(9, 99_000, Some(99_900));
    match report_job(&t, &j, &[gpu(9, 0, 50.0, 2, 10.0, 5, None)]).await {
        Outcome::Failed(e) => assert!(e.contains("cannot reach MLflow") && e.contains("mlflow.tracking_uri"), "{e}"),
        other => panic!("{other:?}"),
    }
}
