-- What the operator console's record page reads (see the PostgreSQL migration):
-- the last inconclusive probe's answer, and the audit rows of one scope.
ALTER TABLE idemgate_records ADD COLUMN probe_last_answer TEXT;
CREATE INDEX idemgate_audit_scope ON idemgate_audit (idempotency_key, tenant, principal, operation, id);
