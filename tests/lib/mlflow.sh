# A real MLflow tracking server for tests, from the repo's venv (tests/setup/deps.sh).
# Source it, then:
#   mlflow_start [PORT]   start `mlflow server` on 127.0.0.1:PORT (default 5000, the lab agent's
#                         tracking URI); waits up to 120 s. A port that is already taken is an
#                         error: on a shared node anyone can listen there, so a test never
#                         talks to a server it did not start.
#   mlflow_stop [PORT]    stop the server this helper started (pid file), if any; a test that
#                         starts one stops it at exit (lab_cleanup_add "mlflow_stop PORT")
#   MLFLOW_URL            http://127.0.0.1:PORT after mlflow_start
#   MLFLOW_SERVE_ARTIFACTS=1 mlflow_start PORT: the server stores artifacts and serves them
#                         (runs' artifact URIs are `mlflow-artifacts:/...`, uploaded and
#                         downloaded through its REST API), instead of clients writing to a
#                         local artifact root directly (`file:` URIs)
# State (SQLite store, artifacts, log) lives in /var/tmp/gpuhub-mlflow-PORT; loopback only,
# because MLflow has no authentication.

MLFLOW_REPO="${MLFLOW_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
MLFLOW_BIN="$MLFLOW_REPO/.venv/bin/mlflow"

mlflow_start() {
    local port="${1:-5000}" dir i pid
    MLFLOW_URL="http://127.0.0.1:$port"
    dir="/var/tmp/gpuhub-mlflow-$port"
    if ss -Hltn "sport = :$port" | grep -q .; then
        echo "[mlflow] 127.0.0.1:$port is already taken ($(ss -Hltnp "sport = :$port" | awk '{print $NF}' | head -n1)); stop it or pick another port" >&2
        return 1
    fi
    [ -x "$MLFLOW_BIN" ] || { echo "[mlflow] $MLFLOW_BIN missing: run tests/setup/deps.sh" >&2; return 1; }
    mkdir -p "$dir/artifacts"
    echo "[mlflow] starting mlflow server on $MLFLOW_URL (log $dir/server.log)"
    # --workers 1: the default spawns several gunicorn/uvicorn workers (~1.5 GB) on a 2-core box.
    local artifacts=(--default-artifact-root "$dir/artifacts")
    [ "${MLFLOW_SERVE_ARTIFACTS:-0}" = 1 ] && artifacts=(--serve-artifacts --artifacts-destination "$dir/artifacts")
    # No job execution (MLflow's GenAI evaluation jobs, which gpuhub does not use): it starts a
    # huey consumer beside the server and leaves a store directory in /dev/shm at every start.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$MLFLOW_BIN" server --host 127.0.0.1 --port "$port" --workers 1 \
        --backend-store-uri "sqlite:///$dir/mlflow.db" "${artifacts[@]}" \
        >>"$dir/server.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" > "$dir/server.pid"
    for ((i = 0; i < 480; i++)); do
        curl -sf --max-time 2 "$MLFLOW_URL/health" >/dev/null 2>&1 && return 0
        kill -0 "$pid" 2>/dev/null || { echo "[mlflow] server exited; log:" >&2; tail -n 20 "$dir/server.log" >&2; return 1; }
        sleep 0.25
    done
    echo "[mlflow] not ready after 120 s; log:" >&2
    tail -n 20 "$dir/server.log" >&2
    return 1
}

mlflow_stop() {
    local port="${1:-5000}" f pid i
    f="/var/tmp/gpuhub-mlflow-$port/server.pid"
    [ -s "$f" ] || return 0
    pid="$(cat "$f")"
    # The server is a process group (gunicorn/uvicorn children): stop the group we started.
    kill -- -"$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$f"
}
