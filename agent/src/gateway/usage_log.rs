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
//!
//! When the journal cannot take a row (the state directory's filesystem is full: the journal
//! reserves its blocks, so that is an error, never a signal), the row waits in memory for the
//! writer instead. At most `gateway.usage_queue` rows wait so; then [`UsageLog::accepting`]
//! turns false and the gateway refuses new calls with a 503 that says why, so no call it
//! answers goes unaccounted. Once space returns (or the store takes them) they are written.
//!
//! A row the store refuses for what it holds (PostgreSQL refuses a NUL byte in text, a site's
//! constraint, ...; see [`crate::store::gateway::refuses_rows`]) would be refused at every
//! retry and stall every row behind it. The writer splits a refused batch until it finds the
//! row(s), writes each to the dead-letter file `<state_dir>/usage-dead-letter.jsonl` with the
//! store's reason (`gateway_usage_rows_dead_lettered_total`, `gpuhub doctor`), and stores the
//! rest.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::journal;
use crate::store::gateway::UsageConnection;
use crate::store::{Backend, Store};

/// The dead-letter file in the state directory.
pub const DEAD_LETTER_FILE: &str = "usage-dead-letter.jsonl";

/// One call, as the usage log stores it. Empty strings stand for "not known" (a call refused
/// before its body was read has no requested name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
    /// `Resolution::state()`: active, deprecated, retired, unknown, unassigned, unserved ("" if the call
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
    /// How many calls this row stands for: 1, except for the one row per peer and minute that
    /// sums up refused unauthenticated calls ([`super::refusals`]).
    pub calls: i64,
    /// The API key's id ("" for job tokens, the SSO header and refusals): its own limits
    /// (`gateway::fair_use`) are reloaded from these rows.
    pub key_id: String,
}

impl Default for UsageRow {
    fn default() -> Self {
        UsageRow {
            request_id: String::new(),
            time_us: 0,
            user: String::new(),
            app: String::new(),
            job_id: None,
            client_addr: String::new(),
            user_agent: String::new(),
            requested_name: String::new(),
            resolved_model: String::new(),
            model_version: String::new(),
            name_state: String::new(),
            route: String::new(),
            status: 0,
            error_code: String::new(),
            prompt_tokens: 0,
            completion_tokens: 0,
            streamed: false,
            latency_us: 0,
            upstream_ttfb_us: 0,
            overhead_us: 0,
            usage_source: UsageSource::None,
            adapter: String::new(),
            calls: 1,
            key_id: String::new(),
        }
    }
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
    /// Answered once every row recorded before it is stored, those only the journal holds too
    /// (it rotates the segment): [`UsageLog::flush`].
    Flush(oneshot::Sender<()>),
    /// Answered once the rows queued before it are stored, without a rotation:
    /// [`UsageLog::settle`].
    Settle(oneshot::Sender<()>),
    Close,
}

/// Someone waiting for the writer's next pass to store what it holds.
struct Waiter {
    tx: oneshot::Sender<()>,
    /// A [`Msg::Flush`]: the pass rotates the segment, so the rows that only the journal holds
    /// are stored too.
    journal: bool,
}

struct Segment {
    seq: u64,
    file: Option<journal::Segment>,
    rows: u64,
    /// Rows of this segment that found the writer's queue full: replayed from the file.
    spilled: u64,
    opened: Instant,
}

struct Inner {
    dir: PathBuf,
    segment: Mutex<Segment>,
    spilled: Counter,
    write_failures: Counter,
    /// Rows recorded and not yet stored (queued, spilled to the journal, in memory, or in
    /// segments left by an earlier run).
    waiting: Gauge,
    /// Since when the store refuses the writer's batches (Unix µs; 0: it does not). Only the
    /// writer sets it.
    failing_since_us: AtomicI64,
    /// When shutdown asked the writer to stop (store retries end `CLOSE_DEADLINE` later).
    close_requested: Mutex<Option<Instant>>,
    /// Rows the journal could not take, until the writer takes them.
    memory: Mutex<Vec<UsageRow>>,
    /// Rows held in memory only (in `memory` or in the writer's hands) until they are stored.
    memory_only: AtomicUsize,
    memory_gauge: Gauge,
    /// Most rows that may wait in memory only (`gateway.usage_queue`).
    memory_cap: usize,
    /// The last append to the journal failed.
    journal_failing: AtomicBool,
    journal_gauge: Gauge,
    dead: DeadLetters,
}

/// Rows the store refused, kept in a file with the reason.
struct DeadLetters {
    path: PathBuf,
    /// Lines in the file (those found at start included).
    count: AtomicU64,
    last_reason: Mutex<Option<String>>,
    counter: Counter,
}

