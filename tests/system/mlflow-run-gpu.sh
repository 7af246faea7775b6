#!/usr/bin/env bash
# timeout: 420
# GPU use on the MLflow run page, end to end. Two real Slurm jobs (--gres=shard:7 each, on the
# same GPU: a whole-GPU job holds the other) each log an MLflow run through nothing but the
# environment the SPANK plugin injects (MLFLOW_TRACKING_URI from the agent's snapshot,
# MLFLOW_EXPERIMENT_NAME, MLFLOW_RUN_CONTEXT with slurm.job_id), against a real `mlflow server`.
# The experiment is the site's default (mlflow.default_experiment): the agent creates it before
# any job runs, so the two jobs start their runs in the same instant (MLflow's client would race
# to create a missing one: RESOURCE_ALREADY_EXISTS).
# A private gpuhub-agent reads two fake H200s (tests/fake-nvml) scripted with the jobs' PIDs:
# job a's process holds 6 GiB at 60 % SM, b's 3 GiB at 30 %, and the shared GPU's energy
# counter (power 0) jumps once by 360 J while both are listed: a's share is 240 J, b's 120 J.
# MLflow is stopped before the jobs end, so the agent's first tries fail (logged); it comes back
# and the agent's retry logs the figures. Asserted on each run, compared as numbers:
#   gpuhub.gpuN.utilization_mean_pct = 60 / 30, vram_peak_gib = 6 / 3, energy_wh = 240/3600 /
#   120/3600, gpuhub.gpuN.shards = 7, the totals, and that they equal `gpuhub job --json`;
# and two hostile runs tagged with a's job id get nothing: one that starts before the job
# (runs/create with an old start_time) and one of another MLflow user.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/lab.sh"   # its EXIT trap replaces telemetry.sh's:
lab_cleanup_add tel_cleanup                          # runs last, before plugstack_restore
. "$(dirname "${BASH_SOURCE[0]}")/../lib/mlflow.sh"
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
[ -x "$cli" ] || lab_fail "$cli missing; run cargo build --release"
tel_init
GIB=$((1024 * 1024 * 1024))
PORT="$(tel_free_port)"
mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT; rm -rf /var/tmp/gpuhub-mlflow-$PORT"
mkdir -p "$T/jobs"
EXP="run-gpu-$$-$RANDOM"
api() { curl -sf --max-time 10 -H 'content-type: application/json' "$@"; }

# ---- the fake GPUs: no processes, energy counters flat (power 0)
declare -A ENERGY=([0]=1000000 [1]=1000000) PROCS=()
write_script() {
    local i
    {
        for i in 0 1; do
            tel_gpu_line "$i" $((2 * GIB)) 40 | sed "s/power_mw=400000 energy_mj=1000 /power_mw=0 energy_mj=${ENERGY[$i]} /"
        done
        for i in "${!PROCS[@]}"; do echo "${PROCS[$i]}"; done
    } > "$T/nvml/conf.tmp"
    mv -f "$T/nvml/conf.tmp" "$T/nvml/fake-nvml.conf"
}
write_script
TEL_JOB_MAP_DIR="" tel_start_agent true "[accounting]
ingest_interval_ms = 200
[mlflow]
tracking_uri = \"$MLFLOW_URL\"
default_experiment = \"$EXP\"
registry_poll_s = 0"
sock="$T/run/agent.sock"
for ((i = 0; i < 100; i++)); do [ -S "$sock" ] && [ -s "$T/run/snapshot.json" ] && break; sleep 0.1; done
[ -S "$sock" ] || tel_fail "no control socket $sock"
jq -e --arg u "$MLFLOW_URL" '.. | strings | select(. == $u)' "$T/run/snapshot.json" >/dev/null \
    || tel_fail "the agent's snapshot does not carry mlflow.tracking_uri $MLFLOW_URL"
exp_id=""
for ((i = 0; i < 100; i++)); do
    exp_id="$(api "$MLFLOW_URL/api/2.0/mlflow/experiments/get-by-name?experiment_name=$EXP" 2>/dev/null | jq -r .experiment.experiment_id)" || exp_id=""
    [ -n "$exp_id" ] && [ "$exp_id" != null ] && break
    sleep 0.2
