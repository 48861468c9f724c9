-- A relay behind its writers takes a lane's batch in several takes, and
-- each take after the first read the batch again from its start: the
-- lane's index (lane, xid) bounds a batch by its two snapshots, not by how
-- far it is delivered. Under sustained load this made every take read
-- hundreds of delivered events to find the next hundred.
--
-- From here on a batch also has an upper bound on `seq` (`upto_seq`): the
-- sequence's last value read after the batch's snapshot `upto` was taken.
-- Every event visible in `upto` committed before that snapshot, so it drew
-- its seq before it, and its seq is at most that value. A take after the
-- first one of a batch reads the range (`after_seq`, `upto_seq`] of a second
-- index, (lane, seq), and checks both snapshots as before; the first take
-- of a batch reads the batch by transaction, as before.
--
-- `upto_seq_of` is the text of the `upto` the bound belongs to: a bound is
-- used only while the lane's batch is that one (a relay of an earlier
-- version leases and ends batches without knowing of these columns).
--
-- Every seq is positive (the sequence starts at 1): the index's predicate
-- `seq > 0` holds for every event. It is there so that only the statements
-- whose conditions state it (the relay's take, and its settling's look-up
-- of the events it copies) read this index; the log's other statements
-- keep the index by transaction whatever the statistics say.
--
-- Building the index reads the log once under a lock that holds event
-- inserts (and so final states) back; on a large log run `idemgate
-- migrate` at a quiet time.
--
-- Appending an event also costs less: the statements of this version pass
-- the slot (read once per statement; the column's default calls a function
-- per row) and the event's id, computed by `idemgate_log_event_id(seq)`
-- from the writing transaction's id (its first 48 bits, as before, which
-- is how `events redeliver` finds it), the version 8, and the event's seq
-- (unique) instead of random bytes. Ids of events written before, and by
-- replicas of an earlier version (the column's default), keep their form.
DO $migration$
BEGIN
-- Nothing on a Citus store: `idemgate migrate` says which kind it migrates
-- for (`idemgate.store_kind`). A PostgreSQL store on a database that merely
-- has the extension (Citus's Docker image creates it in its default
-- database) gets the log. Without the setting (the file applied by hand), the extension decides.
IF coalesce(current_setting('idemgate.store_kind', true), '') = 'citus'
   OR (coalesce(current_setting('idemgate.store_kind', true), '') = ''
       AND EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')) THEN
    RETURN;
END IF;
ALTER TABLE idemgate_event_lanes ADD COLUMN upto_seq bigint, ADD COLUMN upto_seq_of text;
CREATE INDEX idemgate_event_log_lane_seq ON idemgate_event_log (lane, seq) WHERE seq > 0;
CREATE FUNCTION idemgate_log_event_id(seq bigint) RETURNS uuid LANGUAGE sql VOLATILE
    AS $fn$ SELECT (lpad(to_hex(pg_current_xact_id()::text::int8 & x'ffffffffffff'::int8), 12, '0') || '8000'
                    || lpad(to_hex(seq | x'8000000000000000'::int8), 16, '0'))::uuid $fn$;
END
$migration$;
