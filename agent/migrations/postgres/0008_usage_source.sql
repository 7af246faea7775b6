-- Where a usage row's token counts came from (agent/src/gateway/usage_log.rs `UsageSource`):
-- 'reported' (the worker's usage), 'counted' (the gateway counted a stream's content deltas:
-- the worker reported none), 'tokenized' (counted, and the prompt counted by the worker's
-- tokenize endpoint), 'none' (no counts). '' marks rows written before this column existed.
ALTER TABLE usage_log ADD COLUMN usage_source TEXT NOT NULL DEFAULT '';
-- The LoRA adapter that served the call on `resolved_model`'s worker ('' if none).
ALTER TABLE usage_log ADD COLUMN adapter TEXT NOT NULL DEFAULT '';
