#!/usr/bin/env bash
# Gateway with two replicas on two nodes (#18): wrk against one worker directly and through
# gpu01's gateway serving a model with two replicas (min_replicas = max_replicas = 2: one job on
# gpu01, one on gpu02; least-outstanding routing between them), in one run. Prints, per paced
# pair (direct, then gateway) and as medians:
#   - added p50/p99 latency at ~RATE requests/s (wrk's delay() paces each connection),
#   - the gateway's CPU-seconds per 1000 requests (utime+stime of gpu01's agent, /proc/PID/stat),
#   - the store's CPU-seconds per 1000 gateway requests (utime+stime of the lab's PostgreSQL:
#     its postmaster and backends), work the gateway's figure does not count,
#   - the proxy floor: the same for nginx on the host in front of the replica on gpu02
#     (bench/lib/nginx.sh), the third run of each pair;
#   - the store's share of the added latency: a fourth run through the gateway with the lab's
#     PostgreSQL stopped (SIGSTOP, SIGCONT after; the gateway keeps answering, its usage rows
#     wait in its journal and are written after). On these two shared cores the store runs
#     beside wrk, the gateway and both replicas; in a cluster it usually has a host of its own.
# The upstream is the repo's test worker (answers from memory), as in bench/gateway.sh.
#   sudo bench/gateway-replicas.sh          DURATION=10 RATE=2000 CONNS=20 REPEAT=3 by default
# It holds /run/gpuhub-run-all.lock (the lab is shared), switches the lab to two nodes
# (GPUHUB_LAB_NODES=2 tests/lab/up.sh) and restores the one-node lab at exit.
# Needs: cargo build --release; wrk and nginx-light (apt). Results go to stdout; copy them to BENCHMARKS.md.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${GPUHUB_BENCH_LOCKED:-}" ]; then
    exec env GPUHUB_BENCH_LOCKED=1 flock -o /run/gpuhub-run-all.lock "$0" "$@"
fi
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lab/nodes.sh"
lab_require
command -v wrk >/dev/null || { echo "wrk not installed (apt-get install wrk)" >&2; exit 1; }
command -v nginx >/dev/null || { echo "nginx not installed (apt-get install nginx-light): each pair measures it as the proxy floor" >&2; exit 1; }
DURATION="${DURATION:-10}"; RATE="${RATE:-2000}"; CONNS="${CONNS:-20}"; REPEAT="${REPEAT:-3}"
NODES_SH="$REPO/tests/lab/nodes.sh"
PSQL=(psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -d "$NODES_PG_DB" -tAq)
DIR="$(mktemp -d /tmp/gpuhub-bench-replicas.XXXXXX)"
MODEL=bench-r

restore() {
    local jobs
    jobs="$(squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')"
    # shellcheck disable=SC2086
    [ -n "${jobs// /}" ] && lab_cancel $jobs
    GPUHUB_LAB_BUILD=0 GPUHUB_LAB_SMOKE=0 "$REPO/tests/lab/up.sh" >"$DIR/restore.log" 2>&1 ||
        { cat "$DIR/restore.log" >&2; echo "the one-node lab did not come back (tests/lab/up.sh)" >&2; }
    rm -rf "$DIR"
}
lab_cleanup_add restore
lab_wait_gpus_free 240

# The agents pass quotas at the production default (the lab's 2 s is for the quota tests).
export NODES_QUOTA_INTERVAL_MS=60000
cat > "$DIR/models.toml" <<'TOML'

[[models]]
name = "bench-r"
launcher = "slurm"
command = "/usr/local/libexec/gpuhub/gpuhub-test-worker --model {model} --host {host} --port {port} --api-key-file {api_key_file}"
resources = { shards = 2, vram_gib = 8.0 }
idle_timeout_s = 600
load_timeout_s = 60
health_path = "/health"
max_concurrency = 64
min_replicas = 2
max_replicas = 2
TOML
GPUHUB_LAB_NODES=2 GPUHUB_LAB_BUILD=0 "$REPO/tests/lab/up.sh" >"$DIR/up.log" 2>&1 || { tail -n 30 "$DIR/up.log" >&2; exit 1; }
"$NODES_SH" agent-stop gpu01
GPUHUB_LAB_NODES_EXTRA="$DIR/models.toml" "$NODES_SH" agent-start gpu01 60
GW_PID="$(cat "$NODES_DIR/gpu01/agent.pid")"
GW="http://$(nodes_ip gpu01):8400"
models() { nodes_exec gpu01 "$REPO/target/release/gpuhub" models list --json 2>/dev/null | jq -c ".models[] | select(.name == \"$MODEL\")"; }
m=""
for _ in $(seq 240); do   # min_replicas = 2: both start with the agent
    m="$(models || true)"
    # Ready, and each replica's node known (the agent learns it from squeue on its next tick).
    [ "$(jq '[.replicas[] | select(.state == "ready" and .node != null)] | length' <<<"$m" 2>/dev/null)" = 2 ] && break
    sleep 0.5
