-- A batch's first take read the whole batch. It starts at `done` (every
-- event whose transaction is visible in that snapshot is delivered), and
-- the events after it were found by transaction (the lane's index by xid)
-- and sorted by seq to take the first ones: every row of the batch was read
-- to take a few hundred. A relay far behind its writers (millions of
-- events in a lane) spent seconds on that read, longer than a statement may
-- run, and took the same batch again and again without ever getting past it.
--
-- From here on a lane also keeps, for its `done` snapshot, a floor on seq
-- (`done_floor`) and a bound on transaction ids (`done_xid`): the batch's
-- bound on seq (`upto_seq`, the sequence's value read by the take that
-- started the batch), and the id of the transaction that leased the batch,
-- drawn after that take. An undelivered event at or below the floor was written
-- by a transaction that drew its seq before the floor was read, so it had
-- its id before the bound was drawn; not visible in `done`, it is one of
-- the transactions the snapshot lists as running, or at or above the
-- snapshot's xmax (the last completed id plus one, not the next id to be
-- drawn) and below the bound. So a batch's first take reads the events
-- above the floor through the index by lane and seq, in seq order and up
-- to what it needs, and those below it by those few transactions' ids
-- through the index by lane and xid: about what it takes, however long the
-- batch.
--
-- This rests on two things: a writer's transaction has its id before its
-- event draws a seq (the statements of this version make sure of it, and
-- so does the column's default below; every statement of earlier versions
-- appends after the update it reports, which draws the id), and the
-- sequence hands out its values in order (`CACHE 1`, as created: with a
-- cache, values cached by other sessions are handed out after the floor is
-- read, by transactions with later ids).
--
-- A batch keeps the pair while it runs (`upto_floor`, `upto_xid`, written
-- when its lease starts it, with the `upto` they belong to) and hands it to
-- `done` when it ends (`done_pair_of`: the `done` it belongs to). A pair is
-- used only with its own `done`: relays of an earlier version start and end
-- batches without these columns, and a stale pair (correct, but with a
-- floor far behind) would make every take read from that floor on. A lane
-- without a pair of its own is read as before, until a batch this version
-- started has ended.
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
ALTER TABLE idemgate_event_lanes ADD COLUMN upto_floor bigint, ADD COLUMN upto_xid xid8, ADD COLUMN upto_pair_of text,
    ADD COLUMN done_floor bigint, ADD COLUMN done_xid xid8, ADD COLUMN done_pair_of text;
-- An event's seq is drawn once its transaction has an id (an insert that
-- leaves both to the columns' defaults would draw the seq first).
ALTER TABLE idemgate_event_log ALTER COLUMN seq
    SET DEFAULT CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('idemgate_events_seq_seq') END;
END
$migration$;
