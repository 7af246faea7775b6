#!/usr/bin/env bash
# gpuhub_slurm_* from slurmctld, whatever the request syntax: jobs submitted on the lab with
# --gres=gpu:N, --gres=gpu:h200:N, --gpus=N, --gpus-per-node, --gpus-per-task and shards
# (--gres=shard:N, --gres=shard:h200:N) show their GPU and shard counts in the lab agent's
# gpuhub_slurm_job_gpus / _shards and the node's gpuhub_slurm_gpus / _shards within one Slurm
# snapshot (telemetry.slurm_interval_ms) of running; CPUs and memory agree with slurmctld's
# node line; a job that cannot start is pending with its reason; a drained node shows as
# draining with the admin's reason, and idle/mixed again after resume. (squeue -o %b prints
# N/A for --gpus jobs: the old squeue-based snapshot counted them as 0.)
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
lab_user
agent_start || lab_fail "the lab agent does not start"
lab_wait_gpus_free 240
METRICS=http://127.0.0.1:9410/metrics
INTERVAL_S=$(( $(sed -n 's/^slurm_interval_ms *= *\([0-9]*\).*/\1/p' "$LAB_AGENT_CONFIG" | head -n1) / 1000 ))
[ "$INTERVAL_S" -ge 1 ] || lab_fail "cannot read telemetry.slurm_interval_ms from $LAB_AGENT_CONFIG"
# One snapshot: the next one after the jobs run, plus the commands' own time.
LIMIT=$((INTERVAL_S + 3))
JOBS=()
lab_cleanup_add 'for j in "${JOBS[@]}"; do scancel "$j" 2>/dev/null || true; done; for j in "${JOBS[@]}"; do lab_wait_job "$j" 30 || true; done'
lab_cleanup_add "scontrol update nodename=$LAB_NODE state=resume 2>/dev/null || true"

# submit VAR NAME SBATCH-ARGS...: a job of the lab user that sleeps; its id into VAR.
submit() {
    local var="$1" name="$2" id
    shift 2
    id="$(runuser -u "$LAB_USER" -- sbatch --parsable -J "tel-slurm-$name" -t 3 -o /dev/null --chdir=/tmp "$@" --wrap 'sleep 170')" \
        || lab_fail "sbatch $* failed"
    echo "+ sbatch $* -> job $id ($name)"
    JOBS+=("$id")
    printf -v "$var" '%s' "$id"
}
# running JOB...: wait (60 s) until each job runs; prints nothing.
running() {
    local j i
    for j in "$@"; do
        for ((i = 0; i < 300; i++)); do [ "$(squeue -h -j "$j" -o %T 2>/dev/null)" = RUNNING ] && break; sleep 0.2; done
        [ "$(squeue -h -j "$j" -o %T 2>/dev/null)" = RUNNING ] || lab_fail "job $j not running after 60 s: $(squeue -h -j "$j" -o '%T %r')"
    done
}
# value SELECTOR: the value of the one /metrics sample whose name and labels start with SELECTOR.
value() { curl -fsS "$METRICS" | grep -F -- "$1" | head -n1 | awk '{ print $NF }'; }
# expect_within SECS SELECTOR WANT: the sample reaches WANT within SECS (numeric comparison).
expect_within() {
    local secs="$1" sel="$2" want="$3" got="" t0=$SECONDS
    while ((SECONDS - t0 <= secs)); do
        got="$(value "$sel" || true)"
        if [ -n "$got" ] && awk -v a="$got" -v b="$want" 'BEGIN { exit !(a + 0 == b + 0) }'; then
            echo "ok: $sel... = $got (after $((SECONDS - t0)) s)"
            return 0
        fi
        sleep 0.25
    done
    curl -fsS "$METRICS" | grep -E '^gpuhub_slurm_' >&2 || true
    lab_fail "$sel... is '${got:-<absent>}' after ${secs}s, want $want"
}
job() { echo "gpuhub_slurm_job_$1{jobid=\"$2\",user=\"$LAB_USER\","; }
cancel_all() { local j; for j in "${JOBS[@]}"; do scancel "$j" 2>/dev/null || true; done; for j in "${JOBS[@]}"; do lab_wait_job "$j" 30 || true; done; JOBS=(); }

