//! The OpenAI-compatible gateway: one API for every model on the node, every call accounted for.
//!
//! # Parts
//! - [`server`]: the listeners, served over HTTP/1.1 with a connection cap, header and idle
//!   timeouts.
//! - [`router`]: the route table and middleware order (auth on by default).
//! - [`auth`]: API keys (hashes only), per-job tokens, the SSO header.
//! - [`sso`]: the proof that an SSO header comes from the site's proxy (a shared secret, or
//!   the uid on a Unix socket).
//! - [`refusals`]: unauthenticated (and usage-log-full) refusals: counted per peer, one row per
//!   peer and minute, rate-limited.
//! - [`limits`]: request-body bytes held in memory across all calls.
//! - [`parse`]: the `model`/`stream` of a JSON body or multipart form, nothing more.
//! - [`proxy`]: forwards any `/v1/*` call that names a model, without understanding the route.
//! - [`stream`]: SSE pass-through chunk by chunk, keep-alives, usage capture.
//! - [`upstream`]: the HTTP/1.1 client for workers, run inside each call's task.
//! - [`models_list`]: `GET /v1/models`.
//! - [`error`]: the one OpenAI-shaped error type.
//! - [`usage_log`]: one row per call, journaled to disk, written in batches.
//! - [`journal`]: the usage log's segment files (appended through a shared memory map).
//! - [`metrics`]: requests, errors, tokens, latency, overhead, in-flight, queued.
//! - [`api`]: the control-socket routes for `gpuhub keys` and `gpuhub usage --calls`.

pub mod access;
pub mod api;
pub mod auth;
pub mod error;
pub mod fair_use;
#[doc(hidden)]
pub mod fuzz;
pub mod journal;
pub mod key_policy;
pub mod limits;
pub mod metrics;
pub mod models_list;
pub mod parse;
pub mod policy;
pub mod proxy;
pub mod refusals;
pub mod router;
pub mod server;
pub mod sso;
pub mod stream;
pub mod upstream;
pub mod usage_log;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::{IntoResponse, Response};
use prometheus_client::registry::Registry;

pub use error::GatewayError;
pub use router::router;

use crate::config::Config;
use crate::store::Store;
use usage_log::{UsageLog, UsageRow};

/// The gateway's long-lived parts (in `AppState::gateway`).
pub struct Gateway {
    pub metrics: metrics::GatewayMetrics,
    pub usage: UsageLog,
    pub keys: auth::KeyCache,
    /// Whether a job token's job has ended (the store, at most once a second per job).
    pub jobs: auth::JobStates,
    /// uid -> passwd name, for job tokens.
    pub users: auth::UserNames,
    /// The HTTP/1.1 client for every worker, with its pool of idle connections.
    pub upstream: upstream::Client,
    /// Request-body bytes held across all calls (`gateway.max_body_bytes_total`).
    pub budget: limits::BodyBudget,
    /// Plain answers not yet taken by their callers (`gateway.max_response_bytes_total`).
    pub answers: limits::BodyBudget,
    /// Refused calls nobody can be billed for: counters, rate buckets, one row per minute.
    pub refusals: refusals::Refusals,
    /// What proves an SSO header (`[gateway.sso]`).
    pub sso: sso::SsoProof,
    /// Connection slots and counters of every gateway listener.
    pub connections: Arc<server::Connections>,
    /// Requests per minute and tokens per day, per user and per API key (`[gateway.limits]`).
    pub fair_use: fair_use::FairUse,
    /// `[gateway.user_models]` and `keys_per_user`, as last (re)loaded.
    pub access: access::Access,
}

impl Gateway {
    /// Registers metrics in `registry` (the `gpuhub` sub-registry), loads the API keys and
    /// starts the usage-log writer.
    pub async fn start(config: &Config, store: &Store, registry: &mut Registry) -> anyhow::Result<Gateway> {
        use anyhow::Context;
        let g = &config.file.gateway;
        let sso = sso::SsoProof::load(&g.sso)?;
        let metrics = metrics::GatewayMetrics::register(registry);
        let usage = UsageLog::start(&config.file.paths.state_dir, store.clone(), g.usage_queue, registry)?;
        let keys = auth::KeyCache::default();
        let records = store.api_keys().await.context("cannot load the gateway's API keys from the store")?;
        let fair_use = fair_use::FairUse::new(g.limits.clone());
        // Rows a killed agent left in the journal count too: they are replayed before a flush
        // is answered (bounded: a store that is down must not hold up the start).
        if tokio::time::timeout(Duration::from_secs(10), usage.flush()).await.is_err() {
            tracing::warn!("the usage journal was not replayed within 10 s: [gateway.limits] count only the rows already stored");
        }
        let now = crate::util::now_us();
        let day = fair_use::day_of(now);
        let used = store
            .limit_usage(day, now - 60_000_000)
            .await
            .context("cannot load the day's gateway usage (for [gateway.limits]) from the store")?;
        fair_use.reload(&records, &used, now);
        if store.backend() == crate::store::Backend::Postgres {
            // Other gateways on this store: their calls are in the usage log just reloaded.
            let me = config.file.telemetry.effective_node_name();
            let others = store
                .others_limit_counts(&me, day)
                .await
                .context("cannot load the other gateways' counts of the day (for [gateway.limits]) from the store")?;
            fair_use.start_with_others(day, &others, now);
        }
        keys.replace(records);
        let connect = Duration::from_secs(g.upstream_connect_timeout_s.min(g.upstream_timeout_s));
        let upstream = upstream::Client::new(256, Duration::from_secs(60), connect);
        upstream.spawn_pruner(Duration::from_secs(15));
        Ok(Gateway {
            metrics,
            usage,
            keys,
            jobs: auth::JobStates::default(),
            users: auth::UserNames::default(),
            upstream,
            budget: limits::BodyBudget::new(g.max_body_bytes_total),
            answers: limits::BodyBudget::new(g.max_response_bytes_total),
            refusals: refusals::Refusals::register(g.unauth_refusals_per_s, registry),
            sso,
            connections: Arc::new(server::Connections::register(server::Limits::from_config(g), registry)),
            fair_use,
            access: access::Access::new(g),
        })
    }

