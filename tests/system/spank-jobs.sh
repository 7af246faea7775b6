#!/usr/bin/env bash
# SPANK plugin as shipped (spank_gpuhub.so: no job hooks), the five job shapes: srun
# --gres=gpu:1, --gres=gpu:2, --gres=shard:7, a CPU-only step and an sbatch job. Each must show
# the injected variables and leave step start/end records with the right GPUs (index + UUID from
# the snapshot) and shards, and no job records (job boundaries are slurmctld's, through the
# agent; the job-hooks build is spank-job-hooks.sh). An salloc without a step leaves no record.
# Uses a private spool/snapshot/key (spank_fixture), so a running agent does not ingest them.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
cd "$T"

# check_env OUT JOB: the variables every step gets from the fixture's snapshot and key.
check_env() {
    local out="$1" job="$2" ctx
    grep -qx "GPUHUB_URL=http://127.0.0.1:8400" <<<"$out" || lab_fail "job $job: GPUHUB_URL missing"
    grep -qx "OPENAI_BASE_URL=http://127.0.0.1:8400/v1" <<<"$out" || lab_fail "job $job: OPENAI_BASE_URL missing"
    grep -qx "MLFLOW_TRACKING_URI=http://127.0.0.1:5000" <<<"$out" || lab_fail "job $job: MLFLOW_TRACKING_URI missing"
    grep -qx "MLFLOW_EXPERIMENT_NAME=lab-default" <<<"$out" || lab_fail "job $job: site default experiment missing"
    grep -qx "OCR_MODEL=dots.ocr" <<<"$out" || lab_fail "job $job: OCR_MODEL=dots.ocr missing"
    if grep -q "^TTS_MODEL=" <<<"$out"; then lab_fail "job $job: TTS_MODEL set although the role has no model"; fi
    grep -qE "^GPUHUB_TOKEN=ghj1\.0\.root\.$job\.[0-9]+\.[0-9a-f]{64}$" <<<"$out" || lab_fail "job $job: GPUHUB_TOKEN missing or not for uid 0/root/job $job"
    [ "$(grep '^GPUHUB_TOKEN=' <<<"$out" | cut -d= -f2)" = "$(grep '^OPENAI_API_KEY=' <<<"$out" | cut -d= -f2)" ] \
        || lab_fail "job $job: OPENAI_API_KEY differs from GPUHUB_TOKEN"
    for v in MLFLOW_RUN_CONTEXT MLFLOW_TAGS; do
        ctx="$(grep "^$v=" <<<"$out" | cut -d= -f2-)"
        [ "$(jq -r '."slurm.job_id"' <<<"$ctx")" = "$job" ] || lab_fail "job $job: $v has no slurm.job_id=$job: $ctx"
        [ "$(jq -r '."slurm.user"' <<<"$ctx")" = "root" ] || lab_fail "job $job: $v has no slurm.user: $ctx"
        jq -e 'has("slurm.partition") and has("slurm.gpus")' <<<"$ctx" >/dev/null || lab_fail "job $job: $v lacks partition/gpus: $ctx"
    done
}

# check_records JOB NGPUS SHARDS STEP: start/end records of step STEP, and no job records.
check_records() {
    local job="$1" ngpus="$2" shards="$3" step="$4" recs n
    lab_wait_record "$T_SPOOL" "$job" step_end 30 || lab_fail "job $job: no step_end record in $T_SPOOL/records"
    recs="$(lab_records "$T_SPOOL" "$job")"
    echo "  records of job $job:"; sed 's/^/    /' <<<"$recs"
    for k in step_start step_end; do
        n="$(jq -c --arg k "$k" --argjson s "$step" 'select(.kind == $k and .step_id == $s)' <<<"$recs" | wc -l)"
        [ "$n" = 1 ] || lab_fail "job $job: expected one $k record of step $step, got $n"
    done
    if lab_jq_any 'select(.kind == "job_start" or .kind == "job_end") | true' <<<"$recs"; then
        lab_fail "job $job: the shipped plugin wrote a job record (it must have no prolog/epilog hooks)"
    fi
    n="$(jq -c --argjson s "$step" 'select(.kind == "step_start" and .step_id == $s) | .gpus | length' <<<"$recs")"
    [ "$n" = "$ngpus" ] || lab_fail "job $job step $step: step_start has $n GPUs, expected $ngpus"
    if [ "$ngpus" -gt 0 ]; then
        lab_jq_any 'select(.kind == "step_start") | .gpus | all(.uuid | startswith("GPU-"))' <<<"$recs" \
            || lab_fail "job $job: step_start GPUs lack the snapshot's UUIDs"
    fi
    n="$(jq -c --argjson s "$step" 'select(.kind == "step_start" and .step_id == $s) | .shards' <<<"$recs")"
    [ "$n" = "$shards" ] || lab_fail "job $job step $step: shards $n, expected $shards"
    lab_jq_any --argjson s "$step" 'select(.kind == "step_start" and .step_id == $s) | .user == "root" and .uid == 0 and .node == "gpu01" and (.time_us > 1700000000000000)' <<<"$recs" \
        || lab_fail "job $job: step_start identity/time wrong"
    lab_jq_any --argjson s "$step" 'select(.kind == "step_end" and .step_id == $s) | (.exit_status // 0) == 0' <<<"$recs" \
        || lab_fail "job $job step $step: step_end has a non-zero exit status"
}

