//! The OpenAI-compatible gateway: one API for every model on the node.

pub mod router;

pub use router::router;
