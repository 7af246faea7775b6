#!/usr/bin/env bash
# Two gateway builds side by side: each with its own test worker and SQLite store (the config
# of tests/lib/gateway.sh), both under the same paced plain-call load at the same time. This
# 2-core VM's speed drifts from minute to minute (the host's steal, a neighbour's load), so runs
# of one build after the other can differ by more than the change being measured; two builds
# measured in the same seconds drift alike. Prints each round's CPU-s per 1,000 calls of each
# gateway, the host's steal in that round, and the median ratio B / A.
#   bench/gateway-ab.sh A_BIN [B_BIN]   directories holding gpuhub-agent, gpuhub and
#                                       gpuhub-test-worker (B_BIN: this tree's target/release)
#   DURATION=10 RATE=1000 CONNS=10 REPEAT=5 by default (RATE per gateway)
#   A_ENV, B_ENV: NAME=VALUE words for that gateway's agent only, to compare one build under
#   two settings (e.g. B_ENV=TOKIO_WORKER_THREADS=1 bench/gateway-ab.sh target/release)
# Both gateways call B's test worker binary; A's agent must accept this tree's agent.toml.
# Needs: wrk (apt). Results go to stdout.
set -euo pipefail
DURATION="${DURATION:-10}"; RATE="${RATE:-1000}"; CONNS="${CONNS:-10}"; REPEAT="${REPEAT:-5}"

if [ "${1:-}" = --instance ]; then
    # One gateway: --instance TAG AGENT_BIN WORKER_BIN SYNC_DIR. Round i starts when
    # SYNC_DIR/go.i exists; its result is SYNC_DIR/res.TAG.i ("CPU-s per 1000, req/s, p99 us").
    TAG="$2"; SYNC="$5"
    GW_BIN="$4"
    source "$(dirname "$0")/../tests/lib/gateway.sh"
    gw_init
    gw_worker demo-chat
    GW_BIN="$3"
    gw_config
    if [ "$TAG" = A ]; then GW_AGENT_ENV="${A_ENV:-}"; else GW_AGENT_ENV="${B_ENV:-}"; fi
    gw_start
    KEY="$(gw_key bench wrk)"
    WRK_DIR="$GW_DIR"
    . "$(dirname "$0")/lib/wrk.sh"
    BODY='{"model":"demo-chat","messages":[{"role":"user","content":"hello"}]}'
    touch "$SYNC/ready.$TAG"
    for i in $(seq "$REPEAT"); do
        while [ ! -e "$SYNC/go.$i" ]; do sleep 0.05; done
        C0="$(cpu_ticks "$GW_AGENT_PID")"
        wrk_run "$TAG-$i" "$GW_URL" "$KEY" "$BODY" "$CONNS" $(( CONNS * 1000 / RATE )) || gw_fail "$TAG: the benchmark got non-2xx answers"
        C1="$(cpu_ticks "$GW_AGENT_PID")"
        awk -v c="$((C1 - C0))" -v tick="$TICK" -v reqs="$REQS" -v rps="$RPS" -v p99="$P99" \
            'BEGIN { printf "%.4f %.0f %.0f\n", (c / tick) / (reqs / 1000), rps, p99 }' >"$SYNC/res.$TAG.$i.tmp"
        mv "$SYNC/res.$TAG.$i.tmp" "$SYNC/res.$TAG.$i"
    done
    gw_stop
    exit 0
fi

command -v wrk >/dev/null || { echo "wrk not installed (apt-get install wrk)" >&2; exit 1; }
REPO="$(cd "$(dirname "$0")/.." && pwd)"
A_BIN="${1:?usage: bench/gateway-ab.sh A_BIN [B_BIN] (directories with gpuhub-agent, gpuhub, gpuhub-test-worker)}"
B_BIN="${2:-$REPO/target/release}"
for d in "$A_BIN" "$B_BIN"; do
    for b in gpuhub-agent gpuhub gpuhub-test-worker; do
        [ -x "$d/$b" ] || { echo "$d/$b missing" >&2; exit 1; }
    done
done
SYNC="$(mktemp -d /tmp/gpuhub-ab.XXXXXX)"
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$SYNC"
}
trap cleanup EXIT
for t in A B; do
    bin="$A_BIN"; [ "$t" = B ] && bin="$B_BIN"
    "$0" --instance "$t" "$bin" "$B_BIN" "$SYNC" >"$SYNC/log.$t" 2>&1 &
    PIDS+=($!)
done
for i in $(seq 300); do
    [ -e "$SYNC/ready.A" ] && [ -e "$SYNC/ready.B" ] && break
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { cat "$SYNC"/log.* >&2; exit 1; }; done
    sleep 0.1
done
WRK_DIR="$SYNC"
. "$(dirname "$0")/lib/wrk.sh"   # steal_ticks
echo "gateway A/B: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start; both at ~$RATE req/s ($CONNS connections), ${DURATION}s per round, at the same time"
echo "A: $A_BIN${A_ENV:+ with $A_ENV}"
echo "B: $B_BIN${B_ENV:+ with $B_ENV}"
echo "round  A CPU-s/1000  B CPU-s/1000  B/A    A req/s  B req/s  A p99 us  B p99 us  host steal (ticks)"
: >"$SYNC/ratios"
for i in $(seq "$REPEAT"); do
    s0="$(steal_ticks)"
    touch "$SYNC/go.$i"
    until [ -e "$SYNC/res.A.$i" ] && [ -e "$SYNC/res.B.$i" ]; do
        for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null || { cat "$SYNC"/log.* >&2; exit 1; }; done
        sleep 0.1
    done
    read -r ca ra pa <"$SYNC/res.A.$i"
    read -r cb rb pb <"$SYNC/res.B.$i"
    awk -v i="$i" -v ca="$ca" -v cb="$cb" -v ra="$ra" -v rb="$rb" -v pa="$pa" -v pb="$pb" -v st="$(( $(steal_ticks) - s0 ))" \
        'BEGIN { printf "%5d  %12.4f  %12.4f  %5.3f  %7.0f  %7.0f  %8.0f  %8.0f  %d\n", i, ca, cb, cb / ca, ra, rb, pa, pb, st }'
    awk -v ca="$ca" -v cb="$cb" 'BEGIN { printf "%.4f\n", cb / ca }' >>"$SYNC/ratios"
done
wait "${PIDS[@]}"
PIDS=()
echo "median B/A CPU per call: $(sort -n "$SYNC/ratios" | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }') (over $REPEAT rounds)"
