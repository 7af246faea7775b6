#!/usr/bin/env bash
# timeout: 240
# Issue 19: JupyterHub on the lab, for real, with the shipped rpm/share/jupyterhub config
# (ProfilesSpawner + batchspawner.SlurmSpawner, GpuhubSSOAuthenticator) behind
# configurable-http-proxy (tests/setup/jupyterhub.sh installs them, and Debian's chromium):
#   - curl plays the edge proxy from 127.0.0.2: an unmapped e-mail, a mapped one from an
#     untrusted peer (127.0.0.3) and one without the secret are refused with a page that says why;
#   - headless Chromium (tests/lib/jupyterhub_browser.py, the DevTools protocol) signs in through
#     the edge's header, picks "About half a GPU (7 shards)" in the spawn form (a real Slurm job
#     with --gres=shard:7 as the lab's unprivileged user), runs a JupyterLab cell that prints
#     OPENAI_BASE_URL, MLFLOW_* and OCR_MODEL and calls the gateway with the injected
#     OPENAI_API_KEY (the job's credential: answered), opens the gpuhub page (the shipped
#     JupyterHub service, through the hub's OAuth: it shows the job with its 7 shards) and stops
#     the server from the hub's home page; screenshots in target/test-logs/jupyterhub-*.png;
#   - on the gpuhub page (curl, signed in through the hub's OAuth) a key created there works at
#     the gateway and stops working once revoked there; another user's key cannot be revoked;
#   - the stopped server's Slurm job ends, and `gpuhub job` bills its 7 shards to the user.
# Overrides of the shipped config, for the lab only: ports, state paths, the secret file, the
# user table, PATH of the job (the venv), the profiles' memory (the lab node has 16 GB) and the
# notebook's host (the lab node's name gpu01 does not resolve; it is 127.0.0.1).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
lab_user
agent_healthy || lab_fail "gpuhub-agent is not answering http://127.0.0.1:8400/healthz; run tests/lab/up.sh"
VENV=/opt/gpuhub-lab/jupyterhub
[ -x "$VENV/bin/jupyterhub" ] && [ -x "$VENV/bin/configurable-http-proxy" ] ||
    prereq_missing "JupyterHub is not installed in $VENV" "run tests/setup/jupyterhub.sh" || exit 0
GPUHUB="$LAB_REPO/target/release/gpuhub"
U="$LAB_USER"
unprivileged_exec_check "$U" "$GPUHUB"
T="$(mktemp -d /tmp/gpuhub-jhub.XXXXXX)"
port() { python3 "$LAB_REPO/tests/lib/free_port.py"; }
PUB="$(port)"; API="$(port)"; HUB="$(port)"; PAGE="$(port)"
SECRET="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
(umask 077; echo "$SECRET" >"$T/sso-secret")
HUB_PID=""
cleanup() {
    if [ -n "$HUB_PID" ] && kill -0 "$HUB_PID" 2>/dev/null; then
        kill -TERM "$HUB_PID"
        for _ in $(seq 150); do kill -0 "$HUB_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$HUB_PID" 2>/dev/null || true
    fi
    # A notebook job the hub did not stop (a failed run) must not outlive the test.
    local jobs; jobs="$(squeue -h -u "$U" -n jupyterhub -o %i 2>/dev/null || true)"
    [ -z "$jobs" ] || lab_cancel $jobs
    # The proxy the hub started (the hub stops it on SIGTERM; not after a kill -9).
    local chp; chp="$(cat "$T/jupyterhub-proxy.pid" 2>/dev/null || true)"
    [ -z "$chp" ] || kill "$chp" 2>/dev/null || true
    [ -z "${BOB_KEY:-}" ] || "$GPUHUB" keys revoke "$BOB_KEY" >/dev/null 2>&1 || true
    [ -n "${GPUHUB_KEEP:-}" ] || rm -rf "$T"
}
lab_cleanup_add cleanup
fail() { echo "--- hub log (tail)" >&2; tail -n 40 "$T/hub.log" >&2 || true; lab_fail "$@"; }

