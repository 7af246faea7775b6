//! `[cluster]`: each node's role, in the one agent.toml a cluster shares.
//!
//! Telemetry, spool ingest and the control socket run on every node (every node has GPUs and
//! jobs to account for), so they have no switch. The gateway (the OpenAI API and the workers
//! it starts) runs on the nodes named in `gateway_nodes`, matched against the agent's Slurm
//! node name (`telemetry.slurm_node_name`, else the host name): one list, one file for every
//! node. Empty (the default): every node runs a gateway, as a single node always did.

use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// Slurm node names whose agent runs the gateway; empty: every node.
    #[serde(deserialize_with = "node_names")]
    pub gateway_nodes: Vec<String>,
}

/// The list, checked while parsing so a bad entry is reported with its line: Slurm node names
/// (letters, digits, `-`, `_`, `.`), each once.
fn node_names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let names = Vec::<String>::deserialize(d)?;
    for (i, n) in names.iter().enumerate() {
        if n.is_empty() || !n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(serde::de::Error::custom(format!(
                "`{}` is not a Slurm node name (letters, digits, `-`, `_`, `.`); list the nodes as `scontrol show nodes` names them",
                crate::util::sanitize(n)
            )));
        }
        if names[..i].contains(n) {
            return Err(serde::de::Error::custom(format!("`{n}` is listed twice; list each gateway node once")));
        }
    }
    Ok(names)
}

impl ClusterConfig {
    /// Whether the agent of Slurm node `node` runs the gateway.
    pub fn is_gateway(&self, node: &str) -> bool {
        self.gateway_nodes.is_empty() || self.gateway_nodes.iter().any(|n| n == node)
    }

    /// Cross-field check for the agent of `node`: a node without the gateway still tells its
    /// jobs a gateway URL, so `gateway.public_url` must name a gateway node.
    pub(super) fn validate(&self, node: &str, public_url: Option<&str>) -> Result<(), (String, String)> {
        if !self.is_gateway(node) && public_url.is_none_or(str::is_empty) {
            return Err((
                "cluster.gateway_nodes".into(),
                format!(
                    "this node ({}) is not in the list ({}), so it runs no gateway, and gateway.public_url is not set: its jobs would be told a gateway that does not listen; set gateway.public_url to a gateway node's URL (e.g. http://{}:8400)",
                    crate::util::sanitize(node),
                    self.gateway_nodes.join(", "),
                    self.gateway_nodes.first().map(String::as_str).unwrap_or("NODE")
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use crate::config::Config;

    #[test]
    fn every_node_is_a_gateway_by_default() {
        let c = Config::from_toml("").unwrap();
        assert!(c.file.cluster.is_gateway("gpu01"));
        assert!(c.is_gateway());
    }

    #[test]
    fn the_list_decides_and_a_non_gateway_needs_a_public_url() {
        let base = "[telemetry]\nslurm_node_name = \"gpu02\"\n";
        let c =
            Config::from_toml(&format!("{base}[gateway]\npublic_url = \"http://gpu01:8400\"\n[cluster]\ngateway_nodes = [\"gpu01\"]\n"))
                .unwrap();
        assert!(!c.is_gateway(), "gpu02 is not listed");
        assert!(c.file.cluster.is_gateway("gpu01"));
        let c = Config::from_toml(&format!("{base}[cluster]\ngateway_nodes = [\"gpu01\", \"gpu02\"]\n")).unwrap();
        assert!(c.is_gateway());

        let err = Config::from_toml(&format!("{base}[cluster]\ngateway_nodes = [\"gpu01\"]\n")).unwrap_err().to_string();
        assert!(err.contains("cluster.gateway_nodes") && err.contains("gpu02") && err.contains("gateway.public_url"), "{err}");
    }

    #[test]
    fn bad_entries_are_refused_with_their_line() {
        let err = Config::from_toml("[cluster]\n\ngateway_nodes = [\"gpu01\", \"gpu 02\"]\n").unwrap_err().to_string();
        assert!(err.contains("line 3") && err.contains("`gpu 02` is not a Slurm node name"), "{err}");
        let err = Config::from_toml("[cluster]\ngateway_nodes = [\"gpu01\", \"gpu01\"]\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("listed twice"), "{err}");
        let err = Config::from_toml("[cluster]\ngateway = [\"gpu01\"]\n").unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("gateway_nodes"), "{err}");
    }
}
