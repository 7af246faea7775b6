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
stats() { "${PSQL[@]}" -c "SELECT relname, n_tup_ins, n_tup_upd, n_tup_del, seq_scan, idx_scan FROM pg_stat_user_tables WHERE n_tup_ins+n_tup_upd+n_tup_del+seq_scan+coalesce(idx_scan,0) > 0 ORDER BY relname" ; "${PSQL[@]}" -c "SELECT xact_commit, tup_returned, tup_fetched FROM pg_stat_database WHERE datname = current_database()"; }
sleep 5
stats > "$DIR/s0"; Q0="$(pg_ticks)"; sleep "$DURATION"; Q1="$(pg_ticks)"; stats > "$DIR/s1"
echo "idle PG ticks over $DURATION s: $((Q1-Q0))"
diff "$DIR/s0" "$DIR/s1" || true
Q0="$(pg_ticks)"; stats > "$DIR/s2"
run "gateway" "$GW" "$KEY"; echo "gateway p50 $P50 p99 $P99 reqs $REQS"
Q1="$(pg_ticks)"; stats > "$DIR/s3"
echo "busy PG ticks: $((Q1-Q0))"
diff "$DIR/s2" "$DIR/s3" || true
for p in "$PG_PM" $(pgrep -P "$PG_PM"); do echo "$p $(cpu_ticks $p) $(tr '\0' ' ' < /proc/$p/cmdline)"; done
