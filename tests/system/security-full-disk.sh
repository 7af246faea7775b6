#!/usr/bin/env bash
# timeout: 240
# Issue 13, full disk: a private agent's state directory (its SQLite store and usage journal)
# is a 16 MiB tmpfs, filled up with a file while the agent runs (usage_queue = 300). As the
# unprivileged gpuhublab, calls go on until 20 in a row are refused:
#   - the agent does not crash (no SIGBUS from the journal's map), /healthz answers throughout;
#   - calls are answered 200 while their rows fit (the journal's reserved space, then memory),
#     then 503 usage_log_full with a message that names the state directory and usage_queue;
#   - `gpuhub doctor` fails its usage-log check while the disk is full;
#   - once the filler is removed, every 200 call's row is in the store, new calls are answered
#     200, and after a stop the refused calls are counted too (one row per minute).
set -euo pipefail
. "$(dirname "$0")/../lib/gateway.sh"
. "$(dirname "$0")/../lib/prereq.sh"
command -v sqlite3 >/dev/null || prereq_missing "sqlite3 is not installed" "apt-get install sqlite3"
USER_="$(unprivileged_user)"
gw_init
chmod 755 "$GW_DIR"
STATE="$GW_DIR/state"
mkdir -p "$STATE"
mount -t tmpfs -o size=16m,mode=0700 tmpfs "$STATE" || prereq_missing "cannot mount a tmpfs on $STATE" "run the test as root on a kernel with tmpfs"
trap 'umount -l "$STATE" 2>/dev/null || true; gw_cleanup' EXIT
gw_worker demo-chat
gw_config
gw_config_add gateway 'usage_queue = 300'
gw_start
KEY="$(gw_key alice full-disk)"
U="$GW_DIR/u"   # where the user's client writes what it got
mkdir -p "$U"; chown "$USER_" "$U"
runuser -u "$USER_" -- python3 "$GW_REPO/tests/lib/gateway_calls.py" "$GW_URL" "$KEY" "$U/before" --max 20 >/dev/null
[ "$(awk '$1 == 200' "$U/before" | wc -l)" = 20 ] || gw_fail "calls before the disk filled up failed: $(head -n3 "$U/before")"

echo "== filling $STATE"
dd if=/dev/zero of="$STATE/filler" bs=64k 2>/dev/null || true
df -h "$STATE" | tail -n1
runuser -u "$USER_" -- python3 "$GW_REPO/tests/lib/gateway_calls.py" "$GW_URL" "$KEY" "$U/calls" --max 20000 --stop-after-refused 20
kill -0 "$GW_AGENT_PID" 2>/dev/null || gw_fail "the agent died on a full disk (exit status: $(wait "$GW_AGENT_PID"; echo $?))"
curl -sf "$GW_URL/healthz" >/dev/null || gw_fail "/healthz does not answer on a full disk"
[ "$(curl -s -o /dev/null -w '%{http_code}' "$GW_URL/readyz")" = 503 ] || gw_fail "/readyz does not say 503 while calls are refused"
ok="$(awk '$1 == 200' "$U/calls" | wc -l)"
full="$(awk '$1 == 503 && $3 == "usage_log_full"' "$U/calls" | wc -l)"
other="$(awk '$1 != 200 && !($1 == 503 && $3 == "usage_log_full")' "$U/calls" | wc -l)"
echo "on the full disk: $ok answered 200, $full refused 503 usage_log_full, $other other"
[ "$full" -ge 20 ] || gw_fail "new calls were not refused once memory was full ($full refusals)"
[ "$ok" -ge 300 ] || gw_fail "only $ok calls were answered before the refusals (usage_queue = 300 rows fit in memory)"
[ "$other" -eq 0 ] || gw_fail "$other calls got another answer: $(awk '$1 != 200 && $1 != 503' "$U/calls" | head -n3)"
msg="$(cat "$U/calls.message")"
echo "503 message: $msg"
grep -q "$STATE" <<<"$msg" && grep -q 'gateway.usage_queue' <<<"$msg" || gw_fail "the 503 does not name the state directory and the limit: $msg"
set +e
doc="$(GPUHUB_CONFIG="$GW_DIR/agent.toml" "$GW_BIN/gpuhub" --socket "$GW_SOCKET" doctor 2>&1)"
set -e
grep -Eq '^FAIL +usage-log +cannot write the usage journal' <<<"$doc" || gw_fail "gpuhub doctor does not report the full disk: $doc"
grep -q 'gpuhub_gateway_usage_journal_writable 0' <<<"$(curl -s "http://127.0.0.1:$GW_METRICS_PORT/metrics")" || gw_fail "metric: the journal is not reported unwritable"

echo "== space returns"
rm -f "$STATE/filler"
awk '$1 == 200 {print $2}' "$U/before" "$U/calls" | sort -u >"$GW_DIR/ids"
missing=-1
for i in $(seq 150); do
    if gw_rows 'SELECT request_id FROM usage_log' 2>/dev/null | sort -u >"$GW_DIR/stored"; then
        missing="$(comm -23 "$GW_DIR/ids" "$GW_DIR/stored" | wc -l)"
        [ "$missing" -eq 0 ] && break
    fi
    sleep 0.2
done
[ "$missing" -eq 0 ] || gw_fail "$missing of $(wc -l <"$GW_DIR/ids") answered calls have no usage row 30 s after space returned"
runuser -u "$USER_" -- python3 "$GW_REPO/tests/lib/gateway_calls.py" "$GW_URL" "$KEY" "$U/after" --max 20 >/dev/null
[ "$(awk '$1 == 200' "$U/after" | wc -l)" = 20 ] || gw_fail "calls after space returned failed: $(head -n3 "$U/after")"
gw_stop
counted="$(gw_rows "SELECT CAST(COALESCE(SUM(calls), 0) AS BIGINT) FROM usage_log WHERE error_code = 'usage_log_full'")"
[ "$counted" -eq "$full" ] || gw_fail "the usage log counts $counted refused calls, $full were refused"
echo "PASS security-full-disk: $ok calls answered on a full disk, all $(wc -l <"$GW_DIR/ids") rows stored after; $full refused with 503"
