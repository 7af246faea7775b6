#!/usr/bin/env bash
# timeout: 400
# Trust battery, identity (issue 21): a local user who controls their job's environment cannot
# change who gpuhub says ran a job, nor push unbounded text into a record or a token.
# As the unprivileged $LAB_USER (gpuhublab), three hostile environments are exported before
# srun, sbatch and `salloc ... srun ...` (nine jobs):
#   lies  SLURM_JOB_USER=root SLURM_JOB_UID=0 SLURM_JOB_ID=1 SLURM_JOB_ACCOUNT, SLURM_JOB_PARTITION
#         and SLURMD_NODENAME set to made-up names (srun gets SLURM_JOB_ID through --export:
#         in its own environment srun would try to attach to job 1)
#   big   a 100 KB value in SLURM_JOB_USER, SLURM_JOB_UID, SLURM_JOB_ACCOUNT, SLURM_JOB_PARTITION,
#         SLURMD_NODENAME, SLURM_STEP_GPUS and SLURM_SHARDS_ON_NODE
#   ctl   the same variables holding a newline, an escape sequence and a tab
# For each job: every spool record (private spool, spank_fixture) carries the job's id, the
# user's uid and passwd name, equal to Slurm's (`sacct -j JOB -o User,UID` where slurmdbd runs,
# else `id`); the shipped plugin writes step records only, which carry no account or partition
# (the agent takes both from Slurm: trust-reconcile.sh); the node is gpu01 or unknown; no record holds a made-up value, a
# 100 KB value or a control character. The GPUHUB_TOKEN the job sees is for that uid, that
# user and that job id. Last, with the lab's own plugstack line and the lab agent: a job's
# token (forged environment again) is accepted while it runs and refused once it has ended.
# The gateway's other checks (a forged name with a valid MAC, allow-lists) are in
# agent/tests/gateway_proxy.rs.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
lab_user
spank_fixture
cd /tmp
uid="$(id -u "$LAB_USER")"
U="$T/u"
mkdir -p "$U" && chown "$LAB_USER" "$U"

acct_type="$(scontrol show config 2>/dev/null | awk '$1 == "AccountingStorageType" {print $3}')"
sacct_on=0
if [ "$acct_type" = accounting_storage/slurmdbd ]; then
    sacct_on=1
else
    prereq_missing "the lab runs without slurmdbd (AccountingStorageType=${acct_type:-unknown}), so sacct cannot say who ran a job" \
        "bring it up with GPUHUB_LAB_ACCOUNTING=1 tests/lab/up.sh" || echo "  (the truth is then \`id $LAB_USER\`)"
fi

# ---- the hostile environments, as files the user sources
big="$(head -c 102400 /dev/zero | tr '\0' x)"
ctl=$'ctl\nSLURM_JOB_USER=root\e[31m\tend'
write_env() { # ROUND NAME=VALUE...
    local f="$U/$1.env" kv
    shift
    : > "$f"
    for kv in "$@"; do printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}" >> "$f"; done
    chmod 644 "$f"
}
write_env lies SLURM_JOB_USER=root SLURM_JOB_UID=0 SLURM_JOB_ACCOUNT=forged-account SLURM_JOB_PARTITION=forged-partition SLURMD_NODENAME=forged-node
for round in big ctl; do
    [ "$round" = big ] && v="$big" || v="$ctl"
    write_env "$round" "SLURM_JOB_USER=$v" "SLURM_JOB_UID=$v" "SLURM_JOB_ACCOUNT=$v" "SLURM_JOB_PARTITION=$v" \
        "SLURMD_NODENAME=$v" "SLURM_STEP_GPUS=$v" "SLURM_SHARDS_ON_NODE=$v"
done
# What no record may contain: the made-up names, the big value's run of x, the control value
# (JSON would escape its newline as \n and its escape as \u001b).
forged_re='forged-|root|x{300}|\\n|\\t|\\u001b|\\u0009|ctl'

# What each job prints: its id and token (decoded below, not here: the job's output is the user's).
job_cmd='echo "JOB=$SLURM_JOB_ID"; echo "TOKEN=${GPUHUB_TOKEN:-none}"'

