# Example JupyterHub configuration for a gpuhub Slurm node (shipped in
# /usr/share/gpuhub/jupyterhub/). Each user picks one of the site's four profiles; the
# notebook server then runs as an ordinary Slurm job, so the gpuhub SPANK plugin records its
# GPUs and shards (GPU-hours per user) and injects MLFLOW_*, OPENAI_BASE_URL, GPUHUB_URL,
# OPENAI_API_KEY (a per-job gateway credential) and <ROLE>_MODEL into the notebook's
# environment, exactly as for sbatch jobs.
#
# Needs: pip install jupyterhub batchspawner wrapspawner (in the hub's environment), and
# batchspawner's `batchspawner-singleuser` in the users' environment on the node.
# Copy to /etc/jupyterhub/jupyterhub_config.py and adapt partitions, memory and paths.
#
# The four profiles (GPU profiles in partition `interactive`, CPU in `cpu`; see slurm-conf/):
#   1 GPU, 8 hours            --gres=gpu:1
#   2 GPUs, 4 hours           --gres=gpu:2
#   ~half a GPU, 6 hours      --gres=shard:7   (7 of the 14 shards of one H200: VRAM is shared
#                                               on trust, there is no fencing between shard jobs)
#   CPU only, 8 hours         no GPU
import os
import sys

c = get_config()  # noqa: F821 (provided by JupyterHub when it loads this file)

# Sign-in: single sign-on from the site's edge proxy, which authenticates the user and sends
# their e-mail address in a header; gpuhub_jupyterhub_sso.py (next to this file) believes it
# only with the edge's shared secret and from its address, and maps it to a Unix user. Others
# get a page that says why. See docs/admin-guide.md ("JupyterHub") and the module's doc.
sys.path.insert(0, os.environ.get("GPUHUB_JUPYTERHUB_DIR", "/usr/share/gpuhub/jupyterhub"))
c.JupyterHub.authenticator_class = "gpuhub_jupyterhub_sso.GpuhubSSOAuthenticator"
c.GpuhubSSOAuthenticator.email_header = "X-Auth-Request-Email"
c.GpuhubSSOAuthenticator.secret_header = "X-Gpuhub-Proxy-Secret"
# Root-only (0600), at least 16 bytes: (umask 077; openssl rand -hex 32 > /etc/jupyterhub/sso-secret)
c.GpuhubSSOAuthenticator.shared_secret_file = "/etc/jupyterhub/sso-secret"
# The edge's address as configurable-http-proxy sees it (127.0.0.1 for an edge on this node:
# the secret is what proves it).
c.GpuhubSSOAuthenticator.trusted_proxies = ["127.0.0.1"]
# E-mail -> Unix user; wins over local_part_domains.
c.GpuhubSSOAuthenticator.user_map = {"john.doe@example.org": "jdoe"}
# Addresses in these domains map to their local part (alice@example.org -> alice).
c.GpuhubSSOAuthenticator.local_part_domains = ["example.org"]
# No sign-in maps to a system account.
c.GpuhubSSOAuthenticator.min_uid = 1000

# Imported here although only named below: the import registers batchspawner's hub API
# (/hub/api/batchspawner), where the notebook's Slurm job reports the port it listens on.
import batchspawner  # noqa: E402,F401

c.JupyterHub.spawner_class = "wrapspawner.ProfilesSpawner"
# Slurm may need a while to place a GPU job; the hub waits this long for the server to start.
c.Spawner.start_timeout = 300
c.Spawner.http_timeout = 120

# Common batchspawner settings: the job script runs the single-user server; Slurm picks the
# node, the plugin does the rest. {gres} and {runtime} come from each profile below.
c.SlurmSpawner.batch_script = """#!/bin/bash
#SBATCH --job-name=jupyterhub
#SBATCH --partition={partition}
#SBATCH --time={runtime}
#SBATCH --cpus-per-task={nprocs}
#SBATCH --mem={memory}
#SBATCH --output={homedir}/.jupyterhub-slurm-%j.log
#SBATCH --export={keepvars}
#SBATCH --chdir={homedir}
{options}
set -euo pipefail
trap 'echo SIGTERM received' TERM
{prologue}
{cmd}
echo "jupyterhub-singleuser ended gracefully"
{epilogue}
"""


def profile(label, key, partition, runtime, options, nprocs, memory):
    return (
        label,
        key,
        "batchspawner.SlurmSpawner",
        {
            "req_partition": partition,
            "req_runtime": runtime,
            "req_nprocs": str(nprocs),
            "req_memory": memory,
            "req_options": options,
        },
    )


c.ProfilesSpawner.profiles = [
    profile("1 GPU (H200), 8 hours", "gpu1-8h", "interactive", "8:00:00", "#SBATCH --gres=gpu:1", 8, "64G"),
    profile("2 GPUs (H200), 4 hours", "gpu2-4h", "interactive", "4:00:00", "#SBATCH --gres=gpu:2", 16, "128G"),
    profile("About half a GPU (7 shards), 6 hours", "shard7-6h", "interactive", "6:00:00", "#SBATCH --gres=shard:7", 4, "32G"),
    profile("CPU only, 8 hours", "cpu-8h", "cpu", "8:00:00", "", 4, "16G"),
]
# Preselected in the form: the cheapest choice that has a GPU.
c.ProfilesSpawner.default_profile = "shard7-6h"

# The gpuhub page (/services/gpuhub/): each signed-in user's running jobs with GPU utilisation
# and VRAM, their GPU-hours this month, the models and names, and their gateway keys (create,
# revoke); hub admins see everyone. Signed in through the hub (OAuth); it runs as root and asks
# the agent through `gpuhub` run as the signed-in user, so the agent names them by SO_PEERCRED.
GPUHUB_PAGE_URL = "http://127.0.0.1:8402"
c.JupyterHub.services = [
    {
        "name": "gpuhub",
        "url": GPUHUB_PAGE_URL,
        "command": [sys.executable, os.path.join(os.environ.get("GPUHUB_JUPYTERHUB_DIR", "/usr/share/gpuhub/jupyterhub"), "gpuhub_page.py")],
        "oauth_no_confirm": True,
        "display": True,
    }
]
# Every user may open it (JupyterHub's default user role has only `self`).
c.JupyterHub.load_roles = [{"name": "user", "scopes": ["self", "access:services!service=gpuhub"]}]
