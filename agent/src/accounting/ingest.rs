//! The spool ingest task (see the module docs of [`crate::accounting`] for the exactly-once
//! argument). One task, one file at a time, in name order (names start with the record time).

use std::collections::{BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use gpuhub_wire::spool::{QUARANTINE_DIR, RECORDS_DIR, Record};
use tokio_util::sync::CancellationToken;

use super::{AccountingMetrics, GpuView, KindLabels, db};
use crate::store::Store;

/// A record file larger than this is not a record (the plugin writes < 2 KiB).
const MAX_RECORD_BYTES: u64 = 1024 * 1024;
/// How often the heartbeat (the "agent was alive at" time used to close jobs lost in a reboot)
/// is written.
const HEARTBEAT_EVERY: Duration = Duration::from_secs(30);
const SETTING_HEARTBEAT: &str = "accounting.heartbeat_us";
const SETTING_NODES: &str = "accounting.local_nodes";

/// What one pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PassReport {
    pub ingested: u64,
    pub duplicates: u64,
    pub quarantined: u64,
    /// Files left for the next pass (a store error stopped this one).
    pub left: u64,
}

/// Ingests the spool into the store.
pub struct Ingestor {
    store: Store,
    spool_dir: PathBuf,
    gpus: Arc<dyn GpuView>,
    metrics: AccountingMetrics,
    /// Nodes whose records this spool carried (persisted), for closing jobs after a reboot.
    nodes: BTreeSet<String>,
    /// Files whose quarantine failed; logged once.
    stuck: HashSet<String>,
}

impl std::fmt::Debug for Ingestor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ingestor").field("spool_dir", &self.spool_dir).finish_non_exhaustive()
    }
}

impl Ingestor {
    pub fn new(store: Store, spool_dir: impl Into<PathBuf>, gpus: Arc<dyn GpuView>, metrics: AccountingMetrics) -> Self {
        Self { store, spool_dir: spool_dir.into(), gpus, metrics, nodes: BTreeSet::new(), stuck: HashSet::new() }
    }

    /// Runs until `shutdown`: drain the spool, close jobs lost in a reboot, then a pass every
    /// `interval`. Finishes the file in hand before returning (a pass never stops mid-file).
    pub async fn run(mut self, interval: Duration, shutdown: CancellationToken) {
        let heartbeat_before = match self.store.get_setting(SETTING_HEARTBEAT).await {
            Ok(v) => v.and_then(|s| s.parse::<i64>().ok()),
            Err(e) => {
                tracing::warn!("accounting: cannot read the heartbeat: {e}");
                None
            }
        };
        if let Ok(Some(nodes)) = self.store.get_setting(SETTING_NODES).await {
            self.nodes.extend(nodes.split(',').filter(|n| !n.is_empty()).map(str::to_string));
        }
        self.pass().await;
        match boot_time_us() {
            Some(boot) => self.close_after_reboot(boot, heartbeat_before).await,
            None => tracing::warn!("accounting: cannot read the boot time from /proc/stat; jobs lost in a reboot stay open"),
        }
        let mut last_heartbeat = None::<tokio::time::Instant>;
        loop {
            if last_heartbeat.is_none_or(|t| t.elapsed() >= HEARTBEAT_EVERY) {
                if let Err(e) = self.store.set_setting(SETTING_HEARTBEAT, &crate::util::now_us().to_string()).await {
                    tracing::warn!("accounting: cannot write the heartbeat: {e}");
                }
                last_heartbeat = Some(tokio::time::Instant::now());
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(interval) => {}
            }
            self.pass().await;
        }
        tracing::info!("accounting: ingest stopped");
    }

    /// Closes this spool's jobs that started before `boot_us` and never ended.
    pub async fn close_after_reboot(&mut self, boot_us: i64, heartbeat_us: Option<i64>) {
        let nodes: Vec<String> = self.nodes.iter().cloned().collect();
        match db::close_jobs_lost_in_reboot(self.store.pool(), &nodes, boot_us, heartbeat_us).await {
            Ok(closed) => {
                for (node, job) in closed {
                    tracing::warn!("accounting: job {job} on {node}: {}", super::Anomaly::NeverEnded.explain());
                    self.metrics.anomalies.get_or_create(&KindLabels { kind: super::Anomaly::NeverEnded.as_str().into() }).inc();
                }
            }
            Err(e) => {
                tracing::error!("accounting: closing jobs lost in a reboot failed: {e}; retried at the next start");
                self.metrics.ingest_errors.inc();
            }
        }
    }

