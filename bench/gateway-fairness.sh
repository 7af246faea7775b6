#!/usr/bin/env bash
# Fair queueing benchmark: user A sends BURST (500) calls at once to a model served one call at
# a time (max_concurrency 1, queue_len 600); user B sends one call while they wait. Prints B's
# latency against the per-call time (median of 5 solo calls) and A's own call sent right after
# B's (it waits behind A's burst). tests/lib/gateway_fairness.py does the calls.
#   WORKER=llama (default): the lab's SmolLM2-135M-Instruct on llama.cpp's server
#     (llama-cpp-python, tests/setup/llama.sh), one thread as in tests/lab/agent.toml, run by
#     the bench as a static worker (no Slurm), max_tokens 8 per call.
#   WORKER=test: the TEST worker with 10 ms per token (9 tokens: ~80 ms a call).
# usage: bench/gateway-fairness.sh   (BURST=N WORKER=llama|test)
set -euo pipefail
source "$(dirname "$0")/../tests/lib/gateway.sh"
BURST="${BURST:-500}"; WORKER="${WORKER:-llama}"
gw_init
LLAMA_PY=/opt/gpuhub-lab/llama-venv/bin/python
MODEL_FILE=/opt/gpuhub-lab/models/SmolLM2-135M-Instruct.Q4_1.gguf
EXTRA=()
case "$WORKER" in
    test) gw_worker demo-chat --token-delay-ms 10 ;;
    llama)
        [ -x "$LLAMA_PY" ] && [ -s "$MODEL_FILE" ] || gw_fail "llama.cpp's server or SmolLM2 is missing under /opt/gpuhub-lab: run tests/setup/llama.sh"
        PORT="$(gw_free_port)"
        API_KEY=worker-key OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=1 "$LLAMA_PY" -m llama_cpp.server --model "$MODEL_FILE" \
            --model_alias demo-chat --host 127.0.0.1 --port "$PORT" --n_threads 1 --n_threads_batch 1 --n_ctx 2048 --verbose false \
            >"$GW_DIR/worker.log" 2>&1 &
        GW_PIDS+=($!)
        for _ in $(seq 600); do curl -sf -H 'authorization: Bearer worker-key' "http://127.0.0.1:$PORT/v1/models" >/dev/null 2>&1 && break; sleep 0.1; done
        curl -sf -H 'authorization: Bearer worker-key' "http://127.0.0.1:$PORT/v1/models" >/dev/null || gw_fail "llama.cpp's server did not start: $(tail -5 "$GW_DIR/worker.log")"
        GW_WORKER_ADDR="127.0.0.1:$PORT"
        EXTRA=(--max-tokens 8) ;;
    *) gw_fail "WORKER must be llama or test, not $WORKER" ;;
esac
gw_config
sed -i 's/^max_concurrency = 512$/max_concurrency = 1/; s/^queue_len = 512$/queue_len = 600/' "$GW_DIR/agent.toml"
gw_config_add gateway "upstream_timeout_s = 1800"
gw_start
A="$(gw_key alice burst)"; B="$(gw_key bob single)"
echo "== WORKER=$WORKER BURST=$BURST ($(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg))"
python3 "$GW_REPO/tests/lib/gateway_fairness.py" "$GW_URL" "$A" "$B" --metrics "http://127.0.0.1:$GW_METRICS_PORT/metrics" \
    --burst "$BURST" --timeout 1800 "${EXTRA[@]}"
gw_stop
