#!/usr/bin/env bash
# Worker jobs still waiting in Slurm's queue when their models leave the catalog are cancelled
# there and then, never started: not left to hold their place in the queue until they run,
# load and are stopped. A user's job holds one of the two GPUs; a test agent of its own
# (tests/lib/models.sh), the TEST worker:
#  - `mt-two` (gpus = 1, min_replicas = max_replicas = 2): its first replica runs on the free
#    GPU, its second waits in the queue; the agent is killed (-9) and started again, and adopts
#    both (the queued one is the case the old agent missed);
#  - `mt-q` (gpus = 1): a call starts its worker, whose job waits in the queue;
#  - both models leave agent.toml, `gpuhub models reload`: both queued jobs are cancelled before
#    the first replica's GPU is free (Slurm never starts them: sacct says "None assigned"), the
#    first replica drains and stops, and the waiting call is answered with the reason.
# About 30 s.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
lab_user

echo "== a user's job holds one of the two GPUs"
hold="$(runuser -u "$LAB_USER" -- sbatch --parsable -J hold-one-gpu --gres=gpu:1 -t 5 -D /tmp -o /dev/null --wrap 'sleep 240' | cut -d';' -f1)"
lab_cleanup_add "scancel $hold 2>/dev/null || true"
for ((i = 0; i < 100; i++)); do [ "$(squeue -h -j "$hold" -o %T 2>/dev/null)" = RUNNING ] && break; sleep 0.1; done
[ "$(squeue -h -j "$hold" -o %T)" = RUNNING ] || models_fail "the holding job $hold did not start"

models_setup "
[[models]]
name = \"mt-two\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { gpus = 1, vram_gib = 1.0 }
idle_timeout_s = 600
load_timeout_s = 120
min_replicas = 2
max_replicas = 2

[[models]]
name = \"mt-q\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { gpus = 1, vram_gib = 1.0 }
idle_timeout_s = 600
load_timeout_s = 120
"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")
replicas() { "${CLI[@]}" models list --json | jq -c '[.models[] | select(.name == "mt-two") | .replicas[]? | {job_id, state}]'; }
# one_ready_one_queued: the first replica ready, the second's job pending in Slurm; sets READY QUEUED.
one_ready_one_queued() {
    local r
    r="$(replicas)"
    READY="$(jq -r '[.[] | select(.state == "ready") | .job_id] | join(" ")' <<<"$r")"
    QUEUED="$(jq -r '[.[] | select(.state == "pending") | .job_id] | join(" ")' <<<"$r")"
    [ -n "$READY" ] && [ "${READY// /}" = "$READY" ] && [ -n "$QUEUED" ] && [ "${QUEUED// /}" = "$QUEUED" ] &&
        [ "$(squeue -h -j "$QUEUED" -o %T 2>/dev/null)" = PENDING ]
}
until_ready() { local i; for ((i = 0; i < $2 * 5; i++)); do "$1" && return 0; sleep 0.2; done; return 1; }

echo "== mt-two: one replica ready on the free GPU, the other's job queued"
until_ready one_ready_one_queued 60 || models_fail "mt-two should have one ready replica and one queued: $(replicas); squeue: $(squeue -h -o '%i %j %T %r' | tr '\n' ';')"
echo "   ready $READY, queued $QUEUED"
first_ready="$READY" first_queued="$QUEUED"

echo "== the agent killed (-9) and started again adopts both, the queued one too"
models_agent_kill9
models_agent_start
until_ready one_ready_one_queued 60 || models_fail "after a restart mt-two should have one ready replica and one queued: $(replicas)"
[ "$READY $QUEUED" = "$first_ready $first_queued" ] || models_fail "after a restart the replicas are $READY (ready) and $QUEUED (queued), not the adopted $first_ready and $first_queued"
grep -q "adopting replica $QUEUED" "$MT_DIR/agent.log" || models_fail "the agent did not log adopting the queued replica $QUEUED"
"${CLI[@]}" models list >"$MT_DIR/list.txt"
grep -qx "  worker $QUEUED: pending, its Slurm job waits in the queue" "$MT_DIR/list.txt" ||
    models_fail "gpuhub models list should show the queued replica $QUEUED: $(cat "$MT_DIR/list.txt")"

echo "== a call to mt-q waits for its worker, whose job is queued"
body='{"model":"mt-q","messages":[{"role":"user","content":"wait for it"}]}'
curl -s --max-time 60 -o "$MT_DIR/q.body" -w '%{http_code}' -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
    -d "$body" "http://$MT_GW/v1/chat/completions" >"$MT_DIR/q.code" &
client=$!
lab_cleanup_add "kill $client 2>/dev/null || true"
qjob=""
for ((i = 0; i < 100; i++)); do
    qjob="$(models_jobs mt-q)"
    [ -n "$qjob" ] && [ "$(squeue -h -j "$qjob" -o %T 2>/dev/null)" = PENDING ] && break
    sleep 0.1
done
[ -n "$qjob" ] && [ "$(squeue -h -j "$qjob" -o %T 2>/dev/null)" = PENDING ] || models_fail "mt-q's worker job should be queued: '$qjob'"
echo "   mt-q's job $qjob queued"

echo "== both models leave agent.toml; gpuhub models reload"
sed -i '/^\[\[models\]\]/,$d' "$MT_DIR/agent.toml"
"${CLI[@]}" models reload >"$MT_DIR/reload.out" || models_fail "gpuhub models reload failed: $(cat "$MT_DIR/reload.out")"
for ((i = 0; i < 150; i++)); do
    [ -z "$(models_jobs mt-two)$(models_jobs mt-q)" ] && break
    sleep 0.1
done
[ -z "$(models_jobs mt-two)$(models_jobs mt-q)" ] || models_fail "worker jobs still in the queue 15 s after the reload: $(squeue -h -o '%i %j %T' | tr '\n' ';')"
wait "$client" || true
code="$(cat "$MT_DIR/q.code")"
[ "$code" != 200 ] || models_fail "the call waiting for mt-q got 200 after mt-q left the catalog"
grep -q "its model left the catalog while its Slurm job $qjob was still queued; the job is cancelled" "$MT_DIR/q.body" ||
    models_fail "the waiting call's answer ($code) should say why it failed: $(head -c 400 "$MT_DIR/q.body")"
echo "   the waiting call: $code $(jq -r .error.message "$MT_DIR/q.body" 2>/dev/null | head -c 200)"

echo "== the queued jobs never ran; the ready replica did"
nodes_of() { sacct -j "$1" -X -n -P -o NodeList 2>/dev/null | head -n1; }
for j in "$QUEUED" "$qjob"; do
    n=""
    for ((i = 0; i < 50; i++)); do n="$(nodes_of "$j")"; [ -n "$n" ] && break; sleep 0.2; done
    [ "$n" = "None assigned" ] || models_fail "queued worker job $j ran on '$n' after its model left the catalog (sacct: $(sacct -j "$j" -X -n -P -o State,NodeList,Start,End))"
done
[ "$(nodes_of "$READY")" != "None assigned" ] || models_fail "sacct says the ready replica $READY never ran: the check above proves nothing"
grep -q "the replica was not needed any more (its model left the catalog) while its Slurm job $QUEUED was still queued; the job is cancelled" "$MT_DIR/agent.log" ||
    models_fail "the agent's log does not say why replica $QUEUED was cancelled"
echo "PASS: models-queued-removed"
