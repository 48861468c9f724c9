//! PostgreSQL: completion events as a log read in batches bounded by
//! transaction snapshots (migration 0015 describes the tables).
//!
//! A final state's statement appends its event to `idemgate_event_log`;
//! while deliveries succeed, that insert is the only write the event costs.
//! The log is split into [`LANES`] lanes by a hash of the idempotency key,
//! so every event of one scope is in one lane. A lane's row says how far
//! its events are delivered: `done`, a snapshot (every event whose
//! transaction is visible in it is delivered), and the batch under way,
//! `upto` (the events visible in it and not in `done`, in seq order, of
//! which those up to `after_seq` are delivered). A transaction that commits
//! after later events were delivered is not visible in `done`: its event
//! comes in a later batch, never skipped. A batch's first take finds its
//! events above a floor on seq kept with `done` by seq, and those below it
//! by the ids of the transactions that were running (migration 0017), so it
//! reads about what it takes however long the batch; later takes read on by
//! seq from `after_seq`.
//!
//! A relay's take ([`PgStore::take_log`]) reads the next events of the
//! free lanes (one statement), keeps of each lane the events before the
//! second event of any scope (order per scope: one event of a scope at a
//! time), then leases those lanes with one write that checks nothing moved
//! meanwhile. Settling ([`SETTLE`]) advances each lane it holds over the
//! events delivered or set aside, in one write per round. An event that
//! cannot be delivered now (a failure, a destination backed off, an
//! operation this relay does not deliver, an earlier event of its scope
//! being retried or parked) is copied into `idemgate_events`, which keeps
//! the retry, parking and redelivery of earlier releases; the log's lane
//! goes on past it.

use std::sync::LazyLock;

use super::events::decode_event;
use super::sql::{log_append, prefixed};
use super::*;
use crate::outbox::{Delivery, OutboxEvent};

/// Lanes of the log (migration 0015: `hashtextextended(key) & 15`, 16 rows).
pub(super) const LANES: i64 = 16;

/// Lanes one take reads at most: all of them. A take stops after its
/// worth of events (the relay's batch), lane by lane, and leases only the
/// lanes it returned events of: a relay that is behind leases the first
/// lanes it reaches, and relays on other replicas take the rest. A caught-up
/// relay takes every lane's few events in one round (with 8 lanes a take,
/// it took half the lanes' events per round, twice as many rounds).
const LANES_PER_TAKE: i64 = 16;

/// Events read per lane beyond the take's limit (those set aside do not count).
const READ_MARGIN: i64 = 16;

/// Takes in a row that only set events aside, before a take gives up.
const TAKES_PAST_ASIDE: usize = 4;

pub(super) static LOG_INSERT_ONE: LazyLock<String> = LazyLock::new(|| {
    log_append("SELECT $1::text, $2::text, $3::text, $4::text, $5::text, $6::int8, $7::int4, $8::text, $9::text, $10::bytea")
});

/// A log row read as an event row (`decode_event`'s columns): pending,
/// never attempted.
fn log_columns(e: &str) -> String {
    format!(
        "{e}.seq, {e}.event_id, {e}.event_type, {e}.tenant, {e}.principal, {e}.operation, {e}.idempotency_key, {e}.generation, \
         {e}.status, {e}.operation_id, {e}.actor, {e}.at, {e}.body, 'pending'::text, 0::int4, {e}.at, NULL::text, NULL::timestamptz"
    )
}

// Every statement reads `idemgate_event_lanes` through its primary key
// (`lane >= 0` where it reads them all): under `enable_seqscan = off` a
// sequential scan costs the plan so much that PostgreSQL compiles it with
// JIT, seconds per statement on a busy machine.

/// Event `{e}` belongs to the batch of lane row `{l}` (columns `lane`,
/// `done`, `upto`, `after_seq`) and is not yet delivered: committed after
/// `done`, visible in `upto`, past `after_seq`. The range on `xid` is what
/// the lane's index reads.
fn in_batch(e: &str, l: &str) -> String {
    format!(
        "{e}.lane = {l}.lane AND {e}.xid >= pg_snapshot_xmin({l}.done) AND {e}.xid < pg_snapshot_xmax({l}.upto) \
         AND NOT pg_visible_in_snapshot({e}.xid, {l}.done) AND pg_visible_in_snapshot({e}.xid, {l}.upto) \
         AND ({l}.after_seq IS NULL OR {e}.seq > {l}.after_seq)"
    )
}

/// Event `{e}` of lane row `{l}` is delivered (or set aside): in `done`,
/// or in the batch under way up to `after_seq`.
fn consumed(e: &str, l: &str) -> String {
    format!(
        "(pg_visible_in_snapshot({e}.xid, {l}.done) OR ({l}.upto IS NOT NULL AND pg_visible_in_snapshot({e}.xid, {l}.upto) \
         AND {e}.seq <= coalesce({l}.after_seq, 0)))"
    )
}

