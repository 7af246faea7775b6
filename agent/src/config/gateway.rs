use std::collections::{BTreeMap, BTreeSet};

use std::net::IpAddr;
use std::path::PathBuf;

use secrecy::{ExposeSecret, SecretString};
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
    /// A new connection to a worker must be made within this many seconds; past it the call
    /// goes to another replica, or the worker is checked (a node that drops packets answers
    /// nothing, and a call would wait this long before it fails over). `upstream_timeout_s`
    /// bounds it too (the whole call).
    pub upstream_connect_timeout_s: u64,
    /// A request body must arrive within this many seconds (slow clients get a 408); a stream
    /// whose client takes no event for this long is ended (it stopped reading).
    pub body_timeout_s: u64,
    /// Bound of the in-memory usage-log queue before rows spill to disk; also how many rows
    /// may wait in memory alone while the journal cannot be written (a full disk), after which
    /// new calls get a 503 until space returns.
    pub usage_queue: usize,
    /// The head of a request (request line and headers) must arrive within this many seconds:
    /// on a new connection from when it opens, on a kept-alive one from its first byte.
    pub header_timeout_s: u64,
    /// A kept-alive connection with no request for this many seconds is closed.
    pub idle_timeout_s: u64,
    /// Connections open at once; past it a new connection is answered 503 and closed.
    pub max_connections: usize,
    /// Request-body bytes held in memory across all calls together; past it a call is
    /// answered 503 (retry) instead of being read.
    pub max_body_bytes_total: usize,
    /// Largest worker answer held in memory: a whole plain answer, or one event of a stream.
    /// A larger one is answered 502.
    pub max_response_bytes: usize,
    /// Plain answers held in memory across all calls together, from when the worker's answer
    /// is read until the caller has taken it (a slow reader holds its answer); past it a call's
    /// answer is refused with 503 (retry) instead of held.
    pub max_response_bytes_total: usize,
    /// Unauthenticated refusals answered per second to one peer address (with a burst of five
    /// seconds' worth); past it the peer gets 429 and its connection is closed.
    pub unauth_refusals_per_s: u32,
    /// Active API keys a user may hold from creating their own (`gpuhub keys create` run as
    /// themselves); past it they must revoke one first. Keys an admin creates do not count
    /// against it when made, and admins are not limited. 0: users cannot create keys.
    pub keys_per_user: u32,
    pub sso: SsoConfig,
    /// `[gateway.user_models]`: per-user model allow-lists, `alice = ["demo-chat"]`. A listed
    /// user may call only these models (catalog names or aliases), with any credential: API
    /// keys (on top of the key's own `--models`), job tokens and the SSO header alike. Users
    /// not listed may call every model their credential allows.
    pub user_models: BTreeMap<UserName, Vec<String>>,
    /// `[gateway.limits]`: requests per minute and tokens per day, per user.
    pub limits: LimitsConfig,
}

/// `[gateway.limits]`: fair use of the gateway. Every authenticated user (API key, job token,
/// SSO) gets `rpm` and `tokens_per_day` unless `[[gateway.limits.users]]` says otherwise; an
/// API key may have its own limits too (`gpuhub keys create --rpm --tokens-per-day`), checked
/// on top of its user's. 0 means no limit. Over a limit a call is answered 429 with
/// `Retry-After`.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Requests per minute per user (a burst of up to this many, then one every 60/rpm s).
    pub rpm: u32,
    /// Tokens (prompt + completion, as the usage log records them) per UTC day per user.
    pub tokens_per_day: u64,
    /// Per-user overrides.
    pub users: Vec<UserLimits>,
}

/// One `[[gateway.limits.users]]` entry: a user's own limits (a missing one: the default).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct UserLimits {
    pub user: LimitUser,
    pub rpm: Option<u32>,
    pub tokens_per_day: Option<u64>,
}

/// A user name in `[[gateway.limits.users]]` (checked as [`UserName`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct LimitUser(pub String);

