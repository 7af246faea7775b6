//! Model workers: the catalog, and the lifecycle that turns a model name into an upstream
//! the gateway can forward to (starting the worker through a launcher when needed).
//!
//! - [`catalog`]: names, aliases and roles from `[[models]]`/`[roles]`.
//! - [`lifecycle`]: the per-model state machine (single-flight load, queue, idle unload,
//!   crash restart, adoption, VRAM-aware placement with LRU eviction).
//! - [`launcher`]: `local` (child process) and `slurm` (sbatch/squeue/scancel) workers.
//! - [`mlflow`]: `@production` resolution, discovery, eval-gated promotion.
//! - [`gate`]: gpuhub's promotion gate and the versions it promoted (served over `@production`).
//! - [`registry`]: catalog entries from registry tags (`served_by=gateway`, `gpuhub.*`).
//! - [`inventory`]: every registered model (served or not) for `gpuhub models registry`.
//! - [`artifacts`]: a version's weights, downloaded into a bounded content-addressed cache.
//! - [`replicas`]: replica scaling policy, least-outstanding routing, spread over nodes, health.
//! - [`routes`]: the OpenAI routes a model serves (the gateway forwards nothing else).
//! - [`metrics`]: `gpuhub_model_*` series.
//! - [`sync`]: the catalog follows agent.toml reloads and registry polls.
//! - [`single_flight`]: gateways on one store start one worker per model and share it.
//! - [`api`]: the control-socket routes behind `gpuhub models`.

pub mod api;
pub mod artifacts;
pub mod catalog;
pub mod fair_queue;
pub mod gate;
pub mod inventory;
pub mod launcher;
pub mod lifecycle;
pub mod metrics;
pub mod mlflow;
pub mod registry;
pub mod replicas;
pub mod routes;
pub mod single_flight;
pub mod sync;

pub use catalog::{Catalog, LiveCatalog};
pub use lifecycle::{CatalogChange, Lease, ManagerDeps, ModelError, ModelManager, ModelStatus, State, Switch};
