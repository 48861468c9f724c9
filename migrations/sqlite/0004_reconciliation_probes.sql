-- Reconciliation probes: see the PostgreSQL migration.
ALTER TABLE idemgate_records ADD COLUMN probe_generation INTEGER;
ALTER TABLE idemgate_records ADD COLUMN probe_attempts INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idemgate_records ADD COLUMN next_probe_at INTEGER;
ALTER TABLE idemgate_records ADD COLUMN probe_token BLOB;
ALTER TABLE idemgate_records ADD COLUMN probe_until INTEGER;
