#!/usr/bin/env bash
# What one usage batch costs on PostgreSQL, two builds side by side: the usage writer's path
# (agent/examples/usage_batch_cost.rs: Store::insert_usage_on on a kept connection) inserting
# BATCHES batches of ROWS rows, A and B in alternating rounds against one PostgreSQL server on
# this host (tests/lib/pg.sh), each round on a fresh database. Prints per round the
# PostgreSQL backends' CPU per batch, this process's (the writer's) CPU per batch and the wall
# time per batch of each build, and the medians of B / A. Since 738868a a batch leaves its
# rollups to the writer's fold once a second (Store::fold_rollups_on), which this does not run:
# compare builds on either side of it with bench/gateway-replicas.sh. Rounds alternate because
# this VM's speed drifts from minute to minute more than the change being measured.
#   bench/usage-batch.sh A_BIN [B_BIN]   usage_batch_cost binaries (B_BIN: this tree's
#                                        target/release/examples/usage_batch_cost)
#   BATCHES=3000 ROWS=20 REPEAT=5 by default (20 rows: a 10 ms batch at ~2,000 calls/s)
# A_BIN from another commit: build the example with that commit's agent/src, e.g.
#   git checkout C -- agent/src && cargo build --release -p gpuhub-agent --example usage_batch_cost \
#     && cp target/release/examples/usage_batch_cost /tmp/usage_batch_cost.A; git checkout HEAD -- agent/src
# Needs: root (tests/lib/pg.sh). Results go to stdout.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
BATCHES="${BATCHES:-3000}"; ROWS="${ROWS:-20}"; REPEAT="${REPEAT:-5}"
A="${1:?usage: bench/usage-batch.sh A_BIN [B_BIN]}"
B="${2:-$REPO/target/release/examples/usage_batch_cost}"
for b in "$A" "$B"; do
    [ -x "$b" ] || { echo "missing $b: cargo build --release -p gpuhub-agent --example usage_batch_cost" >&2; exit 2; }
done
URL="$("$REPO/tests/lib/pg.sh")"
trap '"$REPO/tests/lib/pg.sh" stop >/dev/null 2>&1 || true' EXIT
echo "usage batches on PostgreSQL: $BATCHES batches of $ROWS rows per build and round, $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
echo "round | A: PostgreSQL ms, writer ms, wall ms per batch | B: the same | B/A PostgreSQL, writer"
: > "${TMPDIR:-/tmp}/usage-batch.$$"
for i in $(seq "$REPEAT"); do
    a="$("$A" "$URL" "$BATCHES" "$ROWS")"
    b="$("$B" "$URL" "$BATCHES" "$ROWS")"
    read -r apg aw awall <<<"$a"
    read -r bpg bw bwall <<<"$b"
    awk -v i="$i" -v apg="$apg" -v aw="$aw" -v awall="$awall" -v bpg="$bpg" -v bw="$bw" -v bwall="$bwall" \
        'BEGIN { printf "%5d | %.3f %.3f %.3f | %.3f %.3f %.3f | %.3f %.3f\n", i, apg, aw, awall, bpg, bw, bwall, bpg / apg, bw / aw }'
    echo "$apg $aw $bpg $bw" >> "${TMPDIR:-/tmp}/usage-batch.$$"
done
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "median B/A: PostgreSQL CPU per batch $(awk '{ printf "%.3f\n", $3 / $1 }' "${TMPDIR:-/tmp}/usage-batch.$$" | median)," \
     "writer CPU per batch $(awk '{ printf "%.3f\n", $4 / $2 }' "${TMPDIR:-/tmp}/usage-batch.$$" | median)"
echo "median A: PostgreSQL $(awk '{ print $1 }' "${TMPDIR:-/tmp}/usage-batch.$$" | median) ms per batch; B: $(awk '{ print $3 }' "${TMPDIR:-/tmp}/usage-batch.$$" | median) ms"
rm -f "${TMPDIR:-/tmp}/usage-batch.$$"