    /// One pass over the spool.
    pub async fn pass(&mut self) -> PassReport {
        let mut report = PassReport::default();
        let dir = self.spool_dir.join(RECORDS_DIR);
        let mut names = match list_records(&dir) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::error!("accounting: cannot read the spool {}: {e} (check spool_dir and its permissions)", dir.display());
                self.metrics.ingest_errors.inc();
                return report;
            }
        };
        names.sort();
        let total = names.len() as u64;
        for (i, name) in names.iter().enumerate() {
            let path = dir.join(name);
            match self.ingest_file(&path, name).await {
                Ok(Outcome::Ingested) => report.ingested += 1,
                Ok(Outcome::Duplicate) => report.duplicates += 1,
                Ok(Outcome::Quarantined) => report.quarantined += 1,
                Ok(Outcome::Gone) => {}
                Err(e) => {
                    tracing::error!("accounting: store error while ingesting {}: {e}; the file stays and is retried", path.display());
                    self.metrics.ingest_errors.inc();
                    report.left = total - i as u64;
                    break;
                }
            }
        }
        self.metrics.backlog.set(i64::try_from(report.left).unwrap_or(i64::MAX));
        self.metrics.last_pass.set(crate::util::now_us() as f64 / 1e6);
        if report != PassReport::default() {
            tracing::debug!(?report, "accounting: ingest pass");
        }
        report
    }

    async fn ingest_file(&mut self, path: &Path, name: &str) -> Result<Outcome, sqlx::Error> {
        let bytes = match read_capped(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Outcome::Gone),
            Err(e) => return Ok(self.quarantine(path, name, &format!("cannot read: {e}"))),
        };
        let rec = match Record::parse(&bytes) {
            Ok(r) => r,
            Err(reason) => return Ok(self.quarantine(path, name, &reason)),
        };
        let stats = match &rec {
            Record::JobEnd { job, .. } => self.gpus.job_gpu_stats(job.job_id),
            _ => Vec::new(),
        };
        let known = self.gpus.known_gpus();
        let outcome = match db::ingest_record(self.store.pool(), &rec, known.as_ref(), &stats, crate::util::now_us()).await? {
            None => {
                self.metrics.duplicates.inc();
                tracing::debug!("accounting: {name} was already ingested (re-read after a restart); removing it");
                Outcome::Duplicate
            }
            Some(anomalies) => {
                self.metrics.ingested.get_or_create(&KindLabels { kind: rec.kind().into() }).inc();
                for a in anomalies {
                    self.metrics.anomalies.get_or_create(&KindLabels { kind: a.as_str().into() }).inc();
                    tracing::warn!("accounting: job {} on {} ({}): {}", rec.job().job_id, rec.job().node, rec.kind(), a.explain());
                }
                Outcome::Ingested
            }
        };
        self.remember_node(&rec.job().node).await;
        // Only now, after the commit: a crash before this line re-reads the file as a duplicate.
        if let Err(e) = std::fs::remove_file(path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!("accounting: ingested {} but cannot remove it: {e}; it will be skipped as a duplicate", path.display());
        }
        Ok(outcome)
    }

    async fn remember_node(&mut self, node: &str) {
        if node.is_empty() || self.nodes.contains(node) {
            return;
        }
        self.nodes.insert(node.to_string());
        let list = self.nodes.iter().cloned().collect::<Vec<_>>().join(",");
        if let Err(e) = self.store.set_setting(SETTING_NODES, &list).await {
            tracing::warn!("accounting: cannot remember node {node}: {e}");
        }
    }

    /// Moves a file that is not a record to `<spool>/quarantine/` with a `.reason` beside it.
    fn quarantine(&mut self, path: &Path, name: &str, reason: &str) -> Outcome {
        let qdir = self.spool_dir.join(QUARANTINE_DIR);
        let moved = std::fs::create_dir_all(&qdir).and_then(|()| {
            std::fs::write(
                qdir.join(format!("{name}.reason")),
                format!("{reason}\nquarantined at unix time {} by gpuhub-agent\n", crate::util::now_s()),
            )?;
            std::fs::rename(path, qdir.join(name))
        });
        match moved {
            Ok(()) => {
                self.metrics.quarantined.inc();
                tracing::warn!(
                    "accounting: spool file {name} is not a usage record ({reason}); moved to {} (inspect it, then delete it or fix and move it back)",
                    qdir.display()
                );
                Outcome::Quarantined
            }
            Err(e) => {
                if self.stuck.insert(name.to_string()) {
                    tracing::error!(
                        "accounting: spool file {name} is not a usage record ({reason}) and cannot be moved to {}: {e}; it stays in place",
                        qdir.display()
                    );
                }
                Outcome::Gone
            }
        }
    }
}

enum Outcome {
    Ingested,
    Duplicate,
    Quarantined,
    /// Vanished or could not be quarantined: nothing changed.
    Gone,
}

/// Committed record files: `*.json`, not the plugin's `.tmp` files in flight.
fn list_records(dir: &Path) -> std::io::Result<Vec<String>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        if entry.file_type().map(|t| t.is_file()).unwrap_or(false) {
            out.push(name);
        }
    }
    Ok(out)
}

fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    let meta = std::fs::metadata(path)?;
    if meta.len() > MAX_RECORD_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{} bytes is larger than any record ({MAX_RECORD_BYTES} max)", meta.len()),
        ));
    }
    std::fs::read(path)
}

/// Boot time (Unix microseconds) from `/proc/stat`'s `btime`.
pub fn boot_time_us() -> Option<i64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs: i64 = stat.lines().find_map(|l| l.strip_prefix("btime "))?.trim().parse().ok()?;
    Some(secs * 1_000_000)
}
