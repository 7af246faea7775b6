-- Inference billed to its callers (agent/src/accounting/inference.rs). Times: Unix microseconds.

-- Every model worker the agent submitted as a Slurm job, kept after the worker stops (unlike
-- model_workers): what makes a job a worker job is this row, written by the agent when sbatch
-- answered, never the job's name. `uid` is the worker account's: a job with this id of another
-- uid (ids reused after a StateSaveLocation purge) is not a worker job.
CREATE TABLE inference_workers (
    job_id BIGINT PRIMARY KEY,
    model TEXT NOT NULL,
    uid BIGINT NOT NULL,
    submitted_us BIGINT NOT NULL
);

-- A worker job whose GPU time was split among its callers, once (after it ended): its totals.
CREATE TABLE inference_jobs (
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    model TEXT NOT NULL,
    gpu_us BIGINT NOT NULL,
    shard_us BIGINT NOT NULL,
    busy_us BIGINT NOT NULL,
    calls BIGINT NOT NULL,
    computed_us BIGINT NOT NULL,
    PRIMARY KEY (node, job_id)
);

-- Each (user, app)'s share of a worker job; the shares of a job sum to its inference_jobs row.
CREATE TABLE inference_shares (
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    model TEXT NOT NULL,
    user_name TEXT NOT NULL,
    app TEXT NOT NULL,
    busy_us BIGINT NOT NULL,
    calls BIGINT NOT NULL,
    gpu_us BIGINT NOT NULL,
    shard_us BIGINT NOT NULL,
    PRIMARY KEY (node, job_id, user_name, app)
);
CREATE INDEX inference_shares_user ON inference_shares (user_name);
