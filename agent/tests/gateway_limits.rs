//! The gateway's limits against other users of the node, in process: slow and idle
//! connections, the connection cap, unauthenticated floods (counted per peer, one row per
//! minute, throttled), request bodies held across calls, oversized worker answers, model names
//! the usage log could not store, and the SSO header over the Unix socket (SO_PEERCRED).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::time::{Duration, Instant};

use gateway_support::start;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// Reads from `s` until EOF, an error, or `limit`; returns what arrived and whether the
/// connection ended.
async fn read_until_closed(s: &mut (impl AsyncReadExt + Unpin), limit: Duration) -> (String, bool) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return (String::from_utf8_lossy(&out).into_owned(), false),
            Ok(Ok(0)) | Ok(Err(_)) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
        }
    }
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap();
    (status, body["error"].clone())
}

#[tokio::test]
async fn slow_heads_do_not_stop_other_calls_and_are_closed_after_the_header_timeout() {
    let a = start("[gateway]\nheader_timeout_s = 2\nidle_timeout_s = 4\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    // 200 connections that trickle a request head and never finish it, and 50 that send nothing.
    let mut slow = Vec::new();
    for i in 0..250 {
        let mut s = TcpStream::connect(a.gateway).await.unwrap();
        if i < 200 {
            s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ").await.unwrap();
        }
        slow.push(s);
    }
    let opened = Instant::now();
    let t = Instant::now();
    let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "chat"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(1), "another client's call took {:?}", t.elapsed());
    // Every slow connection is closed after the header timeout (2 s), not before; those that
    // sent part of a head are told why.
    let mut told = 0;
    for (i, s) in slow.iter_mut().enumerate() {
        let (text, closed) = read_until_closed(s, Duration::from_secs(6)).await;
        assert!(closed, "slow connection {i} still open after {:?}", opened.elapsed());
        if text.starts_with("HTTP/1.1 408") {
            assert!(text.contains("gateway.header_timeout_s") && text.contains("header_timeout"), "{text}");
            told += 1;
        }
    }
    let took = opened.elapsed();
    assert!(took >= Duration::from_millis(1900), "closed before the header timeout: {took:?}");
    assert!(told >= 190, "only {told} of 200 slow heads got a 408");
    let m = a.scrape().await;
    assert!(m.contains("gpuhub_gateway_connection_timeouts_total{kind=\"header\"} 200"), "{m}");
    assert!(m.contains("gpuhub_gateway_connection_timeouts_total{kind=\"silent\"} 50"), "{m}");

    // A kept-alive connection lives past the header timeout while idle, and is closed at the
    // idle timeout.
    let mut s = TcpStream::connect(a.gateway).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut buf = [0u8; 1024];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let idle = Instant::now();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"), "kept-alive connection cut at the header timeout");
    let idle2 = Instant::now();
    let (text, closed) = read_until_closed(&mut s, Duration::from_secs(8)).await;
    assert!(closed && text.is_empty(), "an idle connection is closed without an answer: {text:?}");
    assert!(idle2.elapsed() >= Duration::from_millis(3900), "closed before the idle timeout: {:?}", idle.elapsed());
    a.stop().await;
}

