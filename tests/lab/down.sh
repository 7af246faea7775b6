#!/usr/bin/env bash
# Stop the gpuhub lab started by up.sh: the agent, then Slurm (slurmd, slurmctld, slurmdbd),
# MariaDB if up.sh started it, and munge, by pid files.
# Idempotent. Cancels remaining jobs first.
#   --purge   also delete Slurm's saved state, lab logs, the fake /dev/nvidia* nodes up.sh
#             created, and the lab's gpuhub spool/runtime dirs (configs stay in /etc/slurm)
set -uo pipefail

# GPUHUB_LAB_SLURM=24.11: the lab's second Slurm (Debian 13's 24.11 from a root, run on this host
# in place of this lab's daemons, with slurmdbd and the agent): tests/lab/slurm24.sh. Unset or 22.05: this lab.
case "${GPUHUB_LAB_SLURM:-22.05}" in
    22.05) ;;
    24.11) exec "$(dirname "${BASH_SOURCE[0]}")/slurm24.sh" down "$@" ;;
    *) echo "[lab] ERROR: GPUHUB_LAB_SLURM=$GPUHUB_LAB_SLURM: the lab has Slurm 22.05 (default) and 24.11" >&2; exit 1 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PURGE=0
[ "${1:-}" = "--purge" ] && PURGE=1
STATE_DIR=/run/gpuhub-lab
# shellcheck source=../lib/lab.sh
. "$REPO/tests/lib/lab.sh"
trap - EXIT

log() { echo "[lab] $*"; }
[ "$(id -u)" -eq 0 ] || { echo "[lab] ERROR: must run as root" >&2; exit 1; }

pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1")"
    [ -d "/proc/$pid" ] && grep -q "^$2" "/proc/$pid/comm" 2>/dev/null
}
stop_pid() {
    local pid
    if ! pid_alive "$1" "$2"; then rm -f "$1"; return 0; fi
    pid="$(cat "$1")"
    log "stopping $2 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 150); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    if [ -d "/proc/$pid" ]; then
        log "$2 (pid $pid) still running after 15 s, sending SIGKILL"
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

if agent_running; then log "stopping gpuhub-agent (pid $(cat "$LAB_AGENT_PID"))"; fi
agent_stop

if pid_alive /run/slurmctld.pid slurmctld; then
    jobs="$(squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')"
    if [ -n "${jobs// /}" ]; then
        log "cancelling jobs: $jobs"
        # shellcheck disable=SC2086
        scancel $jobs 2>/dev/null || true
        for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    fi
fi

stop_pid /run/slurmd.pid slurmd
# The two-node lab's nodes (GPUHUB_LAB_NODES=2): agents, slurmds, namespaces, bridge, store.
# shellcheck source=nodes.sh
. "$REPO/tests/lab/nodes.sh"
if nodes_active; then log "stopping the two-node lab's nodes"; nodes_down; fi
stop_pid /run/slurmctld.pid slurmctld
stop_pid /run/slurmdbd.pid slurmdbd
if [ -e "$STATE_DIR/mariadb-started" ]; then
    log "stopping MariaDB"
    /etc/init.d/mariadb stop >/dev/null 2>&1 || true
    rm -f "$STATE_DIR/mariadb-started"
fi
stop_pid /run/munge/munged.pid munged

left="$(pgrep -x slurmstepd | tr '\n' ' ' || true)"
[ -n "$left" ] && log "warning: slurmstepd processes still running: $left"

if [ "$PURGE" = 1 ]; then
    log "purging Slurm state, logs, fake devices and the lab's gpuhub spool/runtime"
    rm -rf /var/lib/slurm/slurmctld/* /var/lib/slurm/slurmd/*
    rm -f /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log /var/log/slurm/slurmdbd.log
    rm -rf /var/spool/gpuhub/records /var/spool/gpuhub/quarantine /run/gpuhub/dcgm-job-map
    if [ -f "$STATE_DIR/fake-devices" ]; then
        while read -r d; do [ -n "$d" ] && rm -f "$d"; done < "$STATE_DIR/fake-devices"
        rm -f "$STATE_DIR/fake-devices"
    fi
fi
log "down"
exit 0