impl DeadLetters {
    /// Appends `row` with `reason`; says so in the log (the row itself too, if the file cannot
    /// take it: then the log is the only place left).
    fn keep(&self, row: &UsageRow, reason: &str) {
        self.counter.inc();
        self.count.fetch_add(1, Ordering::Relaxed);
        *lock(&self.last_reason) = Some(reason.to_string());
        let mut line =
            serde_json::to_vec(&serde_json::json!({"time_us": crate::util::now_us(), "reason": reason, "row": row})).unwrap_or_default();
        line.push(b'\n');
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&self.path)
            .and_then(|mut f| std::io::Write::write_all(&mut f, &line));
        match written {
            Ok(()) => tracing::error!(
                request_id = %row.request_id, reason, path = %self.path.display(),
                "the store refused a usage row; it is kept in the dead-letter file and the other rows are written"
            ),
            Err(e) => tracing::error!(
                row = ?row, reason, path = %self.path.display(), error = %e,
                "the store refused a usage row and the dead-letter file cannot take it: the row is only in this log line"
            ),
        }
    }
}

/// The usage log's state for `gpuhub doctor` (`/v1/status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageHealth {
    /// Rows in the dead-letter file.
    pub dead_letters: u64,
    pub dead_letter_path: PathBuf,
    pub last_reason: Option<String>,
    /// Rows waiting in memory only (the journal could not take them).
    pub memory_only: usize,
    pub memory_cap: usize,
    /// The last append to the journal failed (a full disk).
    pub journal_failing: bool,
    pub journal_dir: PathBuf,
    /// Rows recorded and not yet in the store.
    pub waiting: i64,
    /// Since when the store refuses the writer's batches (Unix µs), if it does.
    pub store_failing_since_us: Option<i64>,
}

