-- Accounting reconciled with Slurm (agent/src/accounting/reconcile.rs). Times: Unix microseconds.

-- Where the job's billed allocation came from: '' (not asked yet), 'slurmctld', 'sacct', or
-- 'unverified' (Slurm knew nothing; the records' values stand).
ALTER TABLE acct_jobs ADD COLUMN verified TEXT NOT NULL DEFAULT '';
-- Whole GPUs Slurm allocated on this node (NULL: not verified; then the GPU rows count).
ALTER TABLE acct_jobs ADD COLUMN slurm_gpus INTEGER;
-- Slurm's start and end of the job (whole seconds), the bounds a record's time must lie in.
ALTER TABLE acct_jobs ADD COLUMN slurm_start_us INTEGER;
ALTER TABLE acct_jobs ADD COLUMN slurm_end_us INTEGER;
-- Shards the job holds on this GPU (NULL: unknown or a whole GPU).
ALTER TABLE acct_job_gpus ADD COLUMN shards INTEGER;

-- What a record claimed that Slurm's allocation contradicts, once per job and field.
CREATE TABLE acct_disagreements (
    node TEXT NOT NULL,
    job_id INTEGER NOT NULL,
    field TEXT NOT NULL,
    claimed TEXT NOT NULL,
    slurm TEXT NOT NULL,
    used TEXT NOT NULL,
    source TEXT NOT NULL,
    detected_us INTEGER NOT NULL,
    PRIMARY KEY (node, job_id, field)
);
