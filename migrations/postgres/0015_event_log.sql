-- Completion events as a log (PostgreSQL; a Citus coordinator keeps the
-- outbox table of migration 0007, distributed by tenant: this migration
-- creates nothing there).
--
-- Until now every event was a row of `idemgate_events` that the relay
-- leased (an update entering its indexes) and marked sent (another): three
-- writes per event, two of them making dead tuples. From here on a final
-- state's statement appends its event to `idemgate_event_log`, and that
-- insert is the only write an event costs while deliveries succeed:
--
-- - Each event carries the id of the transaction that wrote it (`xid`).
--   The log is split into 16 lanes by a hash of the idempotency key (every
--   event of one scope is in one lane, so order per scope is order within a
--   lane). A lane's row in `idemgate_event_lanes` holds a snapshot `done`:
--   every event whose transaction is visible in it has been delivered (or
--   set aside, below). A relay leases a lane, takes the snapshot of the
--   moment as the end of the lane's next batch (`upto`), and delivers the
--   events visible in `upto` but not in `done`, in `seq` order (within a
--   batch, `after_seq` says how far it got). A transaction that commits
--   late, after later events were delivered, was not visible in `done`, so
--   its event is in a later batch: nothing is skipped however long a
--   transaction takes. One write per lane and batch records the progress.
-- - An event whose delivery fails, or that this relay cannot deliver now,
--   is copied into `idemgate_events` (from now on the table of events being
--   retried, parked, or redelivered by an operator), with its seq and id,
--   and goes on there as before; the later events of its scope follow it
--   there, so order per scope holds. Pending rows of that table from before
--   this migration are delivered from it as before.
-- - The log is partitioned into three slots. New events go to the current
--   slot (`idemgate_event_rotation`); the sweeper makes the next slot
--   current once the current one has been current for `events_retention`,
--   and empties a slot with TRUNCATE once every event in it is delivered
--   and older than `events_retention` (`idemgate_rotate_event_log`). So
--   delivered events are kept for one to two retention periods, and the
--   log makes no dead tuples.
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

CREATE TABLE idemgate_event_rotation (
    one   boolean     PRIMARY KEY DEFAULT true CHECK (one),
    -- The slot new events go to, and since when.
    slot  integer     NOT NULL CHECK (slot BETWEEN 0 AND 2),
    since timestamptz NOT NULL DEFAULT now()
);
INSERT INTO idemgate_event_rotation (slot) VALUES (0);

CREATE FUNCTION idemgate_event_slot() RETURNS integer LANGUAGE sql STABLE
    AS $fn$ SELECT slot FROM idemgate_event_rotation WHERE one $fn$;

