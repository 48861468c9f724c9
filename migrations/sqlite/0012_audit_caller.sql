-- Who made a change through the admin API (see the PostgreSQL migration).
ALTER TABLE idemgate_audit ADD COLUMN peer TEXT;
ALTER TABLE idemgate_audit ADD COLUMN token_label TEXT;
