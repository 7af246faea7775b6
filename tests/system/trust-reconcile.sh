#!/usr/bin/env bash
# timeout: 500
# Slurm wins: the agent's records are reconciled with Slurm's, on the lab, as the unprivileged
# lab user with nothing but environment variables and spool faults. A private gpuhub-agent
# (telemetry.enable_slurm on, so accounting reconciles with Slurm every 2 s) ingests the
# plugin's private spool. Proves, each against sacct's AllocTRES x ElapsedRaw (1.5 s per job):
#  (a) `SLURM_SHARDS_ON_NODE=1 srun --gres=gpu:2`, the same with sbatch, and srun --gres=gpu:1
#      with SLURM_JOB_GPUS / SLURM_STEP_GPUS / CUDA_VISIBLE_DEVICES pre-set: `gpuhub job --json`
#      bills Slurm's GPUs and shards, and where the records claimed other GPUs/shards an
#      anomaly (kind slurm_disagrees, with the field, the claim, Slurm's value and the one used)
#      is recorded and counted in gpuhub_accounting_slurm_disagreements_total;
#  (b) a job whose end records (step_end; job_end with the job-hooks build) are deleted from the
#      spool while the agent is stopped is closed from Slurm within one reconciliation interval
#      after the agent starts;
#  (c) a job run while the agent is stopped and the spool's records/ is immutable (chattr +i:
#      the plugin cannot write, the job must still succeed) is filled in from Slurm after the
#      agent starts;
#  (d) a job whose name holds a line break and a whole imitated scontrol line (a job of root's
#      with 2 GPUs), then `JobId=N` (the rest of its real line parses as job N), is billed from
#      Slurm, and neither imitated job is billed at all;
#  (e) a job its user requeues (`scontrol requeue`) while it runs is billed for both runs, each
#      against its own line of `sacct --duplicates`, with no anomaly (as shipped the first run
#      ends at sacct's End of that run, the second is created from Slurm);
# then `gpuhub usage` for the user equals the sum over those jobs. As shipped (job boundaries
# from Slurm) (b) and (c) are the normal path: state `ended`, no anomaly. With the job-hooks build
# (GPUHUB_TRUST_BOUNDARIES=prolog: spank_gpuhub_prolog.so, PrologFlags=Alloc, job_boundaries =
# "prolog") a missing job record is an anomaly: (b) `closed_from_slurm` with end_from_slurm, (c)
# `filled_from_slurm` with start_from_slurm, both counted in gpuhub_accounting_anomalies_total.
#   GPUHUB_TRUST_BACKEND=postgres  run the agent on a fresh database of GPUHUB_TEST_PG_URL
#                                  (default: SQLite in the temp dir)
#   GPUHUB_TRUST_BOUNDARIES=prolog the job-hooks setup above (default: slurm, as shipped)
#   GPUHUB_AGENT_BIN / GPUHUB_CLI_BIN override the binaries (default target/release/); pointing
#   GPUHUB_AGENT_BIN at an agent without reconciliation makes this test fail (it must).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
agent_bin="${GPUHUB_AGENT_BIN:-$LAB_REPO/target/release/gpuhub-agent}"
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
interval_s=2
lab_require
[ -x "$agent_bin" ] || lab_fail "$agent_bin missing; run cargo build --release"
acct_type="$(scontrol show config 2>/dev/null | awk '$1 == "AccountingStorageType" {print $3}')"
[ "$acct_type" = accounting_storage/slurmdbd ] \
    || lab_fail "this test compares with sacct but the lab runs without slurmdbd (AccountingStorageType=${acct_type:-unknown}); bring it up with GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh"
MODE="${GPUHUB_TRUST_BOUNDARIES:-slurm}"
case "$MODE" in slurm|prolog) ;; *) lab_fail "GPUHUB_TRUST_BOUNDARIES must be slurm or prolog, not '$MODE'" ;; esac
spank_fixture
[ "$MODE" = slurm ] || lab_slurm_setup prolog Alloc
lab_user
chmod 755 "$T"
cd /tmp

