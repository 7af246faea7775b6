//! The `/metrics` listener. A scrape only encodes what the samplers last stored.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::telemetry::exposition::Exposition;
use tokio_util::sync::CancellationToken;

const CONTENT_TYPE_TEXT: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

pub fn router(exposition: Arc<Exposition>) -> Router {
    Router::new().route("/metrics", get(metrics)).with_state(exposition)
}

async fn metrics(State(exposition): State<Arc<Exposition>>, headers: axum::http::HeaderMap) -> impl IntoResponse {
    let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok());
    if crate::telemetry::exposition::wants_openmetrics(accept) {
        ([(CONTENT_TYPE, CONTENT_TYPE_TEXT)], exposition.render(true))
    } else {
        ([(CONTENT_TYPE, crate::telemetry::exposition::PROMETHEUS_TEXT_CONTENT_TYPE)], exposition.render(false))
    }
}

pub async fn serve(listener: TcpListener, exposition: Arc<Exposition>, shutdown: CancellationToken) -> std::io::Result<()> {
    axum::serve(listener, router(exposition)).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
