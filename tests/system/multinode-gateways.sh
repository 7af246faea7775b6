#!/usr/bin/env bash
# Gateways share the work, and one config decides each node's role (#18). On the two-node lab
# (GPUHUB_LAB_NODES=2 tests/lab/up.sh, both agents on one PostgreSQL, the lab models' idle
# timeout cut to 10 s):
#  1. gateway role on both nodes: four concurrent first calls to the cold dots.ocr, two through
#     gpu01's gateway and two through gpu02's, start exactly one worker job (squeue and the
#     store; single flight through a PostgreSQL advisory lock), and all four succeed; the
#     gateway that does not own the worker routed to it (its log names the worker); a stale
#     store row of another agent (its job cancelled, its port on gpu02 held by a process of
#     $LAB_USER answering every health check) is refused before its key is sent: the squatter
#     sees no request, the refusal is logged with the job;
#  2. calls that keep coming through the non-owning gateway only keep the worker loaded past its
#     idle timeout (the owner reads their use from the store); a key's tokens of the day spent at
#     gpu01 are refused at gpu02; once the calls stop, the owner unloads the worker;
#  2b. an API key created, widened (`gpuhub keys set`) and revoked through gpu01's agent, and a
#     role moved there, apply at gpu02's gateway and to gpu02's jobs within 6 s; a key's --rpm
#     used up at gpu01 is refused at gpu02 (the gateways exchange their limit counts); and a
#     version promoted by another agent (its model_promotions row) is served by both (cluster
#     sync);
#  2c. gpu02 runs sync-reg's worker (version 7), gpu01's gateway calls it in a loop; a promotion
#     to version 8 recorded through another agent: gpu02 switches its worker (a second job on
#     8, the old one drains and ends), gpu01's calls move to 8, and none fails;
#  2d. gpu02's agent restarted with other [gateway.limits]: gpu01's `gpuhub doctor` names gpu02
#     and both values (gateway-policy; the same before), and both agents' logs and
#     gpuhub_gateway_policy_differences say so (gpu01's within 6 s); its limits set back by
#     `gpuhub models reload` (no restart), both agree again within 6 s; meanwhile a role set
#     through gpu02 to a model only gpu02 serves is logged and counted (gpuhub_roles_unserved)
#     by gpu01 within 6 s, and its return too;
#  2e. gpu02's gateway borrows gpu01's wrap-gw worker, whose job outlives its server; the
#     server is killed: gpu02's next call gets 200 from a worker gpu02 starts, gpu02 reports the
#     dead worker through the store, and gpu01 checks it and stops its job within 20 s (its
#     idle timeout is 300 s);
#  3. gateway role on gpu01 only ([cluster] gateway_nodes = ["gpu01"]): gpu02's agent opens no
#     gateway port and removes its published policy, a job on gpu02 is told gpu01's gateway and
#     is served there, and gpu02's
#     agent shows that call (`gpuhub usage --calls`, `gpuhub names callers`: the store is
#     cluster-wide).
# Restores the one-node lab at exit. About 150 s (two lab re-ups of ~30 s each).
# timeout: 360
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lab/nodes.sh"
lab_require
lab_user
NODES_SH="$REPO/tests/lab/nodes.sh"
PSQL=(psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -d "$NODES_PG_DB" -tAq)
export NODES_IDLE_TIMEOUT_S=10
unset NODES_GATEWAY_NODES
G1="http://$(nodes_ip gpu01):8400"
G2="http://$(nodes_ip gpu02):8400"

fail() { nodes_test_fail "$@"; }
lab_cleanup_add nodes_test_restore
# A registry-served model on both agents (never started here), for the promotion in 2b.
EXTRA="$(mktemp /tmp/gpuhub-multigw-extra.XXXXXX)"
lab_cleanup_add "rm -f '$EXTRA'"
chmod 644 "$EXTRA"
cat > "$EXTRA" <<'TOML'

[[models]]
name = "sync-reg"
launcher = "slurm"
command = "/usr/local/libexec/gpuhub/gpuhub-test-worker --model {model} --version {version} --host {host} --port {port} --api-key-file {api_key_file}"
resources = { shards = 1, vram_gib = 1.0 }
mlflow_model = "sync-reg-model"

[[models]]
name = "wrap-gw"
launcher = "slurm"
# A wrapper that outlives its server: `{ server; sleep 300; }` (the job runs the command in the
# background, so it is one group).
command = "{ /usr/local/libexec/gpuhub/gpuhub-test-worker --model {model} --host {host} --port {port} --api-key-file {api_key_file}; sleep 300; }"
resources = { shards = 1, vram_gib = 1.0 }
idle_timeout_s = 300
TOML
export GPUHUB_LAB_NODES_EXTRA="$EXTRA"
lab_wait_gpus_free 240

echo "== two nodes, the gateway on both"
GPUHUB_LAB_NODES=2 GPUHUB_LAB_BUILD=0 "$REPO/tests/lab/up.sh" 2>&1 | grep -E '^\[lab\] (up|two nodes|ERROR)' || true
nodes_agent_healthy gpu01 && nodes_agent_healthy gpu02 || fail "an agent does not answer /healthz"
[ -z "$(squeue -h -n gpuhub-worker-dots.ocr -o %i)" ] || fail "a dots.ocr worker runs before the test"

