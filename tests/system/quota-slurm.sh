#!/usr/bin/env bash
# GPU-hour quotas on the lab with slurmdbd (docs/quotas.md): the lab agent's [[quotas]] entry
# for gpuhubquota (tests/lab/agent.toml), driven with `gpuhub quota set` relative to what the
# user has used, so every step is exact whatever earlier runs left this month:
#   1. under quota: a real GPU job runs, srun prints no quota line;
#   2. limit at ~86 % of usage: srun, sbatch and salloc print `gpuhub: you have used X of Y GPU-hours
#      this month (8x %)`; at ~96 %: the same line with 9x %;
#   3. over quota while a job runs: the agent holds the user's association (sacctmgr shows
#      GrpTRES gres/gpu=0), sbatch prints gpuhub's used-up line, the new job stays PENDING with
#      Slurm's own reason AssocGrpGRES, and the running job keeps running (never cancelled);
#   4. `gpuhub quota grant` (a top-up) releases the hold before it returns; the pending job starts;
#      the running job ends COMPLETED;
#   5. `gpuhub quota revoke` of that top-up holds the association again before it returns.
# At exit the admin limit is cleared (1000 GPU-hours a month: nothing held).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
U="$(quota_user)"
enforce="$(scontrol show config 2>/dev/null | awk -F' = ' '$1 ~ /^AccountingStorageEnforce/ {print $2}')"
grep -q limits <<<"$enforce" || lab_fail "AccountingStorageEnforce is '$enforce', not limits: bring the lab up with accounting (GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh)"
agent_healthy || lab_fail "the lab's gpuhub-agent does not answer on 127.0.0.1:8400"
"$cli" quota --json | jq -e --arg k "user:$U" '.quotas[] | select(.quota == $k)' >/dev/null ||
    lab_fail "the lab agent has no quota for user:$U (tests/lab/agent.toml [[quotas]])"
# Top-ups last the period: one granted by an earlier run this month (step 4) would raise every
# limit set below, so the test revokes its user's top-ups in force (`gpuhub quota revoke`),
# before and after.
topups() { "$cli" quota --json | jq -r --arg k "user:$U" '.topups[] | select(.quota == $k) | .id'; }
clear_topups() {
    local id
    for id in $(topups); do "$cli" quota revoke "$id" --reason "quota-slurm: earlier run" >/dev/null || return 1; done
    [ -z "$(topups)" ]
}
clear_topups || lab_fail "cannot revoke the earlier top-ups of $U with gpuhub quota revoke"
lab_cleanup_add "'$cli' quota set --user '$U' --clear >/dev/null 2>&1 || true; clear_topups >/dev/null 2>&1 || true"
cd /tmp

q() { "$cli" quota --json | jq -r --arg k "user:$U" ".quotas[] | select(.quota == \$k) | $1"; }
# used_stable: print the user's GPU-hours once two reads 4 s apart agree (the last job was
# ingested and closed from Slurm).
used_stable() {
    local a b i
    a="$(q .used_gpu_hours)"
    for ((i = 0; i < 30; i++)); do
        sleep 4
        b="$(q .used_gpu_hours)"
        [ "$a" = "$b" ] && { echo "$b"; return 0; }
        a="$b"
    done
    lab_fail "the usage of $U does not settle: $a"
}
set_pct() { # set_pct PERCENT: limit = used / PERCENT * 100
    local used limit
    used="$(used_stable)"
    limit="$(awk -v u="$used" -v p="$1" 'BEGIN { printf "%.9f", u * 100 / p }')"
    echo "  used $used GPU-hours; limit set to $limit ($1 %)"
    "$cli" quota set --user "$U" --gpu-hours "$limit" >/dev/null
}
as_user() { runuser -u "$U" -- "$@"; }

"$cli" quota set --user "$U" --clear >/dev/null
lab_wait_gpus_free 240

echo "== 1. under quota: a GPU job runs, no quota line"
lab_run as_user srun -p gpu --gres=gpu:1 -t 2 sleep 20
[ "$LAB_RC" = 0 ] || lab_fail "srun under quota failed"
grep -q 'GPU-hours' <<<"$LAB_OUT" && lab_fail "a quota line under quota: $LAB_OUT"
[ "$(q .held)" = false ] || lab_fail "held under quota"

# warn_check PERCENT REGEX: set the limit to PERCENT of the settled usage, then srun and sbatch
# (each after a fresh set: a job's own second or two moves a tiny quota by a few percent) print
# the line matching REGEX.
warn_check() {
    local pct="$1" re="$2" j
    set_pct "$pct"
    [ "$(q '.percent | floor')" -ge 80 ] || lab_fail "percent $(q .percent) after a limit at $pct %"
    lab_run as_user srun -p gpu --gres=gpu:1 -t 1 true
    grep -Eq "$re" <<<"$LAB_OUT" || lab_fail "srun printed no line matching $re"
    set_pct "$pct"
    lab_run as_user sbatch -p gpu --gres=gpu:1 -t 1 -o /dev/null --wrap true
    grep -Eq "$re" <<<"$LAB_OUT" || lab_fail "sbatch printed no line matching $re"
    j="$(grep -o 'Submitted batch job [0-9]*' <<<"$LAB_OUT" | awk '{print $4}')"
    lab_wait_job "$j" 60 || lab_fail "job $j did not end"
    set_pct "$pct"
    lab_run as_user salloc -p gpu --gres=gpu:1 -t 1 true
    grep -Eq "$re" <<<"$LAB_OUT" || lab_fail "salloc printed no line matching $re"
}
echo "== 2a. at ~86 %: srun and sbatch warn"
warn_check 86 'gpuhub: you have used [0-9.]+ of [0-9.]+ GPU-hours this month \((8[0-9]|9[0-4]) %\)'
echo "== 2b. at ~96 %: srun and sbatch warn"
warn_check 96 'gpuhub: you have used [0-9.]+ of [0-9.]+ GPU-hours this month \(9[5-9] %\)'

