#!/usr/bin/env bash
# timeout: 300
# `gpuhub job JOBID` end to end: what NVML measured for real Slurm jobs lands in the job summary.
# Three jobs of the unprivileged lab user: c (--gres=gpu:1, two GPU processes) holds one GPU;
# a and b (--gres=shard:7 each) then share the other. The plugin writes their records into the
# spool of a private gpuhub-agent that reads two fake H200s (tests/fake-nvml) scripted with the
# jobs' real PIDs, in phases of ~3 s whose VRAM and utilisation differ, so that peak and mean
# cannot be mistaken for each other or for the last value. Asserted from `gpuhub job --json`,
# per job and GPU:
#   - the GPU is the one Slurm allocated (index and the fake UUID), 7 shards for a and b;
#   - peak VRAM = the largest scripted sum of the job's processes at one time, exactly (c's
#     peak is 18+12 GiB: more than either process ever held alone);
#   - mean utilisation = the time-weighted mean of the scripted phases (c alone: the GPU's
#     utilisation; a, b: their processes' SM utilisation), within the error of one sample at
#     each phase boundary (bound computed below); samples = visible time / 200 ms, +-15 %;
#   - energy: a and b's GPU has power 0, so its counter moves only in two scripted jumps, made
#     while the utilisations held still: each job gets exactly jump x its share of the GPU's
#     utilisation at that time. c's GPU draws a constant 300 W plus one jump of 1000 J: c gets
#     1000 J + 300 W x the time its processes were listed, within 300 W x (1 sample + 0.5 s);
#   - the human `gpuhub job JOBID` line of each GPU shows those numbers;
#   - while the jobs run, each GPU's `current` is the last sample (utilisation and VRAM now).
# The agent runs as shipped (job boundaries from slurmctld: it verifies and closes the jobs there,
# storing the measurements at the close). Attribution is by process only (telemetry.job_map_dir
# = "": the job map path is spank-dcgm.sh's), so a job is on its GPU exactly while the script
# lists its PIDs.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../lib/telemetry.sh"
. "$(dirname "${BASH_SOURCE[0]}")/../lib/lab.sh"   # its EXIT trap replaces telemetry.sh's:
lab_cleanup_add tel_cleanup                          # runs last, before plugstack_restore
cli="${GPUHUB_CLI_BIN:-$LAB_REPO/target/release/gpuhub}"
lab_require
[ -x "$cli" ] || lab_fail "$cli missing; run cargo build --release"
tel_init
lab_user
GIB=$((1024 * 1024 * 1024))
HOLD=3            # seconds per phase
INTERVAL=0.2      # the agent's telemetry.interval_ms (tel_start_agent)
G0=GPU-tel00000-0000-0000-0000-000000000000
G1=GPU-tel00000-0000-0000-0000-000000000001
mkdir -p "$T/jobs"
chmod 777 "$T/jobs"

# ---- the fake GPUs: no processes yet; energy counters flat (power 0) until the jobs are placed
declare -A UTIL=([0]=0 [1]=0) POWER=([0]=0 [1]=0) ENERGY=([0]=1000000 [1]=1000000) PROCS=()
write_script() {
    local i
    {
        for i in 0 1; do
            tel_gpu_line "$i" $((2 * GIB)) "${UTIL[$i]}" |
                sed "s/power_mw=400000 energy_mj=1000 /power_mw=${POWER[$i]} energy_mj=${ENERGY[$i]} /"
        done
        for i in "${!PROCS[@]}"; do echo "${PROCS[$i]}"; done
    } > "$T/nvml/conf.tmp"
    mv -f "$T/nvml/conf.tmp" "$T/nvml/fake-nvml.conf"
}
write_script
TEL_JOB_MAP_DIR="" tel_start_agent true '[accounting]
ingest_interval_ms = 200'
sock="$T/run/agent.sock"
for ((i = 0; i < 100; i++)); do [ -S "$sock" ] && [ -s "$T/run/snapshot.json" ] && break; sleep 0.1; done
[ -S "$sock" ] || tel_fail "no control socket $sock"

