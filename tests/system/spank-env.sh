#!/usr/bin/env bash
# SPANK plugin, environment injection rules:
# - a value the user set (MLFLOW_TRACKING_URI, OPENAI_API_KEY, OCR_MODEL) is kept;
# - --mlflow-experiment from the command line and from an #SBATCH line (and the srun steps
#   inside that batch job inherit it); it overrides the site default;
# - --gpuhub-no-inject and GPUHUB_NO_INJECT=1 opt out (records are still written);
# - the token is an HMAC-SHA256 over "ghj1.<uid>.<user>.<job>.<expiry>" with the node key;
# - without a snapshot: the plugstack role.* fallbacks; without both: no <ROLE>_MODEL and one log line;
# - without the key: no token, the job runs.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
cd "$T"
PRINT='echo JOB=$SLURM_JOB_ID; env | grep -E "^(GPUHUB|OPENAI|MLFLOW|[A-Z_]+_MODEL)" | sort'
val() { sed -n "s/^$1=//p" <<<"$LAB_OUT" | head -n1; }

echo "== user-set values win"
lab_run env MLFLOW_TRACKING_URI=http://user.example:1 OPENAI_API_KEY=sk-user OCR_MODEL=my-ocr \
    timeout 120 srun -N1 -t 2 bash -c "$PRINT"
[ "$LAB_RC" = 0 ] || lab_fail "srun failed"
[ "$(val MLFLOW_TRACKING_URI)" = "http://user.example:1" ] || lab_fail "user's MLFLOW_TRACKING_URI overwritten: $(val MLFLOW_TRACKING_URI)"
[ "$(val OPENAI_API_KEY)" = "sk-user" ] || lab_fail "user's OPENAI_API_KEY overwritten"
[ "$(val OCR_MODEL)" = "my-ocr" ] || lab_fail "user's OCR_MODEL overwritten"
[ -n "$(val GPUHUB_TOKEN)" ] || lab_fail "GPUHUB_TOKEN missing"
echo "ok"

echo "== token verifies with the node key (HMAC-SHA256)"
tok="$(val GPUHUB_TOKEN)"
python3 - "$T_KEY" "$tok" <<'PY' || lab_fail "token does not verify"
import hmac, hashlib, sys, time
key = open(sys.argv[1], "rb").read()
body, sig = sys.argv[2].rsplit(".", 1)
assert hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(), sig), "bad MAC"
exp = int(body.split(".")[4])
assert exp > time.time() + 3600, f"expiry {exp} too soon"
print("  token verifies; expires in", exp - int(time.time()), "s")
PY
echo "ok"

echo "== --mlflow-experiment on srun overrides the site default"
lab_run timeout 120 srun -N1 -t 2 --mlflow-experiment="exp one" bash -c "$PRINT"
[ "$(val MLFLOW_EXPERIMENT_NAME)" = "exp one" ] || lab_fail "MLFLOW_EXPERIMENT_NAME=$(val MLFLOW_EXPERIMENT_NAME), expected 'exp one'"
echo "ok"

echo "== #SBATCH --mlflow-experiment, inherited by srun inside the batch script"
cat > "$T/job.sh" <<'SH'
#!/bin/bash
#SBATCH --mlflow-experiment=from-sbatch
#SBATCH -t 2
echo "BATCH_EXP=$MLFLOW_EXPERIMENT_NAME"
srun bash -c 'echo "STEP_EXP=$MLFLOW_EXPERIMENT_NAME"; echo "STEP_JOB=$(echo "$MLFLOW_RUN_CONTEXT" | grep -o "slurm.job_id[^,]*")"'
SH
lab_run sbatch --parsable -o "$T/job.out" "$T/job.sh"
job="${LAB_OUT%%;*}"
lab_wait_job "$job" 60 || lab_fail "batch job $job did not finish in 60 s"
cat "$T/job.out" | sed 's/^/  | /'
grep -qx "BATCH_EXP=from-sbatch" "$T/job.out" || lab_fail "batch script lacks MLFLOW_EXPERIMENT_NAME=from-sbatch"
grep -qx "STEP_EXP=from-sbatch" "$T/job.out" || lab_fail "srun step inside the batch job lacks MLFLOW_EXPERIMENT_NAME=from-sbatch"
grep -q "STEP_JOB=slurm.job_id\":\"$job\"" "$T/job.out" || lab_fail "step inside the batch job lacks the job's run context"
echo "ok"

