-- What the operator console's record page reads.
--
-- What the reconciler's last inconclusive probe of a record said ("probe GET
-- answered 503 (neither found nor absent)", "probe failed: ..."). Meaningful
-- only while probe_generation is the record's generation, like
-- probe_attempts. NULL before the first one.
ALTER TABLE idemgate_records ADD COLUMN probe_last_answer text;

-- The audit rows of one scope, newest first, without reading the whole trail
-- (it is never swept). The key leads, as in the records' primary key: it
-- decides almost every comparison.
CREATE INDEX idemgate_audit_scope ON idemgate_audit (idempotency_key, tenant, principal, operation, id);
