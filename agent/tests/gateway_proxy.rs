//! The gateway in process, against a scriptable upstream on 127.0.0.1:0: forwarding, streaming,
//! identity, every bad input, the usage rows and the metrics each call leaves.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use gateway_support::{Agent, start};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(a: &Agent, key: &str, path: &str, body: Value) -> reqwest::Response {
    client().post(a.url(path)).bearer_auth(key).json(&body).send().await.unwrap()
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let status = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or_else(|e| panic!("status {status}: body is not JSON: {e}"));
    let err = body["error"].clone();
    assert!(
        err["message"].is_string() && err.get("type").is_some() && err.get("param").is_some() && err.get("code").is_some(),
        "not OpenAI-shaped: {body}"
    );
    (status, err)
}

fn find<'a>(rows: &'a [Value], request_id: &str) -> &'a Value {
    rows.iter().find(|r| r["request_id"] == request_id).unwrap_or_else(|| panic!("no row for {request_id}: {rows:#?}"))
}

#[tokio::test]
async fn plain_call_is_forwarded_with_the_workers_key_and_leaves_one_row() {
    let a = start("").await;
    let (key, _) = a.key("alice", "ocr-service", &[]).await;
    let r = client()
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .header("user-agent", "app/1.0")
        .json(&json!({"model": "chat", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "hello");
    let seen = a.upstream.seen.lock().unwrap().clone();
    assert_eq!(seen.authorization.as_deref(), Some("Bearer worker-secret"), "the client's key must never reach the worker");
    assert_eq!(seen.path, "/v1/chat/completions");
    let rows = a.rows(1).await;
    let row = find(&rows, &rid);
    assert_eq!((row["user_name"].as_str(), row["app"].as_str(), row["status"].as_i64()), (Some("alice"), Some("ocr-service"), Some(200)));
    assert_eq!((row["prompt_tokens"].as_i64(), row["completion_tokens"].as_i64()), (Some(5), Some(7)));
    assert_eq!(
        (row["requested_name"].as_str(), row["resolved_model"].as_str(), row["name_state"].as_str()),
        (Some("chat"), Some("chat"), Some("active"))
    );
    assert_eq!(
        (row["route"].as_str(), row["user_agent"].as_str(), row["client_addr"].as_str()),
        (Some("/v1/chat/completions"), Some("app/1.0"), Some("127.0.0.1"))
    );
    assert_eq!(row["streamed"].as_i64(), Some(0));
    assert!(row["latency_us"].as_i64().unwrap() >= row["overhead_us"].as_i64().unwrap());
    assert!(row["upstream_ttfb_us"].as_i64().unwrap() > 0);
    // Only OpenAI inference routes are forwarded (the query string goes along).
    let r = post(&a, &key, "/v1/completions?lang=en", json!({"model": "chat", "prompt": "Ada Lovelace"})).await;
    assert_eq!(r.status(), 200);
    assert_eq!(a.upstream.seen.lock().unwrap().path, "/v1/completions");
    // Audio speech: binary bytes come back untouched.
    let r = post(&a, &key, "/v1/audio/speech", json!({"model": "chat", "input": "hi", "voice": "x"})).await;
    assert_eq!(r.headers()["content-type"], "audio/wav");
    assert_eq!(r.bytes().await.unwrap().as_ref(), &[0u8, 1, 2, 3, 255]);
    a.stop().await;
}

#[tokio::test]
async fn deprecated_names_are_served_renamed_with_headers() {
    let a = start("").await;
    let (key, _) = a.key("alice", "ocr-service", &[]).await;
    let r = post(&a, &key, "/v1/chat/completions", json!({"model": "svc-chat", "messages": []})).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["deprecation"].to_str().unwrap().starts_with('@'));
    assert_eq!(r.headers()["sunset"], "Thu, 31 Dec 2026 00:00:00 GMT");
    assert!(r.headers()["link"].to_str().unwrap().contains("chat"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["echo"]["model"], "chat", "the worker must be asked for its own name");
    let rows = a.rows(1).await;
    assert_eq!(
        (rows[0]["requested_name"].as_str(), rows[0]["resolved_model"].as_str(), rows[0]["name_state"].as_str()),
        (Some("svc-chat"), Some("chat"), Some("deprecated"))
    );
    a.stop().await;
}

/// Reads an SSE body into its events, with the time each arrived.
async fn events(r: reqwest::Response) -> Vec<String> {
    let text = r.text().await.unwrap();
    text.split("\n\n").filter(|e| !e.is_empty()).map(str::to_string).collect()
}

#[tokio::test]
async fn streams_pass_through_and_usage_is_captured_but_stripped_unless_asked() {
    let a = start("").await;
    let (key, _) = a.key("bob", "chatbot", &[]).await;
    let r = post(&a, &key, "/v1/chat/completions", json!({"model": "chat", "stream": true, "messages": []})).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let ev = events(r).await;
    assert_eq!(ev.len(), 4, "{ev:?}"); // 3 chunks + [DONE], no usage chunk
    assert!(ev.iter().all(|e| !e.contains("\"usage\":{")), "{ev:?}");
    assert_eq!(ev.last().unwrap(), "data: [DONE]");
    let asked: Value = serde_json::from_slice(&a.upstream.seen.lock().unwrap().body).unwrap();
    assert_eq!(asked["stream_options"]["include_usage"], true, "the gateway asks the upstream for usage");
    let rows = a.rows(1).await;
    assert_eq!(
        (rows[0]["prompt_tokens"].as_i64(), rows[0]["completion_tokens"].as_i64(), rows[0]["streamed"].as_i64()),
        (Some(4), Some(3), Some(1))
    );

    let r =
        post(&a, &key, "/v1/chat/completions", json!({"model": "chat", "stream": true, "stream_options": {"include_usage": true}})).await;
    let ev = events(r).await;
    assert_eq!(ev.len(), 5, "{ev:?}");
    assert!(ev[3].contains("\"prompt_tokens\":4"), "{ev:?}");
    a.rows(2).await;
    a.stop().await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_keeps_its_usage_row() {
    let a = start("").await;
    let (key, _) = a.key("carol", "app", &[]).await;
    let r = post(&a, &key, "/v1/chat/completions", json!({"model": "slow", "stream": true})).await;
    let rid = r.headers()["x-request-id"].to_str().unwrap().to_string();
    let mut s = r.bytes_stream();
    let first = s.next().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("w0"));
    drop(s); // the client goes away after the first chunk
    let t = Instant::now();
    let rows = a.rows(1).await;
    let row = find(&rows, &rid);
    assert_eq!(row["completion_tokens"].as_i64(), Some(10), "the upstream was drained to its usage chunk");
    assert_eq!(row["error_code"].as_str(), Some("client_closed"));
    assert!(t.elapsed() < Duration::from_secs(5));
    a.stop().await;
}

/// A plain call whose client gives up while the worker thinks (an SDK's timeout) still leaves
/// its row: hyper drops the handler's future, the row says 499 `client_closed`.
#[tokio::test]
async fn a_client_that_gives_up_on_a_plain_call_keeps_its_usage_row() {
    let a = start("").await;
    let (key, _) = a.key("carol", "app", &[]).await;
    let t = Instant::now();
    let gave_up = client()
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .timeout(Duration::from_millis(500))
        .json(&json!({"model": "hang"}))
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()), "the client timed out");
    let rows = a.rows(1).await;
    let row = &rows[0];
    assert_eq!((row["user_name"].as_str(), row["requested_name"].as_str()), (Some("carol"), Some("hang")), "{row}");
    assert_eq!((row["status"].as_i64(), row["error_code"].as_str()), (Some(499), Some("client_closed")), "{row}");
    assert!(row["latency_us"].as_i64().unwrap() >= 500_000, "{row}");
    assert!(t.elapsed() < Duration::from_secs(10), "the row came when the client left, not when the worker answered");
    a.stop().await;
}

