//! The gateway's HTTP/1.1 client for model workers.
//!
//! Workers are OpenAI-compatible servers on this node (vLLM, llama.cpp, TGI) reached over
//! plain HTTP/1.1 on loopback or the node's network. The client runs entirely inside the
//! task of the call that uses it: a call checks out an idle connection (or connects), writes
//! the request, reads the answer on that same task and checks the connection back in when the
//! body has been read to its end. There is no connection task and no channel between the
//! call and its socket, so a call wakes one thread, not two (a pooled client with a task per
//! connection costs a cross-thread hand-off per request and its answer).
//!
//! - Framing per RFC 9112 §6.3: `Transfer-Encoding: chunked`, `Content-Length`, or read to
//!   close; no body for 1xx, 204, 304 and HEAD. Interim 1xx answers are skipped.
//! - Bodies are handed out as they arrive ([`Response::chunk`]): a streamed event reaches
//!   the caller when its bytes do, never after a whole chunk or body.
//! - A connection is reused only when its answer was HTTP/1.1 without `Connection: close`,
//!   was read to its end, and nothing followed it. An idle connection the worker closed is
//!   noticed at checkout (a non-blocking peek) and dropped; if a reused connection still
//!   fails before any byte of an answer arrives, the request is sent once more on a new one
//!   (the worker never saw it: it closed the idle connection first).

use std::collections::{HashMap, VecDeque};
use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::models::launcher::Instance;

/// Largest response head accepted (status line and headers).
const MAX_HEAD: usize = 64 * 1024;
/// Most response headers accepted.
const MAX_HEADERS: usize = 96;
/// Longest chunk-size line or trailer line accepted.
const MAX_LINE: usize = 4096;
/// Bodies up to this size are written with the head in one `write`.
const COALESCE: usize = 16 * 1024;

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("`{url}` is not an http:// URL (the gateway speaks plain HTTP/1.1 to its workers)")]
    Url { url: String },
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("connecting to {addr} took longer than {seconds}s")]
    ConnectTimeout { addr: String, seconds: u64 },
    /// The port is on this host, and what listens there is not the worker alone (its worker
    /// died and another process took the port, or another worker's process shares it) or
    /// cannot be told: nothing was sent.
    #[error("the port of {addr} is not held by its worker alone: {what}")]
    NotTheWorker { addr: String, what: PortLost },
    #[error("the connection broke off: {0}")]
    Io(#[from] io::Error),
    #[error("the worker closed the connection before it answered")]
    Closed,
    #[error("the worker closed the connection before the end of its answer")]
    Incomplete,
    #[error("the worker's answer is not valid HTTP/1.1: {0}")]
    Protocol(String),
    #[error("the worker's answer is larger than {limit} bytes")]
    TooLarge { limit: usize },
}

impl UpstreamError {
    /// True when no connection could be made (the worker is not listening).
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            UpstreamError::Connect { .. }
                | UpstreamError::ConnectTimeout { .. }
                | UpstreamError::NotTheWorker { .. }
                | UpstreamError::Url { .. }
        )
    }
}

/// What was found on a worker's port instead of that worker alone, or why it cannot be told.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PortLost {
    /// No connection (refused, timed out), or the kernel could not be asked.
    #[error("{0}")]
    Unreachable(String),
    #[error("nothing listens on port {port} any more")]
    Nobody { port: u16 },
    #[error("uid {uid} listens on port {port} (the worker account is uid {worker_uid})")]
    OtherUser { uid: u32, port: u16, worker_uid: u32 },
    /// The worker still listens; another worker's process of the same account shares the port.
    #[error(
        "another worker's process (pid {pid}) of the worker account listens on port {port} too (SO_REUSEPORT: the kernel would hand it some of the connections)"
    )]
    Shared { pid: u32, port: u16 },
}

impl PortLost {
    /// Whether the worker itself stopped serving (its server died or left the port): only
    /// then does its stop count toward the model's back-off (`max_restarts`). Another worker's
    /// process sharing its port is not the model's fault.
    pub fn worker_failed(&self) -> bool {
        !matches!(self, PortLost::Shared { .. })
    }
}

