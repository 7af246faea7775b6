#!/usr/bin/env bash
# `gpuhub keys create/list/revoke` and `gpuhub usage --calls` through the real binaries: a key
# works, shows in the list without its secret, stops working once revoked (with a 401 that
# says so), and the calls show up in the rollups.
# Then fair use ([gateway.limits], `keys create --rpm --tokens-per-day`), on SQLite and on
# PostgreSQL (a fresh database of GPUHUB_TEST_PG_URL): a user's and a key's requests per
# minute and tokens per day are answered 429 with Retry-After and a message that names the
# limit, and still are after the agent restarts (SIGTERM on SQLite, kill -9 on PostgreSQL: the
# rows then come back from the usage journal); others are not affected. Changed limits in
# agent.toml apply to the next call after `gpuhub models reload` (SIGHUP), no restart.
# timeout: 300
set -euo pipefail
source "$(dirname "$0")/../lib/gateway.sh"
gw_init
gw_worker demo-chat
gw_config
gw_start
G=("$GW_BIN/gpuhub" --socket "$GW_SOCKET")
KEY="$(gw_key alice ocr-service)"
echo "+ gpuhub keys create --user alice --app ocr-service -> ${KEY:0:12}..."
[[ "$KEY" == ghk_* ]] || gw_fail "expected a ghk_ key, got: $KEY"
call() { curl -s -o "$GW_DIR/body" -w '%{http_code}' -H "authorization: Bearer $1" -H 'content-type: application/json' \
    -d '{"model":"demo-chat","messages":[{"role":"user","content":"hi"}]}' "$GW_URL/v1/chat/completions"; }
S="$(call "$KEY")"; [ "$S" = 200 ] || gw_fail "a new key got $S (expected 200): $(cat "$GW_DIR/body")"
LIST="$("${G[@]}" keys list)"
echo "+ gpuhub keys list"; echo "$LIST"
echo "$LIST" | grep -q "alice .*ocr-service .*active" || gw_fail "keys list does not show alice's active key"
if echo "$LIST" | grep -q "$KEY"; then gw_fail "keys list prints the secret key"; fi
ID="$(echo "$LIST" | awk '$3 == "alice" {print $1}' | head -n1)"
"${G[@]}" keys revoke "$ID" | grep -q "revoked" || gw_fail "gpuhub keys revoke $ID did not say revoked"
S="$(call "$KEY")"
[ "$S" = 401 ] && grep -q "was revoked" "$GW_DIR/body" || gw_fail "a revoked key got $S: $(cat "$GW_DIR/body") (expected 401 saying it was revoked)"
if "${G[@]}" keys revoke nosuch 2>"$GW_DIR/err"; then gw_fail "revoking an unknown key succeeded"; fi
grep -q "gpuhub keys list" "$GW_DIR/err" || gw_fail "unknown key id: message does not point to gpuhub keys list: $(cat "$GW_DIR/err")"
if "${G[@]}" keys create --user "bad user" --app x 2>"$GW_DIR/err"; then gw_fail "a user name with a space was accepted"; fi
sleep 1
CALLS="$("${G[@]}" usage --calls --since 1h)"
echo "+ gpuhub usage --calls --since 1h"; echo "$CALLS"
echo "$CALLS" | awk '$1 == "alice" && $2 == "ocr-service" && $3 == "demo-chat" && $5 == 1 {ok=1} END {exit !ok}' \
    || gw_fail "usage --calls does not show alice's one successful call"
gw_stop

# ---- fair use: rate and token limits, across a restart
. "$GW_REPO/tests/lib/prereq.sh"
# limited USER KEY: a call's status; the body in $GW_DIR/body, the headers in $GW_DIR/headers.
limited() { curl -s -D "$GW_DIR/headers" -o "$GW_DIR/body" -w '%{http_code}' -H "authorization: Bearer $1" -H 'content-type: application/json' \
    -d '{"model":"demo-chat","messages":[{"role":"user","content":"hi"}]}' "$GW_URL/v1/chat/completions"; }
