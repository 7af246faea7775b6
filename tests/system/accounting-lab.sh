#!/usr/bin/env bash
# Accounting on the lab: srun --gres=gpu:1, --gres=gpu:2, --gres=shard:7 and a CPU-only job
# run and end as the unprivileged lab user with the plugin writing to a private spool; then a
# private gpuhub-agent ingests that spool. Two setups (GPUHUB_ACCT_BOUNDARIES):
#   slurm (default, as shipped): the plugin without job hooks, no PrologFlags; the agent takes
#     job boundaries and allocations from slurmctld (accounting.job_boundaries = "slurm");
#   prolog (accounting-lab-prolog.sh): the job-hooks build with PrologFlags=Alloc and an agent
#     without Slurm (job_boundaries = "prolog"), where `gpuhub usage --json` must show exactly
#     the GPU-seconds and shard-seconds computed here from the records' own timestamps.
# In both, `gpuhub job` shows the shard job's 7 shards, and then Slurm's own accounting
# (slurmdbd): per job, sacct's AllocTRES (gres/gpu, gres/shard) and ElapsedRaw against `gpuhub
# job --json`, and in sum against `gpuhub usage --json` (tolerances below, where they are checked).
#   GPUHUB_REQUIRE_SACCT=1   a lab without slurmdbd fails the test (tests/run-all.sh sets it);
#                            otherwise the sacct comparison is skipped with a message
#   GPUHUB_SACCT_TIMEOUT=60  seconds to wait for slurmdbd to list the ended jobs
# GPUHUB_AGENT_BIN / GPUHUB_CLI_BIN override the binaries (default target/release/).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
agent_bin="${GPUHUB_AGENT_BIN:-$LAB_REPO/target/release/gpuhub-agent}"
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
"$cli" usage --help 2>/dev/null | grep -q -- '--by' || lab_fail "$cli has no \`usage --by\`: the accounting CLI is not wired in this build"
# Slurm's accounting: checked first, so that a harness that requires it fails before any job.
acct_type="$(scontrol show config 2>/dev/null | awk '$1 == "AccountingStorageType" {print $3}')"
sacct_on=0
if [ "$acct_type" = accounting_storage/slurmdbd ]; then
    sacct_on=1
elif [ "${GPUHUB_REQUIRE_SACCT:-0}" = 1 ] || [ "${GPUHUB_TEST_STRICT:-0}" = 1 ]; then
    lab_fail "GPUHUB_REQUIRE_SACCT=1 but the lab runs without slurmdbd (AccountingStorageType=${acct_type:-unknown}); bring it up with accounting: GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh"
fi
MODE="${GPUHUB_ACCT_BOUNDARIES:-slurm}"
case "$MODE" in slurm|prolog) ;; *) lab_fail "GPUHUB_ACCT_BOUNDARIES must be slurm or prolog, not '$MODE'" ;; esac
spank_fixture
[ "$MODE" = slurm ] || lab_slurm_setup prolog Alloc
lab_user
t_submit="$(date +%s)"
chmod 755 "$T"
cd /tmp

declare -A JOB
for shape in gpu1 gpu2 shard7 cpu; do
    case "$shape" in
        gpu1) gres=(--gres=gpu:1) ;;
        gpu2) gres=(--gres=gpu:2) ;;
        shard7) gres=(--gres=shard:7) ;;
        cpu) gres=() ;;
    esac
    lab_run runuser -u "$LAB_USER" -- srun "${gres[@]}" -t 2 -J "acct-$shape" sh -c 'echo JOB=$SLURM_JOB_ID; sleep 2'
    [ "$LAB_RC" -eq 0 ] || lab_fail "srun ${gres[*]} failed"
    JOB[$shape]="$(sed -n 's/^JOB=//p' <<<"$LAB_OUT" | head -n1)"
    [ -n "${JOB[$shape]}" ] || lab_fail "no job id from srun ${gres[*]}"
