# Shared helpers for the lab (tests/lab/up.sh, down.sh) and the system tests
# (tests/system/*.sh). Source it; it defines functions and LAB_* variables only.
#
#   lab_require             exit 1 unless root and the lab is up (node idle/mixed, plugin installed)
#   lab_fail MSG...         print MSG, the last slurmd.log lines, exit 1
#   lab_run CMD...          run CMD, print it with its output and exit status; sets LAB_OUT, LAB_RC
#   plugstack_set ARGS...   replace the gpuhub plugstack line's arguments (srun, slurmstepd and the
#                           prolog/epilog reread plugstack.conf for every job); plugstack_restore undoes it
#   lab_slurm_setup PLUGIN PROLOGFLAGS [KEY=VALUE...]   another Slurm setup for this test: the
#                           plugstack line's plugin (none|shipped|prolog), slurm.conf's PrologFlags
#                           and other slurm.conf keys replaced, Slurm restarted; the lab's setup
#                           comes back (and Slurm restarts) at exit
#   lab_restart_slurm       restart slurmctld and slurmd (no job may run), wait for the node
#   lab_cleanup_add CMD     run CMD at exit (in reverse order), with plugstack_restore always last
#   lab_records DIR JOB     the records of job JOB under DIR/records, one JSON object per line
#   lab_wait_record DIR JOB KIND [SECS]   wait until a record of KIND exists (default 20 s)
#   lab_jq_any FILTER       true if FILTER yields `true` for any JSON line on stdin
#   lab_wait_job JOB [SECS] / lab_cancel JOB...   wait until a job left the queue / scancel and wait
#   lab_node_ok             fail if the node is drained or down
#   lab_wait_gpus_free [SECS]   wait until no job holds GPUs/shards (e.g. idle model workers)
#   lab_user                create the unprivileged account $LAB_USER (gpuhublab) if missing
#   spank_fixture [MLFLOW_URL] [ARGS...]   private spool/snapshot/key for SPANK tests (see below)
#   agent_start [SECS] / agent_stop / agent_running / agent_healthy   the lab's gpuhub-agent

LAB_REPO="${LAB_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
LAB_NODE=gpu01
LAB_AGENT_PID=/run/gpuhub/agent.pid
LAB_AGENT_LOG=/var/log/gpuhub/agent.log
LAB_AGENT_BIN="$LAB_REPO/target/release/gpuhub-agent"
LAB_AGENT_CONFIG="${GPUHUB_LAB_AGENT_CONFIG:-$LAB_REPO/tests/lab/agent.toml}"
export PATH="$PATH:/usr/sbin:/sbin"

