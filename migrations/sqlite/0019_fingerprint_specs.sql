-- The fingerprint settings each operation has had (see the PostgreSQL
-- migration): a mismatch is also compared under them.
CREATE TABLE idemgate_fingerprint_specs (
    operation     TEXT    NOT NULL,
    spec          TEXT    NOT NULL,
    registered_at INTEGER NOT NULL,
    PRIMARY KEY (operation, spec)
);
