//! PostgreSQL: the outbox (the [`Events`] part of the store's contract).
//!
//! On PostgreSQL new events are appended to a log (`event_log`) and
//! `idemgate_events` holds the events being retried, parked or redelivered
//! by an operator (and those written before the log); a take serves that
//! table first, then the log. A Citus coordinator keeps every event in
//! `idemgate_events`, distributed by tenant, with the statements below.

use super::event_log::{LOG_REDELIVER, RETRIES_DEFERRED, ROTATE, log_xid};
use super::sql::{EVENT_COLUMNS, EVENT_INSERT, prefixed};
use super::*;
use std::sync::LazyLock;

pub(super) static EVENT_INSERT_ONE: LazyLock<String> =
    LazyLock::new(|| format!("INSERT INTO idemgate_events {EVENT_INSERT} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"));

/// The condition that event `{e}` is deliverable in order: no earlier
/// pending event of its scope, and no earlier parked one (a parked event
/// holds the later ones of its scope; through the parked events' own index:
/// there are few). Each is a scalar subquery with `LIMIT 1`, which the
/// planner cannot turn into a join: as `NOT EXISTS`, an anti join planned
/// on an empty, never-analyzed table read the whole scope index once per
/// candidate (`tests/it/pg_plans.rs` checks for it), 23 s for a window of 512
/// with 40,000 events pending; as a subquery each check descends the index
/// by the candidate's scope.
pub(super) fn not_held_back(e: &str) -> String {
    held_back_unless(e, |x| format!("{x}.seq < {e}.seq"))
}

/// [`not_held_back`] on Citus, where a scope's events are ordered by
/// generation first: an event's `seq` comes from the range of the node its
/// statement entered, so two events of one scope written through different
/// nodes can have theirs the wrong way round, while generations grow per
/// scope on every node (each event-writing change draws one or ends its
/// generation; a release names the generation released). Events written
/// before releases named one sort first in their scope.
pub(super) fn not_held_back_by_generation(e: &str) -> String {
    held_back_unless(e, |x| format!("(coalesce({x}.generation, 0), {x}.seq) < (coalesce({e}.generation, 0), {e}.seq)"))
}

/// No pending (`p`) or parked (`q`) event of `{e}`'s scope for which
/// `earlier` holds.
fn held_back_unless(e: &str, earlier: impl Fn(&str) -> String) -> String {
    let (p, q) = (earlier("p"), earlier("q"));
    format!(
        "(SELECT p.seq FROM idemgate_events p
               WHERE p.delivery = 'pending' AND p.tenant = {e}.tenant AND p.principal = {e}.principal
                 AND p.operation = {e}.operation AND p.idempotency_key = {e}.idempotency_key AND {p} LIMIT 1) IS NULL
              AND (SELECT q.seq FROM idemgate_events q
               WHERE q.delivery = 'parked' AND {q} AND q.tenant = {e}.tenant AND q.principal = {e}.principal
                 AND q.operation = {e}.operation AND q.idempotency_key = {e}.idempotency_key LIMIT 1) IS NULL"
    )
}

/// How many of the oldest due events [`TAKE_EVENTS_WINDOW`] considers, per
/// event it may take.
const WINDOW_PER_EVENT: i64 = 4;

/// The relay's take, over a window: the oldest due, unleased pending events
/// (at most `$2 * WINDOW_PER_EVENT`, read in `next_attempt_at` order through
/// the pending index, which a LIMIT on one table lets the planner stop
/// early), then among those the ones no earlier pending or parked event of
/// their scope holds back. Its cost follows the window, not the backlog:
/// [`TAKE_EVENTS`] over the whole pending set cost 20-140 ms per round with
/// 5,000-30,000 events pending (the planner sorts all of them), so a relay
/// behind a burst fell further behind. Events the window cannot reach (more
/// than a window's worth held back by their scopes) are the full take's,
/// which `take_events` runs whenever the window gives less than a batch.
pub(super) static TAKE_EVENTS_WINDOW: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH win AS MATERIALIZED (
            SELECT w.seq, w.tenant, w.principal, w.operation, w.idempotency_key, w.next_attempt_at FROM idemgate_events w
            WHERE w.delivery = 'pending' AND w.next_attempt_at <= now() AND (w.lease_until IS NULL OR w.lease_until <= now())
              AND w.operation = ANY($1::text[])
            ORDER BY w.next_attempt_at LIMIT $2::int8 * {WINDOW_PER_EVENT}
        ), due AS (
            SELECT e.seq FROM idemgate_events e JOIN win ON e.seq = win.seq
            WHERE CASE e.delivery WHEN 'pending' THEN true ELSE false END AND (e.lease_until IS NULL OR e.lease_until <= now())
              AND {}
            ORDER BY win.next_attempt_at LIMIT $2 FOR UPDATE OF e SKIP LOCKED)
        UPDATE idemgate_events e SET lease_token = $3, lease_until = now() + $4::int8 * interval '1 microsecond'
        FROM due WHERE e.seq = due.seq
        RETURNING {}",
        not_held_back("win"),
        prefixed(EVENT_COLUMNS, "e.")
    )
});

