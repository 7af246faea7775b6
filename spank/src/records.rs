//! Builds usage records from what a hook can see. Pure functions over a variable lookup, so
//! the per-context modules stay thin and these are unit-tested without Slurm.
//!
//! What each context may trust (the threat is a local user who controls their job's
//! environment: anything they `export` before `srun`, `sbatch` or `salloc` reaches the step):
//! - Everywhere: the job id and uid come from `spank_get_item` (`S_JOB_ID`, `S_JOB_UID`), the
//!   user name from the password database for that uid ([`user_name_of`]). `SLURM_JOB_ID`,
//!   `SLURM_JOB_UID` and `SLURM_JOB_USER` are never read in a step.
//! - JOB_SCRIPT (prolog/epilog, root): plain `getenv` is the environment slurmd builds for the
//!   spank prolog/epilog, as root, from its own records and the job credential: Slurm 22.05
//!   `src/plugins/prep/script/prep_script_slurmd.c` `_build_env()` sets `SLURMD_NODENAME`,
//!   `SLURM_JOB_ID`, `SLURM_JOB_UID`, `SLURM_JOB_USER` (`uid_to_string`), `SLURM_JOB_PARTITION`
//!   and `SLURM_JOB_ACCOUNT` (from the credential), `SLURM_JOB_EXIT_CODE` (epilog), merges the
//!   GRES plugin's `SLURM_JOB_GPUS`, and passes it to `execve` of `slurmstepd spank
//!   prolog|epilog` (`_run_spank_job_script`). The only user-written part is the SPANK job
//!   environment, which `valid_spank_job_env()` (`src/common/slurm_protocol_defs.c`) prefixes
//!   with `SPANK_`; the user's submission environment is not in it. So these are trusted (and
//!   still bounded). Measured on 22.05 (`shared/slurm-lab/README.md`): `SLURM_JOB_GPUS` is also
//!   set for shard jobs (the GPU index); there is no shard count.
//! - REMOTE (slurmstepd, root in `init_post_opt`/`exit`): `spank_getenv` is the step's
//!   environment, which the user writes. Account and partition are not taken from it (recorded
//!   as unknown; the agent fills them from slurmctld). The node name comes from slurmstepd's
//!   *own* environment, which slurmstepd sets from the configuration slurmd hands it
//!   (`src/slurmd/slurmstepd/slurmstepd.c`: `setenvf(NULL, "SLURMD_NODENAME", ...)`).
//!   `SLURM_STEP_GPUS` (srun steps), `SLURM_JOB_GPUS` (batch step and steps inside it) and
//!   `SLURM_SHARDS_ON_NODE` (shard jobs) are the only place a step's shard count is visible,
//!   so they are still recorded, as claims (`gpuhub_wire::spool`): the agent checks them
//!   against Slurm's allocation.
//!
//! Every value is bounded (`gpuhub_wire::bounds`): one over its cap or holding a control
//! character is recorded as unknown and the refusal lands in [`Notes`], which the hook logs in
//! one line, describing the value without quoting it.
//!
//! GPU indices are node-global (`SLURM_*_GPUS`), never the renumbered `CUDA_VISIBLE_DEVICES`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use gpuhub_wire::bounds::{self, MAX_FIELD_BYTES, MAX_USER_BYTES};
use gpuhub_wire::spool::{GpuRef, JobIdentity, RECORD_VERSION, Record, parse_index_list};

/// Wall-clock time in Unix microseconds.
pub fn now_us() -> i64 {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(_) => 0,
    }
}

/// Values a hook refused to use, with why; logged once per hook by the caller.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Notes {
    pub refused: Vec<String>,
}

impl Notes {
    fn refuse(&mut self, what: &str, why: &dyn std::fmt::Display) {
        let line = format!("{what} {why}");
        if !self.refused.contains(&line) {
            self.refused.push(line);
        }
    }

