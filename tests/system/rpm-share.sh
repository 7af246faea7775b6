#!/usr/bin/env bash
# What the RPM ships in /usr/share/gpuhub, checked against real tools and the real agent:
# promtool (config, rules, and unit tests of the names alerts in tests/rpm/alerts-test.yml),
# the Grafana dashboards (fresh from rpm/grafana/make-dashboards.py, every query parsed by
# promtool, every metric exported by a running gpuhub-agent) and the JupyterHub example
# (tests/rpm/check_share.py) with its SSO authenticator's unit tests (tests/rpm/test_jupyterhub_sso.py).
# A mutated alert rule proves the alert tests can fail.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
command -v promtool >/dev/null || { echo "FAIL: promtool not found (apt-get install prometheus)"; exit 1; }
work="$(mktemp -d)"
agent_pid=""
cleanup() {
    if [ -n "$agent_pid" ] && kill -0 "$agent_pid" 2>/dev/null; then
        kill "$agent_pid"; wait "$agent_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

echo "+ promtool check rules rpm/share/prometheus/gpuhub-alerts.yml"
promtool check rules rpm/share/prometheus/gpuhub-alerts.yml
echo "+ promtool check config (rule_files pointed at the repository copy)"
sed "s|/usr/share/gpuhub/prometheus/gpuhub-alerts.yml|$REPO/rpm/share/prometheus/gpuhub-alerts.yml|" \
    rpm/share/prometheus/gpuhub.yml > "$work/prometheus.yml"
promtool check config "$work/prometheus.yml"
echo "+ promtool test rules tests/rpm/alerts-test.yml"
(cd tests/rpm && promtool test rules alerts-test.yml)
echo "+ self-test: the alert tests fail when GpuhubRetiredModelNameCalled watches the wrong state"
# Every selector of the rule's expression (the line after its name) watches the wrong state.
sed '/alert: GpuhubRetiredModelNameCalled$/{n;s/state="retired"/state="active"/g}' rpm/share/prometheus/gpuhub-alerts.yml > "$work/mutated-alerts.yml"
cmp -s rpm/share/prometheus/gpuhub-alerts.yml "$work/mutated-alerts.yml" && { echo "FAIL: the self-test's mutation changed nothing (rule renamed?)"; exit 1; }
sed "s|../../rpm/share/prometheus/gpuhub-alerts.yml|$work/mutated-alerts.yml|" tests/rpm/alerts-test.yml > "$work/mutated-test.yml"
if promtool test rules "$work/mutated-test.yml" > "$work/mutated.out" 2>&1; then
    echo "FAIL: the alert unit tests passed against a broken rule"; exit 1
fi
echo "failed as expected"

echo "+ cargo build --release --workspace; start it on free loopback ports with temp dirs"
cargo build --release --quiet --workspace
. "$REPO/tests/lib/agent-config.sh"
agent_config "$work"
m_port="$AGENT_METRICS_PORT"
env -u GPUHUB_STORE_URL target/release/gpuhub-agent run --config "$work/agent.toml" > "$work/agent.log" 2>&1 &
agent_pid=$!
for _ in $(seq 100); do
    curl -fsS "http://127.0.0.1:$m_port/metrics" > "$work/metrics.txt" 2>/dev/null && break
    kill -0 "$agent_pid" 2>/dev/null || { cat "$work/agent.log"; echo "FAIL: gpuhub-agent exited"; exit 1; }
    sleep 0.1
done
[ -s "$work/metrics.txt" ] || { tail -20 "$work/agent.log"; echo "FAIL: no /metrics from the agent within 10 s"; exit 1; }
python3 tests/rpm/check_share.py "$REPO" "$work/metrics.txt" "$work"
echo "+ python3 -B tests/rpm/test_jupyterhub_sso.py (the JupyterHub SSO authenticator's trust and e-mail mapping)"
python3 -B tests/rpm/test_jupyterhub_sso.py
echo "PASS rpm-share"
