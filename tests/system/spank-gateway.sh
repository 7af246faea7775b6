#!/usr/bin/env bash
# SPANK plugin + the running agent (tests/lab/up.sh starts it): with the lab's own plugstack
# line, a job's injected OPENAI_BASE_URL and OPENAI_API_KEY (the job token minted with the
# agent's key) are accepted by the gateway, and the same token with one field changed is not.
# The role variables come from the agent's snapshot.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
agent_healthy || lab_fail "gpuhub-agent is not answering http://127.0.0.1:8400/healthz; run tests/lab/up.sh"
[ -s /run/gpuhub/snapshot.json ] || lab_fail "the agent wrote no /run/gpuhub/snapshot.json"
cd /tmp

lab_run timeout 120 srun -N1 -t 2 --gres=shard:2 bash -c '
    echo "JOB=$SLURM_JOB_ID"
    echo "URL=$OPENAI_BASE_URL"
    echo "ROLES=$(env | grep -E "^[A-Z_]+_MODEL=" | sort | tr "\n" " ")"
    echo "GOOD=$(curl -s -o /dev/null -w "%{http_code}" --max-time 10 -H "Authorization: Bearer $OPENAI_API_KEY" "$OPENAI_BASE_URL/models")"
    bad="$(echo "$OPENAI_API_KEY" | sed -E "s/^ghj1\.([0-9]+)\.([^.]+)\.([0-9]+)\./ghj1.\1.\2.$((SLURM_JOB_ID + 1))./")"
    echo "BAD=$(curl -s -o /dev/null -w "%{http_code}" --max-time 10 -H "Authorization: Bearer $bad" "$OPENAI_BASE_URL/models")"'
[ "$LAB_RC" = 0 ] || lab_fail "srun failed"
val() { sed -n "s/^$1=//p" <<<"$LAB_OUT" | head -n1; }
[ "$(val URL)" = "$(jq -r .gateway_url /run/gpuhub/snapshot.json)/v1" ] || lab_fail "OPENAI_BASE_URL $(val URL) does not follow the snapshot"
want_roles="$(jq -r '.roles | to_entries[] | select(.value != null) | "\(.key | ascii_upcase | gsub("[-.]"; "_"))_MODEL=\(.value)"' /run/gpuhub/snapshot.json | sort | tr '\n' ' ')"
[ "$(val ROLES)" = "$want_roles" ] || lab_fail "role variables '$(val ROLES)', expected from the snapshot: '$want_roles'"
[ "$(val GOOD)" = 200 ] || lab_fail "the gateway answered $(val GOOD) to the job's own token, expected 200"
[ "$(val BAD)" = 401 ] || lab_fail "the gateway answered $(val BAD) to a token with another job id, expected 401"
lab_node_ok
echo "PASS: spank-gateway"
