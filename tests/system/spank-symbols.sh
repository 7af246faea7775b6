#!/usr/bin/env bash
# SPANK plugin, build contract: the .so exports exactly the symbols Slurm needs (plugin_name,
# plugin_type, plugin_version, spank_plugin_version and the slurm_spank_* hooks we implement),
# plugin_version carries the installed Slurm's major.minor, nothing links libslurm, and the
# plugin's dependency graph has no tokio, axum or sqlx. Needs only a release build.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
SO="$REPO/target/release/libgpuhub_spank.so"
fail() { echo "FAIL: $*" >&2; exit 1; }
[ -f "$SO" ] || (cd "$REPO" && cargo build --release -p gpuhub-spank) || fail "cannot build $SO"

echo "+ nm -D --defined-only $SO"
got="$(nm -D --defined-only "$SO" | awk '{print $3}' | sort)"
sed 's/^/  | /' <<<"$got"
want="$(printf '%s\n' plugin_name plugin_type plugin_version spank_plugin_version \
    slurm_spank_exit slurm_spank_init slurm_spank_init_post_opt slurm_spank_job_epilog \
    slurm_spank_job_prolog slurm_spank_task_exit | sort)"
[ "$got" = "$want" ] || fail "exported symbols differ; expected:
$want
got:
$got"
for s in plugin_name plugin_type plugin_version; do
    nm -D --defined-only "$SO" | grep -qE " [RD] $s\$" || fail "$s is not an exported data symbol"
done
nm -D --defined-only "$SO" | grep -qE ' T (init|fini)$' && fail "exports init/fini, which Slurm's loader would call"

echo "+ readelf -d $SO (NEEDED)"
needed="$(readelf -d "$SO" | grep NEEDED || true)"
sed 's/^/  | /' <<<"$needed"
if grep -qi slurm <<<"$needed"; then fail "the plugin links libslurm; spank_* must come from the host process"; fi

echo "+ plugin_version vs /usr/include/slurm/slurm_version.h"
hdr="$(awk '/#define SLURM_VERSION_NUMBER/ {print $3}' /usr/include/slurm/slurm_version.h)"
off="$(nm -D --defined-only "$SO" | awk '$3 == "plugin_version" {print $1}')"
ver="$(python3 - "$SO" "$off" <<'PY'
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

echo "+ cargo tree -p gpuhub-spank -e normal | grep -E 'tokio|axum|sqlx'"
tree="$(cd "$REPO" && cargo tree -p gpuhub-spank -e normal)" || fail "cargo tree failed"
grep -q '^gpuhub-spank' <<<"$tree" || fail "cargo tree printed no dependency graph: $tree"
grep -q 'gpuhub-wire' <<<"$tree" || fail "cargo tree lacks gpuhub-wire; is this the right graph? $tree"
bad="$(grep -E 'tokio|axum|sqlx' <<<"$tree" || true)"
[ -z "$bad" ] || fail "the plugin depends on an async runtime/server/database crate:
$bad"
echo "PASS: spank-symbols"
