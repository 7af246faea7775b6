# JupyterHub on the lab with the shipped rpm/share/jupyterhub config, for tests/system/jupyterhub-*.sh
# (the setup of tests/system/jupyterhub-lab.sh, shared). Source it after tests/lib/lab.sh,
# `lab_require` and `lab_user`.
#
#   jh_start              temp dir $JH_T, free ports, the SSO secret, a hub API token; writes the
#                         lab overrides of the shipped config and starts the hub (stopped, with the
#                         user's notebook jobs, at exit). Sets JH_PUB (the hub's public URL),
#                         JH_SECRET, JH_TOKEN, JH_VENV, JH_GPUHUB (the CLI), JH_U (the lab user).
#   jh_fail MSG           the hub log's tail, then lab_fail MSG
#   jh_login FROM EMAIL [SECRET]   GET /hub/login as the edge would send it, from address FROM:
#                         prints the status; the page in $JH_T/page, cookies in $JH_T/jar
#   jh_signin             signs $JH_U in as lab.user@example.org through the trusted edge
#   jh_api ARGS..         curl with the test's hub token
#   jh_spawn KEY LABEL    picks profile KEY (whose form label is LABEL) in the spawn form, waits
#                         until the server is ready; sets JH_JOB (its Slurm job)
#   jh_cell CODE          runs CODE in a new kernel of the user's notebook server; prints its output
#   jh_page [ACTION name=value..]   the gpuhub page (GET, or a POST of its form); the status,
#                         the page in $JH_T/gpage; jh_text: the page as text
#   jh_stop               stops the user's server, waits for its job to end and for the agent to
#                         close it; `gpuhub job --json` in $JH_T/job.json
#
# Overrides of the shipped config, for the lab only: ports, state paths, the secret file, the
# user table, PATH of the job (the venv), the profiles' memory (the lab node has 16 GB) and the
# notebook's host (the lab node's name gpu01 does not resolve; it is 127.0.0.1).
JH_VENV=/opt/gpuhub-lab/jupyterhub
JH_HUB_PID=""

jh_fail() { echo "--- hub log (tail)" >&2; tail -n 40 "$JH_T/hub.log" >&2 || true; lab_fail "$@"; }

jh_cleanup() {
    if [ -n "$JH_HUB_PID" ] && kill -0 "$JH_HUB_PID" 2>/dev/null; then
        kill -TERM "$JH_HUB_PID"
        for _ in $(seq 150); do kill -0 "$JH_HUB_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$JH_HUB_PID" 2>/dev/null || true
    fi
    # A notebook job the hub did not stop (a failed run) must not outlive the test.
    local jobs; jobs="$(squeue -h -u "$JH_U" -n jupyterhub -o %i 2>/dev/null || true)"
    [ -z "$jobs" ] || lab_cancel $jobs
    # The proxy the hub started (the hub stops it on SIGTERM; not after a kill -9).
    local chp; chp="$(cat "$JH_T/jupyterhub-proxy.pid" 2>/dev/null || true)"
    [ -z "$chp" ] || kill "$chp" 2>/dev/null || true
    [ -n "${GPUHUB_KEEP:-}" ] || rm -rf "$JH_T"
}

