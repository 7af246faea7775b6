#!/usr/bin/env bash
# timeout: 300
# Worker keys are never on a command line, and no worker runs as root (issue 13), checked the
# way another user on the node would look: as the unprivileged $LAB_USER (gpuhublab) reading
# every /proc/PID/cmdline.
#   1. The lab's own agent and catalog: the first call to SmolLM2-135M-Instruct (llama.cpp's
#      server, the key in API_KEY) starts its Slurm worker job;
#      the worker's key (root reads it from the lab's store) is in no process's argv; the job
#      runs as gpuhub-worker and none of its processes is root.
#   2. A test agent (tests/lib/models.sh) with a secret variable in its own environment, a Slurm
#      worker and a local worker (key by environment): the same argv and uid checks; neither
#      worker inherited the agent's variable; the key is in no log line of the agent; the
#      workers dir and its keys/ are closed to other users.
#   3. A worker that fails: root (an admin) sees its last log lines in `gpuhub models`, the
#      unprivileged user does not; the caller gets the reason in one line, without the key.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
lab_user
WORKER_USER="$(worker_account)"
worker_uid="$(id -u "$WORKER_USER")"
CLI="$REPO/target/release/gpuhub"
fail() { echo "FAIL: $*" >&2; exit 1; }

# key_in_argv KEY: the pids whose command line holds KEY, as the unprivileged user sees /proc
# (the key goes in on stdin: on the scanner's own command line it would find itself).
key_in_argv() {
    runuser -u "$LAB_USER" -- python3 -c '
import os, sys
key = sys.stdin.readline().strip().encode()
seen = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cmd = open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        continue
    seen += 1
    if key in cmd:
        print(pid, cmd.replace(b"\0", b" ").decode(errors="replace")[:200])
if seen < 20:
    print(f"only {seen} processes readable: /proc is mounted hidepid?", file=sys.stderr)
    sys.exit(2)
' <<<"$1"
}

# check_job JOB: every process of Slurm job JOB (but slurmstepd) runs as the worker account.
check_job() {
    local job="$1" p n=0 uid comm owner status
    owner="$(squeue -h -j "$job" -o %u)"
    [ "$owner" = "$WORKER_USER" ] || fail "Slurm job $job runs as '$owner', expected $WORKER_USER"
    for p in $(scontrol listpids "$job" 2>/dev/null | awk 'NR > 1 {print $1}'); do
        # A process of the job may exit between listpids and this read (a llama.cpp helper,
        # srun's own): read its status once, and skip it when it is gone.
        status="$(cat "/proc/$p/status" 2>/dev/null)" || continue
        [ -n "$status" ] || continue
        comm="$(awk '/^Name:/ {print $2}' <<<"$status")"
        [ "$comm" = slurmstepd ] && continue
        uid="$(awk '/^Uid:/ {print $3}' <<<"$status")"
        [ "$uid" = "$worker_uid" ] || fail "process $p ($comm) of worker job $job runs as uid $uid, not $WORKER_USER ($worker_uid)"
        n=$((n + 1))
    done
    [ "$n" -ge 2 ] || fail "found only $n processes in job $job (scontrol listpids $job)"
    echo "   ok: job $job runs as $WORKER_USER ($n processes, none root)"
}

MODEL=SmolLM2-135M-Instruct   # the lab's chat model (tests/lab/agent.toml)
echo "== 1. the lab agent's $MODEL (Slurm worker, llama.cpp's server)"
agent_healthy || fail "the lab agent does not answer on 127.0.0.1:8400 (tests/lab/up.sh)"
created="$("$CLI" keys create --user root --app security-test --json)"
LAB_KEY="$(jq -r .key <<<"$created")"
[ -n "$LAB_KEY" ] && [ "$LAB_KEY" != null ] || fail "cannot create an API key through the lab agent: $created"
lab_cleanup_add "'$CLI' keys revoke '$(jq -r .id <<<"$created")' >/dev/null 2>&1 || true"
body="{\"model\":\"$MODEL\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"hello\"}]}"
out="$(curl -s --max-time 90 -w '\n%{http_code}' -H "Authorization: Bearer $LAB_KEY" -H 'content-type: application/json' \
    -d "$body" http://127.0.0.1:8400/v1/chat/completions || true)"
[ "$(tail -n1 <<<"$out")" = 200 ] || fail "$MODEL: expected 200, got: $out"
# The lab agent's store, as its configuration says (SQLite under the lab's state dir).
lab_db="$(env -u GPUHUB_STORE_URL "$REPO/target/release/gpuhub-agent" check-config --config "$LAB_AGENT_CONFIG" | sed -n 's|^url = "sqlite://\(.*\)"$|\1|p' | head -n1)"
[ -f "$lab_db" ] || fail "cannot find the lab agent's SQLite store (check-config --config $LAB_AGENT_CONFIG gives '$lab_db')"
row="$(sqlite3 -separator ' ' "$lab_db" "SELECT instance_id, api_key FROM model_workers WHERE model = '$MODEL'")"
read -r job key <<<"$row"
[ -n "${key:-}" ] || fail "the lab store remembers no worker for $MODEL"
hits="$(key_in_argv "$key")" || fail "cannot scan /proc as $LAB_USER"
[ -z "$hits" ] || fail "the worker key of $MODEL is on a command line other users read:
$hits"
echo "   ok: the worker key is in no process's argv ($(ls /proc | grep -c '^[0-9]') processes)"
check_job "$job"
"$CLI" models unload "$MODEL" >/dev/null || true

