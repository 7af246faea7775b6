# Shared helpers for tests/system/telemetry-*.sh. Source it after `set -euo pipefail`.
#
#   tel_init                 temp dir $T (removed at exit), fake NVML built into $T/nvml
#   tel_free_port            print a free loopback TCP port
#   tel_gpu_line IDX USED UTIL   one `gpu` line of the fake NVML script (UUID GPU-tel-...IDX)
#   tel_start_agent [SLURM] [TOML]  write $T/agent.toml (fake NVML, 200 ms sampling, private paths and
#                            ports; SLURM=true|false; TOML: more sections appended, e.g. [accounting];
#                            TEL_JOB_MAP_DIR: telemetry.job_map_dir, default $T/run/dcgm-job-map, "" off)
#                            and start the real gpuhub-agent; sets TEL_METRICS_ADDR (host:port),
#                            TEL_METRICS_URL, TEL_AGENT_PID; stopped at exit
#   tel_fail MSG             print MSG and the agent log tail, exit 1
TEL_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TEL_AGENT="${GPUHUB_AGENT_BIN:-$TEL_REPO/target/release/gpuhub-agent}"
TEL_CLEANUP=()
TEL_AGENT_PID=""

tel_cleanup() {
    local i
    for ((i = ${#TEL_CLEANUP[@]} - 1; i >= 0; i--)); do eval "${TEL_CLEANUP[$i]}" || true; done
}
trap tel_cleanup EXIT

tel_fail() {
    echo "FAIL: $*" >&2
    if [ -n "${T:-}" ] && [ -f "$T/agent.log" ]; then
        echo "--- last lines of the agent log ($T/agent.log)" >&2
        tail -n 25 "$T/agent.log" >&2
    fi
    exit 1
}

tel_free_port() { python3 "$(dirname "${BASH_SOURCE[0]}")/free_port.py"; }
# shellcheck source=agent-config.sh
. "$(dirname "${BASH_SOURCE[0]}")/agent-config.sh"

tel_init() {
    T="$(mktemp -d /tmp/gpuhub-telemetry-test.XXXXXX)"
    chmod 755 "$T"
    TEL_CLEANUP+=("rm -rf '$T'")
    [ -x "$TEL_AGENT" ] || tel_fail "$TEL_AGENT missing; run cargo build --release"
    "$TEL_REPO/tests/fake-nvml/build.sh" "$T/nvml" >/dev/null || tel_fail "cannot build the fake NVML library"
}

tel_gpu_line() {
    printf 'gpu index=%d uuid=GPU-tel00000-0000-0000-0000-%012d name="NVIDIA H200" pci=00000000:%02X:00.0 mem_total=150754820096 mem_used=%s util=%s mem_util=20 temp=45 power_mw=400000 energy_mj=1000 sm_clock=1980 mem_clock=2619 ecc_sbe=0 ecc_dbe=0\n' \
        "$1" "$1" $((0x19 + $1)) "$2" "$3"
}

tel_start_agent() {
    local slurm="${1:-false}" i
    agent_config "$T" "nvml_library = \"$T/nvml/libnvidia-ml.so.1\"
interval_ms = 200
slurm_interval_ms = 1000
hostname = \"gpu01\"
enable_slurm = $slurm
job_map_dir = \"${TEL_JOB_MAP_DIR-$T/run/dcgm-job-map}\""
    [ -z "${2:-}" ] || printf '%s\n' "$2" >> "$T/agent.toml"
    echo "+ $TEL_AGENT --config $T/agent.toml run   (log $T/agent.log)"
    "$TEL_AGENT" --config "$T/agent.toml" run >"$T/agent.log" 2>&1 &
    TEL_AGENT_PID=$!
    TEL_CLEANUP+=("kill $TEL_AGENT_PID 2>/dev/null; wait $TEL_AGENT_PID 2>/dev/null")
    TEL_METRICS_ADDR="127.0.0.1:$AGENT_METRICS_PORT"
    TEL_METRICS_URL="http://$TEL_METRICS_ADDR/metrics"
    for ((i = 0; i < 120; i++)); do
        curl -fsS -o /dev/null "$TEL_METRICS_URL" 2>/dev/null && return 0
        kill -0 "$TEL_AGENT_PID" 2>/dev/null || tel_fail "gpuhub-agent exited during startup"
        sleep 0.25
    done
    tel_fail "gpuhub-agent did not serve $TEL_METRICS_URL within 30 s"
}
