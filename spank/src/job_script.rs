//! JOB_SCRIPT context: `slurmstepd spank prolog|epilog`, forked by slurmd once per job per
//! node, as root. Sees every allocation (also `salloc` without steps, with
//! `PrologFlags=Alloc`), and runs after `scancel` and time limits too, so JobStart/JobEnd
//! here are the authoritative job boundaries. Variables come from plain `getenv`: the
//! environment slurmd builds for this hook as root, not the user's (`records` cites where in
//! Slurm's source); the job id and uid come from `spank_get_item` all the same.
//!
//! A crash here drains the node and `spank_job_control_*` crashes in this context on 22.05:
//! this module calls neither; every error is returned to the guard, logged, and the hook
//! returns success.

use std::collections::BTreeMap;

use gpuhub_wire::spool::Record;

use crate::config::Config;
use crate::spank::{Spank, process_env};
use crate::{dcgm, files, log, records, spool, sys, write_record_logged};

fn uuids(cfg: &Config) -> BTreeMap<u32, String> {
    match files::read_snapshot(&cfg.snapshot) {
        Ok(s) => s.gpus,
        Err(e) => {
            log::debug(&format!("gpuhub: GPU UUIDs unknown ({e}); records carry GPU indices only"));
            BTreeMap::new()
        }
    }
}

fn update_map(cfg: &Config, rec: &Record, gpus: &[u32], add: bool) {
    let Some(dir) = &cfg.dcgm_job_map_dir else { return };
    let job_id = rec.job().job_id;
    if let Err(e) = dcgm::update(dir, gpus, job_id, add) {
        log::error(&format!(
            "gpuhub: dcgm job map {}: cannot {} job {job_id} on GPUs {gpus:?}: {e} (the job continues; \
             dcgm-exporter misattributes these GPUs until the next update)",
            dir.display(),
            if add { "add" } else { "remove" },
        ));
    }
}

fn gpu_indices(rec: &Record) -> Vec<u32> {
    match rec {
        Record::JobStart { gpus, .. } | Record::JobEnd { gpus, .. } | Record::StepStart { gpus, .. } => {
            gpus.iter().map(|g| g.index).collect()
        }
        Record::StepEnd { .. } => Vec::new(),
    }
}

fn log_notes(notes: &records::Notes, rec: &Record) {
    if let Some(line) = notes.line(Some(rec.job().job_id)) {
        log::error(&line);
    }
}

/// `slurm_spank_job_prolog`.
pub fn prolog(sp: Spank, cfg: &Config) -> Result<(), String> {
    let mut notes = records::Notes::default();
    let job = records::job_script_identity(&process_env, sp.item_u32(sys::S_JOB_ID), sp.item_u32(sys::S_JOB_UID), &mut notes)?;
    let rec = records::job_start(job, &process_env, &uuids(cfg), records::now_us(), &mut notes);
    log_notes(&notes, &rec);
    write_record_logged(cfg, &rec);
    update_map(cfg, &rec, &gpu_indices(&rec), true);
    Ok(())
}

/// `slurm_spank_job_epilog`.
pub fn epilog(sp: Spank, cfg: &Config) -> Result<(), String> {
    let mut notes = records::Notes::default();
    let job = records::job_script_identity(&process_env, sp.item_u32(sys::S_JOB_ID), sp.item_u32(sys::S_JOB_UID), &mut notes)?;
    let rec = records::job_end(job, &process_env, &uuids(cfg), records::now_us(), &mut notes);
    log_notes(&notes, &rec);
    write_record_logged(cfg, &rec);
    update_map(cfg, &rec, &gpu_indices(&rec), false);
    // The job's records were written without fsync (most of them while srun waits); make them
    // all durable now, JobEnd included, with one directory fsync.
    let job = rec.job();
    let synced = if cfg.fsync_all { Ok(0) } else { spool::sync_job_records(&cfg.spool_dir, &job.node, job.job_id) };
    match synced {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {} // no spool: the write error is logged
        Err(e) => log::error(&format!(
            "gpuhub: cannot fsync job {}'s records in {}: {e} (they stay in the page cache; a node crash now could lose them)",
            job.job_id,
            cfg.spool_dir.display()
        )),
    }
    Ok(())
}
