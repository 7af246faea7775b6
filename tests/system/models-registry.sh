#!/usr/bin/env bash
# timeout: 300
# `gpuhub models registry` is the registry's inventory: every registered model in a real
# `mlflow server`, served or not, with its latest version, aliases and tags, read through every
# page of MLflow's search (53 models, as many as the seed; the agent reads 50 per page).
# The expected values come from the recipe that registered the models, compared per model:
#   - model i has 1 + i % 3 versions (latest = that number), tag team=t(i % 4), description;
#   - @production -> 1 for even i, @canary -> latest for i % 5 == 0;
#   - the 15 models i < 15 are tagged served_by=gateway (without a template: listed, not served,
#     and the error says why), the others are not tagged and still listed;
#   - the table has one row per model and says "53 registered models".
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
. "$REPO/tests/lib/lab.sh"
. "$REPO/tests/lib/models.sh"
. "$REPO/tests/lib/mlflow.sh"
lab_require
PORT="$(python3 "$REPO/tests/lib/free_port.py")"
mlflow_start "$PORT" || lab_fail "mlflow server did not start"
lab_cleanup_add "mlflow_stop $PORT; rm -rf /var/tmp/gpuhub-mlflow-$PORT"
PY="$REPO/.venv/bin/python"
PFX="inv-$$-"
N=53

echo "== registering $N models ($PFX*)"
"$PY" - "$MLFLOW_URL" "$PFX" "$N" <<'PYEOF' || lab_fail "registering the test models in MLflow failed"
import sys, mlflow
from mlflow import MlflowClient
uri, pfx, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
mlflow.set_tracking_uri(uri)
mlflow.set_experiment("gpuhub-inventory-test")
c = MlflowClient()
with mlflow.start_run() as r:
    pass
for i in range(n):
    name = f"{pfx}{i:02d}"
    tags = {"team": f"t{i % 4}"}
    if i < 15:
        tags["served_by"] = "gateway"
    c.create_registered_model(name, tags=tags, description=f"model number {i}")
    for _ in range(1 + i % 3):
        c.create_model_version(name, source=f"runs:/{r.info.run_id}/model", run_id=r.info.run_id)
    if i % 2 == 0:
        c.set_registered_model_alias(name, "production", "1")
    if i % 5 == 0:
        c.set_registered_model_alias(name, "canary", str(1 + i % 3))
print("registered", n)
PYEOF

models_setup "" "[mlflow]
tracking_uri = \"$MLFLOW_URL\"
registry_poll_s = 5"
CLI=("$MT_CLI" --socket "$MT_DIR/run/agent.sock")

echo "== gpuhub models registry --json"
"${CLI[@]}" models registry --json > "$MT_DIR/registry.json" || models_fail "gpuhub models registry --json failed"
python3 - "$MT_DIR/registry.json" "$PFX" "$N" <<'PY' || models_fail "gpuhub models registry differs from what was registered (MISMATCH lines above)"
import json, sys
rows = json.load(open(sys.argv[1]))["registered"]
pfx, n = sys.argv[2], int(sys.argv[3])
mine = {r["name"]: r for r in rows if r["name"].startswith(pfx)}
bad = []
def check(ok, msg):
    if not ok:
        print("MISMATCH:", msg)
        bad.append(msg)
check(len(mine) == n, f"{len(mine)} of the {n} registered models listed (MLflow pages its search results)")
for i in range(n):
    name = f"{pfx}{i:02d}"
    r = mine.get(name)
    if r is None:
        check(False, f"{name} missing")
        continue
    latest = str(1 + i % 3)
    aliases = {}
    if i % 2 == 0:
        aliases["production"] = "1"
    if i % 5 == 0:
        aliases["canary"] = latest
    tags = {"team": f"t{i % 4}"}
    if i < 15:
        tags["served_by"] = "gateway"
    check(r["latest_version"] == latest, f"{name}: latest_version {r['latest_version']!r}, want {latest}")
    check(r["aliases"] == aliases, f"{name}: aliases {r['aliases']}, want {aliases}")
    check(r["production"] == aliases.get("production"), f"{name}: production {r['production']!r}")
    check(r["tags"] == tags, f"{name}: tags {r['tags']}, want {tags}")
    check(r["description"] == f"model number {i}", f"{name}: description {r['description']!r}")
    check(r["gateway_tagged"] == (i < 15), f"{name}: gateway_tagged {r['gateway_tagged']}")
    check(r["served_as"] == [], f"{name}: served as {r['served_as']} (nothing serves it)")
    if i < 15:
        check(any("gpuhub.template" in e for e in r["errors"]), f"{name}: tagged served_by=gateway without a template, but no error says so: {r['errors']}")
    else:
        check(r["errors"] == [], f"{name}: errors {r['errors']} for an untagged model")
print(f"ok: {len(mine)} models, each with its latest version, aliases, tags" if not bad else f"{len(bad)} mismatches")
sys.exit(1 if bad else 0)
PY

echo "== the table"
out="$("${CLI[@]}" models registry)" || models_fail "gpuhub models registry failed"
echo "$out" | head -n 5
[ "$(grep -c "^$PFX" <<<"$out")" = "$N" ] || models_fail "the table has $(grep -c "^$PFX" <<<"$out") rows of $PFX*, want $N"
grep -E "^${PFX}10 +2 +@canary=2,@production=1 +\(not served\) +served_by=gateway,team=t2 *$" <<<"$out" >/dev/null ||
    models_fail "the row of ${PFX}10 should read: latest 2, @canary=2,@production=1, (not served), served_by=gateway,team=t2"
grep -E "^${PFX}51 +1 +- +\(not served\) +team=t3 *$" <<<"$out" >/dev/null ||
    models_fail "the row of ${PFX}51 should read: latest 1, no alias, (not served), team=t3"
grep -q "^$N registered models$" <<<"$out" || models_fail "the table does not end with \"$N registered models\""
echo "PASS models-registry"