jh_start() {
    agent_healthy || lab_fail "gpuhub-agent is not answering http://127.0.0.1:8400/healthz; run tests/lab/up.sh"
    [ -x "$JH_VENV/bin/jupyterhub" ] && [ -x "$JH_VENV/bin/configurable-http-proxy" ] ||
        prereq_missing "JupyterHub is not installed in $JH_VENV" "run tests/setup/jupyterhub.sh" || exit 0
    JH_GPUHUB="$LAB_REPO/target/release/gpuhub"
    JH_U="$LAB_USER"
    unprivileged_exec_check "$JH_U" "$JH_GPUHUB"
    JH_T="$(mktemp -d /tmp/gpuhub-jhub.XXXXXX)"
    local pub api hub page
    pub="$(python3 "$LAB_REPO/tests/lib/free_port.py")"; api="$(python3 "$LAB_REPO/tests/lib/free_port.py")"
    hub="$(python3 "$LAB_REPO/tests/lib/free_port.py")"; page="$(python3 "$LAB_REPO/tests/lib/free_port.py")"
    JH_PUB="http://127.0.0.1:$pub"
    JH_SECRET="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    JH_TOKEN="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    (umask 077; echo "$JH_SECRET" >"$JH_T/sso-secret")
    lab_cleanup_add jh_cleanup
    cat >"$JH_T/jupyterhub_config.py" <<PY
c = get_config()  # noqa: F821
load_subconfig("$LAB_REPO/rpm/share/jupyterhub/jupyterhub_config.py")  # noqa: F821 (the shipped file)
c.JupyterHub.bind_url = "http://127.0.0.1:$pub"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:$hub"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:$api"
c.ConfigurableHTTPProxy.command = ["$JH_VENV/bin/configurable-http-proxy"]
c.JupyterHub.db_url = "sqlite:///$JH_T/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "$JH_T/cookie_secret"
c.GpuhubSSOAuthenticator.shared_secret_file = "$JH_T/sso-secret"
c.GpuhubSSOAuthenticator.trusted_proxies = ["127.0.0.1", "127.0.0.2"]  # curl from .2; the browser (jupyterhub-lab) from .1
c.GpuhubSSOAuthenticator.user_map = {"lab.user@example.org": "$JH_U"}
c.GpuhubSSOAuthenticator.local_part_domains = ["example.org"]
c.SlurmSpawner.req_prologue = "export PATH=$JH_VENV/bin:\$PATH"
c.SlurmSpawner.state_exechost_exp = "127.0.0.1"
c.Spawner.start_timeout = 120
c.ProfilesSpawner.profiles = [(l, k, cls, dict(o, req_memory="1G", req_nprocs="1")) for (l, k, cls, o) in c.ProfilesSpawner.profiles]
for s in c.JupyterHub.services:  # the gpuhub page: a free port, the lab's CLI
    if s["name"] == "gpuhub":
        s["url"] = "http://127.0.0.1:$page"
        s["environment"] = {"GPUHUB_CLI": "$JH_GPUHUB"}
c.JupyterHub.services.append({"name": "gpuhub-lab-test", "api_token": "$JH_TOKEN"})
c.JupyterHub.load_roles.append({"name": "gpuhub-lab-test", "services": ["gpuhub-lab-test"],
                                "scopes": ["admin:users", "admin:servers", "access:servers"]})
c.JupyterHub.load_roles.append({"name": "admin", "services": ["gpuhub-lab-test"]})  # may make a user admin
PY
    echo "+ jupyterhub (shipped config + lab overrides) on $JH_PUB"
    # No __pycache__ in rpm/share (the RPM ships that directory whole).
    (cd "$JH_T" && PATH="$JH_VENV/bin:$PATH" PYTHONDONTWRITEBYTECODE=1 GPUHUB_JUPYTERHUB_DIR="$LAB_REPO/rpm/share/jupyterhub" \
        exec "$JH_VENV/bin/jupyterhub" -f "$JH_T/jupyterhub_config.py" >"$JH_T/hub.log" 2>&1) &
    JH_HUB_PID=$!
    for _ in $(seq 150); do
        curl -sf "$JH_PUB/hub/health" >/dev/null 2>&1 && break
        kill -0 "$JH_HUB_PID" 2>/dev/null || jh_fail "jupyterhub exited"
        sleep 0.2
    done
    curl -sf "$JH_PUB/hub/health" >/dev/null || jh_fail "jupyterhub did not answer within 30 s"
}

jh_login() {
    local args=(-s -o "$JH_T/page" -w '%{http_code}' --interface "$1" -c "$JH_T/jar" -b "$JH_T/jar" -H "X-Auth-Request-Email: $2")
    [ -z "${3:-}" ] || args+=(-H "X-Gpuhub-Proxy-Secret: $3")
    curl "${args[@]}" "$JH_PUB/hub/login"
}

jh_api() { curl -s -H "Authorization: token $JH_TOKEN" "$@"; }

jh_signin() {
    rm -f "$JH_T/jar"
    local s; s="$(jh_login 127.0.0.2 lab.user@example.org "$JH_SECRET")"
    [ "$s" = 302 ] || jh_fail "sign-in as lab.user@example.org: got $s (expected a redirect): $(head -c 400 "$JH_T/page")"
    [ "$(jh_api "$JH_PUB/hub/api/users/$JH_U" | jq -r .name)" = "$JH_U" ] || jh_fail "the hub has no user $JH_U after the sign-in"
}

