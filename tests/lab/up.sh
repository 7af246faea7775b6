#!/usr/bin/env bash
# Bring up the gpuhub lab on one machine, as root: a real single-node Slurm 22.05 with fake
# H200 GPUs (gpu:h200:2, shard:h200:28; partitions gpu, interactive, cpu) and Slurm's own job
# accounting (slurmdbd on a local MariaDB, so sacct works), the freshly built SPANK plugin, and
# the gpuhub agent on its embedded defaults (SQLite).
# Idempotent: installs what is missing, rebuilds, restarts only what changed, waits until all
# is ready, and fails within GPUHUB_LAB_TIMEOUT seconds with the relevant log lines otherwise.
#
# Environment:
#   GPUHUB_LAB_AGENT=0       do not start the agent (plugin-only lab)
#   GPUHUB_LAB_BUILD=0       do not run cargo build (use target/release as it is)
#   GPUHUB_LAB_TIMEOUT=60    seconds to wait for the node and for the agent
#   GPUHUB_LAB_RESTART=1     restart slurmctld/slurmd even if nothing changed
#   GPUHUB_LAB_ACCOUNTING=0  no MariaDB/slurmdbd (sacct off); default 1: installs
#                            mariadb-server + slurmdbd on first use (15-30 s), starts MariaDB
#                            unless it already runs (down.sh stops only one up.sh started),
#                            slurmdbd, registers the cluster, waits until sacct lists a job
#   GPUHUB_LAB_SMOKE=0       skip the final srun smoke test
#   GPUHUB_DEPS_PYTHON=0     (tests/setup/deps.sh) skip the Python venv with mlflow/openai
#   GPUHUB_LAB_SLURM=24.11   instead: Slurm 24.11 from a Debian 13 root (tests/lab/slurm24.sh)
#   GPUHUB_LAB_NODES=2       two GPU nodes gpu01/gpu02 in network namespaces, each with its
#                            slurmd and agent, all agents on one lab PostgreSQL
#                            (tests/lab/nodes.sh); unset or 1: the one-node lab
set -euo pipefail

# GPUHUB_LAB_SLURM=24.11: the lab's second Slurm (Debian 13's 24.11 from a root, run on this host
# in place of this lab's daemons, with slurmdbd and the agent): tests/lab/slurm24.sh. Unset or 22.05: this lab.
case "${GPUHUB_LAB_SLURM:-22.05}" in
    22.05) ;;
    24.11) exec "$(dirname "${BASH_SOURCE[0]}")/slurm24.sh" up "$@" ;;
    *) echo "[lab] ERROR: GPUHUB_LAB_SLURM=$GPUHUB_LAB_SLURM: the lab has Slurm 22.05 (default) and 24.11" >&2; exit 1 ;;
esac

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/tests/lab"
NODE=gpu01
ACCOUNTING="${GPUHUB_LAB_ACCOUNTING:-1}"
TIMEOUT="${GPUHUB_LAB_TIMEOUT:-60}"
SMOKE="${GPUHUB_LAB_SMOKE:-1}"
RESTART="${GPUHUB_LAB_RESTART:-0}"
AGENT="${GPUHUB_LAB_AGENT:-1}"
BUILD="${GPUHUB_LAB_BUILD:-1}"
NODES="${GPUHUB_LAB_NODES:-1}"
case "$NODES" in 1|2) ;; *) echo "[lab] ERROR: GPUHUB_LAB_NODES=$NODES: the lab has 1 (default) or 2 nodes" >&2; exit 1 ;; esac
STATE_DIR=/run/gpuhub-lab
CLUSTER="$(sed -n 's/^ClusterName=//p' "$HERE/slurm.conf")"
export PATH="$PATH:/root/.cargo/bin:/usr/sbin:/sbin"

# shellcheck source=../lib/lab.sh
. "$REPO/tests/lib/lab.sh"
# shellcheck source=nodes.sh
. "$HERE/nodes.sh"