done
[ "$(jq '[.replicas[] | select(.state == "ready")] | length' <<<"$m")" = 2 ] || { echo "no 2 ready replicas: $m" >&2; exit 1; }
[ "$(jq -r '[.replicas[].node] | sort | join(",")' <<<"$m")" = "gpu01,gpu02" ] || { echo "replicas not one per node: $m" >&2; exit 1; }
# The direct target: the replica on gpu02 (the gateway on gpu01 reaches it over the bridge too).
DIRECT="$(jq -r '.replicas[] | select(.node == "gpu02") | .base_url' <<<"$m")"
JOB2="$(jq -r '.replicas[] | select(.node == "gpu02") | .job_id' <<<"$m")"
WKEY="$("${PSQL[@]}" -c "SELECT api_key FROM model_workers WHERE instance_id = '$JOB2'")"
KEY="$(nodes_exec gpu01 "$REPO/target/release/gpuhub" keys create --user bench --app wrk | tail -n 1)"
WRK_DIR="$DIR"
. "$REPO/bench/lib/wrk.sh"
. "$REPO/bench/lib/nginx.sh"
nginx_start "${DIRECT#http://}" || exit 1
lab_cleanup_add "kill $NGINX_PID"
run() { wrk_run "$1" "$2" "$3" "$BODY" "$CONNS" "$DELAY" || exit 1; }   # run NAME URL AUTH -> P50 P99 RPS REQS
BODY="{\"model\":\"$MODEL\",\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}"
DELAY=$(( CONNS * 1000 / RATE ))
echo "gateway with 2 replicas on 2 nodes: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), wrk -t2, ${DURATION}s per run, $CONNS connections at ~$RATE req/s"
echo "replicas: $(jq -c '[.replicas[] | {job_id, node, base_url}]' <<<"$m"); direct: $DIRECT (gpu02); gateway: $GW (gpu01, pid $GW_PID); proxy floor: nginx at $NGINX_URL -> $DIRECT"
# The lab's PostgreSQL (tests/lab/nodes.sh): its postmaster and every backend (the agents'
# pools keep theirs for the run).
PG_PM="$(head -n1 "$NODES_PG_DATA/postmaster.pid")"
pg_ticks() { local t=0 p; for p in "$PG_PM" $(pgrep -P "$PG_PM"); do t=$((t + $(cpu_ticks "$p" 2>/dev/null || echo 0))); done; echo "$t"; }
# pg_signal STOP|CONT: every process of the lab's PostgreSQL.
pg_signal() { kill -"$1" "$PG_PM" $(pgrep -P "$PG_PM") 2>/dev/null || true; }
lab_cleanup_add "kill -CONT $PG_PM \$(pgrep -P $PG_PM) 2>/dev/null || true"
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
# The agent's own work without calls (telemetry, Slurm polls, quota pass), for scale: it is
# counted in the per-call figures below, not taken off them.
C0="$(cpu_ticks "$GW_PID")"; sleep "$DURATION"; C1="$(cpu_ticks "$GW_PID")"
IDLE="$(awk -v c="$((C1 - C0))" -v tick="$TICK" -v d="$DURATION" 'BEGIN { printf "%.4f", c / tick / d }')"
: >"$DIR/pairs"
WINDOWS=""
for i in $(seq "$REPEAT"); do
    S0="$(steal_ticks)"
    run "direct-$i" "$DIRECT" "$WKEY"; D50=$P50; D99=$P99
    C0="$(cpu_ticks "$GW_PID")"; Q0="$(pg_ticks)"
    W0="$(date +%s%6N)"
    run "gateway-$i" "$GW" "$KEY"; G50=$P50; G99=$P99; GRPS=$RPS; GREQS=$REQS
    WINDOWS="${WINDOWS:+$WINDOWS OR }time_us BETWEEN $W0 AND $(date +%s%6N)"
    C1="$(cpu_ticks "$GW_PID")"; Q1="$(pg_ticks)"
    N0="$(cpu_ticks "$NGINX_WORKER")"
    run "nginx-$i" "$NGINX_URL" "$WKEY"; N50=$P50; N99=$P99; NREQS=$REQS
    N1="$(cpu_ticks "$NGINX_WORKER")"
    pg_signal STOP
    run "gateway-store-paused-$i" "$GW" "$KEY"; P99S=$P99
    pg_signal CONT
    S1="$(steal_ticks)"
    awk -v d50="$D50" -v d99="$D99" -v g50="$G50" -v g99="$G99" -v grps="$GRPS" -v tick="$TICK" -v c="$((C1 - C0))" -v reqs="$GREQS" -v st="$((S1 - S0))" \
        -v n50="$N50" -v n99="$N99" -v n="$((N1 - N0))" -v nreqs="$NREQS" -v q="$((Q1 - Q0))" -v p99s="$P99S" \
        'BEGIN { printf "%.0f %.0f %.0f %.0f %.0f %.4f %d %.0f %.0f %.4f %.4f %.0f\n", d50, d99, g50, g99, grps, (c / tick) / (reqs / 1000), st, n50, n99, (n / tick) / (nreqs / 1000), (q / tick) / (reqs / 1000), p99s }' >>"$DIR/pairs"
