-- A job Slurm requeues runs again under the same id, on the same node or another
-- (`scontrol requeue`, a node failure, preemption with requeue): each run is billed. `run`
-- numbers a job's runs on one node in the order they started, from 0; rows from before this
-- migration are run 0. Every run is its own row, so sums over rows count every run.
CREATE TABLE acct_jobs_runs (
    node TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    run INTEGER NOT NULL DEFAULT 0,
    uid INTEGER NOT NULL,
    user_name TEXT NOT NULL,
    account TEXT,
    partition TEXT,
    start_us INTEGER,
    end_us INTEGER,
    first_seen_us INTEGER NOT NULL,
    last_seen_us INTEGER NOT NULL,
    exit_code INTEGER,
    end_reason TEXT,
    shards INTEGER NOT NULL DEFAULT 0,
    anomalies TEXT NOT NULL DEFAULT '',
    verified TEXT NOT NULL DEFAULT '',
    slurm_gpus INTEGER,
    slurm_start_us INTEGER,
    slurm_end_us INTEGER,
    PRIMARY KEY (node, job_id, run)
);
INSERT INTO acct_jobs_runs (node, job_id, run, uid, user_name, account, partition, start_us, end_us, first_seen_us, last_seen_us,
        exit_code, end_reason, shards, anomalies, verified, slurm_gpus, slurm_start_us, slurm_end_us)
    SELECT node, job_id, 0, uid, user_name, account, partition, start_us, end_us, first_seen_us, last_seen_us,
        exit_code, end_reason, shards, anomalies, verified, slurm_gpus, slurm_start_us, slurm_end_us FROM acct_jobs;
DROP TABLE acct_jobs;
ALTER TABLE acct_jobs_runs RENAME TO acct_jobs;
CREATE INDEX acct_jobs_end ON acct_jobs (end_us);
CREATE INDEX acct_jobs_user ON acct_jobs (user_name);

CREATE TABLE acct_job_gpus_runs (
    node TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    run INTEGER NOT NULL DEFAULT 0,
    gpu_index INTEGER NOT NULL,
    gpu_uuid TEXT,
    mean_util REAL,
    peak_vram_bytes INTEGER,
    energy_joules REAL,
    samples INTEGER,
    shards INTEGER,
    PRIMARY KEY (node, job_id, run, gpu_index)
);
INSERT INTO acct_job_gpus_runs (node, job_id, run, gpu_index, gpu_uuid, mean_util, peak_vram_bytes, energy_joules, samples, shards)
    SELECT node, job_id, 0, gpu_index, gpu_uuid, mean_util, peak_vram_bytes, energy_joules, samples, shards FROM acct_job_gpus;
DROP TABLE acct_job_gpus;
ALTER TABLE acct_job_gpus_runs RENAME TO acct_job_gpus;
