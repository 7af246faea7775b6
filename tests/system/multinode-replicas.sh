#!/usr/bin/env bash
# Replicas (#18) on the two-node lab: gpu01's agent serves `dots-r` (the TEST worker, each call
# ~1.5 s: --token-delay-ms) with min_replicas = 0, max_replicas = 2, target_in_flight = 1 and a
# 6 s idle timeout, and proves:
#  1. under load (a job on gpu02 keeps 4 calls in flight through gpu01's gateway) the model
#     scales to 2 replicas, one on gpu01 and one on gpu02 (`gpuhub models --json` and squeue's
#     node list), the store holds one row per replica, both replicas serve calls
#     (least-outstanding routing: each had calls in flight), and no call fails;
#  2. killing one replica's worker (SIGKILL, its job ends) mid-call fails that call with a 502 naming the model and the
#     worker that died, and the next call succeeds on the other replica;
#  3. idle: back to 0 replicas (no worker job left, the model `unloaded`).
# Restores the one-node lab at exit. 95 s under tests/run-all.sh (two lab re-ups of ~30 s each).
# timeout: 300
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lab/nodes.sh"
lab_require
lab_user
NODES_SH="$REPO/tests/lab/nodes.sh"
PSQL=(psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -d "$NODES_PG_DB" -tAq)
EXTRA=/tmp/gpuhub-replicas-models.toml
OUT=/tmp/gpuhub-replicas
MODEL=dots-r

fail() { nodes_test_fail "$@"; }
restore() {
    rm -f "$EXTRA"
    rm -rf "$OUT"
    nodes_test_restore
}
lab_cleanup_add restore
lab_wait_gpus_free 240
rm -rf "$OUT" && mkdir -p "$OUT" && chmod 755 "$OUT"

cat > "$EXTRA" <<'TOML'

[[models]]
name = "dots-r"
launcher = "slurm"
command = "/usr/local/libexec/gpuhub/gpuhub-test-worker --model {model} --host {host} --port {port} --api-key-file {api_key_file} --token-delay-ms 100"
resources = { shards = 2, vram_gib = 8.0 }
idle_timeout_s = 6
load_timeout_s = 60
health_path = "/health"
min_replicas = 0
max_replicas = 2
target_in_flight = 1
scale_up_after_s = 1
probe_interval_s = 1
TOML

echo "== two nodes: GPUHUB_LAB_NODES=2 tests/lab/up.sh; gpu01's agent serves $MODEL (max_replicas = 2)"
GPUHUB_LAB_NODES=2 GPUHUB_LAB_BUILD=0 "$REPO/tests/lab/up.sh" 2>&1 | grep -E '^\[lab\] (up|two nodes|ERROR)' || true
"$NODES_SH" agent-stop gpu01
GPUHUB_LAB_NODES_EXTRA="$EXTRA" "$NODES_SH" agent-start gpu01 60 || fail "gpu01's agent did not start with $MODEL"
nodes_agent_healthy gpu02 || fail "gpu02's agent does not answer /healthz"

models() { nodes_exec gpu01 "$REPO/target/release/gpuhub" models list --json 2>/dev/null | jq -c ".models[] | select(.name == \"$MODEL\")"; }

# calls N ROUNDS WORDS: a job of $LAB_USER on gpu02 runs ROUNDS rounds of N concurrent calls
# through gpu01's gateway (its injected credential); prints one HTTP status per call, then the
# bodies of the failed ones.
calls() {
    (cd /tmp && runuser -u "$LAB_USER" -- srun -w gpu02 -t 3 -J replicas-load sh -c '
        n="$0"; rounds="$1"; words="$2"; out="$3"
        body="{\"model\":\"dots-r\",\"messages\":[{\"role\":\"user\",\"content\":\"$words\"}]}"
        r=0
        while [ "$r" -lt "$rounds" ]; do
            i=0
            while [ "$i" -lt "$n" ]; do
                curl -s -o "$out/body.$$.$r.$i" -w "%{http_code}\n" --max-time 90 "$GPUHUB_URL/v1/chat/completions" \
                    -H "Authorization: Bearer $OPENAI_API_KEY" -H content-type:application/json -d "$body" &
                i=$((i + 1))
            done
            wait
            r=$((r + 1))
        done
        grep -L "chat.completion" "$out"/body.$$.* 2>/dev/null | xargs -r cat
        rm -f "$out"/body.$$.*' "$@" "$OUT")
}

echo "== 1. load: 4 calls in flight for ~25 s scale $MODEL to 2 replicas, one per node"
chmod 777 "$OUT"
calls 4 16 "one two three four five six seven eight" > "$OUT/load.txt" 2>&1 &
load_pid=$!
seen_busy=""
two=""
for _ in $(seq 160); do
    m="$(models || true)"
    [ -n "$m" ] || { sleep 0.25; continue; }
    # Each replica that has calls in flight now (least-outstanding routing spreads them).
    for j in $(jq -r '.replicas[] | select(.in_flight > 0) | .job_id' <<<"$m"); do
        case " $seen_busy " in *" $j "*) ;; *) seen_busy="$seen_busy $j" ;; esac
    done
    if [ "$(jq '[.replicas[] | select(.state == "ready")] | length' <<<"$m")" = 2 ]; then
        two="$m"
        [ "$(wc -w <<<"$seen_busy")" -ge 2 ] && break
    fi
    sleep 0.25
