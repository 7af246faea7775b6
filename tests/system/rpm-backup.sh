#!/usr/bin/env bash
# Backup and restore of the store, exactly as the admin guide documents them (SQLite, the
# default store): the daily unit's command (`gpuhub backup --keep 7`, run as root against the
# agent's control socket), then a restore after later changes: stop the agent, put the backup
# in place of gpuhub.db (dropping -wal/-shm), start it, and see the state of the backup.
# Also: retention (--keep) prunes old backups, and a non-admin is refused.
# Then the same story on PostgreSQL (a real server: GPUHUB_TEST_PG_URL, else tests/lib/pg.sh;
# a fresh database per run, dropped at the end unless GPUHUB_KEEP_DB=1): the backup is a
# pg_dump file and the restore is the guide's `pg_restore --clean --if-exists --no-owner`.
# Runs the real agent and CLI (target/release) on temp dirs and free loopback ports; as root.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
. tests/lib/prereq.sh
[ "$(id -u)" -eq 0 ] || { echo "FAIL: run as root (the agent treats root as admin)"; exit 1; }
echo "+ cargo build --release --workspace (a no-op after tests/run-all.sh built it)"
cargo build --release --quiet --workspace
AGENT="$REPO/target/release/gpuhub-agent"
CLI="$REPO/target/release/gpuhub"
work="$(mktemp -d)"
chmod 755 "$work"
agent_pid=""
stop_agent() {
    if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
        kill "$agent_pid"
        for _ in $(seq 100); do kill -0 "$agent_pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$agent_pid" 2>/dev/null && { echo "FAIL: agent did not stop on SIGTERM within 10 s"; kill -9 "$agent_pid"; }
        wait "$agent_pid" 2>/dev/null || true
    fi
    agent_pid=""
}
trap 'stop_agent; rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; echo "--- agent log"; tail -n 30 "$work/agent.log" || true; exit 1; }

. "$REPO/tests/lib/agent-config.sh"
write_config() { # write_config [STORE_URL]
    agent_config "$work"
    if [ -n "${1:-}" ]; then printf '[store]\nurl = "%s"\n' "$1" >> "$work/agent.toml"; fi
}
write_config
export GPUHUB_SOCKET="$work/run/agent.sock"
start_agent() {
    env -u GPUHUB_STORE_URL "$AGENT" run --config "$work/agent.toml" >> "$work/agent.log" 2>&1 &
    agent_pid=$!
    for _ in $(seq 100); do
        "$CLI" whoami > /dev/null 2>&1 && return 0
        kill -0 "$agent_pid" 2>/dev/null || fail "gpuhub-agent exited at start"
        sleep 0.1
    done
    fail "the agent's control socket did not answer within 10 s"
}
keys() { "$CLI" keys list --json | python3 -c 'import json,sys; v=json.load(sys.stdin); v=v.get("keys", v) if isinstance(v, dict) else v; print(" ".join(sorted(k["app"] for k in v)))'; }

start_agent
echo "+ gpuhub keys create --user alice --app before-backup"
"$CLI" keys create --user alice --app before-backup > /dev/null
echo "+ gpuhub backup --keep 7   (the command of gpuhub-backup.service, dir: <state_dir>/backups)"
"$CLI" backup --keep 7 | tee "$work/backup.out"
backup="$(sed -n 's/^backup written: //p' "$work/backup.out")"
[ -f "$backup" ] || fail "gpuhub backup printed '$(cat "$work/backup.out")'; expected 'backup written: <file>' naming an existing file"
case "$backup" in "$work/state/backups/"gpuhub-*.db) ;; *) fail "backup at $backup, expected $work/state/backups/gpuhub-*.db" ;; esac
echo "+ gpuhub keys create --user bob --app after-backup"
"$CLI" keys create --user bob --app after-backup > /dev/null
[ "$(keys)" = "after-backup before-backup" ] || fail "before restore: keys '$(keys)', expected 'after-backup before-backup'"

