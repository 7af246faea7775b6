#!/usr/bin/env bash
# Model workers on the real Slurm lab, through a test agent of its own (tests/lib/models.sh):
#   1. first call → sbatch → ready → answer
#   2. 50 concurrent first calls → one Slurm job
#   3. idle → scancel, state back to unloaded
#   4. kill the worker → detected; the next call restarts it (a new job)
#   5. kill -9 the agent → the restarted agent adopts the job (no duplicate sbatch)
#   6. a model that does not fit → LRU eviction, then a clear 503 naming the holder
# Bounded: every wait has a limit; about 60 s in all.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require

CMD='command = "@WORKER@ --model {model} --version {version} --host {host} --port {port} --api-key-file {api_key_file}'
models_setup "
[[models]]
name = \"mt-chat\"
launcher = \"slurm\"
$CMD\"
resources = { shards = 2, vram_gib = 4.0 }
idle_timeout_s = 4
load_timeout_s = 60

[[models]]
name = \"mt-ocr\"
launcher = \"slurm\"
$CMD\"
resources = { shards = 2, vram_gib = 4.0 }
idle_timeout_s = 600
load_timeout_s = 60

[[models]]
name = \"mt-big\"
launcher = \"slurm\"
$CMD --token-delay-ms 400\"
resources = { shards = 2, vram_gib = 9.0 }
idle_timeout_s = 600
load_timeout_s = 60
" "vram_gib = 10.0"

echo "== 1. first call -> sbatch -> ready -> answer"
[ "$(models_state mt-chat)" = unloaded ] || models_fail "mt-chat should start unloaded"
models_call mt-chat "first call"
[ "$MC_STATUS" = 200 ] || models_fail "first call: expected 200, got $MC_STATUS: $MC_BODY"
echo "$MC_BODY" | grep -q 'Hello from mt-chat' || models_fail "first call: the worker's answer is missing: $MC_BODY"
job="$(models_field mt-chat worker_id)"
[ "$(models_jobs mt-chat)" = "$job" ] || models_fail "expected Slurm job $job named gpuhub-worker-mt-chat, squeue shows '$(models_jobs mt-chat)'"
scontrol show job "$job" | grep -q 'Requeue=0' || models_fail "worker job $job may be requeued: $(scontrol show job "$job" | grep -o 'Requeue=[0-9]*')"
if out="$(scontrol requeue "$job" 2>&1)"; then models_fail "scontrol requeue $job was accepted: a worker job must never run twice under one id"; fi
echo "   ok: answered by Slurm job $job (never requeued: $out)"

echo "== 2. 50 concurrent first calls -> one Slurm job"
pids=()
for i in $(seq 50); do
    ( models_call mt-ocr "call $i"; echo "$MC_STATUS" > "$MT_DIR/c.$i" ) &
    pids+=($!)
done
wait "${pids[@]}"
ok="$(cat "$MT_DIR"/c.* | grep -c '^200$' || true)"
[ "$ok" = 50 ] || models_fail "50 first calls: expected 50 x 200, got $ok ($(sort "$MT_DIR"/c.* | uniq -c | tr '\n' ' '))"
jobs="$(models_jobs mt-ocr | wc -l)"
launched="$(grep -c 'worker launched.*model=mt-ocr\|model=mt-ocr.*worker launched' "$MT_DIR/agent.log" || true)"
[ "$jobs" = 1 ] && [ "$launched" = 1 ] || models_fail "expected one job for 50 first calls; squeue: $jobs, sbatch calls: $launched"
echo "   ok: 50 x 200 from one job ($(models_jobs mt-ocr))"

echo "== 3. idle -> scancel"
models_wait_state mt-chat unloaded 20
for ((i = 0; i < 100; i++)); do [ -z "$(models_jobs mt-chat)" ] && break; sleep 0.1; done
[ -z "$(models_jobs mt-chat)" ] || models_fail "mt-chat is unloaded but job $(models_jobs mt-chat) is still in squeue"
models_field mt-chat detail | grep -q idle || models_fail "the unload reason should say idle: $(models_field mt-chat detail)"
echo "   ok: job $job cancelled after the idle timeout"

