-- Scopes compare byte for byte (COLLATE "C"). Tenants, principals, operations
-- and keys are identifiers: equality was already byte equality under any
-- deterministic collation, but every primary-key comparison went through the
-- database's collation (strcoll under en_US.UTF-8 or C.UTF-8), about a fifth
-- of PostgreSQL's CPU on first writes. Only the order of listings changes,
-- to byte order. Changing a collation keeps the table's rows (text is text)
-- and rebuilds the indexes on these columns, under an exclusive lock: on a
-- large table, run `idemgate migrate` before the new replicas start.
ALTER TABLE idemgate_records
    ALTER COLUMN tenant TYPE text COLLATE "C",
    ALTER COLUMN principal TYPE text COLLATE "C",
    ALTER COLUMN operation TYPE text COLLATE "C",
    ALTER COLUMN idempotency_key TYPE text COLLATE "C";
-- The outbox's per-scope index is compared with records' scopes.
ALTER TABLE idemgate_events
    ALTER COLUMN tenant TYPE text COLLATE "C",
    ALTER COLUMN principal TYPE text COLLATE "C",
    ALTER COLUMN operation TYPE text COLLATE "C",
    ALTER COLUMN idempotency_key TYPE text COLLATE "C";
