#!/usr/bin/env bash
# timeout: 300
# The optional job-hooks build (spank_gpuhub_prolog.so) with PrologFlags=Alloc, as
# slurm-conf/slurm.conf.snippet documents it: Slurm is restarted with that setup for this test and
# restored after. The prolog writes JobStart and the epilog JobEnd for every allocation (srun,
# sbatch, salloc without a step, and after scancel), with the GPUs Slurm gave the job and their
# UUIDs, account and partition from the prolog's environment; JobStart comes before the first
# step's StepStart; the prolog adds the job to the dcgm job map (seen from inside the job) and the
# epilog removes it. The shipped build's behaviour is spank-jobs.sh and spank-dcgm.sh.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
lab_slurm_setup prolog Alloc
cd "$T"

# records_of JOB: wait for its job_end (30 s), print its records.
records_of() {
    lab_wait_record "$T_SPOOL" "$1" job_end 30 || lab_fail "job $1: no job_end record from the epilog"
    lab_records "$T_SPOOL" "$1"
}
# check_job JOB NGPUS: one job_start and one job_end with NGPUS GPUs (UUIDs from the snapshot),
# the root identity, a partition; the start before any step's start.
check_job() {
    local job="$1" ngpus="$2" recs n
    recs="$(records_of "$job")"
    echo "  records of job $job:"; sed 's/^/    /' <<<"$recs"
    for k in job_start job_end; do
        n="$(jq -c --arg k "$k" 'select(.kind == $k)' <<<"$recs" | wc -l)"
        [ "$n" = 1 ] || lab_fail "job $job: expected one $k record, got $n"
        n="$(jq -c --arg k "$k" 'select(.kind == $k) | .gpus | length' <<<"$recs")"
        [ "$n" = "$ngpus" ] || lab_fail "job $job: $k has $n GPUs, expected $ngpus"
    done
    if [ "$ngpus" -gt 0 ]; then
        lab_jq_any 'select(.kind == "job_start") | .gpus | all(.uuid | startswith("GPU-"))' <<<"$recs" \
            || lab_fail "job $job: job_start GPUs lack the snapshot's UUIDs"
    fi
    lab_jq_any 'select(.kind == "job_start") | .user == "root" and .uid == 0 and .node == "gpu01" and .partition != null' <<<"$recs" \
        || lab_fail "job $job: job_start identity or partition wrong"
    RECS="$recs" python3 - <<'PY' || lab_fail "job $job: a step started before the prolog's job_start"
import json, os, sys
recs = [json.loads(l) for l in os.environ["RECS"].splitlines() if l.strip()]
start = min(r["time_us"] for r in recs if r["kind"] == "job_start")
steps = [r["time_us"] for r in recs if r["kind"] == "step_start"]
sys.exit(0 if all(t >= start for t in steps) else 1)
PY
}

echo "== srun --gres=gpu:2: job records, and the prolog's map entry seen from inside the job"
lab_run timeout 120 srun -N1 -t 2 --gres=gpu:2 bash -c "echo JOB=\$SLURM_JOB_ID; for g in 0 1; do echo MAP\$g=\$(tr '\n' ' ' < $T_MAP/\$g); done"
[ "$LAB_RC" = 0 ] || lab_fail "srun failed"
job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
for g in 0 1; do
    grep -qE "^MAP$g=(.* )?$job( |$)" <<<"$LAB_OUT" || lab_fail "job $job not in $T_MAP/$g while it ran (the prolog adds it before the step)"
done
check_job "$job" 2
for g in 0 1; do
    if grep -qx "$job" "$T_MAP/$g"; then lab_fail "job $job still in $T_MAP/$g after its epilog"; fi
done
echo "ok: srun (job $job)"

echo "== sbatch --gres=shard:7: job records and the batch step's shards"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:7 -o /dev/null --wrap 'true'
job="${LAB_OUT%%;*}"
lab_wait_job "$job" 60 || lab_fail "batch job $job did not finish in 60 s"
check_job "$job" 1
lab_records "$T_SPOOL" "$job" | lab_jq_any 'select(.kind == "step_start" and .step_id == 4294967291) | .shards == 7' \
    || lab_fail "job $job: the batch step's record lacks shards 7"
echo "ok: sbatch (job $job)"

echo "== salloc without a step (PrologFlags=Alloc): job records only"
lab_run timeout 120 salloc -N1 -t 2 --gres=gpu:1 bash -c 'echo JOB=$SLURM_JOB_ID'
[ "$LAB_RC" = 0 ] || lab_fail "salloc failed"
job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
check_job "$job" 1
if lab_records "$T_SPOOL" "$job" | lab_jq_any 'select(.kind == "step_start") | true'; then lab_fail "salloc job $job: a step record without a step"; fi
echo "ok: salloc (job $job)"

echo "== scancel: the epilog still writes job_end"
lab_run sbatch --parsable -N1 -t 5 --gres=gpu:1 -o /dev/null --wrap 'srun sleep 600'
job="${LAB_OUT%%;*}"
lab_cleanup_add "lab_cancel $job"
for ((i = 0; i < 150; i++)); do
    lab_records "$T_SPOOL" "$job" | lab_jq_any 'select(.kind == "step_start") | .step_id == 0' && break
    sleep 0.2
done
lab_run scancel "$job"
lab_wait_job "$job" 60 || lab_fail "job $job still queued 60 s after scancel"
check_job "$job" 1
echo "ok: scancel (job $job)"
lab_node_ok
echo "PASS: spank-job-hooks"