/// Event `{e}` must wait behind an earlier event of its scope that is
/// pending or parked in `idemgate_events` (being retried, parked, or
/// redelivered; the same event redelivered by an operator counts too).
/// Whether that table has a pending (a parked) event at all is asked once
/// per statement (an uncorrelated subquery): while deliveries succeed it
/// has none, and no event's scope is looked up there.
fn held_back(e: &str) -> String {
    format!(
        "((EXISTS (SELECT 1 FROM idemgate_events a WHERE a.delivery = 'pending')
           AND (SELECT p.seq FROM idemgate_events p
               WHERE p.delivery = 'pending' AND p.tenant = {e}.tenant AND p.principal = {e}.principal
                 AND p.operation = {e}.operation AND p.idempotency_key = {e}.idempotency_key AND p.seq <= {e}.seq LIMIT 1) IS NOT NULL)
          OR (EXISTS (SELECT 1 FROM idemgate_events b WHERE b.delivery = 'parked')
           AND (SELECT q.seq FROM idemgate_events q
               WHERE q.delivery = 'parked' AND q.seq <= {e}.seq AND q.tenant = {e}.tenant AND q.principal = {e}.principal
                 AND q.operation = {e}.operation AND q.idempotency_key = {e}.idempotency_key LIMIT 1) IS NOT NULL))"
    )
}

/// Event `{e}` is in the batch of lane row `{l}` past `after_seq`, read
/// through the index on (lane, seq): `{l}.upto_seq` bounds the seqs of
/// the events visible in `upto` (migration 0016). Only for a batch under
/// way (`after_seq` set) whose bound is known. `seq > 0` (true of every
/// event) is the partial index's predicate: only statements that state it
/// (this, and settling's look-up of the events it copies) read that index.
fn in_batch_by_seq(e: &str, l: &str) -> String {
    format!(
        "{e}.lane = {l}.lane AND {e}.seq > 0 AND {e}.seq > {l}.after_seq AND {e}.seq <= {l}.upto_seq \
         AND {e}.xid >= pg_snapshot_xmin({l}.done) AND {e}.xid < pg_snapshot_xmax({l}.upto) \
         AND NOT pg_visible_in_snapshot({e}.xid, {l}.done) AND pg_visible_in_snapshot({e}.xid, {l}.upto)"
    )
}

/// Lane row `{l}`'s batch is read through the seq index ([`in_batch_by_seq`]).
fn by_seq(l: &str) -> String {
    format!("{l}.after_seq IS NOT NULL AND {l}.upto_seq IS NOT NULL")
}

/// Lane row `{l}` (a batch not read by seq) has a floor on seq and a bound
/// on transaction ids for its `done` snapshot (migration 0017) and a bound
/// on seq for its batch: the batch is read as [`running_in_done`],
/// [`running_after_xmax`] and [`above_floor`], not by transaction.
fn floored(l: &str) -> String {
    format!("{l}.done_floor IS NOT NULL AND {l}.done_xid IS NOT NULL AND {l}.upto_seq IS NOT NULL")
}

/// The events of the batch of lane row `{l}` at or below the floor of
/// `done` written by the transactions `done` lists as running, as a FROM
/// item named `{e}`, one probe of the index on (lane, xid) each (`OFFSET 0`
/// keeps the look-up a subquery run per id: as a join, or as `xid =
/// ANY(...)`, a plan made while the log was empty read the whole lane once).
/// With [`running_after_xmax`], every undelivered event at or below the
/// floor (the batch's seq bound, read by the take that started it): its
/// transaction drew its seq before the floor was read, so it had its id
/// before `done_xid` was drawn (by the lease after that take), and, not
/// visible in `done`, it is in the snapshot's list of running transactions
/// or at or above its xmax (the last completed id plus one, not the next id
/// drawn).
fn running_in_done(e: &str, l: &str) -> String {
    format!(
        "pg_snapshot_xip({l}.done) AS r(xid) CROSS JOIN LATERAL (SELECT * FROM idemgate_event_log {e} \
         WHERE {e}.lane = {l}.lane AND {e}.xid = r.xid AND {e}.seq <= {l}.done_floor AND pg_visible_in_snapshot({e}.xid, {l}.upto) \
         AND ({l}.after_seq IS NULL OR {e}.seq > {l}.after_seq) OFFSET 0) {e}"
    )
}

/// Event `{e}` is in the batch of lane row `{l}`, at or below the floor of
/// `done`, written by a transaction with an id from `done`'s xmax up to
/// `done_xid` (see [`running_in_done`]): a few transactions' worth of the
/// lane's index.
fn running_after_xmax(e: &str, l: &str) -> String {
    format!(
        "{e}.lane = {l}.lane AND {e}.xid >= pg_snapshot_xmax({l}.done) AND {e}.xid < {l}.done_xid AND {e}.seq <= {l}.done_floor \
         AND pg_visible_in_snapshot({e}.xid, {l}.upto) AND ({l}.after_seq IS NULL OR {e}.seq > {l}.after_seq)"
    )
}

