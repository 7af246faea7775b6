//! `[[models]]` and `[roles]`: the model catalog.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::NamesConfig;
use super::templates::{self, TemplateConfig, WorkerSpec};
use crate::models::routes::Route;

/// How a model's worker runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LauncherKind {
    /// An always-on OpenAI-compatible server at `url`; gpuhub never starts or stops it.
    Static,
    /// A child process of the agent (embedded default without Slurm).
    Local,
    /// A Slurm job submitted with sbatch, cancelled when idle.
    Slurm,
}

/// `[workers]`: settings shared by every on-demand model worker (`local` and `slurm`).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkersConfig {
    /// Address workers bind (`{host}`). Loopback by default, so only the gateway reaches them.
    pub host: String,
    /// The unprivileged account workers run as (`local`: the agent drops to it before exec;
    /// `slurm`: jobs are submitted as it). Never root. The agent RPM creates `gpuhub-worker`.
    pub user: String,
    /// Directory for job scripts, address files, key files and worker logs (default:
    /// `slurm.worker_dir`, else `<state_dir>/workers`). The agent keeps it `root:<worker
    /// group>` mode 0770: workers write their logs and address files there, other users
    /// cannot look inside.
    pub dir: Option<PathBuf>,
    /// GPU memory workers may use in total, GiB. Without it, placement uses NVML's free memory
    /// (and without NVML, every model fits).
    pub vram_gib: Option<f64>,
    /// Longest wait for in-flight calls when a worker is unloaded, seconds.
    pub drain_timeout_s: u64,
    /// Failed starts or crashes in a row before a model is marked `failed` with back-off.
    pub max_restarts: u32,
    /// First back-off after a failure, seconds (doubles each time, at most 10 minutes).
    pub backoff_s: u64,
}

impl Default for WorkersConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            user: "gpuhub-worker".into(),
            dir: None,
            vram_gib: None,
            drain_timeout_s: 30,
            max_restarts: 3,
            backoff_s: 5,
        }
    }
}

impl WorkersConfig {
    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        if self.host.trim().is_empty() {
            return Err(("workers.host".into(), "must be an address workers bind, e.g. \"127.0.0.1\"".into()));
        }
        if let Some(v) = self.vram_gib
            && !(v.is_finite() && v > 0.0)
        {
            return Err(("workers.vram_gib".into(), format!("{v} is not a positive number of GiB; remove it to use NVML's free memory")));
        }
        if self.max_restarts == 0 {
            return Err(("workers.max_restarts".into(), "must be at least 1".into()));
        }
        let user = self.user.trim();
        if user.is_empty() || user == "root" || user == "0" {
            return Err((
                "workers.user".into(),
                format!(
                    "`{user}`: workers must run as an unprivileged account, never root; use the RPM's `gpuhub-worker` (or create one: useradd --system --shell /usr/sbin/nologin gpuhub-worker)"
                ),
            ));
        }
        Ok(())
    }
}

/// GPUs or shards a worker needs (Slurm `--gres`).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ResourceRequest {
    pub gpus: u32,
    pub shards: u32,
    /// VRAM the worker is expected to use, GiB (placement and eviction).
    pub vram_gib: f64,
}