/// Whether the window of [`TAKE_EVENTS_WINDOW`] could have missed a due
/// event: it is full (`$2 * WINDOW_PER_EVENT` candidates). When it is not,
/// the window saw every due, unleased pending event, and the full take
/// would find nothing more, so the relay skips it: with thousands of events
/// pending and a window held back by a few leases, the full take cost
/// seconds per round on a database never analyzed (a sort of the whole
/// pending set), and a relay behind a burst fell further behind.
pub(super) static EVENTS_WINDOW_FULL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT count(*) >= $2::int8 * {WINDOW_PER_EVENT} FROM (
            SELECT 1 FROM idemgate_events w
            WHERE w.delivery = 'pending' AND w.next_attempt_at <= now() AND (w.lease_until IS NULL OR w.lease_until <= now())
              AND w.operation = ANY($1::text[])
            LIMIT $2::int8 * {WINDOW_PER_EVENT}) c"
    )
});

/// The relay's take over every due pending event (see [`TAKE_EVENTS_WINDOW`]).
pub(super) static TAKE_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH due AS (
            SELECT e.seq FROM idemgate_events e
            WHERE e.delivery = 'pending' AND e.next_attempt_at <= now() AND (e.lease_until IS NULL OR e.lease_until <= now())
              AND e.operation = ANY($1::text[])
              AND {}
            ORDER BY e.next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED)
        UPDATE idemgate_events e SET lease_token = $3, lease_until = now() + $4::int8 * interval '1 microsecond'
        FROM due WHERE e.seq = due.seq
        RETURNING {}",
        not_held_back("e"),
        prefixed(EVENT_COLUMNS, "e.")
    )
});

pub(super) const EVENTS_DELIVERED: &str = "UPDATE idemgate_events SET delivery = 'sent', sent_at = now(), lease_token = NULL, \
     lease_until = NULL WHERE seq = ANY($1::int8[]) AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END \
     RETURNING seq";

pub(super) const EVENT_FAILED: &str = "UPDATE idemgate_events SET attempts = attempts + 1, last_error = $3, \
     next_attempt_at = now() + $4::int8 * interval '1 microsecond', \
     delivery = CASE WHEN $5 THEN 'parked' ELSE 'pending' END, lease_token = NULL, lease_until = NULL \
     WHERE seq = $1 AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END RETURNING 1";

/// Events newest first, of one delivery state (`$1`) or all.
pub(super) static EVENTS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {EVENT_COLUMNS} FROM idemgate_events ORDER BY seq DESC LIMIT $1"));

pub(super) static EVENTS_BY_DELIVERY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {EVENT_COLUMNS} FROM idemgate_events \
         WHERE CASE delivery WHEN $1 THEN true ELSE false END ORDER BY seq DESC LIMIT $2"
    )
});

pub(super) const REDELIVER: &str = "UPDATE idemgate_events SET delivery = 'pending', attempts = 0, next_attempt_at = now(), \
     lease_token = NULL, lease_until = NULL, last_error = NULL, sent_at = NULL WHERE event_id = $1 RETURNING 1";

pub(super) const SWEEP_EVENTS: &str = "DELETE FROM idemgate_events WHERE seq IN (
        SELECT seq FROM idemgate_events
        WHERE delivery = 'sent' AND sent_at <= now() - $2::int8 * interval '1 microsecond'
        ORDER BY sent_at LIMIT $1)
    RETURNING 1";

/// Pending events through their index, parked ones through theirs; the held
/// ones (pending behind a parked event of their scope) by a lateral subquery
/// per parked event that descends the scope index (see [`not_held_back`]).
pub(super) const EVENT_STATS: &str = "SELECT \
     (SELECT count(*) FROM idemgate_events WHERE delivery = 'pending'), \
     (SELECT count(*) FROM idemgate_events WHERE delivery = 'parked'), \
     (SELECT min(at) FROM idemgate_events WHERE delivery = 'pending'), \
     (SELECT count(*) FROM idemgate_events q CROSS JOIN LATERAL (SELECT 1 FROM idemgate_events e \
        WHERE e.delivery = 'pending' AND e.tenant = q.tenant AND e.principal = q.principal AND e.operation = q.operation \
          AND e.idempotency_key = q.idempotency_key AND e.seq > q.seq OFFSET 0) held \
      WHERE q.delivery = 'parked')";

