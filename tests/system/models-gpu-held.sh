#!/usr/bin/env bash
# While a user's Slurm job holds the GPUs, a caller of a model whose worker job must wait is
# told what holds them: the job, its user, since when and until its time limit, in the SSE
# comments of its stream and in `gpuhub models`; when the job ends, the worker starts and the
# same stream gets its answer. Real Slurm, a test agent of its own (tests/lib/models.sh), the
# TEST worker. About 20 s.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
lab_user

MT_GATEWAY_EXTRA="keepalive_s = 1"
models_setup "
[[models]]
name = \"mt-held\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { gpus = 1, vram_gib = 1.0 }
idle_timeout_s = 5
load_timeout_s = 60
"

echo "== a user's job holds both GPUs (time limit 5 minutes)"
hold="$(runuser -u "$LAB_USER" -- sbatch --parsable -J hold-gpus --gres=gpu:2 -t 5 -D /tmp -o /dev/null --wrap 'sleep 120' | cut -d';' -f1)"
lab_cleanup_add "scancel $hold 2>/dev/null || true"
for ((i = 0; i < 100; i++)); do [ "$(squeue -h -j "$hold" -o %T 2>/dev/null)" = RUNNING ] && break; sleep 0.1; done
[ "$(squeue -h -j "$hold" -o %T)" = RUNNING ] || models_fail "the holding job $hold did not start"
end="$(squeue -h -j "$hold" -o %e)"
echo "   Slurm job $hold of $LAB_USER, running until $end"

echo "== a streamed call waits; its SSE comments say what holds the GPUs and until when"
curl -sN --max-time 60 -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
    -d '{"model":"mt-held","stream":true,"messages":[{"role":"user","content":"wait for it"}]}' \
    "http://$MT_GW/v1/chat/completions" > "$MT_DIR/stream" &
client=$!
for ((i = 0; i < 150; i++)); do grep -q "hold-gpus" "$MT_DIR/stream" 2>/dev/null && break; sleep 0.1; done
note="$(grep -m1 'hold-gpus' "$MT_DIR/stream" || true)"
[ -n "$note" ] || models_fail "no SSE comment named the holding job within 15 s; the stream so far: $(head -c 600 "$MT_DIR/stream")"
echo "   $note"
case "$note" in
    ": gpuhub: model \`mt-held\` is loading (pending: Slurm job "*" pending: Resources; "*"Slurm job $hold \`hold-gpus\` of $LAB_USER, 2 GPUs since "*", until its time limit at $end"*) ;;
    *) models_fail "the comment should name the model's state, Slurm's reason, job $hold, its user $LAB_USER and its end $end: $note" ;;
esac
detail="$(models_field mt-held detail)"
grep -q "Slurm job $hold \`hold-gpus\` of $LAB_USER" <<<"$detail" || models_fail "\`gpuhub models\` should show the holder: $detail"
echo "   gpuhub models: $detail"

echo "== the job ends; the worker starts and the waiting stream is answered"
scancel "$hold"
wait "$client" || models_fail "the waiting stream failed after the GPUs were freed: $(tail -c 600 "$MT_DIR/stream")"
answer="$(sed -n 's/^data: {.*"content":"\([^"]*\)".*/\1/p' "$MT_DIR/stream" | tr -d '\n')"
[ "$answer" = "Hello from mt-held version -: you said: wait for it" ] || models_fail "the stream's answer is '$answer': $(tail -c 600 "$MT_DIR/stream")"
tail -n2 "$MT_DIR/stream" | grep -q '^data: \[DONE\]' || models_fail "the stream did not end with [DONE]: $(tail -c 300 "$MT_DIR/stream")"
models_wait_state mt-held unloaded 30
echo "PASS: models-gpu-held"
