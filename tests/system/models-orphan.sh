#!/usr/bin/env bash
# A worker left without an agent stops itself after its idle timeout: kill -9 the (test) agent
# and never restart it; the worker job must leave squeue once the agent's heartbeat is older
# than idle_timeout_s (15 s here), saying why in its log. Bounded: about 25 s.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require

models_setup "
[[models]]
name = \"mt-orphan\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key {api_key}\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 15
load_timeout_s = 60
"
models_call mt-orphan "hello"
[ "$MC_STATUS" = 200 ] || models_fail "first call: expected 200, got $MC_STATUS: $MC_BODY"
job="$(models_field mt-orphan worker_id)"
echo "== worker job $job runs; kill -9 the agent and do not restart it"
models_agent_kill9
start=$SECONDS
while [ $((SECONDS - start)) -lt 45 ] && [ -n "$(models_jobs mt-orphan)" ]; do sleep 1; done
[ -z "$(models_jobs mt-orphan)" ] || models_fail "job $job still runs $((SECONDS - start)) s after its agent died (idle_timeout_s = 15)"
took=$((SECONDS - start))
[ "$took" -ge 8 ] || models_fail "job $job ended after only $took s: it should wait for the heartbeat to age past 15 s"
grep -q 'no agent heartbeat' "$MT_DIR/workers/mt-orphan.$job.log" || models_fail "the worker log should say why it stopped"
echo "   ok: job $job stopped itself $took s after the agent died: $(grep 'no agent heartbeat' "$MT_DIR/workers/mt-orphan.$job.log")"
echo "PASS models-orphan"
