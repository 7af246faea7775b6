#!/usr/bin/env bash
# More than one GPU node (#18): switches the lab to two nodes (GPUHUB_LAB_NODES=2
# tests/lab/up.sh: gpu01 and gpu02 in their own namespaces, an agent each, one PostgreSQL) and
# proves, with gpu01's GPUs held by a blocker job so every worker lands on gpu02:
#  1. a job on gpu02 calls the gateway on gpu01 (the GPUHUB_URL it was given) with its injected
#     credential, and the store attributes the call to its user and job;
#  2. the model that call needs (dots.ocr, the TEST worker) starts on gpu02, binds gpu02's
#     address (workers.host = "node") and is served through gpu01's gateway;
#  3. gpu02's gateway routes dots.ocr to gpu01's worker (one worker per model across gateways,
#     models/single_flight) and starts its own worker of SmolLM2-135M-Instruct; restarting
#     gpu02's agent adopts its worker and leaves gpu01's alone, restarting gpu01's agent the
#     other way round (ownership in the store, migration 0014); both still serve afterwards;
#     each agent's `workers.vram_gib` is 8 GiB, what dots.ocr alone takes: the worker gpu02
#     routes to is gpu01's, so it does not count against gpu02's budget (SmolLM2 still starts);
#  3b. gpu01's worker on gpu02 killed between calls: the next call through gpu01 is answered by a
#     new worker (not a 502);
#  4. a shard job on each node: the shard-seconds the store holds for them (read through gpu01's
#     agent: `gpuhub job` shows every node) equal sacct's, per job and in sum;
#  5. a job requeued from gpu01 that runs again on gpu02 while gpu01's agent is down: gpu01's
#     agent closes its run there at sacct's End of that run (`--duplicates`), not approximately.
# Restores the one-node lab at exit. About 100 s (two lab re-ups of ~30 s each).
# timeout: 360
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lab/nodes.sh"
lab_require
lab_user
NODES_SH="$REPO/tests/lab/nodes.sh"
PSQL=(psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -d "$NODES_PG_DB" -tAq)
# Each agent may hold 8 GiB of workers: dots.ocr's 8.0 exactly (tests/lab/agent.toml).
export NODES_VRAM_GIB=8

fail() { nodes_test_fail "$@"; }
lab_cleanup_add nodes_test_restore
lab_wait_gpus_free 240

echo "== two nodes: GPUHUB_LAB_NODES=2 tests/lab/up.sh"
GPUHUB_LAB_NODES=2 GPUHUB_LAB_BUILD=0 "$REPO/tests/lab/up.sh" 2>&1 | grep -E '^\[lab\] (up|two nodes|starting|ERROR)' || true
[ "$(sinfo -h -n gpu01,gpu02 -o '%n %T' | sort | tr '\n' ' ')" = "gpu01 idle gpu02 idle " ] ||
    fail "both nodes must be idle: $(sinfo -h -n gpu01,gpu02 -o '%n %T %E' | tr '\n' ';')"
[ "$(nodes_exec gpu02 hostname)" = gpu02 ] || fail "gpu02's namespace has host name '$(nodes_exec gpu02 hostname)'"
nodes_agent_healthy gpu01 && nodes_agent_healthy gpu02 || fail "an agent does not answer /healthz"

# gpu01's GPUs are busy: every worker (2 shards) goes to gpu02.
blocker="$(cd /tmp && sbatch --parsable -J gpuhub-test-blocker -w gpu01 --gres=gpu:2 -t 5 -o /dev/null --wrap 'sleep 300')"
for _ in $(seq 50); do [ "$(squeue -h -j "$blocker" -o %T)" = RUNNING ] && break; sleep 0.2; done
[ "$(squeue -h -j "$blocker" -o %T)" = RUNNING ] || fail "the blocker job $blocker does not run on gpu01"