/// Handle to the usage log (cheap to share behind `Arc`).
pub struct UsageLog {
    inner: Arc<Inner>,
    tx: mpsc::Sender<Msg>,
    writer: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Rows per transaction (a drain takes up to 8 of them).
const BATCH: usize = 500;
/// How long the writer lets rows gather after the first one of a batch, per backend.
///
/// On PostgreSQL a batch's insert is a burst of the store server's work on the node's cores:
/// 50 ms (~100 rows at 2,000 calls/s, about 1.5 ms of PostgreSQL) put +1.46-1.61 ms on the
/// two-node gateway's p99 where 10 ms (~20 rows) put +0.77-1.25 ms, for ~0.01 CPU-s more per
/// 1,000 calls (BENCHMARKS.md, "Smaller batches"). On SQLite the store's work is the agent's
/// own, and most of a batch's is its commit (a WAL append of every page it touched, several
/// messages to the database thread): 100 ms cost the single-node gateway ~20 % less CPU per
/// call than 10 ms, at no higher p99 (BENCHMARKS.md, "SQLite batches every 100 ms").
fn linger(backend: Backend) -> Duration {
    match backend {
        Backend::Postgres => Duration::from_millis(10),
        Backend::Sqlite => Duration::from_millis(100),
    }
}
/// How often the journal segment is rotated (and a partial batch written).
const TICK: Duration = Duration::from_millis(250);
const ROTATE_AFTER: Duration = Duration::from_secs(1);
/// The thread that creates and finishes journal segments ([`crate::util::run_idle`]).
const JOURNAL_THREAD: &str = "gpuhub-journal";
/// Bytes of a new journal segment faulted in before calls append to it, at least.
const MIN_PREFAULT: usize = 64 * 1024;
/// How long shutdown keeps retrying a store that is down before leaving rows to the journal.
const CLOSE_DEADLINE: Duration = Duration::from_secs(10);
/// How often the writer adds the rows it stored to the rollups (PostgreSQL,
/// [`Store::fold_rollups_on`]). A fold is one burst of the store's work per interval: rare
/// longer bursts delay fewer calls than one after every batch (the p99 of the two-node bench,
/// BENCHMARKS.md "Rollups folded once a second"); readers fold what waits themselves, so the
/// interval never shows in what they read.
const FOLD_EVERY: Duration = Duration::from_secs(1);
/// How long shutdown waits for the last fold (what it leaves waits for the next reader).
const CLOSE_FOLD: Duration = Duration::from_secs(2);

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
        let (memory_gauge, journal_gauge, dead_counter) = (Gauge::default(), Gauge::default(), Counter::default());
        let waiting = Gauge::default();
        registry.register(
            "gateway_usage_rows_waiting",
            "Usage rows recorded and not yet in the store (queued, in the on-disk journal, or in memory); grows while the store is down or slower than the calls",
            waiting.clone(),
        );
        registry.register(
            "gateway_usage_rows_spilled",
            "Usage rows that found the writer queue full and wait in the on-disk journal",
            spilled.clone(),
        );
        registry.register(
            "gateway_usage_write_failures",
            "Failed usage-log writes (journal, store, or the fold of stored rows into the rollups); rows are retried, not dropped",
            write_failures.clone(),
        );
        registry.register(
            "gateway_usage_rows_in_memory",
            "Usage rows the journal could not take (a full disk), waiting in memory to be stored; at gateway.usage_queue new calls get 503",
            memory_gauge.clone(),
        );
        registry.register(
            "gateway_usage_journal_writable",
            "1 while the usage journal takes rows, 0 after an append failed",
            journal_gauge.clone(),
        );
        registry.register(
            "gateway_usage_rows_dead_lettered",
            "Usage rows the store refused for what they hold, kept in <state_dir>/usage-dead-letter.jsonl with the reason",
            dead_counter.clone(),
        );
        journal_gauge.set(1);
        let dead_path = state_dir.join(DEAD_LETTER_FILE);
        let found = count_lines(&dead_path);
        if found > 0 {
            tracing::warn!(path = %dead_path.display(), rows = found, "the usage dead-letter file holds rows the store refused (see gpuhub doctor)");
        }
        let inner = Arc::new(Inner {
            dir,
            segment: Mutex::new(Segment { seq, file: Some(file), rows: 0, spilled: 0, opened: Instant::now() }),
            spilled,
            write_failures,
            waiting,
            failing_since_us: AtomicI64::new(0),
            close_requested: Mutex::new(None),
            memory: Mutex::new(Vec::new()),
            memory_only: AtomicUsize::new(0),
            memory_gauge,
            memory_cap: queue.max(1),
            journal_failing: AtomicBool::new(false),
            journal_gauge,
            dead: DeadLetters { path: dead_path, count: AtomicU64::new(found), last_reason: Mutex::new(None), counter: dead_counter },
        });
        let (tx, rx) = mpsc::channel(queue.max(1));
        let handle = tokio::spawn(writer(inner.clone(), rx, store, old));
        Ok(UsageLog { inner, tx, writer: Mutex::new(Some(handle)) })
    }

    /// Whether a new call may start: false once `gateway.usage_queue` rows wait in memory
    /// because the journal cannot take them (the call is then refused with a 503).
    pub fn accepting(&self) -> bool {
        self.inner.memory_only.load(Ordering::Relaxed) < self.inner.memory_cap
    }

    /// What `gpuhub doctor` shows about the usage log.
    pub fn health(&self) -> UsageHealth {
        UsageHealth {
            dead_letters: self.inner.dead.count.load(Ordering::Relaxed),
            dead_letter_path: self.inner.dead.path.clone(),
            last_reason: lock(&self.inner.dead.last_reason).clone(),
            memory_only: self.inner.memory_only.load(Ordering::Relaxed),
            memory_cap: self.inner.memory_cap,
            journal_failing: self.inner.journal_failing.load(Ordering::Relaxed),
            journal_dir: self.inner.dir.clone(),
            waiting: self.inner.waiting.get(),
            store_failing_since_us: Some(self.inner.failing_since_us.load(Ordering::Relaxed)).filter(|t| *t > 0),
        }
    }

    /// Records one call. Never blocks on the store; returns once the row is in the journal
    /// (or, while the journal cannot take rows, in memory).
    pub fn record(&self, row: UsageRow) {
        let mut line = match serde_json::to_vec(&row) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(request_id = %row.request_id, error = %e, "cannot serialise a usage row");
                Vec::new()
            }
        };
        line.push(b'\n');
        let inner = &self.inner;
        let mut seg = lock(&inner.segment);
        let appended = match seg.file.as_mut() {
            Some(f) => f.append(&line),
            None => Err(std::io::Error::other("no journal segment is open")),
        };
        if let Err(e) = appended {
            inner.write_failures.inc();
            drop(seg);
            if !inner.journal_failing.swap(true, Ordering::Relaxed) {
                inner.journal_gauge.set(0);
                tracing::error!(
                    dir = %inner.dir.display(), error = %e, max_in_memory = inner.memory_cap,
                    "cannot append to the usage journal; rows wait in memory until they are stored, and once gateway.usage_queue of them wait, new calls get 503 (free space in paths.state_dir)"
                );
            }
            let n = inner.memory_only.fetch_add(1, Ordering::Relaxed) + 1;
            inner.memory_gauge.set(n as i64);
            inner.waiting.inc();
            lock(&inner.memory).push(row);
            return;
        }
        if inner.journal_failing.swap(false, Ordering::Relaxed) {
            inner.journal_gauge.set(1);
            tracing::info!(dir = %inner.dir.display(), "the usage journal takes rows again");
        }
        seg.rows += 1;
        inner.waiting.inc();
        if let Err(mpsc::error::TrySendError::Full(_) | mpsc::error::TrySendError::Closed(_)) = self.tx.try_send(Msg::Row(Box::new(row))) {
            // In the journal: replayed from there once the writer catches up.
            seg.spilled += 1;
            inner.spilled.inc();
        }
    }

    /// Waits until every row recorded so far is in the store (tests, shutdown).
    pub async fn flush(&self) {
        self.wait_for(Msg::Flush).await;
    }

    /// Waits until the rows queued so far are in the store, so that a report read right after
    /// a call counts it: what the writer holds is written at once, without the segment
    /// rotation of [`Self::flush`], so any report may ask on every read. Rows that only the
    /// journal holds (the queue was full: the store is slow or down) are not waited for.
    pub async fn settle(&self) {
        self.wait_for(Msg::Settle).await;
    }

    /// Sends the writer `msg` and waits for its answer (none once the writer has stopped).
    async fn wait_for(&self, msg: fn(oneshot::Sender<()>) -> Msg) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(msg(tx)).await.is_ok() {
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
    /// Kept between batches (no pool round trips around each).
    conn: UsageConnection,
    /// A batch was given up at shutdown: no segment may be deleted after that.
    gave_up: bool,
    /// Rows were stored since the last fold into the rollups.
    unfolded: bool,
    folded_at: Instant,
    /// The last fold failed (logged once until one succeeds).
    fold_failing: bool,
}

