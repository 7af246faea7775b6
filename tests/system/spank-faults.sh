#!/usr/bin/env bash
# SPANK plugin under faults: malformed plugstack arguments; an unreadable (FIFO, directory),
# huge, corrupt or wrong-version snapshot; a read-only spool; a full file system under the
# spool. In every case the job succeeds within its timeout, the node is not drained, and
# slurmd.log has a line that names the problem.
set -euo pipefail
. "$(dirname "$0")/../lib/lab.sh"
lab_require
spank_fixture
cd "$T"
PRINT='echo JOB=$SLURM_JOB_ID; env | grep -E "^(GPUHUB|MLFLOW|[A-Z_]+_MODEL)" | sort'
val() { sed -n "s/^$1=//p" <<<"$LAB_OUT" | head -n1; }

# run_ok NAME: srun a GPU step (prolog, step and epilog all run) that must succeed in 30 s.
run_ok() {
    local t0=$SECONDS
    lab_run timeout 30 srun -N1 -t 1 --gres=gpu:1 "$@" bash -c "$PRINT"
    [ "$LAB_RC" = 0 ] || lab_fail "the job failed (exit $LAB_RC); a plugin fault must never fail a job"
    [ $((SECONDS - t0)) -lt 20 ] || lab_fail "the job took $((SECONDS - t0)) s"
    JOB="$(val JOB)"
    [ -n "$JOB" ] || lab_fail "no job id in the output"
    lab_wait_job "$JOB" 30 || lab_fail "job $JOB still in the queue"
    lab_node_ok
}
log_has() { # log_has JOB-INDEPENDENT-TEXT: the text appears in slurmd.log after the mark
    tail -c +"$MARK" "$LAB_SLURMD_LOG" | grep -F -- "$1" >/dev/null || lab_fail "slurmd.log has no line containing: $1"
}
mark() { MARK=$(( $(stat -c %s "$LAB_SLURMD_LOG") + 1 )); }

echo "== malformed plugstack arguments: plugin stays out of the way, options still work"
for bad in "spool=/x|unknown key \"spool\"; known keys: spool_dir" \
           "inject=maybe|accepted values: yes, no" \
           "spool_dir|expected key=value" \
           "token_ttl_s=-1|expected whole seconds from 60"; do
    arg="${bad%%|*}"; want="${bad#*|}"
    plugstack_set "spool_dir=$T_SPOOL" "snapshot=$T_SNAP" "$arg"
    mark
    run_ok --mlflow-experiment=still-accepted
    if grep -q '^GPUHUB_URL=' <<<"$LAB_OUT"; then lab_fail "$arg: the plugin injected variables despite a bad plugstack line"; fi
    log_has "gpuhub: plugstack argument \"$arg\": $want"
    log_has "the plugin is disabled for this process"
    echo "ok: $arg"
done

echo "== snapshot faults: fall back (no roles), log, never hang"
mkfifo "$T/fifo.json"
mkdir "$T/dir.json"
{ printf '{"version":1,"generated_at":1,"gateway_url":null,"mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{"ocr":"huge"},"pad":"'
  head -c 200000 /dev/zero | tr '\0' 'x'; printf '"}'; } > "$T/huge.json"
head -c 60 "$T_SNAP" > "$T/corrupt.json"
sed 's/"version":1/"version":99/' "$T_SNAP" > "$T/v99.json"
for c in "fifo.json|is not a regular file" "dir.json|is not a regular file" \
         "huge.json|over the 65536-byte limit" "corrupt.json|corrupt snapshot" "v99.json|snapshot version 99 is not supported"; do
    f="${c%%|*}"; want="${c#*|}"
    plugstack_set "spool_dir=$T_SPOOL" "snapshot=$T/$f" "job_key=$T_KEY"
    mark
    run_ok
    [ "$(val GPUHUB_URL)" = "http://127.0.0.1:8400" ] || lab_fail "$f: GPUHUB_URL not injected from the defaults"
    if grep -q '_MODEL=' <<<"$LAB_OUT"; then lab_fail "$f: role variables from a bad snapshot"; fi
    log_has "$T/$f"
    log_has "$want"
    lab_wait_record "$T_SPOOL" "$JOB" step_end 20 || lab_fail "$f: usage records must not depend on the snapshot"
    echo "ok: $f"
done

echo "== read-only spool: job succeeds, the lost record is logged whole"
mkdir -p "$T/ro"
mount -t tmpfs -o size=1m,ro tmpfs "$T/ro" || lab_fail "cannot mount a tmpfs (need CAP_SYS_ADMIN)"
lab_cleanup_add "umount -l '$T/ro' 2>/dev/null"
plugstack_set "spool_dir=$T/ro/spool" "snapshot=$T_SNAP" "job_key=$T_KEY"
mark
run_ok
log_has "cannot write the step_start record of job $JOB under $T/ro/spool"
log_has "Read-only file system"
log_has "\"kind\":\"step_start\",\"v\":1"
echo "ok: read-only spool"

echo "== full file system under the spool"
mkdir -p "$T/full"
mount -t tmpfs -o size=64k tmpfs "$T/full" || lab_fail "cannot mount a tmpfs"
lab_cleanup_add "umount -l '$T/full' 2>/dev/null"
mkdir -p "$T/full/spool/records"
dd if=/dev/zero of="$T/full/fill" bs=4k 2>/dev/null || true   # until ENOSPC
plugstack_set "spool_dir=$T/full/spool" "snapshot=$T_SNAP" "job_key=$T_KEY"
mark
run_ok
log_has "cannot write the step_start record of job $JOB"
log_has "No space left on device"
left="$(find "$T/full/spool/records" -name '.*.tmp' | wc -l)"
[ "$left" = 0 ] || lab_fail "$left temp files left behind in the full spool"
rm -f "$T/full/fill"
run_ok
lab_wait_record "$T/full/spool" "$JOB" step_end 20 || lab_fail "records do not resume once space is free"
echo "ok: full file system"
echo "PASS: spank-faults"
