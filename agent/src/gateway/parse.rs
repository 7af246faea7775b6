//! Reads just enough of a request body to route it: the `model` (JSON field or multipart form
//! field) and whether the client wants a stream. The body is forwarded unchanged unless the
//! gateway must ask the upstream for a usage chunk.
//!
//! Pure functions over bytes, so the fuzz loop (`agent/tests/gateway_fuzz.rs`) drives them
//! directly.

use serde_json::{Map, Value};

use super::error::GatewayError;

/// Longest model name accepted (catalog names are at most 128 characters).
pub const MAX_MODEL_NAME: usize = 256;

/// The routing fields of a JSON body; every other field is skipped without being stored.
#[derive(serde::Deserialize)]
struct Head {
    model: Option<Value>,
    stream: Option<Value>,
    stream_options: Option<Value>,
}

impl Head {
    fn get(&self, k: &str) -> Option<&Value> {
        match k {
            "model" => self.model.as_ref(),
            "stream" => self.stream.as_ref(),
            _ => self.stream_options.as_ref(),
        }
    }
}

/// What the gateway needs to know about a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Parsed {
    pub model: String,
    pub stream: bool,
    /// The client set `stream_options.include_usage = true` itself.
    pub client_wants_usage: bool,
    /// The JSON object, when the body was JSON (needed only to rewrite it).
    pub json: Option<Map<String, Value>>,
    /// Multipart bodies: where the `model` field's value sits in the body.
    pub model_span: Option<std::ops::Range<usize>>,
}

/// Parses a body given its `Content-Type`.
pub fn parse(content_type: Option<&str>, body: &[u8]) -> Result<Parsed, GatewayError> {
    let ct = content_type.unwrap_or("").trim();
    if ct.get(..19).is_some_and(|p| p.eq_ignore_ascii_case("multipart/form-data")) {
        return parse_multipart(ct, body);
    }
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Err(GatewayError::MissingModel);
    }
    // serde_json does not check the UTF-8 of strings it skips; the whole body must be UTF-8.
    if let Err(e) = std::str::from_utf8(body) {
        return Err(GatewayError::MalformedJson(format!("invalid UTF-8 at byte {}", e.valid_up_to())));
    }
    // Only the routing fields are decoded; the rest is checked for syntax and skipped (the
    // whole object is decoded only when the body must be rewritten, see `upstream_body`).
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        serde_json::from_slice::<serde::de::IgnoredAny>(body).map_err(|e| GatewayError::MalformedJson(e.to_string()))?;
        return Err(GatewayError::BadRequest("the request body must be a JSON object such as {\"model\": \"NAME\", ...}".into()));
    }
    let map: Head = serde_json::from_slice(body).map_err(|e| GatewayError::MalformedJson(e.to_string()))?;
    let model = match map.get("model") {
        None | Some(Value::Null) => return Err(GatewayError::MissingModel),
        Some(Value::String(s)) => check_name(s)?,
        Some(_) => return Err(GatewayError::WrongType { field: "model", expected: "a string (a model name)" }),
    };
    let stream = match map.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(GatewayError::WrongType { field: "stream", expected: "true or false" }),
    };
    let client_wants_usage = match map.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(GatewayError::WrongType { field: "stream_options.include_usage", expected: "true or false" }),
        },
        Some(_) => return Err(GatewayError::WrongType { field: "stream_options", expected: "an object" }),
    };
    Ok(Parsed { model, stream, client_wants_usage, json: None, model_span: None })
}

/// A model name is 1..=[`MAX_MODEL_NAME`] bytes of printable text. Control characters (NUL
/// included) are refused here: no catalog name holds one, and the usage log must be able to
/// store every name it is given (PostgreSQL refuses a NUL byte in text).
fn check_name(s: &str) -> Result<String, GatewayError> {
    check_name_of("`model`", s)
}

