//! The per-job gateway credential.
//!
//! Format: `ghj1.<uid>.<user>.<job_id>.<expires_unix>.<hmac-sha256 hex>`; the MAC covers
//! everything before the last dot. The user name may itself contain dots (`john.doe`): a token
//! is parsed from both ends (prefix and uid from the left; MAC, expiry and job id from the
//! right; the user is what remains), so the format is unchanged and every token minted before
//! still verifies.
//!
//! The key is a root-only file on the node (see `paths::JOB_KEY_FILE_NAME`), created by the
//! agent; the plugin mints tokens in a hook that runs as root (REMOTE `init_post_opt`) and
//! injects them as `GPUHUB_TOKEN` and, unless the user set one, `OPENAI_API_KEY`. Both sides
//! turn the file's bytes into the key with [`parse_key`], so they cannot disagree about it.
//!
//! Threat model (short; `docs/security.md` has the whole of it): the token proves "this call
//! comes from job J of uid N on this node until T". uid and job id come from Slurm
//! (`spank_get_item`), the user name from the password database for that uid; the gateway
//! takes the uid as authoritative (the name must match the uid's passwd entry there too) and
//! refuses the token once the job has ended. Anyone who can read the job's environment (the
//! user, root) can replay it while the job runs; that is the same trust boundary as the job
//! itself. Users cannot mint tokens: the key is 0600 root.

use std::fmt;

use hmac::{Hmac, Mac};
use sha2::Sha256;

pub const PREFIX: &str = "ghj1";

/// Shortest accepted key, after trimming.
pub const MIN_KEY_BYTES: usize = 16;

/// Longest user name a token carries (also the cap for user names in records).
pub const MAX_USER_BYTES: usize = 64;

/// What a valid job token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobClaims {
    pub uid: u32,
    pub user: String,
    pub job_id: u32,
    pub expires: i64,
}

/// Why a key file's contents cannot be a job key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyError {
    /// Fewer than [`MIN_KEY_BYTES`] bytes once whitespace at both ends is removed.
    TooShort { len: usize },
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyError::TooShort { len } => write!(
                f,
                "holds {len} bytes besides leading/trailing whitespace; a job key needs at least {MIN_KEY_BYTES} \
                 (fix: remove the file and restart gpuhub-agent, which creates a new key)"
            ),
        }
    }
}

impl std::error::Error for KeyError {}

/// The job key in a key file's bytes: ASCII whitespace at both ends is not part of it (so
/// `echo KEY > file` works), and what remains must be at least [`MIN_KEY_BYTES`] long. The
/// plugin (signing) and the agent (verifying) both call this on the raw file contents.
pub fn parse_key(raw: &[u8]) -> Result<Vec<u8>, KeyError> {
    let key = raw.trim_ascii();
    if key.len() < MIN_KEY_BYTES {
        return Err(KeyError::TooShort { len: key.len() });
    }
    Ok(key.to_vec())
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

/// Whether a user name can be carried in a token: 1 to [`MAX_USER_BYTES`] bytes of ASCII
/// letters, digits and `. _ - @` (dots included: `john.doe`).
pub fn user_ok(user: &str) -> bool {
    !user.is_empty() && user.len() <= MAX_USER_BYTES && user.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b))
}

