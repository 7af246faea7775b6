#!/usr/bin/env bash
# Every installed path and default address in the packaging equals the code's default:
# wire/src/paths.rs (the constants both plugin and agent use) and the agent's own effective
# defaults (`gpuhub-agent check-config` on an empty file, `gpuhub --help`). Checked places:
# the spec (%files, expanded by rpmspec), the agent unit, the backup unit, the tmpfiles.d file,
# the shipped agent.toml, the plugstack snippet, the Prometheus scrape config and the admin
# guide's table. A mutated copy of the spec proves the check can fail.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"
command -v rpmspec >/dev/null || { echo "FAIL: rpmspec not found (apt-get install rpm)"; exit 1; }
echo "+ cargo build --release --workspace (a no-op after tests/run-all.sh built it)"
cargo build --release --quiet --workspace
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

: > "$work/empty.toml"
env -u GPUHUB_STORE_URL -u GPUHUB_CONFIG target/release/gpuhub-agent check-config --config "$work/empty.toml" > "$work/defaults.txt"
target/release/gpuhub --help > "$work/cli-help.txt" 2>&1 || true

spec_paths() {
    local load=()
    [ -n "$(rpm --eval '%{?_unitdir}')" ] || load=(--load rpm/macros.debian)
    rpmspec -P "${load[@]}" "$1"
}
spec_paths rpm/gpuhub.spec > "$work/spec.txt"
sed 's|%global gpuhub_statedir %{_localstatedir}/lib/gpuhub|%global gpuhub_statedir %{_localstatedir}/lib/gpuhub-old|' rpm/gpuhub.spec > "$work/mutated.spec"
spec_paths "$work/mutated.spec" > "$work/spec-mutated.txt"

python3 - "$work" <<'PY'
import re, sys, tomllib
work = sys.argv[1]
src = open("wire/src/paths.rs").read()
wire = dict(re.findall(r'pub const ([A-Z_]+): &str = "([^"]*)";', src))
need = ["CONFIG_DIR", "CONFIG_FILE", "STATE_DIR", "SPOOL_DIR", "RUNTIME_DIR", "DCGM_JOB_MAP_DIR_NAME", "SNAPSHOT_FILE_NAME", "JOB_KEY_FILE_NAME", "GATEWAY_LISTEN", "METRICS_LISTEN"]
missing = [n for n in need if n not in wire]
if missing:
    print(f"FAIL: wire/src/paths.rs lacks {missing}; update this test with the new names"); sys.exit(1)
print("wire defaults:", {k: wire[k] for k in need})
job_map = wire["RUNTIME_DIR"] + "/" + wire["DCGM_JOB_MAP_DIR_NAME"]
failures = []

def expect(where, cond, what):
    print(("ok   " if cond else "FAIL ") + f"{where}: {what}")
    if not cond:
        failures.append(f"{where}: {what}")

def files_section(text):
    """Paths listed in the %files sections of an expanded spec."""
    out, on = set(), False
    for line in text.splitlines():
        if line.startswith("%files"):
            on = True; continue
        if line.startswith("%changelog"):
            on = False
        if on:
            m = re.search(r"(/\S+)\s*$", line)
            if m: out.add(m.group(1))
    return out

def check_spec(text, label):
    files = files_section(text)
    bad = []
    for path in (wire["CONFIG_DIR"], wire["CONFIG_FILE"], wire["STATE_DIR"], wire["SPOOL_DIR"], wire["RUNTIME_DIR"], job_map):
        if path not in files:
            bad.append(path)
    return files, bad

files, bad = check_spec(open(f"{work}/spec.txt").read(), "spec")
expect("rpm/gpuhub.spec %files", not bad, f"lists {wire['CONFIG_FILE']}, state, spool, runtime and job-map dirs" + (f"; missing {bad}" if bad else ""))
_, bad_m = check_spec(open(f"{work}/spec-mutated.txt").read(), "mutated")
expect("self-test (spec with state dir renamed)", wire["STATE_DIR"] in bad_m, f"the check notices {wire['STATE_DIR']} missing")

unit = open("rpm/gpuhub-agent.service").read()
expect("gpuhub-agent.service", f"--config {wire['CONFIG_FILE']}" in unit, f"ExecStartPre/ExecStart use --config {wire['CONFIG_FILE']}")
expect("gpuhub-agent.service", re.search(r"^StateDirectory=gpuhub$", unit, re.M) and wire["STATE_DIR"] == "/var/lib/gpuhub", "StateDirectory=gpuhub is /var/lib/gpuhub == STATE_DIR")
expect("gpuhub-agent.service", re.search(r"^RuntimeDirectory=gpuhub$", unit, re.M) and wire["RUNTIME_DIR"] == "/run/gpuhub", "RuntimeDirectory=gpuhub is /run/gpuhub == RUNTIME_DIR")
expect("gpuhub-agent.service", re.search(r"^ReadWritePaths=-?" + re.escape(wire["SPOOL_DIR"]) + r"$", unit, re.M) is not None, f"ReadWritePaths has {wire['SPOOL_DIR']}")
backup = open("rpm/gpuhub-backup.service").read()
expect("gpuhub-backup.service", re.search(r"^ExecStart=/usr/bin/gpuhub backup\b", backup, re.M) is not None and "--socket" not in backup, "runs `gpuhub backup` on the CLI's default socket")
expect("rpm/gpuhub.spec %files", wire["STATE_DIR"] + "/backups" in files, f"owns {wire['STATE_DIR']}/backups (the agent's default backup dir)")

