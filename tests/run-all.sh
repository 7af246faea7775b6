#!/usr/bin/env bash
# Runs every gpuhub test on this machine, as root, from a fresh clone:
#   1. installs what is missing (tests/setup/deps.sh: Slurm, munge, libclang, PostgreSQL,
#      Prometheus, rpm tools, the Python venv with mlflow and openai)
#   2. builds the workspace (release profile: the plugin, the agent, the CLI, the test worker)
#   3. starts a throw-away PostgreSQL server and runs the Rust tests on SQLite and PostgreSQL
#   4. starts the lab (tests/lab/up.sh: real Slurm with slurmdbd accounting + the plugin + the agent)
#   5. runs every tests/system/*.sh against it, one at a time, with a time limit each
# Logs of each system test: target/test-logs/<name>.log (the tail is printed on failure).
#   6. checks that the tests left nothing behind: no process this run started (other than the
#      lab's daemons and agent), no new listening port, no Slurm job but the lab agent's workers
#   GPUHUB_TESTS=PATTERN   run only system tests whose file name matches PATTERN (grep -E);
#                          a pattern that matches no test is an error
#   GPUHUB_SKIP_CARGO=1    skip step 3
# Nothing is skipped silently here: GPUHUB_TEST_STRICT=1 makes every test whose prerequisite is
# missing fail (tests/lib/prereq.sh; the Rust "every backend" tests without GPUHUB_TEST_PG_URL),
# the lab always runs with Slurm's accounting (GPUHUB_LAB_ACCOUNTING=1: MariaDB + slurmdbd), and
# GPUHUB_REQUIRE_SACCT=1 makes a test that compares with sacct fail instead of skipping.
# One run at a time per machine (the system tests share one lab): a second one waits for the lock.
# The whole run is one function, parsed before it starts: editing this file during a run (bash
# reads a script as it goes) cannot change the run that is under way.
main() {
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
LOGS="$REPO/target/test-logs"
log() { echo "[run-all] $(date +%T) $*"; }
# phase NAME: start timing phase NAME (ends the one before); phases_summary prints them all.
_phases=(); _phase_name=""; _phase_start=$SECONDS
phase() {
    [ -n "$_phase_name" ] && _phases+=("$_phase_name $((SECONDS - _phase_start))s")
    _phase_name="$1"; _phase_start=$SECONDS
    [ -z "$1" ] || log "$1"
}
phases_summary() { phase ""; local IFS=';'; log "time per phase: ${_phases[*]}; total $SECONDS s"; }
die() { echo "[run-all] ERROR: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "run as root (the lab starts Slurm daemons): sudo tests/run-all.sh"
export PATH="$HOME/.cargo/bin:$PATH"
# One run at a time: the run re-executes itself under `flock -o`, so the lock is held by flock
# alone and no daemon this run starts (the lab's munged, slurmdbd, agent) inherits it. In the
# locked run flock is the parent: GPUHUB_RUN_ALL_LOCKED holds its pid (the pid exec kept).
if [ "${GPUHUB_RUN_ALL_LOCKED:-}" != "$PPID" ]; then
    flock -n /run/gpuhub-run-all.lock true || log "another tests/run-all.sh holds /run/gpuhub-run-all.lock; waiting for it"
    exec flock -o /run/gpuhub-run-all.lock env GPUHUB_RUN_ALL_LOCKED="$$" bash "$REPO/tests/run-all.sh" "$@"
fi
export GPUHUB_TEST_STRICT=1
# Every process this run starts inherits the marker, so what is still running at the end can be
# told from what was there before, even after it left its process group (setsid, daemons).
GPUHUB_TEST_RUN="run-all.$$.$(date +%s)"
export GPUHUB_TEST_RUN
tests=()
for t in tests/system/*.sh; do
    [ -f "$t" ] || continue
    if [ -n "${GPUHUB_TESTS:-}" ] && ! grep -qE "$GPUHUB_TESTS" <<<"$(basename "$t" .sh)"; then continue; fi
    tests+=("$t")
done
[ "${#tests[@]}" -gt 0 ] || die "GPUHUB_TESTS='${GPUHUB_TESTS:-}' matches no test in tests/system/ (names: $(cd tests/system && ls *.sh | sed 's/\.sh$//' | tr '\n' ' '))"

phase dependencies
tests/setup/deps.sh || die "installing dependencies failed"

phase "build (release)"
cargo build --release --workspace --locked || die "cargo build failed"

phase "PostgreSQL for the storage tests"
GPUHUB_TEST_PG_URL="$(tests/lib/pg.sh)" || die "cannot start PostgreSQL (tests/lib/pg.sh)"
export GPUHUB_TEST_PG_URL
# The throw-away server is this run's: stop it at the end, whatever happens.
trap 'tests/lib/pg.sh stop' EXIT

. tests/lib/leftovers.sh
leftovers_baseline

if [ "${GPUHUB_SKIP_CARGO:-0}" != 1 ]; then
    phase "cargo test (SQLite and PostgreSQL)"
    cargo test --release --workspace --locked --no-fail-fast || die "cargo test failed"
    leftovers_note "cargo test"
    phase "fmt + clippy"; log "cargo fmt --check, cargo clippy (lints deny unwrap/expect/panic/print outside tests)"
    cargo fmt --all -- --check || die "cargo fmt --check: run cargo fmt --all"
    cargo clippy --release --workspace --all-targets --locked -- -D warnings || die "cargo clippy reported problems"
    log "plugin dependency contract"
    if cargo tree -p gpuhub-spank -p gpuhub-spank-prolog -e normal | grep -E 'tokio|axum|sqlx'; then
        die "the SPANK plugin must not depend on tokio, axum or sqlx"
    fi
fi

phase "lab (with slurmdbd accounting)"
export GPUHUB_LAB_ACCOUNTING=1 GPUHUB_REQUIRE_SACCT=1
tests/lab/up.sh || die "tests/lab/up.sh failed"

leftovers_note "tests/lab/up.sh"
mkdir -p "$LOGS"
phase "system tests (${#tests[@]})"
pass=0; fail=0; failed=()
for t in "${tests[@]}"; do
    name="$(basename "$t" .sh)"
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
    leftovers_note "$name"
done
phase leftovers; log "leftovers: waiting up to 60 s for what the tests started to be gone"
if leftovers_check 60; then
    pass=$((pass + 1)); log "PASS leftovers (no process, port or Slurm job left behind)"
else
    fail=$((fail + 1)); failed+=(leftovers)
    log "FAIL leftovers: the tests left these behind (first seen after the test named):"
    sed 's/^/    /' "$LEFTOVERS_REPORT"
    cp "$LEFTOVERS_REPORT" "$LOGS/leftovers.log"
fi
leftovers_done
phases_summary
[ "${#failed[@]}" -eq 0 ] || log "failed: ${failed[*]}"
echo "system: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
}
main "$@"
