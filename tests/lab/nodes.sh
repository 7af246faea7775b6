#!/usr/bin/env bash
# The lab's second shape: two GPU nodes under the host's slurmctld/slurmdbd (GPUHUB_LAB_NODES=2
# tests/lab/up.sh). Each node, gpu01 (10.77.0.11) and gpu02 (10.77.0.12), is a network
# namespace on the bridge gpuhub-br0 (the host is 10.77.0.1), with its own mount and UTS
# namespace (host name gpuNN; its own /var/lib/slurm/slurmd, /var/spool/gpuhub, /run/gpuhub,
# /var/lib/gpuhub and /etc/hosts, bound from /run/gpuhub-lab/nodes/gpuNN), its own slurmd
# (`slurmd -N gpuNN`, NodeAddr its address), its own fake GPUs (gpu01 /dev/nvidia[0-1], gpu02
# /dev/nvidia[2-3]) and its own gpuhub-agent (tests/lab/agent.toml plus the node's
# [store]/[gateway]/[metrics]/[workers]), all agents on one lab PostgreSQL on 10.77.0.1:15433
# (below the ephemeral port range: see tests/lib/pg.sh).
# gpu01 runs the gateway jobs are told (gateway_url http://10.77.0.11:8400); workers bind their
# node's address (workers.host = "node") and write to /var/lib/gpuhub-lab-workers/gpuNN.
#
# NODES_GATEWAY_NODES="gpu01" gives the agents `[cluster] gateway_nodes` (unset: both run a
# gateway); NODES_IDLE_TIMEOUT_S shortens the lab models' idle timeout (tests/system/multinode-gateways.sh);
# NODES_QUOTA_INTERVAL_MS sets the agents' quota refresh (the lab's 2000 is for the quota tests;
# bench/gateway-replicas.sh runs the production default); NODES_VRAM_GIB gives each agent a
# `workers.vram_gib` budget (tests/system/multinode-lab.sh).
#
# Sourced by up.sh and down.sh (functions only). Run directly:
#   tests/lab/nodes.sh exec NODE CMD...     run CMD inside NODE (its namespaces)
#   tests/lab/nodes.sh agent-stop NODE      stop NODE's agent
#   tests/lab/nodes.sh agent-start NODE     start NODE's agent, wait until healthy
#   tests/lab/nodes.sh pg-url               the lab store's URL (from the host)

NODES_LIST=(gpu01 gpu02)
NODES_DIR=/run/gpuhub-lab/nodes
NODES_BRIDGE=gpuhub-br0
NODES_HOST_IP=10.77.0.1
NODES_WORKERS=/var/lib/gpuhub-lab-workers
NODES_PG_DATA=/var/tmp/gpuhub-lab-pg
NODES_PG_PORT=15433
NODES_PG_DB=gpuhub_lab
NODES_GATEWAY="http://10.77.0.11:8400"
NODES_REPO="${NODES_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"

nodes_ip() { echo "10.77.0.1${1#gpu0}"; }           # gpu01 -> 10.77.0.11
nodes_dev_range() { case "$1" in gpu01) echo "0-1" ;; gpu02) echo "2-3" ;; esac; }
nodes_holder() { cat "$NODES_DIR/$1/holder.pid" 2>/dev/null; }
nodes_exec() { local n="$1"; shift; nsenter -t "$(nodes_holder "$n")" -m -u -n -- "$@"; }
nodes_active() { [ -d "$NODES_DIR" ] || ip netns list 2>/dev/null | grep -q '^gpu0[12]\b' || ip link show "$NODES_BRIDGE" >/dev/null 2>&1; }
nodes_pg_url() { echo "postgres://postgres@$NODES_HOST_IP:$NODES_PG_PORT/$NODES_PG_DB"; }
nodes_log() { echo "[lab] $*"; }

