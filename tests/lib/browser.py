#!/usr/bin/env python3
"""A headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for the portal's
browser test (tests/system/jupyterhub-lab.sh). No Playwright and no browser download: the
protocol over tornado's websocket client (the JupyterHub venv has tornado).

    async with Browser(headers={...}) as b:     # starts chromium, one page
        await b.goto("http://127.0.0.1:8000/hub/login")
        await b.wait_for("document.querySelector('select')")
        await b.eval("...")                       # JavaScript in the page; returns its value
        await b.screenshot("page.png")

`headers` are sent with every request of the page (Network.setExtraHTTPHeaders); `edge`
(URL pattern, headers) adds headers only to the requests that match (the Fetch domain): the
test plays the SSO edge with it, which sends its sign-in headers to the hub's paths only. Chromium runs with a private profile directory, no sandbox (root), and is
killed (its whole process group) when the block ends. JavaScript dialogs (a page's "leave
this page?") are accepted.
"""
import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

CHROMIUM = os.environ.get("GPUHUB_CHROMIUM", "chromium")


class BrowserError(Exception):
    pass


class Browser:
    def __init__(self, headers=None, edge=None, width=1280, height=1600, timeout=30):
        self.headers = headers or {}
        # (URL pattern, headers): added to matching requests only (Fetch domain), as an edge
        # proxy adds its sign-in headers to some paths.
        self.edge = edge
        self.size = (width, height)
        self.timeout = timeout
        self.ids = itertools.count(1)
        self.proc = None
        self.profile = None
        self.ws = None
        self.pending = {}
        self.events = []
        self.reader = None

    async def __aenter__(self):
        exe = shutil.which(CHROMIUM)
        if not exe:
            raise BrowserError(f"`{CHROMIUM}` not found: apt-get install chromium (or set GPUHUB_CHROMIUM)")
        self.profile = tempfile.mkdtemp(prefix="gpuhub-chromium.")
        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking", "--disable-sync", "--mute-audio",
             f"--user-data-dir={self.profile}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
             f"--window-size={self.size[0]},{self.size[1]}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        url = await self._devtools_url()
        page = await self._page_ws(url)
        self.ws = await websocket_connect(HTTPRequest(page, connect_timeout=self.timeout), max_message_size=256 << 20)
        self.reader = asyncio.ensure_future(self._read())
        await self.send("Page.enable")
        await self.send("Runtime.enable")
        await self.send("Network.enable")
        if self.headers:
            await self.send("Network.setExtraHTTPHeaders", headers=self.headers)
        if self.edge:
            await self.send("Fetch.enable", patterns=[{"urlPattern": self.edge[0], "requestStage": "Request"}])
        return self

    async def __aexit__(self, *exc):
        if self.reader:
            self.reader.cancel()
        if self.ws:
            self.ws.close()
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc:
            # Its renderer and GPU processes leave a moment after the browser: wait for the
            # whole group (it is the browser's session), then kill what is left.
            for _ in range(50):
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.1)
            else:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.profile:
            shutil.rmtree(self.profile, ignore_errors=True)

    async def _devtools_url(self):
        """The browser's DevTools port, from the DevToolsActivePort file of the profile."""
        path = os.path.join(self.profile, "DevToolsActivePort")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while loop.time() < deadline:
            if self.proc.poll() is not None:
                raise BrowserError(f"chromium exited ({self.proc.returncode}): {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            try:
                port = open(path).read().split("\n")[0].strip()
                if port:
                    return f"http://127.0.0.1:{port}"
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise BrowserError(f"chromium wrote no {path} within {self.timeout} s")

    async def _page_ws(self, base):
        from tornado.httpclient import AsyncHTTPClient
        r = await AsyncHTTPClient().fetch(base + "/json/list", request_timeout=self.timeout)
        pages = [t for t in json.loads(r.body) if t.get("type") == "page"]
        if not pages:
            raise BrowserError("chromium has no page target")
        return pages[0]["webSocketDebuggerUrl"]

    async def _read(self):
        while True:
            raw = await self.ws.read_message()
            if raw is None:
                for f in self.pending.values():
                    if not f.done():
                        f.set_exception(BrowserError("the DevTools connection closed"))
                return
            m = json.loads(raw)
            if "id" in m and m["id"] in self.pending:
                self.pending.pop(m["id"]).set_result(m)
            elif m.get("method") == "Fetch.requestPaused":
                p = m["params"]
                headers = {**p["request"].get("headers", {}), **self.edge[1]}
                asyncio.ensure_future(self._continue(p["requestId"], headers))
            elif m.get("method") == "Page.javascriptDialogOpening":
                # JupyterLab's "leave the page?" (beforeunload) would block the next navigation
                # and every command after it: leaving is what the test means.
                asyncio.ensure_future(self._quietly("Page.handleJavaScriptDialog", accept=True))
            elif "method" in m:
                self.events.append(m)

    async def _continue(self, request_id, headers):
        await self._quietly("Fetch.continueRequest", requestId=request_id,
                            headers=[{"name": k, "value": v} for k, v in headers.items()])

    async def _quietly(self, method, **params):
        try:
            await self.send(method, **params)
        except (BrowserError, asyncio.TimeoutError):
            pass  # the page went away meanwhile

    async def send(self, method, **params):
        i = next(self.ids)
        f = asyncio.get_running_loop().create_future()
        self.pending[i] = f
        await self.ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
        m = await asyncio.wait_for(f, self.timeout)
        if "error" in m:
            raise BrowserError(f"{method}: {m['error'].get('message')}")
        return m.get("result", {})

    async def eval(self, expression):
        """Evaluates JavaScript in the page (promises awaited); returns its value."""
        r = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(f"{expression[:80]!r}: {d.get('exception', {}).get('description') or d.get('text')}")
        return r.get("result", {}).get("value")

    async def goto(self, url):
        r = await self.send("Page.navigate", url=url)
        if r.get("errorText"):
            raise BrowserError(f"cannot open {url}: {r['errorText']}")
        await self.wait_for("document.readyState === 'complete'")

    async def wait_for(self, expression, timeout=None, what=None):
        """Waits until `expression` is truthy in the page (it may navigate meanwhile)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout or self.timeout)
        last = None
        while loop.time() < deadline:
            try:
                value = await self.eval(expression)
                if value:
                    return value
            except BrowserError as e:  # the page is navigating
                last = e
            await asyncio.sleep(0.25)
        raise BrowserError(f"waited {timeout or self.timeout} s for {what or expression!r} on {await self.url()}" + (f" ({last})" if last else ""))

    async def url(self):
        try:
            return await self.eval("location.href")
        except BrowserError:
            return "(navigating)"

    async def text(self):
        return await self.eval("document.body ? document.body.innerText : ''")

    async def key(self, key, code, modifiers=0):
        """Presses a key in the focused element (modifiers: 1 Alt, 2 Ctrl, 4 Meta, 8 Shift)."""
        for kind in ("rawKeyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", type=kind, key=key, code=code, modifiers=modifiers,
                            windowsVirtualKeyCode=13 if key == "Enter" else 0)

    async def screenshot(self, path):
        r = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(r["data"])
        with open(path, "wb") as f:
            f.write(data)
        return len(data)