expect_ok() { local s; s="$(limited "$1")"; [ "$s" = 200 ] || gw_fail "$2: got $s (expected 200): $(cat "$GW_DIR/body")"; }
# expect_429 KEY CODE TEXT WHAT: a 429 with code CODE, Retry-After 1..MAX, and TEXT in the message.
expect_429() {
    local s ra
    s="$(limited "$1")"
    [ "$s" = 429 ] || gw_fail "$5: got $s (expected 429 $2): $(cat "$GW_DIR/body")"
    ra="$(tr -d '\r' <"$GW_DIR/headers" | awk 'tolower($1) == "retry-after:" {print $2}')"
    [[ "$ra" =~ ^[0-9]+$ ]] && [ "$ra" -ge 1 ] && [ "$ra" -le "$4" ] || gw_fail "$5: Retry-After is '$ra' (expected 1..$4)"
    python3 - "$GW_DIR/body" "$2" "$3" <<'PY' || gw_fail "$5: the 429's body is not the expected OpenAI error: $(cat "$GW_DIR/body")"
import json, sys
e = json.load(open(sys.argv[1]))["error"]
assert e["code"] == sys.argv[2] and e["type"] == "rate_limit_error", e
assert sys.argv[3] in e["message"], (sys.argv[3], e["message"])
PY
    echo "   429 $2, Retry-After $ra: $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["error"]["message"])' "$GW_DIR/body")"
}

# limits_toml DAVE_RPM ERIN_TOKENS [HAL_TOKENS]: the [gateway.limits] section (default 1000 rpm).
limits_toml() {
    printf '[gateway.limits]\nrpm = 1000\n[[gateway.limits.users]]\nuser = "dave"\nrpm = %s\n' "$1"
    printf '[[gateway.limits.users]]\nuser = "erin"\ntokens_per_day = %s\n' "$2"
    [ -z "${3:-}" ] || printf '[[gateway.limits.users]]\nuser = "hal"\ntokens_per_day = %s\n' "$3"
}