cat >"$T/jupyterhub_config.py" <<PY
c = get_config()  # noqa: F821
load_subconfig("$LAB_REPO/rpm/share/jupyterhub/jupyterhub_config.py")  # noqa: F821 (the shipped file)
c.JupyterHub.bind_url = "http://127.0.0.1:$PUB"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:$HUB"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:$API"
c.ConfigurableHTTPProxy.command = ["$VENV/bin/configurable-http-proxy"]
c.JupyterHub.db_url = "sqlite:///$T/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "$T/cookie_secret"
c.GpuhubSSOAuthenticator.shared_secret_file = "$T/sso-secret"
c.GpuhubSSOAuthenticator.trusted_proxies = ["127.0.0.1", "127.0.0.2"]
c.GpuhubSSOAuthenticator.user_map = {"lab.user@example.org": "$U"}
c.GpuhubSSOAuthenticator.local_part_domains = ["example.org"]
c.SlurmSpawner.req_prologue = "export PATH=$VENV/bin:\$PATH"
c.SlurmSpawner.state_exechost_exp = "127.0.0.1"
c.Spawner.start_timeout = 120
c.ProfilesSpawner.profiles = [(l, k, cls, dict(o, req_memory="1G", req_nprocs="1")) for (l, k, cls, o) in c.ProfilesSpawner.profiles]
for s in c.JupyterHub.services:  # the gpuhub page: a free port, the lab's CLI
    if s["name"] == "gpuhub":
        s["url"] = "http://127.0.0.1:$PAGE"
        s["environment"] = {"GPUHUB_CLI": "$GPUHUB"}
c.JupyterHub.services.append({"name": "gpuhub-lab-test", "api_token": "$TOKEN"})
c.JupyterHub.load_roles.append({"name": "gpuhub-lab-test", "services": ["gpuhub-lab-test"],
                                "scopes": ["admin:users", "admin:servers", "access:servers"]})
PY
echo "+ jupyterhub (shipped config + lab overrides) on 127.0.0.1:$PUB"
(cd "$T" && PATH="$VENV/bin:$PATH" GPUHUB_JUPYTERHUB_DIR="$LAB_REPO/rpm/share/jupyterhub" \
    exec "$VENV/bin/jupyterhub" -f "$T/jupyterhub_config.py" >"$T/hub.log" 2>&1) &
HUB_PID=$!
for _ in $(seq 150); do curl -sf "http://127.0.0.1:$PUB/hub/health" >/dev/null 2>&1 && break; kill -0 "$HUB_PID" 2>/dev/null || fail "jupyterhub exited"; sleep 0.2; done
curl -sf "http://127.0.0.1:$PUB/hub/health" >/dev/null || fail "jupyterhub did not answer within 30 s"

# login FROM EMAIL [SECRET]: GET /hub/login as the edge would send it, from address FROM;
# the status; the page in $T/page, cookies in $T/jar.
login() {
    local args=(-s -o "$T/page" -w '%{http_code}' --interface "$1" -c "$T/jar" -b "$T/jar" -H "X-Auth-Request-Email: $2")
    [ -z "${3:-}" ] || args+=(-H "X-Gpuhub-Proxy-Secret: $3")
    curl "${args[@]}" "http://127.0.0.1:$PUB/hub/login"
}
refused() {
    local s; s="$(login "$1" "$2" "${3:-}")"
    [ "$s" = 403 ] && grep -qF "$4" "$T/page" || fail "$5: got $s, expected a 403 page saying '$4': $(sed 's/<[^>]*>//g' "$T/page" | tr -s ' \n' ' ' | head -c 600)"
    echo "   refused ($5): $(grep -oF "$4" "$T/page" | head -n1)..."
}
refused 127.0.0.2 mallory@elsewhere.net "$SECRET" "mallory@elsewhere.net has no account on this hub" "an unmapped e-mail"
refused 127.0.0.2 nosuchuser@example.org "$SECRET" "there is no user \`nosuchuser\` on this node" "a domain address without a Unix user"
refused 127.0.0.3 lab.user@example.org "$SECRET" "(it came from 127.0.0.3); open the hub through the site" "a header from an untrusted peer"
refused 127.0.0.2 lab.user@example.org "" "came without the single sign-on proxy" "a header without the secret"
refused 127.0.0.2 lab.user@example.org "wrong-$SECRET" "came without the single sign-on proxy" "a wrong secret"
rm -f "$T/jar"

