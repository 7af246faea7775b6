#!/usr/bin/env bash
# timeout: 240
# Issue 13, the usage writer never stalls, on PostgreSQL (a private throw-away server):
#   1. as the unprivileged gpuhublab (with an API key), calls whose `model` holds a NUL byte (and
#      other control characters) get 400 invalid_model_name with a message that says what is
#      wrong, and so do such names (and one not UTF-8, or too long) in GET /v1/models/{name};
#      the writer keeps writing: a later call's row reaches PostgreSQL;
#   2. a row PostgreSQL refuses anyway (a CHECK constraint the site added, which only the database
#      knows) goes to <state_dir>/usage-dead-letter.jsonl with the database's reason, the metric
#      gateway_usage_rows_dead_lettered_total counts it, `gpuhub doctor` fails its usage-log check
#      naming the file, and the rows of the calls around it are stored.
set -euo pipefail
. "$(dirname "$0")/../lib/gateway.sh"
. "$(dirname "$0")/../lib/prereq.sh"
USER_="$(unprivileged_user)"
gw_init
PGBIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
[ -x "$PGBIN/pg_ctl" ] || prereq_missing "PostgreSQL binaries not found" "run tests/setup/deps.sh"
PGDATA="$GW_DIR/pg"; PGPORT="$(gw_free_port)"
mkdir -p "$PGDATA"; chown postgres:postgres "$PGDATA"; chmod 755 "$GW_DIR"
runuser -u postgres -- "$PGBIN/initdb" -D "$PGDATA" -A trust -U postgres >/dev/null
printf "listen_addresses = '127.0.0.1'\nport = %s\nunix_socket_directories = '%s'\nfsync = off\n" "$PGPORT" "$PGDATA" >>"$PGDATA/postgresql.conf"
pg() { runuser -u postgres -- "$PGBIN/pg_ctl" -D "$PGDATA" -l "$PGDATA/log" -w -t 30 "$@" >/dev/null; }
pg start
trap 'pg -m immediate stop || true; gw_cleanup' EXIT
gw_worker demo-chat
gw_config "postgres://postgres@127.0.0.1:$PGPORT/postgres"
gw_start
KEY="$(gw_key "$USER_" nul-test)"
as_user() { runuser -u "$USER_" -- "$@"; }
post() { # BODY [CURL ARGS]: as the user; prints the answer's body, then "<status> <x-request-id>"
    local body="$1" out; shift
    out="$(as_user curl -s -i -w '\n%{http_code}' -H "Authorization: Bearer $KEY" -H 'content-type: application/json' \
        --data-binary "$body" "$@" "$GW_URL/v1/chat/completions" | tr -d '\r' || true)"
    grep '^{' <<<"$out" | head -n1
    printf '%s %s\n' "$(tail -n1 <<<"$out")" "$(awk -F': ' 'tolower($1) == "x-request-id" {print $2}' <<<"$out")"
}
wait_row() { # REQUEST_ID: until its row is in PostgreSQL (15 s)
    local i
    for i in $(seq 75); do
        [ "$(gw_rows "SELECT COUNT(*) FROM usage_log WHERE request_id = '$1'")" = 1 ] && return 0
        sleep 0.2
    done
    return 1
}
echo "== 1. control characters in model names"
for name in 'demo-chat\u0000' '\u0000' 'demo\u001b[31m-chat' 'demo\nchat'; do
    out="$(post "{\"model\": \"$name\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}")"
    status="$(tail -n1 <<<"$out" | awk '{print $1}')"
    echo "model \"$name\" -> $(head -n1 <<<"$out" | cut -c1-220) [$status]"
    [ "$status" = 400 ] || gw_fail "model \"$name\": expected 400, got $status"
    grep -q '"code":"invalid_model_name"' <<<"$out" && grep -q 'control character U+' <<<"$out" ||
        gw_fail "model \"$name\": the error does not say what is wrong: $out"
done
LONG="$(printf 'x%.0s' $(seq 300))"
for path in 'demo-chat%00' 'demo%1B%5B31m' '%FF' "$LONG"; do
    out="$(as_user curl -s -i -w '\n%{http_code}' -H "Authorization: Bearer $KEY" "$GW_URL/v1/models/$path" | tr -d '\r' || true)"
    status="$(tail -n1 <<<"$out")"
    echo "GET /v1/models/${path:0:20} -> $(grep '^{' <<<"$out" | cut -c1-220) [$status]"
    [ "$status" = 400 ] || gw_fail "GET /v1/models/${path:0:20}: expected 400, got $status"
    grep -q '^{"error":{' <<<"$out" && grep -q 'the model name in the path' <<<"$out" ||
        gw_fail "GET /v1/models/${path:0:20}: not an OpenAI-shaped error that names the path: $out"
done
out="$(post '{"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]}')"
read -r status rid < <(tail -n1 <<<"$out")
[ "$status" = 200 ] || gw_fail "a good call after the NUL names got $status"
wait_row "$rid" || gw_fail "the row of a call after the NUL names never reached PostgreSQL (the writer stalled)"
[ "$(gw_rows "SELECT COUNT(*) FROM usage_log WHERE error_code = 'invalid_model_name'")" = 7 ] &&
    [ "$(gw_rows "SELECT COUNT(*) FROM usage_log WHERE error_code = 'invalid_request' AND route = '/v1/models/{name}'")" = 1 ] ||
    gw_fail "the refused calls are not all in the usage log"
echo "ok: 400 at parse; the writer goes on"

echo "== 2. a row PostgreSQL refuses goes to the dead-letter file"
gw_rows "ALTER TABLE usage_log ADD CONSTRAINT site_rule CHECK (user_agent <> 'refused-by-the-db')" >/dev/null
out="$(post '{"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]}' -A 'refused-by-the-db')"
read -r status bad < <(tail -n1 <<<"$out")
[ "$status" = 200 ] || gw_fail "the call got $status"
out="$(post '{"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]}')"
read -r status after < <(tail -n1 <<<"$out")
wait_row "$after" || gw_fail "the row after a refused one never reached PostgreSQL"
DEAD="$GW_DIR/state/usage-dead-letter.jsonl"
for i in $(seq 50); do [ -s "$DEAD" ] && break; sleep 0.2; done
[ -s "$DEAD" ] || gw_fail "no dead-letter file $DEAD"
cat "$DEAD"
jq -e --arg id "$bad" 'select(.row.request_id == $id) | .reason | test("site_rule|check constraint")' "$DEAD" >/dev/null ||
    gw_fail "the dead-letter file does not hold request $bad with the database's reason"
[ "$(gw_rows "SELECT COUNT(*) FROM usage_log WHERE request_id = '$bad'")" = 0 ] || gw_fail "the refused row is in the store?"
grep -Eq '^gpuhub_gateway_usage_rows_dead_lettered_total 1$' <<<"$(curl -s "http://127.0.0.1:$GW_METRICS_PORT/metrics")" ||
    gw_fail "gateway_usage_rows_dead_lettered_total is not 1"
set +e
doc="$(GPUHUB_CONFIG="$GW_DIR/agent.toml" "$GW_BIN/gpuhub" --socket "$GW_SOCKET" doctor 2>&1)"
set -e
echo "$doc" | grep -A1 usage-log
grep -Eq "^FAIL +usage-log +1 usage row\\(s\\) the store refused are kept in $DEAD" <<<"$doc" ||
    gw_fail "gpuhub doctor does not report the dead-lettered row: $doc"
kill -0 "$GW_AGENT_PID" || gw_fail "the agent died"
gw_stop
echo "PASS security-nul-model"
