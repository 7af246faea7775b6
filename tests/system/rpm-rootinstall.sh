#!/usr/bin/env bash
# timeout: 600
# The RPMs install for real: `rpm --root R -i`, then `rpm --root R -e`, where R is an overlay
# of this host's / (lower, read-only) with a tmpfs as the upper layer, in a private mount
# namespace: the scriptlets run in a chroot with this host's shell, systemctl and
# systemd-tmpfiles, every write lands in the tmpfs, and the mounts vanish with this process
# (even on SIGKILL; the trap removes the empty mount point). No Slurm, no lab.
# What it proves:
#  1. Every Require of gpuhub-spank and gpuhub-agent (`rpm -qp --requires`) is met by this
#     host: rpmlib() features by this rpm (`rpm --showrc`), file paths exist, sonames with
#     their symbol versions by the libraries ldconfig knows (objdump -p), Slurm and systemd
#     by the installed Debian packages (dpkg-query; the Slurm range from the headers), and the
#     packages' own Provides (config(), gpuhub-spank). A Require no rule covers fails the test.
#  2. rpm itself agrees, without --nodeps: R's rpm database is empty (the Debian packages are
#     not in any rpm database), so a TEST-ONLY package is installed in the same transaction
#     that Provides exactly what step 1 found on this host (slurm = the Debian Slurm version,
#     the sonames, /bin/sh, ...); rpm then resolves the Requires, the rich Slurm range
#     included, and orders the scriptlets as on RHEL.
#  3. The scriptlets run and do what the spec says, on a host where systemd is PID 1 (R gets
#     a tmpfs /run with /run/systemd/system, the marker the scriptlets test) and a preset that
#     enables the units: %post spank creates the %ghost /run/gpuhub dirs with their modes
#     (systemd-tmpfiles), %post agent enables gpuhub-agent.service and gpuhub-backup.timer,
#     %pre agent creates the model worker account gpuhub-worker (system account, no login
#     shell; the only user or group created, the workers dir the only file not root:root) and
#     nothing outside the packages' files, the account files, the rpm database and the unit
#     symlinks is written (the overlay's upper layer is compared before and after). Modes and owners of the packaged
#     directories and %config files are as packaged, `rpm -V` is clean, the installed agent
#     runs in R and accepts the installed agent.toml (the unit's ExecStartPre).
#  4. `rpm -e` removes the packages' files, %preun disables the units, a modified
#     %config(noreplace) agent.toml is kept as agent.toml.rpmsave, an unmodified plugstack
#     snippet is removed, and the state and spool data stay; nothing else is left.
# The scriptlets are those of the packages built here (rpm/macros.debian on Debian: the same
# branches as RHEL's systemd-rpm-macros). Uses target/rpm/*.rpm from rpm-build.sh; builds
# them (GPUHUB_RPM_PREBUILT=1) if missing. Run as root.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
# shellcheck source=tests/lib/prereq.sh
source tests/lib/prereq.sh
[ "$(id -u)" -eq 0 ] || { echo "FAIL: run as root (mounts an overlay, runs rpm --root)" >&2; exit 1; }
for tool in rpm rpmbuild objdump ldconfig dpkg-query systemctl systemd-tmpfiles unshare chroot; do
    command -v "$tool" > /dev/null ||
        { prereq_missing "$tool not found" "run tests/setup/deps.sh (rpm, binutils, systemd, util-linux)" || exit 0; }
done
grep -qw overlay /proc/filesystems ||
    { prereq_missing "the kernel has no overlay filesystem" "modprobe overlay" || exit 0; }
if [ "${GPUHUB_ROOTINSTALL_NS:-0}" != 1 ]; then
    # A private mount namespace: what is mounted below is gone when this process is.
    GPUHUB_ROOTINSTALL_NS=1 exec unshare --mount --propagation private bash "$0" "$@"
fi

OUT="$REPO/target/rpm"
version="$(awk '$1=="Version:"{print $2; exit}' rpm/gpuhub.spec)"
arch="$(rpm --eval '%{_arch}')"
libdir="$(rpm --eval '%{_libdir}')"
spank="$OUT/gpuhub-spank-$version-1.$arch.rpm"
agent="$OUT/gpuhub-agent-$version-1.$arch.rpm"
if [ ! -s "$spank" ] || [ ! -s "$agent" ]; then
    echo "+ no RPMs in $OUT yet: GPUHUB_RPM_PREBUILT=1 rpm/build.sh"
    GPUHUB_RPM_PREBUILT=1 GPUHUB_RPM_LINT=0 rpm/build.sh > "$REPO/target/rpm-rootinstall-build.log" 2>&1 ||
        { tail -n 30 "$REPO/target/rpm-rootinstall-build.log"; echo "FAIL: rpm/build.sh"; exit 1; }
