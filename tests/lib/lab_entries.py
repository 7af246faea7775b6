#!/usr/bin/env python3
"""Prints [[models]] entries of the lab's catalog (tests/lab/agent.toml) as TOML, so tests and
benchmarks run exactly the commands the lab runs, with their own overrides.

    lab_entries.py NAME... [--set KEY=VALUE]... [--prefix-command SHELL]

`--set idle_timeout_s=8` overrides a key in every entry (the value is TOML). `--prefix-command`
puts a shell command before each entry's command (`PREFIX; COMMAND`). A NAME the lab's catalog
lacks is an error.
"""
import argparse
import json
import pathlib
import sys
import tomllib

LAB = pathlib.Path(__file__).resolve().parents[1] / "lab" / "agent.toml"


def val(v):
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {val(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(val(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="+")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--prefix-command")
    a = ap.parse_args()
    models = {m["name"]: m for m in tomllib.loads(LAB.read_text())["models"]}
    out = []
    for n in a.names:
        if n not in models:
            sys.exit(f"lab_entries: {LAB} has no model `{n}` (it has: {', '.join(models)})")
        m = dict(models[n])
        for kv in a.set:
            k, v = kv.split("=", 1)
            m[k] = tomllib.loads(f"v = {v}")["v"]
        if a.prefix_command:
            m["command"] = f"{a.prefix_command}; {m['command']}"
        out.append("[[models]]\n" + "".join(f"{k} = {val(v)}\n" for k, v in m.items()))
    print("\n".join(out))


if __name__ == "__main__":
    main()