# ---- the plugin writes into this agent's spool and reads its snapshot and key
lab_wait_gpus_free 240
plugstack_set "spool_dir=$T/spool" "snapshot=$T/run/snapshot.json" "job_key=$T/state/job-token.key"
declare -A JOB PID PID2 GPU
start_job() { # NAME GRES: a task that waits for $T/jobs/NAME.stop; c also has a second process
    local name="$1" gres="$2" extra=""
    [ "$name" = c ] && extra='sleep 600 & p2=$!; '
    echo "+ runuser -u $LAB_USER -- srun --gres=$gres -t 3 -J tel-job-$name ... (job $name)"
    runuser -u "$LAB_USER" -- srun --gres="$gres" -t 3 -J "tel-job-$name" --chdir=/tmp sh -c \
        "${extra}echo \$\$ \${p2:-0} \$SLURM_JOB_ID > $T/jobs/$name.tmp && mv $T/jobs/$name.tmp $T/jobs/$name.info
         while [ ! -e $T/jobs/$name.stop ]; do sleep 0.1; done; [ \${p2:-0} = 0 ] || kill \$p2" \
        >"$T/jobs/$name.srun.log" 2>&1 &
    lab_cleanup_add "touch $T/jobs/$name.stop; kill $! 2>/dev/null || true"
    for ((i = 0; i < 120; i++)); do [ -s "$T/jobs/$name.info" ] && break; sleep 0.25; done
    [ -s "$T/jobs/$name.info" ] || { cat "$T/jobs/$name.srun.log" >&2; tel_fail "srun job $name did not start within 30 s"; }
    read -r PID[$name] PID2[$name] JOB[$name] < "$T/jobs/$name.info"
    lab_cleanup_add "lab_cancel ${JOB[$name]}"
    # The GPU the agent's accounting has for the job (Slurm's, verified from the step record): the
    # one its measurements must be filed under.
    local j=""
    for ((i = 0; i < 100; i++)); do
        j="$("$cli" --socket "$sock" job "${JOB[$name]}" --json 2>/dev/null)" || j='{}'
        [ "$(jq -r '.nodes[0].gpus | length' <<<"$j")" = 1 ] && break
        sleep 0.2
    done
    GPU[$name]="$(jq -r '.nodes[0].gpus[0].index' <<<"$j")"
    [[ "${GPU[$name]}" =~ ^[01]$ ]] || tel_fail "job $name (${JOB[$name]}): the agent has no single GPU for it: ${j:-no answer}"
    echo "  job $name: Slurm job ${JOB[$name]}, pid ${PID[$name]}$([ "${PID2[$name]}" = 0 ] || echo " and ${PID2[$name]}"), GPU ${GPU[$name]}"
}
start_job c gpu:1
start_job a shard:7
start_job b shard:7
gc=${GPU[c]} gs=${GPU[a]}
[ "${GPU[b]}" = "$gs" ] && [ "$gs" != "$gc" ] \
    || tel_fail "Slurm placed the shard jobs on GPU ${GPU[a]} and ${GPU[b]} with the whole-GPU job on $gc: they must share the other GPU"
POWER[$gc]=300000

