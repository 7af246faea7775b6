#!/usr/bin/env python3
"""Collects the license texts of the vendored crates that are compiled into the binaries.

usage: collect-licenses.py VENDOR_DIR OUT_DIR DEPENDENCY_LIST... [--same-as FILE]...

Each DEPENDENCY_LIST is `rpm/licenses.sh CRATE --list` output ("name vVERSION LICENSE").
Every distinct license text is stored once, under the first crate that has it
(OUT_DIR/<name>-<version>/<file>); OUT_DIR/INDEX lists, for every crate, where its texts are. A text identical to a --same-as
FILE (the project's own LICENSE, shipped next to OUT_DIR) is not stored again.
Storing each text once keeps the package small and rpmlint's duplicate check quiet; the index
keeps every crate's license findable. Run from the gpuhub.spec build section.
"""
import hashlib
import os
import re
import shutil
import sys

LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|UNLICENSE|COPYRIGHT)", re.I)


def main() -> int:
    if len(sys.argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    vendor, out, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    stored = {}  # sha256 -> path relative to OUT_DIR
    lists = []
    while rest:
        arg = rest.pop(0)
        if arg == "--same-as" and rest:
            same = rest.pop(0)
            with open(same, "rb") as f:
                stored[hashlib.sha256(f.read()).hexdigest()] = "../" + os.path.basename(same)
        else:
            lists.append(arg)
    crates = []
    for path in lists:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2:
                    crates.append((parts[0], parts[1].lstrip("v")))
    os.makedirs(out, exist_ok=True)
    shared = len(stored)
    index = []
    missing = []
    for name, version in sorted(set(crates)):
        src = os.path.join(vendor, f"{name}-{version}")
        if not os.path.isdir(src):
            continue  # a workspace crate: its license is the top-level LICENSE
        files = sorted(e for e in os.listdir(src) if LICENSE_FILE.match(e) and os.path.isfile(os.path.join(src, e)))
        if not files:
            missing.append(f"{name}-{version}")
            index.append(f"{name}-{version}: (no license file in the crate; see LICENSE.dependencies)")
            continue
        where = []
        for fname in files:
            with open(os.path.join(src, fname), "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            if digest not in stored:
                rel = f"{name}-{version}/{fname}"
                os.makedirs(os.path.join(out, f"{name}-{version}"), exist_ok=True)
                shutil.copyfile(os.path.join(src, fname), os.path.join(out, rel))
                stored[digest] = rel
            where.append(f"{fname} -> {stored[digest]}")
        index.append(f"{name}-{version}: " + ", ".join(where))
    with open(os.path.join(out, "INDEX"), "w") as f:
        f.write("# crate: its license files -> where the (deduplicated) text is stored\n")
        f.write("\n".join(index) + "\n")
    print(f"collect-licenses: {len(index)} crates, {len(stored) - shared} distinct texts stored, {len(missing)} without a file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