-- An event id that names the transaction which wrote the event: its first
-- 48 bits are the transaction id (`idemgate events redeliver <id>` finds
-- the event through the lanes' index), then the version 8 of RFC 9562
-- (custom), then 74 random bits (the variant bits included).
CREATE FUNCTION idemgate_log_event_id() RETURNS uuid LANGUAGE sql VOLATILE
    AS $fn$ SELECT (lpad(to_hex(pg_current_xact_id()::text::int8), 12, '0') || '8'
                    || substr(replace(gen_random_uuid()::text, '-', ''), 14))::uuid $fn$;

CREATE TABLE idemgate_event_log (
    slot            integer     NOT NULL DEFAULT idemgate_event_slot(),
    -- The outbox's sequence: seqs of the log and of idemgate_events never collide.
    seq             bigint      NOT NULL DEFAULT nextval('idemgate_events_seq_seq'),
    xid             xid8        NOT NULL DEFAULT pg_current_xact_id(),
    event_id        uuid        NOT NULL DEFAULT idemgate_log_event_id(),
    event_type      text        NOT NULL CHECK (event_type IN ('completed', 'unknown', 'failed_retryable', 'released')),
    tenant          text        COLLATE "C" NOT NULL,
    principal       text        COLLATE "C" NOT NULL,
    operation       text        COLLATE "C" NOT NULL,
    idempotency_key text        COLLATE "C" NOT NULL,
    lane            smallint    GENERATED ALWAYS AS ((hashtextextended(idempotency_key, 0) & 15)::smallint) STORED,
    generation      bigint,
    status          integer,
    operation_id    text,
    actor           text,
    at              timestamptz NOT NULL DEFAULT now(),
    body            bytea
) PARTITION BY LIST (slot);
CREATE TABLE idemgate_event_log_0 PARTITION OF idemgate_event_log FOR VALUES IN (0);
CREATE TABLE idemgate_event_log_1 PARTITION OF idemgate_event_log FOR VALUES IN (1);
CREATE TABLE idemgate_event_log_2 PARTITION OF idemgate_event_log FOR VALUES IN (2);
-- The only index: a lane's events by transaction (a batch is a range of it).
CREATE INDEX idemgate_event_log_lane ON idemgate_event_log (lane, xid);

CREATE TABLE idemgate_event_lanes (
    lane        smallint    PRIMARY KEY,
    -- Every event whose transaction is visible in this snapshot is delivered
    -- (or copied into idemgate_events).
    done        pg_snapshot NOT NULL,
    -- The batch being delivered: events visible here and not in `done`, in
    -- seq order, of which those up to `after_seq` are delivered.
    upto        pg_snapshot,
    after_seq   bigint,
    -- The events a relay holds (its lease), and whether they end the batch.
    taken       bigint[],
    taken_all   boolean     NOT NULL DEFAULT false,
    lease_token uuid,
    lease_until timestamptz
);
-- Events written from now on; the lanes start here.
INSERT INTO idemgate_event_lanes (lane, done) SELECT g, pg_current_snapshot() FROM generate_series(0, 15) g;

-- The sweeper's turn of the log (see above). Runs as the owner of the
-- tables (TRUNCATE is theirs): the role that serves needs only EXECUTE.
-- Returns about how many events it removed (the table's statistics).
CREATE FUNCTION idemgate_rotate_event_log(retention_us bigint) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET jit = off SET enable_seqscan = on AS $fn$
DECLARE
    keep    interval := retention_us * interval '1 microsecond';
    v_cur   integer;
    v_since timestamptz;
    v_slot  integer;
    tbl     text;
    busy    boolean;
    newest  timestamptz;
    removed bigint := 0;
    v_rows  real;
BEGIN
    SELECT r.slot, r.since INTO v_cur, v_since FROM idemgate_event_rotation r FOR UPDATE;
    -- The next slot becomes current once this one has been for a retention
    -- period, if it is empty (else new events stay where they are).
    tbl := format('idemgate_event_log_%s', (v_cur + 1) % 3);
    EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', tbl) INTO busy;
    IF v_since <= now() - keep AND NOT busy THEN
        v_cur := (v_cur + 1) % 3;
        UPDATE idemgate_event_rotation SET slot = v_cur, since = now();
    END IF;
    FOR v_slot IN SELECT s FROM generate_series(0, 2) s WHERE s <> v_cur LOOP
        tbl := format('idemgate_event_log_%s', v_slot);
        BEGIN
            -- Writers of this slot (statements that read the current slot
            -- before a switch) finish first, or this turn skips it.
            EXECUTE format('LOCK TABLE %I IN ACCESS EXCLUSIVE MODE NOWAIT', tbl);
        EXCEPTION WHEN lock_not_available THEN
            CONTINUE;
        END;
        -- Any event not yet delivered in its lane keeps the slot.
        EXECUTE format(
            'SELECT EXISTS (SELECT 1 FROM idemgate_event_lanes l CROSS JOIN LATERAL (
                 SELECT 1 FROM %I e WHERE e.lane = l.lane AND e.xid >= pg_snapshot_xmin(l.done)
                   AND NOT pg_visible_in_snapshot(e.xid, l.done) LIMIT 1) x)', tbl) INTO busy;
        CONTINUE WHEN busy;
        -- The newest event of each lane (the last transaction's).
        EXECUTE format(
            'SELECT max(x.at) FROM idemgate_event_lanes l CROSS JOIN LATERAL (
                 SELECT e.at FROM %I e WHERE e.lane = l.lane ORDER BY e.xid DESC LIMIT 1) x', tbl) INTO newest;
        CONTINUE WHEN newest IS NULL OR newest > now() - keep;
        SELECT c.reltuples INTO v_rows FROM pg_class c WHERE c.oid = tbl::regclass;
        EXECUTE format('TRUNCATE %I', tbl);
        removed := removed + greatest(coalesce(v_rows, 0), 1)::bigint;
    END LOOP;
    RETURN removed;
END
$fn$;
END
$migration$;
