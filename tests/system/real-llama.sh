#!/usr/bin/env bash
# Real models on a real server through the gateway, as Slurm jobs: the lab's catalog entries
# for SmolLM2-135M-Instruct (chat) and all-MiniLM-L6-v2 (embeddings) on llama.cpp's server
# (llama-cpp-python, tests/setup/llama.sh), run by a test agent of its own (tests/lib/models.sh)
# with a short idle timeout, called with the stock `openai` SDK:
#   1. the first call starts a Slurm job; "What is the capital of France? Answer in one word."
#      at temperature 0 answers with "Paris"
#   2. streams with and without stream_options.include_usage: the rows have nonzero completion
#      tokens (the server reports none in streams: the gateway counts them, and the server's
#      tokenize endpoint counts the prompt)
#   3. completions work
#   4. embeddings: 384 dimensions; two paraphrases are closer than two unrelated sentences
#   5. a Responses API stream (the TEST worker) ends at response.completed, its usage recorded
#   6. idle: both jobs are cancelled and the models are unloaded
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
. "$REPO/tests/lib/prereq.sh"
lab_require

PY="$REPO/.venv/bin/python"
LLAMA_PY=/opt/gpuhub-lab/llama-venv/bin/python
[ -x "$PY" ] && "$PY" -c 'import openai' 2>/dev/null ||
    { prereq_missing "$PY with the openai SDK is missing" "run tests/setup/deps.sh" || exit 0; }
[ -x "$LLAMA_PY" ] && [ -s /opt/gpuhub-lab/models/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ -s /opt/gpuhub-lab/models/all-MiniLM-L6-v2.gguf ] ||
    { prereq_missing "llama.cpp's server or the lab's models are missing under /opt/gpuhub-lab" "run tests/setup/llama.sh" || exit 0; }

# The lab's own entries (the commands the lab runs), with a short idle timeout.
ENTRIES="$("$PY" "$REPO/tests/lib/lab_entries.py" SmolLM2-135M-Instruct all-MiniLM-L6-v2 --set idle_timeout_s=8)" ||
    models_fail "cannot read the real models from tests/lab/agent.toml"
models_setup "$ENTRIES
[[models]]
name = \"mt-resp\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file}\"
resources = { shards = 1, vram_gib = 0.1 }
idle_timeout_s = 8
load_timeout_s = 60
" "[roles]
chat = \"SmolLM2-135M-Instruct\"
embeddings = \"all-MiniLM-L6-v2\""
DB="$MT_DIR/state/gpuhub.db"
sql() { sqlite3 -separator '|' "$DB" "$1"; }

echo "== 1-5. the openai SDK through the gateway (first calls start the Slurm jobs)"
t0=$SECONDS
OPENAI_BASE_URL="http://$MT_GW/v1" OPENAI_API_KEY="$MT_KEY" "$PY" - <<'EOF' || models_fail "the openai SDK checks failed (above)"
import math, time
from openai import OpenAI

c = OpenAI(timeout=180, max_retries=0)
q = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
t = time.time()
r = c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=q, temperature=0, max_tokens=16)
a = r.choices[0].message.content
print(f"   chat ({time.time() - t:.1f} s, first call): {a!r}, usage {r.usage.prompt_tokens}+{r.usage.completion_tokens}")
assert "Paris" in a, a
assert r.usage.completion_tokens > 0
# The chat role's name serves the same model.
r2 = c.chat.completions.create(model="chat", messages=q, temperature=0, max_tokens=16)
assert "Paris" in r2.choices[0].message.content, r2

for include in (False, True):
    kw = {"stream_options": {"include_usage": True}} if include else {}
    text, chunks, usage = "", 0, None
    for ch in c.chat.completions.create(model="SmolLM2-135M-Instruct", messages=q, temperature=0, max_tokens=16, stream=True, **kw):
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            chunks += 1
        usage = ch.usage or usage
    print(f"   stream (include_usage={include}): {text!r} in {chunks} deltas; usage in the stream: {usage}")
    assert "Paris" in text and chunks > 0, text

r = c.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0)
print(f"   completion: {r.choices[0].text!r}")
assert r.choices[0].text.strip(), r

