#!/usr/bin/env bash
# Inference billed to its callers (docs/accounting.md, "Inference"), on the real Slurm lab through
# a test agent of its own (tests/lib/models.sh): two Unix users (root and the unprivileged lab
# user, each with an API key of their own; the lab user calls as itself) call a model whose
# worker is a Slurm job; the worker goes idle, is cancelled, and Slurm closes the job. Then:
#   - `gpuhub usage --json` splits the worker job's shard-seconds between both users (each > 0),
#     the split is stored (settled), and its sum equals sacct's AllocTRES (gres/shard or gres/gpu)
#     x ElapsedRaw for that job, to the microsecond;
#   - the worker account is no user row of that time; the table shows the inference section;
#   - /metrics has gpuhub_inference_shard_seconds_total for both callers, summing to the same.
# The worker is the repo's TEST worker: this is about billing, not serving.
# Needs slurmdbd (tests/run-all.sh brings the lab up with it); bounded: about 90 s.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require
acct_type="$(scontrol show config 2>/dev/null | awk '$1 == "AccountingStorageType" {print $3}')"
[ "$acct_type" = accounting_storage/slurmdbd ] \
    || lab_fail "this test compares with sacct, but the lab runs without slurmdbd (AccountingStorageType=${acct_type:-unknown}); bring it up with accounting: GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh"
lab_user

CMD='command = "@WORKER@ --model {model} --version {version} --host {host} --port {port} --api-key-file {api_key_file} --token-delay-ms 150"'
models_setup "
[[models]]
name = \"inf-chat\"
launcher = \"slurm\"
$CMD
resources = { shards = 2, vram_gib = 4.0 }
idle_timeout_s = 4
load_timeout_s = 60
" "vram_gib = 10.0

[telemetry]
enable_slurm = true
slurm_node_name = \"$LAB_NODE\"
slurm_interval_ms = 1000

[accounting]
usage_counters_interval_ms = 1000"
SOCK="$MT_DIR/run/agent.sock"
KEY_B="$("$MT_CLI" --socket "$SOCK" keys create --user "$LAB_USER" --app inf-b --json | jq -r .key)"
[ -n "$KEY_B" ] && [ "$KEY_B" != null ] || models_fail "cannot create an API key for $LAB_USER"
# The lab user's key in a file only that user reads (never on a command line).
install -m 600 -o "$LAB_USER" /dev/null "$MT_DIR/key-b"
printf 'Authorization: Bearer %s\n' "$KEY_B" > "$MT_DIR/key-b"

stream_body() { jq -nc --arg c "$1" '{model: "inf-chat", stream: true, messages: [{role: "user", content: $c}]}'; }

echo "== root calls the model (its first call starts the worker as a Slurm job)"
for i in 1 2 3; do
    out="$(curl -s --max-time 90 -w '\n%{http_code}' -H "Authorization: Bearer $MT_KEY" -H 'content-type: application/json' \
        -d "$(stream_body "root call $i")" "http://$MT_GW/v1/chat/completions" || true)"
    [ "$(tail -n1 <<<"$out")" = 200 ] || models_fail "root call $i: expected 200, got: $(tail -n 3 <<<"$out")"
done
job="$(models_field inf-chat worker_id)"
[ -n "$job" ] && [ "$(models_jobs inf-chat)" = "$job" ] || models_fail "expected the worker's Slurm job in squeue, got '$(models_jobs inf-chat)' (worker_id '$job')"
echo "   ok: 3 calls answered by Slurm job $job"

echo "== $LAB_USER calls the same worker, as itself"
out="$(cd /tmp && runuser -u "$LAB_USER" -- curl -s --max-time 90 -w '\n%{http_code}' -H "@$MT_DIR/key-b" -H 'content-type: application/json' \
    -d "$(stream_body "lab call")" "http://$MT_GW/v1/chat/completions" || true)"
