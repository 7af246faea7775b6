//! The per-worker key outside any command line: the 0600 key file, the shim that hands the
//! key to one program by environment, the marker that finds a local worker again after a
//! restart, and redaction of the key from anything a person reads.
//!
//! Every name derives from a hash of the key ([`tag`]), so an agent that restarts and reads
//! the key from its store finds the same file and marker again, and nothing in a file name
//! or an environment variable other than the key's own reveals the key.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::account::WorkerUser;
use crate::config::templates::KeyDelivery;

/// Environment variable that marks a local worker's process (`GPUHUB_WORKER_TAG=<tag>`); the
/// agent reads it from `/proc/PID/environ` to adopt the worker after a restart.
pub const TAG_ENV: &str = "GPUHUB_WORKER_TAG";

/// 16 hex digits of SHA-256 over the key: names the key file and marks the process.
pub fn tag(key: &str) -> String {
    hex::encode(&Sha256::digest(key.as_bytes())[..8])
}

/// The files that carry one worker's key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFiles {
    /// `<workers dir>/keys/<model>.<tag><suffix>`, 0600, owned by the worker account.
    pub file: PathBuf,
    /// `<workers dir>/keys/<model>.<tag>.bin`: the shim directory put first on `PATH` when only
    /// one program may see the key (`api_key_env_for`).
    pub shim_dir: Option<PathBuf>,
}

impl KeyFiles {
    /// Where the key files of `model`'s worker with `key` live (they may not exist yet).
    pub fn locate(dir: &Path, safe_model: &str, key: &str, how: &KeyDelivery) -> KeyFiles {
        let base = format!("{safe_model}.{}", tag(key));
        let keys = dir.join("keys");
        KeyFiles {
            file: keys.join(format!("{base}{}", how.file_suffix)),
            shim_dir: how.env_for.as_ref().map(|_| keys.join(format!("{base}.bin"))),
        }
    }

    /// Writes the key file (and the shim) for the worker account: created fresh (never
    /// through an existing file or link), mode 0600 (shim 0700), then handed to the account.
    pub fn write(&self, key: &str, how: &KeyDelivery, user: &WorkerUser) -> std::io::Result<()> {
        self.remove();
        let content = how.file_format.replace("{api_key}", key);
        write_private(&self.file, content.as_bytes(), 0o600, user)?;
        if let (Some(shim_dir), Some(var), Some(program)) = (&self.shim_dir, &how.env, &how.env_for) {
            std::fs::create_dir(shim_dir)?;
            std::fs::set_permissions(shim_dir, std::fs::Permissions::from_mode(0o700))?;
            chown(shim_dir, user)?;
            let script = shim_script(var, program, &self.file, shim_dir);
            write_private(&shim_dir.join(program), script.as_bytes(), 0o700, user)?;
        }
        Ok(())
    }

