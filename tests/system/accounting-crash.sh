#!/bin/bash
# Exactly-once ingest across crashes: 3,000 usage records (1,000 gpu:1 jobs: start, step,
# end) in a spool; the real gpuhub-agent ingests them and is killed with SIGKILL mid-ingest,
# three times; after the last restart every record is in the store exactly once and the
# GPU-seconds equal the sum computed from the records' own timestamps.
# SQLite always; with GPUHUB_TEST_PG_URL set (tests/run-all.sh sets it), then the same run on
# PostgreSQL in a fresh database.
# GPUHUB_AGENT_BIN / GPUHUB_CLI_BIN override the binaries (default target/release/).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$repo/tests/lib/prereq.sh"
agent="${GPUHUB_AGENT_BIN:-$repo/target/release/gpuhub-agent}"
cli="${GPUHUB_CLI_BIN:-$repo/target/release/gpuhub}"
jobs=1000
fail() { echo "FAIL: $*" >&2; [ -f "${T:-/nonexistent}/agent.log" ] && { echo "--- agent log tail" >&2; tail -n 25 "$T/agent.log" >&2; }; exit 1; }
[ -x "$agent" ] || fail "$agent missing; run cargo build --release"
T=""
agent_pid=""
pg_db=""
psql_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)/psql"
cleanup() {
    [ -n "$agent_pid" ] && kill -9 "$agent_pid" 2>/dev/null
    [ -n "$T" ] && rm -rf "$T"
    [ -n "$pg_db" ] && "$psql_bin" "$GPUHUB_TEST_PG_URL" -qc "DROP DATABASE IF EXISTS $pg_db WITH (FORCE)" >/dev/null 2>&1
    true
}
trap cleanup EXIT
port() { python3 "$repo/tests/lib/free_port.py"; }

run_backend() {
backend="$1"
cleanup
T="$(mktemp -d /tmp/gpuhub-acct-crash.XXXXXX)"
store_url="sqlite://$T/state/gpuhub.db"
if [ "$backend" = postgres ]; then
    pg_db="gpuhub_crash_$$"
    "$psql_bin" "$GPUHUB_TEST_PG_URL" -qc "CREATE DATABASE $pg_db" || fail "cannot create database $pg_db"
    store_url="${GPUHUB_TEST_PG_URL%/*}/$pg_db"
fi
sql() {
    if [ "$backend" = sqlite ]; then sqlite3 "$T/state/gpuhub.db" "$1"; else "$psql_bin" "$store_url" -Atc "$1"; fi
}

# ---- the spool: 1,000 jobs x (job_start, step_start, job_end), like the plugin writes them
mkdir -p "$T/spool/records" "$T/state" "$T/run"
expected_us="$(python3 - "$T/spool/records" "$jobs" <<'PY'
import json, sys, time
d, n = sys.argv[1], int(sys.argv[2])
t0 = int(time.time() * 1e6) - 86400 * 1_000_000
total = 0
def put(rec, rid):
    name = "%020d-%s-%d.json" % (rec["time_us"], rid.replace(":", "_"), 777)
    open(f"{d}/{name}", "w").write(json.dumps(rec))
for j in range(n):
    job = 100000 + j
    ident = dict(job_id=job, uid=1000 + j % 5, user=f"user{j % 5}", account="lab", partition="gpu", node="gpu01")
    gpus = [dict(index=j % 2)]
    start = t0 + j * 1_000_000
    dur = (j % 50 + 1) * 1_000_000 + j  # microsecond-exact, different per job
    total += dur
    put(dict(kind="job_start", v=1, time_us=start, gpus=gpus, **ident), f"gpu01:{job}:job_start")
    put(dict(kind="step_start", v=1, time_us=start + 1, step_id=0, gpus=gpus, shards=None, **ident), f"gpu01:{job}.0:step_start")
    put(dict(kind="job_end", v=1, time_us=start + dur, exit_code=0, gpus=gpus, **ident), f"gpu01:{job}:job_end")
print(total)
PY
)"
n_records=$((jobs * 3))
echo "spool: $n_records records of $jobs gpu:1 jobs; expected GPU-seconds $(python3 -c "print($expected_us/1e6)") ($backend)"