[ "$(tail -n1 <<<"$out")" = 200 ] || models_fail "$LAB_USER's call: expected 200, got: $(tail -n 3 <<<"$out")"
[ "$(models_field inf-chat worker_id)" = "$job" ] || models_fail "$LAB_USER's call was served by another worker ($(models_field inf-chat worker_id), not $job)"
echo "   ok: answered by the same job $job"

echo "== the worker goes idle, is cancelled, Slurm ends the job"
models_wait_state inf-chat unloaded 30
for ((i = 0; i < 300; i++)); do [ -z "$(models_jobs inf-chat)" ] && break; sleep 0.1; done
[ -z "$(models_jobs inf-chat)" ] || models_fail "job $job is still in squeue after the unload"

echo "== gpuhub usage splits the job once it is closed (Slurm's end + 30 s)"
usage=""
for ((i = 0; i < 120; i++)); do
    usage="$("$MT_CLI" --socket "$SOCK" usage --since 1h --json)"
    [ "$(jq --argjson j "$job" '[(.inference_jobs // [])[] | select(.job_id == $j and .settled)] | length' <<<"$usage")" = 1 ] && break
    sleep 1
done
wj="$(jq -c --argjson j "$job" '(.inference_jobs // [])[] | select(.job_id == $j)' <<<"$usage")"
if [ "$(jq -r .settled <<<"$wj")" != true ]; then
    db="$MT_DIR/state/gpuhub.db"
    models_fail "worker job $job was not split and stored within 120 s: $(jq -c .inference_jobs <<<"$usage")
   the store's worker record: $(sqlite3 "$db" "SELECT * FROM inference_workers WHERE job_id = $job" 2>&1)
   the store's job: $(sqlite3 "$db" "SELECT node, job_id, uid, user_name, start_us, end_us, first_seen_us FROM acct_jobs WHERE job_id = $job" 2>&1)
   Slurm: $(SLURM_TIME_FORMAT=%s scontrol show job -o "$job" 2>&1 | grep -o 'JobState=[^ ]*\|UserId=[^ ]*\|StartTime=[^ ]*\|EndTime=[^ ]*\|NodeList=[^ ]*' | tr '\n' ' ')"
fi
echo "   job $job: $wj"
share() { jq -r --arg u "$1" --arg k "$2" '[.shares[] | select(.user == $u) | .[$k]] | add // 0' <<<"$wj"; }
a_shard="$(share root shard_us)" b_shard="$(share "$LAB_USER" shard_us)"
a_gpu="$(share root gpu_us)" b_gpu="$(share "$LAB_USER" gpu_us)"
[ "$(jq '.shares | length' <<<"$wj")" = 2 ] || models_fail "expected exactly two callers (root, $LAB_USER) of job $job: $wj"
[ $((a_shard + a_gpu)) -gt 0 ] && [ $((b_shard + b_gpu)) -gt 0 ] || models_fail "both callers must get a share: root $a_gpu/$a_shard, $LAB_USER $b_gpu/$b_shard (GPU/shard us)"
[ "$(share root calls)" = 3 ] && [ "$(share "$LAB_USER" calls)" = 1 ] || models_fail "calls per caller: root $(share root calls) (3), $LAB_USER $(share "$LAB_USER" calls) (1)"

echo "== against Slurm's own accounting (sacct)"
sacct_out=""
for ((i = 0; i < 120; i++)); do
    sacct_out="$(SLURM_TIME_FORMAT=%s sacct -n -X -P -j "$job" -o JobID,State,AllocTRES,ElapsedRaw,User 2>&1 || true)"
    awk -F'|' '$4 ~ /^[0-9]+$/ && $2 != "RUNNING" && $2 != "PENDING"' <<<"$sacct_out" | grep -q . && break
    sleep 0.5
