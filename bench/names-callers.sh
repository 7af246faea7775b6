#!/usr/bin/env bash
# Benchmark: `gpuhub names callers NAME --since 30d` over 10 million usage rows, on SQLite and
# on PostgreSQL. Target: ≤ 50 ms per call (the whole CLI: process start, control socket, query).
#
# For each backend it starts the real agent (target/release/gpuhub-agent run) on a fresh store,
# generates BENCH_ROWS usage_log rows in SQL (a recursive CTE in SQLite, generate_series in
# PostgreSQL: no client round trips), builds the callers rollup with the same SQL the agent's
# `gpuhub names rebuild-callers` runs (store/names.rs callers_rollup_sql, whose bucketing and
# keys a unit test checks against the live path), then times the CLI with hyperfine.
#
# Data shape: 90 days; 3,000 caller profiles (user of 200, app of 60, client address, user
# agent), each calling 3 of 30 names; Slurm jobs change every 3 days (a quarter of the calls
# come from API keys without a job), so one name has ~3,000 distinct callers in 30 days.
#
#   BENCH_ROWS=10000000 BENCH_BACKENDS="sqlite postgres" bench/names-callers.sh
# Needs: root (PostgreSQL via tests/lib/pg.sh), sqlite3, psql, hyperfine, jq; cargo build --release.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROWS="${BENCH_ROWS:-10000000}"
BACKENDS="${BENCH_BACKENDS:-sqlite postgres}"
RUNS="${BENCH_RUNS:-30}"
AGENT="$REPO/target/release/gpuhub-agent"
CLI="$REPO/target/release/gpuhub"
PSQL="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)/psql"
for b in "$AGENT" "$CLI"; do [ -x "$b" ] || { echo "missing $b: cargo build --release" >&2; exit 2; }; done
for t in sqlite3 hyperfine jq; do command -v "$t" >/dev/null || { echo "missing $t (tests/setup/deps.sh)" >&2; exit 2; }; done
W="$(mktemp -d /var/tmp/gpuhub-bench-names.XXXXXX)"
AGENT_PID=""
cleanup() {
    [ -n "$AGENT_PID" ] && kill "$AGENT_PID" 2>/dev/null && wait "$AGENT_PID" 2>/dev/null || true
    [ "${BENCH_KEEP:-0}" = 1 ] && echo "kept $W" || rm -rf "$W"
}
trap cleanup EXIT
now_us=$(( $(date +%s) * 1000000 ))

# The generator's columns, shared by both dialects: $I is the row number.
cols() { # cols I_EXPR CONCAT_FN
    local i="$1"
    local p="($i % 3000)"                         # caller profile
    local off="(($i * 7919) % 7776000)"           # seconds back, 90 days
    local day="($off / 86400)"
    cat <<SQL
'r' || $i,
$now_us - $off * 1000000 - ($i % 1000000),
'user' || ($p % 200),
'app' || ($p % 60),
CASE WHEN $p % 4 = 0 THEN NULL ELSE 100000 + $p * 40 + $day / 3 END,
'10.' || ($p % 7) || '.' || ($p % 250) || '.' || ($p % 13),
'client/' || ($p % 12) || '.0',
CASE WHEN ($p * 31 + ($i / 3000) % 3) % 30 = 0 THEN 'svc-ocr' ELSE 'model-' || (($p * 31 + ($i / 3000) % 3) % 30) END,
'dots.ocr', '', CASE WHEN $i % 50 = 0 THEN 'unknown' ELSE 'deprecated' END, '/v1/chat/completions',
CASE WHEN $i % 50 = 0 THEN 404 ELSE 200 END, '', 20, 10, 0, 1500, 900, 80
SQL
}
INSERT_COLS="request_id, time_us, user_name, app, job_id, client_addr, user_agent, requested_name, resolved_model, model_version, name_state, route, status, error_code, prompt_tokens, completion_tokens, streamed, latency_us, upstream_ttfb_us, overhead_us"

start_agent() { # start_agent STORE_URL
    local d="$W/agent" i
    rm -rf "$d"; mkdir -p "$d"
    cat > "$d/agent.toml" <<TOML
[paths]
state_dir = "$d/state"
runtime_dir = "$d/run"
spool_dir = "$d/spool"
[store]
url = "$1"
[gateway]
listen = "127.0.0.1:18471"
[metrics]
listen = "127.0.0.1:18472"
[admin]
socket = "$d/agent.sock"
[telemetry]
enable_nvml = false
enable_slurm = false
[[models]]
name = "dots.ocr"
launcher = "static"
url = "http://127.0.0.1:9"
TOML
    SOCK="$d/agent.sock"
    "$AGENT" --config "$d/agent.toml" run >"$d/agent.log" 2>&1 &
    AGENT_PID=$!
    for ((i = 0; i < 100; i++)); do
        "$CLI" --socket "$SOCK" whoami >/dev/null 2>&1 && return 0
        kill -0 "$AGENT_PID" 2>/dev/null || { cat "$d/agent.log" >&2; exit 1; }
        sleep 0.2
    done
    echo "agent did not start; log:" >&2; cat "$d/agent.log" >&2; exit 1
}
stop_agent() { kill "$AGENT_PID" 2>/dev/null; wait "$AGENT_PID" 2>/dev/null || true; AGENT_PID=""; }

