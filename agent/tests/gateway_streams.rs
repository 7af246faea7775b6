//! Every protocol's stream ends where it ends, and every stream leaves token counts: the
//! gateway in process, in front of the repo's TEST worker (`tests/worker`, started by the
//! `local` launcher) speaking chat, completions and the Responses API.
//!
//! - A Responses API stream ends at `response.completed` (no `[DONE]`), with its usage.
//! - A worker that ignores `stream_options.include_usage` (as llama.cpp's Python server
//!   does): the row has the counted completion tokens (`usage_source = counted`), and the
//!   prompt counted by the worker's tokenize endpoint where the model has one (`tokenized`).
//! - A stream that breaks off: the client gets an error event, the row says `stream_broken`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// TEST-worker models: `resp` (plain), `resp-break` (streams break off after 2 deltas),
/// `nousage` (ignores include_usage), `nousage-tok` (the same, with a tokenize endpoint).
fn models() -> String {
    let w = gateway_support::worker_bin();
    let entry = |name: &str, flags: &str, extra: &str| {
        format!(
            "[[models]]\nname = \"{name}\"\nlauncher = \"local\"\ncommand = \"{} --model {{model}} --host {{host}} --port {{port}} --api-key-file {{api_key_file}} {flags}\"\nload_timeout_s = 30\n{extra}\n",
            w.display()
        )
    };
    // Local workers run as `nobody` under root: the default workers.user (gpuhub-worker) exists
    // only where the agent RPM or the lab created it, not on a fresh machine.
    format!("[workers]\nuser = \"{}\"\n", gateway_support::worker_user())
        + &entry("resp", "", "")
        + &entry("resp-break", "--break-stream-after 2", "")
        + &entry("nousage", "--no-stream-usage", "")
        + &entry("nousage-tok", "--no-stream-usage", "tokenize_path = \"/tokenize\"")
}

/// Every usage row with the columns these tests look at, oldest first, once `n` exist.
async fn rows(db_url: &str, n: usize) -> Vec<Value> {
    use sqlx::Row;
    sqlx::any::install_default_drivers();
    let t = Instant::now();
    loop {
        let pool = sqlx::AnyPool::connect(db_url).await.unwrap();
        let out: Vec<Value> = sqlx::query(
            "SELECT requested_name, route, status, error_code, prompt_tokens, completion_tokens, streamed, usage_source FROM usage_log ORDER BY time_us",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default()
        .iter()
        .map(|r| {
            json!({
                "model": r.get::<String, _>(0), "route": r.get::<String, _>(1), "status": r.get::<i64, _>(2),
                "error_code": r.get::<String, _>(3), "prompt_tokens": r.get::<i64, _>(4), "completion_tokens": r.get::<i64, _>(5),
                "streamed": r.get::<i64, _>(6), "usage_source": r.get::<String, _>(7),
            })
        })
        .collect();
        pool.close().await;
        if out.len() >= n {
            return out;
        }
        assert!(t.elapsed() < Duration::from_secs(15), "expected {n} usage rows, found {}: {out:#?}", out.len());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn row_of<'a>(rows: &'a [Value], model: &str, route: &str) -> &'a Value {
    rows.iter().find(|r| r["model"] == model && r["route"] == route).unwrap_or_else(|| panic!("no row for {model} {route}: {rows:#?}"))
}

/// The SSE events of a body: (event name, data).
fn events(body: &str) -> Vec<(Option<String>, String)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: ").map(str::to_string));
            let data = e.lines().filter_map(|l| l.strip_prefix("data: ")).collect::<Vec<_>>().join("\n");
            (name, data)
        })
        .collect()
}

