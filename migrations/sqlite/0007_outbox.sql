-- The outbox (see the PostgreSQL migration). Times are microseconds since the
-- Unix epoch; event_id is 16 bytes.
CREATE TABLE idemgate_events (
    seq              INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id         BLOB    NOT NULL,
    event_type       TEXT    NOT NULL CHECK (event_type IN ('completed', 'unknown', 'failed_retryable', 'released')),
    tenant           TEXT    NOT NULL,
    principal        TEXT    NOT NULL,
    operation        TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    generation       INTEGER,
    status           INTEGER,
    operation_id     TEXT,
    actor            TEXT,
    at               INTEGER NOT NULL,
    body             BLOB,
    delivery         TEXT    NOT NULL DEFAULT 'pending' CHECK (delivery IN ('pending', 'sent', 'parked')),
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  INTEGER NOT NULL,
    lease_token      BLOB,
    lease_until      INTEGER,
    last_error       TEXT,
    sent_at          INTEGER
);
CREATE UNIQUE INDEX idemgate_events_event_id ON idemgate_events (event_id);
CREATE INDEX idemgate_events_pending ON idemgate_events (next_attempt_at) WHERE delivery = 'pending';
CREATE INDEX idemgate_events_scope ON idemgate_events (tenant, principal, operation, idempotency_key, seq) WHERE delivery = 'pending';
CREATE INDEX idemgate_events_sent ON idemgate_events (sent_at) WHERE delivery = 'sent';
