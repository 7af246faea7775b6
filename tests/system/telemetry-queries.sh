#!/usr/bin/env bash
# timeout: 600
# Every query gpuhub ships, against a real Prometheus scraping the lab: every panel query and
# variable of every dashboard (rpm/share/grafana) must answer with at least one series, every
# alert rule (rpm/share/prometheus/gpuhub-alerts.yml, loaded by the shipped gpuhub.yml) must load,
# evaluate without error and name only metrics and labels that exist (tests/lib/prom_queries.py).
#
# Prometheus runs the shipped rpm/share/prometheus/gpuhub.yml, with only its targets, intervals
# and rule path rewritten for the test; it scrapes:
#   - the lab's gpuhub-agent (Slurm, accounting, gateway, names, models: real Slurm jobs of the
#     lab user, gateway calls from two users and apps to a model worker the agent starts through
#     Slurm, a deprecated name, an unknown name and a role without a model);
#   - a second gpuhub-agent reading two fake H200s (tests/fake-nvml, the lab machine has no GPU)
#     whose GPU processes are those Slurm jobs: two shard jobs on GPU 0, a whole-GPU job on GPU 1
#     (which then reports XID 79);
#   - a real node_exporter (Debian's prometheus-node-exporter) for the dashboard's CPU, RAM, disk.
# No double counting: with two shard jobs GPU 0 has two copies of every DCGM series, yet the GPU
# dashboard says 2 GPUs, 800 W (2 x 400 W), 85 % mean utilisation.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/lab.sh"   # its EXIT trap replaces telemetry.sh's:
lab_cleanup_add tel_cleanup                          # runs last, before plugstack_restore
lab_require
command -v prometheus >/dev/null || lab_fail "prometheus not installed (tests/setup/deps.sh)"
command -v prometheus-node-exporter >/dev/null || lab_fail "prometheus-node-exporter not installed (tests/setup/deps.sh)"
GPUHUB="$LAB_REPO/target/release/gpuhub"
[ -x "$GPUHUB" ] || lab_fail "$GPUHUB missing: cargo build --release"
tel_init
lab_user
agent_start 60 || lab_fail "the lab agent does not start"
lab_wait_gpus_free 240
GIB=$((1024 * 1024 * 1024))
GW=http://127.0.0.1:8400

echo "== Slurm jobs of $LAB_USER: a whole GPU, two shard jobs, one pending"
mkdir -p "$T/jobs"; chmod 777 "$T/jobs"
JOBS=()
lab_cleanup_add 'for j in "${JOBS[@]}"; do scancel "$j" 2>/dev/null || true; done; for j in "${JOBS[@]}"; do lab_wait_job "$j" 30 || true; done'
submit() { # submit NAME SBATCH-ARGS...: the job writes "pid jobid" to $T/jobs/NAME, then sleeps as that pid
    local name="$1" id
    shift
    id="$(runuser -u "$LAB_USER" -- sbatch --parsable -J "tel-q-$name" -t 5 -o /dev/null --chdir=/tmp "$@" \
        --wrap "echo \$\$ \$SLURM_JOB_ID > $T/jobs/$name.tmp && mv $T/jobs/$name.tmp $T/jobs/$name && exec sleep 280")" || lab_fail "sbatch $* failed"
    echo "+ sbatch $* -> job $id ($name)"
    JOBS+=("$id")
}
submit whole --gres=gpu:1
submit shard-a --gres=shard:3
submit shard-b --gres=shard:3
submit later --gres=shard:1 --begin=now+1hour
declare -A PID JOB
for name in whole shard-a shard-b; do
    for ((i = 0; i < 240; i++)); do [ -s "$T/jobs/$name" ] && break; sleep 0.25; done
    [ -s "$T/jobs/$name" ] || lab_fail "job $name did not start within 60 s: $(squeue -h -n "tel-q-$name" -o '%i %T %r')"
    read -r PID[$name] JOB[$name] < "$T/jobs/$name"
    echo "  $name: job ${JOB[$name]}, pid ${PID[$name]}"
