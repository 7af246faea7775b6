#!/usr/bin/env bash
# Builds the gpuhub RPMs (gpuhub-spank, gpuhub-agent, and the source RPM) into target/rpm/,
# offline, from a source tarball with every crate vendored; then lists their contents, runs
# rpmlint (rpm/rpmlintrc + rpm/rpmlint.toml: zero errors) and `systemd-analyze verify` on the
# packaged units. A missing systemd-analyze or network namespace (unshare -n) is reported and
# skipped by hand, and fails under GPUHUB_TEST_STRICT=1 (tests/run-all.sh; tests/lib/prereq.sh).
#
#   rpm/build.sh                        full build: rpmbuild compiles the workspace from the
#                                       tarball with `cargo build --release --offline --frozen`
#   GPUHUB_RPM_PREBUILT=1 rpm/build.sh  CI mode: `cargo build --release` here (a no-op when CI
#                                       just built it), then rpmbuild packages those artifacts
#                                       instead of compiling everything a second time
#   GPUHUB_RPM_PREBUILT_DIR=DIR         with PREBUILT=1: take the artifacts from DIR as they are
#                                       (no cargo build here; default: target/release, built)
#   GPUHUB_RPM_LINT=0                   skip rpmlint (not recommended)
#   GPUHUB_RPM_TARGET_CACHE=DIR         full build: rpmbuild compiles in DIR/KEY (KEY: Cargo.lock,
#                                       this script, rustc's version), which keeps the compiled
#                                       third-party crates for the next build on this machine;
#                                       gpuhub's own crates are compiled from the tarball every
#                                       time. Default /var/cache/gpuhub/rpm-target where it is
#                                       writable; "none": compile everything in the build tree
#   GPUHUB_SLURM_INCLUDE=DIR            build the plugin against the Slurm headers in DIR/slurm/
#                                       (spank.h, slurm_version.h) instead of the installed ones:
#                                       gpuhub-spank then Requires that Slurm's major.minor, and
#                                       the RPMs go to target/rpm-slurm-MM.mm/ (with PREBUILT=1 the
#                                       plugin is built into target/slurm-MM.mm/, the agent is
#                                       target/release's). E.g. the lab's Slurm 24.11 root:
#                                       GPUHUB_SLURM_INCLUDE=/var/lib/gpuhub-lab/slurm24-root/usr/include
#
# On Debian (the lab) the RHEL BuildRequires (rust-toolset, slurm-devel, clang-devel,
# systemd-rpm-macros) are not in the rpm database, so rpmbuild runs with --nodeps; the systemd
# macros come from rpm/macros.debian. The headers and tools are the Debian equivalents
# (libslurm-dev, libclang-dev, cargo from rustup). On RHEL 10: install the BuildRequires
# (`dnf builddep target/rpm/gpuhub-*.src.rpm`) and run `rpmbuild --rebuild` on the source RPM,
# or this script (it adds --nodeps only where the macros are missing).
#
# Outputs: target/rpm/*.rpm, target/rpm/gpuhub-VERSION.tar.gz, target/rpm/contents.txt
# (file lists with modes and owners, requires/provides), target/rpm/rpmlint.txt.
# Caches (target/rpm-cache/): the vendored crates, keyed by Cargo.lock's hash.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$REPO/target/rpm"
CACHE="$REPO/target/rpm-cache"
PREBUILT="${GPUHUB_RPM_PREBUILT:-0}"
LINT="${GPUHUB_RPM_LINT:-1}"
SPEC="$REPO/rpm/gpuhub.spec"
SLURM_INCLUDE="${GPUHUB_SLURM_INCLUDE:-}"

log() { echo "[rpm] $*"; }
die() { echo "[rpm] ERROR: $*" >&2; exit 1; }
# prereq_missing WHAT FIX: a failure under GPUHUB_TEST_STRICT=1 (tests/run-all.sh), else SKIP.
# shellcheck source=tests/lib/prereq.sh
source "$REPO/tests/lib/prereq.sh"
t_start=$(date +%s)

