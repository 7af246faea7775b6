//! What a job step's environment gets: a pure plan, applied by `remote.rs` with
//! `spank_setenv`. Unit-tested here without Slurm.
//!
//! Precedence, most specific first:
//! - a variable the user already set always wins (applied with `overwrite = 0`), except
//!   `MLFLOW_EXPERIMENT_NAME` given through `--mlflow-experiment`, which is the user's own,
//!   more specific choice for this job;
//! - the agent's snapshot (current role models, gateway and MLflow URLs);
//! - the plugstack arguments (static fallbacks);
//! - built-in defaults (only the gateway URL has one).

use std::collections::BTreeMap;

use gpuhub_wire::snapshot::{Snapshot, role_env_var};
use gpuhub_wire::spool::JobIdentity;

use crate::config::Config;

/// One variable to set in the step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvVar {
    pub name: String,
    pub value: String,
    /// `true` only for values the user chose for this job (`--mlflow-experiment`).
    pub overwrite: bool,
}

/// A log line the caller emits once: `error` lines are for the admin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Note {
    Error(String),
    Debug(String),
}

/// The variables and the log lines for one step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub vars: Vec<EnvVar>,
    pub notes: Vec<Note>,
}

/// Inputs that do not come from configuration.
#[derive(Debug, Clone)]
pub struct StepFacts<'a> {
    pub job: &'a JobIdentity,
    pub gpus: &'a [u32],
    pub shards: Option<u32>,
    /// `--mlflow-experiment=NAME` (or its `SLURM_SPANK_*` env form), if given.
    pub experiment_option: Option<&'a str>,
    /// The minted job token, if a key was available.
    pub token: Option<String>,
}

