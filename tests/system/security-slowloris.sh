#!/usr/bin/env bash
# timeout: 180
# Issue 13, slowloris: as the unprivileged gpuhublab, 1,000 connections each send part of a
# request head to a private agent (header timeout 4 s) and stall. Another client's call (a key,
# the TEST worker as the model) is answered within 1 s meanwhile, and every half-open
# connection is closed after the header timeout (not before it, and within 3 s after it), with a
# 408 that names gateway.header_timeout_s. The agent's metrics count them.
set -euo pipefail
. "$(dirname "$0")/../lib/gateway.sh"
. "$(dirname "$0")/../lib/prereq.sh"
USER_="$(unprivileged_user)"
gw_init
gw_worker demo-chat
gw_config
gw_config_add gateway 'header_timeout_s = 4'
gw_start
KEY="$(gw_key alice slowloris)"
N=1000
echo "== $N half-open connections as $USER_, then one call"
res="$(runuser -u "$USER_" -- python3 "$GW_REPO/tests/lib/slowloris.py" 127.0.0.1 "$GW_PORT" "$KEY" "$N" 4)"
echo "$res"
j() { python3 -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$res" "$1"; }
[ "$(j call_status)" = 200 ] || gw_fail "the other client's call got $(j call_status)"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < 1.0 else 1)" "$(j call_s)" ||
    gw_fail "the other client's call took $(j call_s) s with $N half-open connections (want < 1 s)"
[ "$(j closed)" = "$N" ] || gw_fail "only $(j closed) of $N half-open connections were closed within twice the header timeout"
[ "$(j closed_early)" = 0 ] || gw_fail "$(j closed_early) connections were closed before the header timeout"
python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) <= 7.0 else 1)" "$(j close_max_s)" ||
    gw_fail "the last half-open connection was closed $(j close_max_s) s after they opened (header timeout 4 s)"
[ "$(j told_408)" -ge $((N * 9 / 10)) ] || gw_fail "only $(j told_408) of $N were told 408 with the limit's key"
m="$(curl -s "http://127.0.0.1:$GW_METRICS_PORT/metrics")"
grep -E '^gpuhub_gateway_connection_timeouts_total\{kind="header"\} [0-9]+' <<<"$m" || gw_fail "no header-timeout metric"
count="$(sed -n 's/^gpuhub_gateway_connection_timeouts_total{kind="header"} \([0-9]*\).*/\1/p' <<<"$m")"
[ "$count" -ge "$N" ] || gw_fail "the metric counts $count header timeouts, want $N"
kill -0 "$GW_AGENT_PID" || gw_fail "the agent died"
gw_stop
echo "PASS security-slowloris: call answered in $(j call_s) s; $N half-open connections closed after $(j close_min_s)-$(j close_max_s) s"
