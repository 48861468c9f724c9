-- Async operations: see the PostgreSQL migration. SQLite cannot change a CHECK
-- constraint in place, so the table is rebuilt with the new states and columns.
CREATE TABLE idemgate_records_new (
    tenant            TEXT    NOT NULL,
    principal         TEXT    NOT NULL,
    operation         TEXT    NOT NULL,
    idempotency_key   TEXT    NOT NULL,
    request_hash      BLOB    NOT NULL,
    state             TEXT    NOT NULL
        CHECK (state IN ('in_flight', 'completed', 'unknown', 'queued', 'processing', 'failed_retryable')),
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
    operation_id      TEXT,
    request           BLOB,
    attempts          INTEGER NOT NULL DEFAULT 0,
    next_attempt_at   INTEGER,
    sent_at           INTEGER,
    last_status       INTEGER,
    maybe_executed    INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, principal, operation, idempotency_key)
) WITHOUT ROWID;
INSERT INTO idemgate_records_new
    (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at)
SELECT tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
       lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at
FROM idemgate_records;
DROP TABLE idemgate_records;
ALTER TABLE idemgate_records_new RENAME TO idemgate_records;

CREATE INDEX idemgate_records_sweep ON idemgate_records (expires_at) WHERE state IN ('completed', 'failed_retryable');
CREATE INDEX idemgate_records_open ON idemgate_records (state, lease_expires_at) WHERE state <> 'completed';
CREATE UNIQUE INDEX idemgate_records_operation_id ON idemgate_records (tenant, operation_id) WHERE operation_id IS NOT NULL;
CREATE INDEX idemgate_records_queue ON idemgate_records (next_attempt_at) WHERE state = 'queued';
