#!/bin/bash
# A real Prometheus (Debian's package) scrapes the real gpuhub-agent, which reads two fake H200s
# (tests/fake-nvml). Two shard jobs share GPU 0 and a whole-GPU job holds GPU 1; their "GPU
# processes" are real processes: Slurm jobs started with srun when the lab is up (real
# SLURM_JOB_ID, SLURM_SHARDS_ON_NODE, the lab's unprivileged user); plain processes with that environment only
# when run by hand on a machine without Slurm (under tests/run-all.sh the lab is required).
# Asserts through Prometheus's HTTP API that each job's VRAM and utilisation arrive with the
# right jobid and user labels, that the DCGM series carry hpc_job, that an XID scripted on GPU 1
# arrives as DCGM_FI_DEV_XID_ERRORS and gpuhub_gpu_xid_errors_total, and that /metrics passes
# `promtool check metrics`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
command -v prometheus >/dev/null || tel_fail "prometheus not installed (tests/setup/deps.sh)"
tel_init
GIB=$((1024 * 1024 * 1024))

# ---- the job processes
# Real Slurm jobs whenever there is a Slurm to run them; plain processes only by hand on a machine
# without the lab. Under tests/run-all.sh (GPUHUB_TEST_STRICT=1) the lab is required: wait for the
# node (a test before may have left it completing), then fail if it does not come back.
mode=plain
node_state=""
for ((i = 0; i < 120; i++)); do
    [ "$(id -u)" -eq 0 ] && command -v sinfo >/dev/null || break
    node_state="$(timeout 5 sinfo -h -n gpu01 -o %T 2>/dev/null | head -n1 || true)"
    case "$node_state" in idle|mixed|allocated|completing) mode=slurm; break ;; esac
    [ "${GPUHUB_TEST_STRICT:-0}" = 1 ] || [ -n "$node_state" ] || break
    sleep 0.5
done
if [ "$mode" = plain ] && { [ "${GPUHUB_TEST_STRICT:-0}" = 1 ] || [ -n "$node_state" ]; }; then
    tel_fail "the lab's node gpu01 is '${node_state:-unreachable}' after 60 s, and this test needs real Slurm jobs there; run tests/lab/up.sh"
fi
declare -A PID JOB USR
if [ "$mode" = slurm ]; then
    # The lab's unprivileged user: Slurm refuses jobs of users without an association
    # (AccountingStorageEnforce), and tests/lab/up.sh gives this one an association.
    . "$(dirname "${BASH_SOURCE[0]}")/../lib/prereq.sh"
    run_user="$(unprivileged_user)"
    # Shards and whole GPUs must be free (model workers of earlier tests can hold them).
    for ((i = 0; i < 480; i++)); do
        [ -z "$(squeue -h -t PD,R,CG,S -o '%b' 2>/dev/null | grep -E 'gpu|shard' || true)" ] && break
        [ "$i" = 0 ] && echo "  waiting up to 240 s for GPU jobs to end"
        sleep 0.5
    done
    # One at a time, so Slurm places them where the fake GPUs' script below has their processes
    # (a, b: shards of GPU 0; c: GPU 1): the agent also takes each job's GPUs from slurmctld
    # (its dcgm job map), and a process on another GPU than its job's would show up twice.
    chmod 777 "$T"
    declare -A WANT_GPU=([a]=0 [b]=0 [c]=1)
    for name in a b c; do
        case "$name" in c) gres=gpu:1 ;; *) gres=shard:7 ;; esac
        out="$T/$name.info"
        # The task writes its pid, job id and GPU, then becomes the long-running "GPU process".
        echo "+ runuser -u $run_user -- srun --gres=$gres -t 2 ... (job $name)"
        runuser -u "$run_user" -- srun --gres="$gres" -t 2 -J "tel-$name" --chdir=/tmp \
            sh -c "echo \$\$ \$SLURM_JOB_ID \${SLURM_STEP_GPUS:-\$CUDA_VISIBLE_DEVICES} > $out.tmp && mv $out.tmp $out && exec sleep 110" \
            >"$T/$name.srun.log" 2>&1 &
        TEL_CLEANUP+=("kill $! 2>/dev/null")
        for ((i = 0; i < 120; i++)); do [ -s "$T/$name.info" ] && break; sleep 0.25; done
        [ -s "$T/$name.info" ] || { cat "$T/$name.srun.log" >&2; tel_fail "srun job $name did not start within 30 s"; }
        read -r PID[$name] JOB[$name] gpu < "$T/$name.info"
        USR[$name]=$run_user
        TEL_CLEANUP+=("scancel ${JOB[$name]} 2>/dev/null")
        echo "  job $name: Slurm job ${JOB[$name]}, pid ${PID[$name]}, GPU $gpu"
        [ "$gpu" = "${WANT_GPU[$name]}" ] || tel_fail "Slurm put job $name on GPU $gpu, not ${WANT_GPU[$name]} (the GPUs were not free?)"
    done
