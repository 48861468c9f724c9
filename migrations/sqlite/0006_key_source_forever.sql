-- Legacy clients and durable business identity: see the PostgreSQL migration.
-- Records kept forever have expires_at = 9223372036854775807 (the largest
-- integer), later than any clock.
ALTER TABLE idemgate_records ADD COLUMN key_source TEXT;
CREATE INDEX idemgate_records_forever ON idemgate_records (operation) WHERE expires_at = 9223372036854775807;
