#!/usr/bin/env bash
# timeout: 240
# `gpuhub doctor` finds each fault it is there for, one at a time. A private gpuhub-agent (its
# own config, state, spool and runtime dirs under $T, fake NVML so that the `nvml` check passes;
# not the lab's /var/lib/gpuhub etc.) is checked healthy first: exit 0, no FAIL line. Then one
# thing at a time is broken and restored:
#   spool    missing (and doctor must not recreate it), not writable (immutable), open to users
#   snapshot missing, corrupt JSON, a version the plugin refuses, stale (says another gateway)
#   store    the SQLite file gone (the agent writes into a deleted inode), a corrupt file in its
#            place (the agent keeps its open file, so both are invisible to its own ping)
#   job-key  missing, mode 0644, owned by a user, empty, 15 bytes (a trailing newline is healthy:
#            the plugin and the agent read the key with one function that trims it)
#   config   GPUHUB_CONFIG naming another agent's config than the socket asked
# For each: exit status 1, exactly one FAIL line, naming that check, with its detail and a
# `fix:` line that says what to do. After the last fault, healthy again (exit 0), so every
# restore is proven too. The plugin and slurm checks read the lab's plugstack and sinfo.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/prereq.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/lab.sh"   # its EXIT trap replaces telemetry.sh's:
lab_cleanup_add tel_cleanup                          # runs last, before plugstack_restore
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
[ -x "$cli" ] || lab_fail "$cli missing; run cargo build --release"
command -v chattr >/dev/null || prereq_missing "chattr not installed" "apt-get install e2fsprogs" || true
lab_user
tel_init
tel_gpu_line 0 $((1024 * 1024 * 1024)) 10 > "$T/nvml/fake-nvml.conf"
tel_start_agent false
sock="$T/run/agent.sock"
for ((i = 0; i < 100; i++)); do [ -S "$sock" ] && [ -s "$T/run/snapshot.json" ] && [ -s "$T/state/job-token.key" ] && break; sleep 0.1; done
[ -S "$sock" ] || tel_fail "no control socket $sock"
export GPUHUB_CONFIG="$T/agent.toml"
SPOOL="$T/spool" SNAP="$T/run/snapshot.json" DB="$T/state/gpuhub.db" KEY="$T/state/job-token.key"
lab_cleanup_add "chattr -i '$SPOOL' 2>/dev/null"   # else the temp dir cannot be removed

doctor() { lab_run "$cli" --socket "$sock" doctor; }
healthy() {
    doctor
    [ "$LAB_RC" -eq 0 ] || tel_fail "healthy ($1): doctor exited $LAB_RC, want 0"
    ! grep -q '^FAIL' <<<"$LAB_OUT" || tel_fail "healthy ($1): doctor printed a FAIL line"
    for c in plugin slurm agent store spool snapshot nvml job-key; do
        grep -Eq "^ok +$c " <<<"$LAB_OUT" || tel_fail "healthy ($1): no \`ok $c\` line"
    done
    echo "ok: healthy ($1): exit 0, no FAIL"
}
# expect_fail CHECK DETAIL_REGEX FIX_REGEX WHAT
expect_fail() {
    local check="$1" detail="$2" fix="$3" what="$4" fails fixline
    doctor
    [ "$LAB_RC" -eq 1 ] || tel_fail "$what: doctor exited $LAB_RC, want 1"
    fails="$(grep '^FAIL' <<<"$LAB_OUT" || true)"
    [ "$(grep -c . <<<"$fails")" -eq 1 ] || tel_fail "$what: want exactly one FAIL line (for $check), got:
$fails"
    grep -Eq "^FAIL +$check +.*$detail" <<<"$fails" || tel_fail "$what: the FAIL line does not name $check with /$detail/: $fails"
    fixline="$(grep -A1 '^FAIL' <<<"$LAB_OUT" | tail -n1)"
    grep -Eq "^ +fix: .*$fix" <<<"$fixline" || tel_fail "$what: no \`fix:\` line matching /$fix/ under the FAIL line (got: $fixline)"
    echo "ok: $what -> FAIL $check, exit 1"
}

