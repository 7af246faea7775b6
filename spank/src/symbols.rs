//! The data symbols Slurm's plugin loader looks up (`src/common/plugin.c`).
//!
//! `plugin_name` and `plugin_type` must be NUL-terminated byte arrays (Slurm uses the symbol
//! address as a `char *`). `plugin_version` must carry the major.minor of the Slurm that loads
//! the plugin; it comes from the installed headers, so building against another release's
//! headers produces a plugin for that release. These are defined in Rust because a C object
//! built with `cc` has its symbols hidden by rustc's version script (STYLE.md §2).
//! `tests/system/spank-symbols.sh` checks `nm -D` lists exactly these plus the hooks.

#![allow(non_upper_case_globals)]

use crate::sys;

/// Name used in plugstack errors, option env variables (`_SLURM_SPANK_OPTION_gpuhub_*`) and logs.
#[unsafe(no_mangle)]
pub static plugin_name: [u8; 7] = *b"gpuhub\0";

/// Always `"spank"` for a SPANK plugin.
#[unsafe(no_mangle)]
pub static plugin_type: [u8; 6] = *b"spank\0";

/// Slurm compares `(plugin_version & 0xffff00)` with its own `SLURM_VERSION_NUMBER`.
#[unsafe(no_mangle)]
pub static plugin_version: u32 = sys::SLURM_VERSION_NUMBER;

/// The second argument of `SPANK_PLUGIN(name, ver)`: the plugin's own interface version.
/// Slurm does not check it; we keep it for parity with C plugins.
#[unsafe(no_mangle)]
pub static spank_plugin_version: u32 = 1;