done
last=job_end; [ "$MODE" = prolog ] || last=step_end
for shape in gpu1 gpu2 shard7 cpu; do
    lab_wait_record "$T_SPOOL" "${JOB[$shape]}" "$last" 30 || lab_fail "job ${JOB[$shape]} ($shape): no $last record"
done

if [ "$MODE" = prolog ]; then
# Expected usage, from the records (before the agent ingests and removes them).
expected="$(
    for shape in gpu1 gpu2 shard7 cpu; do lab_records "$T_SPOOL" "${JOB[$shape]}"; done | python3 -c '
import json, sys
jobs = {}
for line in sys.stdin:
    r = json.loads(line)
    j = jobs.setdefault(r["job_id"], {"shards": 0, "gpus": set()})
    if r["kind"] == "job_start": j["start"] = r["time_us"]; j["gpus"] |= {g["index"] for g in r["gpus"]}
    if r["kind"] == "job_end": j["end"] = r["time_us"]; j["gpus"] |= {g["index"] for g in r["gpus"]}
    if r["kind"] == "step_start" and r.get("shards"): j["shards"] = max(j["shards"], r["shards"])
gpu_us = shard_us = 0
for j in jobs.values():
    t = j["end"] - j["start"]
    if j["shards"]: shard_us += j["shards"] * t
    else: gpu_us += len(j["gpus"]) * t
print(gpu_us, shard_us, len(jobs))
')"
read -r exp_gpu_us exp_shard_us exp_jobs <<<"$expected"
echo "expected from the records: gpu_seconds $(python3 -c "print($exp_gpu_us/1e6)"), shard_seconds $(python3 -c "print($exp_shard_us/1e6)"), jobs $exp_jobs"
fi

# A private agent on the test's spool.
port() { python3 "$LAB_REPO/tests/lib/free_port.py"; }
mkdir -p "$T/state" "$T/run"
cat > "$T/agent.toml" <<TOML
[paths]
state_dir = "$T/state"
spool_dir = "$T_SPOOL"
runtime_dir = "$T/run"
[gateway]
listen = "127.0.0.1:$(port)"
[metrics]
listen = "127.0.0.1:$(port)"
[telemetry]
enable_nvml = false
$(if [ "$MODE" = slurm ]; then printf 'enable_slurm = true\nslurm_node_name = "%s"\nslurm_interval_ms = 1000\n' "$LAB_NODE"; else echo 'enable_slurm = false'; fi)
job_map_dir = "$T/run/dcgm-job-map"
[accounting]
ingest_interval_ms = 200
job_boundaries = "$MODE"
TOML
echo "+ $agent_bin --config $T/agent.toml run"
setsid "$agent_bin" --config "$T/agent.toml" run >"$T/agent.log" 2>&1 </dev/null &
apid=$!
lab_cleanup_add "kill $apid 2>/dev/null"
for ((i = 0; i < 150; i++)); do
    [ -z "$(find "$T_SPOOL/records" -name '*.json' 2>/dev/null)" ] && [ -S "$T/run/agent.sock" ] && break
    kill -0 "$apid" 2>/dev/null || { tail -n 20 "$T/agent.log"; lab_fail "the agent exited"; }
    sleep 0.2
done
[ -z "$(find "$T_SPOOL/records" -name '*.json' 2>/dev/null)" ] || lab_fail "the agent did not ingest the spool in 30 s"
if [ "$MODE" = slurm ]; then
    # Job boundaries come from slurmctld: each job is closed at its next reconciliation (1 s here).
    for shape in gpu1 gpu2 shard7 cpu; do
        for ((i = 0; i < 100; i++)); do
            [ "$("$cli" --socket "$T/run/agent.sock" job "${JOB[$shape]}" --json 2>/dev/null | jq '.nodes[0].end_us // null')" != null ] && break
            sleep 0.2
        done
        lab_run "$cli" --socket "$T/run/agent.sock" job "${JOB[$shape]}" --json
        [ "$(jq '.nodes[0].end_us // null' <<<"$LAB_OUT")" != null ] || lab_fail "job ${JOB[$shape]} ($shape) not closed from slurmctld within 20 s"
        [ "$(jq '.nodes[0].anomalies | length' <<<"$LAB_OUT")" = 0 ] \
            || lab_fail "job ${JOB[$shape]}: anomalies $(jq -c '.nodes[0].anomalies' <<<"$LAB_OUT"); with job boundaries from Slurm a normal job has none"
    done
