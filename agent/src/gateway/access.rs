//! Who may use what at this gateway: `[gateway.user_models]` (each user's allow-list of
//! models) and `gateway.keys_per_user` (how many keys a user may create). Read at start and
//! again by `gpuhub models reload` (SIGHUP): every call and every key creation after a reload
//! reads the new lists. A key created earlier keeps its own `--models`, and its user's
//! allow-list applies on top of them, so narrowing a user's list takes effect for their
//! existing keys at once.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, RwLock};

use crate::config::{GatewayConfig, UserName};

/// The settings as last read.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AccessLists {
    pub user_models: BTreeMap<UserName, Vec<String>>,
    pub keys_per_user: u32,
}

impl AccessLists {
    pub fn of(gateway: &GatewayConfig) -> AccessLists {
        AccessLists { user_models: gateway.user_models.clone(), keys_per_user: gateway.keys_per_user }
    }

    /// The allow-list of `user`, if `[gateway.user_models]` has one.
    pub fn user_models_of(&self, user: &str) -> Option<&[String]> {
        self.user_models.get(user).map(Vec::as_slice)
    }
}

/// The gateway's current [`AccessLists`], replaced whole on a reload.
#[derive(Debug)]
pub struct Access {
    now: RwLock<Arc<AccessLists>>,
}

impl Access {
    pub fn new(gateway: &GatewayConfig) -> Access {
        Access { now: RwLock::new(Arc::new(AccessLists::of(gateway))) }
    }

    /// The lists now (a snapshot: a reload meanwhile does not change it).
    pub fn get(&self) -> Arc<AccessLists> {
        self.now.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Applies the lists of `gateway` (as read again); whether they changed.
    pub fn set(&self, gateway: &GatewayConfig) -> bool {
        let new = AccessLists::of(gateway);
        let mut now = self.now.write().unwrap_or_else(PoisonError::into_inner);
        if **now == new {
            return false;
        }
        *now = Arc::new(new);
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_reload_replaces_the_lists_and_says_whether_they_changed() {
        let toml = |lists: &str| {
            Config::from_toml(&format!(
                "[gateway]\n{lists}\n[[models]]\nname = \"a\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n[[models]]\nname = \"b\"\nlauncher = \"static\"\nurl = \"http://127.0.0.1:9\"\n"
            ))
            .unwrap()
            .file
            .gateway
        };
        let access = Access::new(&toml("keys_per_user = 3\n[gateway.user_models]\nalice = [\"a\"]"));
        let before = access.get();
        assert_eq!(
            (before.user_models_of("alice"), before.user_models_of("bob"), before.keys_per_user),
            (Some(&["a".to_string()][..]), None, 3)
        );
        assert!(!access.set(&toml("keys_per_user = 3\n[gateway.user_models]\nalice = [\"a\"]")), "the same lists are no change");
        assert!(access.set(&toml("keys_per_user = 0\n[gateway.user_models]\nalice = [\"a\", \"b\"]\nbob = [\"b\"]")));
        let after = access.get();
        assert_eq!(after.user_models_of("alice").map(<[String]>::len), Some(2));
        assert_eq!((after.user_models_of("bob").map(<[String]>::len), after.keys_per_user), (Some(1), 0));
        assert_eq!(before.keys_per_user, 3, "a snapshot taken before the reload is unchanged");
    }
}
