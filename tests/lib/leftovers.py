#!/usr/bin/env python3
"""What the system tests left behind, for tests/run-all.sh (through tests/lib/leftovers.sh).

    leftovers.py baseline DIR      record the processes and listening TCP ports there are now
    leftovers.py scan DIR          print one line per leftover, "KEY<TAB>DESCRIPTION"

A leftover is
  - a process that carries this run's marker (GPUHUB_TEST_RUN in its environment, inherited by
    everything the run starts, setsid'd daemons included), was not there at the baseline, and is
    not one of the lab's own daemons (Slurm, munge, MariaDB, the test PostgreSQL) or the lab's
    gpuhub-agent (/run/gpuhub/agent.pid);
  - a model worker a test's agent started with the `local` launcher (its environment is
    cleared, so it has no marker: GPUHUB_WORKER_TAG in its environment), not there at the
    baseline and not a child of the lab's gpuhub-agent;
  - a listening TCP port that was not listening at the baseline, held by a process of this run;
  - a Slurm job other than the lab agent's own model workers (they unload themselves when idle);
  - a file or directory /tmp/gpuhub* that was not there at the baseline (every test's mktemp
    template starts so; state the tests keep on purpose lives in /var/tmp/gpuhub-*).
"""
import os
import re
import subprocess
import sys

LAB_DAEMONS = {"slurmctld", "slurmd", "slurmstepd", "slurmdbd", "munged", "mariadbd", "mysqld", "mysqld_safe", "postgres"}
# Their children are theirs too (mysqld_safe's logger, slurmctld's slurmscriptd); not slurmstepd's,
# which are a job's processes (and a job still there is a leftover of its own).
LAB_DAEMON_TREES = LAB_DAEMONS - {"slurmstepd", "slurmd"}
LAB_AGENT_PID = "/run/gpuhub/agent.pid"
# Set in every model worker's environment by gpuhub-agent (agent/src/models/launcher/secret.rs).
WORKER_TAG = b"GPUHUB_WORKER_TAG="
# The lab agent's worker jobs: comment `gpuhub-worker:<owner>:<workers dir>` (the owner is its
# Slurm node, gpu01).
LAB_WORKERS = ("gpuhub-worker:/var/lib/gpuhub/workers", "gpuhub-worker:gpu01:/var/lib/gpuhub/workers")


def read(path, mode="r"):
    try:
        with open(path, mode) as f:
            return f.read()
    except OSError:
        return None


def processes():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            stat = read(f"/proc/{d}/stat")
            if stat is None:
                continue
            # comm may contain spaces and parentheses: the fields after the last ')' are fixed.
            comm = stat[stat.index("(") + 1 : stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            out[int(d)] = (comm, ppid)
    return out


def ancestors(pid, procs):
    seen = set()
    while pid in procs and pid not in seen and pid > 1:
        seen.add(pid)
        pid = procs[pid][1]
    return seen


def listening():
    try:
        text = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    ports = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 4:
            ports[f[3]] = " ".join(f[5:])
    return ports


def tmp_entries():
    try:
        return {n for n in os.listdir("/tmp") if n.startswith("gpuhub")}
    except OSError:
        return set()


def baseline(d):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "pids"), "w") as f:
        f.write("\n".join(str(p) for p in processes()) + "\n")
    with open(os.path.join(d, "ports"), "w") as f:
        f.write("\n".join(listening()) + "\n")
    with open(os.path.join(d, "tmp"), "w") as f:
        f.write("\n".join(sorted(tmp_entries())) + "\n")


def scan(d):
    marker = os.environ.get("GPUHUB_TEST_RUN", "").encode()
    if not marker:
        sys.exit("leftovers.py: GPUHUB_TEST_RUN is not set (tests/run-all.sh sets it)")
    old_pids = {int(x) for x in (read(os.path.join(d, "pids")) or "").split()}
    old_ports = set((read(os.path.join(d, "ports")) or "").split())
    try:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i|%u|%j|%T|%k"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        jobs = ""
    lab_jobs = set()
    for line in jobs.splitlines():
        f = line.split("|")
        if len(f) != 5:
            continue
        if f[4] in LAB_WORKERS:
            lab_jobs.add(f[0].encode())
        else:
            print(f"job:{f[0]}\tSlurm job {f[0]} (user {f[1]}, name {f[2]}, {f[3]}, comment {f[4]!r})")
    procs = processes()
    me = ancestors(os.getpid(), procs)
    agent = (read(LAB_AGENT_PID) or "").strip()
    lab_procs = set()  # the lab's daemons, its agent and its agent's workers: theirs, not a test's
    ours = set()  # processes that carry this run's marker
    for pid, (comm, _ppid) in sorted(procs.items()):
        if pid in me:
            continue
        if comm in LAB_DAEMONS or str(pid) == agent or any(procs[a][0] in LAB_DAEMON_TREES for a in ancestors(procs[pid][1], procs)):
            lab_procs.add(pid)
            continue
        env = read(f"/proc/{pid}/environ", "rb")
        if env is None:
            continue
        env = env.split(b"\0")
        if any(b"SLURM_JOB_ID=" + j in env for j in lab_jobs):
            lab_procs.add(pid)
            continue
        local_worker = any(v.startswith(WORKER_TAG) for v in env) and not (agent.isdigit() and int(agent) in ancestors(pid, procs))
        if b"GPUHUB_TEST_RUN=" + marker not in env and not local_worker:
            continue
        ours.add(pid)
        if pid in old_pids:
            continue
        args = (read(f"/proc/{pid}/cmdline", "rb") or b"").replace(b"\0", b" ").decode(errors="replace").strip()
        try:
            user = str(os.stat(f"/proc/{pid}").st_uid)
        except OSError:
            continue
        print(f"pid:{pid}\tprocess {pid} (uid {user}, {comm}): {args[:300]}")
    for addr, owner in sorted(listening().items()):
        owners = {int(x) for x in re.findall(r"pid=(\d+)", owner)}
        # A port whose owner is known and not of this run (another session's) is not a leftover.
        if addr not in old_ports and not owners & lab_procs and (not owners or owners & ours):
            print(f"port:{addr}\tlistening TCP port {addr} {owner}")
    old_tmp = set((read(os.path.join(d, "tmp")) or "").split())
    for name in sorted(tmp_entries() - old_tmp):
        print(f"tmp:{name}\t/tmp/{name} (remove it in the test's cleanup)")

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("baseline", "scan"):
        sys.exit(__doc__)
    (baseline if sys.argv[1] == "baseline" else scan)(sys.argv[2])
