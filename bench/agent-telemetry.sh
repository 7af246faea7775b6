#!/bin/bash
# Agent telemetry benchmark, measured with the fake NVML library (tests/fake-nvml), not a GPU: the
# real gpuhub-agent with 8 fake H200s scripted with every field it reads (every DCGM_FI_* series,
# the GPM profiling ones included) and 200
# running "jobs" (real processes carrying SLURM_JOB_ID/SLURM_JOB_USER, 25 per GPU, listed by the
# fake NVML as GPU processes), sampling every 1 s. Prints, from one run:
#   - idle RSS of the agent (VmRSS after warm-up, and VmHWM at the end)
#   - CPU used per minute (utime+stime over BENCH_SECONDS, scaled to 60 s) as % of one core
#   - p50/p99 time of a /metrics scrape (wrk, 1 connection, after the CPU window)
# Targets (issues 3 and 16): RSS <= 30 MiB, CPU <= 1 % of a core, scrape p99 <= 5 ms.
# Usage: bench/agent-telemetry.sh            (BENCH_SECONDS=60 BENCH_JOBS=200 BENCH_GPUS=8)
# Needs: cargo build --release (target/release/gpuhub-agent), cc, wrk, curl, python3.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
agent="$repo/target/release/gpuhub-agent"
secs="${BENCH_SECONDS:-60}"
njobs="${BENCH_JOBS:-200}"
ngpus="${BENCH_GPUS:-8}"
[ -x "$agent" ] || { echo "FAIL: $agent missing; run cargo build --release" >&2; exit 1; }
for t in cc wrk curl python3; do command -v "$t" >/dev/null || { echo "FAIL: $t not installed (tests/setup/deps.sh)" >&2; exit 1; }; done

T="$(mktemp -d /tmp/gpuhub-bench-telemetry.XXXXXX)"
pids=()
agent_pid=""
cleanup() {
    [ -n "$agent_pid" ] && kill "$agent_pid" 2>/dev/null && wait "$agent_pid" 2>/dev/null || true
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$T"
}
trap cleanup EXIT

"$repo/tests/fake-nvml/build.sh" "$T/nvml" >/dev/null
# 200 job processes: job ids 1000.., users user0..user19, every 2nd job a shard job.
for ((j = 0; j < njobs; j++)); do
    if ((j % 2)); then shards=7; else shards=""; fi
    env SLURM_JOB_ID=$((1000 + j)) SLURM_JOB_USER="user$((j % 20))" ${shards:+SLURM_SHARDS_ON_NODE=$shards} \
        sleep 100000 &
    pids+=("$!")
done
{
    echo "driver version=550.54.15"
    for ((g = 0; g < ngpus; g++)); do
        # Every field the agent reads, so every DCGM_FI_* series (GPM profiling included) is exported.
        printf 'gpu index=%d uuid=GPU-bench000-0000-0000-0000-%012d name="NVIDIA H200" pci=00000000:%02X:00.0 mem_total=150754820096 mem_used=100000000000 util=87 mem_util=40 temp=55 power_mw=600000 energy_mj=1000000 sm_clock=1980 mem_clock=2619 ecc_sbe=0 ecc_dbe=0 mem_reserved=536870912 memory_temp=60 pcie_tx_kbs=1000 pcie_rx_kbs=2000 pcie_replay=0 enc_util=0 dec_util=0 nvlink_tx_kibps=1000 nvlink_rx_kibps=3000 remap_cor=0 remap_unc=0 remap_failed=0 gpm_gr_engine=80 gpm_sm_active=70 gpm_sm_occupancy=40 gpm_tensor=55 gpm_dram=45 gpm_pcie_tx=1500 gpm_pcie_rx=2500 gpm_nvlink_tx=3500 gpm_nvlink_rx=4500\n' "$g" "$g" $((0x19 + g))
    done
    for ((j = 0; j < njobs; j++)); do
        echo "proc gpu=$((j % ngpus)) pid=${pids[$j]} mem=$((4 * 1024 * 1024 * 1024)) sm=$((j % 40))"
    done
} > "$T/nvml/fake-nvml.conf"

