#!/usr/bin/env bash
# The lab's second Slurm: 24.11 (Debian 13's packages) from the root that slurm24-root.sh makes,
# beside the default 22.05 lab. Its daemons run chrooted in that root on their own ports
# (slurmctld 6917, slurmd 6918: the 22.05 lab keeps 6817/6818/6819), with their own munged
# (socket inside the root) and their own state, logs and spool under the root; they share the
# host's network, /proc, /sys and /dev (the fake /dev/nvidia0-1 of the 22.05 lab, made here too
# when missing). Plugin-only for now: no slurmdbd, no agent (see docs/spank.md, "Other Slurm versions").
#
#   tests/lab/slurm24.sh up      build the plugin against the root's headers (target/slurm-24.11),
#                                install it in the root's PluginDir, start munged, slurmctld, slurmd,
#                                wait for the node and run a smoke job (GPUHUB_URL injected)
#   tests/lab/slurm24.sh down    stop the daemons (cancel jobs first), unmount; idempotent
#   tests/lab/slurm24.sh configure   only the build, the plugin and the Slurm files; no daemon
#   tests/lab/slurm24.sh run CMD...   run CMD in the root (e.g. srun --help), cwd /tmp there
#
# Environment: GPUHUB_SLURM24_ROOT (default /var/lib/gpuhub-lab/slurm24-root),
# GPUHUB_LAB_BUILD=0 (do not run cargo), GPUHUB_LAB_TIMEOUT=60.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/tests/lab"
ROOT="${GPUHUB_SLURM24_ROOT:-/var/lib/gpuhub-lab/slurm24-root}"
TARGET="$REPO/target/slurm-24.11"
TIMEOUT="${GPUHUB_LAB_TIMEOUT:-60}"
BUILD="${GPUHUB_LAB_BUILD:-1}"
NODE=gpu01
PLUGINDIR=/usr/lib/x86_64-linux-gnu/slurm-wlm
export PATH="$PATH:/root/.cargo/bin:/usr/sbin:/sbin"

log() { echo "[lab24] $*" >&2; }
die() {
    echo "[lab24] ERROR: $*" >&2
    for f in "$ROOT/var/log/slurm/slurmctld.log" "$ROOT/var/log/slurm/slurmd.log" "$ROOT/var/log/munge/munged.log"; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 15 "$f" >&2; }
    done
    exit 1
}
[ "$(id -u)" -eq 0 ] || die "must run as root (chroot, mounts, daemons)"

in_root() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"; }
mounted() { grep -q " $ROOT$1 " /proc/self/mounts; }
mount_all() {
    mounted /proc || mount -t proc proc "$ROOT/proc"
    mounted /sys || mount --rbind /sys "$ROOT/sys"
    mounted /dev || mount --rbind /dev "$ROOT/dev"
}
umount_all() {
    local m
    for m in /dev /sys /proc; do
        mounted "$m" && { umount -R "$ROOT$m" 2>/dev/null || umount -R -l "$ROOT$m"; }
    done
    return 0
}
# pid_of NAME: the pid of daemon NAME whose root is $ROOT (the 22.05 lab's run in /).
pid_of() {
    local p
    for p in $(pgrep -x "$1" || true); do
        [ "$(readlink "/proc/$p/root" 2>/dev/null)" = "$ROOT" ] && { echo "$p"; return 0; }
    done
    return 1
}
stop_daemon() {
    local pid
    pid="$(pid_of "$1")" || return 0
    log "stopping $1 (pid $pid)"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 150); do [ -d "/proc/$pid" ] || return 0; sleep 0.1; done
    log "$1 (pid $pid) still running after 15 s, sending SIGKILL"
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    if pid_of slurmctld >/dev/null; then
        jobs="$(in_root squeue -h -o '%i' 2>/dev/null | tr '\n' ' ' || true)"
        if [ -n "${jobs// /}" ]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            in_root scancel $jobs 2>/dev/null || true
            for _ in $(seq 50); do [ -z "$(in_root squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
        fi
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
    local left
    left="$(for p in $(pgrep -x slurmstepd || true); do [ "$(readlink "/proc/$p/root")" = "$ROOT" ] && echo "$p"; done | tr '\n' ' ')"
    [ -n "${left// /}" ] && log "warning: slurmstepd processes of the 24.11 lab still running: $left"
    umount_all
    log "down"
}

