//! The states of an agent's worker jobs from one `squeue` for all of them.
//!
//! Every ready worker's supervisor asks for its job's state once a second. One `squeue -j ID`
//! each would be one process and one slurmctld RPC per worker per second (a node serving ten
//! models: ten of each); instead the first caller whose answer is older than [`MAX_AGE`] runs
//! one `squeue -j ID1,ID2,...` for every job asked about in the last [`FORGET_AFTER`], and the
//! others read its answer. A job is seen at most [`MAX_AGE`] late.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::slurm::JobInfo;

/// How old an answer may be when a caller reads it (a supervisor asks every second).
pub const MAX_AGE: Duration = Duration::from_millis(900);
/// A job nobody asked about for this long is left out of the next `squeue`.
pub const FORGET_AFTER: Duration = Duration::from_secs(10);

/// One `squeue` answer: the jobs it was asked about, and those it listed.
struct Answer {
    /// When the `squeue` started (what it says is at least this recent).
    at: Instant,
    asked: HashSet<String>,
    listed: HashMap<String, JobInfo>,
}

#[derive(Default)]
pub struct JobWatch {
    /// Job id -> when a caller last asked about it.
    watched: Mutex<HashMap<String, Instant>>,
    last: Mutex<Option<Answer>>,
    /// One `squeue` at a time: the callers that find the answer stale wait for it.
    pub(super) refresh: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for JobWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobWatch").field("watched", &lock(&self.watched).len()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl JobWatch {
    /// Job `id` is asked about now: the next `squeue` includes it.
    pub fn note(&self, id: &str, now: Instant) {
        lock(&self.watched).insert(id.to_string(), now);
    }

    /// What the last answer says of job `id` (`Some(None)`: it asked and squeue did not list
    /// the job, so it has ended), if that answer asked about `id` and is younger than
    /// [`MAX_AGE`] at `now`.
    pub fn fresh(&self, id: &str, now: Instant) -> Option<Option<JobInfo>> {
        let last = lock(&self.last);
        let a = last.as_ref().filter(|a| now.saturating_duration_since(a.at) < MAX_AGE && a.asked.contains(id))?;
        Some(a.listed.get(id).cloned())
    }

    /// The jobs the next `squeue` asks about (those asked about within [`FORGET_AFTER`] of
    /// `now`; the others are forgotten), sorted.
    pub fn ids(&self, now: Instant) -> Vec<String> {
        let mut w = lock(&self.watched);
        w.retain(|_, t| now.saturating_duration_since(*t) < FORGET_AFTER);
        let mut ids: Vec<String> = w.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// Keeps the answer of a `squeue` that started at `at`, asked about `asked` and listed
    /// `jobs` (those of other ids are dropped).
    pub fn store(&self, at: Instant, asked: Vec<String>, jobs: Vec<JobInfo>) {
        let asked: HashSet<String> = asked.into_iter().collect();
        let listed = jobs.into_iter().filter(|j| asked.contains(&j.id)).map(|j| (j.id.clone(), j)).collect();
        *lock(&self.last) = Some(Answer { at, asked, listed });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn job(id: &str, state: &str) -> JobInfo {
        JobInfo {
            id: id.into(),
            name: "gpuhub-worker-m".into(),
            state: state.into(),
            reason: "None".into(),
            uid: Some(990),
            comment: String::new(),
        }
    }

    #[test]
    fn one_answer_serves_every_job_it_asked_about_until_it_is_stale() {
        let w = JobWatch::default();
        let t0 = Instant::now();
        w.note("41", t0);
        w.note("42", t0);
        assert_eq!(w.fresh("41", t0), None, "no answer yet");
        assert_eq!(w.ids(t0), vec!["41", "42"]);
        // squeue lists 41 (and someone else's 7); 42 is gone.
        w.store(t0, w.ids(t0), vec![job("41", "RUNNING"), job("7", "RUNNING")]);
        assert_eq!(w.fresh("41", t0 + Duration::from_millis(500)), Some(Some(job("41", "RUNNING"))));
        assert_eq!(w.fresh("42", t0 + Duration::from_millis(500)), Some(None), "asked and not listed: ended");
        assert_eq!(w.fresh("7", t0), None, "a job it did not ask about is not answered");
        w.note("43", t0);
        assert_eq!(w.fresh("43", t0), None, "a job noted after the answer needs a new squeue");
        assert_eq!(w.fresh("41", t0 + MAX_AGE), None, "stale");
    }

    #[test]
    fn jobs_nobody_asks_about_leave_the_next_squeue() {
        let w = JobWatch::default();
        let t0 = Instant::now();
        w.note("41", t0);
        w.note("42", t0 + Duration::from_secs(5));
        assert_eq!(w.ids(t0 + FORGET_AFTER + Duration::from_secs(1)), vec!["42"]);
        assert_eq!(w.ids(t0 + Duration::from_secs(5) + FORGET_AFTER), Vec::<String>::new());
    }
}
