#!/usr/bin/env bash
# The MLflow registry decides what is served, with a real `mlflow server` that serves
# artifacts (tests/lib/mlflow.sh, MLFLOW_SERVE_ARTIFACTS=1) and a real model on a real server
# (SmolLM2-135M GGUF on llama.cpp's server from llama-cpp-python), run by a test agent of its
# own whose agent.toml has no [[models]] entry for it and is never edited while it serves:
#   1. a registered model whose version's artifacts hold the GGUF, tagged served_by=gateway,
#      gpuhub.template=llama-cpp-python, gpuhub.resources=shards=1,vram_gib=0.5 and
#      gpuhub.name, with @production set, answers through the gateway within one registry poll;
#      the worker runs on the downloaded copy in the content-addressed cache (same SHA-256 as
#      the original), its version is @production's;
#   2. a model tagged with a template that does not exist is not served: `gpuhub models
#      registry` and the agent's log name the model, the tag and the fix;
#   3. a reload of an agent.toml that does not validate (`gpuhub models reload`) changes
#      nothing and says why (exit 2); a valid one (SIGHUP) adds its [[models]] entry;
#   4. removing served_by=gateway (MLflow's REST API) retires the name: calls get the names
#      lifecycle's answer ("retired ... no longer tagged served_by=gateway"), not a bare 404,
#      and the worker's Slurm job ends.
# Throughout, agent.toml's [roles] names the tagged model (mlchat = the served name): before the
# registry serves it, and after it is untagged, calls to the role get 503 role_model_not_served
# naming the model and the fix (a warning in the log, `gpuhub doctor` fails `roles`); while it is
# served, the role answers, and jobs get MLCHAT_MODEL from the start.
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

PORT="${GPUHUB_TEST_MLFLOW_PORT:-5079}"
# A fresh store each run: registered models (and their 100 MB GGUF copies) of earlier runs
# would pile up, and their tags would be polled too.
rm -rf "/var/tmp/gpuhub-mlflow-$PORT"
MLFLOW_SERVE_ARTIFACTS=1 mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT"
STAMP="$(date +%s)-$$"
REG="gpuhub-test-serve-$STAMP"
SERVED="mt-smol-$STAMP"
BAD="gpuhub-test-badtag-$STAMP"
POLL_S=2
# An allow-list entry no registry read serves (a typo): agent.toml cannot be checked for it.
TYPO="mt-smoll-$STAMP"

