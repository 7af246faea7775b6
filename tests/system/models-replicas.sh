#!/usr/bin/env bash
# Replica health and adoption (#18) on the one-node lab, with a test agent of its own
# (tests/lib/models.sh) and the TEST worker for the fault (`--unhealthy-file`: its /health
# answers 503 while the file exists, while it still listens and answers calls, as a server whose
# engine died). `mt-rh`: min_replicas = max_replicas = 2, probe_interval_s = 1,
# unhealthy_after = 2, calls of ~1 s (--token-delay-ms). Proves:
#  1. min_replicas: two replicas (two Slurm jobs) load and are ready and healthy;
#  2. an agent killed with -9 and started again adopts both: the same jobs, ready, no new job,
#     and each made non-requeueable (made requeueable meanwhile, as an older agent left them);
#  3. a replica whose health check fails turns `unhealthy` after unhealthy_after probes
#     (`gpuhub models --json`, gpuhub_model_replicas{state="unhealthy"}) and gets no call while
#     it is: concurrent calls all go to the other replica, and none fails;
#  4. once its health check passes again it is `ready` and takes calls again;
#  5. a replica whose worker dies between calls (SIGKILL, nothing in flight) costs no call: the
#     calls sent before its job's end or a probe shows it (the first goes to it: the oldest
#     replica takes ties) find its port closed, nothing was sent, and the other replica answers
#     them (the agent logs each such reroute); none fails.
# timeout: 240
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
lab_require

MODEL=mt-rh
# The fault files: the worker account must see them (it runs the workers).
HDIR="$(mktemp -d /var/tmp/gpuhub-replica-health.XXXXXX)"
chmod 755 "$HDIR"
lab_cleanup_add "rm -rf $HDIR"
models_setup "
[[models]]
name = \"$MODEL\"
launcher = \"slurm\"
command = \"@WORKER@ --model {model} --host {host} --port {port} --api-key-file {api_key_file} --token-delay-ms 100 --unhealthy-file $HDIR/unhealthy.{port}\"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 600
load_timeout_s = 60
min_replicas = 2
max_replicas = 2
probe_interval_s = 1
unhealthy_after = 2
"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")

# replicas: the model's replicas as [{job_id, state, health, in_flight, base_url}].
replicas() {
    "${CLI[@]}" models list --json | jq -c --arg m "$MODEL" '[.models[] | select(.name == $m) | .replicas[]? | {job_id, state, health, in_flight, base_url}]'
}
# wait_replicas JQ SECS: until the replicas match the jq filter JQ.
wait_replicas() {
    local i
    for ((i = 0; i < $2 * 5; i++)); do
        replicas | jq -e "$1" >/dev/null && return 0
        sleep 0.2
    done
    return 1
}
unhealthy_metric() {
    curl -s --max-time 5 "http://$MT_METRICS/metrics" |
        awk -v m="gpuhub_model_replicas{model=\"$MODEL\",state=\"unhealthy\"}" '$1 == m {print $2}'
}
# load N: N concurrent calls (~1 s each) while the replicas are sampled every 0.1 s; prints
# the most calls each replica (by job id) had in flight at once, as "JOB MAX" lines; fails the
# test unless every call got 200.
load() {
    local n="$1" i pids=() seen="$MT_DIR/seen.$RANDOM" body
    body="$(jq -nc --arg m "$MODEL" '{model: $m, messages: [{role: "user", content: "one two three four five six seven eight"}]}')"
    for ((i = 0; i < n; i++)); do
        curl -s -o /dev/null -w '%{http_code}\n' --max-time 60 -H "Authorization: Bearer $MT_KEY" \
            -H 'content-type: application/json' -d "$body" "http://$MT_GW/v1/chat/completions" >>"$MT_DIR/codes" &
        pids+=($!)
    done
    : >"$seen"
    while kill -0 "${pids[@]}" 2>/dev/null; do
        replicas | jq -r '.[] | "\(.job_id) \(.in_flight)"' >>"$seen"
        sleep 0.1
    done
    wait "${pids[@]}" || true
    awk '{ if (!($1 in m) || $2 > m[$1]) m[$1] = $2 } END { for (j in m) print j, m[j] }' "$seen" | sort
}
# max_of JOB: the most calls JOB had in flight in the last load's output ($LOADED).
max_of() { awk -v j="$1" '$1 == j {print $2}' <<<"$LOADED"; }
check_codes() {
    local total ok
    total="$(wc -l <"$MT_DIR/codes")"
    ok="$(grep -cx 200 "$MT_DIR/codes" || true)"
    [ "$total" = "$1" ] && [ "$ok" = "$1" ] || models_fail "$ok of $total calls ($1 sent) got 200: $(sort "$MT_DIR/codes" | uniq -c | tr '\n' ' ')"
    rm -f "$MT_DIR/codes"
}

echo "== 1. min_replicas = 2: two replicas load, ready and healthy"
models_call "$MODEL" "hello"
[ "$MC_STATUS" = 200 ] || models_fail "the first call to $MODEL got $MC_STATUS: $MC_BODY"
wait_replicas 'length == 2 and all(.[]; .state == "ready" and .health == "ready")' 60 ||
    models_fail "$MODEL should run two ready, healthy replicas: $(replicas)"
jobs_before="$(replicas | jq -r '.[].job_id' | sort | paste -sd' ')"
[ "$(models_jobs "$MODEL" | sort | paste -sd' ')" = "$jobs_before" ] ||
    models_fail "squeue's worker jobs ($(models_jobs "$MODEL" | paste -sd' ')) are not the replicas ($jobs_before)"
echo "   ok: replicas $jobs_before"