/// [`check_name`] for a name given as `what` (the body's `model`, a path's name): the same
/// rules wherever a name reaches the gateway.
pub fn check_name_of(what: &str, s: &str) -> Result<String, GatewayError> {
    if s.is_empty() {
        return Err(GatewayError::MissingModel);
    }
    if s.len() > MAX_MODEL_NAME {
        return Err(GatewayError::BadRequest(format!("{what} is {} bytes long; model names are at most {MAX_MODEL_NAME}", s.len())));
    }
    if let Some((at, c)) = s.char_indices().find(|(_, c)| c.is_control()) {
        return Err(GatewayError::InvalidModelName(format!(
            "{what} holds the control character U+{:04X} at byte {at}; model names are printable text (see `GET /v1/models`)",
            u32::from(c)
        )));
    }
    Ok(s.to_string())
}

/// The body to send upstream. The client's bytes go unchanged unless the gateway must
/// rewrite them: a name served under another name (a deprecated name, an alias, a role) is
/// replaced by `model`, the name the worker serves (the catalog model, or the LoRA adapter:
/// an adapter keeps its own name), because workers (like vLLM) answer only to their own; a
/// stream that did not ask for the final usage chunk asks for it where the route has one
/// (`ask_usage`, see [`asks_usage_chunk`]).
pub fn upstream_body(p: &Parsed, original: &[u8], model: &str, ask_usage: bool) -> Option<Vec<u8>> {
    let rename = p.model != model;
    let want_usage = ask_usage && p.stream && !p.client_wants_usage;
    if let Some(span) = &p.model_span {
        if !rename || span.end > original.len() {
            return None;
        }
        let mut out = Vec::with_capacity(original.len() + model.len());
        out.extend_from_slice(&original[..span.start]);
        out.extend_from_slice(model.as_bytes());
        out.extend_from_slice(&original[span.end..]);
        return Some(out);
    }
    if !rename && !want_usage {
        return None;
    }
    let mut map = match &p.json {
        Some(m) => m.clone(),
        None => match serde_json::from_slice::<Value>(original).ok()? {
            Value::Object(m) => m,
            _ => return None,
        },
    };
    if rename {
        map.insert("model".into(), Value::String(model.to_string()));
    }
    if want_usage {
        let opts = map.entry("stream_options").or_insert_with(|| Value::Object(Map::new()));
        if let Value::Null = opts {
            *opts = Value::Object(Map::new());
        }
        if let Value::Object(o) = opts {
            o.insert("include_usage".into(), Value::Bool(true));
        }
    }
    serde_json::to_vec(&Value::Object(map)).ok()
}

fn boundary(ct: &str) -> Option<&str> {
    ct.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        k.trim().eq_ignore_ascii_case("boundary").then(|| v.trim().trim_matches('"'))
    })
}

