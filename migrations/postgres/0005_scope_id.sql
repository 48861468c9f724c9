-- The scope id that logs print (the first 8 bytes of a SHA-256 over the
-- scope, as a signed 64-bit integer), so `idemgate keys show --scope-id`
-- finds the record a log line is about. Every claim writes it; records
-- claimed before this migration keep NULL (no table rewrite at upgrade) and
-- are found through the partial index below, which new records never enter.
ALTER TABLE idemgate_records ADD COLUMN scope_id bigint;
CREATE INDEX idemgate_records_scope_id ON idemgate_records (scope_id);
CREATE INDEX idemgate_records_no_scope_id ON idemgate_records (tenant, principal, operation, idempotency_key) WHERE scope_id IS NULL;