echo "== 2. the agent killed (-9) and started again adopts both replicas"
models_agent_kill9
# As an agent from before --no-requeue left them: requeueable. The adopting agent makes them
# non-requeueable (scontrol update Requeue=0).
for j in $jobs_before; do scontrol update JobId="$j" Requeue=1; done
requeue_flags() { for j in $jobs_before; do scontrol show job "$j" | grep -o 'Requeue=[0-9]'; done | sort -u | paste -sd' '; }
[ "$(requeue_flags)" = "Requeue=1" ] || models_fail "the test could not make the worker jobs requeueable: $(requeue_flags)"
models_agent_start
wait_replicas "length == 2 and all(.[]; .state == \"ready\") and ([.[].job_id] | sort | join(\" \")) == \"$jobs_before\"" 60 ||
    models_fail "after a restart the replicas should be the same jobs ($jobs_before), ready: $(replicas)"
[ "$(models_jobs "$MODEL" | sort | paste -sd' ')" = "$jobs_before" ] ||
    models_fail "after a restart the worker jobs are $(models_jobs "$MODEL" | paste -sd' '), not only $jobs_before (a new one started?)"
models_call "$MODEL" "hello again"
[ "$MC_STATUS" = 200 ] || models_fail "a call after the restart got $MC_STATUS: $MC_BODY"
[ "$(requeue_flags)" = "Requeue=0" ] || models_fail "the adopted worker jobs should be non-requeueable: $(requeue_flags)"
echo "   ok: adopted $jobs_before, no new job, both non-requeueable again"

read -r sick sick_url < <(replicas | jq -r '.[0] | "\(.job_id) \(.base_url)"')
well="$(replicas | jq -r --arg j "$sick" '.[] | select(.job_id != $j) | .job_id')"
echo "== 3. replica $sick ($sick_url) fails its health check: unhealthy, no call goes to it"
touch "$HDIR/unhealthy.${sick_url##*:}"
wait_replicas ".[] | select(.job_id == \"$sick\") | .health == \"unhealthy\"" 15 ||
    models_fail "replica $sick should be unhealthy after 2 failed probes (1 s apart): $(replicas)"
[ "$(unhealthy_metric)" = 1 ] || models_fail "gpuhub_model_replicas{model=\"$MODEL\",state=\"unhealthy\"} is '$(unhealthy_metric)', expected 1"
# It stays a replica (alive, its job runs): the health state only keeps calls away.
replicas | jq -e --arg j "$sick" 'any(.[]; .job_id == $j and .state == "ready")' >/dev/null ||
    models_fail "the unhealthy replica $sick should still be listed as ready (its job runs): $(replicas)"
LOADED="$(load 4)"
echo "   most calls in flight per replica: $(paste -sd, <<<"$LOADED")"
check_codes 4
[ "$(max_of "$sick")" = 0 ] || models_fail "the unhealthy replica $sick had $(max_of "$sick") call(s) in flight"
[ "$(max_of "$well")" -ge 2 ] || models_fail "the healthy replica $well should have taken the calls: $LOADED"
echo "   ok: 4 of 4 calls answered 200, all on $well"

echo "== 4. its health check passes again: ready, and it takes calls again"
rm -f "$HDIR/unhealthy.${sick_url##*:}"
wait_replicas 'all(.[]; .health == "ready")' 15 || models_fail "replica $sick should be ready again after a passing probe: $(replicas)"
[ "$(unhealthy_metric)" = 0 ] || models_fail "gpuhub_model_replicas{state=\"unhealthy\"} is '$(unhealthy_metric)', expected 0"
LOADED="$(load 4)"
echo "   most calls in flight per replica: $(paste -sd, <<<"$LOADED")"
check_codes 4
[ "$(max_of "$sick")" -ge 1 ] && [ "$(max_of "$well")" -ge 1 ] ||
    models_fail "least-outstanding routing should spread the calls over both replicas again: $LOADED"
echo "   ok: both replicas took calls"
read -r dead dead_url < <(replicas | jq -r '.[0] | "\(.job_id) \(.base_url)"')
echo "== 5. the worker of replica $dead ($dead_url) dies between calls: no call fails"
dead_pid="$(ss -Hltnp "sport = :${dead_url##*:}" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n1)"
[ -n "$dead_pid" ] || models_fail "cannot find the process listening at $dead_url"
reroutes_before="$(grep -c 'the call goes to another one' "$MT_DIR/agent.log" || true)"
kill -9 "$dead_pid"
body="$(jq -nc --arg m "$MODEL" '{model: $m, messages: [{role: "user", content: "after"}]}')"
for _ in 1 2 3; do
    curl -s -o /dev/null -w '%{http_code}\n' --max-time 60 -H "Authorization: Bearer $MT_KEY" \
        -H 'content-type: application/json' -d "$body" "http://$MT_GW/v1/chat/completions" >>"$MT_DIR/codes"
done
check_codes 3
reroutes="$(( $(grep -c 'the call goes to another one' "$MT_DIR/agent.log" || true) - reroutes_before ))"
[ "$reroutes" -ge 1 ] ||
    models_fail "no call was sent to the dead replica $dead and rerouted (the agent logged no 'the call goes to another one'): the test did not reach the case"
grep 'the call goes to another one' "$MT_DIR/agent.log" | tail -n1 | grep -q "from=${dead_url}" ||
    models_fail "the reroute logged is not from the dead replica's $dead_url: $(grep 'the call goes to another one' "$MT_DIR/agent.log" | tail -n1)"
echo "   ok: 3 of 3 calls answered 200; $reroutes sent to the dead replica first and rerouted"
echo "PASS models-replicas"
