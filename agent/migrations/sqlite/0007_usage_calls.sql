-- Refusals of unauthenticated calls are kept as one row per peer and minute
-- (agent/src/gateway/refusals.rs), not one per request: `calls` is how many calls a row stands
-- for (1 for every ordinary call). Rollups add it instead of counting rows.
ALTER TABLE usage_log ADD COLUMN calls INTEGER NOT NULL DEFAULT 1;
