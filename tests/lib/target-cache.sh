# shellcheck shell=bash
# The machine's cache of compiled third-party crates for tests/run-all.sh (what CI caches of a
# Rust target directory: everything but the workspace's own crates). A fresh clone's first
# `cargo build --release` then compiles only gpuhub's crates; a machine compiles the crates of a
# Cargo.lock once, as it builds the llama.cpp wheel once (tests/setup/llama.sh).
#
#   GPUHUB_TARGET_CACHE=DIR   the cache (default /var/cache/gpuhub/cargo-target); "none": off
#
# DIR/KEY/release, KEY = HOME-LOCK: HOME hashes the CARGO_HOME path (cargo's fingerprints of a
# registry crate include where its source lies, so another CARGO_HOME recompiles everything),
# LOCK hashes Cargo.lock, the workspace Cargo.toml (profiles) and `rustc -vV`; one LOCK per HOME
# is kept. tests/fresh-clone.sh empties one fixed CARGO_HOME for each run, so its runs share a
# key too. Cargo's own fingerprints still decide what is fresh: a crate whose flags or
# features differ from the cached build is recompiled. The workspace's crates are never taken
# from the cache (their fingerprints go by mtime, and a clone's mtimes say nothing about content):
# `cargo clean -p` removes them from both the seed and what is saved.
# Needs: cargo, rustc, jq, sha256sum; the current directory at the workspace root.

target_cache_dir() { echo "${GPUHUB_TARGET_CACHE:-/var/cache/gpuhub/cargo-target}"; }
target_cache_home() { echo "${CARGO_HOME:-$HOME/.cargo}" | sha256sum | cut -c1-8; }
target_cache_key() { echo "$(target_cache_home)-$(cat Cargo.lock Cargo.toml <(rustc -vV) | sha256sum | cut -c1-16)"; }
# target_cache_clean_workspace TARGET_DIR: drop the workspace crates' artifacts from TARGET_DIR.
target_cache_clean_workspace() {
    local pkgs=() p
    while read -r p; do pkgs+=(-p "$p"); done < <(cargo metadata --no-deps --format-version 1 --locked --offline | jq -r '.packages[].name')
    [ "${#pkgs[@]}" -gt 0 ] || return 1
    CARGO_TARGET_DIR="$1" cargo clean --release --locked --offline --quiet "${pkgs[@]}"
    rm -rf "$1/release/incremental"   # incremental state exists only for the workspace's crates
}

# target_cache_seed: a clone without target/release starts from the cache, when it has this key.
target_cache_seed() {
    local dir key
    dir="$(target_cache_dir)"
    [ "$dir" != none ] || return 0
    [ ! -e target/release ] || return 0
    key="$(target_cache_key)"
    [ -d "$dir/$key/release" ] || { echo "[target-cache] no compiled crates for this Cargo.lock in $dir (key $key): compiling them all"; return 0; }
    mkdir -p target
    cp -a --reflink=auto "$dir/$key/release" target/release.seed && mv target/release.seed target/release ||
        { rm -rf target/release.seed target/release; echo "[target-cache] copying $dir/$key failed: compiling every crate"; return 0; }
    # The cache never holds them, but a cache written by an older gpuhub might: clean again.
    target_cache_clean_workspace target || { rm -rf target/release; echo "[target-cache] cargo clean -p failed on the seed: compiling every crate"; return 0; }
    echo "[target-cache] target/release seeded from $dir/$key (third-party crates only)"
}

# target_cache_save: after a build that passed, store its third-party crates under this key
# (once per key; the same CARGO_HOME's other keys are removed).
target_cache_save() {
    local dir key tmp
    dir="$(target_cache_dir)"
    [ "$dir" != none ] || return 0
    key="$(target_cache_key)"
    [ ! -d "$dir/$key/release" ] || return 0
    mkdir -p "$dir" 2>/dev/null && [ -w "$dir" ] || { echo "[target-cache] $dir is not writable: nothing cached"; return 0; }
    tmp="$dir/tmp.$$"
    rm -rf "$tmp"; mkdir -p "$tmp"
    # Hard links first (target/ holds ~10 GB, mostly the workspace's), cleaned, then copied for
    # real: cargo rewrites some files in place, which must not reach the cache through a link.
    if ! cp -al target/release "$tmp/linked" 2>/dev/null; then
        rm -rf "$tmp/linked"   # another file system: a plain copy
        cp -a target/release "$tmp/linked" || { rm -rf "$tmp"; echo "[target-cache] copying target/release to $dir failed: nothing cached"; return 0; }
    fi
    mkdir -p "$tmp/t" && mv "$tmp/linked" "$tmp/t/release"
    if target_cache_clean_workspace "$tmp/t" && cp -a --reflink=auto "$tmp/t/release" "$tmp/release"; then
        rm -rf "$tmp/t"
        find "$dir" -mindepth 1 -maxdepth 1 \( -name "$(target_cache_home)-*" -o -name 'tmp.*' \) ! -name "tmp.$$" -exec rm -rf {} +
        mv "$tmp" "$dir/$key"
        echo "[target-cache] saved the third-party crates to $dir/$key ($(du -sh "$dir/$key" | cut -f1))"
    else
        rm -rf "$tmp"
        echo "[target-cache] saving to $dir failed: nothing cached"
    fi
}
