//! Catalog entries from MLflow registry tags: a registered model tagged `served_by=gateway`,
//! `gpuhub.template` and `gpuhub.resources` (and optionally `gpuhub.name`) is served without
//! an `agent.toml` entry.
//!
//! The tags are hostile input: MLflow has no login, so anyone on the node can set them. They
//! choose only what an admin already allows: one of the site's templates (shipped, or
//! `[templates.NAME]` in agent.toml, which holds the command line, environment and key
//! delivery), the GPUs or shards to ask Slurm for, and the served name. No tag reaches a
//! command line or an environment. A bad tag refuses that one model, with an error that names
//! the model, the tag and the fix; the other models are served.
//!
//! `[[models]]` entries win: a registered model that a catalog entry names in `mlflow_model`
//! is served by that entry, and a served name the catalog already has is refused.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use super::mlflow::RegisteredModel;
use crate::config::{ConfigFile, ModelConfig, ResourceRequest, templates};

/// `served_by=gateway`: the tag that makes a registered model a gateway model.
pub const SERVED_BY: &str = "served_by";
pub const GATEWAY: &str = "gateway";
/// The worker template (a shipped one or `[templates.NAME]`).
pub const TAG_TEMPLATE: &str = "gpuhub.template";
/// `gpus=N,vram_gib=G` or `shards=N,vram_gib=G`.
pub const TAG_RESOURCES: &str = "gpuhub.resources";
/// The served name (default: the registered model's name).
pub const TAG_NAME: &str = "gpuhub.name";

/// GPUs one registry model may ask for (a node has a few), and shards (a node has a few
/// dozen): larger values are typos that would leave a job pending forever.
const MAX_GPUS: u32 = 16;
const MAX_SHARDS: u32 = 1024;

/// A registered model that cannot be served as tagged.
#[derive(Debug, Clone, PartialEq, Serialize, thiserror::Error)]
#[error("MLflow registered model `{model}`: tag `{tag}`: {problem}; {fix}")]
pub struct TagError {
    /// The registered model's name (control characters escaped).
    pub model: String,
    pub tag: String,
    pub problem: String,
    pub fix: String,
}

impl TagError {
    fn new(model: &str, tag: &str, problem: impl Into<String>, fix: impl Into<String>) -> TagError {
        TagError { model: crate::util::sanitize(model), tag: tag.to_string(), problem: problem.into(), fix: fix.into() }
    }
}

/// What the registry adds to the catalog: the entries it serves, and why the others are not.
#[derive(Debug, Clone, Default)]
pub struct RegistryModels {
    /// Validated entries (`worker` resolved), sorted by name.
    pub entries: Vec<ModelConfig>,
    pub errors: Vec<TagError>,
}

/// Whether a registered model asks to be served by the gateway.
pub fn is_served(tags: &BTreeMap<String, String>) -> bool {
    tags.get(SERVED_BY).is_some_and(|v| v.trim() == GATEWAY)
}

/// Parses `gpuhub.resources`: comma-separated `key=value`, keys `gpus`, `shards`, `vram_gib`.
pub fn parse_resources(model: &str, value: &str) -> Result<ResourceRequest, TagError> {
    let example = "e.g. `gpus=1,vram_gib=20` or `shards=2,vram_gib=4`";
    let bad = |problem: String| {
        TagError::new(model, TAG_RESOURCES, problem, format!("write comma-separated gpus=N or shards=N, and vram_gib=GiB, {example}"))
    };
    let mut r = ResourceRequest::default();
    let mut seen = BTreeSet::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(bad(format!("`{}` is not key=value", part.escape_debug())));
        };
        let (k, v) = (k.trim(), v.trim());
        if !seen.insert(k.to_string()) {
            return Err(bad(format!("`{}` is given twice", k.escape_debug())));
        }
        match k {
            "gpus" | "shards" => {
                let n: u32 = v.parse().map_err(|_| bad(format!("{k} = `{}` is not a whole number", v.escape_debug())))?;
                let max = if k == "gpus" { MAX_GPUS } else { MAX_SHARDS };
                if n > max {
                    return Err(bad(format!("{k} = {n} is more than {max}")));
                }
                if k == "gpus" {
                    r.gpus = n;
                } else {
                    r.shards = n;
                }
            }
            "vram_gib" => {
                let g: f64 = v.parse().map_err(|_| bad(format!("vram_gib = `{}` is not a number", v.escape_debug())))?;
                if !(g.is_finite() && g > 0.0 && g <= 4096.0) {
                    return Err(bad(format!("vram_gib = {v} is not a positive number of GiB")));
                }
                r.vram_gib = g;
            }
            other => return Err(bad(format!("unknown key `{}` (known: gpus, shards, vram_gib)", other.escape_debug()))),
        }
    }
    if r.gpus > 0 && r.shards > 0 {
        return Err(TagError::new(
            model,
            TAG_RESOURCES,
            "asks for gpus and shards",
            "ask for one of them: Slurm allocates a GPU either whole or as shards",
        ));
    }
    if r.gpus == 0 && r.shards == 0 {
        return Err(bad("names neither gpus nor shards".into()));
    }
    if r.vram_gib <= 0.0 {
        return Err(bad("has no vram_gib (placement needs the GPU memory the worker uses)".into()));
    }
    Ok(r)
}

