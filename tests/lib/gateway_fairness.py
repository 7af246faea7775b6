#!/usr/bin/env python3
"""One user's burst against another user's single call (stdlib only), for
tests/system/gateway-fairness.sh and bench/gateway-fairness.sh.

1. The per-call time: the median of --solo sequential calls of user B (nothing else running).
2. User A sends --burst calls at once (one connection each); once all are sent and the
   gateway's queue holds them (gpuhub_gateway_queued on --metrics), user B sends one call,
   and right after it A sends one more (A's own late call, which waits behind A's burst).
3. Prints the figures and one JSON line (--json FILE too); exits 1 if a call failed or B's
   call took longer than --bound-calls per-call times plus --slack-ms.

usage: gateway_fairness.py URL KEY_A KEY_B --metrics URL [--burst 500] [--model M]
"""
import argparse, http.client, json, statistics, sys, threading, time, urllib.parse, urllib.request

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("key_a"); ap.add_argument("key_b")
ap.add_argument("--metrics", required=True, help="the agent's metrics URL (…/metrics)")
ap.add_argument("--burst", type=int, default=500)
ap.add_argument("--solo", type=int, default=5)
ap.add_argument("--model", default="demo-chat")
ap.add_argument("--max-tokens", type=int, default=0, help="max_tokens in each call (0: none)")
ap.add_argument("--bound-calls", type=float, default=2.0, help="B's latency bound, in per-call times (its own call plus the one it may wait for)")
ap.add_argument("--slack-ms", type=float, default=150.0)
ap.add_argument("--timeout", type=float, default=900.0)
ap.add_argument("--json")
a = ap.parse_args()
u = urllib.parse.urlparse(a.url)
req = {"model": a.model, "messages": [{"role": "user", "content": "Say hi."}]}
if a.max_tokens:
    req["max_tokens"] = a.max_tokens
body = json.dumps(req)


def call(key, conn=None):
    """(status, seconds, body) of one call."""
    own = conn is None
    conn = conn or http.client.HTTPConnection(u.hostname, u.port, timeout=a.timeout)
    t = time.monotonic()
    conn.request("POST", "/v1/chat/completions", body, {"authorization": "Bearer " + key, "content-type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    dt = time.monotonic() - t
    if own:
        conn.close()
    return r.status, dt, data


def queued():
    try:
        text = urllib.request.urlopen(a.metrics, timeout=5).read().decode()
    except Exception:
        return -1
    n = 0
    for line in text.splitlines():
        if line.startswith("gpuhub_gateway_queued{") and 'model="%s"' % a.model in line:
            n += int(float(line.rsplit(" ", 1)[1]))
    return n


solo = []
for _ in range(a.solo):
    s, dt, data = call(a.key_b)
    if s != 200:
        sys.exit("FAIL: a solo call of user B got %d: %s" % (s, data[:300]))
    solo.append(dt)
per_call = statistics.median(solo)
print("per-call time (median of %d solo calls): %.1f ms" % (a.solo, per_call * 1000))

results = [None] * a.burst
sent = threading.Semaphore(0)
go = threading.Event()


def burst(i):
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=a.timeout)
    conn.connect()
    go.wait()
    t = time.monotonic()
    try:
        conn.request("POST", "/v1/chat/completions", body, {"authorization": "Bearer " + a.key_a, "content-type": "application/json"})
        sent.release()
        r = conn.getresponse()
        r.read()
        results[i] = (r.status, time.monotonic() - t)
    except Exception as e:
        sent.release()
        results[i] = (0, repr(e))
    conn.close()


threads = [threading.Thread(target=burst, args=(i,)) for i in range(a.burst)]
for t in threads:
    t.start()
t_burst = time.monotonic()
go.set()
for _ in range(a.burst):
    sent.acquire()
# Wait until the gateway holds the burst (in flight or queued), at most 30 s.
deadline = time.monotonic() + 30
q = queued()
while q < a.burst * 0.9 - 4 and time.monotonic() < deadline:
    time.sleep(0.05)
    q = queued()
print("user A's burst: %d calls sent; the gateway's queue for %s holds %d" % (a.burst, a.model, q))

late = {}


def late_a():
    s, dt, _ = call(a.key_a)
    late["a"] = (s, dt)


b_status, b_latency, b_body = call(a.key_b)
la = threading.Thread(target=late_a)
la.start()
for t in threads:
    t.join()
la.join()
burst_s = time.monotonic() - t_burst

bad = [r for r in results if r is None or r[0] != 200]
ok = [r[1] for r in results if r and r[0] == 200]
delay = b_latency - per_call
out = {
    "burst": a.burst,
    "queued_when_b_called": q,
    "per_call_ms": round(per_call * 1000, 1),
    "b_latency_ms": round(b_latency * 1000, 1),
    "b_delay_ms": round(delay * 1000, 1),
    "b_delay_calls": round(delay / per_call, 2),
    "a_late_call_ms": round(late["a"][1] * 1000, 1),
    "a_burst_s": round(burst_s, 2),
    "a_median_ms": round(statistics.median(ok) * 1000, 1) if ok else None,
    "failed": len(bad),
}
print("user B's single call during A's burst: %.1f ms = its own call (%.1f ms) + %.1f ms waiting (%.2f call times)"
      % (b_latency * 1000, per_call * 1000, delay * 1000, delay / per_call))
print("user A's own call sent right after B's: %.1f ms (behind A's burst); whole burst %.1f s" % (late["a"][1] * 1000, burst_s))
print("RESULT " + json.dumps(out))
if a.json:
    with open(a.json, "w") as f:
        json.dump(out, f)
if b_status != 200:
    sys.exit("FAIL: user B's call got %d: %s" % (b_status, b_body[:300]))
if bad or late["a"][0] != 200:
    sys.exit("FAIL: %d of user A's calls failed, e.g. %s; late call %s" % (len(bad), bad[:3], late["a"]))
if q < a.burst * 0.9 - 4:
    sys.exit("FAIL: the burst was not queued when B called (queued %d of %d): the measurement shows nothing" % (q, a.burst))
bound = a.bound_calls * per_call + a.slack_ms / 1000
if b_latency > bound:
    sys.exit("FAIL: user B waited %.1f ms behind user A's burst; the bound is %.1f ms (%.1f call times + %.0f ms)"
             % (b_latency * 1000, bound * 1000, a.bound_calls, a.slack_ms))
print("ok: B's latency %.1f ms <= %.1f ms (%.1f call times + %.0f ms slack)" % (b_latency * 1000, bound * 1000, a.bound_calls, a.slack_ms))
