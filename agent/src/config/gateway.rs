use serde::{Deserialize, Serialize};

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
