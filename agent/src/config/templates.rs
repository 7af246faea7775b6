//! Worker templates: how one kind of inference server is started (`template = "vllm"` in a
//! catalog entry), and the resolution of a catalog entry into the [`WorkerSpec`] the launchers
//! run.
//!
//! A template knows the server's command line (with `--served-model-name {model}` or its
//! equivalent, so the served name is the catalog name), its health path, how it takes the
//! worker's key, which OpenAI routes it serves and whether its streams report usage. The
//! shipped templates are [`BUILTIN`]; `[templates.NAME]` in agent.toml defines a new one or
//! overrides fields of a shipped one.
//!
//! The worker's key never goes on a command line, where every user on the node reads it
//! (`ps`, `/proc/PID/cmdline`): a template passes it by environment (`api_key_env`) or by a
//! 0600 file owned by the worker user (`{api_key_file}`). `{api_key}` in a command is refused.
//!
//! Flags were read from each server's own source (docs/models.md lists the versions); those of
//! the servers installable here are checked against the server's own `--help`
//! (tests/system/templates-help.sh, tests/system/models-llama-key.sh).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::{Deserialize, Serialize};

use super::{LauncherKind, ModelConfig};
use crate::models::routes::Route;

/// The shipped templates, as `[templates.NAME]` tables (the same keys a site writes).
/// `tests::builtin_templates_parse_and_take_the_key_outside_argv` checks that it parses.
pub const BUILTIN: &str = r#"
# vLLM (read from vLLM 0.10: vllm/envs.py VLLM_API_KEY, entrypoints/openai/api_server.py):
# VLLM_API_KEY protects /v1/* (the CLI's --api-key takes precedence; /health stays open).
# Not checked against its --help here: without an NVIDIA GPU `vllm serve --help` fails
# ("Failed to infer device type"); docs/models.md has the numbers.
[vllm]
command = "vllm serve {model_path} --served-model-name {model} --host {host} --port {port}"
health_path = "/health"
api_key_env = "VLLM_API_KEY"
routes = ["chat", "completions", "responses", "embeddings", "rerank", "audio.transcriptions", "audio.translations"]
stream_usage = true

# SGLang (read from sglang server_args.py and server_args_config_parser.py; checked by hand
# against 0.5.23's `--help`, too large to install for CI): no environment variable for the key,
# but `--config FILE.yaml` reads any CLI option from a YAML file.
[sglang]
command = "python3 -m sglang.launch_server --model-path {model_path} --served-model-name {model} --host {host} --port {port} --config {api_key_file}"
health_path = "/health"
api_key_file_format = "api-key: \"{api_key}\"\n"
api_key_file_suffix = ".yaml"
routes = ["chat", "completions", "responses", "embeddings", "rerank"]
stream_usage = true

# llama.cpp's C++ server (read from llama.cpp common/arg.cpp; checked against `llama-server
# --help` of build 10434 by tests/system/templates-help.sh): --api-key-file FNAME, one key
# per line; --alias is the served name; the final stream chunk carries usage. GGUF servers
# load one file: {model_file} (model_path itself, or the single weights file of an MLflow
# version's artifacts).
[llama-cpp]
command = "llama-server --model {model_file} --alias {model} --host {host} --port {port} --api-key-file {api_key_file}"
health_path = "/health"
routes = ["chat", "completions", "embeddings", "rerank"]
stream_usage = true

# llama-cpp-python 0.3.36 (llama_cpp/server/settings.py, pydantic settings: every option is also
# an environment variable; checked against `python -m llama_cpp.server --help` by
# tests/system/models-llama-key.sh). With a key every route needs it, /v1/models included, and
# it has no /health. Its streams carry no usage.
[llama-cpp-python]
command = "python3 -m llama_cpp.server --model {model_file} --model_alias {model} --host {host} --port {port}"
health_path = "/v1/models"
api_key_env = "API_KEY"
routes = ["chat", "completions", "embeddings"]
stream_usage = false