# No [[models]] entry: the site's llama-cpp-python template (as tests/lab/agent.toml runs the
# server: the lab's venv on PATH, one thread, a passive OpenMP wait) is all agent.toml says.
models_setup "" "[mlflow]
tracking_uri = \"$MLFLOW_URL\"
registry_poll_s = $POLL_S
[templates.llama-cpp-python]
command = \"python3 -m llama_cpp.server --model {model_file} --model_alias {model} --host {host} --port {port} --n_threads 1 --n_threads_batch 1 --n_ctx 2048 --verbose false\"
env = { PATH = \"/opt/gpuhub-lab/llama-venv/bin:/usr/bin:/bin\", OMP_WAIT_POLICY = \"PASSIVE\", OMP_NUM_THREADS = \"1\" }
[roles]
mlchat = \"$SERVED\"
[gateway.user_models]
nobody = [\"$SERVED\", \"$TYPO\"]"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")
cp "$MT_DIR/agent.toml" "$MT_DIR/agent.toml.orig"
# roles_check: gpuhub doctor's `roles` check, as "ok|detail".
roles_check() { "${CLI[@]}" doctor --json 2>/dev/null | jq -r '.[] | select(.name == "roles") | "\(.ok)|\(.detail)"'; }
# allowed_check: gpuhub doctor's `user-models` check, as "ok|detail".
allowed_check() { "${CLI[@]}" doctor --json 2>/dev/null | jq -r '.[] | select(.name == "user-models") | "\(.ok)|\(.detail)"'; }
# unserved_gauge: the agent's gpuhub_roles_unserved on its metrics endpoint.
unserved_gauge() { curl -sf --max-time 5 "http://$MT_METRICS/metrics" | awk '$1 == "gpuhub_roles_unserved" { print $2 }'; }
# gauge_is N WHEN: gpuhub_roles_unserved reads N within 5 s (it is set after the catalog changes).
gauge_is() {
    local i
    for ((i = 0; i < 25; i++)); do [ "$(unserved_gauge)" = "$1" ] && return; sleep 0.2; done
    models_fail "gpuhub_roles_unserved $2: expected $1, got '$(unserved_gauge)'"
}

echo "== 0. [roles] mlchat names $SERVED, which no registry poll serves yet: 503 naming it, a warning, doctor fails"
models_call mlchat
[ "$MC_STATUS" = 503 ] && [ "$(jq -r .error.code <<<"$MC_BODY")" = role_model_not_served ] ||
    models_fail "a call to the role mlchat before $SERVED is served: expected 503 role_model_not_served, got $MC_STATUS: $MC_BODY"
jq -r .error.message <<<"$MC_BODY" | grep -F "role \`mlchat\` is assigned \`$SERVED\`, which this node does not serve now" | grep -qF "gpuhub roles set mlchat MODEL" ||
    models_fail "the 503 for mlchat does not name the role, its model and the fix: $MC_BODY"
logged_unserved() { grep -F "a role's model is not served on this node" "$MT_DIR/agent.log" | grep -qF "mlchat -> $SERVED"; }
for ((i = 0; i < 50; i++)); do logged_unserved && break; sleep 0.2; done
logged_unserved || models_fail "the agent did not log that role mlchat's model $SERVED is not served"
[[ "$(roles_check)" == "false|not served now: mlchat -> $SERVED" ]] || models_fail "gpuhub doctor's roles check: $(roles_check)"
gauge_is 1 "with mlchat's model not served"
[[ "$(allowed_check)" == "false|"*"nobody: $SERVED; nobody: $TYPO" ]] || models_fail "gpuhub doctor's user-models check before $SERVED is served: $(allowed_check)"
"${CLI[@]}" env | grep -qx "MLCHAT_MODEL=$SERVED" || models_fail "gpuhub env does not give jobs MLCHAT_MODEL=$SERVED: $("${CLI[@]}" env)"
echo "ok: $MC_STATUS $(jq -r .error.message <<<"$MC_BODY" | cut -c1-100)..."

echo "== 1. registering $REG (artifacts: the GGUF), tagged for the gateway as $SERVED, @production -> 1"
"$PY" - "$MLFLOW_URL" "$REG" "$SERVED" "$GGUF" "$BAD" <<'PYEOF' || models_fail "registering the model in MLflow failed"
import sys, mlflow
from mlflow import MlflowClient
uri, name, served, gguf, bad = sys.argv[1:6]
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("gpuhub-serve-test")
c = MlflowClient()
with mlflow.start_run() as r:
    mlflow.log_artifact(gguf, artifact_path="model")
src = f"{r.info.artifact_uri}/model"
assert src.startswith("mlflow-artifacts:"), f"the artifacts are not served by the tracking server: {src}"
c.create_registered_model(name, tags={
    "served_by": "gateway",
    "gpuhub.template": "llama-cpp-python",
    "gpuhub.resources": "shards=1,vram_gib=0.5",
    "gpuhub.name": sys.argv[3],
})
mv = c.create_model_version(name, source=src, run_id=r.info.run_id)
c.set_registered_model_alias(name, "production", mv.version)
c.create_registered_model(bad, tags={"served_by": "gateway", "gpuhub.template": "no-such-template", "gpuhub.resources": "shards=1,vram_gib=0.5"})
print("registered", name, "version", mv.version, "from", src)
PYEOF

# Within one poll (plus the time to start the worker and load the model).
t0=$(date +%s)
for ((i = 0; i < 4 * POLL_S + 4; i++)); do
    "${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m)' >/dev/null && break
    sleep 0.5
done
"${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m)' >/dev/null ||
    models_fail "$SERVED is not in the catalog $((POLL_S * 2 + 2)) s after it was tagged (registry_poll_s = $POLL_S)"
echo "in the catalog after $(($(date +%s) - t0)) s"
MC_TIMEOUT=180 models_call "$SERVED" "What is the capital of France? Answer in one word."
[ "$MC_STATUS" = 200 ] || models_fail "calling $SERVED: expected 200, got $MC_STATUS: $MC_BODY"
echo "$MC_BODY" | jq -e '.choices[0].message.content | length > 0' >/dev/null || models_fail "no answer from $SERVED: $MC_BODY"
echo "answered: $(echo "$MC_BODY" | jq -c '.choices[0].message.content')"
[ "$(models_field "$SERVED" version)" = 1 ] || models_fail "$SERVED serves version '$(models_field "$SERVED" version)', expected @production = 1"

# Served from the downloaded artifacts: the cache holds the same bytes, and the worker's
# command line names the cached file.
cached="$(find "$MT_DIR/state/mlflow-cache" -path '*/sha256-*/SmolLM2-135M-Instruct.Q4_1.gguf' | head -n1)"
[ -n "$cached" ] || models_fail "no downloaded copy of the GGUF under $MT_DIR/state/mlflow-cache"
[ "$(sha256sum < "$cached")" = "$(sha256sum < "$GGUF")" ] || models_fail "the cached copy $cached differs from the original"
[ -z "$(find "$MT_DIR/state/mlflow-cache/partial" -mindepth 1 2>/dev/null)" ] || models_fail "a partial download was left in the cache"
pgrep -af 'llama_cpp.server' | grep -F -- "--model $cached" >/dev/null ||
    models_fail "no llama_cpp.server runs on $cached: $(pgrep -af llama_cpp.server || echo none)"
echo "ok: served from $cached"
models_call mlchat "Say hi."
[ "$MC_STATUS" = 200 ] || models_fail "the role mlchat, now served by $SERVED, answered $MC_STATUS: $MC_BODY"
[[ "$(roles_check)" == true\|* ]] || models_fail "gpuhub doctor's roles check after $SERVED is served: $(roles_check)"
grep -qF "every assigned role's model is served again" "$MT_DIR/agent.log" || models_fail "the agent did not log that role mlchat is served again"
gauge_is 0 "once mlchat's model is served"
# The allow-list's typo stays: a warning naming the user and the name, and doctor fails.
[[ "$(allowed_check)" == "false|"*": nobody: $TYPO" ]] || models_fail "gpuhub doctor's user-models check once $SERVED is served: $(allowed_check)"
grep -F "an allow-list names a model that is not served here" "$MT_DIR/agent.log" | tail -n1 | grep -qF "entries=nobody: $TYPO" ||
    models_fail "the agent did not log the allow-list entry nobody: $TYPO as not served: $(grep -F 'allow-list names' "$MT_DIR/agent.log" | tail -n1)"
echo "ok: the role mlchat ([roles] in agent.toml) is served by $SERVED from the registry"

echo "== 2. a bad tag is reported with the model, the tag and the fix"
out="$("${CLI[@]}" models registry)"
echo "$out"
echo "$out" | grep -F "not served: MLflow registered model \`$BAD\`: tag \`gpuhub.template\`: \`no-such-template\` is not a template here" >/dev/null ||
    models_fail "gpuhub models registry does not explain why $BAD is not served"
echo "$out" | grep -F "[templates.no-such-template]" >/dev/null || models_fail "the registry listing names no fix for $BAD"
grep -F "$BAD" "$MT_DIR/agent.log" | grep -F "gpuhub.template" >/dev/null || models_fail "the agent did not log the bad tag of $BAD"
[ "$(grep -F "a registry-tagged model is not served" "$MT_DIR/agent.log" | grep -cF "model=$BAD ")" -le 1 ] ||
    models_fail "the bad tag was logged at every poll, not once"

echo "== 3. reloads: a file that does not validate changes nothing; SIGHUP applies a valid one"
printf '[[models]]\nname = "mt-static"\nlauncher = "static"\nurl = "http://127.0.0.1:9"\nidle_timout_s = 5\n' >> "$MT_DIR/agent.toml"
set +e
out="$("${CLI[@]}" models reload 2>&1)"; rc=$?
set -e
echo "$out"
[ "$rc" = 2 ] || models_fail "reloading an invalid agent.toml: expected exit 2, got $rc"
echo "$out" | grep -F "unknown field \`idle_timout_s\`" >/dev/null && echo "$out" | grep -F "running catalog is unchanged" >/dev/null ||
    models_fail "the refused reload does not say what is wrong and that nothing changed: $out"
"${CLI[@]}" models list --json | jq -e '.models[] | select(.name == "mt-static")' >/dev/null && models_fail "a refused reload changed the catalog"
"${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m and .state == "ready")' >/dev/null ||
    models_fail "a refused reload disturbed $SERVED"
cp "$MT_DIR/agent.toml.orig" "$MT_DIR/agent.toml"
printf '[[models]]\nname = "mt-static"\nlauncher = "static"\nurl = "http://127.0.0.1:9"\n' >> "$MT_DIR/agent.toml"
kill -HUP "$(cat "$MT_DIR/agent.pid")"
for ((i = 0; i < 50; i++)); do
    "${CLI[@]}" models list --json | jq -e '.models[] | select(.name == "mt-static")' >/dev/null && break
    sleep 0.1
done
"${CLI[@]}" models list --json | jq -e '.models[] | select(.name == "mt-static")' >/dev/null || models_fail "SIGHUP did not add mt-static"
"${CLI[@]}" models list --json | jq -e --arg m "$SERVED" '.models[] | select(.name == $m and .state == "ready")' >/dev/null ||
    models_fail "the reload restarted or dropped $SERVED (its entry did not change)"
echo "ok: SIGHUP added mt-static, $SERVED kept serving"

echo "== 4. untagging retires the name through the names lifecycle"
curl -sf --max-time 5 -X DELETE -H 'content-type: application/json' \
    -d "$(jq -nc --arg n "$REG" '{name: $n, key: "served_by"}')" \
    "$MLFLOW_URL/api/2.0/mlflow/registered-models/delete-tag" >/dev/null || models_fail "cannot delete the served_by tag"
for ((i = 0; i < 4 * POLL_S + 4; i++)); do
    models_call "$SERVED"
    [ "$MC_STATUS" != 200 ] && break
    sleep 0.5
done
echo "after untagging: $MC_STATUS $MC_BODY"
case "$MC_STATUS" in 404 | 410) ;; *) models_fail "a call to the untagged $SERVED: expected the retired answer (404/410), got $MC_STATUS: $MC_BODY" ;; esac
echo "$MC_BODY" | jq -r .error.message | grep -F "\`$SERVED\` was retired" | grep -F "no longer tagged served_by=gateway" >/dev/null ||
    models_fail "the refusal does not say what happened: $MC_BODY"
"${CLI[@]}" names list --json 2>/dev/null | jq -e --arg m "$SERVED" '.. | objects | select(.name? == $m and .state? == "retired")' >/dev/null ||
    models_fail "gpuhub names list does not show $SERVED retired"
models_call mlchat
[ "$MC_STATUS" = 503 ] && [ "$(jq -r .error.code <<<"$MC_BODY")" = role_model_not_served ] ||
    models_fail "a call to the role mlchat after $SERVED was untagged: expected 503 role_model_not_served, got $MC_STATUS: $MC_BODY"
gauge_is 1 "after $SERVED was untagged"
for ((i = 0; i < 300; i++)); do
    [ -z "$(models_jobs "$SERVED")" ] && break
    sleep 0.1
done
[ -z "$(models_jobs "$SERVED")" ] || models_fail "the worker job of the untagged $SERVED still runs: $(models_jobs "$SERVED")"
echo "PASS: models-mlflow-serve"
