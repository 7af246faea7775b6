#!/usr/bin/env python3
"""Checks the shipped /etc/gpuhub/agent.toml (rpm/agent.toml) against the agent's schema.

usage: check_config.py GPUHUB_AGENT_BINARY SHIPPED_TOML WORKDIR

The shipped file lists every option commented out: `#key = value` is the built-in default,
`##key = value` an example, `#[section]` a header. Checks, each failing with what differs:
  1. `gpuhub-agent check-config` accepts the file as shipped;
  2. uncommenting every default line changes nothing: the effective config equals the
     embedded defaults (so the documented defaults are the code's defaults);
  3. uncommenting the headers and every example validates (the examples work);
  4. every option the agent knows (the keys of the effective config, defaults and examples)
     is documented in the file, so a new option cannot ship undocumented.
"""
import os
import re
import subprocess
import sys
import tomllib

FREE_FORM = {("roles",), ("models", "env"), ("gateway", "user_models")}  # user-chosen keys, not options
HEADER = re.compile(r"^#{1,2}\[\[?([A-Za-z0-9_.]+)\]\]?\s*$")
KEYLINE = re.compile(r"^#{1,2}([A-Za-z0-9_]+)\s*=\s*(.*)$")
failures = []


def fail(msg):
    failures.append(msg)
    print(f"FAIL: {msg}")


def check_config(agent, path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUHUB_")}
    p = subprocess.run([agent, "check-config", "--config", path], capture_output=True, text=True, env=env, timeout=30)
    return p.returncode, p.stdout, p.stderr


def effective(stdout):
    return tomllib.loads("\n".join(l for l in stdout.splitlines() if not l.startswith("#")))


def uncomment(lines, defaults, examples):
    out = []
    for l in lines:
        if HEADER.match(l) and (examples or not l.startswith("##")):
            out.append(l.lstrip("#"))
        elif l.startswith("##") and examples:
            out.append(l[2:])
        elif defaults and KEYLINE.match(l) and not l.startswith("##"):
            out.append(l[1:])
        else:
            out.append(l)
    return "\n".join(out) + "\n"


def documented(lines):
    """(section path, key) pairs the file documents."""
    docs, section = set(), ()
    for l in lines:
        m = HEADER.match(l)
        if m:
            section = tuple(m.group(1).split("."))
            docs.add((section[:-1], section[-1]))
            continue
        m = KEYLINE.match(l)
        if m:
            key, value = m.group(1), m.group(2)
            docs.add((section, key))
            if value.startswith("{"):
                for inner in re.findall(r"([A-Za-z0-9_]+)\s*=", value):
                    docs.add((section + (key,), inner))
    return docs


def keys(value, path=()):
    """(section path, key) for every option in an effective config."""
    out = set()
    if path in FREE_FORM:
        return out
    for k, v in value.items():
        out.add((path, k))
        if isinstance(v, dict):
            out |= keys(v, path + (k,))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for item in v:
                out |= keys(item, path + (k,))
    return out


def main():
    agent, shipped, work = sys.argv[1:4]
    lines = open(shipped).read().splitlines()

    rc, out, err = check_config(agent, shipped)
    print(f"$ gpuhub-agent check-config --config {shipped}  -> rc {rc}")
    if rc != 0:
        fail(f"check-config rejects the shipped file: {err.strip()}")
        return
    pristine = effective(out)

    empty = os.path.join(work, "empty.toml")
    open(empty, "w").close()
    rc, out, err = check_config(agent, empty)
    if rc != 0:
        fail(f"check-config rejects an empty file: {err.strip()}")
        return
    builtin = effective(out)
    if pristine != builtin:
        fail("the shipped file (all commented) does not give the embedded defaults; an uncommented line?")

    defaults_path = os.path.join(work, "defaults.toml")
    open(defaults_path, "w").write(uncomment(lines, defaults=True, examples=False))
    rc, out, err = check_config(agent, defaults_path)
    print(f"$ gpuhub-agent check-config (every #default uncommented)  -> rc {rc}")
    if rc != 0:
        fail(f"the documented defaults do not validate: {err.strip()} (file: {defaults_path})")
    else:
        got = effective(out)
        if got != builtin:
            for section in sorted(set(got) | set(builtin)):
                if got.get(section) != builtin.get(section):
                    fail(f"documented default differs from the code in [{section}]: file gives {got.get(section)!r}, code {builtin.get(section)!r}")

    examples_path = os.path.join(work, "examples.toml")
    open(examples_path, "w").write(uncomment(lines, defaults=False, examples=True))
    rc, out, err = check_config(agent, examples_path)
    print(f"$ gpuhub-agent check-config (every ##example uncommented)  -> rc {rc}")
    if rc != 0:
        fail(f"the examples do not validate: {err.strip()} (file: {examples_path})")
        with_examples = {}
    else:
        with_examples = effective(out)

    known = keys(builtin) | keys(with_examples)
    docs = documented(lines)
    missing = sorted(k for k in known if k not in docs)
    for section, key in missing:
        where = ".".join(section + (key,))
        fail(f"option `{where}` is not documented in {shipped}; add `#{key} = <default>` (or `##{key} = <example>`) under [{'.'.join(section) or 'top level'}]")
    stale = sorted(k for k in docs if k not in known and k[0] not in FREE_FORM)
    for section, key in stale:
        fail(f"{shipped} documents `{'.'.join(section + (key,))}`, which the agent does not know (renamed or removed?)")
    print(f"options known to the agent: {len(known)}, documented: {len(docs)}")


if __name__ == "__main__":
    main()
    if failures:
        print(f"{len(failures)} problem(s) with the shipped agent.toml")
        sys.exit(1)
    print("shipped agent.toml: ok")
