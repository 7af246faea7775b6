-- Replicas (more than one worker per model, spread over the nodes): one row per worker, so an
-- agent that restarts adopts every replica it started. Keyed (owner, model, instance_id).
ALTER TABLE model_workers DROP CONSTRAINT model_workers_pkey;
ALTER TABLE model_workers ADD PRIMARY KEY (owner, model, instance_id);