limits_round() {
    local store="$1" label="$2" restart="$3"
    echo "== fair use on $label"
    gw_config "$store"
    sed -i "s#$GW_DIR/state#$GW_DIR/state-$label#" "$GW_DIR/agent.toml"
    limits_toml 2 30 >>"$GW_DIR/agent.toml"
    gw_start
    local dave erin frank gina hal until_midnight
    dave="$(gw_key dave app)"; erin="$(gw_key erin app)"; hal="$(gw_key hal app)"
    frank="$("$GW_BIN/gpuhub" --socket "$GW_SOCKET" keys create --user frank --app x --rpm 1 | tail -n 1)"
    gina="$("$GW_BIN/gpuhub" --socket "$GW_SOCKET" keys create --user gina --app y --tokens-per-day 10 | tail -n 1)"
    "$GW_BIN/gpuhub" --socket "$GW_SOCKET" keys list | tee "$GW_DIR/list" | grep -E ' (frank|gina) '
    grep -q ' frank .* 1/min ' "$GW_DIR/list" && grep -q ' gina .* 10 tok/day ' "$GW_DIR/list" || gw_fail "keys list does not show the keys' own limits"
    if "$GW_BIN/gpuhub" --socket "$GW_SOCKET" keys create --user x --app y --rpm 0 2>"$GW_DIR/err"; then gw_fail "--rpm 0 was accepted"; fi
    grep -q "at least 1" "$GW_DIR/err" || gw_fail "--rpm 0: the error does not say what is allowed: $(cat "$GW_DIR/err")"
    until_midnight=$((86400 - $(date -u +%s) % 86400 + 5))
    # A call costs 9 tokens with the TEST worker ("hi" -> 1 prompt + 8 completion); checked.
    expect_ok "$erin" "erin's first call"
    grep -q '"total_tokens":9' "$GW_DIR/body" || gw_fail "expected a call of 9 tokens: $(cat "$GW_DIR/body")"
    expect_ok "$dave" "dave's 1st call"; expect_ok "$dave" "dave's 2nd call"
    expect_429 "$dave" rate_limit_exceeded 'user `dave` may make 2 requests per minute (rpm, gateway.limits)' 60 "dave's 3rd call in a minute"
    expect_ok "$frank" "frank's key's 1st call"
    expect_429 "$frank" rate_limit_exceeded "(frank/x) may make 1 requests per minute (rpm, the key's own --rpm)" 60 "frank's key's 2nd call"
    expect_ok "$erin" "erin's 2nd call"; expect_ok "$erin" "erin's 3rd call"; expect_ok "$erin" "erin's 4th call (27 < 30 tokens)"
    expect_429 "$erin" token_limit_exceeded 'user `erin` may use 30 tokens per day (tokens_per_day, gateway.limits) and has used 36 today' "$until_midnight" "erin's 5th call"
    expect_ok "$gina" "gina's key's 1st call"; expect_ok "$gina" "gina's key's 2nd call (9 < 10 tokens)"
    expect_429 "$gina" token_limit_exceeded "(gina/y) may use 10 tokens per day (tokens_per_day, the key's own --tokens-per-day) and has used 18 today" "$until_midnight" "gina's key's 3rd call"
    for i in 1 2 3 4 5; do expect_ok "$hal" "hal's call $i (under the default rpm)"; done
    echo "-- restart the agent ($restart): the limits hold"
    if [ "$restart" = kill-9 ]; then gw_kill9; else gw_stop; fi
    gw_start
    expect_429 "$dave" rate_limit_exceeded 'user `dave` may make 2 requests per minute' 60 "dave after the restart"
    expect_429 "$frank" rate_limit_exceeded "(frank/x) may make 1 requests per minute" 60 "frank's key after the restart"
    expect_429 "$erin" token_limit_exceeded 'has used 36 today' "$until_midnight" "erin after the restart"
    expect_429 "$gina" token_limit_exceeded 'has used 18 today' "$until_midnight" "gina's key after the restart"
    expect_ok "$hal" "hal after the restart"
    echo "-- [gateway.limits] changed in agent.toml and reloaded (gpuhub models reload, as SIGHUP): the next call sees them"
    sed -i '/^\[gateway.limits\]$/,$d' "$GW_DIR/agent.toml"   # the section is the file's last
    limits_toml 600 100 50 >>"$GW_DIR/agent.toml"
    "$GW_BIN/gpuhub" --socket "$GW_SOCKET" models reload | tee "$GW_DIR/reload"
    grep -q '\[gateway.limits\] apply from the next call' "$GW_DIR/reload" || gw_fail "models reload does not say that [gateway.limits] changed"
    ! grep -q 'next restart' "$GW_DIR/reload" || gw_fail "models reload says a restart is needed for [gateway.limits]"
    expect_ok "$dave" "dave, his rpm raised to 600"
    expect_ok "$erin" "erin, her tokens raised to 100 (36 used)"
    expect_429 "$hal" token_limit_exceeded 'user `hal` may use 50 tokens per day (tokens_per_day, gateway.limits) and has used 54 today' "$until_midnight" "hal, his tokens lowered to 50 (54 used)"
    gw_stop
}

limits_round "" sqlite SIGTERM
[ -n "${GPUHUB_TEST_PG_URL:-}" ] || prereq_missing "GPUHUB_TEST_PG_URL is not set (the PostgreSQL round)" "export the URL tests/lib/pg.sh prints" || { echo "PASS gateway-keys (SQLite only)"; exit 0; }
PG_DB="gw_keys_$$"
psql "$GPUHUB_TEST_PG_URL" -qc "CREATE DATABASE $PG_DB" || gw_fail "cannot create database $PG_DB on $GPUHUB_TEST_PG_URL"
trap 'psql "$GPUHUB_TEST_PG_URL" -qc "DROP DATABASE IF EXISTS $PG_DB" >/dev/null 2>&1 || true; gw_cleanup' EXIT
limits_round "${GPUHUB_TEST_PG_URL%/*}/$PG_DB" postgres kill-9
echo "PASS gateway-keys"
