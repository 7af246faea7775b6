#!/usr/bin/env bash
# Kill -9 the agent during a burst of calls, while another process holds the store's write lock,
# so that answered calls exist only in the usage journal at the kill; after a restart those
# calls come from the journal's replay, every call that got a response has exactly one usage
# row (inserts are idempotent), and the call rollups count each call once.
set -euo pipefail
source "$(dirname "$0")/../lib/gateway.sh"
gw_init
gw_worker demo-chat
gw_config
gw_start
KEY="$(gw_key alice burst)"
DB="${GW_STORE_URL#sqlite://}"
echo "burst: 8 clients against $GW_URL, agent pid $GW_AGENT_PID"
python3 "$GW_REPO/tests/lib/gateway_burst.py" "$GW_URL" "$KEY" "$GW_DIR/responses" --threads 8 --seconds 20 &
BURST=$!
sleep 1.5
# For the last seconds before the kill another process holds the store's write lock (as a long
# admin transaction or a stuck disk would), so the calls answered then are in the journal only:
# after the restart they must come from the replay, not from writes that happened to finish.
python3 - "$DB" "$GW_DIR/locked" <<'PY' &
import sqlite3, sys, time
c = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)
c.execute("BEGIN EXCLUSIVE")
open(sys.argv[2], "w").close()
time.sleep(3)
c.execute("ROLLBACK")
PY
LOCKER=$!
for i in $(seq 100); do [ -e "$GW_DIR/locked" ] && break; sleep 0.05; done
[ -e "$GW_DIR/locked" ] || gw_fail "could not take the store's write lock within 5 s"
AT_LOCK="$(grep -c . "$GW_DIR/responses" || true)"
sleep 2
gw_kill9
wait "$LOCKER" || gw_fail "the lock holder failed"
wait "$BURST" || true
GOT="$(grep -c . "$GW_DIR/responses" || true)"
echo "kill -9 after ${GOT} responses (${AT_LOCK} before the store was locked); journal: $(ls "$GW_DIR/state/usage-journal" | tr '\n' ' ')"
[ "$GOT" -gt 50 ] || gw_fail "expected a burst of more than 50 responses before the kill, got $GOT"
[ "$GOT" -gt $((AT_LOCK + 20)) ] || gw_fail "only $((GOT - AT_LOCK)) calls were answered while the store was locked (expected more than 20: the gateway must keep answering from the journal)"
awk '{print $2}' "$GW_DIR/responses" | sort -u >"$GW_DIR/ids"
gw_rows 'SELECT request_id FROM usage_log' | sort -u >"$GW_DIR/stored-before"
BEFORE="$(wc -l <"$GW_DIR/stored-before")"
PENDING="$(comm -23 "$GW_DIR/ids" "$GW_DIR/stored-before" | wc -l)"
echo "answered but not in the store at the kill: $PENDING"
[ "$PENDING" -gt 0 ] || gw_fail "every answered call was already stored at the kill, so nothing tests the replay (the lock did not hold back the writer)"
gw_start
for i in $(seq 100); do
    gw_rows 'SELECT request_id FROM usage_log' | sort -u >"$GW_DIR/stored"
    MISSING="$(comm -23 "$GW_DIR/ids" "$GW_DIR/stored" | wc -l)"
    [ "$MISSING" -eq 0 ] && break
    sleep 0.2
done
gw_rolled_up
REPLAYED="$(comm -13 "$GW_DIR/stored-before" "$GW_DIR/stored" | comm -12 - "$GW_DIR/ids" | wc -l)"
echo "responses=$GOT rows_before_restart=$BEFORE rows_after=$ROWS replayed=$REPLAYED rollup_calls=$ROLLED missing=$MISSING"
[ "$MISSING" -eq 0 ] || gw_fail "$MISSING calls got a response but have no usage row (expected 0); e.g. $(comm -23 "$GW_DIR/ids" "$GW_DIR/stored" | head -n 3 | tr '\n' ' ')"
[ "$REPLAYED" -eq "$PENDING" ] || gw_fail "$PENDING answered calls were only in the journal at the kill, but $REPLAYED of them reached the store after the restart"
grep -q "replaying the journal" "$GW_DIR/agent.log" || gw_fail "the restarted agent did not log that it replayed the journal"
[ "$ROWS" -eq "$ROLLED" ] || gw_fail "rollups count $ROLLED calls for $ROWS rows (expected equal: a replayed row was counted twice)"
# Rows the client never saw (answered as the kill hit) may exist; more than the in-flight
# clients could have sent would mean duplicates under new ids.
[ "$ROWS" -le $((GOT + 8)) ] || gw_fail "$ROWS rows for $GOT responses + 8 in flight (expected at most $((GOT + 8)))"
gw_stop
echo "PASS gateway-kill9: $GOT responses, $PENDING only in the journal at the kill and replayed, $ROWS rows, none lost, none twice"
