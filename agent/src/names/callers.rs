//! The callers registry: who calls which name, rolled up from the gateway's usage log.
//!
//! The gateway's usage writer calls [`roll_up`] inside the transaction that inserts a batch
//! of usage rows, so the rollup and the log never disagree (a replayed row that the log
//! refuses as a duplicate is never passed here). The rollup is keyed by (name, UTC day,
//! user, app, job, client address, user agent) with call counts, refused counts and
//! first/last seen: `gpuhub names callers NAME --since 30d` reads at most 31 days of that
//! key range, however many millions of rows the usage log holds.
//!
//! Bounded keys: the client address is kept without its port (a port is new on every
//! connection), and the user agent is cut at [`MAX_USER_AGENT`] characters.

use std::collections::BTreeMap;

use crate::gateway::usage_log::UsageRow;
use crate::store::names::{CallerCounts, CallerKey, CallerRow, day_of, upsert_callers};

/// Longest user agent kept in the rollup (the usage log keeps the whole string).
pub const MAX_USER_AGENT: usize = 200;

/// The name states the registry refuses (counted in `refused`).
pub const REFUSED_STATES: &[&str] = &["retired", "unknown", "unassigned", "unserved"];

/// Whether a call in name state `state` was refused ([`REFUSED_STATES`]).
pub fn is_refused(state: &str) -> bool {
    REFUSED_STATES.contains(&state)
}

/// `10.0.0.1:5433` -> `10.0.0.1`, `[::1]:80` -> `::1`; anything else unchanged.
pub fn address_only(addr: &str) -> String {
    match addr.parse::<std::net::SocketAddr>() {
        Ok(sa) => sa.ip().to_string(),
        Err(_) => addr.to_string(),
    }
}

/// The rollup key and counts of one call.
pub fn key_of(row: &UsageRow) -> (CallerKey, CallerCounts) {
    (
        CallerKey {
            name: row.requested_name.clone(),
            day_us: day_of(row.time_us),
            user: row.user.clone(),
            app: row.app.clone(),
            job_id: row.job_id.map(|j| j.to_string()).unwrap_or_default(),
            client_addr: address_only(&row.client_addr),
            user_agent: row.user_agent.chars().take(MAX_USER_AGENT).collect(),
        },
        CallerCounts {
            calls: row.calls.max(1),
            refused: if is_refused(&row.name_state) { row.calls.max(1) } else { 0 },
            first_us: row.time_us,
            last_us: row.time_us,
        },
    )
}

/// Aggregates rows by rollup key (one upsert per key: PostgreSQL refuses to update the same
/// row twice in one `INSERT .. ON CONFLICT`).
pub fn aggregate<'a>(rows: impl IntoIterator<Item = &'a UsageRow>) -> Vec<(CallerKey, CallerCounts)> {
    let mut agg: BTreeMap<CallerKey, CallerCounts> = BTreeMap::new();
    for row in rows {
        // A call rejected before it named a model (bad JSON, no credentials) has no name.
        if row.requested_name.is_empty() {
            continue;
        }
        let (k, c) = key_of(row);
        agg.entry(k).and_modify(|a| a.merge(&c)).or_insert(c);
    }
    agg.into_iter().collect()
}

/// Folds freshly inserted usage rows into the callers rollup, inside the writer's transaction.
/// `rows` holds only rows that were inserted now (never a replayed duplicate), so adding
/// their counts keeps the rollup exact.
pub async fn roll_up(conn: &mut sqlx::AnyConnection, rows: &[UsageRow]) -> Result<(), sqlx::Error> {
    let agg = aggregate(rows);
    if agg.is_empty() {
        return Ok(());
    }
    upsert_callers(conn, &agg).await
}

/// What `gpuhub names callers` and the rename preflight show: the callers of one name in a
/// window, and a summary.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CallersReport {
    pub name: String,
    /// Start of the window (the UTC day `--since` falls in), Unix microseconds.
    pub since_us: i64,
    pub calls: i64,
    pub refused: i64,
    pub last_us: Option<i64>,
    /// Distinct users and apps, most calls first.
    pub users: Vec<String>,
    pub apps: Vec<String>,
    /// Number of distinct callers (before `limit`).
    pub total_callers: usize,
    pub callers: Vec<CallerRow>,
}

impl CallersReport {
    pub fn build(name: &str, since_us: i64, rows: Vec<CallerRow>, limit: usize) -> CallersReport {
        let mut users: Vec<(String, i64)> = Vec::new();
        let mut apps: Vec<(String, i64)> = Vec::new();
        let bump = |v: &mut Vec<(String, i64)>, k: &str, n: i64| match v.iter_mut().find(|(x, _)| x == k) {
            Some(e) => e.1 += n,
            None => v.push((k.to_string(), n)),
        };
        let (mut calls, mut refused, mut last) = (0, 0, None::<i64>);
        for r in &rows {
            calls += r.calls;
            refused += r.refused;
            last = Some(last.map_or(r.last_us, |l| l.max(r.last_us)));
            bump(&mut users, &r.user_name, r.calls);
            bump(&mut apps, &r.app, r.calls);
        }
        users.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        apps.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let total_callers = rows.len();
        let mut callers = rows;
        callers.truncate(limit);
        CallersReport {
            name: name.to_string(),
            since_us,
            calls,
            refused,
            last_us: last,
            users: users.into_iter().map(|u| u.0).collect(),
            apps: apps.into_iter().map(|a| a.0).collect(),
            total_callers,
            callers,
        }
    }

