#!/usr/bin/env bash
# dcgm-exporter job map (--hpc-job-mapping-dir) as gpuhub ships it: the shipped plugin has no
# prolog, so the agent keeps the map from slurmctld's allocations (accounting/job_map.rs). While a
# job runs, the file named after each GPU index it holds (whole or shards, per `scontrol show job
# -d`) lists its job id, one per line, shared by concurrent shard jobs on one GPU; within one Slurm
# interval of the job's start it is there, within one interval of its end it is gone. The
# job-hooks build keeps the map from its prolog/epilog instead (spank-job-hooks.sh).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
agent_start || lab_fail "the lab agent does not start"
lab_wait_gpus_free 240
MAP=/run/gpuhub/dcgm-job-map
# The lab agent looks at slurmctld every telemetry.slurm_interval_ms (tests/lab/agent.toml).
INTERVAL_S=$(( $(sed -n 's/^slurm_interval_ms *= *\([0-9]*\).*/\1/p' "$LAB_AGENT_CONFIG" | head -n1) / 1000 ))
[ "$INTERVAL_S" -ge 1 ] || lab_fail "cannot read telemetry.slurm_interval_ms from $LAB_AGENT_CONFIG"
LIMIT=$((2 * INTERVAL_S + 3))

# gpus_of JOB: the GPU indices slurmctld gives the running job on the node (IDX:0-1 -> "0 1";
# Slurm 24.11 gives a shard job's shards per GPU as held/configured: (0/14,7/14) -> "1").
gpus_of() {
    local gres
    gres="$(scontrol show job -d "$1" | grep -oE ' GRES=[^ ]+' | tail -n1)"
    if grep -qE 'IDX:[0-9]' <<<"$gres"; then
        grep -oE 'IDX:[0-9,-]+' <<<"$gres" | head -n1 | cut -d: -f2 | tr ',' '\n' \
            | awk -F- '{ if (NF == 2) for (i = $1; i <= $2; i++) print i; else print $1 }' | tr '\n' ' '
    else
        grep -oE '\(([0-9]+/[0-9]+,?)+\)' <<<"$gres" | head -n1 | tr -d '()' | tr ',' '\n' \
            | awk -F/ '$1 > 0 { print NR - 1 }' | tr '\n' ' '
    fi
}
# running JOB: wait (60 s) until the job runs.
running() {
    local i
    for ((i = 0; i < 300; i++)); do [ "$(squeue -h -j "$1" -o %T 2>/dev/null)" = RUNNING ] && return 0; sleep 0.2; done
    lab_fail "job $1 not running after 60 s: $(squeue -h -j "$1" -o '%T %r' 2>/dev/null)"
}
# in_map JOB GPU: the job's id is a line of GPU's map file.
in_map() { grep -qx "$1" "$MAP/$2" 2>/dev/null; }
# wait_map JOB yes|no GPU...: wait (LIMIT s) until the job is in (yes) / absent from (no) each file.
wait_map() {
    local job="$1" want="$2" i g ok; shift 2
    for ((i = 0; i < LIMIT * 5; i++)); do
        ok=1
        for g in "$@"; do
            if [ "$want" = yes ]; then in_map "$job" "$g" || ok=0; else ! in_map "$job" "$g" || ok=0; fi
        done
        [ "$ok" = 1 ] && { echo "  job $job $( [ "$want" = yes ] && echo in || echo out of) the map of GPU(s) $* after ~$((i / 5)) s"; return 0; }
        sleep 0.2
    done
    for g in "$@"; do echo "  $MAP/$g: $(tr '\n' ' ' < "$MAP/$g" 2>/dev/null)"; done
    lab_fail "job $job $( [ "$want" = yes ] && echo "not in" || echo "still in") the map of GPU(s) $* after ${LIMIT} s (2 Slurm intervals + 3 s)"
}

echo "== a gpu:2 job is in both GPUs' files while it runs, and gone after it ends"
lab_run sbatch --parsable -N1 -t 2 --gres=gpu:2 -o /dev/null --wrap 'sleep 120'
j="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $j"
running "$j"
g="$(gpus_of "$j")"
[ "$g" = "0 1 " ] || lab_fail "job $j: scontrol gives GPUs '$g', expected 0 and 1"
# shellcheck disable=SC2086
wait_map "$j" yes $g
lab_cancel "$j"
# shellcheck disable=SC2086
wait_map "$j" no $g
echo "ok"

echo "== two concurrent shard jobs on one GPU share its map file; a waiting third appears when it runs"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:14 -o /dev/null --wrap 'sleep 120'
a="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $a"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:7 -o /dev/null --wrap 'sleep 120'
b="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $b"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:7 -o /dev/null --wrap 'sleep 120'
c="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $c"
lab_run sbatch --parsable -N1 -t 2 --gres=shard:14 -o /dev/null --wrap 'sleep 120'
d="${LAB_OUT%%;*}"; lab_cleanup_add "lab_cancel $d"
running "$a"; running "$b"; running "$c"
ga="$(gpus_of "$a")"; gb="$(gpus_of "$b")"; gc="$(gpus_of "$c")"
echo "  slurmctld: job $a on GPU $ga, $b on $gb, $c on $gc"
[ "$gb" = "$gc" ] || lab_fail "the two shard:7 jobs $b and $c are on different GPUs ($gb, $gc); expected them to share one"
# shellcheck disable=SC2086
{ wait_map "$a" yes $ga; wait_map "$b" yes $gb; wait_map "$c" yes $gc; }
[ "$(grep -cxE "$b|$c" "$MAP/${gb% }")" = 2 ] || lab_fail "GPU ${gb% }'s file does not list both shard jobs $b and $c"
[ "$(squeue -h -j "$d" -o %T)" = PENDING ] || lab_fail "job $d should wait (both GPUs' shards are taken)"
if grep -qx "$d" "$MAP"/* 2>/dev/null; then lab_fail "pending job $d is in the map"; fi
lab_cancel "$a"
running "$d"
gd="$(gpus_of "$d")"
# shellcheck disable=SC2086
{ wait_map "$a" no $ga; wait_map "$d" yes $gd; }
lab_cancel "$b" "$c" "$d"
# shellcheck disable=SC2086
{ wait_map "$b" no $gb; wait_map "$c" no $gc; wait_map "$d" no $gd; }
all="$(cat "$MAP"/0 "$MAP"/1 2>/dev/null)"
[ -z "$(tr -d '\n' <<<"$all")" ] || lab_fail "map not empty after all jobs ended: $all"
lab_node_ok
echo "PASS: spank-dcgm"