/// Where a worker is: `http://AUTHORITY[/PREFIX]`.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    /// `host:port` (the `Host` header; with the worker, the pool key).
    pub authority: &'a str,
    /// A path the worker is mounted under (`""` usually).
    pub prefix: &'a str,
    /// The worker gpuhub started there, whose port's listening sockets must all be its own;
    /// checked on every new connection to a port on this host ([`Target::owned_by`]).
    pub owner: Option<&'a Instance>,
}

impl<'a> Target<'a> {
    /// Splits a worker's base URL.
    pub fn parse(base_url: &'a str) -> Result<Target<'a>, UpstreamError> {
        let bad = || UpstreamError::Url { url: crate::util::sanitize(base_url) };
        let rest = base_url.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, prefix) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
        if authority.is_empty() || authority.contains('@') || authority.bytes().any(|b| b.is_ascii_whitespace() || b.is_ascii_control()) {
            return Err(bad());
        }
        Ok(Target { authority, prefix: prefix.trim_end_matches('/'), owner: None })
    }

    /// A worker gpuhub started: a new connection to its port on this host is used only when
    /// every socket listening on that port is the worker account's and held by the worker's
    /// own processes. The proof at start says nothing once the worker is gone and another user
    /// has bound its port (that process would get the calls' prompts and the worker's key), or
    /// once another worker's process shares the port by `SO_REUSEPORT` (the kernel would hand
    /// it some of the connections, so calls for one model would reach another).
    pub fn owned_by(self, worker: Option<&'a Instance>) -> Target<'a> {
        Target { owner: worker, ..self }
    }

    /// Idle connections are kept per worker, not per address: a connection made for one
    /// worker (to its own process, proved when it was made) never carries another worker's
    /// call, even one given the same address later (a server that stopped listening but still
    /// holds kept-alive connections while it drains).
    fn pool_key(&self) -> String {
        let id = self.owner.map_or("", |w| w.id.as_str());
        let mut key = String::with_capacity(self.authority.len() + 1 + id.len());
        key.push_str(self.authority);
        if !id.is_empty() {
            key.push(' ');
            key.push_str(id);
        }
        key
    }

    /// The address to connect to (port 80 when the URL names none).
    fn connect_addr(&self) -> String {
        let has_port = match self.authority.rfind(':') {
            Some(i) => !self.authority.ends_with(']') && self.authority[i + 1..].bytes().all(|b| b.is_ascii_digit()),
            None => false,
        };
        if has_port { self.authority.to_string() } else { format!("{}:80", self.authority) }
    }
}

/// A request to send: everything but `Host` and `Content-Length`, which the client adds.
pub struct Request<'a> {
    pub method: &'a Method,
    pub path_and_query: &'a str,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: &'a [u8],
}

/// One idle connection.
struct Idle {
    conn: TcpStream,
    since: Instant,
}

struct Pool {
    idle: Mutex<HashMap<String, VecDeque<Idle>>>,
    max_idle_per_host: usize,
    idle_timeout: Duration,
}

impl Pool {
    /// The most recently used live connection of `key` ([`Target::pool_key`]), if any.
    fn checkout(&self, key: &str) -> Option<TcpStream> {
        loop {
            let i = self.idle.lock().unwrap_or_else(PoisonError::into_inner).get_mut(key)?.pop_back()?;
            // The peek is a system call: not under the lock.
            if i.since.elapsed() < self.idle_timeout && still_open(&i.conn) {
                return Some(i.conn);
            }
        }
    }

    fn checkin(&self, key: &str, conn: TcpStream) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let conns = match idle.get_mut(key) {
            Some(c) => c,
            None => idle.entry(key.to_string()).or_default(),
        };
        while conns.front().is_some_and(|i| now.duration_since(i.since) >= self.idle_timeout) {
            conns.pop_front();
        }
        if conns.len() < self.max_idle_per_host {
            conns.push_back(Idle { conn, since: now });
        }
    }

    /// Drops idle connections older than the idle timeout.
    fn prune(&self) {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|_, conns| {
            conns.retain(|i| now.duration_since(i.since) < self.idle_timeout && still_open(&i.conn));
            !conns.is_empty()
        });
    }
}