# Hugging Face TGI 3.3 (launcher/src/main.rs, router/src/server.rs): the launcher reads API_KEY
# and passes it to its router as `--api-key KEY` on the command line, so only the router gets
# the key, through a shim on PATH; the launcher never sees it. TGI answers under any model name.
[tgi]
command = "text-generation-launcher --model-id {model_path} --hostname {host} --port {port}"
health_path = "/health"
api_key_env = "API_KEY"
api_key_env_for = "text-generation-router"
routes = ["chat", "completions"]
stream_usage = true

# infinity-emb 0.0.78 (infinity_server.py; checked against `infinity_emb v2 --help` by
# tests/system/templates-help.sh): --api-key reads INFINITY_API_KEY; routes are served under
# --url-prefix; /health stays at the root.
[infinity]
command = "infinity_emb v2 --model-id {model_path} --served-model-name {model} --host {host} --port {port} --url-prefix /v1"
health_path = "/health"
api_key_env = "INFINITY_API_KEY"
routes = ["embeddings", "rerank"]
stream_usage = false

# speaches (faster-whisper; src/speaches/config.py, routers/): API_KEY protects every route but
# /health. It has no served-name flag: the catalog name is the model id it loads
# (e.g. "Systran/faster-distil-whisper-small.en"); aliases and roles give friendly names.
[whisper]
command = "uvicorn --factory speaches.main:create_app --host {host} --port {port}"
health_path = "/health"
api_key_env = "API_KEY"
routes = ["audio.transcriptions", "audio.translations"]
stream_usage = false
env = { ENABLE_UI = "false" }

# An OpenAI-compatible speech server: speaches' /v1/audio/speech (Kokoro, Piper voices); the
# catalog name is the voice model's id, as for whisper.
[tts]
command = "uvicorn --factory speaches.main:create_app --host {host} --port {port}"
health_path = "/health"
api_key_env = "API_KEY"
routes = ["audio.speech"]
stream_usage = false
env = { ENABLE_UI = "false" }
"#;

/// `[templates.NAME]`: a template as written (every field optional when it overrides a
/// shipped template of the same name; `command` required for a new one).
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TemplateConfig {
    /// Command line with placeholders: `{model}` `{model_path}` `{model_file}` `{version}`
    /// `{host}` `{port}` `{api_key_file}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// Polled with the worker's key while it loads (default `/health`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_path: Option<String>,
    /// Environment variable that carries the worker's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Give `api_key_env` only to this program (started by the command), through a shim on
    /// `PATH`: for servers whose launcher would put the key on a child's command line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env_for: Option<String>,
    /// Contents of `{api_key_file}` (default `"{api_key}\n"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file_format: Option<String>,
    /// File name ending of `{api_key_file}` (default `.key`; SGLang needs `.yaml`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_file_suffix: Option<String>,
    /// The OpenAI routes the server answers (default: every route).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routes: Option<Vec<Route>>,
    /// Whether its streams end with a usage chunk when asked (`stream_options.include_usage`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_usage: Option<bool>,
    /// Environment the server needs (the model's `env` wins).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

impl TemplateConfig {
    /// `self` with every field `over` sets replaced.
    fn merged(&self, over: &TemplateConfig) -> TemplateConfig {
        let mut env = self.env.clone();
        env.extend(over.env.clone());
        TemplateConfig {
            command: over.command.clone().or_else(|| self.command.clone()),
            health_path: over.health_path.clone().or_else(|| self.health_path.clone()),
            api_key_env: over.api_key_env.clone().or_else(|| self.api_key_env.clone()),
            api_key_env_for: over.api_key_env_for.clone().or_else(|| self.api_key_env_for.clone()),
            api_key_file_format: over.api_key_file_format.clone().or_else(|| self.api_key_file_format.clone()),
            api_key_file_suffix: over.api_key_file_suffix.clone().or_else(|| self.api_key_file_suffix.clone()),
            routes: over.routes.clone().or_else(|| self.routes.clone()),
            stream_usage: over.stream_usage.or(self.stream_usage),
            env,
        }
    }
}

/// The shipped templates by name.
pub fn builtin() -> &'static BTreeMap<String, TemplateConfig> {
    static B: OnceLock<BTreeMap<String, TemplateConfig>> = OnceLock::new();
    // A unit test parses BUILTIN; an empty table here would only mean that test failed.
    B.get_or_init(|| toml::from_str(BUILTIN).unwrap_or_default())
}

