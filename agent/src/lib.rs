//! gpuhub node agent (skeleton being filled in).
pub mod telemetry;
