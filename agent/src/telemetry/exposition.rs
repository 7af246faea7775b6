//! OpenMetrics text -> Prometheus text format 0.0.4, for scrapers and tools that do not speak
//! OpenMetrics (`curl | promtool check metrics` with Debian's promtool 2.42, older Prometheus).
//!
//! prometheus-client encodes OpenMetrics only. The formats differ where it matters here: an
//! OpenMetrics counter family `x` has samples `x_total`, while Prometheus text wants the HELP
//! and TYPE lines to name `x_total` (promtool otherwise reports "no help text"); `# UNIT` and
//! `# EOF` do not exist there; `info`/`stateset` types become `gauge`, `unknown` `untyped`.
//! The `/metrics` handler serves OpenMetrics when the `Accept` header asks for
//! `application/openmetrics-text` (Prometheus does) and this conversion otherwise.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::registry::Registry;

use super::dcgm::DcgmExposition;

/// What `/metrics` serves: the registry (gpuhub's series) and the DCGM block.
#[derive(Debug)]
pub struct Exposition {
    registry: Registry,
    dcgm: Option<Arc<DcgmExposition>>,
    /// Size of the last body, to allocate the next one at once.
    last_len: AtomicUsize,
}

impl Exposition {
    pub fn new(registry: Registry, dcgm: Option<Arc<DcgmExposition>>) -> Self {
        Self { registry, dcgm, last_len: AtomicUsize::new(64 * 1024) }
    }

    /// The whole body: OpenMetrics (ending in `# EOF`) or the Prometheus text format. The DCGM
    /// block is the same text in both (dcgm-exporter's counters keep their names).
    pub fn render(&self, openmetrics: bool) -> String {
        let body = render(&self.registry, self.dcgm.as_deref(), openmetrics, self.last_len.load(Ordering::Relaxed));
        self.last_len.store(body.len(), Ordering::Relaxed);
        body
    }
}

/// [`Exposition::render`] on borrowed parts; `capacity` is a hint.
pub fn render(registry: &Registry, dcgm: Option<&DcgmExposition>, openmetrics: bool, capacity: usize) -> String {
    let mut body = String::with_capacity(capacity + 4096);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut body, registry) {
        tracing::error!(error = %e, "encoding metrics failed");
    }
    let mut body = if openmetrics {
        if body.ends_with("# EOF\n") {
            body.truncate(body.len() - "# EOF\n".len());
        }
        body
    } else {
        to_prometheus_text(&body)
    };
    if let Some(d) = dcgm {
        d.encode(&mut body);
    }
    if openmetrics {
        body.push_str("# EOF\n");
    }
    body
}

/// Content type of [`to_prometheus_text`]'s output.
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an `Accept` header value asks for OpenMetrics.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| a.contains("application/openmetrics-text"))
}

/// Rewrites OpenMetrics text (as prometheus-client encodes it) into Prometheus text format.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // Families whose sample names carry a suffix, so their HELP line (which comes before TYPE)
    // is renamed too. A counter's samples end in `_total` when prometheus-client wrote them;
    // dcgm-exporter's counters (the DCGM block) keep their bare names, and so does their TYPE.
    let lines: Vec<&str> = openmetrics.lines().collect();
    let mut suffixes: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for (i, rest) in lines.iter().enumerate().filter_map(|(i, l)| l.strip_prefix("# TYPE ").map(|r| (i, r))) {
        if let Some(name) = rest.strip_suffix(" counter") {
            let first_sample = lines[i + 1..].iter().find(|l| !l.starts_with('#'));
            let total = format!("{name}_total");
            if first_sample.is_none_or(|l| l.starts_with(&total)) {
                suffixes.insert(name, "_total");
            } else {
                suffixes.insert(name, "");
            }
        } else if let Some(name) = rest.strip_suffix(" info") {
            suffixes.insert(name, "_info");
        }
    }
    for line in lines {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let suffix = suffixes.get(name).copied().unwrap_or("");
            out.push_str(&format!("# HELP {name}{suffix} {help}\n"));
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name_suffix, kind) = match kind {
                "counter" => (suffixes.get(name).copied().unwrap_or("_total"), "counter"),
                "info" => ("_info", "gauge"),
                "stateset" | "gaugehistogram" => ("", "gauge"),
                "unknown" => ("", "untyped"),
                other => ("", other),
            };
            out.push_str(&format!("# TYPE {name}{name_suffix} {kind}\n"));
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_get_total_names_and_openmetrics_only_lines_go() {
        let om = "# HELP a_seconds Time.\n# TYPE a_seconds counter\n# UNIT a_seconds seconds\na_seconds_total{x=\"1\"} 2\n# HELP g Gauge.\n# TYPE g gauge\ng 1\n# TYPE i info\ni_info{v=\"1\"} 1\n# EOF\n";
        let p = to_prometheus_text(om);
        assert_eq!(
            p,
            "# HELP a_seconds_total Time.\n# TYPE a_seconds_total counter\na_seconds_total{x=\"1\"} 2\n# HELP g Gauge.\n# TYPE g gauge\ng 1\n# TYPE i_info gauge\ni_info{v=\"1\"} 1\n"
        );
        // A dcgm-exporter counter keeps its bare name.
        let om = "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION E.\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu=\"0\"} 5\n# EOF\n";
        assert_eq!(
            to_prometheus_text(om),
            "# HELP DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION E.\n# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\nDCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{gpu=\"0\"} 5\n"
        );
        assert!(wants_openmetrics(Some("application/openmetrics-text;version=1.0.0,text/plain;q=0.5")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
    }
}