done
[ -n "$exp_id" ] && [ "$exp_id" != null ] || tel_fail "the agent did not create the site's default experiment $EXP in MLflow within 20 s"
for ((i = 0; i < 50; i++)); do grep -q "the site's default experiment exists" "$T/agent.log" && break; sleep 0.1; done
grep -q "the site's default experiment exists" "$T/agent.log" || tel_fail "the agent did not log that experiment $EXP exists"
echo "  the agent created the site's default experiment $EXP (id $exp_id) before any job"

lab_wait_gpus_free 240
plugstack_set "spool_dir=$T/spool" "snapshot=$T/run/snapshot.json" "job_key=$T/state/job-token.key"

# ---- c holds one whole GPU, so that a and b share the other
srun --gres=gpu:1 -t 3 -J run-gpu-c sh -c "echo \$SLURM_JOB_ID > $T/jobs/c.id; while [ ! -e $T/jobs/c.stop ]; do sleep 0.2; done" \
    >"$T/jobs/c.log" 2>&1 &
lab_cleanup_add "touch $T/jobs/c.stop; kill $! 2>/dev/null || true"
for ((i = 0; i < 120; i++)); do [ -s "$T/jobs/c.id" ] && break; sleep 0.25; done
[ -s "$T/jobs/c.id" ] || { cat "$T/jobs/c.log" >&2; tel_fail "the whole-GPU job did not start"; }
lab_cleanup_add "lab_cancel $(cat "$T/jobs/c.id")"

# The job: a plain mlflow client, no MLFLOW_* set by the test. It ends its run, then waits to
# exit, so the test can stop MLflow before the job (and its report) ends.
unset MLFLOW_TRACKING_URI MLFLOW_EXPERIMENT_NAME MLFLOW_EXPERIMENT_ID MLFLOW_RUN_CONTEXT MLFLOW_TAGS MLFLOW_RUN_ID
cat > "$T/run.py" <<'PY'
import os, sys, time, mlflow
name, d = sys.argv[1], sys.argv[2]
def wait(f):
    while not os.path.exists(f"{d}/{name}.{f}"):
        time.sleep(0.1)
with mlflow.start_run() as run:
    mlflow.log_metric("loss", 0.5)
    with open(f"{d}/{name}.tmp", "w") as f:
        f.write(f"{os.getpid()} {os.environ['SLURM_JOB_ID']} {run.info.run_id}\n")
    os.rename(f"{d}/{name}.tmp", f"{d}/{name}.info")
    wait("stop")
open(f"{d}/{name}.ended", "w").close()
wait("exit")
PY
declare -A JOB PID RUN GPU
for name in a b; do
    echo "+ srun --gres=shard:7 python run.py $name   (the site's default experiment)"
    srun --gres=shard:7 -t 3 -J "run-gpu-$name" "$MLFLOW_REPO/.venv/bin/python" "$T/run.py" "$name" "$T/jobs" \
        >"$T/jobs/$name.log" 2>&1 &
    lab_cleanup_add "touch $T/jobs/$name.stop $T/jobs/$name.exit; kill $! 2>/dev/null || true"
done
for name in a b; do
    for ((i = 0; i < 240; i++)); do [ -s "$T/jobs/$name.info" ] && break; sleep 0.25; done
    [ -s "$T/jobs/$name.info" ] || { cat "$T/jobs/$name.log" >&2; tel_fail "job $name did not start its MLflow run within 60 s"; }
    read -r PID[$name] JOB[$name] RUN[$name] < "$T/jobs/$name.info"
    run_exp="$(api "$MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=${RUN[$name]}" | jq -r .run.info.experiment_id)"
    [ "$run_exp" = "$exp_id" ] || tel_fail "job $name's run ${RUN[$name]} is in experiment $run_exp, not the site's default $EXP ($exp_id)"
    lab_cleanup_add "lab_cancel ${JOB[$name]}"
    j=""
    for ((i = 0; i < 100; i++)); do
        j="$("$cli" --socket "$sock" job "${JOB[$name]}" --json 2>/dev/null)" || j='{}'
        [ "$(jq -r '.nodes[0].gpus | length' <<<"$j")" = 1 ] && break
        sleep 0.2
    done
    GPU[$name]="$(jq -r '.nodes[0].gpus[0].index' <<<"$j")"
    [[ "${GPU[$name]}" =~ ^[01]$ ]] || tel_fail "job $name (${JOB[$name]}): the agent has no single GPU for it: $j"
    echo "  job $name: Slurm job ${JOB[$name]}, pid ${PID[$name]}, GPU ${GPU[$name]}, MLflow run ${RUN[$name]}"