# ---- the phases; T_MARK[k] = when phase k's script was in place
declare -A T_MARK
now() { date +%s.%N; }
# phase VRAM_C1 VRAM_C2 UTIL_C VRAM_A SM_A VRAM_B SM_B (GiB, percent)
phase() {
    UTIL[$gc]=$3
    PROCS=([c1]="proc gpu=$gc pid=${PID[c]} mem=$(($1 * GIB)) sm=5"
           [c2]="proc gpu=$gc pid=${PID2[c]} mem=$(($2 * GIB)) sm=5"
           [a]="proc gpu=$gs pid=${PID[a]} mem=$(($4 * GIB)) sm=$5"
           [b]="proc gpu=$gs pid=${PID[b]} mem=$(($6 * GIB)) sm=$7")
    write_script
}
jump() { ENERGY[$1]=$((ENERGY[$1] + $2)); write_script; }   # GPU, millijoules
write_script                      # c's GPU now draws 300 W; nobody is on it yet
sleep 1
half="$(python3 -c "print($HOLD / 2)")"
phase 12 6 20 4 10 8 30;  T_MARK[1]="$(now)"; sleep "$HOLD"
phase 18 12 90 10 60 8 30; T_MARK[2]="$(now)"; sleep "$half"
# While phase 2 holds: each running job's last sample on its GPU (`current`, the live view of the
# JupyterHub page): c alone on its GPU has the GPU's 90 % and its two processes' 18+12 GiB; a has
# its processes' 60 % and 10 GiB (not the means of the phases so far).
for spec in "c 90 30" "a 60 10"; do
    read -r name util vram <<<"$spec"
    j="$("$cli" --socket "$sock" job "${JOB[$name]}" --json 2>&1)" || tel_fail "gpuhub job ${JOB[$name]}: $j"
    jq -e --argjson u "$util" --argjson v "$((vram * GIB))" '.nodes[0].state == "running"
        and (.nodes[0].gpus[0].current | .util == $u and .vram_bytes == $v and .at > 0)' <<<"$j" >/dev/null ||
        tel_fail "job $name (${JOB[$name]}): current is not $util % and $vram GiB during phase 2: $(jq -c '.nodes[0].gpus' <<<"$j")"
done
echo "  live: c now 90 % and 30 GiB, a now 60 % and 10 GiB (gpuhub job --json: current)"
jump "$gs" 400000; jump "$gc" 1000000; sleep "$half"           # shares a:b = 60:30
phase 6 6 50 2 20 16 20;  T_MARK[3]="$(now)"; sleep "$half"
jump "$gs" 300000; sleep "$half"                                # shares a:b = 20:20
PROCS=(); write_script;   T_MARK[4]="$(now)"
sleep 1                           # >= 5 samples without the processes: the stats are final
for name in a b c; do touch "$T/jobs/$name.stop"; done
declare -A J
for name in a b c; do
    for ((i = 0; i < 150; i++)); do
        J[$name]="$("$cli" --socket "$sock" job "${JOB[$name]}" --json 2>/dev/null)" || J[$name]='{}'
        [ "$(jq -r '.nodes[0].state' <<<"${J[$name]}")" = ended ] && break
        sleep 0.2
    done
    [ "$(jq -r '.nodes[0].state' <<<"${J[$name]}")" = ended ] || tel_fail "job $name (${JOB[$name]}) not ended in the agent after 30 s: ${J[$name]}"
    printf '%s\n' "${J[$name]}" > "$T/job-$name.json"
    lab_run "$cli" --socket "$sock" job "${JOB[$name]}"
    printf '%s\n' "$LAB_OUT" > "$T/job-$name.txt"
done

# ---- expected values, from the script above, against the agent's
python3 - "$T" "$gc" "$gs" "$INTERVAL" "$LAB_USER" "${T_MARK[1]}" "${T_MARK[2]}" "${T_MARK[3]}" "${T_MARK[4]}" <<'PY' \
    || tel_fail "gpuhub job differs from what the fake NVML script made the GPUs report (MISMATCH lines above)"