/// Finds the `model` (and `stream`) fields of a multipart form without copying the upload.
fn parse_multipart(ct: &str, body: &[u8]) -> Result<Parsed, GatewayError> {
    let b = boundary(ct)
        .filter(|b| !b.is_empty() && b.len() <= 200)
        .ok_or_else(|| GatewayError::BadRequest("multipart/form-data needs a boundary parameter in Content-Type".into()))?;
    let delim = format!("--{b}");
    let mut model: Option<(String, std::ops::Range<usize>)> = None;
    let mut stream = false;
    let mut parts = split(body, delim.as_bytes()).into_iter();
    parts.next(); // preamble
    for part in parts {
        if part.starts_with(b"--") {
            break; // closing delimiter
        }
        let part = part.strip_prefix(b"\r\n").unwrap_or(part);
        let Some(sep) = find(part, b"\r\n\r\n") else { continue };
        let (head, value) = (&part[..sep], &part[sep + 4..]);
        let value = value.strip_suffix(b"\r\n").unwrap_or(value);
        let head = String::from_utf8_lossy(head);
        let Some(name) = field_name(&head) else { continue };
        match name.as_str() {
            "model" => {
                let v = std::str::from_utf8(value).map_err(|_| GatewayError::WrongType { field: "model", expected: "UTF-8 text" })?;
                let start = (value.as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
                model = Some((check_name(v.trim())?, start..start + value.len()));
            }
            "stream" => stream = value.eq_ignore_ascii_case(b"true"),
            _ => {}
        }
    }
    let (model, span) = model.ok_or(GatewayError::MissingModel)?;
    // Multipart bodies are forwarded byte for byte (but for a renamed model): no usage
    // request is injected.
    Ok(Parsed { model, stream, client_wants_usage: true, json: None, model_span: Some(span) })
}

fn field_name(head: &str) -> Option<String> {
    let line = head.lines().find(|l| l.get(..19).is_some_and(|p| p.eq_ignore_ascii_case("content-disposition")))?;
    line.split(';').skip(1).find_map(|p| {
        let (k, v) = p.trim().split_once('=')?;
        (k.trim() == "name").then(|| v.trim().trim_matches('"').to_string())
    })
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if needle.is_empty() || hay.len() < needle.len() {
        return None;
    }
    hay.windows(needle.len()).position(|w| w == needle)
}

fn split<'a>(mut hay: &'a [u8], delim: &[u8]) -> Vec<&'a [u8]> {
    let mut out = Vec::new();
    while let Some(i) = find(hay, delim) {
        out.push(&hay[..i]);
        hay = &hay[i + delim.len()..];
    }
    out.push(hay);
    out
}

/// Token counts from an OpenAI `usage` object inside a JSON body or stream chunk; `None` if
/// the body has no usage (cheap check first: most stream chunks carry none).
pub fn usage_of(body: &[u8]) -> Option<(i64, i64)> {
    #[derive(serde::Deserialize)]
    struct WithUsage {
        usage: Option<Map<String, Value>>,
    }
    find(body, b"\"usage\"")?;
    let u = serde_json::from_slice::<WithUsage>(body).ok()?.usage?;
    Some(token_counts(&u))
}

/// (prompt, completion) tokens of an OpenAI `usage` object. Embeddings report only prompt
/// tokens; the Responses API and audio APIs report input/output tokens.
pub fn token_counts(u: &Map<String, Value>) -> (i64, i64) {
    let n = |k: &str| u.get(k).and_then(Value::as_i64).unwrap_or(0);
    (n("prompt_tokens").max(n("input_tokens")), n("completion_tokens").max(n("output_tokens")))
}

/// Where `needle` first occurs in `hay`.
pub fn find_bytes(hay: &[u8], needle: &[u8]) -> Option<usize> {
    find(hay, needle)
}

