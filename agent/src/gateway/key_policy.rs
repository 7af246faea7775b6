//! Who may create, see and revoke which gateway API key, and what a new key may carry.
//!
//! Self-service: any user on the node manages their own keys through the control socket, named
//! by the kernel (SO_PEERCRED, [`crate::control::Caller`]), never by an argument. Admins manage
//! everyone's. A key can only narrow what its user has: its `--models` must be within the
//! user's allow-list (`[gateway.user_models]`), and its `--rpm` / `--tokens-per-day` at most the
//! user's own limits (`[gateway.limits]`): a larger one is refused (not capped), since the
//! user's limit applies to every key of theirs anyway and a larger number would only mislead.

use axum::http::StatusCode;

use crate::control::Caller;
use crate::store::gateway::ApiKeyRecord;

/// Why a key operation is refused; every message names the thing and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyPolicyError {
    #[error(
        "you (`{caller}`) can create keys only for yourself, not for `{user}`: leave out --user (the key is then yours); an admin can create keys for anyone"
    )]
    NotYourUser { caller: String, user: String },
    #[error(
        "key `{id}` is not yours: you (`{caller}`) can see, change and revoke only your own keys (`gpuhub keys list` shows them); an admin can change or revoke any key"
    )]
    NotYourKey { id: String, caller: String },
    #[error(
        "--models: `{model}` is not allowed for `{user}`: the allow-list gateway.user_models.{user} permits only {allowed}; a key can only narrow its user's models (an admin can extend the allow-list)"
    )]
    ModelNotAllowed { user: String, model: String, allowed: String },
    #[error(
        "--{flag} {asked} is above the limit of `{user}`, {limit} {unit} (gateway.limits); a key's limits can only be tighter than its user's: use --{flag} {limit} or less, or leave it out (the user's limit applies to the key anyway)"
    )]
    AboveUserLimit { flag: &'static str, user: String, asked: u64, limit: u64, unit: &'static str },
    #[error(
        "you (`{user}`) have {active} active keys, the most a user may hold from creating their own (gateway.keys_per_user = {max}); revoke one with `gpuhub keys revoke ID` first (`gpuhub keys list` shows them), or ask an admin"
    )]
    TooManyKeys { user: String, active: usize, max: u32 },
    #[error(
        "users cannot create their own keys on this node (gateway.keys_per_user = 0); ask an admin for `gpuhub keys create --user {user}`"
    )]
    SelfServiceOff { user: String },
}

impl KeyPolicyError {
    pub fn status(&self) -> StatusCode {
        match self {
            KeyPolicyError::NotYourUser { .. } | KeyPolicyError::NotYourKey { .. } | KeyPolicyError::SelfServiceOff { .. } => {
                StatusCode::FORBIDDEN
            }
            KeyPolicyError::TooManyKeys { .. } => StatusCode::CONFLICT,
            KeyPolicyError::ModelNotAllowed { .. } | KeyPolicyError::AboveUserLimit { .. } => StatusCode::BAD_REQUEST,
        }
    }
}

/// The user a new key is for: `asked` (`--user`) or, without it, the caller. Non-admins get
/// keys only for themselves.
pub fn owner(caller: &Caller, asked: Option<&str>) -> Result<String, KeyPolicyError> {
    match asked {
        None => Ok(caller.user.clone()),
        Some(u) if caller.admin || u == caller.user => Ok(u.to_string()),
        Some(u) => Err(KeyPolicyError::NotYourUser { caller: caller.user.clone(), user: crate::util::sanitize(u) }),
    }
}

/// A non-admin creating their own key: self-service must be on and they must be under
/// `max` active keys (`keys`: theirs, revoked ones included).
pub fn check_count(caller: &Caller, keys: &[ApiKeyRecord], max: u32) -> Result<(), KeyPolicyError> {
    if caller.admin {
        return Ok(());
    }
    if max == 0 {
        return Err(KeyPolicyError::SelfServiceOff { user: caller.user.clone() });
    }
    let active = keys.iter().filter(|k| k.user == caller.user && k.revoked_us.is_none()).count();
    if active >= max as usize {
        return Err(KeyPolicyError::TooManyKeys { user: caller.user.clone(), active, max });
    }
    Ok(())
}

/// Each of the key's models must be in the user's allow-list (`allow`, if they have one), by
/// its name or by what it resolves to (`resolve`: catalog name of a name or alias).
pub fn check_models(
    user: &str,
    models: &[String],
    allow: Option<&[String]>,
    resolve: impl Fn(&str) -> Option<String>,
) -> Result<(), KeyPolicyError> {
    let Some(allow) = allow else { return Ok(()) };
    for m in models {
        let resolved = resolve(m);
        let ok = allow.iter().any(|a| a == m || Some(a) == resolved.as_ref() || resolve(a).is_some_and(|r| Some(r) == resolved));
        if !ok {
            return Err(KeyPolicyError::ModelNotAllowed {
                user: user.to_string(),
                model: crate::util::sanitize(m),
                allowed: allow.join(", "),
            });
        }
    }
    Ok(())
}