import json, re, sys
tmp, gc, gs, dt, user = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
t = [float(x) for x in sys.argv[6:10]]
dur = [t[1] - t[0], t[2] - t[1], t[3] - t[2]]        # the three phases' wall time
T = sum(dur)
GIB = 1 << 30
U = {"G0": "GPU-tel00000-0000-0000-0000-000000000000", "G1": "GPU-tel00000-0000-0000-0000-000000000001"}
uuid = lambda i: U[f"G{i}"]
# Per job: GPU, shards, util per phase, VRAM per phase (sum of its processes), energy (J) and
# its tolerance.
want = {
    "c": (gc, 0, [20, 90, 50], [18, 30, 12], 1000 + 300 * T, 300 * (dt + 0.5)),
    "a": (gs, 7, [10, 60, 20], [4, 10, 2], 400 * 60 / 90 + 300 * 20 / 40, 0.01),
    "b": (gs, 7, [30, 30, 20], [8, 8, 16], 400 * 30 / 90 + 300 * 20 / 40, 0.01),
}
bad = []
for name, (gpu, shards, utils, vram, energy, etol) in want.items():
    n = json.load(open(f"{tmp}/job-{name}.json"))["nodes"][0]
    text = open(f"{tmp}/job-{name}.txt").read()
    mean = sum(u * d for u, d in zip(utils, dur)) / T
    # A phase boundary seen one sample early or late moves the mean by at most
    # |util step| x interval / T; four boundaries (start, 1->2, 2->3, end), each up to one
    # interval plus 0.2 s of sampler lateness.
    steps = [abs(utils[0] - mean), abs(utils[1] - utils[0]), abs(utils[2] - utils[1]), abs(utils[2] - mean)]
    mtol = sum(steps) * (dt + 0.2) / T + 0.5
    checks = [(n["user"] == user, f"user {n['user']!r}, want {user!r}"),
              (n["shards"] == shards, f"shards {n['shards']}, want {shards}"),
              (len(n["gpus"]) == 1, f"{len(n['gpus'])} GPUs, want 1")]
    g = n["gpus"][0] if n["gpus"] else {}
    samples, expect_samples = g.get("samples") or 0, T / dt
    checks += [
        (g.get("index") == gpu and g.get("uuid") == uuid(gpu), f"GPU {g.get('index')} {g.get('uuid')}, want {gpu} {uuid(gpu)}"),
        (g.get("peak_vram_bytes") == max(vram) * GIB, f"peak VRAM {g.get('peak_vram_bytes')}, want {max(vram)} GiB = {max(vram) * GIB}"),
        (abs((g.get("mean_util") or -1) - mean) <= mtol, f"mean util {g.get('mean_util')}, want {mean:.2f} +- {mtol:.2f}"),
        (abs((g.get("energy_joules") or -1) - energy) <= etol, f"energy {g.get('energy_joules')} J, want {energy:.3f} +- {etol:.3f}"),
        (abs(samples - expect_samples) <= 0.15 * expect_samples, f"{samples} samples, want {expect_samples:.0f} +- 15 %"),
    ]
    if g.get("samples"):
        line = (f"GPU {g['index']} {g['uuid']}: mean util {g['mean_util']:.1f} %, peak VRAM {g['peak_vram_bytes'] / GIB:.2f} GiB, "
                f"energy {g['energy_joules']:.0f} J ({g['samples']} samples)")
        checks.append((f"  {line}\n" in text, f"the human output lacks the line `{line}`"))
        head = f"job {n['job_id']} on {n['node']}: user {user} "
        checks.append((head in text and "ended" in text, f"the human output lacks `{head}... ended`"))
    errs = [m for ok, m in checks if not ok]
    bad += errs
    print(("ok" if not errs else "MISMATCH") + f": job {name} ({n['job_id']}) GPU {g.get('index')}: peak VRAM "
          f"{(g.get('peak_vram_bytes') or 0) / GIB:.2f} GiB (want {max(vram)}), mean util {g.get('mean_util')} "
          f"(want {mean:.2f} +- {mtol:.2f}), energy {g.get('energy_joules')} J (want {energy:.3f} +- {etol:.3f}), "
          f"{samples} samples (want ~{expect_samples:.0f})")
    for m in errs:
        print(f"MISMATCH: job {name}: {m}")
sys.exit(1 if bad else 0)
PY
lab_node_ok
echo "PASS: telemetry-job"
