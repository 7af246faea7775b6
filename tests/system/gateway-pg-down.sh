#!/usr/bin/env bash
# Stop PostgreSQL during load: calls go on (keys are checked from memory; rows wait in the
# on-disk journal), and every row arrives once the database is back. Uses its own throw-away
# PostgreSQL (not the shared test server, which other tests use at the same time).
set -euo pipefail
source "$(dirname "$0")/../lib/gateway.sh"
gw_init
PGBIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
[ -x "$PGBIN/pg_ctl" ] || gw_fail "PostgreSQL binaries not found; run tests/setup/deps.sh"
PGDATA="$GW_DIR/pg"; PGPORT="$(gw_free_port)"
mkdir -p "$PGDATA"; chown postgres:postgres "$PGDATA" "$GW_DIR"; chmod 755 "$GW_DIR"
runuser -u postgres -- "$PGBIN/initdb" -D "$PGDATA" -A trust -U postgres >/dev/null
printf "listen_addresses = '127.0.0.1'\nport = %s\nunix_socket_directories = '%s'\nfsync = off\n" "$PGPORT" "$PGDATA" >>"$PGDATA/postgresql.conf"
pg() { runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGDATA" -l "$PGDATA/log" -w -t 30 "$@" >/dev/null; }
stop_pg() { pg -m immediate stop || true; }
pg start
trap 'stop_pg; gw_cleanup' EXIT
gw_worker demo-chat
gw_config "postgres://postgres@127.0.0.1:$PGPORT/postgres"
gw_start
KEY="$(gw_key alice pgtest)"
python3 "$GW_REPO/tests/lib/gateway_burst.py" "$GW_URL" "$KEY" "$GW_DIR/responses" --threads 4 --seconds 10 &
BURST=$!
sleep 2
echo "stopping PostgreSQL (immediate) during the burst"
stop_pg
sleep 1
DURING_START="$(grep -c . "$GW_DIR/responses" || true)"
sleep 3
DURING_END="$(grep -c . "$GW_DIR/responses" || true)"
READY="$(curl -s -o /dev/null -w '%{http_code}' "$GW_URL/readyz" || true)"
echo "while the database was down: $((DURING_END - DURING_START)) responses in 3 s; /readyz answered $READY"
[ $((DURING_END - DURING_START)) -gt 20 ] || gw_fail "calls stopped while PostgreSQL was down (expected them to go on)"
[ "$READY" = 503 ] || gw_fail "/readyz answered $READY with the store down (expected 503)"
waiting() { curl -sf "http://127.0.0.1:$GW_METRICS_PORT/metrics" | awk '$1 == "gpuhub_gateway_usage_rows_waiting" {print $2}'; }
WAITING="$(waiting)"
echo "rows waiting for the store while it is down: $WAITING"
[ "${WAITING:-0}" -gt 20 ] || gw_fail "gpuhub_gateway_usage_rows_waiting is '${WAITING}' with the store down during calls (expected the rows in the journal)"
DOCTOR="$("$GW_BIN/gpuhub" --socket "$GW_SOCKET" doctor 2>&1 || true)"
grep -q "the store has refused usage writes for .* row(s) wait in the journal" <<<"$DOCTOR" \
    || gw_fail "gpuhub doctor does not say that usage rows wait for the store: $DOCTOR"
echo "starting PostgreSQL again"
pg start
wait "$BURST" || true
GOT="$(grep -c . "$GW_DIR/responses")"
BAD="$(awk '$1 != 200' "$GW_DIR/responses" | wc -l)"
[ "$BAD" -eq 0 ] || gw_fail "$BAD of $GOT calls failed during the outage (expected all 200): $(awk '$1 != 200' "$GW_DIR/responses" | head -n 3 | tr '\n' ' ')"
awk '{print $2}' "$GW_DIR/responses" | sort -u >"$GW_DIR/ids"
MISSING=-1
for i in $(seq 150); do
    if gw_rows 'SELECT request_id FROM usage_log' 2>/dev/null | sort -u >"$GW_DIR/stored"; then
        MISSING="$(comm -23 "$GW_DIR/ids" "$GW_DIR/stored" | wc -l)"
        [ "$MISSING" -eq 0 ] && break
    fi
    sleep 0.2
done
gw_rolled_up
echo "responses=$GOT rows=$ROWS rollup_calls=$ROLLED missing=$MISSING"
[ "$MISSING" -eq 0 ] || gw_fail "$MISSING calls have no usage row 30 s after PostgreSQL came back (expected 0)"
[ "$ROWS" -eq "$GOT" ] || gw_fail "$ROWS rows for $GOT responses (expected equal)"
[ "$ROWS" -eq "$ROLLED" ] || gw_fail "rollups count $ROLLED calls for $ROWS rows"
WAITING="$(waiting)"
[ "$WAITING" = 0 ] || gw_fail "gpuhub_gateway_usage_rows_waiting is '$WAITING' after every row arrived (expected 0)"
grep -q "the store refused a batch" "$GW_DIR/agent.log" || gw_fail "the agent never noticed the outage (expected a warning in its log)"
gw_stop
echo "PASS gateway-pg-down: $GOT calls, all answered, all $ROWS rows arrived after the outage"
