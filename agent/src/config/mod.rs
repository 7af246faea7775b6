//! Agent configuration: `agent.toml` parsed into typed sections, then validated.
//!
//! Two stages (STYLE.md §5): [`ConfigFile`] deserialises with `deny_unknown_fields`, so a typo
//! is an error with line, column and the expected keys; [`ConfigFile::validate`] then runs the
//! cross-field checks and builds the runtime [`Config`], with messages that name the full key
//! path. Every section has defaults, so an absent file means "embedded defaults" (the lab and
//! a fresh install run on them).
//!
//! Precedence: the file, then the few environment overrides in [`Config::load`] (each named in
//! `gpuhub-agent check-config` output). Setting a value both in the file and in the environment
//! is an error that names both sources.

mod catalog;
mod cluster;
mod gateway;
mod names;
mod paths;
pub mod quotas;
mod store;
pub mod templates;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use catalog::{LauncherKind, ModelConfig, ResourceRequest, WorkersConfig, valid_model_name, validate_registry_entry};
pub use cluster::ClusterConfig;
pub use gateway::{GatewayConfig, LimitUser, LimitsConfig, SSO_SECRET_HEADER, Secret, SsoConfig, UserLimits, UserName, own_addresses};
pub use names::{NameHistoryEntry, NamesConfig, RetiredStatus, is_date};
pub use paths::PathsConfig;
pub use quotas::{QuotaConfig, QuotaPeriod, QuotaTarget};
pub use store::StoreConfig;

pub use crate::telemetry::TelemetryConfig;

/// Errors from loading or validating the configuration. Each says which file or key, what is
/// wrong and how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source} (pass --config PATH or set GPUHUB_CONFIG)")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {key}: {message}")]
    Invalid { path: PathBuf, key: String, message: String },
}

/// `agent.toml` as written. Every section is optional.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfigFile {
    pub paths: PathsConfig,
    pub store: StoreConfig,
    pub gateway: GatewayConfig,
    pub metrics: MetricsConfig,
    pub telemetry: TelemetryConfig,
    pub accounting: AccountingConfig,
    pub mlflow: MlflowConfig,
    pub slurm: SlurmConfig,
    pub admin: AdminConfig,
    pub names: NamesConfig,
    /// App role -> current model name. An empty string means "this role has no model
    /// assigned" (calls get a 503 that says so; jobs get no `<ROLE>_MODEL`).
    pub roles: std::collections::BTreeMap<String, String>,
    /// The model catalog: `[[models]]` entries.
    pub models: Vec<ModelConfig>,
    /// Settings shared by on-demand model workers.
    pub workers: WorkersConfig,
    /// `[templates.NAME]`: worker templates of this site (new ones, or fields overriding a
    /// shipped one of the same name).
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub templates: std::collections::BTreeMap<String, templates::TemplateConfig>,
    /// `[[quotas]]`: GPU-hour quotas per user, account or Unix group, held by Slurm
    /// (docs/quotas.md).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub quotas: Vec<QuotaConfig>,
    /// `[cluster]`: which nodes run the gateway (one file for every node of a cluster).
    pub cluster: ClusterConfig,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// Listener for `/metrics`. Loopback by default: a Prometheus in a container reaches the
    /// host only through a bridge address, so such sites set `0.0.0.0:9410` (and firewall it).
    pub listen: String,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { listen: gpuhub_wire::paths::METRICS_LISTEN.to_string() }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AccountingConfig {
    /// Shards per GPU in the node's gres.conf (`Name=shard Count=14` per GPU on the reference
    /// node). GPU-equivalent seconds = shard-seconds / this.
    pub shards_per_gpu: u32,
    /// How often the spool is scanned, in milliseconds.
    pub ingest_interval_ms: u64,
    /// Verify each job's records against Slurm (`scontrol show job -d`, else `sacct`) and bill
    /// Slurm's allocation; close jobs whose end record never came and fill in jobs whose start
    /// record never came (docs/accounting.md). Needs `telemetry.enable_slurm`.
    pub slurm_reconcile: bool,
    /// How often open jobs are reconciled with Slurm, in milliseconds (default:
    /// `telemetry.slurm_interval_ms`).
    pub reconcile_interval_ms: Option<u64>,
    /// Where a job's start and end come from (see [`JobBoundaries`]).
    pub job_boundaries: JobBoundaries,
    /// How often the GPU-hours counters (`gpuhub_slurm_gpu_seconds_total`) are summed from
    /// the store, in milliseconds; each pass also splits ended worker jobs among their callers.
    pub usage_counters_interval_ms: u64,
    /// How often `[[quotas]]` usage is summed and Slurm's limits are brought in step, in
    /// milliseconds.
    pub quota_interval_ms: u64,
}

