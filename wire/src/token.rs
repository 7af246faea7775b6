//! The per-job gateway credential.
//!
//! Format: `ghj1.<uid>.<user>.<job_id>.<expires_unix>.<hmac-sha256 hex>`; the MAC covers
//! everything before the last dot. The key is a root-only file on the node (see
//! `paths::JOB_KEY_FILE_NAME`), created by the agent; the plugin mints tokens in a hook that
//! runs as root (REMOTE `init_post_opt`) and injects them as `GPUHUB_TOKEN` and, unless the
//! user set one, `OPENAI_API_KEY`.
//!
//! Threat model (short; `docs/security.md` has the whole of it): the token proves "this call
//! comes from job J of user U on this node until T". Anyone who can read the job's environment
//! (the user, root) can replay it until it expires; that is the same trust boundary as the
//! job itself. Users cannot mint tokens: the key is 0600 root. Tokens are bound to one node's
//! key, carry no privileges beyond attribution and the user's own model allow-list, and
//! expire (job time limit + margin, capped).

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const PREFIX: &str = "ghj1";

/// What a valid job token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobClaims {
    pub uid: u32,
    pub user: String,
    pub job_id: u32,
    pub expires: i64,
}

fn mac(key: &[u8], body: &str) -> String {
    // HMAC accepts keys of any length; `new_from_slice` cannot fail for it.
    match Hmac::<Sha256>::new_from_slice(key) {
        Ok(mut m) => {
            m.update(body.as_bytes());
            hex::encode(m.finalize().into_bytes())
        }
        Err(_) => String::new(),
    }
}

fn user_ok(user: &str) -> bool {
    !user.is_empty() && user.len() <= 64 && user.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Mints a token. Returns `None` for a user name that cannot be carried safely.
pub fn mint(key: &[u8], claims: &JobClaims) -> Option<String> {
    if !user_ok(&claims.user) || key.len() < 16 {
        return None;
    }
    let body = format!("{PREFIX}.{}.{}.{}.{}", claims.uid, claims.user, claims.job_id, claims.expires);
    let sig = mac(key, &body);
    Some(format!("{body}.{sig}"))
}

/// Why a token was refused (the gateway turns these into 401s; the reason is logged, not sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenError {
    NotAJobToken,
    Malformed,
    BadSignature,
    Expired,
}

/// Verifies a token against the key at time `now` (Unix seconds).
pub fn verify(key: &[u8], token: &str, now: i64) -> Result<JobClaims, TokenError> {
    if !token.starts_with("ghj1.") {
        return Err(TokenError::NotAJobToken);
    }
    let (body, sig) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
    let parts: Vec<&str> = body.split('.').collect();
    let [_, uid, user, job, exp] = parts.as_slice() else {
        return Err(TokenError::Malformed);
    };
    let claims = JobClaims {
        uid: uid.parse().map_err(|_| TokenError::Malformed)?,
        user: (*user).to_string(),
        job_id: job.parse().map_err(|_| TokenError::Malformed)?,
        expires: exp.parse().map_err(|_| TokenError::Malformed)?,
    };
    if !user_ok(&claims.user) {
        return Err(TokenError::Malformed);
    }
    let expected = mac(key, body);
    if expected.is_empty() || !constant_time_eq(expected.as_bytes(), sig.as_bytes()) {
        return Err(TokenError::BadSignature);
    }
    if claims.expires < now {
        return Err(TokenError::Expired);
    }
    Ok(claims)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &[u8] = b"0123456789abcdef0123456789abcdef";

    #[test]
    fn round_trip_and_tamper() {
        let c = JobClaims { uid: 1000, user: "alice".into(), job_id: 7, expires: 100 };
        let t = mint(KEY, &c).unwrap();
        assert_eq!(verify(KEY, &t, 50), Ok(c));
        assert_eq!(verify(KEY, &t, 101), Err(TokenError::Expired));
        let forged = t.replace(".alice.", ".mallory");
        assert!(verify(KEY, &forged, 50).is_err());
        let other_job = t.replacen(".7.", ".8.", 1);
        assert_eq!(verify(KEY, &other_job, 50), Err(TokenError::BadSignature));
        assert_eq!(verify(b"another key, 32 bytes long.....", &t, 50), Err(TokenError::BadSignature));
        assert_eq!(verify(KEY, "sk-abc", 50), Err(TokenError::NotAJobToken));
        assert!(
            mint(KEY, &JobClaims { user: "a.b;rm".into(), ..JobClaims { uid: 0, user: String::new(), job_id: 0, expires: 0 } }).is_none()
        );
    }
}
