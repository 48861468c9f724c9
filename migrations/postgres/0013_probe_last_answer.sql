-- What the reconciler's last inconclusive probe of a record said ("probe GET
-- answered 503 (neither found nor absent)", "probe failed: ..."), for the
-- operator console's record page. Meaningful only while probe_generation is
-- the record's generation, like probe_attempts. NULL before the first one.
ALTER TABLE idemgate_records ADD COLUMN probe_last_answer text;
