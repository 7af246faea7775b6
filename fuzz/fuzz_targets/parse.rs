//! The client's request body: `model`/`stream` under each content type the gateway sees, the
//! rewrite for a renamed model, and the SSE event classifier.
#![no_main]

use gpuhub_agent::gateway::parse::{MAX_MODEL_NAME, parse, upstream_body};
use gpuhub_agent::gateway::stream::{classify, event_end};
use libfuzzer_sys::fuzz_target;

const CONTENT_TYPES: &[Option<&str>] = &[
    None,
    Some("application/json"),
    Some("multipart/form-data; boundary=XyZ"),
    Some("multipart/form-data; boundary=\"XyZ\""),
    Some("multipart/form-data"),
    Some("text/plain"),
];

fuzz_target!(|body: &[u8]| {
    for ct in CONTENT_TYPES {
        match parse(*ct, body) {
            Ok(p) => {
                assert!(!p.model.is_empty() && p.model.len() <= MAX_MODEL_NAME);
                if let Some(new) = upstream_body(&p, body, "renamed-model") {
                    let again = parse(*ct, &new).expect("a rewritten body must parse again");
                    assert_eq!(again.model, "renamed-model");
                }
            }
            Err(e) => assert!((400..500).contains(&e.status().as_u16())),
        }
    }
    if let Some(end) = event_end(body) {
        let _ = classify(&body[..end], true);
        let _ = classify(&body[..end], false);
    }
});