# calls NODE 'URL...' [ROUNDS GAP]: a job of $LAB_USER on NODE posts chat calls to dots.ocr, to
# every URL at once (`env`: the GPUHUB_URL it was given), ROUNDS times GAP s apart (default
# once), with its injected credential; prints one HTTP status per call, then GPUHUB_URL and the
# job id.
calls() {
    (cd /tmp && runuser -u "$LAB_USER" -- srun -w "$1" -t 2 -J multigw-call sh -c '
        urls="$0"; [ "$urls" = env ] && urls="$GPUHUB_URL"
        for r in $(seq "$1"); do
            [ "$r" = 1 ] || sleep "$2"
            for url in $urls; do
                curl -s -o /dev/null -w "%{http_code}\n" --max-time 90 "$url/v1/chat/completions" \
                    -H "Authorization: Bearer $OPENAI_API_KEY" -H content-type:application/json \
                    -d "{\"model\":\"dots.ocr\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}" &
            done
            wait
        done
        echo "url $GPUHUB_URL"; echo "job $SLURM_JOB_ID"' "$2" "${3:-1}" "${4:-0}")
}

# until SECONDS CMD...: CMD succeeds within SECONDS (the agents read each other's changes every 2 s)
until_ok() { local end=$((SECONDS + $1)); shift; until "$@"; do [ "$SECONDS" -lt "$end" ] || return 1; sleep 0.2; done; }
g2_models() { nodes_exec gpu02 curl -s --max-time 5 -H "Authorization: Bearer $1" "$G2/v1/models"; }
g2_says() { g2_models "$1" | grep -q "$2"; }
# chat_at NODE URL KEY MODEL: one chat call from NODE with API key KEY; prints the HTTP status,
# the answer's body goes to $BODY.
BODY="$(mktemp /tmp/gpuhub-multigw-body.XXXXXX)"
lab_cleanup_add "rm -f '$BODY'"
chat_at() {
    local out
    out="$(nodes_exec "$1" curl -s -w '\n%{http_code}' --max-time 30 "$2/v1/chat/completions" -H "Authorization: Bearer $3" \
        -H content-type:application/json -d "{\"model\":\"$4\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}")"
    sed '$d' <<<"$out" >"$BODY"
    tail -n 1 <<<"$out"
}

echo "== 1. concurrent first calls through both gateways start one worker"
# A stale row first: agent gpu09's dots.ocr worker, a cancelled job, whose port on gpu02 a
# process of $LAB_USER holds, answering 200 to anything and logging what it was sent.
SQ="$(mktemp -d)"; chmod 755 "$SQ"
lab_cleanup_add "rm -rf '$SQ'"
cat > "$SQ/squat.py" <<'PY'
import http.server, os, sys
class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        with open(sys.argv[2], "a") as log:
            log.write(f"{self.command} {self.path} auth={self.headers.get('authorization')}\n")
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers(); self.wfile.write(b"{}")
    do_GET = do_POST = answer
    def log_message(self, *a):
        pass
s = http.server.ThreadingHTTPServer((sys.argv[1], 0), H)
open(sys.argv[3] + ".pid", "w").write(str(os.getpid()))
open(sys.argv[3], "w").write(str(s.server_address[1]))
s.serve_forever()
PY
touch "$SQ/log" && chown "$LAB_USER" "$SQ/log" "$SQ"
nsenter -t "$(nodes_holder gpu02)" -m -u -n -- runuser -u "$LAB_USER" -- python3 "$SQ/squat.py" "$(nodes_ip gpu02)" "$SQ/log" "$SQ/port" 2>"$SQ/err" &
squatter=$!
lab_cleanup_add "kill \$(cat '$SQ/port.pid' 2>/dev/null) $squatter 2>/dev/null || true"
cjob="$(cd /tmp && runuser -u "$LAB_USER" -- sbatch --parsable -H -J multigw-stale -t 1 --wrap 'sleep 1')" || fail "cannot submit the stale row's job"
scancel "$cjob"
for _ in $(seq 50); do [ -s "$SQ/port" ] && break; sleep 0.1; done
[ -s "$SQ/port" ] || fail "the squatter did not start: $(cat "$SQ/err")"
"${PSQL[@]}" -c "INSERT INTO model_workers (owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us) \
    VALUES ('gpu09', 'dots.ocr', 'slurm', '$cjob', 'http://$(nodes_ip gpu02):$(cat "$SQ/port")', 'gpuhub-worker-stale', NULL, '/dev/null', 1)"
out="$(calls gpu01 "$G1 $G1 $G2 $G2")" || fail "the calling job did not run: $out"
"${PSQL[@]}" -c "DELETE FROM model_workers WHERE owner = 'gpu09'"
kill "$(cat "$SQ/port.pid")" "$squatter" 2>/dev/null || true
[ ! -s "$SQ/log" ] || fail "the stale row's port (job $cjob cancelled) was sent: $(cat "$SQ/log")"
grep -hE "not routing to another agent's worker.*worker=$cjob\b.*(has ended|not RUNNING)" "$NODES_DIR"/gpu0[12]/agent.log >/dev/null ||
    fail "no gateway logged why it refused the stale row of cancelled job $cjob"
echo "   the stale row of cancelled job $cjob: refused (logged), its port's squatter saw no request"
codes="$(grep -E '^[0-9]{3}$' <<<"$out" | sort | tr '\n' ' ')"
[ "$codes" = "200 200 200 200 " ] || fail "the four concurrent first calls got: $codes"
workers="$(squeue -h -n gpuhub-worker-dots.ocr -o %i | tr '\n' ' ')"
[ "$(wc -w <<<"$workers")" = 1 ] || fail "the concurrent first calls started $(wc -w <<<"$workers") worker jobs: $workers"
rows="$("${PSQL[@]}" -c "SELECT owner || ' ' || instance_id FROM model_workers WHERE model = 'dots.ocr'")"
[ "$(wc -l <<<"$rows")" = 1 ] || fail "the store records more than one dots.ocr worker: $rows"
read -r owner wjob <<<"$rows"
[ "$wjob " = "$workers" ] || fail "the store's worker $wjob is not the running job $workers"
other="$([ "$owner" = gpu01 ] && echo gpu02 || echo gpu01)"
grep -E "routing to another agent's ready worker.*worker=$wjob\b" "$NODES_DIR/$other/agent.log" >/dev/null ||
    fail "$other's gateway did not route to $owner's worker $wjob"
echo "   one worker: job $wjob, owned by $owner; $other's gateway routed to it"

echo "== 2. calls through $other's gateway only keep $owner's worker past its idle timeout (10 s)"
GO="http://$(nodes_ip "$other"):8400"
out="$(calls "$other" "$GO" 6 3)" || fail "the calling job on $other did not run: $out"
codes="$(grep -cx 200 <<<"$out" || true)"
[ "$codes" = 6 ] || fail "calls through $other's gateway: $codes of 6 succeeded: $out"
[ "$(squeue -h -j "$wjob" -o %T 2>/dev/null)" = RUNNING ] ||
    fail "$owner unloaded worker $wjob while $other's gateway called it (idle counted from $owner's own calls only)"
! grep -E "idle for .*s \(idle_timeout_s\)" "$NODES_DIR/$owner/agent.log" >/dev/null || fail "$owner logged an idle unload"
"${PSQL[@]}" -c "SELECT last_used_us FROM worker_use WHERE instance_id = '$wjob'" | grep -q . ||
    fail "no use of worker $wjob through $other's gateway in the store"
# Tokens per day count across gateways too: a key with --tokens-per-day 1 spends its day at
# gpu01 (one call while the worker is loaded); once gpu01 has published that and gpu02 has read
# it (a pass each), gpu02's gateway refuses the key's next call.
TKEY="$(nodes_exec gpu01 "$REPO/target/release/gpuhub" keys create --user "$LAB_USER" --app multigw-tokens --tokens-per-day 1 | tail -n 1)"
TKID="$(nodes_exec gpu01 "$REPO/target/release/gpuhub" keys list --json | jq -r '.keys[] | select(.app == "multigw-tokens") | .id')"
lab_cleanup_add "nodes_exec gpu01 $REPO/target/release/gpuhub keys revoke $TKID >/dev/null 2>&1 || true"
until_ok 6 g2_says "$TKEY" '"data"' || fail "key $TKID (created through gpu01) does not work at gpu02's gateway within 6 s"
st="$(chat_at gpu01 "$G1" "$TKEY" dots.ocr)"
[ "$st" = 200 ] || fail "the first call of key $TKID (--tokens-per-day 1) at gpu01: HTTP $st: $(cat "$BODY")"
for _ in $(seq 30); do
    [ "$("${PSQL[@]}" -c "SELECT tokens FROM gateway_limit_counts WHERE gateway = 'gpu01' AND kind = 'key' AND who = '$TKID'")" -gt 0 ] 2>/dev/null && break
    sleep 0.2
done
sleep 2.5
st="$(chat_at gpu02 "$G2" "$TKEY" dots.ocr)"
[ "$st" = 429 ] && grep -q "token limit reached: API key $TKID" "$BODY" ||
    fail "key $TKID spent its tokens of the day at gpu01, and gpu02's gateway answered HTTP $st: $(cat "$BODY")"
nodes_exec gpu01 "$REPO/target/release/gpuhub" keys revoke "$TKID" >/dev/null
echo "   key $TKID (--tokens-per-day 1): its day spent at gpu01, refused at gpu02 (429 token limit)"
for _ in $(seq 100); do [ -z "$(squeue -h -j "$wjob" -o %T 2>/dev/null)" ] && break; sleep 0.3; done
[ -z "$(squeue -h -j "$wjob" -o %T 2>/dev/null)" ] || fail "$owner did not unload worker $wjob once the calls stopped"
echo "   kept for 15 s of calls through $other only, unloaded by $owner after them"

echo "== 2b. keys, roles and names changed through one agent apply at the other's gateway and jobs"
GH=("$REPO/target/release/gpuhub")
g2_lists() { [ "$(g2_models "$1" | jq '.data | length' 2>/dev/null)" = "$2" ]; }
KEY="$(nodes_exec gpu01 "${GH[@]}" keys create --user "$LAB_USER" --app multigw-sync --models dots.ocr | tail -n 1)"
KID="$(nodes_exec gpu01 "${GH[@]}" keys list --json | jq -r '.keys[] | select(.app == "multigw-sync") | .id')"
until_ok 6 g2_lists "$KEY" 1 || fail "a key created through gpu01 ($KID) does not work at gpu02's gateway within 6 s: $(g2_models "$KEY")"
nodes_exec gpu01 "${GH[@]}" keys set "$KID" --all-models >/dev/null || fail "gpuhub keys set $KID --all-models failed on gpu01"
all="$(nodes_exec gpu01 curl -s --max-time 5 -H "Authorization: Bearer $KEY" "$G1/v1/models" | jq '.data | length')"
[ "$all" -gt 1 ] || fail "gpu01's gateway lists $all model(s) for key $KID after --all-models"
until_ok 6 g2_lists "$KEY" "$all" || fail "key $KID's new allow-list (set through gpu01) does not apply at gpu02's gateway within 6 s: $(g2_models "$KEY")"
nodes_exec gpu01 "${GH[@]}" keys revoke "$KID" >/dev/null || fail "cannot revoke $KID through gpu01"
until_ok 6 g2_says "$KEY" "was revoked" || fail "key $KID, revoked through gpu01, still works at gpu02's gateway after 6 s: $(g2_models "$KEY")"
# Limits count across gateways: a key with its own --rpm 3 makes its three calls of the minute
# at gpu01 (to an unknown name: a call is counted before its body is read), and gpu02's gateway
# refuses its next one, once the agents have exchanged their counts (a pass each, 2 s).
RKEY="$(nodes_exec gpu01 "${GH[@]}" keys create --user "$LAB_USER" --app multigw-rpm --rpm 3 | tail -n 1)"
RKID="$(nodes_exec gpu01 "${GH[@]}" keys list --json | jq -r '.keys[] | select(.app == "multigw-rpm") | .id')"
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} keys revoke $RKID >/dev/null 2>&1 || true"
until_ok 6 g2_says "$RKEY" '"data"' || fail "key $RKID (created through gpu01) does not work at gpu02's gateway within 6 s"
for i in 1 2 3; do
    st="$(chat_at gpu01 "$G1" "$RKEY" multigw-no-such-model)"
    [ "$st" = 404 ] || fail "call $i of key $RKID (--rpm 3) at gpu01: HTTP $st, expected 404 (unknown name, admitted): $(cat "$BODY")"