log() { echo "[lab] $*"; }
die() {
    echo "[lab] ERROR: $*" >&2
    for f in /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log /var/log/slurm/slurmdbd.log "$LAB_AGENT_LOG"; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 20 "$f" >&2; }
    done
    exit 1
}

[ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts Slurm daemons)"
mkdir -p "$STATE_DIR"

# ---------------------------------------------------------------- packages, build
log "checking packages (tests/setup/deps.sh)"
"$REPO/tests/setup/deps.sh" || die "tests/setup/deps.sh failed"
if [ "$ACCOUNTING" = 1 ]; then
    missing=()
    for p in slurmdbd mariadb-server; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        log "installing ${missing[*]} for Slurm accounting (GPUHUB_LAB_ACCOUNTING=0 skips it)"
        own_policy=0
        if [ ! -e /usr/sbin/policy-rc.d ]; then
            # package scripts must not start MariaDB: up.sh starts it and down.sh stops what up.sh started
            printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; own_policy=1
        fi
        rc=0
        apt-get update -qq || rc=$?
        [ "$rc" -eq 0 ] && { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?; }
        [ "$own_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
        [ "$rc" -eq 0 ] || die "apt-get install ${missing[*]} failed (rc=$rc); or run with GPUHUB_LAB_ACCOUNTING=0"
    fi
fi
if [ "$BUILD" = 1 ]; then
    command -v cargo >/dev/null || die "cargo not found; install Rust (https://rustup.rs) or set GPUHUB_LAB_BUILD=0"
    log "cargo build --release (workspace)"
    (cd "$REPO" && cargo build --release --workspace 2>&1 | tail -n 3) || die "cargo build --release failed"
fi
SO="$REPO/target/release/libgpuhub_spank.so"
SO_PROLOG="$REPO/target/release/libgpuhub_spank_prolog.so"
for f in "$SO" "$SO_PROLOG"; do [ -f "$f" ] || die "$f missing: run 'cargo build --release' in $REPO"; done
# The repo's TEST model worker, which the lab catalog (tests/lab/agent.toml) starts through Slurm.
WORKER_SRC="$REPO/target/release/gpuhub-test-worker"
WORKER_DST=/usr/local/libexec/gpuhub/gpuhub-test-worker
[ -f "$WORKER_SRC" ] || die "$WORKER_SRC missing: run 'cargo build --release -p gpuhub-test-worker' in $REPO"
if ! cmp -s "$WORKER_SRC" "$WORKER_DST"; then
    mkdir -p "$(dirname "$WORKER_DST")"
    install -m 755 "$WORKER_SRC" "$WORKER_DST.new.$$" && mv -f "$WORKER_DST.new.$$" "$WORKER_DST"
    log "installed the test model worker $WORKER_DST"
fi

# Model workers run as this unprivileged account (workers.user), as the agent RPM creates it.
worker_account >/dev/null

# ---------------------------------------------------------------- helpers
pid_alive() {
    local pid
    [ -s "$1" ] || return 1
    pid="$(cat "$1")"
    [ -d "/proc/$pid" ] && grep -q "^$2" "/proc/$pid/comm" 2>/dev/null
}
stop_pid() {
    local pid
    pid_alive "$1" "$2" || return 0
    pid="$(cat "$1")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do [ -d "/proc/$pid" ] || break; sleep 0.1; done
    if [ -d "/proc/$pid" ]; then kill -9 "$pid" 2>/dev/null || true; fi
    rm -f "$1"
}
# install_conf SRC DST MODE: copy if different; marks a daemon restart as pending
install_conf() {
    if ! cmp -s "$1" "$2"; then
        if [ -f "$2" ] && ! grep -q 'slurm-lab\|gpuhub lab' "$2" && [ ! -e "$2.pre-gpuhub-lab" ]; then
            cp -p "$2" "$2.pre-gpuhub-lab"
        fi
        install -m "$3" "$1" "$2"
        touch "$STATE_DIR/restart-pending"
    fi
}

# ---------------------------------------------------------------- slurm files
mkdir -p /etc/slurm /var/lib/slurm/slurmd /var/lib/slurm/slurmctld /var/log/slurm
if [ "$NODES" = 2 ]; then
    nodes_slurm_conf "$HERE/slurm.conf" > "$STATE_DIR/slurm.conf"
    nodes_gres_conf "$HERE/gres.conf" > "$STATE_DIR/gres.conf"
    install_conf "$STATE_DIR/slurm.conf" /etc/slurm/slurm.conf 644
    install_conf "$STATE_DIR/gres.conf" /etc/slurm/gres.conf 644
else
    install_conf "$HERE/slurm.conf" /etc/slurm/slurm.conf 644
    install_conf "$HERE/gres.conf" /etc/slurm/gres.conf 644
fi
install_conf "$HERE/cgroup.conf" /etc/slurm/cgroup.conf 644
if [ "$ACCOUNTING" = 1 ] && [ "$NODES" = 2 ]; then
    # Each node's sacct runs in that node's namespace, where localhost is its own: slurmdbd
    # (listening on every address) is reached at the host's bridge address.
    sed "s/^AccountingStorageHost=localhost\$/AccountingStorageHost=$NODES_HOST_IP/" "$HERE/accounting-slurmdbd.conf" > "$STATE_DIR/lab-accounting.conf"
    install_conf "$STATE_DIR/lab-accounting.conf" /etc/slurm/lab-accounting.conf 644
    install_conf "$HERE/slurmdbd.conf" /etc/slurm/slurmdbd.conf 600
elif [ "$ACCOUNTING" = 1 ]; then
    install_conf "$HERE/accounting-slurmdbd.conf" /etc/slurm/lab-accounting.conf 644
    install_conf "$HERE/slurmdbd.conf" /etc/slurm/slurmdbd.conf 600
else
    install_conf "$HERE/accounting-none.conf" /etc/slurm/lab-accounting.conf 644
fi
[ -f /etc/slurm/plugstack.conf ] || echo 'include /etc/slurm/plugstack.conf.d/*.conf' > /etc/slurm/plugstack.conf
grep -q 'plugstack.conf.d' /etc/slurm/plugstack.conf \
    || die "/etc/slurm/plugstack.conf does not include /etc/slurm/plugstack.conf.d/*.conf; add: include /etc/slurm/plugstack.conf.d/*.conf"
mkdir -p /etc/slurm/plugstack.conf.d

# The plugins: the shipped build (no job hooks), and beside it the build with job hooks that
# tests/system/spank-job-hooks.sh switches to. Copied to a temp name and renamed, so running
# slurmstepds keep their mapped copy. slurmd decides at start whether the loaded plugin has
# job_prolog/job_epilog hooks: a change in that set needs a restart.
job_hooks() { nm -D --defined-only "$1" 2>/dev/null | awk '$3 ~ /^slurm_spank_job_/ {print $3}' | sort | tr '\n' ' '; }
install_plugin() { # SRC DST
    if ! cmp -s "$1" "$2"; then
        [ -e "$2" ] && [ "$(job_hooks "$1")" = "$(job_hooks "$2")" ] || touch "$STATE_DIR/restart-pending"
        install -m 755 "$1" "$2.new.$$" && mv -f "$2.new.$$" "$2"
        log "installed plugin $2"
    fi
}
PLUGIN="$(lab_plugin_path)"
mkdir -p "$(dirname "$PLUGIN")"
install_plugin "$SO" "$PLUGIN"
install_plugin "$SO_PROLOG" "$(lab_plugin_path prolog)"
sed "s|@PLUGIN@|$PLUGIN|" "$HERE/plugstack-gpuhub.conf" > "$STATE_DIR/gpuhub.conf"
# Two nodes: jobs on every node are told gpu01's gateway address, not loopback.
[ "$NODES" = 2 ] && sed -i "s|gateway_url=http://127.0.0.1:8400|gateway_url=$NODES_GATEWAY|" "$STATE_DIR/gpuhub.conf"
install_conf "$STATE_DIR/gpuhub.conf" "$LAB_PLUGSTACK" 644

# Fake GPU device nodes (only where none exist). Slurm only stat()s them.
spare=(/dev/null /dev/zero)
for i in 0 1; do
    d="/dev/nvidia$i"
    [ -e "$d" ] && continue
    if mknod -m 666 "$d" c 195 "$i" 2>/dev/null; then
        log "created fake GPU device $d (char 195:$i)"
    elif ln -s "${spare[$i]}" "$d" 2>/dev/null; then
        log "mknod not permitted: $d -> ${spare[$i]} (symlink fallback)"
    else
        die "cannot create $d (need mknod or write access to /dev)"
    fi
    echo "$d" >> "$STATE_DIR/fake-devices"
done

# Two nodes: their namespaces and the bridge first (slurmdbd and slurmctld are reached there).
if [ "$NODES" = 2 ]; then
    nodes_net_up || die "cannot set up the nodes' namespaces (tests/lab/nodes.sh)"
fi

# ---------------------------------------------------------------- munge
if [ ! -s /etc/munge/munge.key ]; then
    log "creating munge key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 600 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge:munge /run/munge /var/lib/munge /var/log/munge
chmod 755 /run/munge
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    stop_pid /run/munge/munged.pid munged
    log "starting munged"
    runuser -u munge -- /usr/sbin/munged --force || die "munged failed to start (see /var/log/munge/munged.log)"
    for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n </dev/null | unmunge >/dev/null 2>&1 || die "munge credential round trip fails"
fi

# ---------------------------------------------------------------- accounting
# db_up: slurmdbd answers sacctmgr (it listens only once it has reached MariaDB).
db_up() { timeout 10 sacctmgr -n -P list cluster format=Cluster >/dev/null 2>&1; }
if [ "$ACCOUNTING" = 1 ]; then
    if ! mysqladmin ping >/dev/null 2>&1; then
        log "starting MariaDB"
        /etc/init.d/mariadb start >/dev/null || die "MariaDB failed to start (/etc/init.d/mariadb start)"
        touch "$STATE_DIR/mariadb-started"   # down.sh stops only a MariaDB that up.sh started
    fi
    mysqladmin ping >/dev/null 2>&1 || die "MariaDB does not answer (mysqladmin ping)"
    mysql -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
              CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurmlab';
              ALTER USER 'slurm'@'localhost' IDENTIFIED BY 'slurmlab';
              GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;" \
        || die "cannot create the accounting database slurm_acct_db"
    [ -e "$STATE_DIR/restart-pending" ] && stop_pid /run/slurmdbd.pid slurmdbd
    if ! pid_alive /run/slurmdbd.pid slurmdbd && ! pgrep -x slurmdbd >/dev/null; then
        log "starting slurmdbd"
        slurmdbd || die "slurmdbd failed to start"
    fi
    # The first start creates the tables (a few seconds on 2 cores).
    deadline=$((SECONDS + TIMEOUT))
    until db_up; do
        [ "$SECONDS" -lt "$deadline" ] || die "slurmdbd does not answer sacctmgr on port 6819 after ${TIMEOUT}s"
        pgrep -x slurmdbd >/dev/null || die "slurmdbd exited (see /var/log/slurm/slurmdbd.log)"
        sleep 0.5
    done
    # slurmctld adds a missing cluster itself when it first connects; adding it here, before
    # slurmctld starts, does not depend on that and fails here, with a message, if it cannot.
    if ! sacctmgr -n -P list cluster format=Cluster 2>/dev/null | grep -qx "$CLUSTER"; then
        log "registering cluster $CLUSTER in slurmdbd"
        timeout 20 sacctmgr -i add cluster "$CLUSTER" >/dev/null || die "sacctmgr -i add cluster $CLUSTER failed"
    fi
    # AccountingStorageEnforce=associations,limits (accounting-slurmdbd.conf, for gpuhub's quotas)
    # refuses jobs of users without an association: every user the lab's tests submit as gets
    # one in account `lab` (root has its own since the cluster was added).
    . "$HERE/../lib/prereq.sh"
    lab_assoc_users=("$(unprivileged_user)" "$(worker_account)" "$(quota_user)")
    if ! sacctmgr -n -P list account lab format=Account 2>/dev/null | grep -qx lab; then
        timeout 20 sacctmgr -i add account lab Cluster="$CLUSTER" Description="gpuhub lab" Organization=gpuhub >/dev/null ||
            die "sacctmgr -i add account lab failed"
    fi
    for u in "${lab_assoc_users[@]}"; do
        if ! sacctmgr -n -P list associations users="$u" accounts=lab format=User 2>/dev/null | grep -qx "$u"; then
            log "adding the association of $u (account lab) in slurmdbd"
            timeout 20 sacctmgr -i add user "$u" Account=lab DefaultAccount=lab >/dev/null || die "sacctmgr -i add user $u account=lab failed"
        fi
    done
else
    stop_pid /run/slurmdbd.pid slurmdbd
    if [ -e "$STATE_DIR/mariadb-started" ]; then
        log "stopping MariaDB (GPUHUB_LAB_ACCOUNTING=0)"
        /etc/init.d/mariadb stop >/dev/null 2>&1 || true
        rm -f "$STATE_DIR/mariadb-started"
    fi
fi

# ---------------------------------------------------------------- slurm daemons
if [ "$NODES" = 1 ] && nodes_active; then
    log "stopping the two-node lab's nodes (back to one node)"
    nodes_down
fi
if [ -e "$STATE_DIR/restart-pending" ] || [ "$RESTART" = 1 ]; then
    # gres.conf and plugins with job_prolog/job_epilog hooks are only read at daemon start.
    log "restarting slurmctld and slurmd (configuration or plugin set changed)"
    stop_pid /run/slurmd.pid slurmd
    stop_pid /run/slurmctld.pid slurmctld
fi
if ! pid_alive /run/slurmctld.pid slurmctld; then
    log "starting slurmctld"
    slurmctld || die "slurmctld failed to start"
fi
if [ "$NODES" = 2 ]; then
    # The host runs no slurmd: each node's runs in its namespaces.
    stop_pid /run/slurmd.pid slurmd
    nodes_slurmd_up || die "the nodes' slurmd did not start"
elif ! pid_alive /run/slurmd.pid slurmd; then
    log "starting slurmd -N $NODE"
    slurmd -N "$NODE" || die "slurmd failed to start"
fi
rm -f "$STATE_DIR/restart-pending"

resumed=0
state=""
deadline=$((SECONDS + TIMEOUT))
while [ "$SECONDS" -lt "$deadline" ]; do
    # A daemon writes its pid file a moment after it forks: fall back to the process table.
    pid_alive /run/slurmctld.pid slurmctld || pgrep -x slurmctld >/dev/null || die "slurmctld exited (see /var/log/slurm/slurmctld.log)"
    pid_alive /run/slurmd.pid slurmd || pgrep -x slurmd >/dev/null || die "slurmd exited (see /var/log/slurm/slurmd.log)"
    state="$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true)"
    # Two nodes: both must be up (the state of the one that is not).
    [ "$NODES" = 2 ] && state="$(sinfo -h -n gpu01,gpu02 -o '%T' 2>/dev/null | sort -u | grep -vE '^(idle|mixed|allocated|planned|completing)$' | head -n1 || true)" && state="${state:-idle}"
    case "$state" in
        idle|mixed|allocated|planned|completing) break ;;
        *drain*|down*)
            if [ "$resumed" = 0 ]; then
                log "node is '$state' ($(sinfo -h -n "$NODE" -o '%E' | head -n1)); resuming it"
                scontrol update nodename="$([ "$NODES" = 2 ] && echo gpu01,gpu02 || echo "$NODE")" state=resume 2>/dev/null || true
                resumed=1
            fi ;;
    esac
    sleep 0.5