for tool in rpmbuild rpm cargo tar gzip python3 sha256sum; do
    command -v "$tool" >/dev/null || die "$tool not found; run tests/setup/deps.sh (Debian: apt-get install rpm rpmlint)"
done
[ -f "$REPO/Cargo.lock" ] || die "Cargo.lock missing at $REPO; run cargo build once"
[ -f "$REPO/LICENSE" ] || die "LICENSE missing at the repository root; the spec ships it as %license"

# ------------------------------------------------------------------ version: spec == Cargo.toml
cargo_version="$(awk '/^\[workspace.package\]/{s=1;next} /^\[/{s=0} s && $1=="version"{gsub(/"/,"",$3); print $3; exit}' "$REPO/Cargo.toml")"
spec_version="$(awk '$1=="Version:"{print $2; exit}' "$SPEC")"
[ -n "$cargo_version" ] || die "cannot read [workspace.package] version from Cargo.toml"
[ "$cargo_version" = "$spec_version" ] ||
    die "rpm/gpuhub.spec has Version: $spec_version but Cargo.toml says $cargo_version; make them equal"
VERSION="$cargo_version"
NV="gpuhub-$VERSION"

# ------------------------------------------------------------------ Slurm headers: which major.minor
# slurm_mm "DIR": the major.minor (YY.MM) of the slurm_version.h under DIR/slurm/.
slurm_mm() {
    local n
    n="$(sed -n 's/^#define[[:space:]]\+SLURM_VERSION_NUMBER[[:space:]]\+\(0x[0-9a-fA-F]\+\).*/\1/p' "$1/slurm/slurm_version.h" 2>/dev/null | head -n1)"
    [ -n "$n" ] || return 1
    printf '%02d.%02d\n' $(( (n >> 16) & 0xff )) $(( (n >> 8) & 0xff ))
}
if [ -n "$SLURM_INCLUDE" ]; then
    SLURM_INCLUDE="$(cd "$SLURM_INCLUDE" 2>/dev/null && pwd)" || die "GPUHUB_SLURM_INCLUDE=${GPUHUB_SLURM_INCLUDE} is not a directory"
    [ -f "$SLURM_INCLUDE/slurm/spank.h" ] ||
        die "GPUHUB_SLURM_INCLUDE=$SLURM_INCLUDE holds no slurm/spank.h; point it at the include directory that contains slurm/"
    SLURM_MM="$(slurm_mm "$SLURM_INCLUDE")" ||
        die "no SLURM_VERSION_NUMBER in $SLURM_INCLUDE/slurm/slurm_version.h"
    OUT="$REPO/target/rpm-slurm-$SLURM_MM"
    log "building the plugin for Slurm $SLURM_MM (headers in $SLURM_INCLUDE); RPMs in $OUT"
fi

# ------------------------------------------------------------------ crates: every platform's
# licenses.sh (cargo tree), cargo vendor and cargo metadata below run --offline. cargo fetch
# without --target downloads every platform's crates, which a Linux `cargo build` leaves out
# (the Windows-only ones); it is a no-op, without network, when $CARGO_HOME/registry has them.
(cd "$REPO" && cargo fetch --locked --quiet) ||
    die "cargo fetch --locked failed: the crates of Cargo.lock are not all in ${CARGO_HOME:-~/.cargo}/registry and crates.io is unreachable; run rpm/build.sh once with network"

# ------------------------------------------------------------------ License: tags == what is linked
for crate in gpuhub-spank gpuhub-agent; do
    want="$("$REPO/rpm/licenses.sh" "$crate")" || die "rpm/licenses.sh $crate failed"
    sub="${crate#gpuhub-}"
    have="$(awk -v pkg="$sub" '$1=="%package" && $2==pkg {s=1; next} /^%package|^%description/ {s=0} s && $1=="License:" {sub(/^License:[ \t]*/, ""); print; exit}' "$SPEC")"
    [ "$want" = "$have" ] || die "License: of gpuhub-$sub in rpm/gpuhub.spec does not match the crates it links.
  spec:   $have
  linked: $want
  (rpm/licenses.sh $crate --list shows which crate brings which license; update the spec)"
