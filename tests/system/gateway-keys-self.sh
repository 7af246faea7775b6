#!/usr/bin/env bash
# timeout: 60
# Issue 19, self-service keys: the unprivileged gpuhublab runs the real `gpuhub keys` against a
# private agent (SQLite, the TEST worker as the model), named by SO_PEERCRED, never by an
# argument: creates its own key (it carries the user's allow-list and limits: a --models outside
# gateway.user_models or an --rpm above [gateway.limits] is refused with the limit named), calls
# the gateway with it, lists only its own keys, revokes it (the call then gets 401), cannot
# create a key for another user, and cannot see or revoke an admin-made key of another user
# (the refusal names the key and why, the key still works). `gpuhub keys set` changes its own
# key's limits under the same rules, never another user's key. Past gateway.keys_per_user it
# must revoke one first. Root still lists and revokes everyone's. A changed allow-list and
# keys_per_user apply after `gpuhub models reload`, no restart, to the user's existing keys too.
set -euo pipefail
. "$(dirname "$0")/../lib/gateway.sh"
. "$(dirname "$0")/../lib/prereq.sh"
U="$(unprivileged_user)"
gw_init
unprivileged_exec_check "$U" "$GW_BIN/gpuhub"
gw_worker other-chat
OTHER_ADDR="$GW_WORKER_ADDR"
gw_worker demo-chat
gw_config
cat >>"$GW_DIR/agent.toml" <<TOML
[[models]]
name = "other-chat"
launcher = "static"
url = "http://$OTHER_ADDR"
api_key = "worker-key"
TOML
gw_config_add gateway 'keys_per_user = 2'
gw_config_add gateway "user_models = { \"$U\" = [\"demo-chat\"] }"
cat >>"$GW_DIR/agent.toml" <<TOML
[gateway.limits]
[[gateway.limits.users]]
user = "$U"
rpm = 50
TOML
chmod 0711 "$GW_DIR" # the socket (0666) must be reachable by $U; nothing else in it is readable
gw_start
ROOT=("$GW_BIN/gpuhub" --socket "$GW_SOCKET")
AS_U=(runuser -u "$U" -- "$GW_BIN/gpuhub" --socket "$GW_SOCKET")
call() { curl -s -o "$GW_DIR/body" -w '%{http_code}' -H "authorization: Bearer $1" -H 'content-type: application/json' \
    -d "{\"model\":\"${2:-demo-chat}\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" "$GW_URL/v1/chat/completions"; }
# refused WHAT TEXT CMD..: CMD must fail and print TEXT on stderr.
refused() {
    local what="$1" text="$2"; shift 2
    if "$@" >"$GW_DIR/out" 2>"$GW_DIR/err"; then gw_fail "$what was accepted: $(cat "$GW_DIR/out")"; fi
    grep -qF -- "$text" "$GW_DIR/err" || gw_fail "$what: the error does not say '$text': $(cat "$GW_DIR/err")"
    echo "   refused ($what): $(cat "$GW_DIR/err")"
}

OTHER="$("${ROOT[@]}" keys create --user bob --app bob-app --json)"
OTHER_ID="$(jq -r .id <<<"$OTHER")"; OTHER_KEY="$(jq -r .key <<<"$OTHER")"
echo "+ [root] gpuhub keys create --user bob --app bob-app -> $OTHER_ID"

echo "+ [$U] gpuhub keys create --app mine --json"
MINE="$("${AS_U[@]}" keys create --app mine --json)"
ID="$(jq -r .id <<<"$MINE")"; KEY="$(jq -r .key <<<"$MINE")"
[ "$(jq -r .user <<<"$MINE")" = "$U" ] || gw_fail "the key is not $U's: $MINE"
[ "$(jq -r .created_by <<<"$MINE")" = "$U" ] || gw_fail "created_by is not $U: $MINE"
[[ "$KEY" == ghk_* ]] || gw_fail "expected a ghk_ key, got: $KEY"
S="$(call "$KEY")"; [ "$S" = 200 ] || gw_fail "$U's own key got $S (expected 200): $(cat "$GW_DIR/body")"
S="$(call "$KEY" other-chat)"
[ "$S" = 403 ] && grep -q "gateway.user_models.$U" "$GW_DIR/body" || gw_fail "$U's key called other-chat outside $U's allow-list: $S $(cat "$GW_DIR/body")"

refused "a key for another user" "can create keys only for yourself, not for \`bob\`" "${AS_U[@]}" keys create --user bob --app x
refused "--models outside the user's allow-list" "the allow-list gateway.user_models.$U permits only demo-chat" "${AS_U[@]}" keys create --app x --models other-chat
refused "--rpm above the user's limit" "--rpm 51 is above the limit of \`$U\`, 50 requests per minute" "${AS_U[@]}" keys create --app x --rpm 51
LIMITED="$("${AS_U[@]}" keys create --app limited --rpm 50 --models demo-chat --json | jq -r .id)"
refused "a third key past keys_per_user = 2" "gateway.keys_per_user = 2" "${AS_U[@]}" keys create --app third

