//! Logging through Slurm's own logger, so lines land where Slurm's do: `slurmd.log` for the
//! prolog/epilog and slurmstepd, the user's terminal for srun/sbatch.
//!
//! The message is always passed as an argument to a constant `"%s"` format: user-controlled
//! text (experiment names, paths) must never become a printf format string. Interior NUL bytes
//! are replaced so that nothing is silently truncated.
//!
//! Outside Slurm (unit tests link the rlib without a host process) the functions would be
//! unresolved, so `cfg(test)` builds write to stderr instead.

use std::ffi::CString;

#[cfg(not(test))]
use crate::sys;

fn c_message(msg: &str) -> CString {
    CString::new(msg.replace('\0', "\\0")).unwrap_or_default()
}

/// An error the admin should see (`error:` in slurmd.log).
pub fn error(msg: &str) {
    let m = c_message(msg);
    #[cfg(not(test))]
    // SAFETY: constant format with exactly one `%s` argument, a valid NUL-terminated string.
    unsafe {
        sys::slurm_error(c"%s".as_ptr(), m.as_ptr())
    };
    #[cfg(test)]
    eprintln!("error: {}", m.to_string_lossy());
}

/// Routine information (shown at SlurmdDebug=info and above).
pub fn info(msg: &str) {
    let m = c_message(msg);
    #[cfg(not(test))]
    // SAFETY: as in `error`.
    unsafe {
        sys::slurm_info(c"%s".as_ptr(), m.as_ptr())
    };
    #[cfg(test)]
    eprintln!("info: {}", m.to_string_lossy());
}

/// Chatter: visible with `srun -v` or in slurmd.log at `SlurmdDebug=verbose`.
pub fn verbose(msg: &str) {
    let m = c_message(msg);
    #[cfg(not(test))]
    // SAFETY: as in `error`.
    unsafe {
        sys::slurm_verbose(c"%s".as_ptr(), m.as_ptr())
    };
    #[cfg(test)]
    eprintln!("verbose: {}", m.to_string_lossy());
}

/// Debug detail (`SlurmdDebug=debug`).
pub fn debug(msg: &str) {
    let m = c_message(msg);
    #[cfg(not(test))]
    // SAFETY: as in `error`.
    unsafe {
        sys::slurm_debug(c"%s".as_ptr(), m.as_ptr())
    };
    #[cfg(test)]
    eprintln!("debug: {}", m.to_string_lossy());
}