done
sleep 6
st="$(chat_at gpu02 "$G2" "$RKEY" multigw-no-such-model)"
[ "$st" = 429 ] || fail "key $RKID made its 3 calls of the minute at gpu01, and gpu02's gateway answered its 4th with HTTP $st, not 429: $(cat "$BODY")"
grep -q "API key $RKID .* may make 3 requests per minute" "$BODY" || fail "gpu02's 429 does not name the key's limit: $(cat "$BODY")"
pub="$("${PSQL[@]}" -c "SELECT calls FROM gateway_limit_counts WHERE gateway = 'gpu01' AND kind = 'key' AND who = '$RKID'")"
[ "$pub" = 3 ] || fail "gpu01 published $pub call(s) of key $RKID (gateway_limit_counts), expected 3"
nodes_exec gpu01 "${GH[@]}" keys revoke "$RKID" >/dev/null
echo "   key $RKID (--rpm 3): 3 calls at gpu01, the 4th refused at gpu02 ($(jq -r .error.message "$BODY" | cut -c1-80)...)"
g2_ocr() { nodes_exec gpu02 "${GH[@]}" env | grep -qx "OCR_MODEL=$1"; }
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} roles set ocr dots.ocr >/dev/null 2>&1 || true"
nodes_exec gpu01 "${GH[@]}" roles set ocr SmolLM2-135M-Instruct >/dev/null || fail "gpuhub roles set ocr failed on gpu01"
until_ok 6 g2_ocr SmolLM2-135M-Instruct || fail "the ocr role moved through gpu01 is not gpu02's within 6 s: $(nodes_exec gpu02 "${GH[@]}" env | grep OCR_MODEL)"
job_ocr="$(cd /tmp && runuser -u "$LAB_USER" -- srun -w gpu02 -t 1 -J multigw-role printenv OCR_MODEL)" || fail "the job on gpu02 did not run"
[ "$job_ocr" = SmolLM2-135M-Instruct ] || fail "a job on gpu02 got OCR_MODEL=$job_ocr after the role moved through gpu01 (gpu02's snapshot)"
nodes_exec gpu01 "${GH[@]}" roles set ocr dots.ocr >/dev/null || fail "cannot set the ocr role back"
until_ok 6 g2_ocr dots.ocr || fail "the ocr role set back through gpu01 is not gpu02's within 6 s"
# A promotion recorded by another agent (the row `gpuhub models promote` writes): both agents
# serve that version from the next start of sync-reg.
promoted_on() { [ "$(nodes_exec "$1" "${GH[@]}" models list --json | jq -r '.models[] | select(.name == "sync-reg") | .promoted_version')" = "$2" ]; }
promoted_on gpu02 null || fail "sync-reg has a promoted version before the test"
"${PSQL[@]}" -c "INSERT INTO model_promotions (model, version, previous_version, metric, value, previous_value, threshold, forced, uid, user_name, at_us) \
    VALUES ('sync-reg-model', '7', NULL, NULL, NULL, NULL, NULL, 1, 0, 'gpu09-admin', $(date +%s%6N))"