# configure: the root, the plugin built against its headers and installed in its PluginDir, the
# lab's Slurm files; no daemon.
configure() {
    "$HERE/slurm24-root.sh" >/dev/null || die "tests/lab/slurm24-root.sh failed"
    if [ "$BUILD" = 1 ]; then
        log "cargo build --release of the plugin against $ROOT/usr/include into $TARGET"
        (cd "$REPO" && GPUHUB_SLURM_INCLUDE="$ROOT/usr/include" CARGO_TARGET_DIR="$TARGET" \
            cargo build --release --locked -p gpuhub-spank -p gpuhub-spank-prolog 2>&1 | tail -n 2) \
            || die "cargo build of the plugin for Slurm 24.11 failed"
    fi
    local so="$TARGET/release/libgpuhub_spank.so"
    [ -f "$so" ] || die "$so missing: run this without GPUHUB_LAB_BUILD=0"
    install -m 755 "$so" "$ROOT$PLUGINDIR/spank_gpuhub.so.new" && mv -f "$ROOT$PLUGINDIR/spank_gpuhub.so.new" "$ROOT$PLUGINDIR/spank_gpuhub.so"
    install -m 755 "$TARGET/release/libgpuhub_spank_prolog.so" "$ROOT$PLUGINDIR/spank_gpuhub_prolog.so"

    # The 22.05 lab's files, on this leg's ports, without slurmdbd (not yet on this leg).
    mkdir -p "$ROOT/etc/slurm/plugstack.conf.d" "$ROOT/var/lib/slurm/slurmd" "$ROOT/var/lib/slurm/slurmctld" "$ROOT/var/log/slurm"
    { echo "# gpuhub lab, Slurm 24.11 leg: made by tests/lab/slurm24.sh from tests/lab/slurm.conf"
      sed 's|^Include /etc/slurm/lab-accounting.conf|Include /etc/slurm/lab-accounting.conf\nSlurmctldPort=6917\nSlurmdPort=6918|' "$HERE/slurm.conf"
    } > "$ROOT/etc/slurm/slurm.conf"
    cp "$HERE/gres.conf" "$HERE/cgroup.conf" "$ROOT/etc/slurm/"
    # No slurmdbd yet, so no AccountingStorageTRES either: 24.11's slurmctld refuses to start with
    # gres/gpu in it without slurmdbd ("slurmdbd is required to run with TRES gres/gpu"), so
    # AllocTRES carries no gres on this leg.
    cp "$HERE/accounting-none.conf" "$ROOT/etc/slurm/lab-accounting.conf"
    echo 'include /etc/slurm/plugstack.conf.d/*.conf' > "$ROOT/etc/slurm/plugstack.conf"
    sed "s|@PLUGIN@|$PLUGINDIR/spank_gpuhub.so|" "$HERE/plugstack-gpuhub.conf" > "$ROOT/etc/slurm/plugstack.conf.d/gpuhub.conf"

    # The host's names: slurmctld resolves the submitting host (srun's address is `hostname`), and
    # a name missing here costs 10 s of retries per job and leaves it COMPLETING.
    cp /etc/hosts "$ROOT/etc/hosts"

    # The lab's unprivileged account, with the host's uid and gid, so jobs can run as it here too.
    local pw gr
    if pw="$(getent passwd gpuhublab)" && ! grep -q '^gpuhublab:' "$ROOT/etc/passwd"; then
        gr="$(getent group "$(cut -d: -f4 <<<"$pw")")" || die "no group for gpuhublab's gid"
        grep -q "^${gr%%:*}:" "$ROOT/etc/group" || echo "$gr" >> "$ROOT/etc/group"
        echo "$pw" | awk -F: -v OFS=: '{$6="/tmp"; print}' >> "$ROOT/etc/passwd"
        echo "gpuhublab:!:20000::::::" >> "$ROOT/etc/shadow"
    fi

    local spare=(/dev/null /dev/zero) i
    for i in 0 1; do
        [ -e "/dev/nvidia$i" ] || mknod -m 666 "/dev/nvidia$i" c 195 "$i" 2>/dev/null || ln -s "${spare[$i]}" "/dev/nvidia$i" \
            || die "cannot create /dev/nvidia$i"
    done
}

up() {
    configure
    local ver
    ver="$(in_root dpkg-query -W -f='${Version}' slurmctld)"
    mount_all

    if ! pid_of munged >/dev/null; then
        log "starting munged (in the root)"
        in_root sh -c 'mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge && runuser -u munge -- /usr/sbin/munged --force' \
            || die "munged failed to start in $ROOT"
        for _ in $(seq 50); do in_root sh -c 'munge -n </dev/null | unmunge >/dev/null 2>&1' && break; sleep 0.1; done
    fi
    stop_daemon slurmd; stop_daemon slurmctld   # they read the files above only at start
    log "starting slurmctld and slurmd -N $NODE (Slurm $ver, ports 6917/6918)"
    in_root slurmctld || die "slurmctld failed to start"
    in_root slurmd -N "$NODE" || die "slurmd failed to start"
    local state="" deadline=$((SECONDS + TIMEOUT))
    while [ "$SECONDS" -lt "$deadline" ]; do
        pid_of slurmctld >/dev/null || die "slurmctld exited"
        pid_of slurmd >/dev/null || die "slurmd exited"
        state="$(in_root sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true)"
        case "$state" in idle|mixed|allocated) break ;; esac
        sleep 0.5
    done
    case "$state" in idle|mixed|allocated) ;; *) die "node $NODE is '${state:-unknown}' after ${TIMEOUT}s" ;; esac
    local out
    out="$(in_root sh -c 'cd /tmp && timeout 60 srun -N1 -t 1 --gres=gpu:1 printenv CUDA_VISIBLE_DEVICES GPUHUB_URL' 2>&1)" \
        || die "smoke test 'srun --gres=gpu:1' failed: $out"
    echo "$out" | grep -q '^http://' || die "smoke test: the plugin injected no GPUHUB_URL: $out"
    log "up: Slurm $ver, node $NODE $state, plugin loaded (smoke job got GPUHUB_URL, CUDA_VISIBLE_DEVICES=$(echo "$out" | head -n1))"
}

case "${1:-}" in
    up) up ;;
    down) shift; down ;;
    configure) configure ;;
    run)
        shift; [ "$#" -gt 0 ] || die "usage: $0 run CMD..."
        [ -f "$ROOT/etc/slurm/slurm.conf" ] || die "$ROOT has no Slurm configuration yet: run '$0 configure' (or up) first"
        # Mounts this call made are undone after it; a running lab's stay.
        own=0; mounted /proc || { own=1; mount_all; }
        rc=0; in_root sh -c 'cd /tmp && exec "$@"' sh "$@" || rc=$?
        [ "$own" = 0 ] || umount_all
        exit "$rc" ;;
    *) die "usage: $0 up|down|configure|run CMD..." ;;
esac