# The lab's Slurm (GPUHUB_LAB_SLURM): 22.05 (default: Debian 12's packages, tests/lab/up.sh) or
# 24.11 (Debian 13's, from the root tests/lab/slurm24.sh runs on this host). Each test uses only
# these LAB_* paths and the functions below, so it runs unchanged on either leg:
#   LAB_SLURM          22.05 or 24.11
#   LAB_SLURM_CONF     the slurm.conf the daemons read (SLURM_CONF on the 24.11 leg)
#   LAB_PLUGSTACK      the gpuhub plugstack line's file
#   LAB_PLUGIN_DIR     Slurm's PluginDir, where the plugin is installed (lab_plugin_path)
#   LAB_SLURMD_LOG, LAB_SLURMDBD_LOG, LAB_SLURMCTLD_PID, LAB_SLURMD_PID, LAB_SLURMDBD_PID
# On the 24.11 leg the leg's client wrappers (/run/gpuhub-lab24/bin: srun, sbatch, squeue, sacct,
# ...) come first on PATH and SLURM_CONF is exported, for the tests, their jobs and the agent.
LAB_SLURM="${GPUHUB_LAB_SLURM:-22.05}"
case "$LAB_SLURM" in
    22.05)
        LAB_SLURM_CONF=/etc/slurm/slurm.conf
        LAB_PLUGSTACK=/etc/slurm/plugstack.conf.d/gpuhub.conf
        LAB_PLUGIN_DIR=/usr/lib/x86_64-linux-gnu/slurm-wlm
        for _d in /usr/lib/x86_64-linux-gnu/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
            if [ -d "$_d" ]; then LAB_PLUGIN_DIR="$_d"; break; fi
        done
        LAB_SLURMD_LOG=/var/log/slurm/slurmd.log
        LAB_SLURMDBD_LOG=/var/log/slurm/slurmdbd.log
        LAB_SLURMCTLD_PID=/run/slurmctld.pid
        LAB_SLURMD_PID=/run/slurmd.pid
        LAB_SLURMDBD_PID=/run/slurmdbd.pid ;;
    24.11)
        LAB24_ROOT="${GPUHUB_SLURM24_ROOT:-/var/lib/gpuhub-lab/slurm24-root}"
        LAB24_DIR=/run/gpuhub-lab24
        LAB24_BIN="$LAB24_DIR/bin"
        LAB24_SBIN="$LAB24_DIR/sbin"
        LAB24_LIBS="$LAB24_ROOT/usr/lib/x86_64-linux-gnu/slurm-wlm:$LAB24_ROOT/usr/lib/x86_64-linux-gnu"
        LAB_SLURM_CONF="$LAB24_ROOT/etc/slurm/slurm.conf"
        LAB_PLUGSTACK="$LAB24_ROOT/etc/slurm/plugstack.conf.d/gpuhub.conf"
        LAB_PLUGIN_DIR="$LAB24_ROOT/usr/lib/x86_64-linux-gnu/slurm-wlm"
        LAB_SLURMD_LOG="$LAB24_ROOT/var/log/slurm/slurmd.log"
        LAB_SLURMDBD_LOG="$LAB24_ROOT/var/log/slurm/slurmdbd.log"
        LAB_SLURMCTLD_PID="$LAB24_ROOT/run/slurmctld.pid"
        LAB_SLURMD_PID="$LAB24_ROOT/run/slurmd.pid"
        LAB_SLURMDBD_PID="$LAB24_ROOT/run/slurmdbd.pid"
        case ":$PATH:" in *":$LAB24_BIN:"*) ;; *) PATH="$LAB24_BIN:$PATH" ;; esac
        export PATH SLURM_CONF="$LAB_SLURM_CONF" ;;
    *) echo "FAIL: GPUHUB_LAB_SLURM=$LAB_SLURM: the lab has Slurm 22.05 (default) and 24.11" >&2; exit 1 ;;
esac

# lab_plugin_path [prolog]: where the plugin is installed in the leg's PluginDir;
# `prolog`: the build with job hooks (spank_gpuhub_prolog.so) beside it.
lab_plugin_path() {
    if [ "${1:-}" = prolog ]; then echo "$LAB_PLUGIN_DIR/spank_gpuhub_prolog.so"; else echo "$LAB_PLUGIN_DIR/spank_gpuhub.so"; fi
}

# lab_pid_alive PIDFILE NAME: the pid in PIDFILE runs and is named NAME.
lab_pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    # The daemon may remove its pid file between the test and the read (it is stopping).
    pid="$(cat "$1" 2>/dev/null)" || return 1
    [ -d "/proc/$pid" ] && grep -qx "$2" "/proc/$pid/comm" 2>/dev/null
}

# lab_start_slurm: start the leg's slurmctld and slurmd -N gpu01 (not waiting for the node).
# 24.11: through the leg's wrappers (tests/lab/slurm24.sh).
lab_start_slurm() {
    if [ "$LAB_SLURM" = 22.05 ]; then
        slurmctld && slurmd -N "$LAB_NODE"
    else
        "$LAB24_SBIN/slurmctld" && "$LAB24_SBIN/slurmd" -N "$LAB_NODE"
    fi
}

# lab_stop_pidfile FILE: stop the daemon whose pid FILE holds (SIGKILL after 15 s), remove FILE.
lab_stop_pidfile() {
    local pid
    pid="$(cat "$1" 2>/dev/null)" || return 0
    if [ -n "$pid" ]; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 150); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
        [ -d "/proc/$pid" ] && kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$1"
}

