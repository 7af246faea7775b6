#!/usr/bin/env python3
"""Writes gpuhub's Grafana dashboards (rpm/share/grafana/*.json, shipped in
/usr/share/gpuhub/grafana/).

usage: make-dashboards.py [OUT_DIR]      (default: rpm/share/grafana next to this script)

The JSON files are generated so that every query is written once, here, and checked: the
test tests/system/rpm-share.sh regenerates them (a stale JSON fails) and compares every metric
name they query with what a running gpuhub-agent exports. Import in Grafana with
Dashboards > New > Import, or provision the directory (see the admin guide). Each dashboard
has a `datasource` variable, so it works with any Prometheus data source name.
"""
import json
import os
import sys

DS = {"type": "prometheus", "uid": "${datasource}"}


class Layout:
    """Places panels left to right on a 24-column grid."""

    def __init__(self):
        self.x, self.y, self.row_h, self.next_id = 0, 0, 0, 1

    def place(self, w, h):
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"x": self.x, "y": self.y, "w": w, "h": h}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def newline(self):
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0

    def id(self):
        self.next_id += 1
        return self.next_id - 1


def targets(exprs, fmt="time_series", instant=False):
    out = []
    for i, (expr, legend) in enumerate(exprs):
        t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
        if fmt == "table":
            t.update({"format": "table", "instant": True})
        elif instant:
            t["instant"] = True
        out.append(t)
    return out


def timeseries(L, title, exprs, unit="short", w=12, h=8, stack=False, description=""):
    return {
        "id": L.id(), "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "gridPos": L.place(w, h), "targets": targets(exprs),
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"fillOpacity": 20 if stack else 5, "stacking": {"mode": "normal" if stack else "none"}}}, "overrides": []},
        "options": {"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull", "max"]}, "tooltip": {"mode": "multi"}},
    }


def stat(L, title, expr, unit="short", w=4, h=4, description="", thresholds=None):
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "id": L.id(), "type": "stat", "title": title, "description": description, "datasource": DS,
        "gridPos": L.place(w, h), "targets": targets([(expr, "")], instant=True),
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value", "graphMode": "none"},
    }


def gauge(L, title, expr, unit="percent", w=6, h=6, max_=100, description=""):
    return {
        "id": L.id(), "type": "gauge", "title": title, "description": description, "datasource": DS,
        "gridPos": L.place(w, h), "targets": targets([(expr, "")], instant=True),
        "fieldConfig": {"defaults": {"unit": unit, "min": 0, "max": max_, "thresholds": {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "orange", "value": max_ * 0.8}, {"color": "red", "value": max_ * 0.95}]}}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def table(L, title, exprs, w=24, h=9, units=None, rename=None, description="", sort=None):
    """An instant table; `exprs` are (expr, column name) merged on their labels."""
    overrides = []
    for i, (_, col) in enumerate(exprs):
        if units and col in units:
            overrides.append({"matcher": {"id": "byName", "options": col}, "properties": [{"id": "unit", "value": units[col]}]})
    rename_map = {f"Value #{chr(ord('A') + i)}": col for i, (_, col) in enumerate(exprs)}
    rename_map.update(rename or {})
    panel = {
        "id": L.id(), "type": "table", "title": title, "description": description, "datasource": DS,
        "gridPos": L.place(w, h), "targets": targets(exprs, fmt="table"),
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True, "instance": True}, "renameByName": rename_map}},
        ],
        "fieldConfig": {"defaults": {"custom": {"align": "auto"}}, "overrides": overrides},
        "options": {"showHeader": True},
    }
    if sort:
        panel["options"]["sortBy"] = [{"displayName": sort, "desc": True}]
    return panel


def text(L, title, content, w=24, h=3):
    return {"id": L.id(), "type": "text", "title": title, "gridPos": L.place(w, h), "options": {"mode": "markdown", "content": content}}


def row(L, title, repeat=None):
    L.newline()
    r = {"id": L.id(), "type": "row", "title": title, "collapsed": False, "gridPos": L.place(24, 1), "panels": []}
    if repeat:
        r["repeat"] = repeat
    L.newline()
    return r


def query_var(name, label, query, multi=True, include_all=True):
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
        "refresh": 2, "multi": multi, "includeAll": include_all, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]} if include_all else {},
        "sort": 1, "options": [],
    }


def datasource_var():
    return {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "current": {}, "hide": 0, "options": [], "refresh": 1}