/// Sends a chat call on a connection with a 4 KiB receive buffer that never reads a byte of
/// the answer (the connection stays open while the returned socket lives).
async fn call_and_never_read(gateway: std::net::SocketAddr, key: &str, body: &Value) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let mut sock = sock.connect(gateway).await.unwrap();
    let body = body.to_string();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(format!("{head}{body}").as_bytes()).await.unwrap();
    sock
}

/// A stream whose client stops reading but keeps its connection is taken as gone after
/// `body_timeout_s` without taking an event: its row is written and its slot freed.
#[tokio::test]
async fn a_stream_whose_client_stops_reading_is_ended() {
    let a = start("[gateway]\nbody_timeout_s = 1\n").await;
    let (key, _) = a.key("dave", "app", &[]).await;
    let sock = call_and_never_read(a.gateway, &key, &json!({"model": "flood", "stream": true})).await;
    let t = Instant::now();
    let rows = a.rows(1).await; // never reads a byte of the answer
    let row = &rows[0];
    assert_eq!((row["user_name"].as_str(), row["error_code"].as_str()), (Some("dave"), Some("client_closed")), "{row}");
    assert!(t.elapsed() < Duration::from_secs(8), "ended {:?} after the call", t.elapsed());
    drop(sock);
    a.stop().await;
}