    /// "3 callers (alice/ocr-app, bob/batch) made 120 calls since 2026-11-01".
    pub fn summary(&self) -> String {
        if self.calls == 0 {
            return format!("no calls to `{}` since {}", self.name, super::civil_from_days(self.since_us.div_euclid(86_400_000_000)));
        }
        let who: Vec<String> = self.callers.iter().take(5).map(|c| format!("{}/{}", c.user_name, c.app)).collect();
        let more = if self.total_callers > who.len() { format!(", +{} more", self.total_callers - who.len()) } else { String::new() };
        format!(
            "{} caller{} ({}{more}) made {} call{} to `{}` since {}",
            self.total_callers,
            if self.total_callers == 1 { "" } else { "s" },
            who.join(", "),
            self.calls,
            if self.calls == 1 { "" } else { "s" },
            self.name,
            super::civil_from_days(self.since_us.div_euclid(86_400_000_000))
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::names::DAY_US;
    use crate::store::testing;

    fn row(name: &str, t: i64, user: &str, state: &str, addr: &str) -> UsageRow {
        UsageRow {
            request_id: format!("{name}-{t}-{user}"),
            time_us: t,
            user: user.into(),
            app: "ocr-app".into(),
            job_id: Some(42),
            client_addr: addr.into(),
            user_agent: "OpenAI/Python 1.0".into(),
            requested_name: name.into(),
            name_state: state.into(),
            ..UsageRow::default()
        }
    }

    #[test]
    fn ports_are_dropped_and_batches_aggregate() {
        assert_eq!(address_only("10.1.2.3:5555"), "10.1.2.3");
        assert_eq!(address_only("[::1]:80"), "::1");
        assert_eq!(address_only("unix"), "unix");
        let rows = [
            row("svc-ocr", 5, "alice", "deprecated", "10.0.0.1:1"),
            row("svc-ocr", 9, "alice", "retired", "10.0.0.1:2"),
            row("", 9, "x", "", ""),
        ];
        let agg = aggregate(&rows);
        assert_eq!(agg.len(), 1, "{agg:?}");
        assert_eq!(agg[0].1, CallerCounts { calls: 2, refused: 1, first_us: 5, last_us: 9 });
        assert_eq!(agg[0].0.job_id, "42");
    }

    #[tokio::test]
    async fn live_rollup_equals_the_rebuild_from_the_usage_log() {
        for (store, _dir) in testing::stores().await {
            let rows: Vec<UsageRow> = (0..300)
                .map(|i| {
                    let user = ["alice", "bob", "carol"][i % 3];
                    let state = ["active", "deprecated", "retired", "unknown"][i % 4];
                    let mut r = row(["svc-ocr", "dots.ocr"][i % 2], (i as i64) * DAY_US / 7, user, state, "10.0.0.9");
                    r.job_id = if i % 5 == 0 { None } else { Some((i % 7) as i64) };
                    r
                })
                .collect();
            // The live path, in batches, as the gateway's writer does.
            for batch in rows.chunks(64) {
                let mut tx = store.pool().begin().await.unwrap();
                roll_up(&mut tx, batch).await.unwrap();
                tx.commit().await.unwrap();
            }
            let live = (store.name_callers("svc-ocr", 0).await.unwrap(), store.name_totals().await.unwrap());
            // The same rows through the usage log and the rebuild SQL.
            for r in &rows {
                sqlx::query(
                    "INSERT INTO usage_log (request_id, time_us, user_name, app, job_id, client_addr, user_agent, requested_name, resolved_model, model_version, name_state, route, status, error_code, prompt_tokens, completion_tokens, streamed, latency_us, upstream_ttfb_us, overhead_us) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, '', '', $9, '/v1/chat/completions', 200, '', 0, 0, 0, 0, 0, 0)",
                )
                .bind(&r.request_id)
                .bind(r.time_us)
                .bind(&r.user)
                .bind(&r.app)
                .bind(r.job_id)
                .bind(address_only(&r.client_addr))
                .bind(&r.user_agent)
                .bind(&r.requested_name)
                .bind(&r.name_state)
                .execute(store.pool())
                .await
                .unwrap();
            }
            store.rebuild_name_callers().await.unwrap();
            let rebuilt = (store.name_callers("svc-ocr", 0).await.unwrap(), store.name_totals().await.unwrap());
            assert_eq!(live, rebuilt, "{:?}", store.backend());
            assert_eq!(live.1.iter().map(|t| t.calls).sum::<i64>(), 300);
        }
    }

    #[test]
    fn report_summarises_users_and_apps() {
        let c = |user: &str, app: &str, calls| CallerRow {
            user_name: user.into(),
            app: app.into(),
            job_id: String::new(),
            client_addr: String::new(),
            user_agent: String::new(),
            calls,
            refused: 0,
            first_us: 1,
            last_us: calls,
        };
        let r = CallersReport::build("svc-ocr", 0, vec![c("alice", "ocr-app", 10), c("bob", "batch", 3), c("alice", "batch", 1)], 2);
        assert_eq!((r.calls, r.total_callers, r.callers.len(), r.last_us), (14, 3, 2, Some(10)));
        assert_eq!(r.users, vec!["alice", "bob"]);
        assert_eq!(r.apps, vec!["ocr-app", "batch"]);
        assert!(
            r.summary().starts_with("3 callers (alice/ocr-app, bob/batch, +1 more) made 14 calls to `svc-ocr` since 1970-01-01"),
            "{}",
            r.summary()
        );
    }
}