    /// The one log line for these refusals, if any.
    pub fn line(&self, job_id: Option<u32>) -> Option<String> {
        if self.refused.is_empty() {
            return None;
        }
        let job = job_id.map(|j| format!(" for job {j}")).unwrap_or_default();
        Some(format!("gpuhub: ignored{job}, recorded as unknown (gpuhub-agent takes these from Slurm): {}", self.refused.join("; ")))
    }
}

/// A variable read through `get`: trimmed, empty as `None`, and refused (as `None`, with a
/// note) when it breaks `cap` or holds a control character.
pub fn var(get: &dyn Fn(&str) -> Option<String>, name: &str, cap: usize, notes: &mut Notes) -> Option<String> {
    let v = get(name)?;
    // Check the raw value: trimming must not hide a trailing newline.
    let t = v.trim_matches(' ');
    if let Err(why) = bounds::check(t, cap) {
        notes.refuse(name, &why);
        return None;
    }
    Some(t.to_string()).filter(|s| !s.is_empty())
}

/// Looks up the user name of `uid` in the password database (NSS). Returns `None` when the
/// uid has no entry.
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

/// The uid's passwd name, bounded; `fallback` (a trusted value, the prolog's
/// `SLURM_JOB_USER`) when the password database has no entry; else empty.
fn user_of(uid: u32, fallback: Option<String>, notes: &mut Notes) -> String {
    match user_name_of(uid) {
        Some(name) => match bounds::check(&name, MAX_USER_BYTES) {
            Ok(()) => name,
            Err(why) => {
                notes.refuse(&format!("the password database's name for uid {uid}"), &why);
                String::new()
            }
        },
        None => fallback.unwrap_or_default(),
    }
}

/// JOB_SCRIPT (prolog/epilog): the identity from the `spank_get_item` ids and the environment
/// slurmd built for the hook (trusted, bounded). The environment's `SLURM_JOB_ID`/`SLURM_JOB_UID`
/// are used only where the items are unavailable.
pub fn job_script_identity(
    get: &dyn Fn(&str) -> Option<String>,
    job_id_item: Option<u32>,
    uid_item: Option<u32>,
    notes: &mut Notes,
) -> Result<JobIdentity, String> {
    let job_id = job_id_item
        .or_else(|| var(get, "SLURM_JOB_ID", MAX_FIELD_BYTES, notes).and_then(|s| s.parse().ok()))
        .ok_or("no job id (S_JOB_ID unavailable and SLURM_JOB_ID unset)")?;
    let uid = uid_item
        .or_else(|| var(get, "SLURM_JOB_UID", MAX_FIELD_BYTES, notes).and_then(|s| s.parse().ok()))
        .ok_or("no job uid (S_JOB_UID unavailable and SLURM_JOB_UID unset)")?;
    let env_user = var(get, "SLURM_JOB_USER", MAX_USER_BYTES, notes);
    Ok(JobIdentity {
        job_id,
        uid,
        user: user_of(uid, env_user, notes),
        account: var(get, "SLURM_JOB_ACCOUNT", MAX_FIELD_BYTES, notes),
        partition: var(get, "SLURM_JOB_PARTITION", MAX_FIELD_BYTES, notes),
        node: var(get, "SLURMD_NODENAME", MAX_FIELD_BYTES, notes).unwrap_or_default(),
    })
}

/// REMOTE (slurmstepd): the identity from the `spank_get_item` ids only, the user from the
/// password database, the node from slurmstepd's own `SLURMD_NODENAME` (`stepd_node`), and
/// account and partition unknown. Nothing here reads the step's environment.
pub fn step_identity(
    job_id_item: Option<u32>,
    uid_item: Option<u32>,
    stepd_node: Option<String>,
    notes: &mut Notes,
) -> Result<JobIdentity, String> {
    let job_id = job_id_item.ok_or("no job id (S_JOB_ID unavailable)")?;
    let uid = uid_item.ok_or("no job uid (S_JOB_UID unavailable)")?;
    let node_get = move |_: &str| stepd_node.clone();
    Ok(JobIdentity {
        job_id,
        uid,
        user: user_of(uid, None, notes),
        account: None,
        partition: None,
        node: var(&node_get, "SLURMD_NODENAME", MAX_FIELD_BYTES, notes).unwrap_or_default(),
    })
}

