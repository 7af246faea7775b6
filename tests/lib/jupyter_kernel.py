#!/usr/bin/env python3
"""Runs CODE in a new kernel of a Jupyter server through Jupyter's REST and websocket kernel
API, prints what the kernel printed, and deletes the kernel. Exit 1 if the code raised.

usage: jupyter_kernel.py SERVER_URL TOKEN CODE   (SERVER_URL e.g. http://127.0.0.1:8000/user/alice/)
Needs tornado (the hub's venv has it)."""
import asyncio
import json
import sys
import uuid

from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.websocket import websocket_connect


async def main(base, token, code):
    base = base.rstrip("/") + "/"
    auth = {"Authorization": f"token {token}"}
    http = AsyncHTTPClient()
    r = await http.fetch(HTTPRequest(base + "api/kernels", method="POST", headers=auth, body="{}", request_timeout=60))
    kernel = json.loads(r.body)["id"]
    failed = True
    try:
        ws = await websocket_connect(HTTPRequest(base.replace("http", "ws", 1) + f"api/kernels/{kernel}/channels", headers=auth, connect_timeout=30))
        msg_id = uuid.uuid4().hex
        ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex, "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {}, "allow_stdin": False},
        }))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        # Done when both the reply (shell) and the kernel's `idle` (iopub) for this cell came: the
        # reply may overtake the cell's output on the other channel.
        replied = idle = False
        while not (replied and idle):
            raw = await asyncio.wait_for(ws.read_message(), max(1, deadline - loop.time()))
            if raw is None:
                raise SystemExit("the kernel's websocket closed before the cell finished")
            m = json.loads(raw)
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = m["header"]["msg_type"]
            if kind == "stream":
                sys.stdout.write(m["content"]["text"])
            elif kind == "error":
                sys.stdout.write("\n".join(m["content"]["traceback"]) + "\n")
            elif kind == "execute_reply":
                failed = m["content"]["status"] != "ok"
                replied = True
            elif kind == "status" and m["content"].get("execution_state") == "idle":
                idle = True
        ws.close()
    finally:
        await http.fetch(HTTPRequest(base + f"api/kernels/{kernel}", method="DELETE", headers=auth, request_timeout=30), raise_error=False)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
