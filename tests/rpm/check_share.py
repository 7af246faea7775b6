#!/usr/bin/env python3
"""Checks what gpuhub ships in /usr/share/gpuhub (rpm/share/) against the real agent.

usage: check_share.py REPO METRICS_TEXT WORKDIR

  - the Grafana JSON in rpm/share/grafana equals a fresh run of rpm/grafana/make-dashboards.py;
  - every dashboard: unique uid, a `datasource` variable, every query on ${datasource};
  - every PromQL query of the dashboards parses (written as recording rules, checked with
    `promtool check rules`, template variables replaced by sample values);
  - every metric the dashboards and alert rules query is exported by the running agent
    (METRICS_TEXT, the agent's /metrics; `up` is Prometheus' own);
  - the JupyterHub example defines the site's four profiles (1 GPU 8 h, 2 GPUs 4 h, 7 shards
    6 h, CPU only 8 h).
"""
import filecmp
import glob
import json
import os
import re
import subprocess
import sys

failures = []


def expect(where, cond, what):
    print(("ok   " if cond else "FAIL ") + f"{where}: {what}")
    if not cond:
        failures.append(f"{where}: {what}")


def exported_names(metrics_text):
    names = {"up"}
    for line in metrics_text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            name, kind = m.groups()
            names.add(name)
            if kind == "counter":
                names |= {name + "_total", name + "_created"}
            elif kind in ("histogram", "gaugehistogram"):
                names |= {name + "_bucket", name + "_sum", name + "_count", name + "_created"}
            elif kind == "summary":
                names |= {name + "_sum", name + "_count", name + "_created"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def queried_names(expr):
    # Metric names: gpuhub_* and DCGM_*; `up` handled by the alert check itself.
    return set(re.findall(r"\b(gpuhub_[a-z0-9_]+|DCGM_FI_[A-Z0-9_]+)\b", expr))


def substitute(expr):
    return (expr.replace("$__range", "1h").replace("$shards_per_gpu", "14")
            .replace("$gpu", "0").replace("$Hostname", "gpu01").replace("$model", ".*")
            .replace("$user", ".*").replace("$app", ".*").replace("$account", ".*"))


def main():
    repo, metrics_path, work = sys.argv[1:4]
    exported = exported_names(open(metrics_path).read())
    print(f"agent exports {len(exported)} sample names")

    fresh = os.path.join(work, "grafana")
    subprocess.run([sys.executable, os.path.join(repo, "rpm/grafana/make-dashboards.py"), fresh], check=True)
    shipped = sorted(glob.glob(os.path.join(repo, "rpm/share/grafana/*.json")))
    names = [os.path.basename(p) for p in shipped]
    expect("grafana", names == sorted(os.listdir(fresh)), f"shipped dashboards {names} are what make-dashboards.py writes")
    for p in shipped:
        same = os.path.exists(os.path.join(fresh, os.path.basename(p))) and filecmp.cmp(p, os.path.join(fresh, os.path.basename(p)), shallow=False)
        expect(os.path.basename(p), same, "equals a fresh make-dashboards.py run (else run: python3 rpm/grafana/make-dashboards.py)")

    uids, rules, used = set(), [], {}
    for p in shipped:
        board = json.load(open(p))
        name = os.path.basename(p)
        expect(name, board["uid"] not in uids, f"uid {board['uid']} is unique")
        uids.add(board["uid"])
        variables = {v["name"]: v for v in board["templating"]["list"]}
        expect(name, variables.get("datasource", {}).get("type") == "datasource", "has a `datasource` variable")
        queries = 0
        for panel in board["panels"]:
            for t in panel.get("targets", []):
                queries += 1
                if t.get("datasource", {}).get("uid") != "${datasource}":
                    expect(name, False, f"panel '{panel['title']}' query {t['refId']} uses ${{datasource}}")
                rules.append((f"{name} / {panel['title']} / {t['refId']}", t["expr"]))
                for n in queried_names(t["expr"]):
                    used.setdefault(n, set()).add(name)
        for v in variables.values():
            if v.get("type") == "query":
                rules.append((f"{name} / variable {v['name']}", re.sub(r"^label_values\((.*), *\w+\)$", r"\1", v["definition"])))
                for n in queried_names(v["definition"]):
                    used.setdefault(n, set()).add(name)
        expect(name, queries > 0, f"{queries} queries")

    rule_file = os.path.join(work, "dashboard-queries.yml")
    with open(rule_file, "w") as f:
        f.write("groups:\n  - name: dashboard-queries\n    rules:\n")
        for i, (_, expr) in enumerate(rules):
            f.write(f"      - record: q{i}\n        expr: {json.dumps(substitute(expr))}\n")
    p = subprocess.run(["promtool", "check", "rules", rule_file], capture_output=True, text=True)
    detail = p.stdout + p.stderr
    for i, (where, _) in enumerate(rules):  # name the failing panels
        if re.search(rf"\bq{i}\b", detail) and p.returncode != 0:
            print(f"     query q{i} is {where}")
    expect("dashboards", p.returncode == 0, f"all {len(rules)} PromQL queries parse (promtool check rules)" + ("" if p.returncode == 0 else f": {detail.strip()}"))

    alerts = "\n".join(l for l in open(os.path.join(repo, "rpm/share/prometheus/gpuhub-alerts.yml")).read().splitlines()
                       if not l.lstrip().startswith("#"))
    for n in queried_names(alerts):
        used.setdefault(n, set()).add("gpuhub-alerts.yml")
    # The dead-letter counter is registered by the gateway branch (usage_log.rs); until that code
    # is in this tree the alert on it is the only query allowed to name a metric the agent does
    # not export. The exemption ends by itself once the registration is in agent/src.
    pending = set()
    if not any("gateway_usage_rows_dead_lettered" in open(p, errors="replace").read()
               for p in glob.glob(os.path.join(repo, "agent/src/**/*.rs"), recursive=True)):
        pending.add("gpuhub_gateway_usage_rows_dead_lettered_total")
    for n in sorted(used):
        if n in pending and n not in exported:
            print(f"note metric {n}: queried by {', '.join(sorted(used[n]))}; registered by the gateway branch, not in this tree yet")
            continue
        expect("metric " + n, n in exported, f"queried by {', '.join(sorted(used[n]))}; exported by gpuhub-agent")

    ns = {}

    class Config(dict):
        def __getattr__(self, k):
            return self.setdefault(k, Config())

        def __setattr__(self, k, v):
            self[k] = v

    cfg = Config()
    # The example imports batchspawner (for its hub API); only its settings are checked here.
    sys.modules.setdefault("batchspawner", type(sys)("batchspawner"))
    code = open(os.path.join(repo, "rpm/share/jupyterhub/jupyterhub_config.py")).read()
    exec(compile(code, "jupyterhub_config.py", "exec"), {"get_config": lambda: cfg, "__name__": "jupyterhub_config"}, ns)
    profiles = cfg.ProfilesSpawner.profiles
    expect("jupyterhub", cfg.JupyterHub.spawner_class == "wrapspawner.ProfilesSpawner", "uses wrapspawner.ProfilesSpawner")
    want = [("--gres=gpu:1", "8:00:00"), ("--gres=gpu:2", "4:00:00"), ("--gres=shard:7", "6:00:00"), ("", "8:00:00")]
    got = [((re.search(r"--gres=\S+", p[3]["req_options"]) or [""])[0], p[3]["req_runtime"]) for p in profiles]
    expect("jupyterhub", got == want, f"four profiles (gres, runtime) = {got}, want {want}")
    expect("jupyterhub", all(p[2] == "batchspawner.SlurmSpawner" for p in profiles), "every profile is a batchspawner.SlurmSpawner (a Slurm job)")
    expect("jupyterhub", cfg.ProfilesSpawner.default_profile in [p[1] for p in profiles], "default_profile is one of the profiles")
    auth = cfg.JupyterHub.authenticator_class
    module = os.path.join(repo, "rpm/share/jupyterhub", auth.split(".")[0] + ".py")
    expect("jupyterhub", auth == "gpuhub_jupyterhub_sso.GpuhubSSOAuthenticator" and os.path.exists(module),
           f"signs in through the shipped SSO authenticator ({auth}, {os.path.relpath(module, repo)})")
    page = [sv for sv in cfg.JupyterHub.services if sv.get("name") == "gpuhub"]
    expect("jupyterhub", len(page) == 1 and page[0]["command"][-1].endswith("/gpuhub_page.py")
           and os.path.exists(os.path.join(repo, "rpm/share/jupyterhub/gpuhub_page.py")),
           "runs the shipped gpuhub page (gpuhub_page.py) as the JupyterHub service `gpuhub`")
    s = cfg.GpuhubSSOAuthenticator
    expect("jupyterhub", s.shared_secret_file.startswith("/") and s.trusted_proxies and s.email_header,
           "the SSO authenticator has a secret file, trusted proxies and an e-mail header")


if __name__ == "__main__":
    main()
    if failures:
        print(f"{len(failures)} problem(s) in rpm/share")
        sys.exit(1)
    print("rpm/share: ok")