# lab24_stop_daemons [NAME...]: stop the 24.11 leg's slurmd, slurmctld, slurmdbd, or only the
# daemons NAMEd (SIGKILL after 15 s).
lab24_stop_daemons() {
    local f n
    for f in "$LAB_SLURMD_PID:slurmd" "$LAB_SLURMCTLD_PID:slurmctld" "$LAB_SLURMDBD_PID:slurmdbd"; do
        n="${f##*:}"; f="${f%:*}"
        [ "$#" = 0 ] || [[ " $* " == *" $n "* ]] || continue
        lab_pid_alive "$f" "$n" || { rm -f "$f"; continue; }
        lab_stop_pidfile "$f"
    done
    return 0
}

lab_fail() {
    echo "FAIL: $*" >&2
    if [ -f "$LAB_SLURMD_LOG" ]; then
        echo "--- last lines of $LAB_SLURMD_LOG" >&2
        tail -n 25 "$LAB_SLURMD_LOG" >&2
    fi
    exit 1
}

lab_require() {
    [ "$(id -u)" -eq 0 ] || { echo "FAIL: run as root" >&2; exit 1; }
    local state="" i
    # `completing` (a job's epilog still running) and the `+`/`*` suffixes are transient: wait.
    for i in $(seq 40); do
        state="$(sinfo -h -n "$LAB_NODE" -o '%T' 2>/dev/null | head -n1 || true)"
        case "$state" in
            idle|mixed|allocated|planned|completing) break ;;
        esac
        sleep 0.5
    done
    case "$state" in
        idle|mixed|allocated|planned|completing) ;;
        *) echo "FAIL: the lab is not up (node $LAB_NODE is '${state:-unreachable}' for 20 s); run tests/lab/up.sh" >&2; exit 1 ;;
    esac
    [ -f "$LAB_PLUGSTACK" ] || { echo "FAIL: $LAB_PLUGSTACK missing; run tests/lab/up.sh" >&2; exit 1; }
}

lab_run() {
    echo "+ $*"
    set +e
    LAB_OUT="$("$@" 2>&1)"
    LAB_RC=$?
    set -e
    printf '%s\n' "$LAB_OUT" | sed 's/^/  | /'
    echo "  (exit $LAB_RC)"
}

