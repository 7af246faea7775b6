//! Turns a model name into a ready upstream.
//!
//! This first version serves `launcher = "static"` upstreams (an always-on server at a URL).
//! Workers started on demand (`local`, `slurm`) plug in here behind the same `acquire` call.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use serde::Serialize;

use super::Catalog;
use crate::config::LauncherKind;

/// Why a model cannot serve a call right now. Each message names the model and what to do.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model `{0}` is not in the catalog")]
    NotInCatalog(String),
    #[error("model `{model}` is busy: {in_flight} calls in flight and the queue of {queue} is full; retry in a few seconds")]
    Overloaded { model: String, in_flight: u32, queue: u32, retry_after_s: u64 },
    #[error("model `{model}` cannot start: {reason}")]
    Unavailable { model: String, reason: String },
    #[error("model `{model}` did not become ready within {seconds}s; see `gpuhub models` for its log")]
    LoadTimeout { model: String, seconds: u64 },
}

/// A permission to forward one call to a ready upstream. Dropping it ends the call (in-flight
/// counts, idle timers).
#[derive(Debug)]
pub struct Lease {
    pub model: String,
    /// Base URL without `/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub version: Option<String>,
    guard: InFlightGuard,
}

impl Lease {
    pub fn in_flight(&self) -> u32 {
        self.guard.0.in_flight.load(Ordering::Relaxed)
    }
}

#[derive(Debug)]
struct InFlightGuard(Arc<Slot>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug, Default)]
struct Slot {
    in_flight: AtomicU32,
}

/// What `/v1/models`, `gpuhub models` and metrics show per model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelStatus {
    pub name: String,
    pub state: &'static str,
    pub role: Option<String>,
    pub aliases: Vec<String>,
    pub in_flight: u32,
    pub detail: Option<String>,
}

pub struct ModelManager {
    catalog: Arc<Catalog>,
    slots: std::collections::BTreeMap<String, Arc<Slot>>,
}

impl ModelManager {
    pub fn new(catalog: Arc<Catalog>) -> ModelManager {
        let slots = catalog.models().map(|m| (m.name.clone(), Arc::new(Slot::default()))).collect();
        ModelManager { catalog, slots }
    }

    /// Waits until `model` can take a call and returns the lease for it.
    pub async fn acquire(&self, model: &str) -> Result<Lease, ModelError> {
        let entry = self.catalog.get(model).ok_or_else(|| ModelError::NotInCatalog(model.to_string()))?;
        let slot = self.slots.get(&entry.name).ok_or_else(|| ModelError::NotInCatalog(model.to_string()))?;
        let limit = entry.max_concurrency + entry.queue_len;
        let now = slot.in_flight.fetch_add(1, Ordering::AcqRel) + 1;
        let guard = InFlightGuard(slot.clone());
        if now > limit {
            return Err(ModelError::Overloaded { model: entry.name.clone(), in_flight: now - 1, queue: entry.queue_len, retry_after_s: 1 });
        }
        match entry.launcher {
            LauncherKind::Static => Ok(Lease {
                model: entry.name.clone(),
                base_url: entry.url.clone().unwrap_or_default().trim_end_matches('/').to_string(),
                api_key: entry.api_key.clone(),
                version: None,
                guard,
            }),
            LauncherKind::Local | LauncherKind::Slurm => Err(ModelError::Unavailable {
                model: entry.name.clone(),
                reason: "on-demand workers are not available in this build".into(),
            }),
        }
    }

    pub fn statuses(&self) -> Vec<ModelStatus> {
        self.catalog
            .models()
            .map(|m| ModelStatus {
                name: m.name.clone(),
                state: match m.launcher {
                    LauncherKind::Static => "ready",
                    _ => "unloaded",
                },
                role: self.catalog.roles().iter().find(|(_, v)| v.as_deref() == Some(m.name.as_str())).map(|(r, _)| r.clone()),
                aliases: self.catalog.aliases_of(&m.name),
                in_flight: self.slots.get(&m.name).map(|s| s.in_flight.load(Ordering::Relaxed)).unwrap_or(0),
                detail: None,
            })
            .collect()
    }
}
