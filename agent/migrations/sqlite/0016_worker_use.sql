-- Several gateways on one store: a gateway that routes calls to a worker another agent owns
-- records when it last used it, so the owner's idle unload sees calls that went through the
-- other gateway (models::single_flight). One row per worker instance (launcher, instance id).
CREATE TABLE worker_use (
    launcher TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    last_used_us INTEGER NOT NULL,
    PRIMARY KEY (launcher, instance_id)
);
