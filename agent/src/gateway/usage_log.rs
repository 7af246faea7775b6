//! The usage log: one row per call, success or failure, written off the request path and
//! never lost.
//!
//! How a row travels:
//! 1. [`UsageLog::record`] appends the row as one JSON line to the current journal segment
//!    (`<state_dir>/usage-journal/segment-N.jsonl`, see [`journal`](super::journal)): copied
//!    into a shared file mapping, no fsync, but the bytes are in the kernel's page cache, so
//!    they survive `kill -9` of the agent. Handlers call it before the response leaves, so
//!    every call that got a response has its line.
//! 2. It then hands the row to a bounded channel (`gateway.usage_queue`). When the channel is
//!    full (store slow or down) the row is only in the journal: the segment is marked spilled.
//! 3. The writer task inserts rows in batches, one transaction each, with
//!    `ON CONFLICT (request_id) DO NOTHING` (a replayed row is never counted twice), and
//!    updates the rollups from the rows that were really new.
//! 4. About once a second the writer rotates the segment; when every row of the old segment is
//!    stored (the channel drained, and the file replayed if it spilled) the file is deleted.
//!    Segments left by a crash, or by a store that stayed down through shutdown, are replayed
//!    at the next start.
//!
//! So the store can be down for as long as the disk lasts; memory stays bounded by the queue.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::journal;
use crate::store::Store;

/// One call, as the usage log stores it. Empty strings stand for "not known" (a call refused
/// before its body was read has no requested name).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct UsageRow {
    /// Unique per call (also sent to the client as `x-request-id`).
    pub request_id: String,
    /// When the call arrived, Unix microseconds.
    pub time_us: i64,
    pub user: String,
    /// The API key's app name (`job` for job tokens, `sso` for the SSO header).
    pub app: String,
    pub job_id: Option<i64>,
    pub client_addr: String,
    pub user_agent: String,
    /// The model name the client asked for.
    pub requested_name: String,
    /// The catalog model that served it ("" if none).
    pub resolved_model: String,
    pub model_version: String,
    /// `Resolution::state()`: active, deprecated, retired, unknown, unassigned ("" if the call
    /// failed before resolution).
    pub name_state: String,
    /// The request path, e.g. `/v1/chat/completions`.
    pub route: String,
    pub status: u16,
    /// OpenAI error `code` for failures ("" on success).
    pub error_code: String,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub streamed: bool,
    /// Arrival to the last byte handed to the client, microseconds.
    pub latency_us: i64,
    /// Request sent upstream to the upstream's response headers, microseconds (0: no upstream).
    pub upstream_ttfb_us: i64,
    /// Time spent in the gateway itself (latency minus time waiting for the upstream).
    pub overhead_us: i64,
    /// Where `prompt_tokens`/`completion_tokens` came from.
    pub usage_source: UsageSource,
    /// The LoRA adapter that served the call on `resolved_model`'s worker ("" if none).
    pub adapter: String,
}

/// Where a row's token counts came from (the usage log's `usage_source`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UsageSource {
    /// The worker's own `usage` (a plain answer, a stream's usage chunk, `response.completed`).
    Reported,
    /// The worker reported none in its stream: the completion tokens are the gateway's count
    /// of content deltas (one per token for llama.cpp's server; a lower bound for servers
    /// that batch tokens into a delta); the prompt tokens are unknown (0).
    Counted,
    /// As `Counted`, and the prompt tokens are the count of the worker's tokenize endpoint
    /// (`tokenize_path`) for the prompt's text (for chat: the messages' text, without the
    /// chat template's own tokens).
    Tokenized,
    /// No counts: a failure before the worker answered, or an answer without usage (audio,
    /// images, a server that reports none).
    #[default]
    None,
}

impl UsageSource {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageSource::Reported => "reported",
            UsageSource::Counted => "counted",
            UsageSource::Tokenized => "tokenized",
            UsageSource::None => "none",
        }
    }
}

enum Msg {
    Row(Box<UsageRow>),
    Flush(oneshot::Sender<()>),
    Close,
}

struct Segment {
    seq: u64,
    file: Option<journal::Segment>,
    rows: u64,
    spilled: bool,
    opened: Instant,
}

struct Inner {
    dir: PathBuf,
    segment: Mutex<Segment>,
    spilled: Counter,
    write_failures: Counter,
    /// When shutdown asked the writer to stop (store retries end `CLOSE_DEADLINE` later).
    close_requested: Mutex<Option<Instant>>,
}

