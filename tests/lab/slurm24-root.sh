#!/usr/bin/env bash
# Make (once) and check the Debian 13 (trixie) root that the lab's Slurm 24.11 leg runs from:
# slurmctld, slurmd, slurmdbd, the Slurm clients, munge and libslurm-dev (the headers the plugin
# is built against), plus the few tools the system tests call inside it.
# Idempotent: a complete root (its marker file names the package set) is reused as it is;
# an incomplete one (an interrupted debootstrap) is removed and made again.
# Prints the root's path on stdout, everything else on stderr.
#
# Environment:
#   GPUHUB_SLURM24_ROOT   where the root lives (default /var/lib/gpuhub-lab/slurm24-root)
#   GPUHUB_SLURM24_MIRROR Debian mirror (default http://deb.debian.org/debian)
set -euo pipefail

ROOT="${GPUHUB_SLURM24_ROOT:-/var/lib/gpuhub-lab/slurm24-root}"
MIRROR="${GPUHUB_SLURM24_MIRROR:-http://deb.debian.org/debian}"
SUITE=trixie
# The tests inside the root call jq, curl, python3, ss, nm/readelf, sqlite3, runuser, setsid.
PACKAGES="slurmctld,slurmd,slurmdbd,slurm-client,munge,libslurm-dev,jq,curl,ca-certificates,python3,iproute2,procps,binutils,sqlite3,util-linux,less"
MARKER="$ROOT/.gpuhub-root"

log() { echo "[slurm24-root] $*" >&2; }
die() { echo "[slurm24-root] ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap and chroot need it)"

if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$SUITE $PACKAGES" ]; then
    echo "$ROOT"
    exit 0
fi
# Never remove a root that something still has mounted (a running 24.11 leg).
if [ -d "$ROOT" ] && grep -q " $ROOT/" /proc/self/mounts; then
    die "$ROOT is incomplete or stale but has mounts below it (a running 24.11 lab?): run 'GPUHUB_LAB_SLURM=24.11 tests/lab/down.sh' first"
fi
if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null \
        || die "apt-get install debootstrap failed"
fi
[ -e "/usr/share/debootstrap/scripts/$SUITE" ] \
    || die "this debootstrap does not know '$SUITE': install a newer debootstrap (bookworm's 1.0.128 knows it)"
rm -rf "$ROOT"
mkdir -p "$(dirname "$ROOT")"
log "debootstrap $SUITE into $ROOT (minbase + $PACKAGES); a few minutes on first use"
start=$SECONDS
# Package scripts in the root must not start daemons: the lab starts what it needs.
if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOT" "$MIRROR" >"$ROOT.debootstrap.log" 2>&1; then
    tail -n 20 "$ROOT.debootstrap.log" >&2
    die "debootstrap $SUITE failed (full log $ROOT.debootstrap.log); the mirror $MIRROR must be reachable"
fi
# Keep the root small: the package cache is not needed once installed.
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*
ver="$(chroot "$ROOT" dpkg-query -W -f='${Version}' slurmctld)"
case "$ver" in 24.11.*) ;; *) die "$SUITE's slurmctld is $ver, not 24.11.x" ;; esac
[ -f "$ROOT/usr/include/slurm/spank.h" ] || die "libslurm-dev installed no /usr/include/slurm/spank.h in $ROOT"
echo "$SUITE $PACKAGES" > "$MARKER"
log "root ready in $((SECONDS - start)) s: Slurm $ver, $(du -sxh "$ROOT" | cut -f1)"
echo "$ROOT"
