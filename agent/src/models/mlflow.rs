//! The MLflow model registry, as the gateway uses it: which models are served
//! (`served_by=gateway` tag), which version `@production` points at (resolved again at every
//! worker start, off the request path of calls to ready models), and eval-gated promotion.
//!
//! REST only (`/api/2.0/mlflow`), one fresh connection per call: a kept-alive connection costs
//! ~56 ms per lookup against MLflow's server (Nagle + delayed ACK), a fresh one ~13 ms.

use std::time::Duration;

use serde_json::Value;

pub const ALIAS: &str = "production";

#[derive(Debug, thiserror::Error)]
pub enum MlflowError {
    #[error("cannot reach MLflow at {uri}: {source} (is the tracking server up? check mlflow.tracking_uri)")]
    Unreachable { uri: String, source: reqwest::Error },
    #[error("MLflow answered {status} to {what}: {message}")]
    Api { what: String, status: u16, message: String },
    #[error("registered model `{0}` has no version {1} in MLflow")]
    NoSuchVersion(String, String),
}

/// A registered model the registry says the gateway serves.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RegisteredModel {
    pub name: String,
    pub production: Option<String>,
    /// The registered model's tags (`served_by`, `gpuhub.*`, ...).
    pub tags: std::collections::BTreeMap<String, String>,
}

impl RegisteredModel {
    /// From one entry of `registered-models/search`.
    fn from_json(m: &Value) -> RegisteredModel {
        RegisteredModel {
            name: m["name"].as_str().unwrap_or("").to_string(),
            production: m["aliases"]
                .as_array()
                .and_then(|a| a.iter().find(|x| x["alias"] == ALIAS))
                .and_then(|x| x["version"].as_str())
                .map(str::to_string),
            tags: m["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| Some((t["key"].as_str()?.to_string(), t["value"].as_str().unwrap_or("").to_string())))
                .collect(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Mlflow {
    base: String,
    http: reqwest::Client,
}

impl Mlflow {
    pub fn new(tracking_uri: &str) -> Mlflow {
        let http = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(5)).build().unwrap_or_default();
        Mlflow { base: format!("{}/api/2.0/mlflow", tracking_uri.trim_end_matches('/')), http }
    }

    async fn call(&self, what: &str, req: reqwest::RequestBuilder) -> Result<(u16, Value), MlflowError> {
        let resp = req.send().await.map_err(|source| MlflowError::Unreachable { uri: self.base.clone(), source })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 && status != 404 && !(status == 400 && body["error_code"] == "INVALID_PARAMETER_VALUE") {
            return Err(MlflowError::Api { what: what.into(), status, message: body["message"].as_str().unwrap_or("").to_string() });
        }
        Ok((status, body))
    }

    /// The version `name@production` points at (`None`: no such alias or model).
    pub async fn production_version(&self, name: &str) -> Result<Option<String>, MlflowError> {
        let req = self.http.get(format!("{}/registered-models/alias", self.base)).query(&[("name", name), ("alias", ALIAS)]);
        let (status, body) = self.call("an alias lookup", req).await?;
        if status >= 400 {
            return Ok(None);
        }
        Ok(body["model_version"]["version"].as_str().map(str::to_string))
    }

    /// Registered models tagged `served_by=gateway`, with their `@production` version and
    /// tags (every page of the search).
    pub async fn discover(&self) -> Result<Vec<RegisteredModel>, MlflowError> {
        let mut out = Vec::new();
        let mut token = String::new();
        // At most 100 pages of 1000: a registry larger than that is not a node's.
        for _ in 0..100 {
            let mut q = vec![("filter", "tags.served_by = 'gateway'"), ("max_results", "1000")];
            if !token.is_empty() {
                q.push(("page_token", token.as_str()));
            }
            let req = self.http.get(format!("{}/registered-models/search", self.base)).query(&q);
            let (status, body) = self.call("a registry search", req).await?;
            if status >= 400 {
                return Err(MlflowError::Api {
                    what: "a registry search".into(),
                    status,
                    message: body["message"].as_str().unwrap_or("").to_string(),
                });
            }
            out.extend(body["registered_models"].as_array().into_iter().flatten().map(RegisteredModel::from_json));
            match body["next_page_token"].as_str().filter(|t| !t.is_empty()) {
                Some(t) => token = t.to_string(),
                None => break,
            }
        }
        Ok(out)
    }

    /// Where version `version` of `name` keeps its artifacts (`model-versions/get-download-uri`:
    /// `mlflow-artifacts:/...`, `file:///...`, ...).
    pub async fn download_uri(&self, name: &str, version: &str) -> Result<String, MlflowError> {
        let req = self.http.get(format!("{}/model-versions/get-download-uri", self.base)).query(&[("name", name), ("version", version)]);
        let (status, body) = self.call("a download-URI lookup", req).await?;
        match body["artifact_uri"].as_str().filter(|u| status < 400 && !u.is_empty()) {
            Some(u) => Ok(u.to_string()),
            None => Err(MlflowError::NoSuchVersion(name.into(), version.into())),
        }
    }

    /// The tracking server's base URL (`mlflow.tracking_uri`, no trailing /).
    pub fn tracking_uri(&self) -> &str {
        self.base.trim_end_matches("/api/2.0/mlflow")
    }

    /// What version `version` of `name` logged as `metric` in its run.
    pub async fn version_metric(&self, name: &str, version: &str, metric: &str) -> Result<VersionMetric, MlflowError> {
        let req = self.http.get(format!("{}/model-versions/get", self.base)).query(&[("name", name), ("version", version)]);
        let (status, body) = self.call("a model-version lookup", req).await?;
        if status >= 400 {
            return Err(MlflowError::NoSuchVersion(name.into(), version.into()));
        }
        let run_id = body["model_version"]["run_id"].as_str().unwrap_or("").to_string();
        if run_id.is_empty() {
            return Ok(VersionMetric::NoRun);
        }
        let req = self.http.get(format!("{}/runs/get", self.base)).query(&[("run_id", run_id.as_str())]);
        let (_, run) = self.call("a run lookup", req).await?;
        let value = run["run"]["data"]["metrics"]
            .as_array()
            .and_then(|ms| ms.iter().find(|m| m["key"] == metric))
            .and_then(|m| m["value"].as_f64());
        Ok(match value {
            Some(v) => VersionMetric::Value(v),
            None => VersionMetric::NotLogged(run_id),
        })
    }

    /// Whether version `version` of `name` exists.
    pub async fn version_exists(&self, name: &str, version: &str) -> Result<bool, MlflowError> {
        let req = self.http.get(format!("{}/model-versions/get", self.base)).query(&[("name", name), ("version", version)]);
        let (status, _) = self.call("a model-version lookup", req).await?;
        Ok(status < 400)
    }

    /// Points `name@production` at `version`.
    pub async fn set_production(&self, name: &str, version: &str) -> Result<(), MlflowError> {
        let req = self
            .http
            .post(format!("{}/registered-models/alias", self.base))
            .json(&serde_json::json!({"name": name, "alias": ALIAS, "version": version}));
        let (status, body) = self.call("moving the alias", req).await?;
        if status >= 400 {
            return Err(MlflowError::Api {
                what: "moving the alias".into(),
                status,
                message: body["message"].as_str().unwrap_or("").to_string(),
            });
        }
        Ok(())
    }
}

/// A version's eval metric, as its run logged it.
#[derive(Debug, Clone, PartialEq)]
pub enum VersionMetric {
    Value(f64),
    /// The version was not logged from a run.
    NoRun,
    /// Its run (this id) did not log the metric.
    NotLogged(String),
}