done

# ------------------------------------------------------------------ vendored crates (cached)
# cargo vendor copies from $CARGO_HOME/registry; --locked keeps Cargo.lock as is. Windows-only
# crates are stubbed (their import libraries are ~170 MB and never compiled on Linux): files
# removed, an empty src/lib.rs, their entries dropped from .cargo-checksum.json (cargo checks
# only the files listed there; the package checksum from Cargo.lock is kept), licenses kept.
lock_key="$(cat "$REPO/Cargo.lock" "$REPO/rpm/build.sh" | sha256sum | cut -c1-16)"
VENDOR_PARENT="$CACHE/vendor-$lock_key"
if [ ! -d "$VENDOR_PARENT/vendor" ]; then
    log "vendoring crates for Cargo.lock $lock_key"
    mkdir -p "$CACHE"
    find "$CACHE" -maxdepth 1 -name 'vendor-*' -exec rm -rf {} +
    tmp="$CACHE/tmp-vendor.$$"
    rm -rf "$tmp"; mkdir -p "$tmp"
    (cd "$REPO" && cargo vendor --locked --offline --versioned-dirs --quiet "$tmp/vendor" >/dev/null) ||
        die "cargo vendor --offline failed after cargo fetch (see above)"
    python3 - "$tmp/vendor" <<'PY'
import json, os, re, shutil, sys
root = sys.argv[1]
keep = re.compile(r"^(Cargo\.toml|\.cargo-checksum\.json|LICEN[CS]E.*|COPYING.*|NOTICE.*)$", re.I)
for crate in sorted(os.listdir(root)):
    if not re.match(r"^(windows|winapi)", crate):
        continue
    d = os.path.join(root, crate)
    for entry in os.listdir(d):
        if keep.match(entry):
            continue
        p = os.path.join(d, entry)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    os.makedirs(os.path.join(d, "src"), exist_ok=True)
    open(os.path.join(d, "src", "lib.rs"), "w").close()
    ck = os.path.join(d, ".cargo-checksum.json")
    with open(ck) as f:
        data = json.load(f)
    data["files"] = {k: v for k, v in data["files"].items() if keep.match(k)}
    with open(ck, "w") as f:
        json.dump(data, f)
PY
    mv "$tmp" "$VENDOR_PARENT"
else
    log "reusing vendored crates ($VENDOR_PARENT)"
fi

# ------------------------------------------------------------------ Rust minimum: spec >= Cargo.lock
# Read from the vendored crates, i.e. what rpmbuild compiles, offline: it depends neither on
# what $CARGO_HOME/registry holds nor on the network (cargo metadata resolves every platform).
spec_rust="$(awk '$1=="BuildRequires:" && $2=="rust" && $3==">=" {print $4; exit}' "$SPEC")"
need_rust="$(cd "$REPO" && cargo metadata --format-version 1 --locked --offline \
    --config 'source.crates-io.replace-with="vendored-sources"' \
    --config "source.vendored-sources.directory=\"$VENDOR_PARENT/vendor\"" 2>"$CACHE/metadata.err" | python3 -c '
import json, sys
d = json.load(sys.stdin)
v = [tuple(int(x) for x in p["rust_version"].split(".")[:2]) for p in d["packages"] if p.get("rust_version")]
print("%d.%d" % max(v) if v else "0.0")')" || die "cargo metadata on the vendored crates ($VENDOR_PARENT/vendor) failed: $(cat "$CACHE/metadata.err")"
if [ "$(printf '%s\n%s\n' "$need_rust" "$spec_rust" | sort -V | tail -n1)" != "$spec_rust" ]; then
    die "Cargo.lock needs Rust >= $need_rust but rpm/gpuhub.spec says BuildRequires: rust >= $spec_rust; raise it (and cargo's) to $need_rust"
fi

