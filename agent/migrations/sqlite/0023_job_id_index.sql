-- Lookups by job id alone (a job token's "has this job ended?", once a second per job and
-- gateway; `gpuhub job`; reconciliation's known jobs) read one index instead of the table:
-- the primary key (node, job_id, run) starts with the node.
CREATE INDEX acct_jobs_job ON acct_jobs (job_id);