/// Handle to the usage log (cheap to share behind `Arc`).
pub struct UsageLog {
    inner: Arc<Inner>,
    tx: mpsc::Sender<Msg>,
    writer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Rows per transaction (a drain takes up to 8 of them).
const BATCH: usize = 500;
/// How long the writer lets rows gather after the first one of a batch.
const LINGER: Duration = Duration::from_millis(50);
/// How often the journal segment is rotated (and a partial batch written).
const TICK: Duration = Duration::from_millis(250);
const ROTATE_AFTER: Duration = Duration::from_secs(1);
/// Bytes of a new journal segment faulted in before calls append to it, at least.
const MIN_PREFAULT: usize = 64 * 1024;
/// How long shutdown keeps retrying a store that is down before leaving rows to the journal.
const CLOSE_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum UsageLogError {
    #[error("cannot create the usage journal {path}: {source} (check paths.state_dir)")]
    Journal { path: String, source: std::io::Error },
}

impl UsageLog {
    /// Opens the journal under `state_dir` and starts the writer (which first replays segments
    /// left by an earlier run).
    pub fn start(state_dir: &Path, store: Store, queue: usize, registry: &mut Registry) -> Result<UsageLog, UsageLogError> {
        let dir = state_dir.join("usage-journal");
        let jerr = |source| UsageLogError::Journal { path: dir.display().to_string(), source };
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(jerr)?;
        let old = journal::list(&dir).map_err(jerr)?;
        let seq = old.iter().map(|(s, _)| *s).max().unwrap_or(0) + 1;
        let file = journal::Segment::create(&dir, seq, MIN_PREFAULT).map_err(jerr)?;
        let spilled = Counter::default();
        let write_failures = Counter::default();
        registry.register(
            "gateway_usage_rows_spilled",
            "Usage rows that found the writer queue full and wait in the on-disk journal",
            spilled.clone(),
        );
        registry.register(
            "gateway_usage_write_failures",
            "Failed usage-log writes (journal or store); rows are retried, not dropped",
            write_failures.clone(),
        );
        let inner = Arc::new(Inner {
            dir,
            segment: Mutex::new(Segment { seq, file: Some(file), rows: 0, spilled: false, opened: Instant::now() }),
            spilled,
            write_failures,
            close_requested: Mutex::new(None),
        });
        let (tx, rx) = mpsc::channel(queue.max(1));
        let handle = tokio::spawn(writer(inner.clone(), rx, store, old));
        Ok(UsageLog { inner, tx, writer: Mutex::new(Some(handle)) })
    }

    /// Records one call. Never blocks on the store; returns once the row is in the journal.
    pub fn record(&self, row: UsageRow) {
        let mut line = match serde_json::to_vec(&row) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(request_id = %row.request_id, error = %e, "cannot serialise a usage row");
                Vec::new()
            }
        };
        line.push(b'\n');
        let mut seg = lock(&self.inner.segment);
        let journaled = match seg.file.as_mut().map(|f| f.append(&line)) {
            Some(Ok(())) => true,
            Some(Err(e)) => {
                self.inner.write_failures.inc();
                tracing::error!(request_id = %row.request_id, error = %e, "cannot append to the usage journal; the row waits in memory only");
                false
            }
            None => false,
        };
        seg.rows += 1;
        match self.tx.try_send(Msg::Row(Box::new(row))) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(Msg::Row(row))) | Err(mpsc::error::TrySendError::Closed(Msg::Row(row))) => {
                seg.spilled = true;
                self.inner.spilled.inc();
                if !journaled {
                    // Neither queue nor journal took it: say so loudly, with the whole row.
                    tracing::error!(row = ?row, "usage row LOST: journal unwritable and queue full");
                }
            }
            Err(_) => {}
        }
    }

    /// Waits until every row recorded so far is in the store (tests, shutdown).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// Writes what is queued and stops the writer. Rows the store could not take within the
    /// deadline stay in the journal for the next start.
    pub async fn close(&self) {
        *lock(&self.inner.close_requested) = Some(Instant::now());
        let _ = self.tx.send(Msg::Close).await;
        let handle = lock(&self.writer).take();
        if let Some(h) = handle
            && let Err(e) = h.await
        {
            tracing::error!(error = %e, "usage-log writer failed");
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

struct Writer {
    inner: Arc<Inner>,
    store: Store,
    failing_since: Option<Instant>,
    /// A batch was given up at shutdown: no segment may be deleted after that.
    gave_up: bool,
}

impl Writer {
    /// Inserts `rows`, retrying with back-off while the store fails. Returns false only when
    /// shutdown's deadline passed (the rows are still in the journal).
    async fn commit(&mut self, rows: &[UsageRow]) -> bool {
        let mut delay = Duration::from_millis(50);
        for chunk in rows.chunks(BATCH) {
            loop {
                match self.store.insert_usage(chunk).await {
                    Ok(_) => {
                        if let Some(since) = self.failing_since.take() {
                            tracing::info!(down_s = since.elapsed().as_secs(), "usage log: the store is back; writing queued rows");
                        }
                        break;
                    }
                    Err(e) => {
                        self.inner.write_failures.inc();
                        if self.failing_since.is_none() {
                            self.failing_since = Some(Instant::now());
                            tracing::warn!(error = %e, rows = chunk.len(), "usage log: the store refused a batch; rows wait in the journal and are retried");
                        }
                        let closing = *lock(&self.inner.close_requested);
                        if closing.is_some_and(|t| t.elapsed() >= CLOSE_DEADLINE) {
                            tracing::warn!("usage log: store still down at shutdown; rows stay in the journal for the next start");
                            self.gave_up = true;
                            return false;
                        }
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(2));
                    }
                }
            }
        }
        true
    }

    /// Replays one segment file and deletes it once everything in it is stored.
    async fn replay(&mut self, path: &Path) -> bool {
        let rows = match journal::read(path) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot read a usage-journal segment; it is kept for inspection");
                return false;
            }
        };
        if !rows.is_empty() && !self.commit(&rows).await {
            return false;
        }
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %e, "cannot delete a replayed usage-journal segment (replaying it again is harmless)");
        }
        true
    }
}

