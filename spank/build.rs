//! Generates the SPANK bindings from `<slurm/spank.h>` and `<slurm/slurm_version.h>` (via
//! `include/wrapper.h`): the installed ones, or those under `GPUHUB_SLURM_INCLUDE` (a directory
//! holding `slurm/spank.h`, e.g. another Slurm's install prefix `.../usr/include`), so one source
//! builds a plugin for any supported Slurm. The plugin's `plugin_version` comes from the headers
//! used, so the result loads only on that Slurm's major.minor. Build each Slurm's plugin into its
//! own target directory (`CARGO_TARGET_DIR`), see docs/spank.md.
//!
//! Narrow allowlists keep the bindings small and keep the hook prototypes out (we define the
//! hooks ourselves). `spank_option` is redefined in `src/sys.rs` with `const` pointers, so the
//! option table can live in read-only statics.

use std::env;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let header = manifest.join("../include/wrapper.h");
    println!("cargo:rerun-if-changed={}", header.display());
    println!("cargo:rerun-if-env-changed=GPUHUB_SLURM_INCLUDE");
    let include = match env::var_os("GPUHUB_SLURM_INCLUDE").filter(|v| !v.is_empty()) {
        Some(dir) => {
            let dir = PathBuf::from(dir);
            if !dir.join("slurm/spank.h").is_file() || !dir.join("slurm/slurm_version.h").is_file() {
                eprintln!(
                    "gpuhub-spank: GPUHUB_SLURM_INCLUDE={} holds no slurm/spank.h and slurm/slurm_version.h. \
                     Set it to the include directory of the Slurm to build for (the one that contains slurm/), \
                     or unset it to use the installed headers.",
                    dir.display()
                );
                std::process::exit(1);
            }
            Some(dir)
        }
        None => None,
    };
    // Re-run when the headers change (a Slurm upgrade must rebuild the plugin).
    let dir = include.clone().unwrap_or_else(|| PathBuf::from("/usr/include"));
    println!("cargo:rerun-if-changed={}", dir.join("slurm/spank.h").display());
    println!("cargo:rerun-if-changed={}", dir.join("slurm/slurm_version.h").display());

    let mut builder = bindgen::Builder::default().header(header.to_string_lossy());
    if let Some(dir) = &include {
        // Searched before the system directories, so <slurm/...> resolves there; libc's headers
        // stay the host's (spank.h needs only stdint/sys/types).
        builder = builder.clang_arg(format!("-I{}", dir.display()));
    }
    let bindings = builder
        .allowlist_function("spank_.*")
        .allowlist_function("slurm_(info|error|verbose|debug|debug2|debug3|spank_log)")
        .allowlist_type("spank_.*")
        .allowlist_var("SLURM_VERSION_NUMBER|ESPANK_SUCCESS|SPANK_OPTION_MAXLEN")
        .blocklist_item("spank_options")
        .blocklist_type("spank_option")
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate();
    let bindings = match bindings {
        Ok(b) => b,
        Err(e) => {
            // A build script reports failure by exiting non-zero with a message; no panic needed.
            eprintln!(
                "gpuhub-spank: bindgen failed on include/wrapper.h (Slurm headers from {}): {e}. \
                 Install the Slurm headers (Debian: libslurm-dev, RHEL: slurm-devel) and libclang \
                 (Debian: libclang-dev, RHEL: clang-devel).",
                dir.display()
            );
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(env::var("OUT_DIR").unwrap_or_else(|_| ".".into())).join("spank_bindings.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        eprintln!("gpuhub-spank: cannot write {}: {e}", out.display());
        std::process::exit(1);
    }
}
