//! Generates the SPANK bindings from the installed `<slurm/spank.h>` (via `include/wrapper.h`).
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
    // Re-run when the installed headers change (a Slurm upgrade must rebuild the plugin).
    println!("cargo:rerun-if-changed=/usr/include/slurm/spank.h");
    println!("cargo:rerun-if-changed=/usr/include/slurm/slurm_version.h");

    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
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
                "gpuhub-spank: bindgen failed on include/wrapper.h: {e}. \
                 Install the Slurm headers (Debian: libslurm-dev, RHEL: slurm-devel) and libclang \
                 (Debian: libclang-dev, RHEL: clang-devel)."
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