# nodes_slurm_conf SRC: the two-node slurm.conf from the one-node SRC.
nodes_slurm_conf() {
    sed -e "s/^SlurmctldHost=localhost\$/SlurmctldHost=localhost($NODES_HOST_IP)/" \
        -e 's|^SlurmdPidFile=.*|SlurmdPidFile=/var/lib/slurm/slurmd/slurmd.pid|' \
        -e 's|^SlurmdLogFile=.*|SlurmdLogFile=/var/lib/slurm/slurmd/slurmd.log|' \
        -e 's/^\(PartitionName=.* Nodes=\)gpu01 /\1gpu01,gpu02 /' \
        -e '/^NodeName=gpu01 /d' "$1"
    local n
    for n in "${NODES_LIST[@]}"; do
        echo "NodeName=$n NodeHostname=$n NodeAddr=$(nodes_ip "$n") CPUs=16 RealMemory=16000 Gres=gpu:h200:2,shard:h200:28 State=UNKNOWN"
    done
}

# nodes_gres_conf SRC: gres.conf with each node's own device files.
nodes_gres_conf() {
    grep -v '^NodeName=' "$1"
    local n r a b
    for n in "${NODES_LIST[@]}"; do
        r="$(nodes_dev_range "$n")"; a="${r%-*}"; b="${r#*-}"
        echo "NodeName=$n Name=gpu Type=h200 File=/dev/nvidia[$r]"
        echo "NodeName=$n Name=shard Type=h200 Count=14 File=/dev/nvidia$a"
        echo "NodeName=$n Name=shard Type=h200 Count=14 File=/dev/nvidia$b"
    done
}

nodes_pg_up() {
    local bin
    bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
    [ -x "$bin/pg_ctl" ] || { echo "[lab] ERROR: PostgreSQL server binaries not found; run tests/setup/deps.sh" >&2; return 1; }
    if [ -f "$NODES_PG_DATA/PG_VERSION" ] && ! grep -qx "port = $NODES_PG_PORT" "$NODES_PG_DATA/postgresql.conf"; then
        # Made for another port (an older lab): the lab's store is made afresh on this one.
        [ -f "$NODES_PG_DATA/postmaster.pid" ] && runuser -u postgres -- "$bin/pg_ctl" -D "$NODES_PG_DATA" -m fast stop >/dev/null 2>&1 || true
        rm -rf "$NODES_PG_DATA"
    fi
    if [ ! -f "$NODES_PG_DATA/PG_VERSION" ]; then
        rm -rf "$NODES_PG_DATA"; mkdir -p "$NODES_PG_DATA"; chown postgres:postgres "$NODES_PG_DATA"
        runuser -u postgres -- "$bin/initdb" -D "$NODES_PG_DATA" -A trust -U postgres >/dev/null || return 1
        cat >> "$NODES_PG_DATA/postgresql.conf" <<CONF
listen_addresses = '127.0.0.1,$NODES_HOST_IP'
port = $NODES_PG_PORT
unix_socket_directories = '$NODES_PG_DATA'
fsync = off
synchronous_commit = off
CONF
        echo "host all all 10.77.0.0/24 trust" >> "$NODES_PG_DATA/pg_hba.conf"
    fi
    if ! runuser -u postgres -- "$bin/pg_ctl" -D "$NODES_PG_DATA" status >/dev/null 2>&1; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$NODES_PG_DATA" -l "$NODES_PG_DATA/server.log" -w -t 30 start >/dev/null ||
            { echo "[lab] ERROR: the lab PostgreSQL failed to start:" >&2; tail -n 20 "$NODES_PG_DATA/server.log" >&2; return 1; }
    fi
    psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$NODES_PG_DB'" | grep -q 1 ||
        psql -h 127.0.0.1 -p "$NODES_PG_PORT" -U postgres -qc "CREATE DATABASE $NODES_PG_DB" || return 1
}

nodes_pg_down() {
    local bin
    bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1)"
    if [ -f "$NODES_PG_DATA/postmaster.pid" ]; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$NODES_PG_DATA" -m fast stop >/dev/null 2>&1 || true
    fi
    rm -rf "$NODES_PG_DATA"
}

