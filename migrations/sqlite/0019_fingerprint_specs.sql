-- The fingerprint settings a record's hash was computed under, and the
-- settings each operation has had (see the PostgreSQL migration).
ALTER TABLE idemgate_records ADD COLUMN fingerprint_spec TEXT;
CREATE TABLE idemgate_fingerprint_specs (
    operation     TEXT    NOT NULL,
    spec          TEXT    NOT NULL,
    registered_at INTEGER NOT NULL,
    PRIMARY KEY (operation, spec)
);
