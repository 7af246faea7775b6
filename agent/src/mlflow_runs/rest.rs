//! The few MLflow tracking REST calls the run-page reporter makes (`/api/2.0/mlflow`):
//! experiments/search and runs/search (every page) to find the runs tagged with a job id, and
//! runs/log-batch to write the figures; experiments/get-by-name and experiments/create for the
//! site's default experiment (`site_experiment.rs`). One fresh connection per call, bounded timeouts.

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
    Api { uri: String, what: &'static str, status: u16, code: String, message: String },
}

impl RestError {
    /// MLflow's `error_code` (`RESOURCE_DOES_NOT_EXIST`, ...), if it answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            RestError::Api { code, .. } if !code.is_empty() => Some(code),
            _ => None,
        }
    }
}

/// An experiment, as experiments/get-by-name describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Experiment {
    pub id: String,
    /// `false`: it is deleted (in MLflow's trash); runs cannot start in it.
    pub active: bool,
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
        self.send(what, self.http.post(format!("{}/{path}", self.base)).json(&body)).await
    }

    async fn send(&self, what: &'static str, req: reqwest::RequestBuilder) -> Result<Value, RestError> {
        let resp = req.send().await.map_err(|source| RestError::Unreachable { uri: self.base.clone(), source })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 {
            return Err(RestError::Api {
                uri: self.base.clone(),
                what,
                status,
                code: crate::util::sanitize(body["error_code"].as_str().unwrap_or("")),
                message: crate::util::sanitize(body["message"].as_str().unwrap_or("")),
            });
        }
        Ok(body)
    }

    /// The experiment called `name`, or `None` if there is none (active or deleted).
    pub async fn experiment_by_name(&self, name: &str) -> Result<Option<Experiment>, RestError> {
        let req = self.http.get(format!("{}/experiments/get-by-name", self.base)).query(&[("experiment_name", name)]);
        match self.send("an experiment lookup (experiments/get-by-name)", req).await {
            Ok(v) => Ok(v["experiment"]["experiment_id"].as_str().map(|id| Experiment {
                id: id.to_string(),
                active: v["experiment"]["lifecycle_stage"].as_str().unwrap_or("active") == "active",
            })),
            Err(e) if e.code() == Some("RESOURCE_DOES_NOT_EXIST") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The experiment called `name`, created if there is none. Someone else creating it at the
    /// same time (a job, another node's agent) is not an error: it is read back.
    pub async fn ensure_experiment(&self, name: &str) -> Result<Experiment, RestError> {
        if let Some(e) = self.experiment_by_name(name).await? {
            return Ok(e);
        }
        match self.post("creating an experiment (experiments/create)", "experiments/create", json!({"name": name})).await {
            Ok(v) => match v["experiment_id"].as_str() {
                Some(id) => Ok(Experiment { id: id.to_string(), active: true }),
                None => self.read_back(name).await,
            },
            Err(e) if e.code() == Some("RESOURCE_ALREADY_EXISTS") => self.read_back(name).await,
            Err(e) => Err(e),
        }
    }

    async fn read_back(&self, name: &str) -> Result<Experiment, RestError> {
        self.experiment_by_name(name).await?.ok_or_else(|| RestError::Api {
            uri: self.base.clone(),
            what: "an experiment lookup (experiments/get-by-name)",
            status: 404,
            code: "RESOURCE_DOES_NOT_EXIST".into(),
            message: format!("experiment {:?} was created but cannot be read back", crate::util::sanitize(name)),
        })
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
