-- A job Slurm requeues runs again under the same id, on the same node or another
-- (`scontrol requeue`, a node failure, preemption with requeue): each run is billed. `run`
-- numbers a job's runs on one node in the order they started, from 0; rows from before this
-- migration are run 0. Every run is its own row, so sums over rows count every run.
ALTER TABLE acct_jobs ADD COLUMN run BIGINT NOT NULL DEFAULT 0;
ALTER TABLE acct_jobs DROP CONSTRAINT acct_jobs_pkey;
ALTER TABLE acct_jobs ADD PRIMARY KEY (node, job_id, run);
ALTER TABLE acct_job_gpus ADD COLUMN run BIGINT NOT NULL DEFAULT 0;
ALTER TABLE acct_job_gpus DROP CONSTRAINT acct_job_gpus_pkey;
ALTER TABLE acct_job_gpus ADD PRIMARY KEY (node, job_id, run, gpu_index);