    /// Ends a call: metrics, then the usage log (journaled before this returns).
    pub fn finish(&self, row: UsageRow) {
        self.fair_use.count(&row, crate::util::now_us());
        self.metrics.observe(&row);
        self.usage.record(row);
    }

    /// Answers a call refused before anyone can be billed: no valid credentials (a 401, or a
    /// 429 once the peer is over `gateway.unauth_refusals_per_s`), or a usage log that cannot
    /// take rows (503). Counted per peer; the usage log gets one row per peer and minute.
    pub fn refuse(&self, meta: &RequestMeta, peer: &server::Peer, route: &str, e: GatewayError, rate: u32) -> Response {
        let peer_addr = peer.address();
        let (kind, e) = match e {
            GatewayError::UsageBacklog { .. } => (refusals::Kind::UsageBacklog, e),
            e if self.refusals.admit(&peer_addr) => (refusals::Kind::Unauthenticated, e),
            _ => (refusals::Kind::Unauthenticated, GatewayError::Throttled { peer: peer_addr.clone(), rate }),
        };
        let mut row = meta.row(route, &auth::Identity::default());
        row.status = e.status().as_u16();
        row.error_code = e.code().to_string();
        row.latency_us = us_since(meta.started);
        row.overhead_us = row.latency_us;
        self.metrics.observe(&row);
        if self.refusals.count(&peer_addr, kind, row) {
            tracing::warn!(peer = %peer_addr, code = e.code(), reason = %e, "refusing calls from this peer (logged once a minute; counted in gpuhub_gateway_refused_calls_total)");
        }
        e.into_response()
    }

    /// Hands the refusal rows of minutes that are over (all of them with `all`) to the usage
    /// log.
    pub fn flush_refusals(&self, all: bool) {
        for row in self.refusals.take(crate::util::now_us(), all) {
            self.usage.record(row);
        }
    }

    /// Waits, at most [`REPORT_SETTLE`], until the calls this gateway has answered are in the
    /// store (those its writer holds: all of them unless the store is slow or down), so that a
    /// report read right after a call counts it (`gpuhub names callers`, the
    /// callers check of a rename or retirement, `gpuhub usage --calls`): the usage writer
    /// otherwise lets rows gather for up to 100 ms (SQLite) before it stores them. Cheap enough
    /// for every report, whoever asks ([`UsageLog::settle`]: no journal rotation). Another
    /// gateway's calls on the same store count once its own writer has stored them (10 ms
    /// batches on PostgreSQL). When the store does not take the rows in time, the report counts
    /// what is stored, and the log says so.
    pub async fn settle_usage(&self) {
        if tokio::time::timeout(REPORT_SETTLE, self.usage.settle()).await.is_err() {
            tracing::warn!(
                waiting = self.usage.health().waiting,
                "a report was read before this gateway's latest calls reached the store (it is slow or down): they are not counted in it"
            );
        }
    }
}

/// How long a report waits for this gateway's latest calls to reach the store
/// ([`Gateway::settle_usage`]).
pub const REPORT_SETTLE: Duration = Duration::from_secs(2);

/// Longest route kept in a usage row (a path is whatever the client sent).
pub const MAX_ROUTE: usize = 128;

/// Per-request facts gathered by the auth middleware (request extension).
#[derive(Debug, Clone)]
pub struct RequestMeta {
    pub request_id: String,
    pub started: Instant,
    pub time_us: i64,
    pub client_addr: String,
    pub user_agent: String,
}

impl RequestMeta {
    /// A usage row pre-filled with what is known before the body is read.
    pub fn row(&self, route: &str, id: &auth::Identity) -> UsageRow {
        UsageRow {
            request_id: self.request_id.clone(),
            time_us: self.time_us,
            user: id.user.clone(),
            app: id.app.clone(),
            job_id: id.job_id,
            key_id: id.key_id.clone().unwrap_or_default(),
            client_addr: self.client_addr.clone(),
            user_agent: self.user_agent.clone(),
            route: route.chars().take(MAX_ROUTE).collect(),
            ..UsageRow::default()
        }
    }

    /// The call this request becomes, timed from its arrival.
    pub fn call(&self, route: &str, id: &auth::Identity) -> proxy::Call {
        proxy::Call::new(self.row(route, id), self.started)
    }
}

/// A fresh request id: 32 hex digits, the arrival time in microseconds (14 digits) then 72
/// random bits. Time first, so the usage log's primary key grows at its end (random keys
/// scatter inserts over the whole index).
pub fn new_request_id() -> String {
    let r: u128 = rand::random::<u128>() & ((1u128 << 72) - 1);
    format!("{:014x}{:018x}", crate::util::now_us().max(0) as u64 & 0x00ff_ffff_ffff_ffff, r)
}

/// Microseconds since `t`.
pub(crate) fn us_since(t: Instant) -> i64 {
    i64::try_from(t.elapsed().as_micros()).unwrap_or(i64::MAX)
}
