#!/usr/bin/env bash
# SPANK plugin + a real MLflow: a plain `mlflow` client (PyPI, from the repo venv) run under
# srun with nothing but the injected environment (MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME,
# MLFLOW_RUN_CONTEXT) logs a run tagged with its Slurm job id, user, partition and GPUs, in a
# real `mlflow server` this test starts (tests/lib/mlflow.sh) on a private port.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
. "$(dirname "$0")/../lib/mlflow.sh"
lab_require
PORT="${GPUHUB_TEST_MLFLOW_PORT:-5077}"
mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT"
spank_fixture "$MLFLOW_URL"
cd "$T"
EXP="spank-test-$$-$RANDOM"

# The client sees only what the job environment has: the test sets no MLFLOW_* variable.
unset MLFLOW_TRACKING_URI MLFLOW_EXPERIMENT_NAME MLFLOW_EXPERIMENT_ID MLFLOW_RUN_CONTEXT MLFLOW_TAGS MLFLOW_RUN_ID
cat > "$T/run.py" <<'PY'
import os, mlflow
print("JOB", os.environ["SLURM_JOB_ID"])
print("URI", os.environ.get("MLFLOW_TRACKING_URI"), "EXP", os.environ.get("MLFLOW_EXPERIMENT_NAME"))
with mlflow.start_run() as run:
    mlflow.log_param("source", "spank-mlflow.sh")
    mlflow.log_metric("loss", 0.5)
    print("RUN_ID", run.info.run_id)
PY
lab_run timeout 180 srun -N1 -t 3 --gres=shard:2 --mlflow-experiment="$EXP" "$MLFLOW_REPO/.venv/bin/python" "$T/run.py"
[ "$LAB_RC" = 0 ] || lab_fail "the mlflow client failed under srun"
run_id="$(sed -n 's/^RUN_ID //p' <<<"$LAB_OUT")"
[ -n "$run_id" ] || lab_fail "no run id printed"
job="$(sed -n 's/^JOB //p' <<<"$LAB_OUT")"
[ -n "$job" ] || lab_fail "no job id printed"

echo "+ GET $MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=$run_id"
run="$(curl -sf --max-time 10 "$MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=$run_id")" || lab_fail "runs/get failed"
tags="$(jq -c '[.run.data.tags[] | {(.key): .value}] | add' <<<"$run")"
echo "  tags: $tags"
[ "$(jq -r '."slurm.job_id"' <<<"$tags")" = "$job" ] || lab_fail "run $run_id has slurm.job_id=$(jq -r '."slurm.job_id"' <<<"$tags"), expected $job"
[ "$(jq -r '."slurm.user"' <<<"$tags")" = "root" ] || lab_fail "run lacks slurm.user=root"
[ "$(jq -r '."slurm.partition"' <<<"$tags")" = "gpu" ] || lab_fail "run lacks slurm.partition=gpu"
[ "$(jq -r '."slurm.shards"' <<<"$tags")" = "2" ] || lab_fail "run lacks slurm.shards=2"
jq -e '."slurm.gpus" | test("^[01]$")' <<<"$tags" >/dev/null || lab_fail "run lacks slurm.gpus"

echo "+ runs/search in experiment $EXP for tags.\`slurm.job_id\` = '$job'"
exp_id="$(curl -sf --max-time 10 "$MLFLOW_URL/api/2.0/mlflow/experiments/get-by-name?experiment_name=$EXP" | jq -r .experiment.experiment_id)"
[ -n "$exp_id" ] && [ "$exp_id" != null ] || lab_fail "experiment $EXP (from --mlflow-experiment) does not exist"
found="$(curl -sf --max-time 10 -X POST "$MLFLOW_URL/api/2.0/mlflow/runs/search" -H 'content-type: application/json' \
    -d "{\"experiment_ids\":[\"$exp_id\"],\"filter\":\"tags.\`slurm.job_id\` = '$job'\"}" | jq -r '.runs[].info.run_id')"
[ "$found" = "$run_id" ] || lab_fail "search by slurm.job_id found '$found', expected $run_id"
lab_node_ok
echo "PASS: spank-mlflow"
