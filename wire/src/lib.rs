//! Wire types shared by the gpuhub SPANK plugin (`spank/`) and the node agent (`agent/`).
//!
//! This crate is the contract between a process that runs inside every Slurm job
//! (the plugin, no async runtime, no threads) and the privileged daemon (the agent).
//! It must stay small: serde for the formats, HMAC for the job credential, nothing else.
//!
//! Parts:
//! - [`paths`]: the installed default paths; the RPM spec and the agent's config test
//!   check against these.
//! - [`spool`]: usage records the plugin writes at job/step start and end, and how they
//!   are named on disk so the agent ingests each exactly once.
//! - [`snapshot`]: the file the agent keeps (replaced atomically) that the plugin reads to
//!   inject `<ROLE>_MODEL`, the gateway URL and the MLflow tracking URI into jobs.
//! - [`token`]: the per-job gateway credential (HMAC over uid, user, job id and expiry) and the
//!   one function both sides read the key file with.
//! - [`bounds`]: length caps and the no-control-characters rule for every string that reaches a
//!   record or a token.

pub mod bounds;
pub mod paths;
pub mod snapshot;
pub mod spool;
pub mod token;
