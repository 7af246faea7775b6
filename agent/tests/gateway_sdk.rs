//! The stock `openai` Python SDK (from PyPI, in `.venv`) against the gateway, with a real
//! upstream process on loopback: the repo's test worker (`gpuhub-test-worker`), started the
//! way a site starts vLLM. Chat (plain and streaming, with and without usage), completions,
//! embeddings, audio speech and transcription, and the SDK's own error classes.
//!
//! Needs `cargo build --release -p gpuhub-test-worker` and `tests/setup/deps.sh` (the venv);
//! the test fails with that instruction when either is missing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

const SDK_SCRIPT: &str = r#"
import os, sys
import openai
base = os.environ["GW"] + "/v1"
c = openai.OpenAI(base_url=base, api_key=os.environ["KEY"], max_retries=0)
msgs = [{"role": "user", "content": "hello there"}]

r = c.chat.completions.create(model="demo-chat", messages=msgs)
assert r.choices[0].message.content.startswith("Hello from demo-chat"), r
assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage

chunks = list(c.chat.completions.create(model="demo-chat", messages=msgs, stream=True))
text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
assert "you said: hello there" in text, text
assert all(getattr(ch, "usage", None) is None for ch in chunks), "usage chunk not asked for but sent"

chunks = list(c.chat.completions.create(model="demo-chat", messages=msgs, stream=True, stream_options={"include_usage": True}))
assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, chunks[-1]

r = c.completions.create(model="demo-chat", prompt="one two three")
assert "completion of" in r.choices[0].text, r

r = c.embeddings.create(model="demo-chat", input=["a", "b"])
assert len(r.data) == 2 and len(r.data[0].embedding) > 0, r

speech = c.audio.speech.create(model="demo-chat", voice="alloy", input="hi")
data = speech.read()
assert data[:4] == b"RIFF", data[:16]

t = c.audio.transcriptions.create(model="demo-chat", file=("a.wav", data))
assert isinstance(t.text, str), t

try:
    c.chat.completions.create(model="demo-chta", messages=msgs)
    sys.exit("unknown model was answered")
except openai.NotFoundError as e:
    assert e.code == "model_not_found" and "did you mean `demo-chat`" in e.message, e.message

try:
    openai.OpenAI(base_url=base, api_key="ghk_wrong", max_retries=0).chat.completions.create(model="demo-chat", messages=msgs)
    sys.exit("a wrong key was accepted")
except openai.AuthenticationError as e:
    assert e.code == "invalid_api_key", e

try:
    c.chat.completions.create(model="demo-chat", messages=msgs, stream="yes")
    sys.exit("a wrong type was accepted")
except openai.BadRequestError as e:
    assert e.code == "invalid_type", e

ids = [m.id for m in c.models.list()]
assert "demo-chat" in ids, ids
print("SDK OK")
"#;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[tokio::test]
async fn stock_openai_sdk_works_unchanged() {
    let worker = gateway_support::worker_bin();
    let python = repo().join(".venv/bin/python");
    assert!(python.exists(), "{} is missing: run tests/setup/deps.sh (installs the openai SDK)", python.display());
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("worker.addr");
    let mut child = tokio::process::Command::new(&worker)
        .args(["--model", "demo-chat", "--host", "127.0.0.1", "--port", "0", "--api-key", "worker-key-1", "--report-file"])
        .arg(&report)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let t = Instant::now();
    let addr = loop {
        if let Ok(s) = std::fs::read_to_string(&report) {
            let mut p = s.split_whitespace();
            if let (Some(h), Some(port)) = (p.next(), p.next()) {
                break format!("{h}:{port}");
            }
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the test worker did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let extra = format!("[[models]]\nname = \"demo-chat\"\nlauncher = \"static\"\nurl = \"http://{addr}\"\napi_key = \"worker-key-1\"\n");
    let (up, upstream) = gateway_support::upstream().await;
    let a = gateway_support::start_in(dir, up, upstream, &extra).await;
    let (key, _) = a.key("alice", "sdk-test", &[]).await;
    let script = a.dir.path().join("sdk.py");
    std::fs::write(&script, SDK_SCRIPT).unwrap();
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .env("GW", format!("http://{}", a.gateway))
        .env("KEY", &key)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stdout.contains("SDK OK"), "python {} failed ({}):\n{stdout}\n{stderr}", script.display(), out.status);
    // 11 calls; the one with a wrong key is counted in a row per peer and minute, written later.
    let rows = a.rows(10).await;
    let ok = rows.iter().filter(|r| r["status"] == 200 && r["user_name"] == "alice").count();
    assert!(ok >= 8, "{rows:#?}");
    assert!(rows.iter().any(|r| r["streamed"] == 1 && r["completion_tokens"].as_i64().unwrap_or(0) > 0), "{rows:#?}");
    a.stop().await;
    let _ = child.kill().await;
}
