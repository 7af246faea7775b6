-- Promotions through gpuhub's gate (`gpuhub models promote`, agent/src/models/gate.rs): the
-- version gpuhub serves is the model's latest row here, not whatever MLflow's @production says
-- (MLflow has no login: anyone can move an alias). Times: Unix microseconds.
CREATE TABLE model_promotions (
    id BIGSERIAL PRIMARY KEY,
    -- The MLflow registered model.
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    -- The version served before (gpuhub's last promotion, else @production); NULL: none.
    previous_version TEXT,
    -- The gate: metric, the version's value, the previous version's, the threshold.
    metric TEXT,
    value DOUBLE PRECISION,
    previous_value DOUBLE PRECISION,
    threshold DOUBLE PRECISION,
    -- 1: promoted with --force past a failed gate.
    forced BIGINT NOT NULL,
    -- The admin who promoted: the control socket's peer uid (never a value the caller set).
    uid BIGINT NOT NULL,
    user_name TEXT NOT NULL,
    at_us BIGINT NOT NULL
);
CREATE INDEX model_promotions_model ON model_promotions (model, id);
