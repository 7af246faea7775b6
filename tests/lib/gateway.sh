# Shared helpers for the gateway's system tests and benchmark (source it; bash).
# Everything runs on loopback, in a temp directory, with bounded waits.
#   gw_init                      temp dir $GW_DIR, free ports, builds nothing
#   gw_worker NAME [ARGS..]      starts the test worker; sets $GW_WORKER_ADDR
#   gw_config [STORE_URL]        writes $GW_DIR/agent.toml (model demo-chat -> the worker)
#   gw_config_add SECTION LINE   adds LINE (`key = value`) to [SECTION] of that file (gateway, store)
#   gw_start / gw_kill9 / gw_stop  run the real agent binary
#   gw_key USER APP              prints a new API key (through the real `gpuhub` CLI)
#   gw_rows SQL                  runs SQL against the store (SQLite or PostgreSQL)
#   gw_rolled_up                 sets $ROWS (usage rows) and $ROLLED (calls in call_rollups), once
#                                they agree or after 10 s (PostgreSQL folds rows in about once a second)

GW_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
GW_BIN="${GW_BIN:-$GW_REPO/target/release}"

gw_fail() { echo "FAIL: $*" >&2; [ -n "${GW_DIR:-}" ] && [ -f "$GW_DIR/agent.log" ] && { echo "--- agent.log (tail)" >&2; tail -n 30 "$GW_DIR/agent.log" >&2; }; exit 1; }

gw_free_port() { python3 "$(dirname "${BASH_SOURCE[0]}")/free_port.py"; }

gw_init() {
    for b in gpuhub-agent gpuhub gpuhub-test-worker; do
        [ -x "$GW_BIN/$b" ] || gw_fail "$GW_BIN/$b missing: run cargo build --release"
    done
    GW_DIR="$(mktemp -d ${GW_TMP:-/tmp}/gpuhub-gw.XXXXXX)"
    GW_PORT="$(gw_free_port)"; GW_METRICS_PORT="$(gw_free_port)"
    GW_URL="http://127.0.0.1:$GW_PORT"
    GW_SOCKET="$GW_DIR/agent.sock"
    GW_PIDS=()
    trap gw_cleanup EXIT
}

gw_cleanup() {
    local p
    for p in "${GW_PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
    [ -n "${GW_AGENT_PID:-}" ] && kill "$GW_AGENT_PID" 2>/dev/null || true
    [ -n "${GW_KEEP:-}" ] || rm -rf "$GW_DIR"
}

gw_worker() {
    local name="$1"; shift
    rm -f "$GW_DIR/worker.addr"
    "$GW_BIN/gpuhub-test-worker" --model "$name" --host 127.0.0.1 --port 0 --api-key worker-key \
        --report-file "$GW_DIR/worker.addr" "$@" >"$GW_DIR/worker.log" 2>&1 &
    GW_PIDS+=($!)
    local i
    for i in $(seq 100); do [ -s "$GW_DIR/worker.addr" ] && break; sleep 0.05; done
    [ -s "$GW_DIR/worker.addr" ] || gw_fail "test worker did not start: $(cat "$GW_DIR/worker.log")"
    GW_WORKER_ADDR="$(awk '{print $1":"$2}' "$GW_DIR/worker.addr")"
}

gw_config() {
    local store="${1:-sqlite://$GW_DIR/state/gpuhub.db}"
    GW_STORE_URL="$store"
    cat >"$GW_DIR/agent.toml" <<TOML
[paths]
state_dir = "$GW_DIR/state"
runtime_dir = "$GW_DIR/run"
spool_dir = "$GW_DIR/spool"
[store]
url = "$store"
[gateway]
listen = "127.0.0.1:$GW_PORT"
[metrics]
listen = "127.0.0.1:$GW_METRICS_PORT"
[admin]
socket = "$GW_SOCKET"
[telemetry]
enable_nvml = false
enable_slurm = false
[[models]]
name = "demo-chat"
launcher = "static"
url = "http://$GW_WORKER_ADDR"
api_key = "worker-key"
max_concurrency = 512
queue_len = 512
TOML
}

gw_config_add() {
    local section="$1" line="$2"
    grep -q "^\[$section\]\$" "$GW_DIR/agent.toml" || gw_fail "gw_config_add: no [$section] in $GW_DIR/agent.toml"
    sed -i "/^\[$section\]\$/a $line" "$GW_DIR/agent.toml"
}

# GW_AGENT_ENV: NAME=VALUE words added to the agent's environment (bench/gateway-ab.sh).
gw_start() {
    # shellcheck disable=SC2086 # word splitting intended: NAME=VALUE words
    env ${GW_AGENT_ENV:-} GPUHUB_LOG_FORMAT=text "$GW_BIN/gpuhub-agent" --config "$GW_DIR/agent.toml" run >>"$GW_DIR/agent.log" 2>&1 &
    GW_AGENT_PID=$!
    local i
    for i in $(seq 200); do curl -sf "$GW_URL/healthz" >/dev/null 2>&1 && return 0; sleep 0.05; done
    gw_fail "agent did not answer /healthz within 10 s"
}

gw_kill9() { kill -9 "$GW_AGENT_PID"; wait "$GW_AGENT_PID" 2>/dev/null || true; GW_AGENT_PID=; }

gw_stop() {
    kill -TERM "$GW_AGENT_PID"
    local i
    for i in $(seq 300); do kill -0 "$GW_AGENT_PID" 2>/dev/null || { wait "$GW_AGENT_PID" 2>/dev/null || true; GW_AGENT_PID=; return 0; }; sleep 0.1; done
    gw_fail "agent did not stop within 30 s of SIGTERM"
}

gw_key() { "$GW_BIN/gpuhub" --socket "$GW_SOCKET" keys create --user "$1" --app "$2" | tail -n 1; }

gw_rolled_up() {
    local i
    for i in $(seq 50); do
        ROWS="$(gw_rows 'SELECT COUNT(*) FROM usage_log')"
        ROLLED="$(gw_rows 'SELECT CAST(SUM(calls) AS BIGINT) FROM call_rollups')"
        [ "$ROWS" = "$ROLLED" ] && return 0
        sleep 0.2
    done
}

gw_rows() {
    case "$GW_STORE_URL" in
        sqlite://*) sqlite3 "${GW_STORE_URL#sqlite://}" "$1" ;;
        postgres*) psql -X -A -t -q "$GW_STORE_URL" -c "$1" 2>/dev/null || "$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)/psql" -X -A -t -q "$GW_STORE_URL" -c "$1" ;;
    esac
}