srun_case() {
    local name="$1" ngpus="$2" shards="$3"; shift 3
    echo "== $name"
    lab_run timeout 120 srun -N1 -t 2 "$@" bash -c 'echo JOB=$SLURM_JOB_ID; env | grep -E "^(GPUHUB|OPENAI|MLFLOW|[A-Z_]+_MODEL)" | sort'
    [ "$LAB_RC" = 0 ] || lab_fail "$name: srun failed"
    local job
    job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
    [ -n "$job" ] || lab_fail "$name: no job id in the output"
    check_env "$LAB_OUT" "$job"
    check_records "$job" "$ngpus" "$shards" 0
    echo "ok: $name (job $job)"
}

srun_case "srun --gres=gpu:1" 1 null --gres=gpu:1
srun_case "srun --gres=gpu:2" 2 null --gres=gpu:2
srun_case "srun --gres=shard:7" 1 7 --gres=shard:7
srun_case "srun -p cpu (no GPU)" 0 null -p cpu

echo "== sbatch --gres=gpu:2 (batch step recorded as step 4294967291)"
lab_run sbatch --parsable -N1 -t 2 --gres=gpu:2 -o "$T/batch.out" --wrap 'echo JOB=$SLURM_JOB_ID; env | grep -E "^(GPUHUB|OPENAI|MLFLOW|[A-Z_]+_MODEL)" | sort'
[ "$LAB_RC" = 0 ] || lab_fail "sbatch failed"
job="${LAB_OUT%%;*}"
lab_wait_job "$job" 60 || lab_fail "batch job $job still queued after 60 s"
out="$(cat "$T/batch.out")"
sed 's/^/  | /' <<<"$out"
check_env "$out" "$job"
check_records "$job" 2 null 4294967291
echo "== salloc without a step: no record at all (the agent learns the job from slurmctld)"
lab_run timeout 120 salloc -N1 -t 2 --gres=gpu:1 bash -c 'echo JOB=$SLURM_JOB_ID'
[ "$LAB_RC" = 0 ] || lab_fail "salloc failed"
job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
lab_wait_job "$job" 30 || lab_fail "salloc job $job still listed 30 s after salloc returned"
recs="$(lab_records "$T_SPOOL" "$job")"
[ -z "$recs" ] || lab_fail "salloc job $job without a step left records: $recs"
echo "ok: salloc (job $job)"

echo "== a non-root user: srun and sbatch as $LAB_USER (uid, name and token are the user's)"
lab_user
mkdir -p "$T/u" && chown "$LAB_USER" "$T/u"
lab_run runuser -u "$LAB_USER" -- bash -c "cd $T/u && timeout 120 srun -N1 -t 2 --gres=shard:7 bash -c 'echo JOB=\$SLURM_JOB_ID; env | grep -E \"^(GPUHUB_TOKEN|MLFLOW_RUN_CONTEXT)=\"'"
[ "$LAB_RC" = 0 ] || lab_fail "srun as $LAB_USER failed"
job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
uid="$(id -u "$LAB_USER")"
grep -qE "^GPUHUB_TOKEN=ghj1\.$uid\.$LAB_USER\.$job\." <<<"$LAB_OUT" || lab_fail "token of job $job is not for $LAB_USER ($uid)"
grep -q "\"slurm.user\":\"$LAB_USER\"" <<<"$LAB_OUT" || lab_fail "run context of job $job lacks slurm.user=$LAB_USER"
lab_wait_record "$T_SPOOL" "$job" step_end 30 || lab_fail "no step_end for $LAB_USER's job $job"
lab_records "$T_SPOOL" "$job" | lab_jq_any --argjson u "$uid" --arg n "$LAB_USER" 'select(.kind == "step_start") | .uid == $u and .user == $n and .shards == 7' \
    || lab_fail "step_start of job $job lacks uid $uid / user $LAB_USER / shards 7"
lab_run runuser -u "$LAB_USER" -- bash -c "cd $T/u && sbatch --parsable -N1 -t 2 -o $T/u/b.out --wrap 'echo \$GPUHUB_TOKEN'"
job="${LAB_OUT%%;*}"
lab_wait_job "$job" 60 || lab_fail "batch job $job of $LAB_USER did not finish"
grep -qE "^ghj1\.$uid\.$LAB_USER\.$job\." "$T/u/b.out" || lab_fail "batch job $job: token not for $LAB_USER: $(cat "$T/u/b.out")"
lab_wait_record "$T_SPOOL" "$job" step_end 30 || lab_fail "no step_end for batch job $job"
lab_records "$T_SPOOL" "$job" | lab_jq_any --arg n "$LAB_USER" 'select(.kind == "step_start" and .step_id == 4294967291) | .user == $n' \
    || lab_fail "batch step record of job $job lacks user $LAB_USER (the batch step has no SLURM_JOB_USER: the passwd fallback must fill it)"
echo "ok: $LAB_USER"
lab_node_ok
echo "PASS: spank-jobs"