# ---- a private agent on the test's spool
port() { python3 "$LAB_REPO/tests/lib/free_port.py"; }
mkdir -p "$T/state" "$T/run"
store_url="sqlite://$T/state/gpuhub.db"
if [ "${GPUHUB_TRUST_BACKEND:-sqlite}" = postgres ]; then
    [ -n "${GPUHUB_TEST_PG_URL:-}" ] || lab_fail "GPUHUB_TRUST_BACKEND=postgres needs GPUHUB_TEST_PG_URL (tests/lib/pg.sh starts a server and prints it)"
    pg_db="gpuhub_trust_$$"
    psql "$GPUHUB_TEST_PG_URL" -qc "CREATE DATABASE $pg_db" || lab_fail "cannot create database $pg_db on $GPUHUB_TEST_PG_URL"
    lab_cleanup_add "psql '$GPUHUB_TEST_PG_URL' -qc 'DROP DATABASE IF EXISTS $pg_db WITH (FORCE)' >/dev/null 2>&1"
    store_url="${GPUHUB_TEST_PG_URL%/*}/$pg_db"
fi
echo "  store: $store_url"
cat > "$T/agent.toml" <<TOML
[paths]
state_dir = "$T/state"
spool_dir = "$T_SPOOL"
runtime_dir = "$T/run"
[store]
url = "$store_url"
[gateway]
listen = "127.0.0.1:$(port)"
[metrics]
listen = "127.0.0.1:$(port)"
[telemetry]
enable_nvml = false
enable_slurm = true
slurm_node_name = "$LAB_NODE"
slurm_interval_ms = $((interval_s * 1000))
job_map_dir = "$T/run/dcgm-job-map"
[accounting]
ingest_interval_ms = 200
job_boundaries = "$MODE"
TOML
metrics_url="http://$(sed -n '/^\[metrics\]/,/^\[/s/^listen = "\(.*\)"/\1/p' "$T/agent.toml")/metrics"
apid=""
start_agent() {
    echo "+ $agent_bin --config $T/agent.toml run  (log $T/agent.log)"
    setsid "$agent_bin" --config "$T/agent.toml" run >>"$T/agent.log" 2>&1 </dev/null &
    apid=$!
    local i
    for ((i = 0; i < 150; i++)); do
        [ -S "$T/run/agent.sock" ] && "$cli" --socket "$T/run/agent.sock" usage --since 1m >/dev/null 2>&1 && return 0
        kill -0 "$apid" 2>/dev/null || { tail -n 20 "$T/agent.log"; lab_fail "the agent exited (log above)"; }
        sleep 0.2
    done
    lab_fail "the agent's control socket did not answer in 30 s"
}
stop_agent() {
    [ -n "$apid" ] || return 0
    kill "$apid" 2>/dev/null || true
    local i
    for ((i = 0; i < 100; i++)); do kill -0 "$apid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$apid" 2>/dev/null || true
    apid=""
    rm -f "$T/run/agent.sock"
}
lab_cleanup_add 'stop_agent'
lab_cleanup_add "chattr -i '$T_SPOOL/records' 2>/dev/null || true"
wait_ingested() {
    local i
    for ((i = 0; i < 150; i++)); do
        [ -z "$(find "$T_SPOOL/records" -name '*.json' 2>/dev/null)" ] && return 0
        sleep 0.2
    done
    lab_fail "the agent did not ingest the spool in 30 s"
}
sql() {
    case "$store_url" in
        sqlite://*) sqlite3 "${store_url#sqlite://}" "$1" ;;
        *) psql "$store_url" -Atc "$1" ;;
    esac
}
JOBS=()
declare -A WHAT
as_user() { runuser -u "$LAB_USER" -- "$@"; }
run_srun() {  # run_srun LABEL ENV... -- SRUN-ARGS...
    local label="$1"
    shift
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    lab_run as_user env "${envs[@]}" srun -t 2 -J "trust-$label" "$@" sh -c 'echo JOB=$SLURM_JOB_ID; sleep 3'
    [ "$LAB_RC" -eq 0 ] || lab_fail "$label: srun failed (a gpuhub fault must never fail a job)"
    LAST_JOB="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT" | head -n1)"
    [ -n "$LAST_JOB" ] || lab_fail "$label: no job id from srun"
    JOBS+=("$LAST_JOB")
    WHAT[$LAST_JOB]="$label"
}