# call NODE GATEWAY [MODEL]: a job of $LAB_USER on NODE posts one chat call for MODEL (default
# dots.ocr) to GATEWAY (default: the GPUHUB_URL it was given) with its injected credential;
# prints JOB STATUS URL.
call() {
    (cd /tmp && runuser -u "$LAB_USER" -- srun -w "$1" -t 2 -J multinode-call sh -c '
        url="${0:-$GPUHUB_URL}"
        code="$(curl -s -o /dev/null -w "%{http_code}" --max-time 90 "$url/v1/chat/completions" \
            -H "Authorization: Bearer $OPENAI_API_KEY" -H content-type:application/json \
            -d "{\"model\":\"$1\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":4}")"
        echo "$SLURM_JOB_ID $code $GPUHUB_URL"' "${2:-}" "${3:-dots.ocr}")
}

echo "== 1+2. a job on gpu02 calls gpu01's gateway; the worker starts on gpu02"
read -r job code url < <(call gpu02) || fail "the job on gpu02 did not run"
echo "   job $job: HTTP $code via GPUHUB_URL=$url"
[ "$url" = "$NODES_GATEWAY" ] || fail "the job on gpu02 was told GPUHUB_URL=$url, not gpu01's gateway $NODES_GATEWAY"
[ "$code" = 200 ] || fail "the call from gpu02 through gpu01's gateway got HTTP $code"
row=""
for _ in $(seq 40); do   # the gateway writes its call log in the background
    row="$("${PSQL[@]}" -c "SELECT user_name, job_id, status FROM usage_log WHERE job_id = $job AND resolved_model = 'dots.ocr'" | head -n1)"
    [ -n "$row" ] && break
    sleep 0.25
done
[ "$row" = "$LAB_USER|$job|200" ] || fail "the store does not attribute the call to $LAB_USER and job $job: '$row'"
w1="$("${PSQL[@]}" -c "SELECT instance_id || ' ' || base_url FROM model_workers WHERE owner = 'gpu01' AND model = 'dots.ocr'")"
read -r w1_job w1_url <<<"$w1"
[ -n "${w1_job:-}" ] || fail "gpu01's agent recorded no dots.ocr worker in the store"
[ "$(squeue -h -j "$w1_job" -o %N)" = gpu02 ] || fail "gpu01's worker job $w1_job runs on '$(squeue -h -j "$w1_job" -o %N)', not gpu02"
case "$w1_url" in "http://$(nodes_ip gpu02):"*) ;; *) fail "gpu01's worker on gpu02 listens at '$w1_url', not gpu02's address" ;; esac
proof="$(cat "$NODES_WORKERS/gpu01/dots.ocr.$w1_job.proof")" || fail "worker job $w1_job wrote no proof of its port"
[ "$proof" = "$w1_job ${w1_url##*:} ok" ] || fail "worker job $w1_job's proof says '$proof'"
echo "   worker $w1_job (owner gpu01) on gpu02 at $w1_url, port proven by its job"
# The job's proof counts only the sockets a call to the worker's address reaches: $LAB_USER
# on gpu02's 127.0.0.1:P beside a worker-account socket on gpu02's address:P neither fails the
# proof nor is taken for the worker (the same binary, as the worker account, in gpu02's
# namespace); without the address it is counted, so the check can tell the two apart.
PD="$(mktemp -d)"; chmod 777 "$PD"
lab_cleanup_add "kill \$(cat '$PD'/*.pid 2>/dev/null) 2>/dev/null || true; rm -rf '$PD'"
listen_as() { # listen_as USER ADDR PORT NAME: a socket of USER listening on ADDR:PORT in gpu02 for 60 s
    nodes_exec gpu02 runuser -u "$1" -- python3 -c 'import os,socket,sys,time
s=socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
open(sys.argv[3] + ".pid", "w").write(str(os.getpid())); time.sleep(60)' "$2" "$3" "$PD/$4" 2>"$PD/$4.err" &
    for _ in $(seq 50); do [ -s "$PD/$4.pid" ] && return 0; sleep 0.1; done
    fail "no socket of $1 on $2:$3 in gpu02: $(cat "$PD/$4.err")"
}
port="$(nodes_exec gpu02 python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
listen_as "$LAB_USER" 127.0.0.1 "$port" beside
listen_as gpuhub-worker "$(nodes_ip gpu02)" "$port" worker
prove() { nodes_exec gpu02 runuser -u gpuhub-worker -- env ${2:+GPUHUB_PROOF_HOST="$2"} "$REPO/target/release/gpuhub-agent" worker-proof "$port" 7 "$PD/$1.proof" 5 && cat "$PD/$1.proof"; }
got="$(prove to-node "$(nodes_ip gpu02)")" || fail "worker-proof on gpu02 failed: $got"
[ "$got" = "7 $port ok" ] || fail "$LAB_USER's socket on gpu02's 127.0.0.1:$port beside the worker on $(nodes_ip gpu02):$port: the proof says '$got', not ok"
got="$(prove anywhere)" || fail "worker-proof on gpu02 (no address) failed: $got"
[ "$got" = "7 $port uid $(id -u "$LAB_USER")" ] || fail "without the worker's address the proof does not see $LAB_USER's socket: '$got'"
kill "$(cat "$PD/beside.pid")" "$(cat "$PD/worker.pid")" 2>/dev/null || true
echo "   a socket of $LAB_USER on gpu02's 127.0.0.1:$port beside a worker on gpu02's address: not counted by the job's proof"

