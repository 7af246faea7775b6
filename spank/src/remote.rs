//! REMOTE context: the slurmstepd of each step, as root (except `user_init`/`task_init`).
//!
//! - `init_post_opt` (root, after the option callbacks): writes the StepStart record (the only
//!   place a shard job's shard count is visible) and injects the environment with
//!   `spank_setenv`, minting the job token with the root-only key.
//! - `task_exit` (stepd, root, per task): remembers the task's exit status.
//! - `exit` (stepd, root): writes the StepEnd record.
//!
//! Which steps: srun steps, the interactive step, and the batch step (recorded with
//! `step_id = 0xfffffffb`, `SLURM_BATCH_SCRIPT`), because an sbatch shard job that never
//! runs srun shows its shard count only there. The batch step also carries the injected
//! environment into the script and everything it starts. The extern step (`PrologFlags=Contain`)
//! runs no user code and is skipped, as is the pending-step placeholder.
//!
//! Identity: the job id and uid from `spank_get_item`, the user from the password database,
//! the node from slurmstepd's own environment; never the step's environment, which the user
//! writes (`records` has the details). The step's environment is read only for what it claims
//! about GPUs and shards (recorded as hints), the MLflow run tags, and the user's opt-outs.
//!
//! No threads, no network, no waiting on the agent: a spool file and `spank_setenv` calls.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use gpuhub_wire::bounds::MAX_FIELD_BYTES;
use gpuhub_wire::spool::{JobIdentity, Record};
use gpuhub_wire::token::{self, JobClaims};

use crate::config::Config;
use crate::inject::{self, Note, StepFacts};
use crate::spank::{Spank, process_env};
use crate::{files, log, options, records, sys, write_record_logged};

/// The step recorded by `init_post_opt`, reused by `exit` (same slurmstepd process).
static STEP: Mutex<Option<(JobIdentity, u32)>> = Mutex::new(None);
static EXIT_STATUS: AtomicI32 = AtomicI32::new(0);
static HAVE_EXIT_STATUS: AtomicBool = AtomicBool::new(false);

fn recorded_step(step_id: u32) -> bool {
    step_id != sys::SLURM_EXTERN_CONT && step_id != sys::SLURM_PENDING_STEP
}

/// The identity of this step: ids from `spank_get_item`, the user from the password database,
/// the node from slurmstepd's own environment. The step's environment (the user's) is not read.
fn identity(sp: Spank, notes: &mut records::Notes) -> Result<JobIdentity, String> {
    records::step_identity(sp.item_u32(sys::S_JOB_ID), sp.item_u32(sys::S_JOB_UID), process_env("SLURMD_NODENAME"), notes)
}

fn log_notes(notes: &records::Notes, job_id: Option<u32>) {
    if let Some(line) = notes.line(job_id) {
        log::error(&line);
    }
}

fn opted_out(sp: Spank, cfg: &Config) -> bool {
    !cfg.inject || options::no_inject() || matches!(sp.getenv("GPUHUB_NO_INJECT").as_deref().map(str::trim), Some("1" | "yes" | "true"))
}

fn mint_token(cfg: &Config, job: &JobIdentity) -> Option<String> {
    let key = match files::read_job_key(&cfg.job_key) {
        Ok(k) => k,
        Err(e) => {
            log::error(&format!(
                "gpuhub: no gateway token for job {}: {e} (the job runs without GPUHUB_TOKEN; fix: start gpuhub-agent, which creates the key)",
                job.job_id
            ));
            return None;
        }
    };
    let now_s = records::now_us() / 1_000_000;
    let claims = JobClaims { uid: job.uid, user: job.user.clone(), job_id: job.job_id, expires: now_s + cfg.token_ttl_s };
    let t = token::mint(&key, &claims);
    if t.is_none() {
        if job.user.is_empty() {
            log::error(&format!(
                "gpuhub: no gateway token for job {}: uid {} has no usable name in the password database (fix: make NSS resolve it on this node)",
                job.job_id, job.uid
            ));
        } else {
            log::error(&format!(
                "gpuhub: no gateway token for job {}: user name \"{}\" cannot be carried in a token (letters, digits and . _ - @ only)",
                job.job_id,
                job.user.escape_debug()
            ));
        }
    }
    t
}