done
col() { awk -v c="$1" '{ print $c }' "$DIR/pairs" | median; }
addcol() { awk -v a="$1" -v b="$2" '{ print $a - $b }' "$DIR/pairs" | median; }
echo "paced pairs (direct p50 p99 | gateway p50 p99 us | gateway req/s | gateway CPU-s per 1000 | host steal ticks | nginx p50 p99 us, CPU-s per 1000 | PostgreSQL CPU-s per 1000 gateway requests | gateway p99 us with the store stopped):"
sed 's/^/    /' "$DIR/pairs"
awk -v d50="$(col 1)" -v d99="$(col 2)" -v g50="$(col 3)" -v g99="$(col 4)" -v a50="$(addcol 3 1)" -v a99="$(addcol 4 2)" \
    -v grps="$(col 5)" -v cpu="$(col 6)" -v n="$REPEAT" -v n50="$(addcol 8 1)" -v n99="$(addcol 9 2)" -v ncpu="$(col 10)" -v pg="$(col 11)" -v s99="$(addcol 12 2)" 'BEGIN {
    printf "median of %d pairs: direct p50 %.0f us p99 %.0f us | gateway %.0f req/s p50 %.0f us p99 %.0f us | added p50 %.0f us, p99 %.0f us\n", n, d50, d99, grps, g50, g99, a50, a99
    printf "gateway CPU: %.3f CPU-s per 1000 requests (median)\n", cpu
    printf "store: PostgreSQL %.3f CPU-s per 1000 gateway requests (median; not in the gateway figure)\n", pg
    printf "floor: nginx on the host in front of the replica on gpu02, median of %d: added p50 %.0f us, p99 %.0f us, %.3f CPU-s per 1000 requests\n", n, n50, n99, ncpu
    printf "the store'"'"'s share: through the gateway with PostgreSQL stopped, median of %d: added p99 %.0f us (against %.0f us with it running)\n", n, s99, a99
}'
echo "gpu01's agent without calls: $IDLE CPU-s per second"
# The gateway's own account of its overhead (latency minus the time it waited for a replica),
# from the usage rows of the calls above: what is left of the added latency is outside the
# gateway's code (the scheduler of a busy 2-core VM, the bridge between the node namespaces).
# Only the calls of the gateway runs with the store running (WINDOWS), not those it answered
# while PostgreSQL was stopped.
sleep 1
GW_ROWS="requested_name = '$MODEL' AND status = 200 AND ($WINDOWS)"
pct() { "${PSQL[@]}" -c "SELECT $1 FROM usage_log WHERE $GW_ROWS ORDER BY $1 LIMIT 1 OFFSET (SELECT COUNT(*) * $2 / 100 FROM usage_log WHERE $GW_ROWS)"; }
echo "usage rows: overhead_us p50 $(pct overhead_us 50) p99 $(pct overhead_us 99); upstream_ttfb_us p50 $(pct upstream_ttfb_us 50) p99 $(pct upstream_ttfb_us 99)"
# The single-node gateway's own bench (bench/gateway.sh: loopback, SQLite, a static upstream),
# plain calls, right after on the same machine: its targets are the ones this one is held to,
# and this VM's speed drifts from day to day.
REF="$(MODES=plain QUICK=1 DURATION="$DURATION" REPEAT="$REPEAT" RATE="$RATE" CONNS="$CONNS" "$REPO/bench/gateway.sh" 2>&1)" ||
    { echo "$REF" >&2; exit 1; }
echo "single-node reference (bench/gateway.sh, plain, right after):"
grep -E 'paced pairs|^ +[0-9]|median of|cpu:|floor:' <<<"$REF" | sed 's/^/    /'
R99="$(sed -n 's/.*paced, median.*added p50 [0-9-]* us, p99 \([0-9-]*\) us.*/\1/p' <<<"$REF")"
RCPU="$(sed -n 's/.*cpu: *gateway \([0-9.]*\) CPU-s.*/\1/p' <<<"$REF")"
awk -v a99="$(addcol 4 2)" -v cpu="$(col 6)" -v r99="$R99" -v rcpu="$RCPU" 'BEGIN {
    printf "two replicas on two nodes against the single-node gateway, same run: added p99 %+.0f us (%.0f against %.0f), CPU per 1000 x%.2f (%.3f against %.3f)\n", a99 - r99, a99, r99, cpu / rcpu, cpu, rcpu
}'
echo "replicas after the runs: $(models | jq -c '[.replicas[] | {node, state, health}]')"