echo "== 3. over quota while a job runs"
"$cli" quota set --user "$U" --clear >/dev/null
lab_run as_user sbatch -p gpu --gres=gpu:1 -t 3 -o /dev/null --wrap 'sleep 50'
R="$(grep -o 'Submitted batch job [0-9]*' <<<"$LAB_OUT" | awk '{print $4}')"
lab_cleanup_add "lab_cancel $R"
for ((i = 0; i < 60; i++)); do [ "$(squeue -h -j "$R" -o %T)" = RUNNING ] && break; sleep 0.5; done
[ "$(squeue -h -j "$R" -o %T)" = RUNNING ] || lab_fail "job $R does not run"
sleep 6
used="$(q .used_gpu_hours)"
"$cli" quota set --user "$U" --gpu-hours "$(awk -v u="$used" 'BEGIN { printf "%.9f", u / 2 }')" >/dev/null
[ "$(q .held)" = true ] || lab_fail "not held over quota: $("$cli" quota)"
tres="$(sacctmgr -n -P list associations users="$U" format=User,GrpTRES | awk -F'|' -v u="$U" '$1 == u {print $2}')"
echo "  sacctmgr: $U GrpTRES=$tres"
grep -q 'gres/gpu=0' <<<"$tres" || lab_fail "the association of $U is not held in slurmdbd: GrpTRES=$tres"
"$cli" quota
lab_run as_user sbatch -p gpu --gres=gpu:1 -t 1 -o /dev/null --wrap true
P="$(grep -o 'Submitted batch job [0-9]*' <<<"$LAB_OUT" | awk '{print $4}')"
[ -n "$P" ] || lab_fail "sbatch over quota did not submit: Slurm should keep the job pending, not refuse it"
lab_cleanup_add "lab_cancel $P"
grep -q "gpuhub: quota user:$U is used up: .* GPU-hours this month .*AssocGrpGRES.*resets on" <<<"$LAB_OUT" ||
    lab_fail "sbatch printed no used-up line naming the quota, the reason and the reset"
reason=""
for ((i = 0; i < 40; i++)); do
    reason="$(squeue -h -j "$P" -o '%T %r')"
    [ "$reason" = "PENDING AssocGrpGRES" ] && break
    sleep 0.5
done
echo "  squeue: job $P: $reason; job $R: $(squeue -h -j "$R" -o '%T %r')"
[ "$reason" = "PENDING AssocGrpGRES" ] || lab_fail "job $P over quota is '$reason', not PENDING with Slurm's reason AssocGrpGRES"
sleep 8
[ "$(squeue -h -j "$P" -o %T)" = PENDING ] || lab_fail "job $P left PENDING while held"
[ "$(squeue -h -j "$R" -o %T)" = RUNNING ] || lab_fail "the running job $R was stopped by the hold: $(squeue -h -j "$R" -o '%T %r')"

echo "== 4. a top-up releases the pending job"
lab_run "$cli" quota grant --user "$U" --gpu-hours 1 --reason "quota-slurm test"
[ "$LAB_RC" = 0 ] || lab_fail "gpuhub quota grant failed"
[ "$(q .held)" = false ] || lab_fail "still held after a top-up"
tres="$(sacctmgr -n -P list associations users="$U" format=User,GrpTRES | awk -F'|' -v u="$U" '$1 == u {print $2}')"
grep -q 'gres/gpu=0' <<<"$tres" && lab_fail "slurmdbd still holds $U after the top-up: GrpTRES=$tres"
started=0
for ((i = 0; i < 180; i++)); do
    st="$(squeue -h -j "$P" -o %T)"
    if [ "$st" != PENDING ]; then started=1; break; fi
    sleep 0.5
done
[ "$started" = 1 ] || lab_fail "job $P still pending 90 s after the top-up: $(squeue -h -j "$P" -o '%T %r')"
echo "  job $P left PENDING after the top-up (${st:-ended})"
lab_wait_job "$R" 90 || lab_fail "job $R did not end"
for ((i = 0; i < 60; i++)); do
    st="$(sacct -n -X -P -j "$R" -o State | head -n1)"
    [ -n "$st" ] && [ "$st" != RUNNING ] && break
    sleep 1
done
echo "  sacct: job $R $st"
[ "$st" = COMPLETED ] || lab_fail "the job that ran through the hold ended $st, not COMPLETED"

echo "== 5. revoking the top-up holds the user again"
id="$(topups)"
[ "$(wc -w <<<"$id")" = 1 ] || lab_fail "expected the one top-up of step 4 in gpuhub quota, got: '$id'"
lab_run "$cli" quota revoke "$id" --reason "quota-slurm test"
[ "$LAB_RC" = 0 ] || lab_fail "gpuhub quota revoke $id failed"
[ "$(q .held)" = true ] || lab_fail "not held again after the top-up was revoked"
tres="$(sacctmgr -n -P list associations users="$U" format=User,GrpTRES | awk -F'|' -v u="$U" '$1 == u {print $2}')"
grep -q 'gres/gpu=0' <<<"$tres" || lab_fail "slurmdbd does not hold $U after the revoke: GrpTRES=$tres"
[ -z "$(topups)" ] || lab_fail "top-up $id is still listed after its revoke"
lab_run "$cli" quota revoke "$id"
[ "$LAB_RC" != 0 ] && grep -q "no top-up $id is in force" <<<"$LAB_OUT" || lab_fail "a second revoke of $id did not say it is no longer in force"
echo "PASS: quota-slurm"
