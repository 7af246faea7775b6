//! dcgm-exporter's HPC job map (`--hpc-job-mapping-dir`, `telemetry.job_map_dir`) kept from
//! slurmctld's allocations, when job boundaries come from Slurm (`accounting.job_boundaries =
//! "slurm"`, the shipped plugin has no prolog to keep it). One file per GPU index of this node
//! holding the ids of the jobs Slurm lists live on that GPU (whole GPU or shards), one per line;
//! the agent's telemetry reads it too (a whole-GPU job that has not opened CUDA yet).
//!
//! Written after each look at slurmctld (every reconciliation interval), so a job appears and
//! leaves within one interval of its start and end. Each file is replaced atomically (temp +
//! rename) and only when it changes, under the same `<dir>/.lock` the plugin's job-hooks build
//! takes, so dcgm-exporter never reads a half-written file.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use super::slurm::{SlurmState, is_live};

/// GPU index -> ids of the jobs slurmctld lists live on it on one of `nodes`.
pub fn from_slurm(st: &SlurmState, nodes: &BTreeSet<String>) -> BTreeMap<u32, BTreeSet<u32>> {
    let mut map: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
    for j in st.ctld.values().filter(|j| is_live(&j.state)) {
        let Some(idx) = j.alloc_on(nodes).and_then(|a| a.indices) else { continue };
        for gpu in idx.gpus.iter().chain(idx.shards.keys()) {
            map.entry(*gpu).or_default().insert(j.job_id);
        }
    }
    map
}

/// Makes `dir` hold exactly `map`: every GPU file in it lists its jobs; GPU files of GPUs
/// with no job (already in `dir`) are emptied, never removed (dcgm-exporter keeps watching
/// them). Returns how many files changed.
pub fn write(dir: &Path, map: &BTreeMap<u32, BTreeSet<u32>>) -> io::Result<usize> {
    if !dir.is_dir() {
        fs::DirBuilder::new().recursive(true).mode(0o755).create(dir)?;
    }
    let lock = OpenOptions::new().read(true).write(true).create(true).truncate(false).mode(0o600).open(dir.join(".lock"))?;
    // SAFETY: a valid open descriptor; flock has no memory-safety preconditions. Blocking is
    // bounded by the plugin's own 2 s hold limit, and this runs on a blocking-pool thread.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut gpus: BTreeSet<u32> = map.keys().copied().collect();
    for entry in fs::read_dir(dir)? {
        if let Some(i) = entry?.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) {
            gpus.insert(i);
        }
    }
    let mut changed = 0;
    for gpu in gpus {
        let body: String = map.get(&gpu).into_iter().flatten().map(|j| format!("{j}\n")).collect();
        let path = dir.join(gpu.to_string());
        if fs::read_to_string(&path).is_ok_and(|old| old == body) {
            continue;
        }
        let tmp = dir.join(format!(".{gpu}.agent.tmp"));
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).mode(0o644).open(&tmp)?;
        f.write_all(body.as_bytes())?;
        drop(f);
        fs::rename(&tmp, &path)?;
        changed += 1;
    }
    Ok(changed) // the lock is released when `lock` is closed
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn writes_each_gpu_and_empties_the_ones_that_freed() {
        let d = tempfile::tempdir().unwrap();
        let map = BTreeMap::from([(0, BTreeSet::from([7, 9])), (1, BTreeSet::from([8]))]);
        assert_eq!(write(d.path(), &map).unwrap(), 2);
        assert_eq!(fs::read_to_string(d.path().join("0")).unwrap(), "7\n9\n");
        assert_eq!(fs::read_to_string(d.path().join("1")).unwrap(), "8\n");
        assert_eq!(write(d.path(), &map).unwrap(), 0, "unchanged files are not rewritten");
        let map = BTreeMap::from([(0, BTreeSet::from([9]))]);
        assert_eq!(write(d.path(), &map).unwrap(), 2);
        assert_eq!(fs::read_to_string(d.path().join("0")).unwrap(), "9\n");
        assert_eq!(fs::read_to_string(d.path().join("1")).unwrap(), "", "a freed GPU's file stays, empty");
        let names: Vec<String> = fs::read_dir(d.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    }
}