#[tokio::test]
async fn a_responses_stream_ends_at_response_completed_with_its_usage_recorded() {
    let agent = gateway_support::start(&models()).await;
    let (key, _) = agent.key("alice", "app", &[]).await;
    let http = reqwest::Client::new();
    let body = json!({"model": "resp", "input": "tell me three words", "stream": true});
    let r = http.post(agent.url("/v1/responses")).bearer_auth(&key).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    let ev = events(&text);
    assert!(!text.contains("[DONE]"), "a Responses API stream has no [DONE]: {text}");
    let (last_name, last_data) = ev.last().unwrap();
    assert_eq!(last_name.as_deref(), Some("response.completed"), "{text}");
    let last: Value = serde_json::from_str(last_data).unwrap();
    let usage = &last["response"]["usage"];
    assert_eq!(ev.first().unwrap().0.as_deref(), Some("response.created"));
    let deltas = ev.iter().filter(|(n, _)| n.as_deref() == Some("response.output_text.delta")).count() as i64;
    assert!(deltas > 3, "{text}");
    // Plain (not streamed) too.
    let plain: Value = http
        .post(agent.url("/v1/responses"))
        .bearer_auth(&key)
        .json(&json!({"model": "resp", "input": [{"role": "user", "content": "two words"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(plain["object"], "response");
    let rows = rows(&agent.db_url, 2).await;
    let streamed = rows.iter().find(|r| r["streamed"] == 1).unwrap();
    assert_eq!(streamed["status"], 200);
    assert_eq!(streamed["error_code"], "", "a clean end: {streamed}");
    assert_eq!(streamed["prompt_tokens"], usage["input_tokens"]);
    assert_eq!(streamed["completion_tokens"], usage["output_tokens"]);
    assert_eq!(streamed["completion_tokens"], deltas, "one delta per output word");
    assert_eq!(streamed["usage_source"], "reported");
    let plain_row = rows.iter().find(|r| r["streamed"] == 0).unwrap();
    assert_eq!(plain_row["prompt_tokens"], plain["usage"]["input_tokens"]);
    assert_eq!(plain_row["completion_tokens"], plain["usage"]["output_tokens"]);
    assert_eq!(plain_row["usage_source"], "reported");
    agent.stop().await;
}

#[tokio::test]
async fn streams_that_break_off_are_logged_as_broken_for_each_protocol() {
    let agent = gateway_support::start(&models()).await;
    let (key, _) = agent.key("alice", "app", &[]).await;
    let http = reqwest::Client::new();
    for (route, body) in [
        ("/v1/responses", json!({"model": "resp-break", "input": "a b c d e", "stream": true})),
        ("/v1/chat/completions", json!({"model": "resp-break", "messages": [{"role": "user", "content": "a b c d e"}], "stream": true})),
    ] {
        let r = http.post(agent.url(route)).bearer_auth(&key).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "the stream was committed before it broke");
        let text = r.text().await.unwrap();
        let ev = events(&text);
        let err = ev.iter().find(|(_, d)| d.starts_with("{\"error\"")).unwrap_or_else(|| panic!("{route}: no error event: {text}"));
        let err: Value = serde_json::from_str(&err.1).unwrap();
        assert_eq!(err["error"]["code"], "stream_broken", "{route}: {text}");
        assert!(err["error"]["message"].as_str().unwrap().contains("resp-break"), "{err}");
        assert!(!ev.iter().any(|(n, _)| n.as_deref() == Some("response.completed")), "{route}: {text}");
        assert!(ev.len() > 2, "{route}: the events before the break were forwarded: {text}");
        assert_eq!(text.contains("[DONE]"), route != "/v1/responses", "{route}: [DONE] only where the protocol has one: {text}");
    }
    let rows = rows(&agent.db_url, 2).await;
    for route in ["/v1/responses", "/v1/chat/completions"] {
        let r = row_of(&rows, "resp-break", route);
        assert_eq!(r["error_code"], "stream_broken", "{r}");
        assert_eq!(r["completion_tokens"], 2, "the deltas that came before the break are counted: {r}");
        assert_eq!(r["usage_source"], "counted", "{r}");
    }
    agent.stop().await;
}

#[tokio::test]
async fn streams_without_usage_are_counted_and_the_prompt_tokenized_where_the_worker_can() {
    let agent = gateway_support::start(&models()).await;
    let (key, _) = agent.key("alice", "app", &[]).await;
    let http = reqwest::Client::new();
    let prompt = "what is the capital of France";
    let mut answers = Vec::new();
    for (model, include_usage) in [("nousage", true), ("nousage-tok", false), ("nousage-tok", true), ("resp", false)] {
        let mut body = json!({"model": model, "messages": [{"role": "user", "content": prompt}], "stream": true});
        if include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        let text = http.post(agent.url("/v1/chat/completions")).bearer_auth(&key).json(&body).send().await.unwrap().text().await.unwrap();
        let ev = events(&text);
        assert_eq!(ev.last().unwrap().1, "[DONE]", "{text}");
        let deltas = ev
            .iter()
            .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
            .filter(|v| v.pointer("/choices/0/delta/content").and_then(Value::as_str).is_some_and(|c| !c.is_empty()))
            .count() as i64;
        answers.push((model, include_usage, deltas, text));
    }
    // Completions stream too (`choices[].text` deltas).
    let text = http
        .post(agent.url("/v1/completions"))
        .bearer_auth(&key)
        .json(&json!({"model": "nousage-tok", "prompt": "one two three", "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let rows = rows(&agent.db_url, 5).await;
    let chat: Vec<&Value> = rows.iter().filter(|r| r["route"] == "/v1/chat/completions").collect();
    for ((model, _, deltas, text), row) in answers.iter().zip(&chat) {
        assert_eq!(row["model"], *model);
        assert!(row["completion_tokens"].as_i64().unwrap() > 0, "{row}");
        assert_eq!(row["completion_tokens"], *deltas, "{model}: the deltas forwarded: {row} {text}");
        assert_eq!(row["error_code"], "");
    }
    assert_eq!((chat[0]["usage_source"].as_str(), chat[0]["prompt_tokens"].as_i64()), (Some("counted"), Some(0)), "no tokenize endpoint");
    for r in &chat[1..3] {
        assert_eq!(r["usage_source"], "tokenized", "{r}");
        assert_eq!(r["prompt_tokens"], 6, "the worker counted the prompt's 6 words: {r}");
    }
    assert_eq!(chat[3]["usage_source"], "reported", "a worker that reports usage: {}", chat[3]);
    let completion = row_of(&rows, "nousage-tok", "/v1/completions");
    assert_eq!((completion["usage_source"].as_str(), completion["prompt_tokens"].as_i64()), (Some("tokenized"), Some(3)), "{completion}");
    assert!(completion["completion_tokens"].as_i64().unwrap() > 0);
    // The client that asked for usage got none from this worker, and the gateway invents none.
    assert!(!answers[0].3.contains("\"usage\":{"), "{}", answers[0].3);
    agent.stop().await;
}
