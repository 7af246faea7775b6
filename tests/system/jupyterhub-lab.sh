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
# The hub's setup (the lab's overrides of the shipped config) is tests/lib/jupyterhub.sh.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
lab_user
. "$(dirname "$0")/../lib/jupyterhub.sh"
jh_start
BOB_KEY=""
revoke_bob() { [ -z "$BOB_KEY" ] || "$JH_GPUHUB" keys revoke "$BOB_KEY" >/dev/null 2>&1 || true; }
lab_cleanup_add revoke_bob

refused() {
    local s; s="$(jh_login "$1" "$2" "${3:-}")"
    [ "$s" = 403 ] && grep -qF "$4" "$JH_T/page" || jh_fail "$5: got $s, expected a 403 page saying '$4': $(sed 's/<[^>]*>//g' "$JH_T/page" | tr -s ' \n' ' ' | head -c 600)"
    echo "   refused ($5): $(grep -oF "$4" "$JH_T/page" | head -n1)..."
}
refused 127.0.0.2 mallory@elsewhere.net "$JH_SECRET" "mallory@elsewhere.net has no account on this hub" "an unmapped e-mail"
refused 127.0.0.2 nosuchuser@example.org "$JH_SECRET" "there is no user \`nosuchuser\` on this node" "a domain address without a Unix user"
refused 127.0.0.3 lab.user@example.org "$JH_SECRET" "(it came from 127.0.0.3); open the hub through the site" "a header from an untrusted peer"
refused 127.0.0.2 lab.user@example.org "" "came without the single sign-on proxy" "a header without the secret"
refused 127.0.0.2 lab.user@example.org "wrong-$JH_SECRET" "came without the single sign-on proxy" "a wrong secret"
rm -f "$JH_T/jar"

echo "+ in headless Chromium: sign in through the edge, spawn 'About half a GPU (7 shards)', run a cell in JupyterLab, open the gpuhub page"
CELL='import json, os, urllib.request
for k in ("OPENAI_BASE_URL", "SLURM_JOB_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TAGS", "OCR_MODEL"):
    print(k + "=" + os.environ.get(k, "(unset)"))
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models", headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
with urllib.request.urlopen(req, timeout=30) as r:
    print("GATEWAY", r.status, "models:", ",".join(m["id"] for m in json.load(r)["data"]))'
SHOTS="$LAB_REPO/target/test-logs"; mkdir -p "$SHOTS"
rm -f "$SHOTS"/jupyterhub-*.png
"$JH_VENV/bin/python" "$LAB_REPO/tests/lib/jupyterhub_browser.py" "$JH_PUB" "$JH_U" lab.user@example.org "$JH_T/sso-secret" \
    "$SHOTS" "About half a GPU (7 shards)" "$CELL" >"$JH_T/browser.out" 2>&1 || { cat "$JH_T/browser.out" >&2; jh_fail "the browser run failed (above; screenshot in $SHOTS)"; }
grep '^STEP' "$JH_T/browser.out" | sed 's/^/   /'
OUT="$(sed -n '/^OUTPUT:$/,/^STEP the gpuhub page$/p' "$JH_T/browser.out")"
sed 's/^/  | /' <<<"$OUT"
JOB="$(sed -n 's/^SLURM_JOB_ID=//p' <<<"$OUT")"
[ -n "$JOB" ] || jh_fail "the kernel runs in no Slurm job (no SLURM_JOB_ID)"
lab_run scontrol show job "$JOB"
grep -qE "UserId=$JH_U\(" <<<"$LAB_OUT" && grep -qE "JobName=jupyterhub( |$)" <<<"$LAB_OUT" && grep -qE "Partition=interactive" <<<"$LAB_OUT" && grep -qE "(TresPerNode|TRES)=.*shard(:h200)?[:=]7" <<<"$LAB_OUT" ||
    jh_fail "job $JOB is not $JH_U's 7-shard jupyterhub job in partition interactive"
SNAP=/run/gpuhub/snapshot.json
grep -qx "OPENAI_BASE_URL=$(jq -r .gateway_url "$SNAP")/v1" <<<"$OUT" || jh_fail "the kernel's OPENAI_BASE_URL is not the gateway's"
grep -qx "MLFLOW_TRACKING_URI=$(jq -r .mlflow_tracking_uri "$SNAP")" <<<"$OUT" || jh_fail "the kernel's MLFLOW_TRACKING_URI is not the snapshot's"
grep -q '^MLFLOW_EXPERIMENT_NAME=.' <<<"$OUT" || jh_fail "the kernel has no MLFLOW_EXPERIMENT_NAME"
sed -n 's/^MLFLOW_TAGS=//p' <<<"$OUT" | jq -e --arg j "$JOB" '.["slurm.job_id"] == $j and .["slurm.shards"] == "7"' >/dev/null ||
    jh_fail "the kernel's MLFLOW_TAGS do not carry slurm.job_id $JOB and slurm.shards 7"