impl<'de> Deserialize<'de> for LimitUser {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if gpuhub_wire::token::user_ok(&s) {
            Ok(LimitUser(s))
        } else {
            Err(serde::de::Error::custom(format!(
                "gateway.limits.users: `{}` is not a user name (1 to 64 letters, digits, . _ - or @)",
                crate::util::sanitize(&s)
            )))
        }
    }
}

impl LimitsConfig {
    /// Whether any limit is set (a default or a user's own).
    pub fn any(&self) -> bool {
        self.rpm > 0
            || self.tokens_per_day > 0
            || self.users.iter().any(|u| u.rpm.is_some_and(|r| r > 0) || u.tokens_per_day.is_some_and(|t| t > 0))
    }

    /// The limits of `user`: (rpm, tokens_per_day), 0 = none.
    pub fn for_user(&self, user: &str) -> (u32, u64) {
        let o = self.users.iter().rev().find(|u| u.user.0 == user);
        (o.and_then(|o| o.rpm).unwrap_or(self.rpm), o.and_then(|o| o.tokens_per_day).unwrap_or(self.tokens_per_day))
    }
}

/// `gateway.<one>_total` (`total`) holds at least one largest `<one>` and fits the 4 GiB a
/// memory budget counts.
fn total_holds_one(one: &str, largest: usize, what: &str, total: usize) -> Result<(), (String, String)> {
    if total < largest {
        return Err((
            format!("gateway.{one}_total"),
            format!("{total} is less than gateway.{one} ({largest}): one largest {what} must fit; raise it or lower gateway.{one}"),
        ));
    }
    if total > u32::MAX as usize {
        return Err((format!("gateway.{one}_total"), format!("must be at most {} (4 GiB)", u32::MAX)));
    }
    Ok(())
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
            upstream_connect_timeout_s: 3,
            body_timeout_s: 30,
            usage_queue: 10_000,
            header_timeout_s: 10,
            idle_timeout_s: 60,
            max_connections: 4096,
            max_body_bytes_total: 256 * 1024 * 1024,
            max_response_bytes: 64 * 1024 * 1024,
            max_response_bytes_total: 1024 * 1024 * 1024,
            unauth_refusals_per_s: 20,
            keys_per_user: 20,
            sso: SsoConfig::default(),
            user_models: BTreeMap::new(),
            limits: LimitsConfig::default(),
        }
    }
}

/// `[gateway.sso]`: trust an authenticated-user header set by the site's proxy, only when the
/// proxy proves itself. Off by default.
///
/// Every user on the node can connect to the gateway from 127.0.0.1 (or from any of the
/// node's own addresses) and send any header, so a peer address on this node proves nothing.
/// The proof is a shared secret the proxy sends in `secret_header`, or a connection on the
/// Unix socket `socket` from one of `socket_users` (the kernel reports the peer's uid). An
/// address in `trusted_proxies` alone is enough only for a proxy on another machine.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SsoConfig {
    pub enabled: bool,
    /// e.g. `X-Forwarded-User`.
    pub user_header: Option<String>,
    /// Peer IPs allowed to set the header; from anyone else it is refused and logged. Without
    /// a shared secret only addresses of other machines are accepted here.
    pub trusted_proxies: Vec<String>,
    /// The header that carries the shared secret.
    pub secret_header: String,
    /// A root-only file (0600) whose content (surrounding whitespace removed, at least 16
    /// bytes) the proxy sends in `secret_header`. Read at start.
    pub shared_secret_file: Option<PathBuf>,
    /// The shared secret itself, when it is kept in this file (which is then a secret too).
    pub shared_secret: Option<Secret>,
    /// A Unix socket the gateway also serves; a connection on it from `socket_users` proves
    /// the proxy (SO_PEERCRED), without a secret.
    pub socket: Option<PathBuf>,
    /// Users (names or numeric uids) whose connections on `socket` may set the header.
    pub socket_users: Vec<String>,
}

/// The default `gateway.sso.secret_header`.
pub const SSO_SECRET_HEADER: &str = "X-Gpuhub-Proxy-Secret";

