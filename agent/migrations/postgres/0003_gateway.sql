-- Gateway: API keys (hashes only), the per-call usage log, and hourly call rollups.

-- An API key names a user and an app. Only the SHA-256 of the key is stored; `prefix` is
-- its first characters, shown by `gpuhub keys list` so people can tell keys apart.
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    prefix TEXT NOT NULL,
    user_name TEXT NOT NULL,
    app TEXT NOT NULL,
    -- Comma-separated model names this key may use; '' = every model.
    models TEXT NOT NULL DEFAULT '',
    created_us BIGINT NOT NULL,
    created_by TEXT NOT NULL,
    revoked_us BIGINT
);
CREATE INDEX api_keys_user_app ON api_keys (user_name, app);

-- One row per call, success or failure. `request_id` is unique so that replaying the
-- on-disk journal after a crash inserts each call exactly once.
CREATE TABLE usage_log (
    request_id TEXT PRIMARY KEY,
    time_us BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    app TEXT NOT NULL,
    job_id BIGINT,
    client_addr TEXT NOT NULL,
    user_agent TEXT NOT NULL,
    requested_name TEXT NOT NULL,
    resolved_model TEXT NOT NULL,
    model_version TEXT NOT NULL,
    name_state TEXT NOT NULL,
    route TEXT NOT NULL,
    status BIGINT NOT NULL,
    error_code TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    streamed BIGINT NOT NULL,
    latency_us BIGINT NOT NULL,
    upstream_ttfb_us BIGINT NOT NULL,
    overhead_us BIGINT NOT NULL
);
CREATE INDEX usage_log_time ON usage_log (time_us);
CREATE INDEX usage_log_name_time ON usage_log (requested_name, time_us);

-- Hourly rollup that `gpuhub usage --calls` reads (never the raw log).
CREATE TABLE call_rollups (
    hour_us BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    app TEXT NOT NULL,
    requested_name TEXT NOT NULL,
    resolved_model TEXT NOT NULL,
    calls BIGINT NOT NULL,
    errors BIGINT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    latency_us_sum BIGINT NOT NULL,
    PRIMARY KEY (hour_us, user_name, app, requested_name, resolved_model)
);
CREATE INDEX call_rollups_user_hour ON call_rollups (user_name, hour_us);