# ------------------------------------------------------------------ source tarball
# The tree as git sees it (tracked + untracked, minus .gitignore'd: target/, .venv/), plus
# vendor/ and a .cargo/config.toml that points cargo at it.
mkdir -p "$OUT" "$CACHE/extra/.cargo"
cat > "$CACHE/extra/.cargo/config.toml" <<'EOF'
# Generated by rpm/build.sh: build from the vendored crates only (no network).
[source.crates-io]
replace-with = "vendored-sources"

[source.vendored-sources]
directory = "vendor"

[net]
offline = true
EOF
filelist="$CACHE/files.txt"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) > "$filelist"
grep -qz '^\.cargo/' "$filelist" && die "the repository has its own .cargo/; merge it with the generated config in build.sh"
tarball="$OUT/$NV.tar.gz"
log "writing $tarball"
tar --create --file - --owner=0 --group=0 --numeric-owner --sort=name \
    --transform "s,^,$NV/," \
    -C "$REPO" --null --files-from "$filelist" \
    -C "$CACHE/extra" .cargo/config.toml \
    -C "$VENDOR_PARENT" vendor | gzip -1 > "$tarball.tmp"
mv "$tarball.tmp" "$tarball"

# ------------------------------------------------------------------ rpmbuild
TOPDIR="$CACHE/rpmbuild"
rm -rf "$TOPDIR"
mkdir -p "$TOPDIR"/{SOURCES,SPECS,BUILD,RPMS,SRPMS}
ln -f "$tarball" "$TOPDIR/SOURCES/" 2>/dev/null || cp "$tarball" "$TOPDIR/SOURCES/"
args=(--define "_topdir $TOPDIR" --define "_build_name_fmt %%{NAME}-%%{VERSION}-%%{RELEASE}.%%{ARCH}.rpm")
if [ -z "$(rpm --eval '%{?_unitdir}')" ]; then
    # Debian: no systemd-rpm-macros, and the RHEL BuildRequires are not in the rpm database.
    args+=(--load "$REPO/rpm/macros.debian" --nodeps)
fi
if [ -n "$SLURM_INCLUDE" ]; then
    args+=(--define "slurm_includedir $SLURM_INCLUDE")
fi
if [ "$PREBUILT" = 1 ]; then
    if [ -n "${GPUHUB_RPM_PREBUILT_DIR:-}" ]; then
        prebuilt_dir="$(cd "$GPUHUB_RPM_PREBUILT_DIR" && pwd)"
        log "GPUHUB_RPM_PREBUILT=1: packaging the artifacts in $prebuilt_dir as they are"
    else
        prebuilt_dir="$REPO/target/release"
        log "GPUHUB_RPM_PREBUILT=1: cargo build --release here, rpmbuild packages target/release"
        (cd "$REPO" && cargo build --release --locked --workspace)
        if [ -n "$SLURM_INCLUDE" ]; then
            # The plugin for the other Slurm, in its own target directory (the headers are an input
            # of spank/build.rs: sharing target/ would rebuild it back and forth); the agent and the
            # CLI do not depend on Slurm's headers.
            plugin_target="$REPO/target/slurm-$SLURM_MM"
            log "cargo build --release of the plugin against $SLURM_INCLUDE into $plugin_target"
            (cd "$REPO" && GPUHUB_SLURM_INCLUDE="$SLURM_INCLUDE" CARGO_TARGET_DIR="$plugin_target" \
                cargo build --release --locked -p gpuhub-spank -p gpuhub-spank-prolog)
            prebuilt_dir="$CACHE/prebuilt-slurm-$SLURM_MM"
            rm -rf "$prebuilt_dir"; mkdir -p "$prebuilt_dir"
            cp "$REPO/target/release/gpuhub-agent" "$REPO/target/release/gpuhub" "$prebuilt_dir/"
            cp "$plugin_target/release/libgpuhub_spank.so" "$plugin_target/release/libgpuhub_spank_prolog.so" "$prebuilt_dir/"
        fi
    fi
    for f in gpuhub-agent gpuhub libgpuhub_spank.so libgpuhub_spank_prolog.so; do
        [ -f "$prebuilt_dir/$f" ] || die "GPUHUB_RPM_PREBUILT=1 but $prebuilt_dir/$f does not exist; run cargo build --release"
    done
    # The spec pins Requires to the headers' major.minor: the prebuilt plugins must be built for it.
    want_mm="$(slurm_mm "${SLURM_INCLUDE:-/usr/include}")" ||
        die "no SLURM_VERSION_NUMBER in ${SLURM_INCLUDE:-/usr/include}/slurm/slurm_version.h; install libslurm-dev/slurm-devel or set GPUHUB_SLURM_INCLUDE"
    for f in libgpuhub_spank.so libgpuhub_spank_prolog.so; do
        have_mm="$(python3 "$REPO/rpm/plugin-slurm-version.py" "$prebuilt_dir/$f")" || die "cannot read plugin_version of $prebuilt_dir/$f"
        [ "$have_mm" = "$want_mm" ] ||
            die "$prebuilt_dir/$f was built for Slurm $have_mm, but the headers (${SLURM_INCLUDE:-/usr/include}) are $want_mm and the package would require $want_mm; rebuild it against those headers (GPUHUB_SLURM_INCLUDE, see docs/spank.md)"
    done
    args+=(--define "gpuhub_prebuilt_dir $prebuilt_dir")
