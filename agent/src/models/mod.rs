//! Model workers: the catalog, and the lifecycle that turns a model name into an upstream
//! the gateway can forward to (starting the worker through a launcher when needed).

pub mod catalog;
pub mod lifecycle;

pub use catalog::Catalog;
pub use lifecycle::{Lease, ModelError, ModelManager, ModelStatus};