/// True when an idle connection has neither been closed by its peer nor sent anything
/// unasked (one non-blocking peek).
fn still_open(conn: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: recv on a socket this process owns, into a 1-byte stack buffer; MSG_PEEK
    // leaves the data (there should be none) where it is; MSG_DONTWAIT never blocks.
    let n = unsafe { libc::recv(conn.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
}

/// The client: a pool of idle connections per worker. Cheap to clone.
#[derive(Clone)]
pub struct Client {
    pool: Arc<Pool>,
    connect_timeout: Duration,
    proved: Arc<Proved>,
}

impl Client {
    pub fn new(max_idle_per_host: usize, idle_timeout: Duration, connect_timeout: Duration) -> Client {
        let pool = Arc::new(Pool { idle: Mutex::default(), max_idle_per_host, idle_timeout });
        Client { pool, connect_timeout, proved: Arc::default() }
    }

    /// Drops idle connections every `every` while the client lives (a worker that closed an
    /// idle connection leaves it in CLOSE_WAIT here until then).
    pub fn spawn_pruner(&self, every: Duration) {
        let pool = Arc::downgrade(&self.pool);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match pool.upgrade() {
                    Some(p) => p.prune(),
                    None => return,
                }
            }
        });
    }

    /// Sends `req` to `target` and reads the answer's head; the body is read from the
    /// returned [`Response`].
    pub async fn send(&self, target: Target<'_>, req: &Request<'_>) -> Result<Response, UpstreamError> {
        // A small body goes out with the head in one write.
        let mut head = encode_head(target, req);
        let rest = if req.body.len() <= COALESCE {
            head.extend_from_slice(req.body);
            &[][..]
        } else {
            req.body
        };
        let mut resent = false;
        let key = target.pool_key();
        if let Some(conn) = self.pool.checkout(&key) {
            match exchange(conn, &head, rest, req.method).await {
                Ok(r) => return Ok(self.response(key, r)),
                // The worker closed this idle connection without reading the request.
                Err(UpstreamError::Closed) => {
                    tracing::debug!(upstream = %target.authority, "a pooled connection was closed; reconnecting");
                    resent = true;
                }
                Err(e) => return Err(e),
            }
        }
        let conn = match self.connect(target).await {
            Ok(c) => c,
            // No worker there now: it may have read the request on the pooled connection and
            // died before answering, so this is not a call that was never sent (no failover).
            Err(e) if resent && e.is_connect() => return Err(UpstreamError::Closed),
            Err(e) => return Err(e),
        };
        let r = exchange(conn, &head, rest, req.method).await?;
        Ok(self.response(key, r))
    }

    fn response(&self, pool_key: String, (status, headers, body): (StatusCode, HeaderMap, Body)) -> Response {
        Response { status, headers, body, pool: Some((self.pool.clone(), pool_key)) }
    }

    async fn connect(&self, target: Target<'_>) -> Result<TcpStream, UpstreamError> {
        let addr = target.connect_addr();
        let conn = match tokio::time::timeout(self.connect_timeout, TcpStream::connect(&addr)).await {
            Err(_) => return Err(UpstreamError::ConnectTimeout { addr, seconds: self.connect_timeout.as_secs() }),
            Ok(Err(source)) => return Err(UpstreamError::Connect { addr, source }),
            Ok(Ok(c)) => c,
        };
        if let Some(worker) = target.owner {
            check_owner(&conn, worker, &self.proved).map_err(|what| UpstreamError::NotTheWorker { addr, what })?;
        }
        // Small SSE events must not wait for Nagle.
        conn.set_nodelay(true)?;
        Ok(conn)
    }
}

