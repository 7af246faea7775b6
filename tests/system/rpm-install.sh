#!/usr/bin/env bash
# timeout: 900
# The packages work as installed: the RPMs' files, extracted into a temp root
# (rpm2cpio | cpio), run on the lab.
#  1. The packaged plugin loads into the test cluster: the lab's plugstack file is replaced, for
#     this test only, by the PACKAGED /etc/slurm/plugstack.conf.d/gpuhub.conf with its plugin
#     path pointed at the extracted spank_gpuhub.so (no other gpuhub line remains), then
#     `srun --help` must list the [gpuhub] options (srun loaded it), a job must get GPUHUB_URL
#     injected, and the job's slurmstepd must have the extracted .so mapped.
#  2. The packaged agent starts with the packaged config, the way the unit starts it: the
#     ExecStartPre/ExecStart lines of the packaged gpuhub-agent.service, run with the packaged
#     binary, on the packaged agent.toml with its documented defaults uncommented (equivalent,
#     see rpm-config.sh) and only paths and listeners moved to temp dirs and free ports (the lab
#     agent holds the defaults). It must answer /healthz, /metrics and the packaged CLI, and
#     stop cleanly on SIGTERM.
#  3. The packaged tmpfiles.d file creates the spool and runtime dirs with the packaged modes.
# Uses target/rpm/*.rpm from rpm-build.sh; builds them (GPUHUB_RPM_PREBUILT=1) if missing.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
# shellcheck source=tests/lib/lab.sh
source tests/lib/lab.sh
# shellcheck source=tests/lib/prereq.sh
source tests/lib/prereq.sh
lab_require

OUT="$REPO/target/rpm"
version="$(awk '$1=="Version:"{print $2; exit}' rpm/gpuhub.spec)"
arch="$(rpm --eval '%{_arch}')"
spank="$OUT/gpuhub-spank-$version-1.$arch.rpm"
agent="$OUT/gpuhub-agent-$version-1.$arch.rpm"
if [ ! -s "$spank" ] || [ ! -s "$agent" ]; then
    echo "+ no RPMs in $OUT yet: GPUHUB_RPM_PREBUILT=1 rpm/build.sh"
    GPUHUB_RPM_PREBUILT=1 GPUHUB_RPM_LINT=0 rpm/build.sh > "$REPO/target/rpm-install-build.log" 2>&1 ||
        { tail -n 30 "$REPO/target/rpm-install-build.log"; echo "FAIL: rpm/build.sh"; exit 1; }
fi
root="$(mktemp -d /tmp/gpuhub-rpm-root.XXXXXX)"
chmod 755 "$root"
agent_pid=""
stop_rpm_agent() {
    if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then kill -9 "$agent_pid" 2>/dev/null || true; fi
}
lab_cleanup_add 'stop_rpm_agent; rm -rf "$root"'
echo "+ extract $(basename "$spank") $(basename "$agent") into $root"
(cd "$root" && rpm2cpio "$spank" | cpio -idm --quiet && rpm2cpio "$agent" | cpio -idm --quiet)

# ------------------------------------------------------------------ 1. the plugin in Slurm
so="$(find "$root" -path '*/slurm/spank_gpuhub.so' -type f | head -n1)"
[ -n "$so" ] || lab_fail "no */slurm/spank_gpuhub.so in the extracted gpuhub-spank"
chmod 755 "$so"
snippet="$root/etc/slurm/plugstack.conf.d/gpuhub.conf"
[ -f "$snippet" ] || lab_fail "the package has no /etc/slurm/plugstack.conf.d/gpuhub.conf"
pkg_path="${so#"$root"}"
grep -q "^optional $pkg_path\b" "$snippet" || lab_fail "the packaged snippet does not load $pkg_path as optional: $(grep -v '^#' "$snippet")"
# Another test's temporary plugstack (marked by plugstack_set) must not be saved as "the lab's".
for _ in $(seq 120); do grep -q '^# temporary (tests/system)' "$LAB_PLUGSTACK" || break; sleep 1; done
grep -q '^# temporary (tests/system)' "$LAB_PLUGSTACK" && lab_fail "$LAB_PLUGSTACK is another test's temporary file for 120 s"
plugstack_set   # saves the lab's file; restored at exit
{ echo "# temporary (tests/system): $0"; sed "s|^optional $pkg_path|optional $so|" "$snippet"; } > "$LAB_PLUGSTACK.tmp.$$"
mv -f "$LAB_PLUGSTACK.tmp.$$" "$LAB_PLUGSTACK"
echo "+ $LAB_PLUGSTACK is now the packaged snippet: $(grep -v '^#' "$LAB_PLUGSTACK")"
active="$(grep -Ev '^[[:space:]]*(#|$)' "$LAB_PLUGSTACK")"
[ "$(wc -l <<<"$active")" -eq 1 ] && grep -qF "$so" <<<"$active" ||
    lab_fail "the plugstack file should hold exactly the packaged line, has: $active"

