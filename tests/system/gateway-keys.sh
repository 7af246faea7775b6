#!/usr/bin/env bash
# `gpuhub keys create/list/revoke` and `gpuhub usage --calls` through the real binaries: a key
# works, shows in the list without its secret, stops working once revoked (with a 401 that
# says so), and the calls show up in the rollups.
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
echo "PASS gateway-keys"