echo "== 3. gpu02's gateway routes to gpu01's worker and starts its own of another model; restarts leave the other agent's worker alone"
read -r job2 code2 _ < <(call gpu01 "http://$(nodes_ip gpu02):8400") || fail "the job on gpu01 did not run"
[ "$code2" = 200 ] || fail "the call to gpu02's gateway got HTTP $code2"
[ "$("${PSQL[@]}" -c "SELECT string_agg(owner || ':' || instance_id, ' ') FROM model_workers WHERE model = 'dots.ocr'")" = "gpu01:$w1_job" ] ||
    fail "gpu02's gateway started a second dots.ocr worker instead of routing to gpu01's $w1_job"
read -r _ code2 _ < <(call gpu01 "http://$(nodes_ip gpu02):8400" SmolLM2-135M-Instruct) || fail "the job on gpu01 did not run"
[ "$code2" = 200 ] || fail "the SmolLM2-135M-Instruct call to gpu02's gateway got HTTP $code2 (see $NODES_DIR/gpu02/agent.log)"
# gpu02 routes to gpu01's dots.ocr worker: that holds nothing of gpu02's 8 GiB, so SmolLM2 fit
# without unloading the route to it (which frees no memory here).
! grep -E "evicting the least recently used idle model.*victim=dots\.ocr" "$NODES_DIR/gpu02/agent.log" ||
    fail "gpu02's agent counted gpu01's dots.ocr worker, which it only routes to, against its workers.vram_gib and evicted it"
st="$(nodes_exec gpu02 "$REPO/target/release/gpuhub" models list --json | jq -r '.models[] | select(.name == "dots.ocr") | .state')"
[ "$st" = ready ] || fail "gpu02's agent shows dots.ocr (gpu01's worker) '$st' after starting SmolLM2, not ready"
w2_job="$("${PSQL[@]}" -c "SELECT instance_id FROM model_workers WHERE owner = 'gpu02' AND model = 'SmolLM2-135M-Instruct'")"
[ -n "$w2_job" ] && [ "$w2_job" != "$w1_job" ] || fail "gpu02's agent recorded no worker of its own ('$w2_job'; gpu01's is $w1_job)"
for n in gpu02 gpu01; do
    : > "$NODES_DIR/$n/agent.log"
    "$NODES_SH" agent-stop "$n"
    "$NODES_SH" agent-start "$n" 60 || fail "$n's agent did not come back"
    for j in "$w1_job" "$w2_job"; do
        [ "$(squeue -h -j "$j" -o %T)" = RUNNING ] || fail "worker job $j is '$(squeue -h -j "$j" -o %T)' after $n's agent restarted"
    done
    mine="$([ "$n" = gpu01 ] && echo "$w1_job" || echo "$w2_job")"
    other="$([ "$n" = gpu01 ] && echo "$w2_job" || echo "$w1_job")"
    grep -E "adopting a worker.*worker=$mine\b" "$NODES_DIR/$n/agent.log" >/dev/null || fail "$n's agent did not adopt its worker $mine"
    ! grep -qE "(job|worker)=$other\b" "$NODES_DIR/$n/agent.log" || fail "$n's agent touched the other agent's worker $other: $(grep -E "(job|worker)=$other\b" "$NODES_DIR/$n/agent.log")"
    echo "   $n restarted: adopted $mine, left $other alone"
done
read -r _ code _ < <(call gpu02) || fail "the job on gpu02 did not run"
[ "$code" = 200 ] || fail "after both restarts, gpu01's gateway got HTTP $code"
[ "$("${PSQL[@]}" -c "SELECT instance_id FROM model_workers WHERE owner = 'gpu01' AND model = 'dots.ocr'")" = "$w1_job" ] ||
    fail "gpu01's gateway no longer serves through its adopted worker $w1_job"

