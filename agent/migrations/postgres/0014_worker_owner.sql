-- Several agents on one store (more than one GPU node): each worker row names the agent that
-- started it and manages it (`owner`: its Slurm node name, telemetry.slurm_node_name). An agent
-- adopts, stops and forgets only its own rows, and never cancels a job another agent owns.
-- One row per (owner, model). Rows from before this migration have owner '' and are adopted by
-- the first agent that starts (the one-node setup they come from).
ALTER TABLE model_workers ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE model_workers DROP CONSTRAINT model_workers_pkey;
ALTER TABLE model_workers ADD PRIMARY KEY (owner, model);
CREATE INDEX model_workers_instance ON model_workers (launcher, instance_id);
