//! Builds usage records from what a hook can see. Pure functions over a variable lookup, so
//! the per-context modules stay thin and these are unit-tested without Slurm.
//!
//! Where the values come from (measured on 22.05, `shared/slurm-lab/README.md`):
//! - JOB_SCRIPT (prolog/epilog, root): `getenv` has `SLURM_JOB_ID`, `SLURM_JOB_UID`,
//!   `SLURM_JOB_USER`, `SLURM_JOB_PARTITION`, `SLURM_JOB_ACCOUNT` (with accounting),
//!   `SLURM_JOB_GPUS` (also for shard jobs: the GPU index), `SLURMD_NODENAME`, and in the
//!   epilog `SLURM_JOB_EXIT_CODE`. No shard count.
//! - REMOTE (slurmstepd, root in `init_post_opt`/`exit`): `spank_getenv` has the step's
//!   environment: `SLURM_STEP_GPUS` (srun steps), `SLURM_JOB_GPUS` (batch step and steps inside
//!   it), `SLURM_SHARDS_ON_NODE` (shard jobs). The batch step lacks `SLURM_JOB_USER` until
//!   `task_init`, so the user name falls back to the password database.
//!
//! GPU indices are node-global (`SLURM_*_GPUS`), never the renumbered `CUDA_VISIBLE_DEVICES`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use gpuhub_wire::spool::{GpuRef, JobIdentity, RECORD_VERSION, Record, parse_index_list};

/// Wall-clock time in Unix microseconds.
pub fn now_us() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

fn non_empty(v: Option<String>) -> Option<String> {
    v.map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Looks up the user name of `uid` in the password database (NSS), for hooks where Slurm has
/// not exported `SLURM_JOB_USER` yet. Returns `None` when the uid has no entry.
pub fn user_name_of(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: `passwd` is plain old data; zeroed is a valid initial value.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: all pointers are valid for the call; `buf` outlives the use of `pwd`'s fields.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() || pwd.pw_name.is_null() {
        return None;
    }
    // SAFETY: getpwuid_r succeeded, so pw_name points at a NUL-terminated string inside `buf`.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

/// This machine's host name, the last fallback for the node name.
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len() - 1) };
    if rc != 0 {
        return String::new();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    let full = String::from_utf8_lossy(&buf[..end]).into_owned();
    full.split('.').next().unwrap_or_default().to_string()
}

/// What identifies a job, read through `get` (an environment lookup), with the ids Slurm
/// handed over through `spank_get_item` as fallbacks.
pub fn identity(get: &dyn Fn(&str) -> Option<String>, job_id_item: Option<u32>, uid_item: Option<u32>) -> Result<JobIdentity, String> {
    let job_id = non_empty(get("SLURM_JOB_ID"))
        .and_then(|s| s.parse::<u32>().ok())
        .or(job_id_item)
        .ok_or("no job id (SLURM_JOB_ID unset and S_JOB_ID unavailable)")?;
    let uid = uid_item
        .or_else(|| non_empty(get("SLURM_JOB_UID")).and_then(|s| s.parse::<u32>().ok()))
        .ok_or("no job uid (SLURM_JOB_UID unset and S_JOB_UID unavailable)")?;
    let user = non_empty(get("SLURM_JOB_USER")).or_else(|| user_name_of(uid)).unwrap_or_default();
    let node = non_empty(get("SLURMD_NODENAME")).unwrap_or_else(host_name);
    Ok(JobIdentity {
        job_id,
        uid,
        user,
        account: non_empty(get("SLURM_JOB_ACCOUNT")),
        partition: non_empty(get("SLURM_JOB_PARTITION")),
        node,
    })
}

/// GPU references for an index list, with UUIDs from the agent's snapshot where known.
pub fn gpu_refs(list: Option<String>, uuids: &BTreeMap<u32, String>) -> Vec<GpuRef> {
    parse_index_list(list.as_deref().unwrap_or("")).into_iter().map(|index| GpuRef { index, uuid: uuids.get(&index).cloned() }).collect()
}

/// The GPUs a step holds: `SLURM_STEP_GPUS` for srun steps, else the job's `SLURM_JOB_GPUS`
/// (the batch step and steps without their own GPU list).
pub fn step_gpu_list(get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    non_empty(get("SLURM_STEP_GPUS")).or_else(|| non_empty(get("SLURM_JOB_GPUS")))
}

/// `SLURM_SHARDS_ON_NODE`, when the job holds shards.
pub fn shards(get: &dyn Fn(&str) -> Option<String>) -> Option<u32> {
    non_empty(get("SLURM_SHARDS_ON_NODE")).and_then(|s| s.parse().ok()).filter(|&n| n > 0)
}