fi
pkgs=("$spank" "$agent")

failures=0
fail() { echo "FAIL $*"; failures=$((failures + 1)); }
ok() { echo "ok   $*"; }
check() { # check DESCRIPTION COMMAND...
    local what="$1"; shift
    if "$@" > /dev/null 2>&1; then ok "$what"; else fail "$what   (ran: $*)"; fi
}
vercmp() { rpm --eval "%{lua: print(rpm.vercmp('$1', '$2'))}"; }
# vercmp_ok HAVE OP WANT: HAVE OP WANT holds in rpm's version order
vercmp_ok() {
    local c
    c="$(vercmp "$1" "$3")"
    case "$2" in
        '>=') [ "$c" -ge 0 ] ;; '>') [ "$c" -gt 0 ] ;; '=') [ "$c" -eq 0 ] ;;
        '<=') [ "$c" -le 0 ] ;; '<') [ "$c" -lt 0 ] ;; *) return 1 ;;
    esac
}

# ------------------------------------------------------------------ 1. Requires against this host
# Names that RHEL packages provide and Debian packages carry under other names: name ->
# Debian packages (all installed, one upstream version, which is the version provided).
declare -A DEB_PKGS=(
    [slurm]="slurmd slurm-client"
    [systemd]="systemd"
)
declare -A DEB_WHY=(
    [slurm]="RHEL's slurm package (srun, slurmstepd, which load the plugin); Debian: slurmd + slurm-client"
    [systemd]="systemctl and systemd-tmpfiles in the scriptlets; Debian: systemd"
)
# Virtual Requires no Debian package names; each one is checked here as explained.
# (Pipes into `grep -q` are avoided here: with pipefail, the writer's SIGPIPE fails them.)
LDCACHE="$(ldconfig -p)"
ldcache_lib() { awk -v so="$1" '$1==so && /x86-64|AArch64/ && !f {print $NF; f=1}' <<<"$LDCACHE"; }
rtld_gnu_hash() { # rtld(GNU_HASH): the dynamic linker reads DT_GNU_HASH (glibc >= 2.5); its own libc uses it
    local libc sections
    libc="$(ldcache_lib libc.so.6)"
    [ -n "$libc" ] && sections="$(objdump -h "$libc")" && grep -q '\.gnu\.hash' <<<"$sections"
}
declare -A rpmlib_have=()
while read -r feat _ v; do rpmlib_have[$feat]="$v"; done < <(rpm --showrc | sed -n 's/^ *\(rpmlib([^)]*) = .*\)/\1/p')
set_provides="$(rpm -qp --provides "${pkgs[@]}")"
deb_version() { # the upstream version of an installed Debian package (no epoch, no revision)
    local v
    v="$(dpkg-query -W -f='${Status} ${Version}' "$1" 2>/dev/null)" || return 1
    case "$v" in "install ok installed "*) ;; *) return 1 ;; esac
    v="${v##* }"; v="${v#*:}"; echo "${v%-*}"
}
# provided_version NAME: the version this host provides NAME in (a mapped Debian package), or fail
provided_version() {
    local name="$1" p v="" pv
    [ -n "${DEB_PKGS[$name]:-}" ] || return 1
    for p in ${DEB_PKGS[$name]}; do
        pv="$(deb_version "$p")" || { echo "Debian package $p is not installed" >&2; return 1; }
        [ -z "$v" ] || [ "$v" = "$pv" ] || { echo "Debian packages ${DEB_PKGS[$name]} differ in version" >&2; return 1; }
        v="$pv"
    done
    echo "$v"
}
# soname_ok NAME(VERSION)(64bit): ldconfig knows the 64-bit library and it defines VERSION
soname_ok() {
    local req="$1" so ver lib defs
    [[ "$req" =~ ^([^\(\)]+)\(([^\(\)]*)\)\(64bit\)$ ]] || return 1
    so="${BASH_REMATCH[1]}"; ver="${BASH_REMATCH[2]}"
    lib="$(ldcache_lib "$so")"
    [ -n "$lib" ] && [ -e "$lib" ] || return 1
    [ -n "$ver" ] || return 0
    defs="$(objdump -p "$lib" | awk '/^Version definitions:/{s=1; next} /^$/{s=0} s && NF==4 {print $4}')"
    grep -qxF "$ver" <<<"$defs"
}
shim=()        # what the TEST-ONLY host package provides: only what was found on this host
unresolved=0
resolve() { # resolve NAME FLAGS VERSION: prints how, adds to shim[]; fails if not met here
    local name="$1" flags="$2" ver="$3" have
    local want="$name${flags:+ $flags $ver}"
    case "$name" in
    rpmlib\(*\))
        have="${rpmlib_have[$name]:-}"
        [ -n "$have" ] && vercmp_ok "$have" '>=' "$ver" || return 1
        echo "this rpm supports $name = $have" ;;
    /*)
        [ -e "$name" ] || return 1
        shim+=("$name"); echo "file on this host" ;;
    rtld\(GNU_HASH\))
        rtld_gnu_hash || return 1
        shim+=("$name"); echo "virtual (glibc on RHEL): this host's libc.so.6 has .gnu.hash, so its ld.so reads it" ;;
    *.so*\(*\)\(64bit\))
        soname_ok "$name" || return 1
        shim+=("$name"); echo "ldconfig: $(ldcache_lib "${name%%(*}")" ;;
    \(*\))
        # Rich dependency: only "(N OP V with N OP V)" (one package in a range) is understood.
        local re='^\(([A-Za-z0-9_.+-]+) (>=|>|<=|<|=) ([^ ()]+) with ([A-Za-z0-9_.+-]+) (>=|>|<=|<|=) ([^ ()]+)\)$'
        [[ "$name" =~ $re ]] && [ "${BASH_REMATCH[1]}" = "${BASH_REMATCH[4]}" ] || { echo "rich dependency this test does not understand" >&2; return 1; }
        local n="${BASH_REMATCH[1]}" op1="${BASH_REMATCH[2]}" v1="${BASH_REMATCH[3]}" op2="${BASH_REMATCH[5]}" v2="${BASH_REMATCH[6]}"
        have="$(provided_version "$n")" || return 1
        vercmp_ok "$have" "$op1" "$v1" && vercmp_ok "$have" "$op2" "$v2" || { echo "$n is $have here" >&2; return 1; }
        shim+=("$n = $have"); echo "$n = $have (${DEB_WHY[$n]})" ;;
    *)
        if grep -qxF "$want" <<<"$set_provides" || { [ -z "$flags" ] && grep -q "^$name\( \|$\)" <<<"$set_provides"; }; then
            echo "provided by the packages installed with it"
        elif have="$(provided_version "$name")"; then
            [ -z "$flags" ] || vercmp_ok "$have" "$flags" "$ver" || { echo "$name is $have here" >&2; return 1; }
            shim+=("$name = $have"); echo "$name = $have (${DEB_WHY[$name]})"
        else
            return 1
        fi ;;
    esac
}
echo "+ Requires of $(basename "$spank") $(basename "$agent"), resolved against this host"
while IFS='|' read -r pkg type name flags ver; do
    if how="$(resolve "$name" "$flags" "$ver")"; then
        printf 'ok   %-13s %-9s %-45s <- %s\n' "$pkg" "$type" "$name${flags:+ $flags $ver}" "$how"
    else
        printf 'FAIL %-13s %-9s %-45s <- UNRESOLVED on this host (add a rule with its reason to this test, or fix the spec)\n' "$pkg" "$type" "$name${flags:+ $flags $ver}"
        unresolved=$((unresolved + 1))
    fi
done < <(rpm -qp --qf '[%{=NAME}|%{REQUIREFLAGS:deptype}|%{REQUIRENAME}|%{REQUIREFLAGS:depflags}|%{REQUIREVERSION}\n]' "${pkgs[@]}")
# The resolve() calls above ran in subshells ($(...)): collect shim[] again, in this shell.
while IFS='|' read -r name flags ver; do resolve "$name" "$flags" "$ver" > /dev/null 2>&1 || true; done \
    < <(rpm -qp --qf '[%{REQUIRENAME}|%{REQUIREFLAGS:depflags}|%{REQUIREVERSION}\n]' "${pkgs[@]}" | sort -u)
echo "weak dependencies, not checked: $(rpm -qp --qf '[%{=NAME} recommends %{RECOMMENDNAME} %{RECOMMENDFLAGS:depflags} %{RECOMMENDVERSION}; ][%{=NAME} suggests %{SUGGESTNAME}; ]' "${pkgs[@]}")"
[ "$unresolved" -eq 0 ] || { echo "FAIL: $unresolved Require(s) not met on this host (see above)"; exit 1; }

# ------------------------------------------------------------------ the root: host / + tmpfs upper layer
work="$(mktemp -d /tmp/gpuhub-rpmroot.XXXXXX)"
cleanup() { umount -R "$work" 2>/dev/null || umount -R -l "$work" 2>/dev/null || true; rmdir "$work" 2>/dev/null || true; }
trap cleanup EXIT
trap 'exit 143' TERM INT
mount -t tmpfs -o mode=0755,size=2g gpuhub-rpmroot "$work"
mkdir "$work/upper" "$work/ovl-work" "$work/root" "$work/shim"
R="$work/root"
mount -t overlay gpuhub-rpmroot -o "lowerdir=/,upperdir=$work/upper,workdir=$work/ovl-work" "$R"
mount -t proc proc "$R/proc"
mount --bind /dev "$R/dev"
mount -t tmpfs -o mode=0755 gpuhub-rpmroot-run "$R/run"   # as at boot: an empty /run
mkdir -p "$R/run/systemd/system"                           # "systemd is PID 1", for the scriptlets
echo "+ root $R: overlay of / (upper layer: tmpfs $work/upper), /run a fresh tmpfs"
# R starts as this host without gpuhub (the lab's files are hidden in the overlay, not touched).
mapfile -t owned < <(rpm -qlp "${pkgs[@]}" | sort -u)
for f in "${owned[@]}" /etc/gpuhub /var/lib/gpuhub /var/spool/gpuhub; do
    if [ -e "$R$f" ] || [ -L "$R$f" ]; then rm -rf "${R:?}$f"; fi
done
rm -f "$R"/etc/systemd/system/*.wants/gpuhub-*
# A fresh rpm database at RHEL's path (Debian's rpm defaults to ~/.rpmdb).
DB=(--root "$R" --dbpath /var/lib/rpm)
# Debian's rpm warns on -i/-e (use alien) without --force-debian; RHEL's rpm has no such option.
FORCE=()
[ "$(rpm --help 2>&1 | grep -c -- '--force-debian')" -eq 0 ] || FORCE=(--force-debian)
rm -rf "$R/var/lib/rpm"; mkdir -p "$R/var/lib/rpm"
rpm "${DB[@]}" --initdb
# The site policy that enables the units (RHEL's default preset is "disable *").
mkdir -p "$R/etc/systemd/system-preset"
printf 'enable gpuhub-agent.service\nenable gpuhub-backup.timer\n' > "$R/etc/systemd/system-preset/00-gpuhub-test.preset"
# systemctl runs client-side (offline) in a chroot, as under `dnf --installroot`; it detects the
# chroot through /proc/1/root, which a sandbox may hide (EACCES: "assuming not" and then no bus),
# so say so explicitly. The scriptlets inherit the environment.
export SYSTEMD_OFFLINE=1
# The worker account must come from %pre agent: a host that has it (the lab's up.sh creates
# it) loses it in R first, so R starts as a fresh RHEL node would.
# (sed, not userdel: the host's workers may be running as it.)
sed -i '/^gpuhub-worker:/d' "$R/etc/passwd" "$R/etc/shadow" "$R/etc/group" "$R/etc/gshadow"
for f in passwd group shadow gshadow; do cut -d: -f1 "$R/etc/$f" | sort > "$work/accounts-before.$f"; done
snapshot() { (cd "$work/upper" && find . -mindepth 1 -printf '%P|%y|%m|%u:%g\n' | sort); }
snapshot > "$work/before.txt"

# ------------------------------------------------------------------ 2. install, without --nodeps
cat > "$work/shim/host.spec" <<EOF
Name:      gpuhub-test-debian-host
Version:   1
Release:   0
Summary:   TEST ONLY: what this Debian host provides (checked by tests/system/rpm-rootinstall.sh)
License:   Apache-2.0
BuildArch: noarch
$(printf 'Provides:  %s\n' "${shim[@]}" | sort -u)
%description
TEST ONLY. The Debian packages are in no rpm database; this package provides what
tests/system/rpm-rootinstall.sh found on this host, so rpm resolves the Requires itself.
%files
EOF
rpmbuild -bb --quiet --define "_topdir $work/shim" --define '_build_name_fmt host.rpm' "$work/shim/host.spec" > "$work/shim/build.log" 2>&1 ||
    { cat "$work/shim/build.log"; echo "FAIL: cannot build the test-only host package"; exit 1; }
shim_rpm="$work/shim/RPMS/host.rpm"
echo "+ test-only host package provides: $(rpm -qp --provides "$shim_rpm" | grep -v '^gpuhub-test-debian-host' | tr '\n' ',' | sed 's/,$//; s/,/, /g')"
echo "+ rpm --root $R -i (no --nodeps) host.rpm $(basename "$spank") $(basename "$agent")"
rc=0
rpm "${DB[@]}" "${FORCE[@]}" -i "$shim_rpm" "${pkgs[@]}" > "$work/install.log" 2>&1 || rc=$?
sed 's/^/  | /' "$work/install.log"
[ "$rc" -eq 0 ] || { echo "FAIL: rpm -i exited $rc (unmet dependency or failed scriptlet: see above)"; exit 1; }
ok "rpm -i: dependencies resolved by rpm, scriptlets ran (exit 0)"
check "rpm -i printed no warning (user/group lookup, .rpmnew, scriptlet)" test ! -s "$work/install.log"
check "rpm -q: both packages installed" rpm "${DB[@]}" -q gpuhub-spank gpuhub-agent

# ------------------------------------------------------------------ 3. what the install did
mode_is() { [ "$(stat -c '%a %U:%G %F' "$R$1")" = "$2" ]; }
# %post spank: systemd-tmpfiles made the %ghost runtime dirs (not in the payload).
check "%post spank: /run/gpuhub 755 root:root" mode_is /run/gpuhub "755 root:root directory"
check "%post spank: /run/gpuhub/dcgm-job-map 755 root:root" mode_is /run/gpuhub/dcgm-job-map "755 root:root directory"
# %post agent: systemctl preset enabled both units (symlinks where [Install] says).
enabled() { # enabled TARGET UNIT: the [Install] symlink points at the packaged unit (/lib = /usr/lib)
    case "$(readlink "$R/etc/systemd/system/$1.wants/$2")" in /usr/lib/systemd/system/"$2"|/lib/systemd/system/"$2") ;; *) return 1 ;; esac
    [ -f "$R/usr/lib/systemd/system/$2" ]
}
check "%post agent: gpuhub-agent.service enabled (multi-user.target.wants)" enabled multi-user.target gpuhub-agent.service
check "%post agent: gpuhub-backup.timer enabled (timers.target.wants)" enabled timers.target gpuhub-backup.timer
# Users and groups: %pre agent adds the worker account and its group, nothing else.
account_diff() { # account_diff FILE: the names R's /etc/FILE has now and had before rpm -i lacked
    comm -13 "$work/accounts-before.$1" <(cut -d: -f1 "$R/etc/$1" | sort) | tr '\n' ' '
}
for f in passwd group shadow gshadow; do
    check "%pre agent: /etc/$f gained only gpuhub-worker" test "$(account_diff "$f")" = "gpuhub-worker "
    check "%pre agent: /etc/$f lost nothing" test -z "$(comm -23 "$work/accounts-before.$f" <(cut -d: -f1 "$R/etc/$f" | sort))"
done
worker_account_ok() { # a system uid, home the workers dir, no login shell
    local e sys_max uid home shell
    e="$(chroot "$R" getent passwd gpuhub-worker)" || return 1
    sys_max="$(awk '$1 == "SYS_UID_MAX" {print $2}' "$R/etc/login.defs" 2>/dev/null)"
    IFS=: read -r _ _ uid _ _ home shell <<<"$e"
    [ "$uid" -le "${sys_max:-999}" ] && [ "$home" = /var/lib/gpuhub/workers ] && [ "$shell" = /usr/sbin/nologin ]
}
check "%pre agent: gpuhub-worker is a system account without a login shell, home the workers dir" worker_account_ok
owners_ok() {
    [ "$(rpm -qp --qf '[%{FILEUSERNAME}:%{FILEGROUPNAME} %{FILENAMES}\n]' "$spank" "$agent" | grep -v '^root:root ' | tr '\n' ' ')" = 'root:gpuhub-worker /var/lib/gpuhub/workers ' ]
}
check "every packaged file is root:root but the workers dir (root:gpuhub-worker)" owners_ok
# Packaged directories and %config files.
check "/var/spool/gpuhub 700 root:root" mode_is /var/spool/gpuhub "700 root:root directory"
check "/var/lib/gpuhub 711 root:root" mode_is /var/lib/gpuhub "711 root:root directory"
check "/var/lib/gpuhub/workers 770 root:gpuhub-worker" mode_is /var/lib/gpuhub/workers "770 root:gpuhub-worker directory"
check "/var/lib/gpuhub/backups 700 root:root" mode_is /var/lib/gpuhub/backups "700 root:root directory"
check "/etc/gpuhub 755 root:root" mode_is /etc/gpuhub "755 root:root directory"
check "/etc/gpuhub/agent.toml 600 root:root" mode_is /etc/gpuhub/agent.toml "600 root:root regular file"
check "/etc/slurm/plugstack.conf.d/gpuhub.conf 644 root:root" mode_is /etc/slurm/plugstack.conf.d/gpuhub.conf "644 root:root regular file"
# 0644 where rpmbuild's brp-elfperms drops the x bit of shared libraries; dlopen() does not need it.
check "$libdir/slurm/spank_gpuhub.so 644 or 755 root:root" sh -c "stat -c '%a %U:%G' '$R$libdir/slurm/spank_gpuhub.so' | grep -Ex '(644|755) root:root'"
check "/usr/bin/gpuhub-agent 755 root:root" mode_is /usr/bin/gpuhub-agent "755 root:root regular file"
check "%config files: agent.toml and the plugstack snippet" \
    test "$(rpm "${DB[@]}" -qc gpuhub-spank gpuhub-agent | sort | tr '\n' ' ')" = "/etc/gpuhub/agent.toml /etc/slurm/plugstack.conf.d/gpuhub.conf "
check "the plugstack snippet loads the installed plugin" grep -q "^optional $libdir/slurm/spank_gpuhub.so\b" "$R/etc/slurm/plugstack.conf.d/gpuhub.conf"
rpm "${DB[@]}" -V gpuhub-spank gpuhub-agent > "$work/verify.txt" 2>&1 || true
if [ -s "$work/verify.txt" ]; then sed 's/^/  | /' "$work/verify.txt"; fi
check "rpm -V gpuhub-spank gpuhub-agent: clean" test ! -s "$work/verify.txt"
check "installed gpuhub-agent --version runs in the root" sh -c "chroot '$R' /usr/bin/gpuhub-agent --version | grep -qF '$version'"
check "installed agent accepts the installed agent.toml (the unit's ExecStartPre)" \
    chroot "$R" env -u GPUHUB_STORE_URL -u GPUHUB_CONFIG /usr/bin/gpuhub-agent check-config --config /etc/gpuhub/agent.toml

# Nothing written outside the packages' files, the rpm database and the unit symlinks: every
# new entry of the upper layer is one of those, or a directory copied up unchanged.
in_list() { grep -qxF "$1" "$2"; }
printf '%s\n' "${owned[@]}" > "$work/owned.txt"
# Parent directories of packaged paths that this host lacks (on RHEL: owned by slurm, filesystem)
# are created by rpm and stay after rpm -e, empty.
ancestors() { local p; while read -r p; do while p="${p%/*}"; [ -n "$p" ]; do echo "$p"; done; done < "$work/owned.txt" | sort -u; }
ancestors > "$work/ancestors.txt"
footprint() { # footprint ALLOWED_FILE: print the upper layer's new entries that ALLOWED_FILE lacks
    local allowed="$1" p y m o
    comm -13 "$work/before.txt" <(snapshot) | while IFS='|' read -r p y m o; do
        in_list "/$p" "$allowed" && continue
        if [ "$y" = d ] && [ ! -e "/$p" ] && in_list "/$p" "$work/ancestors.txt" &&
            { [ "$allowed" != "$work/allowed-erase.txt" ] || [ -z "$(ls -A "$R/$p")" ]; }; then continue; fi
        # a whiteout: a packaged path removed again (erase), which hides the host's copy, if any
        [ "$y" = c ] && in_list "/$p" "$work/owned.txt" && continue
        case "/$p" in /var/lib/rpm/*) continue ;; esac
        if [ "$y" = d ] && [ -d "/$p" ] && [ "$(stat -c '%a|%U:%G' "/$p")" = "$m|$o" ]; then continue; fi
        echo "/$p ($y $m $o)"
    done
}
# The account files useradd/groupadd rewrite (and their backups).
accounts() { local f; for f in passwd group shadow gshadow; do echo "/etc/$f"; echo "/etc/$f-"; done; echo /etc/.pwd.lock; }
{ cat "$work/owned.txt"; accounts; echo /etc/systemd/system/multi-user.target.wants/gpuhub-agent.service
  echo /etc/systemd/system/timers.target.wants/gpuhub-backup.timer; echo /etc/systemd/system/timers.target.wants
  echo /etc/systemd/system/multi-user.target.wants; } > "$work/allowed-install.txt"
footprint "$work/allowed-install.txt" > "$work/stray.txt"
[ -s "$work/stray.txt" ] && sed 's/^/  | /' "$work/stray.txt"
check "the install wrote nothing but its files, the account files, the rpm database and the unit symlinks" test ! -s "$work/stray.txt"

# ------------------------------------------------------------------ 4. erase
echo "# local edit" >> "$R/etc/gpuhub/agent.toml"
echo 'store' > "$R/var/lib/gpuhub/store.db"
echo '{}' > "$R/var/spool/gpuhub/1.start.json"
echo "+ rpm --root $R -e gpuhub-agent gpuhub-spank (agent.toml edited; a store and a spool record written)"
rc=0
rpm "${DB[@]}" "${FORCE[@]}" -e gpuhub-agent gpuhub-spank > "$work/erase.log" 2>&1 || rc=$?
sed 's/^/  | /' "$work/erase.log"
[ "$rc" -eq 0 ] || { echo "FAIL: rpm -e exited $rc"; exit 1; }
ok "rpm -e: exit 0"
check "rpm -e said only that the edited agent.toml was saved as .rpmsave" \
    test "$(grep -v 'saved as /etc/gpuhub/agent.toml.rpmsave$' "$work/erase.log" | wc -l)" -eq 0
check "rpm -q: neither package installed any more" sh -c "! rpm ${DB[*]} -q gpuhub-spank && ! rpm ${DB[*]} -q gpuhub-agent"
check "%preun agent: gpuhub-agent.service disabled" test ! -L "$R/etc/systemd/system/multi-user.target.wants/gpuhub-agent.service"
check "%preun agent: gpuhub-backup.timer disabled" test ! -L "$R/etc/systemd/system/timers.target.wants/gpuhub-backup.timer"
for f in /usr/bin/gpuhub-agent /usr/bin/gpuhub "$libdir/slurm/spank_gpuhub.so" /usr/lib/systemd/system/gpuhub-agent.service \
         /usr/lib/tmpfiles.d/gpuhub-spank.conf /usr/share/gpuhub /etc/gpuhub/agent.toml; do
    check "removed: $f" test ! -e "$R$f"
done
check "unmodified %config removed: /etc/slurm/plugstack.conf.d/gpuhub.conf (no .rpmsave)" \
    sh -c "[ ! -e '$R/etc/slurm/plugstack.conf.d/gpuhub.conf' ] && [ ! -e '$R/etc/slurm/plugstack.conf.d/gpuhub.conf.rpmsave' ]"
check "edited %config(noreplace) kept: /etc/gpuhub/agent.toml.rpmsave has the local edit" grep -qx '# local edit' "$R/etc/gpuhub/agent.toml.rpmsave"
check "kept: the store /var/lib/gpuhub/store.db" test -s "$R/var/lib/gpuhub/store.db"
check "kept: the spool record /var/spool/gpuhub/1.start.json" test -s "$R/var/spool/gpuhub/1.start.json"
{ printf '%s\n' /etc/gpuhub /etc/gpuhub/agent.toml.rpmsave /var/lib/gpuhub /var/lib/gpuhub/store.db \
    /var/spool/gpuhub /var/spool/gpuhub/1.start.json /etc/systemd/system/timers.target.wants \
    /etc/systemd/system/multi-user.target.wants; accounts; } > "$work/allowed-erase.txt"
footprint "$work/allowed-erase.txt" > "$work/left.txt"
[ -s "$work/left.txt" ] && sed 's/^/  | /' "$work/left.txt"
# The worker account stays (files it owned, e.g. logs under a site's workers.dir, keep an owner).
check "rpm -e left only the .rpmsave, the store, the spool record and the worker account" test ! -s "$work/left.txt"

[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "PASS rpm-rootinstall"
