-- Kept in step with the PostgreSQL migration of the same number: the parked
-- events' index and the replay cache's hold column (unused here: the
-- embedded store has no replay cache). The PostgreSQL index of records by
-- updated_at is left out: the embedded store's listing is unchanged and its
-- writes keep their cost.
CREATE INDEX idemgate_events_parked ON idemgate_events (seq) WHERE delivery = 'parked';
ALTER TABLE idemgate_records ADD COLUMN cache_hold_until INTEGER;