slurm=false
if command -v squeue >/dev/null && timeout 5 squeue -h -o %i >/dev/null 2>&1; then slurm=true; fi
. "$(dirname "$0")/../tests/lib/agent-config.sh"
agent_config "$T" "nvml_library = \"$T/nvml/libnvidia-ml.so.1\"
interval_ms = 1000
hostname = \"bench01\"
enable_slurm = $slurm
job_map_dir = \"$T/run/dcgm-job-map\""
GPUHUB_LOG=warn "$agent" --config "$T/agent.toml" run >"$T/agent.log" 2>&1 &
agent_pid=$!
url="http://127.0.0.1:$AGENT_METRICS_PORT/metrics"
for ((i = 0; i < 120; i++)); do
    curl -fsS -o /dev/null "$url" 2>/dev/null && break
    kill -0 "$agent_pid" 2>/dev/null || { echo "FAIL: agent exited:"; cat "$T/agent.log"; exit 1; }
    sleep 0.25
done
sleep 5 # warm-up: a few samples, attribution cache filled
body="$(curl -fsS "$url")"
job_series="$(grep -c '^gpuhub_job_gpu_memory_used_bytes{' <<<"$body" || true)"
lines="$(grep -vc '^#' <<<"$body" || true)"
dcgm_job="$(grep -c '^DCGM_FI_[A-Z_]*{.*hpc_job="[^"]' <<<"$body" || true)"   # per-job copies of the DCGM series
dcgm_families="$(grep -oE '^DCGM_FI_[A-Z_]+\{' <<<"$body" | sort -u | wc -l)"
[ "$job_series" -eq "$njobs" ] || { echo "FAIL: expected $njobs per-job series, got $job_series"; tail -n 20 "$T/agent.log"; exit 1; }
# Every DCGM family the agent has (dcgm.rs FAMILIES) carries samples, so the bench measures them all.
[ "$dcgm_families" -eq 33 ] || { echo "FAIL: expected all 33 DCGM_FI_* families with samples, got $dcgm_families"; exit 1; }

clk="$(getconf CLK_TCK)"
cpu_ticks() { awk '{ print $14 + $15 }' "/proc/$agent_pid/stat"; }
rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$agent_pid/status"; }
rss_idle="$(rss_kib)"
c0="$(cpu_ticks)"; t0="$(date +%s.%N)"
sleep "$secs"
c1="$(cpu_ticks)"; t1="$(date +%s.%N)"
cpu_pct="$(awk -v a="$c0" -v b="$c1" -v hz="$clk" -v s0="$t0" -v s1="$t1" 'BEGIN { printf "%.3f", (b - a) / hz / (s1 - s0) * 100 }')"
cpu_s_per_min="$(awk -v p="$cpu_pct" 'BEGIN { printf "%.3f", p / 100 * 60 }')"
rss_end="$(rss_kib)"
hwm="$(awk '/^VmHWM:/ { print $2 }' "/proc/$agent_pid/status")"
# The Accept header Prometheus sends (OpenMetrics: no conversion to the classic text format).
wrk_out="$(wrk -t1 -c1 -d10s --latency -H 'Accept: application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5' "$url")"
p50="$(awk '$1 == "50%" { print $2 }' <<<"$wrk_out")"
p99="$(awk '$1 == "99%" { print $2 }' <<<"$wrk_out")"
reqs="$(awk '/requests in/ { print $1 }' <<<"$wrk_out")"

echo "agent telemetry benchmark, MEASURED WITH THE FAKE NVML (tests/fake-nvml: scripted GPUs, no driver calls): $ngpus fake H200s, $njobs running jobs ($((njobs / ngpus))/GPU, half shard jobs), sampling 1 s, slurm snapshots: $slurm"
echo "  /metrics: $lines samples, $(printf %s "$body" | wc -c) bytes; $dcgm_families DCGM_FI_* families, $dcgm_job of the samples are their copies per job"
printf '  idle RSS:        %6.1f MiB after warm-up, %6.1f MiB at end, peak (VmHWM) %6.1f MiB   (target <= 30 MiB)\n' \
    "$(awk -v k="$rss_idle" 'BEGIN{print k/1024}')" "$(awk -v k="$rss_end" 'BEGIN{print k/1024}')" "$(awk -v k="$hwm" 'BEGIN{print k/1024}')"
echo "  CPU:             $cpu_pct % of one core = $cpu_s_per_min CPU-s per minute over ${secs}s, no scrapes   (target <= 1 %)"
echo "  scrape latency:  p50 $p50, p99 $p99 over $reqs scrapes (wrk -t1 -c1 -d10s, Prometheus's Accept header)   (target p99 <= 5 ms)"
echo "  machine: $(nproc) CPUs, load average $(cut -d' ' -f1-3 /proc/loadavg)"
