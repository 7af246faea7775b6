//! Plugstack arguments: every default in one place, then a strict `key=value` parse.
//!
//! The arguments come from the plugstack line (`optional spank_gpuhub.so key=value ...`) and
//! arrive unchanged in every hook and context. An unknown key or a bad value is an error that
//! names the key and what is accepted; the caller then logs it once and keeps the plugin out
//! of the way for that process (no records, no env), never failing the job.
//! `slurm-conf/plugstack.conf.d/gpuhub.conf` documents every key.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use gpuhub_wire::{paths, snapshot};

/// Keys accepted on the plugstack line (`role.<name>` is a family).
pub const KNOWN_KEYS: &str = "spool_dir, snapshot, job_key, dcgm_job_map_dir, gateway_url, mlflow_uri, \
mlflow_experiment, role.<name>, inject, token_ttl_s, fsync";

/// Longest accepted token lifetime: 30 days.
pub const MAX_TOKEN_TTL_S: i64 = 30 * 24 * 3600;

/// The plugin's effective configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Spool root; records go to `<spool_dir>/records/`.
    pub spool_dir: PathBuf,
    /// The agent's snapshot file.
    pub snapshot: PathBuf,
    /// Root-only HMAC key for job tokens.
    pub job_key: PathBuf,
    /// dcgm-exporter `--hpc-job-mapping-dir`; `None` disables the job map (`dcgm_job_map_dir=none`).
    pub dcgm_job_map_dir: Option<PathBuf>,
    /// Fallback gateway URL when the snapshot has none.
    pub gateway_url: String,
    /// Fallback `MLFLOW_TRACKING_URI` when the snapshot has none.
    pub mlflow_uri: Option<String>,
    /// Fallback site default experiment.
    pub mlflow_experiment: Option<String>,
    /// Static role -> model fallback used only when no snapshot can be read.
    pub roles: BTreeMap<String, String>,
    /// Inject environment variables into job steps (`inject=no` turns it off site-wide).
    pub inject: bool,
    /// Lifetime of job tokens, seconds.
    pub token_ttl_s: i64,
    /// `fsync=all`: make start records durable before the hook returns (~7 ms each on the
    /// lab disk, on every srun's path); default `fsync=end` (see `spool`).
    pub fsync_all: bool,
}

impl Default for Config {
    fn default() -> Self {
        let runtime = PathBuf::from(paths::RUNTIME_DIR);
        Config {
            spool_dir: PathBuf::from(paths::SPOOL_DIR),
            snapshot: runtime.join(paths::SNAPSHOT_FILE_NAME),
            job_key: PathBuf::from(paths::STATE_DIR).join(paths::JOB_KEY_FILE_NAME),
            dcgm_job_map_dir: Some(runtime.join(paths::DCGM_JOB_MAP_DIR_NAME)),
            gateway_url: format!("http://{}", paths::GATEWAY_LISTEN),
            mlflow_uri: None,
            mlflow_experiment: None,
            roles: BTreeMap::new(),
            inject: true,
            token_ttl_s: 7 * 24 * 3600,
            fsync_all: false,
        }
    }
}

/// A plugstack argument the plugin cannot accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The argument as written.
    pub arg: String,
    /// What is wrong and what is accepted.
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gpuhub: plugstack argument \"{}\": {}; the plugin is disabled for this process (jobs run unchanged). \
             Fix the gpuhub line in plugstack.conf (see slurm-conf/plugstack.conf.d/gpuhub.conf)",
            self.arg.escape_debug(),
            self.problem
        )
    }
}

fn abs_path(arg: &str, v: &str) -> Result<PathBuf, ConfigError> {
    if v.starts_with('/') && !v.contains('\0') {
        Ok(PathBuf::from(v))
    } else {
        Err(ConfigError { arg: arg.into(), problem: "expected an absolute path (starting with /)".into() })
    }
}

fn url(arg: &str, v: &str) -> Result<String, ConfigError> {
    let ok = (v.starts_with("http://") || v.starts_with("https://"))
        && v.len() > "http://".len()
        && v.len() <= 2048
        && !v.bytes().any(|b| b.is_ascii_control() || b == b' ');
    if ok {
        Ok(v.trim_end_matches('/').to_string())
    } else {
        Err(ConfigError { arg: arg.into(), problem: "expected an http:// or https:// URL without spaces".into() })
    }
}

fn text(arg: &str, v: &str) -> Result<String, ConfigError> {
    if !v.is_empty() && v.len() <= 256 && !v.chars().any(char::is_control) {
        Ok(v.to_string())
    } else {
        Err(ConfigError { arg: arg.into(), problem: "expected 1 to 256 printable characters".into() })
    }
}