/// Event `{e}` is in the batch of lane row `{l}`, above the floor of
/// `done`: read through the index on (lane, seq) in seq order, from the
/// floor up to the batch's bound (events above the floor that `done`
/// already shows, delivered, are the few written between the floor's read
/// and the snapshot).
fn above_floor(e: &str, l: &str) -> String {
    format!(
        "{e}.lane = {l}.lane AND {e}.seq > 0 AND {e}.seq <= {l}.upto_seq AND {e}.seq > {l}.done_floor \
         AND NOT pg_visible_in_snapshot({e}.xid, {l}.done) AND pg_visible_in_snapshot({e}.xid, {l}.upto) \
         AND ({l}.after_seq IS NULL OR {e}.seq > {l}.after_seq)"
    )
}

/// The next `limit` undelivered events of lane row `{l}`'s batch, in seq
/// order, as a subquery named `e`. A batch under way whose bound is known
/// reads on from `after_seq` by seq. Otherwise, with a floor for `done`,
/// the events of the transactions `done` lists as running and the first
/// ones above the floor, each up to `limit` (the caller's ORDER BY merges
/// them by seq): about what the take needs, however long the batch.
/// Without a floor (a lane none of whose batches started by this version has
/// ended: migration 0017),
/// the batch by transaction, every row of it sorted by seq (`ORDER BY
/// seq + 0`: the seq index would read the whole lane). The conditions on
/// `{l}` alone are one-time filters: one branch runs, or the floor's two.
fn next_in_batch(l: &str, limit: &str) -> String {
    format!(
        "((SELECT * FROM idemgate_event_log e WHERE NOT ({by}) AND NOT ({floored}) AND {xid} ORDER BY e.seq + 0 LIMIT {limit})
          UNION ALL
          (SELECT e.* FROM {running} WHERE NOT ({by}) AND {floored} ORDER BY e.seq + 0 LIMIT {limit})
          UNION ALL
          (SELECT * FROM idemgate_event_log e WHERE NOT ({by}) AND {floored} AND {after_xmax} ORDER BY e.seq + 0 LIMIT {limit})
          UNION ALL
          (SELECT * FROM idemgate_event_log e WHERE NOT ({by}) AND {floored} AND {above} ORDER BY e.seq LIMIT {limit})
          UNION ALL
          (SELECT * FROM idemgate_event_log e WHERE {by} AND {seq} ORDER BY e.seq LIMIT {limit})) e",
        by = by_seq(l),
        floored = floored(l),
        xid = in_batch("e", l),
        running = running_in_done("e", l),
        after_xmax = running_after_xmax("e", l),
        above = above_floor("e", l),
        seq = in_batch_by_seq("e", l),
    )
}

