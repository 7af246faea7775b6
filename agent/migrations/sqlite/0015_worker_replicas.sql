-- Replicas (more than one worker per model, spread over the nodes): one row per worker, so an
-- agent that restarts adopts every replica it started. Keyed (owner, model, instance_id).
CREATE TABLE model_workers_replicas (
    owner TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL,
    launcher TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    base_url TEXT NOT NULL,
    api_key TEXT NOT NULL,
    version TEXT,
    log_path TEXT NOT NULL,
    started_us INTEGER NOT NULL,
    PRIMARY KEY (owner, model, instance_id)
);
INSERT INTO model_workers_replicas (owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us)
    SELECT owner, model, launcher, instance_id, base_url, api_key, version, log_path, started_us FROM model_workers;
DROP TABLE model_workers;
ALTER TABLE model_workers_replicas RENAME TO model_workers;
CREATE INDEX model_workers_instance ON model_workers (launcher, instance_id);
