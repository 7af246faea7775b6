#!/usr/bin/env bash
# Names: the incident replayed on the lab (real agent, real Slurm jobs, real SPANK plugin).
#   1. an app (API key alice/ocr-app) calls `svc-ocr` through the gateway; jobs get OCR_MODEL=svc-ocr
#   2. `gpuhub names rename svc-ocr dots.ocr --sunset D --dry-run` names the app and user, changes nothing
#   3. the rename: the app keeps working and gets Deprecation, Sunset and Link headers
#   4. a job started after the rename gets OCR_MODEL=dots.ocr (srun printenv; the plugin reads the snapshot)
#   5. `gpuhub names callers svc-ocr` names the app and the user
#   6. `retire` is refused (exit 1) while the app calls; `retire --force` retires it
#   7. the app gets the self-explaining 404; /metrics counted every step
# At exit the lab's registry is put back as tests/lab/agent.toml seeds it (svc-ocr deprecated
# -> dots.ocr, role ocr -> dots.ocr) and the test key is revoked.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
agent_start 60 || lab_fail "gpuhub-agent did not start"
GPUHUB="$LAB_REPO/target/release/gpuhub"
[ -x "$GPUHUB" ] || lab_fail "$GPUHUB missing: cargo build --release"
GW=http://127.0.0.1:8400
METRICS=http://127.0.0.1:9410/metrics
T="$(mktemp -d /tmp/gpuhub-names-test.XXXXXX)"
lab_cleanup_add "rm -rf '$T'"
today="$(date -u +%F)"
sunset="$(date -u -d '+30 days' +%F)"

state_of() { "$GPUHUB" names list --json | jq -r --arg n "$1" '.names[] | select(.name == $n) | .state'; }
metric() { # metric STATE NAME -> the alice/ocr-app counter (0 if absent)
    curl -sf --max-time 5 "$METRICS" | awk -v k="gpuhub_gateway_name_calls_total{state=\"$1\",name=\"$2\",user=\"alice\",app=\"ocr-app\"}" '$1 == k { print $2; f = 1 } END { if (!f) print 0 }'
}
call() { # call MODEL -> sets CODE, writes headers to $T/h and the body to $T/b
    echo "+ POST $GW/v1/chat/completions model=$1"
    CODE="$(curl -s --max-time 150 -o "$T/b" -D "$T/h" -w '%{http_code}' "$GW/v1/chat/completions" \
        -H "authorization: Bearer $KEY" -H 'content-type: application/json' -H 'user-agent: ocr-app/1.0' \
        -d "{\"model\":\"$1\",\"messages\":[{\"role\":\"user\",\"content\":\"scan\"}]}" || true)"
    echo "  HTTP $CODE $(head -c 300 "$T/b")"
}
job_ocr_model() { lab_run timeout 90 srun -N1 -t 2 bash -c 'echo "OCR_MODEL=${OCR_MODEL-<unset>}"' >&2; sed -n 's/^OCR_MODEL=//p' <<<"$LAB_OUT" | head -n1; }
wait_callers() { # wait_callers NAME N: usage rows are written in batches
    local i
    for ((i = 0; i < 100; i++)); do
        [ "$("$GPUHUB" names callers "$1" --since 1d --json | jq '.report.calls')" -ge "$2" ] && return 0
        sleep 0.2
    done
    lab_fail "gpuhub names callers $1 never showed $2 calls"
}

restore_lab() {
    echo "== cleanup: back to the lab's seeded state"
    [ "$(state_of svc-ocr)" = active ] || "$GPUHUB" names restore svc-ocr >/dev/null 2>&1 || true
    "$GPUHUB" names deprecate svc-ocr --replacement dots.ocr --sunset 2026-12-31 --force >/dev/null 2>&1 \
        || "$GPUHUB" names deprecate svc-ocr --replacement dots.ocr --force >/dev/null 2>&1 || true
    "$GPUHUB" roles set ocr dots.ocr >/dev/null 2>&1 || true
    [ -n "${KEY_ID:-}" ] && "$GPUHUB" keys revoke "$KEY_ID" >/dev/null 2>&1 || true
    echo "  svc-ocr is $(state_of svc-ocr); role ocr -> $("$GPUHUB" roles --json 2>/dev/null | jq -r '.roles[] | select(.role == "ocr") | .model')"
}
lab_cleanup_add restore_lab

echo "== setup: svc-ocr is a served name and role ocr names it (the state before the incident)"
[ "$(state_of svc-ocr)" = active ] || { lab_run "$GPUHUB" names restore svc-ocr; [ "$LAB_RC" = 0 ] || lab_fail "restore svc-ocr failed"; }
cur="$("$GPUHUB" roles --json | jq -r '.roles[] | select(.role == "ocr") | .model')"
[ "$cur" = svc-ocr ] || { lab_run "$GPUHUB" roles set ocr svc-ocr; [ "$LAB_RC" = 0 ] || lab_fail "roles set ocr svc-ocr failed"; }
lab_run "$GPUHUB" keys create --user alice --app ocr-app --json
[ "$LAB_RC" = 0 ] || lab_fail "gpuhub keys create failed"
KEY="$(jq -r .key <<<"$LAB_OUT")"
KEY_ID="$(jq -r .id <<<"$LAB_OUT")"
base_active="$(metric active svc-ocr)"; base_dep="$(metric deprecated svc-ocr)"; base_ret="$(metric retired svc-ocr)"