done
case "$state" in
    idle|mixed|allocated|planned|completing) ;;
    *) die "node $NODE is '${state:-unknown}' instead of idle after ${TIMEOUT}s (reason: $(sinfo -h -n "$NODE" -o '%E' 2>/dev/null | head -n1))" ;;
esac

if [ "$ACCOUNTING" = 1 ]; then
    # slurmctld is connected to slurmdbd once the cluster row carries its address.
    deadline=$((SECONDS + TIMEOUT))
    until [ -n "$(timeout 10 sacctmgr -n -P list cluster "$CLUSTER" format=ControlHost 2>/dev/null)" ]; do
        [ "$SECONDS" -lt "$deadline" ] || die "slurmctld has not registered with slurmdbd after ${TIMEOUT}s (sacctmgr list cluster $CLUSTER shows no ControlHost)"
        sleep 0.5
    done
fi

# ---------------------------------------------------------------- agent
if [ "$AGENT" = 1 ] && [ "$NODES" = 2 ]; then
    agent_stop
    nodes_agents_up "$TIMEOUT" || die "the nodes' gpuhub-agents did not come up (logs: $NODES_DIR/gpuNN/agent.log)"
elif [ "$AGENT" = 1 ]; then
    # A running agent from an older build or config is replaced: the lab runs what was just built.
    # So is one that another checkout started (its binary or config is not this one's).
    if agent_running; then
        apid="$(cat "$LAB_AGENT_PID")"
        exe="$(readlink "/proc/$apid/exe" 2>/dev/null || true)"
        if [ "$exe" != "$(readlink -f "$LAB_AGENT_BIN")" ] || [ "$LAB_AGENT_CONFIG" -nt "$LAB_AGENT_PID" ] ||
            ! tr '\0' '\n' < "/proc/$apid/cmdline" | grep -qxF -- "$LAB_AGENT_CONFIG"; then
            log "restarting gpuhub-agent (new binary or config: running ${exe:-?})"
            agent_stop
        fi
    fi
    if ! agent_start "$TIMEOUT"; then
        # The lab's store is the lab's own (SQLite under /var/lib/gpuhub): when another checkout
        # with newer migrations used this lab, or a development build whose migration was changed
        # since, this build refuses it. Set it aside and start fresh (production never does this:
        # there the refusal stands and names the upgrade).
        if tail -n 5 "$LAB_AGENT_LOG" | grep -q 'was migrated by a newer gpuhub\|differs from the one built into this agent'; then
            aside="/var/lib/gpuhub/gpuhub.db.newer.$(date +%s)"
            log "the lab store was migrated by another gpuhub-agent (another checkout or build); moving it to $aside and starting on a fresh one"
            for f in /var/lib/gpuhub/gpuhub.db /var/lib/gpuhub/gpuhub.db-wal /var/lib/gpuhub/gpuhub.db-shm; do
                [ -e "$f" ] && mv -f "$f" "$aside${f#/var/lib/gpuhub/gpuhub.db}"
            done
            agent_start "$TIMEOUT" || die "gpuhub-agent did not answer http://127.0.0.1:8400/healthz within ${TIMEOUT}s"
        else
            die "gpuhub-agent did not answer http://127.0.0.1:8400/healthz within ${TIMEOUT}s"
        fi
    fi