/// The run tags that identify the job: a JSON object with string values, used for both
/// `MLFLOW_RUN_CONTEXT` (plain mlflow merges it into every new run's tags) and `MLFLOW_TAGS`
/// (the transformers MLflow callback).
pub fn run_tags(f: &StepFacts<'_>) -> String {
    let mut tags: BTreeMap<&str, String> = BTreeMap::new();
    tags.insert("slurm.job_id", f.job.job_id.to_string());
    tags.insert("slurm.user", f.job.user.clone());
    tags.insert("slurm.partition", f.job.partition.clone().unwrap_or_default());
    tags.insert("slurm.gpus", f.gpus.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    tags.insert("slurm.node", f.job.node.clone());
    if let Some(a) = &f.job.account {
        tags.insert("slurm.account", a.clone());
    }
    if let Some(s) = f.shards {
        tags.insert("slurm.shards", s.to_string());
    }
    serde_json::to_string(&tags).unwrap_or_else(|_| "{}".into())
}

/// Computes the step's variables from the configuration and the snapshot (or why there is none).
pub fn plan(cfg: &Config, snapshot: Result<&Snapshot, &str>, f: &StepFacts<'_>) -> Plan {
    let mut p = Plan::default();
    let mut set = |name: &str, value: String, overwrite: bool| p.vars.push(EnvVar { name: name.into(), value, overwrite });
    let snap = snapshot.ok();

    let gateway = snap.and_then(|s| s.gateway_url.clone()).unwrap_or_else(|| cfg.gateway_url.clone());
    let gateway = gateway.trim_end_matches('/').to_string();
    set("GPUHUB_URL", gateway.clone(), false);
    set("OPENAI_BASE_URL", format!("{gateway}/v1"), false);

    if let Some(uri) = snap.and_then(|s| s.mlflow_tracking_uri.clone()).or_else(|| cfg.mlflow_uri.clone()) {
        set("MLFLOW_TRACKING_URI", uri, false);
    }
    match f.experiment_option {
        Some(e) => set("MLFLOW_EXPERIMENT_NAME", e.to_string(), true),
        None => {
            if let Some(e) = snap.and_then(|s| s.mlflow_experiment.clone()).or_else(|| cfg.mlflow_experiment.clone()) {
                set("MLFLOW_EXPERIMENT_NAME", e, false);
            }
        }
    }
    let tags = run_tags(f);
    set("MLFLOW_RUN_CONTEXT", tags.clone(), false);
    set("MLFLOW_TAGS", tags, false);

    let roles: Vec<(String, String)> = match snap {
        Some(s) => s.roles.iter().filter_map(|(r, m)| m.clone().map(|m| (r.clone(), m))).collect(),
        None => cfg.roles.iter().map(|(r, m)| (r.clone(), m.clone())).collect(),
    };
    for (role, model) in &roles {
        if let Some(var) = role_env_var(role) {
            set(&var, model.clone(), false);
        }
    }
    if let Some(t) = &f.token {
        set("GPUHUB_TOKEN", t.clone(), false);
        set("OPENAI_API_KEY", t.clone(), false);
    }

    if let Err(why) = snapshot {
        if cfg.roles.is_empty() {
            p.notes.push(Note::Error(format!(
                "gpuhub: no role models for job {}: {why}, and no role.<name>=<model> plugstack arguments; \
                 no <ROLE>_MODEL variables injected (fix: start gpuhub-agent, which writes the snapshot)",
                f.job.job_id
            )));
        } else {
            p.notes.push(Note::Debug(format!("gpuhub: snapshot unavailable ({why}); using the plugstack role.* arguments")));
        }
    }
    p
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;

    fn job() -> JobIdentity {
        JobIdentity { job_id: 42, uid: 1000, user: "alice".into(), account: None, partition: Some("gpu".into()), node: "gpu01".into() }
    }

    fn get<'a>(p: &'a Plan, name: &str) -> Option<&'a EnvVar> {
        p.vars.iter().find(|v| v.name == name)
    }

    fn snap() -> Snapshot {
        Snapshot {
            version: 1,
            generated_at: 0,
            gateway_url: Some("http://127.0.0.1:8400/".into()),
            mlflow_tracking_uri: Some("http://127.0.0.1:5000".into()),
            mlflow_experiment: Some("site".into()),
            roles: BTreeMap::from([("ocr".into(), Some("dots.ocr".into())), ("chat".into(), None)]),
            gpus: BTreeMap::new(),
            quota_notes: BTreeMap::new(),
        }
    }

    #[test]
    fn snapshot_drives_everything_and_null_roles_get_nothing() {
        let j = job();
        let f = StepFacts { job: &j, gpus: &[0, 1], shards: None, experiment_option: None, token: Some("ghj1.x".into()) };
        let s = snap();
        let p = plan(&Config::default(), Ok(&s), &f);
        assert_eq!(get(&p, "GPUHUB_URL").unwrap().value, "http://127.0.0.1:8400");
        assert_eq!(get(&p, "OPENAI_BASE_URL").unwrap().value, "http://127.0.0.1:8400/v1");
        assert_eq!(get(&p, "MLFLOW_TRACKING_URI").unwrap().value, "http://127.0.0.1:5000");
        let exp = get(&p, "MLFLOW_EXPERIMENT_NAME").unwrap();
        assert_eq!((exp.value.as_str(), exp.overwrite), ("site", false));
        assert_eq!(get(&p, "OCR_MODEL").unwrap().value, "dots.ocr");
        assert!(get(&p, "CHAT_MODEL").is_none());
        assert_eq!(get(&p, "OPENAI_API_KEY").unwrap().value, "ghj1.x");
        assert!(p.vars.iter().filter(|v| v.name != "MLFLOW_EXPERIMENT_NAME").all(|v| !v.overwrite), "user values win");
        let tags: serde_json::Value = serde_json::from_str(&get(&p, "MLFLOW_RUN_CONTEXT").unwrap().value).unwrap();
        assert_eq!(tags["slurm.job_id"], "42");
        assert_eq!(tags["slurm.user"], "alice");
        assert_eq!(tags["slurm.partition"], "gpu");
        assert_eq!(tags["slurm.gpus"], "0,1");
        assert_eq!(get(&p, "MLFLOW_TAGS").unwrap().value, get(&p, "MLFLOW_RUN_CONTEXT").unwrap().value);
        assert!(p.notes.is_empty());
    }

    #[test]
    fn option_experiment_overrides_and_shards_are_tagged() {
        let j = job();
        let f = StepFacts { job: &j, gpus: &[1], shards: Some(7), experiment_option: Some("mine"), token: None };
        let p = plan(&Config::default(), Ok(&snap()), &f);
        let exp = get(&p, "MLFLOW_EXPERIMENT_NAME").unwrap();
        assert_eq!((exp.value.as_str(), exp.overwrite), ("mine", true));
        assert!(get(&p, "MLFLOW_RUN_CONTEXT").unwrap().value.contains(r#""slurm.shards":"7""#));
        assert!(get(&p, "GPUHUB_TOKEN").is_none());
    }

    #[test]
    fn without_snapshot_static_roles_then_one_error() {
        let j = job();
        let f = StepFacts { job: &j, gpus: &[], shards: None, experiment_option: None, token: None };
        let cfg = Config::parse(&["role.ocr=static-ocr", "mlflow_uri=http://127.0.0.1:5001"]).unwrap();
        let p = plan(&cfg, Err("corrupt snapshot"), &f);
        assert_eq!(get(&p, "OCR_MODEL").unwrap().value, "static-ocr");
        assert_eq!(get(&p, "MLFLOW_TRACKING_URI").unwrap().value, "http://127.0.0.1:5001");
        assert_eq!(get(&p, "GPUHUB_URL").unwrap().value, "http://127.0.0.1:8400");
        assert!(matches!(p.notes.as_slice(), [Note::Debug(_)]));

        let p = plan(&Config::default(), Err("cannot open /run/gpuhub/snapshot.json"), &f);
        assert!(!p.vars.iter().any(|v| v.name.ends_with("_MODEL")));
        assert!(get(&p, "MLFLOW_TRACKING_URI").is_none());
        match p.notes.as_slice() {
            [Note::Error(m)] => assert!(m.contains("no role models for job 42") && m.contains("cannot open"), "{m}"),
            other => panic!("expected one error note, got {other:?}"),
        }
    }
}