declare -A JOB=()
declare -A TOKEN=()
as_user() { # ROUND COMMAND: run COMMAND as the user in $U with the ROUND environment
    lab_run runuser -u "$LAB_USER" -- bash -c "cd $U && . $U/$1.env && $2"
}
val() { sed -n "s/^$1=//p" <<<"$2" | head -n1; }
for round in lies big ctl; do
    jobid_lie=""
    [ "$round" = lies ] && jobid_lie=",SLURM_JOB_ID=1"
    echo "== $round: srun"
    as_user "$round" "timeout 120 srun --export=ALL$jobid_lie -N1 -t 2 --gres=gpu:1 bash -c '$job_cmd'"
    [ "$LAB_RC" = 0 ] || lab_fail "$round: srun as $LAB_USER failed (exit $LAB_RC); a hostile environment must not break the job"
    JOB[$round-srun]="$(val JOB "$LAB_OUT")"; TOKEN[$round-srun]="$(val TOKEN "$LAB_OUT")"

    echo "== $round: sbatch"
    [ "$round" = lies ] && lie_id="export SLURM_JOB_ID=1 && " || lie_id=""
    as_user "$round" "${lie_id}sbatch --parsable -N1 -t 2 --gres=shard:2 -o $U/$round-sbatch.out --wrap '$job_cmd'"
    [ "$LAB_RC" = 0 ] || lab_fail "$round: sbatch as $LAB_USER failed (exit $LAB_RC)"
    j="$(tail -n1 <<<"$LAB_OUT")"; j="${j%%;*}"
    lab_cleanup_add "lab_cancel $j"
    lab_wait_job "$j" 90 || lab_fail "$round: batch job $j did not finish in 90 s"
    out="$(cat "$U/$round-sbatch.out")"
    JOB[$round-sbatch]="$(val JOB "$out")"; TOKEN[$round-sbatch]="$(val TOKEN "$out")"
    [ "${JOB[$round-sbatch]}" = "$j" ] || lab_fail "$round: batch job $j printed job id '${JOB[$round-sbatch]}'"

    echo "== $round: salloc ... srun ..."
    as_user "$round" "${lie_id}timeout 120 salloc -N1 -t 2 --gres=gpu:1 srun bash -c '$job_cmd'"
    [ "$LAB_RC" = 0 ] || lab_fail "$round: salloc as $LAB_USER failed (exit $LAB_RC)"
    JOB[$round-salloc]="$(val JOB "$LAB_OUT")"; TOKEN[$round-salloc]="$(val TOKEN "$LAB_OUT")"
done

# ---- the truth, per job, and the checks
fails=0
bad() { echo "MISMATCH: $*"; fails=$((fails + 1)); }
for key in lies-srun lies-sbatch lies-salloc big-srun big-sbatch big-salloc ctl-srun ctl-sbatch ctl-salloc; do
    job="${JOB[$key]}"
    [[ "$job" =~ ^[0-9]+$ ]] || { bad "$key: the job printed no job id"; continue; }
    lab_wait_record "$T_SPOOL" "$job" step_end 30 || bad "$key: job $job has no step_end record"
    want_user="$LAB_USER" want_uid="$uid" want_acct="" want_part=""
    if [ "$sacct_on" = 1 ]; then
        line=""
        for ((i = 0; i < 60; i++)); do
            line="$(sacct -n -X -P -j "$job" -o User,UID,Account,Partition 2>/dev/null | head -n1)"
            [ -n "$line" ] && break
            sleep 0.5
        done
        [ -n "$line" ] || lab_fail "sacct does not list job $job after 30 s"
        IFS='|' read -r want_user want_uid want_acct want_part <<<"$line"
        [ "$want_user" = "$LAB_USER" ] && [ "$want_uid" = "$uid" ] || lab_fail "sacct says job $job is $want_user/$want_uid, expected $LAB_USER/$uid"
    fi
    recs="$(lab_records "$T_SPOOL" "$job")"
    echo "-- $key: job $job (Slurm: user $want_user uid $want_uid account ${want_acct:-?} partition ${want_part:-?})"
    cut -c1-400 <<<"$recs" | sed 's/^/    /'
    for k in step_start step_end; do
        lab_jq_any --arg k "$k" 'select(.kind == $k) | true' <<<"$recs" || bad "$key: job $job has no $k record"
    done
    lab_jq_any --argjson u "$want_uid" --arg n "$want_user" 'select(.uid != $u or .user != $n) | true' <<<"$recs" \
        && bad "$key: job $job has a record whose uid/user is not $want_uid/$want_user"
    lab_jq_any --arg node "$LAB_NODE" 'select(.node != $node and .node != "") | true' <<<"$recs" \
        && bad "$key: job $job has a record whose node is neither $LAB_NODE nor unknown"
    lab_jq_any 'select((.kind | startswith("step_")) and (.account != null or .partition != null)) | true' <<<"$recs" \
        && bad "$key: job $job has a step record with an account or partition (the step's environment is the user's)"
    if grep -Eq "$forged_re" <<<"$recs"; then bad "$key: job $job has a record holding a hostile value: $(grep -Eo "$forged_re" <<<"$recs" | sort -u | head -c 200 | tr '\n' ' ')"; fi
    n="$(wc -c <<<"$recs")"
    [ "$n" -lt 8192 ] || bad "$key: job $job's records are $n bytes (a 100 KB value got in)"
    # The token: ghj1.<uid>.<user>.<job>.<expiry>.<mac>, the user possibly with dots.
    t="${TOKEN[$key]}"
    echo "    token: $t"
    if [[ "$t" =~ ^ghj1\.([0-9]+)\.(.+)\.([0-9]+)\.([0-9]+)\.([0-9a-f]{64})$ ]]; then
        [ "${BASH_REMATCH[1]}" = "$want_uid" ] || bad "$key: job $job's token is for uid ${BASH_REMATCH[1]}, not $want_uid"
        [ "${BASH_REMATCH[2]}" = "$want_user" ] || bad "$key: job $job's token is for user ${BASH_REMATCH[2]}, not $want_user"
        [ "${BASH_REMATCH[3]}" = "$job" ] || bad "$key: job $job's token is for job ${BASH_REMATCH[3]}"
    else
        bad "$key: job $job got no well-formed GPUHUB_TOKEN: '$(head -c 200 <<<"$t")'"
    fi