fi
if [ "$PREBUILT" != 1 ]; then
    target_cache="${GPUHUB_RPM_TARGET_CACHE:-/var/cache/gpuhub/rpm-target}"
    if [ "$target_cache" != none ] && mkdir -p "$target_cache" 2>/dev/null && [ -w "$target_cache" ]; then
        rustc_key="$(rustc -V | sha256sum | cut -c1-8)"
        cargo_target="$target_cache/$lock_key-$rustc_key"
        # One key at a time: a new Cargo.lock or toolchain starts over (the old one is ~2 GB).
        find "$target_cache" -mindepth 1 -maxdepth 1 ! -name "$lock_key-$rustc_key" -exec rm -rf {} +
        log "compiling in $cargo_target ($( [ -d "$cargo_target/release" ] && echo "third-party crates from an earlier build" || echo "first build of this Cargo.lock here"))"
        args+=(--define "gpuhub_cargo_target_dir $cargo_target")
    else
        log "no target cache (GPUHUB_RPM_TARGET_CACHE=$target_cache is 'none' or not writable): rpmbuild compiles every crate"
    fi
fi
# Offline for real: where we may create a network namespace (root, or user namespaces), rpmbuild
# runs in one without any network, so a build that tried to download would fail here.
netns=()
if unshare -n true 2>/dev/null; then
    netns=(unshare -n)
    log "rpmbuild -ba without network (unshare -n) (log: $OUT/rpmbuild.log)"
else
    prereq_missing "no network namespace for rpmbuild (unshare -n: $(unshare -n true 2>&1 | head -n1)), so the build is not proven offline" \
        "run rpm/build.sh as root (unshare is in util-linux); in a container, allow it to create namespaces (CAP_SYS_ADMIN)" ||
        log "rpmbuild -ba WITH network; offline by --offline --frozen only (log: $OUT/rpmbuild.log)"
fi
t_rpm=$(date +%s)
if ! "${netns[@]}" rpmbuild "${args[@]}" -ba "$SPEC" > "$OUT/rpmbuild.log" 2>&1; then
    tail -n 40 "$OUT/rpmbuild.log" >&2
    die "rpmbuild failed; full log: $OUT/rpmbuild.log"
fi
log "rpmbuild took $(( $(date +%s) - t_rpm )) s"
echo "$(( $(date +%s) - t_rpm ))" > "$OUT/rpmbuild-seconds"
rm -f "$OUT"/*.rpm
find "$TOPDIR/RPMS" "$TOPDIR/SRPMS" -name '*.rpm' -exec cp {} "$OUT/" \;
rm -rf "$TOPDIR/BUILD" "$TOPDIR/BUILDROOT"

# ------------------------------------------------------------------ contents
{
    for p in "$OUT"/*.rpm; do
        echo "=== $(basename "$p")"
        rpm -qp --qf 'License: %{LICENSE}\n' "$p"
        echo "--- files"
        rpm -qlvp "$p"
        echo "--- config files"
        rpm -qcp "$p"
        echo "--- requires"
        rpm -qp --requires "$p"
        echo "--- provides"
        rpm -qp --provides "$p"
    done
} > "$OUT/contents.txt"
for p in "$OUT"/*.rpm; do
    case "$p" in *.src.rpm|*-debuginfo-*|*-debugsource-*) continue ;; esac
    echo "=== $(basename "$p")"
    rpm -qlp "$p" | grep -v '^/usr/share/licenses/.*/vendor-licenses/.' | sed 's/^/  /'
