-- Indexes for the statements that had none (issue #9: every statement uses
-- the primary key or an index of its own, whatever the statistics), and the
-- replay cache's hold.
--
-- `keys list` and GET /admin/records without a filter: records newest first.
CREATE INDEX idemgate_records_recent ON idemgate_records (updated_at);
-- The event stats' count of parked events (pending ones have their index).
CREATE INDEX idemgate_events_parked ON idemgate_events (seq) WHERE delivery = 'parked';
-- Replicas keep completed records they read for a second (the replay
-- cache). A resolution of a completed record first sets this, so that no
-- replica caches the record from then on, and changes it only once every
-- entry taken before has run out. Not indexed: setting it is a HOT update.
ALTER TABLE idemgate_records ADD COLUMN cache_hold_until timestamptz;
