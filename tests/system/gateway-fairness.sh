#!/usr/bin/env bash
# Fair queueing within a model's queue (agent/src/models/fair_queue.rs): user A sends a burst of
# 500 calls at once to a model that serves one call at a time (max_concurrency 1, queue_len
# 600); user B sends one call while they wait. B's call must wait for at most about one call's
# time (it is served when the slot frees next), not behind A's burst. Prints the figures
# (tests/lib/gateway_fairness.py); A's own call sent right after B's shows the burst's length.
# The TEST worker with a fixed latency (10 ms per token, 9 tokens: ~80 ms a call): the real
# llama.cpp server's figure is in BENCHMARKS.md (bench/gateway-fairness.sh).
# timeout: 300
set -euo pipefail
source "$(dirname "$0")/../lib/gateway.sh"
gw_init
gw_worker demo-chat --token-delay-ms 10
gw_config
sed -i 's/^max_concurrency = 512$/max_concurrency = 1/; s/^queue_len = 512$/queue_len = 600/' "$GW_DIR/agent.toml"
grep -q '^max_concurrency = 1$' "$GW_DIR/agent.toml" && grep -q '^queue_len = 600$' "$GW_DIR/agent.toml" ||
    gw_fail "could not set max_concurrency 1 and queue_len 600 in $GW_DIR/agent.toml"
gw_config_add gateway "max_connections = 2048"
gw_start
A="$(gw_key alice burst)"; B="$(gw_key bob single)"
python3 "$GW_REPO/tests/lib/gateway_fairness.py" "$GW_URL" "$A" "$B" --metrics "http://127.0.0.1:$GW_METRICS_PORT/metrics" \
    --burst 500 --bound-calls 2 --slack-ms 150 --json "$GW_DIR/result.json" || gw_fail "the fairness check failed (above)"
# The queue bound still answers 429: 600 waiting + 1 in flight, then about 100 more.
python3 - "$GW_URL" "$A" <<'PY' || gw_fail "a burst over queue_len was not answered 429 with Retry-After"
import http.client, json, sys, threading, urllib.parse
u = urllib.parse.urlparse(sys.argv[1]); key = sys.argv[2]
body = json.dumps({"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]})
got = []
def one():
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    c.request("POST", "/v1/chat/completions", body, {"authorization": "Bearer " + key, "content-type": "application/json"})
    r = c.getresponse(); b = r.read()
    got.append((r.status, r.getheader("retry-after"), b))
ts = [threading.Thread(target=one) for _ in range(700)]
for t in ts: t.start()
for t in ts: t.join()
over = [g for g in got if g[0] == 429]
ok = [g for g in got if g[0] == 200]
print("700 calls at once against 1 slot + queue_len 600: %d answered 200, %d answered 429" % (len(ok), len(over)))
assert len(ok) + len(over) == 700, [g for g in got if g[0] not in (200, 429)][:3]
assert len(over) >= 1 and len(ok) >= 601, (len(ok), len(over))
assert all(g[1] and int(g[1]) >= 1 for g in over), over[:3]
assert all(json.loads(g[2])["error"]["code"] == "model_overloaded" for g in over), over[:3]
PY
sleep 1
ROWS="$(gw_rows "SELECT user_name, COUNT(*) FROM usage_log WHERE status = 200 GROUP BY user_name ORDER BY user_name")"
echo "+ successful calls in the usage log per user:"; echo "$ROWS"
echo "$ROWS" | grep -q '^bob|6$' || gw_fail "expected bob's 6 calls in the usage log, got: $ROWS"
gw_stop
echo "PASS gateway-fairness"
