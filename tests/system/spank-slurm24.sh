#!/usr/bin/env bash
# timeout: 600
# SPANK plugin on Slurm 24.11 (Debian 13's packages), beside the lab's 22.05: the same source,
# built by bindgen against the 24.11 root's <slurm/spank.h> and <slurm/slurm_version.h>
# (GPUHUB_SLURM_INCLUDE, target/slurm-24.11), loads there and works:
# - the root exists (tests/lab/slurm24-root.sh: debootstrap of trixie on first use, ~3 min) and
#   its slurmctld is 24.11;
# - the plugin's plugin_version says 24.11; the 22.05 build says 22.05 and 24.11's srun refuses
#   it ("Incompatible Slurm plugin"), so the check below can fail;
# - 24.11's `srun --help` lists the [gpuhub] options;
# - with 24.11's munged, slurmctld, slurmd running chrooted on ports 6917/6918 (tests/lab/slurm24.sh):
#   a --gres=gpu:1 job gets CUDA_VISIBLE_DEVICES and GPUHUB_URL, a --gres=shard:7
#   --mlflow-experiment job gets MLFLOW_EXPERIMENT_NAME and SLURM_SHARDS_ON_NODE=7, and the
#   plugin writes the step's start and end records with the job id, uid and user Slurm gave it
#   (a job of root and one of the unprivileged gpuhublab, whose account up copies into the root).
# The 24.11 daemons are stopped at exit. Not yet on 24.11: slurmdbd/sacct, the agent, the
# other system tests (docs/spank.md, "Build and version").
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
. "$REPO/tests/lib/prereq.sh"
LAB24="$REPO/tests/lab/slurm24.sh"
fail() {
    echo "FAIL: $*" >&2
    local f
    for f in slurmd slurmctld; do
        [ -f "$ROOT/var/log/slurm/$f.log" ] && { echo "--- last lines of $ROOT/var/log/slurm/$f.log" >&2; tail -n 20 "$ROOT/var/log/slurm/$f.log" >&2; }
    done
    exit 1
}
[ "$(id -u)" -eq 0 ] || fail "run as root (chroot, mounts, Slurm daemons)"
command -v debootstrap >/dev/null || [ -f /var/lib/gpuhub-lab/slurm24-root/.gpuhub-root ] ||
    prereq_missing "debootstrap is not installed and there is no Slurm 24.11 root yet" "apt-get install debootstrap (tests/lab/slurm24-root.sh installs it itself when apt works)" || exit 0

echo "== the Slurm 24.11 root"
t0=$SECONDS
ROOT="$("$REPO/tests/lab/slurm24-root.sh")" || fail "tests/lab/slurm24-root.sh failed"
ver="$(chroot "$ROOT" dpkg-query -W -f='${Version}' slurmctld)"
echo "  $ROOT: slurmctld $ver ($((SECONDS - t0)) s)"
case "$ver" in 24.11.*) ;; *) fail "the root's slurmctld is $ver, not 24.11" ;; esac
trap '"$LAB24" down >/dev/null 2>&1 || true' EXIT

echo "== the plugin built against the root's headers"
t0=$SECONDS
"$LAB24" configure || fail "tests/lab/slurm24.sh configure (build against $ROOT/usr/include) failed"
echo "  built and installed in $((SECONDS - t0)) s"
SO24="$REPO/target/slurm-24.11/release/libgpuhub_spank.so"
for so in "$SO24" "$REPO/target/slurm-24.11/release/libgpuhub_spank_prolog.so"; do
    mm="$(python3 "$REPO/rpm/plugin-slurm-version.py" "$so")" || fail "cannot read plugin_version of $so"
    echo "  $so: plugin_version $mm"
    [ "$mm" = 24.11 ] || fail "$so was built for Slurm $mm, not 24.11 (GPUHUB_SLURM_INCLUDE not honoured?)"
done

echo "== 24.11's srun --help lists the [gpuhub] options"
help="$("$LAB24" run srun --help 2>&1)" || fail "srun --help failed in the root: $help"
grep '\[gpuhub\]' <<<"$help" | sed 's/^/  | /'
# Each option's usage starts with [gpuhub], on the option's line or, after a long option, the next.
for opt in '--mlflow-experiment=NAME' '--gpuhub-no-inject'; do
    grep -A1 -- "^ *$opt" <<<"$help" | grep -q '\[gpuhub\]' || fail "srun --help on 24.11 does not list $opt as a [gpuhub] option"
done

echo "== a plugin built for 22.05 is refused by 24.11 (the version check is real)"
SO22="$REPO/target/release/libgpuhub_spank.so"
[ -f "$SO22" ] || fail "$SO22 missing: cargo build --release"
mm22="$(python3 "$REPO/rpm/plugin-slurm-version.py" "$SO22")" || fail "cannot read plugin_version of $SO22"
PLUGIN="$ROOT/usr/lib/x86_64-linux-gnu/slurm-wlm/spank_gpuhub.so"
cp "$SO22" "$PLUGIN"
help22="$("$LAB24" run srun --help 2>&1 || true)"
install -m 755 "$SO24" "$PLUGIN"
grep -i 'incompatible' <<<"$help22" | sed 's/^/  | /'
[ "$mm22" != 24.11 ] || fail "target/release's plugin says 24.11; this host's headers should be another Slurm"
grep -q "Incompatible Slurm plugin .*spank_gpuhub.so version ($mm22" <<<"$help22" ||
    fail "24.11's srun did not refuse the $mm22 plugin with 'Incompatible Slurm plugin'"