/// How the worker gets its key. The key file always exists while the worker runs (the Slurm
/// job reads the environment variable's value from it); `{api_key_file}` names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyDelivery {
    /// Environment variable holding the key.
    pub env: Option<String>,
    /// Only this program gets `env` (through a shim on `PATH`).
    pub env_for: Option<String>,
    /// Contents of the key file; `{api_key}` is the key.
    pub file_format: String,
    /// Ending of the key file's name.
    pub file_suffix: String,
}

impl Default for KeyDelivery {
    fn default() -> Self {
        KeyDelivery { env: None, env_for: None, file_format: "{api_key}\n".into(), file_suffix: ".key".into() }
    }
}

impl KeyDelivery {
    /// How check-config and docs describe it (never the key).
    pub fn describe(&self, uses_file: bool) -> String {
        let mut parts = Vec::new();
        match (&self.env, &self.env_for) {
            (Some(v), Some(p)) => parts.push(format!("environment {v} (only for `{p}`, through a shim on PATH)")),
            (Some(v), None) => parts.push(format!("environment {v}")),
            _ => {}
        }
        if uses_file {
            parts.push(format!("0600 file {{api_key_file}} (<workers.dir>/keys/<model>.<id>{})", self.file_suffix));
        }
        parts.join(" and ")
    }
}

/// A catalog entry resolved against its template: what the launchers run.
#[derive(Debug, Clone, Default)]
pub struct WorkerSpec {
    /// The template used, if any.
    pub template: Option<String>,
    /// Command template (placeholders not filled yet), `args` appended.
    pub command: String,
    pub health_path: String,
    pub key: KeyDelivery,
    pub routes: Vec<Route>,
    pub stream_usage: bool,
    /// The template's environment with the model's on top.
    pub env: BTreeMap<String, String>,
}

impl WorkerSpec {
    /// Whether the command takes the key file (`{api_key_file}`).
    pub fn uses_key_file(&self) -> bool {
        self.command.contains("{api_key_file}")
    }
}

/// Environment variable names a shell and `export` accept.
pub fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Checks the user's `[templates.NAME]` tables on their own.
pub fn validate_templates(templates: &BTreeMap<String, TemplateConfig>) -> Result<(), (String, String)> {
    for (name, t) in templates {
        let key = format!("templates.{name}");
        if !name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) || name.is_empty() {
            return Err((key, "template names are letters, digits, - _ .".into()));
        }
        let merged = builtin().get(name).map(|b| b.merged(t)).unwrap_or_else(|| t.clone());
        if merged.command.as_deref().is_none_or(|c| c.trim().is_empty()) {
            return Err((
                format!("{key}.command"),
                format!("template `{name}` needs a command (it is not one of the shipped templates: {})", builtin_names()),
            ));
        }
        check_template(&merged, &key)?;
    }
    Ok(())
}

fn builtin_names() -> String {
    builtin().keys().cloned().collect::<Vec<_>>().join(", ")
}