echo "+ [$U] gpuhub keys list"
"${AS_U[@]}" keys list | tee "$GW_DIR/list"
grep -q "^$ID .* $U .*mine .*active" "$GW_DIR/list" && grep -q "^$LIMITED .*limited .*50/min" "$GW_DIR/list" || gw_fail "$U's list lacks its keys"
if grep -q "$OTHER_ID\|bob" "$GW_DIR/list"; then gw_fail "$U's list shows bob's key"; fi
if grep -q "$KEY" "$GW_DIR/list"; then gw_fail "keys list prints the secret key"; fi

refused "revoking another user's key" "key \`$OTHER_ID\` is not yours: you (\`$U\`)" "${AS_U[@]}" keys revoke "$OTHER_ID"
S="$(call "$OTHER_KEY")"; [ "$S" = 200 ] || gw_fail "bob's key stopped working after $U's refused revoke: $S $(cat "$GW_DIR/body")"

echo "+ [$U] gpuhub keys set $LIMITED --rpm 20"
"${AS_U[@]}" keys set "$LIMITED" --rpm 20 | tee "$GW_DIR/out" | grep -q "limits 20/min" || gw_fail "$U could not lower its own key's --rpm: $(cat "$GW_DIR/out")"
refused "keys set --rpm above the user's limit" "--rpm 51 is above the limit of \`$U\`, 50 requests per minute" "${AS_U[@]}" keys set "$LIMITED" --rpm 51
refused "keys set --models outside the user's allow-list" "the allow-list gateway.user_models.$U permits only demo-chat" "${AS_U[@]}" keys set "$LIMITED" --models other-chat
refused "changing another user's key" "key \`$OTHER_ID\` is not yours: you (\`$U\`)" "${AS_U[@]}" keys set "$OTHER_ID" --rpm 1
"${ROOT[@]}" keys list --json | jq -e --arg id "$OTHER_ID" '.keys[] | select(.id == $id) | .rpm == null' >/dev/null ||
    gw_fail "bob's key $OTHER_ID changed after $U's refused keys set"

echo "+ [$U] gpuhub keys revoke $ID"
"${AS_U[@]}" keys revoke "$ID" | grep -q "revoked" || gw_fail "$U could not revoke its own key"
S="$(call "$KEY")"
[ "$S" = 401 ] && grep -q "was revoked" "$GW_DIR/body" || gw_fail "the revoked key got $S: $(cat "$GW_DIR/body") (expected 401 saying it was revoked)"
THIRD_KEY="$("${AS_U[@]}" keys create --app third --json | jq -r .key)"
[[ "$THIRD_KEY" == ghk_* ]] || gw_fail "$U could not create a key after revoking one: $THIRD_KEY"

# reload_access KEYS_PER_USER MODELS: agent.toml's keys_per_user and $U's allow-list changed,
# then `gpuhub models reload` (no restart): it must say they apply from the next call.
reload_access() {
    sed -i -e "s/^keys_per_user = .*/keys_per_user = $1/" -e "s/^user_models = .*/user_models = { \"$U\" = [$2] }/" "$GW_DIR/agent.toml"
    "${ROOT[@]}" models reload | tee "$GW_DIR/reload"
    grep -q '\[gateway.user_models\] and gateway.keys_per_user apply from the next call' "$GW_DIR/reload" ||
        gw_fail "models reload does not say that [gateway.user_models] and keys_per_user changed"
    ! grep -q 'next restart' "$GW_DIR/reload" || gw_fail "models reload says a restart is needed for [gateway.user_models] or keys_per_user"
}
echo "+ [root] $U's allow-list widened to other-chat and keys_per_user raised to 3 in agent.toml; gpuhub models reload"
reload_access 3 '"demo-chat", "other-chat"'
S="$(call "$THIRD_KEY" other-chat)"; [ "$S" = 200 ] || gw_fail "after the reload $U's key still cannot call other-chat: $S $(cat "$GW_DIR/body")"
"${AS_U[@]}" keys create --app fourth --json | jq -e .key >/dev/null || gw_fail "$U could not create a third active key after keys_per_user was raised to 3"
refused "a fourth key past the reloaded keys_per_user = 3" "gateway.keys_per_user = 3" "${AS_U[@]}" keys create --app fifth
echo "+ [root] $U's allow-list narrowed back to demo-chat; gpuhub models reload: $U's existing key follows"
reload_access 3 '"demo-chat"'
S="$(call "$THIRD_KEY" other-chat)"
[ "$S" = 403 ] && grep -q "gateway.user_models.$U" "$GW_DIR/body" || gw_fail "after narrowing the allow-list $U's key still calls other-chat: $S $(cat "$GW_DIR/body")"
S="$(call "$THIRD_KEY")"; [ "$S" = 200 ] || gw_fail "after narrowing the allow-list $U's key cannot call demo-chat: $S $(cat "$GW_DIR/body")"

echo "+ [root] gpuhub keys list; revoke bob's key"
"${ROOT[@]}" keys list | tee "$GW_DIR/list"
grep -q "^$OTHER_ID .* bob " "$GW_DIR/list" && grep -q "^$ID .* $U " "$GW_DIR/list" || gw_fail "root does not see every key"
"${ROOT[@]}" keys revoke "$OTHER_ID" | grep -q revoked || gw_fail "root could not revoke bob's key"
gw_stop
echo "PASS gateway-keys-self"