/// Whether a worker still holds its port, without sending it anything: a connection is
/// accepted within `timeout` and, on this host, every listener there is `worker`'s
/// ([`Target::owned_by`]); else what was found instead. For the lifecycle's check after a call
/// could not reach the worker.
pub async fn holds_port(base_url: &str, worker: Option<&Instance>, timeout: Duration) -> Result<(), PortLost> {
    let target = Target::parse(base_url).map_err(|e| PortLost::Unreachable(e.to_string()))?;
    let addr = target.connect_addr();
    let conn = match tokio::time::timeout(timeout, TcpStream::connect(&addr)).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return Err(PortLost::Unreachable(format!("cannot connect to {addr}: {e}"))),
        Err(_) => return Err(PortLost::Unreachable(format!("connecting to {addr} took longer than {}s", timeout.as_secs()))),
    };
    worker.map_or(Ok(()), |w| check_owner(&conn, w, &Proved::default()))
}

/// Listening sockets found to be held by a worker's own processes, by worker and port: each
/// is looked up in `/proc` once (a scan of the worker account's processes), not on every new
/// connection.
#[derive(Default)]
struct Proved(Mutex<HashMap<(String, u16), Vec<u64>>>);

impl Proved {
    /// Workers remembered at most; past that the memory starts again (a worker's sockets are
    /// then looked up once more).
    const MAX: usize = 256;
}

/// For a connection to a port on this host (its peer address is one of ours: loopback, or the
/// node's address), that every socket listening on the port is the worker account's and held
/// by `worker`'s own processes (`launcher::foreign_holder`). A worker on another node proved
/// its port on that node at start (`launcher::proof`); this host cannot see it.
fn check_owner(conn: &TcpStream, worker: &Instance, proved: &Proved) -> Result<(), PortLost> {
    use crate::models::launcher::{self, proof};
    let (Ok(local), Ok(peer)) = (conn.local_addr(), conn.peer_addr()) else {
        return Err(PortLost::Unreachable("the connection has no addresses".into()));
    };
    if local.ip() != peer.ip() && !peer.ip().is_loopback() {
        return Ok(());
    }
    let port = peer.port();
    let listeners = proof::reachable(port, Some(&[peer.ip()]))
        .map_err(|e| PortLost::Unreachable(format!("cannot ask the kernel who listens on port {port}: {e}")))?;
    match proof::owner_of(&listeners, worker.uid) {
        proof::PortOwner::Worker => {}
        proof::PortOwner::Other { uid } => return Err(PortLost::OtherUser { uid, port, worker_uid: worker.uid }),
        proof::PortOwner::Nobody => return Err(PortLost::Nobody { port }),
    }
    let inodes: Vec<u64> = listeners.iter().map(|l| l.inode).collect();
    let key = (worker.id.clone(), port);
    let mut ours = proved.0.lock().unwrap_or_else(PoisonError::into_inner).get(&key).cloned().unwrap_or_default();
    if let Some(pid) = launcher::foreign_holder(worker, &inodes, &mut ours) {
        return Err(PortLost::Shared { pid, port });
    }
    let mut map = proved.0.lock().unwrap_or_else(PoisonError::into_inner);
    if map.len() >= Proved::MAX {
        map.clear();
    }
    map.insert(key, ours);
    Ok(())
}

/// The request head: request line, `Host`, the caller's headers, `Content-Length` (with
/// room for a small body after it).
fn encode_head(target: Target<'_>, req: &Request<'_>) -> Vec<u8> {
    let mut h = Vec::with_capacity(256 + if req.body.len() <= COALESCE { req.body.len() } else { 0 });
    h.extend_from_slice(req.method.as_str().as_bytes());
    h.push(b' ');
    h.extend_from_slice(target.prefix.as_bytes());
    h.extend_from_slice(req.path_and_query.as_bytes());
    h.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    h.extend_from_slice(target.authority.as_bytes());
    for (k, v) in &req.headers {
        h.extend_from_slice(b"\r\n");
        h.extend_from_slice(k.as_str().as_bytes());
        h.extend_from_slice(b": ");
        h.extend_from_slice(v.as_bytes());
    }
    h.extend_from_slice(b"\r\ncontent-length: ");
    h.extend_from_slice(req.body.len().to_string().as_bytes());
    h.extend_from_slice(b"\r\n\r\n");
    h
}

