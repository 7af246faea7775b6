//! The usage log's on-disk journal: segment files of JSON lines, appended through a shared
//! memory map.
//!
//! A row must be on its way to disk before its call is answered, and a `kill -9` of the
//! agent must not lose it. Bytes copied into a `MAP_SHARED` file mapping are in the page cache
//! the moment the copy ends, exactly like bytes passed to `write()`, so they survive the
//! process; the kernel writes them back like any dirty page (no fsync either way: a machine
//! crash can lose the last seconds, as before). What the map saves is one system call and one
//! filesystem write path per call: measured at ~6 % of the agent's CPU at 2,000 calls/s.
//!
//! A segment is created sparse at [`MAP_BYTES`] and mapped, but rows are copied only into the
//! part whose blocks are *reserved* (`fallocate`): a store into a mapped page the filesystem
//! cannot back (a full disk, a tmpfs at its `size=`) raises SIGBUS and kills the agent, while
//! a reservation that fails is an ordinary error. The writer task reserves and faults in as
//! many bytes as the last second needed ([`Segment::create`]'s `prefault`) off the request
//! path (the first write to a page of a sparse file stalled calls by 3-4 ms on ext4); past
//! that, an append reserves the next [`RESERVE_STEP`] itself. Where a reservation fails, or
//! past the mapped size, rows are appended with `pwrite`, which reports a full disk as
//! `ENOSPC` (the usage log then keeps the row in memory). Readers stop at the first NUL byte
//! of the mapped tail; [`Segment::finish`] truncates the file to what was written.

use std::fs::File;
use std::io::BufRead;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::usage_log::UsageRow;

/// The mapped (sparse) size of a new segment: ~30,000 rows, a busy minute of one node.
pub const MAP_BYTES: usize = 16 << 20;
/// Bytes faulted in by one system call when a segment is created.
const POPULATE_PIECE: usize = 128 << 10;

/// How much more of the map an append reserves when it reaches the end of the reservation.
pub const RESERVE_STEP: usize = 1 << 20;

/// One open segment.
pub struct Segment {
    file: File,
    map: Option<memmap2::MmapMut>,
    len: usize,
    /// Bytes from the start of the file whose blocks are allocated: the map is written only
    /// below this.
    reserved: usize,
}

/// Allocates the blocks of `[from, from + len)` of `file` (its size is already past that).
fn reserve(file: &File, from: usize, len: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(from), libc::off_t::try_from(len)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    // SAFETY: fallocate on a file descriptor this segment owns; mode 0 allocates the range.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, off, n) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

impl Segment {
    /// Creates segment `seq` in `dir` (mode 0600), sized and mapped, with its first
    /// `prefault` bytes faulted in writable.
    pub fn create(dir: &Path, seq: u64, prefault: usize) -> std::io::Result<Segment> {
        let file = std::fs::OpenOptions::new().create(true).truncate(false).read(true).write(true).mode(0o600).open(path(dir, seq))?;
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(usize::MAX);
        if len != 0 {
            // A segment number is never reused; one that exists was left by a crash and is
            // replayed by the writer. Append after it without mapping.
            return Ok(Segment { file, map: None, len, reserved: 0 });
        }
        file.set_len(MAP_BYTES as u64)?;
        let want = prefault.clamp(4096, MAP_BYTES);
        let reserved = match reserve(&file, 0, want) {
            Ok(()) => want,
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // A filesystem that cannot reserve: a map could SIGBUS on it, so plain appends.
                tracing::warn!(path = %path(dir, seq).display(), "the usage-journal filesystem cannot reserve space (fallocate); appending with pwrite");
                file.set_len(0)?;
                return Ok(Segment { file, map: None, len: 0, reserved: 0 });
            }
            Err(e) => {
                // Out of space (or quota): nothing is reserved, every append tries pwrite.
                tracing::warn!(path = %path(dir, seq).display(), error = %e, "cannot reserve space for a usage-journal segment");
                0
            }
        };
        // SAFETY: the file lives in the agent's own 0700 journal directory and only this
        // process writes it while it is mapped; nobody truncates it under the map (`finish`
        // unmaps before it truncates); only reserved bytes are ever stored through the map.
        match unsafe { memmap2::MmapMut::map_mut(&file) } {
            Ok(mut map) => {
                let n = prefault.min(reserved);
                // In pieces: a kernel without preemption lets a woken thread have the CPU only
                // between system calls, and megabytes in one call took milliseconds.
                let populated = (0..n)
                    .step_by(POPULATE_PIECE)
                    .try_for_each(|at| map.advise_range(memmap2::Advice::PopulateWrite, at, POPULATE_PIECE.min(n - at)));
                if populated.is_err() {
                    // Kernels before 5.14: touch one byte per page (writing the zero that
                    // is there).
                    for at in (0..n).step_by(4096) {
                        // SAFETY: `at` is inside the map and the reservation; nothing else
                        // uses the map yet.
                        unsafe { std::ptr::write_volatile(map.as_mut_ptr().add(at), 0) };
                    }
                }
                Ok(Segment { file, map: Some(map), len: 0, reserved })
            }
            Err(e) => {
                // A filesystem without shared mappings: plain appends, one `pwrite` per row.
                tracing::warn!(path = %path(dir, seq).display(), error = %e, "cannot map a usage-journal segment; appending with pwrite");
                file.set_len(0)?;
                Ok(Segment { file, map: None, len: 0, reserved: 0 })
            }
        }
    }

    /// Appends one line (it ends with `\n`). A full disk is an error (`ENOSPC`), never a
    /// signal; the segment stays usable and a later append may succeed once space returns.
    pub fn append(&mut self, line: &[u8]) -> std::io::Result<()> {
        let end = self.len + line.len();
        if let Some(map) = self.map.as_mut()
            && end <= map.len()
        {
            if end > self.reserved {
                let want = (end - self.reserved).max(RESERVE_STEP).min(map.len() - self.reserved);
                if reserve(&self.file, self.reserved, want).is_ok() {
                    self.reserved += want;
                }
            }
            if end <= self.reserved {
                map[self.len..end].copy_from_slice(line);
                self.len = end;
                return Ok(());
            }
        }
        // Past the map or the reservation: the filesystem allocates (or refuses) the blocks.
        self.file.write_all_at(line, self.len as u64)?;
        self.len = end;
        Ok(())
    }

    /// Bytes written so far.
    pub fn written(&self) -> usize {
        self.len
    }

    /// Unmaps the segment and cuts the file to what was written.
    pub fn finish(mut self) -> std::io::Result<()> {
        if self.map.take().is_some() {
            self.file.set_len(self.len as u64)?;
        }
        Ok(())
    }
}

