//! A worker's answer as the gateway's client decodes it (head, chunked/length/close framing).
#![no_main]

use gpuhub_agent::gateway::upstream::{UpstreamError, decode};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    match decode(bytes) {
        Ok((_, body)) => assert!(body.len() <= bytes.len()),
        Err(UpstreamError::Protocol(_) | UpstreamError::Incomplete | UpstreamError::Closed) => {}
        Err(e) => panic!("decoding bytes in memory failed with {e:?}"),
    }
});