#[async_trait]
impl Events for PgStore {
    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        Ok(self.take_events_more(operations, limit, lease, token).await?.0)
    }

    async fn take_events_more(
        &self,
        operations: &[&str],
        limit: u32,
        lease: Duration,
        token: Uuid,
    ) -> Result<(Vec<OutboxEvent>, bool), StoreError> {
        if self.flavor == Flavor::Citus {
            let (rows, every_tenant_asked) = self.take_event_rows_citus(operations, limit, micros(lease), token).await?;
            let taken = decode_events(&rows)?;
            let more = crate::store::contract::reached(&taken, limit) || (every_tenant_asked && !taken.is_empty());
            return Ok((taken, more));
        }
        // Events being retried first (usually none), then the log.
        let mut taken = self.take_retries(operations, limit, lease, token).await?;
        let room = limit.saturating_sub(u32::try_from(taken.len()).unwrap_or(u32::MAX));
        if room == 0 {
            return Ok((taken, true));
        }
        let (log, more) = self.take_log(operations, room, lease, token).await?;
        taken.extend(log);
        taken.sort_by_key(|e| e.seq);
        Ok((taken, more))
    }

    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError> {
        if self.flavor == Flavor::Citus {
            let rows = self.query(EVENTS_DELIVERED, &[&seqs, &token], true).await?;
            return rows.iter().map(|r| r.try_get::<_, i64>(0).map_err(|e| StoreError::Corrupt(e.to_string()))).collect();
        }
        self.settle(seqs, token, &[], None, Duration::ZERO, false, 0).await
    }

    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError> {
        if self.retried_event_failed(seq, token, error, retry_after, park).await? {
            return Ok(true);
        }
        if self.flavor == Flavor::Citus {
            return Ok(false);
        }
        // A log event: copied into the retried events, its first attempt made.
        Ok(!self.settle(&[], token, &[seq], Some(error), retry_after, park, 1).await?.is_empty())
    }

    async fn first_attempts_failed(
        &self,
        seqs: &[i64],
        token: Uuid,
        error: &str,
        retry_after: Duration,
        park: bool,
    ) -> Result<Vec<i64>, StoreError> {
        // The log's events in one settling (copied into the retried events,
        // their first attempt made); the rest (copies set aside before, and
        // Citus's events) one at a time.
        let mut held = if self.flavor == Flavor::Citus {
            Vec::new()
        } else {
            self.settle(&[], token, seqs, Some(error), retry_after, park, 1).await?
        };
        let copied: std::collections::HashSet<i64> = held.iter().copied().collect();
        for &seq in seqs.iter().filter(|s| !copied.contains(s)) {
            if self.retried_event_failed(seq, token, error, retry_after, park).await? {
                held.push(seq);
            }
        }
        Ok(held)
    }

    async fn events_deferred(&self, seqs: &[i64], token: Uuid, retry_after: Duration) -> Result<Vec<i64>, StoreError> {
        let rows = self.query(RETRIES_DEFERRED, &[&seqs, &token, &micros(retry_after)], true).await?;
        let mut held: Vec<i64> =
            rows.iter().map(|r| r.try_get::<_, i64>(0).map_err(|e| StoreError::Corrupt(e.to_string()))).collect::<Result<_, _>>()?;
        if self.flavor != Flavor::Citus {
            held.extend(self.settle(&[], token, seqs, None, retry_after, false, 0).await?);
        }
        Ok(held)
    }

    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        let n = i64::from(limit);
        let mut events = match delivery {
            Some(d) => self.events_where(&EVENTS_BY_DELIVERY, &[&d.as_str(), &n], false).await?,
            None => self.events_where(&EVENTS, &[&n], false).await?,
        };
        if self.flavor != Flavor::Citus {
            events.extend(self.log_events(delivery, limit).await?);
            // The newest `limit`, oldest first.
            events.sort_by_key(|e| std::cmp::Reverse(e.seq));
            events.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
            events.sort_by_key(|e| e.seq);
        }
        Ok(events)
    }

    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError> {
        if !self.query(REDELIVER, &[&event_id], true).await?.is_empty() {
            return Ok(true);
        }
        match log_xid(event_id) {
            Some(xid) if self.flavor != Flavor::Citus => {
                // `$2::text::xid8`: the statement takes the id as text.
                Ok(!self.query(&LOG_REDELIVER, &[&event_id, &xid.to_string()], true).await?.is_empty())
            }
            _ => Ok(false),
        }
    }

    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError> {
        let mut swept = self.query(SWEEP_EVENTS, &[&i64::from(batch), &micros(older_than)], true).await?.len() as u64;
        if self.flavor != Flavor::Citus {
            let rows = self.query(ROTATE, &[&micros(older_than)], true).await?;
            let removed: i64 = rows.first().map(|r| r.try_get(0)).transpose().map_err(|e| StoreError::Corrupt(e.to_string()))?.unwrap_or(0);
            swept += u64::try_from(removed).unwrap_or(0);
        }
        Ok(swept)
    }

    async fn event_stats(&self) -> Result<EventStats, StoreError> {
        let rows = self.query(EVENT_STATS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("event stats returned no row".into()))?;
        let mut stats = EventStats {
            pending: row.try_get(0).map_err(c)?,
            parked: row.try_get(1).map_err(c)?,
            oldest_pending_at: row.try_get(2).map_err(c)?,
            held: row.try_get(3).map_err(c)?,
        };
        if self.flavor != Flavor::Citus {
            let (pending, oldest) = self.log_stats().await?;
            stats.pending += pending;
            stats.oldest_pending_at = match (stats.oldest_pending_at, oldest) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        Ok(stats)
    }
}