_LAB_CLEANUP=()
_LAB_PLUGSTACK_SAVED=""
_lab_on_exit() {
    local rc=$? i
    for ((i = ${#_LAB_CLEANUP[@]} - 1; i >= 0; i--)); do eval "${_LAB_CLEANUP[$i]}" || true; done
    plugstack_restore
    return $rc
}
trap _lab_on_exit EXIT
lab_cleanup_add() { _LAB_CLEANUP+=("$1"); }

plugstack_set() {
    _plugstack_save
    local line
    line="$(grep -E '^(optional|required)[[:space:]]' "$LAB_PLUGSTACK" "$_LAB_PLUGSTACK_SAVED" 2>/dev/null | head -n1 | cut -d: -f2- | awk '{print $1, $2}')"
    [ -n "$line" ] || lab_fail "no plugin line in $LAB_PLUGSTACK"
    printf '# temporary (tests/system): %s\n%s %s\n' "$0" "$line" "$*" > "$LAB_PLUGSTACK.tmp.$$"
    mv -f "$LAB_PLUGSTACK.tmp.$$" "$LAB_PLUGSTACK"
    echo "+ plugstack: $line $*"
}

_plugstack_save() {
    if [ -z "$_LAB_PLUGSTACK_SAVED" ]; then
        _LAB_PLUGSTACK_SAVED="$(mktemp /tmp/gpuhub-plugstack.XXXXXX)"
        cp -p "$LAB_PLUGSTACK" "$_LAB_PLUGSTACK_SAVED"
    fi
}

plugstack_restore() {
    if [ -n "$_LAB_PLUGSTACK_SAVED" ] && [ -f "$_LAB_PLUGSTACK_SAVED" ]; then
        mv -f "$_LAB_PLUGSTACK_SAVED" "$LAB_PLUGSTACK"
        _LAB_PLUGSTACK_SAVED=""
    fi
}

# lab_restart_slurm: restart slurmctld and slurmd (no job may run) and wait (30 s) until the
# node is idle. slurmd decides at start whether the loaded plugin has job prolog/epilog hooks.
lab_restart_slurm() {
    local i
    kill "$(cat "$LAB_SLURMD_PID" 2>/dev/null)" "$(cat "$LAB_SLURMCTLD_PID" 2>/dev/null)" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do lab_pid_alive "$LAB_SLURMD_PID" slurmd || lab_pid_alive "$LAB_SLURMCTLD_PID" slurmctld || break; sleep 0.1; done
    for ((i = 0; i < 150; i++)); do pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break; sleep 0.1; done
    lab_start_slurm || lab_fail "slurmctld/slurmd did not restart"
    for ((i = 0; i < 150; i++)); do sinfo -h -n "$LAB_NODE" -o %T 2>/dev/null | grep -qE '^(idle|mixed)$' && return 0; sleep 0.2; done
    lab_fail "node $LAB_NODE not idle 30 s after restarting Slurm"
}

# lab_slurm_setup PLUGIN PROLOGFLAGS [KEY=VALUE...]: PLUGIN is `none` (no gpuhub plugstack
# line), `shipped` (spank_gpuhub.so) or `prolog` (spank_gpuhub_prolog.so, the build with job
# hooks), keeping the line's arguments; PROLOGFLAGS is slurm.conf's PrologFlags (empty: none);
# each KEY=VALUE replaces that slurm.conf key (e.g. ProctrackType=proctrack/cgroup). Restarts
# Slurm. At exit the lab's slurm.conf and plugstack come back and Slurm restarts once more.
_LAB_SLURM_CONF_SAVED=""
lab_slurm_setup() {
    local plugin="$1" flags="$2" conf="$LAB_SLURM_CONF" line path args kv
    shift 2
    _plugstack_save
    if [ -z "$_LAB_SLURM_CONF_SAVED" ]; then
        _LAB_SLURM_CONF_SAVED="$(mktemp /tmp/gpuhub-slurm-conf.XXXXXX)"
        cp -p "$conf" "$_LAB_SLURM_CONF_SAVED"
        lab_cleanup_add "plugstack_restore; cp -p '$_LAB_SLURM_CONF_SAVED' '$conf' && rm -f '$_LAB_SLURM_CONF_SAVED' && lab_restart_slurm"
    fi
    line="$(grep -E '^(optional|required)[[:space:]]' "$LAB_PLUGSTACK" "$_LAB_PLUGSTACK_SAVED" 2>/dev/null | head -n1 | cut -d: -f2-)"
    args="$(awk '{$1 = ""; $2 = ""; print}' <<<"$line" | sed 's/^ *//')"
    case "$plugin" in
        none) : > "$LAB_PLUGSTACK.tmp.$$" ;;
        shipped|prolog)
            if [ "$plugin" = prolog ]; then path="$(lab_plugin_path prolog)"; else path="$(lab_plugin_path)"; fi
            [ -f "$path" ] || lab_fail "$path missing; run tests/lab/up.sh"
            printf '# temporary (tests/system): %s\noptional %s %s\n' "$0" "$path" "$args" > "$LAB_PLUGSTACK.tmp.$$" ;;
        *) lab_fail "lab_slurm_setup: plugin must be none, shipped or prolog, not '$plugin'" ;;
    esac
    mv -f "$LAB_PLUGSTACK.tmp.$$" "$LAB_PLUGSTACK"
    grep -v '^PrologFlags=' "$_LAB_SLURM_CONF_SAVED" > "$conf.tmp.$$"
    [ -z "$flags" ] || echo "PrologFlags=$flags" >> "$conf.tmp.$$"
    for kv in "$@"; do
        grep -v "^${kv%%=*}=" "$conf.tmp.$$" > "$conf.tmp2.$$" || true
        echo "$kv" >> "$conf.tmp2.$$"
        mv -f "$conf.tmp2.$$" "$conf.tmp.$$"
    done
    mv -f "$conf.tmp.$$" "$conf"
    echo "+ Slurm setup: plugin $plugin${path:+ ($path)}, PrologFlags=${flags:-none}${*:+, $*}; restarting slurmctld and slurmd"
    lab_restart_slurm
}

