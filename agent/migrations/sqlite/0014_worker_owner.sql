-- Several agents on one store (more than one GPU node): each worker row names the agent that
-- started it and manages it (`owner`: its Slurm node name, telemetry.slurm_node_name). An agent
-- adopts, stops and forgets only its own rows, and never cancels a job another agent owns.
-- One row per (owner, model). Rows from before this migration have owner '' and are adopted by
-- the first agent that starts (the one-node setup they come from).
CREATE TABLE model_workers_owned (
    owner TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL,
    launcher TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    base_url TEXT NOT NULL,
    api_key TEXT NOT NULL,
    version TEXT,
    log_path TEXT NOT NULL,
    started_us INTEGER NOT NULL,
    PRIMARY KEY (owner, model)
);
INSERT INTO model_workers_owned (owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us)
    SELECT '', model, launcher, instance_id, base_url, api_key, version, log_path, started_us FROM model_workers;
DROP TABLE model_workers;
ALTER TABLE model_workers_owned RENAME TO model_workers;
CREATE INDEX model_workers_instance ON model_workers (launcher, instance_id);