echo "== round 1: --gres=gpu:1, --gres=shard:5, --gres=shard:h200:3"
submit a gres-gpu --gres=gpu:1
submit s1 gres-shard --gres=shard:5
submit s2 gres-shard-typed --gres=shard:h200:3
running "$a" "$s1" "$s2"
expect_within "$LIMIT" "$(job gpus "$a")" 1
expect_within "$LIMIT" "$(job shards "$s1")" 5
expect_within "$LIMIT" "$(job shards "$s2")" 3
expect_within "$LIMIT" "$(job gpus "$s1")" 0
expect_within "$LIMIT" 'gpuhub_slurm_gpus{state="allocated"}' 1
expect_within "$LIMIT" 'gpuhub_slurm_shards{state="allocated"}' 8
expect_within "$LIMIT" "gpuhub_slurm_node_state{node=\"$LAB_NODE\",state=\"mixed\",reason=\"\"}" 1
# CPUs and memory: what slurmctld says of the node, and each job's (DefMemPerCPU=500).
cpus="$(scontrol show node -o "$LAB_NODE" | grep -oE 'CPUAlloc=[0-9]+' | cut -d= -f2)"
mem="$(scontrol show node -o "$LAB_NODE" | grep -oE 'AllocMem=[0-9]+' | cut -d= -f2)"
expect_within "$LIMIT" "gpuhub_slurm_node_cpus{node=\"$LAB_NODE\",state=\"allocated\"}" "$cpus"
expect_within "$LIMIT" "gpuhub_slurm_node_memory_bytes{node=\"$LAB_NODE\",state=\"allocated\"}" $((mem * 1048576))
expect_within "$LIMIT" "$(job cpus "$a")" 1
expect_within "$LIMIT" "$(job memory_bytes "$a")" $((500 * 1048576))
cancel_all

echo "== round 2: --gres=gpu:h200:1 and --gpus=1 (squeue %b shows N/A for the second)"
submit b gres-gpu-typed --gres=gpu:h200:1
submit c gpus --gpus=1
running "$b" "$c"
echo "  squeue %b of the --gpus job: '$(squeue -h -j "$c" -o %b)'"
expect_within "$LIMIT" "$(job gpus "$b")" 1
expect_within "$LIMIT" "$(job gpus "$c")" 1
expect_within "$LIMIT" 'gpuhub_slurm_gpus{state="allocated"}' 2
expect_within "$LIMIT" 'gpuhub_slurm_gpus{state="idle"}' 0
# A third GPU job cannot start: pending, with slurmctld's reason.
submit p pending --gres=gpu:1
for ((i = 0; i < 50; i++)); do [ "$(squeue -h -j "$p" -o %r)" = Resources ] && break; sleep 0.2; done
[ "$(squeue -h -j "$p" -o %T)" = PENDING ] || lab_fail "job $p should pend, is $(squeue -h -j "$p" -o '%T %r')"
expect_within "$LIMIT" "gpuhub_slurm_pending_jobs{reason=\"$(squeue -h -j "$p" -o %r)\"}" 1
expect_within "$LIMIT" "gpuhub_slurm_jobs{state=\"pending\",partition=\"gpu\",user=\"$LAB_USER\"}" 1
[ -z "$(value "$(job gpus "$p")")" ] || lab_fail "pending job $p must hold no GPUs in gpuhub_slurm_job_gpus"
# The node drained under running jobs: draining, with the admin's reason; back after resume.
echo "+ scontrol update nodename=$LAB_NODE state=drain reason='gpuhub telemetry test'"
scontrol update nodename="$LAB_NODE" state=drain reason="gpuhub telemetry test"
expect_within "$LIMIT" "gpuhub_slurm_node_state{node=\"$LAB_NODE\",state=\"draining\",reason=\"gpuhub telemetry test\"}" 1
echo "+ scontrol update nodename=$LAB_NODE state=resume"
scontrol update nodename="$LAB_NODE" state=resume
expect_within "$LIMIT" "gpuhub_slurm_node_state{node=\"$LAB_NODE\",state=\"mixed\",reason=\"\"}" 1
[ -z "$(value "gpuhub_slurm_node_state{node=\"$LAB_NODE\",state=\"draining\"")" ] || lab_fail "the draining state stayed after resume"
cancel_all

echo "== round 3: --gpus-per-node=2"
submit d gpus-per-node --gpus-per-node=2
running "$d"
expect_within "$LIMIT" "$(job gpus "$d")" 2
expect_within "$LIMIT" 'gpuhub_slurm_gpus{state="allocated"}' 2
cancel_all

echo "== round 4: -n 2 --gpus-per-task=1"
submit e gpus-per-task -n 2 --gpus-per-task=1
running "$e"
expect_within "$LIMIT" "$(job gpus "$e")" 2
expect_within "$LIMIT" "$(job cpus "$e")" 2
cancel_all

echo "== all jobs gone: no per-job series left, the node idle"
expect_within "$LIMIT" 'gpuhub_slurm_gpus{state="allocated"}' 0
expect_within "$LIMIT" "gpuhub_slurm_node_state{node=\"$LAB_NODE\",state=\"idle\",reason=\"\"}" 1
left="$(curl -fsS "$METRICS" | grep -E "^gpuhub_slurm_job_gpus\{.*tel-slurm|^gpuhub_slurm_job_gpus\{jobid=\"($a|$b|$c|$d|$e)\"" || true)"
[ -z "$left" ] || lab_fail "series of ended jobs stayed: $left"
lab_node_ok
echo "PASS telemetry-slurm"
