//! Small helpers shared across modules.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock time in Unix microseconds.
pub fn now_us() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

/// Wall-clock time in Unix seconds.
pub fn now_s() -> i64 {
    now_us() / 1_000_000
}

/// UTC time as `YYYYMMDDTHHMMSSZ` (file names that sort by time and read as dates).
pub fn utc_stamp(unix_s: i64) -> String {
    let (days, secs) = (unix_s.div_euclid(86_400), unix_s.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// UTC time as `YYYY-MM-DD HH:MM:SS UTC`, for messages people read.
pub fn utc_time(unix_s: i64) -> String {
    let (days, secs) = (unix_s.div_euclid(86_400), unix_s.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", secs / 3600, secs % 3600 / 60, secs % 60)
}

/// (year, month, day) for days since 1970-01-01 (H. Hinnant's civil-from-days).
pub fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Writes `bytes` to `path` atomically: a temp file in the same directory, fsync, rename.
/// Readers see the old file or the new one, never half of either.
pub fn write_atomic(path: &std::path::Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    {
        let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)
}

/// Parses durations such as `30d`, `12h`, `15m`, `90s` into seconds.
/// Splits `s` on commas outside `open`..`close` brackets (Slurm lists: `gpu[01-03],cpu1`,
/// `gpu:h200:2(IDX:0,1),shard:h200:7`), trimming each item and dropping empty ones.
pub fn split_outside(s: &str, open: char, close: char) -> Vec<&str> {
    let mut depth = 0i32;
    let mut start = 0;
    let mut items = Vec::new();
    for (i, c) in s.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth -= 1;
        } else if c == ',' && depth == 0 {
            items.push(&s[start..i]);
            start = i + 1;
        }
    }
    items.push(&s[start..]);
    items.into_iter().map(str::trim).filter(|i| !i.is_empty()).collect()
}

pub fn parse_duration_s(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: i64 = num.parse().map_err(|_| format!("`{s}` is not a duration; use e.g. 30d, 12h, 15m or 90s"))?;
    let mult = match unit {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" | "" => 1,
        _ => return Err(format!("`{s}` has an unknown unit `{unit}`; use d, h, m or s")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("`{s}` is too large"))
}

/// Makes user-supplied text safe to print on a terminal (no control characters).
pub fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// Runs `f` on a thread of its own (named `name`, at most 15 bytes) at the scheduler's idle
/// policy, `SCHED_IDLE`, and waits for its answer. For housekeeping that can wait a little
/// (faulting in a usage-journal segment takes milliseconds of CPU): a thread that serves calls
/// and wakes on the same CPU takes it from such a thread at once, where behind a normal thread
/// it would wait for that thread's slice, even with the other CPU idle. On a host with every
/// CPU busy the work still runs, slowly. Where the policy cannot be set, `f` runs at the normal
/// one.
pub async fn run_idle<T: Send + 'static>(name: &str, f: impl FnOnce() -> T + Send + 'static) -> std::io::Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new().name(name.to_string()).spawn(move || {
        let param = libc::sched_param { sched_priority: 0 };
        // SAFETY: sets the calling thread's own policy (pid 0) from a valid parameter.
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
        let _ = tx.send(f());
    })?;
    rx.await.map_err(|_| std::io::Error::other(format!("the {name} thread ended without an answer")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration_s("30d"), Ok(30 * 86_400));
        assert_eq!(parse_duration_s("15m"), Ok(900));
        assert_eq!(parse_duration_s("7"), Ok(7));
        assert!(parse_duration_s("3w").unwrap_err().contains("unknown unit"));
        assert!(parse_duration_s("d").is_err());
    }

    #[test]
    fn atomic_write_replaces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.json");
        write_atomic(&p, b"1", 0o644).unwrap();
        write_atomic(&p, b"22", 0o644).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"22");
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
    }

    #[test]
    fn utc_stamps() {
        assert_eq!(utc_stamp(0), "19700101T000000Z");
        assert_eq!(utc_stamp(1_798_761_599), "20261231T235959Z");
    }

    #[test]
    fn control_chars_are_escaped() {
        assert_eq!(sanitize("a\x1b[31mb"), "a?[31mb");
    }

    #[tokio::test]
    async fn run_idle_runs_at_the_idle_policy_and_answers() {
        // SAFETY: reads the calling thread's own policy.
        let policy = run_idle("gpuhub-test", || unsafe { libc::sched_getscheduler(0) }).await.unwrap();
        assert_eq!(policy, libc::SCHED_IDLE, "the thread runs at SCHED_IDLE");
        // SAFETY: as above, on the test's own thread.
        assert_ne!(unsafe { libc::sched_getscheduler(0) }, libc::SCHED_IDLE, "the caller's policy is unchanged");
    }
}