fi

if [ "$MODE" = prolog ]; then
lab_run "$cli" --socket "$T/run/agent.sock" usage --since 1d --by user --json
row="$(jq -c --arg u "$LAB_USER" '.rows[] | select(.user == $u)' <<<"$LAB_OUT")"
[ -n "$row" ] || lab_fail "no usage row for $LAB_USER"
python3 - "$row" "$exp_gpu_us" "$exp_shard_us" "$exp_jobs" <<'PY' || lab_fail "gpuhub usage differs from the records (see above)"
import json, sys
row, g, s, n = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ok = abs(row["gpu_seconds"] - g / 1e6) < 1e-6 and abs(row["shard_seconds"] - s / 1e6) < 1e-6 and row["jobs"] == n \
    and abs(row["gpu_equivalent_seconds"] - (g + s / 14) / 1e6) < 1e-6
print(("ok" if ok else "MISMATCH") + f": gpu_seconds {row['gpu_seconds']} (want {g/1e6}), shard_seconds {row['shard_seconds']} (want {s/1e6}), jobs {row['jobs']} (want {n})")
sys.exit(0 if ok else 1)
PY
fi
lab_run "$cli" --socket "$T/run/agent.sock" usage --since 1d --by user
grep -q "GPU_EQ_H" <<<"$LAB_OUT" || lab_fail "the usage table has no GPU_EQ_H column"
lab_run "$cli" --socket "$T/run/agent.sock" job "${JOB[shard7]}" --json
[ "$(jq '.nodes[0].shards' <<<"$LAB_OUT")" = 7 ] || lab_fail "gpuhub job ${JOB[shard7]}: shards is not 7"
[ "$(jq '.nodes[0].gpu_seconds' <<<"$LAB_OUT")" = 0 ] || lab_fail "gpuhub job ${JOB[shard7]}: a shard job has whole-GPU seconds"
lab_run "$cli" --socket "$T/run/agent.sock" job "${JOB[gpu2]}"
grep -q "GPU 1" <<<"$LAB_OUT" || lab_fail "gpuhub job ${JOB[gpu2]}: GPU 1 not listed"

# Slurm's own accounting (slurmdbd), per job and in sum.
if [ "$sacct_on" = 0 ]; then
    echo "SKIP (sacct comparison): the lab runs without slurmdbd (AccountingStorageType=${acct_type:-unknown});"
    echo "  GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh turns it on; GPUHUB_REQUIRE_SACCT=1 makes this a failure"
    echo "PASS: accounting-lab (without the sacct comparison)"
    exit 0
fi
ids="${JOB[gpu1]},${JOB[gpu2]},${JOB[shard7]},${JOB[cpu]}"
sacct_timeout="${GPUHUB_SACCT_TIMEOUT:-60}"
# slurmdbd stores a job's end asynchronously (slurmctld's agent queue): poll until all four are
# COMPLETED with an end time. -X: the allocation line; Start/End as epoch seconds.
sacct_cmd=(sacct -n -X -P -j "$ids" -o JobID,State,AllocTRES,ElapsedRaw,Start,End)
echo "+ SLURM_TIME_FORMAT=%s ${sacct_cmd[*]}  (until all 4 are COMPLETED, at most ${sacct_timeout}s)"
for ((i = 0; ; i++)); do
    sacct_out="$(SLURM_TIME_FORMAT=%s "${sacct_cmd[@]}" 2>&1)" || true
    [ "$(awk -F'|' '$2 == "COMPLETED" && $6 ~ /^[0-9]+$/' <<<"$sacct_out" | wc -l)" -eq 4 ] && break
    [ "$i" -lt $((sacct_timeout * 2)) ] || {
        printf '%s\n' "$sacct_out" | sed 's/^/  | /'
        tail -n 10 "$LAB_SLURMDBD_LOG" 2>/dev/null | sed 's/^/  slurmdbd.log: /'
        lab_fail "sacct does not list jobs $ids as COMPLETED after ${sacct_timeout}s: slurmctld -> slurmdbd is broken or slow (sdiag shows the DBD agent queue; see $LAB_SLURMDBD_LOG)"
    }
    sleep 0.5
