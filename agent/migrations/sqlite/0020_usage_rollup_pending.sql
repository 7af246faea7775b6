-- PostgreSQL only (usage_rollup_pending: a batch's rows wait there for the rollups). SQLite's
-- usage writer adds each batch to the rollups in the batch's own transaction, as before; this
-- file keeps the two backends' migration numbers in step.
SELECT 1;
