-- The PostgreSQL store writes completion events to a log and delivers them
-- in batches bounded by transaction snapshots (see its migration). The
-- embedded store has one writer: its outbox table stays as it is.
SELECT 1;
