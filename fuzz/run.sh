#!/usr/bin/env bash
# Builds the coverage-guided libFuzzer targets (fuzz/fuzz_targets/) and runs each for
# FUZZ_SECONDS (default 300). No cargo-fuzz needed: these are the flags it passes.
#   fuzz/run.sh                         stable toolchain, no sanitizer (panics and hangs)
#   FUZZ_TOOLCHAIN=nightly fuzz/run.sh  nightly, with AddressSanitizer
#   TARGETS=upstream FUZZ_SECONDS=60 fuzz/run.sh
# New inputs go to fuzz/work/<target>/ (the seeds in fuzz/corpus/<target>/ stay as they are);
# a crash or hang is written to fuzz/artifacts/<target>/ and the script fails.
set -euo pipefail
cd "$(dirname "$0")"
toolchain="${FUZZ_TOOLCHAIN:-stable}"
seconds="${FUZZ_SECONDS:-300}"
triple="$(rustc +"$toolchain" -vV | awk '/^host:/ {print $2}')"
flags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4"
flags="$flags -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table"
flags="$flags -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
[ "$toolchain" = nightly ] && flags="$flags -Zsanitizer=address"
# --target keeps the flags off build scripts and proc macros.
RUSTFLAGS="$flags" cargo +"$toolchain" build --release --target "$triple" --bins
for t in ${TARGETS:-parse upstream}; do
    mkdir -p "work/$t" "artifacts/$t"
    echo "fuzz: $t for ${seconds}s ($toolchain)"
    "target/$triple/release/$t" "work/$t" "corpus/$t" -max_total_time="$seconds" -timeout=10 \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 2>&1 | grep -E "^(#[0-9]+ +DONE|INFO: seed corpus|stat::|==|SUMMARY|Done)" || true
    if [ -n "$(ls -A "artifacts/$t")" ]; then
        echo "fuzz: $t FOUND something: fuzz/artifacts/$t/" >&2
        exit 1
    fi
done