done
gs=${GPU[a]}
[ "${GPU[b]}" = "$gs" ] || tel_fail "the shard jobs are on GPUs ${GPU[a]} and ${GPU[b]}; they must share one"

# ---- hostile runs tagged with a's job id: one started an hour before the job, one of another user
now_ms=$(($(date +%s) * 1000))
hostile() { # START_MS USER
    api -X POST "$MLFLOW_URL/api/2.0/mlflow/runs/create" -d "$(jq -nc --arg e "$exp_id" --argjson t "$1" --arg u "$2" --arg j "${JOB[a]}" \
        '{experiment_id: $e, start_time: $t, user_id: $u, tags: [{key: "slurm.job_id", value: $j}]}')" | jq -r .run.info.run_id
}
EARLY="$(hostile $((now_ms - 3600 * 1000)) root)"
OTHER="$(hostile "$now_ms" mallory)"
[ -n "$EARLY" ] && [ -n "$OTHER" ] || tel_fail "cannot create the hostile runs"

# ---- the measured phase: constant figures, one energy jump while both are listed
PROCS=([a]="proc gpu=$gs pid=${PID[a]} mem=$((6 * GIB)) sm=60" [b]="proc gpu=$gs pid=${PID[b]} mem=$((3 * GIB)) sm=30")
write_script
sleep 2
ENERGY[$gs]=$((ENERGY[$gs] + 360000)); write_script
sleep 2
PROCS=(); write_script
sleep 1
touch "$T/jobs/a.stop" "$T/jobs/b.stop"
for name in a b; do
    for ((i = 0; i < 120; i++)); do [ -e "$T/jobs/$name.ended" ] && break; sleep 0.25; done
    [ -e "$T/jobs/$name.ended" ] || { cat "$T/jobs/$name.log" >&2; tel_fail "job $name did not end its run"; }
done

# ---- MLflow goes away before the jobs end: the figures must wait, not be lost
mlflow_stop "$PORT"
touch "$T/jobs/a.exit" "$T/jobs/b.exit"
for name in a b; do
    for ((i = 0; i < 150; i++)); do
        J="$("$cli" --socket "$sock" job "${JOB[$name]}" --json 2>/dev/null)" || J='{}'
        [ "$(jq -r '.nodes[0].state' <<<"$J")" = ended ] && break
        sleep 0.2
    done
    [ "$(jq -r '.nodes[0].state' <<<"$J")" = ended ] || tel_fail "job $name (${JOB[$name]}) not ended in the agent after 30 s: $J"
    printf '%s\n' "$J" > "$T/job-$name.json"
done
for ((i = 0; i < 60; i++)); do grep -q 'could not be logged' "$T/agent.log" && break; sleep 0.5; done
grep 'mlflow run page' "$T/agent.log" | tail -n 3
grep -q 'could not be logged; they are kept and tried again later' "$T/agent.log" || tel_fail "no log line says MLflow could not be reached"

mlflow_start "$PORT" || lab_fail "mlflow server did not start again"
for ((i = 0; i < 240; i++)); do
    n=0
    for name in a b; do
        api "$MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=${RUN[$name]}" > "$T/run-$name.json" 2>/dev/null || continue
        jq -e '.run.data.metrics // [] | any(.key == "gpuhub.gpu_count")' "$T/run-$name.json" >/dev/null && n=$((n + 1))
    done
    [ "$n" = 2 ] && break
    sleep 0.5
