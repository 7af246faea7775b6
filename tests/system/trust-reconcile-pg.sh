#!/usr/bin/env bash
# timeout: 500
# trust-reconcile.sh with the agent's store on PostgreSQL (a fresh database of
# GPUHUB_TEST_PG_URL, which tests/run-all.sh starts): the same faults, the same comparison with
# sacct, on the production backend.
set -euo pipefail
. "$(dirname "$0")/../lib/prereq.sh"
[ -n "${GPUHUB_TEST_PG_URL:-}" ] || prereq_missing "GPUHUB_TEST_PG_URL is not set" "export the URL tests/lib/pg.sh prints" || exit 0
GPUHUB_TRUST_BACKEND=postgres exec bash "$(dirname "$0")/trust-reconcile.sh"