echo "== 1. the app calls svc-ocr; a job gets OCR_MODEL=svc-ocr"
call svc-ocr
[ "$CODE" = 200 ] || lab_fail "svc-ocr before the rename: expected HTTP 200, got $CODE (dots.ocr runs as a Slurm worker job: see $LAB_AGENT_LOG)"
grep -qi '^deprecation:' "$T/h" && lab_fail "an active name got a Deprecation header"
got="$(job_ocr_model)"
[ "$got" = svc-ocr ] || lab_fail "job before the rename: expected OCR_MODEL=svc-ocr, got '$got'"
wait_callers svc-ocr 1
echo ok

echo "== 2. dry run: names the caller, changes nothing"
lab_run "$GPUHUB" names rename svc-ocr dots.ocr --sunset "$sunset" --dry-run
[ "$LAB_RC" = 0 ] || lab_fail "dry run: expected exit 0, got $LAB_RC"
grep -q 'alice/ocr-app' <<<"$LAB_OUT" || lab_fail "dry run does not name alice/ocr-app"
grep -q 'dry run: nothing changed' <<<"$LAB_OUT" || lab_fail "dry run did not say it changed nothing"
[ "$(state_of svc-ocr)" = active ] || lab_fail "dry run changed svc-ocr to $(state_of svc-ocr)"
echo ok

echo "== 3. rename: the app keeps working, with Deprecation, Sunset and Link"
lab_run "$GPUHUB" names rename svc-ocr dots.ocr --sunset "$sunset"
[ "$LAB_RC" = 0 ] && grep -q '^applied' <<<"$LAB_OUT" || lab_fail "rename not applied (exit $LAB_RC)"
call svc-ocr
sed 's/^/  < /' "$T/h" | grep -Ei 'deprecation|sunset|link' || true
[ "$CODE" = 200 ] || lab_fail "svc-ocr after the rename: expected 200, got $CODE"
grep -qiE '^deprecation: @[0-9]+' "$T/h" || lab_fail "no Deprecation: @<epoch> header"
grep -qiE "^sunset: .* $(date -u -d "$sunset" +%Y) 00:00:00 GMT" "$T/h" || lab_fail "no Sunset header for $sunset"
grep -qi '^link: </v1/models/dots.ocr>; rel="successor-version"' "$T/h" || lab_fail "no Link to dots.ocr"
echo ok

echo "== 4. a job started after the rename gets OCR_MODEL=dots.ocr"
got="$(job_ocr_model)"
[ "$got" = dots.ocr ] || lab_fail "job after the rename: expected OCR_MODEL=dots.ocr, got '$got'"
lab_run "$GPUHUB" env
grep -qx 'OCR_MODEL=dots.ocr' <<<"$LAB_OUT" || lab_fail "gpuhub env lacks OCR_MODEL=dots.ocr"
echo ok

echo "== 5. gpuhub names callers svc-ocr names the app and the user"
wait_callers svc-ocr 2
lab_run "$GPUHUB" names callers svc-ocr --since 30d
grep -qE '^alice +ocr-app ' <<<"$LAB_OUT" || lab_fail "callers table lacks a row for alice/ocr-app"
grep -q 'ocr-app/1.0' <<<"$LAB_OUT" || lab_fail "callers table lacks the user agent"
echo ok

echo "== 6. retire: refused while the app calls, then forced"
lab_run "$GPUHUB" names retire svc-ocr
[ "$LAB_RC" = 1 ] || lab_fail "retire with recent callers: expected exit 1, got $LAB_RC"
grep -q 'refused: .*alice' <<<"$LAB_OUT" || lab_fail "the refusal does not name alice"
[ "$(state_of svc-ocr)" = deprecated ] || lab_fail "a refused retire changed the state"
lab_run "$GPUHUB" names retire svc-ocr --force
[ "$LAB_RC" = 0 ] && grep -q 'applied (forced)' <<<"$LAB_OUT" || lab_fail "retire --force not applied"
echo ok

echo "== 7. the app gets the self-explaining error"
call svc-ocr
want="model \`svc-ocr\` was renamed to \`dots.ocr\` on $today; set OCR_MODEL or use \`dots.ocr\`"
[ "$CODE" = 404 ] || lab_fail "retired svc-ocr: expected 404, got $CODE"
[ "$(jq -r .error.code "$T/b")" = model_not_found ] || lab_fail "error code is not model_not_found"
[ "$(jq -r .error.message "$T/b")" = "$want" ] || lab_fail "message: expected '$want', got '$(jq -r .error.message "$T/b")'"
echo ok

echo "== 8. /metrics counted every step (alice/ocr-app)"
a=$(( $(metric active svc-ocr) - base_active )); d=$(( $(metric deprecated svc-ocr) - base_dep )); r=$(( $(metric retired svc-ocr) - base_ret ))
echo "  active +$a, deprecated +$d, retired +$r"
[ "$a" = 1 ] && [ "$d" = 1 ] && [ "$r" = 1 ] || lab_fail "gpuhub_gateway_name_calls_total: expected +1 active, +1 deprecated, +1 retired; got +$a, +$d, +$r"
lab_run "$GPUHUB" names history svc-ocr --limit 5
grep -qE 'retire +svc-ocr' <<<"$LAB_OUT" && grep -qE 'rename +svc-ocr' <<<"$LAB_OUT" || lab_fail "history lacks the rename and the retire"
echo "PASS: names-incident"
