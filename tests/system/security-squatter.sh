#!/usr/bin/env bash
# timeout: 300
# A process of another user on a worker's port is never taken for the worker (issue 13).
# A test agent (tests/lib/models.sh) serves `sq-chat`, a Slurm worker whose server takes 60 s to
# bind its port. The lab's GPUs are held by another job first, so the worker job pends:
#   1. while it pends there is no port to squat: the job has written no address file (the port
#      is picked when the job starts, not at submission);
#   2. the blocker ends, the job starts and writes `<model>.<job>.addr`; the unprivileged
#      $LAB_USER (gpuhublab) binds that port first with a server that answers 200 to everything
#      (the window between the job's pick and the worker's bind);
#   3. the model is never `ready`, the squatter gets no call with a prompt (only the agent's
#      keyed probe of the health path), and the caller gets a 503 that says the port is held by
#      another user's process and names its uid.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
lab_user
squatter_uid="$(id -u "$LAB_USER")"

lab_wait_gpus_free 240
blocker="$(cd /tmp && runuser -u "$LAB_USER" -- sbatch --parsable -J gpuhub-test-blocker --gres=gpu:2 -t 5 --wrap 'sleep 300')"
lab_cleanup_add "lab_cancel $blocker"
for ((i = 0; i < 100; i++)); do [ "$(squeue -h -j "$blocker" -o %T)" = RUNNING ] && break; sleep 0.2; done
[ "$(squeue -h -j "$blocker" -o %T)" = RUNNING ] || lab_fail "the blocker job $blocker does not run: $(squeue -h -j "$blocker" -o '%T %r')"

models_setup "
[[models]]
name = \"sq-chat\"
launcher = \"slurm\"
command = \"sleep 60 && exec @WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { gpus = 1, vram_gib = 1.0 }
idle_timeout_s = 60
load_timeout_s = 90
"
states="$MT_DIR/states"
( while :; do models_state sq-chat >> "$states" 2>/dev/null; sleep 0.1; done ) &
watcher=$!
lab_cleanup_add "kill $watcher 2>/dev/null || true"
( MC_TIMEOUT=120 models_call sq-chat "my secret prompt"; printf '%s\n%s\n' "$MC_STATUS" "$MC_BODY" > "$MT_DIR/first-call" ) &
caller=$!
lab_cleanup_add "kill $caller 2>/dev/null || true"

echo "== 1. the worker job pends: no port, nothing to squat"
for ((i = 0; i < 200; i++)); do job="$(models_jobs sq-chat)"; [ -n "$job" ] && break; sleep 0.1; done
[ -n "$job" ] || models_fail "no worker job for sq-chat"
for ((i = 0; i < 50; i++)); do [ "$(squeue -h -j "$job" -o %T)" = PENDING ] && break; sleep 0.1; done
[ "$(squeue -h -j "$job" -o %T)" = PENDING ] || models_fail "worker job $job should pend behind the blocker, is $(squeue -h -j "$job" -o '%T %r')"
sleep 2
addr="$MT_DIR/workers/sq-chat.$job.addr"
[ ! -e "$addr" ] || models_fail "the pending job $job already has an address ($(cat "$addr")): a port picked before the job runs can be taken by anyone"
echo "   ok: job $job pends ($(squeue -h -j "$job" -o %r)) with no port picked"

echo "== 2. the job starts; $LAB_USER squats the port it picked before the worker binds it"
lab_cancel "$blocker"
for ((i = 0; i < 300; i++)); do [ -s "$addr" ] && break; sleep 0.05; done
[ -s "$addr" ] || models_fail "job $job wrote no address file $addr"
read -r host port jobid < "$addr"
[ "$jobid" = "$job" ] || models_fail "$addr names job $jobid, not $job"
# A copy the lab user can read whatever the checkout's permissions.
install -m 644 "$REPO/tests/lib/squat.py" "$MT_DIR/squat.py"
touch "$MT_DIR/squat.log" && chown "$LAB_USER" "$MT_DIR/squat.log"
runuser -u "$LAB_USER" -- python3 "$MT_DIR/squat.py" "$port" "$MT_DIR/squat.log" &
squatter=$!
lab_cleanup_add "kill $squatter 2>/dev/null || true"
for ((i = 0; i < 100; i++)); do curl -s -o /dev/null --max-time 1 "http://127.0.0.1:$port/" && break; sleep 0.05; done
echo "   $LAB_USER (uid $squatter_uid) listens on $host:$port, the port job $job picked"

echo "== 3. the model is never ready; the caller is told why"
wait "$caller" || true
kill "$watcher" 2>/dev/null || true
[ -s "$MT_DIR/first-call" ] || models_fail "the first call never returned"
status="$(head -n1 "$MT_DIR/first-call")"
body="$(sed 1d "$MT_DIR/first-call")"
if grep -qx ready "$states"; then models_fail "sq-chat was marked ready with $LAB_USER's process on its port"; fi
grep -q 'my secret prompt' "$MT_DIR/squat.log" && models_fail "the squatter received the caller's prompt: $(cat "$MT_DIR/squat.log")"
[ "$status" = 503 ] || models_fail "the call to sq-chat: expected 503, got $status: $body"
msg="$(jq -r .error.message <<<"$body")"
grep -q "held by another user's process (uid $squatter_uid" <<<"$msg" || models_fail "the caller is not told what happened: $msg"
detail="$(models_field sq-chat detail)"
grep -q "uid $squatter_uid" <<<"$detail" || models_fail "gpuhub models does not say it either: $detail"
echo "   ok: states seen: $(sort -u "$states" | tr '\n' ' '); the squatter saw: $(cut -c1-60 "$MT_DIR/squat.log" | sort -u | tr '\n' ';')"
echo "   ok: caller: $msg"
echo "PASS security-squatter"
