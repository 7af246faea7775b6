//! The registry's inventory: every registered model in MLflow, served or not (latest version,
//! aliases, tags), read through every page of `registered-models/search`, for
//! `gpuhub models registry`.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

/// Registered models per page (MLflow's default and a safe maximum on every version).
pub const PAGE: u32 = 50;
/// Pages read at most (100,000 models): more is not a node's registry.
const MAX_PAGES: usize = 2000;

#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    #[error("cannot reach MLflow at {uri}: {source} (is the tracking server up? check mlflow.tracking_uri)")]
    Unreachable { uri: String, source: reqwest::Error },
    #[error("MLflow at {uri} answered {status} to a registry search: {message}")]
    Api { uri: String, status: u16, message: String },
    #[error("MLflow at {uri} gave page {page} of the registry search twice (its page token repeats); the list would never end")]
    Loop { uri: String, page: usize },
}

/// One registered model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegistryEntry {
    pub name: String,
    /// The highest version number among the model's versions MLflow reports as latest.
    pub latest_version: Option<String>,
    /// alias -> version.
    pub aliases: BTreeMap<String, String>,
    pub tags: BTreeMap<String, String>,
    pub description: String,
}

impl RegistryEntry {
    pub fn from_json(m: &Value) -> RegistryEntry {
        let latest = m["latest_versions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v["version"].as_str())
            .max_by_key(|v| (v.parse::<u64>().unwrap_or(0), v.to_string()))
            .map(str::to_string);
        RegistryEntry {
            name: m["name"].as_str().unwrap_or("").to_string(),
            latest_version: latest,
            aliases: m["aliases"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| Some((a["alias"].as_str()?.to_string(), a["version"].as_str().unwrap_or("").to_string())))
                .collect(),
            tags: m["tags"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| Some((t["key"].as_str()?.to_string(), t["value"].as_str().unwrap_or("").to_string())))
                .collect(),
            description: m["description"].as_str().unwrap_or("").to_string(),
        }
    }
}

/// Every registered model, sorted by name.
pub async fn list_all(tracking_uri: &str) -> Result<Vec<RegistryEntry>, InventoryError> {
    let base = format!("{}/api/2.0/mlflow", tracking_uri.trim_end_matches('/'));
    let http = reqwest::Client::builder().pool_max_idle_per_host(0).timeout(Duration::from_secs(10)).build().unwrap_or_default();
    let mut out = Vec::new();
    let mut token = String::new();
    let mut seen = std::collections::HashSet::new();
    for page in 0..MAX_PAGES {
        let mut q = vec![("max_results", PAGE.to_string())];
        if !token.is_empty() {
            q.push(("page_token", token.clone()));
        }
        let resp = http
            .get(format!("{base}/registered-models/search"))
            .query(&q)
            .send()
            .await
            .map_err(|source| InventoryError::Unreachable { uri: base.clone(), source })?;
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        if status >= 400 {
            return Err(InventoryError::Api { uri: base, status, message: crate::util::sanitize(body["message"].as_str().unwrap_or("")) });
        }
        out.extend(body["registered_models"].as_array().into_iter().flatten().map(RegistryEntry::from_json));
        match body["next_page_token"].as_str().filter(|t| !t.is_empty()) {
            Some(t) if !seen.insert(t.to_string()) => return Err(InventoryError::Loop { uri: base, page: page + 1 }),
            Some(t) => token = t.to_string(),
            None => break,
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out.dedup_by(|a, b| a.name == b.name);
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_search_entry_reads_latest_version_aliases_and_tags() {
        let e = RegistryEntry::from_json(&json!({
            "name": "smol",
            "latest_versions": [{"version": "9", "current_stage": "None"}, {"version": "12", "current_stage": "Production"}],
            "aliases": [{"alias": "production", "version": "9"}, {"alias": "canary", "version": "12"}],
            "tags": [{"key": "served_by", "value": "gateway"}, {"key": "team", "value": "nlp"}],
            "description": "a small chat model"
        }));
        assert_eq!(e.name, "smol");
        assert_eq!(e.latest_version.as_deref(), Some("12"), "numeric, not string order");
        assert_eq!(e.aliases["production"], "9");
        assert_eq!(e.aliases["canary"], "12");
        assert_eq!(e.tags["team"], "nlp");
        assert_eq!(e.description, "a small chat model");
        let bare = RegistryEntry::from_json(&json!({"name": "empty"}));
        assert!(bare.latest_version.is_none() && bare.aliases.is_empty() && bare.tags.is_empty());
    }
}
