-- idemgate records: one row per scope (tenant, principal, operation, key).
-- Times that decide (lease expiry, retention) are this database's clock.
CREATE TABLE idemgate_records (
    tenant            text        NOT NULL,
    principal         text        NOT NULL,
    operation         text        NOT NULL,
    idempotency_key   text        NOT NULL,
    request_hash      bytea       NOT NULL,
    -- in_flight | completed | unknown; async mode will add queued and
    -- failed_retryable, so the check is a list rather than a type.
    state             text        NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    -- Fencing token: grows with every claim or take-over of the scope.
    generation        bigint      NOT NULL,
    -- Fresh per claim; read back after an ambiguous commit.
    claim_token       uuid        NOT NULL,
    owner             text        NOT NULL,
    lease_expires_at  timestamptz,
    response_status   integer,
    response_headers  bytea,
    -- NULL with a status: the body exceeded max_stored_response.
    response_body     bytea,
    created_at        timestamptz NOT NULL,
    updated_at        timestamptz NOT NULL,
    -- For completed records: replayed until then, swept afterwards.
    expires_at        timestamptz NOT NULL,
    PRIMARY KEY (tenant, principal, operation, idempotency_key)
);

-- The sweeper's scan: completed records by expiry.
CREATE INDEX idemgate_records_sweep ON idemgate_records (expires_at) WHERE state = 'completed';
-- The lease reaper's scan and `keys list --state in_flight|unknown`.
CREATE INDEX idemgate_records_open ON idemgate_records (state, lease_expires_at) WHERE state <> 'completed';
