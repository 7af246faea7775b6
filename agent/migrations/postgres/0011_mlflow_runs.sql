-- GPU use reported to MLflow runs (agent/src/mlflow_runs). Times: Unix microseconds.

-- One row per ended job whose measured GPU use was (or is to be) logged as metrics of the
-- MLflow runs tagged with its slurm.job_id. `state`: pending (retried at next_try_us), done,
-- gave_up (MLflow stayed unreachable for every bounded retry; the figures stay in
-- acct_job_gpus and `gpuhub job`).
CREATE TABLE mlflow_job_reports (
    node TEXT NOT NULL,
    job_id BIGINT NOT NULL,
    state TEXT NOT NULL,
    attempts BIGINT NOT NULL,
    next_try_us BIGINT NOT NULL,
    runs BIGINT NOT NULL DEFAULT 0,
    last_error TEXT,
    updated_us BIGINT NOT NULL,
    PRIMARY KEY (node, job_id)
);
