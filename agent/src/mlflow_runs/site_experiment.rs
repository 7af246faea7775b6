//! The site's default experiment (`mlflow.default_experiment`, which the SPANK plugin injects as
//! `MLFLOW_EXPERIMENT_NAME`) exists before jobs use it.
//!
//! MLflow's client creates a missing experiment named by `MLFLOW_EXPERIMENT_NAME` with a lookup
//! then a create, and does not retry: of two jobs that start in the same instant (a job array),
//! the one that loses fails in `mlflow.start_run()` with RESOURCE_ALREADY_EXISTS. So the agent
//! creates the experiment when it starts, retrying while MLflow is down, and looks again every
//! [`RECHECK`]: a deleted experiment makes every job's `start_run` fail, and is logged with the
//! fix. A name a job chooses itself (`--mlflow-experiment`) is the job's: the agent never sees it
//! before the job runs (docs/spank.md).

use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::rest::{Experiment, Tracking};

/// How often an existing experiment is looked at again.
const RECHECK: Duration = Duration::from_secs(600);
/// The first retry delay while MLflow cannot be reached; doubled up to [`MAX_RETRY`].
const FIRST_RETRY: Duration = Duration::from_secs(5);
const MAX_RETRY: Duration = Duration::from_secs(300);

/// Keeps `name` created until `stop` (one log line when what the agent sees changes).
pub async fn keep(tracking: Tracking, name: String, stop: CancellationToken) {
    let shown = crate::util::sanitize(&name);
    let mut retry = FIRST_RETRY;
    let mut last: Option<Experiment> = None;
    loop {
        let found = tokio::select! {
            _ = stop.cancelled() => return,
            r = tracking.ensure_experiment(&name) => r,
        };
        let wait = match found {
            Ok(e) => {
                if last.as_ref() != Some(&e) {
                    if e.active {
                        tracing::info!(experiment = %shown, id = %e.id, "MLflow: the site's default experiment exists; jobs log their runs there");
                    } else {
                        tracing::warn!(experiment = %shown, id = %e.id,
                            "MLflow: the site's default experiment is deleted, so jobs that use it fail in mlflow.start_run(); restore it (mlflow experiments restore --experiment-id ID) or set another mlflow.default_experiment");
                    }
                }
                last = Some(e);
                retry = FIRST_RETRY;
                RECHECK
            }
            Err(e) => {
                tracing::warn!(experiment = %shown, error = %e, retry_s = retry.as_secs(),
                    "MLflow: cannot make sure the site's default experiment exists (jobs starting together may race to create it)");
                let w = retry;
                retry = (retry * 2).min(MAX_RETRY);
                w
            }
        };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}