impl Writer {
    /// Inserts `rows`, retrying with back-off while the store fails. A batch the store refuses
    /// for what some row holds is split until the refused rows are found; they go to the
    /// dead-letter file and the rest is stored. Returns false only when shutdown's deadline
    /// passed (the rows not stored are still in the journal, or in memory).
    async fn commit(&mut self, rows: &[UsageRow]) -> bool {
        for chunk in rows.chunks(BATCH) {
            // Parts still to insert, last first: a refused part is split in two.
            let mut todo: Vec<&[UsageRow]> = vec![chunk];
            let mut delay = Duration::from_millis(50);
            while let Some(part) = todo.pop() {
                loop {
                    match self.store.insert_usage_on(&mut self.conn, part).await {
                        Ok(stored) => {
                            self.unfolded |= stored > 0;
                            let since = self.inner.failing_since_us.swap(0, Ordering::Relaxed);
                            if since > 0 {
                                let down_s = (crate::util::now_us() - since).max(0) / 1_000_000;
                                tracing::info!(down_s, "usage log: the store is back; writing queued rows");
                            }
                            break;
                        }
                        Err(e) if crate::store::gateway::refuses_rows(&e) => {
                            self.inner.write_failures.inc();
                            if let [row] = part {
                                self.inner.dead.keep(row, &e.to_string());
                            } else {
                                let (a, b) = part.split_at(part.len() / 2);
                                todo.push(b);
                                todo.push(a);
                            }
                            break;
                        }
                        Err(e) => {
                            self.inner.write_failures.inc();
                            if self.inner.failing_since_us.load(Ordering::Relaxed) == 0 {
                                self.inner.failing_since_us.store(crate::util::now_us(), Ordering::Relaxed);
                                tracing::warn!(error = %e, rows = part.len(), "usage log: the store refused a batch; rows wait in the journal and are retried");
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
        }
        true
    }

    /// Stores the rows that wait in memory only (the journal could not take them). Those it
    /// could not store (shutdown's deadline passed) go back to wait.
    async fn commit_memory(&mut self) {
        let rows = std::mem::take(&mut *lock(&self.inner.memory));
        if rows.is_empty() {
            return;
        }
        if !self.commit(&rows).await {
            let mut memory = lock(&self.inner.memory);
            let newer = std::mem::replace(&mut *memory, rows);
            memory.extend(newer);
            return;
        }
        let left = self.inner.memory_only.fetch_sub(rows.len(), Ordering::Relaxed).saturating_sub(rows.len());
        self.inner.memory_gauge.set(left as i64);
        self.inner.waiting.dec_by(rows.len() as i64);
    }

    /// Adds the rows stored since the last fold to the rollups once [`FOLD_EVERY`] has passed
    /// (at shutdown: now, for at most [`CLOSE_FOLD`]). One that fails is tried again an
    /// interval later; the rows wait in the store meanwhile, and readers fold them themselves.
    async fn fold_if_due(&mut self, closing: bool) {
        // At shutdown with the store down, the batches' deadline has passed already.
        let due = if closing { self.inner.failing_since_us.load(Ordering::Relaxed) == 0 } else { self.folded_at.elapsed() >= FOLD_EVERY };
        if !self.unfolded || !due {
            return;
        }
        self.folded_at = Instant::now();
        let folded = if closing {
            tokio::time::timeout(CLOSE_FOLD, self.store.fold_rollups_on(&mut self.conn)).await.unwrap_or(Ok(0))
        } else {
            self.store.fold_rollups_on(&mut self.conn).await
        };
        match folded {
            Ok(_) => {
                self.unfolded = false;
                if std::mem::take(&mut self.fold_failing) {
                    tracing::info!("usage log: stored rows are added to the rollups again");
                }
            }
            Err(e) => {
                self.inner.write_failures.inc();
                if !std::mem::replace(&mut self.fold_failing, true) {
                    tracing::warn!(error = %e, "usage log: cannot add stored rows to the rollups; they wait in the store, and readers add them");
                }
            }
        }
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
    let mut w = Writer {
        inner: inner.clone(),
        store,
        conn: UsageConnection::default(),
        gave_up: false,
        unfolded: false,
        folded_at: Instant::now(),
        fold_failing: false,
    };
    if !old.is_empty() {
        // Counted before the first is replayed (here, not at start: after a long outage they
        // may be gigabytes), so the gauge shows them all while the store is still down.
        let paths: Vec<PathBuf> = old.into_iter().map(|(_, path)| path).collect();
        let (paths, rows) = tokio::task::spawn_blocking(move || {
            let rows: Vec<u64> = paths.iter().map(|path| journal::count(path).unwrap_or(0)).collect();
            (paths, rows)
        })
        .await
        .unwrap_or_default();
        inner.waiting.inc_by(rows.iter().sum::<u64>() as i64);
        tracing::info!(
            segments = paths.len(),
            rows = rows.iter().sum::<u64>(),
            "usage log: replaying the journal left by the previous run"
        );
        for (path, n) in paths.iter().zip(rows) {
            if w.replay(path).await {
                inner.waiting.dec_by(n as i64);
            }
        }
    }
    let linger = linger(w.store.backend());
    let mut batch: Vec<UsageRow> = Vec::with_capacity(BATCH);
    let mut waiters: Vec<Waiter> = Vec::new();
    let mut closing = false;
    loop {
        match tokio::time::timeout(TICK, rx.recv()).await {
            Ok(Some(m)) => {
                let first_row = matches!(m, Msg::Row(_));
                take(m, &mut batch, &mut waiters, &mut closing);
                if first_row && !closing && waiters.is_empty() {
                    // Let a batch gather: one transaction per linger instead of one per row
                    // (and one wake-up instead of one per row).
                    tokio::time::sleep(linger).await;
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
            if w.commit(&batch).await {
                inner.waiting.dec_by(batch.len() as i64);
            }
            batch.clear();
        }
        w.commit_memory().await;
        w.fold_if_due(closing).await;
        w.conn.release_if_idle().await;
        let rotate = {
            let seg = lock(&inner.segment);
            closing || (seg.rows > 0 && (waiters.iter().any(|w| w.journal) || seg.opened.elapsed() >= ROTATE_AFTER))
        };
        if rotate {
            let last = closing;
            rotate_segment(&mut w, &mut rx, &mut waiters, &mut closing, last).await;
        }
        for w in waiters.drain(..) {
            let _ = w.tx.send(());
        }
        if closing {
            break;
        }
    }
    let stranded = std::mem::take(&mut *lock(&inner.memory));
    if !stranded.is_empty() {
        keep_stranded(&inner, stranded);
    }
    tracing::info!("usage log: writer stopped");
}

/// At shutdown, rows that waited in memory and that the store did not take in time: one more
/// try to put them in a journal segment for the next start; failing that, the log is the last
/// place that holds them.
fn keep_stranded(inner: &Inner, rows: Vec<UsageRow>) {
    let seq = lock(&inner.segment).seq + 1;
    let mut seg = journal::Segment::create(&inner.dir, seq, 0);
    let mut lost = 0usize;
    for row in &rows {
        let mut line = serde_json::to_vec(row).unwrap_or_default();
        line.push(b'\n');
        let ok = match seg.as_mut() {
            Ok(s) => s.append(&line).is_ok(),
            Err(_) => false,
        };
        if !ok {
            lost += 1;
            tracing::error!(row = ?row, "usage row LOST: the store is down and the journal cannot take it at shutdown");
        }
    }
    if let Ok(s) = seg
        && let Err(e) = s.finish()
    {
        tracing::warn!(error = %e, "cannot truncate the last usage-journal segment (its zeroed tail is skipped on replay)");
    }
    tracing::warn!(rows = rows.len(), lost, "usage log: rows that waited in memory were put in the journal for the next start");
}

/// Lines in a file (0 if it cannot be read).
fn count_lines(path: &Path) -> u64 {
    use std::io::BufRead;
    match std::fs::File::open(path) {
        Ok(f) => std::io::BufReader::new(f).split(b'\n').filter(|l| l.as_ref().is_ok_and(|l| !l.is_empty())).count() as u64,
        Err(_) => 0,
    }
}

fn take(m: Msg, batch: &mut Vec<UsageRow>, waiters: &mut Vec<Waiter>, closing: &mut bool) {
    match m {
        Msg::Row(r) => batch.push(*r),
        Msg::Flush(tx) => waiters.push(Waiter { tx, journal: true }),
        Msg::Settle(tx) => waiters.push(Waiter { tx, journal: false }),
        Msg::Close => *closing = true,
    }
}

/// Starts a new segment, makes sure every row of the old one is stored, then deletes it.
async fn rotate_segment(w: &mut Writer, rx: &mut mpsc::Receiver<Msg>, waiters: &mut Vec<Waiter>, closing: &mut bool, last: bool) {
    let inner = w.inner.clone();
    // Only this task rotates, so the number is stable; the file is created and the old one
    // unmapped and truncated outside the lock (calls keep appending meanwhile), on a thread at
    // the idle policy: faulting in the next segment takes milliseconds of CPU, and calls that
    // wait behind it on a busy host were the slowest of each second (perf sched timehist).
    let (seq, used) = {
        let seg = lock(&inner.segment);
        (seg.seq + 1, seg.file.as_ref().map_or(0, journal::Segment::written))
    };
    let next = if last {
        None
    } else {
        // Room for twice what the last segment took, faulted in before calls append to it.
        let (dir, prefault) = (inner.dir.clone(), (used * 2).clamp(MIN_PREFAULT, journal::MAP_BYTES));
        match crate::util::run_idle(JOURNAL_THREAD, move || journal::Segment::create(&dir, seq, prefault)).await {
            Ok(Ok(f)) => Some(f),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the thread that creates a usage-journal segment; keeping the current one");
                return;
            }
            Ok(Err(e)) => {
                tracing::error!(dir = %inner.dir.display(), error = %e, "cannot start a new usage-journal segment; keeping the current one");
                return;
            }
        }
    };
    let old = std::mem::replace(&mut *lock(&inner.segment), Segment { seq, file: next, rows: 0, spilled: 0, opened: Instant::now() });
    let (old_seq, spilled) = (old.seq, old.spilled);
    let finished = match old.file {
        Some(f) => crate::util::run_idle(JOURNAL_THREAD, move || f.finish()).await.and_then(|r| r),
        None => Ok(()),
    };
    if let Err(e) = finished {
        tracing::warn!(dir = %inner.dir.display(), error = %e, "cannot truncate a finished usage-journal segment (its zeroed tail is skipped on replay)");
    }
    // Every row of the old segment that reached the channel is in it now: drain and store.
    let mut rest = Vec::new();
    while let Ok(m) = rx.try_recv() {
        take(m, &mut rest, waiters, closing);
    }
    let stored = w.commit(&rest).await;
    if stored {
        inner.waiting.dec_by(rest.len() as i64);
    }
    let path = journal::path(&inner.dir, old_seq);
    if !stored || w.gave_up {
        return;
    }
    if spilled > 0 {
        if w.replay(&path).await {
            inner.waiting.dec_by(spilled as i64);
        }
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
            assert_eq!(log.health().waiting, 0, "every row, spilled ones included, is stored");
            log.close().await;
            assert_eq!(journal::list(&dir.path().join("usage-journal")).unwrap().len(), 0);
        }
    }

    #[tokio::test]
    async fn settle_stores_what_is_queued_at_once_without_rotating_the_journal() {
        for (store, _d) in testing::stores().await {
            let dir = tempfile::tempdir().unwrap();
            let jdir = dir.path().join("usage-journal");
            let log = UsageLog::start(dir.path(), store.clone(), 100, &mut Registry::default()).unwrap();
            let seq = || journal::list(&jdir).unwrap().iter().map(|(s, _)| *s).max().unwrap_or(0);
            let (t, first) = (Instant::now(), seq());
            for i in 0..20 {
                log.record(row(i));
                log.settle().await;
                assert_eq!(store.usage_row_count().await.unwrap(), i as i64 + 1, "{:?}: a settled row is stored", store.backend());
            }
            // Only the rotations due by time (one per ROTATE_AFTER with rows), not one per settle.
            let by_time = t.elapsed().as_secs_f64() / ROTATE_AFTER.as_secs_f64();
            let rotated = (seq() - first) as f64;
            assert!(rotated <= by_time.ceil() + 1.0, "{:?}: {rotated} rotations for 20 settles in {:?}", store.backend(), t.elapsed());
            let (t, first) = (Instant::now(), seq());
            for i in 20..25 {
                log.record(row(i));
                log.flush().await;
            }
            assert_eq!(seq() - first, 5, "{:?}: every flush rotates ({:?})", store.backend(), t.elapsed());
            log.close().await;
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
            assert_eq!(log.health().waiting, 0, "the segment's 20 lines and the torn one were counted, and uncounted once replayed");
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
        let health = log.health();
        assert_eq!(health.waiting, 50);
        assert!(health.store_failing_since_us.is_some());
        let check = crate::control::status::usage_log_check(&health);
        assert!(!check.ok && check.detail.contains("50 row(s) wait in the journal"), "{check:?}");
        log.close().await; // gives up after the deadline; rows stay in the journal
        let jdir = dir.path().join("usage-journal");
        let n: usize = journal::list(&jdir).unwrap().iter().map(|(_, p)| journal::read(p).unwrap().len()).sum();
        assert_eq!(n, 50);
        // A start with the store still down (on a copy of the journal) shows those rows waiting.
        {
            let copy = tempfile::tempdir().unwrap();
            std::fs::create_dir(copy.path().join("usage-journal")).unwrap();
            for (_, p) in journal::list(&jdir).unwrap() {
                std::fs::copy(&p, copy.path().join("usage-journal").join(p.file_name().unwrap())).unwrap();
            }
            let down = Store::open(&format!("sqlite://{}", copy.path().join("t.db").display()), None).await.unwrap();
            down.close().await;
            let log = UsageLog::start(copy.path(), down, 4, &mut Registry::default()).unwrap();
            let t = Instant::now();
            while log.health().waiting != 50 {
                assert!(t.elapsed() < Duration::from_secs(5), "rows waiting at a start with the store down: {}", log.health().waiting);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // Next start with a working store: everything arrives.
        let store = Store::open(&url, None).await.unwrap();
        let log = UsageLog::start(dir.path(), store.clone(), 4, &mut Registry::default()).unwrap();
        log.record(row(50));
        log.flush().await;
        assert_eq!(store.usage_row_count().await.unwrap(), 51);
        let health = log.health();
        assert_eq!((health.waiting, health.store_failing_since_us), (0, None));
        assert!(crate::control::status::usage_log_check(&health).ok);
        log.close().await;
    }

    #[tokio::test]
    async fn a_row_the_store_refuses_goes_to_the_dead_letter_file_and_the_rest_is_written() {
        for (store, _d) in testing::stores().await {
            testing::refuse_user_agent(&store, "reject-me").await;
            let dir = tempfile::tempdir().unwrap();
            let log = UsageLog::start(dir.path(), store.clone(), 100, &mut Registry::default()).unwrap();
            for i in 0..30 {
                let mut r = row(i);
                if i == 7 || i == 21 {
                    r.user_agent = "reject-me".into();
                }
                log.record(r);
            }
            log.flush().await;
            assert_eq!(store.usage_row_count().await.unwrap(), 28, "{:?}: the other rows are stored", store.backend());
            assert_eq!(log.health().waiting, 0, "refused rows wait in the dead-letter file, not for the store");
            let h = log.health();
            assert_eq!(h.dead_letters, 2);
            assert!(h.last_reason.as_deref().is_some_and(|r| r.contains("store query failed")), "{h:?}");
            let text = std::fs::read_to_string(dir.path().join(DEAD_LETTER_FILE)).unwrap();
            let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
            assert_eq!(lines.iter().map(|l| l["row"]["request_id"].as_str().unwrap()).collect::<Vec<_>>(), ["req-7", "req-21"]);
            assert!(lines.iter().all(|l| l["reason"].as_str().is_some_and(|r| !r.is_empty())));
            // The writer goes on: a later row is stored.
            log.record(row(30));
            log.flush().await;
            assert_eq!(store.usage_row_count().await.unwrap(), 29);
            log.close().await;
            // The next start counts the file (for `gpuhub doctor`).
            let log = UsageLog::start(dir.path(), store.clone(), 100, &mut Registry::default()).unwrap();
            assert_eq!(log.health().dead_letters, 2);
            log.close().await;
        }
    }

    /// PostgreSQL: a fold that fails counts as a write failure, the stored rows wait in
    /// `usage_rollup_pending`, and a fold once the store is whole again adds them, once.
    #[tokio::test]
    async fn a_fold_that_fails_is_counted_and_its_rows_are_folded_later() {
        async fn scalar(store: &Store, sql: &str) -> i64 {
            sqlx::query_scalar::<_, i64>(sql).fetch_one(store.pool()).await.unwrap()
        }
        async fn until(what: &str, mut done: impl AsyncFnMut() -> bool) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !done().await {
                assert!(Instant::now() < deadline, "{what} within 10 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        for (store, _d) in testing::stores().await {
            if store.backend() != crate::store::Backend::Postgres {
                continue;
            }
            sqlx::query("ALTER TABLE call_rollups RENAME TO call_rollups_away").execute(store.pool()).await.unwrap();
            let dir = tempfile::tempdir().unwrap();
            let log = UsageLog::start(dir.path(), store.clone(), 100, &mut Registry::default()).unwrap();
            for i in 0..10 {
                log.record(row(i));
            }
            log.flush().await;
            until("a failed fold counted", async || log.inner.write_failures.get() > 0).await;
            assert_eq!(store.usage_row_count().await.unwrap(), 10, "the batch itself is stored");
            assert_eq!(scalar(&store, "SELECT COUNT(*) FROM usage_rollup_pending").await, 10);
            sqlx::query("ALTER TABLE call_rollups_away RENAME TO call_rollups").execute(store.pool()).await.unwrap();
            until("the waiting rows folded", async || scalar(&store, "SELECT COUNT(*) FROM usage_rollup_pending").await == 0).await;
            assert_eq!(scalar(&store, "SELECT CAST(SUM(calls) AS BIGINT) FROM call_rollups").await, 10);
            log.close().await;
        }
    }

    #[tokio::test]
    async fn a_full_state_disk_keeps_rows_in_memory_then_refuses_then_writes_everything() {
        let Some(fs) = journal::small_fs::Tmpfs::mount("usage-log full-disk test", "2m") else { return };
        // The store (SQLite) is on the same full filesystem, as with the default paths.
        let url = format!("sqlite://{}", fs.path().join("gpuhub.db").display());
        let store = Store::open(&url, None).await.unwrap();
        let cap = 40;
        let log = UsageLog::start(fs.path(), store.clone(), cap, &mut Registry::default()).unwrap();
        let filler = fs.fill();
        let mut n = 0;
        while log.accepting() {
            log.record(row(n));
            n += 1;
            assert!(n < 50_000, "the usage log kept accepting on a full disk");
        }
        let h = log.health();
        assert!(h.journal_failing && h.memory_only >= cap, "{h:?}");
        assert!(h.waiting >= h.memory_only as i64, "{h:?}");
        assert!(n > cap, "rows the journal had reserved room for were journaled first");
        // The disk stays full a while: the writer retries, other writers of the store fail too.
        for i in 0..10 {
            let _ = store.set_setting("while-full", &"x".repeat(4096 * (i + 1))).await;
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        // Space returns: every row is stored, and calls are accepted again.
        std::fs::remove_file(filler).unwrap();
        let t = Instant::now();
        while store.usage_row_count().await.unwrap_or(0) < n as i64 {
            assert!(t.elapsed() < Duration::from_secs(30), "rows were not written once space returned");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        log.record(row(n));
        log.flush().await;
        assert_eq!(store.usage_row_count().await.unwrap(), n as i64 + 1);
        assert!(log.accepting());
        assert_eq!(log.health().waiting, 0);
        // No connection the full disk broke was put back in the pool holding the write lock:
        // every other writer of the store gets through too.
        for i in 0..8 {
            tokio::time::timeout(Duration::from_secs(3), store.set_setting("after-full-disk", &i.to_string()))
                .await
                .expect("a write after the full disk waited for a lock")
                .unwrap();
        }
        let h = log.health();
        assert!(!h.journal_failing && h.memory_only == 0, "{h:?}");
        log.close().await;
        store.close().await;
    }
}
