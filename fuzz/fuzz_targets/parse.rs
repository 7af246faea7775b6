//! The client's request body: `model`/`stream` under each content type the gateway sees, the
//! rewrite for a renamed model, and the SSE event classifier
//! (`gpuhub_agent::gateway::fuzz::check_request`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    gpuhub_agent::gateway::fuzz::check_request(body);
});
