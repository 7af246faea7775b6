#!/usr/bin/env bash
# What a Slurm look costs as the cluster's job count grows. Every accounting look and every
# telemetry snapshot (15 s by default each) runs `scontrol show job -d -o` and, to vouch for its
# lines, `squeue --json -t all` (docs/accounting.md). This submits N held jobs of the lab user
# (they never run) on the lab (tests/lab/up.sh), then times both commands, alternated in one
# run, REPEAT times, and prints the medians and the ratio squeue / scontrol for each N.
#   sudo bench/slurm-looks.sh            N in 0 1000 3000 by default (JOBS="0 500 ..."), REPEAT=7
# slurmctld keeps every pending job in memory (MaxJobCount, 10,000 by default); the jobs are
# cancelled at the end, and on any exit.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$REPO/tests/lib/lab.sh"
lab_require
lab_user
JOBS="${JOBS:-0 1000 3000}"; REPEAT="${REPEAT:-7}"
TAG="gpuhub-bench-looks-$$"
cleanup() { scancel -n "$TAG" 2>/dev/null || true; }
trap cleanup EXIT

# ms COMMAND...: wall milliseconds of one run (output discarded; a failure stops the bench).
ms() {
    local t0 t1
    t0="$(date +%s%N)"
    "$@" >/dev/null
    t1="$(date +%s%N)"
    echo $(((t1 - t0) / 1000000))
}
median() { sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}'; }

submitted=0
printf '%8s %16s %12s %8s %10s\n' jobs 'squeue --json' scontrol ratio json_bytes
for n in $JOBS; do
    while [ "$submitted" -lt "$n" ]; do
        # Batches of 100 in one shell: sbatch itself is the slow part.
        runuser -u "$LAB_USER" -- sh -c "i=0; while [ \$i -lt 100 ]; do sbatch -Q --hold -J '$TAG' -o /dev/null --wrap true || exit 1; i=\$((i + 1)); done"
        submitted=$((submitted + 100))
    done
    listed="$(squeue -h -n "$TAG" -o %i | wc -l)"
    [ "$listed" -ge "$n" ] || { echo "FAIL: $listed of $n held jobs listed" >&2; exit 1; }
    : >/tmp/gpuhub-bench-looks.sq; : >/tmp/gpuhub-bench-looks.sc
    for _ in $(seq "$REPEAT"); do
        ms squeue --json -t all >>/tmp/gpuhub-bench-looks.sq
        SLURM_TIME_FORMAT=%s ms scontrol show job -d -o >>/tmp/gpuhub-bench-looks.sc
    done
    sq="$(median </tmp/gpuhub-bench-looks.sq)"; sc="$(median </tmp/gpuhub-bench-looks.sc)"
    bytes="$(squeue --json -t all | wc -c)"
    printf '%8s %14s ms %9s ms %8s %10s\n' "$submitted" "$sq" "$sc" "$(awk -v a="$sq" -v b="$sc" 'BEGIN {printf "%.1f", (b > 0 ? a / b : 0)}')" "$bytes"
done
rm -f /tmp/gpuhub-bench-looks.sq /tmp/gpuhub-bench-looks.sc
