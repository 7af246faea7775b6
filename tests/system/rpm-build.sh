#!/usr/bin/env bash
# timeout: 1800
# rpm/build.sh builds the RPMs (offline, from the vendored tarball, in a network namespace
# where possible), rpmlint is clean, the units pass systemd-analyze verify; then this test
# checks the packages themselves: names, file lists, modes, %config(noreplace), the Slurm
# requirement derived from the installed headers, the scriptlets, the tarball's contents, and
# that the packaged binaries run.
#   GPUHUB_RPM_PREBUILT=1  package the release build instead of compiling inside rpmbuild
#                          (CI time: see rpm/build.sh; the full build is the default)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
OUT="$REPO/target/rpm"
echo "+ rpm/build.sh   (GPUHUB_RPM_PREBUILT=${GPUHUB_RPM_PREBUILT:-0})"
rpm/build.sh
failures=0
check() { # check DESCRIPTION COMMAND...
    local what="$1"; shift
    if "$@" > /dev/null 2>&1; then echo "ok   $what"; else echo "FAIL $what   (ran: $*)"; failures=$((failures + 1)); fi
}

version="$(awk '$1=="Version:"{print $2; exit}' rpm/gpuhub.spec)"
arch="$(rpm --eval '%{_arch}')"
libdir="$(rpm --eval '%{_libdir}')"
spank="$OUT/gpuhub-spank-$version-1.$arch.rpm"
agent="$OUT/gpuhub-agent-$version-1.$arch.rpm"
for p in "$spank" "$agent" "$OUT/gpuhub-$version-1.src.rpm" "$OUT/gpuhub-$version.tar.gz" \
         "$OUT/gpuhub-spank-debuginfo-$version-1.$arch.rpm" "$OUT/gpuhub-agent-debuginfo-$version-1.$arch.rpm"; do
    check "built $(basename "$p")" test -s "$p"
done
[ -s "$spank" ] && [ -s "$agent" ] || { echo "FAIL: packages missing; see $OUT/rpmbuild.log"; exit 1; }

ls_pkg() { rpm -qp --qf '[%{FILEMODES:perms} %{FILEUSERNAME} %{FILEGROUPNAME} %{FILEFLAGS:fflags} %{FILENAMES}\n]' "$1"; }
ls_pkg "$spank" > "$OUT/spank.files"
ls_pkg "$agent" > "$OUT/agent.files"
has() { grep -Eq "^$2\$" "$OUT/$1.files"; }
# gpuhub-spank
check "spank: $libdir/slurm/spank_gpuhub.so" has spank "-rw[-x]r-[-x]r-[-x] root root [a-z]* $libdir/slurm/spank_gpuhub.so"
check "spank: $libdir/slurm/spank_gpuhub_prolog.so (the job-hooks build)" has spank "-rw[-x]r-[-x]r-[-x] root root [a-z]* $libdir/slurm/spank_gpuhub_prolog.so"
check "spank: plugstack snippet is %config(noreplace)" has spank "-rw-r--r-- root root cn /etc/slurm/plugstack.conf.d/gpuhub.conf"
check "spank: spool dir 0700 root" has spank "drwx------ root root [a-z]* /var/spool/gpuhub"
check "spank: /run/gpuhub is %ghost" has spank "drwxr-xr-x root root g /run/gpuhub"
check "spank: tmpfiles.d" has spank "-rw-r--r-- root root [a-z]* /usr/lib/tmpfiles.d/gpuhub-spank.conf"
check "spank: slurm-conf docs" has spank ".* [a-z]*d[a-z]* /usr/share/doc/gpuhub-spank[^/]*/slurm-conf/README.md"
check "spank: license texts" has spank ".* l /usr/share/licenses/gpuhub-spank[^/]*/LICENSE"
# gpuhub-agent
check "agent: /usr/bin/gpuhub-agent" has agent "-rwxr-xr-x root root [a-z]* /usr/bin/gpuhub-agent"
check "agent: /usr/bin/gpuhub" has agent "-rwxr-xr-x root root [a-z]* /usr/bin/gpuhub"
check "agent: agent.toml is %config(noreplace), 0600 root" has agent "-rw------- root root cn /etc/gpuhub/agent.toml"
check "agent: state dir 0711 root (the worker account passes through to workers/)" has agent "drwx--x--x root root [a-z]* /var/lib/gpuhub"
check "agent: workers dir 0770 root:gpuhub-worker" has agent "drwxrwx--- root gpuhub-worker [a-z]* /var/lib/gpuhub/workers"
check "agent: sysusers.d declares the worker account" has agent "-rw-r--r-- root root [a-z]* /usr/lib/sysusers.d/gpuhub-agent.conf"
check "agent: backups dir 0700 root" has agent "drwx------ root root [a-z]* /var/lib/gpuhub/backups"
for u in gpuhub-agent.service gpuhub-backup.service gpuhub-backup.timer; do
    check "agent: unit $u" has agent "-rw-r--r-- root root [a-z]* /usr/lib/systemd/system/$u"
