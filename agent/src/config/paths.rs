use std::path::PathBuf;

use gpuhub_wire::paths;
use serde::{Deserialize, Serialize};

/// `[paths]`: where the agent keeps state, reads the spool and writes runtime files.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PathsConfig {
    /// SQLite store, job-credential key, usage-log spill (`/var/lib/gpuhub`).
    pub state_dir: PathBuf,
    /// The SPANK plugin's spool (`/var/spool/gpuhub`); must match the plugstack `spool_dir`.
    pub spool_dir: PathBuf,
    /// Snapshot for the plugin, dcgm-exporter job map, control socket (`/run/gpuhub`).
    pub runtime_dir: PathBuf,
}

impl Default for PathsConfig {
    fn default() -> Self {
        Self { state_dir: paths::STATE_DIR.into(), spool_dir: paths::SPOOL_DIR.into(), runtime_dir: paths::RUNTIME_DIR.into() }
    }
}

impl PathsConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        for (key, p) in
            [("paths.state_dir", &self.state_dir), ("paths.spool_dir", &self.spool_dir), ("paths.runtime_dir", &self.runtime_dir)]
        {
            if !p.is_absolute() {
                return Err((key.into(), format!("`{}` must be an absolute path", p.display())));
            }
        }
        Ok(())
    }
}