t = time.time()
e = c.embeddings.create(model="all-MiniLM-L6-v2", input=["A man is playing a guitar.", "Someone is playing an instrument.", "The stock market fell sharply today."])
v = [d.embedding for d in e.data]
cos = lambda a, b: sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
print(f"   embeddings ({time.time() - t:.1f} s, first call): {len(v[0])} dimensions; paraphrases {cos(v[0], v[1]):.3f}, unrelated {cos(v[0], v[2]):.3f}")
assert all(len(x) == 384 for x in v), [len(x) for x in v]
assert cos(v[0], v[1]) > cos(v[0], v[2]) + 0.2, (cos(v[0], v[1]), cos(v[0], v[2]))
e2 = c.embeddings.create(model="embeddings", input="one sentence")
assert len(e2.data[0].embedding) == 384

events = list(c.responses.create(model="mt-resp", input="a Responses API stream", stream=True))
kinds = [ev.type for ev in events]
print(f"   responses stream: {kinds[0]} ... {kinds[-1]} ({len(kinds)} events), usage {events[-1].response.usage.input_tokens}+{events[-1].response.usage.output_tokens}")
assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
assert events[-1].response.usage.output_tokens > 0
EOF
echo "   ok: all calls answered in $((SECONDS - t0)) s"

echo "== the workers are Slurm jobs"
for m in SmolLM2-135M-Instruct all-MiniLM-L6-v2; do
    job="$(models_field "$m" worker_id)"
    [ -n "$job" ] && [ "$(models_jobs "$m")" = "$job" ] || models_fail "$m: expected Slurm job '$job' named gpuhub-worker-$m, squeue shows '$(models_jobs "$m")'"
    echo "   $m: Slurm job $job"
done

echo "== every call has its row; streams without usage were counted"
sleep 1.5 # rows are written in batches (about every 250 ms)
echo "   $(sql "SELECT COUNT(*) FROM usage_log") rows; chat/completion rows:"
sql "SELECT route, streamed, status, prompt_tokens, completion_tokens, usage_source FROM usage_log WHERE resolved_model = 'SmolLM2-135M-Instruct' ORDER BY time_us" | sed 's/^/     /'
bad="$(sql "SELECT COUNT(*) FROM usage_log WHERE resolved_model IN ('SmolLM2-135M-Instruct', 'all-MiniLM-L6-v2') AND (status != 200 OR error_code != '')")"
[ "$bad" = 0 ] || models_fail "$bad calls to the real models failed: $(sql "SELECT route, status, error_code FROM usage_log WHERE status != 200")"
streams="$(sql "SELECT COUNT(*) FROM usage_log WHERE resolved_model = 'SmolLM2-135M-Instruct' AND streamed = 1 AND completion_tokens > 0 AND prompt_tokens > 0 AND usage_source = 'tokenized'")"
[ "$streams" = 2 ] || models_fail "expected 2 streamed rows with counted completion and tokenized prompt tokens, got $streams"
plain="$(sql "SELECT COUNT(*) FROM usage_log WHERE resolved_model = 'SmolLM2-135M-Instruct' AND streamed = 0 AND completion_tokens > 0 AND usage_source = 'reported'")"
[ "$plain" = 3 ] || models_fail "expected 3 plain chat/completion rows with the server's usage, got $plain"
emb="$(sql "SELECT COUNT(*) FROM usage_log WHERE resolved_model = 'all-MiniLM-L6-v2' AND prompt_tokens > 0 AND usage_source = 'reported'")"
[ "$emb" = 2 ] || models_fail "expected 2 embeddings rows with prompt tokens, got $emb"
resp="$(sql "SELECT prompt_tokens, completion_tokens, usage_source, error_code FROM usage_log WHERE route = '/v1/responses'")"
case "$resp" in [1-9]*"|"[1-9]*"|reported|") ;; *) models_fail "the Responses API stream's row: '$resp' (want its usage, reported, no error)" ;; esac
echo "   ok: streamed rows counted, plain rows reported, the Responses API stream's usage recorded ($resp)"

echo "== idle: the jobs are cancelled, the models unloaded"
for m in SmolLM2-135M-Instruct all-MiniLM-L6-v2 mt-resp; do models_wait_state "$m" unloaded 40; done
# Unloaded means scancel was sent; the job leaves squeue once the server has shut down
# (uvicorn's graceful stop keeps it COMPLETING for a moment).
for m in SmolLM2-135M-Instruct all-MiniLM-L6-v2; do
    for ((w = 0; w < 300; w++)); do [ -z "$(models_jobs "$m")" ] && break; sleep 0.1; done
    [ -z "$(models_jobs "$m")" ] || models_fail "$m: its Slurm job is still listed 30 s after the idle unload: $(squeue -h -n "gpuhub-worker-$m" -o '%i %T %M')"
done
echo "PASS: real-llama"
