//! The few MLflow tracking REST calls the run-page reporter makes (`/api/2.0/mlflow`):
//! experiments/search and runs/search (every page) to find the runs tagged with a job id, and
//! runs/log-batch to write the figures. One fresh connection per call, bounded timeouts.

use std::time::Duration;

use serde_json::{Value, json};

/// Experiments or runs read per page (MLflow's maximum for runs/search is 50000; keep pages small).
const PAGE: u32 = 500;
/// Pages read per search at most: a node's tracking server with more than this is not expected.
const MAX_PAGES: usize = 200;
/// Experiment ids per runs/search call.
const IDS_PER_SEARCH: usize = 100;

#[derive(Debug, thiserror::Error)]
pub enum RestError {
    #[error("cannot reach MLflow at {uri}: {source} (is the tracking server up? check mlflow.tracking_uri)")]
    Unreachable { uri: String, source: reqwest::Error },
    #[error("MLflow at {uri} answered {status} to {what}: {message}")]
    Api { uri: String, what: &'static str, status: u16, message: String },
}

/// A run as runs/search describes it (only what the checks read).
#[derive(Debug, Clone, PartialEq)]
pub struct RunInfo {
    pub run_id: String,
    pub experiment_id: String,
    /// Unix milliseconds (`0` when MLflow gave none).
    pub start_time_ms: i64,
    pub user_id: String,
    pub tags: std::collections::BTreeMap<String, String>,
}

impl RunInfo {
    fn from_json(r: &Value) -> Option<RunInfo> {
        let info = &r["info"];
        let run_id = info["run_id"].as_str().or_else(|| info["run_uuid"].as_str())?.to_string();
        let start_time_ms = match &info["start_time"] {
            Value::Number(n) => n.as_i64().unwrap_or(0),
            Value::String(s) => s.parse().unwrap_or(0),
            _ => 0,
        };
        Some(RunInfo {
            run_id,
            experiment_id: info["experiment_id"].as_str().unwrap_or("").to_string(),
            start_time_ms,
            user_id: info["user_id"].as_str().unwrap_or("").to_string(),
            tags: r["data"]["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| Some((t["key"].as_str()?.to_string(), t["value"].as_str().unwrap_or("").to_string())))
                .collect(),
        })
    }
}

/// One metric of a log-batch call.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Metric {
    pub key: String,
    pub value: f64,
    /// Unix milliseconds.
    pub timestamp: i64,
    pub step: i64,
}

#[derive(Debug, Clone)]
pub struct Tracking {
    base: String,
    http: reqwest::Client,
}

impl Tracking {
    pub fn new(tracking_uri: &str) -> Tracking {
        let http = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(10)).build().unwrap_or_default();
        Tracking { base: format!("{}/api/2.0/mlflow", tracking_uri.trim_end_matches('/')), http }
    }

    async fn post(&self, what: &'static str, path: &str, body: Value) -> Result<Value, RestError> {
        let resp = self
            .http
            .post(format!("{}/{path}", self.base))
            .json(&body)
            .send()
            .await
            .map_err(|source| RestError::Unreachable { uri: self.base.clone(), source })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 {
            return Err(RestError::Api {
                uri: self.base.clone(),
                what,
                status,
                message: crate::util::sanitize(body["message"].as_str().unwrap_or("")),
            });
        }
        Ok(body)
    }

    /// Ids of every active experiment.
    pub async fn experiment_ids(&self) -> Result<Vec<String>, RestError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..MAX_PAGES {
            let mut body = json!({"max_results": PAGE, "view_type": "ACTIVE_ONLY"});
            if let Some(t) = &token {
                body["page_token"] = json!(t);
            }
            let v = self.post("an experiment search", "experiments/search", body).await?;
            out.extend(v["experiments"].as_array().into_iter().flatten().filter_map(|e| e["experiment_id"].as_str().map(str::to_string)));
            match v["next_page_token"].as_str().filter(|t| !t.is_empty()) {
                Some(t) => token = Some(t.to_string()),
                None => break,
            }
        }
        Ok(out)
    }

    /// Active runs tagged `slurm.job_id = job_id`, in any active experiment; at most `limit`.
    pub async fn runs_of_job(&self, job_id: i64, limit: usize) -> Result<Vec<RunInfo>, RestError> {
        let ids = self.experiment_ids().await?;
        let filter = format!("tags.`slurm.job_id` = '{job_id}'");
        let mut out = Vec::new();
        for chunk in ids.chunks(IDS_PER_SEARCH) {
            let mut token: Option<String> = None;
            for _ in 0..MAX_PAGES {
                let mut body = json!({"experiment_ids": chunk, "filter": filter, "run_view_type": "ACTIVE_ONLY", "max_results": PAGE});
                if let Some(t) = &token {
                    body["page_token"] = json!(t);
                }
                let v = self.post("a run search", "runs/search", body).await?;
                out.extend(v["runs"].as_array().into_iter().flatten().filter_map(RunInfo::from_json));
                if out.len() > limit {
                    return Ok(out);
                }
                match v["next_page_token"].as_str().filter(|t| !t.is_empty()) {
                    Some(t) => token = Some(t.to_string()),
                    None => break,
                }
            }
        }
        Ok(out)
    }

    /// Logs `metrics` and `tags` on `run_id` (MLflow takes at most 1000 metrics per call).
    pub async fn log_batch(&self, run_id: &str, metrics: &[Metric], tags: &[(String, String)]) -> Result<(), RestError> {
        let tags: Vec<Value> = tags.iter().map(|(k, v)| json!({"key": k, "value": v})).collect();
        for (i, chunk) in metrics.chunks(1000).enumerate() {
            let t = if i == 0 { tags.clone() } else { Vec::new() };
            self.post("logging GPU metrics (runs/log-batch)", "runs/log-batch", json!({"run_id": run_id, "metrics": chunk, "tags": t}))
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_search_result_reads_into_a_run() {
        let v = json!({"info": {"run_id": "abc", "experiment_id": "3", "start_time": 1700000000123i64, "user_id": "alice"},
                       "data": {"tags": [{"key": "slurm.job_id", "value": "42"}]}});
        let r = RunInfo::from_json(&v).unwrap();
        assert_eq!(
            (r.run_id.as_str(), r.experiment_id.as_str(), r.start_time_ms, r.user_id.as_str()),
            ("abc", "3", 1700000000123, "alice")
        );
        assert_eq!(r.tags["slurm.job_id"], "42");
        // Older servers send numbers as strings; a run without an id is left out.
        let r = RunInfo::from_json(&json!({"info": {"run_uuid": "x", "start_time": "17"}})).unwrap();
        assert_eq!((r.run_id.as_str(), r.start_time_ms), ("x", 17));
        assert!(RunInfo::from_json(&json!({"info": {}})).is_none());
    }
}