echo "+ in headless Chromium: sign in through the edge, spawn 'About half a GPU (7 shards)', run a cell in JupyterLab, open the gpuhub page"
CELL='import json, os, urllib.request
for k in ("OPENAI_BASE_URL", "SLURM_JOB_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TAGS", "OCR_MODEL"):
    print(k + "=" + os.environ.get(k, "(unset)"))
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models", headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
with urllib.request.urlopen(req, timeout=30) as r:
    print("GATEWAY", r.status, "models:", ",".join(m["id"] for m in json.load(r)["data"]))'
SHOTS="$LAB_REPO/target/test-logs"; mkdir -p "$SHOTS"
rm -f "$SHOTS"/jupyterhub-*.png
"$VENV/bin/python" "$LAB_REPO/tests/lib/jupyterhub_browser.py" "http://127.0.0.1:$PUB" "$U" lab.user@example.org "$T/sso-secret" \
    "$SHOTS" "About half a GPU (7 shards)" "$CELL" >"$T/browser.out" 2>&1 || { cat "$T/browser.out" >&2; fail "the browser run failed (above; screenshot in $SHOTS)"; }
grep '^STEP' "$T/browser.out" | sed 's/^/   /'
OUT="$(sed -n '/^OUTPUT:$/,/^STEP the gpuhub page$/p' "$T/browser.out")"
sed 's/^/  | /' <<<"$OUT"
JOB="$(sed -n 's/^SLURM_JOB_ID=//p' <<<"$OUT")"
[ -n "$JOB" ] || fail "the kernel runs in no Slurm job (no SLURM_JOB_ID)"
lab_run scontrol show job "$JOB"
grep -qE "UserId=$U\(" <<<"$LAB_OUT" && grep -qE "JobName=jupyterhub( |$)" <<<"$LAB_OUT" && grep -qE "Partition=interactive" <<<"$LAB_OUT" && grep -qE "(TresPerNode|TRES)=.*shard(:h200)?[:=]7" <<<"$LAB_OUT" ||
    fail "job $JOB is not $U's 7-shard jupyterhub job in partition interactive"
SNAP=/run/gpuhub/snapshot.json
grep -qx "OPENAI_BASE_URL=$(jq -r .gateway_url "$SNAP")/v1" <<<"$OUT" || fail "the kernel's OPENAI_BASE_URL is not the gateway's"
grep -qx "MLFLOW_TRACKING_URI=$(jq -r .mlflow_tracking_uri "$SNAP")" <<<"$OUT" || fail "the kernel's MLFLOW_TRACKING_URI is not the snapshot's"
grep -q '^MLFLOW_EXPERIMENT_NAME=.' <<<"$OUT" || fail "the kernel has no MLFLOW_EXPERIMENT_NAME"
sed -n 's/^MLFLOW_TAGS=//p' <<<"$OUT" | jq -e --arg j "$JOB" '.["slurm.job_id"] == $j and .["slurm.shards"] == "7"' >/dev/null ||
    fail "the kernel's MLFLOW_TAGS do not carry slurm.job_id $JOB and slurm.shards 7"
grep -qx "OCR_MODEL=$(jq -r .roles.ocr "$SNAP")" <<<"$OUT" || fail "the kernel's OCR_MODEL is not the role's model"
grep -q "^GATEWAY 200 models: ." <<<"$OUT" || fail "the gateway did not answer the job's credential with models"
PAGE_TEXT="$(sed -n '/^PAGE:$/,$p' "$T/browser.out")"
grep -q "gpuhub: $U" <<<"$PAGE_TEXT" && grep -qP "^$JOB\t$U\tjupyterhub\tinteractive\t.*\t7 shards\t" <<<"$PAGE_TEXT" ||
    fail "the gpuhub page in the browser does not show $U's job $JOB with 7 shards: $(head -c 800 <<<"$PAGE_TEXT")"
for f in jupyterhub-spawn-form.png jupyterhub-notebook.png jupyterhub-gpuhub-page.png; do
    [ "$(head -c 8 "$SHOTS/$f" | od -An -tx1 | tr -d ' ')" = 89504e470d0a1a0a ] || fail "no PNG screenshot $SHOTS/$f"
done
echo "   screenshots: $SHOTS/jupyterhub-{spawn-form,notebook,gpuhub-page}.png"

