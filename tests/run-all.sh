#!/usr/bin/env bash
# Runs every gpuhub test on this machine, as root, from a fresh clone:
#   1. installs what is missing (tests/setup/deps.sh: Slurm, munge, libclang, PostgreSQL,
#      Prometheus, rpm tools, the Python venv with mlflow and openai)
#   2. builds the workspace (release profile: the plugin, the agent, the CLI, the test worker)
#   3. starts a throw-away PostgreSQL server and runs the Rust tests on SQLite and PostgreSQL
#   4. starts the lab (tests/lab/up.sh: real Slurm with slurmdbd accounting + the plugin + the agent)
#   5. runs every tests/system/*.sh against it, one at a time, with a time limit each
# Logs of each system test: target/test-logs/<name>.log (the tail is printed on failure).
#   GPUHUB_TESTS=PATTERN   run only system tests whose file name matches PATTERN (grep -E)
#   GPUHUB_SKIP_CARGO=1    skip step 3
# The lab always runs with Slurm's accounting here (GPUHUB_LAB_ACCOUNTING=1: MariaDB + slurmdbd),
# and GPUHUB_REQUIRE_SACCT=1 makes a test that compares with sacct fail instead of skipping.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
LOGS="$REPO/target/test-logs"
log() { echo "[run-all] $(date +%T) $*"; }
die() { echo "[run-all] ERROR: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (the lab starts Slurm daemons): sudo tests/run-all.sh"
export PATH="$HOME/.cargo/bin:$PATH"

log "dependencies"
tests/setup/deps.sh || die "installing dependencies failed"

log "build (release)"
cargo build --release --workspace --locked || die "cargo build failed"

log "PostgreSQL for the storage tests"
GPUHUB_TEST_PG_URL="$(tests/lib/pg.sh)" || die "cannot start PostgreSQL (tests/lib/pg.sh)"
export GPUHUB_TEST_PG_URL

if [ "${GPUHUB_SKIP_CARGO:-0}" != 1 ]; then
    log "cargo test (SQLite and PostgreSQL)"
    cargo test --release --workspace --locked --no-fail-fast || die "cargo test failed"
    log "cargo fmt --check, cargo clippy (lints deny unwrap/expect/panic/print outside tests)"
    cargo fmt --all -- --check || die "cargo fmt --check: run cargo fmt --all"
    cargo clippy --release --workspace --all-targets --locked -- -D warnings || die "cargo clippy reported problems"
    log "plugin dependency contract"
    if cargo tree -p gpuhub-spank -e normal | grep -E 'tokio|axum|sqlx'; then
        die "the SPANK plugin must not depend on tokio, axum or sqlx"
    fi
fi

log "lab (with slurmdbd accounting)"
export GPUHUB_LAB_ACCOUNTING=1 GPUHUB_REQUIRE_SACCT=1
tests/lab/up.sh || die "tests/lab/up.sh failed"

mkdir -p "$LOGS"
pass=0; fail=0; failed=()
for t in tests/system/*.sh; do
    [ -f "$t" ] || continue
    name="$(basename "$t" .sh)"
    if [ -n "${GPUHUB_TESTS:-}" ] && ! grep -qE "$GPUHUB_TESTS" <<<"$name"; then continue; fi
    limit="$(sed -n 's/^# *timeout: *\([0-9]\+\).*/\1/p' "$t" | head -n1)"
    limit="${limit:-600}"
    start=$SECONDS
    if timeout --kill-after=10 "$limit" bash "$t" >"$LOGS/$name.log" 2>&1; then
        pass=$((pass + 1)); log "PASS $name ($((SECONDS - start))s)"
    else
        rc=$?
        fail=$((fail + 1)); failed+=("$name")
        log "FAIL $name (exit $rc after $((SECONDS - start))s; limit ${limit}s); last lines of $LOGS/$name.log:"
        tail -n 40 "$LOGS/$name.log" | sed 's/^/    /'
    fi
done
[ "${#failed[@]}" -eq 0 ] || log "failed: ${failed[*]}"
echo "system: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
