//! Holding and releasing a Slurm association with `sacctmgr` (slurmdbd).
//!
//! A held association gets `GrpTRES=gres/gpu=0,gres/shard=0`: slurmctld then leaves every new
//! GPU or shard job of that user (or account) pending with reason `AssocGrpGRES`, and starts
//! none of them; jobs already running keep their GPUs and are never signalled, because
//! `GrpTRES` limits only what may be *allocated* next. `GrpTRESMins` (Slurm's own GPU-minute
//! quota) is not used: when it is reached, slurmctld kills the association's running jobs
//! (Slurm's resource_limits documentation; docs/quotas.md). Releasing sets the two limits
//! back to `-1` (none), and slurmctld starts the pending jobs on its next scheduling pass.
//! Needs `AccountingStorageEnforce=limits` (with associations) in slurm.conf.
//!
//! Every change is checked by reading the association back, so "Nothing modified" from a
//! user without an association is an error that says how to add one, not a silent success.

use std::path::PathBuf;
use std::time::Duration;

/// `squeue`'s reason for a job held by a `GrpTRES` GPU limit of its association.
pub const HELD_REASON: &str = "AssocGrpGRES";

/// The limit a held association carries.
pub const HOLD_TRES: &str = "gres/gpu=0,gres/shard=0";
/// The limit a released association carries (`-1`: no limit).
pub const RELEASE_TRES: &str = "gres/gpu=-1,gres/shard=-1";

#[derive(Debug, thiserror::Error)]
pub enum SacctmgrError {
    #[error("cannot run {bin}: {source} (install Slurm's sacctmgr or set slurm.bin_dir)")]
    Spawn { bin: String, source: std::io::Error },
    #[error("{bin} {args} took longer than {secs} s (is slurmdbd up? `sacctmgr show cluster`)")]
    Timeout { bin: String, args: String, secs: u64 },
    #[error("{bin} {args} failed: {output}")]
    Failed { bin: String, args: String, output: String },
    #[error(
        "Slurm has no association for {kind} {name}, so its quota cannot be held: add one (sacctmgr add {kind} {name} account=ACCOUNT) \
         and set AccountingStorageEnforce=associations,limits in slurm.conf"
    )]
    NoAssociation { kind: String, name: String },
    #[error("{kind} {name}: GrpTRES reads `{now}` after sacctmgr set it to {want}")]
    NotApplied { kind: String, name: String, now: String, want: String },
}

/// Runs `sacctmgr` with a timeout.
#[derive(Debug, Clone)]
pub struct Sacctmgr {
    pub bin: PathBuf,
    pub timeout: Duration,
}

impl Sacctmgr {
    async fn run(&self, args: &[&str]) -> Result<String, SacctmgrError> {
        let bin = self.bin.display().to_string();
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(args).kill_on_drop(true).stdin(std::process::Stdio::null());
        let out = match tokio::time::timeout(self.timeout, cmd.output()).await {
            Err(_) => return Err(SacctmgrError::Timeout { bin, args: args.join(" "), secs: self.timeout.as_secs() }),
            Ok(Err(source)) => return Err(SacctmgrError::Spawn { bin, source }),
            Ok(Ok(o)) => o,
        };
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        // `modify` of an unchanged value prints "Nothing modified" and exits 1; the read-back
        // below decides.
        if out.status.success() || text.contains("Nothing modified") {
            Ok(text)
        } else {
            Err(SacctmgrError::Failed { bin, args: args.join(" "), output: text.trim().replace('\n', "; ") })
        }
    }

    /// The GrpTRES of `kind` (`user`/`account`) `name`'s associations: one entry per
    /// association (a user's on each account; an account's own, with no user).
    pub async fn grp_tres(&self, kind: &str, name: &str) -> Result<Vec<String>, SacctmgrError> {
        let filter = if kind == "user" { format!("users={name}") } else { format!("accounts={name}") };
        let out = self.run(&["-n", "-P", "list", "associations", &filter, "format=User,GrpTRES"]).await?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_once('|'))
            .filter(|(user, _)| if kind == "user" { *user == name } else { user.is_empty() })
            .map(|(_, tres)| tres.trim().to_string())
            .collect())
    }

    /// Holds (`hold = true`) or releases `kind` `name`, then reads the association back.
    pub async fn set(&self, kind: &str, name: &str, hold: bool) -> Result<(), SacctmgrError> {
        let (tres, want) = if hold { (HOLD_TRES, true) } else { (RELEASE_TRES, false) };
        let filter = format!("name={name}");
        let set = format!("GrpTRES={tres}");
        self.run(&["-i", "modify", kind, "where", &filter, "set", &set]).await?;
        let now = self.grp_tres(kind, name).await?;
        if now.is_empty() {
            return Err(SacctmgrError::NoAssociation { kind: kind.into(), name: name.into() });
        }
        for t in &now {
            if is_held(t) != want {
                return Err(SacctmgrError::NotApplied { kind: kind.into(), name: name.into(), now: t.clone(), want: tres.into() });
            }
        }
        Ok(())
    }
}

/// Whether a GrpTRES value holds GPU jobs (`gres/gpu=0`).
pub fn is_held(grp_tres: &str) -> bool {
    grp_tres.split(',').any(|kv| kv.trim() == "gres/gpu=0")
}

#[cfg(test)]
mod tests {
    #[test]
    fn held_reads_from_grp_tres() {
        assert!(super::is_held("gres/gpu=0,gres/shard=0"));
        assert!(super::is_held("cpu=4,gres/gpu=0"));
        assert!(!super::is_held(""));
        assert!(!super::is_held("gres/gpu=00x"));
        assert!(!super::is_held("gres/gpu=2"));
    }
}
