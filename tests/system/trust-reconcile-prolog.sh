#!/usr/bin/env bash
# timeout: 500
# trust-reconcile.sh with the optional job-hooks build (spank_gpuhub_prolog.so, PrologFlags=Alloc,
# accounting.job_boundaries = "prolog"): the same faults and the same comparison with sacct, and a
# job whose JobEnd never arrived, or whose JobStart never came, is an anomaly
# (end_from_slurm / start_from_slurm), counted in gpuhub_accounting_anomalies_total.
set -euo pipefail
GPUHUB_TRUST_BOUNDARIES=prolog exec bash "$(dirname "$0")/trust-reconcile.sh"
