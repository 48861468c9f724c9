-- The scope id that logs print: see the PostgreSQL migration.
ALTER TABLE idemgate_records ADD COLUMN scope_id INTEGER;
CREATE INDEX idemgate_records_scope_id ON idemgate_records (scope_id);
CREATE INDEX idemgate_records_no_scope_id ON idemgate_records (tenant, principal, operation, idempotency_key) WHERE scope_id IS NULL;
