//! [`ArtifactCache::fetch`] end to end against a real HTTP server in the test process that
//! answers MLflow's routes the cache calls (`model-versions/get-download-uri`, the
//! `mlflow-artifacts` listing and download): a `file:` version is copied and served; a short
//! or broken-off download is never served, leaves nothing visible, and the next try completes.
#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::response::IntoResponse;
use axum::routing::get;
use bytes::Bytes;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use super::*;

const BODY: &[u8; 100] = b"GGUF0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefghijklmnopqrstuvwx";

/// How the server answers a file download.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Whole,
    /// Half the bytes, with a Content-Length that says so: a complete HTTP answer, short of
    /// the size MLflow listed.
    Short,
    /// Content-Length 100, half the bytes, then the connection breaks (after the test says).
    BreakOff,
}

/// The test's signal that the first half arrived, and its go to break off.
type Stall = (oneshot::Sender<()>, oneshot::Receiver<()>);

#[derive(Clone)]
struct Fake {
    uri: Arc<Mutex<String>>,
    mode: Arc<Mutex<Mode>>,
    downloads: Arc<AtomicUsize>,
    uri_lookups: Arc<AtomicUsize>,
    /// BreakOff: the test's signal that the first half arrived, and its go to break.
    stalled: Arc<Mutex<Option<Stall>>>,
}

async fn download_uri(State(f): State<Fake>) -> axum::Json<serde_json::Value> {
    f.uri_lookups.fetch_add(1, Ordering::SeqCst);
    axum::Json(json!({"artifact_uri": f.uri.lock().unwrap().clone()}))
}

async fn listing(Query(q): Query<std::collections::HashMap<String, String>>) -> axum::Json<serde_json::Value> {
    assert_eq!(q.get("path").map(String::as_str), Some("1/models/m-1/artifacts"));
    axum::Json(json!({"files": [{"path": "model.gguf", "is_dir": false, "file_size": "100"}]}))
}

async fn file(State(f): State<Fake>) -> axum::response::Response {
    f.downloads.fetch_add(1, Ordering::SeqCst);
    let mode = *f.mode.lock().unwrap();
    match mode {
        Mode::Whole => BODY.to_vec().into_response(),
        Mode::Short => BODY[..50].to_vec().into_response(),
        Mode::BreakOff => {
            let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(2);
            let (reached, go) = f.stalled.lock().unwrap().take().unwrap();
            tokio::spawn(async move {
                tx.send(Ok(Bytes::from_static(&BODY[..50]))).await.unwrap();
                let _ = reached.send(());
                let _ = go.await;
                let _ = tx.send(Err(std::io::Error::other("connection reset by the test"))).await;
            });
            let stream = futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
            axum::response::Response::builder().header("content-length", "100").body(axum::body::Body::from_stream(stream)).unwrap()
        }
    }
}

async fn serve(f: Fake) -> String {
    let app = axum::Router::new()
        .route("/api/2.0/mlflow/model-versions/get-download-uri", get(download_uri))
        .route("/api/2.0/mlflow-artifacts/artifacts", get(listing))
        .route("/api/2.0/mlflow-artifacts/artifacts/{*rest}", get(file))
        .with_state(f);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
    format!("http://{addr}")
}

fn fake(uri: &str, mode: Mode) -> Fake {
    Fake {
        uri: Arc::new(Mutex::new(uri.into())),
        mode: Arc::new(Mutex::new(mode)),
        downloads: Arc::new(AtomicUsize::new(0)),
        uri_lookups: Arc::new(AtomicUsize::new(0)),
        stalled: Arc::new(Mutex::new(None)),
    }
}