    /// Removes the key file and the shim (the worker has stopped). Missing files are fine.
    pub fn remove(&self) {
        let _ = std::fs::remove_file(&self.file);
        if let Some(d) = &self.shim_dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A shell script named like `program` that reads the key from the file into `var` (the
/// shell's `read` builtin: no process gets the key as an argument), takes itself off `PATH`
/// and execs the real `program`.
fn shim_script(var: &str, program: &str, key_file: &Path, shim_dir: &Path) -> String {
    let q = super::shell_quote;
    format!(
        "#!/bin/sh\n# Written by gpuhub-agent: gives {program} the worker key in ${var}, never on a command line.\nIFS= read -r {var} < {file} || {{ echo \"gpuhub: cannot read the worker key {file}\" >&2; exit 1; }}\nexport {var}\nPATH=$(printf '%s' \"$PATH\" | sed -e \"s|^{dir}:||\")\nexport PATH\nexec {program} \"$@\"\n",
        file = q(&key_file.display().to_string()),
        dir = shim_dir.display(),
    )
}

fn write_private(path: &Path, bytes: &[u8], mode: u32, user: &WorkerUser) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).custom_flags(libc::O_NOFOLLOW).open(path)?;
    // The umask may have taken bits away; set exactly `mode`.
    f.set_permissions(std::fs::Permissions::from_mode(mode))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    chown(path, user)
}

fn chown(path: &Path, user: &WorkerUser) -> std::io::Result<()> {
    if user.is_self {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(user.uid), Some(user.gid))
}

/// `text` with every occurrence of `key` replaced by `<worker key>`.
pub fn redact(text: &str, key: &str) -> String {
    if key.len() < 8 || !text.contains(key) {
        return text.to_string();
    }
    text.replace(key, "<worker key>")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn me() -> WorkerUser {
        // SAFETY: plain syscalls.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        WorkerUser { name: "me".into(), uid, gid, home: "/".into(), groups: vec![gid], is_self: true }
    }

    #[test]
    fn the_key_file_is_private_fresh_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("keys")).unwrap();
        let how = KeyDelivery::default();
        let key = "gpuhub-worker-0123456789abcdef";
        let f = KeyFiles::locate(dir.path(), "m", key, &how);
        assert_eq!(f.file, dir.path().join(format!("keys/m.{}.key", tag(key))));
        assert!(!f.file.display().to_string().contains(key), "the file name must not reveal the key");
        f.write(key, &how, &me()).unwrap();
        let meta = std::fs::metadata(&f.file).unwrap();
        assert_eq!(meta.mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&f.file).unwrap(), format!("{key}\n"));
        // A planted link is never written through: write() replaces it with a fresh file.
        std::fs::remove_file(&f.file).unwrap();
        std::os::unix::fs::symlink(dir.path().join("elsewhere"), &f.file).unwrap();
        f.write(key, &how, &me()).unwrap();
        assert!(!dir.path().join("elsewhere").exists());
        f.remove();
        assert!(!f.file.exists());
        let yaml = KeyDelivery { file_format: "api-key: \"{api_key}\"\n".into(), file_suffix: ".yaml".into(), ..KeyDelivery::default() };
        let f = KeyFiles::locate(dir.path(), "m", key, &yaml);
        f.write(key, &yaml, &me()).unwrap();
        assert!(f.file.display().to_string().ends_with(".yaml"));
        assert_eq!(std::fs::read_to_string(&f.file).unwrap(), format!("api-key: \"{key}\"\n"));
    }

    #[test]
    fn the_shim_gives_only_its_program_the_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("keys")).unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        // A "launcher" that starts "router" the way TGI's does, and a "router" that prints
        // what it got.
        let router = bin.join("router");
        std::fs::write(&router, "#!/bin/sh\necho \"router argv=$* key=$SECRET_KEY\"\n").unwrap();
        std::fs::set_permissions(&router, std::fs::Permissions::from_mode(0o755)).unwrap();
        let how = KeyDelivery { env: Some("SECRET_KEY".into()), env_for: Some("router".into()), ..KeyDelivery::default() };
        let key = "gpuhub-worker-feedfacefeedface";
        let f = KeyFiles::locate(dir.path(), "m", key, &how);
        f.write(key, &how, &me()).unwrap();
        let shim = f.shim_dir.clone().unwrap();
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg("echo \"launcher key=${SECRET_KEY:-none}\"; router --port 1")
            .env_clear()
            .env("PATH", format!("{}:{}:/usr/bin:/bin", shim.display(), bin.display()))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(text, format!("launcher key=none\nrouter argv=--port 1 key={key}\n"), "{}", String::from_utf8_lossy(&out.stderr));
        f.remove();
        assert!(!shim.exists() && !f.file.exists());
    }

    #[test]
    fn redaction_hides_the_key() {
        assert_eq!(
            redact("error: bad key gpuhub-worker-abcdef123456 here", "gpuhub-worker-abcdef123456"),
            "error: bad key <worker key> here"
        );
        assert_eq!(redact("nothing", "gpuhub-worker-abcdef123456"), "nothing");
    }
}
