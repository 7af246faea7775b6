#!/usr/bin/env bash
# Benchmark: what the gpuhub SPANK plugin adds to `srun -N1 true` (a new allocation each time).
# Part 1: N rounds; each round runs srun once with the plugin's plugstack line present and once
# with it absent (order alternating per round), so both series see the same machine state, and
# prints each series' median and the difference. Part 2: the cost a user sees, against a Slurm
# with no gpuhub and none of the settings gpuhub asks for (no PrologFlags), for gpuhub as shipped
# and for the optional job-hooks build. Target: at most +5 ms for the configuration we ship.
#
# What is measured: srun (LOCAL hooks) and the step's slurmstepd (REMOTE hooks: StepStart/StepEnd
# records, snapshot read, token HMAC, ~12 spank_setenv); with the job-hooks build also the prolog
# (JobStart record, dcgm map). srun and slurmstepd reread plugstack.conf on every run, so toggling
# the file switches the shipped plugin in part 1. slurmd decides at start whether any plugin has
# job_prolog/job_epilog hooks and then runs `slurmstepd spank prolog` for every job: part 2
# restarts slurmd per configuration, so that counts there. The epilog runs after srun returns and
# is not on the user's path.
#
# Usage (root, lab up): bench/spank-srun.sh [ROUNDS]   (default 30)
#   GPUHUB_BENCH_ARGS="fsync=all"   extra plugstack arguments for the "with" series
#   GPUHUB_BENCH_BLOCKS=2           blocks per Slurm configuration (each ROUNDS runs)
# Restarts slurmctld and slurmd (no jobs may run) and restores slurm.conf and the plugstack.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
. "$REPO/tests/lib/lab.sh"
lab_require
ROUNDS="${1:-30}"
# shellcheck disable=SC2086
spank_fixture http://127.0.0.1:5000 ${GPUHUB_BENCH_ARGS:-}   # private spool/snapshot/key: the full path runs
ON="$(cat "$LAB_PLUGSTACK")"
cd "$T"

ms() { # run srun once on an idle node, print wall microseconds
    local t0 t1 i
    # Wait (untimed) until the previous job's epilog is done, so no run queues behind it.
    for ((i = 0; i < 100; i++)); do [ -z "$(squeue -h)" ] && break; sleep 0.05; done
    t0=$(date +%s%N)
    timeout 60 srun -Q -N1 true || { echo "srun failed" >&2; exit 1; }
    t1=$(date +%s%N)
    echo $(( (t1 - t0) / 1000 ))
}
median() { sort -n | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }

LOG_FROM=$(( $(stat -c %s "$LAB_SLURMD_LOG") + 1 ))

# ---- the plugin's own cost: the same Slurm configuration, plugstack line present or absent,
# interleaved per round (srun, slurmstepd and the prolog reread plugstack.conf for every job).
: > "$T/on"; : > "$T/off"
ms >/dev/null   # warm-up (page cache, munge)
for ((r = 0; r < ROUNDS; r++)); do
    for mode in $( ((r % 2)) && echo "on off" || echo "off on"); do
        if [ "$mode" = on ]; then printf '%s\n' "$ON" > "$LAB_PLUGSTACK"; else : > "$LAB_PLUGSTACK"; fi
        ms >> "$T/$mode"
    done
done
printf '%s\n' "$ON" > "$LAB_PLUGSTACK"

