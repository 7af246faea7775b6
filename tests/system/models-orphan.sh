#!/usr/bin/env bash
# A worker left without an agent stops itself after its idle timeout: kill -9 the (test) agent
# and never restart it; the worker job must leave squeue once the agent's heartbeat is older
# than idle_timeout_s (15 s here), within a few seconds of it (not before, not long after),
# saying why in its log. Bounded: about 25 s.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require

models_setup "
[[models]]
name = \"mt-orphan\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 15
load_timeout_s = 60
"
models_call mt-orphan "hello"
[ "$MC_STATUS" = 200 ] || models_fail "first call: expected 200, got $MC_STATUS: $MC_BODY"
job="$(models_field mt-orphan worker_id)"
echo "== worker job $job runs; kill -9 the agent and do not restart it"
models_agent_kill9
hb="$MT_DIR/workers/agent.heartbeat"
[ -f "$hb" ] || models_fail "no heartbeat file $hb: the agent never touched it"
last_hb="$(stat -c %Y "$hb")"
start=$SECONDS
while [ $((SECONDS - start)) -lt 45 ] && [ -n "$(models_jobs mt-orphan)" ]; do sleep 0.5; done
[ -z "$(models_jobs mt-orphan)" ] || models_fail "job $job still runs $((SECONDS - start)) s after its agent died (idle_timeout_s = 15)"
# The watchdog stops the worker once the heartbeat (touched every 5 s by a live agent) is older
# than the idle timeout: 15 s after the last touch, give or take the 1 s mtime resolution and
# its 1 s loop; then Slurm ends the job (a few seconds). Earlier would cut off a live agent's
# worker; much later would hold the GPU for nothing.
gone="$(date +%s)"
since_hb=$((gone - last_hb))
echo "   job $job left squeue $((SECONDS - start)) s after the kill, $since_hb s after the last heartbeat"
[ "$since_hb" -ge 15 ] || models_fail "job $job ended $since_hb s after the last heartbeat: before its idle timeout (15 s)"
[ "$since_hb" -le 22 ] || models_fail "job $job ended $since_hb s after the last heartbeat: more than 7 s past its idle timeout (15 s)"
msg="$(grep 'no agent heartbeat' "$MT_DIR/workers/mt-orphan.$job.log" || true)"
[ -n "$msg" ] || models_fail "the worker log should say why it stopped"
age="$(sed -n 's/.*no agent heartbeat for \([0-9]*\)s.*/\1/p' <<<"$msg" | head -n1)"
[ -n "$age" ] && [ "$age" -ge 16 ] && [ "$age" -le 18 ] || models_fail "the watchdog stopped at heartbeat age '${age}' s, expected 16-18 (just past idle_timeout_s = 15): $msg"
echo "   ok: $msg"
echo "PASS models-orphan"
