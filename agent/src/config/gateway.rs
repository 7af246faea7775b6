use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize};

/// `[gateway]`: the OpenAI-compatible API.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GatewayConfig {
    /// Listener. Loopback by default; jobs on this node reach it there.
    pub listen: String,
    /// The URL jobs and services are told to use (`GPUHUB_URL`; `OPENAI_BASE_URL` = this + `/v1`).
    /// Default: `http://<listen>`.
    pub public_url: Option<String>,
    /// Largest request body accepted (audio uploads need room), bytes.
    pub max_body_bytes: usize,
    /// Seconds between SSE keep-alive comments while an upstream is silent or a model loads.
    pub keepalive_s: u64,
    /// Upper bound for a whole upstream call, seconds.
    pub upstream_timeout_s: u64,
    /// A request body must arrive within this many seconds (slow clients get a 408).
    pub body_timeout_s: u64,
    /// Bound of the in-memory usage-log queue before rows spill to disk.
    pub usage_queue: usize,
    pub sso: SsoConfig,
    /// `[gateway.user_models]`: per-user model allow-lists, `alice = ["demo-chat"]`. A listed
    /// user may call only these models (catalog names or aliases), with any credential: API
    /// keys (on top of the key's own `--models`), job tokens and the SSO header alike. Users
    /// not listed may call every model their credential allows.
    pub user_models: BTreeMap<UserName, Vec<String>>,
}

/// A user name as a `[gateway.user_models]` key: letters, digits, `. _ - @`, 1 to 64
/// characters (as `gpuhub keys create --user` and job tokens). Checked while parsing, so a bad
/// one is reported with its line.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct UserName(pub String);

impl<'de> Deserialize<'de> for UserName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if gpuhub_wire::token::user_ok(&s) {
            Ok(UserName(s))
        } else {
            Err(serde::de::Error::custom(format!(
                "gateway.user_models: `{}` is not a user name (1 to 64 letters, digits, . _ - or @)",
                crate::util::sanitize(&s)
            )))
        }
    }
}

impl std::borrow::Borrow<str> for UserName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: gpuhub_wire::paths::GATEWAY_LISTEN.to_string(),
            public_url: None,
            max_body_bytes: 32 * 1024 * 1024,
            keepalive_s: 10,
            upstream_timeout_s: 600,
            body_timeout_s: 30,
            usage_queue: 10_000,
            sso: SsoConfig::default(),
            user_models: BTreeMap::new(),
        }
    }
}

/// `[gateway.sso]`: trust an authenticated-user header set by the site's edge proxy, only
/// from these peer addresses. Off by default.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SsoConfig {
    pub enabled: bool,
    /// e.g. `X-Forwarded-User`.
    pub user_header: Option<String>,
    /// Peer IPs allowed to set the header; from anyone else it is ignored and logged.
    pub trusted_proxies: Vec<String>,
}

impl GatewayConfig {
    /// The URL given to jobs.
    pub fn public_url(&self) -> String {
        self.public_url.clone().unwrap_or_else(|| format!("http://{}", self.listen))
    }

    /// The allow-list of `user`, if `[gateway.user_models]` has one.
    pub fn user_models_of(&self, user: &str) -> Option<&[String]> {
        self.user_models.get(user).map(Vec::as_slice)
    }