/// The take's read (`$1` events per lane, `$2` the relay's token, `$3` the
/// lane to start from, `$4` lanes): up to `$4` lanes that are free (or
/// this relay's) and have undelivered events, and their next events in seq
/// order ([`next_in_batch`]). A lane without a batch under way starts one ending at this
/// statement's snapshot (`upto`, returned as text for the lease), its seqs
/// bounded by the sequence's value read after that snapshot (`upto_seq`;
/// the stored bound of a batch under way counts only if it is this batch's).
/// At most `$5` rows in all, lane by lane and in seq order within a lane.
/// The rows come from the nested loop in that order already; the ORDER BY
/// on the lane's position and seq is met by an incremental sort, one lane
/// at a time, so the read still stops after `$5` rows instead of reading
/// and sorting every lane's `$1` (and whether an event waits behind its
/// scope is asked of those rows only). [`PgStore::take_log`] checks the
/// order too. The lanes are put in order before they are asked whether
/// they have events, so that the asking stops once `$4` are found (one to
/// three index probes a lane, of up to 16 lanes). A lane's snapshots are
/// written as text once per lane taken (in `w`), not once per row: under
/// load a snapshot lists tens of running transactions. Whether a lane has
/// events above its floor, or on in its batch under way, is asked as its
/// first one in seq order (a scalar subquery with `LIMIT 1`): as `EXISTS`,
/// a plan made with statistics built a bitmap of the whole range first,
/// every row of a batch millions long. Columns: the event's
/// (`decode_event`), then lane, done, upto, fresh, after_seq, xid (as
/// int8), held back, upto_seq.
pub(super) static TAKE_LOG: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH l AS MATERIALIZED (
            SELECT c.lane, c.done, coalesce(c.upto, pg_current_snapshot()) AS upto, c.after_seq, c.upto IS NULL AS fresh,
                   CASE WHEN c.done_pair_of = c.done::text THEN c.done_floor END AS done_floor,
                   CASE WHEN c.done_pair_of = c.done::text THEN c.done_xid END AS done_xid,
                   CASE WHEN c.upto IS NULL THEN pg_sequence_last_value('idemgate_events_seq_seq'::regclass)
                        WHEN c.upto_seq_of = c.upto::text THEN c.upto_seq END AS upto_seq
            FROM idemgate_event_lanes c
            WHERE c.lane >= 0 AND (c.lease_until IS NULL OR c.lease_until <= now() OR c.lease_token = $2)
        ), w AS (
            SELECT l.*, l.done::text AS done_text, l.upto::text AS upto_text
            FROM (SELECT l.*, (l.lane + $3::int4) % {LANES} AS ord FROM l ORDER BY ord) l
            WHERE EXISTS (SELECT 1 FROM idemgate_event_log x WHERE NOT ({}) AND NOT ({}) AND {})
               OR EXISTS (SELECT 1 FROM {} WHERE NOT ({}) AND {})
               OR EXISTS (SELECT 1 FROM idemgate_event_log x WHERE NOT ({}) AND {} AND {})
               OR (SELECT x.seq FROM idemgate_event_log x WHERE NOT ({}) AND {} AND {} ORDER BY x.seq LIMIT 1) IS NOT NULL
               OR (SELECT x.seq FROM idemgate_event_log x WHERE {} AND {} ORDER BY x.seq LIMIT 1) IS NOT NULL
            ORDER BY l.ord LIMIT $4::int8
        )
        SELECT {}, w.lane, w.done_text, w.upto_text, w.fresh, w.after_seq, e.xid::text::int8, {}, w.upto_seq
        FROM w CROSS JOIN LATERAL {}
        ORDER BY w.ord, e.seq
        LIMIT $5::int8",
        by_seq("l"),
        floored("l"),
        in_batch("x", "l"),
        running_in_done("x", "l"),
        by_seq("l"),
        floored("l"),
        by_seq("l"),
        floored("l"),
        running_after_xmax("x", "l"),
        by_seq("l"),
        floored("l"),
        above_floor("x", "l"),
        by_seq("l"),
        in_batch_by_seq("x", "l"),
        log_columns("e"),
        held_back("e"),
        next_in_batch("w", "$1::int8"),
    )
});

/// The columns of an event row as `idemgate_events` stores it, for copies of
/// log rows.
const COPY_COLUMNS: &str =
    "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, at, body";

/// The take's lease (one write): the lanes read (`$1` lane, `$2` its `done`
/// and `$3` its `upto` as read, `$4` whether its batch starts now, `$5` its
/// `after_seq` as read, `$6` whether the events held end the batch), leased
/// to `$9` for `$10` us if nothing moved since the read, with the events
/// each holds (`$7` lanes, `$8` seqs, grouped by lane in one pass: a
/// look-up of the whole list per lane leased cost 16 passes over a round's
/// events). The held events that wait behind
/// their scope or that this relay does not deliver (`$11` lanes, `$12`
/// xids, `$13` seqs) are copied into `idemgate_events` for the lanes
/// leased, pending and due; `$14` is each lane's seq bound as read (kept
/// with the `upto` it belongs to); a batch starting now also keeps that
/// bound as its floor and this statement's transaction id, drawn after it
/// was read, with the `upto` they belong to (migration 0017; they become
/// `done`'s when the batch ends, if still this batch's: a relay of an
/// earlier version starts batches without them). Returns the lanes leased.
pub(super) static LEASE_LANES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH w AS (
            SELECT * FROM unnest($1::int2[], $2::text[], $3::text[], $4::bool[], $5::int8[], $6::bool[], $14::int8[])
                AS w(lane, done, upto, fresh, after_seq, taken_all, upto_seq)
        ), t AS MATERIALIZED (
            SELECT t.lane, array_agg(t.seq ORDER BY t.seq) AS seqs FROM unnest($7::int2[], $8::int8[]) AS t(lane, seq) GROUP BY t.lane
        ), leased AS (
            UPDATE idemgate_event_lanes c SET upto = w.upto::pg_snapshot, lease_token = $9,
                upto_seq = w.upto_seq, upto_seq_of = CASE WHEN w.upto_seq IS NULL THEN NULL ELSE w.upto END,
                upto_floor = CASE WHEN w.fresh THEN w.upto_seq ELSE c.upto_floor END,
                upto_xid = CASE WHEN w.fresh THEN pg_current_xact_id() ELSE c.upto_xid END,
                upto_pair_of = CASE WHEN w.fresh THEN w.upto ELSE c.upto_pair_of END,
                lease_until = now() + $10::int8 * interval '1 microsecond', taken_all = w.taken_all,
                taken = coalesce(t.seqs, ARRAY[]::int8[])
            FROM w LEFT JOIN t ON t.lane = w.lane
            WHERE c.lane = w.lane AND (c.lease_until IS NULL OR c.lease_until <= now() OR c.lease_token = $9)
              AND c.done::text = w.done AND CASE WHEN w.fresh THEN c.upto IS NULL ELSE c.upto::text = w.upto END
              AND c.after_seq IS NOT DISTINCT FROM w.after_seq
            RETURNING c.lane
        ), aside AS (
            INSERT INTO idemgate_events ({COPY_COLUMNS})
            SELECT {} FROM unnest($11::int2[], $12::int8[], $13::int8[]) AS a(lane, xid, seq)
            JOIN idemgate_event_log e ON e.lane = a.lane AND e.xid = a.xid::text::xid8 AND e.seq = a.seq
            WHERE a.lane IN (SELECT lane FROM leased)
            ON CONFLICT (seq) DO NOTHING
        )
        SELECT lane FROM leased",
        prefixed(COPY_COLUMNS, "e.")
    )
});

