#!/usr/bin/env bash
# The gate belongs to gpuhub, and promotion fails no call. A real `mlflow server` with an
# artifact store (tests/lib/mlflow.sh), a real model on a real server (SmolLM2-135M GGUF on
# llama.cpp's server from llama-cpp-python) and a test agent of its own
# (tests/lib/models.sh). One registered model, tagged for the gateway, five versions whose runs
# log eval_accuracy 0.8, 0.6, 0.75, 0.9, 0.95 (the same GGUF each); the gate (threshold 0.7)
# comes from agent.toml's mlflow.gates, never from MLflow tags:
#   1. @production -> 1 before any promotion through gpuhub: version 1 is served;
#   2. promote 2 (0.6 < 0.7): refused, exit 1, the numbers in the message, alias unchanged;
#   3. promote 3 (0.75: passes 0.7 but regresses against 0.8 of version 1): refused, exit 1;
#   4. promote 4 (0.9) while 20 clients call in a loop: a second worker (Slurm job) starts on
#      version 4, new calls move to it, the old one drains and its job ends; no call fails
#      (counts printed); the promotion is recorded in the store with the caller's uid;
#   5. @production moved to 5 with MLflow's REST API alone: gpuhub keeps serving 4 (also after
#      a restart of the worker) and reports the mismatch (`gpuhub models --json`, the table,
#      gpuhub_model_alias_mismatch);
#   6. promote 5 adopts it through the gate: served, the mismatch clears.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
. "$REPO/tests/lib/mlflow.sh"
. "$REPO/tests/lib/prereq.sh"
lab_require

PY="$REPO/.venv/bin/python"
GGUF=/opt/gpuhub-lab/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -x "$PY" ] && "$PY" -c 'import mlflow' 2>/dev/null ||
    { prereq_missing "$PY with mlflow is missing" "run tests/setup/deps.sh" || exit 0; }
[ -x /opt/gpuhub-lab/llama-venv/bin/python ] && [ -s "$GGUF" ] ||
    { prereq_missing "llama.cpp's server or the lab's SmolLM2 model is missing under /opt/gpuhub-lab" "run tests/setup/llama.sh" || exit 0; }

PORT="${GPUHUB_TEST_MLFLOW_PORT:-5080}"
rm -rf "/var/tmp/gpuhub-mlflow-$PORT" # a fresh store: no models (or GGUF copies) of earlier runs
MLFLOW_SERVE_ARTIFACTS=1 mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT"
STAMP="$(date +%s)-$$"
REG="gpuhub-test-promote-$STAMP"
SERVED="mt-promote-$STAMP"
POLL_S=2