# nodes_net_up: the bridge, and per node a netns with a veth and a holder process in its own
# mount and UTS namespaces (every later process of the node joins the holder's namespaces).
nodes_net_up() {
    local n d ip
    if ! ip link show "$NODES_BRIDGE" >/dev/null 2>&1; then
        ip link add "$NODES_BRIDGE" type bridge || return 1
        ip addr add "$NODES_HOST_IP/24" dev "$NODES_BRIDGE" || return 1
    fi
    ip link set "$NODES_BRIDGE" up || return 1
    mkdir -p /var/lib/slurm/slurmd /var/spool/gpuhub /run/gpuhub /var/lib/gpuhub "$NODES_WORKERS"
    chmod 755 "$NODES_WORKERS"
    for n in "${NODES_LIST[@]}"; do
        d="$NODES_DIR/$n"; ip="$(nodes_ip "$n")"
        mkdir -p "$d/slurmd" "$d/spool" "$d/run" "$d/state"
        chmod 755 "$d" "$d/run"
        if ! ip netns list | grep -q "^$n\b"; then
            ip netns add "$n" || return 1
            ip link add "veth-$n" type veth peer name eth0 netns "$n" || return 1
            ip link set "veth-$n" master "$NODES_BRIDGE" up || return 1
            ip -n "$n" addr add "$ip/24" dev eth0 || return 1
            ip -n "$n" link set eth0 up && ip -n "$n" link set lo up || return 1
            ip -n "$n" route add default via "$NODES_HOST_IP" || return 1
        fi
        printf '127.0.0.1 localhost\n%s %s\n10.77.0.11 gpu01\n10.77.0.12 gpu02\n' "$NODES_HOST_IP" "$(hostname -s)" > "$d/hosts"
        if [ -z "$(nodes_holder "$n")" ] || ! kill -0 "$(nodes_holder "$n")" 2>/dev/null; then
            # nsenter, not `ip netns exec`: that mounts a fresh /sys, without /sys/fs/cgroup,
            # which slurmd needs.
            unshare --mount --uts --propagation private nsenter --net="/run/netns/$n" sh -c "
                mount --bind '$d/slurmd' /var/lib/slurm/slurmd && mount --bind '$d/spool' /var/spool/gpuhub &&
                mount --bind '$d/run' /run/gpuhub && mount --bind '$d/state' /var/lib/gpuhub &&
                mount --bind '$d/hosts' /etc/hosts && hostname '$n' && exec sleep infinity" </dev/null >/dev/null 2>&1 &
            echo $! > "$d/holder.pid"
            local i
            for i in $(seq 50); do
                [ "$(nsenter -t "$(nodes_holder "$n")" -u hostname 2>/dev/null)" = "$n" ] && break
                sleep 0.1
            done
            [ "$(nsenter -t "$(nodes_holder "$n")" -u hostname 2>/dev/null)" = "$n" ] || { echo "[lab] ERROR: node $n's namespaces did not come up" >&2; return 1; }
        fi
    done
    # Fake GPUs of gpu02 (gpu01's /dev/nvidia0-1 are the one-node lab's).
    local i
    for i in 0 1 2 3; do
        [ -e "/dev/nvidia$i" ] && continue
        mknod -m 666 "/dev/nvidia$i" c 195 "$i" 2>/dev/null || ln -s /dev/null "/dev/nvidia$i" || return 1
        echo "/dev/nvidia$i" >> /run/gpuhub-lab/fake-devices
    done
}

nodes_slurmd_up() {
    local n
    for n in "${NODES_LIST[@]}"; do
        if [ -s "$NODES_DIR/$n/slurmd/slurmd.pid" ] && kill -0 "$(cat "$NODES_DIR/$n/slurmd/slurmd.pid")" 2>/dev/null; then continue; fi
        nodes_log "starting slurmd -N $n in its namespaces ($(nodes_ip "$n"))"
        nodes_exec "$n" slurmd -N "$n" || { echo "[lab] ERROR: slurmd -N $n failed; see $NODES_DIR/$n/slurmd/slurmd.log" >&2; return 1; }
    done
}

