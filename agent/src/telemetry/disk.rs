//! Free space where the agent keeps what must not be lost: `gpuhub_disk_free_bytes{dir,path}`
//! and `gpuhub_disk_size_bytes{dir,path}` for the state directory (the SQLite store, the usage
//! journal, the job key) and the spool (the plugin's records). A full state disk stops the
//! store and the usage journal; a full spool makes the plugin's records fail to land.
//!
//! A [`Collector`]: `statvfs(2)` on two paths costs microseconds, so it runs at scrape time and
//! is never stale. "Free" is what an unprivileged process may still use (`f_bavail`), the
//! conservative figure. A path that cannot be read (removed, not mounted) has no series
//! (`gpuhub doctor` says why).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Unit;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirLabels {
    dir: &'static str,
    path: String,
}

/// The directories to watch: (`dir` label, path).
#[derive(Debug)]
pub struct DirSpace {
    dirs: Vec<(&'static str, PathBuf)>,
}

impl DirSpace {
    pub fn new(dirs: Vec<(&'static str, PathBuf)>) -> Self {
        Self { dirs }
    }
}

/// (available to unprivileged users, total) bytes of the filesystem holding `path`.
pub fn space(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs writes into the zeroed struct we own; `c` is a NUL-terminated path that
    // outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let frsize = if st.f_frsize > 0 { st.f_frsize } else { st.f_bsize };
    Ok((st.f_bavail.saturating_mul(frsize), st.f_blocks.saturating_mul(frsize)))
}

impl Collector for DirSpace {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let found: Vec<(DirLabels, (u64, u64))> = self
            .dirs
            .iter()
            .filter_map(|(dir, path)| space(path).ok().map(|s| (DirLabels { dir, path: path.display().to_string() }, s)))
            .collect();
        type Pick = fn((u64, u64)) -> u64;
        let families: [(&str, &str, Pick); 2] = [
            ("disk_free", "Space left for unprivileged writers on the filesystem of the agent's directory (state, spool)", |s| s.0),
            ("disk_size", "Size of the filesystem of the agent's directory (state, spool)", |s| s.1),
        ];
        for (name, help, pick) in families {
            let mut family = encoder.encode_descriptor(name, help, Some(&Unit::Bytes), prometheus_client::metrics::MetricType::Gauge)?;
            for (labels, s) in &found {
                let g = ConstGauge::new(i64::try_from(pick(*s)).unwrap_or(i64::MAX));
                g.encode(family.encode_family(labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn free_and_size_of_each_dir_and_nothing_for_a_missing_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Registry::default();
        r.sub_registry_with_prefix("gpuhub").register_collector(Box::new(DirSpace::new(vec![
            ("state", dir.path().to_path_buf()),
            ("spool", PathBuf::from("/nonexistent/gpuhub-spool")),
        ])));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &r).unwrap();
        let path = dir.path().display();
        let val = |name: &str| -> f64 {
            let prefix = format!("{name}{{dir=\"state\",path=\"{path}\"}} ");
            text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {prefix} in {text}")).parse().unwrap()
        };
        let (free, size) = (val("gpuhub_disk_free_bytes"), val("gpuhub_disk_size_bytes"));
        assert!(size > 0.0 && free <= size, "{text}");
        let (f, s) = space(dir.path()).unwrap();
        assert_eq!(s as f64, size);
        assert!((f as f64 - free).abs() < 64.0 * 1024.0 * 1024.0, "free moved a lot between two reads: {f} vs {free}");
        assert!(!text.contains("dir=\"spool\""), "an unreadable path has no series: {text}");
    }
}
