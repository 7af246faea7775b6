#!/usr/bin/env bash
# timeout: 240
# A worker's port taken over after the worker is gone gets no call (the one-time proof at start
# says nothing then). A test agent (tests/lib/models.sh) serves `tk-chat`, a Slurm worker whose
# job outlives its server (`...; sleep 300`: a wrapper that keeps running after its server
# crashed, so neither the job's end nor a replica probe tells the agent):
#   1. a call loads it and is answered (200), over a kept-alive connection;
#   2. its server is killed (SIGKILL) and the unprivileged $LAB_USER binds the freed port with a
#      server that answers 200 to everything and logs what it receives;
#   3. the next call gets a 502 that says the worker's port is no longer held by the worker and
#      nothing was sent; the squatter receives nothing (no prompt, no worker key); the agent
#      logs the uid it found there;
#   4. that failed call makes the agent check the port at once: not its worker's any more, so
#      it stops the job (no waiting for a job that would run on for minutes) and the next call
#      starts a new worker and is answered (200); the squatter still has received nothing.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
lab_user
squatter_uid="$(id -u "$LAB_USER")"

models_setup "
[[models]]
name = \"tk-chat\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}; sleep 300\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 120
load_timeout_s = 60
"

echo "== 1. tk-chat loads and answers"
MC_TIMEOUT=60 models_call tk-chat "hello"
[ "$MC_STATUS" = 200 ] || models_fail "the first call to tk-chat: expected 200, got $MC_STATUS: $MC_BODY"
url="$(models_field tk-chat replicas | jq -r '.[0].base_url')"
port="${url##*:}"
job="$(models_jobs tk-chat)"
pid="$(ss -Hltnp "sport = :$port" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1)"
[ -n "$pid" ] || models_fail "cannot find the worker's process listening at $url"
echo "   ok: job $job, server pid $pid at $url"

echo "== 2. the server dies (its job runs on); $LAB_USER binds its port"
# A copy the lab user can read whatever the checkout's permissions.
install -m 644 "$REPO/tests/lib/squat.py" "$MT_DIR/squat.py"
touch "$MT_DIR/squat.log" && chown "$LAB_USER" "$MT_DIR/squat.log"
kill -9 "$pid"
# listener_uid: the uid of what listens on the port now (none while the dead server's socket
# is torn down and before the squatter binds).
listener_uid() { ss -Hltne "sport = :$port" | sed -n 's/.*uid:\([0-9]*\).*/\1/p' | head -n1; }
squatter=""
for ((i = 0; i < 200; i++)); do
    if [ -z "$squatter" ] || ! kill -0 "$squatter" 2>/dev/null; then
        runuser -u "$LAB_USER" -- python3 "$MT_DIR/squat.py" "$port" "$MT_DIR/squat.log" 2>/dev/null &
        squatter=$!
        lab_cleanup_add "kill $squatter 2>/dev/null || true"
    fi
    [ "$(listener_uid)" = "$squatter_uid" ] && break
    sleep 0.05
done
owner="$(listener_uid)"
[ "$owner" = "$squatter_uid" ] || models_fail "$LAB_USER did not get port $port (its listener's uid: '${owner:-none}')"
[ "$(squeue -h -j "$job" -o %T)" = RUNNING ] || models_fail "worker job $job should still run (its wrapper sleeps): $(squeue -h -j "$job" -o '%T %r')"
echo "   $LAB_USER (uid $squatter_uid) listens on port $port; job $job still runs"

echo "== 3. the next call is refused; the squatter gets nothing"
models_call tk-chat "my secret prompt"
grep -q 'secret' "$MT_DIR/squat.log" && models_fail "the squatter received the caller's prompt: $(cat "$MT_DIR/squat.log")"
[ -s "$MT_DIR/squat.log" ] && models_fail "the squatter received a request: $(cat "$MT_DIR/squat.log")"
[ "$MC_STATUS" = 502 ] || models_fail "the call with the port taken over: expected 502, got $MC_STATUS: $MC_BODY"
msg="$(jq -r .error.message <<<"$MC_BODY")"
grep -q "model \`tk-chat\`" <<<"$msg" && grep -q "no longer held by the worker" <<<"$msg" && grep -q "nothing was sent" <<<"$msg" ||
    models_fail "the 502 does not say that the worker's port is no longer its worker's: $msg"
grep -F "is not held by the worker account" "$MT_DIR/agent.log" | grep -q "uid $squatter_uid listens on port $port" ||
    models_fail "the agent did not log the uid on the worker's port: $(grep -F 'not held by' "$MT_DIR/agent.log" | tail -n1)"
echo "   ok: $MC_STATUS $msg"

echo "== 4. the agent stops job $job; the next call starts a new worker"
stopped() { grep -F "its server stopped holding its port while the job ran" "$MT_DIR/agent.log" | grep -q 'to="unloaded"'; }
for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h -j "$job" -o %T 2>/dev/null)" ] && stopped && break; sleep 0.1; done
[ -z "$(squeue -h -j "$job" -o %T 2>/dev/null)" ] || models_fail "job $job still runs 10 s after its port was found taken over: $(squeue -h -j "$job" -o '%T %r')"
stopped || models_fail "the agent did not log why it stopped job $job (model state unloaded)"
MC_TIMEOUT=60 models_call tk-chat "hello again"
[ "$MC_STATUS" = 200 ] || models_fail "the call after the stop: expected 200 from a new worker, got $MC_STATUS: $MC_BODY"
new_job="$(models_jobs tk-chat)"
[ -n "$new_job" ] && [ "$new_job" != "$job" ] || models_fail "expected a new worker job, got '$new_job' (old $job)"
[ -s "$MT_DIR/squat.log" ] && models_fail "the squatter received a request: $(cat "$MT_DIR/squat.log")"
echo "   ok: job $job stopped; job $new_job answers"
echo "PASS security-port-takeover"
