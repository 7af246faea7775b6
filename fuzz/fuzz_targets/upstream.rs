//! A worker's answer as the gateway's client decodes it: head, chunked/length/close framing
//! (`gpuhub_agent::gateway::fuzz::check_answer`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    gpuhub_agent::gateway::fuzz::check_answer(bytes);
});