/// The templates a tag may name: the shipped ones and the site's `[templates.NAME]`.
fn template_names(cfg: &ConfigFile) -> Vec<String> {
    let mut all: Vec<String> = templates::builtin().keys().chain(cfg.templates.keys()).cloned().collect();
    all.sort();
    all.dedup();
    all
}

/// The catalog entry a tagged registered model asks for, validated like a `[[models]]` entry.
pub fn entry_from_tags(model: &str, tags: &BTreeMap<String, String>, cfg: &ConfigFile) -> Result<ModelConfig, TagError> {
    let known = template_names(cfg);
    let template = match tags.get(TAG_TEMPLATE).map(|t| t.trim()) {
        None | Some("") => {
            return Err(TagError::new(
                model,
                TAG_TEMPLATE,
                "is missing (the model is tagged served_by=gateway)",
                format!("set it to one of {} (or remove served_by=gateway)", known.join(", ")),
            ));
        }
        Some(t) if !known.iter().any(|k| k == t) => {
            return Err(TagError::new(
                model,
                TAG_TEMPLATE,
                format!("`{}` is not a template here", t.escape_debug()),
                format!("use one of {}, or define [templates.{}] in agent.toml", known.join(", "), t.escape_debug()),
            ));
        }
        Some(t) => t.to_string(),
    };
    let resources = match tags.get(TAG_RESOURCES) {
        Some(v) => parse_resources(model, v)?,
        None => {
            return Err(TagError::new(
                model,
                TAG_RESOURCES,
                "is missing",
                "set it to what the worker needs, e.g. `gpus=1,vram_gib=20` or `shards=2,vram_gib=4`",
            ));
        }
    };
    let (name, name_tag) = match tags.get(TAG_NAME).map(|n| n.trim()).filter(|n| !n.is_empty()) {
        Some(n) => (n.to_string(), TAG_NAME),
        None => (model.to_string(), "served_by"),
    };
    crate::config::valid_model_name(&name).map_err(|e| {
        let fix = if name_tag == TAG_NAME {
            "pick a served name of letters, digits and . _ - / :"
        } else {
            "set gpuhub.name to the name clients call"
        };
        TagError::new(model, name_tag, e, fix)
    })?;
    let mut m = ModelConfig {
        name,
        role: None,
        aliases: Vec::new(),
        launcher: cfg.mlflow.launcher,
        url: None,
        api_key: None,
        template: Some(template.clone()),
        command: None,
        args: None,
        api_key_env: None,
        routes: None,
        stream_usage: None,
        model_path: None,
        mlflow_model: Some(model.to_string()),
        // The gate comes from agent.toml (mlflow.gates), never from tags anyone can edit.
        eval_metric: cfg.mlflow.gates.get(model).map(|g| g.metric.clone()),
        eval_threshold: cfg.mlflow.gates.get(model).map(|g| g.threshold),
        eval_lower_is_better: cfg.mlflow.gates.get(model).is_some_and(|g| g.lower_is_better),
        resources,
        idle_timeout_s: ModelConfig::DEFAULT_IDLE_TIMEOUT_S,
        max_concurrency: ModelConfig::DEFAULT_CONCURRENCY,
        queue_len: ModelConfig::DEFAULT_QUEUE,
        min_replicas: 0,
        max_replicas: 1,
        target_in_flight: 4,
        scale_up_after_s: 5,
        probe_interval_s: 5,
        unhealthy_after: 3,
        health_path: None,
        load_timeout_s: ModelConfig::DEFAULT_LOAD_TIMEOUT_S,
        env: BTreeMap::new(),
        workdir: None,
        worker: Default::default(),
        adapters: Vec::new(),
        tokenize_path: None,
    };
    crate::config::validate_registry_entry(&mut m, &cfg.templates).map_err(|(_, problem)| {
        TagError::new(model, TAG_TEMPLATE, problem, format!("fix [templates.{template}] in agent.toml, or pick another template"))
    })?;
    Ok(m)
}

