#!/usr/bin/env bash
# Gateway benchmark: wrk against a fast upstream (the repo's test worker) directly and through
# the gateway, in one run, for plain and streaming chat calls. Prints, per mode:
#   - added p50/p99 latency at ~RATE requests/s (wrk's delay() paces each connection),
#   - the throughput ratio at saturation (gateway / direct),
#   - the gateway's CPU-seconds per 1000 requests (utime+stime from /proc/<pid>/stat),
# and the streamed-chunk forwarding delay (bench/gateway_chunks.py).
#   bench/gateway.sh                 DURATION=10 RATE=2000 CONNS=20 REPEAT=3 by default
#   STORE=postgres://... bench/gateway.sh   the same on a PostgreSQL store (default: SQLite)
#   MODES=plain QUICK=1 bench/gateway.sh     plain calls' paced pairs only (no saturated runs, no
#                                            chunk delays): bench/gateway-replicas.sh's reference
# Each paced pair also calls the same worker through nginx (bench/lib/nginx.sh): the floor, what
# any reverse proxy adds on this host in the same minute, so a figure above the targets can be
# told from a host on which no proxy meets them.
# Needs: cargo build --release; wrk and nginx-light (apt, tests/setup/deps.sh). Results go to
# stdout; copy them to BENCHMARKS.md.
set -euo pipefail
source "$(dirname "$0")/../tests/lib/gateway.sh"
command -v wrk >/dev/null || gw_fail "wrk not installed (apt-get install wrk)"
command -v nginx >/dev/null || gw_fail "nginx not installed (apt-get install nginx-light): each pair measures it as the proxy floor"
DURATION="${DURATION:-10}"; RATE="${RATE:-2000}"; CONNS="${CONNS:-20}"; REPEAT="${REPEAT:-3}"
gw_init
gw_worker demo-chat
gw_config ${STORE:+"$STORE"}
gw_start
KEY="$(gw_key bench wrk)"
DIRECT="http://$GW_WORKER_ADDR"
WRK_DIR="$GW_DIR"
. "$(dirname "$0")/lib/wrk.sh"
. "$(dirname "$0")/lib/nginx.sh"
nginx_start "$GW_WORKER_ADDR" || gw_fail "the proxy floor (nginx) did not start"
GW_PIDS+=("$NGINX_PID")
# run NAME URL AUTH BODY CONNS DELAY_MS -> sets P50 P99 RPS REQS
run() { wrk_run "$@" || gw_fail "$1: the benchmark got non-2xx answers"; }