done

# ------------------------------------------------------------------ rpmlint
if [ "$LINT" = 1 ]; then
    command -v rpmlint >/dev/null || die "rpmlint not found; apt-get install rpmlint (or GPUHUB_RPM_LINT=0)"
    # The -debuginfo/-debugsource packages are generated by find-debuginfo, not by the spec;
    # Fedora's rpmlint profile filters what rpmlint says about them (.debug files look like
    # unstripped libraries without dependencies), so they are not linted here.
    lint_pkgs=()
    for p in "$OUT"/*.rpm; do
        case "$p" in *-debuginfo-*|*-debugsource-*) ;; *) lint_pkgs+=("$p") ;; esac
    done
    lint_rc=0
    rpmlint --config "$REPO/rpm/rpmlint.toml" --rpmlintrc "$REPO/rpm/rpmlintrc" \
        "${lint_pkgs[@]}" "$SPEC" > "$OUT/rpmlint.txt" 2>&1 || lint_rc=$?
    tail -n 1 "$OUT/rpmlint.txt"
    if [ "$lint_rc" -ne 0 ] || grep -q ': E: ' "$OUT/rpmlint.txt"; then
        grep -E ': (E|W): ' "$OUT/rpmlint.txt" >&2 || true
        die "rpmlint reported errors (rc $lint_rc); full output: $OUT/rpmlint.txt"
    fi
    if grep -q ': W: ' "$OUT/rpmlint.txt"; then
        grep ': W: ' "$OUT/rpmlint.txt" >&2
        die "rpmlint reported warnings that rpm/rpmlintrc does not explain; fix them or add a filter with a reason"
    fi
fi

# ------------------------------------------------------------------ systemd-analyze verify
if command -v systemd-analyze >/dev/null; then
    # --root: an extracted package root (plus this machine's standard units, which verify needs
    # for the implicit dependencies), so the ExecStart binaries are the packaged ones.
    vroot="$CACHE/verify-root"
    rm -rf "$vroot"; mkdir -p "$vroot/usr/lib/systemd/system"
    cp -a /usr/lib/systemd/system/. "$vroot/usr/lib/systemd/system/" 2>/dev/null || true
    for p in "$OUT"/gpuhub-agent-*.rpm; do (cd "$vroot" && rpm2cpio "$p" | cpio -idm --quiet); done
    # ExecReload's /usr/bin/kill comes from the base system (util-linux on RHEL), not from us.
    mkdir -p "$vroot/usr/bin" && cp /usr/bin/kill "$vroot/usr/bin/kill"
    units=(/usr/lib/systemd/system/gpuhub-agent.service /usr/lib/systemd/system/gpuhub-backup.service /usr/lib/systemd/system/gpuhub-backup.timer)
    verify_out="$(systemd-analyze verify --man=no --root="$vroot" "${units[@]}" 2>&1)" ||
        die "systemd-analyze verify failed: $verify_out"
    [ -z "$verify_out" ] || die "systemd-analyze verify complained: $verify_out"
    log "systemd-analyze verify: units clean"
    rm -rf "$vroot"
else
    prereq_missing "systemd-analyze not installed: the packaged units are not verified" \
        "apt-get install systemd (tests/setup/deps.sh installs it; RHEL: dnf install systemd)" || true
fi

log "done in $(( $(date +%s) - t_start )) s: $(cd "$OUT" && ls *.rpm | tr '\n' ' ')"
