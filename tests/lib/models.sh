# Helpers for the model-worker system tests (tests/system/models-*.sh). Source after lab.sh.
# Each test runs its OWN agent (ports 18401/19411, state under a temp dir, workers named
# gpuhub-worker-mt-*), so it never disturbs the lab's agent or other tests; it cancels only
# the Slurm jobs its own workers dir owns.
#
#   models_setup MODELS_TOML [EXTRA_TOML]   write the config, start the agent, create an API key
#                                           (MT_AGENT_ENV="K=V ...": extra environment for the agent)
#                                           ($MT_GATEWAY_EXTRA: more keys of its [gateway] table)
#   models_agent_start / models_agent_kill9  (re)start the test agent / kill -9 it
#   models_call MODEL [CONTENT]             one chat call; sets MC_STATUS and MC_BODY
#   models_state MODEL                      the model's state from `gpuhub models --json`
#   models_field MODEL FIELD                any field of that model's status
#   models_jobs NAME                        ids of pending/running jobs named gpuhub-worker-NAME
#   models_wait_state MODEL STATE SECS      wait until the state is STATE, or fail
#   models_fail MSG                         print MSG, the agent log tail, exit 1

MT_REPO="${MT_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
MT_AGENT="$MT_REPO/target/release/gpuhub-agent"
MT_CLI="$MT_REPO/target/release/gpuhub"
# The worker under test: the repo's build (the lab installs the same binary under /usr/local/libexec).
MT_WORKER="$MT_REPO/target/release/gpuhub-test-worker"
[ -x "$MT_WORKER" ] || MT_WORKER=/usr/local/libexec/gpuhub/gpuhub-test-worker
MT_GW=127.0.0.1:18401
MT_METRICS=127.0.0.1:19411

models_fail() {
    echo "FAIL: $*" >&2
    [ -f "${MT_DIR:-/nonexistent}/agent.log" ] && { echo "--- last lines of $MT_DIR/agent.log" >&2; tail -n 30 "$MT_DIR/agent.log" >&2; }
    squeue -h -o '%i %j %T %r' 2>/dev/null | grep gpuhub-worker-mt- >&2 || true
    exit 1
}

models_cleanup() {
    [ -n "${MT_DIR:-}" ] || return 0
    [ -s "$MT_DIR/agent.pid" ] && kill "$(cat "$MT_DIR/agent.pid")" 2>/dev/null || true
    sleep 0.5
    [ -s "$MT_DIR/agent.pid" ] && kill -9 "$(cat "$MT_DIR/agent.pid")" 2>/dev/null || true
    # Cancel only the jobs this test's workers dir owns (their comment names it).
    local ids
    ids="$(squeue -h -o '%i|%k' 2>/dev/null | awk -F'|' -v c=":$MT_DIR/workers" 'index($2, "gpuhub-worker:") == 1 && substr($2, length($2) - length(c) + 1) == c {print $1}')"
    [ -n "$ids" ] && scancel $ids 2>/dev/null || true
    # Local workers outlive their agent (a restarted agent adopts them): stop this test's, the
    # processes whose working directory is its workers dir.
    local p
    for p in /proc/[0-9]*; do
        case "$(readlink "$p/cwd" 2>/dev/null)" in "$MT_DIR"/*) kill "${p#/proc/}" 2>/dev/null || true ;; esac
    done
    [ "${GPUHUB_TEST_KEEP:-0}" = 1 ] || rm -rf "$MT_DIR"
}

models_agent_start() {
    # shellcheck disable=SC2086 # MT_AGENT_ENV is a list of K=V words
    env ${MT_AGENT_ENV:-} "$MT_AGENT" --config "$MT_DIR/agent.toml" run >>"$MT_DIR/agent.log" 2>&1 &
    echo $! > "$MT_DIR/agent.pid"
    local i
    for ((i = 0; i < 150; i++)); do
        curl -sf --max-time 1 "http://$MT_GW/healthz" >/dev/null 2>&1 && return 0
        kill -0 "$(cat "$MT_DIR/agent.pid")" 2>/dev/null || models_fail "the test agent exited at start"
        sleep 0.1
    done
    models_fail "the test agent did not answer /healthz within 15 s"
}

models_agent_kill9() {
    kill -9 "$(cat "$MT_DIR/agent.pid")"
    local i
    for ((i = 0; i < 50; i++)); do kill -0 "$(cat "$MT_DIR/agent.pid")" 2>/dev/null || return 0; sleep 0.1; done
}

models_setup() {
    MT_DIR="$(mktemp -d /var/tmp/gpuhub-models-test.XXXXXX)"
    lab_cleanup_add models_cleanup
    # Workers run as the worker account: it must reach the workers dir (the agent makes that
    # root:gpuhub-worker 0770) through the test dir, which stays unlistable.
    chmod 711 "$MT_DIR"
    worker_account >/dev/null
    mkdir -p "$MT_DIR/workers"
    cat > "$MT_DIR/agent.toml" <<TOML
[paths]
state_dir = "$MT_DIR/state"
runtime_dir = "$MT_DIR/run"
spool_dir = "$MT_DIR/spool"
[gateway]
listen = "$MT_GW"
${MT_GATEWAY_EXTRA:-}
[metrics]
listen = "$MT_METRICS"
[workers]
dir = "$MT_DIR/workers"
backoff_s = 2
${2:-}
$1
TOML
    sed -i "s|@WORKER@|$MT_WORKER|g" "$MT_DIR/agent.toml"
    models_agent_start
    MT_KEY="$("$MT_CLI" --socket "$MT_DIR/run/agent.sock" keys create --user root --app models-test --json | jq -r .key)"
    [ -n "$MT_KEY" ] && [ "$MT_KEY" != null ] || models_fail "cannot create an API key through the test agent"
}

models_call() {
    local body
    body="$(jq -nc --arg m "$1" --arg c "${2:-hello}" '{model: $m, messages: [{role: "user", content: $c}]}')"
    MC_BODY="$(curl -s --max-time "${MC_TIMEOUT:-90}" -o - -w '\n%{http_code}' -H "Authorization: Bearer $MT_KEY" \
        -H 'content-type: application/json' -d "$body" "http://$MT_GW/v1/chat/completions" || true)"
    MC_STATUS="$(printf '%s' "$MC_BODY" | tail -n1)"
    MC_BODY="$(printf '%s' "$MC_BODY" | sed '$d')"
}

models_field() {
    "$MT_CLI" --socket "$MT_DIR/run/agent.sock" models list --json | jq -r --arg m "$1" --arg f "$2" '.models[] | select(.name == $m) | .[$f] // ""'
}

models_state() { models_field "$1" state; }

models_jobs() {
    squeue -h -n "gpuhub-worker-$1" -o '%i|%k' 2>/dev/null | awk -F'|' -v c=":$MT_DIR/workers" 'index($2, "gpuhub-worker:") == 1 && substr($2, length($2) - length(c) + 1) == c {print $1}'
}

models_wait_state() {
    local i s=""
    for ((i = 0; i < $3 * 10; i++)); do
        s="$(models_state "$1")"
        [ "$s" = "$2" ] && return 0
        sleep 0.1
    done
    models_fail "model $1 is '$s', expected '$2' within $3 s"
}
