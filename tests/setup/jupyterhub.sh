#!/usr/bin/env bash
# Installs JupyterHub for tests/system/jupyterhub-lab.sh, idempotently. Run as root; called by
# tests/setup/deps.sh.
#
#   /opt/gpuhub-lab/jupyterhub/              venv: jupyterhub, batchspawner, wrapspawner (the hub)
#                                            and jupyter_server + ipykernel (the notebook server
#                                            the Slurm job runs as the user) with JupyterLab,
#                                            the notebook the browser test uses; ~200 MB
#   /opt/gpuhub-lab/jupyterhub/node/         configurable-http-proxy from npm (node from apt)
#   /var/cache/gpuhub/jupyterhub/wheels/     the wheels, downloaded once; later runs install offline
#   /var/cache/gpuhub/jupyterhub/npm/        npm's cache for configurable-http-proxy
#   chromium (apt)                           the headless browser of the portal test
#
#   GPUHUB_JUPYTERHUB=0   skip it (tests/system/jupyterhub-lab.sh then fails under run-all)
set -euo pipefail
log() { echo "[jupyterhub] $(date +%T) $*"; }
die() { echo "[jupyterhub] ERROR: $*" >&2; exit 1; }
[ "${GPUHUB_JUPYTERHUB:-1}" = 1 ] || { log "GPUHUB_JUPYTERHUB=0: skipped"; exit 0; }

PREFIX="${GPUHUB_LLAMA_PREFIX:-/opt/gpuhub-lab}/jupyterhub"
CACHE=/var/cache/gpuhub/jupyterhub
PY=/usr/bin/python3
# Pinned: the shipped config is tested against exactly these.
REQS=("jupyterhub==5.2.1" "batchspawner==1.3.0" "wrapspawner==1.0.1" "jupyter_server==2.14.2" "ipykernel==6.29.5" "jupyterlab==4.5.11")
CHP_VERSION=4.6.2
CHECK='import importlib.metadata as m; assert m.version("jupyterhub") == "5.2.1" and m.version("batchspawner") == "1.3.0" and m.version("jupyterlab") == "4.5.11"; import batchspawner, wrapspawner, jupyter_server, ipykernel, jupyterlab'

missing=()
command -v node >/dev/null && command -v npm >/dev/null || missing+=(nodejs npm)
command -v sudo >/dev/null || missing+=(sudo) # batchspawner submits with `sudo -E -u USER sbatch`
if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null || die "apt-get install ${missing[*]} failed"
fi

# The browser test's headless Chromium (tests/lib/browser.py), without its desktop recommends.
if ! command -v chromium >/dev/null; then
    log "apt-get install chromium"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null || die "apt-get install chromium failed"
fi

install -d -m 0755 "$PREFIX" "$CACHE/wheels" "$CACHE/npm"
unset PIP_FIND_LINKS PIP_NO_INDEX
if ! { [ -x "$PREFIX/bin/python" ] && [ "$(readlink -f "$PREFIX/bin/python")" = "$(readlink -f "$PY")" ] && "$PREFIX/bin/python" -c "$CHECK" 2>/dev/null; }; then
    t0=$SECONDS
    find "$PREFIX" -mindepth 1 -maxdepth 1 ! -name node -exec rm -rf {} +
    "$PY" -m venv "$PREFIX"
    pip=("$PREFIX/bin/pip" --disable-pip-version-check -q)
    if ! "${pip[@]}" install --no-index --find-links "$CACHE/wheels" "${REQS[@]}" 2>/dev/null; then
        log "downloading ${REQS[*]} into $CACHE/wheels"
        "${pip[@]}" download -d "$CACHE/wheels" --find-links "$CACHE/wheels" "${REQS[@]}" || die "pip download failed"
        "${pip[@]}" install --no-index --find-links "$CACHE/wheels" "${REQS[@]}" || die "installing ${REQS[*]} from $CACHE/wheels failed"
    fi
    "$PREFIX/bin/python" -c "$CHECK" || die "$PREFIX does not hold ${REQS[*]} after the install"
    log "installed ${REQS[*]} in $((SECONDS - t0)) s"
fi
CHP="$PREFIX/node/node_modules/.bin/configurable-http-proxy"
if ! [ -x "$CHP" ] || ! grep -q "\"version\": \"$CHP_VERSION\"" "$PREFIX/node/node_modules/configurable-http-proxy/package.json" 2>/dev/null; then
    log "npm install configurable-http-proxy@$CHP_VERSION"
    npm install --prefix "$PREFIX/node" --cache "$CACHE/npm" --prefer-offline --no-audit --no-fund --loglevel=error \
        "configurable-http-proxy@$CHP_VERSION" >/dev/null || die "npm install configurable-http-proxy@$CHP_VERSION failed"
fi
ln -sfn "$CHP" "$PREFIX/bin/configurable-http-proxy"
"$PREFIX/bin/configurable-http-proxy" --version >/dev/null || die "configurable-http-proxy does not run"
# The notebook server runs as the user (in the Slurm job): readable by all, writable by root.
chmod -R go+rX,go-w "$PREFIX"
log "ok (in $PREFIX)"