else
    log "GPUHUB_LAB_AGENT=0: not starting gpuhub-agent"
fi

if [ "$SMOKE" = 1 ]; then
    out="$(cd /tmp && timeout 60 srun -N1 -t 1 --gres=gpu:1 printenv CUDA_VISIBLE_DEVICES GPUHUB_URL SLURM_JOB_ID 2>"$STATE_DIR/smoke.err")" \
        || die "smoke test 'srun --gres=gpu:1' failed: $(cat "$STATE_DIR/smoke.err")"
    case "$(echo "$out" | head -n1)" in 0|1) ;; 2|3) [ "$NODES" = 2 ] || die "smoke test: unexpected CUDA_VISIBLE_DEVICES '$out'" ;; *) die "smoke test: unexpected CUDA_VISIBLE_DEVICES '$out'" ;; esac
    echo "$out" | grep -q '^http://' || die "smoke test: the plugin injected no GPUHUB_URL (is $LAB_PLUGSTACK loaded? see slurmd.log)"
    if [ "$ACCOUNTING" = 1 ]; then
        # slurmdbd stores jobs asynchronously: wait until sacct lists the smoke job as ended.
        smoke_job="$(echo "$out" | sed -n 3p)"
        deadline=$((SECONDS + TIMEOUT))
        until [ "$(sacct -n -X -P -j "$smoke_job" -o State 2>/dev/null)" = COMPLETED ]; do
            [ "$SECONDS" -lt "$deadline" ] || die "sacct does not list the smoke job $smoke_job as completed after ${TIMEOUT}s (slurmctld -> slurmdbd; see the logs below)"
            sleep 0.5
        done
    fi
