#!/usr/bin/env bash
# MLflow-driven versions on the real Slurm lab with a real `mlflow server` (tests/lib/mlflow.sh):
#   - the worker serves the version `@production` points at when it starts;
#   - `gpuhub models promote` is eval-gated: a version below the catalog's threshold is refused
#     with the reason (exit 1), a passing one moves the alias (exit 0);
#   - the running worker is switched to the promoted version (a second worker, the old one
#     drained), and the next start serves it too, with no agent restart; the model runs two
#     replicas (min_replicas = 2): the one still on the old version drains and stops after the
#     switch, and a new one starts on the promoted version;
#   - an alias moved in MLflow directly does not change what gpuhub serves (its promotion);
#     `gpuhub models --json` shows the mismatch (tests/system/models-mlflow-promote.sh has more);
#   - registered models tagged served_by=gateway are discovered (`gpuhub models registry`).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
. "$REPO/tests/lib/mlflow.sh"
lab_require
PORT="${GPUHUB_TEST_MLFLOW_PORT:-5078}"
mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT"
PY="$REPO/.venv/bin/python"
NAME="gpuhub-test-mt-$(date +%s)-$$"

echo "== registering $NAME: v1 accuracy 0.9, v2 0.5, v3 0.95; @production -> 1"
"$PY" - "$MLFLOW_URL" "$NAME" <<'PYEOF' || { echo "FAIL: registering test versions in MLflow failed" >&2; exit 1; }
import sys, mlflow
from mlflow import MlflowClient
uri, name = sys.argv[1], sys.argv[2]
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("gpuhub-models-test")
c = MlflowClient()
c.create_registered_model(name, tags={"served_by": "gateway"})
for acc in (0.9, 0.5, 0.95):
    with mlflow.start_run() as r:
        mlflow.log_metric("accuracy", acc)
    mv = c.create_model_version(name, source=f"runs:/{r.info.run_id}/model", run_id=r.info.run_id)
    print("version", mv.version, "accuracy", acc)
c.set_registered_model_alias(name, "production", "1")
PYEOF

alias_version() {
    curl -s --max-time 5 -G "$MLFLOW_URL/api/2.0/mlflow/registered-models/alias" --data-urlencode "name=$NAME" \
        --data-urlencode alias=production | jq -r .model_version.version
}

models_setup "
[[models]]
name = \"mt-reg\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --version {version} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { shards = 1, vram_gib = 1.0 }
mlflow_model = \"$NAME\"
eval_metric = \"accuracy\"
eval_threshold = 0.8
idle_timeout_s = 600
load_timeout_s = 60
min_replicas = 2
max_replicas = 2

[[models]]
name = \"mt-reg-b\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --version {version} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { shards = 1, vram_gib = 1.0 }
mlflow_model = \"$NAME\"
idle_timeout_s = 600
load_timeout_s = 60
" "[mlflow]
tracking_uri = \"$MLFLOW_URL\""
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")

# expect_version VERSION WHAT [MODEL]: a call to MODEL (default mt-reg) is served by VERSION.
expect_version() {
    local m="${3:-mt-reg}"
    models_call "$m" "$2"
    [ "$MC_STATUS" = 200 ] || models_fail "$2: expected 200, got $MC_STATUS: $MC_BODY"
    echo "$MC_BODY" | grep -q "$m version $1:" || models_fail "$2: expected $m version $1, got: $(echo "$MC_BODY" | jq -r '.choices[0].message.content')"
    echo "   ok: $2 served by $m version $1"
}

# replicas_json: mt-reg's replicas as [{state, version, job_id}].
replicas_json() {
    "${CLI[@]}" models list --json | jq -c '[.models[] | select(.name == "mt-reg") | .replicas[]? | {state, version, job_id}]'
}
# wait_replicas VERSION: until mt-reg runs exactly two replicas, both ready on VERSION (60 s).
wait_replicas() {
    local i
    for ((i = 0; i < 300; i++)); do
        replicas_json | jq -e --arg v "$1" 'length == 2 and all(.[]; .state == "ready" and .version == $v)' >/dev/null && return 0
        sleep 0.2
    done
    return 1
}