/// `job_prolog`: the allocation starts on this node.
pub fn job_start(job: JobIdentity, get: &dyn Fn(&str) -> Option<String>, uuids: &BTreeMap<u32, String>, time_us: i64) -> Record {
    Record::JobStart { v: RECORD_VERSION, time_us, job, gpus: gpu_refs(get("SLURM_JOB_GPUS"), uuids) }
}

/// `job_epilog`: the allocation ends on this node (normal end, `scancel`, time limit, ...).
pub fn job_end(job: JobIdentity, get: &dyn Fn(&str) -> Option<String>, uuids: &BTreeMap<u32, String>, time_us: i64) -> Record {
    let exit_code = non_empty(get("SLURM_JOB_EXIT_CODE")).and_then(|s| s.parse().ok());
    Record::JobEnd { v: RECORD_VERSION, time_us, job, exit_code, gpus: gpu_refs(get("SLURM_JOB_GPUS"), uuids) }
}

/// REMOTE `init_post_opt`: a step starts; the only place the shard count is visible.
pub fn step_start(
    job: JobIdentity,
    step_id: u32,
    get: &dyn Fn(&str) -> Option<String>,
    uuids: &BTreeMap<u32, String>,
    time_us: i64,
) -> Record {
    Record::StepStart { v: RECORD_VERSION, time_us, job, step_id, gpus: gpu_refs(step_gpu_list(get), uuids), shards: shards(get) }
}

/// REMOTE `exit`: a step ends.
pub fn step_end(job: JobIdentity, step_id: u32, exit_status: Option<i32>, time_us: i64) -> Record {
    Record::StepEnd { v: RECORD_VERSION, time_us, job, step_id, exit_status }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let m: BTreeMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| m.get(k).cloned()
    }

    #[test]
    fn prolog_identity_and_gpus_with_uuids() {
        let get = env(&[
            ("SLURM_JOB_ID", "42"),
            ("SLURM_JOB_UID", "1000"),
            ("SLURM_JOB_USER", "alice"),
            ("SLURM_JOB_PARTITION", "gpu"),
            ("SLURM_JOB_GPUS", "0,1"),
            ("SLURMD_NODENAME", "gpu01"),
        ]);
        let job = identity(&get, None, None).unwrap();
        assert_eq!(
            job,
            JobIdentity { job_id: 42, uid: 1000, user: "alice".into(), account: None, partition: Some("gpu".into()), node: "gpu01".into() }
        );
        let uuids = BTreeMap::from([(1, "GPU-b".to_string())]);
        let rec = job_start(job, &get, &uuids, 7);
        let Record::JobStart { gpus, time_us, .. } = rec else { unreachable!() };
        assert_eq!(time_us, 7);
        assert_eq!(gpus, vec![GpuRef { index: 0, uuid: None }, GpuRef { index: 1, uuid: Some("GPU-b".into()) }]);
    }

    #[test]
    fn epilog_keeps_the_exit_code() {
        let get = env(&[("SLURM_JOB_ID", "5"), ("SLURM_JOB_UID", "0"), ("SLURM_JOB_EXIT_CODE", "15")]);
        let job = identity(&get, None, None).unwrap();
        let Record::JobEnd { exit_code, gpus, .. } = job_end(job, &get, &BTreeMap::new(), 1) else { unreachable!() };
        assert_eq!(exit_code, Some(15));
        assert!(gpus.is_empty());
    }

    #[test]
    fn shard_step_reports_its_gpu_and_shards() {
        let get = env(&[("SLURM_STEP_GPUS", "1"), ("SLURM_SHARDS_ON_NODE", "7"), ("SLURM_JOB_USER", "bob")]);
        let job = identity(&get, Some(9), Some(1001)).unwrap();
        assert_eq!(job.job_id, 9);
        let Record::StepStart { gpus, shards, step_id, .. } = step_start(job, 0, &get, &BTreeMap::new(), 1) else { unreachable!() };
        assert_eq!((gpus, shards, step_id), (vec![GpuRef { index: 1, uuid: None }], Some(7), 0));
    }

    #[test]
    fn batch_step_falls_back_to_job_gpus_and_passwd() {
        let get = env(&[("SLURM_JOB_GPUS", "0")]);
        let job = identity(&get, Some(3), Some(0)).unwrap();
        assert_eq!(job.user, "root", "uid 0 resolves through the password database");
        assert!(!job.node.is_empty());
        assert_eq!(step_gpu_list(&get).as_deref(), Some("0"));
    }

    #[test]
    fn missing_ids_are_errors() {
        let get = env(&[]);
        assert!(identity(&get, None, Some(0)).unwrap_err().contains("job id"));
        assert!(identity(&get, Some(1), None).unwrap_err().contains("uid"));
    }
}