start_agent
# ---- (a) claims the user pre-set
run_srun srun-shards-on-gpu2 SLURM_SHARDS_ON_NODE=1 -- --gres=gpu:2
run_srun srun-gpus-preset SLURM_JOB_GPUS=1 SLURM_STEP_GPUS=1 CUDA_VISIBLE_DEVICES=1 SLURM_SHARDS_ON_NODE=5 -- --gres=gpu:1
lab_run as_user env SLURM_SHARDS_ON_NODE=1 sbatch --parsable -t 2 -J trust-sbatch --gres=gpu:2 -o /dev/null --wrap 'sleep 3'
[ "$LAB_RC" -eq 0 ] || lab_fail "sbatch failed"
sb="$(tail -n1 <<<"$LAB_OUT" | cut -d';' -f1)"
JOBS+=("$sb")
WHAT[$sb]=sbatch-shards-on-gpu2
lab_wait_job "$sb" 60 || lab_fail "sbatch job $sb did not end in 60 s"
lab_wait_job "${JOBS[0]}" 10 || true
# ---- (d) a job name with a line break, then a whole imitated `scontrol show job -o` line: a job
# slurmctld does not have, root's, 2 GPUs on this node. Nothing is billed for it, and the job
# that carries the name is billed from Slurm like any other (the sums below).
now="$(date +%s)"
# Ids of this run's own (an earlier run's forged lines, still listed, would make them repeats).
fake=$((7000000 + RANDOM * 4)); fake2=$((fake + 1))
forged="JobId=$fake JobName=f UserId=root(0) Account=root JobState=RUNNING Reason=None StartTime=$now EndTime=$((now + 3600)) Partition=$(sinfo -h -o %P | head -n1 | tr -d '*') NodeList=$LAB_NODE NumCPUs=1 TRES=cpu=1,mem=500M,node=1,billing=1,gres/gpu=2 Nodes=$LAB_NODE CPU_IDs=0 Mem=500 GRES=gpu:h200:2(IDX:0-1) MinCPUsNode=1"
# The name ends in a line that starts like a job's, so the rest of the real line (its user's
# real fields) parses as job $fake2 too.
lab_run as_user sbatch --parsable -t 2 -J $'trust-forge\n'"$forged"$'\n'"JobId=$fake2" --gres=gpu:1 -o /dev/null --wrap 'sleep 8'
[ "$LAB_RC" -eq 0 ] || lab_fail "sbatch with a line break in the job name failed"
d_job="$(tail -n1 <<<"$LAB_OUT" | cut -d';' -f1)"
JOBS+=("$d_job")
WHAT[$d_job]=forged-line
scontrol show job -o "$d_job" | grep -q "^JobId=$fake " || lab_fail "scontrol does not print the imitated line (does Slurm quote job names now?); this part proves nothing"
lab_wait_job "$d_job" 60 || lab_fail "job $d_job did not end in 60 s"
wait_ingested
# The claims above differ from Slurm's allocation: counted (before the restarts below reset it).
sleep 1
curl -sf --max-time 5 "$metrics_url" > "$T/metrics-a.txt" || true
grep '^gpuhub_accounting_slurm_disagreements_total' "$T/metrics-a.txt" | sed 's/^/  metrics: /' || true