/// `accounting.job_boundaries`: which source says when a job started and ended on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JobBoundaries {
    /// slurmctld (and sacct), through reconciliation: the shipped plugin (`spank_gpuhub.so`)
    /// has no prolog/epilog hooks and writes step records only. A job is created from Slurm
    /// when Slurm lists it on this node and closed when Slurm says it ended; neither is an
    /// anomaly. Needs `telemetry.enable_slurm` and `accounting.slurm_reconcile` (without them
    /// the agent warns at start: no job it learns of from step records ever ends).
    #[default]
    Slurm,
    /// The JobStart/JobEnd records of the plugin build with job hooks
    /// (`spank_gpuhub_prolog.so`, with `PrologFlags=Alloc`). A job Slurm has to fill in or
    /// close is an anomaly (its record never arrived).
    Prolog,
}

impl Default for AccountingConfig {
    fn default() -> Self {
        Self {
            shards_per_gpu: 14,
            ingest_interval_ms: 1000,
            slurm_reconcile: true,
            reconcile_interval_ms: None,
            job_boundaries: JobBoundaries::Slurm,
            usage_counters_interval_ms: 30_000,
            quota_interval_ms: 60_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlflowConfig {
    /// Tracking server jobs log to (`MLFLOW_TRACKING_URI`) and the registry the gateway reads.
    pub tracking_uri: Option<String>,
    /// Site default `MLFLOW_EXPERIMENT_NAME` for jobs that did not choose one.
    pub default_experiment: Option<String>,
    /// How often the registry is read for models tagged `served_by=gateway`, seconds (0: the
    /// registry adds no models; only `[[models]]` entries are served).
    pub registry_poll_s: u64,
    /// How a registry-served model's worker runs (`slurm` or `local`).
    pub launcher: LauncherKind,
    /// Where `@production` versions' artifacts are kept, one directory per content digest
    /// (default `<state_dir>/mlflow-cache`).
    pub cache_dir: Option<PathBuf>,
    /// Most GiB the artifact cache holds; versions no worker uses are removed, least recently
    /// used first, to make room.
    pub cache_max_gib: f64,
    /// Directories a `file:` artifact source may be under (default: none, so `file:` sources
    /// are refused: anyone can register a version whose source names any file on the node).
    pub file_roots: Vec<PathBuf>,
    /// The promotion gate of registry-tagged models, by MLflow registered model name (an
    /// `[[models]]` entry has its own eval_metric/eval_threshold). Never read from MLflow tags:
    /// MLflow has no login, anyone can edit them.
    pub gates: std::collections::BTreeMap<String, EvalGate>,
}

/// `gpuhub models promote`'s gate for one registered model.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvalGate {
    /// The metric the version's run must have logged.
    pub metric: String,
    /// Its threshold (higher is better unless `lower_is_better`).
    pub threshold: f64,
    #[serde(default)]
    pub lower_is_better: bool,
}

impl Default for MlflowConfig {
    fn default() -> Self {
        Self {
            tracking_uri: None,
            default_experiment: None,
            registry_poll_s: 30,
            launcher: LauncherKind::Slurm,
            cache_dir: None,
            cache_max_gib: 100.0,
            file_roots: Vec::new(),
            gates: std::collections::BTreeMap::new(),
        }
    }
}

impl MlflowConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        if self.launcher == LauncherKind::Static {
            return Err((
                "mlflow.launcher".into(),
                "registry-served models start workers: use \"slurm\" or \"local\" (a static server is a [[models]] entry)".into(),
            ));
        }
        if !(self.cache_max_gib.is_finite() && self.cache_max_gib > 0.0) {
            return Err(("mlflow.cache_max_gib".into(), format!("{} is not a positive number of GiB", self.cache_max_gib)));
        }
        if self.registry_poll_s > 86_400 {
            return Err((
                "mlflow.registry_poll_s".into(),
                format!("{} is over a day; use 1..=86400, or 0 to turn it off", self.registry_poll_s),
            ));
        }
        for (name, g) in &self.gates {
            if g.metric.trim().is_empty() || !g.threshold.is_finite() {
                return Err((
                    format!("mlflow.gates.{name}"),
                    "needs a metric name and a finite threshold, e.g. { metric = \"eval_accuracy\", threshold = 0.7 }".into(),
                ));
            }
        }
        for (i, r) in self.file_roots.iter().enumerate() {
            if !r.is_absolute() {
                return Err((format!("mlflow.file_roots[{i}]"), format!("`{}` must be an absolute directory", r.display())));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SlurmConfig {
    /// Directory holding sbatch, scancel, squeue, sinfo, scontrol (empty: search `PATH`).
    pub bin_dir: Option<PathBuf>,
    /// Partition for model worker jobs.
    pub worker_partition: Option<String>,
    /// Account for model worker jobs.
    pub worker_account: Option<String>,
    /// QOS for model worker jobs.
    pub worker_qos: Option<String>,
    /// Directory for worker job scripts and logs.
    pub worker_dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Members of this Unix group (and root) are admins: they see every user's usage and may
    /// manage keys, names and models.
    pub group: String,
    /// The control socket the `gpuhub` CLI talks to (mode 0666; callers are identified by
    /// SO_PEERCRED, not by the socket's permissions). Default: `<runtime_dir>/agent.sock`.
    pub socket: Option<PathBuf>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self { group: "gpuhub-admin".to_string(), socket: None }
    }
}

/// The validated configuration the agent runs on.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where it came from (`None`: embedded defaults).
    pub source: Option<PathBuf>,
    pub file: ConfigFile,
    pub store_url: String,
    pub control_socket: PathBuf,
    pub snapshot_path: PathBuf,
    pub job_key_path: PathBuf,
}

impl Config {
    /// Whether this agent runs the gateway (`[cluster] gateway_nodes`): without it, no gateway
    /// port and no workers of its own; telemetry, ingest and the control socket still run.
    pub fn is_gateway(&self) -> bool {
        self.file.cluster.is_gateway(&self.file.telemetry.effective_node_name())
    }

    /// Loads `path`; when `path` is the default location and does not exist, runs on the
    /// embedded defaults. `GPUHUB_STORE_URL` overrides `store.url` (tests use it for
    /// PostgreSQL); setting both is an error.
    pub fn load(path: &Path, is_default_path: bool) -> Result<Config, ConfigError> {
        let (file, source) = match std::fs::read_to_string(path) {
            Ok(text) => (parse(&text, path)?, Some(path.to_path_buf())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && is_default_path => (ConfigFile::default(), None),
            Err(source) => return Err(ConfigError::Read { path: path.to_path_buf(), source }),
        };
        let env_url = std::env::var("GPUHUB_STORE_URL").ok().filter(|s| !s.is_empty());
        file.validate(source, env_url)
    }

    /// Parses and validates a config text (tests, `check-config`).
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let path = PathBuf::from("<inline>");
        parse(text, &path)?.validate(Some(path), None)
    }

    /// Path of a file in the state directory.
    pub fn state_path(&self, name: &str) -> PathBuf {
        self.file.paths.state_dir.join(name)
    }

    /// The artifact cache of registry-served versions (`mlflow.cache_dir`).
    pub fn mlflow_cache_dir(&self) -> PathBuf {
        self.file.mlflow.cache_dir.clone().unwrap_or_else(|| self.file.paths.state_dir.join("mlflow-cache"))
    }

    /// The directory of worker scripts, logs, address and key files.
    pub fn workers_dir(&self) -> PathBuf {
        let f = &self.file;
        f.workers.dir.clone().or_else(|| f.slurm.worker_dir.clone()).unwrap_or_else(|| f.paths.state_dir.join("workers"))
    }

    /// For `check-config`, as TOML comments: the final command of each on-demand model, how
    /// its worker gets the key (the file or variable, never the key), its health path, routes,
    /// stream usage, account and environment variable names (values are not shown).
    pub fn render_worker_commands(&self) -> String {
        let mut out = String::new();
        let dir = self.workers_dir();
        for m in &self.file.models {
            let w = &m.worker;
            let routes = crate::models::routes::describe(&w.routes);
            if m.launcher == LauncherKind::Static {
                out.push_str(&format!("# model `{}` (static {}): routes {routes}\n", m.name, m.url.as_deref().unwrap_or("")));
                continue;
            }
            let safe = crate::models::launcher::safe_name(&m.name);
            let key_file = format!("{}/keys/{safe}.<id>{}", dir.display(), w.key.file_suffix);
            let port = if m.launcher == LauncherKind::Slurm { "${GPUHUB_WORKER_PORT}" } else { "<port>" };
            // workers.host = "node": a Slurm job binds its node's address, found when it starts.
            let node_host = self.file.workers.host == crate::models::launcher::slurm::NODE_HOST;
            let (host, host_mark) = match (node_host, m.launcher) {
                (true, LauncherKind::Slurm) => ("\u{0}HOST\u{0}", "${GPUHUB_WORKER_HOST}"),
                (true, _) => ("127.0.0.1", ""),
                (false, _) => (self.file.workers.host.as_str(), ""),
            };
            let command = crate::models::launcher::render(
                &w.command
                    .replace("{host}", if host_mark.is_empty() { "{host}" } else { "\u{0}HOST\u{0}" })
                    .replace("{port}", "\u{0}PORT\u{0}")
                    .replace("{api_key_file}", "\u{0}KEYFILE\u{0}")
                    .replace("{version}", "\u{0}VERSION\u{0}"),
                &[
                    ("model", &m.name),
                    (
                        "model_path",
                        m.model_path.as_deref().unwrap_or(if m.mlflow_model.is_some() { "<artifacts of @production>" } else { "" }),
                    ),
                    (
                        "model_file",
                        m.model_path.as_deref().unwrap_or(if m.mlflow_model.is_some() { "<weights file of @production>" } else { "" }),
                    ),
                    ("host", host),
                ],
            )
            .replace("\u{0}HOST\u{0}", host_mark)
            .replace("\u{0}PORT\u{0}", port)
            .replace("\u{0}KEYFILE\u{0}", &key_file)
            .replace("\u{0}VERSION\u{0}", if m.mlflow_model.is_some() { "<@production version>" } else { "" });
            let mut env: Vec<&str> = vec!["PATH", "HOME", "USER", "LOGNAME", "LANG"];
            env.extend(w.env.keys().map(String::as_str).filter(|k| !["PATH", "HOME", "USER", "LOGNAME", "LANG"].contains(k)));
            out.push_str(&format!(
                "# model `{}` ({} launcher, template {}):\n#   command: {command}\n#   key: {}\n#   health: {} (with the key); routes: {routes}; stream usage: {}\n#   runs as: {}; environment: {} (nothing of the agent's)\n",
                m.name,
                crate::models::lifecycle::launcher_name(m.launcher),
                w.template.as_deref().unwrap_or("none"),
                w.key.describe(w.uses_key_file()),
                w.health_path,
                if w.stream_usage { "reported by the server" } else { "not reported by the server" },
                self.file.workers.user,
                env.join(" "),
            ));
        }
        out
    }

    /// The effective configuration as TOML, secrets redacted (`check-config`, which the unit
    /// runs as `ExecStartPre`, so its output lands in the journal): the store URL's password,
    /// credentials in any URL, every `models[].api_key` and `models[].env` value, and the SSO
    /// secret (its type prints `<redacted>`).
    pub fn render_redacted(&self) -> String {
        let mut file = self.file.clone();
        file.store.url = Some(redact_url(&self.store_url));
        file.gateway.public_url = file.gateway.public_url.as_deref().map(redact_url);
        file.mlflow.tracking_uri = file.mlflow.tracking_uri.as_deref().map(redact_url);
        for m in &mut file.models {
            if m.api_key.is_some() {
                m.api_key = Some(REDACTED.to_string());
            }
            for v in m.env.values_mut() {
                *v = REDACTED.to_string();
            }
            m.url = m.url.as_deref().map(redact_url);
            m.model_path = m.model_path.as_deref().map(redact_url);
        }
        let mut out = String::new();
        out.push_str(&format!(
            "# effective gpuhub-agent configuration (source: {})\n",
            self.source.as_deref().map(|p| p.display().to_string()).unwrap_or_else(|| "embedded defaults".into())
        ));
        out.push_str(&format!(
            "# control socket: {}\n# snapshot: {}\n# job key: {}\n",
            self.control_socket.display(),
            self.snapshot_path.display(),
            self.job_key_path.display()
        ));
        out.push_str(&toml::to_string_pretty(&file).unwrap_or_else(|e| format!("# cannot render: {e}\n")));
        out
    }
}

/// What a redacted secret reads as.
pub const REDACTED: &str = "<redacted>";

fn parse(text: &str, path: &Path) -> Result<ConfigFile, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

/// Removes the credentials from a URL: the password of `user:password@` (or a lone
/// `token@`), and the values of query parameters that carry secrets (`?password=`,
/// `?token=`, ...). Anything that is not a URL is returned unchanged.
pub fn redact_url(url: &str) -> String {
    let Some(s) = url.find("://") else { return url.to_string() };
    let rest = &url[s + 3..];
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let authority = match authority.rfind('@') {
        Some(at) => match authority[..at].split_once(':') {
            Some((user, _)) => format!("{user}:{REDACTED}{}", &authority[at..]),
            None => format!("{REDACTED}{}", &authority[at..]),
        },
        None => authority.to_string(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let (query, frag) = match query.split_once('#') {
                Some((q, f)) => (q, format!("#{f}")),
                None => (query, String::new()),
            };
            let query: Vec<String> = query
                .split('&')
                .map(|kv| match kv.split_once('=') {
                    Some((k, _)) if secret_param(k) => format!("{k}={REDACTED}"),
                    _ => kv.to_string(),
                })
                .collect();
            format!("{path}?{}{frag}", query.join("&"))
        }
        None => tail.to_string(),
    };
    format!("{}{authority}{tail}", &url[..s + 3])
}

/// Query parameters whose values are secrets.
fn secret_param(k: &str) -> bool {
    let k = k.to_ascii_lowercase();
    ["password", "passwd", "pass", "pwd", "secret", "token", "key", "apikey", "api_key", "access_token", "sslpassword", "auth"]
        .iter()
        .any(|s| k == *s || k.ends_with(&format!("_{s}")))
}

impl ConfigFile {
    /// Cross-field validation; builds the runtime [`Config`].
    pub fn validate(mut self, source: Option<PathBuf>, env_store_url: Option<String>) -> Result<Config, ConfigError> {
        let path = source.clone().unwrap_or_else(|| PathBuf::from("<defaults>"));
        let invalid = |key: &str, message: String| ConfigError::Invalid { path: path.clone(), key: key.to_string(), message };

        self.paths.validate().map_err(|(k, m)| invalid(&k, m))?;
        self.gateway.validate().map_err(|(k, m)| invalid(&k, m))?;
        self.names.validate().map_err(|(k, m)| invalid(&k, m))?;
        self.telemetry.validate().map_err(|errs| {
            let key = errs.first().map(|e| format!("telemetry.{}", e.key)).unwrap_or_else(|| "telemetry".into());
            let message = errs.iter().map(|e| e.problem.clone()).collect::<Vec<_>>().join("; ");
            invalid(&key, message)
        })?;
        check_listen(&self.metrics.listen).map_err(|m| invalid("metrics.listen", m))?;
        if self.accounting.shards_per_gpu == 0 {
            return Err(invalid(
                "accounting.shards_per_gpu",
                "must be at least 1 (the `Count=` of one GPU's shard line in gres.conf)".into(),
            ));
        }
        if let Some(ms) = self.accounting.reconcile_interval_ms
            && !(1_000..=3_600_000).contains(&ms)
        {
            return Err(invalid(
                "accounting.reconcile_interval_ms",
                format!("{ms} is out of range; use 1000..=3600000 (default: telemetry.slurm_interval_ms)"),
            ));
        }
        if !(1_000..=3_600_000).contains(&self.accounting.usage_counters_interval_ms) {
            return Err(invalid(
                "accounting.usage_counters_interval_ms",
                format!("{} is out of range; use 1000..=3600000 (default 30000)", self.accounting.usage_counters_interval_ms),
            ));
        }
        if !(1_000..=3_600_000).contains(&self.accounting.quota_interval_ms) {
            return Err(invalid(
                "accounting.quota_interval_ms",
                format!("{} is out of range; use 1000..=3600000 (default 60000)", self.accounting.quota_interval_ms),
            ));
        }
        quotas::validate(&self.quotas).map_err(|(k, m)| invalid(&k, m))?;
        self.mlflow.validate().map_err(|(k, m)| invalid(&k, m))?;
        // The MLflow registry's tagged models are served too, known once it is read.
        let registry = self.mlflow.tracking_uri.is_some() && self.mlflow.registry_poll_s > 0;
        catalog::validate(&mut self.models, &self.templates, &self.roles, &self.names, registry).map_err(|(k, m)| invalid(&k, m))?;
        let known: std::collections::BTreeSet<&str> =
            self.models.iter().flat_map(|m| std::iter::once(m.name.as_str()).chain(m.aliases.iter().map(String::as_str))).collect();
        self.gateway.validate_user_models(&known, registry).map_err(|(k, m)| invalid(&k, m))?;
        self.workers.validate().map_err(|(k, m)| invalid(&k, m))?;
        self.cluster
            .validate(&self.telemetry.effective_node_name(), self.gateway.public_url.as_deref())
            .map_err(|(k, m)| invalid(&k, m))?;

        let store_url = match (self.store.url.clone(), env_store_url) {
            (Some(_), Some(_)) => {
                return Err(invalid("store.url", "is set both in the file and in GPUHUB_STORE_URL; remove one".into()));
            }
            (Some(u), None) | (None, Some(u)) => u,
            (None, None) => format!("sqlite://{}", self.paths.state_dir.join("gpuhub.db").display()),
        };
        store::validate_url(&store_url).map_err(|m| invalid("store.url", m))?;

        let runtime = &self.paths.runtime_dir;
        Ok(Config {
            source,
            control_socket: self.admin.socket.clone().unwrap_or_else(|| runtime.join("agent.sock")),
            snapshot_path: runtime.join(gpuhub_wire::paths::SNAPSHOT_FILE_NAME),
            job_key_path: self.paths.state_dir.join(gpuhub_wire::paths::JOB_KEY_FILE_NAME),
            store_url,
            file: self,
        })
    }
}

/// Checks a `host:port` listener address.
pub fn check_listen(s: &str) -> Result<(), String> {
    s.parse::<std::net::SocketAddr>()
        .map(|_| ())
        .map_err(|_| format!("`{s}` is not an address:port such as 127.0.0.1:8400 (use 0.0.0.0:PORT to listen on every interface)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_use_installed_paths() {
        let c = ConfigFile::default().validate(None, None).unwrap();
        assert_eq!(c.store_url, "sqlite:///var/lib/gpuhub/gpuhub.db");
        assert_eq!(c.file.gateway.listen, "127.0.0.1:8400");
        assert_eq!(c.file.metrics.listen, "127.0.0.1:9410");
        assert_eq!(c.snapshot_path, PathBuf::from("/run/gpuhub/snapshot.json"));
        assert_eq!(c.control_socket, PathBuf::from("/run/gpuhub/agent.sock"));
        assert_eq!(c.job_key_path, PathBuf::from("/var/lib/gpuhub/job-token.key"));
    }

    #[test]
    fn typo_gives_line_and_expected_keys() {
        let err = Config::from_toml("[gateway]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n").unwrap_err().to_string();
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("unknown field `lisen`"), "{err}");
        assert!(err.contains("listen"), "{err}");
    }

    #[test]
    fn bad_listen_names_the_key() {
        let err = Config::from_toml("[metrics]\nlisten = \"localhost\"\n").unwrap_err().to_string();
        assert!(err.contains("metrics.listen"), "{err}");
    }

    #[test]
    fn store_url_in_two_places_is_an_error() {
        let file: ConfigFile = toml::from_str("[store]\nurl = \"sqlite:///tmp/x.db\"\n").unwrap();
        let err = file.validate(None, Some("postgres://u:p@h/db".into())).unwrap_err().to_string();
        assert!(err.contains("GPUHUB_STORE_URL"), "{err}");
    }

    #[test]
    fn check_config_shows_each_workers_final_command_and_how_it_gets_its_key() {
        let c = Config::from_toml(
            "[workers]\ndir = \"/w\"\n[[models]]\nname = \"a\"\nlauncher = \"local\"\ntemplate = \"llama-cpp\"\nmodel_path = \"/m/a.gguf\"\nenv = { HF_TOKEN = \"hf_secret_value\" }\n\
             [[models]]\nname = \"b\"\nlauncher = \"slurm\"\ntemplate = \"vllm\"\nmodel_path = \"/m/b\"\n",
        )
        .unwrap();
        let out = c.render_worker_commands();
        assert!(out.lines().all(|l| l.starts_with('#')), "comments only, so the effective TOML still parses:\n{out}");
        assert!(
            out.contains(
                "#   command: llama-server --model /m/a.gguf --alias a --host 127.0.0.1 --port <port> --api-key-file /w/keys/a.<id>.key"
            ),
            "{out}"
        );
        assert!(out.contains("#   command: vllm serve /m/b --served-model-name b --host 127.0.0.1 --port ${GPUHUB_WORKER_PORT}"), "{out}");
        assert!(out.contains("key: environment VLLM_API_KEY") && out.contains("key: 0600 file {api_key_file}"), "{out}");
        assert!(out.contains("HF_TOKEN") && !out.contains("hf_secret_value"), "env names, never values:\n{out}");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact_url("postgres://gpuhub:s3cret@db:5432/gpuhub"), "postgres://gpuhub:<redacted>@db:5432/gpuhub");
        assert_eq!(redact_url("sqlite:///var/lib/gpuhub/gpuhub.db"), "sqlite:///var/lib/gpuhub/gpuhub.db");
        assert_eq!(redact_url("http://tok3n@mlflow:5000/x"), "http://<redacted>@mlflow:5000/x");
        assert_eq!(
            redact_url("postgres://db/gpuhub?sslmode=require&password=s3cret"),
            "postgres://db/gpuhub?sslmode=require&password=<redacted>"
        );
        assert_eq!(redact_url("https://h/p?user_token=abc#frag"), "https://h/p?user_token=<redacted>#frag");
        // An @ in the path is not a credential.
        assert_eq!(redact_url("http://h:1/a@b"), "http://h:1/a@b");
        assert_eq!(redact_url("Qwen/Qwen3-8B"), "Qwen/Qwen3-8B");
    }

    #[test]
    fn check_config_output_holds_no_secret() {
        let text = r#"
[store]
url = "postgres://gpuhub:pg-pass-1@db/gpuhub?password=pg-pass-2"
[gateway]
public_url = "https://u:pub-pass-3@gpu01.example.org"
[gateway.sso]
enabled = true
user_header = "X-Forwarded-User"
shared_secret = "sso-secret-4-0123456789"
[mlflow]
tracking_uri = "http://ml:ml-pass-5@127.0.0.1:5000"
[[models]]
name = "m"
launcher = "static"
url = "http://127.0.0.1:9"
api_key = "worker-key-6"
[models.env]
HF_TOKEN = "hf-token-7"
OTHER = "plain-8"
"#;
        let c = Config::from_toml(text).unwrap();
        let out = c.render_redacted();
        for secret in ["pg-pass-1", "pg-pass-2", "pub-pass-3", "sso-secret-4", "ml-pass-5", "worker-key-6", "hf-token-7", "plain-8"] {
            assert!(!out.contains(secret), "check-config printed {secret}:\n{out}");
        }
        assert!(out.contains("HF_TOKEN = \"<redacted>\""), "{out}");
        assert!(!format!("{c:?}").contains("sso-secret-4"), "Debug prints the SSO secret");
        // The redacted output is still a valid config.
        let again: ConfigFile = toml::from_str(&out.lines().filter(|l| !l.starts_with('#')).collect::<Vec<_>>().join("\n")).unwrap();
        assert!(again.gateway.sso.enabled);
    }
}
