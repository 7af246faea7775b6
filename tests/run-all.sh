#!/usr/bin/env bash
# Runs every gpuhub test on this machine, as root, from a fresh clone:
#   1. installs what is missing (tests/setup/deps.sh: Slurm, munge, libclang, PostgreSQL,
#      Prometheus, rpm tools, the Python venv with mlflow and openai)
#   2. builds the workspace (release profile: the plugin, the agent, the CLI, the test worker);
#      a clone without target/release starts from the machine's compiled third-party crates
#      (tests/lib/target-cache.sh, /var/cache/gpuhub/cargo-target; GPUHUB_TARGET_CACHE=none: off)
#   3. starts a throw-away PostgreSQL server and runs the Rust tests on SQLite and PostgreSQL
#   4. starts the lab (tests/lab/up.sh: real Slurm with slurmdbd accounting + the plugin + the agent)
#   5. runs every tests/system/*.sh against it, one at a time, with a time limit each
# Logs of each system test: target/test-logs/<name>.log (the tail is printed on failure).
#   6. checks that the tests left nothing behind: no process this run started (other than the
#      lab's daemons and agent), no new listening port, no Slurm job but the lab agent's workers
#   7. the second leg: the spank-*, accounting-lab* and trust-* tests among those selected run
#      again, unchanged, on Slurm 24.11 (tests/lab/slurm24.sh up: Debian 13's Slurm with
#      slurmdbd and the agent, in place of the 22.05 daemons; GPUHUB_LAB_SLURM=24.11), with their
#      own leftovers check; then the 22.05 lab comes back (slurm24.sh down, tests/lab/up.sh).
#      Each leg is reported ("leg 22.05: N passed, M failed"), FAIL lines carry the leg; the
#      second leg's logs are target/test-logs/slurm-24.11/<name>.log.
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
. tests/lib/target-cache.sh
target_cache_seed
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
target_cache_save

phase "lab (with slurmdbd accounting)"
export GPUHUB_LAB_ACCOUNTING=1 GPUHUB_REQUIRE_SACCT=1
tests/lab/up.sh || die "tests/lab/up.sh failed"

leftovers_note "tests/lab/up.sh"
mkdir -p "$LOGS"
# run_leg LEG LOGDIR TEST...: the system tests against the lab that is up (Slurm LEG), one at a
# time with their time limits, then the leftovers check; adds to pass/fail, tags FAIL lines with
# the leg and prints "leg LEG: N passed, M failed".
pass=0; fail=0; failed=(); legs=()
run_leg() {
    local leg="$1" dir="$2" t name limit start rc lpass=0 lfail=0
    shift 2
    mkdir -p "$dir"
    for t in "$@"; do
        name="$(basename "$t" .sh)"
        limit="$(sed -n 's/^# *timeout: *\([0-9]\+\).*/\1/p' "$t" | head -n1)"
        limit="${limit:-600}"
        start=$SECONDS
        if timeout --kill-after=10 "$limit" bash "$t" >"$dir/$name.log" 2>&1; then
            lpass=$((lpass + 1)); log "PASS [$leg] $name ($((SECONDS - start))s)"
        else
            rc=$?
            lfail=$((lfail + 1)); failed+=("$name[$leg]")
            log "FAIL [$leg] $name (exit $rc after $((SECONDS - start))s; limit ${limit}s); last lines of $dir/$name.log:"
            # The test's own verdict first: a long log tail (a multinode test's node logs) can
            # push it out of the last 40 lines.
            grep -m 3 '^FAIL' "$dir/$name.log" | sed 's/^/    /' || true
            tail -n 40 "$dir/$name.log" | sed 's/^/    /'
        fi
        leftovers_note "$name"
    done
    phase "leftovers [$leg]"; log "leftovers: waiting up to 60 s for what the tests started to be gone"
    if leftovers_check 60; then
        lpass=$((lpass + 1)); log "PASS [$leg] leftovers (no process, port or Slurm job left behind)"
    else
        lfail=$((lfail + 1)); failed+=("leftovers[$leg]")
        log "FAIL [$leg] leftovers: the tests left these behind (first seen after the test named):"
        sed 's/^/    /' "$LEFTOVERS_REPORT"
        cp "$LEFTOVERS_REPORT" "$dir/leftovers.log"
    fi
    leftovers_done
    pass=$((pass + lpass)); fail=$((fail + lfail))
    legs+=("leg $leg: $lpass passed, $lfail failed")
    log "leg $leg: $lpass passed, $lfail failed"
}
phase "system tests, Slurm 22.05 (${#tests[@]})"
run_leg 22.05 "$LOGS" "${tests[@]}"