S="$(login 127.0.0.2 lab.user@example.org "$SECRET")"
[ "$S" = 302 ] || fail "sign-in as lab.user@example.org with curl (the page's key actions): got $S: $(head -c 400 "$T/page")"
api() { curl -s -H "Authorization: token $TOKEN" "$@"; }

echo "+ the gpuhub page, signed in through the hub's OAuth"
page() { # page [ACTION ARGS..]: GET, or POST ACTION with name=value ARGS; the page in $T/gpage
    local args=(-s -L -o "$T/gpage" -w '%{http_code}' -b "$T/jar" -c "$T/jar")
    if [ $# -gt 0 ]; then
        args+=(--data-urlencode "action=$1" --data-urlencode "token=$(field token)" --data-urlencode "_xsrf=$(field _xsrf)"); shift
        local kv; for kv in "$@"; do args+=(--data-urlencode "$kv"); done
    fi
    curl "${args[@]}" "http://127.0.0.1:$PUB/services/gpuhub/"
}
field() { grep -o "name=\"$1\" value=\"[^\"]*\"" "$T/gpage" | head -n1 | sed 's/.*value="//; s/"$//'; }
text() { sed 's/<[^>]*>/ /g' "$T/gpage" | tr -s ' \n' ' '; }
S="$(page)"; [ "$S" = 200 ] || fail "GET /services/gpuhub/: $S $(text | head -c 300)"
mkdir -p "$LAB_REPO/target/test-logs" && cp "$T/gpage" "$LAB_REPO/target/test-logs/jupyterhub-gpuhub-page.html"
grep -q "gpuhub: $U " <<<"$(text)" || fail "the page is not $U's: $(text | head -c 300)"
grep -q "GPU-hours this month" <<<"$(text)" || fail "the page has no GPU-hours"
S="$(page create app=page-app)"; [ "$S" = 200 ] || fail "creating a key on the page: $S"
PKEY="$(text | grep -o 'shown only once: ghk_[0-9a-f]*' | sed 's/.*: //' || true)"; PID_="$(text | grep -o 'key k[0-9a-f]* for' | head -n1 | awk '{print $2}' || true)"
[ -n "$PKEY" ] && [ -n "$PID_" ] || fail "the page did not show the new key: $(text | head -c 600)"
gw() { curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $1" http://127.0.0.1:8400/v1/models; }
[ "$(gw "$PKEY")" = 200 ] || fail "the key made on the page ($PID_) does not work at the gateway"
"$GPUHUB" keys list | grep -q "^$PID_ .* $U .*page-app" || fail "key $PID_ is not $U's in gpuhub keys list"
BOB_KEY="$("$GPUHUB" keys create --user bob --app x --json | jq -r .id)"
page revoke "id=$BOB_KEY" >/dev/null
grep -q "the key was not revoked: key \`$BOB_KEY\` is not yours" <<<"$(text)" || fail "revoking another user's key on the page: $(text | head -c 600)"
page revoke "id=$PID_" >/dev/null
grep -q "key $PID_ .*revoked" <<<"$(text)" || fail "revoking $PID_ on the page: $(text | head -c 600)"
[ "$(gw "$PKEY")" = 401 ] || fail "key $PID_ still works after it was revoked on the page"
echo "   page: job $JOB with 7 shards; key $PID_ created (works), revoked (401); bob's key refused"

echo "+ the browser stopped the server: the Slurm job ends"
grep -q '^STEP stopped the server' "$T/browser.out" || fail "the browser did not stop the server"
lab_wait_job "$JOB" 60 || fail "job $JOB still in the queue 60 s after the server was stopped"
for _ in $(seq 60); do
    "$GPUHUB" job "$JOB" --json >"$T/job.json" 2>/dev/null && [ "$(jq -r '.nodes[0].end_us // empty' "$T/job.json")" != "" ] && break
    sleep 0.5
done
lab_run "$GPUHUB" job "$JOB"
jq -e --arg u "$U" '.nodes[0].user == $u and .nodes[0].shards == 7 and .nodes[0].gpu_seconds == 0' "$T/job.json" >/dev/null ||
    fail "gpuhub job $JOB does not bill 7 shards to $U: $(cat "$T/job.json")"
lab_node_ok
echo "PASS jupyterhub-lab"
