//! Who is calling: API keys (only their SHA-256 is stored), per-job tokens minted by the SPANK
//! plugin, and an SSO header believed only from a proxy that proves itself ([`super::sso`]).
//!
//! Keys are checked against an in-memory map (loaded at start, updated by `gpuhub keys`), so
//! authentication of a key never touches the store on the request path.
//!
//! Job tokens: the MAC proves the plugin minted it; then the token's uid is authoritative. Its
//! user name must be that uid's name in this node's password database ([`UserNames`], cached),
//! and the job must not have ended ([`JobStates`]: the store's `acct_jobs`, asked at most once
//! per second per job). The user's own allow-list (`[gateway.user_models]`) applies to every
//! credential of that user: API keys, job tokens and the SSO header.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use super::error::GatewayError;
use super::server::Peer;
use super::sso::Rejected;
use crate::AppState;
use crate::store::Store;
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
    /// Models this credential may use (an API key's `--models`); empty = every model.
    pub models: Vec<String>,
    /// Short key id for messages (never the key).
    pub key_id: Option<String>,
    /// The user's own allow-list (`[gateway.user_models]`), applied on top of `models`;
    /// `None` = every model.
    pub user_models: Option<UserModels>,
    /// An API key's own limits (requests per minute, tokens per UTC day), checked on top of
    /// its user's ([`super::fair_use`]).
    pub key_rpm: Option<u32>,
    pub key_tokens_per_day: Option<u64>,
}

/// A user's allow-list and where it is configured (for the 403 message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserModels {
    pub models: Vec<String>,
    /// The config file that holds it.
    pub source: String,
}

fn allows(list: &[String], asked: &str, resolved: Option<&str>) -> bool {
    list.iter().any(|m| m == asked || Some(m.as_str()) == resolved)
}

impl Identity {
    fn credential(&self) -> String {
        match (self.app.as_str(), &self.key_id, self.job_id) {
            ("job", _, Some(j)) => format!("the job token of job {j}"),
            (_, Some(k), _) => format!("API key {k} ({}/{})", self.user, self.app),
            _ => format!("the {} identity", self.app),
        }
    }

    /// Checks the credential's allow-list, then the user's, against the requested and the
    /// resolved name.
    pub fn check_model(&self, asked: &str, resolved: Option<&str>) -> Result<(), GatewayError> {
        if !self.models.is_empty() && !allows(&self.models, asked, resolved) {
            return Err(GatewayError::Forbidden(format!(
                "the API key {} of {}/{} may not use model `{}`; it may use: {} (an admin can create a key with --models)",
                self.key_id.as_deref().unwrap_or("?"),
                self.user,
                self.app,
                crate::util::sanitize(asked),
                self.models.join(", ")
            )));
        }
        if let Some(u) = &self.user_models
            && !allows(&u.models, asked, resolved)
        {
            return Err(GatewayError::Forbidden(format!(
                "user `{}` may not use model `{}` (with any credential; this call came with {}): \
                 the allow-list gateway.user_models.{} in {} permits only: {}; an admin can add the model there",
                self.user,
                crate::util::sanitize(asked),
                self.credential(),
                self.user,
                u.source,
                u.models.join(", ")
            )));
        }
        Ok(())
    }

    /// Whether `GET /v1/models` shows `name` to this caller.
    pub fn may_list(&self, name: &str) -> bool {
        (self.models.is_empty() || self.models.iter().any(|m| m == name))
            && self.user_models.as_ref().is_none_or(|u| u.models.iter().any(|m| m == name))
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
    /// Bumped by every [`KeyCache::upsert`]: a copy read from the store before a local change
    /// must not replace the cache after it.
    generation: AtomicU64,
}

impl KeyCache {
    pub fn replace(&self, records: Vec<ApiKeyRecord>) {
        let map = records.into_iter().map(|r| (r.key_hash.clone(), r)).collect();
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = map;
    }

