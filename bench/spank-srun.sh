#!/usr/bin/env bash
# Benchmark: what the gpuhub SPANK plugin adds to `srun -N1 true` (a new allocation each time).
# Runs N rounds; each round runs srun once with the plugin's plugstack line present and once
# with it absent (order alternating per round), so both series see the same machine state.
# Prints each series' median and the difference. Target: at most +5 ms.
#
# What is measured: srun (LOCAL hooks), the step's slurmstepd (REMOTE hooks: StepStart/StepEnd
# records with fsync, snapshot read, token HMAC, ~12 spank_setenv) and the prolog (JobStart
# record, dcgm map). srun, slurmstepd and the prolog reread plugstack.conf on every run, so
# toggling the file switches the plugin for all of them. Not measured: slurmd decides at start
# whether any plugin has job_prolog/job_epilog hooks and then runs `slurmstepd spank prolog`
# for every job (also in the "without" series here); the lab README measured that process at
# ~15-20 ms per allocation. The epilog runs after srun returns and is not on the user's path.
#
# Usage (root, lab up): bench/spank-srun.sh [ROUNDS]   (default 30)
#   GPUHUB_BENCH_ARGS="fsync=all"   extra plugstack arguments for the "with" series
#   GPUHUB_BENCH_SLURMD=1           also measure the whole cost including slurmd's prolog/epilog
#                                   processes: two blocks (not interleaved), slurmd restarted
#                                   without and then with the plugin (disturbs running jobs)
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
: > "$T/on"; : > "$T/off"
ms >/dev/null   # warm-up (page cache, munge)
for ((r = 0; r < ROUNDS; r++)); do
    for mode in $( ((r % 2)) && echo "on off" || echo "off on"); do
        if [ "$mode" = on ]; then printf '%s\n' "$ON" > "$LAB_PLUGSTACK"; else : > "$LAB_PLUGSTACK"; fi
        ms >> "$T/$mode"
    done
done
printf '%s\n' "$ON" > "$LAB_PLUGSTACK"

restart_slurmd() {
    local i
    kill "$(cat /run/slurmd.pid)" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do pgrep -x slurmd >/dev/null || break; sleep 0.1; done
    slurmd -N "$LAB_NODE"
    for ((i = 0; i < 100; i++)); do sinfo -h -n "$LAB_NODE" -o %T | grep -qE '^(idle|mixed)$' && break; sleep 0.2; done
}
if [ "${GPUHUB_BENCH_SLURMD:-0}" = 1 ]; then
    : > "$T/block-off"; : > "$T/block-on"
    : > "$LAB_PLUGSTACK"; restart_slurmd; ms >/dev/null
    for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/block-off"; done
    printf '%s\n' "$ON" > "$LAB_PLUGSTACK"; restart_slurmd; ms >/dev/null
    for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/block-on"; done
    bo="$(median < "$T/block-off")"; bn="$(median < "$T/block-on")"
    awk -v on="$bn" -v off="$bo" -v n="$ROUNDS" 'BEGIN {
        printf "srun -N1 true, two blocks of %d, slurmd restarted without / with the plugin (includes the prolog process)\n", n
        printf "  slurmd without plugin:  %7.1f ms\n", off / 1000
        printf "  slurmd with plugin:     %7.1f ms\n", on / 1000
        printf "  difference:             %+7.1f ms\n", (on - off) / 1000
    }'
fi
# The plugin's own time per hook, from its debug lines in slurmd.log (SlurmdDebug=debug).
echo "gpuhub hook durations in slurmd.log during this run (median / max, microseconds):"
tail -c +"$LOG_FROM" "$LAB_SLURMD_LOG" | grep -oE 'gpuhub: [a-z_]+ took [0-9]+ us' | awk '{print $2, $4}' \
    | sort -k1,1 -k2,2n | awk '{v[$1] = v[$1] " " $2; n[$1]++} END {for (h in v) {split(substr(v[h], 2), a, " "); printf "  %-14s n=%-4d median %6d  max %6d\n", h, n[h], a[int((n[h] + 1) / 2)], a[n[h]]}}' | sort | tee "$T/hooks"
# job_epilog runs after srun has returned; every other hook is on srun's path.
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
