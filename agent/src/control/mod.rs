//! The control socket: a local HTTP/JSON API on a Unix socket that the `gpuhub` CLI uses.
//!
//! Callers are identified by the kernel (SO_PEERCRED), not by a key: root and members of
//! `admin.group` are admins and see everything; other users see their own jobs and usage.
//! The socket is mode 0666 so that every user can ask about their own jobs.

pub mod client;
pub mod peer;
pub mod server;
pub mod status;

pub use peer::{Caller, PeerCred};
pub use server::serve;
