//! The `gpuhub` CLI's side of the control socket: HTTP/1.1 over a Unix stream.

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(
        "cannot reach the gpuhub agent at {path}: {source} (is gpuhub-agent running? `systemctl status gpuhub-agent`; or pass --socket)"
    )]
    Connect { path: String, source: std::io::Error },
    #[error("talking to the gpuhub agent failed: {0}")]
    Http(String),
    #[error("{message}")]
    Api { status: u16, message: String },
}

/// Sends one request and returns the JSON body of a 2xx answer; other answers become
/// [`ClientError::Api`] with the agent's message.
pub async fn request(socket: &Path, method: &str, path: &str, body: Option<serde_json::Value>) -> Result<serde_json::Value, ClientError> {
    let stream = UnixStream::connect(socket).await.map_err(|source| ClientError::Connect { path: socket.display().to_string(), source })?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|e| ClientError::Http(e.to_string()))?;
    tokio::spawn(conn);
    let body_bytes = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "gpuhub")
        .header("content-type", "application/json")
        .body(Full::new(body_bytes))
        .map_err(|e| ClientError::Http(e.to_string()))?;
    let resp = sender.send_request(req).await.map_err(|e| ClientError::Http(e.to_string()))?;
    let status = resp.status();
    let bytes = resp.into_body().collect().await.map_err(|e| ClientError::Http(e.to_string()))?.to_bytes();
    if status.is_success() {
        serde_json::from_slice(&bytes).map_err(|e| ClientError::Http(format!("the agent sent invalid JSON: {e}")))
    } else {
        let message = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).trim().to_string());
        Err(ClientError::Api { status: status.as_u16(), message })
    }
}