/// Plain answers that callers do not take stay counted (`max_response_bytes_total`): while
/// one 8 MiB answer waits for a client that reads nothing, a second does not fit in 12 MiB and
/// is refused with a 503 that names the limit; once that client goes, it fits again.
#[tokio::test]
async fn answers_waiting_for_slow_readers_share_one_budget() {
    let a = start("[gateway]\nmax_response_bytes = 10485760\nmax_response_bytes_total = 12582912\n").await;
    let (key, _) = a.key("dave", "app", &[]).await;
    let slow = call_and_never_read(a.gateway, &key, &json!({"model": "flood"})).await;
    let until = |want: u16| {
        let (a, key) = (&a, key.clone());
        async move {
            let t = Instant::now();
            loop {
                let r = post(a, &key, "/v1/chat/completions", json!({"model": "flood"})).await;
                let status = r.status().as_u16();
                let text = r.text().await.unwrap();
                if status == want {
                    return text;
                }
                assert!(t.elapsed() < Duration::from_secs(10), "expected {want}, still {status}: {}", &text[..text.len().min(300)]);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let refused = until(503).await;
    assert!(refused.contains("server_busy") && refused.contains("gateway.max_response_bytes_total"), "{refused}");
    drop(slow);
    until(200).await;
    a.stop().await;
}

#[tokio::test]
async fn upstream_failures_name_the_model_and_what_happened() {
    let a = start("[gateway]\nupstream_timeout_s = 1\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let (s, e) = error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "fail"})).await).await;
    assert_eq!(s, 502);
    assert!(e["message"].as_str().unwrap().contains("model `fail`") && e["message"].as_str().unwrap().contains("500"), "{e}");
    let (s, e) = error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "down"})).await).await;
    assert_eq!(s, 502);
    assert!(e["message"].as_str().unwrap().contains("cannot connect"), "{e}");
    let (s, e) = error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "hang"})).await).await;
    assert_eq!((s, e["code"].as_str()), (504, Some("upstream_timeout")));
    // A 4xx from the model is the model's answer: passed through.
    let r = post(&a, &key, "/v1/chat/completions", json!({"model": "bad"})).await;
    assert_eq!(r.status(), 400);
    // Mid-stream failure: an error event, then [DONE].
    let ev = events(post(&a, &key, "/v1/chat/completions", json!({"model": "break", "stream": true})).await).await;
    assert_eq!(ev.len(), 4, "{ev:?}");
    assert!(ev[2].contains("\"code\":\"stream_broken\"") && ev[2].contains("break"), "{ev:?}");
    assert_eq!(ev[3], "data: [DONE]");
    let ev = events(post(&a, &key, "/v1/chat/completions", json!({"model": "nodone", "stream": true})).await).await;
    assert!(ev[ev.len() - 2].contains("without [DONE]"), "{ev:?}");
    // A stream refused before it started is a plain error.
    let (s, _) = error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "fail", "stream": true})).await).await;
    assert_eq!(s, 502);
    let rows = a.rows(7).await;
    let codes: Vec<&str> = rows.iter().map(|r| r["error_code"].as_str().unwrap()).collect();
    assert!(
        codes.contains(&"upstream_timeout")
            && codes.contains(&"bad_param")
            && codes.iter().filter(|c| **c == "upstream_error").count() == 3
            && codes.iter().filter(|c| **c == "stream_broken").count() == 2,
        "{codes:?}"
    );
    a.stop().await;
}