/// The key's own limits must not exceed its user's (`user_limits`: rpm, tokens per day; 0 =
/// none).
pub fn check_limits(user: &str, rpm: Option<u32>, tokens_per_day: Option<u64>, user_limits: (u32, u64)) -> Result<(), KeyPolicyError> {
    let (user_rpm, user_tpd) = user_limits;
    if let Some(r) = rpm
        && user_rpm > 0
        && r > user_rpm
    {
        return Err(KeyPolicyError::AboveUserLimit {
            flag: "rpm",
            user: user.to_string(),
            asked: u64::from(r),
            limit: u64::from(user_rpm),
            unit: "requests per minute",
        });
    }
    if let Some(t) = tokens_per_day
        && user_tpd > 0
        && t > user_tpd
    {
        return Err(KeyPolicyError::AboveUserLimit {
            flag: "tokens-per-day",
            user: user.to_string(),
            asked: t,
            limit: user_tpd,
            unit: "tokens per day",
        });
    }
    Ok(())
}

/// Whether the caller may see and revoke `key`: their own, or any for admins.
pub fn check_owner(caller: &Caller, key: &ApiKeyRecord) -> Result<(), KeyPolicyError> {
    if caller.admin || key.user == caller.user {
        Ok(())
    } else {
        Err(KeyPolicyError::NotYourKey { id: key.id.clone(), caller: caller.user.clone() })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn caller(user: &str, admin: bool) -> Caller {
        Caller { uid: 1000, user: user.into(), admin }
    }

    fn key(id: &str, user: &str, revoked: bool) -> ApiKeyRecord {
        ApiKeyRecord {
            id: id.into(),
            key_hash: format!("h{id}"),
            prefix: "ghk_".into(),
            user: user.into(),
            app: "a".into(),
            models: vec![],
            created_us: 1,
            created_by: user.into(),
            revoked_us: revoked.then_some(2),
            rpm: None,
            tokens_per_day: None,
        }
    }

    #[test]
    fn a_user_creates_keys_only_for_themselves_admins_for_anyone() {
        let alice = caller("alice", false);
        assert_eq!(owner(&alice, None).unwrap(), "alice");
        assert_eq!(owner(&alice, Some("alice")).unwrap(), "alice");
        let e = owner(&alice, Some("bob")).unwrap_err();
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        assert!(e.to_string().contains("you (`alice`) can create keys only for yourself, not for `bob`: leave out --user"), "{e}");
        let root = caller("root", true);
        assert_eq!(owner(&root, Some("bob")).unwrap(), "bob");
        assert_eq!(owner(&root, None).unwrap(), "root");
    }

    #[test]
    fn a_user_sees_and_revokes_only_their_own_keys() {
        let alice = caller("alice", false);
        assert!(check_owner(&alice, &key("k1", "alice", false)).is_ok());
        let e = check_owner(&alice, &key("k2", "bob", false)).unwrap_err();
        assert_eq!(e.status(), StatusCode::FORBIDDEN);
        let m = e.to_string();
        assert!(m.contains("key `k2` is not yours: you (`alice`)") && m.contains("an admin can change or revoke any key"), "{m}");
        assert!(!m.contains("bob"), "the refusal does not say whose key it is: {m}");
        assert!(check_owner(&caller("root", true), &key("k2", "bob", false)).is_ok());
    }

    #[test]
    fn self_service_is_bounded_by_active_keys() {
        let alice = caller("alice", false);
        let keys = vec![key("k1", "alice", false), key("k2", "alice", true), key("k3", "bob", false)];
        assert!(check_count(&alice, &keys, 2).is_ok(), "one active key of 2; the revoked one does not count");
        let e = check_count(&alice, &keys, 1).unwrap_err();
        assert_eq!(e.status(), StatusCode::CONFLICT);
        assert!(e.to_string().contains("have 1 active keys") && e.to_string().contains("gpuhub keys revoke"), "{e}");
        let e = check_count(&alice, &[], 0).unwrap_err();
        assert!(e.to_string().contains("gateway.keys_per_user = 0") && e.to_string().contains("--user alice"), "{e}");
        assert!(check_count(&caller("root", true), &keys, 0).is_ok(), "admins are not limited");
    }

    #[test]
    fn a_key_narrows_its_users_models() {
        // "chat" is an alias of "demo-chat".
        let resolve = |m: &str| match m {
            "chat" | "demo-chat" => Some("demo-chat".to_string()),
            "ocr" => Some("ocr".to_string()),
            _ => None,
        };
        let allow = vec!["chat".to_string()];
        assert!(check_models("alice", &["demo-chat".into(), "chat".into()], Some(&allow), resolve).is_ok());
        let e = check_models("alice", &["demo-chat".into(), "ocr".into()], Some(&allow), resolve).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(
            e.to_string().contains("`ocr` is not allowed for `alice`: the allow-list gateway.user_models.alice permits only chat"),
            "{e}"
        );
        assert!(check_models("bob", &["ocr".into()], None, resolve).is_ok(), "no allow-list: every model");
    }

    #[test]
    fn a_keys_limits_are_at_most_its_users() {
        assert!(check_limits("alice", Some(5), Some(100), (5, 100)).is_ok());
        let e = check_limits("alice", Some(6), None, (5, 0)).unwrap_err();
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        assert!(e.to_string().contains("--rpm 6 is above the limit of `alice`, 5 requests per minute (gateway.limits)"), "{e}");
        assert!(e.to_string().contains("use --rpm 5 or less"), "{e}");
        let e = check_limits("alice", None, Some(101), (0, 100)).unwrap_err();
        assert!(e.to_string().contains("--tokens-per-day 101 is above the limit of `alice`, 100 tokens per day"), "{e}");
        assert!(check_limits("alice", Some(1_000_000), Some(u64::MAX), (0, 0)).is_ok(), "no user limit: any");
    }
}
