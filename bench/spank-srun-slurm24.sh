#!/usr/bin/env bash
# Benchmark: what the gpuhub SPANK plugin adds to `srun -N1 true` on Slurm 24.11 (the lab's
# second Slurm, tests/lab/slurm24.sh), measured as part 2 of bench/spank-srun.sh measures it on
# 22.05: N rounds, each runs srun once with the plugin's plugstack line present and once with it
# absent (order alternating per round), the plugin with a private spool, snapshot and job key
# (the same fixture as spank_fixture: StepStart/StepEnd records, snapshot read, token HMAC,
# spank_setenv all run); prints each series' median and the difference. The loop runs on the
# host with the 24.11 leg's srun (tests/lab/slurm24.sh run), so only srun is timed.
#
# Both parts of bench/spank-srun.sh (against a Slurm with no gpuhub, and the job-hooks build
# with and without PrologFlags=Alloc) run on the leg as they are, with the leg's environment:
#   tests/lab/slurm24.sh up && GPUHUB_LAB_SLURM=24.11 PATH=/run/gpuhub-lab24/bin:$PATH \
#     SLURM_CONF=/var/lib/gpuhub-lab/slurm24-root/etc/slurm/slurm.conf bench/spank-srun.sh 25
#
# Usage (root): bench/spank-srun-slurm24.sh [ROUNDS]   (default 30)
# Starts the 24.11 lab if it is not up (tests/lab/slurm24.sh up, which stops the 22.05 lab's
# daemons) and stops it again then (tests/lab/up.sh brings the 22.05 lab back);
# restores the root's plugstack line at exit.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
ROUNDS="${1:-30}"
ROOT="${GPUHUB_SLURM24_ROOT:-/var/lib/gpuhub-lab/slurm24-root}"
LAB24="$REPO/tests/lab/slurm24.sh"
CONF="$ROOT/etc/slurm/plugstack.conf.d/gpuhub.conf"
started=0
if ! "$LAB24" run sinfo -h -n gpu01 -o %T 2>/dev/null | grep -qE '^(idle|mixed)'; then
    GPUHUB_LAB_BUILD="${GPUHUB_LAB_BUILD:-1}" "$LAB24" up
    started=1
fi
ON_ORIG="$(cat "$CONF")"
T=/tmp/gpuhub-bench24
rm -rf "$T"; mkdir -p "$T/spool"; chmod 755 "$T"
cleanup() {
    printf '%s\n' "$ON_ORIG" > "$CONF"
    rm -rf "$T"
    [ "$started" = 0 ] || "$LAB24" down
}
trap cleanup EXIT
cat > "$T/snapshot.json" <<'JSON'
{"version":1,"generated_at":1,"gateway_url":"http://127.0.0.1:8400","mlflow_tracking_uri":"http://127.0.0.1:5000",
 "mlflow_experiment":"lab-default","roles":{"ocr":"dots.ocr","tts":null},
 "gpus":{"0":"GPU-00000000-test-0000-0000-000000000000","1":"GPU-11111111-test-1111-1111-111111111111"}}
JSON
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$T/job-token.key"; chmod 600 "$T/job-token.key"
ON="$ON_ORIG spool_dir=$T/spool snapshot=$T/snapshot.json job_key=$T/job-token.key dcgm_job_map_dir=$T/dcgm-job-map"
printf '%s\n' "$ON" > "$T/on.conf"
: > "$T/off.conf"
# The loop, inside the root: per round copy on/off over the plugstack file, wait for an idle
# queue (untimed), time srun.
cat > "$T/loop.sh" <<SH
#!/bin/sh
set -e
T=/tmp/gpuhub-bench24; conf=$CONF
SH
cat >> "$T/loop.sh" <<'SH'
run() {
    cp "$T/$1.conf" "$conf"
    i=0; while [ -n "$(squeue -h)" ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i + 1)); done
    t0=$(date +%s%N); timeout 60 srun -Q -N1 true; t1=$(date +%s%N)
    echo $(( (t1 - t0) / 1000 )) >> "$T/$1"
}
r=0
while [ $r -lt "$1" ]; do
    if [ $((r % 2)) = 0 ]; then run on; run off; else run off; run on; fi
    r=$((r + 1))
done
SH
"$LAB24" run sh "$T/loop.sh" "$ROUNDS"
median() { sort -n | awk '{a[NR]=$1} END {if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
on_us="$(median < "$T/on")"; off_us="$(median < "$T/off")"
recs="$(find "$T/spool/records" -name '*.json' 2>/dev/null | wc -l)"
[ "$recs" -ge "$ROUNDS" ] || { echo "the plugin wrote $recs records for $ROUNDS runs: it did not run" >&2; exit 1; }
echo "Slurm $("$LAB24" run srun -V | awk '{print $2}'), load average $(cut -d' ' -f1-3 /proc/loadavg)"
awk -v n="$ROUNDS" -v on="$on_us" -v off="$off_us" 'BEGIN {
    printf "srun -N1 true, %d interleaved rounds (median wall time)\n", n
    printf "  plugstack line absent  %7.1f ms\n", off / 1000
    printf "  plugstack line present %7.1f ms   (+%.1f ms)\n", on / 1000, (on - off) / 1000 }'