measure() { # measure BACKEND
    local b="$1"
    local gen_s="$2"
    echo "-- rollup (gpuhub names rebuild-callers)"
    local t0=$SECONDS
    "$CLI" --socket "$SOCK" names rebuild-callers
    local roll_s=$((SECONDS - t0))
    "$CLI" --socket "$SOCK" names callers svc-ocr --since 30d --limit 5
    hyperfine -N --warmup 3 --runs "$RUNS" --export-json "$W/$b.json" \
        "$CLI --socket $SOCK names callers svc-ocr --since 30d" \
        "$CLI --socket $SOCK names callers svc-ocr --since 30d --json" \
        "$CLI --socket $SOCK names callers model-7 --since 90d"
    jq -r --arg b "$b" --arg g "$gen_s" --arg r "$roll_s" \
        '.results[] | "RESULT \($b) | \(.command | sub(".*names "; "names ")) | mean \(.mean * 1000 | floor) ms | median \(.median * 1000 | floor) ms | max \(.max * 1000 | floor) ms | generate \($g) s | rollup \($r) s"' "$W/$b.json"
}

for backend in $BACKENDS; do
    echo "== $backend: $ROWS usage rows"
    case "$backend" in
        sqlite)
            db="$W/names.db"
            start_agent "sqlite://$db"
            t0=$SECONDS
            # Indexes are dropped during the load and rebuilt after (the same definitions as
            # migration 0003), which is how a bulk load is done; the agent's writer keeps them.
            sqlite3 "$db" <<SQL
PRAGMA busy_timeout = 10000;
PRAGMA synchronous = OFF;
DROP INDEX usage_log_time; DROP INDEX usage_log_name_time;
BEGIN;
WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < $ROWS - 1)
INSERT INTO usage_log ($INSERT_COLS) SELECT $(cols i) FROM s;
COMMIT;
CREATE INDEX usage_log_time ON usage_log (time_us);
CREATE INDEX usage_log_name_time ON usage_log (requested_name, time_us);
ANALYZE;
SQL
            gen_s=$((SECONDS - t0))
            echo "generated in ${gen_s}s; $(sqlite3 "$db" 'SELECT COUNT(*) FROM usage_log') rows, $(du -h "$db" | cut -f1)"
            measure sqlite "$gen_s"
            stop_agent
            ;;
        postgres)
            base="$("$REPO/tests/lib/pg.sh")"
            dbname="gpuhub_bench_names"
            "$PSQL" "$base" -qc "DROP DATABASE IF EXISTS $dbname" -c "CREATE DATABASE $dbname"
            url="${base%/*}/$dbname"
            start_agent "$url"
            t0=$SECONDS
            "$PSQL" "$url" -q -v ON_ERROR_STOP=1 <<SQL
SET synchronous_commit = off;
SET maintenance_work_mem = '512MB';
DROP INDEX usage_log_time; DROP INDEX usage_log_name_time;
INSERT INTO usage_log ($INSERT_COLS) SELECT $(cols i) FROM generate_series(0::bigint, $ROWS - 1) AS s(i);
CREATE INDEX usage_log_time ON usage_log (time_us);
CREATE INDEX usage_log_name_time ON usage_log (requested_name, time_us);
VACUUM ANALYZE usage_log;
SQL
            gen_s=$((SECONDS - t0))
            echo "generated in ${gen_s}s; $("$PSQL" "$url" -tAc 'SELECT COUNT(*) FROM usage_log') rows, $("$PSQL" "$url" -tAc "SELECT pg_size_pretty(pg_database_size('$dbname'))")"
            "$PSQL" "$url" -qc "ANALYZE" >/dev/null
            measure postgres "$gen_s"
            stop_agent
            [ "${BENCH_KEEP:-0}" = 1 ] || "$PSQL" "$base" -qc "DROP DATABASE IF EXISTS $dbname"
            ;;
        *) echo "unknown backend $backend (sqlite, postgres)" >&2; exit 2 ;;
    esac
done
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