/// The registry's entries for `found` (registered models as discovered), next to the
/// catalog of `cfg`: entries `cfg` already serves are left to it; a served name that `cfg`
/// (a model, alias, adapter or `[[names.history]]` name) or an earlier registered model
/// already uses is refused.
pub fn build(found: &[RegisteredModel], cfg: &ConfigFile) -> RegistryModels {
    let mut taken: BTreeMap<String, String> = BTreeMap::new();
    for m in &cfg.models {
        taken.insert(m.name.clone(), format!("the [[models]] entry `{}` in agent.toml", m.name));
        for a in m.aliases.iter().map(String::as_str).chain(m.adapter_names()) {
            taken.insert(a.to_string(), format!("an alias or adapter of the [[models]] entry `{}`", m.name));
        }
    }
    for h in &cfg.names.history {
        taken.insert(h.name.clone(), "a [[names.history]] name in agent.toml".into());
    }
    let by_config: BTreeSet<&str> = cfg.models.iter().filter_map(|m| m.mlflow_model.as_deref()).collect();
    let mut out = RegistryModels::default();
    let mut found: Vec<&RegisteredModel> = found.iter().filter(|r| is_served(&r.tags)).collect();
    found.sort_by(|a, b| a.name.cmp(&b.name));
    for r in found {
        if by_config.contains(r.name.as_str()) {
            continue; // a [[models]] entry serves it (its mlflow_model)
        }
        match entry_from_tags(&r.name, &r.tags, cfg) {
            Ok(m) => {
                if let Some(owner) = taken.get(&m.name) {
                    let tag = if r.tags.contains_key(TAG_NAME) { TAG_NAME } else { SERVED_BY };
                    out.errors.push(TagError::new(
                        &r.name,
                        tag,
                        format!("the served name `{}` is already {owner}", m.name),
                        "set gpuhub.name to a name nothing else serves",
                    ));
                    continue;
                }
                taken.insert(m.name.clone(), format!("served for the registered model `{}`", crate::util::sanitize(&r.name)));
                out.entries.push(m);
            }
            Err(e) => out.errors.push(e),
        }
    }
    out.entries.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::{Config, LauncherKind};

    fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn reg(name: &str, pairs: &[(&str, &str)]) -> RegisteredModel {
        RegisteredModel { name: name.into(), production: Some("1".into()), tags: tags(pairs) }
    }

    #[test]
    fn resources_parse_gpus_or_shards_with_vram() {
        let r = parse_resources("m", "gpus=1,vram_gib=20").unwrap();
        assert_eq!((r.gpus, r.shards, r.vram_gib), (1, 0, 20.0));
        let r = parse_resources("m", " shards = 2 , vram_gib = 4.5 ").unwrap();
        assert_eq!((r.gpus, r.shards, r.vram_gib), (0, 2, 4.5));
        for (bad, says) in [
            ("gpus=1,shards=2,vram_gib=4", "gpus and shards"),
            ("gpus=1", "vram_gib"),
            ("vram_gib=4", "neither gpus nor shards"),
            ("gpus=one,vram_gib=4", "not a whole number"),
            ("gpus=1,vram_gib=-3", "positive"),
            ("gpus=1,vram_gib=NaN", "positive"),
            ("gpus=1,vram=4", "unknown key `vram`"),
            ("gpus=1,gpus=2,vram_gib=4", "twice"),
            ("gpus 1", "not key=value"),
            ("gpus=99,vram_gib=4", "more than 16"),
        ] {
            let e = parse_resources("my-model", bad).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(says), "{bad}: {text}");
            assert!(text.contains("`my-model`") && text.contains("gpuhub.resources"), "{bad}: {text}");
        }
    }

    #[test]
    fn tags_become_a_validated_entry_that_fetches_its_weights() {
        let cfg = Config::from_toml("").unwrap();
        let m = entry_from_tags(
            "smol",
            &tags(&[("served_by", "gateway"), (TAG_TEMPLATE, "llama-cpp-python"), (TAG_RESOURCES, "shards=1,vram_gib=0.5")]),
            &cfg.file,
        )
        .unwrap();
        assert_eq!(m.name, "smol");
        assert_eq!(m.mlflow_model.as_deref(), Some("smol"));
        assert_eq!(m.launcher, LauncherKind::Slurm, "mlflow.launcher defaults to slurm");
        assert!(m.model_path.is_none(), "the weights come from the version's artifacts");
        assert!(m.worker.command.contains("--model {model_file}"), "{}", m.worker.command);
        assert_eq!(m.worker.key.env.as_deref(), Some("API_KEY"));
        let named = entry_from_tags(
            "team/smol",
            &tags(&[(TAG_TEMPLATE, "vllm"), (TAG_RESOURCES, "gpus=1,vram_gib=20"), (TAG_NAME, "smol-chat")]),
            &cfg.file,
        )
        .unwrap();
        assert_eq!(named.name, "smol-chat");
        assert_eq!(named.mlflow_model.as_deref(), Some("team/smol"));
    }

    #[test]
    fn bad_tags_name_the_model_the_tag_and_the_fix() {
        let cfg =
            Config::from_toml("[templates.lab-gguf]\ncommand = \"srv --model {model_file} --port {port}\"\napi_key_env = \"API_KEY\"\n")
                .unwrap();
        let e = entry_from_tags("m1", &tags(&[(TAG_RESOURCES, "gpus=1,vram_gib=2")]), &cfg.file).unwrap_err().to_string();
        assert!(e.contains("`m1`") && e.contains("gpuhub.template") && e.contains("missing") && e.contains("llama-cpp-python"), "{e}");
        let e = entry_from_tags("m2", &tags(&[(TAG_TEMPLATE, "vlm"), (TAG_RESOURCES, "gpus=1,vram_gib=2")]), &cfg.file)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`vlm` is not a template") && e.contains("lab-gguf") && e.contains("[templates.vlm]"), "{e}");
        let e = entry_from_tags("m3", &tags(&[(TAG_TEMPLATE, "vllm")]), &cfg.file).unwrap_err().to_string();
        assert!(e.contains("`m3`") && e.contains("gpuhub.resources") && e.contains("missing"), "{e}");
        let e = entry_from_tags("bad name", &tags(&[(TAG_TEMPLATE, "vllm"), (TAG_RESOURCES, "gpus=1,vram_gib=2")]), &cfg.file)
            .unwrap_err()
            .to_string();
        assert!(e.contains("set gpuhub.name"), "{e}");
        let e = entry_from_tags(
            "m4",
            &tags(&[(TAG_TEMPLATE, "vllm"), (TAG_RESOURCES, "gpus=1,vram_gib=2"), (TAG_NAME, "x\u{1b}[2J")]),
            &cfg.file,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("gpuhub.name") && !e.contains('\u{1b}'), "control characters are escaped: {e}");
        // A site template works like a shipped one.
        let m = entry_from_tags("m5", &tags(&[(TAG_TEMPLATE, "lab-gguf"), (TAG_RESOURCES, "shards=1,vram_gib=1")]), &cfg.file).unwrap();
        assert_eq!(m.worker.template.as_deref(), Some("lab-gguf"));
    }

    #[test]
    fn the_config_catalog_wins_and_names_are_unique() {
        let cfg = Config::from_toml(
            "[[models]]\nname = \"chat\"\naliases = [\"chat-latest\"]\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n\
             [[models]]\nname = \"pinned\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\nmlflow_model = \"pinned-reg\"\n\
             [[names.history]]\nname = \"old-chat\"\nstate = \"retired\"\n",
        )
        .unwrap();
        let ok = [(TAG_TEMPLATE, "vllm"), (TAG_RESOURCES, "gpus=1,vram_gib=2"), ("served_by", "gateway")];
        let found = vec![
            reg("a-new", &ok),
            reg("chat", &ok),
            reg("b-alias", &[ok[0], ok[1], ok[2], (TAG_NAME, "chat-latest")]),
            reg("c-history", &[ok[0], ok[1], ok[2], (TAG_NAME, "old-chat")]),
            reg("d-dup", &[ok[0], ok[1], ok[2], (TAG_NAME, "a-new")]),
            reg("pinned-reg", &ok),
            reg("untagged", &[ok[0], ok[1]]),
            reg("e-broken", &[ok[0], ok[2]]),
        ];
        let r = build(&found, &cfg.file);
        assert_eq!(r.entries.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(), ["a-new"]);
        let errs: Vec<String> = r.errors.iter().map(ToString::to_string).collect();
        assert_eq!(errs.len(), 5, "{errs:#?}");
        assert!(errs.iter().any(|e| e.contains("`chat`") && e.contains("[[models]] entry `chat`")), "{errs:#?}");
        assert!(errs.iter().any(|e| e.contains("`b-alias`") && e.contains("alias or adapter")), "{errs:#?}");
        assert!(errs.iter().any(|e| e.contains("`c-history`") && e.contains("[[names.history]]")), "{errs:#?}");
        assert!(errs.iter().any(|e| e.contains("`d-dup`") && e.contains("registered model `a-new`")), "{errs:#?}");
        assert!(errs.iter().any(|e| e.contains("`e-broken`") && e.contains("gpuhub.resources")), "{errs:#?}");
        assert!(!errs.iter().any(|e| e.contains("pinned-reg") || e.contains("untagged")), "{errs:#?}");
    }
}
