//! The `/metrics` listener. A scrape only encodes what the samplers last stored.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const CONTENT_TYPE_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn router(registry: Arc<Registry>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(registry)
}

async fn metrics(State(registry): State<Arc<Registry>>, headers: axum::http::HeaderMap) -> impl IntoResponse {
    let mut body = String::with_capacity(64 * 1024);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, &registry) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok());
    if crate::telemetry::exposition::wants_openmetrics(accept) {
        ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], body)
    } else {
        (
            [(CONTENT_TYPE, crate::telemetry::exposition::PROMETHEUS_TEXT_CONTENT_TYPE)],
            crate::telemetry::exposition::to_prometheus_text(&body),
        )
    }
}

pub async fn serve(listener: TcpListener, registry: Arc<Registry>, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, router(registry)).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