done
[ "$n" = 2 ] || tel_fail "after 120 s the runs do not both carry gpuhub.* metrics"
grep 'mlflow run page' "$T/agent.log" | tail -n 4
sleep 2   # a late (wrong) write on the hostile runs would come in the same pass
api "$MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=$EARLY" > "$T/run-early.json"
api "$MLFLOW_URL/api/2.0/mlflow/runs/get?run_id=$OTHER" > "$T/run-other.json"

python3 - "$T" "$gs" <<'PY' || tel_fail "the runs' GPU metrics differ from what the fake NVML script made the GPUs report (MISMATCH lines above)"
import json, sys
tmp, gs = sys.argv[1], int(sys.argv[2])
def metrics(f):
    return {m["key"]: m["value"] for m in json.load(open(f"{tmp}/{f}"))["run"]["data"].get("metrics", [])}
bad = []
def check(ok, msg):
    print(("ok: " if ok else "MISMATCH: ") + msg)
    if not ok:
        bad.append(msg)
close = lambda a, b, tol: a is not None and abs(a - b) <= tol
# job: (util %, peak GiB, energy J): from the script
want = {"a": (60.0, 6.0, 240.0), "b": (30.0, 3.0, 120.0)}
for name, (util, vram, joules) in want.items():
    m = metrics(f"run-{name}.json")
    g = json.load(open(f"{tmp}/job-{name}.json"))["nodes"][0]["gpus"][0]
    p = f"gpuhub.gpu{gs}."
    check(close(m.get(p + "utilization_mean_pct"), util, 1e-6), f"{name}: {p}utilization_mean_pct = {m.get(p + 'utilization_mean_pct')}, want {util}")
    check(close(m.get(p + "vram_peak_gib"), vram, 1e-9), f"{name}: {p}vram_peak_gib = {m.get(p + 'vram_peak_gib')}, want {vram}")
    check(close(m.get(p + "energy_wh"), joules / 3600, 0.01 / 3600), f"{name}: {p}energy_wh = {m.get(p + 'energy_wh')}, want {joules / 3600:.6f}")
    check(m.get(p + "shards") == 7, f"{name}: {p}shards = {m.get(p + 'shards')}, want 7")
    check(m.get("gpuhub.gpu_count") == 1 and m.get("gpuhub.shards") == 7, f"{name}: gpu_count {m.get('gpuhub.gpu_count')}, shards {m.get('gpuhub.shards')}")
    check(close(m.get("gpuhub.total.energy_wh"), joules / 3600, 0.01 / 3600) and close(m.get("gpuhub.total.vram_peak_gib"), vram, 1e-9)
          and close(m.get("gpuhub.total.utilization_mean_pct"), util, 1e-6), f"{name}: totals {[m.get('gpuhub.total.' + k) for k in ('utilization_mean_pct', 'vram_peak_gib', 'energy_wh')]}")
    check(close(m.get(p + "samples"), g["samples"], 0) and close(m.get(p + "energy_wh"), g["energy_joules"] / 3600, 1e-9)
          and close(m.get(p + "utilization_mean_pct"), g["mean_util"], 1e-9), f"{name}: the run's figures are `gpuhub job`'s ({g})")
    check(m.get("loss") == 0.5, f"{name}: the job's own metric is kept (loss = {m.get('loss')})")
for f in ("run-early.json", "run-other.json"):
    leaked = sorted(k for k in metrics(f) if k.startswith("gpuhub."))
    check(not leaked, f"hostile {f}: no gpuhub metric ({leaked})")
sys.exit(1 if bad else 0)
PY
grep -q 'does not get the job.s GPU figures: it started outside' "$T/agent.log" || tel_fail "the refused early run is not logged"
grep -q 'does not get the job.s GPU figures: its MLflow user is not' "$T/agent.log" || tel_fail "the refused run of another user is not logged"
lab_node_ok
echo "PASS: mlflow-run-gpu"
