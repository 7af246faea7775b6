#!/usr/bin/env bash
# Starts (idempotently) a throw-away PostgreSQL server for tests on 127.0.0.1:${GPUHUB_TEST_PG_PORT:-15432}
# and prints the URL tests read from GPUHUB_TEST_PG_URL. Data lives in /var/tmp/gpuhub-test-pg.
# The port is below the kernel's ephemeral range (32768-60999 by default), where any outgoing
# connection may hold it as its source port when the server starts ("Address already in use"),
# and below tests/lib/free_port.py's picks (20000 up).
#   tests/lib/pg.sh          start, print URL
#   tests/lib/pg.sh stop     stop it
set -euo pipefail
PORT="${GPUHUB_TEST_PG_PORT:-15432}"
DATA=/var/tmp/gpuhub-test-pg
BIN="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
[ -x "$BIN/pg_ctl" ] || { echo "pg.sh: PostgreSQL server binaries not found; run tests/setup/deps.sh" >&2; exit 1; }
if [ "${1:-}" = stop ]; then
    [ -f "$DATA/postmaster.pid" ] && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -m fast stop >/dev/null 2>&1 || true
    exit 0
fi
if [ -f "$DATA/PG_VERSION" ] && ! grep -qx "port = $PORT" "$DATA/postgresql.conf"; then
    # Made for another port (an older default, or GPUHUB_TEST_PG_PORT): a throw-away server, so
    # start it afresh on this one.
    [ -f "$DATA/postmaster.pid" ] && runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -m fast stop >/dev/null 2>&1 || true
    rm -rf "$DATA"
fi
if [ ! -f "$DATA/PG_VERSION" ]; then
    rm -rf "$DATA"; mkdir -p "$DATA"; chown postgres:postgres "$DATA"
    runuser -u postgres -- "$BIN/initdb" -D "$DATA" -A trust -U postgres >/dev/null
    cat >> "$DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PORT
unix_socket_directories = '$DATA'
fsync = off
synchronous_commit = off
max_connections = 200
shared_buffers = 256MB
CONF
fi
if ! runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; then
    runuser -u postgres -- "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w -t 30 start >/dev/null \
        || { echo "pg.sh: PostgreSQL failed to start:" >&2; tail -n 20 "$DATA/server.log" >&2; exit 1; }
fi
echo "postgres://postgres@127.0.0.1:$PORT/postgres"
