#!/usr/bin/env bash
# SPANK plugin: dcgm-exporter job map (--hpc-job-mapping-dir). While a job runs, the file
# named after each of its GPU indices lists its job id (one per line, shared by concurrent shard
# jobs on one GPU); after the job, its id is gone.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
cd "$T"

echo "== gpu:2 job sees its id in both map files"
lab_run timeout 120 srun -N1 -t 2 --gres=gpu:2 bash -c "echo JOB=\$SLURM_JOB_ID; for f in $T_MAP/0 $T_MAP/1; do echo \"\$f: \$(tr '\n' ' ' < \$f)\"; done"
[ "$LAB_RC" = 0 ] || lab_fail "srun failed"
job="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT")"
for g in 0 1; do
    grep -qE "^$T_MAP/$g: (.* )?$job( |$)" <<<"$LAB_OUT" || lab_fail "job $job missing from $T_MAP/$g while running"
done
lab_wait_record "$T_SPOOL" "$job" job_end 30 || lab_fail "no job_end for $job"
for g in 0 1; do
    if grep -qx "$job" "$T_MAP/$g"; then lab_fail "job $job still in $T_MAP/$g after it ended"; fi
done
echo "ok"

echo "== two concurrent shard jobs on one GPU share its map file"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:14 -o /dev/null --wrap 'sleep 120'
a="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $a"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:14 -o /dev/null --wrap 'sleep 120'
b="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $b"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:7 -o /dev/null --wrap 'sleep 120'
c="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $c"
for ((i = 0; i < 150; i++)); do
    n=0; for j in "$a" "$b" "$c"; do lab_wait_record "$T_SPOOL" "$j" job_start 0 && n=$((n + 1)); done
    [ "$n" -ge 2 ] && break
    sleep 0.2
done
# shard:14 + shard:14 fill both GPUs, so the shard:7 job waits; check a and b first.
sleep 0.5
cat "$T_MAP"/0 "$T_MAP"/1 2>/dev/null | sed 's/^/  map: /'
all="$(cat "$T_MAP"/0 "$T_MAP"/1 2>/dev/null)"
grep -qx "$a" <<<"$all" && grep -qx "$b" <<<"$all" || lab_fail "running shard jobs $a and $b not both in the map"
scancel "$a" "$b"
for ((i = 0; i < 150; i++)); do lab_wait_record "$T_SPOOL" "$c" job_start 0 && break; sleep 0.2; done
lab_wait_record "$T_SPOOL" "$c" job_start 0 || lab_fail "third shard job $c never started"
sleep 0.5
all="$(cat "$T_MAP"/0 "$T_MAP"/1 2>/dev/null)"
grep -qx "$c" <<<"$all" || lab_fail "job $c not in the map"
scancel "$c"
for j in "$a" "$b" "$c"; do
    lab_wait_record "$T_SPOOL" "$j" job_end 30 || lab_fail "no job_end for $j"
done
all="$(cat "$T_MAP"/0 "$T_MAP"/1 2>/dev/null)"
[ -z "$(tr -d '\n' <<<"$all")" ] || lab_fail "map not empty after all jobs ended: $all"
lab_node_ok
echo "PASS: spank-dcgm"