done

echo "== the GPU agent: two fake H200s whose processes are those jobs'"
{
    tel_gpu_line 0 $((31 * GIB)) 80
    tel_gpu_line 1 $((45 * GIB)) 90
    echo "proc gpu=0 pid=${PID[shard-a]} mem=$((10 * GIB)) sm=30"
    echo "proc gpu=0 pid=${PID[shard-b]} mem=$((20 * GIB)) sm=50"
    echo "proc gpu=1 pid=${PID[whole]} mem=$((40 * GIB)) sm=90"
} > "$T/nvml/fake-nvml.conf"
# The machine's host name (no telemetry.hostname): node_exporter's nodename, which the
# dashboard joins on.
agent_config "$T/gpu-agent" "nvml_library = \"$T/nvml/libnvidia-ml.so.1\"
interval_ms = 500
enable_slurm = true
slurm_interval_ms = 2000
slurm_node_name = \"$LAB_NODE\"
job_map_dir = \"\""
GPU_METRICS="127.0.0.1:$AGENT_METRICS_PORT"
echo "+ $TEL_AGENT --config $T/gpu-agent/agent.toml run"
"$TEL_AGENT" --config "$T/gpu-agent/agent.toml" run > "$T/agent.log" 2>&1 &
gpu_agent=$!
TEL_CLEANUP+=("kill $gpu_agent 2>/dev/null; wait $gpu_agent 2>/dev/null")
for ((i = 0; i < 120; i++)); do
    curl -fsS -o /dev/null "http://$GPU_METRICS/metrics" 2>/dev/null && break
    kill -0 "$gpu_agent" 2>/dev/null || tel_fail "the GPU agent exited"
    sleep 0.25
done
# GPU 1 reports XID 79 (after the agent registered for XID events: earlier ones are not delivered).
sleep 2
sed '/^gpu index=1 /s/$/ xid=79/' "$T/nvml/fake-nvml.conf" > "$T/nvml/conf.tmp" && mv "$T/nvml/conf.tmp" "$T/nvml/fake-nvml.conf"

echo "== node_exporter and Prometheus (the shipped gpuhub.yml, rewritten for the test)"
read -r NE_PORT PROM_PORT < <(python3 "$LAB_REPO/tests/lib/free_port.py" 2)
echo "+ prometheus-node-exporter --web.listen-address=127.0.0.1:$NE_PORT"
prometheus-node-exporter --web.listen-address="127.0.0.1:$NE_PORT" > "$T/node-exporter.log" 2>&1 &
TEL_CLEANUP+=("kill $! 2>/dev/null; wait $! 2>/dev/null")
sed -e "s|/usr/share/gpuhub/prometheus/gpuhub-alerts.yml|$LAB_REPO/rpm/share/prometheus/gpuhub-alerts.yml|" \
    -e "s|\"127.0.0.1:9100\"|\"127.0.0.1:$NE_PORT\"|" \
    -e "s|targets: \\[\"127.0.0.1:9410\"\\]|targets: [\"127.0.0.1:9410\", \"$GPU_METRICS\"]|" \
    -e 's/scrape_interval: 15s/scrape_interval: 1s/; s/scrape_timeout: 5s/scrape_timeout: 1s/; s/evaluation_interval: 30s/evaluation_interval: 1s/' \
    "$LAB_REPO/rpm/share/prometheus/gpuhub.yml" > "$T/prometheus.yml"
grep -q "127.0.0.1:$NE_PORT" "$T/prometheus.yml" && grep -q "$GPU_METRICS" "$T/prometheus.yml" \
    || lab_fail "rewriting the shipped gpuhub.yml failed: $(cat "$T/prometheus.yml")"