echo "== 4. kill the worker -> restart"
old="$(models_field mt-ocr worker_id)"
wpid=""
for p in $(scontrol listpids "$old" 2>/dev/null | awk 'NR > 1 {print $1}'); do
    grep -q gpuhub-test-worker "/proc/$p/cmdline" 2>/dev/null && wpid="$p"
done
[ -n "$wpid" ] || models_fail "no worker process in job $old (scontrol listpids $old)"
kill -9 "$wpid"
models_wait_state mt-ocr unloaded 20
models_field mt-ocr detail | grep -q crashed || models_fail "the state detail should say it crashed: $(models_field mt-ocr detail)"
models_call mt-ocr "after the crash"
[ "$MC_STATUS" = 200 ] || models_fail "call after a crash: expected 200, got $MC_STATUS: $MC_BODY"
new="$(models_field mt-ocr worker_id)"
[ -n "$new" ] && [ "$new" != "$old" ] || models_fail "expected a new job after the crash (old $old, now '$new')"
echo "   ok: job $old crashed, job $new serves"

echo "== 5. kill -9 the agent -> adopted after restart"
models_agent_kill9
models_agent_start
# The agent answers /healthz first and adopts its workers just after (state `starting`).
models_wait_state mt-ocr ready 10
[ "$(models_field mt-ocr worker_id)" = "$new" ] || models_fail "the restarted agent should adopt job $new, shows '$(models_field mt-ocr worker_id)'"
models_call mt-ocr "after the agent restart"
[ "$MC_STATUS" = 200 ] || models_fail "call after an agent restart: expected 200, got $MC_STATUS: $MC_BODY"
[ "$(models_jobs mt-ocr)" = "$new" ] || models_fail "expected only job $new for mt-ocr, squeue: $(models_jobs mt-ocr | tr '\n' ' ')"
echo "   ok: job $new adopted, no duplicate sbatch"

echo "== 6. a model that does not fit -> LRU eviction, then a clear 503"
models_call mt-chat "load chat too"           # mt-ocr 4 + mt-chat 4 of 10 GiB
[ "$MC_STATUS" = 200 ] || models_fail "mt-chat: expected 200, got $MC_STATUS"
models_call mt-big "long answer please" &      # 9 GiB: evicts both (idle), then streams slowly
big=$!
for ((i = 0; i < 300; i++)); do [ "$(models_state mt-big)" = ready ] && break; sleep 0.1; done
[ "$(models_state mt-big)" = ready ] || models_fail "mt-big did not load (state $(models_state mt-big): $(models_field mt-big detail))"
[ "$(models_state mt-ocr)" = unloaded ] && [ "$(models_state mt-chat)" = unloaded ] || models_fail "mt-ocr and mt-chat should have been evicted"
models_field mt-ocr detail | grep -q 'evicted to make room for `mt-big`' || models_fail "eviction not explained: $(models_field mt-ocr detail)"
sleep 0.3
models_call mt-chat "no room"                  # mt-big holds 9 GiB with a call in flight
[ "$MC_STATUS" = 503 ] || models_fail "no room: expected 503, got $MC_STATUS: $MC_BODY"
echo "$MC_BODY" | grep -q 'mt-big' || models_fail "the 503 should name what holds the GPU: $MC_BODY"
echo "   ok: 503: $(echo "$MC_BODY" | jq -r .error.message)"
wait $big || true
echo "== 7. a suspended worker job -> cancelled (it would resume with nobody keeping it)"
sus="$(models_field mt-big worker_id)"
scontrol suspend "$sus" || models_fail "scontrol suspend $sus failed"
models_wait_state mt-big unloaded 20
for ((i = 0; i < 100; i++)); do [ -z "$(models_jobs mt-big)" ] && break; sleep 0.1; done
[ -z "$(models_jobs mt-big)" ] || models_fail "job $sus was suspended and is still listed ($(squeue -h -j "$sus" -o %T)): nothing cancelled it"
models_field mt-big detail | grep -q SUSPENDED || models_fail "the state detail should say the job was suspended: $(models_field mt-big detail)"
echo "   ok: job $sus suspended -> cancelled: $(models_field mt-big detail)"
echo "PASS models-slurm"
