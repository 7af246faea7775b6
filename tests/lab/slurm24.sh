#!/usr/bin/env bash
# The lab's second Slurm: 24.11 (Debian 13's packages) from the root that slurm24-root.sh makes,
# run ON THIS HOST in place of the 22.05 lab (GPUHUB_LAB_SLURM=24.11 tests/lab/up.sh, and
# tests/run-all.sh's second leg). Jobs run on the host's filesystem, so the system tests, the
# repo's .venv and target/release work unchanged on this leg:
# - every Slurm program of the root runs with the root's own dynamic loader and libraries, with
#   SLURM_CONF=$ROOT/etc/slurm/slurm.conf: the clients and slurmdbd (/run/gpuhub-lab24/bin/srun ...,
#   sbin/slurmdbd) through the loader invoked explicitly (a symlink named like the program, so
#   ps/pgrep see `srun`); slurmctld, slurmd and slurmstepd, which re-execute themselves through
#   /proc/self/exe, as copies whose interpreter is the root's loader and whose DT_RPATH is
#   /run/gpuhub-lab24/lib (tests/lab/elf-interp.py); the root's /usr/sbin/slurmd etc. are absolute
#   symlinks to the host's 22.05 files, so the copies are made from slurmd-wlm etc.;
# - slurmd runs the 24.11 slurmstepd: its SBINDIR in the daemons' copy of libslurmfull is
#   /run/l24s, a link to those copies (the host's /usr/sbin/slurmstepd stays 22.05's);
# - slurmctld 6917, slurmd 6918, slurmdbd 6919 (database slurm24_acct_db on the host's MariaDB),
#   the host's munged (same key); state, logs and pid files under the root; job ids from
#   24000000 (FirstJobId), apart from the 22.05 lab's in the agent's store;
# - the 22.05 lab's slurmctld, slurmd, slurmdbd and agent are stopped while this leg runs
#   (tests/lab/up.sh brings them back); the gpuhub agent (target/release, tests/lab/agent.toml)
#   runs with this leg's PATH and SLURM_CONF, so it parses 24.11's squeue/scontrol/sacct/sinfo.
#
#   tests/lab/slurm24.sh up          build the plugin against the root's headers (target/slurm-24.11),
#                                    install it, start the daemons and the agent (idempotent),
#                                    smoke job (GPUHUB_URL injected, sacct lists it)
#   tests/lab/slurm24.sh down        cancel jobs, stop this leg's agent and daemons; idempotent
#   tests/lab/slurm24.sh configure   only the build, the plugin, the Slurm files and wrappers
#   tests/lab/slurm24.sh run CMD...  run CMD on the host with this leg's PATH and SLURM_CONF
#
# Environment: GPUHUB_SLURM24_ROOT (default /var/lib/gpuhub-lab/slurm24-root),
# GPUHUB_LAB_BUILD=0 (do not run cargo), GPUHUB_LAB_TIMEOUT=60, GPUHUB_LAB_AGENT=0 (no agent),
# GPUHUB_LAB_SMOKE=0 (no smoke job), GPUHUB_LAB_AGENT_CONFIG (as tests/lab/up.sh).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/tests/lab"
TARGET="$REPO/target/slurm-24.11"
TIMEOUT="${GPUHUB_LAB_TIMEOUT:-60}"
BUILD="${GPUHUB_LAB_BUILD:-1}"
AGENT="${GPUHUB_LAB_AGENT:-1}"
SMOKE="${GPUHUB_LAB_SMOKE:-1}"
export PATH="$PATH:/root/.cargo/bin:/usr/sbin:/sbin"
export GPUHUB_LAB_SLURM=24.11
# shellcheck source=../lib/lab.sh
. "$REPO/tests/lib/lab.sh"   # the LAB24_* and LAB_* paths of this leg, lab24_* and agent_* functions
ROOT="$LAB24_ROOT"
CONF_DIR="$ROOT/etc/slurm"
CLUSTER="$(sed -n 's/^ClusterName=//p' "$HERE/slurm.conf")"

log() { echo "[lab24] $*" >&2; }
die() {
    echo "[lab24] ERROR: $*" >&2
    for f in "$ROOT/var/log/slurm/slurmctld.log" "$ROOT/var/log/slurm/slurmd.log" "$ROOT/var/log/slurm/slurmdbd.log" "$LAB_AGENT_LOG"; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}
[ "$(id -u)" -eq 0 ] || die "must run as root (daemons, /run)"