echo "gateway benchmark: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) at start, wrk -t2, ${DURATION}s per run, paced runs: $CONNS connections at ~$RATE req/s"
echo "upstream: gpuhub-test-worker at $DIRECT; gateway: $GW_URL (pid $GW_AGENT_PID); proxy floor: nginx at $NGINX_URL (worker pid $NGINX_WORKER)"
DELAY=$(( CONNS * 1000 / RATE ))
WORKER_PID="${GW_PIDS[0]}"
# Paced pairs alternate direct and gateway REPEAT times; the medians are printed (one shared
# 2-core VM drifts by +-15 % between minutes, so one pair proves little).
median() { sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
for mode in ${MODES:-plain stream}; do
    if [ "$mode" = plain ]; then
        BODY='{"model":"demo-chat","messages":[{"role":"user","content":"hello"}]}'
    else
        BODY='{"model":"demo-chat","stream":true,"messages":[{"role":"user","content":"hello"}]}'
    fi
    : >"$GW_DIR/pairs-$mode"
    for i in $(seq "$REPEAT"); do
        S0="$(steal_ticks)"
        W0="$(cpu_ticks "$WORKER_PID")"
        run "$mode-direct-paced-$i" "$DIRECT" worker-key "$BODY" "$CONNS" "$DELAY"; D50=$P50; D99=$P99; DRPS=$RPS; DREQS=$REQS
        W1="$(cpu_ticks "$WORKER_PID")"
        C0="$(cpu_ticks "$GW_AGENT_PID")"
        run "$mode-gateway-paced-$i" "$GW_URL" "$KEY" "$BODY" "$CONNS" "$DELAY"; G50=$P50; G99=$P99; GRPS=$RPS; GREQS=$REQS
        C1="$(cpu_ticks "$GW_AGENT_PID")"
        N0="$(cpu_ticks "$NGINX_WORKER")"
        run "$mode-nginx-paced-$i" "$NGINX_URL" worker-key "$BODY" "$CONNS" "$DELAY"; N50=$P50; N99=$P99; NREQS=$REQS
        N1="$(cpu_ticks "$NGINX_WORKER")"
        S1="$(steal_ticks)"
        awk -v st="$((S1 - S0))" -v d50="$D50" -v d99="$D99" -v g50="$G50" -v g99="$G99" -v drps="$DRPS" -v grps="$GRPS" -v tick="$TICK" \
            -v c="$((C1 - C0))" -v reqs="$GREQS" -v w="$((W1 - W0))" -v dreqs="$DREQS" -v n50="$N50" -v n99="$N99" -v n="$((N1 - N0))" -v nreqs="$NREQS" \
            'BEGIN { printf "%.0f %.0f %.0f %.0f %.0f %.0f %.4f %.4f %d %.0f %.0f %.4f\n", d50, d99, g50, g99, drps, grps, (c / tick) / (reqs / 1000), (w / tick) / (dreqs / 1000), st, n50, n99, (n / tick) / (nreqs / 1000) }' >>"$GW_DIR/pairs-$mode"
    done
    col() { awk -v c="$1" '{ print $c }' "$GW_DIR/pairs-$mode" | median; }
    addcol() { awk -v a="$1" -v b="$2" '{ print $a - $b }' "$GW_DIR/pairs-$mode" | median; }
    DMAX=0; GMAX=0
    if [ -z "${QUICK:-}" ]; then
        run "$mode-direct-max" "$DIRECT" worker-key "$BODY" 32 0; DMAX=$RPS
        run "$mode-gateway-max" "$GW_URL" "$KEY" "$BODY" 32 0; GMAX=$RPS
    fi
    echo "$mode  paced pairs (direct p50 p99 | gateway p50 p99 us | direct, gateway req/s | gateway, worker CPU-s per 1000 | host steal ticks | nginx p50 p99 us, CPU-s per 1000):"
    sed 's/^/        /' "$GW_DIR/pairs-$mode"
    awk -v m="$mode" -v d50="$(col 1)" -v d99="$(col 2)" -v g50="$(col 3)" -v g99="$(col 4)" -v a50="$(addcol 3 1)" -v a99="$(addcol 4 2)" \
        -v grps="$(col 6)" -v dmax="$DMAX" -v gmax="$GMAX" -v cpu="$(col 7)" -v wcpu="$(col 8)" -v n="$REPEAT" \
        -v n50="$(addcol 10 1)" -v n99="$(addcol 11 2)" -v ncpu="$(col 12)" 'BEGIN {
        printf "%-6s paced, median of %d pairs: direct p50 %.0f us p99 %.0f us | gateway %.0f req/s p50 %.0f us p99 %.0f us | added p50 %.0f us, p99 %.0f us\n", m, n, d50, d99, grps, g50, g99, a50, a99
        if (dmax > 0) printf "%-6s max:   direct %.0f req/s, gateway %.0f req/s, ratio %.2f\n", m, dmax, gmax, gmax / dmax
        printf "%-6s cpu:   gateway %.3f CPU-s per 1000 requests (median); for scale, the worker answering the direct run: %.3f\n", m, cpu, wcpu
        printf "%-6s floor: nginx in front of the same worker, median of %d: added p50 %.0f us, p99 %.0f us, %.3f CPU-s per 1000 requests\n", m, n, n50, n99, ncpu
    }'
done
# The gateway's own account of its overhead (latency minus time waiting for the upstream), from
# the usage rows of every call above.
pct() { gw_rows "SELECT $1 FROM usage_log WHERE status = 200 AND streamed = $2 ORDER BY $1 LIMIT 1 OFFSET (SELECT COUNT(*) * $3 / 100 FROM usage_log WHERE status = 200 AND streamed = $2)"; }
sleep 1
for s in 0 1; do
    [ "$s" = 0 ] || [[ " ${MODES:-stream} " == *" stream "* ]] || continue
    echo "usage rows (streamed=$s): overhead_us p50 $(pct overhead_us $s 50) p99 $(pct overhead_us $s 99); upstream_ttfb_us p50 $(pct upstream_ttfb_us $s 50)"
done
gw_stop
[ -z "${QUICK:-}" ] || exit 0
# Streamed chunks: a worker that waits 100 ms between chunks (an idle gap, as between a real
# model's tokens) and stamps each one (--stamp-chunks), read directly and through the gateway.
kill "${GW_PIDS[0]}" 2>/dev/null || true
gw_worker demo-chat --token-delay-ms 100 --stamp-chunks
gw_config ${STORE:+"$STORE"}
gw_start
KEY="$(gw_key bench chunks)"
echo "stream chunk forwarding (worker sends a chunk every 100 ms): $(python3 "$GW_REPO/bench/gateway_chunks.py" "http://$GW_WORKER_ADDR" worker-key "$GW_URL" "$KEY" 15)"
gw_stop
