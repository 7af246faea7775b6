//! `gpuhub keys`: gateway API keys. A key names a user and an app; the agent stores only its
//! hash, so `create` shows it once. Users manage their own keys (the agent knows who runs the
//! command from the socket, SO_PEERCRED); admins manage everyone's.

use std::path::Path;
use std::process::ExitCode;

use clap::Subcommand;
use serde_json::{Value, json};

use super::output;
use crate::control::client;

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Create a key for your app (admins: anyone's) and print it (once: only its hash is kept).
    /// The key carries your model allow-list and limits; its own can only be tighter.
    Create {
        /// The user the key's calls are accounted to; default: you. Only admins name another
        /// user.
        #[arg(long, value_name = "USER")]
        user: Option<String>,
        /// The app name (shown in the usage log and metrics as `app`).
        #[arg(long, value_name = "APP")]
        app: String,
        /// Only these models (comma-separated catalog names); default: every model you may use.
        #[arg(long, value_name = "A,B", value_delimiter = ',')]
        models: Vec<String>,
        /// The key's own limit of requests per minute (on top of its user's
        /// `[gateway.limits]`, and not above it); default: none of its own.
        #[arg(long, value_name = "N")]
        rpm: Option<u32>,
        /// The key's own limit of tokens (prompt + completion) per UTC day (not above its
        /// user's); default: none of its own.
        #[arg(long, value_name = "N")]
        tokens_per_day: Option<u64>,
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// List your keys (admins: every key): id, prefix, user, app, models, created, revoked;
    /// never the keys.
    List {
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Change one of your keys' allow-list and own limits (admins: any key's), by id. The key
    /// itself stays the same, so the app that holds it keeps working; what is left out stays.
    Set {
        /// The key id, e.g. k1a2b3c4d.
        id: String,
        /// Only these models from now on (comma-separated catalog names).
        #[arg(long, value_name = "A,B", value_delimiter = ',', conflicts_with = "all_models")]
        models: Option<Vec<String>>,
        /// Every model its user may use (drop the key's own allow-list).
        #[arg(long)]
        all_models: bool,
        /// The key's own limit of requests per minute (not above its user's).
        #[arg(long, value_name = "N", conflicts_with = "no_rpm")]
        rpm: Option<u32>,
        /// Drop the key's own requests-per-minute limit (its user's still applies).
        #[arg(long)]
        no_rpm: bool,
        /// The key's own limit of tokens per UTC day (not above its user's).
        #[arg(long, value_name = "N", conflicts_with = "no_tokens_per_day")]
        tokens_per_day: Option<u64>,
        /// Drop the key's own tokens-per-day limit (its user's still applies).
        #[arg(long)]
        no_tokens_per_day: bool,
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// Revoke one of your keys (admins: any) by id (see `gpuhub keys list`); its calls get a
    /// 401 that says so.
    Revoke {
        /// The key id, e.g. k1a2b3c4d.
        id: String,
    },
}

/// A key's own limits, e.g. `60/min 100000 tok/day`, `-` for none.
fn limits(k: &Value) -> String {
    let mut out = Vec::new();
    if let Some(r) = k["rpm"].as_u64() {
        out.push(format!("{r}/min"));
    }
    if let Some(t) = k["tokens_per_day"].as_u64() {
        out.push(format!("{t} tok/day"));
    }
    if out.is_empty() { "-".into() } else { out.join(" ") }
}

fn time(us: &Value) -> String {
    us.as_i64().map(|u| format!("{}", u / 1_000_000)).unwrap_or_else(|| "-".into())
}

pub async fn run(socket: &Path, cmd: KeysCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        KeysCommand::Create { user, app, models, rpm, tokens_per_day, json } => {
            let models: Vec<String> = models.into_iter().map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect();
            let v = client::request(
                socket,
                "POST",
                "/v1/keys",
                Some(json!({"user": user, "app": app, "models": models, "rpm": rpm, "tokens_per_day": tokens_per_day})),
            )
            .await?;
            if json {
                output::json(&v);
            } else {
                output::line(&format!(
                    "key {} for {}/{} created; it is shown only now:",
                    v["id"].as_str().unwrap_or("?"),
                    crate::util::sanitize(v["user"].as_str().unwrap_or("?")),
                    crate::util::sanitize(&app)
                ));
                output::line(v["key"].as_str().unwrap_or("?"));
            }
        }
        KeysCommand::List { json } => {
            let v = client::request(socket, "GET", "/v1/keys", None).await?;
            if json {
                output::json(&v);
            } else {
                let rows: Vec<Vec<String>> = v["keys"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|k| {
                                let models = k["models"]
                                    .as_array()
                                    .map(|m| m.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(","))
                                    .unwrap_or_default();
                                vec![
                                    k["id"].as_str().unwrap_or("").to_string(),
                                    format!("{}...", k["prefix"].as_str().unwrap_or("")),
                                    k["user"].as_str().unwrap_or("").to_string(),
                                    k["app"].as_str().unwrap_or("").to_string(),
                                    if models.is_empty() { "*".into() } else { models },
                                    limits(k),
                                    time(&k["created_us"]),
                                    if k["revoked_us"].is_null() { "active".into() } else { format!("revoked {}", time(&k["revoked_us"])) },
                                ]
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                output::table(&["ID", "KEY", "USER", "APP", "MODELS", "LIMITS", "CREATED", "STATE"], &rows);
            }
        }
        KeysCommand::Set { id, models, all_models, rpm, no_rpm, tokens_per_day, no_tokens_per_day, json } => {
            let models = if all_models {
                Some(Vec::new())
            } else {
                models.map(|m| m.into_iter().map(|m| m.trim().to_string()).filter(|m| !m.is_empty()).collect::<Vec<_>>())
            };
            let body = json!({"models": models, "rpm": rpm, "no_rpm": no_rpm, "tokens_per_day": tokens_per_day, "no_tokens_per_day": no_tokens_per_day});
            let v = client::request(socket, "POST", &format!("/v1/keys/{}/set", urlencode(&id)), Some(body)).await?;
            if json {
                output::json(&v);
            } else {
                let models =
                    v["models"].as_array().map(|m| m.iter().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(",")).unwrap_or_default();
                output::line(&format!(
                    "key {} ({}/{}) now: models {}, limits {}",
                    v["id"].as_str().unwrap_or("?"),
                    crate::util::sanitize(v["user"].as_str().unwrap_or("?")),
                    crate::util::sanitize(v["app"].as_str().unwrap_or("?")),
                    if models.is_empty() { "* (every model its user may use)".to_string() } else { models },
                    limits(&v)
                ));
            }
        }
        KeysCommand::Revoke { id } => {
            let v = client::request(socket, "POST", &format!("/v1/keys/{}/revoke", urlencode(&id)), None).await?;
            output::line(&format!(
                "key {} ({}/{}) revoked",
                v["id"].as_str().unwrap_or("?"),
                v["user"].as_str().unwrap_or("?"),
                v["app"].as_str().unwrap_or("?")
            ));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Percent-encodes a path segment.
pub fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| if b.is_ascii_alphanumeric() || b"-._~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") })
        .collect()
}