impl Default for SsoConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            user_header: None,
            trusted_proxies: Vec::new(),
            secret_header: SSO_SECRET_HEADER.into(),
            shared_secret_file: None,
            shared_secret: None,
            socket: None,
            socket_users: Vec::new(),
        }
    }
}

/// A secret in the configuration: never printed (`Debug` and `check-config` show
/// `<redacted>`), compared only through its digest.
#[derive(Clone, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub SecretString);

impl Secret {
    pub fn expose(&self) -> &str {
        self.0.expose_secret()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(super::REDACTED)
    }
}

/// Why an address cannot prove a proxy on its own, if it cannot: loopback, unspecified, or
/// one of this node's own addresses.
fn local_address(ip: IpAddr, own: &[IpAddr]) -> Option<&'static str> {
    let ip = ip.to_canonical();
    if ip.is_loopback() {
        Some("a loopback address")
    } else if ip.is_unspecified() {
        Some("the unspecified address")
    } else if own.contains(&ip) {
        Some("an address of this node")
    } else {
        None
    }
}

/// This node's own interface addresses (`getifaddrs`); empty if they cannot be listed.
pub fn own_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list it allocates; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return out;
    }
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says its real type.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if family == libc::AF_INET {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                out.push(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
            } else if family == libc::AF_INET6 {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                out.push(IpAddr::V6(std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

impl SsoConfig {
    /// Whether a shared secret is configured (in a file or inline).
    pub fn has_secret(&self) -> bool {
        self.shared_secret_file.is_some() || self.shared_secret.is_some()
    }

    fn validate(&self) -> Result<(), (String, String)> {
        let header = self.user_header.as_deref().unwrap_or("");
        if !self.enabled {
            return Ok(());
        }
        if header.is_empty() {
            return Err((
                "gateway.sso.user_header".into(),
                "is required when gateway.sso.enabled = true (e.g. \"X-Forwarded-User\")".into(),
            ));
        }
        for (key, h) in [("gateway.sso.user_header", header), ("gateway.sso.secret_header", self.secret_header.as_str())] {
            if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return Err((key.into(), format!("`{}` is not an HTTP header name", crate::util::sanitize(h))));
            }
        }
        if self.secret_header.eq_ignore_ascii_case(header) {
            return Err(("gateway.sso.secret_header".into(), "must differ from gateway.sso.user_header".into()));
        }
        if self.shared_secret_file.is_some() && self.shared_secret.is_some() {
            return Err((
                "gateway.sso.shared_secret".into(),
                "is set together with gateway.sso.shared_secret_file; keep one (the file is better: this config is printed and copied)"
                    .into(),
            ));
        }
        if let Some(s) = &self.shared_secret
            && s.expose().trim().len() < 16
        {
            return Err((
                "gateway.sso.shared_secret".into(),
                "is shorter than 16 bytes; use a long random value (openssl rand -hex 32)".into(),
            ));
        }
        if let Some(f) = &self.shared_secret_file
            && !f.is_absolute()
        {
            return Err(("gateway.sso.shared_secret_file".into(), format!("`{}` must be an absolute path", f.display())));
        }
        match (&self.socket, self.socket_users.is_empty()) {
            (Some(_), true) => {
                return Err((
                    "gateway.sso.socket_users".into(),
                    "is empty; list the user the proxy runs as (its connections on gateway.sso.socket may set the header)".into(),
                ));
            }
            (None, false) => {
                return Err((
                    "gateway.sso.socket".into(),
                    "is required with gateway.sso.socket_users (the Unix socket the proxy connects to)".into(),
                ));
            }
            (Some(p), false) if !p.is_absolute() => {
                return Err(("gateway.sso.socket".into(), format!("`{}` must be an absolute path", p.display())));
            }
            _ => {}
        }
        for u in &self.socket_users {
            if u.parse::<u32>().is_err() && !gpuhub_wire::token::user_ok(u) {
                return Err(("gateway.sso.socket_users".into(), format!("`{}` is not a user name or uid", crate::util::sanitize(u))));
            }
        }
        let mut proxies = Vec::new();
        for p in &self.trusted_proxies {
            match p.parse::<IpAddr>() {
                Ok(ip) => proxies.push(ip),
                Err(_) => {
                    return Err(("gateway.sso.trusted_proxies".into(), format!("`{}` is not an IP address", crate::util::sanitize(p))));
                }
            }
        }
        if !self.has_secret() {
            let own = if proxies.is_empty() { Vec::new() } else { own_addresses() };
            for (p, ip) in self.trusted_proxies.iter().zip(&proxies) {
                if let Some(what) = local_address(*ip, &own) {
                    return Err((
                        "gateway.sso.trusted_proxies".into(),
                        format!(
                            "`{p}` is {what}: every user on this node can connect from it and send the {header} header, so the address \
                             alone proves nothing. Let the proxy prove itself: set gateway.sso.shared_secret_file (a root-only file \
                             whose content the proxy sends in the {} header), or have it connect through gateway.sso.socket with \
                             gateway.sso.socket_users = [\"<the proxy's user>\"]",
                            self.secret_header
                        ),
                    ));
                }
            }
            if self.socket.is_none() && proxies.is_empty() {
                return Err((
                    "gateway.sso".into(),
                    format!(
                        "nothing proves the proxy: set gateway.sso.shared_secret_file (the proxy sends its content in the {} header), \
                         or gateway.sso.socket with gateway.sso.socket_users, or (for a proxy on another machine) gateway.sso.trusted_proxies",
                        self.secret_header
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl GatewayConfig {
    /// The URL given to jobs.
    pub fn public_url(&self) -> String {
        self.public_url.clone().unwrap_or_else(|| format!("http://{}", self.listen))
    }

    /// Every `[gateway.user_models]` entry lists at least one model, each in the catalog
    /// (`known`: names and aliases), or with a polled MLflow registry (`registry`), whose
    /// tagged models are known only once it is read, any valid model name.
    pub(super) fn validate_user_models(&self, known: &BTreeSet<&str>, registry: bool) -> Result<(), (String, String)> {
        for (user, models) in &self.user_models {
            let key = format!("gateway.user_models.{}", user.0);
            if models.is_empty() {
                return Err((key, format!("is empty; list the models {} may use, or remove the line to allow every model", user.0)));
            }
            for (i, m) in models.iter().enumerate() {
                if known.contains(m.as_str()) {
                    continue;
                }
                if registry {
                    super::valid_model_name(m).map_err(|e| (format!("{key}[{i}]"), e))?;
                } else {
                    let all: Vec<&str> = known.iter().copied().collect();
                    return Err((
                        format!("{key}[{i}]"),
                        format!(
                            "`{}` is not a model in the catalog; use a [[models]] name or alias (known: {}), or, with [mlflow] tracking_uri and registry_poll_s set, a model served from the MLflow registry",
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
        if !(1..=60).contains(&self.upstream_connect_timeout_s) {
            return Err((
                "gateway.upstream_connect_timeout_s".into(),
                format!("{} is out of range; use 1..=60 seconds", self.upstream_connect_timeout_s),
            ));
        }
        for (key, v) in [("gateway.header_timeout_s", self.header_timeout_s), ("gateway.idle_timeout_s", self.idle_timeout_s)] {
            if !(1..=3600).contains(&v) {
                return Err((key.into(), format!("{v} is out of range; use 1..=3600 seconds")));
            }
        }
        if !(16..=1_000_000).contains(&self.max_connections) {
            return Err(("gateway.max_connections".into(), format!("{} is out of range; use 16..=1000000", self.max_connections)));
        }
        if self.max_body_bytes > u32::MAX as usize {
            return Err(("gateway.max_body_bytes".into(), format!("must be at most {} (4 GiB)", u32::MAX)));
        }
        total_holds_one("max_body_bytes", self.max_body_bytes, "body", self.max_body_bytes_total)?;
        if self.max_response_bytes < 64 * 1024 {
            return Err(("gateway.max_response_bytes".into(), "must be at least 65536".into()));
        }
        total_holds_one("max_response_bytes", self.max_response_bytes, "answer", self.max_response_bytes_total)?;
        if self.unauth_refusals_per_s == 0 {
            return Err(("gateway.unauth_refusals_per_s".into(), "must be at least 1".into()));
        }
        self.sso.validate()?;
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
        assert_eq!(g.user_models.get("alice").map(Vec::as_slice), Some(&["demo-chat".to_string()][..]));
        assert_eq!(g.user_models.get("john.doe").map(Vec::as_slice), Some(&["chat".to_string()][..]));
        assert_eq!(g.user_models.get("bob").map(Vec::as_slice), None);
        // The inline form works too.
        let c = Config::from_toml(&format!("[gateway]\nuser_models = {{ alice = [\"demo-chat\"] }}\n{MODELS}")).unwrap();
        assert!(c.file.gateway.user_models.contains_key("alice"));

        let e = Config::from_toml(&format!("[gateway.user_models]\nalice = [\"demo-chat\", \"nope\"]\n{MODELS}")).unwrap_err().to_string();
        assert!(
            e.contains("gateway.user_models.alice[1]") && e.contains("`nope` is not a model") && e.contains("known: chat, demo-chat"),
            "{e}"
        );
        let e = Config::from_toml(&format!("[gateway.user_models]\nalice = []\n{MODELS}")).unwrap_err().to_string();
        assert!(e.contains("gateway.user_models.alice") && e.contains("is empty"), "{e}");
        // With a polled MLflow registry, a model it serves (known only once read) may be listed.
        let mlflow = "[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\n";
        let c = Config::from_toml(&format!("{mlflow}[gateway.user_models]\nalice = [\"demo-chat\", \"smol-chat\"]\n{MODELS}")).unwrap();
        assert_eq!(c.file.gateway.user_models.get("alice").map(Vec::len), Some(2));
        let e = Config::from_toml(&format!("{mlflow}[gateway.user_models]\nalice = [\"bad name\"]\n{MODELS}")).unwrap_err().to_string();
        assert!(e.contains("gateway.user_models.alice[0]"), "{e}");
        // A bad user name or a non-list is a parse error with its line.
        let e =
            Config::from_toml(&format!("[gateway]\nlisten = \"127.0.0.1:8400\"\n[gateway.user_models]\n\"a b\" = [\"chat\"]\n{MODELS}"))
                .unwrap_err()
                .to_string();
        assert!(e.contains("line 4") && e.contains("`a b` is not a user name"), "{e}");
        let e = Config::from_toml(&format!("[gateway.user_models]\n\nalice = \"demo-chat\"\n{MODELS}")).unwrap_err().to_string();
        assert!(e.contains("line 3"), "{e}");
    }

    fn sso(extra: &str) -> Result<Config, String> {
        Config::from_toml(&format!("[gateway.sso]\nenabled = true\nuser_header = \"X-Forwarded-User\"\n{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn sso_from_a_loopback_address_alone_is_refused_with_the_reason_and_the_fix() {
        for addr in ["127.0.0.1", "::1", "127.0.0.2", "0.0.0.0", "::ffff:127.0.0.1"] {
            let e = sso(&format!("trusted_proxies = [\"{addr}\"]")).unwrap_err();
            assert!(e.contains("gateway.sso.trusted_proxies"), "{e}");
            assert!(e.contains("every user on this node can connect from it"), "{e}");
            assert!(e.contains("gateway.sso.shared_secret_file") && e.contains("gateway.sso.socket"), "{e}");
        }
        // An address of this node is no better than loopback.
        if let Some(own) = super::own_addresses().into_iter().find(|ip| !ip.is_loopback()) {
            let e = sso(&format!("trusted_proxies = [\"{own}\"]")).unwrap_err();
            assert!(e.contains("an address of this node"), "{e}");
        }
        // A proof makes it valid: a secret (a loopback proxy is fine then), or the socket.
        sso("trusted_proxies = [\"127.0.0.1\"]\nshared_secret_file = \"/etc/gpuhub/sso-secret\"").unwrap();
        sso("shared_secret = \"0123456789abcdef-long-enough\"").unwrap();
        sso("socket = \"/run/gpuhub/sso.sock\"\nsocket_users = [\"proxy\"]").unwrap();
        // A remote proxy's address alone is still accepted (TEST-NET-1, not on this node).
        sso("trusted_proxies = [\"192.0.2.10\"]").unwrap();
    }

    #[test]
    fn sso_configurations_that_prove_nothing_or_contradict_are_refused() {
        let e = sso("").unwrap_err();
        assert!(e.contains("nothing proves the proxy"), "{e}");
        let e = sso("socket = \"/run/gpuhub/sso.sock\"").unwrap_err();
        assert!(e.contains("gateway.sso.socket_users"), "{e}");
        let e = sso("socket_users = [\"proxy\"]").unwrap_err();
        assert!(e.contains("gateway.sso.socket"), "{e}");
        let e = sso("shared_secret = \"short\"").unwrap_err();
        assert!(e.contains("shorter than 16 bytes"), "{e}");
        let e = sso("shared_secret = \"0123456789abcdef-long-enough\"\nshared_secret_file = \"/etc/s\"").unwrap_err();
        assert!(e.contains("keep one"), "{e}");
        let e = sso("shared_secret_file = \"relative\"").unwrap_err();
        assert!(e.contains("absolute path"), "{e}");
        let e = sso("shared_secret = \"0123456789abcdef-long-enough\"\nsecret_header = \"x-forwarded-user\"").unwrap_err();
        assert!(e.contains("must differ"), "{e}");
        let e = sso("shared_secret = \"0123456789abcdef-long-enough\"\ntrusted_proxies = [\"proxy.example\"]").unwrap_err();
        assert!(e.contains("is not an IP address"), "{e}");
        // Off: nothing is checked.
        Config::from_toml("[gateway.sso]\ntrusted_proxies = [\"127.0.0.1\"]\n").unwrap();
    }

    #[test]
    fn limits_are_checked() {
        let e = Config::from_toml("[gateway]\nmax_body_bytes_total = 1024\n").unwrap_err().to_string();
        assert!(e.contains("gateway.max_body_bytes_total") && e.contains("one largest body must fit"), "{e}");
        let e = Config::from_toml("[gateway]\nmax_response_bytes_total = 65536\n").unwrap_err().to_string();
        assert!(e.contains("gateway.max_response_bytes_total") && e.contains("one largest answer must fit"), "{e}");
        let e = Config::from_toml("[gateway]\nheader_timeout_s = 0\n").unwrap_err().to_string();
        assert!(e.contains("gateway.header_timeout_s"), "{e}");
        for bad in ["upstream_connect_timeout_s = 0", "upstream_connect_timeout_s = 61"] {
            let e = Config::from_toml(&format!("[gateway]\n{bad}\n")).unwrap_err().to_string();
            assert!(e.contains("gateway.upstream_connect_timeout_s") && e.contains("1..=60"), "{bad}: {e}");
        }
        assert_eq!(Config::from_toml("[gateway]\nupstream_connect_timeout_s = 10\n").unwrap().file.gateway.upstream_connect_timeout_s, 10);
        let e = Config::from_toml("[gateway]\nmax_connections = 2\n").unwrap_err().to_string();
        assert!(e.contains("gateway.max_connections"), "{e}");
        let e = Config::from_toml("[gateway]\nmax_response_bytes = 10\n").unwrap_err().to_string();
        assert!(e.contains("gateway.max_response_bytes"), "{e}");
        let e = Config::from_toml("[gateway]\nunauth_refusals_per_s = 0\n").unwrap_err().to_string();
        assert!(e.contains("gateway.unauth_refusals_per_s"), "{e}");
    }
}