lab_records() {
    local dir="$1" job="$2" f
    [ -d "$dir/records" ] || return 0
    for f in "$dir"/records/*.json; do
        [ -e "$f" ] || continue
        jq -c --argjson j "$job" 'select(.job_id == $j)' "$f" 2>/dev/null || true
    done
}

lab_wait_record() {
    local dir="$1" job="$2" kind="$3" secs="${4:-20}" i
    for ((i = 0; i <= secs * 5; i++)); do
        [ "$i" = 0 ] || sleep 0.2
        lab_records "$dir" "$job" | jq -c --arg k "$kind" 'select(.kind == $k)' 2>/dev/null | grep . >/dev/null && return 0
    done
    return 1
}

# lab_jq_any FILTER: true if FILTER yields `true` for any JSON line on stdin (jq -e only
# looks at the last input).
lab_jq_any() { jq -c "$@" 2>/dev/null | grep -x true >/dev/null; }

agent_running() {
    [ -s "$LAB_AGENT_PID" ] && kill -0 "$(cat "$LAB_AGENT_PID")" 2>/dev/null \
        && grep -q gpuhub "/proc/$(cat "$LAB_AGENT_PID")/comm" 2>/dev/null
}

agent_healthy() { curl -sf --max-time 2 http://127.0.0.1:8400/healthz >/dev/null 2>&1; }

agent_start() {
    local secs="${1:-60}" i pid
    if agent_running && agent_healthy; then return 0; fi
    [ -x "$LAB_AGENT_BIN" ] || { echo "[lab] $LAB_AGENT_BIN missing: cargo build --release" >&2; return 1; }
    [ -f "$LAB_AGENT_CONFIG" ] || { echo "[lab] $LAB_AGENT_CONFIG missing" >&2; return 1; }
    if ! agent_running; then
        mkdir -p "$(dirname "$LAB_AGENT_PID")" "$(dirname "$LAB_AGENT_LOG")"
        echo "[lab] starting gpuhub-agent --config $LAB_AGENT_CONFIG run (log $LAB_AGENT_LOG)"
        setsid "$LAB_AGENT_BIN" --config "$LAB_AGENT_CONFIG" run >>"$LAB_AGENT_LOG" 2>&1 </dev/null &
        echo $! > "$LAB_AGENT_PID"
    fi
    # Watch the pid itself, not agent_running: until the child has exec'd the agent its comm is
    # still the shell's, and a look at that moment would report a start that has not happened
    # yet as an exit (and show the previous agent's last log lines as the reason).
    pid="$(cat "$LAB_AGENT_PID")"
    for ((i = 0; i < secs * 4; i++)); do
        agent_healthy && return 0
        kill -0 "$pid" 2>/dev/null || { echo "[lab] gpuhub-agent exited; last log lines:" >&2; tail -n 20 "$LAB_AGENT_LOG" >&2; return 1; }
        sleep 0.25
    done
    echo "[lab] gpuhub-agent not healthy after ${secs}s; last log lines:" >&2
    tail -n 20 "$LAB_AGENT_LOG" >&2
    return 1
}

agent_stop() {
    agent_running || { rm -f "$LAB_AGENT_PID"; return 0; }
    local pid i
    pid="$(cat "$LAB_AGENT_PID")"
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "[lab] gpuhub-agent (pid $pid) ignored SIGTERM for 15 s; SIGKILL" >&2; kill -9 "$pid" 2>/dev/null || true; }
    rm -f "$LAB_AGENT_PID"
}

# ---------------------------------------------------------------- SPANK test fixtures
# spank_fixture: a private spool, snapshot and job key under a fresh temp dir, and the plugstack
# line pointed at them (restored at exit). Sets T (the dir), T_SPOOL, T_SNAP, T_KEY, T_MAP.
# The snapshot names two GPUs with UUIDs, role ocr=dots.ocr, role tts with no model, and
# MLflow at $1 (default http://127.0.0.1:5000). Extra plugstack arguments follow.
spank_fixture() {
    local mlflow="${1:-http://127.0.0.1:5000}"
    shift || true
    T="$(mktemp -d /tmp/gpuhub-spank-test.XXXXXX)"
    chmod 755 "$T"
    lab_cleanup_add "rm -rf '$T' 2>/dev/null || { sleep 1; rm -rf '$T'; }"
    T_SPOOL="$T/spool"
    T_SNAP="$T/snapshot.json"
    T_KEY="$T/job-token.key"
    T_MAP="$T/dcgm-job-map"
    mkdir -p "$T_SPOOL"
    cat > "$T_SNAP" <<JSON
{"version":1,"generated_at":1,"gateway_url":"http://127.0.0.1:8400","mlflow_tracking_uri":"$mlflow",
 "mlflow_experiment":"lab-default","roles":{"ocr":"dots.ocr","tts":null},
 "gpus":{"0":"GPU-00000000-test-0000-0000-000000000000","1":"GPU-11111111-test-1111-1111-111111111111"}}
JSON
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$T_KEY"
    chmod 600 "$T_KEY"
    plugstack_set "spool_dir=$T_SPOOL" "snapshot=$T_SNAP" "job_key=$T_KEY" "dcgm_job_map_dir=$T_MAP" "$@"
    lab_wait_gpus_free 240
}

# lab_user: make sure the unprivileged lab account exists (jobs as a real user).
. "$LAB_REPO/tests/lib/prereq.sh"
LAB_USER=gpuhublab
lab_user() { unprivileged_user >/dev/null; }

# lab_wait_gpus_free [SECS]: wait (default 240 s) until no job holds or waits for GPUs or
# shards, e.g. model workers the agent started in an earlier test (they stay up to their
# idle_timeout_s). Tests that request --gres=gpu:N need whole GPUs without shard users.
# Workers of the lab's agent are unloaded through it (`gpuhub models unload`: they drain and
# their jobs end) instead of waiting out their idle timeout; other jobs are waited for.
lab_wait_gpus_free() {
    local secs="${1:-240}" i busy="" model
    for ((i = 0; i <= secs * 2; i++)); do
        busy="$(squeue -h -t PD,R,CG,S -o '%i %u %j %b' 2>/dev/null | grep -E 'gpu|shard' || true)"
        [ -z "$busy" ] && return 0
        if [ "$i" = 0 ]; then
            echo "  waiting up to ${secs}s for GPU jobs to end:"; sed 's/^/    /' <<<"$busy"
            for model in $(awk '$3 ~ /^gpuhub-worker-/ {sub(/^gpuhub-worker-/, "", $3); print $3}' <<<"$busy" | sort -u); do
                [ -S /run/gpuhub/agent.sock ] || break
                echo "    unloading the lab agent's worker of $model: $("$LAB_REPO/target/release/gpuhub" --socket /run/gpuhub/agent.sock models unload "$model" 2>&1 | head -n1)"
            done
        fi
        sleep 0.5
    done
    lab_fail "GPUs still held after ${secs}s by: $busy"
}

# lab_node_ok: the node is not drained or down (a plugin fault must never drain it).
lab_node_ok() {
    local st
    st="$(sinfo -h -n "$LAB_NODE" -o '%T' 2>/dev/null | head -n1)"
    case "$st" in
        *drain*|down*|fail*) lab_fail "node $LAB_NODE is '$st' (reason: $(sinfo -h -n "$LAB_NODE" -o '%E'))" ;;
    esac
}

# lab_cancel JOB...: scancel and wait (30 s) until each left the queue, so that its epilog
# has finished with the test's plugstack line (use in lab_cleanup_add).
lab_cancel() {
    local j
    scancel "$@" 2>/dev/null || true
    for j in "$@"; do lab_wait_job "$j" 30 || true; done
}

# lab_wait_job JOB [SECS]: wait until the job left the queue (default 60 s).
lab_wait_job() {
    local job="$1" secs="${2:-60}" i
    for ((i = 0; i < secs * 5; i++)); do
        [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && return 0
        sleep 0.2
    done
    return 1
}
