#!/usr/bin/env bash
# Accounting on the lab: srun --gres=gpu:1, --gres=gpu:2, --gres=shard:7 and a CPU-only job
# run and end as the unprivileged lab user with the plugin writing to a private spool; then a
# private gpuhub-agent ingests that spool, and `gpuhub usage --json` must show exactly the
# GPU-seconds and shard-seconds computed here from the records' own timestamps, and `gpuhub
# job` the shard job's 7 shards. With slurmdbd (sacct), the elapsed times are compared too.
# GPUHUB_AGENT_BIN / GPUHUB_CLI_BIN override the binaries (default target/release/).
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
agent_bin="${GPUHUB_AGENT_BIN:-$LAB_REPO/target/release/gpuhub-agent}"
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
"$cli" usage --help 2>/dev/null | grep -q -- '--by' || lab_fail "$cli has no \`usage --by\`: the accounting CLI is not wired in this build"
spank_fixture
lab_user
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
for shape in gpu1 gpu2 shard7 cpu; do
    lab_wait_record "$T_SPOOL" "${JOB[$shape]}" job_end 30 || lab_fail "job ${JOB[$shape]} ($shape): no job_end record"
done

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

# A private agent on the test's spool.
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
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
enable_slurm = false
[accounting]
ingest_interval_ms = 200
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
lab_run "$cli" --socket "$T/run/agent.sock" usage --since 1d --by user
grep -q "GPU_EQ_H" <<<"$LAB_OUT" || lab_fail "the usage table has no GPU_EQ_H column"
lab_run "$cli" --socket "$T/run/agent.sock" job "${JOB[shard7]}" --json
[ "$(jq '.nodes[0].shards' <<<"$LAB_OUT")" = 7 ] || lab_fail "gpuhub job ${JOB[shard7]}: shards is not 7"
[ "$(jq '.nodes[0].gpu_seconds' <<<"$LAB_OUT")" = 0 ] || lab_fail "gpuhub job ${JOB[shard7]}: a shard job has whole-GPU seconds"
lab_run "$cli" --socket "$T/run/agent.sock" job "${JOB[gpu2]}"
grep -q "GPU 1" <<<"$LAB_OUT" || lab_fail "gpuhub job ${JOB[gpu2]}: GPU 1 not listed"

# Slurm's own accounting, where slurmdbd runs: elapsed seconds agree within a second.
if sacct -n -X -j "${JOB[gpu1]}" -o ElapsedRaw >/dev/null 2>&1 && [ -n "$(sacct -n -X -j "${JOB[gpu1]}" -o ElapsedRaw | tr -d ' ')" ]; then
    for shape in gpu1 gpu2 shard7; do
        el="$(sacct -n -X -j "${JOB[$shape]}" -o ElapsedRaw | tr -d ' ' | head -n1)"
        ours="$("$cli" --socket "$T/run/agent.sock" job "${JOB[$shape]}" --json | jq '.nodes[0].seconds')"
        python3 -c "import sys; sys.exit(0 if abs($el - $ours) <= 1.5 else 1)" || lab_fail "job ${JOB[$shape]}: sacct ElapsedRaw $el s, gpuhub $ours s"
        echo "ok: job ${JOB[$shape]} ($shape): sacct $el s, gpuhub $ours s"
    done
else
    echo "(no slurmdbd: comparison with sacct skipped)"
fi
echo "PASS: accounting-lab"