def dashboard(uid, title, description, panels, variables, time_from="now-6h", tags=()):
    return {
        "uid": uid, "title": title, "description": description, "tags": ["gpuhub", *tags],
        "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
        "time": {"from": time_from, "to": "now"}, "refresh": "30s", "timezone": "",
        "templating": {"list": [datasource_var(), *variables]},
        "annotations": {"list": []}, "links": [
            {"title": "gpuhub dashboards", "type": "dashboards", "tags": ["gpuhub"], "asDropdown": True},
        ],
        "panels": panels,
    }


def events(series, rng="$__range"):
    """Events a lazily created counter counted in the range. The agent creates a counter series
    at its first event (a name's first call by a user and app), already at 1, and increase()
    cannot see that first step: series that existed at the range's start contribute their
    increase, series born within the range their whole value."""
    return f"((increase({series}[{rng}]) and {series} offset {rng}) or ({series} unless {series} offset {rng}))"


def g(name, sel):
    """One value per GPU: the agent (like dcgm-exporter) copies each DCGM series once per job on
    the GPU (hpc_job), so a GPU shared by several shard jobs has several identical series. Every
    GPU query takes one of them first, or counts and power are multiplied by the jobs."""
    return f"max by (Hostname, gpu, UUID) ({name}{{{sel}}})"


# Local filesystems (not tmpfs, overlay, squashfs: what fills up and stops a node).
REAL_FS = '{fstype!~"tmpfs|ramfs|devtmpfs|overlay|squashfs|nsfs|fuse.*"}'


def node(expr):
    """A node_exporter series (or rate) of the nodes whose GPUs are selected: node_exporter knows
    no Hostname, so join on node_uname_info's nodename (the host name the agent labels GPUs with)."""
    return f'({expr} * on (instance) group_left () node_uname_info{{nodename=~"$Hostname"}})'