echo "== 3b. gpu01's worker on gpu02 dies between calls: the next call through gpu01 gets a new worker"
port="${w1_url##*:}"
wpid="$(nodes_exec gpu02 ss -Hltnp "sport = :$port" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1)"
[ -n "$wpid" ] || fail "cannot find the process of worker $w1_job listening at $w1_url on gpu02"
key="$(nodes_exec gpu01 "$REPO/target/release/gpuhub" keys create --user "$LAB_USER" --app multinode-dead-worker | tail -n 1)"
kill -9 "$wpid"
code="$(curl -s -o "$NODES_DIR/after-kill.json" -w '%{http_code}' --max-time 120 -H "Authorization: Bearer $key" \
    -H 'content-type: application/json' -d '{"model": "dots.ocr", "messages": [{"role": "user", "content": "hi"}]}' \
    "$NODES_GATEWAY/v1/chat/completions" || true)"
[ "$code" = 200 ] || fail "the call right after gpu01's worker on gpu02 died got HTTP $code: $(cat "$NODES_DIR/after-kill.json")"
w1b="$("${PSQL[@]}" -c "SELECT instance_id FROM model_workers WHERE owner = 'gpu01' AND model = 'dots.ocr'")"
[ -n "$w1b" ] && [ "$w1b" != "$w1_job" ] || fail "expected a new dots.ocr worker of gpu01's after $w1_job died, the store has '$w1b'"
if grep -qF "the model's worker is gone; the call, sent nowhere yet, waits for the model again" "$NODES_DIR/gpu01/agent.log"; then
    echo "   ok: the call found worker $w1_job dead, waited, and was answered by $w1b"
else
    echo "   ok: answered by $w1b (gpu01's agent had seen $w1_job end before the call)"
fi

echo "== 4. usage summed over both nodes equals sacct (a shard:3 job on each node)"
lab_cancel "$blocker"
t_submit="$(date +%s)"
declare -A SJ
for n in gpu01 gpu02; do
    SJ[$n]="$(cd /tmp && runuser -u "$LAB_USER" -- srun -w "$n" -t 1 --gres=shard:3 -J multinode-usage sh -c 'echo $SLURM_JOB_ID; sleep 2' | tail -n1)"
    [ -n "${SJ[$n]}" ] || fail "the shard job on $n did not run"
done
ids="${SJ[gpu01]},${SJ[gpu02]}"
for _ in $(seq 120); do
    sacct_out="$(SLURM_TIME_FORMAT=%s sacct -n -X -P -j "$ids" -o JobID,State,AllocTRES,ElapsedRaw,NodeList 2>/dev/null || true)"
    [ "$(grep -c '|COMPLETED|' <<<"$sacct_out")" = 2 ] && break
    sleep 0.5
done
[ "$(grep -c '|COMPLETED|' <<<"$sacct_out")" = 2 ] || fail "sacct does not list jobs $ids as COMPLETED: $sacct_out"
for n in gpu01 gpu02; do   # through gpu01's agent: the store holds every node's jobs
    for _ in $(seq 100); do
        [ "$(nodes_exec gpu01 "$REPO/target/release/gpuhub" job "${SJ[$n]}" --json 2>/dev/null | jq '.nodes[0].end_us // null')" != null ] && break
        sleep 0.2
    done
    nodes_exec gpu01 "$REPO/target/release/gpuhub" job "${SJ[$n]}" --json > "/tmp/multinode-job-$n.json" 2>&1 ||
        fail "gpuhub job ${SJ[$n]} (on $n) through gpu01's agent: $(cat "/tmp/multinode-job-$n.json")"
done
lab_cleanup_add "rm -f /tmp/multinode-job-gpu01.json /tmp/multinode-job-gpu02.json"
python3 - "$sacct_out" "$t_submit" /tmp/multinode-job-gpu01.json /tmp/multinode-job-gpu02.json <<'PY' || fail "usage over both nodes differs from sacct (above)"
import json, sys
sacct, t_submit = sys.argv[1], int(sys.argv[2])
rows = {f[0]: f for f in (l.split("|") for l in sacct.splitlines()) if len(f) == 5}
TOL, bad, sum_g, sum_s = 1.5, [], 0.0, 0
for path, node in zip(sys.argv[3:], ("gpu01", "gpu02")):
    j = json.load(open(path))
    n = j["nodes"][0]
    f = rows.get(str(j.get("job_id", n.get("job_id", ""))))
    if f is None:
        f = next((r for r in rows.values() if r[4] == node), None)
    if f is None:
        bad.append(f"{node}: no sacct row"); continue
    tres = dict(kv.split("=", 1) for kv in f[2].split(",") if "=" in kv)
    shards, el = int(tres.get("gres/shard", 0)), int(f[3])
    print(f"{node}: job {f[0]} on {f[4]}: gpuhub {n['shard_seconds']:.3f} shard-s ({n.get('node')}), sacct {shards} x {el} s")
    if f[4] != node or n.get("node") != node: bad.append(f"{node}: sacct node {f[4]}, gpuhub node {n.get('node')}")
    if abs(n["shard_seconds"] - shards * el) > shards * TOL: bad.append(f"{node}: shard-seconds {n['shard_seconds']:.3f} vs {shards} x {el}")
    sum_g += n["shard_seconds"]; sum_s += shards * el
