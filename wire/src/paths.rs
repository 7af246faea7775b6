//! Installed default paths. Every one is overridable (agent config, plugstack arguments);
//! these are the values the RPM spec ships. `rpm/` has a test that fails if they diverge.

/// Configuration directory (`agent.toml`).
pub const CONFIG_DIR: &str = "/etc/gpuhub";
/// The agent's configuration file.
pub const CONFIG_FILE: &str = "/etc/gpuhub/agent.toml";
/// Durable state: the SQLite store, the job-credential key, the usage-log spill.
pub const STATE_DIR: &str = "/var/lib/gpuhub";
/// The spool the plugin writes usage records into and the agent ingests from.
pub const SPOOL_DIR: &str = "/var/spool/gpuhub";
/// Runtime files: the role snapshot, the dcgm-exporter job map.
pub const RUNTIME_DIR: &str = "/run/gpuhub";

/// File name of the snapshot inside the runtime directory.
pub const SNAPSHOT_FILE_NAME: &str = "snapshot.json";
/// File name of the job-credential key inside the state directory (root, 0600).
pub const JOB_KEY_FILE_NAME: &str = "job-token.key";
/// Directory (inside the runtime directory) of dcgm-exporter's `--hpc-job-mapping-dir` files.
pub const DCGM_JOB_MAP_DIR_NAME: &str = "dcgm-job-map";

/// Default gateway listener.
pub const GATEWAY_LISTEN: &str = "127.0.0.1:8400";
/// Default metrics listener.
pub const METRICS_LISTEN: &str = "127.0.0.1:9410";
