//! What one usage batch costs on PostgreSQL: the usage writer's path (`Store::insert_usage_on`
//! on a kept connection) inserting `BATCHES` batches of `ROWS` rows into a fresh database, with
//! the CPU time of the PostgreSQL backends serving that database and of this process. Used by
//! `bench/usage-batch.sh`, which runs two builds of it side by side.
//!
//!   usage_batch_cost POSTGRES_URL [BATCHES] [ROWS]
//!
//! Prints one line: `pg_ms_per_batch client_ms_per_batch wall_ms_per_batch`. The server must
//! run on this host (its backends' CPU is read from /proc).
use gpuhub_agent::gateway::usage_log::UsageRow;
mod bench_pg;

use bench_pg::{FreshDb, cpu_ticks, tick_ms};
use gpuhub_agent::store::gateway::UsageConnection;

/// This process's user plus system CPU, microseconds.
fn own_cpu_us() -> i64 {
    // SAFETY: getrusage fills the zeroed struct it is given.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1_000_000 + ru.ru_utime.tv_usec + ru.ru_stime.tv_usec
}

/// A call as the gateway logs it under load: batch `b`, row `i`.
fn row(b: usize, i: usize) -> UsageRow {
    UsageRow {
        request_id: format!("bench-{b}-{i}"),
        time_us: 1_800_000_000_000_000 + (b * 1000 + i) as i64 * 500,
        user: ["alice", "bob", "carol"][i % 3].into(),
        app: "job".into(),
        job_id: Some(4242 + (i % 2) as i64),
        client_addr: "10.77.0.12".into(),
        user_agent: "OpenAI/Python 1.54.0".into(),
        requested_name: "demo-chat".into(),
        resolved_model: "demo-chat".into(),
        name_state: "active".into(),
        route: "/v1/chat/completions".into(),
        status: 200,
        prompt_tokens: 12,
        completion_tokens: 5,
        latency_us: 400,
        upstream_ttfb_us: 300,
        overhead_us: 10,
        calls: 1,
        ..UsageRow::default()
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let Some(url) = args.get(1) else {
        return Err("usage: usage_batch_cost POSTGRES_URL [BATCHES] [ROWS]".into());
    };
    let batches: usize = args.get(2).map_or(Ok(3000), |v| v.parse())?;
    let rows: usize = args.get(3).map_or(Ok(20), |v| v.parse())?;
    let fresh = FreshDb::create(url, "gpuhub_batch").await?;
    let store = &fresh.store;
    let mut conn = UsageConnection::default();
    // Warm-up: the statement prepared, PostgreSQL on its generic plan.
    for b in 0..50 {
        store.insert_usage_on(&mut conn, &(0..rows).map(|i| row(b, i)).collect::<Vec<_>>()).await?;
    }
    let backends: Vec<i32> =
        sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE datname = $1").bind(&fresh.name).fetch_all(&fresh.admin).await?;
    let pg = || backends.iter().map(|p| cpu_ticks(*p, false)).sum::<u64>();
    let batch_rows: Vec<Vec<UsageRow>> = (50..50 + batches).map(|b| (0..rows).map(|i| row(b, i)).collect()).collect();
    let (pg0, own0, t0) = (pg(), own_cpu_us(), std::time::Instant::now());
    for batch in &batch_rows {
        store.insert_usage_on(&mut conn, batch).await?;
    }
    let (pg1, own1, wall) = (pg(), own_cpu_us(), t0.elapsed());
    let tick_ms = tick_ms();
    let n = batches as f64;
    use std::io::Write;
    writeln!(
        std::io::stdout(),
        "{:.4} {:.4} {:.4}",
        (pg1 - pg0) as f64 * tick_ms / n,
        (own1 - own0) as f64 / 1000.0 / n,
        wall.as_secs_f64() * 1000.0 / n
    )?;
    drop(conn);
    fresh.drop().await
}