echo "+ restore: systemctl stop gpuhub-agent; cp BACKUP gpuhub.db; rm gpuhub.db-wal gpuhub.db-shm; systemctl start gpuhub-agent"
stop_agent
cp "$backup" "$work/state/gpuhub.db"
rm -f "$work/state/gpuhub.db-wal" "$work/state/gpuhub.db-shm"
start_agent
got="$(keys)"
echo "keys after restore: $got"
[ "$got" = "before-backup" ] || fail "after restore: keys '$got', expected only 'before-backup' (the state at backup time)"

echo "+ retention: 3 more backups with --keep 2 leave 2 files"
for _ in 1 2 3; do "$CLI" backup --keep 2 > /dev/null; done
n="$(find "$work/state/backups" -name 'gpuhub-*.db' | wc -l)"
[ "$n" -eq 2 ] || fail "$n backups left after --keep 2, expected 2"

user="$(unprivileged_user)"
unprivileged_exec_check "$user" "$CLI"
echo "+ a non-admin user ($user) is refused"
chmod 755 "$work/run"
if runuser -u "$user" -- env GPUHUB_SOCKET="$GPUHUB_SOCKET" "$CLI" backup > "$work/user.out" 2>&1; then
    fail "user $user could write a backup: $(cat "$work/user.out")"
fi
grep -qi "admin" "$work/user.out" || fail "refusal for $user does not say why: $(cat "$work/user.out")"
echo "refused: $(cat "$work/user.out")"

# ------------------------------------------------------------------ PostgreSQL
stop_agent
base_url="${GPUHUB_TEST_PG_URL:-}"
if [ -z "$base_url" ]; then
    echo "+ tests/lib/pg.sh   (GPUHUB_TEST_PG_URL not set: start the test PostgreSQL)"
    base_url="$(tests/lib/pg.sh)" || fail "cannot start PostgreSQL with tests/lib/pg.sh"
fi
db="gpuhub_rpm_backup_$$_$(date +%s)"
server="${base_url%/*}"
echo "+ psql: CREATE DATABASE $db"
psql -q "$base_url" -c "CREATE DATABASE $db" || fail "cannot create database $db on $server"
[ "${GPUHUB_KEEP_DB:-0}" = 1 ] || trap 'stop_agent; psql -q "$base_url" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
pg_url="$server/$db"
write_config "$pg_url"
start_agent
echo "+ [PostgreSQL] gpuhub keys create --user alice --app pg-before-backup"
"$CLI" keys create --user alice --app pg-before-backup > /dev/null
echo "+ [PostgreSQL] gpuhub backup --keep 7"
"$CLI" backup --keep 7 | tee "$work/pg-backup.out"
pg_backup="$(sed -n 's/^backup written: //p' "$work/pg-backup.out")"
case "$pg_backup" in "$work/state/backups/"gpuhub-*.pgdump) ;; *) fail "PostgreSQL backup at '$pg_backup', expected $work/state/backups/gpuhub-*.pgdump" ;; esac
[ -s "$pg_backup" ] || fail "$pg_backup is empty or missing"
"$CLI" keys create --user bob --app pg-after-backup > /dev/null
[ "$(keys)" = "pg-after-backup pg-before-backup" ] || fail "[PostgreSQL] before restore: keys '$(keys)'"
echo "+ [PostgreSQL] restore: stop; pg_restore --clean --if-exists --no-owner -d URL BACKUP; start"
stop_agent
pg_restore --clean --if-exists --no-owner -d "$pg_url" "$pg_backup" || fail "pg_restore failed"
start_agent
got="$(keys)"
echo "keys after restore: $got"
[ "$got" = "pg-before-backup" ] || fail "[PostgreSQL] after restore: keys '$got', expected only 'pg-before-backup'"
echo "PASS rpm-backup"
