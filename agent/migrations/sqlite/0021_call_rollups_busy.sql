-- What the workers spent on each hour's calls, kept in the hourly rollup: a quota pass reads a
-- live worker job's callers from whole hours of call_rollups instead of every usage row of its
-- model (accounting::live_callers). busy_us is the sum, over the hour's rows, of latency_us -
-- overhead_us where that is positive (accounting::inference::callers_between reads the same from
-- the rows). max_latency_us is the hour's longest call: how far before a job's start the calls
-- that ran into it can have started (accounting::inference::earliest_start). Every stored row is
-- in the rollups already (a batch adds them in its transaction).
ALTER TABLE call_rollups ADD COLUMN busy_us INTEGER NOT NULL DEFAULT 0;
ALTER TABLE call_rollups ADD COLUMN max_latency_us INTEGER NOT NULL DEFAULT 0;
UPDATE call_rollups SET busy_us = s.busy_us, max_latency_us = s.max_latency_us
FROM (
    SELECT time_us - (time_us % 3600000000) AS hour_us, user_name, app, requested_name, resolved_model,
           SUM(CASE WHEN latency_us > overhead_us THEN latency_us - overhead_us ELSE 0 END) AS busy_us,
           MAX(latency_us) AS max_latency_us
    FROM usage_log
    GROUP BY 1, 2, 3, 4, 5
) AS s
WHERE call_rollups.hour_us = s.hour_us AND call_rollups.user_name = s.user_name AND call_rollups.app = s.app
  AND call_rollups.requested_name = s.requested_name AND call_rollups.resolved_model = s.resolved_model;
