#!/usr/bin/env bash
# Names: bad input through the real CLI and the lab's agent. Each refusal must exit non-zero
# (2 for an error, 1 for "needs --force") with a message that names the problem and the fix, and
# change nothing (the registry's history is the same before and after). A non-admin cannot
# change names. Needs the lab (tests/lab/up.sh); no Slurm jobs are started.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
agent_start 60 || lab_fail "gpuhub-agent did not start"
GPUHUB="$LAB_REPO/target/release/gpuhub"
[ -x "$GPUHUB" ] || lab_fail "$GPUHUB missing: cargo build --release"
changes() { "$GPUHUB" names history --limit 10000 --json | jq '.history | length'; }
expect() { # expect EXIT "MESSAGE PART" CMD...
    local want_rc="$1" want_msg="$2"
    shift 2
    lab_run "$@"
    [ "$LAB_RC" = "$want_rc" ] || lab_fail "$*: expected exit $want_rc, got $LAB_RC"
    grep -qF -- "$want_msg" <<<"$LAB_OUT" || lab_fail "$*: expected the message to contain '$want_msg'"
}
before="$(changes)"
tomorrow="$(date -u -d '+1 day' +%F)"

echo "== renaming onto a name that serves another model needs --force (exit 1)"
expect 1 'already exists and serves model `SmolLM2-135M-Instruct`' "$GPUHUB" names rename dots.ocr SmolLM2-135M-Instruct --sunset "$tomorrow"
echo "== a cycle: svc-ocr -> dots.ocr exists, so dots.ocr -> svc-ocr is refused"
expect 2 'would make a cycle' "$GPUHUB" names rename dots.ocr svc-ocr
echo "== odd characters"
expect 2 'contains a space' "$GPUHUB" names rename 'svc ocr' dots.ocr
expect 2 'not ASCII' "$GPUHUB" names rename svc-ocr 'dоts.ocr'
expect 2 'control character' "$GPUHUB" names retire "$(printf 'svc\tocr')"
expect 2 'must start with a letter or a digit' "$GPUHUB" names deprecate --replacement dots.ocr -- -svc
echo "== sunsets: in the past, today, not a date"
expect 2 'is not in the future' "$GPUHUB" names rename SmolLM2-135M-Instruct dots.ocr --sunset 2020-01-01
expect 2 'is not in the future' "$GPUHUB" names rename SmolLM2-135M-Instruct dots.ocr --sunset "$(date -u +%F)"
expect 2 'use YYYY-MM-DD' "$GPUHUB" names rename SmolLM2-135M-Instruct dots.ocr --sunset 31/12/2030
echo "== targets that are not served, unknown names, roles"
expect 2 'is not served here' "$GPUHUB" names rename SmolLM2-135M-Instruct no-such-model
expect 2 'did you mean `dots.ocr`' "$GPUHUB" names retire dots-ocr
expect 2 'assign `dots.ocr`' "$GPUHUB" roles set ocr svc-ocr
expect 2 'is a role' "$GPUHUB" names rename ocr dots.ocr
expect 2 'same name' "$GPUHUB" names rename dots.ocr dots.ocr
expect 2 '--since' "$GPUHUB" names callers svc-ocr --since 3w
echo "== a non-admin cannot change names"
lab_user
unprivileged_exec_check "$LAB_USER" "$GPUHUB"
expect 2 'needs an admin' runuser -u "$LAB_USER" -- "$GPUHUB" names retire svc-ocr --force
after="$(changes)"
[ "$before" = "$after" ] || lab_fail "the registry changed: $before history rows before, $after after"
[ "$("$GPUHUB" names list --json | jq -r '.names[] | select(.name == "svc-ocr") | .state')" = deprecated ] || lab_fail "svc-ocr is no longer deprecated"
echo "PASS: names-bad-input"
