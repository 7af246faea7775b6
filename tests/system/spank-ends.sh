#!/usr/bin/env bash
# SPANK plugin as shipped: a job ended by scancel, and one ended by its time limit, still get
# their step end records (StepEnd from each step's slurmstepd: the batch step and step 0). The
# job's own end is slurmctld's (the agent closes it from there; the job-hooks build's JobEnd after
# scancel is spank-job-hooks.sh). The time-limit case takes 60-120 s: Slurm limits are whole
# minutes (KillWait=5 in tests/lab/slurm.conf).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
cd "$T"

echo "== time limit: sbatch -t 1 sleep 600 (submitted first, checked last)"
lab_run sbatch --parsable -N1 -t 1 --gres=gpu:1 -o "$T/tl.out" --wrap 'srun sleep 600'
[ "$LAB_RC" = 0 ] || lab_fail "sbatch failed"
tl_job="${LAB_OUT%%;*}"
lab_cleanup_add "lab_cancel $tl_job"

echo "== scancel: sbatch --wrap 'srun sleep 600', cancelled once its step runs"
lab_run sbatch --parsable -N1 -t 5 --gres=shard:3 -o "$T/sc.out" --wrap 'srun sleep 600'
[ "$LAB_RC" = 0 ] || lab_fail "sbatch failed"
sc_job="${LAB_OUT%%;*}"
lab_cleanup_add "lab_cancel $sc_job"
for ((i = 0; i < 150; i++)); do
    lab_records "$T_SPOOL" "$sc_job" | lab_jq_any 'select(.kind == "step_start") | .step_id == 0' && break
    sleep 0.2
done
lab_records "$T_SPOOL" "$sc_job" | lab_jq_any 'select(.kind == "step_start") | .step_id == 0' || lab_fail "job $sc_job: step 0 never started"
lab_run scancel "$sc_job"
lab_wait_job "$sc_job" 60 || lab_fail "job $sc_job still queued 60 s after scancel"
lab_wait_record "$T_SPOOL" "$sc_job" step_end 30 || lab_fail "job $sc_job: no step_end record after scancel"
recs="$(lab_records "$T_SPOOL" "$sc_job")"
sed 's/^/    /' <<<"$recs"
lab_jq_any 'select(.kind == "step_end") | .step_id == 0' <<<"$recs" || lab_fail "job $sc_job: no step_end for step 0 after scancel"
lab_jq_any 'select(.kind == "step_end") | .step_id == 4294967291' <<<"$recs" || lab_fail "job $sc_job: no step_end for the batch step after scancel"
lab_jq_any 'select(.kind == "step_start" and .step_id == 0) | .shards == 3' <<<"$recs" || lab_fail "job $sc_job: shard count missing"
echo "ok: scancel (job $sc_job)"

echo "== waiting for the time limit of job $tl_job (up to 180 s)"
lab_wait_job "$tl_job" 180 || lab_fail "job $tl_job still running 180 s after a 1-minute limit"
# slurmctld forgets a finished job after MinJobAge; then Slurm's accounting still knows how it ended.
state="$(scontrol show job "$tl_job" 2>/dev/null | grep -oE 'JobState=[A-Z_]+' | head -n1 | cut -d= -f2 || true)"
if [ -z "$state" ]; then
    for ((i = 0; i < 60; i++)); do
        state="$(sacct -n -X -P -j "$tl_job" -o State 2>/dev/null | head -n1 | awk '{print $1}')"
        case "$state" in ""|RUNNING|PENDING|COMPLETING) sleep 0.5 ;; *) break ;; esac
    done
    echo "  sacct: State=$state"
    [ -n "$state" ] || lab_fail "job $tl_job: neither scontrol nor sacct knows how it ended (is slurmdbd up? GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh)"
else
    echo "  scontrol: JobState=$state"
fi
[ "$state" = TIMEOUT ] || lab_fail "job $tl_job ended as $state, expected TIMEOUT (its 1-minute limit)"
lab_wait_record "$T_SPOOL" "$tl_job" step_end 30 || lab_fail "job $tl_job: no step_end record after its time limit"
recs="$(lab_records "$T_SPOOL" "$tl_job")"
sed 's/^/    /' <<<"$recs"
lab_jq_any 'select(.kind == "step_end") | .step_id == 0' <<<"$recs" || lab_fail "job $tl_job: no step_end for step 0 after the time limit"
lab_node_ok
echo "PASS: spank-ends"
