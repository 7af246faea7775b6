# What a test does when something it needs is missing. Source it, then:
#   prereq_missing WHAT FIX   a prerequisite is missing: under tests/run-all.sh (GPUHUB_TEST_STRICT=1)
#                             print "FAIL: WHAT; FIX" and exit 1; run by hand, print "SKIP: ..." and
#                             return 1 so the caller can leave that part out
# run-all.sh exports GPUHUB_TEST_STRICT=1, so no part of a test is skipped silently there.
prereq_missing() {
    local what="$1" fix="$2"
    if [ "${GPUHUB_TEST_STRICT:-0}" = 1 ]; then
        echo "FAIL: $what; $fix (GPUHUB_TEST_STRICT=1: under tests/run-all.sh a missing prerequisite is a failure)" >&2
        exit 1
    fi
    echo "SKIP: $what; $fix (GPUHUB_TEST_STRICT=1 makes this a failure)"
    return 1
}

# unprivileged_user: print the name of an unprivileged login (gpuhublab), creating it if missing,
# so a test of "a non-admin is refused" never depends on the distribution's `nobody`.
unprivileged_user() {
    id -u gpuhublab >/dev/null 2>&1 || useradd -m -s /bin/bash gpuhublab >/dev/null ||
        { echo "FAIL: cannot create the unprivileged test user gpuhublab (useradd)" >&2; exit 1; }
    echo gpuhublab
}

# quota_user: print the unprivileged login whose GPU-hour quota tests/system/quota-slurm.sh
# drives (gpuhubquota; the lab's agent.toml has its [[quotas]] entry), creating it if missing.
# A user of its own, so that holding it in Slurm never touches another test's jobs.
quota_user() {
    id -u gpuhubquota >/dev/null 2>&1 || useradd -m -s /bin/bash gpuhubquota >/dev/null ||
        { echo "FAIL: cannot create the quota test user gpuhubquota (useradd)" >&2; exit 1; }
    echo gpuhubquota
}

# worker_account: print the account model workers run as (gpuhub-worker, the agent's default
# workers.user), creating it as the agent RPM does (rpm/gpuhub.spec %pre) if missing.
worker_account() {
    if ! id -u gpuhub-worker >/dev/null 2>&1; then
        { getent group gpuhub-worker >/dev/null || groupadd -r gpuhub-worker; } &&
            useradd -r -l -g gpuhub-worker -d /var/lib/gpuhub/workers -M -s /usr/sbin/nologin -c "gpuhub model workers" gpuhub-worker ||
            { echo "FAIL: cannot create the model worker account gpuhub-worker (useradd)" >&2; exit 1; }
    fi
    echo gpuhub-worker
}

# unprivileged_exec_check USER PATH: fail with the reason when USER cannot run PATH (a checkout in
# a 0700 directory, e.g. under mktemp -d), instead of a bare "Permission denied" from runuser.
unprivileged_exec_check() {
    runuser -u "$1" -- test -x "$2" && return 0
    local d="$2"
    while [ "$d" != / ]; do d="$(dirname "$d")"; runuser -u "$1" -- test -x "$d" || break; done
    echo "FAIL: user $1 cannot run $2: $d (mode $(stat -c %a "$d")) is not searchable by other users; clone the repository where other users can read it (chmod o+rx $d)" >&2
    exit 1
}
