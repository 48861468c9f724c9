-- What the reconciler's last inconclusive probe said (see the PostgreSQL migration).
ALTER TABLE idemgate_records ADD COLUMN probe_last_answer TEXT;
