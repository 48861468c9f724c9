-- What bounds an async attempt's time at the upstream: set together with
-- sent_at, to the send's time plus the whole-response timeout the attempt
-- was sent with (the latest of those of this record's attempts). The
-- reconciler probes an unknown record only after it (plus settle), whatever
-- its own replica's timeout. NULL on rows sent before this column existed
-- (and on synchronous records, whose claim's lease bounds them): see the
-- reconciler's take for what bounds those.
ALTER TABLE idemgate_records ADD COLUMN at_upstream_until timestamptz;
