//! Who is calling: API keys (only their SHA-256 is stored), per-job tokens minted by the SPANK
//! plugin, and an SSO header trusted only from configured proxy addresses.
//!
//! Keys are checked against an in-memory map (loaded at start, updated by `gpuhub keys`), so
//! authentication never touches the store on the request path.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::RwLock;

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use super::error::GatewayError;
use crate::AppState;
use crate::store::gateway::ApiKeyRecord;

/// Prefix of gateway API keys (`ghk_` + 40 hex characters).
pub const KEY_PREFIX: &str = "ghk_";

/// The authenticated caller of one request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub user: String,
    /// The key's app name (`job` for job tokens, `sso` for the SSO header).
    pub app: String,
    pub job_id: Option<i64>,
    /// Models this caller may use; empty = every model.
    pub models: Vec<String>,
    /// Short key id for messages (never the key).
    pub key_id: Option<String>,
}

impl Identity {
    /// Checks the per-key allow-list against the requested and the resolved name.
    pub fn check_model(&self, asked: &str, resolved: Option<&str>) -> Result<(), GatewayError> {
        if self.models.is_empty() || self.models.iter().any(|m| m == asked || Some(m.as_str()) == resolved) {
            return Ok(());
        }
        Err(GatewayError::Forbidden(format!(
            "the API key {} of {}/{} may not use model `{}`; it may use: {} (an admin can create a key with --models)",
            self.key_id.as_deref().unwrap_or("?"),
            self.user,
            self.app,
            crate::util::sanitize(asked),
            self.models.join(", ")
        )))
    }
}

/// SHA-256 of a key, hex.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// A fresh random key.
pub fn new_key() -> String {
    let bytes: [u8; 20] = rand::random();
    format!("{KEY_PREFIX}{}", hex::encode(bytes))
}

/// Key hash -> record (revoked keys included, so their callers hear why).
#[derive(Default)]
pub struct KeyCache {
    keys: RwLock<HashMap<String, ApiKeyRecord>>,
}

impl KeyCache {
    pub fn replace(&self, records: Vec<ApiKeyRecord>) {
        let map = records.into_iter().map(|r| (r.key_hash.clone(), r)).collect();
        match self.keys.write() {
            Ok(mut g) => *g = map,
            Err(p) => *p.into_inner() = map,
        }
    }

    pub fn upsert(&self, record: ApiKeyRecord) {
        match self.keys.write() {
            Ok(mut g) => g.insert(record.key_hash.clone(), record),
            Err(p) => p.into_inner().insert(record.key_hash.clone(), record),
        };
    }

    fn get(&self, hash: &str) -> Option<ApiKeyRecord> {
        match self.keys.read() {
            Ok(g) => g.get(hash).cloned(),
            Err(p) => p.into_inner().get(hash).cloned(),
        }
    }
}

/// Authenticates a request: `Authorization: Bearer <key or job token>` first, then the SSO
/// header from a trusted proxy. Every refusal says what to send instead; the precise reason
/// for a bad token is logged, not sent.
pub fn authenticate(state: &AppState, headers: &HeaderMap, peer: SocketAddr) -> Result<Identity, GatewayError> {
    let sso = &state.config.file.gateway.sso;
    let sso_header = sso.user_header.as_deref().filter(|_| sso.enabled).and_then(|h| headers.get(h).map(|v| (h, v)));
    if let Some(bearer) = bearer(headers) {
        return authenticate_bearer(state, bearer);
    }
    if let Some((name, value)) = sso_header {
        if !trusted(&sso.trusted_proxies, peer.ip()) {
            tracing::warn!(peer = %peer, header = name, "SSO header from an untrusted address ignored");
            return Err(GatewayError::Unauthenticated(format!(
                "the {name} header is only accepted from the site's proxy; send `Authorization: Bearer <API key>` (an admin creates one with `gpuhub keys create`)"
            )));
        }
        let user = value.to_str().unwrap_or("").trim();
        if user.is_empty() || user.len() > 128 || user.chars().any(|c| c.is_control()) {
            return Err(GatewayError::Unauthenticated(format!("the {name} header from the proxy does not hold a user name")));
        }
        return Ok(Identity { user: user.to_string(), app: "sso".into(), ..Identity::default() });
    }
    Err(GatewayError::Unauthenticated(
        "no credentials: send `Authorization: Bearer <API key>` (jobs get one in OPENAI_API_KEY; others ask an admin for `gpuhub keys create`)".into(),
    ))
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(axum::http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

fn trusted(proxies: &[String], ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    proxies.iter().any(|p| p.parse::<IpAddr>().ok() == Some(ip))
}

fn authenticate_bearer(state: &AppState, token: &str) -> Result<Identity, GatewayError> {
    if token.starts_with(gpuhub_wire::token::PREFIX) {
        let Some(key) = state.job_key.as_deref() else {
            tracing::error!("a job token arrived but the job-credential key could not be read at start");
            return Err(GatewayError::Unauthenticated(
                "job tokens cannot be checked on this node right now (the agent's key is missing); use an API key".into(),
            ));
        };
        return match gpuhub_wire::token::verify(key, token, crate::util::now_s()) {
            Ok(c) => Ok(Identity { user: c.user, app: "job".into(), job_id: Some(i64::from(c.job_id)), models: Vec::new(), key_id: None }),
            Err(gpuhub_wire::token::TokenError::Expired) => Err(GatewayError::Unauthenticated(
                "this job token has expired (it is valid for the job's time limit); start a new job or use an API key".into(),
            )),
            Err(e) => {
                tracing::warn!(reason = ?e, "job token refused");
                Err(GatewayError::Unauthenticated("invalid job token (it must come from a job on this node, unchanged)".into()))
            }
        };
    }
    match state.gateway.keys.get(&hash_key(token)) {
        Some(k) if k.revoked_us.is_none() => Ok(Identity { user: k.user, app: k.app, job_id: None, models: k.models, key_id: Some(k.id) }),
        Some(k) => Err(GatewayError::Unauthenticated(format!(
            "API key {} ({}/{}) was revoked; ask an admin for a new one (`gpuhub keys create`)",
            k.id, k.user, k.app
        ))),
        None => {
            Err(GatewayError::Unauthenticated("invalid API key; ask an admin for one (`gpuhub keys create --user USER --app APP`)".into()))
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_hashed() {
        let (a, b) = (new_key(), new_key());
        assert_ne!(a, b);
        assert!(a.starts_with(KEY_PREFIX) && a.len() == 44);
        assert_eq!(hash_key(&a).len(), 64);
        assert_ne!(hash_key(&a), a);
    }

    #[test]
    fn bearer_parsing() {
        let mut h = HeaderMap::new();
        h.insert("authorization", "bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&h), Some("abc"));
        h.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "Bearer ".parse().unwrap());
        assert_eq!(bearer(&h), None);
    }

    #[test]
    fn proxies_match_v4_mapped() {
        let p = vec!["127.0.0.2".to_string()];
        assert!(trusted(&p, "127.0.0.2".parse().unwrap()));
        assert!(trusted(&p, "::ffff:127.0.0.2".parse().unwrap()));
        assert!(!trusted(&p, "127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn allow_list() {
        let id = Identity { user: "a".into(), app: "x".into(), models: vec!["m1".into()], key_id: Some("k".into()), ..Identity::default() };
        assert!(id.check_model("m1", Some("m1")).is_ok());
        assert!(id.check_model("old", Some("m1")).is_ok());
        let e = id.check_model("m2", Some("m2")).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
        assert!(Identity::default().check_model("any", None).is_ok());
    }
}
