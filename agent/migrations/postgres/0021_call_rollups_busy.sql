-- What the workers spent on each hour's calls, kept in the hourly rollup: a quota pass reads a
-- live worker job's callers from whole hours of call_rollups instead of every usage row of its
-- model (accounting::live_callers). busy_us is the sum, over the hour's rows, of latency_us -
-- overhead_us where that is positive (accounting::inference::callers_between reads the same from
-- the rows). max_latency_us is the hour's longest call: how far before a job's start the calls
-- that ran into it can have started (accounting::inference::earliest_start). A row waiting in
-- usage_rollup_pending brings its overhead_us to the fold.
--
-- No fold runs while the sums are filled in (the fold lock, store::gateway FOLD_LOCK).
SELECT pg_advisory_xact_lock(7453586474804576257);
ALTER TABLE call_rollups ADD COLUMN busy_us BIGINT NOT NULL DEFAULT 0;
ALTER TABLE call_rollups ADD COLUMN max_latency_us BIGINT NOT NULL DEFAULT 0;
ALTER TABLE usage_rollup_pending ADD COLUMN overhead_us BIGINT NOT NULL DEFAULT 0;
-- The rollups hold every stored row but those waiting in usage_rollup_pending, which came
-- without an overhead (0 above) and will add their whole latency when folded: it is taken off
-- here, so that each sum comes out exact once they are. An hour that only waiting rows have
-- reached gets its rollup row now (no calls yet: the fold adds them).
INSERT INTO call_rollups (hour_us, user_name, app, requested_name, resolved_model, calls, errors, prompt_tokens,
                          completion_tokens, latency_us_sum, busy_us, max_latency_us)
SELECT hour_us, user_name, app, requested_name, resolved_model, 0, 0, 0, 0, 0, SUM(busy_us), MAX(latency_us)
FROM (
    SELECT time_us - (time_us % 3600000000) AS hour_us, user_name, app, requested_name, resolved_model,
           CASE WHEN latency_us > overhead_us THEN latency_us - overhead_us ELSE 0 END AS busy_us, latency_us
    FROM usage_log
    UNION ALL
    SELECT time_us - (time_us % 3600000000), user_name, app, requested_name, resolved_model, -GREATEST(latency_us, 0), latency_us
    FROM usage_rollup_pending
) r
GROUP BY hour_us, user_name, app, requested_name, resolved_model
ON CONFLICT (hour_us, user_name, app, requested_name, resolved_model)
DO UPDATE SET busy_us = excluded.busy_us, max_latency_us = excluded.max_latency_us;