/// GPU references for an index list, with UUIDs from the agent's snapshot where known.
pub fn gpu_refs(list: Option<String>, uuids: &BTreeMap<u32, String>) -> Vec<GpuRef> {
    parse_index_list(list.as_deref().unwrap_or("")).into_iter().map(|index| GpuRef { index, uuid: uuids.get(&index).cloned() }).collect()
}

/// The GPUs a step's environment claims: `SLURM_STEP_GPUS` for srun steps, else the job's
/// `SLURM_JOB_GPUS` (the batch step and steps without their own GPU list). A claim: users can
/// pre-set both.
pub fn step_gpu_list(get: &dyn Fn(&str) -> Option<String>, notes: &mut Notes) -> Option<String> {
    var(get, "SLURM_STEP_GPUS", MAX_FIELD_BYTES, notes).or_else(|| var(get, "SLURM_JOB_GPUS", MAX_FIELD_BYTES, notes))
}

/// `SLURM_SHARDS_ON_NODE`, when the step's environment claims shards.
pub fn shards(get: &dyn Fn(&str) -> Option<String>, notes: &mut Notes) -> Option<u32> {
    var(get, "SLURM_SHARDS_ON_NODE", MAX_FIELD_BYTES, notes).and_then(|s| s.parse().ok()).filter(|&n| n > 0)
}

/// `job_prolog`: the allocation starts on this node.
pub fn job_start(
    job: JobIdentity,
    get: &dyn Fn(&str) -> Option<String>,
    uuids: &BTreeMap<u32, String>,
    time_us: i64,
    notes: &mut Notes,
) -> Record {
    let gpus = gpu_refs(var(get, "SLURM_JOB_GPUS", MAX_FIELD_BYTES, notes), uuids);
    Record::JobStart { v: RECORD_VERSION, time_us, job, gpus }
}

/// `job_epilog`: the allocation ends on this node (normal end, `scancel`, time limit, ...).
pub fn job_end(
    job: JobIdentity,
    get: &dyn Fn(&str) -> Option<String>,
    uuids: &BTreeMap<u32, String>,
    time_us: i64,
    notes: &mut Notes,
) -> Record {
    let exit_code = var(get, "SLURM_JOB_EXIT_CODE", MAX_FIELD_BYTES, notes).and_then(|s| s.parse().ok());
    let gpus = gpu_refs(var(get, "SLURM_JOB_GPUS", MAX_FIELD_BYTES, notes), uuids);
    Record::JobEnd { v: RECORD_VERSION, time_us, job, exit_code, gpus }
}

