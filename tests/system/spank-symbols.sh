#!/usr/bin/env bash
# SPANK plugin, build contract, for both builds: the shipped plugin (libgpuhub_spank.so) and the
# build with job hooks (libgpuhub_spank_prolog.so). Each exports exactly the symbols Slurm needs
# (plugin_name, plugin_type, plugin_version, spank_plugin_version and the slurm_spank_* hooks it
# implements): the shipped one has NO job_prolog/job_epilog (a plugin with them makes slurmd run a
# prolog process for every job, +12 ms per srun), the other has exactly those two more.
# plugin_version carries the installed Slurm's major.minor, nothing links libslurm, and the
# plugin's dependency graph has no tokio, axum or sqlx. Needs only a release build.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
SO="$REPO/target/release/libgpuhub_spank.so"
SO_PROLOG="$REPO/target/release/libgpuhub_spank_prolog.so"
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -f "$SO" ] && [ -f "$SO_PROLOG" ] || (cd "$REPO" && cargo build --release -p gpuhub-spank -p gpuhub-spank-prolog) \
    || fail "cannot build $SO and $SO_PROLOG"

step_hooks="plugin_name plugin_type plugin_version spank_plugin_version slurm_spank_exit slurm_spank_init slurm_spank_init_post_opt slurm_spank_task_exit"
# check_exports SO SYMBOL...: SO exports exactly these.
check_exports() {
    local so="$1" got want; shift
    echo "+ nm -D --defined-only $so"
    got="$(nm -D --defined-only "$so" | awk '{print $3}' | sort)"
    sed 's/^/  | /' <<<"$got"
    want="$(printf '%s\n' "$@" | sort)"
    [ "$got" = "$want" ] || fail "$so: exported symbols differ; expected:
$want
got:
$got"
}
# shellcheck disable=SC2086
check_exports "$SO" $step_hooks
# shellcheck disable=SC2086
check_exports "$SO_PROLOG" $step_hooks slurm_spank_job_prolog slurm_spank_job_epilog
for so in "$SO" "$SO_PROLOG"; do
    for s in plugin_name plugin_type plugin_version; do
        nm -D --defined-only "$so" | grep -qE " [RD] $s\$" || fail "$s is not an exported data symbol"
    done
    nm -D --defined-only "$so" | grep -qE ' T (init|fini)$' && fail "exports init/fini, which Slurm's loader would call"

    echo "+ readelf -d $so (NEEDED)"
    needed="$(readelf -d "$so" | grep NEEDED || true)"
    sed 's/^/  | /' <<<"$needed"
    if grep -qi slurm <<<"$needed"; then fail "the plugin links libslurm; spank_* must come from the host process"; fi

    echo "+ plugin_version vs /usr/include/slurm/slurm_version.h"
    hdr="$(awk '/#define SLURM_VERSION_NUMBER/ {print $3}' /usr/include/slurm/slurm_version.h)"
    off="$(nm -D --defined-only "$so" | awk '$3 == "plugin_version" {print $1}')"
    ver="$(python3 - "$so" "$off" <<'PY'
import sys, subprocess
so, addr = sys.argv[1], int(sys.argv[2], 16)
# Map the symbol's virtual address to a file offset through the section headers.
out = subprocess.run(["readelf", "-SW", so], capture_output=True, text=True).stdout
for line in out.splitlines():
    parts = line.replace("[ ", "[").split()
    if len(parts) > 5 and parts[0].startswith("[") and parts[0] != "[Nr]":
        try:
            va, off, size = int(parts[3], 16), int(parts[4], 16), int(parts[5], 16)
        except ValueError:
            continue
        if va <= addr < va + size and va:
            with open(so, "rb") as f:
                f.seek(off + addr - va)
                print(hex(int.from_bytes(f.read(4), "little")))
            break
PY
    )"
    echo "  plugin_version=$ver header=$hdr"
    [ "$((ver & 0xffff00))" = "$((hdr & 0xffff00))" ] || fail "plugin_version $ver does not match the headers' major.minor ($hdr)"
done

echo "+ cargo tree -p gpuhub-spank-prolog -e normal | grep -E 'tokio|axum|sqlx' (its graph holds gpuhub-spank's)"
tree="$(cd "$REPO" && cargo tree -p gpuhub-spank-prolog -e normal)" || fail "cargo tree failed"
grep -q '^gpuhub-spank-prolog' <<<"$tree" && grep -q 'gpuhub-spank v' <<<"$tree" || fail "cargo tree printed no dependency graph: $tree"
grep -q 'gpuhub-wire' <<<"$tree" || fail "cargo tree lacks gpuhub-wire; is this the right graph? $tree"
bad="$(grep -E 'tokio|axum|sqlx' <<<"$tree" || true)"
[ -z "$bad" ] || fail "the plugin depends on an async runtime/server/database crate:
$bad"
echo "PASS: spank-symbols"