# wrappers: /run/gpuhub-lab24/{ld,bin,sbin}. ld/NAME is a symlink to the root's loader, so the
# process's name is NAME; bin/NAME and sbin/NAME exec it on the root's program.
wrappers() {
    local b dir prog
    mkdir -p "$LAB24_DIR/ld" "$LAB24_BIN" "$LAB24_SBIN" "$LAB24_DIR/exe" "$LAB24_DIR/lib"
    ln -sfn "$ROOT/lib64/ld-linux-x86-64.so.2" "$LAB24_DIR/ld.so"
    for f in "$ROOT"/usr/lib/x86_64-linux-gnu/*.so*; do
        ln -sfn "$f" "$LAB24_DIR/lib/${f##*/}"
    done
    # slurmd runs slurmstepd (steps, and the SPANK prolog/epilog) from SBINDIR, compiled into
    # libslurmfull as "/usr/sbin": the daemons' copy of the library names /run/l24s instead, a
    # link to $LAB24_DIR/exe (the host's /usr/sbin/slurmstepd is 22.05's). No mount namespace, so
    # the tests' mounts (spank-faults' read-only spool) reach the jobs.
    ln -sfn "$LAB24_DIR/exe" /run/l24s
    python3 - "$ROOT/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so" "$LAB24_DIR/lib/libslurmfull.so" <<'PY' ||
import os, sys
src, dst = sys.argv[1], sys.argv[2]
data = open(src, "rb").read()
old, new = b"\0/usr/sbin\0%s/slurmstepd\0", b"\0/run/l24s\0%s/slurmstepd\0"
if data.count(old) != 1:
    sys.exit(f"{src}: SBINDIR /usr/sbin next to %s/slurmstepd not found once")
data = data.replace(old, new)
if os.path.islink(dst) or not os.path.exists(dst) or open(dst, "rb").read() != data:
    tmp = f"{dst}.new.{os.getpid()}"
    open(tmp, "wb").write(data)
    os.replace(tmp, dst)
PY
        die "cannot make $LAB24_DIR/lib/libslurmfull.so"
    for b in srun sbatch salloc scontrol squeue sinfo sacct sacctmgr scancel sstat sattach sprio sshare sreport sdiag strigger sbcast \
        slurmctld slurmd slurmstepd slurmdbd; do
        case "$b" in
            slurmctld|slurmd|slurmstepd) dir="$LAB24_SBIN"; prog="$ROOT/usr/sbin/$b-wlm" ;;
            slurmdbd) dir="$LAB24_SBIN"; prog="$ROOT/usr/sbin/$b" ;;
            *) dir="$LAB24_BIN"; prog="$ROOT/usr/bin/$b" ;;
        esac
        [ -f "$prog" ] || continue
        case "$b" in slurmctld|slurmd|slurmstepd)
            # They re-execute themselves through /proc/self/exe (slurmctld's slurmscriptd, slurmd's
            # script launcher for the SPANK prolog/epilog): copies that name the root's loader as
            # their interpreter and $LAB24_DIR/lib (the root's libraries) as their DT_RPATH, so
            # they need no LD_LIBRARY_PATH, which would reach the host's programs they run.
            python3 "$HERE/elf-interp.py" "$prog" "$LAB24_DIR/exe/$b" "$LAB24_DIR/ld.so" "$LAB24_DIR/lib" ||
                die "cannot make $LAB24_DIR/exe/$b from $prog"
            printf '#!/bin/sh\n# gpuhub lab, Slurm 24.11 leg (tests/lab/slurm24.sh): %s from %s on this host\nSLURM_CONF="${SLURM_CONF:-%s}"; export SLURM_CONF\nexec %s "$@"\n' \
                "$b" "$ROOT" "$LAB_SLURM_CONF" "$LAB24_DIR/exe/$b" > "$dir/$b.new"
            chmod 755 "$dir/$b.new"; mv -f "$dir/$b.new" "$dir/$b"
            continue ;;
        esac
        ln -sfn "$ROOT/lib64/ld-linux-x86-64.so.2" "$LAB24_DIR/ld/$b"
        printf '#!/bin/sh\n# gpuhub lab, Slurm 24.11 leg (tests/lab/slurm24.sh): %s from %s on this host\nSLURM_CONF="${SLURM_CONF:-%s}"; export SLURM_CONF\nexec %s --argv0 %s --library-path %s %s "$@"\n' \
            "$b" "$ROOT" "$LAB_SLURM_CONF" "$LAB24_DIR/ld/$b" "$b" "$LAB24_LIBS" "$prog" > "$dir/$b.new"
        chmod 755 "$dir/$b.new"; mv -f "$dir/$b.new" "$dir/$b"
    done
}