# --------------------------------------------------------------------------- GPU telemetry
def gpu_telemetry():
    L = Layout()
    sel = 'Hostname=~"$Hostname", gpu=~"$gpu"'
    p = [
        stat(L, "GPUs", f"count({g('DCGM_FI_DEV_GPU_UTIL', sel)})"),
        stat(L, "Mean utilisation", f"avg({g('DCGM_FI_DEV_GPU_UTIL', sel)})", unit="percent"),
        stat(L, "VRAM in use", f"sum({g('DCGM_FI_DEV_FB_USED', sel)}) / sum({g('DCGM_FI_DEV_FB_TOTAL', sel)}) * 100", unit="percent"),
        stat(L, "Power", f"sum({g('DCGM_FI_DEV_POWER_USAGE', sel)})", unit="watt"),
        stat(L, "Jobs on GPUs", 'count(count by (jobid) (gpuhub_job_gpu_processes{gpu=~"$gpu"}))'),
        stat(L, "NVML", "min(gpuhub_nvml_up)", description="1: the agent reads the GPUs; 0: no NVML or no GPU (see gpuhub doctor)",
             thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}]),
    ]
    # The node beside the GPUs (Debian's prometheus-node-exporter, the `node` job of the shipped
    # scrape config), matched to the GPUs' Hostname through node_uname_info's nodename.
    busy = [{"color": "green", "value": None}, {"color": "orange", "value": 80}, {"color": "red", "value": 95}]
    idle_rate = node('rate(node_cpu_seconds_total{mode="idle"}[5m])')
    mem_avail, mem_total = node("node_memory_MemAvailable_bytes"), node("node_memory_MemTotal_bytes")
    fs_avail, fs_size = node("node_filesystem_avail_bytes" + REAL_FS), node("node_filesystem_size_bytes" + REAL_FS)
    p += [
        stat(L, "CPU busy", f"100 * (1 - avg({idle_rate}))", unit="percent", w=8,
             description="All cores of the node, from node_exporter.", thresholds=busy),
        stat(L, "RAM used", f"100 * (1 - sum({mem_avail}) / sum({mem_total}))",
             unit="percent", w=8, description="MemTotal - MemAvailable, from node_exporter.", thresholds=busy),
        stat(L, "Fullest disk", f"max(100 * (1 - {fs_avail} / {fs_size}))",
             unit="percent", w=8, description="The fullest local filesystem (space an unprivileged user can still use).", thresholds=busy),
    ]
    p.append(row(L, "GPU $gpu", repeat="gpu"))
    one = 'Hostname=~"$Hostname", gpu=~"$gpu"'
    prof = [("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "graphics engine"), ("DCGM_FI_PROF_SM_ACTIVE", "SM active"),
            ("DCGM_FI_PROF_SM_OCCUPANCY", "SM occupancy"), ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "tensor cores"),
            ("DCGM_FI_PROF_DRAM_ACTIVE", "HBM (DRAM) active")]
    p += [
        gauge(L, "Utilisation", f"avg({g('DCGM_FI_DEV_GPU_UTIL', one)})", w=4),
        gauge(L, "VRAM used", f"sum({g('DCGM_FI_DEV_FB_USED', one)}) / sum({g('DCGM_FI_DEV_FB_TOTAL', one)}) * 100", w=4),
        timeseries(L, "Utilisation", [(g("DCGM_FI_DEV_GPU_UTIL", one), "SM"), (g("DCGM_FI_DEV_MEM_COPY_UTIL", one), "memory copy"),
                                      (g("DCGM_FI_DEV_ENC_UTIL", one), "encoder"), (g("DCGM_FI_DEV_DEC_UTIL", one), "decoder")], unit="percent", w=8, h=6),
        timeseries(L, "VRAM", [(f"{g('DCGM_FI_DEV_FB_USED', one)} * 1048576", "used"), (f"{g('DCGM_FI_DEV_FB_FREE', one)} * 1048576", "free"),
                               (f"{g('DCGM_FI_DEV_FB_RESERVED', one)} * 1048576", "reserved")], unit="bytes", w=8, h=6, stack=True),
        timeseries(L, "Profiling (GPM, Hopper and later)", [(g(n, one), legend) for n, legend in prof], unit="percentunit", w=12, h=6,
                   description="dcgm-exporter's DCGM_FI_PROF_* ratios over the last sampling interval, from NVML's GPM. Empty before Hopper."),
        timeseries(L, "PCIe and NVLink", [
            (g("DCGM_FI_PROF_PCIE_TX_BYTES", one), "PCIe TX"), (g("DCGM_FI_PROF_PCIE_RX_BYTES", one), "PCIe RX"),
            (g("DCGM_FI_PROF_NVLINK_TX_BYTES", one), "NVLink TX"), (g("DCGM_FI_PROF_NVLINK_RX_BYTES", one), "NVLink RX"),
        ], unit="Bps", w=12, h=6),
        timeseries(L, "Temperature", [(g("DCGM_FI_DEV_GPU_TEMP", one), "GPU"), (g("DCGM_FI_DEV_MEMORY_TEMP", one), "memory (HBM)")], unit="celsius", w=6, h=6),
        timeseries(L, "Power", [(g("DCGM_FI_DEV_POWER_USAGE", one), "draw"), (f"max by (Hostname, gpu, UUID) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{{{one}}}[5m])) / 1000", "from energy counter")],
                   unit="watt", w=6, h=6),
        timeseries(L, "Clocks", [(g("DCGM_FI_DEV_SM_CLOCK", one), "SM"), (g("DCGM_FI_DEV_MEM_CLOCK", one), "memory")], unit="rotmhz", w=6, h=6),
        timeseries(L, "Errors", [
            (g("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", one), "ECC single-bit"), (g("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", one), "ECC double-bit"),
            (g("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", one), "rows remapped (correctable)"),
            (g("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", one), "rows remapped (uncorrectable)"),
            (g("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", one), "PCIe replays"), (g("DCGM_FI_DEV_XID_ERRORS", one), "last XID"),
        ], w=6, h=6, description="Counts since the driver loaded; last XID: the code of the GPU's last XID error (0: none)."),
    ]
    p.append(row(L, "Node: CPU, memory, disks, network (node_exporter)"))
    cpu_busy = node('rate(node_cpu_seconds_total{mode!="idle"}[5m])')
    cpus = node('node_cpu_seconds_total{mode="idle"}')
    cached, buffers = node("node_memory_Cached_bytes"), node("node_memory_Buffers_bytes")
    net_in = node('rate(node_network_receive_bytes_total{device!="lo"}[5m])')
    net_out = node('rate(node_network_transmit_bytes_total{device!="lo"}[5m])')
    p += [
        timeseries(L, "CPU by mode", [(f"sum by (mode) ({cpu_busy}) / scalar(count({cpus}))", "{{mode}}")],
                   unit="percentunit", w=6, h=7, stack=True),
        timeseries(L, "Memory", [
            (f"sum({mem_total}) - sum({mem_avail})", "used"),
            (f"sum({cached}) + sum({buffers})", "cache and buffers"),
            (f"sum({mem_avail})", "available"),
        ], unit="bytes", w=6, h=7),
        timeseries(L, "Disk space used", [(f"100 * (1 - {fs_avail} / {fs_size})", "{{mountpoint}}")], unit="percent", w=6, h=7),
        timeseries(L, "Disk and network I/O", [
            (f"sum({node('rate(node_disk_read_bytes_total[5m])')})", "disk read"),
            (f"sum({node('rate(node_disk_written_bytes_total[5m])')})", "disk write"),
            (f"sum({net_in})", "network in"),
            (f"sum({net_out})", "network out"),
        ], unit="Bps", w=6, h=7),
    ]
    p.append(row(L, "Jobs on the GPUs (per process, shards included)"))
    jsel = 'gpu=~"$gpu"'
    p += [
        table(L, "Jobs on GPUs now", [
            (f"sum by (jobid, user, gpu) (gpuhub_job_gpu_memory_used_bytes{{{jsel}}})", "VRAM"),
            (f"avg by (jobid, user, gpu) (gpuhub_job_gpu_utilization_ratio{{{jsel}}}) * 100", "Utilisation %"),
            (f"max by (jobid, user, gpu) (gpuhub_job_gpu_shards{{{jsel}}})", "Shards"),
            (f"sum by (jobid, user, gpu) (gpuhub_job_gpu_processes{{{jsel}}})", "Processes"),
        ], units={"VRAM": "bytes", "Utilisation %": "percent"}, sort="VRAM",
            description="Per-process attribution from NVML, mapped to Slurm jobs: two shard jobs on one GPU each get their own row."),
        timeseries(L, "VRAM per job", [(f"sum by (jobid, user) (gpuhub_job_gpu_memory_used_bytes{{{jsel}}})", "{{jobid}} ({{user}})")], unit="bytes", stack=True),
        timeseries(L, "Utilisation per job", [(f"sum by (jobid, user) (gpuhub_job_gpu_utilization_ratio{{{jsel}}})", "{{jobid}} ({{user}})")], unit="percentunit"),
        timeseries(L, "VRAM no job accounts for", [(f"gpuhub_gpu_memory_unattributed_bytes{{{jsel}}}", "GPU {{gpu}}")], unit="bytes",
                   description="Memory in use that no running job's process holds (a stray process, or one outside Slurm)."),
        timeseries(L, "Energy per job", [(f"sum by (jobid, user) (rate(gpuhub_job_gpu_energy_joules_total{{{jsel}}}[5m]))", "{{jobid}} ({{user}})")], unit="watt"),
    ]
    variables = [
        query_var("Hostname", "Node", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"),
        query_var("gpu", "GPU", 'label_values(DCGM_FI_DEV_GPU_UTIL{Hostname=~"$Hostname"}, gpu)'),
    ]
    return dashboard("gpuhub-gpus", "gpuhub / GPU telemetry",
                     "Per-GPU utilisation, memory, temperature, power and clocks (dcgm-exporter series), and the jobs on each GPU.",
                     p, variables, time_from="now-1h", tags=("gpu",))


# --------------------------------------------------------------------------- GPU-hours
def gpu_hours():
    L = Layout()
    us = 'user=~"$user", account=~"$account"'
    gh = f"sum by (user, account) (increase(gpuhub_slurm_gpu_seconds_total{{{us}}}[$__range])) / 3600"
    sh = f"sum by (user, account) (increase(gpuhub_slurm_shard_seconds_total{{{us}}}[$__range])) / 3600"
    p = [
        text(L, "", "GPU-hours in the selected range, from the accounting store: what Slurm allocated, as "
             "`gpuhub usage --by user` bills it (running jobs up to now). Per job, GPU and shard: `gpuhub job JOBID`. "
             "GPU-equivalent hours = GPU-hours + shard-hours / $shards_per_gpu.", h=2),
        stat(L, "GPU-hours", f"sum({gh})", unit="short", w=6),
        stat(L, "Shard-hours", f"sum({sh})", unit="short", w=6),
        stat(L, "GPU-equivalent hours", f"sum({gh}) + sum({sh}) / $shards_per_gpu", unit="short", w=6),
        stat(L, "Users", f"count(sum by (user) (increase(gpuhub_slurm_gpu_seconds_total{{{us}}}[$__range])) > 0 or sum by (user) (increase(gpuhub_slurm_shard_seconds_total{{{us}}}[$__range])) > 0)", w=6),
        table(L, "GPU-hours per user and account", [
            (gh, "GPU-hours"), (sh, "Shard-hours"), (f"({gh}) + ({sh}) / $shards_per_gpu", "GPU-equivalent hours"),
        ], units={"GPU-hours": "short", "Shard-hours": "short", "GPU-equivalent hours": "short"}, sort="GPU-equivalent hours", w=12, h=10),
        {**timeseries(L, "GPU-equivalent hours by account", [(f"sum by (account) (({gh}) + ({sh}) / $shards_per_gpu)", "{{account}}")], w=12, h=10),
         "type": "bargauge", "options": {"orientation": "horizontal", "displayMode": "gradient", "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}},
        timeseries(L, "GPUs held, by user", [(f"sum by (user) (rate(gpuhub_slurm_gpu_seconds_total{{{us}}}[5m]))", "{{user}}")], stack=True,
                   description="GPU-seconds per second = whole GPUs allocated to the user's jobs."),
        timeseries(L, "Shards held, by user", [(f"sum by (user) (rate(gpuhub_slurm_shard_seconds_total{{{us}}}[5m]))", "{{user}}")], stack=True),
        timeseries(L, "GPUs allocated / idle", [("sum by (state) (gpuhub_slurm_gpus)", "{{state}}")], stack=True, w=8),
        timeseries(L, "Shards allocated / idle", [("sum by (state) (gpuhub_slurm_shards)", "{{state}}")], stack=True, w=8),
        timeseries(L, "Pending jobs by reason", [("sum by (reason) (gpuhub_slurm_pending_jobs)", "{{reason}}")], stack=True, w=8),
        timeseries(L, "Jobs by state and partition", [('sum by (state, partition) (gpuhub_slurm_jobs{user=~"$user"})', "{{partition}} {{state}}")], stack=True, w=24),
    ]
    p.append(row(L, "This node in Slurm (from slurmctld, whatever the request syntax)"))
    js = 'user=~"$user", account=~"$account"'
    p += [
        table(L, "Node state", [("max by (node, state, reason) (gpuhub_slurm_node_state == 1)", "Now")], w=8, h=5,
              description="idle, mixed, allocated, drained (drain and nothing runs), draining, down, ...; the reason is the admin's."),
        timeseries(L, "CPUs allocated / idle", [("sum by (state) (gpuhub_slurm_node_cpus)", "{{state}}")], stack=True, w=8, h=5),
        timeseries(L, "Memory allocated / idle", [("sum by (state) (gpuhub_slurm_node_memory_bytes)", "{{state}}")], unit="bytes", stack=True, w=8, h=5),
        table(L, "Running jobs on this node", [
            (f"sum by (jobid, user, account, partition) (gpuhub_slurm_job_gpus{{{js}}})", "GPUs"),
            (f"sum by (jobid, user, account, partition) (gpuhub_slurm_job_shards{{{js}}})", "Shards"),
            (f"sum by (jobid, user, account, partition) (gpuhub_slurm_job_cpus{{{js}}})", "CPUs"),
            (f"sum by (jobid, user, account, partition) (gpuhub_slurm_job_memory_bytes{{{js}}})", "Memory"),
        ], units={"Memory": "bytes"}, sort="GPUs", w=24, h=8,
            description="Each running job's allocation as slurmctld reports it (--gres, --gpus, --gpus-per-node, --gpus-per-task, shards alike)."),
    ]
    variables = [
        query_var("user", "User", "label_values(gpuhub_slurm_gpu_seconds_total, user)"),
        query_var("account", "Account", "label_values(gpuhub_slurm_gpu_seconds_total, account)"),
        {"name": "shards_per_gpu", "label": "Shards per GPU", "type": "constant", "query": "14", "hide": 2,
         "current": {"text": "14", "value": "14"}, "options": [{"text": "14", "value": "14", "selected": True}]},
    ]
    return dashboard("gpuhub-gpu-hours", "gpuhub / GPU-hours per user",
                     "Who used the GPUs: GPU-, shard- and GPU-equivalent hours per user and account, allocation and queue.",
                     p, variables, time_from="now-30d", tags=("accounting",))


# --------------------------------------------------------------------------- gateway
def gateway():
    L = Layout()
    f = 'model=~"$model", user=~"$user", app=~"$app"'
    m = 'model=~"$model"'
    p = [
        stat(L, "Calls/s", f"sum(rate(gpuhub_gateway_requests_total{{{f}}}[5m]))", unit="reqps"),
        stat(L, "Errors", f"sum(rate(gpuhub_gateway_errors_total{{{f}}}[5m])) / sum(rate(gpuhub_gateway_requests_total{{{f}}}[5m])) * 100", unit="percent",
             thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}, {"color": "red", "value": 5}]),
        stat(L, "p99 latency", f"histogram_quantile(0.99, sum by (le) (rate(gpuhub_gateway_request_duration_seconds_bucket{{{m}}}[5m])))", unit="s"),
        stat(L, "p99 gateway overhead", f"histogram_quantile(0.99, sum by (le) (rate(gpuhub_gateway_overhead_seconds_bucket{{{m}}}[5m])))", unit="s",
             description="Time a call spends in the gateway itself (latency minus upstream time)."),
        stat(L, "Tokens/s", f"sum(rate(gpuhub_gateway_tokens_total{{{f}}}[5m]))"),
        stat(L, "In flight", f"sum(gpuhub_gateway_in_flight{{{m}}})"),
        timeseries(L, "Calls/s by model", [(f"sum by (model) (rate(gpuhub_gateway_requests_total{{{f}}}[5m]))", "{{model}}")], unit="reqps", w=8, stack=True),
        timeseries(L, "Calls/s by user", [(f"sum by (user) (rate(gpuhub_gateway_requests_total{{{f}}}[5m]))", "{{user}}")], unit="reqps", w=8, stack=True),
        timeseries(L, "Calls/s by app", [(f"sum by (app) (rate(gpuhub_gateway_requests_total{{{f}}}[5m]))", "{{app}}")], unit="reqps", w=8, stack=True),
        timeseries(L, "Errors/s by code", [(f"sum by (code, model) (rate(gpuhub_gateway_errors_total{{{f}}}[5m]))", "{{code}} {{model}}")], unit="reqps", stack=True),
        timeseries(L, "Tokens/s by model", [(f"sum by (model, kind) (rate(gpuhub_gateway_tokens_total{{{f}}}[5m]))", "{{model}} {{kind}}")], stack=True),
        timeseries(L, "Latency by model", [
            (f"histogram_quantile(0.5, sum by (le, model) (rate(gpuhub_gateway_request_duration_seconds_bucket{{{m}}}[5m])))", "p50 {{model}}"),
            (f"histogram_quantile(0.99, sum by (le, model) (rate(gpuhub_gateway_request_duration_seconds_bucket{{{m}}}[5m])))", "p99 {{model}}"),
        ], unit="s"),
        timeseries(L, "Gateway overhead by model", [
            (f"histogram_quantile(0.5, sum by (le, model) (rate(gpuhub_gateway_overhead_seconds_bucket{{{m}}}[5m])))", "p50 {{model}}"),
            (f"histogram_quantile(0.99, sum by (le, model) (rate(gpuhub_gateway_overhead_seconds_bucket{{{m}}}[5m])))", "p99 {{model}}"),
        ], unit="s"),
        timeseries(L, "In flight and queued", [(f"sum by (model) (gpuhub_gateway_in_flight{{{m}}})", "in flight {{model}}"), (f"sum by (model) (gpuhub_gateway_queued{{{m}}})", "queued {{model}}")]),
        table(L, "Model workers", [
            (f"max by (model, state) (gpuhub_model_state{{{m}}} == 1)", "Current"),
            (f"sum by (model) {events(f'gpuhub_model_transitions_total{{{m}}}')}", "Transitions"),
            (f"sum by (model) (increase(gpuhub_model_evictions_total{{{m}}}[$__range]))", "Evictions"),
        ], w=12, h=8, description="State per model (unloaded, pending in Slurm, starting, ready, draining, failed); `gpuhub models` shows the reasons."),
        timeseries(L, "Cold-start time (first call to ready)", [(f"histogram_quantile(0.5, sum by (le, model) (rate(gpuhub_model_load_duration_seconds_bucket{{{m}}}[1h])))", "p50 {{model}}")], unit="s"),
        timeseries(L, "Usage log", [("sum(rate(gpuhub_gateway_usage_rows_spilled_total[5m]))", "rows spilled to disk/s"), ("sum(rate(gpuhub_gateway_usage_write_failures_total[5m]))", "write failures/s"), ("sum by (instance) (gpuhub_gateway_usage_rows_waiting)", "rows waiting for the store {{instance}}")],
                   description="Every call gets a usage row; when the store is slow rows wait on disk and are replayed, never dropped. Rows waiting that keep growing: the store is down or slower than the calls (`gpuhub doctor`)."),
        table(L, "Calls in the range per model, name asked, user and app", [
            (f"sum by (model, requested, user, app) {events(f'gpuhub_gateway_requests_total{{{f}}}')}", "Calls"),
        ], w=12, h=8, sort="Calls"),
    ]
    variables = [
        query_var("model", "Model", "label_values(gpuhub_gateway_requests_total, model)"),
        query_var("user", "User", "label_values(gpuhub_gateway_requests_total, user)"),
        query_var("app", "App", "label_values(gpuhub_gateway_requests_total, app)"),
    ]
    return dashboard("gpuhub-gateway", "gpuhub / Model gateway",
                     "OpenAI-compatible gateway: calls, errors, tokens and latency per model, user and app; model worker states.",
                     p, variables, time_from="now-6h", tags=("gateway",))


# --------------------------------------------------------------------------- names
CALLS = 'gpuhub_gateway_name_calls_total{{state=~"{}"}}'


def names():
    L = Layout()
    p = [
        text(L, "", "Every call is counted by the state of the name it asked for. **Retired** and **unknown** names fail; "
             "**deprecated** names still work until their sunset. Act with `gpuhub names callers NAME`, "
             "`gpuhub names rename OLD NEW --sunset DATE`, `gpuhub names restore NAME`.", h=2),
        stat(L, "Calls to retired names", f'sum {events(CALLS.format("retired"))} or vector(0)', w=6,
             thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
        stat(L, "Calls to unknown names", f'sum {events(CALLS.format("unknown"))} or vector(0)', w=6,
             thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
        stat(L, "Calls to deprecated names", f'sum {events(CALLS.format("deprecated"))} or vector(0)', w=6,
             thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
        stat(L, "Calls to roles without a served model", f'sum {events(CALLS.format("unassigned|unserved"))} or vector(0)', w=6,
             thresholds=[{"color": "green", "value": None}, {"color": "orange", "value": 1}]),
        timeseries(L, "Calls by name state", [("sum by (state) (rate(gpuhub_gateway_name_calls_total[5m]))", "{{state}}")], unit="reqps", stack=True, w=24),
        table(L, "Deprecated names: sunset and who still calls them", [
            ("max by (name, replacement) (gpuhub_name_sunset_timestamp_seconds - time()) / 86400", "Days to sunset"),
        ], w=8, h=9, sort="Days to sunset"),
        table(L, "Callers of deprecated names (range)", [
            (f'sum by (name, user, app) {events(CALLS.format("deprecated"))} > 0', "Calls"),
        ], w=16, h=9, sort="Calls"),
        table(L, "Callers of retired and unknown names and unserved roles (range)", [
            (f'sum by (state, name, user, app) {events(CALLS.format("retired|unknown|unassigned|unserved"))} > 0', "Calls"),
        ], w=12, h=9, sort="Calls"),
        table(L, "Unknown names asked for (range)", [
            (f"topk(20, sum by (name) {events('gpuhub_gateway_unknown_model_requests_total')}) > 0", "Calls"),
        ], w=12, h=9, sort="Calls"),
        timeseries(L, "Calls per name (active and deprecated)", [('sum by (name, state) (rate(gpuhub_gateway_name_calls_total{state=~"active|deprecated"}[5m]))', "{{name}} ({{state}})")], unit="reqps", w=24),
    ]
    return dashboard("gpuhub-names", "gpuhub / Model names and callers",
                     "Renamed, retired and unknown model names, and who still calls them.", p, [], time_from="now-7d", tags=("names",))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "share", "grafana")
    os.makedirs(out, exist_ok=True)
    for name, board in (("gpuhub-gpu-telemetry", gpu_telemetry()), ("gpuhub-gpu-hours", gpu_hours()),
                        ("gpuhub-gateway", gateway()), ("gpuhub-names", names())):
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            json.dump(board, f, indent=2, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
