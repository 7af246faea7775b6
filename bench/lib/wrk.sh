# wrk runs for the gateway benchmarks (bench/gateway.sh, bench/gateway-replicas.sh). Source it
# after setting WRK_DIR (a private temp dir) and DURATION (seconds per run):
#   wrk_run NAME URL AUTH BODY CONNS DELAY_MS   POSTs BODY to URL/v1/chat/completions with
#                 `Authorization: Bearer AUTH`, CONNS connections each pausing DELAY_MS between
#                 calls; sets P50 P99 (us) RPS REQS; wrk's output in $WRK_DIR/wrk-NAME.txt.
#                 Any non-2xx answer: a message and status 1.
#   cpu_ticks PID  utime+stime of PID in clock ticks ($TICK per second)
#   steal_ticks    the host's steal so far, in clock ticks (/proc/stat): time this VM was ready
#                  to run but the hypervisor ran something else. Printed beside each paced pair:
#                  a pair with hundreds of ticks ran on a contended host (its CPU figures inflate).
cat >"$WRK_DIR/post.lua" <<'LUA'
wrk.method = "POST"
wrk.body = os.getenv("BODY")
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. os.getenv("AUTH")
local d = tonumber(os.getenv("DELAY_MS") or "0")
function delay() return d end
LUA
TICK="$(getconf CLK_TCK)"
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
steal_ticks() { awk '/^cpu / {print $9}' /proc/stat; }
to_us() { awk -v v="$1" 'BEGIN { n = v + 0; if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000; else if (v ~ /s$/) print n * 1000000; else print n }'; }

wrk_run() {
    local out non2xx
    out="$(BODY="$4" AUTH="$3" DELAY_MS="$6" wrk -t2 -c"$5" -d"${DURATION}s" --latency -s "$WRK_DIR/post.lua" "$2/v1/chat/completions")"
    echo "$out" >"$WRK_DIR/wrk-$1.txt"
    P50="$(to_us "$(echo "$out" | awk '$1 == "50%" {print $2}')")"
    P99="$(to_us "$(echo "$out" | awk '$1 == "99%" {print $2}')")"
    RPS="$(echo "$out" | awk '/Requests\/sec/ {print $2}')"
    REQS="$(echo "$out" | awk '/requests in/ {print $1}')"
    non2xx="$(echo "$out" | awk '/Non-2xx/ {print $NF}')"
    [ -z "$non2xx" ] || { echo "$1: $non2xx non-2xx answers (see $WRK_DIR/wrk-$1.txt)" >&2; return 1; }
}