/// Writes the request (`head`, then `rest` of the body) and reads the answer's head.
/// [`UpstreamError::Closed`] means the connection ended before any byte of an answer (safe to
/// send again on a new connection).
async fn exchange(mut conn: TcpStream, head: &[u8], rest: &[u8], method: &Method) -> Result<(StatusCode, HeaderMap, Body), UpstreamError> {
    let written = match conn.write_all(head).await {
        Ok(()) if !rest.is_empty() => conn.write_all(rest).await,
        other => other,
    };
    if let Err(e) = written {
        return Err(if is_reset(&e) { UpstreamError::Closed } else { UpstreamError::Io(e) });
    }
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let (status, headers, framing, reusable) = read_head(&mut conn, &mut buf, method).await?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(UpstreamError::Protocol("it switched protocols".into()));
            }
            continue;
        }
        return Ok((status, headers, Body { conn: Some(conn), buf, framing, reusable }));
    }
}

fn is_reset(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionAborted)
}

/// What a response head says: status, headers, body framing, whether the connection may be
/// reused after the body.
type Head = (StatusCode, HeaderMap, Framing, bool);

/// Reads one response head from `conn` into `buf` and consumes it.
async fn read_head(conn: &mut TcpStream, buf: &mut BytesMut, method: &Method) -> Result<Head, UpstreamError> {
    let fresh = buf.is_empty();
    loop {
        if let Some(head) = parse_head(buf, method)? {
            return Ok(head);
        }
        buf.reserve(8 * 1024);
        match conn.read_buf(buf).await {
            Ok(0) if fresh && buf.is_empty() => return Err(UpstreamError::Closed),
            Err(e) if fresh && buf.is_empty() && is_reset(&e) => return Err(UpstreamError::Closed),
            Ok(0) => return Err(UpstreamError::Incomplete),
            Ok(_) => {}
            Err(e) => return Err(UpstreamError::Io(e)),
        }
    }
}

/// Takes a complete response head off the front of `buf`; `None` while more bytes are needed.
fn parse_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, UpstreamError> {
    if buf.is_empty() {
        return Ok(None);
    }
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut slots);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(UpstreamError::Protocol(format!("its response head is over {} KiB", MAX_HEAD / 1024)));
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(UpstreamError::Protocol(e.to_string())),
    };
    let code = parsed.code.unwrap_or(0);
    let version = parsed.version.unwrap_or(0);
    let status = StatusCode::from_u16(code).map_err(|_| UpstreamError::Protocol(format!("status {code}")))?;
    // Header values share one copy of the head (no allocation per value).
    let head = Bytes::copy_from_slice(&buf[..len]);
    let base = buf.as_ptr() as usize;
    let mut headers = HeaderMap::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| UpstreamError::Protocol(format!("header name {:?}", crate::util::sanitize(h.name))))?;
        let at = h.value.as_ptr() as usize - base;
        let value = HeaderValue::from_maybe_shared(head.slice(at..at + h.value.len()))
            .map_err(|_| UpstreamError::Protocol(format!("value of header {name}")))?;
        headers.append(name, value);
    }
    buf.advance(len);
    let (framing, mut reusable) = framing(status, &headers, method)?;
    reusable &= version == 1 && !has_token(&headers, header::CONNECTION, "close");
    Ok(Some((status, headers, framing, reusable)))
}

/// Decodes a whole answer to a POST held in memory, as the client would read it off a
/// connection that then closed: the final status and the body. The fuzz targets' entry point.
pub fn decode(bytes: &[u8]) -> Result<(StatusCode, Bytes), UpstreamError> {
    let mut buf = BytesMut::from(bytes);
    loop {
        let Some((status, _, framing, reusable)) = parse_head(&mut buf, &Method::POST)? else {
            return Err(if buf.is_empty() { UpstreamError::Closed } else { UpstreamError::Incomplete });
        };
        if status.is_informational() {
            continue;
        }
        let mut body = Body { conn: None, buf, framing, reusable };
        let mut out = BytesMut::new();
        while let Some(b) = body.decode()? {
            out.extend_from_slice(&b);
        }
        return match body.framing {
            Framing::Done | Framing::Close => Ok((status, out.freeze())),
            _ => Err(UpstreamError::Incomplete),
        };
    }
}

