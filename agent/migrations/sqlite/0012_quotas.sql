-- GPU-hour quotas (agent/src/quota, docs/quotas.md). Times: Unix microseconds; amounts:
-- GPU-equivalent microseconds (1 GPU-hour = 3,600,000,000).

-- An admin's limit for a target (`gpuhub quota set`), in place of agent.toml's gpu_hours.
-- target: `user:NAME`, `account:NAME`, `group:NAME`.
CREATE TABLE quota_limits (
    target TEXT PRIMARY KEY,
    limit_us INTEGER NOT NULL,
    set_by TEXT NOT NULL,
    set_us INTEGER NOT NULL
);

-- Top-ups (`gpuhub quota grant`): extra GPU-hours for a target until the period that was
-- current when they were granted ends (expires_us).
CREATE TABLE quota_topups (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    target TEXT NOT NULL,
    amount_us INTEGER NOT NULL,
    granted_by TEXT NOT NULL,
    reason TEXT NOT NULL,
    granted_us INTEGER NOT NULL,
    expires_us INTEGER NOT NULL
);
CREATE INDEX quota_topups_target ON quota_topups (target, expires_us);

-- Slurm associations the agent holds (GrpTRES gres/gpu=0,gres/shard=0) because of a quota:
-- kind `user` or `account`, the quota that holds it. Kept so that after a restart, or when a
-- quota leaves agent.toml, the agent releases exactly the associations it held.
CREATE TABLE quota_holds (
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    quota TEXT NOT NULL,
    held_us INTEGER NOT NULL,
    PRIMARY KEY (kind, name)
);
