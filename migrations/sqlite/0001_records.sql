-- idemgate records on the embedded store; same columns and meaning as the
-- PostgreSQL schema. Times are integer microseconds since the Unix epoch.
CREATE TABLE idemgate_records (
    tenant            TEXT    NOT NULL,
    principal         TEXT    NOT NULL,
    operation         TEXT    NOT NULL,
    idempotency_key   TEXT    NOT NULL,
    request_hash      BLOB    NOT NULL,
    state             TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    generation        INTEGER NOT NULL,
    claim_token       BLOB    NOT NULL,
    owner             TEXT    NOT NULL,
    lease_expires_at  INTEGER,
    response_status   INTEGER,
    response_headers  BLOB,
    response_body     BLOB,
    created_at        INTEGER NOT NULL,
    updated_at        INTEGER NOT NULL,
    expires_at        INTEGER NOT NULL,
    PRIMARY KEY (tenant, principal, operation, idempotency_key)
) WITHOUT ROWID;

CREATE INDEX idemgate_records_sweep ON idemgate_records (expires_at) WHERE state = 'completed';
CREATE INDEX idemgate_records_open ON idemgate_records (state, lease_expires_at) WHERE state <> 'completed';
