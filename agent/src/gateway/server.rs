//! Serves the gateway's listeners (its TCP address and, with `[gateway.sso] socket`, a Unix
//! socket) over HTTP/1.1, with the limits that keep one client from taking the gateway away
//! from the others on the node:
//!
//! - **Connection cap** (`gateway.max_connections`, over every listener together): past it a
//!   new connection is answered `503 too_many_connections` and closed, so the accept loop never
//!   stalls and the refused client learns why.
//! - **Header timeout** (`gateway.header_timeout_s`): a new connection must deliver a request
//!   head within it, and on a kept-alive connection the head must be complete within it of its
//!   first byte. A connection that trickles a head (slowloris) is answered
//!   `408 header_timeout` and closed; one that sent nothing is closed.
//! - **Idle timeout** (`gateway.idle_timeout_s`): a kept-alive connection without a request is
//!   closed.
//! - A request head is at most [`MAX_HEAD`] bytes (hyper answers `431` past it).
//!
//! hyper's own `header_read_timeout` starts its clock when a connection goes idle, so an idle
//! keep-alive connection would be cut at the header timeout; the two timeouts are kept apart
//! here by watching each connection: its requests in progress (a request counts from its head
//! to the last byte of its answer) and the first byte that arrives while it is idle.
//!
//! Request bodies and answers have their own limits (`gateway.body_timeout_s`,
//! `gateway.max_body_bytes[_total]`, `gateway.max_response_bytes`; see [`super::limits`]).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use super::error::GatewayError;

/// Largest request head (request line and headers) read.
pub const MAX_HEAD: usize = 64 * 1024;
/// Refusals (`503` at the connection cap) being written at once; past it a refused
/// connection is just closed.
const REFUSING: usize = 64;

/// Who is on the other end of a gateway connection (a request extension).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Tcp(SocketAddr),
    /// A connection on the SSO Unix socket, with the credentials the kernel reports.
    Unix {
        uid: u32,
        gid: u32,
        pid: Option<i32>,
    },
}

impl Peer {
    /// The peer as the usage log and the refusal counters name it: the IP address without
    /// its port (a new one per connection), or `unix:uid=N`.
    pub fn address(&self) -> String {
        match self {
            Peer::Tcp(a) => a.ip().to_canonical().to_string(),
            Peer::Unix { uid, .. } => format!("unix:uid={uid}"),
        }
    }
}

/// The connection limits of [`serve`].
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

