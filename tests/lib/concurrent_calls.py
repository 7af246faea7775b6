#!/usr/bin/env python3
"""concurrent_calls.py URL KEY MODEL OUT STOP [--clients N] [--max-tokens T]: N threads (default
20) call the gateway's /v1/chat/completions in a loop, each on its own kept-alive connection
(stdlib only), until the file STOP exists. Writes one line per call to OUT:
"<end unix time> <client> <status> <error or ->", and prints the counts. A call fails when it
gets no answer or a status other than 200 (a 429 or 503 during a switch counts as failed).
Exit status: 0 when every call succeeded, 1 otherwise.
"""
import argparse, http.client, json, os, threading, time, urllib.parse

ap = argparse.ArgumentParser()
ap.add_argument("url"); ap.add_argument("key"); ap.add_argument("model"); ap.add_argument("out"); ap.add_argument("stop")
ap.add_argument("--clients", type=int, default=20)
ap.add_argument("--max-tokens", type=int, default=4)
a = ap.parse_args()
u = urllib.parse.urlparse(a.url)
body = json.dumps({"model": a.model, "max_tokens": a.max_tokens, "messages": [{"role": "user", "content": "Say hi."}]})
headers = {"authorization": "Bearer " + a.key, "content-type": "application/json"}
lock = threading.Lock()
counts = {"ok": 0, "failed": 0}
out = open(a.out, "w", buffering=1)


def client(n):
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    while not os.path.exists(a.stop):
        err = "-"
        try:
            conn.request("POST", "/v1/chat/completions", body, headers)
            r = conn.getresponse()
            data = r.read()
            status = r.status
            if status != 200:
                try:
                    err = json.loads(data)["error"]["message"].replace("\n", " ")[:300]
                except Exception:
                    err = data[:300].decode("utf-8", "replace").replace("\n", " ")
        except (OSError, http.client.HTTPException) as e:
            status, err = 0, f"{type(e).__name__}: {e}"
            conn.close()
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
        with lock:
            counts["ok" if status == 200 else "failed"] += 1
            out.write(f"{time.time():.3f} {n} {status} {err}\n")


threads = [threading.Thread(target=client, args=(i,)) for i in range(a.clients)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"{a.clients} clients: {counts['ok'] + counts['failed']} calls, {counts['ok']} ok, {counts['failed']} failed")
raise SystemExit(0 if counts["failed"] == 0 else 1)
