-- GPU use reported to MLflow runs (agent/src/mlflow_runs). Times: Unix microseconds.

-- One row per ended job whose measured GPU use was (or is to be) logged as metrics of the
-- MLflow runs tagged with its slurm.job_id. `state`: pending (retried at next_try_us), done,
-- gave_up (MLflow stayed unreachable for every bounded retry; the figures stay in
-- acct_job_gpus and `gpuhub job`).
CREATE TABLE mlflow_job_reports (
    node TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_try_us INTEGER NOT NULL,
    runs INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    updated_us INTEGER NOT NULL,
    PRIMARY KEY (node, job_id)
);
