#!/usr/bin/env bash
# timeout: 420
# The plugin's Slurm version gate, on either leg of the lab (GPUHUB_LAB_SLURM: 22.05, the
# default, or 24.11, which tests/run-all.sh runs second): one source, built by bindgen against
# each Slurm's own <slurm/spank.h> and <slurm/slurm_version.h> (target/release against the host's
# 22.05 headers, target/slurm-24.11 against the 24.11 root's: GPUHUB_SLURM_INCLUDE):
# - the leg's srun is the leg's Slurm, and the plugin installed in its PluginDir says (its
#   plugin_version) that it was built for that major.minor;
# - the leg's `srun --help` lists the [gpuhub] options;
# - the OTHER Slurm's build is refused by the leg's srun ("Incompatible Slurm plugin") and lists
#   no [gpuhub] option, so the checks above can fail (srun --help reads a private copy of the
#   leg's slurm.conf whose PlugStackConfig names that build; the installed plugin is not touched).
# Env injection, records, the job hooks and the hostile-user battery on 24.11 are the other
# spank-*, trust-* and accounting-lab* tests, which run unchanged on both legs.
# On the 22.05 leg the 24.11 build comes from tests/lab/slurm24.sh configure (the Debian 13 root
# is made on first use, ~3 min: tests/lab/slurm24-root.sh).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
REPO="$LAB_REPO"

SO22="$REPO/target/release/libgpuhub_spank.so"
SO24="$REPO/target/slurm-24.11/release/libgpuhub_spank.so"
case "$LAB_SLURM" in
    22.05) MINE="$SO22" OTHER="$SO24" OTHER_MM=24.11 ;;
    24.11) MINE="$SO24" OTHER="$SO22" OTHER_MM=22.05 ;;
esac
if [ "$LAB_SLURM" = 22.05 ]; then
    command -v debootstrap >/dev/null || [ -f "${GPUHUB_SLURM24_ROOT:-/var/lib/gpuhub-lab/slurm24-root}/.gpuhub-root" ] ||
        prereq_missing "debootstrap is not installed and there is no Slurm 24.11 root for the 24.11 build" "apt-get install debootstrap" || exit 0
    echo "== the 24.11 build (tests/lab/slurm24.sh configure: root, bindgen against its headers)"
    t0=$SECONDS
    out="$(GPUHUB_LAB_SLURM=24.11 "$REPO/tests/lab/slurm24.sh" configure 2>&1)" || { echo "$out"; lab_fail "tests/lab/slurm24.sh configure failed"; }
    echo "  $((SECONDS - t0)) s"
fi
for so in "$MINE" "$OTHER"; do [ -f "$so" ] || lab_fail "$so missing (cargo build --release; tests/lab/slurm24.sh configure)"; done

echo "== this leg's Slurm is $LAB_SLURM, and its plugin was built for it"
ver="$(srun -V | awk '{print $2}')"
echo "  srun -V: $ver ($(command -v srun))"
case "$ver" in "$LAB_SLURM".*) ;; *) lab_fail "srun is Slurm $ver, not the leg's $LAB_SLURM (PATH/SLURM_CONF of tests/lib/lab.sh)" ;; esac
installed="$(lab_plugin_path)"
for so in "$installed" "$MINE"; do
    mm="$(python3 "$REPO/rpm/plugin-slurm-version.py" "$so")" || lab_fail "cannot read plugin_version of $so"
    echo "  $so: plugin_version $mm"
    [ "$mm" = "$LAB_SLURM" ] || lab_fail "$so was built for Slurm $mm, not $LAB_SLURM"
done
mm="$(python3 "$REPO/rpm/plugin-slurm-version.py" "$OTHER")" || lab_fail "cannot read plugin_version of $OTHER"
[ "$mm" = "$OTHER_MM" ] || lab_fail "$OTHER was built for Slurm $mm, not $OTHER_MM (GPUHUB_SLURM_INCLUDE not honoured?)"

echo "== srun --help lists the [gpuhub] options"
help="$(srun --help 2>&1)" || lab_fail "srun --help failed: $help"
grep '\[gpuhub\]' <<<"$help" | sed 's/^/  | /'
# Each option's usage starts with [gpuhub], on the option's line or, after a long option, the next.
for opt in '--mlflow-experiment=NAME' '--gpuhub-no-inject'; do
    grep -A1 -- "^ *$opt" <<<"$help" | grep -q '\[gpuhub\]' || lab_fail "srun --help on $LAB_SLURM does not list $opt as a [gpuhub] option"
done

echo "== the $OTHER_MM build is refused by $LAB_SLURM's srun"
T="$(mktemp -d /tmp/gpuhub-spank-version.XXXXXX)"
lab_cleanup_add "rm -rf '$T'"
{ grep -v '^PlugStackConfig=' "$LAB_SLURM_CONF"; echo "PlugStackConfig=$T/plugstack.conf"; } > "$T/slurm.conf"
cp "$(dirname "$LAB_SLURM_CONF")/gres.conf" "$T/" 2>/dev/null || true
grep -E '^(optional|required)[[:space:]]' "$LAB_PLUGSTACK" | head -n1 | awk -v so="$OTHER" '{$2 = so; print}' > "$T/plugstack.conf"
sed 's/^/  plugstack: /' "$T/plugstack.conf"
help2="$(SLURM_CONF="$T/slurm.conf" srun --help 2>&1 || true)"
grep -i 'incompatible' <<<"$help2" | sed 's/^/  | /'
grep -q "Incompatible Slurm plugin .*$(basename "$OTHER") version ($OTHER_MM" <<<"$help2" ||
    lab_fail "$LAB_SLURM's srun did not refuse the $OTHER_MM plugin with 'Incompatible Slurm plugin': $(head -c 600 <<<"$help2")"
grep -q '\[gpuhub\]' <<<"$help2" && lab_fail "$LAB_SLURM's srun listed [gpuhub] options from a $OTHER_MM plugin"
echo "PASS: spank-slurm24 ($LAB_SLURM)"
