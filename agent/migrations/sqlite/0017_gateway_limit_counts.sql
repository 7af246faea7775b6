-- Several gateways on one store: each publishes what [gateway.limits] and the keys' own limits
-- count at it (agent/src/gateway/fair_use.rs), so that a user's and a key's requests per minute
-- and tokens per day are counted across every gateway (cluster_sync reads the others' rows).
-- One row per (gateway node, UTC day, subject): kind 'user' or 'key', who the user name or the
-- key id; tokens and calls admitted that day at that gateway.
CREATE TABLE gateway_limit_counts (
    gateway TEXT NOT NULL,
    day_us INTEGER NOT NULL,
    kind TEXT NOT NULL,
    who TEXT NOT NULL,
    tokens INTEGER NOT NULL,
    calls INTEGER NOT NULL,
    updated_us INTEGER NOT NULL,
    PRIMARY KEY (gateway, day_us, kind, who)
);
CREATE INDEX gateway_limit_counts_day ON gateway_limit_counts (day_us);