grep -qx "OCR_MODEL=$(jq -r .roles.ocr "$SNAP")" <<<"$OUT" || jh_fail "the kernel's OCR_MODEL is not the role's model"
grep -q "^GATEWAY 200 models: ." <<<"$OUT" || jh_fail "the gateway did not answer the job's credential with models"
PAGE_TEXT="$(sed -n '/^PAGE:$/,$p' "$JH_T/browser.out")"
grep -q "gpuhub: $JH_U" <<<"$PAGE_TEXT" && grep -qP "^$JOB\t$JH_U\tjupyterhub\tinteractive\t.*\t7 shards\t" <<<"$PAGE_TEXT" ||
    jh_fail "the gpuhub page in the browser does not show $JH_U's job $JOB with 7 shards: $(head -c 800 <<<"$PAGE_TEXT")"
for f in jupyterhub-spawn-form.png jupyterhub-notebook.png jupyterhub-gpuhub-page.png; do
    [ "$(head -c 8 "$SHOTS/$f" | od -An -tx1 | tr -d ' ')" = 89504e470d0a1a0a ] || jh_fail "no PNG screenshot $SHOTS/$f"
done
echo "   screenshots: $SHOTS/jupyterhub-{spawn-form,notebook,gpuhub-page}.png"

S="$(jh_login 127.0.0.2 lab.user@example.org "$JH_SECRET")"
[ "$S" = 302 ] || jh_fail "sign-in as lab.user@example.org with curl (the page's key actions): got $S: $(head -c 400 "$JH_T/page")"

echo "+ the gpuhub page, signed in through the hub's OAuth"
S="$(jh_page)"; [ "$S" = 200 ] || jh_fail "GET /services/gpuhub/: $S $(jh_text | head -c 300)"
mkdir -p "$LAB_REPO/target/test-logs" && cp "$JH_T/gpage" "$LAB_REPO/target/test-logs/jupyterhub-gpuhub-page.html"
grep -q "gpuhub: $JH_U " <<<"$(jh_text)" || jh_fail "the page is not $JH_U's: $(jh_text | head -c 300)"
grep -q "GPU-hours this month" <<<"$(jh_text)" || jh_fail "the page has no GPU-hours"
S="$(jh_page create app=page-app)"; [ "$S" = 200 ] || jh_fail "creating a key on the page: $S"
PKEY="$(jh_text | grep -o 'shown only once: ghk_[0-9a-f]*' | sed 's/.*: //' || true)"; PID_="$(jh_text | grep -o 'key k[0-9a-f]* for' | head -n1 | awk '{print $2}' || true)"
[ -n "$PKEY" ] && [ -n "$PID_" ] || jh_fail "the page did not show the new key: $(jh_text | head -c 600)"
gw() { curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $1" http://127.0.0.1:8400/v1/models; }
[ "$(gw "$PKEY")" = 200 ] || jh_fail "the key made on the page ($PID_) does not work at the gateway"
"$JH_GPUHUB" keys list | grep -q "^$PID_ .* $JH_U .*page-app" || jh_fail "key $PID_ is not $JH_U's in gpuhub keys list"
BOB_KEY="$("$JH_GPUHUB" keys create --user bob --app x --json | jq -r .id)"
jh_page revoke "id=$BOB_KEY" >/dev/null
grep -q "the key was not revoked: key \`$BOB_KEY\` is not yours" <<<"$(jh_text)" || jh_fail "revoking another user's key on the page: $(jh_text | head -c 600)"
jh_page revoke "id=$PID_" >/dev/null
grep -q "key $PID_ .*revoked" <<<"$(jh_text)" || jh_fail "revoking $PID_ on the page: $(jh_text | head -c 600)"
[ "$(gw "$PKEY")" = 401 ] || jh_fail "key $PID_ still works after it was revoked on the page"
echo "   page: job $JOB with 7 shards; key $PID_ created (works), revoked (401); bob's key refused"

echo "+ the browser stopped the server: the Slurm job ends"
grep -q '^STEP stopped the server' "$JH_T/browser.out" || jh_fail "the browser did not stop the server"
lab_wait_job "$JOB" 60 || jh_fail "job $JOB still in the queue 60 s after the server was stopped"
for _ in $(seq 60); do
    "$JH_GPUHUB" job "$JOB" --json >"$JH_T/job.json" 2>/dev/null && [ "$(jq -r '.nodes[0].end_us // empty' "$JH_T/job.json")" != "" ] && break
    sleep 0.5
done
lab_run "$JH_GPUHUB" job "$JOB"
jq -e --arg u "$JH_U" '.nodes[0].user == $u and .nodes[0].shards == 7 and .nodes[0].gpu_seconds == 0' "$JH_T/job.json" >/dev/null ||
    jh_fail "gpuhub job $JOB does not bill 7 shards to $JH_U: $(cat "$JH_T/job.json")"
lab_node_ok
echo "PASS jupyterhub-lab"