done
for f in prometheus/gpuhub.yml prometheus/gpuhub-alerts.yml grafana/gpuhub-gpu-telemetry.json grafana/gpuhub-gpu-hours.json \
         grafana/gpuhub-gateway.json grafana/gpuhub-names.json jupyterhub/jupyterhub_config.py jupyterhub/gpuhub_jupyterhub_sso.py \
         jupyterhub/gpuhub_page.py; do
    check "agent: /usr/share/gpuhub/$f" has agent "-rw-r--r-- root root [a-z]* /usr/share/gpuhub/$f"
done
check "agent: admin guide" has agent ".* d /usr/share/doc/gpuhub-agent[^/]*/admin-guide.md"
check "agent: LICENSE.dependencies" has agent ".* l /usr/share/licenses/gpuhub-agent[^/]*/LICENSE.dependencies.gpuhub-agent"
check "agent: vendored license index" has agent ".* l /usr/share/licenses/gpuhub-agent[^/]*/vendor-licenses/INDEX"

# The Slurm requirement: derived here independently from the installed header.
num="$(awk '$1=="#define" && $2=="SLURM_VERSION_NUMBER" {print $3}' /usr/include/slurm/slurm_version.h)"
mm="$(printf '%02d.%02d' $(( (num >> 16) & 0xff )) $(( (num >> 8) & 0xff )))"
next="$(printf '%02d.%02d' $(( (num >> 16) & 0xff )) $(( ((num >> 8) & 0xff) + 1 )))"
rpm -qp --requires "$spank" > "$OUT/spank.requires"
check "spank requires (slurm >= $mm with slurm < $next) (header: $num)" grep -qxF "(slurm >= $mm with slurm < $next)" "$OUT/spank.requires"
check "spank provides gpuhub-spank(slurm) = $mm" sh -c "rpm -qp --provides '$spank' | grep -qxF 'gpuhub-spank(slurm) = $mm'"
check "spank %post runs systemd-tmpfiles for gpuhub-spank.conf" sh -c "rpm -qp --scripts '$spank' | grep -q 'systemd-tmpfiles --create.*gpuhub-spank.conf'"
rpm -qp --scripts "$agent" > "$OUT/agent.scripts"
check "agent scriptlets handle gpuhub-agent.service and the timer" grep -q 'gpuhub-agent.service gpuhub-backup.timer' "$OUT/agent.scripts"
check "agent %postun restarts the agent on upgrade" grep -q 'try-restart gpuhub-agent.service' "$OUT/agent.scripts"
check "agent %pre creates the worker account gpuhub-worker (no login shell)" grep -q 'useradd -r .*-s /usr/sbin/nologin .*gpuhub-worker' "$OUT/agent.scripts"

# The source tarball: vendored crates + cargo config, no build output.
tar -tzf "$OUT/gpuhub-$version.tar.gz" > "$OUT/tarball.list"
check "tarball has vendor/ (e.g. tokio)" grep -q "^gpuhub-$version/vendor/tokio-" "$OUT/tarball.list"
check "tarball has .cargo/config.toml" grep -qx "gpuhub-$version/.cargo/config.toml" "$OUT/tarball.list"
check "tarball has Cargo.lock" grep -qx "gpuhub-$version/Cargo.lock" "$OUT/tarball.list"
check "tarball has no target/" sh -c "! grep -q '^gpuhub-$version/target/' '$OUT/tarball.list'"
check "rpmlint: 0 errors, 0 warnings" grep -q '0 errors, 0 warnings' "$OUT/rpmlint.txt"

# The packaged binaries run.
root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT
(cd "$root" && rpm2cpio "$agent" | cpio -idm --quiet && rpm2cpio "$spank" | cpio -idm --quiet)
check "packaged gpuhub-agent --version says $version" sh -c "'$root/usr/bin/gpuhub-agent' --version | grep -q '$version'"
check "packaged gpuhub --help runs" "$root/usr/bin/gpuhub" --help
check "packaged gpuhub-agent accepts the packaged agent.toml" env -u GPUHUB_STORE_URL "$root/usr/bin/gpuhub-agent" check-config --config "$root/etc/gpuhub/agent.toml"
check "packaged plugin exports plugin_name/plugin_type/plugin_version" sh -c "nm -D --defined-only '$root$libdir/slurm/spank_gpuhub.so' | grep -c ' plugin_\(name\|type\|version\)$' | grep -qx 3"
check "packaged spank_gpuhub.so has no job hooks (no prolog process per job)" sh -c "! nm -D --defined-only '$root$libdir/slurm/spank_gpuhub.so' | grep -q ' slurm_spank_job_'"
check "packaged spank_gpuhub_prolog.so has both job hooks" sh -c "nm -D --defined-only '$root$libdir/slurm/spank_gpuhub_prolog.so' | grep -c ' slurm_spank_job_\(prolog\|epilog\)$' | grep -qx 2"

echo "file lists: $OUT/spank.files $OUT/agent.files; full contents: $OUT/contents.txt"
[ -s "$OUT/rpmbuild-seconds" ] && echo "rpmbuild took $(cat "$OUT/rpmbuild-seconds") s (GPUHUB_RPM_PREBUILT=${GPUHUB_RPM_PREBUILT:-0})"
[ "$failures" -eq 0 ] || { echo "$failures check(s) failed"; exit 1; }
echo "PASS rpm-build"