fn check_template(t: &TemplateConfig, key: &str) -> Result<(), (String, String)> {
    if let Some(c) = &t.command {
        check_command(c, &format!("{key}.command"))?;
    }
    if let Some(p) = &t.health_path
        && !p.starts_with('/')
    {
        return Err((format!("{key}.health_path"), format!("`{p}` must start with /")));
    }
    if let Some(v) = &t.api_key_env
        && !valid_env_name(v)
    {
        return Err((format!("{key}.api_key_env"), format!("`{v}` is not an environment variable name (letters, digits, _)")));
    }
    if let Some(p) = &t.api_key_env_for {
        if t.api_key_env.is_none() {
            return Err((format!("{key}.api_key_env_for"), "needs api_key_env (the variable that program reads)".into()));
        }
        if p.is_empty() || p.contains('/') || !p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.+".contains(c)) {
            return Err((format!("{key}.api_key_env_for"), format!("`{p}` must be a program name found on PATH, without /")));
        }
    }
    if let Some(f) = &t.api_key_file_format
        && !f.contains("{api_key}")
    {
        return Err((format!("{key}.api_key_file_format"), "must contain {api_key}, where the key goes".into()));
    }
    if let Some(s) = &t.api_key_file_suffix
        && (s.contains('/') || !s.starts_with('.'))
    {
        return Err((format!("{key}.api_key_file_suffix"), format!("`{s}` must be a file name ending such as .key or .yaml")));
    }
    if let Some(r) = &t.routes
        && r.is_empty()
    {
        return Err((format!("{key}.routes"), format!("name at least one route: {}", Route::all_names())));
    }
    for k in t.env.keys() {
        if !valid_env_name(k) {
            return Err((format!("{key}.env"), format!("`{k}` is not an environment variable name")));
        }
    }
    Ok(())
}

/// A command never carries the key itself.
pub fn check_command(command: &str, key: &str) -> Result<(), (String, String)> {
    if command.contains("{api_key}") {
        return Err((
            key.to_string(),
            "`{api_key}` puts the worker's key on its command line, where every user on the node can read it (ps, /proc/PID/cmdline); pass it by file (e.g. `--api-key-file {api_key_file}`) or by environment (api_key_env = \"VAR\", e.g. VLLM_API_KEY)".into(),
        ));
    }
    Ok(())
}