tmpf = open("rpm/gpuhub-spank.tmpfiles").read()
for p in (wire["SPOOL_DIR"], wire["RUNTIME_DIR"], job_map):
    expect("gpuhub-spank.tmpfiles", re.search(r"^d " + re.escape(p) + r" ", tmpf, re.M) is not None, f"creates {p}")

eff = tomllib.loads("\n".join(l for l in open(f"{work}/defaults.txt").read().splitlines() if not l.startswith("#")))
header = open(f"{work}/defaults.txt").read()
expect("agent defaults", eff["paths"]["state_dir"] == wire["STATE_DIR"], f"paths.state_dir = {eff['paths']['state_dir']}")
expect("agent defaults", eff["paths"]["spool_dir"] == wire["SPOOL_DIR"], f"paths.spool_dir = {eff['paths']['spool_dir']}")
expect("agent defaults", eff["paths"]["runtime_dir"] == wire["RUNTIME_DIR"], f"paths.runtime_dir = {eff['paths']['runtime_dir']}")
expect("agent defaults", eff["gateway"]["listen"] == wire["GATEWAY_LISTEN"], f"gateway.listen = {eff['gateway']['listen']}")
expect("agent defaults", eff["metrics"]["listen"] == wire["METRICS_LISTEN"], f"metrics.listen = {eff['metrics']['listen']}")
expect("agent defaults", eff["telemetry"].get("job_map_dir") == job_map, f"telemetry.job_map_dir = {eff['telemetry'].get('job_map_dir')}")
expect("agent defaults", eff["store"]["url"] == f"sqlite://{wire['STATE_DIR']}/gpuhub.db", f"store.url = {eff['store']['url']}")
sock = wire["RUNTIME_DIR"] + "/agent.sock"
expect("agent defaults", f"# control socket: {sock}" in header, f"control socket {sock}")
expect("gpuhub --help", sock in open(f"{work}/cli-help.txt").read(), f"the CLI's default --socket is {sock}")

shipped = open("rpm/agent.toml").read()
for key, val in (("state_dir", wire["STATE_DIR"]), ("spool_dir", wire["SPOOL_DIR"]), ("runtime_dir", wire["RUNTIME_DIR"]), ("job_map_dir", job_map)):
    expect("rpm/agent.toml", f'#{key} = "{val}"' in shipped, f'documents #{key} = "{val}"')
for listen in (wire["GATEWAY_LISTEN"], wire["METRICS_LISTEN"]):
    expect("rpm/agent.toml", f'#listen = "{listen}"' in shipped, f'documents #listen = "{listen}"')

plug = open("slurm-conf/plugstack.conf.d/gpuhub.conf").read()
where = "slurm-conf/plugstack.conf.d/gpuhub.conf"
expect(where, re.search(r"^optional /usr/lib64/slurm/spank_gpuhub.so\b", plug, re.M) is not None, "has the line `optional /usr/lib64/slurm/spank_gpuhub.so` the spec rewrites to %{_libdir}")
expect("rpm/gpuhub.spec", any(f.endswith("/slurm/spank_gpuhub.so") for f in files), "installs %{_libdir}/slurm/spank_gpuhub.so")
documented = dict(re.findall(r"^#\s+([a-z_]+)=(/\S+)$", plug, re.M))
for key, want in (("spool_dir", wire["SPOOL_DIR"]), ("snapshot", wire["RUNTIME_DIR"] + "/" + wire["SNAPSHOT_FILE_NAME"]),
                  ("job_key", wire["STATE_DIR"] + "/" + wire["JOB_KEY_FILE_NAME"]), ("dcgm_job_map_dir", job_map)):
    expect(where, documented.get(key) == want, f"documents {key}={documented.get(key)} (code: {want})")

prom = open("rpm/share/prometheus/gpuhub.yml").read()
expect("prometheus/gpuhub.yml", wire["METRICS_LISTEN"] in prom, f"scrapes {wire['METRICS_LISTEN']}")
guide = open("docs/admin-guide.md").read()
for p in (wire["CONFIG_FILE"], wire["STATE_DIR"], wire["SPOOL_DIR"], wire["RUNTIME_DIR"], wire["GATEWAY_LISTEN"], wire["METRICS_LISTEN"]):
    expect("docs/admin-guide.md", p in guide, f"mentions {p}")

if failures:
    print(f"{len(failures)} path(s) diverge from the code's defaults"); sys.exit(1)
print("PASS rpm-paths")
PY