# ---- what a user pays: a Slurm with no gpuhub and none of the settings gpuhub asks for, against
# gpuhub as shipped (the plugstack line with spank_gpuhub.so, plus whatever PrologFlags
# slurm-conf/slurm.conf.snippet sets: none), and against the optional build with job hooks
# (spank_gpuhub_prolog.so) without and with the PrologFlags=Alloc it is documented with. Those
# differ in slurm.conf and in slurmd's plugin set (slurmd decides at start whether it runs
# `slurmstepd spank prolog` for every job), so each configuration is a block after restarting
# slurmctld and slurmd; the blocks alternate BLOCKS times so that drift hits all alike.
SHIPPED_FLAGS="$(sed -n 's/^PrologFlags=//p' "$REPO/slurm-conf/slurm.conf.snippet" | tail -n1)"
BLOCKS="${GPUHUB_BENCH_BLOCKS:-2}"
configs=("none|" "shipped|$SHIPPED_FLAGS" "prolog|" "prolog|Alloc")
for c in "${configs[@]}"; do : > "$T/${c/|/-}"; done
for ((b = 0; b < BLOCKS; b++)); do
    for c in "${configs[@]}"; do
        lab_slurm_setup "${c%%|*}" "${c#*|}"
        ms >/dev/null
        for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/${c/|/-}"; done
    done
done
base="$(median < "$T/none-")"; shipped="$(median < "$T/shipped-$SHIPPED_FLAGS")"
hooks="$(median < "$T/prolog-")"; alloc="$(median < "$T/prolog-Alloc")"
awk -v b="$base" -v s="$shipped" -v h="$hooks" -v a="$alloc" -v n="$((ROUNDS * BLOCKS))" -v f="${SHIPPED_FLAGS:-none}" 'BEGIN {
    printf "srun -N1 true, %d runs per configuration in alternating blocks, Slurm restarted per block (median wall time)\n", n
    printf "  no gpuhub, no PrologFlags (baseline):                  %7.1f ms\n", b / 1000
    printf "  gpuhub as shipped (spank_gpuhub.so, PrologFlags=%s):  %7.1f ms  %+7.1f ms  x%.2f   (target <= +5 ms)\n", f, s / 1000, (s - b) / 1000, s / b
    printf "  job-hooks build (spank_gpuhub_prolog.so), no PrologFlags: %7.1f ms  %+7.1f ms  x%.2f\n", h / 1000, (h - b) / 1000, h / b
    printf "  job-hooks build with PrologFlags=Alloc:               %7.1f ms  %+7.1f ms  x%.2f\n", a / 1000, (a - b) / 1000, a / b
}'

# The plugin's own time per hook, from its debug lines in slurmd.log (SlurmdDebug=debug).
echo "gpuhub hook durations in slurmd.log during this run (median / max, microseconds):"
tail -c +"$LOG_FROM" "$LAB_SLURMD_LOG" | grep -oE 'gpuhub: [a-z_]+ took [0-9]+ us' | awk '{print $2, $4}' \
    | sort -k1,1 -k2,2n | awk '{v[$1] = v[$1] " " $2; n[$1]++} END {for (h in v) {split(substr(v[h], 2), a, " "); printf "  %-14s n=%-4d median %6d  max %6d\n", h, n[h], a[int((n[h] + 1) / 2)], a[n[h]]}}' | sort | tee "$T/hooks"
# job_epilog runs after srun has returned; every other hook is on srun's path (job_prolog
# appears only from the job-hooks blocks).
awk '$1 != "job_epilog" { s += $4 } END { printf "  sum of the medians above without job_epilog (the plugin'"'"'s time on srun'"'"'s path): %d us\n", s }' "$T/hooks"
on_us="$(median < "$T/on")"; off_us="$(median < "$T/off")"
recs="$(ls "$T_SPOOL/records" | wc -l)"
awk -v extra="${GPUHUB_BENCH_ARGS:+, plugin args: $GPUHUB_BENCH_ARGS}" -v on="$on_us" -v off="$off_us" -v n="$ROUNDS" -v recs="$recs" 'BEGIN {
    printf "srun -N1 true, %d interleaved rounds (median wall time)%s\n", n, extra
    printf "  without gpuhub plugin: %7.1f ms\n", off / 1000
    printf "  with gpuhub plugin:    %7.1f ms\n", on / 1000
    printf "  difference:            %+7.1f ms (target <= +5 ms)\n", (on - off) / 1000
    printf "  records written by the \"with\" runs: %d\n", recs
}'
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end, $(srun --version)"