/// REMOTE `init_post_opt`: a step starts; the only place the shard count is visible.
pub fn step_start(
    job: JobIdentity,
    step_id: u32,
    get: &dyn Fn(&str) -> Option<String>,
    uuids: &BTreeMap<u32, String>,
    time_us: i64,
    notes: &mut Notes,
) -> Record {
    let gpus = gpu_refs(step_gpu_list(get, notes), uuids);
    Record::StepStart { v: RECORD_VERSION, time_us, job, step_id, gpus, shards: shards(get, notes) }
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

    /// A uid no password database has.
    const NO_SUCH_UID: u32 = 3_999_999_999;

    /// What a hostile user exports before `srun`/`sbatch`: every identity variable lies, and
    /// the rest are huge or hold control characters.
    fn hostile() -> impl Fn(&str) -> Option<String> + use<> {
        let big = "x".repeat(100 * 1024);
        let m: BTreeMap<String, String> = [
            ("SLURM_JOB_ID", "1".to_string()),
            ("SLURM_JOB_UID", "0".to_string()),
            ("SLURM_JOB_USER", "bob".to_string()),
            ("SLURM_JOB_ACCOUNT", "bobs-account".to_string()),
            ("SLURM_JOB_PARTITION", "gpu\nroot".to_string()),
            ("SLURMD_NODENAME", big.clone()),
            ("SLURM_STEP_GPUS", big),
            ("SLURM_JOB_GPUS", "0,1\u{1b}[2J".to_string()),
            ("SLURM_SHARDS_ON_NODE", "7\n".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        move |k: &str| m.get(k).cloned()
    }

    #[test]
    fn step_identity_ignores_the_step_environment() {
        let mut notes = Notes::default();
        let job = step_identity(Some(9), Some(0), Some("gpu01".into()), &mut notes).unwrap();
        assert_eq!(
            job,
            JobIdentity { job_id: 9, uid: 0, user: "root".into(), account: None, partition: None, node: "gpu01".into() },
            "ids from the items, user from passwd"
        );
        assert!(notes.refused.is_empty());
        // Missing items are errors; nothing falls back to the environment.
        assert!(step_identity(None, Some(0), None, &mut notes).unwrap_err().contains("job id"));
        assert!(step_identity(Some(1), None, None, &mut notes).unwrap_err().contains("uid"));
        // A uid without a passwd entry has no user name (the token is then not minted).
        assert_eq!(step_identity(Some(1), Some(NO_SUCH_UID), None, &mut notes).unwrap().user, "");
        // A hostile slurmstepd node value (cannot happen, but bounded all the same).
        let job = step_identity(Some(1), Some(0), Some("n\n1".into()), &mut notes).unwrap();
        assert_eq!(job.node, "");
        assert!(notes.line(Some(1)).unwrap().contains("SLURMD_NODENAME holds a control character"));
    }

    #[test]
    fn hostile_step_environment_claims_are_bounded() {
        let get = hostile();
        let mut notes = Notes::default();
        let job = step_identity(Some(42), Some(0), Some("gpu01".into()), &mut notes).unwrap();
        let rec = step_start(job, 0, &get, &BTreeMap::new(), 1, &mut notes);
        let json = rec.to_json();
        let Record::StepStart { job, gpus, shards, .. } = rec else { unreachable!() };
        assert_eq!((job.job_id, job.uid, job.user.as_str(), job.account, job.partition), (42, 0, "root", None, None));
        assert!(gpus.is_empty(), "a 100 KB SLURM_STEP_GPUS and an escape-laden SLURM_JOB_GPUS are refused: {gpus:?}");
        assert_eq!(shards, None, "a newline in SLURM_SHARDS_ON_NODE is refused");
        assert!(json.len() < 1024 && !json.contains("bob") && !json.contains('\u{1b}'), "{json}");
        let line = notes.line(Some(42)).unwrap();
        assert!(line.contains("SLURM_STEP_GPUS is 102400 bytes long, over the 256-byte limit"), "{line}");
        assert!(line.contains("SLURM_JOB_GPUS holds a control character at byte 3"), "{line}");
        assert!(line.contains("SLURM_SHARDS_ON_NODE holds a control character"), "{line}");
        assert!(line.len() < 1024 && !line.contains('\n') && !line.contains('\u{1b}'), "the log line quotes no value: {line}");
    }

    #[test]
    fn plain_step_claims_are_kept_as_claims() {
        let get = env(&[("SLURM_STEP_GPUS", "1"), ("SLURM_SHARDS_ON_NODE", "7"), ("SLURM_JOB_USER", "bob")]);
        let mut notes = Notes::default();
        let job = step_identity(Some(9), Some(0), None, &mut notes).unwrap();
        assert_eq!((job.user.as_str(), job.node.as_str()), ("root", ""), "SLURM_JOB_USER is not read; no node is unknown");
        let Record::StepStart { gpus, shards, step_id, .. } = step_start(job, 0, &get, &BTreeMap::new(), 1, &mut notes) else {
            unreachable!()
        };
        assert_eq!((gpus, shards, step_id), (vec![GpuRef { index: 1, uuid: None }], Some(7), 0));
        let get = env(&[("SLURM_JOB_GPUS", "0")]);
        assert_eq!(step_gpu_list(&get, &mut notes).as_deref(), Some("0"), "the batch step falls back to SLURM_JOB_GPUS");
        assert!(notes.line(None).is_none());
    }

    #[test]
    fn prolog_identity_and_gpus_with_uuids() {
        let get = env(&[
            ("SLURM_JOB_ID", "42"),
            ("SLURM_JOB_UID", "0"),
            ("SLURM_JOB_USER", "root"),
            ("SLURM_JOB_PARTITION", "gpu"),
            ("SLURM_JOB_GPUS", "0,1"),
            ("SLURMD_NODENAME", "gpu01"),
        ]);
        let mut notes = Notes::default();
        let job = job_script_identity(&get, None, None, &mut notes).unwrap();
        assert_eq!(
            job,
            JobIdentity { job_id: 42, uid: 0, user: "root".into(), account: None, partition: Some("gpu".into()), node: "gpu01".into() }
        );
        let uuids = BTreeMap::from([(1, "GPU-b".to_string())]);
        let rec = job_start(job, &get, &uuids, 7, &mut notes);
        let Record::JobStart { gpus, time_us, .. } = rec else { unreachable!() };
        assert_eq!(time_us, 7);
        assert_eq!(gpus, vec![GpuRef { index: 0, uuid: None }, GpuRef { index: 1, uuid: Some("GPU-b".into()) }]);
        assert!(notes.line(Some(42)).is_none());
    }

    #[test]
    fn prolog_items_win_and_the_user_comes_from_passwd() {
        let get = hostile();
        let mut notes = Notes::default();
        let job = job_script_identity(&get, Some(77), Some(0), &mut notes).unwrap();
        assert_eq!((job.job_id, job.uid, job.user.as_str()), (77, 0, "root"), "items over SLURM_JOB_ID/UID, passwd over SLURM_JOB_USER");
        assert_eq!((job.partition, job.node.as_str()), (None, ""), "bounded even where trusted");
        assert_eq!(job.account.as_deref(), Some("bobs-account"), "a plain value of the prolog's environment is kept");
        let line = notes.line(Some(77)).unwrap();
        assert!(
            line.contains("SLURM_JOB_PARTITION holds a control character") && line.contains("SLURMD_NODENAME is 102400 bytes"),
            "{line}"
        );
        // Without a passwd entry the prolog's own SLURM_JOB_USER (built by slurmd) is used.
        let get = env(&[("SLURM_JOB_USER", "ldapuser")]);
        assert_eq!(job_script_identity(&get, Some(1), Some(NO_SUCH_UID), &mut notes).unwrap().user, "ldapuser");
        let get = env(&[("SLURM_JOB_USER", &"u".repeat(65))]);
        assert_eq!(job_script_identity(&get, Some(1), Some(NO_SUCH_UID), &mut notes).unwrap().user, "");
    }

    #[test]
    fn epilog_keeps_the_exit_code_and_bounds_it() {
        let get = env(&[("SLURM_JOB_ID", "5"), ("SLURM_JOB_UID", "0"), ("SLURM_JOB_EXIT_CODE", "15")]);
        let mut notes = Notes::default();
        let job = job_script_identity(&get, None, None, &mut notes).unwrap();
        let Record::JobEnd { exit_code, gpus, .. } = job_end(job.clone(), &get, &BTreeMap::new(), 1, &mut notes) else { unreachable!() };
        assert_eq!(exit_code, Some(15));
        assert!(gpus.is_empty());
        let get = env(&[("SLURM_JOB_EXIT_CODE", "15\n0")]);
        let Record::JobEnd { exit_code, .. } = job_end(job, &get, &BTreeMap::new(), 1, &mut notes) else { unreachable!() };
        assert_eq!(exit_code, None);
    }

    #[test]
    fn missing_ids_are_errors() {
        let get = env(&[]);
        let mut notes = Notes::default();
        assert!(job_script_identity(&get, None, Some(0), &mut notes).unwrap_err().contains("job id"));
        assert!(job_script_identity(&get, Some(1), None, &mut notes).unwrap_err().contains("uid"));
    }
}