promtool check config "$T/prometheus.yml" >/dev/null || lab_fail "promtool check config $T/prometheus.yml failed"
prometheus --config.file="$T/prometheus.yml" --storage.tsdb.path="$T/prom-data" \
    --web.listen-address="127.0.0.1:$PROM_PORT" > "$T/prometheus.log" 2>&1 &
TEL_CLEANUP+=("kill $! 2>/dev/null; wait $! 2>/dev/null")
PROM="http://127.0.0.1:$PROM_PORT"

echo "== gateway traffic: two users and apps, a deprecated name, an unknown name, a role without a model"
KEYS=()
lab_cleanup_add 'for k in "${KEYS[@]}"; do "$GPUHUB" keys revoke "$k" >/dev/null 2>&1 || true; done'
for who in "alice ocr-app" "bob notebook"; do
    set -- $who
    "$GPUHUB" keys create --user "$1" --app "$2" --json > "$T/key-$1.json" || lab_fail "gpuhub keys create --user $1 --app $2 failed"
    KEYS+=("$(jq -r .id "$T/key-$1.json")")
    echo "+ gpuhub keys create --user $1 --app $2 -> key $(jq -r .id "$T/key-$1.json")"
done
KA="$(jq -r .key "$T/key-alice.json")"; KB="$(jq -r .key "$T/key-bob.json")"
CHAT=SmolLM2-135M-Instruct   # the lab's chat model (tests/lab/agent.toml)
call() { # call KEY MODEL WANT_CODE
    local code
    code="$(curl -s --max-time 150 -o "$T/body" -w '%{http_code}' "$GW/v1/chat/completions" -H "authorization: Bearer $1" \
        -H 'content-type: application/json' -d "{\"model\":\"$2\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" || true)"
    echo "+ POST /v1/chat/completions model=$2 -> HTTP $code"
    [ "$code" = "$3" ] || lab_fail "model $2: expected HTTP $3, got $code: $(head -c 300 "$T/body")"
}
call "$KA" "$CHAT" 200     # the first call starts the worker (llama.cpp's server) through Slurm
call "$KB" "$CHAT" 200
call "$KA" svc-ocr 200       # deprecated alias of dots.ocr: a second worker
call "$KB" no-such-model 404
call "$KA" tts 503           # a role with no model assigned
for i in 1 2 3; do call "$KA" "$CHAT" 200; call "$KB" "$CHAT" 200; done

echo "== every shipped query against Prometheus (up to 180 s for the data to arrive)"
checks='[
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "GPUs", "min": 2, "max": 2},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "Power", "min": 800, "max": 800},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "Mean utilisation", "min": 85, "max": 85},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "Jobs on GPUs", "min": 3, "max": 3},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "CPU busy", "min": 0, "max": 100},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "RAM used", "min": 0.001, "max": 100},
 {"dashboard": "gpuhub-gpu-telemetry.json", "panel": "Fullest disk", "min": 0.001, "max": 100}
]'
# The copies the checks above must not count twice: GPU 0 has one per shard job.
for ((i = 0; i < 60; i++)); do
    n="$(curl -fsS --get --data-urlencode 'query=count(DCGM_FI_DEV_GPU_UTIL{gpu="0"})' "$PROM/api/v1/query" 2>/dev/null | jq -r '.data.result[0].value[1] // 0')"
    [ "$n" = 2 ] && break
    sleep 1
done
[ "$n" = 2 ] || lab_fail "GPU 0 should have 2 copies of DCGM_FI_DEV_GPU_UTIL (one per shard job), has $n"
echo "ok: GPU 0 has 2 copies of each DCGM series (jobs ${JOB[shard-a]} and ${JOB[shard-b]})"
python3 "$LAB_REPO/tests/lib/prom_queries.py" "$PROM" "$LAB_REPO" 180 "$checks" \
    || { tail -n 20 "$T/prometheus.log" >&2; lab_fail "shipped queries that return nothing or an error (above)"; }
echo "PASS telemetry-queries"