echo "== 2. a test agent: Slurm and local workers, the agent's environment, logs, the workers dir"
MT_AGENT_ENV="GPUHUB_AGENT_ONLY_SECRET=must-not-reach-workers"
models_setup "
[[models]]
name = \"sec-slurm\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 120
load_timeout_s = 60

[[models]]
name = \"sec-local\"
launcher = \"local\"
command = \"@WORKER@ --model {model} --host {host} --port {port}\"
api_key_env = \"GPUHUB_TEST_WORKER_API_KEY\"
idle_timeout_s = 120
load_timeout_s = 30

[[models]]
name = \"sec-broken\"
launcher = \"local\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file} --exit-at-start 3\"
load_timeout_s = 30
"
for m in sec-slurm sec-local; do
    models_call "$m" "hello $m"
    [ "$MC_STATUS" = 200 ] || models_fail "$m: expected 200, got $MC_STATUS: $MC_BODY"
done
keys="$(sqlite3 "$MT_DIR/state/gpuhub.db" "SELECT model || ' ' || instance_id || ' ' || api_key FROM model_workers ORDER BY model")"
[ "$(wc -l <<<"$keys")" = 2 ] || models_fail "expected two remembered workers, the store has: $keys"
while read -r m id key; do
    hits="$(key_in_argv "$key")"
    [ -z "$hits" ] || models_fail "the worker key of $m is on a command line:
$hits"
    grep -qF "$key" "$MT_DIR/agent.log" && models_fail "the agent's log holds the worker key of $m"
    if [ "$m" = sec-slurm ]; then
        check_job "$id"
        pids="$(scontrol listpids "$id" | awk 'NR > 1 {print $1}')"
    else
        pids="$id"
        uid="$(awk '/^Uid:/ {print $3}' "/proc/$id/status")"
        [ "$uid" = "$worker_uid" ] || models_fail "the local worker $id runs as uid $uid, not $WORKER_USER"
        echo "   ok: local worker $id runs as $WORKER_USER"
    fi
    found=0
    for p in $pids; do
        grep -qa gpuhub-test-worker "/proc/$p/cmdline" 2>/dev/null || continue
        found=1
        env_of="$(tr '\0' '\n' < "/proc/$p/environ")"
        grep -q '^GPUHUB_AGENT_ONLY_SECRET=' <<<"$env_of" && models_fail "worker $p of $m inherited the agent's environment"
        grep -qx 'PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' <<<"$env_of" ||
            models_fail "worker $p of $m has PATH=$(grep '^PATH=' <<<"$env_of"), not the workers' own"
    done
    [ "$found" = 1 ] || models_fail "no gpuhub-test-worker process found for $m (pids: $pids)"
    echo "   ok: $m: no key in argv or in the agent's log, none of the agent's environment"
done <<<"$keys"
if runuser -u "$LAB_USER" -- ls "$MT_DIR/workers" >/dev/null 2>&1; then models_fail "$LAB_USER can list the workers dir"; fi
if runuser -u "$LAB_USER" -- ls "$MT_DIR/workers/keys" >/dev/null 2>&1; then models_fail "$LAB_USER can list the key files"; fi
stat -c '%a %U:%G' "$MT_DIR/workers" | grep -qx "770 root:$(id -gn "$WORKER_USER")" ||
    models_fail "workers dir is $(stat -c '%a %U:%G' "$MT_DIR/workers"), expected 770 root:$(id -gn "$WORKER_USER")"
echo "   ok: the workers dir is 770 root:$(id -gn "$WORKER_USER"), closed to $LAB_USER"

echo "== 3. a failed worker: the caller gets one line, the log lines are for admins"
models_call sec-broken "hello"
[ "$MC_STATUS" = 503 ] || models_fail "sec-broken: expected 503, got $MC_STATUS: $MC_BODY"
msg="$(jq -r .error.message <<<"$MC_BODY")"
grep -q 'cannot load weights' <<<"$msg" && models_fail "the caller got the worker's log lines: $msg"
[ "$(wc -l <<<"$msg")" = 1 ] || models_fail "the caller's reason is not one line: $msg"
"$MT_CLI" --socket "$MT_DIR/run/agent.sock" models list --json | jq -e '.models[] | select(.name == "sec-broken") | .log_tail | map(select(test("cannot load weights"))) | length > 0' >/dev/null ||
    models_fail "root (an admin) does not see sec-broken's log lines"
as_user="$(runuser -u "$LAB_USER" -- "$MT_CLI" --socket "$MT_DIR/run/agent.sock" models list --json)"
jq -e '.models[] | select(.name == "sec-broken") | .log_tail | length == 0' <<<"$as_user" >/dev/null ||
    models_fail "$LAB_USER sees the worker's log lines: $(jq -c '.models[] | select(.name == "sec-broken") | .log_tail' <<<"$as_user")"
runuser -u "$LAB_USER" -- "$MT_CLI" --socket "$MT_DIR/run/agent.sock" models list | grep -q 'shown to admins only' ||
    models_fail "gpuhub models does not tell $LAB_USER where the log lines went"
echo "   ok: caller: $msg"
for m in sec-slurm sec-local; do "$MT_CLI" --socket "$MT_DIR/run/agent.sock" models unload "$m" >/dev/null; done
echo "PASS security-worker-argv"