/// Settles what a relay holds (`$2`), in one statement: the retried events
/// it delivered (`$1`) are marked sent in `idemgate_events`; the log events
/// of `$3` (a failure or a deferral) are copied there, `$7` attempts made,
/// the last error `$4`, due after `$5` us, parked if `$6`; then each lane
/// it holds advances over its events up to the first one neither delivered
/// nor copied, and is released once all are (its batch ends when the
/// events it held were the batch's last; the new `done`'s floor is then
/// the one read before the batch's snapshot: migration 0017). The copies are found by lane and
/// seq in one scan of the log, and only when there are any (a one-time
/// filter). Before, they were found by a join over the batch's transaction
/// range, so every settle read its batch; a join by seq was worse, because
/// its inner scan of a slot that was empty when the plan was prepared read
/// that slot's whole index. Whether an event held was delivered is asked
/// of a hash of `$1` (a hashed subplan), once per event held: `= ANY($1)`
/// compared each event with the whole array, a cost that grew with the
/// square of a round (about a million comparisons for a round of 1,024).
/// Returns the seqs this relay still held of `$1` and `$3`.
pub(super) static SETTLE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH r AS (
            UPDATE idemgate_events SET delivery = 'sent', sent_at = now(), lease_token = NULL, lease_until = NULL
            WHERE seq = ANY($1::int8[]) AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END
            RETURNING seq
        ), held AS (
            SELECT c.lane, c.done, c.upto, c.taken, c.taken_all FROM idemgate_event_lanes c
            WHERE c.lane >= 0 AND c.lease_token = $2 AND c.taken IS NOT NULL FOR UPDATE
        ), moved AS (
            INSERT INTO idemgate_events ({COPY_COLUMNS}, delivery, attempts, next_attempt_at, last_error)
            SELECT {}, CASE WHEN $6::bool THEN 'parked' ELSE 'pending' END, $7::int4,
                   now() + $5::int8 * interval '1 microsecond', $4::text
            FROM idemgate_event_log e
            WHERE cardinality($3::int8[]) > 0 AND e.lane = ANY(ARRAY(SELECT lane FROM held)) AND e.seq > 0 AND e.seq = ANY($3::int8[])
              AND EXISTS (SELECT 1 FROM held h WHERE h.lane = e.lane AND e.seq = ANY(h.taken))
            ON CONFLICT (seq) DO NOTHING
            RETURNING seq
        ), marks AS (
            SELECT m.lane, m.seq, m.ord, m.delivered,
                   (m.delivered OR m.seq IN (SELECT seq FROM moved) OR EXISTS (SELECT 1 FROM idemgate_events x WHERE x.seq = m.seq)) AS settled
            FROM (SELECT h.lane, t.seq, t.ord, t.seq IN (SELECT unnest($1::int8[])) AS delivered
                  FROM held h CROSS JOIN LATERAL unnest(h.taken) WITH ORDINALITY AS t(seq, ord)) m
        ), open AS (
            SELECT lane, min(ord) FILTER (WHERE NOT settled) AS first FROM marks GROUP BY lane
        ), lanes AS (
            SELECT m.lane, o.first, max(m.seq) FILTER (WHERE o.first IS NULL OR m.ord < o.first) AS through
            FROM marks m JOIN open o ON o.lane = m.lane GROUP BY m.lane, o.first
        ), upd AS (
            UPDATE idemgate_event_lanes c SET
                done = CASE WHEN l.first IS NULL AND h.taken_all THEN h.upto ELSE c.done END,
                done_floor = CASE WHEN l.first IS NULL AND h.taken_all THEN
                                      CASE WHEN c.upto_pair_of = h.upto::text THEN c.upto_floor END ELSE c.done_floor END,
                done_xid = CASE WHEN l.first IS NULL AND h.taken_all THEN
                                    CASE WHEN c.upto_pair_of = h.upto::text THEN c.upto_xid END ELSE c.done_xid END,
                done_pair_of = CASE WHEN l.first IS NULL AND h.taken_all THEN
                                        CASE WHEN c.upto_pair_of = h.upto::text THEN c.upto_pair_of END ELSE c.done_pair_of END,
                upto = CASE WHEN l.first IS NULL AND h.taken_all THEN NULL ELSE c.upto END,
                upto_seq = CASE WHEN l.first IS NULL AND h.taken_all THEN NULL ELSE c.upto_seq END,
                upto_seq_of = CASE WHEN l.first IS NULL AND h.taken_all THEN NULL ELSE c.upto_seq_of END,
                after_seq = CASE WHEN l.first IS NULL AND h.taken_all THEN NULL ELSE coalesce(l.through, c.after_seq) END,
                taken = CASE WHEN l.first IS NULL THEN NULL ELSE c.taken[l.first::int4:] END,
                taken_all = CASE WHEN l.first IS NULL THEN false ELSE c.taken_all END,
                lease_token = CASE WHEN l.first IS NULL THEN NULL ELSE c.lease_token END,
                lease_until = CASE WHEN l.first IS NULL THEN NULL ELSE c.lease_until END
            FROM lanes l JOIN held h ON h.lane = l.lane
            WHERE c.lane = l.lane
            RETURNING c.lane
        )
        SELECT seq FROM r
        UNION SELECT seq FROM marks WHERE delivered
        UNION SELECT seq FROM moved",
        prefixed(COPY_COLUMNS, "e.")
    )
});

