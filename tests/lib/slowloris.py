#!/usr/bin/env python3
"""slowloris.py HOST PORT KEY N HEADER_TIMEOUT_S: the slowloris check of security-slowloris.sh
(stdlib only; run it as an unprivileged user).

Opens N connections that each send part of a request head and never finish it, then times one
ordinary call with KEY on a fresh connection, then waits for the gateway to close the N
connections. Prints one line of JSON: {"opened", "call_status", "call_s", "closed",
"closed_early", "told_408", "close_min_s", "close_max_s"} (each connection's close time counted from its own
opening). Exit 0 if it could run the check at all; the test judges.
"""
import http.client, json, resource, select, socket, sys, time

host, port, key, n, timeout_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = n + 64
if soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))

socks = []
opened_at = {}
for i in range(n):
    s = socket.create_connection((host, port), timeout=5)
    opened_at[s.fileno()] = time.monotonic()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow-%d: " % i)
    s.setblocking(False)
    socks.append(s)
opened = time.monotonic()

t = time.monotonic()
c = http.client.HTTPConnection(host, port, timeout=10)
c.request("POST", "/v1/chat/completions", json.dumps({"model": "demo-chat", "messages": [{"role": "user", "content": "hi"}]}),
          {"authorization": "Bearer " + key, "content-type": "application/json"})
r = c.getresponse()
r.read()
call_s = time.monotonic() - t
call_status = r.status
c.close()

# Wait for every half-open connection to be closed (EOF or reset), up to twice the timeout.
pending = {s.fileno(): s for s in socks}
got = {fd: b"" for fd in pending}
closed_at = {}
deadline = opened + 2 * timeout_s + 5
poller = select.poll()
for fd in pending:
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
while pending and time.monotonic() < deadline:
    for fd, _ in poller.poll(200):
        s = pending.get(fd)
        if s is None:
            continue
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if data:
            got[fd] += data
            continue
        closed_at[fd] = time.monotonic() - opened_at[fd]
        poller.unregister(fd)
        del pending[fd]
times = sorted(closed_at.values())
print(json.dumps({
    "opened": n,
    "call_status": call_status,
    "call_s": round(call_s, 3),
    "closed": len(closed_at),
    "closed_early": sum(1 for x in times if x < timeout_s - 0.5),
    "told_408": sum(1 for v in got.values() if v.startswith(b"HTTP/1.1 408") and b"gateway.header_timeout_s" in v),
    "close_min_s": round(times[0], 2) if times else None,
    "close_max_s": round(times[-1], 2) if times else None,
}))