healthy "at start"
lab_run "$cli" --socket "$sock" doctor --json
jq -e 'length >= 8 and all(.[]; .ok)' <<<"$LAB_OUT" >/dev/null || tel_fail "doctor --json: not every check ok"

# ---- spool
mv "$SPOOL" "$SPOOL.away"
expect_fail spool "$SPOOL missing" "mkdir -m 0755 $SPOOL" "spool dir missing"
# The agent's own probe (after doctor's check) may create an empty spool; it must be empty.
[ ! -e "$SPOOL" ] || rmdir "$SPOOL" || tel_fail "something wrote into the recreated $SPOOL"
mv "$SPOOL.away" "$SPOOL"
if command -v chattr >/dev/null; then
    chattr +i "$SPOOL" || prereq_missing "chattr +i on $SPOOL failed ($(df -T "$SPOOL" | awk 'NR == 2 {print $2}'))" "run the test on ext4/xfs" || true
    if lsattr -d "$SPOOL" 2>/dev/null | awk '{print $1}' | grep -q i; then
        expect_fail spool "not writable" "chattr -i" "spool immutable (unwritable even for root)"
        chattr -i "$SPOOL"
    fi
fi
chmod 777 "$SPOOL"
expect_fail spool "writable by others.*forge" "chmod 755" "spool mode 0777"
chmod 755 "$SPOOL"

# ---- snapshot
cp -p "$SNAP" "$T/snapshot.good"
rm -f "$SNAP"
expect_fail snapshot "$SNAP missing" "restart gpuhub-agent" "snapshot missing"
printf '{"version":1,"gateway_url":' > "$SNAP"
expect_fail snapshot "corrupt snapshot" "restart gpuhub-agent" "snapshot corrupt"
jq -c '.version = 2' "$T/snapshot.good" > "$SNAP"
expect_fail snapshot "version 2 is not supported" "restart gpuhub-agent" "snapshot of another version"
jq -c '.gateway_url = "http://127.0.0.1:1"' "$T/snapshot.good" > "$SNAP"
expect_fail snapshot "stale: GPUHUB_URL is http://127.0.0.1:1 there" "restart gpuhub-agent" "snapshot stale"
cp -p "$T/snapshot.good" "$SNAP"

# ---- store (SQLite): the agent keeps the file it opened, so only the path changes under it
[ -f "$DB" ] || tel_fail "no store file $DB"
mv "$DB" "$DB.away"
expect_fail store "$DB missing" "backup" "store file gone"
head -c 4096 /dev/urandom > "$DB"
expect_fail store "corrupt" "backup" "store file corrupt"
mv -f "$DB.away" "$DB"

# ---- job key
cp -p "$KEY" "$T/key.good"
rm -f "$KEY"
expect_fail job-key "$KEY missing" "restart gpuhub-agent" "job key missing"
cp -p "$T/key.good" "$KEY"; chmod 644 "$KEY"
expect_fail job-key "mode 644" "chmod 600" "job key mode 0644"
chmod 600 "$KEY"; chown "$LAB_USER" "$KEY"
expect_fail job-key "owned by uid $(id -u "$LAB_USER")" "chown root" "job key owned by a user"
chown root "$KEY"; : > "$KEY"
expect_fail job-key "holds 0 bytes" "restart gpuhub-agent" "job key empty"
{ cat "$T/key.good"; echo; } > "$KEY"
healthy "job key with a trailing newline (the plugin and the agent both trim it)"
printf '0123456789abcde\n' > "$KEY"
expect_fail job-key "holds 15 bytes" "restart gpuhub-agent" "job key of 15 bytes and a newline"
cp -p "$T/key.good" "$KEY"

# ---- a config that is not this agent's
GPUHUB_CONFIG="$LAB_REPO/tests/lab/agent.toml" expect_fail config "not of $sock" "GPUHUB_CONFIG" "GPUHUB_CONFIG of another agent"

healthy "after restoring everything"
echo "PASS: doctor-faults"
