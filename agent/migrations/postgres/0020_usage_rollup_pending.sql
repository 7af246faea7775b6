-- PostgreSQL: usage rows stored but not yet added to the rollups (call_rollups, name_callers,
-- name_totals). A usage batch copies the rollup columns of the rows it inserted here, in the
-- same statement (a heap insert, no index), instead of upserting the same few rollup rows on
-- every batch (every 10 ms under load); the usage writer folds them in about once a second,
-- and every reader of a rollup folds them in first, so reads stay exact. A fold deletes what it
-- adds (DELETE ... RETURNING feeding the upserts, one statement under an advisory lock), so a
-- row is counted once, whichever agent folds it (store::gateway, Store::fold_rollups).
CREATE TABLE usage_rollup_pending AS
    SELECT time_us, user_name, app, requested_name, resolved_model, calls, status, prompt_tokens,
           completion_tokens, latency_us, job_id, client_addr, user_agent, name_state
    FROM usage_log WITH NO DATA;
-- Rows logged before this migration are in the rollups already.