lab_cleanup_add "${PSQL[*]} -c \"DELETE FROM model_promotions WHERE model = 'sync-reg-model'\" >/dev/null 2>&1 || true"
for n in gpu01 gpu02; do
    until_ok 6 promoted_on "$n" 7 || fail "$n does not serve sync-reg-model version 7, promoted through another agent, within 6 s"
done
grep -q "a version promoted through another agent; serving it here" "$NODES_DIR/gpu02/agent.log" || fail "gpu02 did not log the promotion it followed"
"${PSQL[@]}" -c "DELETE FROM model_promotions WHERE model = 'sync-reg-model'"
echo "   through gpu01: key $KID created, widened, revoked, and the ocr role moved and back; a promotion recorded by another agent; both gateways and gpu02's jobs followed each within 6 s"

echo "== 2c. a promotion recorded through gpu01 switches gpu02's running worker; gpu01's calls follow, none fails"
# gpu02 owns sync-reg's worker (loaded there, version 7 from the promotion above); gpu01's
# gateway borrows it. A promotion row for version 8 (what `gpuhub models promote` records,
# through gpu01): gpu02 follows it, starts a second worker on 8 next to the old one, moves its
# calls there and drains the old one; gpu01's calls, in a loop all along, move to version 8.
PKEY="$(nodes_exec gpu01 "${GH[@]}" keys create --user "$LAB_USER" --app multigw-promote --models sync-reg | tail -n 1)"
PKID="$(nodes_exec gpu01 "${GH[@]}" keys list --json | jq -r '.keys[] | select(.app == "multigw-promote") | .id')"
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} keys revoke $PKID >/dev/null 2>&1 || true"
lab_cleanup_add "nodes_exec gpu02 ${GH[*]} models unload sync-reg >/dev/null 2>&1 || true"
nodes_exec gpu02 "${GH[@]}" models load sync-reg >/dev/null || fail "gpuhub models load sync-reg failed on gpu02"
old_job="$(squeue -h -n gpuhub-worker-sync-reg -o %i)"
[ "$(wc -w <<<"$old_job")" = 1 ] || fail "gpu02's load of sync-reg did not start one worker job: $old_job"
version_at() { st="$(chat_at gpu01 "$G1" "$PKEY" sync-reg)"; [ "$st" = 200 ] && grep -q "Hello from sync-reg version $1" "$BODY"; }
until_ok 10 version_at 7 || fail "gpu01's gateway does not serve sync-reg version 7 from gpu02's worker: HTTP $st $(cat "$BODY")"
LOOP="$(mktemp /tmp/gpuhub-multigw-loop.XXXXXX)"
lab_cleanup_add "rm -f '$LOOP' '$LOOP.stop'"
# 0.2 s apart until the file STOP exists: one line per call, "STATUS VERSION" (a failed call:
# "STATUS - TIME MESSAGE", the gateway's error message).
( while [ ! -e "$LOOP.stop" ]; do
      out="$(nodes_exec gpu01 curl -s -w '\n%{http_code}' --max-time 30 "$G1/v1/chat/completions" -H "Authorization: Bearer $PKEY" \
          -H content-type:application/json -d '{"model":"sync-reg","messages":[{"role":"user","content":"hi"}]}')"
      st="$(tail -n 1 <<<"$out")"
      if [ "$st" = 200 ]; then
          echo "$st $(sed -n 's/.*Hello from sync-reg version \([0-9]*\).*/\1/p' <<<"$out" | head -n 1)" >>"$LOOP"
      else
          echo "$st - $(date +%T.%N | cut -c1-12) $(sed '$d' <<<"$out" | jq -r '.error.message? // empty' 2>/dev/null | tr -d '\n' | cut -c1-200)" >>"$LOOP"
      fi
      sleep 0.2
  done ) &
