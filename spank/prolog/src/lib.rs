//! The gpuhub SPANK plugin **with job hooks** (`libgpuhub_spank_prolog.so`, installed as
//! `spank_gpuhub_prolog.so`): everything the shipped plugin (`gpuhub-spank`) exports, which this
//! cdylib re-exports from its rlib, plus `slurm_spank_job_prolog` and `slurm_spank_job_epilog`.
//!
//! Why a separate build: slurmd decides at start, from the symbols of the plugins it loads,
//! whether it runs `slurmstepd spank prolog` (and epilog) for every job. That process costs
//! every `srun` ~12 ms on the lab, and `PrologFlags=Alloc` (to see allocations that never start
//! a step) ~90 ms more (BENCHMARKS.md). The shipped plugin therefore has no job hooks, and the
//! agent takes job boundaries and allocations from slurmctld (`accounting.job_boundaries =
//! "slurm"`). This build is for sites that want node-local job records anyway: they keep JobStart
//! and JobEnd in the spool when the agent is down for longer than slurmctld remembers finished
//! jobs (MinJobAge) on a cluster without slurmdbd, and keep the dcgm-exporter job map exact from
//! the first millisecond of a job. Set `accounting.job_boundaries = "prolog"` in the agent with it.
//!
//! JOB_SCRIPT context: root, forked by slurmd once per job per node (`gpuhub_spank::job_script`).

use std::os::raw::{c_char, c_int};

use gpuhub_spank::dispatch::{config, guarded};
use gpuhub_spank::job_script;
use gpuhub_spank::spank::{self, Context, Spank};
use gpuhub_spank::sys;

/// JOB_SCRIPT: the allocation starts on this node (root).
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_job_prolog(sp: sys::spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("job_prolog", || {
        let ctx = spank::context();
        // SAFETY: the hook's own arguments from Slurm.
        match (ctx, unsafe { config(ctx, ac, av) }) {
            (Context::JobScript, Some(cfg)) => job_script::prolog(Spank(sp), &cfg),
            _ => Ok(()),
        }
    })
}

/// JOB_SCRIPT: the allocation ends on this node (root), also after scancel or a time limit.
///
/// # Safety
/// Only Slurm calls it, with its own `spank_t` and plugstack argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_job_epilog(sp: sys::spank_t, ac: c_int, av: *mut *mut c_char) -> c_int {
    guarded("job_epilog", || {
        let ctx = spank::context();
        // SAFETY: the hook's own arguments from Slurm.
        match (ctx, unsafe { config(ctx, ac, av) }) {
            (Context::JobScript, Some(cfg)) => job_script::epilog(Spank(sp), &cfg),
            _ => Ok(()),
        }
    })
}
