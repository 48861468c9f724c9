-- Generations grow across every life of a scope (see the PostgreSQL
-- migration): one counter, advanced in the same transaction as each claim,
-- take-over and operator resolution.
CREATE TABLE idemgate_sequences (
    name   TEXT    PRIMARY KEY,
    value  INTEGER NOT NULL
);
INSERT INTO idemgate_sequences (name, value)
    VALUES ('generation', coalesce((SELECT max(generation) FROM idemgate_records), 0));

CREATE TABLE idemgate_settings (
    name        TEXT    PRIMARY KEY,
    value       BLOB    NOT NULL,
    created_at  INTEGER NOT NULL
);

CREATE TABLE idemgate_audit (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    at               INTEGER NOT NULL,
    actor            TEXT    NOT NULL,
    tenant           TEXT    NOT NULL,
    principal        TEXT    NOT NULL,
    operation        TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    from_state       TEXT    NOT NULL,
    to_state         TEXT    NOT NULL,
    reason           TEXT    NOT NULL,
    forced           INTEGER NOT NULL DEFAULT 0,
    generation       INTEGER
);