looper=$!
lab_cleanup_add "touch '$LOOP.stop'; kill $looper 2>/dev/null || true"
sleep 1
"${PSQL[@]}" -c "INSERT INTO model_promotions (model, version, previous_version, metric, value, previous_value, threshold, forced, uid, user_name, at_us) \
    VALUES ('sync-reg-model', '8', '7', NULL, NULL, NULL, NULL, 1, 0, 'gpu01-admin', $(date +%s%6N))"
lab_cleanup_add "${PSQL[*]} -c \"DELETE FROM model_promotions WHERE model = 'sync-reg-model'\" >/dev/null 2>&1 || true"
on_8() { tail -n 3 "$LOOP" | awk '$2 != 8 {bad = 1} END {exit bad || NR < 3}'; }
until_ok 60 on_8 || fail "gpu01's calls do not reach version 8 within 60 s of the promotion: $(tail -n 5 "$LOOP" | tr '\n' ';')"
old_gone() { [ -z "$(squeue -h -j "$old_job" -o %T 2>/dev/null)" ]; }
until_ok 60 old_gone || fail "gpu02's old worker (job $old_job, version 7) did not drain and end within 60 s of the switch"
sleep 1
touch "$LOOP.stop"; wait "$looper" 2>/dev/null || true; rm -f "$LOOP.stop"
grep -q "promotion: starting a second worker" "$NODES_DIR/gpu02/agent.log" || fail "gpu02 did not start its second worker for the promotion"
if grep -q "promotion: starting a second worker.*sync-reg" "$NODES_DIR/gpu01/agent.log"; then fail "gpu01 started a worker for sync-reg, which gpu02 owns"; fi
bad="$(awk '$1 != 200' "$LOOP" | tr '\n' ';')"
[ -z "$bad" ] || fail "calls through gpu01 failed while gpu02 switched its worker: $bad (of $(wc -l <"$LOOP"))"
new_job="$(squeue -h -n gpuhub-worker-sync-reg -o %i)"
[ "$(wc -w <<<"$new_job")" = 1 ] && [ "$new_job" != "$old_job" ] || fail "after the switch sync-reg runs as job(s) '$new_job' (old $old_job)"
echo "   $(wc -l <"$LOOP") calls through gpu01, all 200: $(awk '{print $2}' "$LOOP" | uniq -c | awk '{printf "%s on %s; ", $1, $2}')job $old_job -> $new_job (gpu02's)"
nodes_exec gpu02 "${GH[@]}" models unload sync-reg >/dev/null || fail "cannot unload sync-reg on gpu02"
nodes_exec gpu01 "${GH[@]}" keys revoke "$PKID" >/dev/null
"${PSQL[@]}" -c "DELETE FROM model_promotions WHERE model = 'sync-reg-model'"