fi

log "up: node $NODE is $state; partitions: $(sinfo -h -o '%P' | tr '\n' ' ')"
[ "$NODES" = 2 ] && log "two nodes: gpu01 $(nodes_ip gpu01), gpu02 $(nodes_ip gpu02) (gateway $NODES_GATEWAY, agents' logs $NODES_DIR/gpuNN/agent.log, store $(nodes_pg_url); tests/lab/nodes.sh exec gpu02 CMD)"
if [ "$ACCOUNTING" = 1 ]; then log "accounting: slurmdbd + MariaDB (sacct works)"; else log "accounting: off (GPUHUB_LAB_ACCOUNTING=0; sacct does not work)"; fi
[ "$AGENT" = 1 ] && log "agent: http://127.0.0.1:8400 (log $LAB_AGENT_LOG, pid $(cat "$LAB_AGENT_PID" 2>/dev/null))"
cat <<TRY
[lab] try next:
  srun --gres=gpu:1 env | grep -E 'GPUHUB|OPENAI|MLFLOW|_MODEL|CUDA'
  srun --gres=shard:7 --mlflow-experiment=demo printenv MLFLOW_EXPERIMENT_NAME SLURM_SHARDS_ON_NODE
  sbatch --gres=gpu:2 --wrap 'env | grep GPUHUB'     # output in ./slurm-<id>.out
  sacct -X -o JobID,JobName,State,AllocTRES%45,ElapsedRaw  # Slurm's own accounting (slurmdbd)
  srun --help | grep -A1 gpuhub                       # the plugin's options
  target/release/gpuhub usage --by user; target/release/gpuhub job <JOBID>   # GPU- and shard-seconds
  curl -s 127.0.0.1:9410/metrics | grep -E '^(DCGM_FI_DEV_GPU_UTIL|gpuhub_slurm)' | head
  target/release/gpuhub names list; target/release/gpuhub roles; target/release/gpuhub models
  # a job calls the gateway with its injected credential; svc-ocr answers with Deprecation/Sunset
  # headers (the first call starts the dots.ocr TEST worker as a Slurm job: see squeue)
  srun sh -c 'curl -sD- "\$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer \$OPENAI_API_KEY" -H content-type:application/json -d "{\"model\":\"svc-ocr\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"'
  target/release/gpuhub names callers svc-ocr          # who still calls the old name
  $REPO/tests/run-all.sh                              # every test
  $REPO/tests/lab/down.sh                             # stop (add --purge to wipe state)
TRY
