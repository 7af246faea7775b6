//! The exported SPANK hooks: guard, read the plugstack arguments, switch on the context.
//! This is the only place that decides which context runs what (STYLE.md §2):
//!
//! | hook | LOCAL (srun) | ALLOCATOR (sbatch/salloc) | REMOTE (slurmstepd) | JOB_SCRIPT (prolog/epilog) |
//! | --- | --- | --- | --- | --- |
//! | `init` | register options | register options | register options | – |
//! | `init_post_opt` | quota line | quota line | StepStart record, env injection | – |
//! | `task_exit` | – | – | remember exit status | – |
//! | `exit` | – | – | StepEnd record | – |
//! | `job_prolog` | – | – | – | JobStart record, dcgm map add (job-hooks build only) |
//! | `job_epilog` | – | – | – | JobEnd record, dcgm map remove (job-hooks build only) |
//!
//! Only these hooks are exported: each exported hook costs every step a call. They are
//! `unsafe extern "C"`: Slurm must pass its own `spank_t` and argument vector. The two job
//! hooks are not exported by this crate at all: a plugin that has them makes slurmd run a
//! `slurmstepd spank prolog` (and epilog) process for every job, +12 ms per `srun` on the lab
//! (BENCHMARKS.md). They live in `gpuhub-spank-prolog` (`spank/prolog/`), the build for sites
//! that want job records from the prolog; the shipped plugin leaves job boundaries to the
//! agent, which takes them from slurmctld (`docs/spank.md`). Every hook
//! returns 0 (`ESPANK_SUCCESS`) whatever happens inside: the job never pays for a gpuhub
//! fault, and with the plugstack line `optional` Slurm ignores plugin errors anyway.

use std::os::raw::{c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::config::Config;
use crate::spank::{self, Context, Spank};
use crate::{log, options, remote, sys};

/// Runs one hook body. A gpuhub fault is logged, never handed to Slurm. The hook's duration
/// goes to the debug log (`gpuhub: <hook> took N us`), which `bench/spank-srun.sh` reports.
pub fn guarded(hook: &str, body: impl FnOnce() -> Result<(), String>) -> c_int {
    let start = Instant::now();
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => log::error(&format!("gpuhub: {hook}: {e} (job continues)")),
        Err(_) => log::error(&format!("gpuhub: {hook}: internal panic (job continues)")),
    }
    log::debug(&format!("gpuhub: {hook} took {} us", start.elapsed().as_micros()));
    0 // ESPANK_SUCCESS: the job never pays for our bugs
}

static CONFIG_ERROR_LOGGED: AtomicBool = AtomicBool::new(false);

/// Parses the plugstack arguments; on error logs once per process and returns `None`, which
/// keeps the plugin out of the way. In srun/sbatch the line goes to `-v` output only: users
/// cannot fix plugstack.conf, the admin sees it in slurmd.log from the prolog and steps.
///
/// # Safety
/// `ac` and `av` must be the argument count and vector Slurm passed to the calling hook.
pub unsafe fn config(ctx: Context, ac: c_int, av: *mut *mut c_char) -> Option<Config> {
    // SAFETY: the caller passes Slurm's `ac` valid argument strings in `av`.
    let args = unsafe { spank::args(ac, av) };
    match Config::parse(&args) {
        Ok(c) => Some(c),
        Err(e) => {
            if !CONFIG_ERROR_LOGGED.swap(true, Ordering::Relaxed) {
                match ctx {
                    Context::Local | Context::Allocator => log::verbose(&e.to_string()),
                    _ => log::error(&e.to_string()),
                }
            }
            None
        }
    }
}

/// All contexts. Registers the options (even with bad plugstack arguments, so that a job
/// script using `--mlflow-experiment` never fails because of the admin's typo).
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_init(sp: sys::spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("init", || {
        let ctx = spank::context();
        if matches!(ctx, Context::Local | Context::Allocator | Context::Remote) {
            options::register(Spank(sp));
        }
        if ctx == Context::Remote {
            // SAFETY: the hook's own arguments from Slurm.
            let _ = unsafe { config(ctx, ac, av) }; // log a bad plugstack line early, once
        }
        Ok(())
    })
}

/// REMOTE: record the step start and inject the environment (root).
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_init_post_opt(sp: sys::spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("init_post_opt", || {
        let ctx = spank::context();
        // SAFETY: the hook's own arguments from Slurm.
        match (ctx, unsafe { config(ctx, ac, av) }) {
            (Context::Remote, Some(cfg)) => remote::init_post_opt(Spank(sp), &cfg),
            (Context::Local | Context::Allocator, Some(cfg)) => {
                crate::quota::notice(&cfg.snapshot);
                Ok(())
            }
            _ => Ok(()),
        }
    })
}

/// REMOTE, per task, in slurmstepd (root): remember the exit status for the StepEnd record.
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_exit(sp: sys::spank_t, _ac: c_int, _av: *mut *mut c_char) -> c_int {
    guarded("task_exit", || {
        if spank::context() == Context::Remote {
            remote::task_exit(Spank(sp));
        }
        Ok(())
    })
}

/// REMOTE: record the step end (root). Also called in srun/sbatch, where it does nothing.
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_exit(sp: sys::spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("exit", || {
        let ctx = spank::context();
        if ctx != Context::Remote {
            return Ok(());
        }
        // SAFETY: the hook's own arguments from Slurm.
        match unsafe { config(ctx, ac, av) } {
            Some(cfg) => remote::exit(Spank(sp), &cfg),
            None => Ok(()),
        }
    })
}