echo "== 2d. a gateway whose [gateway.limits] differ is named by the other's doctor and its own log"
# policy_at NODE: the gateway-policy check of `gpuhub doctor` on NODE, as "ok|detail".
policy_at() { nodes_exec "$1" "${GH[@]}" doctor --json 2>/dev/null | jq -r '.[] | select(.name == "gateway-policy") | "\(.ok)|\(.detail)"'; }
policy_says() { grep -q -- "$2" <<<"$(policy_at "$1")"; }
until_ok 6 policy_says gpu01 '^true|the same .* as gpu02' || fail "gpu01's doctor does not show the same policy as gpu02's: $(policy_at gpu01)"
EXTRA2="$(mktemp /tmp/gpuhub-multigw-extra2.XXXXXX)"
lab_cleanup_add "rm -f '$EXTRA2'"
chmod 644 "$EXTRA2"
# gpu02 also serves g2-only, a model gpu01 does not (for the role below).
{ cat "$EXTRA"; printf '\n[[models]]\nname = "g2-only"\nlauncher = "static"\nurl = "http://127.0.0.1:9"\n\n[gateway.limits]\nrpm = 6000\n'; } > "$EXTRA2"
"$NODES_SH" agent-stop gpu02
GPUHUB_LAB_NODES_EXTRA="$EXTRA2" "$NODES_SH" agent-start gpu02 60 || fail "gpu02's agent did not start with [gateway.limits] rpm = 6000"
until_ok 10 policy_says gpu01 '^false|\[gateway.limits\]: here rpm none, tokens_per_day none; at gpu02 rpm 6000' ||
    fail "gpu01's doctor does not name gpu02's other [gateway.limits]: $(policy_at gpu01)"
until_ok 6 grep -q 'gateway policy: another gateway enforces other settings than this one.*gateways=gpu01' "$NODES_DIR/gpu02/agent.log" ||
    fail "gpu02's agent did not log that gpu01 enforces other settings"
g2_metrics="$(nodes_exec gpu02 curl -s --max-time 5 "http://$(nodes_ip gpu02):9410/metrics")"
grep -qx 'gpuhub_gateway_policy_differences 1' <<<"$g2_metrics" ||
    fail "gpu02's /metrics does not say one other gateway differs: $(grep policy_differences <<<"$g2_metrics")"
