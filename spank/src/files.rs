//! Bounded reads of the two files the plugin trusts: the agent's snapshot and the job key.
//!
//! Both are opened non-blocking and must be regular files, so a FIFO or device put in their
//! place cannot hang a hook; both are read with a size cap, so a huge file cannot slow every
//! job start. Every failure is an error value that names the file and the fix.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;

use gpuhub_wire::snapshot::{MAX_SNAPSHOT_BYTES, Snapshot};

/// Largest accepted job-key file.
pub const MAX_KEY_BYTES: u64 = 4096;

fn open_regular(path: &Path, cap: u64) -> Result<(File, std::fs::Metadata), String> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let meta = f.metadata().map_err(|e| format!("cannot stat {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.len() > cap {
        return Err(format!("{} is {} bytes, over the {cap}-byte limit", path.display(), meta.len()));
    }
    Ok((f, meta))
}

fn read_capped(f: File, path: &Path, cap: u64) -> Result<Vec<u8>, String> {
    let mut buf = Vec::new();
    f.take(cap + 1).read_to_end(&mut buf).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if buf.len() as u64 > cap {
        return Err(format!("{} grew over the {cap}-byte limit while being read", path.display()));
    }
    Ok(buf)
}

/// Reads and parses the snapshot (at most `MAX_SNAPSHOT_BYTES`).
pub fn read_snapshot(path: &Path) -> Result<Snapshot, String> {
    let (f, _) = open_regular(path, MAX_SNAPSHOT_BYTES)?;
    let bytes = read_capped(f, path, MAX_SNAPSHOT_BYTES)?;
    Snapshot::parse(&bytes).map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads the job-token key: the file's bytes through `gpuhub_wire::token::parse_key` (ASCII
/// whitespace at both ends trimmed, at least 16 bytes left), the same function the agent
/// verifies with. Refuses a key that users could read (they could then mint tokens for anyone).
pub fn read_job_key(path: &Path) -> Result<Vec<u8>, String> {
    let (f, meta) = open_regular(path, MAX_KEY_BYTES)?;
    if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
        return Err(format!(
            "{} must be owned by root with mode 0600 (is uid {} mode {:o}); fix: chown root {0} && chmod 600 {0}",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777
        ));
    }
    let raw = read_capped(f, path, MAX_KEY_BYTES)?;
    gpuhub_wire::token::parse_key(&raw).map_err(|e| format!("{} {e}", path.display()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const GOOD: &str = r#"{"version":1,"generated_at":1,"gateway_url":"http://127.0.0.1:8400","mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{"ocr":"dots.ocr","chat":null},"gpus":{"0":"GPU-a"}}"#;

    #[test]
    fn snapshot_good_missing_huge_corrupt_fifo_dir() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.json");
        std::fs::write(&p, GOOD).unwrap();
        let s = read_snapshot(&p).unwrap();
        assert_eq!(s.roles.get("ocr").cloned().flatten().as_deref(), Some("dots.ocr"));
        assert_eq!(s.gpus.get(&0).map(String::as_str), Some("GPU-a"));

        assert!(read_snapshot(&d.path().join("missing")).unwrap_err().contains("cannot open"));
        std::fs::write(&p, vec![b' '; (MAX_SNAPSHOT_BYTES + 1) as usize]).unwrap();
        assert!(read_snapshot(&p).unwrap_err().contains("limit"));
        std::fs::write(&p, b"{\"version\":1,").unwrap();
        assert!(read_snapshot(&p).unwrap_err().contains("corrupt"));
        assert!(read_snapshot(d.path()).unwrap_err().contains("not a regular file"));

        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: valid path string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let t = std::time::Instant::now();
        assert!(read_snapshot(&fifo).unwrap_err().contains("not a regular file"));
        assert!(t.elapsed() < std::time::Duration::from_secs(1), "a FIFO must not block");
    }

    #[test]
    fn job_key_must_be_private_and_long_enough() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("key");
        std::fs::write(&p, b"0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        if unsafe { libc::geteuid() } == 0 {
            // `echo KEY > file`: the newline is not part of the key (the agent trims it too).
            assert_eq!(read_job_key(&p).unwrap(), b"0123456789abcdef0123456789abcdef");
        }
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(read_job_key(&p).unwrap_err().contains("chmod 600"));
        std::fs::write(&p, b"0123456789abcde\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        if unsafe { libc::geteuid() } == 0 {
            assert!(read_job_key(&p).unwrap_err().contains("at least 16"));
        }
    }
}