/// How the body is delimited, and whether that leaves the connection reusable.
fn framing(status: StatusCode, headers: &HeaderMap, method: &Method) -> Result<(Framing, bool), UpstreamError> {
    if method == Method::HEAD || status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::Length(0), true));
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        let last = headers.get_all(header::TRANSFER_ENCODING).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).last();
        // Chunked must be the final coding; anything else is read to close (RFC 9112 §6.3).
        return Ok(if last.is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked")) {
            (Framing::Chunked(Chunk::Size), !headers.contains_key(header::CONTENT_LENGTH))
        } else {
            (Framing::Close, false)
        });
    }
    let mut length: Option<u64> = None;
    for v in headers.get_all(header::CONTENT_LENGTH) {
        for part in v.to_str().unwrap_or("x").split(',') {
            let n = part.trim().parse::<u64>().map_err(|_| UpstreamError::Protocol("a malformed Content-Length".into()))?;
            if length.is_some_and(|l| l != n) {
                return Err(UpstreamError::Protocol("two different Content-Length values".into()));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::Close, false),
    })
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(|t| t.trim().eq_ignore_ascii_case(token))
}

#[derive(Debug)]
enum Framing {
    /// This many body bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// Until the worker closes the connection.
    Close,
    Done,
}

#[derive(Debug, Clone, Copy)]
enum Chunk {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

/// A response body being read from its connection.
struct Body {
    conn: Option<TcpStream>,
    buf: BytesMut,
    framing: Framing,
    reusable: bool,
}

impl Body {
    /// The next piece of the body as soon as any is there; `None` at its end.
    async fn chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        loop {
            if let Some(out) = self.decode()? {
                return Ok(Some(out));
            }
            if matches!(self.framing, Framing::Done) {
                return Ok(None);
            }
            let Some(conn) = self.conn.as_mut() else { return Ok(None) };
            self.buf.reserve(16 * 1024);
            let n = conn.read_buf(&mut self.buf).await?;
            if n == 0 {
                if matches!(self.framing, Framing::Close) {
                    self.framing = Framing::Done;
                    self.reusable = false;
                    return Ok(None);
                }
                return Err(UpstreamError::Incomplete);
            }
        }
    }

    /// Takes what `buf` holds of the body; `None` when more bytes are needed or at the end.
    fn decode(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        loop {
            match &mut self.framing {
                Framing::Done => return Ok(None),
                Framing::Length(0) => self.framing = Framing::Done,
                Framing::Length(left) => {
                    if self.buf.is_empty() {
                        return Ok(None);
                    }
                    let n = (*left).min(self.buf.len() as u64) as usize;
                    *left -= n as u64;
                    return Ok(Some(self.buf.split_to(n).freeze()));
                }
                Framing::Close => {
                    return Ok((!self.buf.is_empty()).then(|| self.buf.split().freeze()));
                }
                Framing::Chunked(state) => match *state {
                    Chunk::Size => {
                        let Some(line) = take_line(&mut self.buf)? else { return Ok(None) };
                        let size = line.split(|b| *b == b';').next().unwrap_or(&[]).trim_ascii();
                        let size = std::str::from_utf8(size)
                            .ok()
                            .filter(|s| !s.is_empty())
                            .and_then(|s| u64::from_str_radix(s, 16).ok())
                            .ok_or_else(|| UpstreamError::Protocol("a malformed chunk size".into()))?;
                        *state = if size == 0 { Chunk::Trailers } else { Chunk::Data(size) };
                    }
                    Chunk::Data(left) => {
                        if self.buf.is_empty() {
                            return Ok(None);
                        }
                        let n = left.min(self.buf.len() as u64) as usize;
                        *state = if left == n as u64 { Chunk::DataEnd } else { Chunk::Data(left - n as u64) };
                        return Ok(Some(self.buf.split_to(n).freeze()));
                    }
                    Chunk::DataEnd => {
                        let Some(line) = take_line(&mut self.buf)? else { return Ok(None) };
                        if !line.is_empty() {
                            return Err(UpstreamError::Protocol("a chunk longer than its size".into()));
                        }
                        *state = Chunk::Size;
                    }
                    Chunk::Trailers => {
                        let Some(line) = take_line(&mut self.buf)? else { return Ok(None) };
                        if line.is_empty() {
                            self.framing = Framing::Done;
                        }
                    }
                },
            }
        }
    }