done
echo "   | $sacct_out"
line="$(awk -F'|' -v j="$job" '$1 == j' <<<"$sacct_out" | head -n1)"
[ -n "$line" ] || models_fail "sacct does not list job $job as ended within 60 s: $sacct_out"
tres="$(cut -d'|' -f3 <<<"$line")" elapsed="$(cut -d'|' -f4 <<<"$line")" suser="$(cut -d'|' -f5 <<<"$line")"
n_shard="$(grep -o 'gres/shard=[0-9]*' <<<"$tres" | cut -d= -f2 || true)" n_gpu="$(grep -o 'gres/gpu=[0-9]*' <<<"$tres" | cut -d= -f2 || true)"
n_shard="${n_shard:-0}" n_gpu="${n_gpu:-0}"
[ $((n_shard + n_gpu)) -gt 0 ] || models_fail "sacct's AllocTRES for job $job names no gres/gpu or gres/shard: $tres"
want_shard=$((n_shard * elapsed * 1000000)) want_gpu=$((n_gpu * elapsed * 1000000))
got_shard=$((a_shard + b_shard)) got_gpu=$((a_gpu + b_gpu))
echo "   sacct: $suser, AllocTRES $tres, ElapsedRaw $elapsed s -> $want_gpu GPU-us, $want_shard shard-us"
echo "   gpuhub: root $a_gpu + $b_gpu GPU-us, $a_shard + $b_shard shard-us ($LAB_USER second)"
[ "$got_shard" = "$want_shard" ] && [ "$got_gpu" = "$want_gpu" ] \
    || models_fail "the callers' shares ($got_gpu GPU-us, $got_shard shard-us) differ from sacct's ($want_gpu, $want_shard) for job $job"
[ "$(jq -r .shard_us <<<"$wj")" = "$want_shard" ] || models_fail "the job's stored total differs from sacct: $wj"
echo "   ok: the shares sum to sacct's AllocTRES x ElapsedRaw exactly"

echo "== the worker account is no user of that time; the table shows inference"
[ "$(jq --arg u "$suser" '[.rows[] | select(.user == $u) | .gpu_seconds + .shard_seconds] | add // 0' <<<"$usage")" = 0 ] \
    || models_fail "the worker account $suser is billed as a user: $(jq -c .rows <<<"$usage")"
for u in root "$LAB_USER"; do
    jq -e --arg u "$u" '.rows[] | select(.user == $u) | .inference_shard_seconds + .inference_gpu_seconds > 0' <<<"$usage" >/dev/null \
        || models_fail "gpuhub usage --by user shows no inference for $u: $(jq -c .rows <<<"$usage")"
done
table="$("$MT_CLI" --socket "$SOCK" usage --since 1h)"
printf '%s\n' "$table" | sed 's/^/   | /'
grep -q '^inference:' <<<"$table" && grep -q "^$LAB_USER .* inf-b .* inf-chat" <<<"$table" \
    || models_fail "the usage table lacks the inference section with $LAB_USER/inf-b/inf-chat"

echo "== /metrics: gpuhub_inference_shard_seconds_total per caller"
m=""
for ((i = 0; i < 50; i++)); do
    m="$(curl -s --max-time 2 "http://$MT_METRICS/metrics" | grep '^gpuhub_inference_\(gpu\|shard\)_seconds_total{' || true)"
    grep -q "user=\"$LAB_USER\"" <<<"$m" && break
    sleep 0.2
done
printf '%s\n' "$m" | sed 's/^/   | /'
grep -q "app=\"inf-b\"" <<<"$m" && grep -q "app=\"models-test\"" <<<"$m" || models_fail "the inference counters lack a caller"
sum="$(awk -v k="$([ "$n_shard" -gt 0 ] && echo shard || echo gpu)" '$1 ~ "^gpuhub_inference_" k "_seconds_total" && $1 ~ /model="inf-chat"/ {s += $2} END {printf "%.3f", s}' <<<"$m")"
want="$(awk -v a="$want_shard" -v b="$want_gpu" 'BEGIN {printf "%.3f", (a > 0 ? a : b) / 1e6}')"
[ "$sum" = "$want" ] || models_fail "the inference counters sum to $sum s, sacct says $want s"
echo "   ok: counters sum to $sum s"
echo "PASS: accounting-inference"