/// Whether a streamed call to `path` may be asked for the final usage chunk
/// (`stream_options.include_usage`): chat and text completions. The Responses API reports
/// usage in `response.completed` and has no such option (a strict server refuses it).
pub fn asks_usage_chunk(path: &str) -> bool {
    let path = path.split('?').next().unwrap_or(path);
    path.ends_with("/chat/completions") || path.ends_with("/completions")
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn json_fields() {
        let raw = br#"{"model":"m","stream":true,"messages":[{"content":"x"}]}"#;
        let p = parse(Some("application/json"), raw).unwrap();
        assert_eq!((p.model.as_str(), p.stream, p.client_wants_usage), ("m", true, false));
        let body: Value = serde_json::from_slice(&upstream_body(&p, raw, "m", true).unwrap()).unwrap();
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["messages"][0]["content"], "x");
        let body: Value = serde_json::from_slice(&upstream_body(&p, raw, "new", true).unwrap()).unwrap();
        assert_eq!(body["model"], "new");
        assert!(upstream_body(&p, raw, "m", false).is_none(), "no usage chunk is asked where the route has none");
        assert!(asks_usage_chunk("/v1/chat/completions") && asks_usage_chunk("/v1/completions?x=1"));
        assert!(!asks_usage_chunk("/v1/responses") && !asks_usage_chunk("/v1/embeddings"));
        let raw = br#"{"model":"m","stream":true,"stream_options":{"include_usage":true}}"#;
        let p = parse(None, raw).unwrap();
        assert!(p.client_wants_usage && upstream_body(&p, raw, "m", true).is_none());
    }

    #[test]
    fn json_errors() {
        let code = |b: &[u8]| parse(Some("application/json"), b).unwrap_err().code();
        assert_eq!(code(b"{\"model\": "), "invalid_json");
        assert_eq!(code(b"\xff\xfe{}"), "invalid_json");
        assert_eq!(code(b""), "missing_model");
        assert_eq!(code(b"{}"), "missing_model");
        assert_eq!(code(b"{\"model\": 3}"), "invalid_type");
        assert_eq!(code(b"{\"model\": \"m\", \"stream\": \"yes\"}"), "invalid_type");
        assert_eq!(code(b"[1]"), "invalid_request");
        assert_eq!(code(b"{\"model\": \"m\", \"messages\": \"\xff\"}"), "invalid_json");
        assert_eq!(code(b"{\"model\": \"m\", \"model\": \"n\"}"), "invalid_json");
        let long = format!("{{\"model\": \"{}\"}}", "x".repeat(300));
        assert_eq!(code(long.as_bytes()), "invalid_request");
        // Control characters, NUL included (JSON escapes them; multipart carries them raw).
        for bad in [
            &b"{\"model\": \"chat\\u0000\"}"[..],
            b"{\"model\": \"a\\nb\"}",
            b"{\"model\": \"x\\u001b[31m\"}",
            b"{\"model\": \"x\\u0085\"}",
        ] {
            let e = parse(Some("application/json"), bad).unwrap_err();
            assert_eq!((e.status().as_u16(), e.code()), (400, "invalid_model_name"), "{}", String::from_utf8_lossy(bad));
            assert_eq!(e.body()["error"]["param"], "model");
            assert!(e.to_string().contains("control character U+"), "{e}");
        }
        let mp = b"--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\x00\r\n--B--\r\n";
        assert_eq!(parse(Some("multipart/form-data; boundary=B"), mp).unwrap_err().code(), "invalid_model_name");
        assert_eq!(parse(None, "{\"model\": \"Qwen/Qwen3-8B é\"}".as_bytes()).unwrap().model, "Qwen/Qwen3-8B é");
    }

    #[test]
    fn multipart_model_field() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        let p = parse(Some("multipart/form-data; boundary=XyZ"), body).unwrap();
        assert_eq!(p.model, "whisper-1");
        assert!(!p.stream);
        assert!(upstream_body(&p, body, "whisper-1", false).is_none());
        let renamed = upstream_body(&p, body, "whisper-large", false).unwrap();
        assert_eq!(parse(Some("multipart/form-data; boundary=XyZ"), &renamed).unwrap().model, "whisper-large");
        assert_eq!(renamed.len(), body.len() + 4);
        assert_eq!(parse(Some("multipart/form-data; boundary=\"XyZ\""), body).unwrap().model, "whisper-1");
        assert_eq!(parse(Some("multipart/form-data"), body).unwrap_err().code(), "invalid_request");
        assert_eq!(parse(Some("multipart/form-data; boundary=other"), body).unwrap_err().code(), "missing_model");
    }

    #[test]
    fn usage_extraction() {
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":3,"completion_tokens":4}}"#), Some((3, 4)));
        assert_eq!(usage_of(br#"{"usage":null}"#), None);
        assert_eq!(usage_of(br#"{"choices":[]}"#), None);
        assert_eq!(usage_of(br#"{"usage":{"prompt_tokens":5,"total_tokens":5}}"#), Some((5, 0)));
        assert_eq!(usage_of(br#"{"object":"response","usage":{"input_tokens":9,"output_tokens":4}}"#), Some((9, 4)));
    }
}