    /// This agent's own change (create, revoke, edit), after the store has it.
    pub fn upsert(&self, record: ApiKeyRecord) {
        let mut g = self.keys.write().unwrap_or_else(|p| p.into_inner());
        g.insert(record.key_hash.clone(), record);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Replaces the cache with `records`, read from the store when the generation was
    /// `read_at` (`cluster_sync`: what other agents changed). Returns whether anything changed;
    /// `false` too when a local change came in between (the next read has it).
    pub fn replace_if_newer(&self, records: Vec<ApiKeyRecord>, read_at: u64) -> bool {
        let map: HashMap<String, ApiKeyRecord> = records.into_iter().map(|r| (r.key_hash.clone(), r)).collect();
        // Compared under the read lock: calls are not held up every pass for nothing.
        if *self.keys.read().unwrap_or_else(|p| p.into_inner()) == map {
            return false;
        }
        let mut g = self.keys.write().unwrap_or_else(|p| p.into_inner());
        if self.generation.load(Ordering::SeqCst) != read_at {
            return false;
        }
        *g = map;
        true
    }

    /// Whether any key that is not revoked has limits of its own.
    pub fn any_own_limit(&self) -> bool {
        let g = self.keys.read().unwrap_or_else(|p| p.into_inner());
        g.values().any(|r| r.revoked_us.is_none() && (r.rpm.is_some_and(|n| n > 0) || r.tokens_per_day.is_some_and(|n| n > 0)))
    }

    /// The own `--rpm` of the key with this id (`None`: none, or no such key).
    pub fn rpm_of(&self, id: &str) -> Option<u32> {
        let g = self.keys.read().unwrap_or_else(|p| p.into_inner());
        g.values().find(|r| r.id == id).and_then(|r| r.rpm)
    }

    /// `f` of the record with this hash, under the read lock (no copy of the whole record on
    /// every call).
    fn with<R>(&self, hash: &str, f: impl FnOnce(&ApiKeyRecord) -> R) -> Option<R> {
        let g = self.keys.read().unwrap_or_else(|p| p.into_inner());
        g.get(hash).map(f)
    }
}

/// How long a job's "has it ended?" answer is reused: a token is refused at most this long
/// after the store learns that its job ended, and each job costs at most one query this often.
pub const JOB_STATE_FRESH: Duration = Duration::from_secs(1);
/// A store that does not answer within this is taken as "not ended" (logged): the gateway must
/// not stall every job's calls on a slow database; the token still expires.
pub const JOB_STATE_TIMEOUT: Duration = Duration::from_millis(250);
/// How long an "ended" answer is reused before the store is asked again: Slurm may requeue an
/// ended job, and its next run's token (the same job id) must work again. A store that fails
/// then keeps the job ended.
pub const JOB_ENDED_RECHECK: Duration = Duration::from_secs(30);
/// Past this many cached jobs, entries older than a minute are dropped.
const JOB_STATE_MAX: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct JobState {
    at: Instant,
    ended: bool,
}

/// One job's cached answer, behind its own async lock.
type JobSlot = Arc<tokio::sync::Mutex<Option<JobState>>>;

/// Per (job id, uid): whether the job has ended, as the store said within the last
/// [`JOB_STATE_FRESH`] ([`JOB_ENDED_RECHECK`] once ended). One async lock per job, so
/// concurrent calls of one job wait for a single query instead of each sending one.
pub struct JobStates {
    jobs: Mutex<HashMap<(u32, u32), JobSlot>>,
    /// Store queries made (tests check the cache with it).
    queries: std::sync::atomic::AtomicU64,
    ended_recheck: Duration,
}

impl Default for JobStates {
    fn default() -> Self {
        JobStates { jobs: Mutex::default(), queries: Default::default(), ended_recheck: JOB_ENDED_RECHECK }
    }
}

impl JobStates {
    fn slot(&self, key: (u32, u32)) -> JobSlot {
        let mut jobs = match self.jobs.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if jobs.len() >= JOB_STATE_MAX {
            jobs.retain(|_, slot| slot.try_lock().map(|g| g.is_some_and(|s| s.at.elapsed() < Duration::from_secs(60))).unwrap_or(true));
        }
        jobs.entry(key).or_default().clone()
    }

    /// Whether job `job_id` of `uid` has ended, from the cache or (at most once per
    /// [`JOB_STATE_FRESH`]) the store.
    pub async fn ended(&self, store: &Store, job_id: u32, uid: u32) -> bool {
        let slot = self.slot((job_id, uid));
        let mut state = slot.lock().await;
        // An ended job is asked about again only every `ended_recheck` (Slurm may requeue it),
        // and a store that fails then cannot make its token good again.
        let was_ended = state.is_some_and(|s| s.ended);
        if let Some(s) = *state
            && s.at.elapsed() < if s.ended { self.ended_recheck } else { JOB_STATE_FRESH }
        {
            return s.ended;
        }
        self.queries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ended = match tokio::time::timeout(JOB_STATE_TIMEOUT, store.job_ended(job_id, uid)).await {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                if !was_ended {
                    tracing::warn!(job_id, error = %e, "cannot ask the store whether a job has ended; its token is accepted meanwhile");
                }
                was_ended
            }
            Err(_) => {
                if !was_ended {
                    tracing::warn!(
                        job_id,
                        timeout_ms = JOB_STATE_TIMEOUT.as_millis() as u64,
                        "the store did not say in time whether a job has ended; its token is accepted meanwhile"
                    );
                }
                was_ended
            }
        };
        *state = Some(JobState { at: Instant::now(), ended });
        ended
    }