# gpu01 compares on every pass: its gauge and its log follow gpu02's publication within a pass.
differences_at() { nodes_exec "$1" curl -s --max-time 5 "http://$(nodes_ip "$1"):9410/metrics" | grep -x "gpuhub_gateway_policy_differences $2" >/dev/null; }
until_ok 6 differences_at gpu01 1 || fail "gpu01's gpuhub_gateway_policy_differences is not 1 within 6 s of gpu02's start with other limits"
grep -q 'gateway policy: another gateway enforces other settings than this one.*gateways=gpu02' "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01's agent did not log that gpu02 enforces other settings"
echo "   gpu01's doctor: $(policy_at gpu01 | cut -c1-120)"
# A role set through gpu02 to a model only gpu02 serves: gpu01 follows the role (cluster sync)
# and says, in its log and gpuhub_roles_unserved, that its model is not served on gpu01; set
# back, it says so again.
unserved_at_g1() { nodes_exec gpu01 curl -s --max-time 5 "http://$(nodes_ip gpu01):9410/metrics" | grep -x "gpuhub_roles_unserved $1" >/dev/null; }
until_ok 6 unserved_at_g1 0 || fail "gpu01 counts an unserved role before the test"
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} roles set ocr dots.ocr >/dev/null 2>&1 || true"
nodes_exec gpu02 "${GH[@]}" roles set ocr g2-only >/dev/null || fail "gpuhub roles set ocr g2-only failed on gpu02 (which serves it)"
until_ok 6 unserved_at_g1 1 || fail "gpu01's gpuhub_roles_unserved is not 1 within 6 s of a role moved through gpu02 to a model gpu01 does not serve"
grep -q "roles: a role's model is not served on this node.*ocr" "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01 did not log that the ocr role's model (g2-only, set through gpu02) is not served there"
nodes_exec gpu02 "${GH[@]}" roles set ocr dots.ocr >/dev/null || fail "cannot set the ocr role back through gpu02"
until_ok 6 unserved_at_g1 0 || fail "gpu01's gpuhub_roles_unserved is not 0 within 6 s of the role set back"
until_ok 2 grep -q "roles: every assigned role's model is served again" "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01 did not log that every role's model is served again"
echo "   a role moved through gpu02 to a model only gpu02 serves: gpu01 logged and counted it, then its return"
# Back to gpu01's [gateway.limits] by a reload, no restart: published on gpu02's next pass.
GPUHUB_LAB_NODES_EXTRA="$EXTRA" nodes_agent_config gpu02 > "$NODES_DIR/gpu02/agent.toml"
nodes_exec gpu02 "${GH[@]}" models reload | grep -q '\[gateway.limits\] apply from the next call' ||
    fail "gpuhub models reload on gpu02 does not say that its [gateway.limits] changed"
until_ok 6 policy_says gpu01 '^true|the same .* as gpu02' ||
    fail "gpu01's doctor does not see gpu02's reloaded [gateway.limits] within 6 s: $(policy_at gpu01)"
until_ok 6 grep -q 'gateway policy: every gateway now has the same' "$NODES_DIR/gpu02/agent.log" ||
    fail "gpu02's agent did not log that the gateways agree again after its reload"
until_ok 6 differences_at gpu01 0 || fail "gpu01's gpuhub_gateway_policy_differences is not 0 within 6 s of gpu02's reload"
grep -q 'gateway policy: every gateway now has the same' "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01's agent did not log that the gateways agree again after gpu02's reload"
echo "   gpu02 reloaded without the rpm: both doctors' policies agree again within 6 s"

echo "== 2e. a borrowed worker whose server died while its job runs on: its owner is told and stops the job"
# wrap-gw's job outlives its server (`...; sleep 300`) and its idle timeout is 300 s, so only a
# check of its port shows the server gone. gpu01 starts it; gpu02's gateway borrows it; its
# server is killed. gpu02's next call cannot reach it: the call gets 200 from a worker gpu02
# starts, and gpu02 tells the owner through the store; gpu01 checks the port and stops its job
# (only the owner may), which would otherwise hold its GPU for the idle timeout.
WKEY="$(nodes_exec gpu01 "${GH[@]}" keys create --user "$LAB_USER" --app multigw-wrap --models wrap-gw | tail -n 1)"
WKID="$(nodes_exec gpu01 "${GH[@]}" keys list --json | jq -r '.keys[] | select(.app == "multigw-wrap") | .id')"
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} keys revoke $WKID >/dev/null 2>&1 || true"
lab_cleanup_add "nodes_exec gpu02 ${GH[*]} models unload wrap-gw >/dev/null 2>&1 || true"
lab_cleanup_add "nodes_exec gpu01 ${GH[*]} models unload wrap-gw >/dev/null 2>&1 || true"
st="$(chat_at gpu01 "$G1" "$WKEY" wrap-gw)"
[ "$st" = 200 ] || fail "the first call to wrap-gw through gpu01: HTTP $st $(cat "$BODY")"
wjob1="$(squeue -h -n gpuhub-worker-wrap-gw -o %i)"
[ "$(wc -w <<<"$wjob1")" = 1 ] || fail "the first call to wrap-gw did not start one worker job: '$wjob1'"
until_ok 6 g2_says "$WKEY" wrap-gw || fail "gpu02's gateway does not know the key created through gpu01 within 6 s"
st="$(chat_at gpu02 "$G2" "$WKEY" wrap-gw)"
[ "$st" = 200 ] || fail "a call to wrap-gw through gpu02: HTTP $st $(cat "$BODY")"
grep -q "routing to another agent's ready worker.*worker=$wjob1" "$NODES_DIR/gpu02/agent.log" ||
    fail "gpu02's gateway did not route to gpu01's worker $wjob1"
