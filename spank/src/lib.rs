//! gpuhub's Slurm SPANK plugin (`libgpuhub_spank.so`, installed as `spank_gpuhub.so`).
//!
//! Slurm loads it into srun, sbatch/salloc, slurmd, the job's prolog/epilog and the
//! slurmstepd of every step. It does three things, all bounded and local (no threads, no
//! network, no database, never waits on the agent):
//!
//! 1. **Usage records** into a spool that the agent ingests exactly once: StepStart / StepEnd
//!    from each step (where the shard count is visible). Job boundaries and allocations come
//!    from slurmctld, through the agent; the build with job hooks (`spank/prolog`,
//!    `gpuhub-spank-prolog`) adds JobStart / JobEnd from the prolog/epilog. See
//!    `gpuhub_wire::spool` for the format and `docs/spank.md` for the per-GPU / per-shard
//!    accounting derived from them.
//! 2. **dcgm-exporter job map** files (`<dir>/<gpu index>`, one job id per line), from the
//!    prolog/epilog of the job-hooks build (the agent keeps them otherwise).
//! 3. **Environment injection** into job steps, never overwriting what the user set:
//!    MLflow (`MLFLOW_TRACKING_URI`, `MLFLOW_EXPERIMENT_NAME`, `MLFLOW_RUN_CONTEXT`,
//!    `MLFLOW_TAGS`), the gateway (`GPUHUB_URL`, `OPENAI_BASE_URL`), one `<ROLE>_MODEL` per app
//!    role, and a per-job credential (`GPUHUB_TOKEN`, `OPENAI_API_KEY`).
//!
//! Contract with Slurm: every hook is guarded and returns success; the plugstack line ships as
//! `optional`; plugstack arguments are parsed strictly and a bad one disables the plugin for
//! that process with one log line (see [`config`]).
//!
//! Parts:
//! - [`dispatch`]: the exported hooks; the one switch on `spank_context()`.
//! - [`remote`], [`job_script`] (used by the job-hooks build only), [`options`]: per-context code.
//! - [`quota`]: the quota line srun/sbatch/salloc print (from the snapshot).
//! - [`config`]: plugstack arguments and defaults; [`inject`]: the environment plan;
//!   [`records`]: usage records from hook variables; [`spool`], [`dcgm`], [`files`]: disk I/O.
//! - [`spank`], [`sys`], [`log`], [`symbols`]: the FFI boundary.
//!
//! The FFI modules are compiled out of unit tests (their symbols exist only inside Slurm);
//! the Slurm-facing behaviour is tested by `tests/system/spank-*.sh` on a real Slurm.

pub mod config;
pub mod dcgm;
pub mod files;
pub mod inject;
pub mod log;
pub mod options;
pub mod quota;
pub mod records;
pub mod spool;
pub mod sys;

#[cfg(not(test))]
pub mod dispatch;
#[cfg(not(test))]
pub mod job_script;
#[cfg(not(test))]
pub mod remote;
#[cfg(not(test))]
pub mod spank;
#[cfg(not(test))]
pub mod symbols;

use gpuhub_wire::spool::Record;

/// Writes a record; on failure logs it whole (so the admin can re-spool it) and moves on.
/// Records are `fsync`ed as they are written only with `fsync=all`; by default they reach the
/// disk by writeback, and the epilog of the job-hooks build fsyncs all of a job's records at once
/// when the job ends (see [`spool`]).
pub fn write_record_logged(cfg: &config::Config, rec: &Record) {
    let sync = if cfg.fsync_all { spool::Sync::Durable } else { spool::Sync::Visible };
    match spool::write_record(&cfg.spool_dir, rec, sync) {
        Ok(path) => log::debug(&format!("gpuhub: {} record {}", rec.kind(), path.display())),
        Err(e) => log::error(&format!(
            "gpuhub: cannot write the {} record of job {} under {}: {e} (the job continues). \
             Fix the spool, then save this line's JSON as {}/{}/<any>.json to keep it: {}",
            rec.kind(),
            rec.job().job_id,
            cfg.spool_dir.display(),
            cfg.spool_dir.display(),
            gpuhub_wire::spool::RECORDS_DIR,
            rec.to_json()
        )),
    }
}