    /// Every `[gateway.user_models]` entry lists at least one model, each in the catalog
    /// (`known`: names and aliases).
    pub(super) fn validate_user_models(&self, known: &BTreeSet<&str>) -> Result<(), (String, String)> {
        for (user, models) in &self.user_models {
            let key = format!("gateway.user_models.{}", user.0);
            if models.is_empty() {
                return Err((key, format!("is empty; list the models {} may use, or remove the line to allow every model", user.0)));
            }
            for (i, m) in models.iter().enumerate() {
                if !known.contains(m.as_str()) {
                    let all: Vec<&str> = known.iter().copied().collect();
                    return Err((
                        format!("{key}[{i}]"),
                        format!(
                            "`{}` is not a model in the catalog; use a [[models]] name or alias (known: {})",
                            crate::util::sanitize(m),
                            all.join(", ")
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn validate(&self) -> Result<(), (String, String)> {
        super::check_listen(&self.listen).map_err(|m| ("gateway.listen".to_string(), m))?;
        if let Some(u) = &self.public_url
            && !(u.starts_with("http://") || u.starts_with("https://"))
        {
            return Err(("gateway.public_url".into(), format!("`{u}` must start with http:// or https://")));
        }
        if self.max_body_bytes < 1024 {
            return Err(("gateway.max_body_bytes".into(), "must be at least 1024".into()));
        }
        for (key, v) in [
            ("gateway.keepalive_s", self.keepalive_s),
            ("gateway.upstream_timeout_s", self.upstream_timeout_s),
            ("gateway.body_timeout_s", self.body_timeout_s),
        ] {
            if v == 0 {
                return Err((key.into(), "must be at least 1 second".into()));
            }
        }
        if self.usage_queue == 0 {
            return Err(("gateway.usage_queue".into(), "must be at least 1".into()));
        }
        if self.sso.enabled {
            if self.sso.user_header.as_deref().unwrap_or("").is_empty() {
                return Err(("gateway.sso.user_header".into(), "is required when gateway.sso.enabled = true".into()));
            }
            if self.sso.trusted_proxies.is_empty() {
                return Err((
                    "gateway.sso.trusted_proxies".into(),
                    "list the edge proxy addresses; without them no header is trusted".into(),
                ));
            }
            for p in &self.sso.trusted_proxies {
                if p.parse::<std::net::IpAddr>().is_err() {
                    return Err(("gateway.sso.trusted_proxies".into(), format!("`{p}` is not an IP address")));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::Config;

    const MODELS: &str = "[[models]]\nname = \"demo-chat\"\naliases = [\"chat\"]\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9/\"\n";

    #[test]
    fn user_models_parse_and_are_checked_against_the_catalog() {
        let c = Config::from_toml(&format!("[gateway.user_models]\nalice = [\"demo-chat\"]\n\"john.doe\" = [\"chat\"]\n{MODELS}")).unwrap();
        let g = &c.file.gateway;
        assert_eq!(g.user_models_of("alice"), Some(&["demo-chat".to_string()][..]));
        assert_eq!(g.user_models_of("john.doe"), Some(&["chat".to_string()][..]));
        assert_eq!(g.user_models_of("bob"), None);
        // The inline form works too.
        let c = Config::from_toml(&format!("[gateway]\nuser_models = {{ alice = [\"demo-chat\"] }}\n{MODELS}")).unwrap();
        assert!(c.file.gateway.user_models_of("alice").is_some());

        let e = Config::from_toml(&format!("[gateway.user_models]\nalice = [\"demo-chat\", \"nope\"]\n{MODELS}")).unwrap_err().to_string();
        assert!(
            e.contains("gateway.user_models.alice[1]") && e.contains("`nope` is not a model") && e.contains("known: chat, demo-chat"),
            "{e}"
        );
        let e = Config::from_toml(&format!("[gateway.user_models]\nalice = []\n{MODELS}")).unwrap_err().to_string();
        assert!(e.contains("gateway.user_models.alice") && e.contains("is empty"), "{e}");
        // A bad user name or a non-list is a parse error with its line.
        let e =
            Config::from_toml(&format!("[gateway]\nlisten = \"127.0.0.1:8400\"\n[gateway.user_models]\n\"a b\" = [\"chat\"]\n{MODELS}"))
                .unwrap_err()
                .to_string();
        assert!(e.contains("line 4") && e.contains("`a b` is not a user name"), "{e}");
        let e = Config::from_toml(&format!("[gateway.user_models]\n\nalice = \"demo-chat\"\n{MODELS}")).unwrap_err().to_string();
        assert!(e.contains("line 3"), "{e}");
    }
}