wurl="$("${PSQL[@]}" -c "SELECT base_url FROM model_workers WHERE owner = 'gpu01' AND instance_id = '$wjob1'")"
wnode="$(squeue -h -j "$wjob1" -o %N)"
wpid="$(nodes_exec "$wnode" ss -Hltnp "sport = :${wurl##*:}" | sed -n 's/.*pid=\([0-9]*\).*/\1/p' | head -n 1)"
[ -n "$wpid" ] || fail "cannot find the server of worker $wjob1 listening at $wurl on $wnode"
kill -9 "$wpid"
st="$(chat_at gpu02 "$G2" "$WKEY" wrap-gw)"
[ "$st" = 200 ] || fail "the call through gpu02 after gpu01's worker's server died: HTTP $st $(cat "$BODY")"
grep -q "its owner is told to check it.*worker=$wjob1" "$NODES_DIR/gpu02/agent.log" ||
    fail "gpu02 did not tell gpu01 that worker $wjob1 lost its server"
wjob1_gone() { [ -z "$(squeue -h -j "$wjob1" -o %T 2>/dev/null)" ]; }
until_ok 20 wjob1_gone || fail "gpu01 did not stop its worker job $wjob1 (server killed, job sleeping on) within 20 s of gpu02's report"
grep -q "another gateway could not reach this worker.*worker=$wjob1" "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01 did not log gpu02's report about worker $wjob1"
# (The job ends at its scancel; the state change is logged after the store forgets the worker.)
until_ok 5 grep -q "its server stopped holding its port while the job ran; the job was stopped" "$NODES_DIR/gpu01/agent.log" ||
    fail "gpu01 did not log why it stopped worker $wjob1: $(grep -e "$wjob1" -e wrap-gw "$NODES_DIR/gpu01/agent.log" | tail -n 5)"
wjob2="$(squeue -h -n gpuhub-worker-wrap-gw -o %i)"
[ "$(wc -w <<<"$wjob2")" = 1 ] && [ "$wjob2" != "$wjob1" ] || fail "after the report wrap-gw runs as job(s) '$wjob2' (first $wjob1)"
echo "   gpu01's job $wjob1 (server killed) stopped by its owner after gpu02's report; gpu02 serves from job $wjob2"
nodes_exec gpu02 "${GH[@]}" models unload wrap-gw >/dev/null || fail "cannot unload wrap-gw on gpu02"
nodes_exec gpu01 "${GH[@]}" keys revoke "$WKID" >/dev/null

echo "== 3. the gateway on gpu01 only"
export NODES_GATEWAY_NODES=gpu01
"$NODES_SH" agent-stop gpu02
"$NODES_SH" agent-start gpu02 60 || fail "gpu02's agent did not start as a non-gateway node"
grep -q "this node runs no gateway" "$NODES_DIR/gpu02/agent.log" || fail "gpu02's agent does not say it runs no gateway"
policy_rows() { [ "$("${PSQL[@]}" -c "SELECT string_agg(gateway, ',' ORDER BY gateway) FROM gateway_policies")" = "$1" ]; }
until_ok 6 policy_rows gpu01 || fail "gpu02, no longer a gateway, still has a row in gateway_policies: $("${PSQL[@]}" -c 'SELECT gateway FROM gateway_policies')"
if nodes_exec gpu02 curl -s -o /dev/null --max-time 2 "$G2/healthz"; then fail "gpu02 still listens on the gateway port"; fi
out="$(calls gpu02 env)" || fail "the job on gpu02 did not run: $out"
url="$(sed -n 's/^url //p' <<<"$out")"; job="$(sed -n 's/^job //p' <<<"$out")"
[ "$url" = "$G1" ] || fail "the job on gpu02 was told GPUHUB_URL=$url, not gpu01's gateway"
[ "$(grep -cx 200 <<<"$out")" = 1 ] || fail "the job on gpu02 got $(head -n1 <<<"$out") from gpu01's gateway"
for _ in $(seq 40); do
    nodes_exec gpu02 "${GH[@]}" names callers dots.ocr --since 1d --json 2>/dev/null | grep -qE "\"job_id\": ?\"$job\"" && break
    sleep 0.25
done
nodes_exec gpu02 "${GH[@]}" names callers dots.ocr --since 1d --json | grep -qE "\"job_id\": ?\"$job\"" ||
    fail "gpuhub names callers on gpu02 does not show job $job's call through gpu01"
nodes_exec gpu02 "${GH[@]}" usage --calls --since 1d --json | grep -q "dots.ocr" ||
    fail "gpuhub usage --calls on gpu02 does not show the calls through gpu01's gateway"
echo "   gpu02: no gateway port; its job $job reached gpu01's gateway; gpu02's CLI shows the call"

nodes_test_restore || exit 1
echo "PASS: two gateways start one worker per model and share it (a stale row is refused before its key is sent); the owner keeps it while the other calls it; keys and roles changed through one agent apply at the other within 6 s; a promotion switches the owner's worker and the other gateway's calls follow, none failing; a gateway whose [gateway.limits] differ is named by the other's doctor; a node without the gateway role opens no port and its jobs reach the gateway node"
