//! dcgm-exporter's HPC job map (`--hpc-job-mapping-dir`): one file per GPU index holding the
//! ids of the jobs on that GPU, one per line. Maintained from the prolog (add) and epilog
//! (remove), for sites that keep dcgm-exporter next to gpuhub.
//!
//! Several jobs share a GPU (shards), and their prologs/epilogs run concurrently, so each
//! update holds an exclusive `flock` on `<dir>/.lock` and replaces the file atomically
//! (temp + rename): dcgm-exporter never reads a half-written file. Waiting for the lock is
//! bounded ([`LOCK_WAIT`]); a timeout is an error for the caller to log.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

/// Longest a prolog/epilog waits for another job's update of the map.
pub const LOCK_WAIT: Duration = Duration::from_secs(2);

/// Adds (`add = true`) or removes `job_id` in the map file of every GPU in `gpus`.
pub fn update(dir: &Path, gpus: &[u32], job_id: u32, add: bool) -> io::Result<()> {
    if gpus.is_empty() {
        return Ok(());
    }
    if !dir.is_dir() {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
    }
    let lock = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(dir.join(".lock"))?;
    lock_bounded(&lock)?;
    for gpu in gpus {
        update_one(dir, *gpu, job_id, add)?;
    }
    Ok(()) // the lock is released when `lock` is closed
}

fn lock_bounded(f: &File) -> io::Result<()> {
    let start = Instant::now();
    loop {
        // SAFETY: a valid open descriptor; flock has no memory-safety preconditions.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(e);
        }
        if start.elapsed() >= LOCK_WAIT {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "another job held the dcgm job-map lock for over 2 s"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn update_one(dir: &Path, gpu: u32, job_id: u32, add: bool) -> io::Result<()> {
    let path = dir.join(gpu.to_string());
    let old = match fs::read_to_string(&path) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e),
    };
    let id = job_id.to_string();
    let mut jobs: Vec<&str> = old.lines().map(str::trim).filter(|l| !l.is_empty() && *l != id).collect();
    if add {
        jobs.push(&id);
    }
    let mut body = jobs.join("\n");
    if !body.is_empty() {
        body.push('\n');
    }
    if body == old {
        return Ok(());
    }
    let tmp = dir.join(format!(".{gpu}.{}.tmp", std::process::id()));
    let res = (|| {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        // No fsync: the map is runtime state under /run (tmpfs), and the prolog is on srun's path.
        f.write_all(body.as_bytes())?;
        fs::rename(&tmp, &path)
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    res
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;

    fn read(dir: &Path, gpu: u32) -> String {
        fs::read_to_string(dir.join(gpu.to_string())).unwrap_or_default()
    }

    #[test]
    fn add_and_remove_jobs_per_gpu() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("map");
        update(&dir, &[0, 1], 10, true).unwrap();
        update(&dir, &[1], 11, true).unwrap();
        update(&dir, &[1], 11, true).unwrap(); // idempotent
        assert_eq!(read(&dir, 0), "10\n");
        assert_eq!(read(&dir, 1), "10\n11\n");
        update(&dir, &[0, 1], 10, false).unwrap();
        assert_eq!(read(&dir, 0), "");
        assert_eq!(read(&dir, 1), "11\n");
    }

    #[test]
    fn concurrent_updates_lose_nothing() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().to_path_buf();
        let handles: Vec<_> = (0..8u32)
            .map(|j| {
                let dir = dir.clone();
                std::thread::spawn(move || update(&dir, &[0], j, true).unwrap())
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let mut got: Vec<u32> = read(&dir, 0).lines().map(|l| l.parse().unwrap()).collect();
        got.sort();
        assert_eq!(got, (0..8).collect::<Vec<_>>());
    }

    #[test]
    fn a_held_lock_times_out_instead_of_hanging() {
        let d = tempfile::tempdir().unwrap();
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(d.path().join(".lock")).unwrap();
        // SAFETY: valid descriptor.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
        let t = Instant::now();
        // flock locks belong to the open file description: a second open conflicts, even in-process.
        let err = update(d.path(), &[0], 1, true).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(4));
    }
}
