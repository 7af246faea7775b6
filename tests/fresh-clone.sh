#!/usr/bin/env bash
# Runs CI as a new machine would: a fresh clone of the committed HEAD (no target/, no .venv/)
# with an empty CARGO_HOME, so no cargo registry or git cache can hide a missing install step,
# then `bash .ci/run` there as root with CI=true. The rustup toolchain itself is kept (it is the
# machine's). Prints the log's per-phase times and the closing line; exits with .ci/run's status.
#   sudo tests/fresh-clone.sh            clone into a new temp dir, run, remove the clone
#   GPUHUB_FRESH_KEEP=1                  keep the clone for inspection (CARGO_HOME stays until the next run)
# Log: /var/tmp/gpuhub-fresh-clone.<time>.log
# What it cannot make new: packages apt already installed here and pip's download cache (both
# install by name, so a missing name still fails), and the lab's /etc/slurm, which up.sh rewrites.
# The machine's build caches are used as CI uses them (the llama.cpp wheel, the compiled
# third-party crates: tests/lib/target-cache.sh, rpm/build.sh); GPUHUB_TARGET_CACHE=none
# GPUHUB_RPM_TARGET_CACHE=none compiles every crate, as on a new machine.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ "$(id -u)" -eq 0 ] || { echo "fresh-clone: run as root (CI runs .ci/run as root): sudo $0" >&2; exit 1; }
[ -z "$(git -C "$REPO" status --porcelain --untracked-files=no)" ] ||
    echo "fresh-clone: note: uncommitted changes in $REPO are not part of the clone (HEAD $(git -C "$REPO" rev-parse --short HEAD))"
work="$(mktemp -d /var/tmp/gpuhub-fresh.XXXXXX)"
chmod 755 "$work"   # as CI's clone folder: the tests run the CLI as an unprivileged user too
log="/var/tmp/gpuhub-fresh-clone.$(date +%Y%m%d-%H%M%S).log"
[ "${GPUHUB_FRESH_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT
git clone --quiet --no-hardlinks "$REPO" "$work/repo"
# Emptied for each run, at one fixed path: cargo's fingerprints include where a crate's source
# lies, so the machine's compiled crates (tests/lib/target-cache.sh) serve this path's runs.
cargo_home=/var/tmp/gpuhub-fresh-cargo-home
rm -rf "$cargo_home"; mkdir -p "$cargo_home"
echo "fresh-clone: $(git -C "$work/repo" rev-parse --short HEAD) in $work/repo, CARGO_HOME=$cargo_home (empty); log $log"
rc=0
(cd "$work/repo" && env CI=true CARGO_HOME="$cargo_home" PATH="$HOME/.cargo/bin:$PATH" bash .ci/run) </dev/null >"$log" 2>&1 || rc=$?
grep -E 'time per phase|^system: |ERROR|FAIL ' "$log" || true
echo "fresh-clone: .ci/run exited $rc (log $log)"
exit "$rc"