jh_spawn() {
    local key="$1" label="$2" action s ready=false
    curl -s -b "$JH_T/jar" -c "$JH_T/jar" --interface 127.0.0.2 -o "$JH_T/form" "$JH_PUB/hub/spawn/$JH_U"
    grep -qF "$label" "$JH_T/form" || jh_fail "the spawn form does not offer '$label': $(head -c 400 "$JH_T/form")"
    action="$(grep -o 'action="/hub/spawn/[^"]*"' "$JH_T/form" | head -n1 | sed 's/^action="//; s/"$//; s/&amp;/\&/g' || true)"
    [ -n "$action" ] || jh_fail "no form action in the spawn page"
    s="$(curl -s -o "$JH_T/page" -w '%{http_code}' -b "$JH_T/jar" -c "$JH_T/jar" --interface 127.0.0.2 \
        -F "profile=$key" "$JH_PUB$action")"
    [ "$s" = 302 ] || jh_fail "POST /hub/spawn/$JH_U ($key): got $s: $(sed 's/<[^>]*>//g' "$JH_T/page" | tr -s ' \n' ' ' | head -c 400)"
    JH_JOB=""
    for _ in $(seq 240); do
        ready="$(jh_api "$JH_PUB/hub/api/users/$JH_U" | jq -r '.servers[""].ready // false')"
        [ -n "$JH_JOB" ] || JH_JOB="$(squeue -h -u "$JH_U" -n jupyterhub -o %i | head -n1)"
        [ "$ready" = true ] && break
        sleep 0.5
    done
    [ "$ready" = true ] || jh_fail "the notebook server ($key) of $JH_U was not ready within 120 s (job '${JH_JOB:-none}': $(tail -n 15 "/home/$JH_U/.jupyterhub-slurm-$JH_JOB.log" 2>/dev/null))"
    [ -n "$JH_JOB" ] || jh_fail "no Slurm job named jupyterhub for $JH_U ($key)"
}

jh_cell() {
    "$JH_VENV/bin/python" "$LAB_REPO/tests/lib/jupyter_kernel.py" "$JH_PUB/user/$JH_U/" "$JH_TOKEN" "$1"
}

jh_field() { grep -o "name=\"$1\" value=\"[^\"]*\"" "$JH_T/gpage" | head -n1 | sed 's/.*value="//; s/"$//'; }
jh_text() { sed 's/<[^>]*>/ /g' "$JH_T/gpage" | tr -s ' \n' ' '; }
jh_page() {
    local args=(-s -L -o "$JH_T/gpage" -w '%{http_code}' -b "$JH_T/jar" -c "$JH_T/jar")
    if [ $# -gt 0 ]; then
        args+=(--data-urlencode "action=$1" --data-urlencode "token=$(jh_field token)" --data-urlencode "_xsrf=$(jh_field _xsrf)"); shift
        local kv; for kv in "$@"; do args+=(--data-urlencode "$kv"); done
    fi
    curl "${args[@]}" "$JH_PUB/services/gpuhub/"
}

jh_stop() {
    local s; s="$(jh_api -o /dev/null -w '%{http_code}' -X DELETE "$JH_PUB/hub/api/users/$JH_U/server")"
    [ "$s" = 204 ] || [ "$s" = 202 ] || jh_fail "DELETE the server: got $s"
    # The hub answers 202 while the job is being cancelled; the next spawn needs it gone.
    for _ in $(seq 120); do
        [ "$(jh_api "$JH_PUB/hub/api/users/$JH_U" | jq -r '.servers[""] // "none" | if type == "object" then "up" else . end')" = none ] && break
        sleep 0.5
    done
    lab_wait_job "$JH_JOB" 60 || jh_fail "job $JH_JOB still in the queue 60 s after the server was stopped"
    for _ in $(seq 60); do
        "$JH_GPUHUB" job "$JH_JOB" --json >"$JH_T/job.json" 2>/dev/null && [ "$(jq -r '.nodes[0].end_us // empty' "$JH_T/job.json")" != "" ] && break
        sleep 0.5
    done
}