/// REMOTE `slurm_spank_init_post_opt`.
pub fn init_post_opt(sp: Spank, cfg: &Config) -> Result<(), String> {
    let step_id = sp.item_u32(sys::S_JOB_STEPID).ok_or("S_JOB_STEPID unavailable")?;
    if !recorded_step(step_id) {
        return Ok(());
    }
    let mut notes = records::Notes::default();
    let job = identity(sp, &mut notes)?;
    // The step's environment: only for what it claims about GPUs and shards (hints the agent
    // checks against Slurm), the MLflow run tags below and the user's opt-outs.
    let get = move |k: &str| sp.getenv(k);
    if let Ok(mut g) = STEP.lock() {
        *g = Some((job.clone(), step_id));
    }
    let snapshot = files::read_snapshot(&cfg.snapshot);
    let uuids = snapshot.as_ref().map(|s| s.gpus.clone()).unwrap_or_default();
    let rec = records::step_start(job.clone(), step_id, &get, &uuids, records::now_us(), &mut notes);
    write_record_logged(cfg, &rec);
    let (gpus, shards) = match &rec {
        Record::StepStart { gpus, shards, .. } => (gpus.iter().map(|g| g.index).collect::<Vec<u32>>(), *shards),
        _ => (Vec::new(), None),
    };
    // MLflow run tags only (never a record or a token): the partition and account as the
    // step's environment has them. The user controls their own run tags anyway
    // (`MLFLOW_RUN_CONTEXT` they set wins), so a claim costs nothing here; bounded all the same.
    let tagged = JobIdentity {
        account: records::var(&get, "SLURM_JOB_ACCOUNT", MAX_FIELD_BYTES, &mut notes),
        partition: records::var(&get, "SLURM_JOB_PARTITION", MAX_FIELD_BYTES, &mut notes),
        ..job.clone()
    };
    log_notes(&notes, Some(job.job_id));

    if opted_out(sp, cfg) {
        log::debug(&format!("gpuhub: job {} step {step_id}: environment injection off", job.job_id));
        return Ok(());
    }
    let experiment = options::experiment();
    let facts = StepFacts { job: &tagged, gpus: &gpus, shards, experiment_option: experiment.as_deref(), token: mint_token(cfg, &job) };
    let plan = inject::plan(cfg, snapshot.as_ref().map_err(String::as_str), &facts);
    for note in &plan.notes {
        match note {
            Note::Error(m) => log::error(m),
            Note::Debug(m) => log::debug(m),
        }
    }
    let failed: Vec<String> = plan.vars.iter().filter_map(|v| sp.setenv(&v.name, &v.value, v.overwrite).err()).collect();
    if !failed.is_empty() {
        return Err(failed.join("; "));
    }
    Ok(())
}

/// REMOTE `slurm_spank_task_exit`: keep the first non-zero task status (else the last).
pub fn task_exit(sp: Spank) {
    if let Some(status) = sp.task_exit_status()
        && (!HAVE_EXIT_STATUS.swap(true, Ordering::Relaxed) || EXIT_STATUS.load(Ordering::Relaxed) == 0)
    {
        EXIT_STATUS.store(status, Ordering::Relaxed);
    }
}

/// REMOTE `slurm_spank_exit`.
pub fn exit(sp: Spank, cfg: &Config) -> Result<(), String> {
    let stored = STEP.lock().ok().and_then(|g| g.clone());
    let (job, step_id) = match stored {
        Some(s) => s,
        None => {
            let step_id = sp.item_u32(sys::S_JOB_STEPID).ok_or("S_JOB_STEPID unavailable")?;
            if !recorded_step(step_id) {
                return Ok(());
            }
            let mut notes = records::Notes::default();
            let job = identity(sp, &mut notes)?;
            log_notes(&notes, Some(job.job_id));
            (job, step_id)
        }
    };
    let status = HAVE_EXIT_STATUS.load(Ordering::Relaxed).then(|| EXIT_STATUS.load(Ordering::Relaxed));
    let rec = records::step_end(job, step_id, status, records::now_us());
    write_record_logged(cfg, &rec);
    Ok(())
}
