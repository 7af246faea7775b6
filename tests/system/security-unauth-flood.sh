#!/usr/bin/env bash
# timeout: 240
# Issue 13, unauthenticated flood: as the unprivileged gpuhublab, wrk sends 100,000 requests
# with a made-up key and a 2 KB path to a private agent. They are refused (401, and 429 past
# gateway.unauth_refusals_per_s) without filling the store: after the agent stops, the usage log
# has gained at most 300 rows (one per peer and minute) whose `calls` sum to every refused call,
# the store (SQLite file and WAL) and the state directory grew by at most 4 MiB, and routes are
# cut to 128 characters. The metric counts the refusals of 127.0.0.1. A call with a valid key,
# made during the flood, is answered 200.
set -euo pipefail
. "$(dirname "$0")/../lib/gateway.sh"
. "$(dirname "$0")/../lib/prereq.sh"
command -v wrk >/dev/null || prereq_missing "wrk is not installed" "apt-get install wrk (tests/setup/deps.sh installs it)"
command -v sqlite3 >/dev/null || prereq_missing "sqlite3 is not installed" "apt-get install sqlite3"
USER_="$(unprivileged_user)"
gw_init
chmod 755 "$GW_DIR"
gw_worker demo-chat
gw_config
gw_start
KEY="$(gw_key alice flood)"
gw_rows "SELECT 1" >/dev/null
bytes() { du -s -B1 "$GW_DIR/state" | awk '{print $1}'; }   # blocks in use (journal segments are sparse)
ROWS0="$(gw_rows 'SELECT COUNT(*) FROM usage_log')"
BYTES0="$(bytes)"
N=100000
THREADS=2
LONG="/v1/$(head -c 2000 /dev/zero | tr '\0' p)"
cp "$GW_REPO/tests/lib/flood.lua" "$GW_DIR/flood.lua"
echo "== $N unauthenticated requests as $USER_ (wrk, $THREADS threads, 32 connections)"
start=$SECONDS
# setpriv execs wrk as the user (so $! is wrk itself, which SIGINT stops below).
setpriv --reuid "$USER_" --regid "$USER_" --init-groups -- env FLOOD_PER_THREAD=$((N / THREADS)) wrk -t "$THREADS" -c 32 -d 100s -s "$GW_DIR/flood.lua" \
    -H 'Authorization: Bearer ghk_0000000000000000000000000000000000000000' "$GW_URL$LONG" >"$GW_DIR/wrk.out" 2>"$GW_DIR/wrk.err" &
WRK=$!
GW_PIDS+=("$WRK")
sleep 3
during="$(curl -s -o /dev/null -w '%{http_code} %{time_total}' -H "Authorization: Bearer $KEY" -H 'content-type: application/json' \
    -d '{"model":"demo-chat","messages":[{"role":"user","content":"hi"}]}' "$GW_URL/v1/chat/completions")"
echo "a call with a valid key during the flood: $during"
# wrk runs for its whole -d even after every thread stopped; once the agent has refused N
# calls, SIGINT makes it print its summary and exit.
refused_so_far() { curl -s "http://127.0.0.1:$GW_METRICS_PORT/metrics" | awk '/^gpuhub_gateway_refused_calls_total\{peer="127.0.0.1"/ {s += $2} END {print s + 0}'; }
while kill -0 "$WRK" 2>/dev/null && [ "$(refused_so_far)" -lt "$N" ]; do sleep 0.5; done
sleep 1
kill -INT "$WRK" 2>/dev/null || true
wait "$WRK" || gw_fail "wrk failed: $(cat "$GW_DIR/wrk.err")"
cat "$GW_DIR/wrk.out"; cat "$GW_DIR/wrk.err"
echo "flood took $((SECONDS - start)) s"
[ "${during%% *}" = 200 ] || gw_fail "a call with a valid key got ${during%% *} during the flood"
sent="$(awk '/requests in/ {print $1}' "$GW_DIR/wrk.out")"
[ "${sent:-0}" -ge "$N" ] || gw_fail "wrk completed ${sent:-0} requests, want at least $N"
other="$(awk '$1 == "status" && $2 != 401 && $2 != 429 {s += $3} END {print s + 0}' "$GW_DIR/wrk.err")"
[ "$other" -eq 0 ] || gw_fail "$other answers were neither 401 nor 429"
m="$(curl -s "http://127.0.0.1:$GW_METRICS_PORT/metrics")"
counted="$(awk -F' ' '/^gpuhub_gateway_refused_calls_total\{peer="127.0.0.1"/ {s += $2} END {print s + 0}' <<<"$m")"
echo "gpuhub_gateway_refused_calls_total{peer=\"127.0.0.1\"} (all codes): $counted"
[ "$counted" -ge "$N" ] || gw_fail "the metric counts $counted refusals for 127.0.0.1, want at least $N"
gw_stop   # records the current minute's refusal row
ROWS1="$(gw_rows 'SELECT COUNT(*) FROM usage_log')"
BYTES1="$(bytes)"
CALLS="$(gw_rows "SELECT CAST(SUM(calls) AS BIGINT) FROM usage_log WHERE user_name = ''")"
LONGEST="$(gw_rows 'SELECT MAX(LENGTH(route)) FROM usage_log')"
echo "usage rows $ROWS0 -> $ROWS1; refused calls in them: $CALLS; longest route: $LONGEST; state dir $BYTES0 -> $BYTES1 bytes"
[ $((ROWS1 - ROWS0)) -le 300 ] || gw_fail "$N unauthenticated requests added $((ROWS1 - ROWS0)) usage rows (want at most 300)"
[ "$CALLS" -ge "$sent" ] || gw_fail "the refusal rows count $CALLS calls, wrk got $sent answers"
[ "$LONGEST" -le 128 ] || gw_fail "a route of $LONGEST characters was stored (want at most 128)"
[ $((BYTES1 - BYTES0)) -le $((4 * 1024 * 1024)) ] || gw_fail "the state directory grew by $((BYTES1 - BYTES0)) bytes (want at most 4 MiB)"
echo "PASS security-unauth-flood: $sent requests, $((ROWS1 - ROWS0)) rows, $((BYTES1 - BYTES0)) bytes"