# nodes_agent_config NODE: tests/lab/agent.toml for NODE: its Slurm name, the lab store, its
# listeners on its own address, the gateway on gpu01 as what jobs are told, workers on the
# node's address in a workers dir every node sees.
nodes_agent_config() {
    local n="$1" ip
    ip="$(nodes_ip "$n")"
    cat <<TOML
# Generated by tests/lab/nodes.sh for node $n of the two-node lab.
[store]
url = "$(nodes_pg_url)"

[gateway]
listen = "$ip:8400"
public_url = "$NODES_GATEWAY"

[metrics]
listen = "$ip:9410"
$(nodes_cluster_toml)

[workers]
host = "node"
dir = "$NODES_WORKERS/$n"
${NODES_VRAM_GIB:+vram_gib = $NODES_VRAM_GIB}

TOML
    sed -e "s/^slurm_node_name = .*/slurm_node_name = \"$n\"/" \
        -e "s/^idle_timeout_s = 120\$/idle_timeout_s = ${NODES_IDLE_TIMEOUT_S:-120}/" \
        -e "s/^quota_interval_ms = .*/quota_interval_ms = ${NODES_QUOTA_INTERVAL_MS:-2000}/" "$NODES_REPO/tests/lab/agent.toml"
    # A test's own catalog entries for this agent (tests/system/multinode-replicas.sh).
    if [ -n "${GPUHUB_LAB_NODES_EXTRA:-}" ]; then cat "$GPUHUB_LAB_NODES_EXTRA"; fi
}

# The [cluster] section when NODES_GATEWAY_NODES names the gateway nodes (space-separated;
# unset: every node runs a gateway). NODES_IDLE_TIMEOUT_S shortens the lab models' idle timeout.
nodes_cluster_toml() {
    [ -n "${NODES_GATEWAY_NODES:-}" ] || return 0
    local n list=""
    for n in $NODES_GATEWAY_NODES; do list="$list${list:+, }\"$n\""; done
    printf '\n[cluster]\ngateway_nodes = [%s]\n' "$list"
}

# For tests/system/multinode-*.sh (after tests/lib/lab.sh):
# nodes_test_fail MSG: FAIL: MSG, then the last lines of each node's agent and slurmd logs; exit 1.
nodes_test_fail() {
    echo "FAIL: $*" >&2
    local f
    for f in "$NODES_DIR"/gpu0?/agent.log "$NODES_DIR"/gpu0?/slurmd/slurmd.log; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 20 "$f" >&2; }
    done
    exit 1
}

# nodes_test_restore: cancels every job and brings the one-node lab back, once (a test's exit
# cleanup); a test's NODES_* settings are dropped first.
NODES_TEST_RESTORED=0
nodes_test_restore() {
    [ "$NODES_TEST_RESTORED" = 1 ] && return 0
    NODES_TEST_RESTORED=1
    local jobs log
    jobs="$(squeue -h -o '%i' 2>/dev/null | tr '\n' ' ')"
    # shellcheck disable=SC2086
    [ -n "${jobs// /}" ] && lab_cancel $jobs
    echo "== restoring the one-node lab"
    unset NODES_GATEWAY_NODES NODES_IDLE_TIMEOUT_S NODES_QUOTA_INTERVAL_MS GPUHUB_LAB_NODES_EXTRA
    log="$(mktemp /tmp/gpuhub-nodes-restore.XXXXXX)"
    GPUHUB_LAB_BUILD=0 GPUHUB_LAB_SMOKE=0 "$NODES_REPO/tests/lab/up.sh" >"$log" 2>&1 ||
        { cat "$log" >&2; rm -f "$log"; echo "FAIL: the one-node lab did not come back (tests/lab/up.sh)" >&2; return 1; }
    rm -f "$log"
}

# nodes_is_gateway NODE: whether NODE's agent runs the gateway.
nodes_is_gateway() { [ -z "${NODES_GATEWAY_NODES:-}" ] || [[ " $NODES_GATEWAY_NODES " == *" $1 "* ]]; }

# Healthy: the gateway answers /healthz; on a node without the gateway, /metrics answers.
nodes_agent_healthy() {
    if nodes_is_gateway "$1"; then
        curl -sf --max-time 2 "http://$(nodes_ip "$1"):8400/healthz" >/dev/null 2>&1
    else
        curl -sf --max-time 2 -o /dev/null "http://$(nodes_ip "$1"):9410/metrics" 2>/dev/null
    fi
}