/// Event rows, in `seq` order.
pub(super) fn decode_events(rows: &[Row]) -> Result<Vec<OutboxEvent>, StoreError> {
    let mut events = rows.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
    events.sort_by_key(|e| e.seq);
    Ok(events)
}

pub(super) fn decode_event(row: &Row) -> Result<OutboxEvent, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let key: &str = row.try_get(6).map_err(c)?;
    let key = IdempotencyKey::new(key).map_err(|e| StoreError::Corrupt(format!("event idempotency_key: {e}")))?;
    let (tenant, principal, operation): (&str, &str, &str) =
        (row.try_get(3).map_err(c)?, row.try_get(4).map_err(c)?, row.try_get(5).map_err(c)?);
    let kind: &str = row.try_get(2).map_err(c)?;
    let delivery: &str = row.try_get(13).map_err(c)?;
    Ok(OutboxEvent {
        seq: row.try_get(0).map_err(c)?,
        id: row.try_get(1).map_err(c)?,
        event_type: EventType::parse(kind).ok_or_else(|| StoreError::Corrupt(format!("event type {kind:?}")))?,
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        generation: row.try_get::<_, Option<i64>>(7).map_err(c)?.map(Generation),
        status: row.try_get::<_, Option<i32>>(8).map_err(c)?.and_then(|s| u16::try_from(s).ok()),
        operation_id: row.try_get(9).map_err(c)?,
        actor: row.try_get(10).map_err(c)?,
        at: row.try_get(11).map_err(c)?,
        body: row.try_get(12).map_err(c)?,
        delivery: Delivery::parse(delivery).ok_or_else(|| StoreError::Corrupt(format!("event delivery {delivery:?}")))?,
        attempts: row.try_get(14).map_err(c)?,
        next_attempt_at: row.try_get(15).map_err(c)?,
        last_error: row.try_get(16).map_err(c)?,
        sent_at: row.try_get(17).map_err(c)?,
    })
}

impl PgStore {
    /// The take over `idemgate_events` (events being retried; on Citus, all).
    async fn take_retries(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        let mut taken = self.events_where(&TAKE_EVENTS_WINDOW, &[&operations, &i64::from(limit), &token, &micros(lease)], true).await?;
        // Less than a batch: the backlog is small (the full take is cheap)
        // or the window was held back; either way the rest comes from all of
        // it. (What the window took is leased now, so not taken twice.)
        let rest = limit.saturating_sub(u32::try_from(taken.len()).unwrap_or(u32::MAX));
        if rest > 0 && self.window_full(operations, limit).await? {
            taken.extend(self.events_where(&TAKE_EVENTS, &[&operations, &i64::from(rest), &token, &micros(lease)], true).await?);
            taken.sort_by_key(|e| e.seq);
        }
        Ok(taken)
    }

    async fn events_where(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<OutboxEvent>, StoreError> {
        decode_events(&self.query(sql, params, write).await?)
    }

    /// See [`EVENTS_WINDOW_FULL`].
    async fn window_full(&self, operations: &[&str], limit: u32) -> Result<bool, StoreError> {
        let rows = self.query(&EVENTS_WINDOW_FULL, &[&operations, &i64::from(limit)], false).await?;
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("the window check returned no row".into()))?;
        row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))
    }
}

impl PgStore {
    /// `EVENT_FAILED`: an event of `idemgate_events` (being retried, or set
    /// aside) this relay holds; whether it was one.
    async fn retried_event_failed(
        &self,
        seq: i64,
        token: Uuid,
        error: &str,
        retry_after: Duration,
        park: bool,
    ) -> Result<bool, StoreError> {
        Ok(!self.query(EVENT_FAILED, &[&seq, &token, &error, &micros(retry_after), &park], true).await?.is_empty())
    }
}
