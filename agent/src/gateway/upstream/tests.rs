//! The client against a scripted raw-TCP server: what it sends, framing, reuse, failures.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::*;

fn client() -> Client {
    Client::new(8, Duration::from_secs(60), Duration::from_secs(2))
}

fn post(body: &[u8]) -> Request<'_> {
    Request {
        method: &Method::POST,
        path_and_query: "/v1/chat/completions?x=1",
        headers: vec![(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body,
    }
}

/// Reads one request (head and Content-Length body) off `conn`; `None` at EOF.
async fn read_request(conn: &mut TcpStream) -> Option<String> {
    let mut buf = Vec::new();
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length: ")).map(|v| v.trim().parse().unwrap()).unwrap_or(0);
            while buf.len() < end + 4 + len {
                let mut more = [0u8; 4096];
                let n = conn.read(&mut more).await.unwrap();
                assert!(n > 0, "request body cut short");
                buf.extend_from_slice(&more[..n]);
            }
            return Some(String::from_utf8_lossy(&buf).to_string());
        }
        let mut more = [0u8; 4096];
        let n = conn.read(&mut more).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&more[..n]);
    }
}

/// A server that answers each request on each connection with the next scripted answer
/// (a list of writes, sent with a short pause between them; an empty write closes the
/// connection, and so does an answer with no writes), reporting (connection number, request
/// text) for each request.
async fn server(answers: Vec<Vec<&'static [u8]>>) -> (String, mpsc::UnboundedReceiver<(usize, String)>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = format!("http://{}", l.local_addr().unwrap());
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut answers = answers.into_iter();
        let mut n_conn = 0;
        loop {
            let (mut conn, _) = l.accept().await.unwrap();
            n_conn += 1;
            loop {
                let Some(req) = read_request(&mut conn).await else { break };
                let _ = tx.send((n_conn, req));
                let Some(writes) = answers.next() else { return };
                let close = writes.is_empty() || writes.contains(&&b""[..]);
                for w in writes.into_iter().filter(|w| !w.is_empty()) {
                    if conn.write_all(w).await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                if close {
                    break;
                }
            }
        }
    });
    (addr, rx)
}

#[tokio::test]
async fn sends_host_path_and_length_and_reuses_the_connection() {
    let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (url, mut seen) = server(vec![vec![ok], vec![ok]]).await;
    let c = client();
    let t = Target::parse(&url).unwrap();
    for _ in 0..2 {
        let r = c.send(t, &post(b"{\"model\":\"m\"}")).await.unwrap();
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.headers[header::CONTENT_TYPE], "application/json");
        assert_eq!(&r.bytes().await.unwrap()[..], b"{}");
    }
    let (c1, r1) = seen.recv().await.unwrap();
    let (c2, _) = seen.recv().await.unwrap();
    assert_eq!((c1, c2), (1, 1), "the second request must reuse the first connection");
    assert!(r1.starts_with("POST /v1/chat/completions?x=1 HTTP/1.1\r\n"), "{r1}");
    assert!(r1.contains(&format!("host: {}\r\n", t.authority)), "{r1}");
    assert!(r1.contains("content-type: application/json\r\ncontent-length: 13\r\n\r\n{\"model\":\"m\"}"), "{r1}");
}

#[tokio::test]
async fn chunked_bodies_arrive_piece_by_piece() {
    let (url, _seen) = server(vec![vec![
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9;ext=1\r\ndata: ",
        b"a\r\n\r\n",
        b"8\r\ndata: b\n\r\n0\r\nx-trailer: 1\r\n\r\n",
    ]])
    .await;
    let mut r = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap();
    let mut pieces = Vec::new();
    while let Some(b) = r.chunk().await.unwrap() {
        pieces.push(String::from_utf8(b.to_vec()).unwrap());
    }
    assert_eq!(pieces.concat(), "data: a\r\ndata: b\n");
    // The first write's partial chunk was handed out before the rest was sent.
    assert_eq!(pieces[0], "data: ");
    assert!(r.body.finished_reusable());
}