lab_run srun --help
grep -q '\[gpuhub\]' <<<"$LAB_OUT" || lab_fail "srun --help lists no [gpuhub] option: srun did not load $so (expected e.g. --mlflow-experiment)"

cd /tmp
lab_run timeout 60 srun -N1 -t 1 --gres=gpu:1 printenv GPUHUB_URL
[ "$LAB_RC" -eq 0 ] || lab_fail "srun with the packaged plugin failed (exit $LAB_RC)"
grep -q '^http://' <<<"$LAB_OUT" || lab_fail "no GPUHUB_URL in the job: the packaged plugin was not loaded by slurmstepd (expected http://...)"

echo "+ srun sleep 4 &  -> look for $so in the job's slurmstepd memory maps"
srun -N1 -t 1 sleep 4 > /dev/null 2>&1 &
srun_pid=$!
mapped=""
for _ in $(seq 40); do
    for p in $(pgrep -x slurmstepd || true); do
        if grep -qF "$so" "/proc/$p/maps" 2>/dev/null; then mapped="$p"; break 2; fi
    done
    sleep 0.1
done
wait "$srun_pid" || true
[ -n "$mapped" ] || lab_fail "no slurmstepd mapped $so while the job ran"
echo "slurmstepd $mapped has $so mapped"
plugstack_restore
echo "+ lab plugstack restored"
cd "$REPO"

# ------------------------------------------------------------------ 2. the agent as the unit starts it
unit="$root/usr/lib/systemd/system/gpuhub-agent.service"
pre="$(sed -n 's/^ExecStartPre=//p' "$unit")"
start="$(sed -n 's/^ExecStart=//p' "$unit")"
[ -n "$pre" ] && [ -n "$start" ] || lab_fail "the packaged unit lacks ExecStartPre= or ExecStart="
work="$root/test"
mkdir -p "$work/state" "$work/spool" "$work/run"
read -r gw_port m_port < <(python3 "$REPO/tests/lib/free_port.py" 2)
# Documented defaults uncommented (#key = value -> key = value; ## examples stay comments),
# then only the paths and the listeners are moved.
sed -E -e 's/^#(\[[a-z.]+\])$/\1/' -e 's/^#([a-z_]+ = )/\1/' "$root/etc/gpuhub/agent.toml" |
    sed -E -e "s|^state_dir = .*|state_dir = \"$work/state\"|" \
           -e "s|^spool_dir = .*|spool_dir = \"$work/spool\"|" \
           -e "s|^runtime_dir = .*|runtime_dir = \"$work/run\"|" \
           -e "s|^job_map_dir = .*|job_map_dir = \"$work/run/dcgm-job-map\"|" \
           -e "s|^listen = \"127.0.0.1:8400\"|listen = \"127.0.0.1:$gw_port\"|" \
           -e "s|^listen = \"127.0.0.1:9410\"|listen = \"127.0.0.1:$m_port\"|" > "$work/agent.toml"