done
printf '%s\n' "$sacct_out" | sed 's/^/  | /'
echo "  (all 4 listed after $((i / 2)) s of polling)"
for shape in gpu1 gpu2 shard7 cpu; do
    "$cli" --socket "$T/run/agent.sock" job "${JOB[$shape]}" --json > "$T/job-${JOB[$shape]}.json" \
        || lab_fail "gpuhub job ${JOB[$shape]} --json failed"
done
lab_run "$cli" --socket "$T/run/agent.sock" usage --since 1d --by user --json
row="$(jq -c --arg u "$LAB_USER" '.rows[] | select(.user == $u)' <<<"$LAB_OUT")"
printf '%s\n' "$sacct_out" > "$T/sacct.txt"
python3 - "$T" "$row" "$t_submit" "gpu1=${JOB[gpu1]}" "gpu2=${JOB[gpu2]}" "shard7=${JOB[shard7]}" "cpu=${JOB[cpu]}" <<'PY' \
    || lab_fail "gpuhub's accounting differs from Slurm's (sacct); see the MISMATCH lines above"
import json, sys
tmp, usage, t_submit = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
shapes = dict(a.split("=") for a in sys.argv[4:])           # shape -> job id
want = {"gpu1": (1, 0), "gpu2": (2, 0), "shard7": (0, 7), "cpu": (0, 0)}   # what was requested
# Tolerance per job, in seconds of job time. Slurm keeps a job's start and end as whole seconds
# (time_t), so ElapsedRaw = End - Start is off from the true duration by less than 1 s. With job
# boundaries from Slurm gpuhub's are exactly those; with the job-hooks build the records are
# taken in the job prolog, which runs just after slurmctld allocated the job
# (PrologFlags=Alloc), and the job epilog, which runs just after slurmctld marked it ended;
# each of those delays measures tens of ms on the lab, allowed up to 0.5 s here. So
#   |gpuhub seconds - ElapsedRaw| <= 1.5 s,
#   |GPU-seconds - gres/gpu x ElapsedRaw| <= gres/gpu x 1.5 s (shards likewise),
#   gpuhub's start (end) lies in [Start - 0.5 s, Start + 1.5 s] (End likewise),
# and the sums over the four jobs within the sum of the per-job tolerances. On jobs this short
# N x 1.5 s is loose, so GPU-seconds (shard-seconds) must also be exactly sacct's gres/gpu
# (gres/shard) times gpuhub's own seconds, which are held to 1.5 s above.
TOL, EARLY = 1.5, 0.5
rows = {}
for line in open(f"{tmp}/sacct.txt"):
    f = line.strip().split("|")
    if len(f) == 6:
        rows[f[0]] = f
