#!/usr/bin/env bash
# The shipped /etc/gpuhub/agent.toml (rpm/agent.toml) against the agent's real schema:
# `gpuhub-agent check-config` accepts it; its documented defaults are the code's defaults; its
# examples validate; every option the agent knows is documented (tests/rpm/check_config.py).
# Then two mutations prove the check can fail: a wrong default and an undocumented option.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
echo "+ cargo build --release --workspace (a no-op after tests/run-all.sh built it)"
cargo build --release --quiet --workspace
AGENT="$REPO/target/release/gpuhub-agent"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "== the shipped file"
python3 tests/rpm/check_config.py "$AGENT" rpm/agent.toml "$work"

echo "== mutation 1: a documented default that is not the code's (keepalive_s 10 -> 11) must fail"
grep -q '^#keepalive_s = 10$' rpm/agent.toml || { echo "FAIL: rpm/agent.toml has no '#keepalive_s = 10' line to mutate"; exit 1; }
sed 's/^#keepalive_s = 10$/#keepalive_s = 11/' rpm/agent.toml > "$work/wrong-default.toml"
if python3 tests/rpm/check_config.py "$AGENT" "$work/wrong-default.toml" "$work" > "$work/out1" 2>&1; then
    cat "$work/out1"; echo "FAIL: expected the checker to reject a wrong default, it passed"; exit 1
fi
grep -q 'documented default differs from the code in \[gateway\]' "$work/out1" ||
    { cat "$work/out1"; echo "FAIL: expected 'documented default differs ... [gateway]'"; exit 1; }
echo "rejected as expected"

echo "== mutation 2: an option missing from the file (telemetry.interval_ms) must fail"
grep -v '^#interval_ms = ' rpm/agent.toml > "$work/undocumented.toml"
if python3 tests/rpm/check_config.py "$AGENT" "$work/undocumented.toml" "$work" > "$work/out2" 2>&1; then
    cat "$work/out2"; echo "FAIL: expected the checker to reject an undocumented option, it passed"; exit 1
fi
grep -q 'option `telemetry.interval_ms` is not documented' "$work/out2" ||
    { cat "$work/out2"; echo "FAIL: expected 'option \`telemetry.interval_ms\` is not documented'"; exit 1; }
echo "rejected as expected"
echo "PASS rpm-config"
