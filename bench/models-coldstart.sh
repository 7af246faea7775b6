#!/usr/bin/env bash
# Benchmark: cold-start overhead that gpuhub adds on top of Slurm's job start and the worker's
# own start (target ≤ 100 ms), and the warm path through the gateway vs. the worker directly.
#
# It runs its own agent on the Slurm lab (tests/lib/models.sh: ports 18401/19411, a temp
# state dir) with one model served by the repo's TEST worker through `launcher = "slurm"`.
# Each cold start: unload, then one chat call, timed by the client (t0 → t_end). The parts:
#   gpuhub before sbatch  = launch_us (agent log, just before sbatch) - t0
#   Slurm job start       = worker process start (worker log `at_us`, first line) - launch_us
#   worker's own start    = worker listening (`at_us`) - worker process start (--startup-delay-ms)
#   gpuhub after ready    = t_end - worker listening (readiness detection + proxying the call)
#   gpuhub overhead       = gpuhub before sbatch + gpuhub after ready
# The sbatch command's own run time counts as Slurm's. Then the warm path: wrk, 10 s each,
# against the worker directly and through the gateway (plain chat calls).
#
#   BENCH_COLD=10 bench/models-coldstart.sh        # as root, with the lab up (tests/lab/up.sh)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
COLD="${BENCH_COLD:-10}"
WARM_S="${BENCH_WARM_S:-10}"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
for t in jq wrk sqlite3; do command -v "$t" >/dev/null || { echo "missing $t (tests/setup/deps.sh)" >&2; exit 2; }; done

models_setup "
[[models]]
name = \"mt-bench\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file} --startup-delay-ms 500\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 600
load_timeout_s = 60
"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")
now_us() { date +%s%6N; }

BODY='{"model":"mt-bench","messages":[{"role":"user","content":"cold"}]}'
printf '%-4s %10s %10s %10s %10s %10s %12s\n' run total_ms slurm_ms worker_ms before_ms after_ms overhead_ms
: > "$MT_DIR/overheads"
for i in $(seq "$COLD"); do
    "${CLI[@]}" models unload mt-bench >/dev/null
    t0="$(now_us)"
    status="$(curl -s --max-time 90 -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $MT_KEY" \
        -H 'content-type: application/json' -d "$BODY" "http://$MT_GW/v1/chat/completions" || true)"
    t_end="$(now_us)"
    [ "$status" = 200 ] || models_fail "cold call $i: HTTP $status"
    job="$(models_field mt-bench worker_id)"
    log="$MT_DIR/workers/mt-bench.$job.log"
    launch="$(grep 'worker launched' "$MT_DIR/agent.log" | tail -n1 | sed -n 's/.*launch_us=\([0-9]*\).*/\1/p')"
    wstart="$(grep -m1 'TEST WORKER starting' "$log" | sed -n 's/.*at_us=\([0-9]*\).*/\1/p')"
    wlisten="$(grep -m1 'at_us=.*listening on' "$log" | sed -n 's/.*at_us=\([0-9]*\).*/\1/p')"
    [ -n "$launch" ] && [ -n "$wstart" ] && [ -n "$wlisten" ] || models_fail "missing timestamps (launch '$launch', worker '$wstart' / '$wlisten')"
    awk -v r="$i" -v t0="$t0" -v te="$t_end" -v l="$launch" -v ws="$wstart" -v wl="$wlisten" 'BEGIN {
        before = (l - t0) / 1000; slurm = (ws - l) / 1000; worker = (wl - ws) / 1000; after = (te - wl) / 1000
        printf "%-4s %10.1f %10.1f %10.1f %10.1f %10.1f %12.1f\n", r, (te - t0) / 1000, slurm, worker, before, after, before + after
    }' | tee -a "$MT_DIR/overheads"
done
sort -n -k7 "$MT_DIR/overheads" | awk '{o[NR] = $7} END {printf "gpuhub cold-start overhead: median %.1f ms, max %.1f ms over %d cold starts (target <= 100 ms)\n", o[int((NR + 1) / 2)], o[NR], NR}'
med() { awk -v c="$1" '{print $c}' "$MT_DIR/overheads" | sort -n | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }
echo "medians (ms): total $(med 2), Slurm job start $(med 3), worker's own start $(med 4), gpuhub before sbatch $(med 5), gpuhub after ready $(med 6)"

echo "== warm path (${WARM_S}s each, wrk -t1 -c4, plain chat calls)"
row="$(sqlite3 "$MT_DIR/state/gpuhub.db" "SELECT base_url || ' ' || api_key FROM model_workers WHERE model = 'mt-bench'")"
wurl="${row% *}"; wkey="${row#* }"
cat > "$MT_DIR/post.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer " .. os.getenv("KEY")
wrk.body = '{"model":"mt-bench","messages":[{"role":"user","content":"warm"}]}'
LUA
for target in "direct $wurl $wkey" "gateway http://$MT_GW $MT_KEY"; do
    set -- $target
    KEY="$3" wrk -t1 -c4 -d"${WARM_S}s" --latency -s "$MT_DIR/post.lua" "$2/v1/chat/completions" > "$MT_DIR/wrk.$1"
    printf '%-8s %s  p50 %s  p99 %s\n' "$1" "$(grep 'Requests/sec' "$MT_DIR/wrk.$1" | tr -s ' ')" \
        "$(awk '$1 == "50%" {print $2}' "$MT_DIR/wrk.$1")" "$(awk '$1 == "99%" {print $2}' "$MT_DIR/wrk.$1")"
done
echo "machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg) at the end"
