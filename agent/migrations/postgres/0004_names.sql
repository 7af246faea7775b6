-- Names: the registry of name states and its history, role assignments, and the callers
-- rollup (who called which name), built from the gateway's usage log.

-- Names whose state differs from "served as the catalog says": deprecated, retired, or an
-- active alias added at run time (a restored name). Catalog names absent here are active.
CREATE TABLE names (
    name TEXT PRIMARY KEY,
    -- 'active' | 'deprecated' | 'retired'
    state TEXT NOT NULL,
    -- The name callers should use instead (deprecated, retired), or the model an active
    -- registry alias serves.
    replacement TEXT,
    -- When the name was renamed / deprecated (YYYY-MM-DD, UTC).
    since_date TEXT,
    -- When a deprecated name stops being served (YYYY-MM-DD, UTC).
    sunset_date TEXT,
    updated_us BIGINT NOT NULL,
    updated_by TEXT NOT NULL
);

-- Every change of a name or a role: who, when, from, to. Append-only.
CREATE TABLE name_history (
    id BIGSERIAL PRIMARY KEY,
    time_us BIGINT NOT NULL,
    actor TEXT NOT NULL,
    -- 'seed' | 'rename' | 'deprecate' | 'retire' | 'restore' | 'repoint' | 'role-set' | 'role-unset'
    action TEXT NOT NULL,
    -- The name (or, for role actions, the role) that changed.
    subject TEXT NOT NULL,
    from_state TEXT,
    to_state TEXT,
    from_target TEXT,
    to_target TEXT,
    sunset_date TEXT,
    note TEXT NOT NULL DEFAULT ''
);
CREATE INDEX name_history_subject ON name_history (subject, id);

-- Role -> model as changed at run time (`gpuhub roles set/unset`); '' = no model assigned.
-- Config `[roles]` seeds it; roles absent here take the catalog's value.
CREATE TABLE role_assignments (
    role TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    updated_us BIGINT NOT NULL,
    updated_by TEXT NOT NULL
);

-- The callers registry: calls per requested name and caller, in UTC-day buckets, so a
-- `--since 30d` query reads a few thousand rows however long the usage log is.
-- Text keys use '' for "none" (NULLs would defeat the primary key's upsert).
CREATE TABLE name_callers (
    name TEXT NOT NULL,
    day_us BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    app TEXT NOT NULL,
    job_id TEXT NOT NULL,
    client_addr TEXT NOT NULL,
    user_agent TEXT NOT NULL,
    calls BIGINT NOT NULL,
    -- Calls the name registry refused (retired, unknown, role without model).
    refused BIGINT NOT NULL,
    first_us BIGINT NOT NULL,
    last_us BIGINT NOT NULL,
    PRIMARY KEY (name, day_us, user_name, app, job_id, client_addr, user_agent)
);

-- Per-name totals (`gpuhub names list` shows the last call without scanning the rollup).
CREATE TABLE name_totals (
    name TEXT PRIMARY KEY,
    calls BIGINT NOT NULL,
    refused BIGINT NOT NULL,
    first_us BIGINT NOT NULL,
    last_us BIGINT NOT NULL
);