models_setup "" "[mlflow]
tracking_uri = \"$MLFLOW_URL\"
registry_poll_s = $POLL_S
[mlflow.gates.\"$REG\"]
metric = \"eval_accuracy\"
threshold = 0.7
[templates.llama-cpp-python]
command = \"python3 -m llama_cpp.server --model {model_file} --model_alias {model} --host {host} --port {port} --n_threads 1 --n_threads_batch 1 --n_ctx 512 --verbose false\"
env = { PATH = \"/opt/gpuhub-lab/llama-venv/bin:/usr/bin:/bin\", OMP_WAIT_POLICY = \"PASSIVE\", OMP_NUM_THREADS = \"1\" }"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")

echo "== registering $REG: versions 1..5 with eval_accuracy 0.8 0.6 0.75 0.9 0.95 (artifacts: the GGUF); @production -> 1"
"$PY" - "$MLFLOW_URL" "$REG" "$SERVED" "$GGUF" <<'PYEOF' || models_fail "registering the model in MLflow failed"
import sys, mlflow
from mlflow import MlflowClient
uri, name, served, gguf = sys.argv[1:5]
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("gpuhub-promote-test")
c = MlflowClient()
c.create_registered_model(name, tags={
    "served_by": "gateway",
    "gpuhub.template": "llama-cpp-python",
    "gpuhub.resources": "shards=1,vram_gib=0.5",
    "gpuhub.name": served,
    # MLflow tags are not the gate: anyone can set this one, and it must change nothing.
    "gpuhub.eval_threshold": "0.0",
})
for acc in (0.8, 0.6, 0.75, 0.9, 0.95):
    with mlflow.start_run() as r:
        mlflow.log_metric("eval_accuracy", acc)
        mlflow.log_artifact(gguf, artifact_path="model")
    mv = c.create_model_version(name, source=f"{r.info.artifact_uri}/model", run_id=r.info.run_id)
    print("version", mv.version, "eval_accuracy", acc)
c.set_registered_model_alias(name, "production", "1")
PYEOF

alias_version() {
    curl -s --max-time 5 -G "$MLFLOW_URL/api/2.0/mlflow/registered-models/alias" --data-urlencode "name=$REG" \
        --data-urlencode alias=production | jq -r .model_version.version
}
mismatch_metric() {
    curl -s --max-time 5 "http://$MT_METRICS/metrics" | awk -v m="gpuhub_model_alias_mismatch{model=\"$SERVED\"}" '$1 == m {print $2}'
}

echo "== 1. before any promotion through gpuhub, @production (1) is served"
for ((i = 0; i < 4 * POLL_S + 4; i++)); do
    "${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m)' >/dev/null && break
    sleep 0.5
done
MC_TIMEOUT=180 models_call "$SERVED" "Say hi."
[ "$MC_STATUS" = 200 ] || models_fail "calling $SERVED: expected 200, got $MC_STATUS: $MC_BODY"
[ "$(models_field "$SERVED" version)" = 1 ] || models_fail "$SERVED serves version '$(models_field "$SERVED" version)', expected @production = 1"
old_job="$(models_field "$SERVED" worker_id)"
echo "ok: version 1 served by Slurm job $old_job"

echo "== 2. a version below the threshold is refused"
lab_run "${CLI[@]}" models promote "$SERVED" 2
[ "$LAB_RC" = 1 ] || models_fail "promoting version 2 (eval_accuracy 0.6 < 0.7): expected exit 1, got $LAB_RC"
echo "$LAB_OUT" | grep -F "eval_accuracy = 0.6, below the threshold 0.7" >/dev/null || models_fail "the refusal does not give the numbers: $LAB_OUT"
[ "$(alias_version)" = 1 ] || models_fail "a refused promotion moved @production to $(alias_version)"

echo "== 3. a version that regresses against the one served is refused"
lab_run "${CLI[@]}" models promote "$SERVED" 3
[ "$LAB_RC" = 1 ] || models_fail "promoting version 3 (0.75, worse than version 1's 0.8): expected exit 1, got $LAB_RC"
echo "$LAB_OUT" | grep -F "regresses against version 1" | grep -F "eval_accuracy = 0.75 against 0.8" >/dev/null ||
    models_fail "the refusal does not name the regression and its numbers: $LAB_OUT"
[ "$(alias_version)" = 1 ] || models_fail "a refused promotion moved @production to $(alias_version)"

echo "== 4. promoting version 4 while 20 clients call in a loop: no failed call"
CALLS="$MT_DIR/calls.txt"
STOP="$MT_DIR/stop-calls"
python3 "$REPO/tests/lib/concurrent_calls.py" "http://$MT_GW" "$MT_KEY" "$SERVED" "$CALLS" "$STOP" --clients 20 --max-tokens 4 \
    >"$MT_DIR/clients.out" 2>&1 &
clients=$!
lab_cleanup_add "touch $STOP; kill $clients 2>/dev/null || true"
for ((i = 0; i < 600; i++)); do
    [ "$(wc -l 2>/dev/null < "$CALLS" || echo 0)" -ge 20 ] && break
    sleep 0.1
done
echo "calls before the promotion: $(wc -l < "$CALLS")"
lab_run "${CLI[@]}" models promote "$SERVED" 4
[ "$LAB_RC" = 0 ] || models_fail "promoting version 4 (0.9): expected exit 0, got $LAB_RC"
switched_at="$(date +%s.%N)"
echo "$LAB_OUT" | grep -F "switched:" >/dev/null || models_fail "the CLI does not say the running worker was switched: $LAB_OUT"
[ "$(alias_version)" = 4 ] || models_fail "@production should point at 4, points at $(alias_version)"
[ "$(models_field "$SERVED" version)" = 4 ] || models_fail "after the switch $SERVED serves version '$(models_field "$SERVED" version)', expected 4"
new_job="$(models_field "$SERVED" worker_id)"
[ -n "$new_job" ] && [ "$new_job" != "$old_job" ] || models_fail "no new worker after the switch (worker '$new_job', old $old_job)"
# Calls go on across the switch and after it; then the old job must be gone.
before="$(wc -l < "$CALLS")"
for ((i = 0; i < 600; i++)); do
    [ "$(($(wc -l < "$CALLS") - before))" -ge 40 ] && break
    sleep 0.1
done
touch "$STOP"
set +e
wait "$clients"
crc=$?
set -e
cat "$MT_DIR/clients.out"
after="$(awk -v t="$switched_at" '$1 > t' "$CALLS" | wc -l)"
echo "calls in all: $(wc -l < "$CALLS"); answered after the switch: $after"
{ grep -v ' 200 -$' "$CALLS" || true; } | head -n 5
[ "$crc" = 0 ] && ! grep -qv ' 200 -$' "$CALLS" || models_fail "calls failed during the switch (see above)"
[ "$after" -ge 20 ] || models_fail "only $after calls were answered after the switch"
for ((i = 0; i < 300; i++)); do
    squeue -h -j "$old_job" -t PD,R,CG 2>/dev/null | grep -q . || break
    sleep 0.1
done
squeue -h -j "$old_job" -t PD,R,CG 2>/dev/null | grep -q . && models_fail "the old worker's Slurm job $old_job still runs after the drain"
[ "$(models_jobs "$SERVED" | wc -l)" = 1 ] || models_fail "expected one worker job after the switch, got: $(models_jobs "$SERVED" | tr '\n' ' ')"
echo "ok: Slurm job $new_job serves version 4; job $old_job drained and ended"
row="$(sqlite3 "$MT_DIR/state/gpuhub.db" "SELECT model, version, previous_version, metric, value, previous_value, threshold, forced, uid FROM model_promotions ORDER BY id" 2>&1)"
echo "store: $row"
[ "$row" = "$REG|4|1|eval_accuracy|0.9|0.8|0.7|0|0" ] || models_fail "the store's promotion record is not the expected one: $row"

echo "== 5. @production moved with MLflow's REST API alone: gpuhub keeps serving 4, reports the mismatch"
curl -sf --max-time 5 -X POST -H 'content-type: application/json' \
    -d "$(jq -nc --arg n "$REG" '{name: $n, alias: "production", version: "5"}')" \
    "$MLFLOW_URL/api/2.0/mlflow/registered-models/alias" >/dev/null || models_fail "cannot move the alias through MLflow's REST API"
for ((i = 0; i < 8 * POLL_S + 10; i++)); do
    [ "$(models_field "$SERVED" alias_mismatch)" = true ] && break
    sleep 0.5
done
"${CLI[@]}" models list --json | jq -c --arg m "$SERVED" '.models[] | select(.name == $m) | {version, promoted_version, production_alias, alias_mismatch}'
"${CLI[@]}" models list --json | jq -e --arg m "$SERVED" \
    '.models[] | select(.name == $m and .alias_mismatch == true and .promoted_version == "4" and .production_alias == "5" and .version == "4")' >/dev/null ||
    models_fail "gpuhub models --json does not show the mismatch (served 4, @production 5)"
lab_run "${CLI[@]}" models
echo "$LAB_OUT" | grep -F "MISMATCH: gpuhub serves version 4" | grep -F "@production points at version 5" >/dev/null ||
    models_fail "the gpuhub models table does not show the mismatch"
[ "$(mismatch_metric)" = 1 ] || models_fail "gpuhub_model_alias_mismatch{model=\"$SERVED\"} is '$(mismatch_metric)', expected 1"
lab_run "${CLI[@]}" models unload "$SERVED"
MC_TIMEOUT=180 models_call "$SERVED" "Say hi."
[ "$MC_STATUS" = 200 ] || models_fail "calling $SERVED after the alias moved: expected 200, got $MC_STATUS: $MC_BODY"
[ "$(models_field "$SERVED" version)" = 4 ] ||
    models_fail "a new worker started on version '$(models_field "$SERVED" version)', expected gpuhub's promoted 4 (not the moved alias)"
echo "ok: the next start still serves version 4"

echo "== 6. promote 5 adopts the moved alias through the gate"
lab_run "${CLI[@]}" models promote "$SERVED" 5
[ "$LAB_RC" = 0 ] || models_fail "adopting version 5 (0.95): expected exit 0, got $LAB_RC"
[ "$(models_field "$SERVED" version)" = 5 ] || models_fail "after the adoption $SERVED serves version '$(models_field "$SERVED" version)', expected 5"
# (jq, not models_field: its `// ""` reads a false as missing)
"${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m) | .alias_mismatch == false' >/dev/null ||
    models_fail "the mismatch did not clear after the adoption"
[ "$(mismatch_metric)" = 0 ] || models_fail "gpuhub_model_alias_mismatch is '$(mismatch_metric)' after the adoption, expected 0"
MC_TIMEOUT=180 models_call "$SERVED" "Say hi."
[ "$MC_STATUS" = 200 ] || models_fail "calling $SERVED after the adoption: expected 200, got $MC_STATUS: $MC_BODY"
echo "PASS: models-mlflow-promote"
