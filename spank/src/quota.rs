//! srun, sbatch and salloc (LOCAL/ALLOCATOR context, running as the user): print the quota
//! line the agent wrote for this user into the snapshot (docs/quotas.md), at most once per
//! process. The agent decides and words it (80 %, 95 %, used up); this module only looks up
//! the caller's uid. No network, no agent call: a missing or unreadable snapshot prints nothing.

use std::path::Path;

use gpuhub_wire::snapshot::Snapshot;

/// The line for `uid`, if the snapshot has one (control characters replaced: the agent
/// writes it, but a terminal is no place to trust a file).
pub fn line_for(snap: &Snapshot, uid: u32) -> Option<String> {
    snap.quota_notes.get(&uid).map(|l| l.chars().map(|c| if c.is_control() { '?' } else { c }).take(1000).collect())
}

/// Prints the caller's line, unless the process runs inside a job already (an `srun` step of
/// a batch script or an allocation starts no new job, so it gets no quota line).
pub fn notice(snapshot: &Path) {
    if std::env::var_os("SLURM_JOB_ID").is_some() {
        return;
    }
    let Ok(snap) = crate::files::read_snapshot(snapshot) else { return };
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    if let Some(line) = line_for(&snap, uid) {
        crate::log::info(&line);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_callers_line_only() {
        let raw = br#"{"version":1,"generated_at":0,"gateway_url":null,"mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{},
            "quota_notes":{"1000":"gpuhub: you have used 172 of 200 GPU-hours this month (86 %)","1001":"x\u001b[2Jy"}}"#;
        let s = Snapshot::parse(raw).unwrap();
        assert_eq!(line_for(&s, 1000).as_deref(), Some("gpuhub: you have used 172 of 200 GPU-hours this month (86 %)"));
        assert_eq!(line_for(&s, 1001).as_deref(), Some("x?[2Jy"), "no terminal escapes");
        assert_eq!(line_for(&s, 1002), None);
        let old = br#"{"version":1,"generated_at":0,"gateway_url":null,"mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{}}"#;
        assert_eq!(line_for(&Snapshot::parse(old).unwrap(), 1000), None, "a snapshot without quotas");
    }
}
