#!/usr/bin/env python3
"""gateway_calls.py URL KEY OUT [--max N] [--stop-after-refused K]: calls the gateway one after
another on a kept-alive connection (stdlib only; run it as an unprivileged user), writing one
line per answer to OUT: "<status> <x-request-id> <error code or ->". Stops after N calls, or once
K calls in a row were refused with 503.
"""
import argparse, http.client, json, urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("key"); ap.add_argument("out")
ap.add_argument("--max", type=int, default=5000)
ap.add_argument("--stop-after-refused", type=int, default=0)
a = ap.parse_args()
u = urllib.parse.urlparse(a.url)
body = json.dumps({"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]})
headers = {"authorization": "Bearer " + a.key, "content-type": "application/json"}
refused_in_a_row = 0
with open(a.out, "w", buffering=1) as out:
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    for _ in range(a.max):
        try:
            conn.request("POST", "/v1/chat/completions", body, headers)
            r = conn.getresponse()
            data = r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
            continue
        code = "-"
        if r.status >= 400:
            try:
                code = json.loads(data)["error"]["code"]
            except Exception:
                code = "unreadable"
            if r.status == 503 and code == "usage_log_full":
                with open(a.out + ".message", "w") as m:
                    m.write(json.loads(data)["error"]["message"])
        out.write("%d %s %s\n" % (r.status, r.getheader("x-request-id", "-"), code))
        refused_in_a_row = refused_in_a_row + 1 if r.status == 503 else 0
        if a.stop_after_refused and refused_in_a_row >= a.stop_after_refused:
            break
