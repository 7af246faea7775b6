#!/usr/bin/env bash
# accounting-lab.sh with the optional job-hooks build: spank_gpuhub_prolog.so with
# PrologFlags=Alloc (Slurm restarted for the test and restored after), and an agent that bills
# the prolog's JobStart/JobEnd records (accounting.job_boundaries = "prolog"), to the microsecond
# of the records and within Slurm's whole seconds of sacct.
set -euo pipefail
GPUHUB_ACCT_BOUNDARIES=prolog exec bash "$(dirname "$0")/accounting-lab.sh"