/// Resolves model `i` against its template (user tables over the shipped ones).
pub fn resolve(i: usize, m: &ModelConfig, user: &BTreeMap<String, TemplateConfig>) -> Result<WorkerSpec, (String, String)> {
    let key = format!("models[{i}]");
    let template = match &m.template {
        None => None,
        Some(name) => {
            if m.launcher == LauncherKind::Static {
                return Err((
                    format!("{key}.template"),
                    format!(
                        "model `{}` is launcher = \"static\": gpuhub does not start it, so a template has nothing to do; remove it",
                        m.name
                    ),
                ));
            }
            let t = match (builtin().get(name), user.get(name)) {
                (Some(b), Some(u)) => b.merged(u),
                (Some(b), None) => b.clone(),
                (None, Some(u)) => u.clone(),
                (None, None) => {
                    let mut all: Vec<String> = builtin().keys().chain(user.keys()).cloned().collect();
                    all.sort();
                    all.dedup();
                    return Err((
                        format!("{key}.template"),
                        format!("`{name}` is not a template; use one of {} or define [templates.{name}]", all.join(", ")),
                    ));
                }
            };
            Some((name.clone(), t))
        }
    };
    let t = template.as_ref().map(|(_, t)| t.clone()).unwrap_or_default();
    if let Some(v) = &m.api_key_env
        && !valid_env_name(v)
    {
        return Err((format!("{key}.api_key_env"), format!("`{v}` is not an environment variable name (letters, digits, _)")));
    }
    let mut command = m.command.clone().or_else(|| t.command.clone()).unwrap_or_default();
    if let Some(args) = m.args.as_deref().filter(|a| !a.trim().is_empty()) {
        check_command(args, &format!("{key}.args"))?;
        command = format!("{} {}", command.trim_end(), args.trim());
    }
    check_command(&command, &format!("{key}.command"))?;
    let routes = m.routes.clone().or_else(|| t.routes.clone()).unwrap_or_else(|| Route::ALL.to_vec());
    if routes.is_empty() {
        return Err((format!("{key}.routes"), format!("name at least one route: {}", Route::all_names())));
    }
    let mut env = t.env.clone();
    env.extend(m.env.clone());
    let (env_var, env_for) = match &m.api_key_env {
        Some(v) => (Some(v.clone()), None),
        None => (t.api_key_env.clone(), t.api_key_env_for.clone()),
    };
    let defaults = KeyDelivery::default();
    let spec = WorkerSpec {
        template: template.as_ref().map(|(n, _)| n.clone()),
        health_path: m.health_path.clone().or_else(|| t.health_path.clone()).unwrap_or_else(|| "/health".into()),
        key: KeyDelivery {
            env: env_var,
            env_for,
            file_format: t.api_key_file_format.clone().unwrap_or(defaults.file_format),
            file_suffix: t.api_key_file_suffix.clone().unwrap_or(defaults.file_suffix),
        },
        routes,
        stream_usage: m.stream_usage.or(t.stream_usage).unwrap_or(true),
        env,
        command,
    };
    if matches!(m.launcher, LauncherKind::Local | LauncherKind::Slurm) && spec.key.env.is_none() && !spec.uses_key_file() {
        return Err((
            format!("{key}.command"),
            format!(
                "the worker of `{}` gets no key, so any user on the node could call it around the gateway; pass it by file (`{{api_key_file}}` in the command, e.g. `--api-key-file {{api_key_file}}`) or set api_key_env = \"VAR\" (the variable the server reads, e.g. VLLM_API_KEY)",
                m.name
            ),
        ));
    }
    // With `mlflow_model` and no model_path, {model_path} is the directory the `@production`
    // version's artifacts are downloaded to (models/artifacts.rs).
    let weights_in = |p: &str| spec.command.contains(p) && m.model_path.as_deref().is_none_or(str::is_empty) && m.mlflow_model.is_none();
    if spec.template.is_some() && (weights_in("{model_path}") || weights_in("{model_file}")) {
        return Err((
            format!("{key}.model_path"),
            format!(
                "template `{}` starts the server on {{model_path}}; set model_path (a path or Hugging Face id) for `{}`",
                spec.template.as_deref().unwrap_or(""),
                m.name
            ),
        ));
    }
    Ok(spec)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn model(extra: &str) -> String {
        format!("[[models]]\nname = \"m\"\nlauncher = \"slurm\"\nmodel_path = \"/models/m\"\n{extra}\n")
    }

    #[test]
    fn builtin_templates_parse_and_take_the_key_outside_argv() {
        let parsed: BTreeMap<String, TemplateConfig> = toml::from_str(BUILTIN).unwrap();
        let names: Vec<&str> = parsed.keys().map(String::as_str).collect();
        assert_eq!(names, ["infinity", "llama-cpp", "llama-cpp-python", "sglang", "tgi", "tts", "vllm", "whisper"]);
        assert_eq!(builtin().len(), parsed.len());
        for (name, t) in &parsed {
            let c = t.command.as_deref().unwrap();
            assert!(!c.contains("{api_key}"), "{name}: the key is on the command line");
            assert!(c.contains("{port}") && c.contains("{host}"), "{name}: {c}");
            assert!(t.api_key_env.is_some() || c.contains("{api_key_file}"), "{name} takes no key");
            assert!(t.health_path.as_deref().is_some_and(|p| p.starts_with('/')), "{name}");
            assert!(t.routes.as_ref().is_some_and(|r| !r.is_empty()), "{name}");
            assert!(t.stream_usage.is_some(), "{name} must say whether its streams report usage");
            check_template(t, name).unwrap();
            let cfg = Config::from_toml(&model(&format!("template = \"{name}\""))).unwrap();
            let w = &cfg.file.models[0].worker;
            assert_eq!(w.template.as_deref(), Some(name.as_str()));
        }
    }

    #[test]
    fn a_template_fills_command_health_key_routes_and_stream_usage() {
        let cfg = Config::from_toml(&model("template = \"vllm\"\nargs = \"--max-model-len 8192\"")).unwrap();
        let w = &cfg.file.models[0].worker;
        assert_eq!(w.command, "vllm serve {model_path} --served-model-name {model} --host {host} --port {port} --max-model-len 8192");
        assert_eq!(w.key.env.as_deref(), Some("VLLM_API_KEY"));
        assert_eq!(w.health_path, "/health");
        assert!(w.stream_usage);
        assert!(w.routes.contains(&Route::Chat) && !w.routes.contains(&Route::AudioSpeech));

        let cfg = Config::from_toml(&model("template = \"llama-cpp-python\"\nroutes = [\"chat\"]\nhealth_path = \"/v1/models\"")).unwrap();
        let w = &cfg.file.models[0].worker;
        assert_eq!((w.routes.clone(), w.stream_usage, w.key.env.as_deref()), (vec![Route::Chat], false, Some("API_KEY")));

        let cfg = Config::from_toml(&model("template = \"sglang\"")).unwrap();
        let w = &cfg.file.models[0].worker;
        assert!(w.uses_key_file() && w.key.env.is_none());
        assert_eq!((w.key.file_format.as_str(), w.key.file_suffix.as_str()), ("api-key: \"{api_key}\"\n", ".yaml"));
    }

    #[test]
    fn a_site_overrides_a_shipped_template_or_defines_its_own() {
        let cfg = Config::from_toml(&format!(
            "[templates.vllm]\ncommand = \"/opt/vllm/bin/vllm serve {{model_path}} --served-model-name {{model}} --host {{host}} --port {{port}}\"\n\
             [templates.mine]\ncommand = \"srv --port {{port}} --host {{host}} --key-file {{api_key_file}}\"\nroutes = [\"embeddings\"]\n{}{}",
            model("template = \"vllm\""),
            model("template = \"mine\"").replace("name = \"m\"", "name = \"n\"")
        ))
        .unwrap();
        let (a, b) = (&cfg.file.models[0].worker, &cfg.file.models[1].worker);
        assert!(a.command.starts_with("/opt/vllm/bin/vllm serve"), "{}", a.command);
        assert_eq!(a.key.env.as_deref(), Some("VLLM_API_KEY"), "fields not overridden stay the shipped ones");
        assert_eq!((b.routes.clone(), b.stream_usage, b.uses_key_file()), (vec![Route::Embeddings], true, true));
    }

    #[test]
    fn the_key_on_a_command_line_is_refused_with_the_fix() {
        for bad in ["command = \"srv --port {port} --api-key {api_key}\"", "template = \"vllm\"\nargs = \"--api-key {api_key}\""] {
            let e = Config::from_toml(&model(bad)).unwrap_err().to_string();
            assert!(e.contains("{api_key}") && e.contains("{api_key_file}") && e.contains("api_key_env"), "{e}");
        }
        let e = Config::from_toml("[templates.x]\ncommand = \"srv --port {port} --api-key {api_key}\"\n").unwrap_err().to_string();
        assert!(e.contains("templates.x.command") && e.contains("command line"), "{e}");
        let e = Config::from_toml(&model("command = \"srv --port {port}\"")).unwrap_err().to_string();
        assert!(e.contains("gets no key") && e.contains("api_key_env"), "{e}");
        let ok = Config::from_toml(&model("command = \"srv --port {port}\"\napi_key_env = \"SRV_KEY\"")).unwrap();
        assert_eq!(ok.file.models[0].worker.key.env.as_deref(), Some("SRV_KEY"));
    }

    #[test]
    fn template_mistakes_name_the_key_and_the_choices() {
        let e = Config::from_toml(&model("template = \"vlm\"")).unwrap_err().to_string();
        assert!(e.contains("models[0].template") && e.contains("vllm") && e.contains("[templates.vlm]"), "{e}");
        let e = Config::from_toml(&model("template = \"vllm\"\nroutes = [\"chta\"]")).unwrap_err().to_string();
        assert!(e.contains("chta") && e.contains("chat"), "{e}");
        let e = Config::from_toml("[templates.new]\nhealth_path = \"/h\"\n").unwrap_err().to_string();
        assert!(e.contains("templates.new.command"), "{e}");
        let e = Config::from_toml("[templates.x]\ncommand = \"s {port}\"\napi_key_env_for = \"r\"\n").unwrap_err().to_string();
        assert!(e.contains("needs api_key_env"), "{e}");
        let e = Config::from_toml(&model("template = \"vllm\"").replace("model_path = \"/models/m\"\n", "")).unwrap_err().to_string();
        assert!(e.contains("models[0].model_path"), "{e}");
        let e = Config::from_toml("[[models]]\nname = \"s\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:1\"\ntemplate = \"vllm\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("static"), "{e}");
    }
}
