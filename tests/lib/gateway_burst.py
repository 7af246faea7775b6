#!/usr/bin/env python3
"""Burst of gateway calls over keep-alive connections (stdlib only), for the gateway's system
tests and benchmark. Writes one line per response received: "<status> <x-request-id>".
Stops when --seconds pass or the gateway goes away (each thread ends at its first
connection error, which is how a kill -9 looks from here).

usage: gateway_burst.py URL KEY OUT [--threads N] [--seconds S] [--model M]
"""
import argparse, http.client, json, threading, time, urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("key"); ap.add_argument("out")
ap.add_argument("--threads", type=int, default=8)
ap.add_argument("--seconds", type=float, default=30)
ap.add_argument("--model", default="demo-chat")
a = ap.parse_args()
u = urllib.parse.urlparse(a.url)
body = json.dumps({"model": a.model, "messages": [{"role": "user", "content": "hi"}]})
headers = {"authorization": "Bearer " + a.key, "content-type": "application/json"}
lock = threading.Lock()
out = open(a.out, "w", buffering=1)
deadline = time.time() + a.seconds

def worker():
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    while time.time() < deadline:
        try:
            conn.request("POST", "/v1/chat/completions", body, headers)
            r = conn.getresponse()
            r.read()
        except Exception:
            return
        with lock:
            out.write("%d %s\n" % (r.status, r.getheader("x-request-id", "")))

ts = [threading.Thread(target=worker) for _ in range(a.threads)]
for t in ts: t.start()
for t in ts: t.join()
