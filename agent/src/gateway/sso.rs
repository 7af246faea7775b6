//! The proof that an SSO header comes from the site's proxy (`[gateway.sso]`).
//!
//! Every user on the node reaches the gateway from 127.0.0.1 and can send any header, so the
//! header alone, or with a loopback (or other local) peer address, proves nothing; the
//! configuration refuses that (`config/gateway.rs`). A call's `user_header` is believed when:
//! - it came on the Unix socket `gateway.sso.socket` from a uid in `socket_users` (the kernel
//!   reports the peer's uid, SO_PEERCRED); or
//! - it carries the shared secret in `secret_header` (compared as SHA-256 digests, in constant
//!   time), from an address in `trusted_proxies` if that list is set; or
//! - no secret is configured and the peer address is in `trusted_proxies` (allowed only for
//!   addresses of other machines).
//!
//! The secret is read at start from `shared_secret_file`, which must be a regular file that
//! no one but its owner (root, or the agent's user) can read: a secret users can read lets
//! them claim to be anyone.

use std::net::IpAddr;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use axum::http::{HeaderMap, HeaderName};
use sha2::{Digest, Sha256};

use super::server::Peer;
use crate::config::SsoConfig;

/// Largest secret file read.
const MAX_SECRET_FILE: u64 = 4096;

/// Why the proxy's proof could not be set up at start.
#[derive(Debug, thiserror::Error)]
pub enum SsoError {
    #[error("gateway.sso.shared_secret_file {path}: {problem}")]
    SecretFile { path: String, problem: String },
    #[error("gateway.sso.socket_users: no user `{0}` on this node (use a user name from /etc/passwd or a numeric uid)")]
    UnknownUser(String),
}

/// What proves the proxy, ready to check each call.
#[derive(Debug, Default)]
pub struct SsoProof {
    enabled: bool,
    user_header: Option<HeaderName>,
    secret_header: Option<HeaderName>,
    /// SHA-256 of the shared secret.
    secret: Option<[u8; 32]>,
    proxies: Vec<IpAddr>,
    socket_uids: Vec<u32>,
}

/// Why a call's SSO header was not believed (logged; the client gets a general refusal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// A TCP peer that is not one of `trusted_proxies`.
    Address,
    /// No secret header, or a wrong one.
    Secret,
    /// A Unix-socket peer whose uid is not in `socket_users`, without a secret.
    Uid,
}

impl SsoProof {
    /// Reads the secret file and resolves `socket_users`; the configuration is validated.
    pub fn load(cfg: &SsoConfig) -> Result<SsoProof, SsoError> {
        if !cfg.enabled {
            return Ok(SsoProof::default());
        }
        let secret = match (&cfg.shared_secret_file, &cfg.shared_secret) {
            (Some(path), _) => Some(digest(read_secret_file(path)?.as_bytes())),
            (None, Some(s)) => Some(digest(s.expose().trim().as_bytes())),
            (None, None) => None,
        };
        let mut socket_uids = Vec::new();
        for u in &cfg.socket_users {
            let uid = match u.parse::<u32>() {
                Ok(uid) => uid,
                Err(_) => crate::control::peer::uid_of(u).ok_or_else(|| SsoError::UnknownUser(crate::util::sanitize(u)))?,
            };
            socket_uids.push(uid);
        }
        Ok(SsoProof {
            enabled: true,
            user_header: cfg.user_header.as_deref().and_then(|h| HeaderName::from_bytes(h.as_bytes()).ok()),
            secret_header: HeaderName::from_bytes(cfg.secret_header.as_bytes()).ok(),
            secret,
            proxies: cfg.trusted_proxies.iter().filter_map(|p| p.parse().ok()).collect(),
            socket_uids,
        })
    }

    /// The SSO header of this call, if SSO is on and the call carries one.
    pub fn header<'h>(&self, headers: &'h HeaderMap) -> Option<(&HeaderName, &'h axum::http::HeaderValue)> {
        let name = self.user_header.as_ref().filter(|_| self.enabled)?;
        headers.get(name).map(|v| (name, v))
    }

    /// Whether the call proves it comes from the proxy.
    pub fn check(&self, headers: &HeaderMap, peer: &Peer) -> Result<(), Rejected> {
        match peer {
            Peer::Unix { uid, .. } if self.socket_uids.contains(uid) => return Ok(()),
            Peer::Unix { .. } if self.secret.is_none() => return Err(Rejected::Uid),
            Peer::Unix { .. } => {}
            Peer::Tcp(addr) => {
                if !self.proxies.is_empty() && !self.proxies.contains(&addr.ip().to_canonical()) {
                    return Err(Rejected::Address);
                }
                if self.secret.is_none() {
                    // Validation allows this only for addresses of other machines.
                    return if self.proxies.is_empty() { Err(Rejected::Secret) } else { Ok(()) };
                }
            }
        }
        let (Some(want), Some(name)) = (&self.secret, &self.secret_header) else { return Err(Rejected::Secret) };
        let got = headers.get(name).map(|v| digest(v.as_bytes()));
        match got {
            Some(got) if equal(&got, want) => Ok(()),
            _ => Err(Rejected::Secret),
        }
    }
}