/// Retried events a relay holds (`$1`, `$2`) and will not deliver now: due
/// again after `$3` us, their attempts unchanged.
pub(super) const RETRIES_DEFERRED: &str = "UPDATE idemgate_events SET lease_token = NULL, lease_until = NULL, \
     next_attempt_at = now() + $3::int8 * interval '1 microsecond' \
     WHERE seq = ANY($1::int8[]) AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END RETURNING seq";

/// Log events newest first (by transaction, lane by lane), `$1` of each
/// lane, as event rows with their delivery state; those copied into
/// `idemgate_events` are listed from there. `filter`: `None` for all,
/// `Some(pending)` for the undelivered or delivered ones.
fn list(filter: Option<bool>) -> String {
    let (range, cond) = match filter {
        None => ("", "true".to_owned()),
        Some(true) => (" AND e.xid >= pg_snapshot_xmin(l.done)", format!("NOT {}", consumed("e", "l"))),
        Some(false) => ("", consumed("e", "l")),
    };
    format!(
        "SELECT {} FROM idemgate_event_lanes l CROSS JOIN LATERAL (
            SELECT e.*, CASE WHEN {} THEN 'sent' ELSE 'pending' END AS delivery FROM idemgate_event_log e
            WHERE e.lane = l.lane{range} AND {cond} AND NOT EXISTS (SELECT 1 FROM idemgate_events x WHERE x.seq = e.seq)
            ORDER BY e.xid DESC LIMIT $1::int8) e WHERE l.lane >= 0",
        log_columns("e").replace("'pending'::text", "e.delivery"),
        consumed("e", "l"),
    )
}

pub(super) static LOG_EVENTS: LazyLock<String> = LazyLock::new(|| list(None));
pub(super) static LOG_PENDING: LazyLock<String> = LazyLock::new(|| list(Some(true)));
pub(super) static LOG_SENT: LazyLock<String> = LazyLock::new(|| list(Some(false)));

/// The undelivered log events (not copied into `idemgate_events`): how many,
/// and when the oldest was written.
pub(super) static LOG_STATS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT count(*), min(x.at) FROM idemgate_event_lanes l CROSS JOIN LATERAL (
            SELECT e.at FROM idemgate_event_log e WHERE e.lane = l.lane AND e.xid >= pg_snapshot_xmin(l.done) AND NOT {}
              AND NOT EXISTS (SELECT 1 FROM idemgate_events r WHERE r.seq = e.seq) OFFSET 0) x WHERE l.lane >= 0",
        consumed("e", "l")
    )
});

/// An operator's redelivery of a log event (`$1`, written by transaction
/// `$2`): a copy in `idemgate_events`, pending from its first attempt.
pub(super) static LOG_REDELIVER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO idemgate_events ({COPY_COLUMNS})
         SELECT {} FROM idemgate_event_log e
         WHERE e.lane = ANY(ARRAY(SELECT generate_series(0, {})::int2)) AND e.xid = $2::text::xid8 AND e.event_id = $1
         ON CONFLICT (seq) DO NOTHING RETURNING 1",
        prefixed(COPY_COLUMNS, "e."),
        LANES - 1
    )
});

/// The sweeper's turn of the log (migration 0015): `$1` is the retention in us.
pub(super) const ROTATE: &str = "SELECT idemgate_rotate_event_log($1::int8)";

