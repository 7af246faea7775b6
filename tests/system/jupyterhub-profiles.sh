#!/usr/bin/env bash
# timeout: 180
# Issue 19: the three JupyterHub profiles that tests/system/jupyterhub-lab.sh does not spawn
# ("1 GPU (H200), 8 hours", "2 GPUs (H200), 4 hours", "CPU only, 8 hours"; keys gpu1-8h,
# gpu2-4h, cpu-8h), each picked in the spawn form of the shipped rpm/share/jupyterhub config on
# the lab (tests/lib/jupyterhub.sh), one after the other (the lab has two GPUs):
#   - the notebook server is a real Slurm job of the signed-in user with the profile's
#     partition, GPUs (TRES gres/gpu) and time limit (scontrol show job);
#   - in its kernel: OPENAI_BASE_URL is the gateway's, the injected OPENAI_API_KEY (the job's
#     credential) gets an answer from the gateway, MLFLOW_TRACKING_URI is the lab's MLflow,
#     MLFLOW_RUN_CONTEXT/MLFLOW_TAGS carry the job's id, user, partition and GPUs, and every
#     assigned role has its <ROLE>_MODEL;
#   - while the 2-GPU job runs, the gpuhub page shows it with its 2 GPUs and each GPU's
#     utilisation and VRAM now (the lab has no NVML: the page says there is no sample), the
#     user's GPU-hours this month and their quota (none covers the lab user), the deprecated
#     alias svc-ocr flagged with its replacement; made a hub admin,
#     the user sees every quota (the lab's user:gpuhubquota) and every user's jobs;
#   - tests/rpm/test_gpuhub_page.py (the page's wording for a GPU sampled now and for quota
#     states, which the lab cannot show) passes with the hub's Python;
#   - after the server is stopped the job ends and `gpuhub job` bills 1, 2 and 0 GPUs (no
#     shards) to the user.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
lab_user
. "$(dirname "$0")/../lib/jupyterhub.sh"
jh_start
# The page's wording for what the lab cannot show (a GPU sampled now, quota states).
"$JH_VENV/bin/python" -B "$LAB_REPO/tests/rpm/test_gpuhub_page.py" 2>&1 | tail -n 3 ||
    lab_fail "tests/rpm/test_gpuhub_page.py failed"
jh_signin
U="$JH_U"
SNAP=/run/gpuhub/snapshot.json
CELL='import json, os, urllib.request
env = {k: v for k, v in os.environ.items() if k.startswith(("MLFLOW_", "OPENAI_BASE_URL", "SLURM_JOB_ID")) or k.endswith("_MODEL")}
print("ENV " + json.dumps(env))
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models", headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
with urllib.request.urlopen(req, timeout=30) as r:
    print("GATEWAY", r.status, len(json.load(r)["data"]), "models")'