done
# Nothing in the spool belongs to another job (a made-up SLURM_JOB_ID=1) or another uid.
others="$(lab_records "$T_SPOOL" 1)"
[ -z "$others" ] || bad "records of job 1 (the made-up SLURM_JOB_ID) appeared: $others"
# The plugin said what it ignored (one line per hook), without quoting it.
ignored="$(grep -a "gpuhub: ignored" "$LAB_SLURMD_LOG" 2>/dev/null | tail -n 20 || true)"
[ -n "$ignored" ] || bad "no \"gpuhub: ignored\" line in $LAB_SLURMD_LOG for the refused values"
echo "  last lines about refused values:"; cut -c1-300 <<<"$ignored" | tail -n 3 | sed 's/^/    /'
if grep -Eq "x{300}|"$'\e' <<<"$ignored"; then bad "$LAB_SLURMD_LOG quotes a refused value"; fi
# The lab agent's gateway (the lab's own plugstack line and key): the token of a job run with
# the forged environment is the user's while the job runs and refused once it has ended.
plugstack_restore
if agent_healthy; then
    as_user lies "timeout 60 srun -N1 -t 1 bash -c 'echo \"JOB=\$SLURM_JOB_ID\"; echo \"TOKEN=\$GPUHUB_TOKEN\"; curl -s -o /dev/null -w \"DURING=%{http_code}\\n\" -H \"Authorization: Bearer \$GPUHUB_TOKEN\" \"\$OPENAI_BASE_URL/models\"'"
    job="$(val JOB "$LAB_OUT")" t="$(val TOKEN "$LAB_OUT")"
    [ "$(val DURING "$LAB_OUT")" = 200 ] || bad "gateway: job $job's own token got $(val DURING "$LAB_OUT") while the job ran, expected 200"
    [[ "$t" == "ghj1.$uid.$LAB_USER.$job."* ]] || bad "gateway: job $job's token is not for $uid/$LAB_USER: $t"
    # The job's step ended just before the job: the agent asks Slurm on its next ingest passes
    # and the gateway refuses the token about 2 s after the job's end (docs/security.md); 5 s
    # here (a reconciliation interval plus its grace would take 5 to 10 s on the lab).
    after="" t0="$(date +%s%N)"
    while :; do
        after="$(curl -s --max-time 5 -H "Authorization: Bearer $t" http://127.0.0.1:8400/v1/models)"
        took_ms=$((($(date +%s%N) - t0) / 1000000))
        grep -q "job $job has ended" <<<"$after" && break
        [ "$took_ms" -lt 5000 ] || break
        sleep 0.1
    done
    if ! grep -q "job $job has ended" <<<"$after"; then
        bad "gateway: job $job's token still works ${took_ms} ms after the job ended: $(head -c 300 <<<"$after")"
        echo "  the lab agent's accounting lines:"; grep -a "accounting\|job_id=$job\b" "$LAB_AGENT_LOG" | tail -n 15 | cut -c1-400 | sed 's/^/    /'
    fi
    echo "  gateway ${took_ms} ms after the job ended: $after"
else
    bad "the lab's gpuhub-agent is not answering http://127.0.0.1:8400/healthz (run tests/lab/up.sh)"
fi
lab_node_ok
[ "$fails" = 0 ] || lab_fail "$fails mismatch(es) between gpuhub's records/tokens and Slurm's truth (see MISMATCH lines)"
echo "PASS: trust-identity"