/// What a take keeps of one lane's events.
#[derive(Debug)]
struct LaneTake {
    lane: i16,
    done: String,
    upto: String,
    fresh: bool,
    after_seq: Option<i64>,
    upto_seq: Option<i64>,
    /// Every event held, in seq order: delivered ones and ones set aside.
    taken: Vec<i64>,
    /// Stopped before a row of the lane that was read (a scope's second,
    /// the limit, or the row past a lane's or the take's worth): the batch
    /// goes on. Not cut: every event left in the batch is taken.
    cut: bool,
}

/// The transaction id in a log event's id (its first 48 bits, version 8);
/// `None` for any other id (events written before the log).
pub(super) fn log_xid(id: Uuid) -> Option<i64> {
    let b = id.as_bytes();
    if b[6] >> 4 != 8 {
        return None;
    }
    Some(b[..6].iter().fold(0i64, |x, byte| (x << 8) | i64::from(*byte)))
}

impl PgStore {
    /// Takes up to `limit` deliverable log events for the relay `token` (see
    /// the module documentation). Events of operations not in `operations`,
    /// and events behind an earlier one of their scope in `idemgate_events`,
    /// are copied there instead (the lane goes on past them). Also says
    /// whether the take left events behind: it stopped in a lane's batch
    /// (its limit, a scope's second event) or set events aside.
    pub(super) async fn take_log(
        &self,
        operations: &[&str],
        limit: u32,
        lease: Duration,
        token: Uuid,
    ) -> Result<(Vec<OutboxEvent>, bool), StoreError> {
        // A take that only set events aside has made progress: the next may
        // find events to deliver behind them.
        for _ in 0..TAKES_PAST_ASIDE {
            let (events, aside, cut) = self.take_log_once(operations, limit, lease, token).await?;
            if !events.is_empty() || aside == 0 {
                return Ok((events, cut || aside > 0));
            }
        }
        Ok((Vec::new(), true))
    }

