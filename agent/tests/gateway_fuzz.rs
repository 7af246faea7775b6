//! A stable-Rust fuzz loop for the gateway's parsers, run by every `cargo test` (the
//! coverage-guided libFuzzer targets in `fuzz/` take the same seeds). Seeds come from
//! `fuzz/corpus/parse/` and `fuzz/corpus/upstream/`; each iteration mutates a seed (bit flips,
//! byte inserts/deletes, splices, interesting bytes, truncation) and feeds it to the body parser
//! under several content types and to the SSE event classifier, or to the worker-answer
//! decoder, checking that nothing panics and that the invariants of
//! `gpuhub_agent::gateway::fuzz` hold.
//!
//! `GPUHUB_FUZZ_ITERS` (default 300000) and `GPUHUB_FUZZ_SEED` (default: time) control a run;
//! the seed is printed so a finding can be replayed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use gpuhub_agent::gateway::fuzz::{check_answer, check_request};
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

/// Runs `check` on every seed of `fuzz/corpus/<name>` (each must be accepted), then on
/// `GPUHUB_FUZZ_ITERS` mutated inputs (default 300000, `GPUHUB_FUZZ_SEED` replays a run); some
/// mutated input must be accepted too, or the mutator is not exercising the code.
fn fuzz(name: &str, check: fn(&[u8]) -> bool) {
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
    let mut rng = StdRng::seed_from_u64(seed);
    for s in &seeds {
        assert!(check(s), "{name}: seed rejected: {:?}", String::from_utf8_lossy(s));
    }
    let mut accepted = 0u64;
    for _ in 0..iters {
        let mut input = seeds[rng.gen_range(0..seeds.len())].clone();
        mutate(&mut rng, &seeds, &mut input);
        accepted += u64::from(check(&input));
    }
    println!("gateway fuzz ({name}): done, {accepted} mutated inputs accepted, no findings");
    assert!(accepted > 0, "{name}: the mutator never produced an accepted input: it is not exercising the code");
}

#[test]
fn fuzz_worker_answers() {
    fuzz("upstream", check_answer);
}

#[test]
fn fuzz_request_parsing() {
    fuzz("parse", check_request);
}
