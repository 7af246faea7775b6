#!/usr/bin/env bash
# Benchmark: a real model on a real server (SmolLM2-135M-Instruct on llama.cpp's server from
# llama-cpp-python, the lab's catalog entry) through the gateway, in one run:
#   1. cold start as a Slurm job, from the first call to its first streamed token, split into
#        gpuhub before sbatch = launch_us (agent log) - t0 (the client's call)
#        Slurm                = the job script's first line - launch_us (sbatch + scheduling)
#        server start         = python start, imports and app setup (to `model load start`),
#                               plus `model loaded` -> `listening` (bench/llama_timed.py marks)
#        model load           = llama_cpp.Llama.__init__ (weights read, context allocated)
#        gateway readiness    = the agent's `ready` transition (agent log) - `listening`
#        first token          = first content delta at the client - `ready` (the proxied call:
#                               prompt evaluation and one token; compare the warm TTFT below)
#   2. warm: BENCH_CALLS calls each, one at a time on a kept-alive connection, direct to the
#      server and through the gateway, alternating blocks: p50/p99 of plain calls (max_tokens=1)
#      and of streamed calls (time to first token, max_tokens=8); the added latency; and the
#      agent's CPU time per 1,000 gateway calls (its utime+stime over the gateway blocks, less
#      what it spent idle over the direct blocks).
# Its own agent on the Slurm lab (tests/lib/models.sh: ports 18401/19411, a temp state dir).
#
#   BENCH_COLD=5 BENCH_CALLS=300 bench/real-server.sh   # as root, lab up, tests/setup/llama.sh done
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
COLD="${BENCH_COLD:-5}"
CALLS="${BENCH_CALLS:-300}"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
PY="$REPO/.venv/bin/python"
for t in jq sqlite3 "$PY" /opt/gpuhub-lab/llama-venv/bin/python; do
    command -v "$t" >/dev/null || { echo "missing $t (tests/setup/deps.sh)" >&2; exit 2; }
done
M=SmolLM2-135M-Instruct
# The lab's entry, started through bench/llama_timed.py (the same server, with timestamps) and
# with a first line that stamps the job's start.
# The entry keeps its llama-cpp-python template (key in API_KEY, the venv on PATH, its args);
# only the command is this one.
CMD="echo \"gpuhub-bench: at_us=\$(date +%s%6N) job started\" >&2; python3 $REPO/bench/llama_timed.py --model {model_path} --model_alias {model} --host {host} --port {port}"
ENTRY="$("$PY" "$REPO/tests/lib/lab_entries.py" "$M" --set idle_timeout_s=600 --set "command=$(jq -Rn --arg c "$CMD" '$c')")"
models_setup "$ENTRY"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")
AGENT_PID="$(cat "$MT_DIR/agent.pid")"