# configure: the root, the plugin built against its headers, the leg's Slurm files; no daemon.
configure() {
    "$HERE/slurm24-root.sh" >/dev/null || die "tests/lab/slurm24-root.sh failed"
    if [ "$BUILD" = 1 ]; then
        log "cargo build --release of the plugin against $ROOT/usr/include into $TARGET"
        (cd "$REPO" && GPUHUB_SLURM_INCLUDE="$ROOT/usr/include" CARGO_TARGET_DIR="$TARGET" \
            cargo build --release --locked -p gpuhub-spank -p gpuhub-spank-prolog 2>&1 | tail -n 2) \
            || die "cargo build of the plugin for Slurm 24.11 failed"
    fi
    local so="$TARGET/release/libgpuhub_spank.so" so2="$TARGET/release/libgpuhub_spank_prolog.so" dst
    for f in "$so" "$so2"; do [ -f "$f" ] || die "$f missing: run this without GPUHUB_LAB_BUILD=0"; done
    for pair in "$so:$(lab_plugin_path)" "$so2:$(lab_plugin_path prolog)"; do
        dst="${pair#*:}"
        cmp -s "${pair%%:*}" "$dst" && continue
        install -m 755 "${pair%%:*}" "$dst.new.$$" && mv -f "$dst.new.$$" "$dst"
    done
    wrappers

    mkdir -p "$CONF_DIR/plugstack.conf.d" "$ROOT/var/lib/slurm/slurmd" "$ROOT/var/lib/slurm/slurmctld" "$ROOT/var/log/slurm" "$ROOT/run"
    local new="$CONF_DIR/.new.$$"
    mkdir -p "$new"
    { echo "# gpuhub lab, Slurm 24.11 leg on the host: made by tests/lab/slurm24.sh from tests/lab/slurm.conf"
      sed -E "s|^Include /etc/slurm/|Include $CONF_DIR/|;
              s#^(SlurmctldPidFile|SlurmdPidFile|SlurmdSpoolDir|StateSaveLocation|SlurmctldLogFile|SlurmdLogFile)=/#\1=$ROOT/#" "$HERE/slurm.conf"
      echo "SlurmctldPort=6917"
      echo "SlurmdPort=6918"
      echo "PluginDir=$LAB_PLUGIN_DIR"
      echo "PlugStackConfig=$CONF_DIR/plugstack.conf"
      echo "FirstJobId=24000000"
    } > "$new/slurm.conf"
    { cat "$HERE/accounting-slurmdbd.conf"; echo "AccountingStoragePort=6919"; } > "$new/lab-accounting.conf"
    sed -E "s|^DbdPort=.*|DbdPort=6919|; s|^StorageLoc=.*|StorageLoc=slurm24_acct_db|;
            s#^(LogFile|PidFile)=/#\1=$ROOT/#" "$HERE/slurmdbd.conf" > "$new/slurmdbd.conf"
    echo "PluginDir=$LAB_PLUGIN_DIR" >> "$new/slurmdbd.conf"
    cp "$HERE/gres.conf" "$HERE/cgroup.conf" "$new/"
    echo "include $CONF_DIR/plugstack.conf.d/*.conf" > "$new/plugstack.conf"
    sed "s|@PLUGIN@|$(lab_plugin_path)|" "$HERE/plugstack-gpuhub.conf" > "$new/gpuhub.conf"
    RESTART=0
    for f in slurm.conf lab-accounting.conf slurmdbd.conf gres.conf cgroup.conf plugstack.conf; do
        cmp -s "$new/$f" "$CONF_DIR/$f" || { install -m 644 "$new/$f" "$CONF_DIR/$f"; RESTART=1; }
    done
    chmod 600 "$CONF_DIR/slurmdbd.conf"
    cmp -s "$new/gpuhub.conf" "$LAB_PLUGSTACK" || install -m 644 "$new/gpuhub.conf" "$LAB_PLUGSTACK"
    rm -rf "$new"

    # Fake GPU devices, as tests/lab/up.sh makes them (only where none exist); down removes the
    # ones made here.
    local spare=(/dev/null /dev/zero) i
    for i in 0 1; do
        [ -e "/dev/nvidia$i" ] && continue
        mknod -m 666 "/dev/nvidia$i" c 195 "$i" 2>/dev/null || ln -s "${spare[$i]}" "/dev/nvidia$i" || die "cannot create /dev/nvidia$i"
        echo "/dev/nvidia$i" >> "$LAB24_DIR/fake-devices"
    done
}