async fn writer(inner: Arc<Inner>, mut rx: mpsc::Receiver<Msg>, store: Store, old: Vec<(u64, PathBuf)>) {
    let mut w = Writer { inner: inner.clone(), store, failing_since: None, gave_up: false };
    if !old.is_empty() {
        tracing::info!(segments = old.len(), "usage log: replaying the journal left by the previous run");
        for (_, path) in &old {
            w.replay(path).await;
        }
    }
    let mut batch: Vec<UsageRow> = Vec::with_capacity(BATCH);
    let mut waiters: Vec<oneshot::Sender<()>> = Vec::new();
    let mut closing = false;
    loop {
        match tokio::time::timeout(TICK, rx.recv()).await {
            Ok(Some(m)) => {
                let first_row = matches!(m, Msg::Row(_));
                take(m, &mut batch, &mut waiters, &mut closing);
                if first_row && !closing && waiters.is_empty() {
                    // Let a batch gather: one transaction per LINGER instead of one per row
                    // (and one wake-up instead of one per row).
                    tokio::time::sleep(LINGER).await;
                }
            }
            Ok(None) => closing = true,
            Err(_) => {}
        }
        while batch.len() < BATCH * 8 {
            match rx.try_recv() {
                Ok(m) => take(m, &mut batch, &mut waiters, &mut closing),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
            w.commit(&batch).await;
            batch.clear();
        }
        let rotate = {
            let seg = lock(&inner.segment);
            closing || (seg.rows > 0 && (!waiters.is_empty() || seg.opened.elapsed() >= ROTATE_AFTER))
        };
        if rotate {
            let last = closing;
            rotate_segment(&mut w, &mut rx, &mut waiters, &mut closing, last).await;
        }
        for tx in waiters.drain(..) {
            let _ = tx.send(());
        }
        if closing {
            break;
        }
    }
    tracing::info!("usage log: writer stopped");
}

fn take(m: Msg, batch: &mut Vec<UsageRow>, waiters: &mut Vec<oneshot::Sender<()>>, closing: &mut bool) {
    match m {
        Msg::Row(r) => batch.push(*r),
        Msg::Flush(tx) => waiters.push(tx),
        Msg::Close => *closing = true,
    }
}

/// Starts a new segment, makes sure every row of the old one is stored, then deletes it.
async fn rotate_segment(
    w: &mut Writer,
    rx: &mut mpsc::Receiver<Msg>,
    waiters: &mut Vec<oneshot::Sender<()>>,
    closing: &mut bool,
    last: bool,
) {
    let inner = w.inner.clone();
    // Only this task rotates, so the number is stable; the file is created and the old one
    // unmapped and truncated outside the lock (calls keep appending meanwhile).
    let (seq, used) = {
        let seg = lock(&inner.segment);
        (seg.seq + 1, seg.file.as_ref().map_or(0, journal::Segment::written))
    };
    let next = if last {
        None
    } else {
        // Room for twice what the last segment took, faulted in on a blocking thread.
        let (dir, prefault) = (inner.dir.clone(), (used * 2).clamp(MIN_PREFAULT, journal::MAP_BYTES));
        match tokio::task::spawn_blocking(move || journal::Segment::create(&dir, seq, prefault)).await {
            Ok(Ok(f)) => Some(f),
            Err(e) => {
                tracing::error!(error = %e, "the task creating a usage-journal segment failed; keeping the current one");
                return;
            }
            Ok(Err(e)) => {
                tracing::error!(dir = %inner.dir.display(), error = %e, "cannot start a new usage-journal segment; keeping the current one");
                return;
            }
        }
    };
    let old = std::mem::replace(&mut *lock(&inner.segment), Segment { seq, file: next, rows: 0, spilled: false, opened: Instant::now() });
    let (old_seq, spilled) = (old.seq, old.spilled);
    if let Some(Err(e)) = old.file.map(journal::Segment::finish) {
        tracing::warn!(dir = %inner.dir.display(), error = %e, "cannot truncate a finished usage-journal segment (its zeroed tail is skipped on replay)");
    }
    // Every row of the old segment that reached the channel is in it now: drain and store.
    let mut rest = Vec::new();
    while let Ok(m) = rx.try_recv() {
        take(m, &mut rest, waiters, closing);
    }
    let stored = w.commit(&rest).await;
    let path = journal::path(&inner.dir, old_seq);
    if !stored || w.gave_up {
        return;
    }
    if spilled {
        w.replay(&path).await;
    } else if let Err(e) = std::fs::remove_file(&path) {
        tracing::warn!(path = %path.display(), error = %e, "cannot delete a written usage-journal segment (replaying it later is harmless)");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::store::testing;

    fn row(i: usize) -> UsageRow {
        UsageRow {
            request_id: format!("req-{i}"),
            time_us: 1_800_000_000_000_000 + i as i64,
            user: "alice".into(),
            status: 200,
            ..UsageRow::default()
        }
    }

    #[tokio::test]
    async fn rows_reach_the_store_and_the_journal_is_emptied() {
        for (store, _d) in testing::stores().await {
            let dir = tempfile::tempdir().unwrap();
            let log = UsageLog::start(dir.path(), store.clone(), 8, &mut Registry::default()).unwrap();
            for i in 0..100 {
                log.record(row(i)); // queue of 8: most rows spill to the journal
            }
            log.flush().await;
            assert_eq!(store.usage_row_count().await.unwrap(), 100);
            log.close().await;
            assert_eq!(journal::list(&dir.path().join("usage-journal")).unwrap().len(), 0);
        }
    }

    #[tokio::test]
    async fn a_journal_left_by_a_crash_is_replayed_exactly_once() {
        for (store, _d) in testing::stores().await {
            let dir = tempfile::tempdir().unwrap();
            let jdir = dir.path().join("usage-journal");
            std::fs::create_dir_all(&jdir).unwrap();
            // rows 0..10 stored already; 0..20 in the journal (as after kill -9), plus a torn line.
            store.insert_usage(&(0..10).map(row).collect::<Vec<_>>()).await.unwrap();
            let mut text = String::new();
            for i in 0..20 {
                text.push_str(&serde_json::to_string(&row(i)).unwrap());
                text.push('\n');
            }
            text.push_str("{\"request_id\":\"torn");
            std::fs::write(journal::path(&jdir, 7), text).unwrap();
            let log = UsageLog::start(dir.path(), store.clone(), 100, &mut Registry::default()).unwrap();
            log.record(row(20));
            log.flush().await;
            assert_eq!(store.usage_row_count().await.unwrap(), 21);
            log.close().await;
            assert!(journal::list(&jdir).unwrap().is_empty());
        }
    }

    #[tokio::test]
    async fn rows_wait_on_disk_while_the_store_is_closed() {
        let dir = tempfile::tempdir().unwrap();
        let db = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", db.path().join("t.db").display());
        let store = Store::open(&url, None).await.unwrap();
        store.close().await; // every insert now fails
        let log = UsageLog::start(dir.path(), store, 4, &mut Registry::default()).unwrap();
        for i in 0..50 {
            log.record(row(i));
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        log.close().await; // gives up after the deadline; rows stay in the journal
        let jdir = dir.path().join("usage-journal");
        let n: usize = journal::list(&jdir).unwrap().iter().map(|(_, p)| journal::read(p).unwrap().len()).sum();
        assert_eq!(n, 50);
        // Next start with a working store: everything arrives.
        let store = Store::open(&url, None).await.unwrap();
        let log = UsageLog::start(dir.path(), store.clone(), 4, &mut Registry::default()).unwrap();
        log.record(row(50));
        log.flush().await;
        assert_eq!(store.usage_row_count().await.unwrap(), 51);
        log.close().await;
    }
}