# One streamed call; prints "T0_US FIRST_TOKEN_US END_US".
first_token() {
    "$PY" - "$1" "$2" "$M" <<'EOF'
import http.client, json, sys, time, urllib.parse
url, key, model = sys.argv[1:4]
u = urllib.parse.urlparse(url)
c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
body = json.dumps({"model": model, "temperature": 0, "max_tokens": 8, "stream": True,
                   "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
t0 = time.time_ns() // 1000
c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json", "authorization": f"Bearer {key}"})
r = c.getresponse()
assert r.status == 200, (r.status, r.read())
first = None
for line in r:
    if first is None and line.startswith(b"data: {") and b'"content"' in line and b'"content": ""' not in line:
        first = time.time_ns() // 1000
print(t0, first or 0, time.time_ns() // 1000)
EOF
}

echo "== cold start as a Slurm job ($COLD runs): first call -> first streamed token"
printf '%-4s %9s %9s %9s %9s %9s %9s %9s\n' run total_ms gpuhub_ms slurm_ms server_ms load_ms ready_ms token_ms
: > "$MT_DIR/cold"
for i in $(seq "$COLD"); do
    old="$(models_field "$M" worker_id)"
    "${CLI[@]}" models unload "$M" >/dev/null
    # A cold start comes long after the last worker ended: wait until its job has left the
    # node (COMPLETING while uvicorn shuts down), or Slurm's wait for it lands in this start.
    for ((w = 0; w < 300; w++)); do [ -z "$old" ] || [ -z "$(squeue -h -j "$old" -o %T 2>/dev/null)" ] && break; sleep 0.1; done
    read -r t0 tfirst _ <<<"$(first_token "http://$MT_GW" "$MT_KEY")"
    [ "$tfirst" != 0 ] || models_fail "cold run $i: no token"
    job="$(models_field "$M" worker_id)"
    log="$MT_DIR/workers/$M.$job.log"
    mark() { grep -m1 "gpuhub-bench: at_us=.* $1\$" "$log" | sed -n 's/.*at_us=\([0-9]*\).*/\1/p'; }
    launch="$(grep 'worker launched' "$MT_DIR/agent.log" | tail -n1 | sed -n 's/.*launch_us=\([0-9]*\).*/\1/p')"
    ready="$("$PY" - "$MT_DIR/agent.log" "$M" <<'EOF'
import datetime, re, sys
t = None
for line in open(sys.argv[1], errors="replace"):
    if "model state" in line and f"model={sys.argv[2]}" in line and re.search(r'to="?ready', line):
        t = line.split()[0]
d = datetime.datetime.fromisoformat(t.replace("Z", "+00:00"))
print(int(d.timestamp() * 1_000_000))
EOF
)"
    js="$(mark 'job started')"; ls_="$(mark 'model load start')"; ld="$(mark 'model loaded')"; li="$(mark listening)"
    [ -n "$launch" ] && [ -n "$js" ] && [ -n "$ls_" ] && [ -n "$ld" ] && [ -n "$li" ] && [ -n "$ready" ] ||
        models_fail "cold run $i: missing timestamps (launch '$launch', job '$js', load '$ls_'/'$ld', listening '$li', ready '$ready'; $log)"
    awk -v r="$i" -v t0="$t0" -v tf="$tfirst" -v l="$launch" -v js="$js" -v ls="$ls_" -v ld="$ld" -v li="$li" -v rd="$ready" 'BEGIN {
        printf "%-4s %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f %9.1f\n", r, (tf - t0) / 1000, (l - t0) / 1000, (js - l) / 1000,
            ((ls - js) + (li - ld)) / 1000, (ld - ls) / 1000, (rd - li) / 1000, (tf - rd) / 1000
    }' | tee -a "$MT_DIR/cold"
done
med() { awk -v c="$1" '{print $c}' "$MT_DIR/cold" | sort -n | awk '{v[NR] = $1} END {printf "%.1f", v[int((NR + 1) / 2)]}'; }
echo "cold start medians (ms): total $(med 2) = gpuhub before sbatch $(med 3) + Slurm $(med 4) + server start $(med 5) + model load $(med 6) + gateway readiness $(med 7) + first token $(med 8)"

echo "== warm: $CALLS calls each, direct vs through the gateway (alternating blocks of 50)"
# Direct calls carry the worker's own key (the server refuses any other), read from the store.
read -r url wkey <<<"$(sqlite3 -separator ' ' "$MT_DIR/state/gpuhub.db" "SELECT base_url, api_key FROM model_workers WHERE model = '$M'")"
[ -n "$url" ] && [ -n "${wkey:-}" ] || models_fail "no worker URL or key for $M"
"$PY" - "$url" "http://$MT_GW" "$MT_KEY" "$M" "$CALLS" "$AGENT_PID" "$wkey" <<'EOF'
import http.client, json, os, sys, time, urllib.parse
direct, gateway, key, model, calls, agent = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
keys = {direct: sys.argv[7], gateway: key}
tick = os.sysconf("SC_CLK_TCK")
def cpu_s():
    f = open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick
q = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
plain = json.dumps({"model": model, "messages": q, "temperature": 0, "max_tokens": 1})
stream = json.dumps({"model": model, "messages": q, "temperature": 0, "max_tokens": 8, "stream": True})
conns = {}
def connect(base):
    # A fresh kept-alive connection per block: uvicorn closes one idle for 5 s (while the other
    # target's block runs), and a reconnect must not land in the timed calls.
    if base in conns:
        conns[base].close()
    u = urllib.parse.urlparse(base)
    conns[base] = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
def call(base, body, streamed):
    c = conns[base]
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json", "authorization": f"Bearer {keys[base]}"})
    r = c.getresponse()
    first = None
    if streamed:
        for line in r:
            if first is None and b'"content"' in line and b'"content": ""' not in line:
                first = time.perf_counter()
    else:
        r.read()
    assert r.status == 200, r.status
    return ((first or time.perf_counter()) - t0) * 1000
lat = {(t, k): [] for t in ("direct", "gateway") for k in ("plain", "ttft")}
cpu = {"direct": 0.0, "gateway": 0.0}
n = {"direct": 0, "gateway": 0}
for base in (direct, gateway):
    connect(base)
    for warm in range(5):
        call(base, plain, False)
done = 0
while done < calls:
    block = min(50, calls - done)
    for target, base in (("direct", direct), ("gateway", gateway)):
        connect(base)
        call(base, plain, False)  # untimed: opens the connection
        c0 = cpu_s()
        for _ in range(block):
            lat[(target, "plain")].append(call(base, plain, False))
            lat[(target, "ttft")].append(call(base, stream, True))
        cpu[target] += cpu_s() - c0
        n[target] += 2 * block
    done += block
def pct(v, p):
    v = sorted(v); return v[min(len(v) - 1, int(len(v) * p))]
for k, what in (("plain", "plain call, max_tokens=1"), ("ttft", "streamed call, time to first token")):
    d, g = lat[("direct", k)], lat[("gateway", k)]
    print(f"{what:40s} direct p50 {pct(d, .5):7.2f} ms  p99 {pct(d, .99):7.2f} ms | gateway p50 {pct(g, .5):7.2f} ms  p99 {pct(g, .99):7.2f} ms"
          f" | added p50 {pct(g, .5) - pct(d, .5):+.2f} ms  p99 {pct(g, .99) - pct(d, .99):+.2f} ms")
net = max(cpu["gateway"] - cpu["direct"], 0.0)
print(f"agent CPU: {cpu['gateway'] * 1000 / n['gateway'] * 1000:.0f} ms per 1,000 gateway calls "
      f"(idle over the direct blocks: {cpu['direct'] * 1000 / n['direct'] * 1000:.0f} ms per 1,000 calls' time; net {net * 1000 / n['gateway'] * 1000:.0f} ms), "
      f"{n['gateway']} gateway calls")
EOF
"${CLI[@]}" models unload "$M" >/dev/null
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end; llama-cpp-python $(/opt/gpuhub-lab/llama-venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')"