impl Limits {
    pub fn from_config(g: &crate::config::GatewayConfig) -> Limits {
        Limits {
            header_timeout: Duration::from_secs(g.header_timeout_s),
            idle_timeout: Duration::from_secs(g.idle_timeout_s),
            max_connections: g.max_connections,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TimeoutLabel {
    kind: &'static str,
}

/// Connection slots and counters, shared by every listener of the gateway.
pub struct Connections {
    limits: Limits,
    slots: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    open: Gauge,
    refused: Counter,
    timeouts: Family<TimeoutLabel, Counter>,
    /// When the last "connection cap reached" / "accept failed" warning was logged.
    warned: Mutex<Option<Instant>>,
}

impl Connections {
    /// Registers the connection metrics in `registry` (the `gpuhub` sub-registry).
    pub fn register(limits: Limits, registry: &mut Registry) -> Connections {
        let c = Connections {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            refusing: Arc::new(Semaphore::new(REFUSING)),
            open: Gauge::default(),
            refused: Counter::default(),
            timeouts: Family::default(),
            warned: Mutex::new(None),
        };
        registry.register("gateway_connections", "Gateway connections open now", c.open.clone());
        registry.register(
            "gateway_connections_refused",
            "Connections answered 503 and closed because gateway.max_connections were open",
            c.refused.clone(),
        );
        registry.register(
            "gateway_connection_timeouts",
            "Connections closed by the gateway: kind = header (head not complete within gateway.header_timeout_s), silent (a new connection that sent nothing), idle (gateway.idle_timeout_s)",
            c.timeouts.clone(),
        );
        c
    }

    /// Logs `msg` at most every 10 s (a flood must not flood the log too).
    fn warn_now(&self) -> bool {
        let mut w = self.warned.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.is_some_and(|t| t.elapsed() < Duration::from_secs(10)) {
            return false;
        }
        *w = Some(Instant::now());
        true
    }
}

/// A socket the gateway accepts connections on.
pub trait Listener: Send + 'static {
    type Io: AsyncRead + AsyncWrite + AsRawFd + Unpin + Send + 'static;
    fn accept_peer(&self) -> impl Future<Output = io::Result<(Self::Io, Peer)>> + Send;
}

impl Listener for TcpListener {
    type Io = TcpStream;
    async fn accept_peer(&self) -> io::Result<(TcpStream, Peer)> {
        let (s, addr) = self.accept().await?;
        // SSE chunks are small writes; with Nagle a chunk can wait ~40 ms for the client's
        // delayed ACK of the previous one.
        if let Err(e) = s.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY on a gateway connection");
        }
        Ok((s, Peer::Tcp(addr)))
    }
}

impl Listener for UnixListener {
    type Io = UnixStream;
    async fn accept_peer(&self) -> io::Result<(UnixStream, Peer)> {
        let (s, _) = self.accept().await?;
        let peer = match s.peer_cred() {
            Ok(c) => Peer::Unix { uid: c.uid(), gid: c.gid(), pid: c.pid() },
            // Unknown peer: nobody, whom no SSO socket user list names.
            Err(_) => Peer::Unix { uid: u32::MAX - 1, gid: u32::MAX - 1, pid: None },
        };
        Ok((s, peer))
    }
}

/// Accepts connections on `listener` and serves `app` on each until `shutdown`; then lets
/// the requests in progress finish (each connection closes after its answer) and returns.
pub async fn serve<L: Listener>(listener: L, app: Router, conns: Arc<Connections>, shutdown: CancellationToken) -> io::Result<()> {
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            r = listener.accept_peer() => r,
            _ = shutdown.cancelled() => break,
        };
        let (io, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors (or another transient failure): the connection stays
                // in the backlog; a short pause keeps this loop from spinning.
                if conns.warn_now() {
                    tracing::warn!(error = %e, "the gateway cannot accept a connection (raise LimitNOFILE or lower gateway.max_connections)");
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
        };
        match conns.slots.clone().try_acquire_owned() {
            Ok(slot) => {
                tracker.spawn(connection(io, peer, app.clone(), conns.clone(), slot, shutdown.clone()));
            }
            Err(_) => {
                conns.refused.inc();
                if conns.warn_now() {
                    tracing::warn!(
                        limit = conns.limits.max_connections,
                        "gateway.max_connections connections are open; new ones are answered 503 and closed"
                    );
                }
                if let Ok(p) = conns.refusing.clone().try_acquire_owned() {
                    let answer = GatewayError::ConnectionCap { limit: conns.limits.max_connections }.raw_response();
                    tokio::spawn(refuse(io, answer, p));
                }
            }
        }
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Writes a refusal to a connection that is not served, then closes it once the client had
/// a moment to read it (a close with unread request bytes would reset the connection and
/// could destroy the answer in flight).
async fn refuse<I: AsyncRead + AsyncWrite + Unpin>(mut io: I, answer: Vec<u8>, _p: OwnedSemaphorePermit) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        io.write_all(&answer).await?;
        io.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut read = 0;
        while read < 64 * 1024 {
            match io.read(&mut sink).await? {
                0 => break,
                n => read += n,
            }
        }
        Ok::<_, io::Error>(())
    })
    .await;
}

/// What a connection is doing, for its deadlines.
struct WatchState {
    opened: Instant,
    /// Requests whose head arrived and whose answer has not been written to its end.
    active: u32,
    /// Requests that arrived so far.
    served: u64,
    /// When the connection last became idle (its last answer ended).
    idle_since: Instant,
    /// The first byte that arrived while the connection was idle.
    first_byte: Option<Instant>,
}

struct Watch {
    state: Mutex<WatchState>,
    /// Set while the connection is idle and no byte arrived since: the next read records its
    /// first byte (a cheap check on every read, the lock only then).
    awaiting_first_byte: AtomicBool,
    /// Wakes the connection's task when a deadline moved earlier (a head began while idle).
    changed: Notify,
}

/// Why a connection's deadline passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    /// Bytes of a head arrived, the head did not complete in time: answered 408.
    Header,
    /// A new connection that sent nothing.
    Silent,
    /// A kept-alive connection without a next request.
    Idle,
}

