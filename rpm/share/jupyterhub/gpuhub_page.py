"""The gpuhub page in JupyterHub: a JupyterHub service (signed in through the hub's OAuth, no
login of its own) that shows the signed-in user their running Slurm jobs with GPU utilisation
and VRAM per GPU or shard, their GPU-hours this month, the models with their state and the
names they may call, and their gateway keys (create, revoke). Hub admins see every user.

Shipped by gpuhub in /usr/share/gpuhub/jupyterhub/; jupyterhub_config.py there runs it as a
managed service (`/services/gpuhub/`). Plain server-rendered HTML, no JavaScript.

Identity: the page runs as root and asks the agent through the real `gpuhub` CLI *as the
signed-in user* (`runuser -u USER -- gpuhub ...`), so the agent names the caller from the
control socket (SO_PEERCRED) exactly as for that user's own shell: they see their own jobs and
keys, and a key they create here is bound by their allow-list, limits and
gateway.keys_per_user. Only hub admins' requests run as root (every user's data).

Environment: JUPYTERHUB_SERVICE_URL (set by the hub), GPUHUB_CLI (default /usr/bin/gpuhub),
GPUHUB_SOCKET (default /run/gpuhub/agent.sock).
"""

import datetime
import hashlib
import hmac
import html
import json
import os
import secrets
import subprocess
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import ioloop, web

CLI = os.environ.get("GPUHUB_CLI", "/usr/bin/gpuhub")
SOCKET = os.environ.get("GPUHUB_SOCKET", "/run/gpuhub/agent.sock")
PREFIX = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpuhub/")
# Signs each user's form token (a forged form from another site cannot revoke a key).
FORM_SECRET = secrets.token_bytes(32)


def gpuhub(user, *args):
    """(exit code, stdout, stderr) of `gpuhub ARGS` run as `user` (None: as root, for admins)."""
    cmd = [CLI, "--socket", SOCKET, *args]
    if user is not None:
        cmd = ["runuser", "-u", user, "--", *cmd]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, "", f"running gpuhub failed: {e}"
    return p.returncode, p.stdout, p.stderr.strip().removeprefix("gpuhub: error: ")


def gpuhub_json(user, *args):
    rc, out, err = gpuhub(user, *args, "--json")
    if rc != 0:
        return None, err or f"gpuhub {' '.join(args)} failed (exit {rc})"
    try:
        return json.loads(out), None
    except ValueError:
        return None, f"gpuhub {' '.join(args)} printed no JSON"


def running_jobs(user):
    """Slurm's running jobs of `user` (None: everyone's): [(job id, user, name, partition, gres)]."""
    cmd = ["squeue", "-h", "-t", "R", "-o", "%i|%u|%j|%P|%b"]
    if user is not None:
        cmd += ["-u", user]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"squeue failed: {e}"
    if p.returncode != 0:
        return None, f"squeue failed: {p.stderr.strip()}"
    return [line.split("|", 4) for line in p.stdout.splitlines() if line.count("|") == 4], None