#[tokio::test]
async fn a_body_without_length_is_read_to_close_and_not_reused() {
    let (url, _seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\n\r\nall of it", b", and more", b""]]).await;
    let c = client();
    let t = Target::parse(&url).unwrap();
    let r = c.send(t, &post(b"")).await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"all of it, and more");
    assert!(c.pool.checkout(t.authority).is_none(), "a close-delimited answer leaves nothing to reuse");
}

#[tokio::test]
async fn a_pooled_connection_closed_while_idle_is_not_used() {
    let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    let (url, mut seen) = server(vec![vec![ok, b""], vec![ok]]).await;
    let c = client();
    let t = Target::parse(&url).unwrap();
    assert_eq!(&c.send(t, &post(b"1")).await.unwrap().bytes().await.unwrap()[..], b"ok");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(&c.send(t, &post(b"2")).await.unwrap().bytes().await.unwrap()[..], b"ok");
    let conns: Vec<usize> = [seen.recv().await.unwrap(), seen.recv().await.unwrap()].iter().map(|s| s.0).collect();
    assert_eq!(conns, vec![1, 2], "the closed connection must be noticed at checkout, not sent on");
}

#[tokio::test]
async fn an_idle_connection_the_worker_closed_is_replaced() {
    let ok: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    // First answer then close (empty script entry closes after the next request arrives).
    let (url, mut seen) = server(vec![vec![ok], vec![], vec![ok]]).await;
    let c = client();
    let t = Target::parse(&url).unwrap();
    assert_eq!(&c.send(t, &post(b"1")).await.unwrap().bytes().await.unwrap()[..], b"ok");
    // The second request lands on the pooled connection, which the server closes unanswered:
    // the client must send it again on a new connection.
    let r = c.send(t, &post(b"2")).await.unwrap();
    assert_eq!(&r.bytes().await.unwrap()[..], b"ok");
    let conns: Vec<usize> =
        [seen.recv().await.unwrap(), seen.recv().await.unwrap(), seen.recv().await.unwrap()].iter().map(|s| s.0).collect();
    assert_eq!(conns, vec![1, 1, 2]);
}

