# Shared helpers for tests/system/telemetry-*.sh. Source it after `set -euo pipefail`.
#
#   tel_init                 temp dir $T (removed at exit), fake NVML built into $T/nvml
#   tel_free_port            print a free loopback TCP port
#   tel_gpu_line IDX USED UTIL   one `gpu` line of the fake NVML script (UUID GPU-tel-...IDX), every
#                            field scripted; TEL_DCGM_EXPECT: the DCGM value each field becomes
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

# Every field the agent reads is scripted (TEL_DCGM_EXPECT lists what each becomes on /metrics).
TEL_GPU_EXTRA='mem_reserved=536870912 memory_temp=52 pcie_tx_kbs=1000 pcie_rx_kbs=2000 pcie_replay=3 enc_util=4 dec_util=5 nvlink_tx_kibps=1000 nvlink_rx_kibps=3000 remap_cor=6 remap_unc=7 remap_failed=0 gpm_gr_engine=61.5 gpm_sm_active=52.5 gpm_sm_occupancy=33.25 gpm_tensor=24.5 gpm_dram=45.5 gpm_pcie_tx=1.5 gpm_pcie_rx=2.5 gpm_nvlink_tx=3.5 gpm_nvlink_rx=4.5'
# DCGM family and the value the line above gives it (the ones whose value does not depend on
# the GPU line's arguments; NVLINK_BANDWIDTH_TOTAL is a rate: 4000 KiB/s / 1000).
TEL_DCGM_EXPECT='DCGM_FI_DEV_SM_CLOCK=1980 DCGM_FI_DEV_MEM_CLOCK=2619 DCGM_FI_DEV_MEMORY_TEMP=52 DCGM_FI_DEV_GPU_TEMP=45
DCGM_FI_DEV_POWER_USAGE=400 DCGM_FI_DEV_PCIE_TX_THROUGHPUT=1000 DCGM_FI_DEV_PCIE_RX_THROUGHPUT=2000
DCGM_FI_DEV_PCIE_REPLAY_COUNTER=3 DCGM_FI_DEV_MEM_COPY_UTIL=20 DCGM_FI_DEV_ENC_UTIL=4 DCGM_FI_DEV_DEC_UTIL=5
DCGM_FI_DEV_FB_RESERVED=512 DCGM_FI_DEV_ECC_SBE_VOL_TOTAL=0 DCGM_FI_DEV_ECC_DBE_VOL_TOTAL=0
DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL=4 DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS=7 DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS=6
DCGM_FI_DEV_ROW_REMAP_FAILURE=0 DCGM_FI_PROF_GR_ENGINE_ACTIVE=0.615 DCGM_FI_PROF_SM_ACTIVE=0.525
DCGM_FI_PROF_SM_OCCUPANCY=0.3325 DCGM_FI_PROF_PIPE_TENSOR_ACTIVE=0.245 DCGM_FI_PROF_DRAM_ACTIVE=0.455
DCGM_FI_PROF_PCIE_TX_BYTES=1572864 DCGM_FI_PROF_PCIE_RX_BYTES=2621440 DCGM_FI_PROF_NVLINK_TX_BYTES=3670016
DCGM_FI_PROF_NVLINK_RX_BYTES=4718592'

tel_gpu_line() {
    printf 'gpu index=%d uuid=GPU-tel00000-0000-0000-0000-%012d name="NVIDIA H200" pci=00000000:%02X:00.0 mem_total=150754820096 mem_used=%s util=%s mem_util=20 temp=45 power_mw=400000 energy_mj=1000 sm_clock=1980 mem_clock=2619 ecc_sbe=0 ecc_dbe=0 %s\n' \
        "$1" "$1" $((0x19 + $1)) "$2" "$3" "$TEL_GPU_EXTRA"
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
