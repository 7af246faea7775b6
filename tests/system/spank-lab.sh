#!/usr/bin/env bash
# The lab scripts: tests/lab/up.sh is idempotent (a second run restarts nothing and passes its
# smoke test); it fails loudly, within its timeout and with the agent's log lines, when the
# agent cannot start; tests/lab/down.sh is idempotent and up.sh brings everything back.
# Cancels running jobs (down.sh): the harness runs tests one at a time.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
REPO="$LAB_REPO"
export GPUHUB_LAB_BUILD=0 GPUHUB_DEPS_PYTHON=0
T="$(mktemp -d /tmp/gpuhub-lab-test.XXXXXX)"
lab_cleanup_add "rm -rf '$T'"
# Whatever happens, leave the lab up with its own agent.
lab_cleanup_add "GPUHUB_LAB_SMOKE=0 '$REPO/tests/lab/up.sh' >/dev/null 2>&1 || echo 'cleanup: tests/lab/up.sh failed' >&2"
pids() { cat "$LAB_SLURMCTLD_PID" "$LAB_SLURMD_PID" "$LAB_SLURMDBD_PID" /run/munge/munged.pid "$LAB_AGENT_PID" 2>/dev/null | tr '\n' ' '; }

echo "== up.sh twice: nothing restarts"
before="$(pids)"
t0=$SECONDS
lab_run "$REPO/tests/lab/up.sh"
[ "$LAB_RC" = 0 ] || lab_fail "up.sh on a running lab failed"
[ "$(pids)" = "$before" ] || lab_fail "up.sh restarted daemons: pids '$before' -> '$(pids)'"
[ $((SECONDS - t0)) -lt 30 ] || lab_fail "up.sh on a running lab took $((SECONDS - t0)) s"
grep -q "try next" <<<"$LAB_OUT" || lab_fail "up.sh does not print what to try next"
echo "ok"

echo "== up.sh with a broken agent config fails loudly within its timeout"
printf '[telemetry]\ninterval_mss = 5\n' > "$T/broken.toml"
agent_stop
t0=$SECONDS
lab_run env GPUHUB_LAB_AGENT_CONFIG="$T/broken.toml" GPUHUB_LAB_TIMEOUT=20 "$REPO/tests/lab/up.sh"
took=$((SECONDS - t0))
[ "$LAB_RC" != 0 ] || lab_fail "up.sh succeeded although the agent cannot start"
[ "$took" -le 40 ] || lab_fail "up.sh took $took s to fail (timeout 20 s)"
grep -q "ERROR: gpuhub-agent" <<<"$LAB_OUT" || lab_fail "up.sh's error does not name gpuhub-agent"
grep -q "interval_mss" <<<"$LAB_OUT" || lab_fail "up.sh does not show the agent's log lines (the bad key interval_mss)"
echo "ok ($took s)"

echo "== down.sh twice, then up.sh: everything comes back"
lab_run "$REPO/tests/lab/down.sh"
[ "$LAB_RC" = 0 ] || lab_fail "down.sh failed"
pgrep -x slurmd >/dev/null && lab_fail "slurmd still running after down.sh"
agent_running && lab_fail "gpuhub-agent still running after down.sh"
lab_run "$REPO/tests/lab/down.sh"
[ "$LAB_RC" = 0 ] || lab_fail "a second down.sh failed"
t0=$SECONDS
lab_run "$REPO/tests/lab/up.sh"
[ "$LAB_RC" = 0 ] || lab_fail "up.sh after down.sh failed"
echo "  up.sh from stopped: $((SECONDS - t0)) s"
agent_healthy || lab_fail "agent not healthy after up.sh"
case "$(sinfo -h -n "$LAB_NODE" -o %T | head -n1)" in idle|mixed|allocated) ;; *) lab_fail "node not up after up.sh: $(sinfo -h -n "$LAB_NODE" -o "%T %E")" ;; esac
echo "PASS: spank-lab"
