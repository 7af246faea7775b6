-- Usage accounting (agent/src/accounting). Times are Unix microseconds.

-- Every usage record ingested from the plugin's spool, once: the primary key is the record's
-- stable id (node:job[.step]:kind), so a file re-read after a crash is a no-op.
CREATE TABLE acct_records (
    record_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    time_us BIGINT NOT NULL,
    body TEXT NOT NULL,
    ingested_us BIGINT NOT NULL
);

-- One row per job and node, folded from its records.
CREATE TABLE acct_jobs (
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    uid BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    account TEXT,
    partition TEXT,
    start_us BIGINT,
    end_us BIGINT,
    first_seen_us BIGINT NOT NULL,
    last_seen_us BIGINT NOT NULL,
    exit_code BIGINT,
    end_reason TEXT,
    shards BIGINT NOT NULL DEFAULT 0,
    anomalies TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (node, job_id)
);
CREATE INDEX acct_jobs_end ON acct_jobs (end_us);
CREATE INDEX acct_jobs_user ON acct_jobs (user_name);

-- The GPUs a job held, with what NVML measured for it there (filled at job end).
CREATE TABLE acct_job_gpus (
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    gpu_index BIGINT NOT NULL,
    gpu_uuid TEXT,
    mean_util DOUBLE PRECISION,
    peak_vram_bytes BIGINT,
    energy_joules DOUBLE PRECISION,
    samples BIGINT,
    PRIMARY KEY (node, job_id, gpu_index)
);