fn digest(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// Compares two digests in time independent of where they differ.
fn equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let mut diff = 0u8;
    for (x, y) in a.iter().zip(b) {
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

/// The secret in `path`, surrounding whitespace removed (so `echo SECRET > file` works), after
/// checking that nobody else can read it.
fn read_secret_file(path: &Path) -> Result<String, SsoError> {
    let bad = |problem: String| SsoError::SecretFile { path: path.display().to_string(), problem };
    let meta =
        std::fs::metadata(path).map_err(|e| bad(format!("{e}; create it: (umask 077; openssl rand -hex 32 > {})", path.display())))?;
    if !meta.is_file() {
        return Err(bad("is not a regular file".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != 0 && meta.uid() != me {
        return Err(bad(format!(
            "is owned by uid {}: only root (or the agent's user) may own the secret; chown root {}",
            meta.uid(),
            path.display()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(format!(
            "has mode {:o}: other users could read the secret and claim to be anyone; chmod 600 {}",
            meta.mode() & 0o777,
            path.display()
        )));
    }
    if meta.len() > MAX_SECRET_FILE {
        return Err(bad(format!("holds {} bytes; a secret file holds one line of at most {MAX_SECRET_FILE} bytes", meta.len())));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(format!("cannot be read as text: {e}")))?;
    let secret = text.trim();
    if secret.len() < 16 {
        return Err(bad(format!("holds {} bytes; use at least 16 random bytes (openssl rand -hex 32)", secret.len())));
    }
    Ok(secret.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn cfg(toml_text: &str) -> SsoConfig {
        crate::config::Config::from_toml(&format!("[gateway.sso]\nenabled = true\nuser_header = \"X-Forwarded-User\"\n{toml_text}"))
            .unwrap()
            .file
            .gateway
            .sso
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_secret_proves_the_proxy_and_an_address_on_this_node_does_not() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("secret");
        std::fs::write(&f, "0123456789abcdef0123\n").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        let p = SsoProof::load(&cfg(&format!("shared_secret_file = \"{}\"", f.display()))).unwrap();
        let lo = Peer::Tcp("127.0.0.1:5000".parse().unwrap());
        assert_eq!(p.check(&headers(&[("x-forwarded-user", "root")]), &lo), Err(Rejected::Secret));
        assert_eq!(p.check(&headers(&[("x-gpuhub-proxy-secret", "0123456789abcdef0124")]), &lo), Err(Rejected::Secret));
        assert_eq!(p.check(&headers(&[("x-gpuhub-proxy-secret", "0123456789abcdef0123")]), &lo), Ok(()));
        // trusted_proxies narrows who may send it, secret or not.
        let p = SsoProof::load(&cfg(&format!("shared_secret_file = \"{}\"\ntrusted_proxies = [\"127.0.0.2\"]", f.display()))).unwrap();
        assert_eq!(p.check(&headers(&[("x-gpuhub-proxy-secret", "0123456789abcdef0123")]), &lo), Err(Rejected::Address));
        let lo2 = Peer::Tcp("[::ffff:127.0.0.2]:1".parse().unwrap());
        assert_eq!(p.check(&headers(&[("x-gpuhub-proxy-secret", "0123456789abcdef0123")]), &lo2), Ok(()));
    }

    #[test]
    fn a_unix_socket_peer_is_checked_by_uid() {
        let p = SsoProof::load(&cfg("socket = \"/run/gpuhub/sso.sock\"\nsocket_users = [\"root\", \"4242\"]")).unwrap();
        assert_eq!(p.socket_uids, vec![0, 4242]);
        let h = headers(&[("x-forwarded-user", "alice")]);
        assert_eq!(p.check(&h, &Peer::Unix { uid: 4242, gid: 1, pid: None }), Ok(()));
        assert_eq!(p.check(&h, &Peer::Unix { uid: 1000, gid: 1, pid: None }), Err(Rejected::Uid));
        assert_eq!(p.check(&h, &Peer::Tcp("127.0.0.1:1".parse().unwrap())), Err(Rejected::Secret));
        let e = SsoProof::load(&cfg("socket = \"/run/s.sock\"\nsocket_users = [\"no-such-user-gpuhub\"]")).unwrap_err();
        assert!(e.to_string().contains("no user `no-such-user-gpuhub`"), "{e}");
    }

    #[test]
    fn a_secret_file_others_can_read_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("secret");
        std::fs::write(&f, "0123456789abcdef0123").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = SsoProof::load(&cfg(&format!("shared_secret_file = \"{}\"", f.display()))).unwrap_err().to_string();
        assert!(e.contains("mode 644") && e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&f, "short\n").unwrap();
        let e = SsoProof::load(&cfg(&format!("shared_secret_file = \"{}\"", f.display()))).unwrap_err().to_string();
        assert!(e.contains("at least 16"), "{e}");
        let e = SsoProof::load(&cfg(&format!("shared_secret_file = \"{}/missing\"", dir.path().display()))).unwrap_err().to_string();
        assert!(e.contains("openssl rand"), "{e}");
    }

    #[test]
    fn digests_compare_equal_only_when_equal() {
        let (a, b) = (digest(b"x"), digest(b"y"));
        assert!(equal(&a, &a) && !equal(&a, &b));
    }
}