#[tokio::test]
async fn bad_input_gets_openai_shaped_errors() {
    let a = start("[gateway]\nmax_body_bytes = 4096\nbody_timeout_s = 1\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let raw = |body: Vec<u8>| {
        let key = key.clone();
        let url = a.url("/v1/chat/completions");
        async move { client().post(url).bearer_auth(key).header("content-type", "application/json").body(body).send().await.unwrap() }
    };
    for (body, status, code) in [
        (b"{\"model\": \"chat\",".to_vec(), 400, "invalid_json"),
        (b"\xff\xfe\x00{\"model\": \"chat\"}".to_vec(), 400, "invalid_json"),
        (b"{\"model\": \"ch\xffat\"}".to_vec(), 400, "invalid_json"),
        (b"{}".to_vec(), 400, "missing_model"),
        (b"".to_vec(), 400, "missing_model"),
        (b"{\"model\": 42}".to_vec(), 400, "invalid_type"),
        (b"{\"model\": \"chat\", \"stream\": \"yes\"}".to_vec(), 400, "invalid_type"),
        (b"[\"chat\"]".to_vec(), 400, "invalid_request"),
        (vec![b' '; 5000], 413, "request_too_large"),
        (b"{\"model\": \"chat-gpt\"}".to_vec(), 404, "model_not_found"),
        (b"{\"model\": \"tts\"}".to_vec(), 503, "role_unassigned"),
    ] {
        let (s, e) = error_of(raw(body.clone()).await).await;
        assert_eq!((s, e["code"].as_str().unwrap()), (status, code), "body {:?}: {e}", String::from_utf8_lossy(&body));
    }
    let (_, e) = error_of(raw(b"{\"model\": \"chta\"}".to_vec()).await).await;
    assert!(e["message"].as_str().unwrap().contains("did you mean `chat`"), "{e}");
    // A chunked body over the limit (no Content-Length to check up front).
    let stream = futures_util::stream::iter((0..10).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1000])));
    let r = client().post(a.url("/v1/chat/completions")).bearer_auth(&key).body(reqwest::Body::wrap_stream(stream)).send().await.unwrap();
    assert_eq!(error_of(r).await.0, 413);
    // Unknown routes, with and without credentials.
    let (s, e) = error_of(client().get(a.url("/v2/whatever")).bearer_auth(&key).send().await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (404, Some("unknown_route")));
    let (s, _) = error_of(client().get(a.url("/v1/files")).bearer_auth(&key).send().await.unwrap()).await;
    assert_eq!(s, 404);
    let (s, e) = error_of(client().delete(a.url("/v1/models")).bearer_auth(&key).send().await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (404, Some("unknown_route")));
    let (s, _) = error_of(client().get(a.url("/v2/whatever")).send().await.unwrap()).await;
    assert_eq!(s, 401);
    // A slow client: headers, then a body that never completes.
    let mut sock = tokio::net::TcpStream::connect(a.gateway).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"model\""
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n =
        tokio::time::timeout(Duration::from_secs(5), sock.read(&mut buf)).await.expect("the gateway must time out a slow body").unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 408") && text.contains("request_timeout"), "{text}");
    a.stop().await;
}