bad = []
sum_g = sum_s = sum_tol_g = sum_tol_s = job_g = job_s = 0.0
for shape, jid in shapes.items():
    f = rows.get(jid)
    if f is None:
        bad.append(f"job {jid} ({shape}): not in sacct"); continue
    _, state, alloc, el, start, end = f
    el, start, end = int(el), int(start), int(end)
    tres = dict(kv.split("=", 1) for kv in alloc.split(",") if "=" in kv)
    s_gpus, s_shards = int(tres.get("gres/gpu", 0)), int(tres.get("gres/shard", 0))
    n = json.load(open(f"{tmp}/job-{jid}.json"))["nodes"][0]
    g_shards = n["shards"]
    g_gpus = 0 if g_shards else len(n["gpus"])          # a shard job holds shards, not whole GPUs
    secs, g_start, g_end = n["seconds"], n["start_us"] / 1e6, n["end_us"] / 1e6
    checks = [
        (start >= t_submit - 1, f"sacct's job {jid} started at {start}, before this test ({t_submit}): a stale row"),
        ((s_gpus, s_shards) == want[shape], f"sacct AllocTRES gres/gpu={s_gpus} gres/shard={s_shards}, requested {want[shape]}"),
        (g_gpus == s_gpus, f"GPUs: gpuhub {g_gpus}, sacct gres/gpu={s_gpus}"),
        (g_shards == s_shards, f"shards: gpuhub {g_shards}, sacct gres/shard={s_shards}"),
        (abs(secs - el) <= TOL, f"seconds: gpuhub {secs:.3f}, sacct ElapsedRaw {el} (tolerance {TOL})"),
        (abs(n["gpu_seconds"] - s_gpus * el) <= s_gpus * TOL + 1e-9,
         f"GPU-seconds: gpuhub {n['gpu_seconds']:.3f}, sacct {s_gpus} x {el} (tolerance {s_gpus * TOL})"),
        (abs(n["shard_seconds"] - s_shards * el) <= s_shards * TOL + 1e-9,
         f"shard-seconds: gpuhub {n['shard_seconds']:.3f}, sacct {s_shards} x {el} (tolerance {s_shards * TOL})"),
        (abs(n["gpu_seconds"] - s_gpus * secs) < 1e-3, f"GPU-seconds: gpuhub {n['gpu_seconds']:.6f}, not sacct's {s_gpus} x gpuhub's {secs:.6f} s"),
        (abs(n["shard_seconds"] - s_shards * secs) < 1e-3, f"shard-seconds: gpuhub {n['shard_seconds']:.6f}, not sacct's {s_shards} x gpuhub's {secs:.6f} s"),
        (-EARLY <= g_start - start <= TOL, f"start: gpuhub {g_start:.3f}, sacct {start} (offset {g_start - start:+.3f})"),
        (-EARLY <= g_end - end <= TOL, f"end: gpuhub {g_end:.3f}, sacct {end} (offset {g_end - end:+.3f})"),
    ]
    errs = [m for ok, m in checks if not ok]
    bad += [f"job {jid} ({shape}): {m}" for m in errs]
    print(("ok" if not errs else "MISMATCH") + f": job {jid} ({shape}): sacct gres/gpu={s_gpus} gres/shard={s_shards} "
          f"ElapsedRaw {el} s; gpuhub gpus {g_gpus} shards {g_shards} seconds {secs:.3f} "
          f"(start {g_start - start:+.3f} s, end {g_end - end:+.3f} s from sacct's), "
          f"gpu_seconds {n['gpu_seconds']:.3f}, shard_seconds {n['shard_seconds']:.3f}")
    sum_g += s_gpus * el; sum_s += s_shards * el
    job_g += n["gpu_seconds"]; job_s += n["shard_seconds"]
    sum_tol_g += s_gpus * TOL; sum_tol_s += s_shards * TOL
for m in bad:
    print("MISMATCH: " + m)
ok_sum = abs(usage["gpu_seconds"] - sum_g) <= sum_tol_g + 1e-9 and abs(usage["shard_seconds"] - sum_s) <= sum_tol_s + 1e-9 \
    and abs(usage["gpu_seconds"] - job_g) < 1e-3 and abs(usage["shard_seconds"] - job_s) < 1e-3
print(("ok" if ok_sum else "MISMATCH") + f": sum: gpuhub usage gpu_seconds {usage['gpu_seconds']:.3f} vs sacct "
      f"sum(gres/gpu x ElapsedRaw) {sum_g:.0f} (tolerance {sum_tol_g}); shard_seconds {usage['shard_seconds']:.3f} "
      f"vs sum(gres/shard x ElapsedRaw) {sum_s:.0f} (tolerance {sum_tol_s}); the jobs' own sums {job_g:.3f}, {job_s:.3f}")
sys.exit(0 if ok_sum and not bad else 1)
PY
echo "PASS: accounting-lab"