# ---- (e) requeued by its user while it runs: both runs billed
lab_run as_user sbatch --parsable --requeue -t 2 -J trust-requeue --gres=gpu:1 -o /dev/null --wrap 'sleep 6'
[ "$LAB_RC" -eq 0 ] || lab_fail "sbatch --requeue failed"
e_job="$(tail -n1 <<<"$LAB_OUT" | cut -d';' -f1)"
JOBS+=("$e_job")
WHAT[$e_job]=requeued
job_state() { squeue -h -j "$1" -o %T 2>/dev/null; }
for ((i = 0; i < 60; i++)); do [ "$(job_state "$e_job")" = RUNNING ] && break; sleep 0.5; done
[ "$(job_state "$e_job")" = RUNNING ] || lab_fail "job $e_job did not start in 30 s"
sleep 3
lab_run as_user scontrol requeue "$e_job"
[ "$LAB_RC" -eq 0 ] || lab_fail "its owner could not requeue job $e_job"
for ((i = 0; i < 60; i++)); do [ "$(job_state "$e_job")" = PENDING ] && break; sleep 0.5; done
[ "$(job_state "$e_job")" = PENDING ] || lab_fail "requeued job $e_job does not pend again"
sleep 3
# Slurm holds a requeued job for 2 minutes (BeginTime); the admin lets it start now.
lab_run scontrol update JobId="$e_job" StartTime=now
lab_wait_job "$e_job" 90 || lab_fail "requeued job $e_job did not run again and end in 90 s"

