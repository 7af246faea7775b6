-- Model worker jobs the agent started, so a restarted agent adopts them instead of starting
-- a duplicate (and cancels what it cannot adopt). One row per model with a live worker.
CREATE TABLE model_workers (
    model TEXT PRIMARY KEY,
    launcher TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    base_url TEXT NOT NULL,
    -- The per-worker key the agent generated; the store is readable by root only.
    api_key TEXT NOT NULL,
    version TEXT,
    log_path TEXT NOT NULL,
    started_us BIGINT NOT NULL
);
