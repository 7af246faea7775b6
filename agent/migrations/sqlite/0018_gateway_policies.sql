-- Several gateways on one store: each publishes the settings every gateway must share
-- ([gateway.limits], [gateway.user_models], gateway.keys_per_user; agent/src/gateway/policy.rs),
-- so that a gateway node whose agent.toml differs is logged and shown by `gpuhub doctor`.
-- One row per gateway node; policy is JSON; updated_us is refreshed about every 30 s.
CREATE TABLE gateway_policies (
    gateway TEXT PRIMARY KEY,
    policy TEXT NOT NULL,
    updated_us BIGINT NOT NULL
);