done
[ -n "$two" ] || fail "$MODEL never had 2 ready replicas under load: $(models)"
echo "   replicas: $(jq -c '[.replicas[] | {job_id, node, state, health, in_flight, base_url}]' <<<"$two")"
nodes_json="$(jq -r '[.replicas[].node] | sort | join(",")' <<<"$two")"
[ "$nodes_json" = "gpu01,gpu02" ] || fail "the 2 replicas run on '$nodes_json' (gpuhub models), not one on each node"
jobs="$(jq -r '[.replicas[].job_id] | join(",")' <<<"$two")"
nodes_sq="$(squeue -h -j "$jobs" -o %N | sort | paste -sd, -)"
[ "$nodes_sq" = "gpu01,gpu02" ] || fail "squeue puts the replica jobs $jobs on '$nodes_sq', not gpu01 and gpu02"
for url in $(jq -r '.replicas[] | "\(.node)=\(.base_url)"' <<<"$two"); do
    case "$url" in "${url%%=*}=http://$(nodes_ip "${url%%=*}"):"*) ;; *) fail "replica $url does not listen on its node's address" ;; esac
done
rows="$("${PSQL[@]}" -c "SELECT count(*) FROM model_workers WHERE owner = 'gpu01' AND model = '$MODEL'")"
[ "$rows" = 2 ] || fail "the store holds $rows rows for $MODEL's 2 replicas (one per replica expected)"
[ "$(wc -w <<<"$seen_busy")" -ge 2 ] || fail "only replica(s)$seen_busy ever had calls in flight: calls were not spread"
echo "   both replicas served calls:$seen_busy; squeue: $nodes_sq; store: $rows rows"
wait "$load_pid" || fail "the load job failed: $(cat "$OUT/load.txt")"
total="$(grep -cx '[0-9][0-9][0-9]' "$OUT/load.txt" || true)"
ok="$(grep -cx 200 "$OUT/load.txt" || true)"
[ "$total" = 64 ] && [ "$ok" = 64 ] || fail "under load $ok of $total calls (64 sent) got 200: $(grep -vx 200 "$OUT/load.txt" | head -5)"
echo "   64 of 64 calls answered 200 while scaling"

echo "== 2. a replica killed mid-call fails that call clearly; the next call goes to the other"
words="$(seq 1 40 | sed 's/^/w/' | tr '\n' ' ')"   # ~5 s per call
calls 1 1 "$words" > "$OUT/killed.txt" 2>&1 &
kill_pid=$!
victim=""
for _ in $(seq 80); do
    victim="$(models | jq -r '.replicas[] | select(.in_flight > 0) | .job_id' | head -n1)"
    [ -n "$victim" ] && break
    sleep 0.1
done
[ -n "$victim" ] || fail "the long call never reached a replica"
# Routed is not yet sent: a replica killed before the call reaches it costs no call (the call
# goes to the other one, models-replicas section 5). Mid-call means well into its ~5 s.
sleep 1
survivor="$(models | jq -r --arg v "$victim" '.replicas[] | select(.job_id != $v) | .job_id')"
# The victim's worker process dies (SIGKILL; its job ends with it): scancel's SIGTERM would let
# the worker finish the call first.
read -r vnode vurl < <(models | jq -r --arg v "$victim" '.replicas[] | select(.job_id == $v) | "\(.node) \(.base_url)"')
vpid="$(nodes_exec "$vnode" ss -Hltnp "sport = :${vurl##*:}" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1)"
[ -n "$vpid" ] || fail "cannot find the process of replica $victim listening at $vurl on $vnode"
echo "   kill -9 the worker of replica $victim (pid $vpid on $vnode, serving the call); $survivor serves on"
kill -9 "$vpid"
wait "$kill_pid" || true
code="$(head -n1 "$OUT/killed.txt")"
[ "$code" = 502 ] || fail "the call to the killed replica got '$code', not 502: $(cat "$OUT/killed.txt")"
grep -q "model \`$MODEL\`" "$OUT/killed.txt" && grep -q "worker died" "$OUT/killed.txt" && grep -q retry "$OUT/killed.txt" ||
    fail "the 502 does not name the model and say its worker died (retry): $(cat "$OUT/killed.txt")"
echo "   the call got 502: $(sed -n 2p "$OUT/killed.txt" | jq -r .error.message)"
calls 1 1 "after" > "$OUT/next.txt" 2>&1 || true
[ "$(head -n1 "$OUT/next.txt")" = 200 ] || fail "the next call did not go to the other replica: $(cat "$OUT/next.txt")"
left=""
for _ in $(seq 40); do
    left="$(models | jq -r '[.replicas[] | .job_id] | join(",")')"
    [ "$left" = "$survivor" ] && break
    sleep 0.25
done
[ "$left" = "$survivor" ] || fail "after the kill $MODEL's replicas are '$left', not the survivor $survivor"
echo "   the next call: 200; replicas now: $left"

echo "== 3. idle: back to 0 replicas"
state=""
for _ in $(seq 80); do
    m="$(models)"
    state="$(jq -r '"\(.state) \(.replicas | length)"' <<<"$m")"
    [ "$state" = "unloaded 0" ] && [ -z "$(squeue -h -n "gpuhub-worker-$MODEL" -o %i)" ] && break
    sleep 0.25
done
[ "$state" = "unloaded 0" ] || fail "$MODEL is '$state' after its idle timeout, not 'unloaded 0'"
[ -z "$(squeue -h -n "gpuhub-worker-$MODEL" -o %i)" ] || fail "worker jobs left: $(squeue -h -n "gpuhub-worker-$MODEL" -o '%i %N %T')"
[ "$("${PSQL[@]}" -c "SELECT count(*) FROM model_workers WHERE model = '$MODEL'")" = 0 ] || fail "the store still remembers $MODEL workers"
echo "   $MODEL unloaded, no worker job, no row"
echo "PASS multinode-replicas"
