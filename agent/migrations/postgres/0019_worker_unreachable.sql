-- Several gateways on one store: a gateway that routed to another agent's worker and found its
-- server gone while its job ran on (the port closed: a wrapper that outlives its server) records
-- when, so that the owner checks the worker itself and stops its job, instead of holding its GPU
-- until the idle timeout (models::single_flight, cluster_sync). 0: nothing reported.
ALTER TABLE worker_use ADD COLUMN unreachable_us BIGINT NOT NULL DEFAULT 0;
