# shellcheck shell=bash
# Sourced by tests and benchmarks that run their own gpuhub-agent beside the lab's:
#   agent_config DIR [TELEMETRY_TOML]
# picks two free loopback ports (AGENT_GW_PORT, AGENT_METRICS_PORT), creates DIR/{state,spool,run}
# and writes DIR/agent.toml with those paths and listeners, plus the `[telemetry]` section given
# (default: no NVML, no Slurm). Append more sections to DIR/agent.toml afterwards if needed.
agent_config() {
    local dir="$1" telemetry="${2-$'enable_nvml = false\nenable_slurm = false'}"
    read -r AGENT_GW_PORT AGENT_METRICS_PORT < <(python3 "$(dirname "${BASH_SOURCE[0]}")/free_port.py" 2)
    mkdir -p "$dir/state" "$dir/spool" "$dir/run"
    cat > "$dir/agent.toml" <<TOML
[paths]
state_dir = "$dir/state"
spool_dir = "$dir/spool"
runtime_dir = "$dir/run"
[gateway]
listen = "127.0.0.1:$AGENT_GW_PORT"
[metrics]
listen = "127.0.0.1:$AGENT_METRICS_PORT"
[telemetry]
$telemetry
TOML
}