/// One `[[models]]` entry.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The name clients call (e.g. `dots.ocr`, `Qwen/Qwen3-8B`).
    pub name: String,
    /// App role this model serves (`ocr`, `chat`, ...), if it is the role's current model.
    #[serde(default)]
    pub role: Option<String>,
    /// Extra names that are served as this model (active, not deprecated).
    #[serde(default)]
    pub aliases: Vec<String>,
    pub launcher: LauncherKind,
    /// `static`: the upstream base URL (without `/v1`).
    #[serde(default)]
    pub url: Option<String>,
    /// `static`: the upstream's API key, if it needs one.
    #[serde(default)]
    pub api_key: Option<String>,
    /// `local`/`slurm`: a shipped or `[templates.NAME]` template (vllm, sglang, llama-cpp,
    /// llama-cpp-python, tgi, infinity, whisper, tts) that knows the command line, health
    /// path, key, routes and stream usage of its server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// `local`/`slurm`: command template (instead of, or overriding, the template's).
    /// Placeholders: `{model}` (name), `{model_path}`, `{version}`, `{port}`, `{host}`,
    /// `{api_key_file}` (a 0600 file with the per-worker key). `{api_key}` is refused: the
    /// key never goes on a command line.
    #[serde(default)]
    pub command: Option<String>,
    /// Extra arguments appended to the (template's) command.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub args: Option<String>,
    /// Environment variable the worker reads its key from (overrides the template's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// The OpenAI routes the gateway forwards to this model (default: the template's, else
    /// all: chat, completions, embeddings, audio.speech, audio.transcriptions,
    /// audio.translations, images, responses, rerank, moderations). Nothing else a worker
    /// serves (management routes) is reachable through the gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routes: Option<Vec<Route>>,
    /// Whether the server's streams end with a usage chunk when asked
    /// (`stream_options.include_usage`; default: the template's, else true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_usage: Option<bool>,
    /// Path or Hugging Face id of the weights, filled into `{model_path}`.
    #[serde(default)]
    pub model_path: Option<String>,
    /// MLflow registered model whose `@production` alias decides the version.
    #[serde(default)]
    pub mlflow_model: Option<String>,
    /// Evaluation metric that must pass before `gpuhub models promote` moves the alias.
    #[serde(default)]
    pub eval_metric: Option<String>,
    /// Threshold for `eval_metric` (higher is better unless `eval_lower_is_better`).
    #[serde(default)]
    pub eval_threshold: Option<f64>,
    #[serde(default)]
    pub eval_lower_is_better: bool,
    #[serde(default)]
    pub resources: ResourceRequest,
    /// Unload after this many seconds without a request.
    #[serde(default = "default_idle_timeout")]
    pub idle_timeout_s: u64,
    /// Requests forwarded at once.
    #[serde(default = "default_concurrency")]
    pub max_concurrency: u32,
    /// Requests waiting beyond `max_concurrency` (or for a load); over it: 429.
    #[serde(default = "default_queue")]
    pub queue_len: u32,
    /// Replicas kept once started (0: the model unloads when idle). See models/replicas.rs.
    #[serde(default)]
    pub min_replicas: u32,
    /// Replicas (workers) at most; above 1 the model scales up under load (`launcher = "slurm"`).
    #[serde(default = "default_max_replicas")]
    pub max_replicas: u32,
    /// In-flight calls per ready replica above which the model scales up.
    #[serde(default = "default_target_in_flight")]
    pub target_in_flight: u32,
    /// Seconds `target_in_flight` must stay exceeded before another replica starts.
    #[serde(default = "default_scale_up_after")]
    pub scale_up_after_s: u64,
    /// Seconds between health probes of each ready replica.
    #[serde(default = "default_probe_interval")]
    pub probe_interval_s: u64,
    /// Failed probes in a row after which a replica is `unhealthy` (no calls until one passes).
    #[serde(default = "default_unhealthy_after")]
    pub unhealthy_after: u32,
    /// Health endpoint polled (with the worker's key) while loading (default: the template's,
    /// else `/health`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_path: Option<String>,
    /// Give up loading after this many seconds (the state becomes `failed`).
    #[serde(default = "default_load_timeout")]
    pub load_timeout_s: u64,
    /// Extra environment for the worker.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory for `local` workers.
    #[serde(default)]
    pub workdir: Option<PathBuf>,
    /// The entry resolved against its template (filled by validation).
    #[serde(skip)]
    pub worker: WorkerSpec,
    /// LoRA adapters this model's worker serves, `"NAME=PATH"` each. Callers name an adapter
    /// like any model; the gateway forwards the call to this model's worker under the
    /// adapter's own name (the `model` field is not rewritten) and the usage row shows both.
    /// `{adapters}` in the command expands to them, one argument each (vLLM:
    /// `--enable-lora --lora-modules {adapters}`). A `static` worker's adapters may be bare
    /// names (the server already knows them).
    #[serde(default)]
    pub adapters: Vec<String>,
    /// The worker's endpoint that counts a prompt's tokens (POST), asked after a stream in
    /// which the worker reported no usage: llama-cpp-python `/extras/tokenize/count`, vLLM
    /// `/tokenize`, llama.cpp's `llama-server` `/tokenize`. Without it such a stream's row
    /// has the counted completion tokens only (`usage_source = counted`).
    #[serde(default)]
    pub tokenize_path: Option<String>,
}

