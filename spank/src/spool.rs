//! Writes usage records into the spool, durably and atomically (layout: `gpuhub_wire::spool`).
//!
//! One record per file: `<spool>/records/.<name>.tmp` is written, renamed to `<name>`, so the
//! agent sees a whole record or none. No hook waits on the agent: a stopped agent simply
//! finds the files later (they live in the page cache and on disk, not in the agent).
//!
//! Durability ([`Sync`]): an `fsync` of the file and of the directory costs ~7 ms on the lab's
//! disk, and srun waits for slurmstepd's hooks (StepStart, StepEnd) and, in the job-hooks build,
//! for the prolog (JobStart): fsyncing those added +15 ms to every `srun -N1 true` (+7 ms with
//! StepEnd alone), against a +5 ms budget (BENCHMARKS.md). So by default records are only
//! renamed into place and reach the disk through normal writeback (seconds). That loses nothing
//! the bill needs: job boundaries and allocations are Slurm's (slurmctld's state save and
//! slurmdbd), and the agent fills in from Slurm a job whose records a node crash took. In the
//! job-hooks build the epilog, which runs after srun has returned, `fsync`s all of the job's
//! record files still in the spool, JobEnd included, and the directory once
//! ([`sync_job_records`]). `fsync=all` on the plugstack line makes every record durable before
//! its hook returns.
//!
//! A write that fails (read-only or full file system) removes its temp file and returns the
//! error; the caller logs it with the whole record, so nothing is lost silently.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use gpuhub_wire::spool::{RECORDS_DIR, Record, record_file_name};

/// How durable a record must be when `write_record` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sync {
    /// Visible to the agent (renamed into place); on disk after normal writeback.
    Visible,
    /// `fsync` of the file and the directory before returning.
    Durable,
}

/// Writes `rec` into `<spool_dir>/records/` and returns the committed path.
pub fn write_record(spool_dir: &Path, rec: &Record, sync: Sync) -> io::Result<PathBuf> {
    let dir = spool_dir.join(RECORDS_DIR);
    if !dir.is_dir() {
        // First record on a node without the agent's package: create the spool (root only).
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
    }
    let name = record_file_name(rec, std::process::id());
    let tmp = dir.join(format!(".{name}.tmp"));
    let dst = dir.join(&name);
    let result = write_then_rename(&tmp, &dst, rec.to_json().as_bytes(), sync);
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    if sync == Sync::Durable {
        // The rename is durable only once the directory entry is on disk.
        File::open(&dir)?.sync_all()?;
    }
    Ok(dst)
}

fn write_then_rename(tmp: &Path, dst: &Path, body: &[u8], sync: Sync) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp)?;
    f.write_all(body)?;
    f.write_all(b"\n")?;
    if sync == Sync::Durable {
        f.sync_all()?;
    }
    drop(f);
    fs::rename(tmp, dst)
}

/// Makes the earlier records of one job on this node durable: `fsync`s each of its files
/// still in the spool (the agent may have ingested some already) and the directory. Run in
/// the epilog. Per-file rather than `syncfs`, which would wait for every dirty page of the
/// file system (measured up to 1 s on a busy build machine). Returns how many were synced.
pub fn sync_job_records(spool_dir: &Path, node: &str, job_id: u32) -> io::Result<usize> {
    let dir = spool_dir.join(RECORDS_DIR);
    let job_prefix = format!("{}_{job_id}", node.replace([':', '/'], "_"));
    let mut n = 0;
    for entry in fs::read_dir(&dir)? {
        let name = entry?.file_name();
        let name = name.to_string_lossy();
        // `<time>-<node>_<job>_<kind>-<pid>.json` or `<time>-<node>_<job>.<step>_<kind>-<pid>.json`
        let Some((_, rest)) = name.split_once('-') else { continue };
        let ours = rest.strip_prefix(&job_prefix).is_some_and(|tail| tail.starts_with('_') || tail.starts_with('.'));
        if ours && name.ends_with(".json") {
            match File::open(dir.join(name.as_ref())) {
                Ok(f) => {
                    f.sync_all()?;
                    n += 1;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {} // ingested meanwhile
                Err(e) => return Err(e),
            }
        }
    }
    File::open(&dir)?.sync_all()?;
    Ok(n)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;
    use gpuhub_wire::spool::{JobIdentity, RECORD_VERSION};

    fn rec_at(time_us: i64) -> Record {
        let job = JobIdentity { job_id: 1, uid: 0, user: "root".into(), account: None, partition: None, node: "n".into() };
        Record::JobStart { v: RECORD_VERSION, time_us, job, gpus: vec![] }
    }

    fn rec() -> Record {
        rec_at(123)
    }

    #[test]
    fn writes_parseable_files_and_no_temp_files() {
        let d = tempfile::tempdir().unwrap();
        let path = write_record(d.path(), &rec(), Sync::Durable).unwrap();
        write_record(d.path(), &rec_at(124), Sync::Visible).unwrap();
        assert_eq!(sync_job_records(d.path(), "n", 1).unwrap(), 2);
        assert_eq!(sync_job_records(d.path(), "n", 11).unwrap(), 0, "job 11 is not job 1");
        assert!(path.starts_with(d.path().join("records")));
        let names: Vec<_> = fs::read_dir(d.path().join("records")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.iter().all(|n| !n.to_string_lossy().starts_with('.')), "no temp files: {names:?}");
        assert_eq!(Record::parse(&fs::read(&path).unwrap()).unwrap(), rec());
    }

    #[test]
    fn an_unusable_spool_is_an_error_not_a_panic() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("not-a-dir");
        fs::write(&file, b"x").unwrap();
        assert!(write_record(&file, &rec(), Sync::Durable).is_err());
    }
}