# ---- (b) end records deleted before ingest
stop_agent
run_srun end-deleted -- --gres=gpu:1
b_job="$LAST_JOB"
lab_wait_job "$b_job" 30 || true
last=job_end; [ "$MODE" = prolog ] || last=step_end
lab_wait_record "$T_SPOOL" "$b_job" "$last" 30 || lab_fail "job $b_job: no $last record to delete"
for f in "$T_SPOOL"/records/*.json; do
    jq -e --argjson j "$b_job" '.job_id == $j and (.kind == "job_end" or .kind == "step_end")' "$f" >/dev/null 2>&1 && { echo "+ rm $f"; rm -f "$f"; }
done
lab_records "$T_SPOOL" "$b_job" | jq -e 'select(.kind == "job_end" or .kind == "step_end")' >/dev/null 2>&1 && lab_fail "job $b_job: an end record is still there"

# ---- (c) the spool is unwritable while the agent is stopped
echo "+ chattr +i $T_SPOOL/records"
chattr +i "$T_SPOOL/records" || lab_fail "chattr +i $T_SPOOL/records failed (needs ext4/xfs and root)"
run_srun spool-unwritable -- --gres=shard:3
c_job="$LAST_JOB"
lab_wait_job "$c_job" 30 || true
chattr -i "$T_SPOOL/records"
[ -z "$(lab_records "$T_SPOOL" "$c_job")" ] || lab_fail "job $c_job wrote records into an immutable spool?"

t_agent="$(date +%s.%N)"
start_agent
# Closed (b) and filled in (c) within one reconciliation interval (plus the first look).
want_b=ended want_c=ended
[ "$MODE" = slurm ] || { want_b=closed_from_slurm; want_c=filled_from_slurm; }
deadline=$(( $(date +%s) + 3 * interval_s + 5 ))
while :; do
    sb_state="$("$cli" --socket "$T/run/agent.sock" job "$b_job" --json 2>/dev/null | jq -r '.nodes[0].state' 2>/dev/null || true)"
    sc_state="$("$cli" --socket "$T/run/agent.sock" job "$c_job" --json 2>/dev/null | jq -r '.nodes[0].state' 2>/dev/null || true)"
    [ "$sb_state" = "$want_b" ] && [ "$sc_state" = "$want_c" ] && break
    if [ "$(date +%s)" -ge "$deadline" ]; then
        tail -n 20 "$T/agent.log" | sed 's/^/  agent.log: /'
        echo "MISMATCH: after $((3 * interval_s + 5)) s: job $b_job is '${sb_state:-unknown}' (want $want_b: its end records were deleted), job $c_job is '${sc_state:-unknown}' (want $want_c: it ran while the spool was unwritable)"
        late=1
        break
    fi
    sleep 0.5
done
[ -n "${late:-}" ] || echo "  closed/filled in from Slurm $(python3 -c "import time; print(round(time.time() - $t_agent, 1))") s after the agent started (interval ${interval_s} s)"
WHAT[$b_job]=end-deleted
WHAT[$c_job]=spool-unwritable
wait_ingested

# ---- everything against sacct
ids="$(IFS=,; echo "${JOBS[*]}")"
# --duplicates: every run of a requeued job, each on its own line.
sacct_cmd=(sacct -n -X -P -D -j "$ids" -o JobID,State,AllocTRES,ElapsedRaw,Start,End)
echo "+ SLURM_TIME_FORMAT=%s ${sacct_cmd[*]}  (until all ${#JOBS[@]} have ended)"
for ((i = 0; ; i++)); do
    sacct_out="$(SLURM_TIME_FORMAT=%s "${sacct_cmd[@]}" 2>&1)" || true
    [ "$(awk -F'|' '$6 ~ /^[0-9]+$/ && $2 != "REQUEUED" {print $1}' <<<"$sacct_out" | sort -u | wc -l)" -eq "${#JOBS[@]}" ] && break
    [ "$i" -lt 120 ] || lab_fail "sacct does not list jobs $ids as ended after 60 s: $sacct_out"
    sleep 0.5
done
printf '%s\n' "$sacct_out" | sed 's/^/  | /'
printf '%s\n' "$sacct_out" > "$T/sacct.txt"
for j in "${JOBS[@]}"; do
    "$cli" --socket "$T/run/agent.sock" job "$j" --json > "$T/job-$j.json" 2>"$T/job-$j.err" || echo '{}' > "$T/job-$j.json"
    sql "SELECT body FROM acct_records WHERE job_id = $j ORDER BY time_us" > "$T/records-$j.jsonl" 2>/dev/null || true
    lab_run "$cli" --socket "$T/run/agent.sock" job "$j"
done
lab_run "$cli" --socket "$T/run/agent.sock" usage --since 1d --by user --json
printf '%s\n' "$LAB_OUT" > "$T/usage.json"
curl -sf --max-time 5 "$metrics_url" > "$T/metrics.txt" || true
grep '^gpuhub_accounting_anomalies' "$T/metrics.txt" | sed 's/^/  metrics: /' || true
whats="$(for j in "${JOBS[@]}"; do printf '%s=%s ' "$j" "${WHAT[$j]}"; done)"
python3 - "$T" "$LAB_USER" "$MODE" $whats <<'PY' || lab_fail "gpuhub's accounting differs from Slurm's (see the MISMATCH lines above)"
import json, sys
tmp, user, mode = sys.argv[1], sys.argv[2], sys.argv[3]
jobs = dict(a.split("=", 1) for a in sys.argv[4:])          # job id -> label
TOL = 1.5
sacct = {}                                                   # job id -> its runs that ended
for line in open(f"{tmp}/sacct.txt"):
    f = line.strip().split("|")
    if len(f) == 6 and f[5].isdigit():
        sacct.setdefault(f[0], []).append(f)
bad = []
sum_g = sum_s = tol_g = tol_s = 0.0
runs_total = 0
for jid, label in jobs.items():
    runs = sacct.get(jid)
    if not runs:
        bad.append(f"job {jid} ({label}): not in sacct"); continue
    f = runs[0]
    tres = dict(kv.split("=", 1) for kv in f[2].split(",") if "=" in kv)
    sg, ss = int(tres.get("gres/gpu", 0)), int(tres.get("gres/shard", 0))
    els = [int(r[3]) for r in runs]
    el, tol = sum(els), TOL * len(runs)
    runs_total += len(runs)
    sum_g += sg * el; sum_s += ss * el; tol_g += sg * tol; tol_s += ss * tol
    try:
        nodes = json.load(open(f"{tmp}/job-{jid}.json"))["nodes"]
        n = nodes[0]
    except Exception as e:
        bad.append(f"job {jid} ({label}): gpuhub job --json has no node ({e}; {open(f'{tmp}/job-{jid}.err').read().strip()})"); continue
    gs, shs = sum(m.get("gpu_seconds", 0.0) for m in nodes), sum(m.get("shard_seconds", 0.0) for m in nodes)
    anomalies = [a for m in nodes for a in m.get("anomalies", [])]
    kinds = [a.get("kind") if isinstance(a, dict) else a for a in anomalies]
    # What the records alone claimed (the pre-reconciliation billing).
    recs = [json.loads(l) for l in open(f"{tmp}/records-{jid}.jsonl") if l.strip()]
    claim_shards = max([r.get("shards") or 0 for r in recs if r["kind"] == "step_start"] or [0])
    # Job records (job-hooks build) name the job's GPUs; as shipped, only steps claim them.
    claim_kinds = ("job_start", "job_end") if mode == "prolog" else ("step_start",)
    claim_gpus = {g["index"] for r in recs if r["kind"] in claim_kinds for g in r.get("gpus", [])}
    claimed = (0, claim_shards) if claim_shards else (len(claim_gpus), 0)
    checks = [
        (abs(gs - sg * el) <= sg * tol + 1e-9, f"GPU-seconds: gpuhub {gs:.3f}, sacct gres/gpu={sg} x ElapsedRaw {el} = {sg * el} (tolerance {sg * tol})"),
        (abs(shs - ss * el) <= ss * tol + 1e-9, f"shard-seconds: gpuhub {shs:.3f}, sacct gres/shard={ss} x ElapsedRaw {el} = {ss * el} (tolerance {ss * tol})"),
        (n.get("user") == user, f"user: gpuhub {n.get('user')!r}, Slurm {user!r}"),
        (len(nodes) == len(runs), f"runs: gpuhub shows {len(nodes)}, sacct --duplicates {len(runs)}"),
    ]
    if recs and claimed != (sg, ss):
        checks.append(("slurm_disagrees" in kinds,
                       f"the records claimed {claimed[0]} GPUs/{claimed[1]} shards, Slurm allocated {sg}/{ss}: no slurm_disagrees anomaly ({kinds})"))
    if label == "end-deleted":
        if mode == "prolog":
            checks.append(("end_from_slurm" in kinds and n.get("state") == "closed_from_slurm", f"not closed from Slurm: state {n.get('state')}, anomalies {kinds}"))
        else:
            checks.append((n.get("state") == "ended" and not kinds, f"not closed from Slurm as a normal job: state {n.get('state')}, anomalies {kinds}"))
    if label == "requeued":
        got = [round(m.get("gpu_seconds", 0.0), 3) for m in nodes]
        checks.append((len(runs) == 2, f"sacct --duplicates lists {len(runs)} runs, expected 2 (was it requeued?)"))
        checks.append((len(got) == len(els) and all(abs(g - sg * e) <= sg * TOL + 1e-9 for g, e in zip(got, els)),
                       f"each run: gpuhub GPU-seconds {got}, sacct {[sg * e for e in els]}"))
        checks.append((not kinds and all(m.get("state") == "ended" for m in nodes), f"runs: states {[m.get('state') for m in nodes]}, anomalies {kinds}"))
    if label == "spool-unwritable":
        checks.append((not recs, f"{len(recs)} records of a job run while the spool was unwritable"))
        if mode == "prolog":
            checks.append(("start_from_slurm" in kinds and n.get("state") == "filled_from_slurm", f"not filled in from Slurm: state {n.get('state')}, anomalies {kinds}"))
        else:
            checks.append((n.get("state") == "ended" and not kinds, f"not created from Slurm as a normal job: state {n.get('state')}, anomalies {kinds}"))
    errs = [m for ok, m in checks if not ok]
    bad += [f"job {jid} ({label}): {m}" for m in errs]
    dis = [f"{a['field']}: claimed {a['claimed']}, Slurm {a['slurm']}, used {a['used']}" for a in anomalies if isinstance(a, dict) and a.get("field")]
    print(("ok" if not errs else "MISMATCH") + f": job {jid} ({label}): sacct gres/gpu={sg} gres/shard={ss} ElapsedRaw {el}; "
          f"gpuhub gpu_seconds {gs:.3f} shard_seconds {shs:.3f} state {n.get('state')} verified {n.get('verified')}; "
          f"records claimed {claimed}; anomalies {kinds}" + (f"; disagreements: {'; '.join(dis)}" if dis else ""))
for m in bad:
    print("MISMATCH: " + m)
try:
    row = next(r for r in json.load(open(f"{tmp}/usage.json"))["rows"] if r.get("user", r.get("key")) == user)
except Exception as e:
    row = {"gpu_seconds": 0.0, "shard_seconds": 0.0, "jobs": 0}
    bad.append(f"no gpuhub usage row for {user} ({e})")
ok_sum = abs(row["gpu_seconds"] - sum_g) <= tol_g + 1e-9 and abs(row["shard_seconds"] - sum_s) <= tol_s + 1e-9 and row["jobs"] == runs_total
print(("ok" if ok_sum else "MISMATCH") + f": gpuhub usage for {user}: gpu_seconds {row['gpu_seconds']:.3f} vs sacct sum {sum_g:.0f} "
      f"(tolerance {tol_g}), shard_seconds {row['shard_seconds']:.3f} vs {sum_s:.0f} (tolerance {tol_s}), job runs {row['jobs']} vs {runs_total}")
sys.exit(0 if ok_sum and not bad else 1)
PY
# Checked last, when many reconciliation looks have seen the imitated lines.
[ "$(sql "SELECT COUNT(*) FROM acct_jobs WHERE job_id IN ($fake, $fake2)")" = 0 ] ||
    lab_fail "lines job $d_job's name imitated were billed as jobs: $(sql "SELECT job_id, node, user_name, start_us, end_us FROM acct_jobs WHERE job_id IN ($fake, $fake2)")"
echo "ok: the lines job $d_job's name imitated ($fake, root's; $fake2) are not billed"
[ -z "${late:-}" ] || lab_fail "jobs $b_job/$c_job were not reconciled within one interval (see the MISMATCH above)"
grep -q '^gpuhub_accounting_slurm_disagreements_total{field="shards"} [1-9]' "$T/metrics-a.txt" \
    || lab_fail "the shard claims of part (a) are not counted in gpuhub_accounting_slurm_disagreements_total{field=\"shards\"} ($metrics_url)"
if [ "$MODE" = prolog ]; then
    grep -q '^gpuhub_accounting_anomalies_total{kind="end_from_slurm"} [1-9]' "$T/metrics.txt" \
        && grep -q '^gpuhub_accounting_anomalies_total{kind="start_from_slurm"} [1-9]' "$T/metrics.txt" \
        || lab_fail "end_from_slurm/start_from_slurm are not counted in gpuhub_accounting_anomalies_total ($metrics_url)"
elif grep -qE '^gpuhub_accounting_anomalies_total\{kind="(end_from_slurm|start_from_slurm)"\} [1-9]' "$T/metrics.txt"; then
    lab_fail "with job boundaries from Slurm, jobs created or closed from Slurm are counted as anomalies ($metrics_url)"
fi
lab_node_ok
echo "PASS: trust-reconcile"
