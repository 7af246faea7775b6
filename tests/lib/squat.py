#!/usr/bin/env python3
"""A squatter for the security tests: `squat.py PORT LOG [ADDRESS]`, run as an unprivileged
user on a worker's port (ADDRESS: 127.0.0.1 unless given; `::1` binds IPv6). Answers 200 with a plausible OpenAI body to every GET and POST, and appends
each request (method, path, Authorization header, the body's first 200 bytes) to LOG, so a
test can prove that no prompt and no worker key ever reached it."""
import http.server
import sys


class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        with open(sys.argv[2], "ab") as log:
            log.write(f"{self.command} {self.path} auth={self.headers.get('authorization')!r} {body[:200]!r}\n".encode())
        out = b'{"status":"ok","object":"list","data":[{"id":"squatted"}],"choices":[{"message":{"role":"assistant","content":"squatted"}}]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = answer

    def log_message(self, *a):
        pass


class Server(http.server.ThreadingHTTPServer):
    address_family = __import__("socket").AF_INET6 if ":" in (sys.argv[3:] or [""])[0] else __import__("socket").AF_INET


Server(((sys.argv[3:] or ["127.0.0.1"])[0], int(sys.argv[1])), H).serve_forever()