else
    echo "(the lab is not up: job processes are plain processes with a Slurm environment; the user"
    echo " is the processes' own, $(id -un): SLURM_JOB_USER is never believed)"
    declare -A J=([a]=101 [b]=102 [c]=103) S=([a]=7 [b]=7 [c]=)
    for name in a b c; do
        env SLURM_JOB_ID="${J[$name]}" SLURM_JOB_USER=someone-else ${S[$name]:+SLURM_SHARDS_ON_NODE=${S[$name]}} sleep 300 &
        PID[$name]=$!; JOB[$name]=${J[$name]}; USR[$name]="$(id -un)"
        TEL_CLEANUP+=("kill ${PID[$name]} 2>/dev/null")
    done
fi
{
    tel_gpu_line 0 $((31 * GIB)) 80
    tel_gpu_line 1 $((45 * GIB)) 90
    echo "proc gpu=0 pid=${PID[a]} mem=$((10 * GIB)) sm=30"
    echo "proc gpu=0 pid=${PID[b]} mem=$((20 * GIB)) sm=50"
    echo "proc gpu=1 pid=${PID[c]} mem=$((40 * GIB)) sm=90"
} > "$T/nvml/fake-nvml.conf"

# ---- the agent, then Prometheus scraping it every second
tel_start_agent "$([ "$mode" = slurm ] && echo true || echo false)"
pp="$(tel_free_port)"
cat > "$T/prometheus.yml" <<YML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: gpuhub
    static_configs:
      - targets: ["$TEL_METRICS_ADDR"]
YML
echo "+ prometheus --config.file=$T/prometheus.yml --web.listen-address=127.0.0.1:$pp (log $T/prometheus.log)"
prometheus --config.file="$T/prometheus.yml" --storage.tsdb.path="$T/prom-data" \
    --web.listen-address="127.0.0.1:$pp" >"$T/prometheus.log" 2>&1 &
TEL_CLEANUP+=("kill $! 2>/dev/null; wait $! 2>/dev/null")
api="http://127.0.0.1:$pp/api/v1"

# query PROMQL: prints the first result's value, or nothing
query() { curl -fsS --get --data-urlencode "query=$1" "$api/query" | jq -r '.data.result[0].value[1] // empty'; }
# expect PROMQL WANT: waits up to 30 s for the query to return WANT
expect() {
    local got="" i
    for ((i = 0; i < 60; i++)); do
        got="$(query "$1" 2>/dev/null || true)"
        [ "$got" = "$2" ] && { echo "ok: $1 = $got"; return 0; }
        sleep 0.5
    done
    tail -n 20 "$T/prometheus.log" >&2
    tel_fail "Prometheus query: $1
  expected: $2
  got:      ${got:-<no series>}"
}
G0=GPU-tel00000-0000-0000-0000-000000000000
G1=GPU-tel00000-0000-0000-0000-000000000001
expect "up{job=\"gpuhub\"}" 1
expect "gpuhub_nvml_up" 1
expect "gpuhub_job_gpu_memory_used_bytes{jobid=\"${JOB[a]}\",user=\"${USR[a]}\",uuid=\"$G0\"}" $((10 * GIB))
expect "gpuhub_job_gpu_memory_used_bytes{jobid=\"${JOB[b]}\",user=\"${USR[b]}\",uuid=\"$G0\"}" $((20 * GIB))
expect "gpuhub_job_gpu_utilization_ratio{jobid=\"${JOB[a]}\",user=\"${USR[a]}\"}" 0.3
expect "gpuhub_job_gpu_utilization_ratio{jobid=\"${JOB[b]}\",user=\"${USR[b]}\"}" 0.5
expect "gpuhub_job_gpu_shards{jobid=\"${JOB[b]}\"}" 7
expect "gpuhub_job_gpu_memory_used_bytes{jobid=\"${JOB[c]}\",user=\"${USR[c]}\",uuid=\"$G1\"}" $((40 * GIB))
expect "gpuhub_job_gpu_utilization_ratio{jobid=\"${JOB[c]}\",user=\"${USR[c]}\",uuid=\"$G1\"}" 0.9
expect "DCGM_FI_DEV_GPU_UTIL{hpc_job=\"${JOB[a]}\",UUID=\"$G0\",modelName=\"NVIDIA H200\",Hostname=\"gpu01\",gpu=\"0\",device=\"nvidia0\"}" 80
expect "DCGM_FI_DEV_FB_USED{hpc_job=\"${JOB[c]}\",UUID=\"$G1\"}" $((45 * 1024))
expect "count(DCGM_FI_DEV_GPU_UTIL{UUID=\"$G0\"})" 2
# Every dcgm-exporter default counter and profiling series, with its scripted value and the
# whole dcgm-exporter label set, on the copy of whole-GPU job c.
DCGM_LABELS="gpu=\"1\",UUID=\"$G1\",pci_bus_id=\"00000000:1A:00.0\",device=\"nvidia1\",modelName=\"NVIDIA H200\",Hostname=\"gpu01\",DCGM_FI_DRIVER_VERSION=\"550.54.15\",hpc_job=\"${JOB[c]}\""
for kv in $TEL_DCGM_EXPECT; do
    name="${kv%%=*}" want="${kv#*=}"
    if [ "$name" = DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL ]; then  # a rate over the sampling interval
        expect "round($name{$DCGM_LABELS})" "$want"
    else
        expect "$name{$DCGM_LABELS}" "$want"
    fi