mp="$(port)"; gp="$(port)"
cat > "$T/agent.toml" <<TOML
[paths]
state_dir = "$T/state"
spool_dir = "$T/spool"
runtime_dir = "$T/run"
[store]
url = "$store_url"
[gateway]
listen = "127.0.0.1:$gp"
[metrics]
listen = "127.0.0.1:$mp"
[telemetry]
enable_nvml = false
enable_slurm = false
[accounting]
ingest_interval_ms = 100
TOML
left() { find "$T/spool/records" -name '*.json' | wc -l; }
start_agent() {
    # setsid: its own session, so bash does not report the SIGKILL as a job death.
    setsid "$agent" --config "$T/agent.toml" run >>"$T/agent.log" 2>&1 &
    agent_pid=$!
    disown "$agent_pid"
}

# ---- three SIGKILLs mid-ingest
for round in 1 2 3; do
    before="$(left)"
    start_agent
    # Wait until this run has ingested something, then kill it without warning.
    for ((i = 0; i < 600; i++)); do
        now="$(left)"
        [ "$now" -lt "$before" ] && break
        kill -0 "$agent_pid" 2>/dev/null || fail "the agent exited (round $round)"
        sleep 0.05
    done
    kill -9 "$agent_pid"
    for ((i = 0; i < 100; i++)); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.05; done
    agent_pid=""
    now="$(left)"
    [ "$now" -lt "$before" ] || fail "round $round: the agent ingested nothing in 30 s ($now files left)"
    [ "$now" -gt 0 ] || fail "round $round: the spool was drained before the kill; raise the job count"
    stored="$(sql 'SELECT COUNT(*) FROM acct_records')"
    echo "round $round: SIGKILL with $now of $before files left; $stored records stored (stored + left = $((stored + now)), $n_records expected, +1 when killed between commit and unlink)"
    [ $((stored + now)) -ge "$n_records" ] || fail "round $round: records lost: $stored stored + $now in the spool < $n_records"
    [ $((stored + now)) -le $((n_records + 1)) ] || fail "round $round: $stored stored + $now in the spool > $n_records + 1"
done

# ---- restart and drain
start_agent
for ((i = 0; i < 1200; i++)); do
    [ "$(left)" -eq 0 ] && break
    kill -0 "$agent_pid" 2>/dev/null || fail "the agent exited during the final drain"
    sleep 0.1
done
[ "$(left)" -eq 0 ] || fail "spool not drained after 120 s: $(left) files left"
sleep 0.5
stored="$(sql 'SELECT COUNT(*) FROM acct_records')"
distinct="$(sql 'SELECT COUNT(DISTINCT record_id) FROM acct_records')"
got_us="$(sql 'SELECT CAST(SUM(end_us - start_us) AS BIGINT) FROM acct_jobs')"
nq="$( (find "$T/spool/quarantine" -type f 2>/dev/null || true) | wc -l)"
echo "after the drain: $stored records ($distinct distinct), job time sum ${got_us} us, quarantine files: $nq"
[ "$stored" -eq "$n_records" ] || fail "expected exactly $n_records records in the store, got $stored"
[ "$distinct" -eq "$n_records" ] || fail "duplicate record ids: $distinct distinct of $stored"
[ "$got_us" -eq "$expected_us" ] || fail "job time: expected $expected_us us (from the records), got $got_us"
[ "$nq" -eq 0 ] || fail "$nq files quarantined; none expected"

# ---- the CLI answer, when this build has it
if [ -x "$cli" ] && "$cli" usage --help 2>/dev/null | grep -q -- '--by'; then
    out="$("$cli" --socket "$T/run/agent.sock" usage --since 30d --by user --json)"
    got="$(jq '[.rows[].gpu_seconds] | add' <<<"$out")"
    python3 -c "import sys; g=float('$got'); e=$expected_us/1e6; sys.exit(0 if abs(g-e) < 1e-6 else 1)" \
        || fail "gpuhub usage --json: gpu_seconds sum $got, expected $(python3 -c "print($expected_us/1e6)")"
    echo "ok: gpuhub usage --by user --json: gpu_seconds sum $got"
else
    echo "(gpuhub usage --by not in this build: checked the store directly)"
fi
echo "ok: accounting-crash ($backend): $n_records records, 3 SIGKILLs, none lost, none counted twice"
kill "$agent_pid" 2>/dev/null || true
for ((i = 0; i < 100; i++)); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
agent_pid=""
}

run_backend sqlite
if [ -n "${GPUHUB_TEST_PG_URL:-}" ]; then
    run_backend postgres
else
    prereq_missing "GPUHUB_TEST_PG_URL is not set, so the PostgreSQL run is left out" "export the URL tests/lib/pg.sh prints" || true
fi
echo "PASS: accounting-crash"