impl ModelConfig {
    /// The adapters' names (`NAME` of each `NAME=PATH`).
    pub fn adapter_names(&self) -> impl Iterator<Item = &str> {
        self.adapters.iter().map(|a| a.split_once('=').map_or(a.as_str(), |(n, _)| n).trim())
    }
}

impl ModelConfig {
    pub const DEFAULT_IDLE_TIMEOUT_S: u64 = 600;
    pub const DEFAULT_CONCURRENCY: u32 = 16;
    pub const DEFAULT_QUEUE: u32 = 64;
    pub const DEFAULT_LOAD_TIMEOUT_S: u64 = 900;
}

fn default_idle_timeout() -> u64 {
    ModelConfig::DEFAULT_IDLE_TIMEOUT_S
}
fn default_concurrency() -> u32 {
    ModelConfig::DEFAULT_CONCURRENCY
}
fn default_queue() -> u32 {
    ModelConfig::DEFAULT_QUEUE
}
fn default_load_timeout() -> u64 {
    ModelConfig::DEFAULT_LOAD_TIMEOUT_S
}
fn default_max_replicas() -> u32 {
    1
}
fn default_target_in_flight() -> u32 {
    4
}
fn default_scale_up_after() -> u64 {
    5
}
fn default_probe_interval() -> u64 {
    5
}
fn default_unhealthy_after() -> u32 {
    3
}

/// Validates one entry made from MLflow registry tags (models/registry.rs) as a `[[models]]`
/// entry would be, on its own: names it shares with the catalog are checked by the caller.
pub fn validate_registry_entry(m: &mut ModelConfig, user_templates: &BTreeMap<String, TemplateConfig>) -> Result<(), (String, String)> {
    let mut one = [m.clone()];
    validate(&mut one, user_templates, &BTreeMap::new(), &NamesConfig::default(), false)?;
    let [done] = one;
    *m = done;
    Ok(())
}

/// Characters allowed in model names (Hugging Face ids included): letters, digits, `.`, `_`,
/// `-`, `/`, `:`, at most 128.
pub fn valid_model_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 {
        return Err(format!("model name `{}` must be 1 to 128 characters", name.escape_debug()));
    }
    if let Some(c) = name.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-/:".contains(*c))) {
        return Err(format!("model name `{}` contains `{}`; use letters, digits and . _ - / :", name.escape_debug(), c.escape_debug()));
    }
    Ok(())
}

