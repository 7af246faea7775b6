//! What a quota pass costs PostgreSQL to find one busy worker job's callers: a job that started
//! 15 minutes ago (older than `LATE_US`, before which a pass reads rows before the job's start
//! on every pass), 40 minutes into an hour, the store filled with `RATE` calls per second of
//! its model for the last `MINUTES` minutes (by six users; 20: five minutes of them before the
//! job), then, `PASSES` times each and alternating, the pass's read as it is now
//! (`LiveCallers::callers` with its kept sums: the job's hours from the hourly rollup)
//! and the read the pass made before (the usage rows of the last `LATE_US`, read on every pass:
//! `callers_between` from the horizon on, the query its kept sums left), plus once each the
//! read of the job's whole life that the old pass made first and repeated every hour (from
//! `MAX_CALL_US` before its start) and the first pass now (the rows before the job from
//! `earliest_start`, the job's hours from the rollup). Used by `bench/live-callers.sh`.
//!
//!   live_callers_cost POSTGRES_URL [RATE] [MINUTES] [PASSES]
//!
//! Prints `rows old_wall_ms old_pg_ms new_wall_ms new_pg_ms whole_wall_ms whole_pg_ms first_wall_ms
//! first_pg_ms`: the median of the passes' wall times, PostgreSQL's CPU per pass (every process of
//! the server, parallel workers included; the mean over the passes, as the CPU is counted in clock
//! ticks), the old whole read's and the first pass's. The server must run on this host.

mod bench_pg;

use bench_pg::{FreshDb, cpu_ticks, tick_ms};
use gpuhub_agent::accounting::inference::{MAX_CALL_US, callers, callers_between};
use gpuhub_agent::accounting::live_callers::{LATE_US, LiveCallers};

/// The parent of `pid`.
fn ppid(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 2..].split(' ').nth(1)?.parse().ok()
}

/// CPU of the whole server: the postmaster's ended children and its live ones.
fn server_ticks(postmaster: i32) -> u64 {
    let live: u64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| ppid(*p) == Some(postmaster))
        .map(|p| cpu_ticks(p, false))
        .sum();
    cpu_ticks(postmaster, true) + live
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let Some(url) = args.get(1) else {
        return Err("usage: live_callers_cost POSTGRES_URL [RATE] [MINUTES] [PASSES]".into());
    };
    let rate: i64 = args.get(2).map_or(Ok(2000), |v| v.parse())?;
    let minutes: i64 = args.get(3).map_or(Ok(30), |v| v.parse())?;
    let passes: usize = args.get(4).map_or(Ok(5), |v| v.parse())?;
    let fresh = FreshDb::create(url, "gpuhub_live").await?;
    let (store, pool) = (&fresh.store, fresh.store.pool());
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&fresh.admin).await?;
    let postmaster = ppid(backend).ok_or("no postmaster")?;

    // Now is 40 minutes into an hour, the job started 15 minutes before; the rows as the usage
    // writer stores them (usage_log and the rows waiting for the fold), then folded.
    let hour = 3_600_000_000_i64;
    let now = 1_800_000_000_000_000 - 1_800_000_000_000_000 % hour + 40 * 60_000_000;
    let from = now - 15 * 60_000_000;
    let rows = rate * minutes * 60;
    let step = 1_000_000 / rate;
    sqlx::query(
        "WITH g AS (SELECT i, $1 + i * $2 AS t, (ARRAY['alice','bob','carol','dave','erin','frank'])[1 + i % 6] AS u FROM generate_series(0, $3 - 1) i), \
         ins AS (INSERT INTO usage_log (request_id, time_us, user_name, app, job_id, client_addr, user_agent, requested_name, resolved_model, \
           model_version, name_state, route, status, error_code, prompt_tokens, completion_tokens, streamed, latency_us, upstream_ttfb_us, overhead_us) \
           SELECT 'r' || i, t, u, 'job', 4242, '10.77.0.12', 'OpenAI/Python 1.54.0', 'demo-chat', 'demo-chat', '', 'active', '/v1/chat/completions', \
           200, '', 12, 5, 0, 400 + i % 300, 300, 10 FROM g RETURNING time_us, user_name, app, requested_name, resolved_model, calls, status, \
           prompt_tokens, completion_tokens, latency_us, job_id, client_addr, user_agent, name_state, overhead_us) \
         INSERT INTO usage_rollup_pending (time_us, user_name, app, requested_name, resolved_model, calls, status, prompt_tokens, \
           completion_tokens, latency_us, job_id, client_addr, user_agent, name_state, overhead_us) SELECT * FROM ins",
    )
    .bind(now - minutes * 60_000_000)
    .bind(step)
    .bind(rows)
    .execute(pool)
    .await?;
    store.fold_rollups().await?;
    sqlx::query("VACUUM ANALYZE usage_log").execute(pool).await?;
    sqlx::query("VACUUM ANALYZE call_rollups").execute(pool).await?;

    let to = now + 1_000_000;
    let live = LiveCallers::default();
    let key = ("gpu01".to_string(), 4242);
    let tick_ms = tick_ms();
    let measure =
        |pg0: u64, t0: std::time::Instant| ((t0.elapsed().as_secs_f64() * 1000.0), (server_ticks(postmaster) - pg0) as f64 * tick_ms);
    // The first pass reads the rows before the job and its hours; later passes keep them.
    let (pg0, t0) = (server_ticks(postmaster), std::time::Instant::now());
    let got = live.callers(pool, &key, "demo-chat", from, to, now).await?;
    let first = measure(pg0, t0);
    let want = callers_between(pool, "demo-chat", from, from - MAX_CALL_US, to + 1).await?;
    if got != want || callers(pool, "demo-chat", from, to).await? != want {
        return Err(format!("the kept sums differ from a whole read: {got:?} against {want:?}").into());
    }
    let (mut old, mut new) = (Vec::new(), Vec::new());
    for pass in 1..=passes {
        let at = now + pass as i64 * 1_000_000;
        let (pg0, t0) = (server_ticks(postmaster), std::time::Instant::now());
        callers_between(pool, "demo-chat", from, at - LATE_US, at + 1_000_001).await?;
        old.push(measure(pg0, t0));
        let (pg0, t0) = (server_ticks(postmaster), std::time::Instant::now());
        live.callers(pool, &key, "demo-chat", from, at + 1_000_000, at).await?;
        new.push(measure(pg0, t0));
    }
    let (pg0, t0) = (server_ticks(postmaster), std::time::Instant::now());
    callers_between(pool, "demo-chat", from, from - MAX_CALL_US, to + 1).await?;
    let whole = measure(pg0, t0);
    let wall = |v: &[(f64, f64)]| median(v.iter().map(|x| x.0).collect());
    let cpu = |v: &[(f64, f64)]| v.iter().map(|x| x.1).sum::<f64>() / v.len() as f64;
    use std::io::Write;
    writeln!(
        std::io::stdout(),
        "{rows} {:.2} {:.2} {:.2} {:.2} {:.1} {:.1} {:.1} {:.1}",
        wall(&old),
        cpu(&old),
        wall(&new),
        cpu(&new),
        whole.0,
        whole.1,
        first.0,
        first.1
    )?;
    fresh.drop().await
}
