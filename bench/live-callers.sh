#!/usr/bin/env bash
# What the quota pass costs PostgreSQL to find a busy worker job's callers, before and since the
# hourly rollup keeps the workers' busy time (migration 0021): agent/examples/live_callers_cost.rs
# on a fresh database of the test PostgreSQL server (tests/lib/pg.sh) with RATE calls per second of
# one model over the last MINUTES minutes, a job started 15 minutes ago (older than LATE_US; five
# minutes of the rows before it), PASSES passes of each read, alternating. Prints the pass's read
# now (LiveCallers::callers: the job's hours from call_rollups), the read the pass made before on
# every pass (the usage rows of the last LATE_US = 10 minutes), the read of the job's whole life the
# old pass made first and repeated every hour (from a day before its start), and the first pass now
# (the rows before the job from inference::earliest_start), with the ratio.
#   bench/live-callers.sh            RATE=2000 MINUTES=20 PASSES=20 by default (2.4 M rows)
# Needs: root (tests/lib/pg.sh). Results go to stdout.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
RATE="${RATE:-2000}"; MINUTES="${MINUTES:-20}"; PASSES="${PASSES:-20}"
(cd "$REPO" && cargo build --release --locked -q -p gpuhub-agent --example live_callers_cost)
URL="$("$REPO/tests/lib/pg.sh")"
trap '"$REPO/tests/lib/pg.sh" stop >/dev/null 2>&1 || true' EXIT
echo "live worker job's callers on PostgreSQL: $RATE calls/s of one model over $MINUTES minutes, $PASSES passes, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
read -r rows ow op nw np ww wp fw fp <<<"$("$REPO/target/release/examples/live_callers_cost" "$URL" "$RATE" "$MINUTES" "$PASSES")"
awk -v rows="$rows" -v ow="$ow" -v op="$op" -v nw="$nw" -v np="$np" -v ww="$ww" -v wp="$wp" -v fw="$fw" -v fp="$fp" 'BEGIN {
    printf "%d usage rows\n", rows
    printf "a pass before (the last 10 minutes of rows):  %9.2f ms wall (median), %8.2f ms PostgreSQL CPU per pass\n", ow, op
    printf "a pass now (kept sums, hours from the rollup): %9.2f ms wall (median), %8.2f ms PostgreSQL CPU per pass\n", nw, np
    printf "the whole read the old pass made every hour:  %9.2f ms wall, %8.2f ms PostgreSQL CPU\n", ww, wp
    printf "the first pass now (once per job and agent):  %9.2f ms wall, %8.2f ms PostgreSQL CPU\n", fw, fp
    printf "now / before: wall %.4f\n", nw / ow
}'