pub(super) fn validate(
    models: &mut [ModelConfig],
    user_templates: &BTreeMap<String, TemplateConfig>,
    roles: &BTreeMap<String, String>,
    names: &NamesConfig,
    registry: bool,
) -> Result<(), (String, String)> {
    templates::validate_templates(user_templates)?;
    let mut seen = BTreeSet::new();
    for (i, m) in models.iter_mut().enumerate() {
        let key = format!("models[{i}]");
        valid_model_name(&m.name).map_err(|e| (format!("{key}.name"), e))?;
        for n in std::iter::once(&m.name).chain(&m.aliases) {
            valid_model_name(n).map_err(|e| (format!("{key}.aliases"), e))?;
            if !seen.insert(n.clone()) {
                return Err((format!("{key}.name"), format!("`{n}` is used by two catalog entries; each name may appear once")));
            }
        }
        for (j, a) in m.adapters.iter().enumerate() {
            let akey = format!("{key}.adapters[{j}]");
            let (name, path) = match a.split_once('=') {
                Some((n, p)) => (n.trim(), Some(p.trim())),
                None => (a.trim(), None),
            };
            valid_model_name(name).map_err(|e| (akey.clone(), format!("{e} (adapters are \"NAME=PATH\")")))?;
            if !seen.insert(name.to_string()) {
                return Err((akey, format!("`{name}` is used by two catalog entries; each name may appear once")));
            }
            if m.launcher != LauncherKind::Static && path.is_none_or(str::is_empty) {
                return Err((
                    akey,
                    format!("adapter `{name}` of `{}` needs its weights: \"{name}=PATH\" (the worker loads it from PATH)", m.name),
                ));
            }
        }
        if let Some(p) = &m.tokenize_path
            && !p.starts_with('/')
        {
            return Err((format!("{key}.tokenize_path"), format!("`{p}` must start with / (e.g. \"/extras/tokenize/count\")")));
        }
        match m.launcher {
            LauncherKind::Static => {
                let url = m.url.as_deref().unwrap_or("");
                if url.starts_with("https://") {
                    return Err((
                        format!("{key}.url"),
                        format!(
                            "the gateway speaks plain HTTP to its workers; give model `{}` an http:// URL (for a remote TLS endpoint, put a local proxy in front of it)",
                            m.name
                        ),
                    ));
                }
                if crate::gateway::upstream::Target::parse(url).is_err() {
                    return Err((
                        format!("{key}.url"),
                        format!("launcher = \"static\" needs url = \"http://HOST:PORT\" (model `{}`)", m.name),
                    ));
                }
            }
            LauncherKind::Local | LauncherKind::Slurm => {
                if m.command.as_deref().unwrap_or("").trim().is_empty() && m.template.is_none() {
                    return Err((
                        format!("{key}.command"),
                        format!(
                            "launcher = \"{}\" needs a command or a template (model `{}`), e.g. template = \"vllm\"",
                            format!("{:?}", m.launcher).to_lowercase(),
                            m.name
                        ),
                    ));
                }
            }
        }
        m.worker = templates::resolve(i, m, user_templates)?;
        if matches!(m.launcher, LauncherKind::Local | LauncherKind::Slurm) && !m.worker.command.contains("{port}") {
            return Err((
                format!("{key}.command"),
                format!("the command of `{}` must contain {{port}} so the worker listens where the gateway expects", m.name),
            ));
        }
        if !m.adapters.is_empty() && m.launcher != LauncherKind::Static && !m.worker.command.contains("{adapters}") {
            return Err((
                format!("{key}.command"),
                format!(
                    "`{}` has adapters but its command has no {{adapters}}; the worker would not load them (vLLM: --enable-lora --lora-modules {{adapters}})",
                    m.name
                ),
            ));
        }
        if m.resources.gpus > 0 && m.resources.shards > 0 {
            return Err((
                format!("{key}.resources"),
                "ask for gpus or shards, not both (Slurm allocates a GPU as one or the other)".into(),
            ));
        }
        if m.max_concurrency == 0 {
            return Err((format!("{key}.max_concurrency"), "must be at least 1".into()));
        }
        if m.max_replicas == 0 {
            return Err((format!("{key}.max_replicas"), "must be at least 1 (min_replicas = 0 lets the model unload when idle)".into()));
        }
        if m.min_replicas > m.max_replicas {
            return Err((
                format!("{key}.min_replicas"),
                format!("{} is more than max_replicas ({}); lower min_replicas or raise max_replicas", m.min_replicas, m.max_replicas),
            ));
        }
        if m.max_replicas > 1 && m.launcher != LauncherKind::Slurm {
            return Err((
                format!("{key}.max_replicas"),
                format!(
                    "`{}` has max_replicas = {} but replicas run as Slurm jobs (spread over the nodes); set launcher = \"slurm\" or max_replicas = 1",
                    m.name, m.max_replicas
                ),
            ));
        }
        for (k, v) in [
            ("target_in_flight", u64::from(m.target_in_flight)),
            ("probe_interval_s", m.probe_interval_s),
            ("unhealthy_after", u64::from(m.unhealthy_after)),
        ] {
            if v == 0 {
                return Err((format!("{key}.{k}"), "must be at least 1".into()));
            }
        }
        if !m.worker.health_path.starts_with('/') {
            return Err((format!("{key}.health_path"), format!("`{}` must start with /", m.worker.health_path)));
        }
        for k in m.env.keys() {
            if !templates::valid_env_name(k) {
                return Err((format!("{key}.env"), format!("`{k}` is not an environment variable name (letters, digits, _)")));
            }
        }
        if let Some(role) = &m.role
            && gpuhub_wire::snapshot::role_env_var(role).is_none()
        {
            return Err((format!("{key}.role"), format!("role `{role}` must be letters, digits, - or _, starting with a letter")));
        }
    }
    for (role, model) in roles {
        if gpuhub_wire::snapshot::role_env_var(role).is_none() {
            return Err((format!("roles.{role}"), "role names must be letters, digits, - or _, starting with a letter".into()));
        }
        if model.is_empty() || seen.contains(model) {
            continue;
        }
        if !registry {
            return Err((
                format!("roles.{role}"),
                format!(
                    "`{model}` is not a model in the catalog; add a [[models]] entry or set \"\" for no model (a model served from the MLflow registry can be named with [mlflow] tracking_uri and registry_poll_s set)"
                ),
            ));
        }
        // With [mlflow], the registry's tagged models are served too, and they are known only
        // once it is read: a name that no poll serves is reported then (log, `gpuhub doctor`),
        // and calls to the role are answered 503 naming it.
        valid_model_name(model).map_err(|e| (format!("roles.{role}"), e))?;
    }
    for (i, h) in names.history.iter().enumerate() {
        if seen.contains(&h.name) {
            return Err((
                format!("names.history[{i}].name"),
                format!("`{}` is also a current catalog name; a renamed name cannot be served twice", h.name),
            ));
        }
        if let Some(r) = &h.replacement
            && !seen.contains(r)
        {
            return Err((format!("names.history[{i}].replacement"), format!("`{r}` is not a model in the catalog")));
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::Config;

    #[test]
    fn roles_name_catalog_models_or_with_a_polled_registry_any_valid_name() {
        let e = Config::from_toml("[roles]\nchat = \"smol-chat\"\n").unwrap_err().to_string();
        assert!(
            e.contains("roles.chat") && e.contains("`smol-chat` is not a model in the catalog") && e.contains("[mlflow] tracking_uri"),
            "{e}"
        );
        let mlflow = "[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\n";
        let ok = Config::from_toml(&format!("{mlflow}[roles]\nchat = \"smol-chat\"\n")).unwrap();
        assert_eq!(ok.file.roles.get("chat").map(String::as_str), Some("smol-chat"));
        // Without polling, the registry serves nothing: the name must be in the catalog.
        let e = Config::from_toml(&format!("{mlflow}registry_poll_s = 0\n[roles]\nchat = \"smol-chat\"\n")).unwrap_err().to_string();
        assert!(e.contains("`smol-chat` is not a model in the catalog"), "{e}");
        let e = Config::from_toml(&format!("{mlflow}[roles]\nchat = \"bad name\"\n")).unwrap_err().to_string();
        assert!(e.contains("roles.chat"), "{e}");
    }

    #[test]
    fn workers_and_worker_models_are_checked_with_key_paths() {
        let e = Config::from_toml("[workers]\nvram_gib = -1").unwrap_err().to_string();
        assert!(e.contains("workers.vram_gib") && e.contains("positive"), "{e}");
        let e = Config::from_toml("[workers]\nvram_gb = 1").unwrap_err().to_string();
        assert!(e.contains("unknown field `vram_gb`"), "{e}");
        let ok = Config::from_toml(
            "[workers]\nvram_gib = 80\n[[models]]\nname = \"m\"\nlauncher = \"slurm\"\ncommand = \"srv --port {port} --key-file {api_key_file}\"\n",
        )
        .unwrap();
        assert_eq!(ok.file.workers.vram_gib, Some(80.0));
        assert_eq!(ok.file.workers.host, "127.0.0.1", "workers listen on loopback by default");
        assert_eq!(ok.file.workers.user, "gpuhub-worker", "workers run as the RPM's unprivileged account by default");
        for root in ["root", "0", ""] {
            let e = Config::from_toml(&format!("[workers]\nuser = \"{root}\"")).unwrap_err().to_string();
            assert!(e.contains("workers.user") && e.contains("never root"), "{e}");
        }
        let e = Config::from_toml("[[models]]\nname = \"m\"\nlauncher = \"local\"\ncommand = \"srv {api_key_file}\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("models[0].command") && e.contains("{port}"), "{e}");
    }

    #[test]
    fn replicas_are_checked_with_key_paths() {
        let entry = |launcher: &str, extra: &str| {
            format!(
                "[[models]]\nname = \"m\"\nlauncher = \"{launcher}\"\ncommand = \"srv --port {{port}} --key-file {{api_key_file}}\"\n{extra}"
            )
        };
        let ok = Config::from_toml(&entry("slurm", "")).unwrap();
        let m = &ok.file.models[0];
        assert_eq!((m.min_replicas, m.max_replicas), (0, 1), "one worker, unloaded when idle, as before replicas");
        let ok =
            Config::from_toml(&entry("slurm", "min_replicas = 1\nmax_replicas = 2\ntarget_in_flight = 2\nscale_up_after_s = 1\n")).unwrap();
        assert_eq!((ok.file.models[0].min_replicas, ok.file.models[0].max_replicas), (1, 2));
        let e = Config::from_toml(&entry("slurm", "min_replicas = 3\nmax_replicas = 2\n")).unwrap_err().to_string();
        assert!(e.contains("models[0].min_replicas") && e.contains("more than max_replicas"), "{e}");
        let e = Config::from_toml(&entry("slurm", "max_replicas = 0\n")).unwrap_err().to_string();
        assert!(e.contains("models[0].max_replicas") && e.contains("at least 1"), "{e}");
        let e = Config::from_toml(&entry("local", "max_replicas = 2\n")).unwrap_err().to_string();
        assert!(e.contains("models[0].max_replicas") && e.contains("launcher = \"slurm\""), "{e}");
        let e = Config::from_toml(&entry("slurm", "probe_interval_s = 0\n")).unwrap_err().to_string();
        assert!(e.contains("models[0].probe_interval_s"), "{e}");
        let e = Config::from_toml(&entry("slurm", "max_replica = 2\n")).unwrap_err().to_string();
        assert!(e.contains("unknown field `max_replica`") && e.contains("line"), "{e}");
    }

    #[test]
    fn adapters_are_names_with_weights_that_the_command_loads() {
        let entry = |adapters: &str, cmd: &str| {
            format!(
                "[[models]]\nname = \"base\"\nlauncher = \"slurm\"\ncommand = \"{cmd}\"\napi_key_env = \"VLLM_API_KEY\"\nadapters = {adapters}\n"
            )
        };
        // The documented form: the vllm template, {adapters} in `args`.
        let t = Config::from_toml(
            "[[models]]\nname = \"base\"\nlauncher = \"slurm\"\ntemplate = \"vllm\"\nmodel_path = \"/m\"\nargs = \"--enable-lora --lora-modules {adapters}\"\nadapters = [\"sql-lora=/w/sql\"]\n",
        )
        .unwrap();
        assert!(t.file.models[0].worker.command.ends_with("--lora-modules {adapters}"), "{}", t.file.models[0].worker.command);
        let ok = Config::from_toml(&entry(r#"["sql-lora=/w/sql", "chat-lora = /w/chat"]"#, "vllm --port {port} --lora-modules {adapters}"))
            .unwrap();
        assert_eq!(ok.file.models[0].adapter_names().collect::<Vec<_>>(), ["sql-lora", "chat-lora"]);
        let e = Config::from_toml(&entry(r#"["sql-lora=/w/sql"]"#, "vllm --port {port}")).unwrap_err().to_string();
        assert!(e.contains("models[0].command") && e.contains("{adapters}"), "{e}");
        let e = Config::from_toml(&entry(r#"["sql-lora"]"#, "vllm --port {port} {adapters}")).unwrap_err().to_string();
        assert!(e.contains("models[0].adapters[0]") && e.contains("sql-lora=PATH"), "{e}");
        let e = Config::from_toml(&entry(r#"["base=/w"]"#, "vllm --port {port} {adapters}")).unwrap_err().to_string();
        assert!(e.contains("models[0].adapters[0]") && e.contains("two catalog entries"), "{e}");
        let e = Config::from_toml(&entry(r#"["bad name=/w"]"#, "vllm --port {port} {adapters}")).unwrap_err().to_string();
        assert!(e.contains("models[0].adapters[0]") && e.contains("NAME=PATH"), "{e}");
        let e = Config::from_toml(
            "[[models]]\nname = \"m\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:1\"\ntokenize_path = \"tokenize\"\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("models[0].tokenize_path"), "{e}");
        // A static worker's adapters are names the server already serves.
        Config::from_toml("[[models]]\nname = \"m\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:1\"\nadapters = [\"m-lora\"]\n")
            .unwrap();
    }
}
