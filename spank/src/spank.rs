//! Thin, typed wrappers over the SPANK C API. The only module (with `options.rs` and
//! `log.rs`) that calls into Slurm; everything unsafe about the host process lives here.
//!
//! Ownership: `spank_t` belongs to Slurm and is valid only during the hook that received it;
//! [`Spank`] borrows it for that call and is never stored. Strings we pass are copied by
//! Slurm; strings Slurm returns are copied into Rust before the hook returns.

use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_int};

use crate::sys;

/// The process the plugin was loaded into (`spank_context()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun, as the submitting user.
    Local,
    /// slurmstepd of a step (batch, srun, extern), root.
    Remote,
    /// sbatch / salloc, as the submitting user.
    Allocator,
    /// slurmd itself.
    Slurmd,
    /// `slurmstepd spank prolog|epilog`, root.
    JobScript,
    /// `S_CTX_ERROR` or a context added by a future Slurm.
    Other,
}

/// The current context. Safe to call from any hook.
pub fn context() -> Context {
    // SAFETY: no arguments; Slurm keeps the context in the host process.
    let c = unsafe { sys::spank_context() };
    match c {
        sys::S_CTX_LOCAL => Context::Local,
        sys::S_CTX_REMOTE => Context::Remote,
        sys::S_CTX_ALLOCATOR => Context::Allocator,
        sys::S_CTX_SLURMD => Context::Slurmd,
        sys::S_CTX_JOB_SCRIPT => Context::JobScript,
        _ => Context::Other,
    }
}

/// Copies the plugstack arguments `(ac, av)` into owned strings.
///
/// # Safety
/// `av` must point at `ac` valid NUL-terminated strings (or be null), as Slurm passes them.
pub unsafe fn args(ac: c_int, av: *mut *mut c_char) -> Vec<String> {
    let n = usize::try_from(ac).unwrap_or(0);
    if av.is_null() {
        return Vec::new();
    }
    (0..n)
        .filter_map(|i| {
            // SAFETY: `i < ac` and the caller guarantees `av[0..ac]` are valid pointers.
            let p = unsafe { *av.add(i) };
            // SAFETY: non-null entries are NUL-terminated strings owned by Slurm.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

/// A SPANK handle borrowed for the duration of one hook.
#[derive(Clone, Copy)]
pub struct Spank(pub sys::spank_t);

impl Spank {
    /// A `uint32_t` item (`S_JOB_ID`, `S_JOB_STEPID`, ...), or `None` where the context lacks it.
    pub fn item_u32(self, item: sys::spank_item_t) -> Option<u32> {
        let mut v: u32 = 0;
        // SAFETY: every item passed here takes a single `uint32_t *` out-argument (spank.h);
        // `uid_t` is `uint32_t` on Linux, so S_JOB_UID fits as well.
        let rc = unsafe { sys::spank_get_item(self.0, item, &mut v as *mut u32) };
        (rc == sys::ESPANK_SUCCESS).then_some(v)
    }

    /// `S_TASK_EXIT_STATUS` (raw wait status), only in `task_exit`.
    pub fn task_exit_status(self) -> Option<i32> {
        let mut v: c_int = 0;
        // SAFETY: S_TASK_EXIT_STATUS takes an `int *`.
        let rc = unsafe { sys::spank_get_item(self.0, sys::S_TASK_EXIT_STATUS, &mut v as *mut c_int) };
        (rc == sys::ESPANK_SUCCESS).then_some(v)
    }

    /// A variable of the job step's environment (REMOTE only), or `None` if unset.
    pub fn getenv(self, name: &str) -> Option<String> {
        let cname = CString::new(name).ok()?;
        let mut len = 4096usize;
        while len <= 1 << 20 {
            let mut buf = vec![0u8; len];
            let clen = c_int::try_from(len).ok()?;
            // SAFETY: `buf` is writable for `len` bytes; Slurm NUL-terminates within it on success.
            let rc = unsafe { sys::spank_getenv(self.0, cname.as_ptr(), buf.as_mut_ptr().cast(), clen) };
            if rc == sys::ESPANK_SUCCESS {
                let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
                return Some(String::from_utf8_lossy(&buf[..end]).into_owned());
            }
            if rc != sys::ESPANK_NOSPACE {
                return None;
            }
            len *= 4;
        }
        None
    }

    /// Sets a variable in the job step's environment (REMOTE only). With `overwrite = false`
    /// an existing value is kept and this still returns `Ok`.
    pub fn setenv(self, name: &str, value: &str, overwrite: bool) -> Result<(), String> {
        let (Ok(n), Ok(v)) = (CString::new(name), CString::new(value)) else {
            return Err(format!("{name}: value contains a NUL byte"));
        };
        // SAFETY: both strings are valid and NUL-terminated; Slurm copies them.
        let rc = unsafe { sys::spank_setenv(self.0, n.as_ptr(), v.as_ptr(), c_int::from(overwrite)) };
        if rc == sys::ESPANK_SUCCESS || rc == sys::ESPANK_ENV_EXISTS {
            Ok(())
        } else {
            Err(format!("spank_setenv({name}) failed: {}", strerror(rc)))
        }
    }
}

fn strerror(rc: sys::spank_err_t) -> String {
    // SAFETY: spank_strerror returns a static string for any code.
    let p = unsafe { sys::spank_strerror(rc) };
    if p.is_null() {
        return format!("error {rc}");
    }
    // SAFETY: non-null static NUL-terminated string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Plain `getenv` of this process (JOB_SCRIPT, LOCAL, ALLOCATOR; in REMOTE it is slurmstepd's
/// own environment, not the job's).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
}