echo "== the first start serves @production, on two replicas (min_replicas = 2)"
expect_version 1 "first start"
wait_replicas 1 || models_fail "mt-reg should run two ready replicas of version 1, has: $(replicas_json)"
old_jobs="$(replicas_json | jq -r '.[].job_id' | sort)"
echo "   ok: replicas $(echo "$old_jobs" | paste -sd' ') on version 1"
expect_version 1 "mt-reg-b, another catalog entry of the same registered model" mt-reg-b

echo "== promote a version that fails the eval gate"
lab_run "${CLI[@]}" models promote mt-reg 2
[ "$LAB_RC" = 1 ] || models_fail "promoting v2 (accuracy 0.5 < 0.8) should exit 1, got $LAB_RC"
echo "$LAB_OUT" | grep -q 'accuracy = 0.5, below the threshold 0.8' || models_fail "the refusal should say why: $LAB_OUT"
[ "$(alias_version)" = 1 ] || models_fail "a refused promotion moved the alias to $(alias_version)"

echo "== promote a version that passes"
lab_run "${CLI[@]}" models promote mt-reg 3
[ "$LAB_RC" = 0 ] || models_fail "promoting v3 (accuracy 0.95) should succeed, got exit $LAB_RC"
[ "$(alias_version)" = 3 ] || models_fail "the alias should point at 3, points at $(alias_version)"
echo "$LAB_OUT" | grep -q 'switched:' || models_fail "the running worker should be switched to version 3: $LAB_OUT"
echo "$LAB_OUT" | grep -qF '1 further replica(s) on version 1 drain and stop' ||
    models_fail "the promotion should say the other replica (version 1) drains and stops: $LAB_OUT"
expect_version 3 "the running worker was switched"
wait_replicas 3 || models_fail "after the promotion mt-reg should run two ready replicas of version 3, has: $(replicas_json)"
for j in $old_jobs; do
    for ((i = 0; i < 100; i++)); do
        squeue -h -j "$j" -t PD,R,CG 2>/dev/null | grep -q . || break
        sleep 0.1
    done
    squeue -h -j "$j" -t PD,R,CG 2>/dev/null | grep -q . && models_fail "Slurm job $j (a version 1 replica) still runs after the promotion"
    replicas_json | jq -e --arg j "$j" 'any(.[]; .job_id == $j)' >/dev/null && models_fail "job $j of version 1 is still listed as a replica: $(replicas_json)"
done
for n in 1 2 3 4; do expect_version 3 "call $n after the promotion"; done
echo "$LAB_OUT" | grep -qF '`mt-reg-b` (the same registered model) switched:' ||
    models_fail "the promotion should switch mt-reg-b's running worker too: $LAB_OUT"
expect_version 3 "mt-reg-b's running worker was switched too" mt-reg-b
echo "   ok: both replicas serve version 3 ($(replicas_json | jq -r '.[].job_id' | paste -sd' ')); the version 1 jobs ended"
lab_run "${CLI[@]}" models unload mt-reg
expect_version 3 "the next start"

echo "== the alias moved in MLflow directly does not change what gpuhub serves"
curl -sf --max-time 5 -X POST -H 'content-type: application/json' \
    -d "{\"name\": \"$NAME\", \"alias\": \"production\", \"version\": \"1\"}" "$MLFLOW_URL/api/2.0/mlflow/registered-models/alias" >/dev/null
lab_run "${CLI[@]}" models unload mt-reg
expect_version 3 "a start after the alias moved behind gpuhub's back"
for ((i = 0; i < 70; i++)); do
    [ "$(models_field mt-reg alias_mismatch)" = true ] && break
    sleep 0.5
done
[ "$(models_field mt-reg alias_mismatch)" = true ] || models_fail "gpuhub models --json does not show the alias mismatch"

echo "== discovery: served_by=gateway"
lab_run "${CLI[@]}" models registry --json
echo "$LAB_OUT" | jq -e --arg n "$NAME" '.registered[] | select(.name == $n and .production == "1" and (.served_as | index("mt-reg")))' >/dev/null \
    || models_fail "gpuhub models registry should list $NAME (production 1, served as mt-reg)"
echo "PASS models-mlflow"
