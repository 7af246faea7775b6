#!/usr/bin/env python3
"""The portal as a user meets it, in headless Chromium (tests/lib/browser.py), for
tests/system/jupyterhub-lab.sh:

  1. opens the hub; the "edge" (the browser's request interception, on /hub/ paths only) sends
     the signed-in e-mail and the proxy secret, as the site's SSO proxy does;
  2. the spawn form: picks the profile labelled PROFILE and starts it (screenshot);
  3. waits for JupyterLab, opens a notebook holding CELL and runs it from the toolbar; prints
     the cell's output (screenshot);
  4. opens the gpuhub page (/services/gpuhub/, the hub's OAuth) and prints its text (screenshot);
  5. stops the server with the hub home page's "Stop My Server".

usage: jupyterhub_browser.py HUB_URL USER EMAIL SECRET_FILE OUT_DIR PROFILE CELL
Prints `STEP ...` lines, then `OUTPUT:` and the cell's output, then `PAGE:` and the page's
text. Exit 1 with the step that failed, its URL and the page's text.
"""
import asyncio
import json
import os
import sys
import urllib.parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from browser import Browser, BrowserError  # noqa: E402

NOTEBOOK = "gpuhub-portal-check.ipynb"


def js(s):
    return json.dumps(s)


async def main(hub, user, email, secret_file, out, profile, cell):
    hub = hub.rstrip("/")
    secret = open(secret_file).read().strip()
    edge = (f"{hub}/hub/*", {"X-Auth-Request-Email": email, "X-Gpuhub-Proxy-Secret": secret})
    step = "start chromium"
    async with Browser(edge=edge, timeout=30) as b:
        try:
            step = "sign in through the edge's header"
            await b.goto(f"{hub}/hub/spawn/{urllib.parse.quote(user)}")
            await b.wait_for("document.querySelector('select[name=profile], #profile-list, form select')", what="the spawn form")
            print(f"STEP signed in as {user}; spawn form at {await b.url()}", flush=True)
            await b.screenshot(os.path.join(out, "jupyterhub-spawn-form.png"))

            step = f"pick the profile {profile!r}"
            picked = await b.eval(f"""(() => {{
                const s = document.querySelector('select[name=profile]') || document.querySelector('form select');
                const o = [...s.options].find(o => o.text.trim().startsWith({js(profile)}));
                if (!o) return 'no option ' + [...s.options].map(o => o.text.trim()).join(' | ');
                s.value = o.value;
                const f = s.form; (f.requestSubmit ? f.requestSubmit() : f.submit());
                return 'ok ' + o.value;
            }})()""")
            if not str(picked).startswith("ok "):
                raise BrowserError(f"the spawn form has {picked}")
            print(f"STEP picked {profile!r} ({picked[3:]}) and started it", flush=True)

            step = "wait for JupyterLab (the Slurm job starts the notebook server)"
            await b.wait_for(f"location.pathname.startsWith({js('/user/' + user + '/')}) && !!document.querySelector('#jp-main-dock-panel')",
                             timeout=180, what="JupyterLab in the user's server")
            print(f"STEP JupyterLab at {await b.url()}", flush=True)

            step = "write the notebook (the server's contents API, the browser's session)"
            nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
                  "cells": [{"cell_type": "code", "id": "check", "metadata": {}, "execution_count": None, "outputs": [], "source": cell}]}
            status = await b.eval(f"""(async () => {{
                const xsrf = (document.cookie.match(/(?:^|; )_xsrf=([^;]*)/) || [])[1] || '';
                const r = await fetch({js('/user/' + user + '/api/contents/' + NOTEBOOK)}, {{method: 'PUT',
                    headers: {{'Content-Type': 'application/json', 'X-XSRFToken': decodeURIComponent(xsrf)}},
                    body: JSON.stringify({{type: 'notebook', format: 'json', content: {js(nb)}}})}});
                return r.status;
            }})()""")
            if status not in (200, 201):
                raise BrowserError(f"PUT the notebook: HTTP {status}")

            step = "open the notebook and run its cell"
            await b.goto(f"{hub}/user/{urllib.parse.quote(user)}/lab/tree/{NOTEBOOK}")
            await b.wait_for("!!document.querySelector('.jp-Notebook .jp-Cell .cm-content')", timeout=60, what="the notebook's cell")
            # JupyterLab asks which kernel to start (its "Select Kernel" dialog): Python 3.
            await asyncio.sleep(2)
            await b.eval("(() => { const d = document.querySelector('.jp-Dialog .jp-mod-accept'); if (d) d.click(); return true; })()")
            await b.wait_for("(() => { const s = document.querySelector('.jp-Notebook-ExecutionIndicator, .jp-KernelStatus'); "
                             "return !s || /idle/i.test(s.getAttribute('data-status') || s.textContent || 'idle'); })()",
                             timeout=60, what="an idle kernel")
            await b.eval("document.querySelector('.jp-Notebook .jp-Cell .cm-content').focus(); true")
            await b.key("Enter", "Enter", modifiers=8)  # Shift+Enter: run the cell
            text = await b.wait_for("(() => { const o = [...document.querySelectorAll('.jp-Notebook .jp-Cell .jp-OutputArea-output')]"
                                    ".map(e => e.innerText).join('\\n'); return /GATEWAY \\d+|Error|Traceback/.test(o) ? o : ''; })()",
                                    timeout=90, what="the cell's output")
            await b.screenshot(os.path.join(out, "jupyterhub-notebook.png"))
            print("STEP the cell ran", flush=True)
            print("OUTPUT:\n" + text.strip(), flush=True)

            step = "the gpuhub page (the hub's OAuth)"
            await b.goto(f"{hub}/services/gpuhub/")
            page = await b.wait_for("(() => { const t = document.body ? document.body.innerText : ''; return /gpuhub: /.test(t) ? t : ''; })()",
                                    timeout=60, what="the gpuhub page")
            await b.screenshot(os.path.join(out, "jupyterhub-gpuhub-page.png"))
            print("STEP the gpuhub page", flush=True)
            print("PAGE:\n" + page.strip(), flush=True)

            step = "stop the server from the hub's home page"
            await b.goto(f"{hub}/hub/home")
            await b.wait_for("!!document.querySelector('#stop')", what="the Stop My Server button")
            await b.eval("document.querySelector('#stop').click(); true")
            await b.wait_for("(() => { const s = document.querySelector('#stop'); return !s || s.offsetParent === null; })()",
                             timeout=90, what="the server stopped (its Stop button gone)")
            print("STEP stopped the server", flush=True)
        except (BrowserError, asyncio.TimeoutError) as e:
            try:
                await b.screenshot(os.path.join(out, "jupyterhub-browser-failed.png"))
                now = (await b.text())[:1500]
            except BrowserError:
                now = ""
            print(f"FAIL at '{step}': {e}\n  at {await b.url()}\n  page: {now}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) != 8:
        sys.exit(__doc__)
    asyncio.run(main(*sys.argv[1:8]))