# The second leg: the same spank-*, accounting-lab* and trust-* tests, unchanged, against Slurm
# 24.11 (Debian 13's packages from the root tests/lab/slurm24.sh runs on this host, with
# slurmdbd and the agent; GPUHUB_LAB_SLURM=24.11 selects its paths in tests/lib/lab.sh). The
# 22.05 lab's daemons stop meanwhile and come back after it (tests/lab/up.sh).
tests24=()
for t in "${tests[@]}"; do
    grep -qE '^(spank-|accounting-lab|trust-)' <<<"$(basename "$t" .sh)" && tests24+=("$t")
done
if [ "${#tests24[@]}" -gt 0 ]; then
    phase "lab, Slurm 24.11 leg (tests/lab/slurm24.sh up)"
    if GPUHUB_LAB_BUILD=1 tests/lab/slurm24.sh up; then
        . tests/lib/leftovers.sh   # a fresh baseline: this leg's daemons and agent
        GPUHUB_LAB_SLURM=24.11 PATH="/run/gpuhub-lab24/bin:$PATH" SLURM_CONF=/var/lib/gpuhub-lab/slurm24-root/etc/slurm/slurm.conf \
            leftovers_baseline
        phase "system tests, Slurm 24.11 (${#tests24[@]})"
        (
            export GPUHUB_LAB_SLURM=24.11
            # shellcheck source=lib/lab.sh
            . tests/lib/lab.sh >/dev/null   # the leg's PATH and SLURM_CONF, for leftovers.py's squeue
            trap - EXIT
            run_leg 24.11 "$LOGS/slurm-24.11" "${tests24[@]}"
            echo "$pass $fail ${legs[*]: -1}" > "$LOGS/slurm-24.11/.leg"
            printf '%s\n' "${failed[@]}" > "$LOGS/slurm-24.11/.failed"
        )
        read -r pass fail leg24 < "$LOGS/slurm-24.11/.leg" || true
        legs+=("${leg24:-leg 24.11: did not finish}")
        mapfile -t failed < "$LOGS/slurm-24.11/.failed"
        [ -n "${failed[*]}" ] || failed=()
    else
        fail=$((fail + 1)); failed+=("slurm24-up"); legs+=("leg 24.11: tests/lab/slurm24.sh up failed")
        log "FAIL [24.11] tests/lab/slurm24.sh up"
    fi
    phase "lab back to Slurm 22.05 (tests/lab/slurm24.sh down, tests/lab/up.sh)"
    tests/lab/slurm24.sh down || { fail=$((fail + 1)); failed+=("slurm24-down"); }
    GPUHUB_LAB_BUILD=0 tests/lab/up.sh >"$LOGS/lab-up-22.05.log" 2>&1 ||
        { fail=$((fail + 1)); failed+=("lab-up-22.05"); log "FAIL tests/lab/up.sh after the 24.11 leg:"; tail -n 20 "$LOGS/lab-up-22.05.log" | sed 's/^/    /'; }
fi
phases_summary
for l in "${legs[@]}"; do log "$l"; done
[ "${#failed[@]}" -eq 0 ] || log "failed: ${failed[*]}"
echo "system: $pass passed, $fail failed"
[ "$fail" -eq 0 ]
}
main "$@"