changed="$(diff <(sed -E -e 's/^#(\[[a-z.]+\])$/\1/' -e 's/^#([a-z_]+ = )/\1/' "$root/etc/gpuhub/agent.toml") "$work/agent.toml" | grep -c '^>' || true)"
[ "$changed" -eq 6 ] || lab_fail "expected to move 6 settings (3 paths, job map, 2 listeners) in the packaged agent.toml, moved $changed"
as_unit() { # the unit's command line with the extracted binary and the test config
    local cmd="$1"
    cmd="${cmd//\/usr\/bin\//$root/usr/bin/}"
    echo "${cmd//\/etc\/gpuhub\/agent.toml/$work/agent.toml}"
}
echo "+ ExecStartPre: $(as_unit "$pre")"
# shellcheck disable=SC2046
env -u GPUHUB_STORE_URL -u GPUHUB_CONFIG $(as_unit "$pre") > "$work/check-config.out" 2>&1 ||
    { cat "$work/check-config.out"; lab_fail "the packaged check-config rejects the packaged config"; }
echo "+ ExecStart: $(as_unit "$start")"
# shellcheck disable=SC2046
env -u GPUHUB_STORE_URL -u GPUHUB_CONFIG $(as_unit "$start") > "$work/agent.log" 2>&1 &
agent_pid=$!
ok=0
for _ in $(seq 150); do
    if curl -sf --max-time 1 "http://127.0.0.1:$gw_port/healthz" > /dev/null; then ok=1; break; fi
    kill -0 "$agent_pid" 2>/dev/null || break
    sleep 0.1
done
[ "$ok" = 1 ] || { tail -n 30 "$work/agent.log"; lab_fail "the packaged agent did not answer /healthz on 127.0.0.1:$gw_port within 15 s"; }
echo "agent from the RPM: /healthz ok on 127.0.0.1:$gw_port"
curl -sf --max-time 5 "http://127.0.0.1:$m_port/metrics" > "$work/metrics.txt" || true
grep -q '^gpuhub_nvml_up ' "$work/metrics.txt" ||
    { tail -n 30 "$work/agent.log"; lab_fail "no gpuhub_nvml_up in the packaged agent's /metrics"; }
echo "agent from the RPM: /metrics ok on 127.0.0.1:$m_port"
lab_run "$root/usr/bin/gpuhub" --socket "$work/run/agent.sock" whoami
[ "$LAB_RC" -eq 0 ] && grep -q 'admin' <<<"$LAB_OUT" || lab_fail "the packaged CLI could not talk to the packaged agent"
kill -TERM "$agent_pid"
stopped=0
for _ in $(seq 100); do kill -0 "$agent_pid" 2>/dev/null || { stopped=1; break; }; sleep 0.1; done
[ "$stopped" = 1 ] || lab_fail "the packaged agent did not stop within 10 s of SIGTERM"
rc=0; wait "$agent_pid" || rc=$?
agent_pid=""
[ "$rc" -eq 0 ] || { tail -n 20 "$work/agent.log"; lab_fail "the packaged agent exited $rc after SIGTERM, expected 0"; }
echo "agent from the RPM: clean exit on SIGTERM"

# ------------------------------------------------------------------ 3. tmpfiles.d
if command -v systemd-tmpfiles > /dev/null; then
    troot="$root/tmpfiles-root"
    mkdir -p "$troot"
    lab_run systemd-tmpfiles --create --root="$troot" "$root/usr/lib/tmpfiles.d/gpuhub-spank.conf"
    for want in "700 /var/spool/gpuhub" "755 /run/gpuhub" "755 /run/gpuhub/dcgm-job-map"; do
        got="$(stat -c '%a' "$troot${want#* }" 2>/dev/null || echo missing)"
        [ "$got" = "${want%% *}" ] || lab_fail "systemd-tmpfiles made ${want#* } with mode $got, expected ${want%% *}"
    done
    echo "tmpfiles.d: spool 0700, runtime 0755, job map 0755"
else
    prereq_missing "systemd-tmpfiles not installed: the packaged tmpfiles.d file is not checked" \
        "apt-get install systemd (tests/setup/deps.sh installs it)" || true
fi
echo "PASS rpm-install"