/// The file of segment `seq`.
pub fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("segment-{seq:016}.jsonl"))
}

/// The segments in `dir`, oldest first.
pub fn list(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(seq) = name.strip_prefix("segment-").and_then(|s| s.strip_suffix(".jsonl")).and_then(|s| s.parse::<u64>().ok()) {
            out.push((seq, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// Reads a segment's rows. The zeroed tail of a segment the agent did not finish (kill -9)
/// ends it; a torn line (the copy was cut off, so its call was never answered) is skipped and
/// logged.
pub fn read(path: &Path) -> std::io::Result<Vec<UsageRow>> {
    let mut rows = Vec::new();
    each_line(path, |n, line| match serde_json::from_slice::<UsageRow>(line) {
        Ok(r) => rows.push(r),
        Err(e) => tracing::warn!(path = %path.display(), line = n, error = %e, "skipping an unreadable usage-journal line"),
    })?;
    Ok(rows)
}

/// A segment's lines, as [`read`] finds them, without reading the rows.
pub fn count(path: &Path) -> std::io::Result<u64> {
    let mut n = 0;
    each_line(path, |_, _| n += 1)?;
    Ok(n)
}

/// Calls `each` with every non-empty line of a segment (its number from 1, its bytes) up to
/// the zeroed tail.
fn each_line(path: &Path, mut each: impl FnMut(usize, &[u8])) -> std::io::Result<()> {
    let f = File::open(path)?;
    for (i, line) in std::io::BufReader::new(f).split(b'\n').enumerate() {
        let line = line?;
        let line = match line.iter().position(|b| *b == 0) {
            Some(0) => break,
            Some(n) => &line[..n],
            None => &line[..],
        };
        if !line.is_empty() {
            each(i + 1, line);
        }
    }
    Ok(())
}

/// A small filesystem to fill up in tests: a tmpfs with a `size=` limit on a fresh directory
/// (needs root to mount; `tests/run-all.sh` runs the tests as root).
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
pub(crate) mod small_fs {
    use std::path::{Path, PathBuf};

    pub struct Tmpfs {
        dir: tempfile::TempDir,
    }

    impl Tmpfs {
        /// Mounts a tmpfs of `size` (e.g. "2m"); `None` (with a note) when not root, except
        /// under `GPUHUB_TEST_STRICT=1`, where that fails the test.
        pub fn mount(test: &str, size: &str) -> Option<Tmpfs> {
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                if std::env::var("GPUHUB_TEST_STRICT").as_deref() == Ok("1") {
                    panic!("{test}: needs root to mount a small tmpfs (GPUHUB_TEST_STRICT=1: run the tests as root)");
                }
                eprintln!("{test}: not root, cannot mount a small tmpfs; left out");
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let st = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(st.success(), "{test}: mount -t tmpfs failed");
            Some(Tmpfs { dir })
        }

        pub fn path(&self) -> &Path {
            self.dir.path()
        }

        /// Writes a filler file until the filesystem is full; returns its path.
        pub fn fill(&self) -> PathBuf {
            use std::io::Write;
            let path = self.path().join("filler");
            let mut f = std::fs::File::create(&path).unwrap();
            let block = vec![0x55u8; 4096];
            loop {
                if let Err(e) = f.write_all(&block) {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "filling the tmpfs: {e}");
                    return path;
                }
            }
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg("-l").arg(self.dir.path()).status();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn a_full_filesystem_is_an_error_not_a_signal_and_appends_resume_when_space_returns() {
        let Some(fs) = small_fs::Tmpfs::mount("journal full-disk test", "1m") else { return };
        let mut s = Segment::create(fs.path(), 1, 8192).unwrap();
        let filler = fs.fill();
        // Past the reservation every append must fail with ENOSPC (a store into an unbacked
        // page of the map would kill the test process with SIGBUS instead).
        let mut ok = 0;
        let err = loop {
            match s.append(&line(&format!("r{ok}"))) {
                Ok(()) => ok += 1,
                Err(e) => break e,
            }
            assert!(ok < 100_000, "the filesystem never filled up");
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(s.append(&line("still-full")).is_err());
        std::fs::remove_file(filler).unwrap();
        s.append(&line("after")).unwrap();
        s.finish().unwrap();
        let ids: Vec<String> = read(&path(fs.path(), 1)).unwrap().into_iter().map(|r| r.request_id).collect();
        assert_eq!(ids.len(), ok + 1, "every row that was accepted reads back, nothing else");
        assert_eq!(ids.last().map(String::as_str), Some("after"));
        // A segment created on a full filesystem has nothing reserved and refuses rows too.
        let filler = fs.fill();
        let mut full = Segment::create(fs.path(), 2, 8192).unwrap();
        assert!(full.append(&line("x")).is_err());
        std::fs::remove_file(filler).unwrap();
        full.append(&line("y")).unwrap();
        full.finish().unwrap();
        assert_eq!(read(&path(fs.path(), 2)).unwrap().len(), 1);
    }

    fn line(id: &str) -> Vec<u8> {
        let mut l = serde_json::to_vec(&UsageRow { request_id: id.into(), ..UsageRow::default() }).unwrap();
        l.push(b'\n');
        l
    }

    #[test]
    fn an_unfinished_segment_reads_back_up_to_its_zeroed_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Segment::create(dir.path(), 1, 8192).unwrap();
        s.append(&line("a")).unwrap();
        s.append(&line("b")).unwrap();
        // As after kill -9: the file is still MAP_BYTES long, its tail zero.
        assert_eq!(std::fs::metadata(path(dir.path(), 1)).unwrap().len(), MAP_BYTES as u64);
        let ids: Vec<String> = read(&path(dir.path(), 1)).unwrap().into_iter().map(|r| r.request_id).collect();
        assert_eq!(ids, ["a", "b"]);
        drop(s);
    }

    #[test]
    fn rows_past_the_map_are_appended_and_finish_truncates() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Segment::create(dir.path(), 2, 0).unwrap();
        let l = line("x");
        let n = MAP_BYTES / l.len() + 3;
        for _ in 0..n {
            s.append(&l).unwrap();
        }
        s.finish().unwrap();
        assert_eq!(std::fs::metadata(path(dir.path(), 2)).unwrap().len(), (n * l.len()) as u64);
        assert_eq!(read(&path(dir.path(), 2)).unwrap().len(), n);
    }

    #[test]
    fn a_torn_line_is_skipped_and_an_existing_segment_is_appended_to() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = line("a");
        text.extend_from_slice(b"{\"request_id\":\"torn\n");
        std::fs::write(path(dir.path(), 3), &text).unwrap();
        let mut s = Segment::create(dir.path(), 3, MAP_BYTES).unwrap();
        s.append(&line("c")).unwrap();
        s.finish().unwrap();
        let ids: Vec<String> = read(&path(dir.path(), 3)).unwrap().into_iter().map(|r| r.request_id).collect();
        assert_eq!(ids, ["a", "c"]);
    }
}