done
expect "count(count by (__name__) ({__name__=~\"DCGM_FI_.*\",UUID=\"$G1\",hpc_job=\"${JOB[c]}\"}))" 33
meta="$(curl -fsS "$api/metadata?metric=DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION" | jq -r '.data[][0].type')"
[ "$meta" = counter ] || tel_fail "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION has type '$meta' in Prometheus, not dcgm-exporter's counter"
echo "ok: DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION is a counter named as dcgm-exporter names it"
expect "rate(gpuhub_job_gpu_energy_joules_total{jobid=\"${JOB[c]}\"}[5s]) > bool 100" 1
if [ "$mode" = slurm ]; then
    expect "gpuhub_slurm_up" 1
    expect "sum(gpuhub_slurm_jobs{state=\"running\",user=\"${USR[a]}\"}) >= bool 3" 1
fi

# ---- GPU 1 reports XID 79 (an NVML event): last-XID gauge on GPU 1 only, counted once
expect "max(DCGM_FI_DEV_XID_ERRORS{UUID=\"$G1\"})" 0
sed '/^gpu index=1 /s/$/ xid=79/' "$T/nvml/fake-nvml.conf" > "$T/nvml/conf.tmp" && mv "$T/nvml/conf.tmp" "$T/nvml/fake-nvml.conf"
expect "DCGM_FI_DEV_XID_ERRORS{hpc_job=\"${JOB[c]}\",UUID=\"$G1\"}" 79
expect "max(DCGM_FI_DEV_XID_ERRORS{UUID=\"$G0\"})" 0
expect "gpuhub_gpu_xid_errors_total{gpu=\"1\",uuid=\"$G1\",xid=\"79\"}" 1
expect "count(gpuhub_gpu_xid_errors_total{uuid=\"$G0\"}) or vector(0)" 0

# ---- job a ends: its series go away (no ghosts) while b's stay
kill "${PID[a]}" 2>/dev/null || true
[ "$mode" = slurm ] && scancel "${JOB[a]}" 2>/dev/null || true
grep -v "pid=${PID[a]} " "$T/nvml/fake-nvml.conf" > "$T/nvml/conf.tmp" && mv "$T/nvml/conf.tmp" "$T/nvml/fake-nvml.conf"
expect "count(gpuhub_job_gpu_memory_used_bytes{jobid=\"${JOB[a]}\"}) or vector(0)" 0
expect "count(DCGM_FI_DEV_GPU_UTIL{UUID=\"$G0\"})" 1
expect "gpuhub_job_gpu_memory_used_bytes{jobid=\"${JOB[b]}\"}" $((20 * GIB))

# ---- promtool on what the endpoint serves to a plain client
echo "+ curl -s $TEL_METRICS_URL | promtool check metrics"
set +e
lint="$(curl -fsS "$TEL_METRICS_URL" | promtool check metrics 2>&1)"
rc=$?
set -e
# Exit 3 = lint findings only. Accepted: findings on dcgm-exporter's own names, labels and types
# on DCGM_FI_* series (kept so existing dashboards work): the camelCase label `modelName`,
# counters without `_total`, "counter" in DCGM_FI_DEV_PCIE_REPLAY_COUNTER.
bad="$(printf '%s\n' "$lint" | grep -v '^$' | grep -Ev "^DCGM_FI_[A-Z_]+ (label names should be written in 'snake_case' not 'camelCase'|counter metrics should have \"_total\" suffix|metric name should not include type 'counter')$" || true)"
if [ "$rc" -ne 0 ] && { [ "$rc" -ne 3 ] || [ -n "$bad" ]; }; then
    tel_fail "promtool check metrics: exit $rc
$lint"
fi
echo "ok: promtool check metrics (exit $rc; only dcgm-exporter's own names and labels flagged)"
echo "PASS: telemetry-prometheus ($mode jobs)"