#[tokio::test]
async fn interim_answers_are_skipped_and_close_is_honoured() {
    let (url, _seen) =
        server(vec![vec![b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\nyes"]]).await;
    let c = client();
    let t = Target::parse(&url).unwrap();
    let r = c.send(t, &post(b"")).await.unwrap();
    assert_eq!(r.status, StatusCode::OK);
    assert_eq!(&r.bytes().await.unwrap()[..], b"yes");
    assert!(c.pool.checkout(t.authority).is_none(), "connection: close must not be pooled");
}

#[tokio::test]
async fn broken_answers_are_errors() {
    let (url, _seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", b""]]).await;
    let r = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap();
    assert!(matches!(r.bytes().await, Err(UpstreamError::Incomplete)));

    let (url, _seen) = server(vec![vec![b"NOT HTTP\r\n\r\n"]]).await;
    let e = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap_err();
    assert!(matches!(e, UpstreamError::Protocol(_)), "{e:?}");

    let (url, _seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nab"]]).await;
    let e = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap_err();
    assert!(e.to_string().contains("Content-Length"), "{e}");

    let (url, _seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"]]).await;
    let mut r = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap();
    assert!(matches!(r.chunk().await, Err(UpstreamError::Protocol(_))));

    // Nobody listening.
    let port = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let e = client().send(Target::parse(&url).unwrap(), &post(b"")).await.unwrap_err();
    assert!(e.is_connect(), "{e:?}");
}

/// A local worker of account `uid` whose process group is `pgrp` (this test process is its
/// process when `pgrp` is this process's group).
fn worker(uid: u32, pgrp: u32) -> Instance {
    Instance::new(crate::config::LauncherKind::Local, pgrp.to_string(), "k".repeat(32), uid, "/dev/null".into())
}

/// This process's effective uid and process group.
fn me() -> (u32, u32) {
    // SAFETY: plain syscalls.
    let (uid, pgrp) = unsafe { (libc::geteuid(), libc::getpgrp()) };
    (uid, u32::try_from(pgrp).unwrap())
}

/// A worker's port taken by another account (its worker gone): a new connection there is not
/// used, and the request is not sent; the worker's own account is served.
#[tokio::test]
async fn a_port_held_by_another_account_gets_nothing() {
    let (url, mut seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]]).await;
    let (me, pgrp) = me();
    let c = client();
    let e = c.send(Target::parse(&url).unwrap().owned_by(Some(&worker(me.wrapping_add(1), pgrp))), &post(b"{}")).await.unwrap_err();
    assert!(matches!(&e, UpstreamError::NotTheWorker { what: PortLost::OtherUser { uid, .. }, .. } if *uid == me), "{e:?}");
    assert!(e.to_string().contains(&format!("uid {me} listens")), "{e}");
    assert!(e.is_connect(), "nothing was sent: a replica may take the call ({e:?})");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(seen.try_recv().is_err(), "the request reached a process of another account");
    let r = c.send(Target::parse(&url).unwrap().owned_by(Some(&worker(me, pgrp))), &post(b"{}")).await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &b"ok"[..]);
    assert!(seen.try_recv().is_ok(), "the worker's own account is served");
}

/// A worker's port on which a process of the worker account that is not this worker's listens
/// (another worker's: `SO_REUSEPORT` lets one account's sockets share a port, and the kernel
/// spreads connections across them): a new connection there is not used, and the process is
/// named; the worker whose process it is, is served.
#[tokio::test]
async fn a_port_another_workers_process_listens_on_gets_nothing() {
    // The answer closes its connection, so each call below connects anew.
    let (url, mut seen) = server(vec![vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b""]]).await;
    let (me, pgrp) = me();
    let c = client();
    let another = worker(me, pgrp.wrapping_add(1));
    let e = c.send(Target::parse(&url).unwrap().owned_by(Some(&another)), &post(b"{}")).await.unwrap_err();
    let pid = std::process::id();
    assert!(matches!(&e, UpstreamError::NotTheWorker { what: PortLost::Shared { pid: p, .. }, .. } if *p == pid), "{e:?}");
    assert!(e.to_string().contains(&format!("another worker's process (pid {pid})")), "{e}");
    assert!(e.is_connect(), "nothing was sent: a replica may take the call ({e:?})");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(seen.try_recv().is_err(), "the request reached another worker's process");
    let own = worker(me, pgrp);
    let r = c.send(Target::parse(&url).unwrap().owned_by(Some(&own)), &post(b"{}")).await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &b"ok"[..]);
    assert!(seen.try_recv().is_ok(), "the worker's own process is served");
    // Still refused for the other worker on a new connection, though the port's sockets were
    // found to be `own`'s: what was found is kept per worker. (After the answer's connection
    // is seen closed, so the call connects anew.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = c.send(Target::parse(&url).unwrap().owned_by(Some(&another)), &post(b"{}")).await;
    assert!(matches!(again, Err(UpstreamError::NotTheWorker { .. })), "{:?}", again.err());
}

/// A kept-alive connection made for one worker is not handed to another worker's call at the
/// same address: that call connects anew, and the new connection is checked for its worker.
#[tokio::test]
async fn a_kept_alive_connection_of_one_worker_never_carries_anothers_call() {
    let ok: &'static [u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    let (url, mut seen) = server(vec![vec![ok], vec![ok]]).await;
    let (me, pgrp) = me();
    let c = client();
    let own = worker(me, pgrp);
    let r = c.send(Target::parse(&url).unwrap().owned_by(Some(&own)), &post(b"{}")).await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &b"ok"[..]);
    assert_eq!(seen.recv().await.unwrap().0, 1);
    // Another worker given the same address (this process is not its own).
    let another = worker(me, pgrp.wrapping_add(1));
    let e = c.send(Target::parse(&url).unwrap().owned_by(Some(&another)), &post(b"{}")).await.unwrap_err();
    assert!(matches!(&e, UpstreamError::NotTheWorker { what: PortLost::Shared { .. }, .. }), "{e:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(seen.try_recv().is_err(), "the other worker's call went out on the first worker's connection");
    // The first worker's own calls still use its kept-alive connection.
    let r = c.send(Target::parse(&url).unwrap().owned_by(Some(&own)), &post(b"{}")).await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &b"ok"[..]);
    assert_eq!(seen.recv().await.unwrap().0, 1, "the first worker's connection is kept for it");
}