impl Config {
    /// Parses plugstack arguments on top of the defaults. Later keys override earlier ones.
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Config, ConfigError> {
        let mut c = Config::default();
        for a in args {
            let arg = a.as_ref();
            let Some((key, v)) = arg.split_once('=') else {
                return Err(ConfigError { arg: arg.into(), problem: format!("expected key=value; known keys: {KNOWN_KEYS}") });
            };
            match key {
                "spool_dir" => c.spool_dir = abs_path(arg, v)?,
                "snapshot" => c.snapshot = abs_path(arg, v)?,
                "job_key" => c.job_key = abs_path(arg, v)?,
                "dcgm_job_map_dir" => c.dcgm_job_map_dir = if v == "none" { None } else { Some(abs_path(arg, v)?) },
                "gateway_url" => c.gateway_url = url(arg, v)?,
                "mlflow_uri" => c.mlflow_uri = Some(url(arg, v)?),
                "mlflow_experiment" => c.mlflow_experiment = Some(text(arg, v)?),
                "inject" => {
                    c.inject = match v {
                        "yes" => true,
                        "no" => false,
                        _ => return Err(ConfigError { arg: arg.into(), problem: "accepted values: yes, no".into() }),
                    }
                }
                "fsync" => {
                    c.fsync_all = match v {
                        "all" => true,
                        "end" => false,
                        _ => return Err(ConfigError { arg: arg.into(), problem: "accepted values: end, all".into() }),
                    }
                }
                "token_ttl_s" => {
                    c.token_ttl_s = match v.parse::<i64>() {
                        Ok(n) if (60..=MAX_TOKEN_TTL_S).contains(&n) => n,
                        _ => {
                            return Err(ConfigError {
                                arg: arg.into(),
                                problem: format!("expected whole seconds from 60 to {MAX_TOKEN_TTL_S}"),
                            });
                        }
                    }
                }
                _ => match key.strip_prefix("role.") {
                    Some(role) if snapshot::role_env_var(role).is_some() => {
                        c.roles.insert(role.to_string(), text(arg, v)?);
                    }
                    Some(_) => {
                        return Err(ConfigError {
                            arg: arg.into(),
                            problem: "a role name is 1-64 of [A-Za-z0-9._-] and does not start with a digit".into(),
                        });
                    }
                    None => {
                        return Err(ConfigError {
                            arg: arg.into(),
                            problem: format!("unknown key \"{}\"; known keys: {KNOWN_KEYS}", key.escape_debug()),
                        });
                    }
                },
            }
        }
        Ok(c)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // tests fail loudly
mod tests {
    use super::*;

    #[test]
    fn defaults_come_from_the_wire_paths() {
        let c = Config::parse::<&str>(&[]).unwrap();
        assert_eq!(c.spool_dir, PathBuf::from("/var/spool/gpuhub"));
        assert_eq!(c.snapshot, PathBuf::from("/run/gpuhub/snapshot.json"));
        assert_eq!(c.job_key, PathBuf::from("/var/lib/gpuhub/job-token.key"));
        assert_eq!(c.dcgm_job_map_dir, Some(PathBuf::from("/run/gpuhub/dcgm-job-map")));
        assert_eq!(c.gateway_url, "http://127.0.0.1:8400");
        assert!(c.inject);
    }

    #[test]
    fn every_key_parses() {
        let c = Config::parse(&[
            "spool_dir=/s",
            "snapshot=/x/snap.json",
            "job_key=/k",
            "dcgm_job_map_dir=none",
            "gateway_url=http://127.0.0.1:9/",
            "mlflow_uri=http://127.0.0.1:5000",
            "mlflow_experiment=lab exp",
            "role.ocr=dots.ocr",
            "role.chat-small=qwen3",
            "inject=no",
            "token_ttl_s=3600",
            "fsync=all",
        ])
        .unwrap();
        assert_eq!(c.spool_dir, PathBuf::from("/s"));
        assert_eq!(c.dcgm_job_map_dir, None);
        assert_eq!(c.gateway_url, "http://127.0.0.1:9");
        assert_eq!(c.mlflow_uri.as_deref(), Some("http://127.0.0.1:5000"));
        assert_eq!(c.mlflow_experiment.as_deref(), Some("lab exp"));
        assert_eq!(c.roles.get("chat-small").map(String::as_str), Some("qwen3"));
        assert!(!c.inject);
        assert_eq!(c.token_ttl_s, 3600);
        assert!(c.fsync_all);
    }

    #[test]
    fn bad_arguments_name_the_key_and_what_is_accepted() {
        let cases: &[(&str, &str)] = &[
            ("spool=/x", "unknown key \"spool\"; known keys: spool_dir"),
            ("spool_dir", "expected key=value"),
            ("spool_dir=relative", "absolute path"),
            ("inject=maybe", "accepted values: yes, no"),
            ("fsync=sometimes", "accepted values: end, all"),
            ("token_ttl_s=5", "from 60 to"),
            ("token_ttl_s=abc", "whole seconds"),
            ("gateway_url=ftp://x", "http:// or https://"),
            ("role.9x=m", "role name"),
            ("role.ocr=", "printable"),
        ];
        for (arg, want) in cases {
            let e = Config::parse(&[*arg]).unwrap_err();
            let msg = e.to_string();
            assert!(msg.contains(want), "{arg}: {msg}");
            assert!(msg.starts_with("gpuhub: plugstack argument"), "{msg}");
            assert!(msg.contains("disabled for this process"), "{msg}");
        }
    }
}