# stop22: the 22.05 lab's agent, slurmctld, slurmd and slurmdbd (its jobs cancelled first); munged
# and MariaDB stay (this leg uses them). tests/lab/up.sh starts them again.
stop22() {
    local f
    [ -s /run/slurmctld.pid ] || [ -s /run/slurmd.pid ] || [ -s /run/slurmdbd.pid ] || return 0
    agent_stop
    if [ -s /run/slurmctld.pid ] && kill -0 "$(cat /run/slurmctld.pid)" 2>/dev/null; then
        log "stopping the 22.05 lab (its jobs cancelled) while the 24.11 leg runs"
        PATH="${PATH#"$LAB24_BIN:"}" SLURM_CONF=/etc/slurm/slurm.conf sh -c 'j="$(squeue -h -o %i)"; [ -z "$j" ] || { scancel $j; sleep 1; }' 2>/dev/null || true
        for _ in $(seq 50); do [ -z "$(PATH="${PATH#"$LAB24_BIN:"}" SLURM_CONF=/etc/slurm/slurm.conf squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
    for f in /run/slurmd.pid /run/slurmctld.pid /run/slurmdbd.pid; do
        [ -s "$f" ] && lab_stop_pidfile "$f"
    done
    return 0
}

db_up() { timeout 10 sacctmgr -n -P list cluster format=Cluster >/dev/null 2>&1; }

up() {
    configure
    local ver state="" deadline out job
    ver="$("$LAB24_BIN/srun" -V | awk '{print $2}')"
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 ||
        die "the host's munged does not answer (this leg shares it): start the 22.05 lab once (tests/lab/up.sh)"
    mysqladmin ping >/dev/null 2>&1 || die "MariaDB does not answer (mysqladmin ping): start the 22.05 lab once (tests/lab/up.sh, GPUHUB_LAB_ACCOUNTING=1)"
    stop22
    # Daemons of an older setup (another slurm.conf, or not running from $LAB24_DIR/exe) restart.
    local n f
    for n in slurmctld slurmd; do
        f="$LAB_SLURMCTLD_PID"; [ "$n" = slurmd ] && f="$LAB_SLURMD_PID"
        lab_pid_alive "$f" "$n" && [ "$(readlink "/proc/$(cat "$f")/exe")" != "$LAB24_DIR/exe/$n" ] && RESTART=1
    done
    [ "$RESTART" = 1 ] && lab24_stop_daemons
    mysql -e "CREATE DATABASE IF NOT EXISTS slurm24_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmlab';
              GRANT ALL ON slurm24_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" \
        || die "cannot create the accounting database slurm24_acct_db"
    if ! lab_pid_alive "$LAB_SLURMDBD_PID" slurmdbd; then
        log "starting slurmdbd 24.11 (port 6919)"
        "$LAB24_SBIN/slurmdbd" || die "slurmdbd failed to start"
    fi
    deadline=$((SECONDS + TIMEOUT))
    until db_up; do
        [ "$SECONDS" -lt "$deadline" ] || die "slurmdbd does not answer sacctmgr on port 6919 after ${TIMEOUT}s"
        lab_pid_alive "$LAB_SLURMDBD_PID" slurmdbd || pgrep -x slurmdbd >/dev/null || die "slurmdbd 24.11 exited"
        sleep 0.5
    done
    if ! sacctmgr -n -P list cluster format=Cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr -i add cluster $CLUSTER failed"
    fi
    if ! sacctmgr -n -P list account lab format=Account 2>/dev/null | grep -qx lab; then
        timeout 20 sacctmgr -i add account lab Cluster="$CLUSTER" Description="gpuhub lab" Organization=gpuhub >/dev/null ||
            die "sacctmgr -i add account lab failed"
    fi
    for u in "$(unprivileged_user)" "$(worker_account)" "$(quota_user)"; do
        if ! sacctmgr -n -P list associations users="$u" accounts=lab format=User 2>/dev/null | grep -qx "$u"; then
            timeout 20 sacctmgr -i add user "$u" Account=lab DefaultAccount=lab >/dev/null || die "sacctmgr -i add user $u failed"
        fi
    done
    if ! lab_pid_alive "$LAB_SLURMCTLD_PID" slurmctld || ! lab_pid_alive "$LAB_SLURMD_PID" slurmd; then
        # The leg's state and database are the lab's own: when the database was made after the
        # state (a new MariaDB, an earlier leg without slurmdbd), slurmctld refuses the cluster id
        # the database gives it; it takes it once its record of the old one is gone.
        lab_pid_alive "$LAB_SLURMCTLD_PID" slurmctld || rm -f "$ROOT/var/lib/slurm/slurmctld/clustername"
        lab24_stop_daemons slurmd slurmctld   # the one of them that still runs
        log "starting slurmctld and slurmd -N $LAB_NODE (Slurm $ver, ports 6917/6918)"
        lab_start_slurm || die "slurmctld/slurmd 24.11 failed to start"
    fi
    deadline=$((SECONDS + TIMEOUT))
    local resumed=0
    while [ "$SECONDS" -lt "$deadline" ]; do
        state="$(sinfo -h -n "$LAB_NODE" -o '%T' 2>/dev/null | head -n1 || true)"
        case "$state" in
            idle|mixed|allocated|completing) break ;;
            *drain*|down*)
                # A node drained in an earlier run (its state is kept): resume it once, as up.sh does.
                if [ "$resumed" = 0 ]; then
                    log "node is '$state' ($(sinfo -h -n "$LAB_NODE" -o '%E' | head -n1)); resuming it"
                    scontrol update nodename="$LAB_NODE" state=resume 2>/dev/null || true
                    resumed=1
                fi ;;
        esac
        lab_pid_alive "$LAB_SLURMCTLD_PID" slurmctld || pgrep -x slurmctld >/dev/null || die "slurmctld exited"
        sleep 0.5
    done
    case "$state" in idle|mixed|allocated|completing) ;; *) die "node $LAB_NODE is '${state:-unknown}' after ${TIMEOUT}s" ;; esac
    deadline=$((SECONDS + TIMEOUT))
    until [ -n "$(timeout 10 sacctmgr -n -P list cluster "$CLUSTER" format=ControlHost 2>/dev/null)" ]; do
        [ "$SECONDS" -lt "$deadline" ] || die "slurmctld 24.11 has not registered with slurmdbd after ${TIMEOUT}s"
        sleep 0.5
    done
    if [ "$AGENT" = 1 ]; then
        if agent_running && ! tr '\0' '\n' < "/proc/$(cat "$LAB_AGENT_PID")/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$LAB_SLURM_CONF"; then
            log "restarting gpuhub-agent (it is not this leg's)"
            agent_stop
        fi
        agent_start "$TIMEOUT" || die "gpuhub-agent did not answer http://127.0.0.1:8400/healthz within ${TIMEOUT}s"
    fi
    if [ "$SMOKE" = 1 ]; then
        out="$(cd /tmp && timeout 60 srun -N1 -t 1 --gres=gpu:1 printenv CUDA_VISIBLE_DEVICES GPUHUB_URL SLURM_JOB_ID 2>&1)" \
            || die "smoke test 'srun --gres=gpu:1' failed: $out"
        echo "$out" | grep -q '^http://' || die "smoke test: the plugin injected no GPUHUB_URL: $out"
        job="$(echo "$out" | sed -n 3p)"
        deadline=$((SECONDS + TIMEOUT))
        until [ "$(sacct -n -X -P -j "$job" -o State 2>/dev/null)" = COMPLETED ]; do
            [ "$SECONDS" -lt "$deadline" ] || die "sacct does not list the smoke job $job as completed after ${TIMEOUT}s"
            sleep 0.5
        done
    fi
    log "up: Slurm $ver on the host, node $LAB_NODE $state, slurmdbd (sacct), plugin $(lab_plugin_path)${AGENT:+, agent}"
    echo "[lab] try next: $LAB24_BIN/srun --help | grep -A1 gpuhub; tests/lab/slurm24.sh run sacct -X; GPUHUB_LAB_SLURM=24.11 tests/lab/down.sh"
}

down() {
    if lab_pid_alive "$LAB_SLURMCTLD_PID" slurmctld; then
        local jobs
        jobs="$(squeue -h -o '%i' 2>/dev/null | tr '\n' ' ' || true)"
        if [ -n "${jobs// /}" ]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
        fi
    fi
    if agent_running && tr '\0' '\n' < "/proc/$(cat "$LAB_AGENT_PID")/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$LAB_SLURM_CONF"; then
        agent_stop
    fi
    lab24_stop_daemons
    local d
    if [ -f "$LAB24_DIR/fake-devices" ]; then
        while read -r d; do rm -f "$d"; done < "$LAB24_DIR/fake-devices"
        rm -f "$LAB24_DIR/fake-devices"
    fi
    log "down (the 22.05 lab: tests/lab/up.sh)"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    configure) configure ;;
    run)
        shift; [ "$#" -gt 0 ] || die "usage: $0 run CMD..."
        [ -x "$LAB24_BIN/srun" ] || die "no wrappers in $LAB24_BIN yet: run '$0 configure' (or up) first"
        exec "$@" ;;
    *) die "usage: $0 up|down|configure|run CMD..." ;;
esac