print(f"sum over both nodes: gpuhub {sum_g:.3f} shard-s, sacct {sum_s} shard-s")
if abs(sum_g - sum_s) > 2 * 3 * TOL: bad.append(f"sum: gpuhub {sum_g:.3f}, sacct {sum_s}")
for b in bad: print("MISMATCH:", b)
sys.exit(1 if bad else 0)
PY

echo "== 5. a job requeued from gpu01 runs again on gpu02 while gpu01's agent is down: its run on gpu01 ends at sacct's End of that run"
rq="$(cd /tmp && runuser -u "$LAB_USER" -- sbatch --parsable --requeue -x gpu02 -t 2 --gres=shard:1 -J multinode-requeue -o /dev/null --wrap 'sleep 12')"
lab_cleanup_add "scancel $rq 2>/dev/null"
on() { squeue -h -j "$rq" -o '%T %N' 2>/dev/null; }
for _ in $(seq 100); do [ "$(on)" = "RUNNING gpu01" ] && break; sleep 0.2; done
[ "$(on)" = "RUNNING gpu01" ] || fail "job $rq does not run on gpu01: '$(on)'"
gj() { nodes_exec gpu01 "$REPO/target/release/gpuhub" job "$rq" --json 2>/dev/null; }
for _ in $(seq 100); do [ "$(gj | jq '[.nodes[] | select(.node == "gpu01")] | length')" = 1 ] && break; sleep 0.2; done
[ "$(gj | jq '[.nodes[] | select(.node == "gpu01")] | length')" = 1 ] || fail "gpu01's agent did not record job $rq: $(gj)"
"$NODES_SH" agent-stop gpu01
runuser -u "$LAB_USER" -- scontrol requeue "$rq" || fail "its owner could not requeue job $rq"
for _ in $(seq 100); do [ "$(on)" = "PENDING " ] && break; sleep 0.2; done
scontrol update JobId="$rq" ExcNodeList=gpu01 StartTime=now || fail "cannot move job $rq to gpu02"
for _ in $(seq 150); do [ "$(on)" = "RUNNING gpu02" ] && break; sleep 0.2; done
[ "$(on)" = "RUNNING gpu02" ] || fail "requeued job $rq does not run on gpu02: '$(on)'"
"$NODES_SH" agent-start gpu01 60 || fail "gpu01's agent did not come back"
for _ in $(seq 150); do [ "$(gj | jq '.nodes[] | select(.node == "gpu01") | .end_us // null')" != null ] && break; sleep 0.2; done
first_end="$(SLURM_TIME_FORMAT=%s sacct -n -X -P -D -j "$rq" -o NodeList,End 2>/dev/null | awk -F'|' '$1 == "gpu01" {print $2; exit}')"
[[ "$first_end" =~ ^[0-9]+$ ]] || fail "sacct --duplicates has no ended run of job $rq on gpu01: $(sacct -n -X -P -D -j "$rq" -o JobID,NodeList,Start,End,State 2>&1)"
gj | python3 -c '
import json, sys
first_end = int(sys.argv[1])
runs = [n for n in json.load(sys.stdin)["nodes"] if n.get("node") == "gpu01"]
kinds = [a.get("kind") if isinstance(a, dict) else a for n in runs for a in n.get("anomalies", [])]
end = (runs[0].get("end_us") or 0) / 1e6 if runs else 0
print(f"   gpu01 run: end {end:.0f}, sacct --duplicates End {first_end}; anomalies {kinds}")
sys.exit(0 if len(runs) == 1 and abs(end - first_end) <= 2 and "end_approximate" not in kinds else 1)
' "$first_end" || fail "job $rq: its run on gpu01 is not closed at sacct's End of that run: $(gj)"
lab_cancel "$rq"

nodes_test_restore || exit 1
echo "PASS: jobs on gpu02 reach gpu01's gateway and are attributed; workers on gpu02 serve gpu01's gateway; each agent keeps to its own workers; usage over both nodes equals sacct; a job requeued to the other node is closed at its real end"
