#!/usr/bin/env python3
"""Streamed-chunk forwarding delay: time from request start to each SSE `data:` line,
directly from the worker and through the gateway (alternating, N streams each). Prints the
added time per chunk (gateway minus direct, same chunk index), p50/p99/max in ms: an upper
bound on how long the gateway holds a chunk (it includes the request's own overhead).

usage: gateway_chunks.py DIRECT_URL DIRECT_KEY GATEWAY_URL GATEWAY_KEY [N]
"""
import http.client, json, statistics, sys, time, urllib.parse

def stream(url, key):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    body = json.dumps({"model": "demo-chat", "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}]})
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"authorization": "Bearer " + key, "content-type": "application/json"})
    r = c.getresponse()
    times = []
    while True:
        line = r.readline()
        if not line:
            break
        if line.startswith(b"data:") and b"[DONE]" not in line:
            times.append((time.perf_counter() - t0) * 1000)
    c.close()
    return times

direct_url, direct_key, gw_url, gw_key = sys.argv[1:5]
n = int(sys.argv[5]) if len(sys.argv) > 5 else 30
stream(direct_url, direct_key); stream(gw_url, gw_key)  # warm up connections and caches
added = []
for _ in range(n):
    d = stream(direct_url, direct_key)
    g = stream(gw_url, gw_key)
    added += [gi - di for gi, di in zip(g, d)]
added.sort()
p = lambda q: added[min(len(added) - 1, int(q * len(added)))]
print("chunks=%d added_ms_p50=%.3f added_ms_p99=%.3f added_ms_max=%.3f" % (len(added), p(0.5), p(0.99), added[-1]))
