#!/usr/bin/env bash
# Prints the SPDX License expression of what one gpuhub crate links (itself + every crate it
# compiles in on x86_64 Linux; build scripts, proc-macros and dev-dependencies are not shipped).
#   rpm/licenses.sh gpuhub-agent|gpuhub-spank [--list]
# --list prints "name version license" per linked crate (shipped as LICENSE.dependencies).
# rpm/build.sh compares the expression with the spec's License: tags and fails on a difference,
# so a new dependency license cannot slip into the RPMs unnoticed.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pkg="${1:?usage: licenses.sh CRATE [--list]}"
mode="${2:-expr}"

tree() {
    # -e normal,no-proc-macro: what ends up in the binary. --offline --locked: no network, no
    # lockfile change; works with the vendored sources inside rpmbuild too.
    (cd "$REPO" && cargo tree -p "$pkg" -e normal,no-proc-macro --prefix none \
        --format '{p}|{l}' --target x86_64-unknown-linux-gnu --offline --locked) |
        sed -e 's/ (\*)$//' -e 's/ ([^)]*)|/|/' | sort -u
}

# Joins the linked crates' license expressions into one SPDX expression: "MIT/Apache-2.0" (old
# cargo style) becomes "MIT OR Apache-2.0", top-level AND terms are split, OR operands sorted,
# duplicates dropped, so the result only changes when a new license (combination) appears.
expression() {
    python3 -c '
import re, sys
def split_top(expr, op):
    parts, depth, cur, i = [], 0, "", 0
    while i < len(expr):
        c = expr[i]
        depth += (c == "(") - (c == ")")
        if depth == 0 and expr.startswith(op, i):
            parts.append(cur); cur = ""; i += len(op); continue
        cur += c; i += 1
    return [p.strip() for p in parts + [cur]]
def strip_parens(e):
    while e.startswith("(") and e.endswith(")") and split_top(e[1:-1], " AND ") and "(" not in e[1:-1]:
        e = e[1:-1].strip()
    return e
terms = set()
for line in sys.stdin:
    lic = line.rstrip("\n").split("|", 1)[1]
    lic = re.sub(r"\s*/\s*", " OR ", lic)
    for t in split_top(lic, " AND "):
        t = strip_parens(t)
        if " AND " not in t and "(" not in t and " OR " in t:
            t = " OR ".join(sorted(split_top(t, " OR ")))
        terms.add(t)
print(" AND ".join(("(%s)" % t) if " " in t else t for t in sorted(terms)))
'
}

case "$mode" in
--list)
    tree | awk -F'|' '{ split($1, p, " "); printf "%s %s %s\n", p[1], p[2], $2 }'
    ;;
expr)
    tree | expression
    ;;
*) echo "licenses.sh: unknown mode '$mode'; use --list or nothing" >&2; exit 2 ;;
esac
