-- Fair use of the gateway (agent/src/gateway/fair_use.rs).
-- An API key's own limits: requests per minute and tokens per UTC day (NULL: only its user's
-- limits from agent.toml [gateway.limits] apply).
ALTER TABLE api_keys ADD COLUMN rpm BIGINT;
ALTER TABLE api_keys ADD COLUMN tokens_per_day BIGINT;
-- The API key a call came with ('' for job tokens, the SSO header and refusals), so that a
-- key's tokens of the day and its calls of the last minute are reloaded at start.
ALTER TABLE usage_log ADD COLUMN key_id TEXT NOT NULL DEFAULT '';
