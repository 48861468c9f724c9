-- What bounds an async attempt's time at the upstream (see the PostgreSQL
-- migration): the send's time plus the timeout it was sent with, in
-- microseconds since the epoch like every time here.
ALTER TABLE idemgate_records ADD COLUMN at_upstream_until INTEGER;
