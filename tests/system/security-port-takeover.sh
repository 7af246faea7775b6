#!/usr/bin/env bash
# timeout: 240
# A worker's port taken over after the worker is gone gets no call (the one-time proof at start
# says nothing then). A test agent (tests/lib/models.sh) serves `tk-chat`, a Slurm worker whose
# job outlives its server (`{ server; sleep 300; }`: a wrapper that keeps running after its
# server crashed, so neither the job's end nor a replica probe tells the agent):
#   1. a call loads it and is answered (200), over a kept-alive connection;
#   1b. the unprivileged $LAB_USER binds the same port on another address ([::1]), which never
#      receives the gateway's calls to 127.0.0.1: calls that open new connections to the worker
#      are answered by the same worker, which is not stopped, and the squatter gets nothing;
#   2. its server is killed (SIGKILL) and the unprivileged $LAB_USER binds the freed port with a
#      server that answers 200 to everything and logs what it receives;
#   3. the next call is answered (200) by a new worker: nothing was sent to the squatter (no
#      prompt, no worker key); the agent logs the uid it found on the port, checks the port at
#      once, stops the job (no waiting for a job that would run on for minutes), and the call,
#      sent nowhere yet, waits for the model's next worker instead of failing;
#   4. the new worker's server dies with nobody on its port (its job runs on): the next call,
#      streamed, is answered by yet another worker in the same way (the sole worker that died
#      between calls costs no call).
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
command = \"{ @WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}; sleep 300; }\"
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

# A copy the lab user can read whatever the checkout's permissions.
install -m 644 "$REPO/tests/lib/squat.py" "$MT_DIR/squat.py"
touch "$MT_DIR/squat.log" && chown "$LAB_USER" "$MT_DIR/squat.log"

echo "== 1b. $LAB_USER binds port $port on [::1] beside the worker (127.0.0.1): the worker keeps serving"
case "$url" in http://127.0.0.1:*) ;; *) models_fail "the worker's address should be on 127.0.0.1 for this step: $url" ;; esac
runuser -u "$LAB_USER" -- python3 "$MT_DIR/squat.py" "$port" "$MT_DIR/squat.log" ::1 2>/dev/null &
beside=$!
lab_cleanup_add "kill $beside 2>/dev/null || true"
for ((i = 0; i < 100; i++)); do ss -Hltn "src [::1]:$port" | grep . >/dev/null && break; sleep 0.05; done
ss -Hltne "src [::1]:$port" | grep "uid:$squatter_uid" >/dev/null || models_fail "$LAB_USER could not bind [::1]:$port"
# Four calls at once: at least three new connections to the worker, each checked.
calls=()
for i in 1 2 3 4; do
    curl -s -o /dev/null -w '%{http_code}\n' --max-time 30 -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
        -d '{"model": "tk-chat", "messages": [{"role": "user", "content": "beside"}]}' "http://$MT_GW/v1/chat/completions" >"$MT_DIR/beside.$i" &
    calls+=($!)
done
wait "${calls[@]}" || true
for i in 1 2 3 4; do [ "$(cat "$MT_DIR/beside.$i")" = 200 ] || models_fail "call $i with a listener on [::1]:$port: $(cat "$MT_DIR/beside.$i")"; done
[ "$(models_jobs tk-chat)" = "$job" ] || models_fail "a listener on another address stopped worker job $job (now: '$(models_jobs tk-chat)')"
grep -F "is not held by that worker alone" "$MT_DIR/agent.log" && models_fail "a listener on [::1]:$port was taken for a squatter on 127.0.0.1:$port"
[ -s "$MT_DIR/squat.log" ] && models_fail "the listener on [::1] received a request: $(cat "$MT_DIR/squat.log")"
kill "$beside" 2>/dev/null || true
wait "$beside" 2>/dev/null || true
echo "   ok: 4 calls answered by job $job; nothing sent to [::1]:$port"

echo "== 2. the server dies (its job runs on); $LAB_USER binds its port"
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

echo "== 3. the next call gets nothing sent to the squatter, and is answered by a new worker"
MC_TIMEOUT=60 models_call tk-chat "my secret prompt"
grep -q 'secret' "$MT_DIR/squat.log" && models_fail "the squatter received the caller's prompt: $(cat "$MT_DIR/squat.log")"
[ -s "$MT_DIR/squat.log" ] && models_fail "the squatter received a request: $(cat "$MT_DIR/squat.log")"
grep -F "is not held by that worker alone" "$MT_DIR/agent.log" | grep -q "uid $squatter_uid listens on port $port" ||
    models_fail "the agent did not log the uid on the worker's port: $(grep -F 'not held by' "$MT_DIR/agent.log" | tail -n1)"
[ "$MC_STATUS" = 200 ] || models_fail "the call with the port taken over: expected 200 from a new worker, got $MC_STATUS: $MC_BODY"
stopped() { grep -F "its server stopped holding its port while the job ran" "$MT_DIR/agent.log" | grep -q 'to="unloaded"'; }
stopped || models_fail "the agent did not log why it stopped job $job (model state unloaded)"
for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h -j "$job" -o %T 2>/dev/null)" ] && break; sleep 0.1; done
[ -z "$(squeue -h -j "$job" -o %T 2>/dev/null)" ] || models_fail "job $job still runs 10 s after its port was found taken over: $(squeue -h -j "$job" -o '%T %r')"
new_job="$(models_jobs tk-chat)"
[ -n "$new_job" ] && [ "$new_job" != "$job" ] || models_fail "expected a new worker job, got '$new_job' (old $job)"
waited() { grep -cF "the model's worker is gone; the call, sent nowhere yet, waits for the model again" "$MT_DIR/agent.log" || true; }
[ "$(waited)" = 1 ] || models_fail "the agent should log once that the call waits for the model again (logged $(waited) times)"
echo "   ok: job $job stopped; the call went to job $new_job (200)"

echo "== 4. the new worker's server dies, nobody on its port: the next call is answered"
url="$(models_field tk-chat replicas | jq -r '.[0].base_url')"
port="${url##*:}"
pid="$(ss -Hltnp "sport = :$port" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1)"
[ -n "$pid" ] || models_fail "cannot find the new worker's process listening at $url"
kill -9 "$pid"
for ((i = 0; i < 100; i++)); do [ -z "$(ss -Hltn "sport = :$port")" ] && break; sleep 0.05; done
[ -z "$(ss -Hltn "sport = :$port")" ] || models_fail "port $port still has a listener after its server was killed"
# A streamed call this time (the streaming path waits the same way, with loading comments).
out="$(curl -sN --max-time 60 -w '\n%{http_code}' -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
    -d '{"model": "tk-chat", "stream": true, "messages": [{"role": "user", "content": "after a plain crash"}]}' \
    "http://$MT_GW/v1/chat/completions" || true)"
[ "$(tail -n1 <<<"$out")" = 200 ] && grep -q '^data: \[DONE\]' <<<"$out" && ! grep -q '"error"' <<<"$out" ||
    models_fail "the streamed call after the worker died: expected a whole stream from another worker, got: $out"
third="$(models_jobs tk-chat)"
[ -n "$third" ] && [ "$third" != "$new_job" ] || models_fail "expected another worker job, got '$third' (before: $new_job)"
[ "$(waited)" = 2 ] || models_fail "the agent should log twice that a call waited for the model again (logged $(waited) times)"
[ -s "$MT_DIR/squat.log" ] && models_fail "the squatter received a request: $(cat "$MT_DIR/squat.log")"
echo "   ok: job $new_job stopped; the call went to job $third (200)"
echo "PASS security-port-takeover"
