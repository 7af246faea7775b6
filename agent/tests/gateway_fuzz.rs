//! A stable-Rust fuzz loop for the gateway's parsers, run by every `cargo test` (the
//! coverage-guided libFuzzer targets in `fuzz/` take the same seeds). Seeds come from
//! `fuzz/corpus/parse/` and `fuzz/corpus/upstream/`; each iteration mutates a seed (bit flips,
//! byte inserts/deletes, splices, interesting bytes, truncation) and feeds it to the body parser
//! under several content types and to the SSE event classifier, or to the worker-answer
//! decoder, checking that nothing panics and that the invariants hold:
//! - an accepted body names a model of 1..=MAX_MODEL_NAME bytes;
//! - rewriting the body for the upstream keeps it parseable, with the new model name;
//! - every refusal is an OpenAI error with a 4xx status;
//! - a decoded worker answer's body is no longer than the answer; a refused one is a protocol
//!   error or an incomplete answer, nothing else.
//!
//! `GPUHUB_FUZZ_ITERS` (default 300000) and `GPUHUB_FUZZ_SEED` (default: time) control a run;
//! the seed is printed so a finding can be replayed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use gpuhub_agent::gateway::parse::{MAX_MODEL_NAME, parse, upstream_body};
use gpuhub_agent::gateway::stream::{classify, event_end};
use gpuhub_agent::gateway::upstream::{self, UpstreamError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const INTERESTING: &[&[u8]] = &[
    b"\"",
    b"\\",
    b"{",
    b"}",
    b"[",
    b"]",
    b":",
    b",",
    b"null",
    b"true",
    b"\xff",
    b"\xc3",
    b"\x00",
    b"\r\n",
    b"\r\n\r\n",
    b"--XyZ",
    b"\"model\"",
    b"\"stream\"",
    b"data: ",
    b"[DONE]",
    b"\"usage\":{\"prompt_tokens\":1}",
    b"1e999",
    b"-0",
    b"\\ud800",
    b"HTTP/1.1 ",
    b"transfer-encoding: chunked\r\n",
    b"content-length: 5\r\n",
    b"\r\n0\r\n\r\n",
    b"ffffffffffffffff\r\n",
];
const CONTENT_TYPES: &[Option<&str>] = &[
    None,
    Some("application/json"),
    Some("multipart/form-data; boundary=XyZ"),
    Some("multipart/form-data; boundary=\"XyZ\""),
    Some("multipart/form-data"),
    Some("MULTIPART/FORM-DATA; BOUNDARY=XyZ"),
    Some("text/plain"),
];

fn mutate(rng: &mut StdRng, seeds: &[Vec<u8>], input: &mut Vec<u8>) {
    for _ in 0..rng.gen_range(1..6) {
        match rng.gen_range(0..7) {
            0 if !input.is_empty() => {
                let i = rng.gen_range(0..input.len());
                input[i] ^= 1 << rng.gen_range(0..8);
            }
            1 => {
                let i = rng.gen_range(0..=input.len());
                input.insert(i, rng.r#gen());
            }
            2 if !input.is_empty() => {
                let i = rng.gen_range(0..input.len());
                let n = rng.gen_range(1..=(input.len() - i).min(16));
                input.drain(i..i + n);
            }
            3 => {
                let i = rng.gen_range(0..=input.len());
                let s = INTERESTING[rng.gen_range(0..INTERESTING.len())];
                input.splice(i..i, s.iter().copied());
            }
            4 => {
                let other = &seeds[rng.gen_range(0..seeds.len())];
                let (i, j) = (rng.gen_range(0..=input.len()), rng.gen_range(0..=other.len()));
                input.truncate(i);
                input.extend_from_slice(&other[j..]);
            }
            5 if !input.is_empty() => input.truncate(rng.gen_range(0..input.len())),
            _ => {
                let i = rng.gen_range(0..=input.len());
                let n = rng.gen_range(1..300);
                input.splice(i..i, std::iter::repeat_n(b'x', n));
            }
        }
    }
}

fn check(body: &[u8]) {
    for ct in CONTENT_TYPES {
        match parse(*ct, body) {
            Ok(p) => {
                assert!(!p.model.is_empty() && p.model.len() <= MAX_MODEL_NAME, "accepted a bad model name {:?}", p.model);
                if let Some(new) = upstream_body(&p, body, "renamed-model") {
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
}

/// A worker's answer, decoded as the gateway's client reads it: no panic, a body no longer
/// than the input, and only the client's own error kinds.
fn check_answer(bytes: &[u8]) -> bool {
    match upstream::decode(bytes) {
        Ok((_, body)) => {
            assert!(body.len() <= bytes.len(), "decoded a body longer than the answer");
            true
        }
        Err(UpstreamError::Protocol(_) | UpstreamError::Incomplete | UpstreamError::Closed) => false,
        Err(e) => panic!("decoding bytes in memory failed with {e:?}"),
    }
}

/// The seed corpus `fuzz/corpus/<name>`, the iteration count and the RNG for one run.
fn setup(name: &str) -> (Vec<Vec<u8>>, u64, StdRng) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(name);
    let seeds: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("seed corpus {}: {e}", dir.display()))
        .map(|e| std::fs::read(e.unwrap().path()).unwrap())
        .collect();
    assert!(seeds.len() >= 5, "seed corpus {} too small", dir.display());
    let iters: u64 = std::env::var("GPUHUB_FUZZ_ITERS").ok().and_then(|s| s.parse().ok()).unwrap_or(300_000);
    let seed: u64 =
        std::env::var("GPUHUB_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| gpuhub_agent::util::now_us() as u64);
    println!("gateway fuzz ({name}): {iters} iterations, GPUHUB_FUZZ_SEED={seed}");
    (seeds, iters, StdRng::seed_from_u64(seed))
}

#[test]
fn fuzz_worker_answers() {
    let (seeds, iters, mut rng) = setup("upstream");
    for s in &seeds {
        assert!(check_answer(s), "seed answer rejected: {:?}", String::from_utf8_lossy(s));
    }
    let mut accepted = 0u64;
    for _ in 0..iters {
        let mut input = seeds[rng.gen_range(0..seeds.len())].clone();
        mutate(&mut rng, &seeds, &mut input);
        accepted += u64::from(check_answer(&input));
    }
    println!("gateway fuzz (upstream): done, {accepted} mutated answers decoded, no findings");
    assert!(accepted > 0, "the mutator never produced a valid answer: it is not exercising the decoder");
}

#[test]
fn fuzz_request_parsing() {
    let (seeds, iters, mut rng) = setup("parse");
    let mut accepted = 0u64;
    for s in &seeds {
        check(s);
    }
    for _ in 0..iters {
        let mut input = seeds[rng.gen_range(0..seeds.len())].clone();
        mutate(&mut rng, &seeds, &mut input);
        check(&input);
        if parse(Some("application/json"), &input).is_ok() || parse(Some("multipart/form-data; boundary=XyZ"), &input).is_ok() {
            accepted += 1;
        }
    }
    println!("gateway fuzz (parse): done, {accepted} mutated inputs accepted, no findings");
    assert!(accepted > 0, "the mutator never produced a valid body: it is not exercising the parser");
}
