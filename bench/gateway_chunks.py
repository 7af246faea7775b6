#!/usr/bin/env python3
"""Streamed-chunk forwarding delay. The worker runs with `--stamp-chunks`: every chunk carries
`x_sent_unix_ns`, the wall clock when the worker made it. This client reads N streams directly
from the worker and N through the gateway (alternating) and takes, per chunk, the time from
the worker's stamp to the moment the client read the `data:` line. Direct delays are the
worker's own send path plus loopback plus this client; through the gateway they add the
gateway's hop. Prints both distributions and the added time (gateway minus direct) at p50,
p99 and max, in ms.

usage: gateway_chunks.py DIRECT_URL DIRECT_KEY GATEWAY_URL GATEWAY_KEY [N]
"""
import http.client, json, sys, time, urllib.parse

def stream(url, key):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    body = json.dumps({"model": "demo-chat", "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}]})
    c.request("POST", "/v1/chat/completions", body, {"authorization": "Bearer " + key, "content-type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        sys.exit("%s answered %d: %s" % (url, r.status, r.read()[:200]))
    delays = []
    while True:
        line = r.readline()
        now = time.time_ns()
        if not line:
            break
        if line.startswith(b"data:") and b"[DONE]" not in line:
            sent = json.loads(line[5:]).get("x_sent_unix_ns")
            if sent is None:
                sys.exit("a chunk without x_sent_unix_ns: run the worker with --stamp-chunks")
            delays.append((now - sent) / 1e6)
    c.close()
    return delays

direct_url, direct_key, gw_url, gw_key = sys.argv[1:5]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 30
stream(direct_url, direct_key); stream(gw_url, gw_key)  # warm up connections and caches
direct, gateway = [], []
for _ in range(n):
    direct += stream(direct_url, direct_key)
    gateway += stream(gw_url, gw_key)
direct.sort(); gateway.sort()
p = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]
print("chunks=%d direct_ms p50=%.3f p99=%.3f max=%.3f | gateway_ms p50=%.3f p99=%.3f max=%.3f | added_ms p50=%.3f p99=%.3f max=%.3f" % (
    len(gateway), p(direct, .5), p(direct, .99), direct[-1], p(gateway, .5), p(gateway, .99), gateway[-1],
    p(gateway, .5) - p(direct, .5), p(gateway, .99) - p(direct, .99), gateway[-1] - direct[-1]))