# profile KEY LABEL PARTITION TIMELIMIT GPUS
profile() {
    local key="$1" label="$2" part="$3" limit="$4" gpus="$5" out env
    echo "+ spawn '$label' ($key)"
    jh_spawn "$key" "$label"
    local job="$JH_JOB"
    lab_run scontrol show job "$job"
    grep -qE "UserId=$U\(" <<<"$LAB_OUT" || jh_fail "job $job is not $U's"
    grep -qE "Partition=$part( |$)" <<<"$LAB_OUT" || jh_fail "job $job ($key) is not in partition $part"
    grep -qE "TimeLimit=$limit( |$)" <<<"$LAB_OUT" || jh_fail "job $job ($key) has not the time limit $limit"
    if [ "$gpus" -gt 0 ]; then
        grep -qE "[ ,=]gres/gpu(:h200)?=$gpus(,| |$)" <<<"$LAB_OUT" || jh_fail "job $job ($key) was not given $gpus GPUs"
    else
        ! grep -qE "gres/(gpu|shard)" <<<"$LAB_OUT" || jh_fail "the CPU job $job has GPUs or shards"
    fi
    out="$(jh_cell "$CELL")" || jh_fail "the cell failed in job $job: $out"
    grep -q "^GATEWAY 200 [1-9][0-9]* models$" <<<"$out" || jh_fail "the gateway did not answer job $job's credential: $out"
    env="$(sed -n 's/^ENV //p' <<<"$out")"
    jq -e --arg j "$job" --arg u "$U" --arg p "$part" --arg gw "$(jq -r .gateway_url "$SNAP")/v1" \
        --arg ml "$(jq -r .mlflow_tracking_uri "$SNAP")" --argjson roles "$(jq .roles "$SNAP")" --argjson n "$gpus" '
        .OPENAI_BASE_URL == $gw and .SLURM_JOB_ID == $j and .MLFLOW_TRACKING_URI == $ml
        and (.MLFLOW_RUN_CONTEXT | fromjson | .["slurm.job_id"] == $j and .["slurm.user"] == $u and .["slurm.partition"] == $p
             and ((.["slurm.gpus"] // "") | split(",") | map(select(. != "")) | length) == $n)
        and .MLFLOW_TAGS == .MLFLOW_RUN_CONTEXT
        and ([$roles | to_entries[] | select(.value != null)] | length > 0)
        and (. as $env | [$roles | to_entries[] | select(.value != null) | $env[(.key | ascii_upcase) + "_MODEL"] == .value] | all)' \
        <<<"$env" >/dev/null || jh_fail "the gpuhub environment in job $job's kernel is not right: $env"
    echo "   job $job: $part, $limit, $gpus GPUs; kernel: gateway answered, MLflow tags and <ROLE>_MODEL of the job"
    [ "$gpus" != 2 ] || page_checks "$job"
    jh_stop
    lab_run "$JH_GPUHUB" job "$job"
    jq -e --arg u "$U" --argjson n "$gpus" '.nodes[0] | .user == $u and .gpu_count == $n and .shards == 0 and .shard_seconds == 0
        and (if $n == 0 then .gpu_seconds == 0 else .gpu_seconds > 0 end)' "$JH_T/job.json" >/dev/null ||
        jh_fail "gpuhub job $job does not bill $gpus GPUs to $U: $(cat "$JH_T/job.json")"
}

page_checks() {
    local job="$1" s
    echo "+ the gpuhub page while job $job runs"
    s="$(jh_page)"; [ "$s" = 200 ] || jh_fail "GET /services/gpuhub/: $s $(jh_text | head -c 300)"
    mkdir -p "$LAB_REPO/target/test-logs" && cp "$JH_T/gpage" "$LAB_REPO/target/test-logs/jupyterhub-profiles-page.html"
    grep -q "<td>$job</td><td>$U</td>.*<td>2 GPUs</td>" "$JH_T/gpage" || jh_fail "the page does not show job $job with 2 GPUs: $(jh_text | head -c 800)"
    # Each GPU's sample now: the lab agent has no NVML (gpuhub_nvml_up 0), so none.
    curl -s http://127.0.0.1:9410/metrics | grep -x "gpuhub_nvml_up 0" >/dev/null || jh_fail "the lab agent reads NVML now: update this check to the sampled values"
    grep -qF "GPU 0: now: no sample (no GPU telemetry for this job); mean -, peak -<br>GPU 1: now: no sample" "$JH_T/gpage" ||
        jh_fail "the page does not show job $job's two GPUs with their sample now: $(jh_text | head -c 800)"
    jh_text | grep -q "GPU-hours this month and quota .* No GPU-hour quota covers you\." ||
        jh_fail "the page does not say that no quota covers $U: $(jh_text | head -c 800)"
    # The lab's deprecated alias (tests/lab/agent.toml) flagged with its replacement.
    grep -q "<td>svc-ocr</td><td>[a-z]*</td><td>dots.ocr</td><td>DEPRECATED: use dots.ocr instead" "$JH_T/gpage" ||
        jh_fail "the page does not flag the deprecated svc-ocr with its replacement dots.ocr: $(jh_text | head -c 1500)"
    s="$(jh_api -o /dev/null -w '%{http_code}' -X PATCH -d '{"admin": true}' "$JH_PUB/hub/api/users/$U")"
    [ "$s" = 200 ] || jh_fail "making $U a hub admin: $s"
    # The page caches who a token is: a new sign-in to it (OAuth again, a new token).
    sed -i '/[[:space:]]service-gpuhub[[:space:]]/d' "$JH_T/jar"
    s="$(jh_page)"; [ "$s" = 200 ] || jh_fail "GET /services/gpuhub/ as an admin: $s"
    cp "$JH_T/gpage" "$LAB_REPO/target/test-logs/jupyterhub-profiles-page-admin.html"
    jh_text | grep -q "You are a hub admin: you see every user" || jh_fail "the admin's page does not say so: $(jh_text | head -c 400)"
    grep -qE "<td>user:gpuhubquota</td><td>month</td><td>[0-9.]+</td><td>1000.0</td>" "$JH_T/gpage" ||
        jh_fail "the admin's page does not show the lab's quota user:gpuhubquota of 1000 GPU-hours: $(jh_text | head -c 1200)"
    grep -q "<td>$job</td><td>$U</td>" "$JH_T/gpage" || jh_fail "the admin's page does not show job $job"
    jh_api -o /dev/null -X PATCH -d '{"admin": false}' "$JH_PUB/hub/api/users/$U"
    echo "   page: job $job with 2 GPUs and their samples now; no quota for $U; the admin sees user:gpuhubquota"
}

profile gpu1-8h "1 GPU (H200), 8 hours" interactive 08:00:00 1
profile gpu2-4h "2 GPUs (H200), 4 hours" interactive 04:00:00 2
profile cpu-8h "CPU only, 8 hours" cpu 08:00:00 0
lab_node_ok
echo "PASS jupyterhub-profiles"