    /// One take of [`Self::take_log`]: the events, how many were set aside,
    /// and whether it stopped before the end of a lane's batch or of the rows
    /// it read.
    async fn take_log_once(
        &self,
        operations: &[&str],
        limit: u32,
        lease: Duration,
        token: Uuid,
    ) -> Result<(Vec<OutboxEvent>, usize, bool), StoreError> {
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let start = i32::from(Uuid::new_v4().as_bytes()[0]) % i32::try_from(LANES).unwrap_or(16);
        let room = usize::try_from(limit).unwrap_or(usize::MAX);
        // Read a little more than a batch: events set aside do not count.
        let read = i64::from(limit) + READ_MARGIN;
        let budget = usize::try_from(read).unwrap_or(usize::MAX);
        // One row more than is taken, per lane and in all: a lane's batch
        // goes on (is cut) only when a row of it is left, read but not
        // taken; a lane whose rows were all taken was read to its batch's
        // end, and the batch ends. Without the extra row, a batch whose last
        // event was exactly the last row read would stay open with nothing
        // left in it, and its lane would never be taken again.
        let ahead = read + 1;
        let rows = self.query(&TAKE_LOG, &[&ahead, &token, &start, &LANES_PER_TAKE, &ahead], false).await?;
        let mut lanes: Vec<LaneTake> = Vec::new();
        let mut deliver: Vec<(i16, OutboxEvent)> = Vec::new();
        let mut aside: (Vec<i16>, Vec<i64>, Vec<i64>) = Default::default();
        let mut scopes: std::collections::HashSet<(i16, Scope)> = std::collections::HashSet::new();
        let mut last_seq = i64::MIN;
        for (i, row) in rows.iter().enumerate() {
            let lane: i16 = row.try_get(18).map_err(c)?;
            let seq: i64 = row.try_get(0).map_err(c)?;
            let new_lane = lanes.last().is_none_or(|l| l.lane != lane);
            // Rows come lane by lane, each lane's in seq order (TAKE_LOG's
            // ORDER BY): any other order would deliver a lane's events out of
            // order or past one never read.
            if new_lane && lanes.iter().any(|l| l.lane == lane) {
                return Err(StoreError::Corrupt(format!("the event log's take returned lane {lane} twice, not lane by lane")));
            }
            if !new_lane && seq <= last_seq {
                return Err(StoreError::Corrupt(format!("the event log's take returned lane {lane} out of seq order")));
            }
            last_seq = seq;
            if i >= budget {
                // The row past the take's worth: the lane it continues goes
                // on; a lane it starts is not read now.
                if let (false, Some(last)) = (new_lane, lanes.last_mut()) {
                    last.cut = true;
                }
                break;
            }
            if new_lane {
                lanes.push(LaneTake {
                    lane,
                    done: row.try_get(19).map_err(c)?,
                    upto: row.try_get(20).map_err(c)?,
                    fresh: row.try_get(21).map_err(c)?,
                    after_seq: row.try_get(22).map_err(c)?,
                    upto_seq: row.try_get(25).map_err(c)?,
                    taken: Vec::new(),
                    cut: false,
                });
            }
            let Some(l) = lanes.last_mut() else { continue };
            // The row past a lane's worth: the lane goes on.
            if l.cut || l.taken.len() >= budget {
                l.cut = true;
                continue;
            }
            let event = decode_event(row)?;
            let (xid, held): (i64, bool) = (row.try_get(23).map_err(c)?, row.try_get(24).map_err(c)?);
            if held || !operations.contains(&&*event.scope.operation) {
                aside.0.push(lane);
                aside.1.push(xid);
                aside.2.push(event.seq);
                l.taken.push(event.seq);
                continue;
            }
            if deliver.len() >= room || !scopes.insert((lane, event.scope.clone())) {
                l.cut = true;
                continue;
            }
            l.taken.push(event.seq);
            deliver.push((lane, event));
        }
        let cut = rows.len() > budget || lanes.iter().any(|l| l.cut);
        lanes.retain(|l| !l.taken.is_empty());
        if lanes.is_empty() {
            return Ok((Vec::new(), 0, cut));
        }
        let (mut t_lane, mut t_seq) = (Vec::new(), Vec::new());
        for l in &lanes {
            t_lane.extend(l.taken.iter().map(|_| l.lane));
            t_seq.extend(l.taken.iter().copied());
        }
        let lane: Vec<i16> = lanes.iter().map(|l| l.lane).collect();
        let done: Vec<&str> = lanes.iter().map(|l| l.done.as_str()).collect();
        let upto: Vec<&str> = lanes.iter().map(|l| l.upto.as_str()).collect();
        let fresh: Vec<bool> = lanes.iter().map(|l| l.fresh).collect();
        let after_seq: Vec<Option<i64>> = lanes.iter().map(|l| l.after_seq).collect();
        let upto_seq: Vec<Option<i64>> = lanes.iter().map(|l| l.upto_seq).collect();
        // A lane not cut was read to its batch's end: the batch ends.
        let all: Vec<bool> = lanes.iter().map(|l| !l.cut).collect();
        let (a_lane, a_xid, a_seq) = &aside;
        let leased = self
            .query(
                &LEASE_LANES,
                &[&lane, &done, &upto, &fresh, &after_seq, &all, &t_lane, &t_seq, &token, &micros(lease), a_lane, a_xid, a_seq, &upto_seq],
                true,
            )
            .await?;
        let leased: Vec<i16> = leased.iter().map(|r| r.try_get(0).map_err(c)).collect::<Result<_, _>>()?;
        if !aside.2.is_empty() && !leased.is_empty() {
            // The copies are settled: lanes that hold nothing else are released.
            self.settle(&[], token, &[], None, Duration::ZERO, false, 0).await?;
        }
        let set_aside = aside.0.iter().filter(|lane| leased.contains(lane)).count();
        Ok((deliver.into_iter().filter(|(lane, _)| leased.contains(lane)).map(|(_, e)| e).collect(), set_aside, cut))
    }

    /// Runs [`SETTLE`]; returns the seqs this relay still held of `delivered` and `moved`.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn settle(
        &self,
        delivered: &[i64],
        token: Uuid,
        moved: &[i64],
        error: Option<&str>,
        retry_after: Duration,
        park: bool,
        attempts: i32,
    ) -> Result<Vec<i64>, StoreError> {
        let rows = self.query(&SETTLE, &[&delivered, &token, &moved, &error, &micros(retry_after), &park, &attempts], true).await?;
        rows.iter().map(|r| r.try_get::<_, i64>(0).map_err(|e| StoreError::Corrupt(e.to_string()))).collect()
    }

    /// Log events for a listing: `delivery` as [`Events::events`] has it
    /// (parked ones are all in `idemgate_events`).
    pub(super) async fn log_events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        let sql: &str = match delivery {
            None => &LOG_EVENTS,
            Some(Delivery::Pending) => &LOG_PENDING,
            Some(Delivery::Sent) => &LOG_SENT,
            Some(Delivery::Parked) => return Ok(Vec::new()),
        };
        self.query(sql, &[&i64::from(limit)], false).await?.iter().map(decode_event).collect()
    }

    /// Undelivered log events: how many, and the oldest's time.
    pub(super) async fn log_stats(&self) -> Result<(i64, Option<Timestamp>), StoreError> {
        let rows = self.query(&LOG_STATS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("log stats returned no row".into()))?;
        Ok((row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_log_events_id_names_its_transaction() {
        let id: Uuid = "00000001-3201-89f0-9567-699acaa711fc".parse().unwrap();
        assert_eq!(log_xid(id), Some(0x0001_3201));
        assert_eq!(log_xid("0f8c7a1e-1111-4222-8333-444455556666".parse().unwrap()), None, "a v4 id is not the log's");
    }
}
