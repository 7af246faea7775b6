//! The plugin's command-line options, in `srun --help` / `sbatch --help` under "Options
//! provided by plugins" with a `[gpuhub]` prefix:
//!
//! - `--mlflow-experiment=NAME`: `MLFLOW_EXPERIMENT_NAME` for this job's steps.
//! - `--gpuhub-no-inject`: inject no environment variables (usage is still recorded).
//!
//! Registered with `spank_option_register` from `slurm_spank_init` in LOCAL, ALLOCATOR and
//! REMOTE (a static `spank_options` table is not read in ALLOCATOR context). They work from
//! `#SBATCH` lines, and Slurm's env form (`SLURM_SPANK__SLURM_SPANK_OPTION_gpuhub_mlflow_experiment`)
//! carries an sbatch option into the `srun`s of the batch script. `GPUHUB_NO_INJECT=1` in the
//! job's environment is the env fallback of the opt-out.
//!
//! Slurm calls a callback once per source in srun/sbatch and twice in slurmstepd, so the
//! callbacks only store the value (idempotent). An invalid experiment name is the user's
//! input error: srun/sbatch reject it with Slurm's "Invalid --mlflow-experiment argument".

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

static EXPERIMENT: Mutex<Option<String>> = Mutex::new(None);
static NO_INJECT: AtomicBool = AtomicBool::new(false);

/// Checks an experiment name: 1-256 characters, no control characters.
pub fn valid_experiment(name: &str) -> bool {
    !name.trim().is_empty() && name.chars().count() <= 256 && !name.chars().any(char::is_control)
}

/// Stores `--mlflow-experiment` (idempotent). Returns false for an invalid name.
pub fn set_experiment(name: &str) -> bool {
    if !valid_experiment(name) {
        return false;
    }
    if let Ok(mut g) = EXPERIMENT.lock() {
        *g = Some(name.to_string());
    }
    true
}

/// The experiment chosen with `--mlflow-experiment`, if any.
pub fn experiment() -> Option<String> {
    EXPERIMENT.lock().ok().and_then(|g| g.clone())
}

/// Records `--gpuhub-no-inject` (idempotent).
pub fn set_no_inject() {
    NO_INJECT.store(true, Ordering::Relaxed);
}

/// Whether the job opted out with `--gpuhub-no-inject`.
pub fn no_inject() -> bool {
    NO_INJECT.load(Ordering::Relaxed)
}

#[cfg(not(test))]
pub use ffi::register;

#[cfg(not(test))]
mod ffi {
    use std::ffi::CStr;
    use std::os::raw::{c_char, c_int};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use crate::spank::Spank;
    use crate::{log, sys};

    const OPT_EXPERIMENT: c_int = 1;
    const OPT_NO_INJECT: c_int = 2;

    /// Option callback. Runs in srun/sbatch (remote = 0) and slurmstepd (remote = 1).
    /// Returns 0 to accept, -1 to reject the user's value.
    unsafe extern "C" fn on_option(val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
        let arg = if optarg.is_null() {
            None
        } else {
            // SAFETY: Slurm passes a NUL-terminated string that lives during the call.
            Some(unsafe { CStr::from_ptr(optarg) }.to_string_lossy().into_owned())
        };
        let r = catch_unwind(AssertUnwindSafe(|| match val {
            OPT_EXPERIMENT => {
                let name = arg.unwrap_or_default();
                if super::set_experiment(&name) {
                    0
                } else {
                    log::error(&format!("gpuhub: --mlflow-experiment \"{}\": expected 1 to 256 printable characters", name.escape_debug()));
                    -1
                }
            }
            OPT_NO_INJECT => {
                super::set_no_inject();
                0
            }
            _ => 0,
        }));
        r.unwrap_or(0)
    }

    static OPTIONS: [sys::spank_option; 2] = [
        sys::spank_option {
            name: c"mlflow-experiment".as_ptr(),
            arginfo: c"NAME".as_ptr(),
            usage: c"[gpuhub] MLflow experiment for this job's runs (sets MLFLOW_EXPERIMENT_NAME; default: the site's)".as_ptr(),
            has_arg: 1,
            val: OPT_EXPERIMENT,
            cb: Some(on_option),
        },
        sys::spank_option {
            name: c"gpuhub-no-inject".as_ptr(),
            arginfo: std::ptr::null(),
            usage: c"[gpuhub] do not inject MLflow, gateway, model or token variables into this job (usage is still recorded; env: GPUHUB_NO_INJECT=1)".as_ptr(),
            has_arg: 0,
            val: OPT_NO_INJECT,
            cb: Some(on_option),
        },
    ];

    /// Registers the options. Only valid from `slurm_spank_init`.
    pub fn register(sp: Spank) {
        for opt in &OPTIONS {
            // SAFETY: `opt` is a 'static table entry; Slurm keeps the pointer and only reads it.
            let rc = unsafe { sys::spank_option_register(sp.0, std::ptr::from_ref(opt).cast_mut()) };
            if rc != sys::ESPANK_SUCCESS {
                log::verbose(&format!("gpuhub: cannot register a command-line option (spank error {rc})"));
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;

    #[test]
    fn experiment_callback_is_idempotent_and_validates() {
        assert!(set_experiment("exp-a"));
        assert!(set_experiment("exp-a"));
        assert_eq!(experiment().as_deref(), Some("exp-a"));
        assert!(!set_experiment(""));
        assert!(!set_experiment("bad\nname"));
        assert!(!set_experiment(&"x".repeat(257)));
        assert_eq!(experiment().as_deref(), Some("exp-a"), "a rejected value leaves the last good one");
        set_no_inject();
        set_no_inject();
        assert!(no_inject());
    }
}