#[tokio::test]
async fn identity_keys_tokens_sso_and_allow_lists() {
    let a = start(
        "[gateway.sso]\nenabled = true\nuser_header = \"X-Forwarded-User\"\ntrusted_proxies = [\"127.0.0.2\"]\nshared_secret = \"proxy-secret-0123456789\"\n",
    )
    .await;
    let body = json!({"model": "chat"});
    // No credentials, a made-up key, a spoofed SSO header from an untrusted peer.
    let (s, e) = error_of(client().post(a.url("/v1/chat/completions")).json(&body).send().await.unwrap()).await;
    assert_eq!((s, e["code"].as_str()), (401, Some("invalid_api_key")));
    let (s, _) = error_of(post(&a, "ghk_0000", "/v1/chat/completions", body.clone()).await).await;
    assert_eq!(s, 401);
    let (s, e) =
        error_of(client().post(a.url("/v1/chat/completions")).header("x-forwarded-user", "root").json(&body).send().await.unwrap()).await;
    assert_eq!(s, 401);
    assert!(e["message"].as_str().unwrap().contains("only accepted from the site's proxy"), "{e}");
    // Even with the secret, not from another address than the proxy's.
    let (s, _) = error_of(
        client()
            .post(a.url("/v1/chat/completions"))
            .header("x-forwarded-user", "root")
            .header("x-gpuhub-proxy-secret", "proxy-secret-0123456789")
            .json(&body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(s, 401);
    // From the proxy's address: without the secret (or with a wrong one) refused, with it accepted.
    let proxy = reqwest::Client::builder().local_address("127.0.0.2".parse::<std::net::IpAddr>().unwrap()).build().unwrap();
    for secret in [None, Some("proxy-secret-0123456780")] {
        let mut r = proxy.post(a.url("/v1/chat/completions")).header("x-forwarded-user", "dave").json(&body);
        if let Some(s) = secret {
            r = r.header("x-gpuhub-proxy-secret", s);
        }
        assert_eq!(error_of(r.send().await.unwrap()).await.0, 401, "secret {secret:?}");
    }
    let r = proxy
        .post(a.url("/v1/chat/completions"))
        .header("x-forwarded-user", "dave")
        .header("x-gpuhub-proxy-secret", "proxy-secret-0123456789")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A proxy that appends its header to the client's (or joins them with a comma) names no one.
    for (first, second) in [("root", Some("dave")), ("root, dave", None)] {
        let mut r = proxy.post(a.url("/v1/chat/completions")).header("x-gpuhub-proxy-secret", "proxy-secret-0123456789");
        r = r.header("x-forwarded-user", first);
        if let Some(v) = second {
            r = r.header("x-forwarded-user", v);
        }
        let (s, e) = error_of(r.send().await.unwrap()).await;
        assert_eq!(s, 401, "{first} {second:?}: {e}");
        let m = e["message"].as_str().unwrap();
        assert!(if second.is_some() { m.contains("came 2 times") } else { m.contains("does not hold a user name") }, "{e}");
    }
    // Revoked keys say so.
    let (key, id) = a.key("alice", "ocr", &[]).await;
    assert_eq!(post(&a, &key, "/v1/chat/completions", body.clone()).await.status(), 200);
    a.control("POST", &format!("/v1/keys/{id}/revoke"), None).await.unwrap();
    let (s, e) = error_of(post(&a, &key, "/v1/chat/completions", body.clone()).await).await;
    assert_eq!(s, 401);
    assert!(e["message"].as_str().unwrap().contains("revoked"), "{e}");
    // Allow-lists.
    let (narrow, nid) = a.key("erin", "ocr", &["fail"]).await;
    let (s, e) = error_of(post(&a, &narrow, "/v1/chat/completions", body.clone()).await).await;
    assert_eq!((s, e["code"].as_str()), (403, Some("model_not_allowed")));
    let models: Value = client().get(a.url("/v1/models")).bearer_auth(&narrow).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"].as_array().unwrap().len(), 1);
    // A key's allow-list and own limits change in place (`gpuhub keys set`): the app keeps its key.
    let set_path = format!("/v1/keys/{nid}/set");
    let set = |body: Value| a.control("POST", &set_path, Some(body));
    assert_eq!(set(json!({"models": []})).await.unwrap()["models"], json!([]));
    assert_eq!(post(&a, &narrow, "/v1/chat/completions", body.clone()).await.status(), 200);
    let v = set(json!({"rpm": 1})).await.unwrap();
    assert_eq!((v["rpm"].as_u64(), v["models"].clone()), (Some(1), json!([])), "what is left out stays");
    assert_eq!(post(&a, &narrow, "/v1/chat/completions", body.clone()).await.status(), 200);
    let (s, e) = error_of(post(&a, &narrow, "/v1/chat/completions", body.clone()).await).await;
    assert_eq!(s, 429, "the key's new --rpm 1 applies at once: {e}");
    assert!(set(json!({"no_rpm": true})).await.unwrap()["rpm"].is_null());
    assert_eq!(post(&a, &narrow, "/v1/chat/completions", body.clone()).await.status(), 200);
    for (bad, says) in [
        (json!({}), "nothing to change"),
        (json!({"rpm": 2, "no_rpm": true}), "not both"),
        (json!({"tokens_per_day": 0}), "at least 1"),
        (json!({"models": ["nope"]}), "not in the catalog"),
    ] {
        let e = set(bad.clone()).await.unwrap_err().to_string();
        assert!(e.contains(says), "{bad}: {e}");
    }
    let e = a.control("POST", &format!("/v1/keys/{id}/set"), Some(json!({"rpm": 5}))).await.unwrap_err().to_string();
    assert!(e.contains("is revoked"), "{e}");
    // Job tokens, minted with the node's key like the SPANK plugin does, for this process's
    // uid and its passwd name (the gateway checks the name against the uid).
    let (uid, me) = whoami();
    let token = job_token(&a, uid, &me, 4242);
    assert_eq!(post(&a, &token, "/v1/chat/completions", body.clone()).await.status(), 200);
    let forged = token.replace(".4242.", ".4243.");
    assert_eq!(error_of(post(&a, &forged, "/v1/chat/completions", body.clone()).await).await.0, 401);
    // Calls that were served or refused after authentication have their own rows; the 401s
    // are counted in one row per peer and minute (written at shutdown, checked below).
    let rows = a.rows(5).await;
    let job = rows.iter().find(|r| r["user_name"] == me.as_str() && r["app"] == "job").unwrap();
    assert_eq!(job["job_id"].as_i64(), Some(4242));
    assert!(rows.iter().any(|r| r["user_name"] == "dave" && r["app"] == "sso"));
    // Control API: an admin (the test runs as root) manages anyone's keys; listing shows no secrets.
    let list = a.control("GET", "/v1/keys", None).await.unwrap();
    assert!(!list.to_string().contains(&key) && !list.to_string().contains("key_hash"));
    let err = a.control("POST", "/v1/keys", Some(json!({"user": "x y", "app": "a"}))).await.unwrap_err().to_string();
    assert!(err.contains("letters, digits"), "{err}");
    let err = a.control("POST", "/v1/keys", Some(json!({"user": "x", "app": "a", "models": ["nope"]}))).await.unwrap_err().to_string();
    assert!(err.contains("not in the catalog"), "{err}");
    let calls = a.control("GET", "/v1/usage/calls?since=1h", None).await.unwrap();
    assert!(calls["calls"].as_array().unwrap().iter().any(|c| c["user"] == "alice" && c["calls"] == 1), "{calls}");
    let db = a.db_url.clone();
    let _dir = a.stop().await;
    let rows = gateway_support::read_rows(&db).await;
    let refused: Vec<&Value> = rows.iter().filter(|r| r["status"] == 401).collect();
    // Two peers (127.0.0.1, and the proxy's 127.0.0.2): one row each (two if a minute ended).
    assert!((2..=4).contains(&refused.len()), "the 401s are kept as one row per peer and minute: {refused:#?}");
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(&db).await.unwrap();
    let (n,): (i64,) =
        sqlx::query_as("SELECT CAST(SUM(calls) AS BIGINT) FROM usage_log WHERE status = 401").fetch_one(&pool).await.unwrap();
    assert_eq!(
        n, 10,
        "no credentials, a made-up key, four SSO headers without the proof, two that name no one, a revoked key, a forged token"
    );
    pool.close().await;
}

#[tokio::test]
async fn overload_gets_429_with_retry_after_and_metrics_count_everything() {
    let a = start("").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let first = post(&a, &key, "/v1/chat/completions", json!({"model": "one", "stream": true})).await;
    assert_eq!(first.status(), 200);
    let r = post(&a, &key, "/v1/chat/completions", json!({"model": "one", "stream": true})).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let m = a.scrape().await;
    assert!(m.contains("gpuhub_gateway_in_flight{model=\"one\"} 1"), "{m}");
    drop(first);
    post(&a, &key, "/v1/chat/completions", json!({"model": "nosuch-model"})).await;
    post(&a, &key, "/v1/chat/completions", json!({"model": "chat"})).await;
    let t = Instant::now();
    loop {
        let m = a.scrape().await;
        let ok = m.contains("gpuhub_gateway_unknown_model_requests_total{name=\"nosuch-model\"} 1")
            && m.contains("gpuhub_gateway_requests_total{model=\"chat\",requested=\"chat\",user=\"alice\",app=\"app\"} 1")
            && m.contains(
                "gpuhub_gateway_errors_total{model=\"one\",requested=\"one\",user=\"alice\",app=\"app\",code=\"model_overloaded\"} 1",
            )
            && m.contains("gpuhub_gateway_tokens_total{model=\"chat\",user=\"alice\",app=\"app\",kind=\"completion\"} 7")
            && m.contains("gpuhub_gateway_request_duration_seconds_bucket")
            && m.contains("gpuhub_gateway_overhead_seconds_bucket")
            && m.contains("gpuhub_gateway_in_flight{model=\"one\"} 0");
        if ok {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "metrics missing: {m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let models: Value = client().get(a.url("/v1/models")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["object"], "list");
    let chat = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "chat").unwrap();
    assert_eq!((chat["object"].as_str(), chat["state"].as_str(), chat["role"].as_str()), (Some("model"), Some("ready"), Some("chat")));
    let one: Value = client().get(a.url("/v1/models/svc-chat")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    assert_eq!(one["id"], "chat");
    a.stop().await;
}

#[tokio::test]
async fn multipart_uploads_are_routed_by_their_model_field() {
    let a = start("").await;
    let (key, _) = a.key("alice", "asr", &[]).await;
    let mut body = Vec::new();
    body.extend_from_slice(
        b"--BOUND\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\n",
    );
    body.extend_from_slice(&[0u8, 159, 146, 150, 13, 10, 45, 45]); // binary, even "\r\n--"
    body.extend_from_slice(b"\r\n--BOUND\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nsvc-chat\r\n--BOUND--\r\n");
    let r = client()
        .post(a.url("/v1/audio/transcriptions"))
        .bearer_auth(&key)
        .header("content-type", "multipart/form-data; boundary=BOUND")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = a.upstream.seen.lock().unwrap().clone();
    assert!(String::from_utf8_lossy(&seen.body).contains("\r\n\r\nchat\r\n--BOUND--"), "renamed to the model's own name");
    assert_eq!(seen.body.len(), body.len() - 4);
    let r = client()
        .post(a.url("/v1/audio/transcriptions"))
        .bearer_auth(&key)
        .header("content-type", "multipart/form-data; boundary=BOUND")
        .body(&b"--BOUND\r\n\r\n--BOUND--"[..])
        .send()
        .await
        .unwrap();
    assert_eq!(error_of(r).await.1["code"], "missing_model");
    a.stop().await;
}

#[tokio::test]
async fn shutdown_writes_every_row_and_leaves_no_journal() {
    let a = start("").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    for _ in 0..50 {
        post(&a, &key, "/v1/chat/completions", json!({"model": "chat"})).await;
    }
    let db = a.db_url.clone();
    let dir = a.stop().await;
    assert_eq!(gateway_support::read_rows(&db).await.len(), 50);
    let journal: Vec<_> = std::fs::read_dir(dir.path().join("state/usage-journal")).unwrap().collect();
    assert!(journal.is_empty(), "{journal:?}");
}

#[tokio::test]
async fn a_stream_waiting_for_a_loading_model_gets_comments_that_say_so() {
    let worker = gateway_support::worker_bin();
    let extra = format!(
        "[gateway]\nkeepalive_s = 1\n[workers]\nuser = \"{}\"\n[[models]]\nname = \"slowload\"\nlauncher = \"local\"\nload_timeout_s = 30\ncommand = \"{} --model {{model}} --host {{host}} --port {{port}} --api-key-file {{api_key_file}} --startup-delay-ms 2500\"\n",
        gateway_support::worker_user(),
        worker.display()
    );
    let a = start(&extra).await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let t = Instant::now();
    let r = post(
        &a,
        &key,
        "/v1/chat/completions",
        json!({"model": "slowload", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(t.elapsed() < Duration::from_secs(2), "the stream must start (with comments) while the model loads");
    let ev = events(r).await;
    assert!(ev[0].starts_with(": gpuhub: model `slowload` is loading"), "{ev:?}");
    assert!(ev.iter().filter(|e| e.starts_with(": gpuhub:")).count() >= 2, "{ev:?}");
    assert!(ev.iter().any(|e| e.contains("\"content\":\"hi\"")), "{ev:?}");
    assert_eq!(ev.last().unwrap(), "data: [DONE]");
    let rows = a.rows(1).await;
    assert!(rows[0]["completion_tokens"].as_i64().unwrap() > 0 && rows[0]["status"] == 200, "{rows:#?}");
    assert!(
        rows[0]["latency_us"].as_i64().unwrap() - rows[0]["overhead_us"].as_i64().unwrap() >= 2_000_000,
        "loading time is not gateway overhead: {rows:#?}"
    );
    // A stopping agent leaves local workers running (a restarted agent adopts them): unload it,
    // so the test leaves no process behind.
    let v = a.control("POST", "/v1/models/unload", Some(json!({"model": "slowload"}))).await.unwrap();
    assert_eq!(v["unloaded"], true, "{v}");
    a.stop().await;
}

fn whoami() -> (u32, String) {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    (uid, gpuhub_agent::control::peer::user_name(uid).expect("this process's uid has a passwd entry"))
}

/// A job token signed with the agent's key read as the plugin reads it (a trailing newline in
/// the key file is not part of the key).
fn job_token(a: &Agent, uid: u32, user: &str, job_id: u32) -> String {
    let raw = std::fs::read(a.dir.path().join("state/job-token.key")).unwrap();
    let key = gpuhub_wire::token::parse_key(&raw).unwrap();
    let claims = gpuhub_wire::token::JobClaims { uid, user: user.into(), job_id, expires: gpuhub_agent::util::now_s() + 600 };
    gpuhub_wire::token::mint(&key, &claims).unwrap()
}

/// Drops a record into the agent's spool, as the plugin would.
fn spool(a: &Agent, rec: &gpuhub_wire::spool::Record) {
    let dir = a.dir.path().join("spool").join(gpuhub_wire::spool::RECORDS_DIR);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(gpuhub_wire::spool::record_file_name(rec, std::process::id())), rec.to_json()).unwrap();
}

#[tokio::test]
async fn job_tokens_are_bound_to_the_uid_and_the_job_and_user_allow_lists_apply() {
    let (uid, me) = whoami();
    // The user's own allow-list: `chat` only, whatever the credential. Quoted key: a passwd
    // name may hold dots.
    let a = start(&format!("[gateway.user_models]\n\"{me}\" = [\"chat\"]\n")).await;
    let chat = json!({"model": "chat"});
    let token = job_token(&a, uid, &me, 5151);
    assert_eq!(post(&a, &token, "/v1/chat/completions", chat.clone()).await.status(), 200);

    // A name that is not the uid's is refused even with a valid MAC (the uid decides).
    let forged = job_token(&a, uid, "somebody.else", 5151);
    let (s, e) = error_of(post(&a, &forged, "/v1/chat/completions", chat.clone()).await).await;
    assert_eq!(s, 401, "{e}");

    // The allow-list applies to the job token and to an unrestricted API key of the same user.
    let (s, e) = error_of(post(&a, &token, "/v1/chat/completions", json!({"model": "slow"})).await).await;
    assert_eq!((s, e["code"].as_str()), (403, Some("model_not_allowed")));
    let m = e["message"].as_str().unwrap();
    assert!(
        m.contains(&format!("user `{me}` may not use model `slow`")) && m.contains(&format!("gateway.user_models.{me} in <inline>")),
        "{m}"
    );
    let (key, _) = a.key(&me, "app", &[]).await;
    assert_eq!(error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "slow"})).await).await.0, 403);
    assert_eq!(post(&a, &key, "/v1/chat/completions", chat.clone()).await.status(), 200);
    let models: Value = client().get(a.url("/v1/models")).bearer_auth(&token).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = models["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, vec!["chat"], "{models}");
    // Another user's key is not restricted by this user's list.
    let (other, _) = a.key("someone-else", "app", &[]).await;
    assert_eq!(post(&a, &other, "/v1/chat/completions", json!({"model": "fail"})).await.status(), 502, "allowed, and the upstream fails");

    // The job ends (its JobEnd record reaches the spool): its token is refused within the
    // ingest interval plus the one-second cache, while another running job's token still works.
    let ident = gpuhub_wire::spool::JobIdentity { job_id: 5151, uid, user: me.clone(), account: None, partition: None, node: "n1".into() };
    let now = gpuhub_agent::util::now_us();
    spool(&a, &gpuhub_wire::spool::Record::JobStart { v: 1, time_us: now - 1_000_000, job: ident.clone(), gpus: vec![] });
    spool(&a, &gpuhub_wire::spool::Record::JobEnd { v: 1, time_us: now, job: ident, exit_code: Some(0), gpus: vec![] });
    let t = Instant::now();
    let e = loop {
        let r = post(&a, &token, "/v1/chat/completions", chat.clone()).await;
        if r.status() == 401 {
            break error_of(r).await.1;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the token of an ended job was still accepted after 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(e["message"].as_str().unwrap().contains("job 5151 has ended"), "{e}");
    let running = job_token(&a, uid, &me, 5152);
    assert_eq!(post(&a, &running, "/v1/chat/completions", chat.clone()).await.status(), 200);
    a.stop().await;
}

#[tokio::test]
async fn only_the_routes_a_model_serves_reach_its_worker() {
    // `emb` declares embeddings only; `chat` declares nothing (every inference route).
    let a = start("[[models]]\nname = \"emb\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9/ok\"\nroutes = [\"embeddings\"]\n").await;
    let (key, _) = a.key("alice", "app", &[]).await;
    // A worker's management routes (vLLM's adapter loading, ...) are never forwarded, for any
    // model, and the refusal names the routes that are.
    for path in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/ner/extract", "/v1/files", "/v1/fine_tuning/jobs"] {
        let r = post(&a, &key, path, json!({"model": "chat", "lora_name": "evil", "lora_path": "/tmp/evil"})).await;
        let (s, e) = error_of(r).await;
        assert_eq!((s, e["code"].as_str()), (404, Some("route_not_served")), "{path}: {e}");
        let m = e["message"].as_str().unwrap();
        assert!(m.contains(path) && m.contains("not forwarded") && m.contains("/v1/chat/completions"), "{m}");
    }
    // speaches downloads a model on `POST /v1/models/{id}`: the gateway's own /v1/models route.
    let (s, _) = error_of(post(&a, &key, "/v1/models/Systran/faster-whisper-large-v3", json!({"model": "chat"})).await).await;
    assert_eq!(s, 404);
    assert_eq!(a.upstream.seen.lock().unwrap().path, "", "no refused call reached the worker");
    // A route the model does not declare: refused with the model's own routes.
    let (s, e) = error_of(post(&a, &key, "/v1/chat/completions", json!({"model": "emb", "messages": []})).await).await;
    assert_eq!((s, e["code"].as_str()), (404, Some("route_not_served")));
    assert_eq!(
        e["message"],
        "model `emb` does not serve POST /v1/chat/completions; it serves /v1/embeddings (`routes` in its catalog entry)"
    );
    // Every refusal is a usage row like any call.
    let rows = a.rows(7).await;
    assert_eq!(rows.iter().filter(|r| r["status"] == 404 && r["error_code"] == "route_not_served").count(), 6, "{rows:#?}");
    a.stop().await;
}