/// A worker whose host answers nothing (here its accept queue is full, so its SYNs are
/// dropped, as by a node that drops packets): the attempt ends at the client's connect
/// timeout (`gateway.upstream_connect_timeout_s`), as a call never sent (a replica may take it).
#[tokio::test]
async fn a_connection_never_answered_ends_at_the_connect_timeout() {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let l = sock.listen(0).unwrap();
    let addr = l.local_addr().unwrap();
    let mut held = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(c)) = tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
            held.push(c);
        }
    }
    let c = Client::new(8, Duration::from_secs(60), Duration::from_secs(1));
    let started = std::time::Instant::now();
    let e = c.send(Target::parse(&format!("http://{addr}")).unwrap(), &post(b"{}")).await.unwrap_err();
    let took = started.elapsed();
    assert!(matches!(e, UpstreamError::ConnectTimeout { seconds: 1, .. }), "{e:?} (connections held: {})", held.len());
    assert!(e.is_connect(), "nothing was sent: a replica may take the call ({e:?})");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(5), "the attempt took {took:?}, not the 1 s timeout");
    drop(l);
}

/// A worker that read the request on a pooled connection and died before answering: the
/// reconnect finds nothing, and the error is not one of a call never sent (no failover).
#[tokio::test]
async fn a_worker_that_died_after_reading_a_pooled_request_is_not_a_connect_failure() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let server = tokio::spawn(async move {
        let (mut conn, _) = l.accept().await.unwrap();
        read_request(&mut conn).await.unwrap();
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await.unwrap();
        // The second request is read, then the worker is gone: connection and port.
        read_request(&mut conn).await.unwrap();
    });
    let c = client();
    let t = Target::parse(&url).unwrap();
    let r = c.send(t, &post(b"{}")).await.unwrap();
    assert_eq!(r.bytes().await.unwrap(), &b"ok"[..]);
    let e = c.send(t, &post(b"{}")).await.unwrap_err();
    server.await.unwrap();
    assert!(matches!(e, UpstreamError::Closed), "{e:?}");
    assert!(!e.is_connect(), "the request may have been read: not a call that was never sent");
}

#[test]
fn targets() {
    let t = Target::parse("http://127.0.0.1:8000").unwrap();
    assert_eq!((t.authority, t.prefix, t.owner.is_none()), ("127.0.0.1:8000", "", true));
    let t = Target::parse("http://gpu01:8000/vllm/").unwrap();
    assert_eq!((t.authority, t.prefix, t.owner.is_none()), ("gpu01:8000", "/vllm", true));
    assert_eq!(Target::parse("http://gpu01").unwrap().connect_addr(), "gpu01:80");
    assert_eq!(Target::parse("http://[::1]:9").unwrap().connect_addr(), "[::1]:9");
    assert_eq!(Target::parse("http://[::1]").unwrap().connect_addr(), "[::1]:80");
    for bad in ["https://x:1", "http://", "ftp://x", "http://u:p@x:1", "http://a b:1"] {
        assert!(Target::parse(bad).is_err(), "{bad}");
    }
}