grep -q '\[gpuhub\]' <<<"$help22" && fail "24.11's srun listed [gpuhub] options from a $mm22 plugin"

LAB_USER="$(unprivileged_user)"
LAB_UID="$(id -u "$LAB_USER")"

echo "== munged, slurmctld, slurmd 24.11 (ports 6917/6918) with the plugin"
t0=$SECONDS
GPUHUB_LAB_BUILD=0 "$LAB24" up || fail "tests/lab/slurm24.sh up failed"
echo "  up in $((SECONDS - t0)) s"
run24() { "$LAB24" run sh -c "$1" 2>&1; }
val() { sed -n "s/^$1=//p" <<<"$out" | head -n1; }

echo "== --gres=gpu:1: CUDA_VISIBLE_DEVICES, GPUHUB_URL"
out="$(run24 'timeout 60 srun -N1 -t 1 --gres=gpu:1 sh -c "echo JOB=\$SLURM_JOB_ID; env" | sort')" || fail "srun --gres=gpu:1 failed: $out"
grep -E '^(JOB|CUDA_VISIBLE_DEVICES|GPUHUB_URL|SLURM_JOB_GPUS)=' <<<"$out" | sed 's/^/  | /'
case "$(val CUDA_VISIBLE_DEVICES)" in 0|1) ;; *) fail "CUDA_VISIBLE_DEVICES='$(val CUDA_VISIBLE_DEVICES)' for one GPU" ;; esac
[ "$(val GPUHUB_URL)" = "http://127.0.0.1:8400" ] || fail "GPUHUB_URL='$(val GPUHUB_URL)', expected the plugstack's gateway_url http://127.0.0.1:8400"
job1="$(val JOB)"

echo "== --gres=shard:7 --mlflow-experiment=demo24"
out="$(run24 'timeout 60 srun -N1 -t 1 --gres=shard:7 --mlflow-experiment=demo24 sh -c "echo JOB=\$SLURM_JOB_ID; env" | sort')" || fail "srun --gres=shard:7 failed: $out"
grep -E '^(JOB|MLFLOW_EXPERIMENT_NAME|SLURM_SHARDS_ON_NODE|CUDA_VISIBLE_DEVICES)=' <<<"$out" | sed 's/^/  | /'
[ "$(val MLFLOW_EXPERIMENT_NAME)" = demo24 ] || fail "MLFLOW_EXPERIMENT_NAME='$(val MLFLOW_EXPERIMENT_NAME)', expected demo24"
[ "$(val SLURM_SHARDS_ON_NODE)" = 7 ] || fail "SLURM_SHARDS_ON_NODE='$(val SLURM_SHARDS_ON_NODE)', expected 7"
job2="$(val JOB)"

echo "== a job of the unprivileged $LAB_USER: its records carry its uid and name (spank_get_item)"
out="$(run24 "timeout 60 runuser -u $LAB_USER -- srun -N1 -t 1 --gres=gpu:1 sh -c 'echo JOB=\$SLURM_JOB_ID; echo ME=\$(id -un)'")" || fail "srun as $LAB_USER failed: $out"
sed 's/^/  | /' <<<"$out"
[ "$(val ME)" = "$LAB_USER" ] || fail "the job did not run as $LAB_USER: $out"
job3="$(val JOB)"

echo "== the plugin's records for the three jobs (the root's /var/spool/gpuhub/records)"
for job in "$job1" "$job2" "$job3"; do
    recs=""
    for _ in $(seq 40); do
        recs="$(cat "$ROOT"/var/spool/gpuhub/records/*.json 2>/dev/null | jq -c --argjson j "$job" 'select(.job_id == $j)' 2>/dev/null || true)"
        grep -q '"kind":"step_end"' <<<"$recs" && break
        sleep 0.5
    done
    sed 's/^/  | /' <<<"$recs"
    grep -q '"kind":"step_start"' <<<"$recs" || fail "no step_start record for job $job in $ROOT/var/spool/gpuhub/records"
    grep -q '"kind":"step_end"' <<<"$recs" || fail "no step_end record for job $job in $ROOT/var/spool/gpuhub/records"
    if [ "$job" = "$job3" ]; then want_uid="$LAB_UID" want_user="$LAB_USER"; else want_uid=0 want_user=root; fi
    jq -e --argjson u "$want_uid" --arg n "$want_user" 'select(.uid != $u or .user != $n)' <<<"$recs" >/dev/null &&
        fail "a record of job $job does not carry uid $want_uid ($want_user), who ran it"
done
start1="$(cat "$ROOT"/var/spool/gpuhub/records/*.json | jq -c --argjson j "$job1" 'select(.job_id == $j and .kind == "step_start")')"
jq -e '(.gpus | length) == 1 and (.gpus[0].index == 0 or .gpus[0].index == 1)' <<<"$start1" >/dev/null ||
    fail "job $job1 (--gres=gpu:1): its step_start record does not hold exactly one GPU: $start1"
start2="$(cat "$ROOT"/var/spool/gpuhub/records/*.json | jq -c --argjson j "$job2" 'select(.job_id == $j and .kind == "step_start")')"
jq -e '.shards == 7' <<<"$start2" >/dev/null || fail "job $job2 (--gres=shard:7): its step_start record does not say 7 shards: $start2"
echo "ok"