nodes_agent_start() {
    local n="$1" d="$NODES_DIR/$1" secs="${2:-60}" i pid
    nodes_agent_config "$n" > "$d/agent.toml"
    if [ -s "$d/agent.pid" ] && kill -0 "$(cat "$d/agent.pid")" 2>/dev/null; then
        nodes_agent_healthy "$n" && return 0
    else
        # One job-credential key for the cluster: a job of any node calls any gateway.
        [ -s "$NODES_DIR/job-token.key" ] || { head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$NODES_DIR/job-token.key"; chmod 600 "$NODES_DIR/job-token.key"; }
        install -m 600 "$NODES_DIR/job-token.key" "$d/state/job-token.key"
        nodes_log "starting gpuhub-agent on $n (log $d/agent.log)"
        nsenter -t "$(nodes_holder "$n")" -m -u -n -- setsid "$NODES_REPO/target/release/gpuhub-agent" --config "$d/agent.toml" run >>"$d/agent.log" 2>&1 </dev/null &
        echo $! > "$d/agent.pid"
    fi
    pid="$(cat "$d/agent.pid")"
    for ((i = 0; i < secs * 4; i++)); do
        nodes_agent_healthy "$n" && return 0
        kill -0 "$pid" 2>/dev/null || { echo "[lab] gpuhub-agent on $n exited; last log lines:" >&2; tail -n 20 "$d/agent.log" >&2; return 1; }
        sleep 0.25
    done
    echo "[lab] gpuhub-agent on $n not healthy after ${secs}s; last log lines:" >&2
    tail -n 20 "$d/agent.log" >&2
    return 1
}

nodes_agent_stop() {
    local d="$NODES_DIR/$1" pid i
    [ -s "$d/agent.pid" ] || return 0
    pid="$(cat "$d/agent.pid")"
    if kill -0 "$pid" 2>/dev/null && grep -q gpuhub "/proc/$pid/comm" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for ((i = 0; i < 150; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$d/agent.pid"
}

nodes_agents_up() {
    local n
    nodes_pg_up || return 1
    for n in "${NODES_LIST[@]}"; do nodes_agent_start "$n" "${1:-60}" || return 1; done
}

# nodes_down: every process of the nodes (agents, slurmd, job steps, holders), their
# namespaces, veths and bridge, the lab PostgreSQL, the node dirs and workers dirs.
nodes_down() {
    local n pids i
    for n in "${NODES_LIST[@]}"; do
        nodes_agent_stop "$n"
        if [ -s "$NODES_DIR/$n/slurmd/slurmd.pid" ]; then kill "$(cat "$NODES_DIR/$n/slurmd/slurmd.pid")" 2>/dev/null || true; fi
    done
    for n in "${NODES_LIST[@]}"; do
        ip netns list 2>/dev/null | grep -q "^$n\b" || continue
        for i in $(seq 50); do
            pids="$(ip netns pids "$n" 2>/dev/null | grep -vx "$(nodes_holder "$n")" | tr '\n' ' ' || true)"
            [ -z "${pids// /}" ] && break
            # shellcheck disable=SC2086
            if [ "$i" = 30 ]; then kill -9 $pids 2>/dev/null || true; fi
            sleep 0.1
        done
        pids="$(ip netns pids "$n" 2>/dev/null | tr '\n' ' ' || true)"
        # shellcheck disable=SC2086
        if [ -n "${pids// /}" ]; then kill -9 $pids 2>/dev/null || true; fi
        ip link del "veth-$n" 2>/dev/null || true
        ip netns del "$n" 2>/dev/null || true
    done
    ip link del "$NODES_BRIDGE" 2>/dev/null || true
    nodes_pg_down
    rm -rf "$NODES_DIR" "$NODES_WORKERS"
    # gpu02's fake GPUs, if nodes_net_up created them.
    local f=/run/gpuhub-lab/fake-devices dev
    for dev in /dev/nvidia2 /dev/nvidia3; do
        if [ -f "$f" ] && grep -qx "$dev" "$f"; then rm -f "$dev"; grep -vx "$dev" "$f" > "$f.tmp"; mv -f "$f.tmp" "$f"; fi
    done
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    case "${1:-}" in
        exec) shift; nodes_exec "$@" ;;
        agent-stop) nodes_agent_stop "$2" ;;
        agent-start) nodes_agent_start "$2" "${3:-60}" ;;
        pg-url) echo "postgres://postgres@127.0.0.1:$NODES_PG_PORT/$NODES_PG_DB" ;;
        *) echo "usage: $0 exec NODE CMD... | agent-stop NODE | agent-start NODE [SECS] | pg-url" >&2; exit 2 ;;
    esac
fi