/// What the cache directory shows: complete versions (`sha256-*`), index entries, and files
/// under `partial/`.
fn visible(dir: &Path) -> (Vec<String>, usize, usize) {
    let names = |d: &Path| -> Vec<String> {
        std::fs::read_dir(d)
            .map(|r| r.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    };
    let mut versions: Vec<String> = names(dir).into_iter().filter(|n| n.starts_with("sha256-")).collect();
    versions.sort();
    let mut partial_files = Vec::new();
    let _ = walk_all(&dir.join("partial"), 0, &mut partial_files);
    (versions, names(&dir.join("index")).len(), partial_files.iter().filter(|p| p.is_file()).count())
}

#[tokio::test]
async fn a_file_source_is_copied_and_served_then_reused() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("models/v1");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("model.gguf"), BODY).unwrap();
    std::fs::write(src.join("MLmodel"), b"flavors: {}\n").unwrap();
    let f = fake(&format!("file://{}", src.display()), Mode::Whole);
    let ml = Mlflow::new(&serve(f.clone()).await);
    let c = ArtifactCache::open(t.path().join("cache"), 1.0, vec![t.path().join("models")], None).unwrap();
    let w = c.fetch(&ml, "m", "1").await.unwrap();
    let file = w.model_file.clone().unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), BODY, "the served file is the source's bytes");
    assert_eq!(std::fs::read(w.dir.join("MLmodel")).unwrap(), b"flavors: {}\n");
    assert!(w.dir.starts_with(t.path().join("cache")) && w.dir.file_name().unwrap().to_string_lossy().starts_with("sha256-"));
    let (versions, index, partial) = visible(&t.path().join("cache"));
    assert_eq!((versions.len(), index, partial), (1, 1, 0));
    // Changing the source afterwards does not change the served copy (a copy, not a link).
    std::fs::write(src.join("model.gguf"), b"changed").unwrap();
    assert_eq!(std::fs::read(&file).unwrap(), BODY);
    // The second fetch is served from the cache: no new lookup.
    let again = c.fetch(&ml, "m", "1").await.unwrap();
    assert_eq!(again.dir, w.dir);
    assert_eq!(f.uri_lookups.load(Ordering::SeqCst), 1);
    // A `file:` source outside mlflow.file_roots is refused.
    *f.uri.lock().unwrap() = format!("file://{}", t.path().join("elsewhere").display());
    let e = c.fetch(&ml, "m", "2").await.unwrap_err().to_string();
    assert!(e.contains("outside mlflow.file_roots"), "{e}");
}

#[tokio::test]
async fn a_short_download_is_never_served_and_the_next_try_completes() {
    let t = tempfile::tempdir().unwrap();
    let f = fake("mlflow-artifacts:/1/models/m-1/artifacts", Mode::Short);
    let ml = Mlflow::new(&serve(f.clone()).await);
    let dir = t.path().join("cache");
    let c = ArtifactCache::open(dir.clone(), 1.0, vec![], None).unwrap();
    let e = c.fetch(&ml, "m", "1").await.unwrap_err().to_string();
    assert!(e.contains("model.gguf") && e.contains("got 50 bytes, MLflow listed 100"), "{e}");
    assert_eq!(visible(&dir), (vec![], 0, 0), "nothing of the short download is left or visible");
    assert!(c.cached("m", "1").is_none());
    *f.mode.lock().unwrap() = Mode::Whole;
    let w = c.fetch(&ml, "m", "1").await.unwrap();
    assert_eq!(std::fs::read(w.model_file.as_ref().unwrap()).unwrap(), BODY);
    assert_eq!(f.downloads.load(Ordering::SeqCst), 2);
    let (versions, index, partial) = visible(&dir);
    assert_eq!((versions.len(), index, partial), (1, 1, 0));
}

#[tokio::test]
async fn a_download_broken_off_midway_is_invisible_while_it_runs_and_after() {
    let t = tempfile::tempdir().unwrap();
    let f = fake("mlflow-artifacts:/1/models/m-1/artifacts", Mode::BreakOff);
    let (reached_tx, reached_rx) = oneshot::channel();
    let (go_tx, go_rx) = oneshot::channel();
    *f.stalled.lock().unwrap() = Some((reached_tx, go_rx));
    let ml = Mlflow::new(&serve(f.clone()).await);
    let dir = t.path().join("cache");
    let c = Arc::new(ArtifactCache::open(dir.clone(), 1.0, vec![], None).unwrap());
    let (c2, ml2) = (Arc::clone(&c), ml.clone());
    let first = tokio::spawn(async move { c2.fetch(&ml2, "m", "1").await.map(|w| w.dir) });
    reached_rx.await.unwrap();
    // Half the file is on disk now, under partial/ only: not a version, not indexed.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (versions, index, partial) = visible(&dir);
    assert_eq!((versions.len(), index), (0, 0), "a download under way is not visible as a version");
    assert_eq!(partial, 1, "the bytes so far are under partial/");
    assert!(c.cached("m", "1").is_none());
    go_tx.send(()).unwrap();
    let e = first.await.unwrap().unwrap_err().to_string();
    assert!(e.contains("model.gguf") && (e.contains("broke off") || e.contains("bytes")), "{e}");
    assert_eq!(visible(&dir), (vec![], 0, 0), "the broken download left nothing behind");
    *f.mode.lock().unwrap() = Mode::Whole;
    let w = c.fetch(&ml, "m", "1").await.unwrap();
    assert_eq!(std::fs::read(w.model_file.as_ref().unwrap()).unwrap(), BODY, "the next try completes");
}
