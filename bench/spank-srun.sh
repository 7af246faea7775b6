#!/usr/bin/env bash
# Benchmark: what the gpuhub SPANK plugin adds to `srun -N1 true` (a new allocation each time).
# Runs N rounds; each round runs srun once with the plugin's plugstack line present and once
# with it absent (order alternating per round), so both series see the same machine state.
# Prints each series' median and the difference; then the cost a user sees, against a Slurm with
# no gpuhub and none of the settings gpuhub asks for (no PrologFlags), for gpuhub as shipped and
# for the plugin alone. Target: at most +5 ms for the configuration we ship.
#
# What is measured: srun (LOCAL hooks), the step's slurmstepd (REMOTE hooks: StepStart/StepEnd
# records with fsync, snapshot read, token HMAC, ~12 spank_setenv) and the prolog (JobStart
# record, dcgm map). srun, slurmstepd and the prolog reread plugstack.conf on every run, so
# toggling the file switches the plugin for all of them. Not measured: slurmd decides at start
# whether any plugin has job_prolog/job_epilog hooks and then runs `slurmstepd spank prolog`
# for every job (also in the "without" series of the first part; the second part restarts
# slurmd per configuration, so it counts). The epilog runs after srun returns and is not on the
# user's path.
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
# gpuhub as shipped (the plugstack line plus slurm-conf/slurm.conf.snippet's PrologFlags) and
# against the plugin alone. Those differ in slurm.conf and in slurmd's plugin set (slurmd decides
# at start whether it runs `slurmstepd spank prolog` for every job), so each configuration is a
# block after restarting slurmctld and slurmd; the blocks alternate BLOCKS times so that drift
# of the machine hits all three alike.
SHIPPED_FLAGS="$(sed -n 's/^PrologFlags=//p' "$REPO/slurm-conf/slurm.conf.snippet" | tail -n1)"
CONF=/etc/slurm/slurm.conf
cp -p "$CONF" "$T/slurm.conf.orig"
restart_slurm() {
    local i
    kill "$(cat /run/slurmd.pid)" "$(cat /run/slurmctld.pid)" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break; sleep 0.1; done
    slurmctld && slurmd -N "$LAB_NODE" || { echo "FAIL: slurmctld/slurmd did not restart" >&2; exit 1; }
    for ((i = 0; i < 150; i++)); do sinfo -h -n "$LAB_NODE" -o %T 2>/dev/null | grep -qE '^(idle|mixed)$' && return 0; sleep 0.2; done
    echo "FAIL: node $LAB_NODE not idle after restarting Slurm" >&2; exit 1
}
lab_cleanup_add "cmp -s '$T/slurm.conf.orig' $CONF || { cp -p '$T/slurm.conf.orig' $CONF && restart_slurm; }"
# configure PLUGIN(0/1) PROLOGFLAGS: the plugstack line on or off, slurm.conf's PrologFlags set
# to PROLOGFLAGS (empty: no PrologFlags line), then Slurm restarted.
configure() {
    if [ "$1" = 1 ]; then printf '%s\n' "$ON" > "$LAB_PLUGSTACK"; else : > "$LAB_PLUGSTACK"; fi
    grep -v '^PrologFlags=' "$T/slurm.conf.orig" > "$T/slurm.conf.new"
    [ -z "$2" ] || echo "PrologFlags=$2" >> "$T/slurm.conf.new"
    cp "$T/slurm.conf.new" "$CONF"
    restart_slurm
}
BLOCKS="${GPUHUB_BENCH_BLOCKS:-2}"
: > "$T/baseline"; : > "$T/shipped"; : > "$T/plugin-only"
for ((b = 0; b < BLOCKS; b++)); do
    configure 0 "";              ms >/dev/null; for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/baseline"; done
    configure 1 "$SHIPPED_FLAGS"; ms >/dev/null; for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/shipped"; done
    configure 1 "";              ms >/dev/null; for ((r = 0; r < ROUNDS; r++)); do ms >> "$T/plugin-only"; done
done
cp -p "$T/slurm.conf.orig" "$CONF"; printf '%s\n' "$ON" > "$LAB_PLUGSTACK"; restart_slurm
base="$(median < "$T/baseline")"; shipped="$(median < "$T/shipped")"; only="$(median < "$T/plugin-only")"
awk -v b="$base" -v s="$shipped" -v o="$only" -v n="$((ROUNDS * BLOCKS))" -v f="${SHIPPED_FLAGS:-none}" 'BEGIN {
    printf "srun -N1 true, %d runs per configuration in alternating blocks, Slurm restarted per block (median wall time)\n", n
    printf "  no gpuhub, no PrologFlags (baseline):       %7.1f ms\n", b / 1000
    printf "  gpuhub as shipped (PrologFlags=%s):      %7.1f ms  %+7.1f ms  x%.2f   (target <= +5 ms)\n", f, s / 1000, (s - b) / 1000, s / b
    printf "  gpuhub plugin only (no PrologFlags):        %7.1f ms  %+7.1f ms  x%.2f\n", o / 1000, (o - b) / 1000, o / b
}'

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