#[tokio::test]
async fn past_the_connection_cap_a_new_connection_is_told_so() {
    let a = start("[gateway]\nmax_connections = 16\n").await;
    let mut held = Vec::new();
    for _ in 0..16 {
        let mut s = TcpStream::connect(a.gateway).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut buf = [0u8; 512];
        assert!(s.read(&mut buf).await.unwrap() > 0);
        held.push(s);
    }
    let mut s = TcpStream::connect(a.gateway).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let (text, closed) = read_until_closed(&mut s, Duration::from_secs(5)).await;
    assert!(closed && text.starts_with("HTTP/1.1 503"), "{text}");
    assert!(text.contains("too_many_connections") && text.contains("gateway.max_connections"), "{text}");
    drop(held);
    let t = Instant::now();
    while client().get(a.url("/healthz")).send().await.map(|r| r.status().as_u16()).unwrap_or(0) != 200 {
        assert!(t.elapsed() < Duration::from_secs(5), "slots were not given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(a.scrape().await.contains("gpuhub_gateway_connections_refused_total 1"));
    a.stop().await;
}

#[tokio::test]
async fn an_unauthenticated_flood_is_counted_throttled_and_kept_as_one_row_per_minute() {
    let a = start("[gateway]\nunauth_refusals_per_s = 10\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let long_path = format!("/v1/{}", "p".repeat(5000));
    let mut statuses = std::collections::BTreeMap::new();
    let http = client();
    for i in 0..600 {
        let path = if i % 2 == 0 { "/v1/chat/completions" } else { long_path.as_str() };
        let r = http.post(a.url(path)).bearer_auth("ghk_wrong").json(&json!({"model": "chat"})).send().await.unwrap();
        let status = r.status().as_u16();
        if status == 429 {
            assert_eq!(r.headers().get("connection").map(|v| v.to_str().unwrap()), Some("close"));
            let (_, e) = error_of(r).await;
            assert_eq!(e["code"], "too_many_unauthenticated");
            assert!(e["message"].as_str().unwrap().contains("gateway.unauth_refusals_per_s"), "{e}");
        }
        *statuses.entry(status).or_insert(0) += 1;
    }
    assert!(statuses.get(&401).is_some_and(|n| *n >= 50) && statuses.get(&429).is_some_and(|n| *n >= 400), "{statuses:?}");
    // A caller with a key, from the same address, is not throttled.
    let r = http.post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "chat"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let m = a.scrape().await;
    let counted: u64 = m
        .lines()
        .filter(|l| l.starts_with("gpuhub_gateway_refused_calls_total{peer=\"127.0.0.1\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(counted, 600, "{m}");
    let db = a.db_url.clone();
    let _dir = a.stop().await; // shutdown records the minute's refusal rows (the store is in _dir)
    let rows = gateway_support::read_rows(&db).await;
    let refused: Vec<&Value> = rows.iter().filter(|r| r["user_name"] == "").collect();
    assert!((1..=2).contains(&refused.len()), "one row per peer and minute, got {}: {refused:#?}", refused.len());
    assert!(refused.iter().all(|r| r["route"].as_str().unwrap().len() <= 128 && r["client_addr"] == "127.0.0.1"), "{refused:#?}");
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(&db).await.unwrap();
    let (calls,): (i64,) =
        sqlx::query_as("SELECT CAST(SUM(calls) AS BIGINT) FROM usage_log WHERE user_name = ''").fetch_one(&pool).await.unwrap();
    assert_eq!(calls, 600, "the row counts every refused call");
    let (rolled,): (i64,) =
        sqlx::query_as("SELECT CAST(SUM(calls) AS BIGINT) FROM call_rollups WHERE user_name = ''").fetch_one(&pool).await.unwrap();
    assert_eq!(rolled, 600);
    pool.close().await;
}

#[tokio::test]
async fn request_bodies_share_a_budget_and_oversized_answers_are_refused() {
    let a = start("[gateway]\nmax_body_bytes = 4096\nmax_body_bytes_total = 8192\nmax_response_bytes = 65536\nbody_timeout_s = 5\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    // Two uploads of 4096 bytes that stall half way hold the whole budget.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(a.gateway).await.unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: 4096\r\n\r\n{{\"model\": \"chat\", \"x\": \""
        );
        s.write_all(head.as_bytes()).await.unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "chat"})).send().await.unwrap();
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (503, Some("server_busy")), "{e}");
    assert!(e["message"].as_str().unwrap().contains("gateway.max_body_bytes_total"), "{e}");
    drop(held);
    let t = Instant::now();
    loop {
        let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "chat"})).send().await.unwrap();
        if r.status() == 200 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(5), "the budget was not given back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A worker answer over gateway.max_response_bytes: plain and streamed.
    let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "big"})).send().await.unwrap();
    let (s, e) = error_of(r).await;
    assert_eq!((s, e["code"].as_str()), (502, Some("upstream_response_too_large")), "{e}");
    assert!(e["message"].as_str().unwrap().contains("gateway.max_response_bytes"), "{e}");
    let r =
        client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "big", "stream": true})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("upstream_response_too_large") && text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(text.len() < 64 * 1024, "the oversized event was not forwarded");
    a.stop().await;
}

#[tokio::test]
async fn a_model_name_with_a_control_character_is_refused_at_parse_and_the_usage_log_goes_on() {
    let a = start("").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    for name in ["chat\u{0}", "ch\nat", "\u{1b}[31mchat"] {
        let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": name})).send().await.unwrap();
        let (s, e) = error_of(r).await;
        assert_eq!((s, e["code"].as_str(), e["param"].as_str()), (400, Some("invalid_model_name"), Some("model")), "{e}");
        assert!(e["message"].as_str().unwrap().contains("control character"), "{e}");
    }
    let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).json(&json!({"model": "chat"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let rows = a.rows(4).await;
    assert!(rows.iter().all(|r| !r["requested_name"].as_str().unwrap().chars().any(char::is_control)), "{rows:#?}");
    assert_eq!(rows.iter().filter(|r| r["error_code"] == "invalid_model_name").count(), 3);
    a.stop().await;
}

fn me() -> (u32, String) {
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    (uid, gpuhub_agent::control::peer::user_name(uid).unwrap())
}

/// One HTTP/1.1 call over a Unix socket; returns the answer's text.
async fn unix_call(path: &std::path::Path, headers: &str) -> String {
    let mut s = tokio::net::UnixStream::connect(path).await.unwrap();
    let body = r#"{"model": "chat"}"#;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{headers}\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    read_until_closed(&mut s, Duration::from_secs(10)).await.0
}

#[tokio::test]
async fn the_sso_socket_believes_the_header_only_from_its_users() {
    let (uid, name) = me();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("sso.sock");
    let cfg = |users: &str| {
        format!(
            "[gateway.sso]\nenabled = true\nuser_header = \"X-Forwarded-User\"\nsocket = \"{}\"\nsocket_users = [{users}]\n",
            sock.display()
        )
    };
    let a = start(&cfg(&format!("\"{name}\""))).await;
    let text = unix_call(&sock, "x-forwarded-user: dave\r\n").await;
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    // The same header over TCP (from 127.0.0.1, where every user is) is refused.
    let r = client()
        .post(a.url("/v1/chat/completions"))
        .header("x-forwarded-user", "dave")
        .json(&json!({"model": "chat"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let rows = a.rows(1).await;
    let dave = rows.iter().find(|r| r["user_name"] == "dave").unwrap();
    assert_eq!((dave["app"].as_str(), dave["client_addr"].as_str()), (Some("sso"), Some(format!("unix:uid={uid}").as_str())));
    a.stop().await;
    // A socket whose users do not include this process's: the header is refused there too.
    let a = start(&cfg(&format!("\"{}\"", uid.wrapping_add(4242)))).await;
    let text = unix_call(&sock, "x-forwarded-user: dave\r\n").await;
    assert!(text.starts_with("HTTP/1.1 401") && text.contains("only accepted from the site's proxy"), "{text}");
    a.stop().await;
}