/// Mints a token. Returns `None` for a user name that cannot be carried safely or a key
/// shorter than [`MIN_KEY_BYTES`].
pub fn mint(key: &[u8], claims: &JobClaims) -> Option<String> {
    if !user_ok(&claims.user) || key.len() < MIN_KEY_BYTES {
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

/// Splits `ghj1.<uid>.<user>.<job>.<exp>` from both ends: the user is whatever lies between
/// the uid and the job id, dots included.
fn parse_body(body: &str) -> Option<JobClaims> {
    let rest = body.strip_prefix(PREFIX)?.strip_prefix('.')?;
    let (uid, rest) = rest.split_once('.')?;
    let (rest, exp) = rest.rsplit_once('.')?;
    let (user, job) = rest.rsplit_once('.')?;
    let all_digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !(all_digits(uid) && all_digits(job) && all_digits(exp)) {
        return None;
    }
    Some(JobClaims { uid: uid.parse().ok()?, user: user.to_string(), job_id: job.parse().ok()?, expires: exp.parse().ok()? })
}

/// Verifies a token against the key at time `now` (Unix seconds).
pub fn verify(key: &[u8], token: &str, now: i64) -> Result<JobClaims, TokenError> {
    if !token.starts_with("ghj1.") {
        return Err(TokenError::NotAJobToken);
    }
    let (body, sig) = token.rsplit_once('.').ok_or(TokenError::Malformed)?;
    let claims = parse_body(body).ok_or(TokenError::Malformed)?;
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

    fn claims(user: &str) -> JobClaims {
        JobClaims { uid: 1000, user: user.into(), job_id: 7, expires: 100 }
    }

    #[test]
    fn round_trip_and_tamper() {
        let c = claims("alice");
        let t = mint(KEY, &c).unwrap();
        assert_eq!(verify(KEY, &t, 50), Ok(c));
        assert_eq!(verify(KEY, &t, 101), Err(TokenError::Expired));
        let forged = t.replace(".alice.", ".mallory");
        assert!(verify(KEY, &forged, 50).is_err());
        let renamed = t.replace(".alice.", ".bob.");
        assert_eq!(verify(KEY, &renamed, 50), Err(TokenError::BadSignature));
        let other_job = t.replacen(".7.", ".8.", 1);
        assert_eq!(verify(KEY, &other_job, 50), Err(TokenError::BadSignature));
        assert_eq!(verify(b"another key, 32 bytes long.....", &t, 50), Err(TokenError::BadSignature));
        assert_eq!(verify(KEY, "sk-abc", 50), Err(TokenError::NotAJobToken));
        assert!(mint(KEY, &claims("a.b;rm")).is_none());
        assert!(mint(KEY, &claims("")).is_none());
        assert!(mint(KEY, &claims(&"a".repeat(MAX_USER_BYTES + 1))).is_none());
        assert!(mint(KEY, &claims("a\nb")).is_none());
        assert!(mint(b"short", &claims("alice")).is_none());
    }

    #[test]
    fn dotted_user_names_round_trip() {
        for user in ["john.doe", "a.b.c", "x.1.2", ".lead", "trail.", "j.doe@ad.example"] {
            let c = claims(user);
            let t = mint(KEY, &c).unwrap();
            assert_eq!(verify(KEY, &t, 50), Ok(c), "{user}: {t}");
        }
        // A token whose user part has been shifted into the job id or expiry does not parse
        // to different claims: the MAC covers the whole body.
        let t = mint(KEY, &claims("john.7")).unwrap();
        assert_eq!(verify(KEY, &t, 50).unwrap().user, "john.7");
    }

    #[test]
    fn malformed_bodies_are_refused() {
        for body in
            ["ghj1", "ghj1.", "ghj1.1000.7.100", "ghj1.x.alice.7.100", "ghj1.1000.alice.7x.100", "ghj1.1000.alice.7.", "ghj1..alice.7.100"]
        {
            let t = format!("{body}.{}", mac(KEY, body));
            assert_eq!(verify(KEY, &t, 50), Err(TokenError::Malformed), "{body}");
        }
        let t = format!("ghj1.1000..7.100.{}", mac(KEY, "ghj1.1000..7.100"));
        assert_eq!(verify(KEY, &t, 50), Err(TokenError::Malformed), "empty user");
    }

    #[test]
    fn key_file_contents_are_read_the_same_everywhere() {
        let k = b"0123456789abcdef0123456789abcdef";
        assert_eq!(parse_key(k).unwrap(), k);
        assert_eq!(parse_key(b"0123456789abcdef0123456789abcdef\n").unwrap(), k, "echo KEY > file");
        assert_eq!(parse_key(b" \t0123456789abcdef0123456789abcdef\r\n\n").unwrap(), k);
        assert_eq!(parse_key(b"0123456789abcdef").unwrap().len(), MIN_KEY_BYTES);
        assert_eq!(parse_key(b"0123456789abcde\n"), Err(KeyError::TooShort { len: 15 }));
        assert_eq!(parse_key(b"\n\n   \n"), Err(KeyError::TooShort { len: 0 }));
        assert!(parse_key(b"").unwrap_err().to_string().contains("at least 16"));
        // A token minted with the key from a file with a newline verifies with the same
        // file's key: this is what broke every token before.
        let signer = parse_key(b"0123456789abcdef0123456789abcdef\n").unwrap();
        let verifier = parse_key(b"0123456789abcdef0123456789abcdef\n").unwrap();
        let t = mint(&signer, &claims("alice")).unwrap();
        assert!(verify(&verifier, &t, 50).is_ok());
    }
}