def month_since(now=None):
    """Seconds since 00:00 UTC on the 1st of this month, as a gpuhub --since value."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    first = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return f"{max(1, int((now - first).total_seconds()))}s"


def e(value):
    return html.escape("" if value is None else str(value))


def table(headers, rows):
    if not rows:
        return "<p><em>none</em></p>"
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def gib(n):
    return f"{n / 2**30:.1f} GiB" if isinstance(n, (int, float)) else "-"


def num(n):
    return isinstance(n, (int, float)) and not isinstance(n, bool)


def hours(h):
    return f"{h:.1f}" if num(h) else "-"


def utc(s):
    return datetime.datetime.fromtimestamp(s, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC") if num(s) else ""


def quota_state(q):
    if q.get("held"):
        return "used up: new GPU jobs wait (running ones go on)"
    return "ok" if (q.get("percent") or 0) < 80 else "nearly used up"


def gpu_line(g):
    """One GPU of a job: the agent's last sample (`current`, running jobs) and the job's mean and peak."""
    cur = g.get("current")
    if isinstance(cur, dict) and num(cur.get("util")):
        now = f"now {cur['util']:.0f} % util, {gib(cur.get('vram_bytes'))} VRAM"
    else:
        now = "now: no sample (no GPU telemetry for this job)"
    mean = f"{g['mean_util']:.1f} %" if num(g.get("mean_util")) else "-"
    shards = f" ({g['shards']} shards)" if g.get("shards") else ""
    return f"GPU {g.get('index')}{shards}: {now}; mean {mean}, peak {gib(g.get('peak_vram_bytes'))}"


class PageHandler(HubOAuthenticated, web.RequestHandler):
    def form_token(self, name):
        return hmac.new(FORM_SECRET, name.encode(), hashlib.sha256).hexdigest()

    def who(self):
        """(user name, as whom the CLI runs: the user, or None for admins)."""
        model = self.get_current_user()
        return model["name"], (None if model.get("admin") else model["name"])

    @web.authenticated
    def get(self):
        name, run_as = self.who()
        self.render_page(name, run_as, self.get_argument("msg", ""))

    @web.authenticated
    def post(self):
        name, run_as = self.who()
        if not hmac.compare_digest(self.get_body_argument("token", ""), self.form_token(name)):
            raise web.HTTPError(403, "the form is stale or not from this page; reload the page and try again")
        action = self.get_body_argument("action", "")
        if action == "create":
            app = self.get_body_argument("app", "").strip()
            # `--app=VALUE` and `--` below: a form value starting with `-` stays a value.
            args = ["keys", "create", f"--app={app}", "--json"]
            if run_as is None:  # an admin creates for themselves here, as the page is theirs
                args += ["--user", name]
            rc, out, err = gpuhub(run_as, *args)
            if rc == 0:
                k = json.loads(out)
                msg = f"key {k['id']} for {k['user']}/{k['app']} created; copy it now, it is shown only once: {k['key']}"
            else:
                msg = f"the key was not created: {err}"
        elif action == "revoke":
            kid = self.get_body_argument("id", "")
            rc, out, err = gpuhub(run_as, "keys", "revoke", "--", kid)
            msg = out.strip() if rc == 0 else f"the key was not revoked: {err}"
        else:
            raise web.HTTPError(400, "unknown action")
        # The page itself, not a redirect, so a new key is not put in a URL.
        self.render_page(name, run_as, msg)

    def render_page(self, name, run_as, msg):
        parts = [f"<h1>gpuhub: {e(name)}</h1>"]
        if run_as is None:
            parts.append("<p>You are a hub admin: you see every user.</p>")
        if msg:
            parts.append(f'<p class="msg">{e(msg)}</p>')

        jobs, err = running_jobs(run_as)
        parts.append("<h2>Running jobs</h2>")
        if err:
            parts.append(f"<p>{e(err)}</p>")
        else:
            rows = []
            for job_id, user, jname, partition, gres in jobs:
                detail, _ = gpuhub_json(run_as, "job", job_id)
                node = (detail or {}).get("nodes", [{}])[0] if detail else {}
                gpus = "<br>".join(e(gpu_line(g)) for g in node.get("gpus", [])) or "-"
                shards = node.get("shards") or 0
                rows.append([e(job_id), e(user), e(jname), e(partition), e(gres),
                             e(f"{shards} shards" if shards else f"{node.get('gpu_count', 0)} GPUs"), gpus])
            parts.append(table(["job", "user", "name", "partition", "gres", "billed",
                                "per GPU: utilisation and VRAM now (job mean, peak)"], rows))

        usage, err = gpuhub_json(run_as, "usage", "--since", month_since())
        parts.append("<h2>GPU-hours this month and quota</h2>")
        if err:
            parts.append(f"<p>{e(err)}</p>")
        else:
            rows = [[e(r.get("key")), e(r.get("jobs")), e(f"{r.get('gpu_equivalent_seconds', 0) / 3600:.2f}"),
                     e(f"{r.get('gpu_seconds', 0) / 3600:.2f}"), e(f"{r.get('shard_seconds', 0) / 3600:.2f}")]
                    for r in usage.get("rows", [])]
            parts.append(table(["user", "jobs", "GPU-equivalent hours", "GPU-hours", "shard-hours"], rows))
        quota, err = gpuhub_json(run_as, "quota")
        if err:
            parts.append(f"<p>quota: {e(err)}</p>")
        elif not quota.get("quotas"):
            parts.append("<p>No GPU-hour quota covers you.</p>" if run_as else "<p>No GPU-hour quota is set.</p>")
        else:
            rows = [[e(q.get("quota")), e(q.get("period")), e(hours(q.get("used_gpu_hours"))), e(hours(q.get("limit_gpu_hours"))),
                     e(f"{q.get('percent', 0):.0f} %"), e(quota_state(q)), e(utc(q.get("resets_s")) or "rolling"),
                     e(hours(q.get("forecast_gpu_hours")))]
                    for q in quota["quotas"]]
            parts.append("<h3>Quota" + ("s" if run_as is None else "") + "</h3>"
                         + table(["quota", "period", "used GPU-hours", "limit", "used", "state", "resets", "forecast"], rows))

        models, err = gpuhub_json(run_as, "models", "list")
        parts.append("<h2>Models</h2>")
        if err:
            parts.append(f"<p>{e(err)}</p>")
        else:
            rows = [[e(m.get("name")), e(m.get("state")), e(", ".join(m.get("aliases") or []) or "-")] for m in models.get("models", [])]
            parts.append(table(["model", "state", "aliases"], rows))
        names, err = gpuhub_json(run_as, "names", "list")
        if err:
            parts.append(f"<p>names: {e(err)}</p>")
        else:
            rows = []
            for n in names.get("names", []):
                if n.get("kind") == "unknown":  # a name callers tried that does not exist
                    continue
                state = n.get("state", "")
                if state in ("deprecated", "retired"):
                    flag = f"{state.upper()}: use {n.get('replacement') or '(ask the admins)'} instead"
                    if n.get("sunset"):
                        flag += f"; {'removed' if state == 'deprecated' else 'retired'} on {n['sunset']}"
                else:
                    flag = state
                rows.append([e(n.get("name")), e(n.get("kind")), e(n.get("serves") or "-"), e(flag)])
            parts.append("<h3>Names you may call</h3>" + table(["name", "kind", "serves", "state"], rows))

        keys, err = gpuhub_json(run_as, "keys", "list")
        parts.append("<h2>Gateway keys</h2>")
        token = self.form_token(name)
        xsrf = self.xsrf_form_html()  # JupyterHub's own check on POSTs (HubOAuth), beside our token
        if err:
            parts.append(f"<p>{e(err)}</p>")
        else:
            rows = []
            for k in keys.get("keys", []):
                if k.get("revoked_us") is None:
                    state = (f'active <form method="post">{xsrf}<input type="hidden" name="token" value="{e(token)}">'
                             f'<input type="hidden" name="action" value="revoke"><input type="hidden" name="id" value="{e(k.get("id"))}">'
                             '<button>revoke</button></form>')
                else:
                    state = "revoked"
                rows.append([e(k.get("id")), e(k.get("user")), e(k.get("app")), e(",".join(k.get("models") or []) or "*"), state])
            parts.append(table(["id", "user", "app", "models", "state"], rows))
        parts.append(f'<form method="post">{xsrf}<input type="hidden" name="token" value="{e(token)}">'
                     '<input type="hidden" name="action" value="create">'
                     '<label>New key for app <input name="app" required pattern="[A-Za-z0-9._@-]{1,64}"></label> '
                     '<button>create</button></form>')
        style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
                 "padding:.3em .6em;text-align:left}.msg{background:#ffd;padding:.5em}form{display:inline}")
        self.set_header("Cache-Control", "no-store")  # a new key is on the page once
        self.set_header("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'")
        self.write(f"<!doctype html><html><head><meta charset=utf-8><title>gpuhub</title><style>{style}</style></head>"
                   f"<body>{''.join(parts)}</body></html>")


def main():
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app = web.Application(
        [(PREFIX, PageHandler), (url_path_join(PREFIX, "oauth_callback"), HubOAuthCallbackHandler)],
        cookie_secret=secrets.token_bytes(32),
    )
    app.listen(url.port, url.hostname)
    ioloop.IOLoop.current().start()


if __name__ == "__main__":
    main()