    /// Store queries made so far.
    pub fn queries(&self) -> u64 {
        self.queries.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How long a uid's passwd name is reused.
const USER_NAME_FRESH: Duration = Duration::from_secs(60);

/// uid -> name in this node's password database (`getpwuid_r`, off the runtime's workers),
/// cached for a minute.
#[derive(Default)]
pub struct UserNames {
    names: Mutex<HashMap<u32, (Instant, Option<String>)>>,
}

impl UserNames {
    pub async fn name_of(&self, uid: u32) -> Option<String> {
        let cached = match self.names.lock() {
            Ok(g) => g.get(&uid).cloned(),
            Err(p) => p.into_inner().get(&uid).cloned(),
        };
        if let Some((at, name)) = cached
            && at.elapsed() < USER_NAME_FRESH
        {
            return name;
        }
        let name = tokio::task::spawn_blocking(move || crate::control::peer::user_name(uid)).await.ok().flatten();
        let mut g = match self.names.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if g.len() >= JOB_STATE_MAX {
            g.retain(|_, (at, _)| at.elapsed() < USER_NAME_FRESH);
        }
        g.insert(uid, (Instant::now(), name.clone()));
        name
    }
}

/// Adds the user's own allow-list (`[gateway.user_models]`) to an identity.
fn with_user_models(state: &AppState, mut id: Identity) -> Identity {
    if let Some(models) = state.gateway.access.get().user_models_of(&id.user) {
        let source = state.config.source.as_deref().map(|p| p.display().to_string()).unwrap_or_else(|| "the configuration".into());
        id.user_models = Some(UserModels { models: models.to_vec(), source });
    }
    id
}

/// Authenticates a request: `Authorization: Bearer <key or job token>` first, then the SSO
/// header from a proxy that proves itself. Every refusal says what to send instead; the
/// precise reason for a bad token is logged, not sent.
pub async fn authenticate(state: &AppState, headers: &HeaderMap, peer: &Peer) -> Result<Identity, GatewayError> {
    authenticate_as(state, headers, peer).await.map(|id| with_user_models(state, id))
}

async fn authenticate_as(state: &AppState, headers: &HeaderMap, peer: &Peer) -> Result<Identity, GatewayError> {
    if let Some(bearer) = bearer(headers) {
        return authenticate_bearer(state, bearer).await;
    }
    let sso = &state.gateway.sso;
    if let Some((name, value)) = sso.header(headers) {
        if let Err(why) = sso.check(headers, peer) {
            // Logged once a minute per peer by the refusal counter; the detail here.
            tracing::debug!(peer = %peer.address(), header = %name, reason = ?why, "SSO header without the proxy's proof refused");
            let fix = match why {
                Rejected::Address | Rejected::Secret => "from the site's proxy",
                Rejected::Uid => "from the site's proxy (its connections on the SSO socket)",
            };
            return Err(GatewayError::Unauthenticated(format!(
                "the {name} header is only accepted {fix}; send `Authorization: Bearer <API key>` (an admin creates one with `gpuhub keys create`)"
            )));
        }
        // A proxy that appends to what the client sent (instead of replacing it) would pass
        // the client's name first: a header that came more than once names no one.
        let times = headers.get_all(name).iter().count();
        if times > 1 {
            return Err(GatewayError::Unauthenticated(format!(
                "the {name} header came {times} times; the site's proxy must set it once, replacing any the client sent (nginx: proxy_set_header {name} $remote_user)"
            )));
        }
        let user = value.to_str().unwrap_or("").trim();
        if user.is_empty() || user.len() > 128 || user.chars().any(|c| c.is_control() || c == ',') {
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

async fn authenticate_bearer(state: &AppState, token: &str) -> Result<Identity, GatewayError> {
    if token.starts_with(gpuhub_wire::token::PREFIX) {
        let Some(key) = state.job_key.as_deref() else {
            tracing::error!("a job token arrived but the job-credential key could not be read at start");
            return Err(GatewayError::Unauthenticated(
                "job tokens cannot be checked on this node right now (the agent's key is missing); use an API key".into(),
            ));
        };
        let c = match gpuhub_wire::token::verify(key, token, crate::util::now_s()) {
            Ok(c) => c,
            Err(gpuhub_wire::token::TokenError::Expired) => {
                return Err(GatewayError::Unauthenticated("this job token has expired; start a new job or use an API key".into()));
            }
            Err(e) => {
                // Debug: a flood of made-up tokens is counted (and logged once a minute) as refusals.
                tracing::debug!(reason = ?e, "job token refused");
                return Err(GatewayError::Unauthenticated("invalid job token (it must come from a job on this node, unchanged)".into()));
            }
        };
        return job_identity(state, c).await;
    }
    let found = state.gateway.keys.with(&hash_key(token), |k| match k.revoked_us {
        None => Ok(Identity {
            user: k.user.clone(),
            app: k.app.clone(),
            job_id: None,
            models: k.models.clone(),
            key_id: Some(k.id.clone()),
            user_models: None,
            key_rpm: k.rpm,
            key_tokens_per_day: k.tokens_per_day,
        }),
        Some(_) => Err(GatewayError::Unauthenticated(format!(
            "API key {} ({}/{}) was revoked; ask an admin for a new one (`gpuhub keys create`)",
            k.id, k.user, k.app
        ))),
    });
    found.unwrap_or_else(|| {
        Err(GatewayError::Unauthenticated("invalid API key; ask an admin for one (`gpuhub keys create --user USER --app APP`)".into()))
    })
}

/// A verified token's caller: the uid decides who it is; the name in the token must be that
/// uid's name here, and the job must still be running.
async fn job_identity(state: &AppState, c: gpuhub_wire::token::JobClaims) -> Result<Identity, GatewayError> {
    let Some(user) = state.gateway.users.name_of(c.uid).await else {
        tracing::warn!(uid = c.uid, job_id = c.job_id, "job token refused: its uid has no entry in this node's password database");
        return Err(GatewayError::Unauthenticated(format!("the job token's uid {} has no user on this node; use an API key", c.uid)));
    };
    if user != c.user {
        tracing::warn!(uid = c.uid, job_id = c.job_id, token_user = %crate::util::sanitize(&c.user), passwd_user = %user, "job token refused: its user name is not its uid's");
        return Err(GatewayError::Unauthenticated("invalid job token (it must come from a job on this node, unchanged)".into()));
    }
    if state.gateway.jobs.ended(&state.store, c.job_id, c.uid).await {
        return Err(GatewayError::Unauthenticated(format!(
            "job {} has ended, so its token is no longer accepted; start a new job or use an API key",
            c.job_id
        )));
    }
    Ok(Identity { user, app: "job".into(), job_id: Some(i64::from(c.job_id)), ..Identity::default() })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn record(id: &str, revoked_us: Option<i64>) -> ApiKeyRecord {
        ApiKeyRecord {
            id: id.into(),
            key_hash: format!("h-{id}"),
            prefix: "ghk_".into(),
            user: "alice".into(),
            app: "app".into(),
            models: Vec::new(),
            created_us: 1,
            created_by: "root".into(),
            revoked_us,
            rpm: None,
            tokens_per_day: None,
        }
    }

    #[test]
    fn a_store_read_never_undoes_a_newer_local_change() {
        let cache = KeyCache::default();
        cache.replace(vec![record("k1", None)]);
        // Another agent revoked k1: the next read applies it.
        let at = cache.generation();
        assert!(cache.replace_if_newer(vec![record("k1", Some(5))], at));
        assert!(!cache.replace_if_newer(vec![record("k1", Some(5))], at), "nothing changed");
        // A read that started before this agent created k2 does not drop k2 ...
        let at = cache.generation();
        cache.upsert(record("k2", None));
        assert!(!cache.replace_if_newer(vec![record("k1", Some(5))], at));
        assert!(cache.with("h-k2", |_| ()).is_some());
        // ... and the next read, which has it, applies.
        let at = cache.generation();
        assert!(cache.replace_if_newer(vec![record("k1", Some(5)), record("k2", Some(9))], at));
        assert_eq!(cache.with("h-k2", |k| k.revoked_us), Some(Some(9)));
    }

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
    fn allow_list() {
        let id = Identity { user: "a".into(), app: "x".into(), models: vec!["m1".into()], key_id: Some("k".into()), ..Identity::default() };
        assert!(id.check_model("m1", Some("m1")).is_ok());
        assert!(id.check_model("old", Some("m1")).is_ok());
        let e = id.check_model("m2", Some("m2")).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
        assert!(Identity::default().check_model("any", None).is_ok());
        assert!(id.may_list("m1") && !id.may_list("m2"));
    }

    #[tokio::test]
    async fn job_state_is_asked_once_a_second_per_job() {
        for (store, _dir) in crate::store::testing::stores().await {
            let states = JobStates { ended_recheck: 3 * JOB_STATE_FRESH, ..JobStates::default() };
            let calls: Vec<_> = (0..50).map(|_| states.ended(&store, 7, 1000)).collect();
            assert!(futures_util::future::join_all(calls).await.iter().all(|e| !e), "unknown job: not ended");
            assert_eq!(states.queries(), 1, "50 concurrent calls of one job, one query");
            assert!(!states.ended(&store, 8, 1000).await);
            assert_eq!(states.queries(), 2, "another job has its own entry");
            sqlx::query(
                "INSERT INTO acct_jobs (node, job_id, uid, user_name, start_us, end_us, first_seen_us, last_seen_us) VALUES ('n', 7, 1000, 'u', 1, 2, 1, 1)",
            )
            .execute(store.pool())
            .await
            .unwrap();
            assert!(!states.ended(&store, 7, 1000).await, "still the cached answer within the second");
            tokio::time::sleep(JOB_STATE_FRESH + Duration::from_millis(50)).await;
            assert!(states.ended(&store, 7, 1000).await, "asked again after a second: ended");
            assert_eq!(states.queries(), 3);
            tokio::time::sleep(JOB_STATE_FRESH + Duration::from_millis(50)).await;
            assert!(states.ended(&store, 7, 1000).await);
            assert_eq!(states.queries(), 3, "an ended job is not asked about again within `ended_recheck`");
            // Slurm requeued it: its next run (run 1) makes its token good again.
            sqlx::query(
                "INSERT INTO acct_jobs (node, job_id, run, uid, user_name, start_us, first_seen_us, last_seen_us) VALUES ('n', 7, 1, 1000, 'u', 5, 5, 5)",
            )
            .execute(store.pool())
            .await
            .unwrap();
            tokio::time::sleep(2 * JOB_STATE_FRESH).await;
            assert!(!states.ended(&store, 7, 1000).await, "a requeued job's next run: asked again, not ended");
            sqlx::query("UPDATE acct_jobs SET end_us = 6 WHERE job_id = 7 AND run = 1").execute(store.pool()).await.unwrap();
            tokio::time::sleep(JOB_STATE_FRESH + Duration::from_millis(50)).await;
            assert!(states.ended(&store, 7, 1000).await, "its last run ended");
            let queries = states.queries();
            tokio::time::sleep(3 * JOB_STATE_FRESH + Duration::from_millis(50)).await;
            store.close().await; // every query fails from now on
            assert!(states.ended(&store, 7, 1000).await, "an ended job stays ended while the store fails");
            assert_eq!(states.queries(), queries + 1, "asked again after `ended_recheck`, and the failure keeps it ended");
            assert!(!states.ended(&store, 9, 1000).await, "a job never seen: accepted while the store fails (logged)");
        }
    }

    #[test]
    fn user_allow_list_applies_to_every_credential() {
        let mine = Some(UserModels { models: vec!["demo-chat".into()], source: "/etc/gpuhub/agent.toml".into() });
        let job = Identity { user: "alice".into(), app: "job".into(), job_id: Some(42), user_models: mine.clone(), ..Identity::default() };
        assert!(job.check_model("demo-chat", Some("demo-chat")).is_ok());
        assert!(job.check_model("old-name", Some("demo-chat")).is_ok(), "a name that resolves to an allowed model");
        let e = job.check_model("big", Some("big")).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::FORBIDDEN);
        let m = e.to_string();
        assert!(
            m.contains("user `alice` may not use model `big`")
                && m.contains("job token of job 42")
                && m.contains("gateway.user_models.alice in /etc/gpuhub/agent.toml")
                && m.contains("permits only: demo-chat"),
            "{m}"
        );
        assert!(job.may_list("demo-chat") && !job.may_list("big"));
        // An API key of the same user: its own list and the user's both apply.
        let key = Identity {
            user: "alice".into(),
            app: "ocr".into(),
            models: vec!["big".into(), "demo-chat".into()],
            key_id: Some("k1".into()),
            user_models: mine,
            ..Identity::default()
        };
        assert!(key.check_model("demo-chat", None).is_ok());
        let m = key.check_model("big", None).unwrap_err().to_string();
        assert!(m.contains("API key k1 (alice/ocr)") && m.contains("gateway.user_models.alice"), "{m}");
        assert!(!key.may_list("big"));
    }
}
