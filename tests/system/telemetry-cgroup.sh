#!/usr/bin/env bash
# timeout: 300
# GPU attribution by cgroup first (issue 21): a GPU process belongs to the job whose cgroup
# slurmstepd put it in, whatever SLURM_JOB_ID its environment claims (any process can export
# one). Slurm runs with ProctrackType=proctrack/cgroup for this test (restored after): each job
# step's tasks live in .../job_<id>/step_<n>. As the unprivileged lab user, a task exports
# SLURM_JOB_ID=1 and SLURM_JOB_USER=root and becomes the GPU process the fake NVML library lists;
# a private agent (attribution by process only) must label its memory with the real job id and
# the user of the process's uid, and never with job 1 or root. On a Slurm without per-job
# cgroups (the lab's proctrack/linuxproc) the environment is the only evidence, as before
# (telemetry-prometheus.sh); the cgroup v2 layout is unit-tested (telemetry/attribution.rs).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/lab.sh"   # its EXIT trap replaces telemetry.sh's:
lab_cleanup_add tel_cleanup                          # runs last, before plugstack_restore
lab_require
tel_init
lab_user
lab_wait_gpus_free 240
lab_slurm_setup shipped "" ProctrackType=proctrack/cgroup
GIB=$((1024 * 1024 * 1024))

# The job: a task that lies about its job and user, then sleeps as the "GPU process".
chmod 777 "$T"
echo "+ runuser -u $LAB_USER -- srun --gres=gpu:1 ... (the task exports SLURM_JOB_ID=1 SLURM_JOB_USER=root)"
runuser -u "$LAB_USER" -- srun --gres=gpu:1 -t 2 -J tel-cgroup --chdir=/tmp sh -c \
    "echo \$\$ \$SLURM_JOB_ID > $T/job.tmp && mv $T/job.tmp $T/job.info && export SLURM_JOB_ID=1 SLURM_JOB_USER=root && exec sleep 110" \
    >"$T/srun.log" 2>&1 &
TEL_CLEANUP+=("kill $! 2>/dev/null")
for ((i = 0; i < 120; i++)); do [ -s "$T/job.info" ] && break; sleep 0.25; done
[ -s "$T/job.info" ] || { cat "$T/srun.log" >&2; tel_fail "the srun job did not start within 30 s"; }
read -r pid job < "$T/job.info"
lab_cleanup_add "lab_cancel $job"
echo "  job $job: task pid $pid"
echo "  /proc/$pid/cgroup:"; sed 's/^/    /' "/proc/$pid/cgroup"
grep -qE "/job_$job(/|$)" "/proc/$pid/cgroup" \
    || tel_fail "Slurm did not put job $job's task in a job_$job cgroup (is proctrack/cgroup working? see $LAB_SLURMD_LOG)"
tr '\0' '\n' < "/proc/$pid/environ" | grep -qx 'SLURM_JOB_ID=1' || tel_fail "the task's environment does not claim SLURM_JOB_ID=1"

{
    tel_gpu_line 0 $((12 * GIB)) 60
    tel_gpu_line 1 0 0
    echo "proc gpu=0 pid=$pid mem=$((10 * GIB)) sm=60"
} > "$T/nvml/fake-nvml.conf"
TEL_JOB_MAP_DIR="" tel_start_agent false
want="gpuhub_job_gpu_memory_used_bytes{gpu=\"0\",uuid=\"GPU-tel00000-0000-0000-0000-000000000000\",jobid=\"$job\",user=\"$LAB_USER\"} $((10 * GIB))"
text=""
for ((i = 0; i < 50; i++)); do
    text="$(curl -fsS "$TEL_METRICS_URL" 2>/dev/null || true)"
    grep -qF "$want" <<<"$text" && break
    sleep 0.2
done
grep '^gpuhub_job_gpu_memory_used_bytes' <<<"$text" | sed 's/^/  metrics: /' || true
grep -qF "$want" <<<"$text" || tel_fail "the process in job $job's cgroup is not attributed to job $job and $LAB_USER (want: $want)"
if grep -E '^gpuhub_job_gpu_[a-z_]+\{[^}]*(jobid="1"|user="root")' <<<"$text"; then
    tel_fail "a job or user claimed only by the task's environment made it into the metrics"
fi
lab_node_ok
echo "PASS: telemetry-cgroup"
