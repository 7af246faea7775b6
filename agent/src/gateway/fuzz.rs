//! The invariants the fuzzers check, in one place: the libFuzzer targets (`fuzz/`) and the
//! stable mutation loop that every `cargo test` runs (`agent/tests/gateway_fuzz.rs`) call
//! these, so the two layers cannot drift. Each panics on a broken invariant.
#![allow(clippy::panic)]

use super::parse::{MAX_MODEL_NAME, parse, upstream_body};
use super::stream::{classify, event_end};
use super::upstream::{self, UpstreamError};

/// The content types a request body is parsed under.
pub const CONTENT_TYPES: &[Option<&str>] = &[
    None,
    Some("application/json"),
    Some("multipart/form-data; boundary=XyZ"),
    Some("multipart/form-data; boundary=\"XyZ\""),
    Some("multipart/form-data"),
    Some("MULTIPART/FORM-DATA; BOUNDARY=XyZ"),
    Some("text/plain"),
];

/// A client's request body under every content type, its rewrite for a renamed model, and the
/// SSE classifier on it: an accepted body names a model of 1..=MAX_MODEL_NAME bytes without
/// control characters (the usage log must be able to store it) and still
/// parses, to the new name, once rewritten; a refusal is a 4xx OpenAI error. Returns whether
/// any content type accepted it.
pub fn check_request(body: &[u8]) -> bool {
    let mut accepted = false;
    for ct in CONTENT_TYPES {
        match parse(*ct, body) {
            Ok(p) => {
                accepted = true;
                assert!(!p.model.is_empty() && p.model.len() <= MAX_MODEL_NAME, "accepted a bad model name {:?}", p.model);
                assert!(!p.model.chars().any(char::is_control), "accepted a model name with a control character {:?}", p.model);
                if let Some(new) = upstream_body(&p, body, "renamed-model", true) {
                    let again = parse(*ct, &new)
                        .unwrap_or_else(|e| panic!("rewritten body no longer parses ({e}): {:?}", String::from_utf8_lossy(&new)));
                    assert_eq!(again.model, "renamed-model", "content type {ct:?}, body {:?}", String::from_utf8_lossy(body));
                }
            }
            Err(e) => {
                let s = e.status().as_u16();
                assert!((400..500).contains(&s), "parse error with status {s}: {e}");
                assert!(e.body()["error"]["message"].is_string());
            }
        }
    }
    let mut buf = body.to_vec();
    buf.extend_from_slice(b"\n\n");
    if let Some(end) = event_end(&buf) {
        let _ = classify(&buf[..end], true);
        let _ = classify(&buf[..end], false);
    }
    accepted
}

/// A worker's answer as the gateway's client decodes it: a decoded body is no longer than
/// the answer; a refusal is a protocol error or an incomplete answer. Returns whether it
/// decoded.
pub fn check_answer(bytes: &[u8]) -> bool {
    match upstream::decode(bytes) {
        Ok((_, body)) => {
            assert!(body.len() <= bytes.len(), "decoded a body longer than the answer");
            true
        }
        Err(UpstreamError::Protocol(_) | UpstreamError::Incomplete | UpstreamError::Closed) => false,
        Err(e) => panic!("decoding bytes in memory failed with {e:?}"),
    }
}