echo "== invalid --mlflow-experiment is a clear user error"
lab_run timeout 120 srun -N1 -t 2 --mlflow-experiment="$(printf 'bad\tname')" true
[ "$LAB_RC" != 0 ] || lab_fail "srun accepted a control character in --mlflow-experiment"
grep -q "mlflow-experiment" <<<"$LAB_OUT" || lab_fail "the error does not name --mlflow-experiment"
echo "ok"

echo "== --gpuhub-no-inject and GPUHUB_NO_INJECT=1 opt out; records are still written"
for how in "--gpuhub-no-inject" "env"; do
    if [ "$how" = env ]; then
        lab_run env GPUHUB_NO_INJECT=1 timeout 120 srun -N1 -t 2 bash -c "$PRINT"
    else
        lab_run timeout 120 srun -N1 -t 2 --gpuhub-no-inject bash -c "$PRINT"
    fi
    [ "$LAB_RC" = 0 ] || lab_fail "$how: srun failed"
    if grep -qE '^(GPUHUB_URL|GPUHUB_TOKEN|MLFLOW_TRACKING_URI|OCR_MODEL)=' <<<"$LAB_OUT"; then lab_fail "$how: variables injected despite the opt-out"; fi
    job="$(val JOB)"
    lab_wait_record "$T_SPOOL" "$job" step_end 30 || lab_fail "$how: no step_end record for job $job"
    lab_wait_record "$T_SPOOL" "$job" step_start 5 || lab_fail "$how: no step_start record for job $job"
done
echo "ok"

echo "== no snapshot: plugstack role.* fallback; no key: no token, job runs"
plugstack_set "spool_dir=$T_SPOOL" "snapshot=$T/missing.json" "job_key=$T/missing.key" "role.ocr=static-ocr" "mlflow_uri=http://127.0.0.1:5999"
lab_run timeout 120 srun -N1 -t 2 bash -c "$PRINT"
[ "$LAB_RC" = 0 ] || lab_fail "srun failed without snapshot and key"
[ "$(val OCR_MODEL)" = "static-ocr" ] || lab_fail "OCR_MODEL=$(val OCR_MODEL), expected the static fallback"
[ "$(val MLFLOW_TRACKING_URI)" = "http://127.0.0.1:5999" ] || lab_fail "mlflow_uri fallback not used"
if grep -q '^GPUHUB_TOKEN=' <<<"$LAB_OUT"; then lab_fail "a token was minted without a key"; fi
job="$(val JOB)"
grep -q "no gateway token for job $job: cannot open $T/missing.key" "$LAB_SLURMD_LOG" || lab_fail "no log line about the missing key for job $job"
echo "ok"

echo "== neither snapshot nor role.*: no <ROLE>_MODEL and one log line"
plugstack_set "spool_dir=$T_SPOOL" "snapshot=$T/missing.json" "job_key=$T_KEY"
lab_run timeout 120 srun -N1 -t 2 bash -c "$PRINT"
[ "$LAB_RC" = 0 ] || lab_fail "srun failed"
if grep -q '_MODEL=' <<<"$LAB_OUT"; then lab_fail "role variables injected without snapshot or fallback"; fi
job="$(val JOB)"
n="$(grep -c "no role models for job $job:" "$LAB_SLURMD_LOG" || true)"
[ "$n" = 1 ] || lab_fail "expected exactly one 'no role models' line for job $job, got $n"
lab_node_ok
echo "PASS: spank-env"
