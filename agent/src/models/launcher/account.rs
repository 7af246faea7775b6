//! The unprivileged account workers run as (`workers.user`, default `gpuhub-worker`), and the
//! workers directory it writes into.
//!
//! - `local` workers: the agent's child drops to the account between fork and exec
//!   ([`WorkerUser::drop_privileges`]: setgroups, setgid, setuid), so the server never holds
//!   root or a capability (a root process loses every capability at setuid to another uid).
//! - `slurm` workers: submitted with `sbatch --uid --gid` (Slurm runs root's submission as that
//!   user).
//!
//! The workers directory is `root:<worker group>` 0770 (workers write logs and `.addr` files,
//! other users cannot look in), its `keys/` subdirectory 0710 (a worker opens its own 0600 key
//! file by name but cannot list the others).

use std::ffi::{CStr, CString};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// `workers.user`, resolved from the password database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// Supplementary groups (`getgrouplist`), primary group included.
    pub groups: Vec<u32>,
    /// The agent already runs as this account: nothing to switch (an unprivileged agent).
    pub is_self: bool,
}

impl WorkerUser {
    /// Looks the account up and checks that the agent can run workers as it.
    pub fn lookup(name: &str) -> Result<WorkerUser, String> {
        let cname = CString::new(name).map_err(|_| format!("workers.user `{}` contains a NUL byte", name.escape_debug()))?;
        let mut buf = vec![0u8; 16384];
        // SAFETY: a zeroed passwd is a valid out-parameter; getpwnam_r fills it with pointers into buf.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the given length; result is set on success.
        let rc = unsafe { libc::getpwnam_r(cname.as_ptr(), &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
        if rc != 0 || result.is_null() {
            return Err(format!(
                "workers.user `{name}` does not exist on this node; create it (the agent RPM does: useradd --system --shell /usr/sbin/nologin {name}) or set workers.user to an unprivileged account"
            ));
        }
        let (uid, gid) = (pwd.pw_uid, pwd.pw_gid);
        // SAFETY: pw_dir points to a NUL-terminated string inside buf (or is null).
        let home = if pwd.pw_dir.is_null() {
            PathBuf::from("/")
        } else {
            PathBuf::from(unsafe { CStr::from_ptr(pwd.pw_dir) }.to_string_lossy().into_owned())
        };
        if uid == 0 {
            return Err(format!("workers.user `{name}` has uid 0: workers must never run as root; use an unprivileged account"));
        }
        // SAFETY: plain syscall.
        let euid = unsafe { libc::geteuid() };
        if euid != 0 && euid != uid {
            return Err(format!(
                "the agent runs as uid {euid}, not root, so it cannot start workers as `{name}` (uid {uid}); run the agent as root (the packaged unit does) or set workers.user to the agent's own account"
            ));
        }
        let groups = group_list(&cname, gid);
        Ok(WorkerUser { name: name.to_string(), uid, gid, home, groups, is_self: euid == uid })
    }

    /// Runs in the forked child before exec (async-signal-safe calls only): drops to the
    /// account for good and checks that root cannot be regained.
    pub fn drop_privileges(&self) -> std::io::Result<()> {
        if self.is_self {
            return Ok(());
        }
        let err = std::io::Error::last_os_error;
        // SAFETY: the groups slice is valid for its length; these are plain syscalls.
        unsafe {
            if libc::setgroups(self.groups.len(), self.groups.as_ptr()) != 0 {
                return Err(err());
            }
            if libc::setgid(self.gid) != 0 {
                return Err(err());
            }
            if libc::setuid(self.uid) != 0 {
                return Err(err());
            }
            if libc::setuid(0) == 0 || libc::geteuid() != self.uid || libc::getegid() != self.gid {
                return Err(std::io::Error::from_raw_os_error(libc::EPERM));
            }
        }
        Ok(())
    }

    /// Whether the account may search (`x`) every directory on the way to `path`; the error
    /// names the directory that stops it and the fix.
    pub fn check_reach(&self, path: &Path) -> Result<(), String> {
        let mut cur = PathBuf::new();
        for part in path.components() {
            cur.push(part);
            let Ok(meta) = std::fs::metadata(&cur) else { return Ok(()) };
            if !meta.is_dir() {
                break;
            }
            if !self.may(&meta, 0o1) {
                return Err(format!(
                    "{} (mode {:o}, owner uid {}, group {}) does not let workers.user `{}` through; allow it (e.g. chmod o+x {}), or set workers.dir to a directory under a path it can reach",
                    cur.display(),
                    meta.mode() & 0o7777,
                    meta.uid(),
                    meta.gid(),
                    self.name,
                    cur.display()
                ));
            }
        }
        Ok(())
    }

    /// Whether the account may run the program `path` (every directory on the way searchable,
    /// the file executable by it); the error names what stops it.
    pub fn check_exec(&self, path: &Path) -> Result<(), String> {
        if let Some(dir) = path.parent() {
            self.check_reach(dir)?;
        }
        let Ok(meta) = std::fs::metadata(path) else { return Ok(()) };
        if meta.is_file() && !self.may(&meta, 0o1) {
            return Err(format!(
                "{} (mode {:o}, owner uid {}) is not executable by workers.user `{}`",
                path.display(),
                meta.mode() & 0o7777,
                meta.uid(),
                self.name
            ));
        }
        Ok(())
    }

    /// Whether permission `bits` (1 = x, 2 = w, 4 = r) is granted to the account.
    fn may(&self, meta: &std::fs::Metadata, bits: u32) -> bool {
        let mode = meta.mode();
        if meta.uid() == self.uid {
            mode & (bits << 6) != 0
        } else if self.groups.contains(&meta.gid()) || meta.gid() == self.gid {
            mode & (bits << 3) != 0
        } else {
            mode & bits != 0
        }
    }
}

fn group_list(user: &CStr, gid: u32) -> Vec<u32> {
    let mut n: libc::c_int = 64;
    for _ in 0..4 {
        let mut groups = vec![0 as libc::gid_t; n as usize];
        let mut count = n;
        // SAFETY: groups has room for `count` entries; getgrouplist updates count.
        let rc = unsafe { libc::getgrouplist(user.as_ptr(), gid, groups.as_mut_ptr(), &mut count) };
        if rc >= 0 {
            groups.truncate(count.max(0) as usize);
            return groups;
        }
        n = count.max(n * 2);
    }
    vec![gid]
}

/// Creates the workers directory and its `keys/` subdirectory with the modes above (a root
/// agent chowns them to `root:<worker group>`), and checks the worker account reaches them.
pub fn prepare_dir(dir: &Path, user: &WorkerUser) -> Result<(), String> {
    let keys = dir.join("keys");
    for (d, mode) in [(dir, 0o770), (keys.as_path(), 0o710)] {
        std::fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e} (check workers.dir)", d.display()))?;
        // SAFETY: plain syscall.
        if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(d, Some(0), Some(user.gid))
                .map_err(|e| format!("cannot chown {} to root:{}: {e}", d.display(), user.gid))?;
        }
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(if user.is_self { mode & 0o700 } else { mode }))
            .map_err(|e| format!("cannot chmod {}: {e}", d.display()))?;
    }
    user.check_reach(&keys)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn root_and_missing_accounts_are_refused_with_the_fix() {
        let e = WorkerUser::lookup("root").unwrap_err();
        assert!(e.contains("never run as root"), "{e}");
        let e = WorkerUser::lookup("gpuhub-no-such-user").unwrap_err();
        assert!(e.contains("does not exist") && e.contains("useradd"), "{e}");
    }

    #[test]
    fn reach_is_checked_directory_by_directory() {
        let dir = tempfile::tempdir().unwrap();
        let inner = dir.path().join("a/b");
        std::fs::create_dir_all(&inner).unwrap();
        let stranger = WorkerUser {
            name: "stranger".into(),
            uid: 4_000_000,
            gid: 4_000_000,
            home: "/".into(),
            groups: vec![4_000_000],
            is_self: false,
        };
        std::fs::set_permissions(dir.path().join("a"), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let tool = inner.join("tool");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o750)).unwrap();
        let e = stranger.check_exec(&tool).unwrap_err();
        assert!(e.contains("mode 700"), "the directory is named first: {e}");
        let e = stranger.check_reach(&inner).unwrap_err();
        assert!(e.contains(&format!("{}/a ", dir.path().display())) && e.contains("mode 700"), "{e}");
        std::fs::set_permissions(dir.path().join("a"), std::fs::Permissions::from_mode(0o711)).unwrap();
        stranger.check_reach(&inner).unwrap();
        let e = stranger.check_exec(&tool).unwrap_err();
        assert!(e.contains("not executable") && e.contains("mode 750"), "{e}");
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        stranger.check_exec(&tool).unwrap();
    }
}