    /// True when the body was read to its end and the connection may carry another request.
    fn finished_reusable(&self) -> bool {
        matches!(self.framing, Framing::Done) && self.reusable && self.buf.is_empty()
    }
}

/// Takes one CRLF- (or LF-) terminated line off `buf`, without its terminator.
fn take_line(buf: &mut BytesMut) -> Result<Option<Bytes>, UpstreamError> {
    match buf.iter().position(|b| *b == b'\n') {
        Some(i) => {
            let mut line = buf.split_to(i + 1).freeze();
            line.truncate(i);
            if line.last() == Some(&b'\r') {
                line.truncate(i - 1);
            }
            Ok(Some(line))
        }
        None if buf.len() > MAX_LINE => Err(UpstreamError::Protocol(format!("a chunk or trailer line over {MAX_LINE} bytes"))),
        None => Ok(None),
    }
}

/// An answer from a worker: status, headers, and a body read on demand. Dropping it before
/// the end of the body closes the connection.
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Body,
    pool: Option<(Arc<Pool>, String)>,
}

impl Response {
    /// The next piece of the body, as soon as the worker sent any; `None` at its end.
    pub async fn chunk(&mut self) -> Result<Option<Bytes>, UpstreamError> {
        let out = self.body.chunk().await;
        if matches!(out, Ok(None)) {
            self.release();
        }
        out
    }

    /// The whole body, refused once it is over `limit` bytes (a `Content-Length` over it is
    /// refused before any byte is read; the connection is then dropped, not reused).
    pub async fn bytes_limited(mut self, limit: usize) -> Result<Bytes, UpstreamError> {
        if let Framing::Length(n) = self.body.framing
            && n > limit as u64
        {
            return Err(UpstreamError::TooLarge { limit });
        }
        let first = match self.chunk().await? {
            None => return Ok(Bytes::new()),
            Some(b) if b.len() > limit => return Err(UpstreamError::TooLarge { limit }),
            Some(b) => b,
        };
        // Usually the whole body: handed on without a copy.
        let Some(second) = self.chunk().await? else { return Ok(first) };
        let mut all = BytesMut::with_capacity(first.len() + second.len());
        all.extend_from_slice(&first);
        let mut next = Some(second);
        while let Some(b) = next {
            if all.len() + b.len() > limit {
                return Err(UpstreamError::TooLarge { limit });
            }
            all.extend_from_slice(&b);
            next = self.chunk().await?;
        }
        Ok(all.freeze())
    }

    /// The whole body.
    pub async fn bytes(mut self) -> Result<Bytes, UpstreamError> {
        let first = match self.chunk().await? {
            None => return Ok(Bytes::new()),
            Some(b) => b,
        };
        let Some(second) = self.chunk().await? else { return Ok(first) };
        let mut all = BytesMut::with_capacity(first.len() + second.len());
        all.extend_from_slice(&first);
        all.extend_from_slice(&second);
        while let Some(b) = self.chunk().await? {
            all.extend_from_slice(&b);
        }
        Ok(all.freeze())
    }

    /// Returns the connection to the pool if it can carry another request.
    fn release(&mut self) {
        if !self.body.finished_reusable() {
            return;
        }
        if let (Some((pool, key)), Some(conn)) = (self.pool.take(), self.body.conn.take()) {
            pool.checkin(&key, conn);
        }
    }
}

impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Response").field("status", &self.status).field("framing", &self.body.framing).finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests;
