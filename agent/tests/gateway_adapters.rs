//! LoRA adapters keep their names: an adapter is served by its base model's worker and
//! forwarded under its own name (the `model` field is not rewritten to the base's), directly,
//! through a deprecated name, or through `/v1/models`; the usage row shows the adapter and the
//! base model. In process, against the scriptable upstream of `gateway_support`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod gateway_support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};

async fn rows(db_url: &str, n: usize) -> Vec<(String, String, String, i64)> {
    use sqlx::Row;
    sqlx::any::install_default_drivers();
    let t = Instant::now();
    loop {
        let pool = sqlx::AnyPool::connect(db_url).await.unwrap();
        let out: Vec<(String, String, String, i64)> = sqlx::query(
            "SELECT requested_name, resolved_model, adapter, status FROM usage_log WHERE route = '/v1/chat/completions' ORDER BY time_us",
        )
        .fetch_all(&pool)
        .await
        .unwrap_or_default()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
        pool.close().await;
        if out.len() >= n {
            return out;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "expected {n} rows, found {out:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_adapter_is_forwarded_under_its_own_name_and_logged_with_its_base_model() {
    let (up, upstream) = gateway_support::upstream().await;
    let extra = format!(
        "[[models]]\nname = \"base\"\nlauncher = \"static\"\nurl = \"http://{up}/ok\"\nadapters = [\"base-sql\"]\n\
         [[names.history]]\nname = \"old-sql\"\nstate = \"deprecated\"\nreplacement = \"base-sql\"\n"
    );
    let a = gateway_support::start_in(tempfile::tempdir().unwrap(), up, upstream, &extra).await;
    let (key, _) = a.key("alice", "app", &[]).await;
    let http = reqwest::Client::new();
    let call = |model: &'static str| {
        let (http, url, key) = (http.clone(), a.url("/v1/chat/completions"), key.clone());
        async move {
            let r = http
                .post(url)
                .bearer_auth(key)
                .json(&json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}))
                .send()
                .await
                .unwrap();
            (r.status(), r.json::<Value>().await.unwrap())
        }
    };
    let seen_model = || serde_json::from_slice::<Value>(&a.upstream.seen.lock().unwrap().body).unwrap()["model"].clone();

    let (s, _) = call("base-sql").await;
    assert_eq!(s, 200);
    assert_eq!(seen_model(), "base-sql", "the adapter's name reaches the worker unchanged");
    let (s, _) = call("old-sql").await;
    assert_eq!(s, 200);
    assert_eq!(seen_model(), "base-sql", "a deprecated name of an adapter is forwarded as the adapter");
    let (s, _) = call("base").await;
    assert_eq!(s, 200);
    assert_eq!(seen_model(), "base");

    let list: Value = http.get(a.url("/v1/models")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    let entry = list["data"].as_array().unwrap().iter().find(|m| m["id"] == "base-sql").unwrap_or_else(|| panic!("{list}"));
    assert_eq!(entry["parent"], "base");
    let one: Value = http.get(a.url("/v1/models/base-sql")).bearer_auth(&key).send().await.unwrap().json().await.unwrap();
    assert_eq!((one["id"].as_str(), one["parent"].as_str()), (Some("base-sql"), Some("base")), "{one}");

    // A key allowed the base model may call its adapters, and sees them listed.
    let (narrow, _) = a.key("alice", "narrow", &["base"]).await;
    let r = http
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(&narrow)
        .json(&json!({"model": "base-sql", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let list: Value = http.get(a.url("/v1/models")).bearer_auth(&narrow).send().await.unwrap().json().await.unwrap();
    let ids: Vec<&str> = list["data"].as_array().unwrap().iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, ["base", "base-sql"], "what the key may call is what it sees: {list}");

    let rows = rows(&a.db_url, 3).await;
    assert_eq!(rows[0], ("base-sql".into(), "base".into(), "base-sql".into(), 200));
    assert_eq!(rows[1], ("old-sql".into(), "base".into(), "base-sql".into(), 200));
    assert_eq!(rows[2], ("base".into(), "base".into(), String::new(), 200));
    a.stop().await;
}