impl Watch {
    fn new() -> Watch {
        let now = Instant::now();
        Watch {
            state: Mutex::new(WatchState { opened: now, active: 0, served: 0, idle_since: now, first_byte: None }),
            awaiting_first_byte: AtomicBool::new(true),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn bytes_in(&self) {
        if !self.awaiting_first_byte.swap(false, Ordering::Relaxed) {
            return;
        }
        let mut s = self.lock();
        if s.active == 0 && s.first_byte.is_none() {
            s.first_byte = Some(Instant::now());
            // A new connection's deadline stays its opening's; a kept-alive one's moves
            // earlier (from the idle timeout to the header timeout): wake the task.
            let moved = s.served > 0;
            drop(s);
            if moved {
                self.changed.notify_one();
            }
        }
    }

    /// When the connection must be closed, and why, unless it changes first.
    fn deadline(&self, l: &Limits) -> Option<(Instant, Expiry)> {
        let s = self.lock();
        if s.active > 0 {
            return None;
        }
        Some(match (s.served, s.first_byte) {
            (0, first) => (s.opened + l.header_timeout, if first.is_some() { Expiry::Header } else { Expiry::Silent }),
            (_, Some(t)) => (t + l.header_timeout, Expiry::Header),
            (_, None) => (s.idle_since + l.idle_timeout, Expiry::Idle),
        })
    }
}

/// Counts a request as in progress until dropped (with its answer's body).
struct Active(Arc<Watch>);

// Neither the start nor the end of a request wakes the connection's task: while a request is
// in progress the task's timer is armed an idle timeout ahead, which is never later than the
// deadline the connection has once it is idle again, so the timer fires, finds the new
// deadline and re-arms.
impl Active {
    fn start(w: &Arc<Watch>) -> Active {
        w.awaiting_first_byte.store(false, Ordering::Relaxed);
        let mut s = w.lock();
        s.active += 1;
        s.served += 1;
        s.first_byte = None;
        drop(s);
        Active(w.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        let mut s = self.0.lock();
        s.active = s.active.saturating_sub(1);
        if s.active == 0 {
            s.idle_since = Instant::now();
            s.first_byte = None;
            self.0.awaiting_first_byte.store(true, Ordering::Relaxed);
        }
    }
}

/// An answer's body that keeps its request counted as in progress until hyper drops it
/// (after the last byte, or when the connection ends).
struct Tracked {
    inner: Body,
    _active: Active,
}

impl HttpBody for Tracked {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's socket, noting the first byte that arrives while it is idle.
struct Watched<I> {
    inner: I,
    watch: Arc<Watch>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Watched<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.watch.bytes_in();
        }
        r
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Watched<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Serves one connection until it ends, its deadline passes, or shutdown has let its last
/// answer finish.
async fn connection<I>(io: I, peer: Peer, app: Router, conns: Arc<Connections>, _slot: OwnedSemaphorePermit, shutdown: CancellationToken)
where
    I: AsyncRead + AsyncWrite + AsRawFd + Unpin + Send + 'static,
{
    conns.open.inc();
    let fd = io.as_raw_fd();
    let watch = Arc::new(Watch::new());
    let svc = {
        let watch = watch.clone();
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(peer.clone());
            let active = Active::start(&watch);
            let app = app.clone();
            async move {
                let resp = app.oneshot(req.map(Body::new)).await?;
                Ok::<_, std::convert::Infallible>(resp.map(|inner| Tracked { inner, _active: active }))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(true).max_buf_size(MAX_HEAD);
    let conn = builder.serve_connection(TokioIo::new(Watched { inner: io, watch: watch.clone() }), svc);
    let mut conn = std::pin::pin!(conn);
    let mut shutting_down = false;
    let arm = |w: &Watch| match w.deadline(&conns.limits) {
        Some((t, _)) => t,
        None => Instant::now() + conns.limits.idle_timeout,
    };
    let mut at = arm(&watch);
    let timer = tokio::time::sleep_until(tokio::time::Instant::from_std(at));
    let mut timer = std::pin::pin!(timer);
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "gateway connection ended with an error");
                }
                break;
            }
            _ = timer.as_mut() => {
                // Due? (A request may have arrived, or ended, since the timer was armed.)
                let due = watch.deadline(&conns.limits).filter(|(t, _)| *t <= Instant::now());
                let Some((_, why)) = due else {
                    at = arm(&watch);
                    timer.as_mut().reset(tokio::time::Instant::from_std(at));
                    continue;
                };
                let kind = match why {
                    Expiry::Header => {
                        // Nothing of an answer was written on this connection since it went
                        // idle, so the refusal is the next thing the client reads.
                        send_now(fd, &GatewayError::HeaderTimeout { seconds: conns.limits.header_timeout.as_secs() }.raw_response());
                        "header"
                    }
                    Expiry::Silent => "silent",
                    Expiry::Idle => "idle",
                };
                conns.timeouts.get_or_create(&TimeoutLabel { kind }).inc();
                break;
            }
            _ = watch.changed.notified() => {
                let next = arm(&watch);
                if next < at {
                    at = next;
                    timer.as_mut().reset(tokio::time::Instant::from_std(at));
                }
            }
            _ = shutdown.cancelled(), if !shutting_down => {
                shutting_down = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
    conns.open.dec();
}

/// Writes `bytes` to the socket `fd` without waiting (a refusal that fits in an empty socket
/// buffer), then shuts down its sending side. The caller owns the socket and is not using it.
fn send_now(fd: RawFd, bytes: &[u8]) {
    // SAFETY: `fd` is the open socket of the connection being closed by this task, which
    // owns it (through the pinned hyper connection) and does not poll it meanwhile; send
    // reads `bytes.len()` bytes from a valid slice and never blocks (MSG_DONTWAIT).
    unsafe {
        libc::send(fd, bytes.as_ptr().cast(), bytes.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL);
        libc::shutdown(fd, libc::SHUT_WR);
    }
}

/// Raises the soft limit on open files to what `connections` need (plus room for the
/// agent's own files and worker connections), up to the hard limit; warns when that is not
/// enough.
pub fn raise_fd_limit(connections: usize) {
    let want = (connections as u64).saturating_mul(2).saturating_add(1024);
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into `lim`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return;
    }
    if lim.rlim_cur < want {
        let new = libc::rlimit { rlim_cur: want.min(lim.rlim_max), rlim_max: lim.rlim_max };
        // SAFETY: setrlimit reads `new`; raising the soft limit up to the hard one is allowed.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &new) } == 0 {
            lim = new;
        }
    }
    if lim.rlim_cur < want {
        tracing::warn!(
            open_files = lim.rlim_cur,
            needed = want,
            "gateway.max_connections needs more open files than the limit allows; raise LimitNOFILE in the unit or lower gateway.max_connections"
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_follow_what_the_connection_does() {
        let l = Limits { header_timeout: Duration::from_secs(10), idle_timeout: Duration::from_secs(60), max_connections: 16 };
        let w = Arc::new(Watch::new());
        let opened = w.lock().opened;
        assert_eq!(w.deadline(&l), Some((opened + l.header_timeout, Expiry::Silent)));
        w.bytes_in();
        assert_eq!(w.deadline(&l).map(|d| d.1), Some(Expiry::Header), "a new connection's head: counted from its opening");
        let a = Active::start(&w);
        assert_eq!(w.deadline(&l), None, "no deadline while a request is in progress");
        w.bytes_in();
        assert_eq!(w.deadline(&l), None, "body bytes are not a new head");
        drop(a);
        let (t, why) = w.deadline(&l).unwrap();
        assert_eq!(why, Expiry::Idle);
        assert!(t >= Instant::now() + Duration::from_secs(59), "idle: gateway.idle_timeout_s");
        w.bytes_in();
        let (t, why) = w.deadline(&l).unwrap();
        assert_eq!(why, Expiry::Header);
        assert!(t <= Instant::now() + Duration::from_secs(10), "a kept-alive head: from its first byte");
    }

    #[test]
    fn peers_are_named_without_ports() {
        assert_eq!(Peer::Tcp("127.0.0.1:5555".parse().unwrap()).address(), "127.0.0.1");
        assert_eq!(Peer::Tcp("[::ffff:10.0.0.1]:1".parse().unwrap()).address(), "10.0.0.1");
        assert_eq!(Peer::Tcp("[::1]:1".parse().unwrap()).address(), "::1");
        assert_eq!(Peer::Unix { uid: 7, gid: 7, pid: None }.address(), "unix:uid=7");
    }
}
