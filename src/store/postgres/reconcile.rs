//! PostgreSQL: the probe's take and bookkeeping, and resolutions (the [`Reconcile`] part of the store's contract).

use super::citus::Flavor;
use super::sql::NOW;
use super::sql::{EXPIRES_8, PK, RECORD_COLUMNS, prefixed};
use super::{Conn, PgStore, citus_sql, classify, decode, micros, retention_us};
use crate::idempotency::key::Scope;
use crate::idempotency::record::{self, Generation, Next, State, Timestamp, TransitionError};
use crate::outbox::{EventPolicies, EventType};
use crate::store::UNRECORDED_AT_UPSTREAM;
use crate::store::audit::AuditNote;
use crate::store::codec::encode_headers;
use crate::store::contract::Reconcile;
use crate::store::{ProbeFence, ProbeRoute, Probing, Resolution, ResolveOutcome, StoreError, audit};
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

/// The resolution's row, locked.
pub(super) static RESOLVE_LOCK: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {RECORD_COLUMNS}, now(), probe_token, cache_hold_until, at_upstream_until FROM idemgate_records WHERE {PK} FOR UPDATE")
});

/// Where `RESOLVE_LOCK`'s own columns are, after the record's and the clock
/// ([`NOW`]).
const LOCK_PROBE_TOKEN: usize = NOW + 1;
const LOCK_CACHE_HOLD: usize = LOCK_PROBE_TOKEN + 1;
const LOCK_AT_UPSTREAM: usize = LOCK_CACHE_HOLD + 1;

/// A completed record about to be resolved is first held out of the
/// replicas' replay caches (see `store::cache`): replicas that read it from
/// now on do not cache it, until `$5` microseconds from now.
pub(super) static RESOLVE_HOLD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET cache_hold_until = now() + $5::int8 * interval '1 microsecond' \
         WHERE {PK} AND CASE state WHEN 'completed' THEN true ELSE false END RETURNING cache_hold_until"
    )
});

/// An async operation released: it runs again, under a new generation (no
/// row: its stored request was dropped when it completed).
pub(super) static RESOLVE_REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'queued', generation = nextval('idemgate_generation'), lease_expires_at = NULL, \
         sent_at = NULL, next_attempt_at = now(), attempts = 0, maybe_executed = false, response_status = NULL, response_headers = NULL, \
         response_body = NULL, updated_at = now(), cache_hold_until = NULL WHERE {PK} AND request IS NOT NULL RETURNING generation"
    )
});

pub(super) static RESOLVE_DELETE: LazyLock<String> = LazyLock::new(|| format!("DELETE FROM idemgate_records WHERE {PK}"));

pub(super) static RESOLVE_COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'completed', generation = nextval('idemgate_generation'), response_status = $5, \
         response_headers = $6, response_body = $7, lease_expires_at = NULL, updated_at = now(), \
         expires_at = {EXPIRES_8}, cache_hold_until = NULL, request = NULL WHERE {PK} RETURNING generation"
    )
});

/// The reconciler takes due `unknown` records of its routes (each past its
/// route's settle time, its attempt no longer possibly at the upstream, not
/// in backoff, not marked by a live probe), marks
/// them with its token until the hold runs out, and gets them back with their
/// stored request and the inconclusive probes of this generation so far.
/// `SKIP LOCKED`: two replicas never take one record.
pub(super) static TAKE_PROBES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[], $6::int8[]) AS ro(operation, settle_us, at_upstream_us)
), due AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key
    FROM idemgate_records r JOIN routes ro ON ro.operation = r.operation
    WHERE {}
    -- Oldest first, sorted after the open states' index found them (no index
    -- provides this key, so none competes with that one).
    ORDER BY r.updated_at + interval '0 seconds'
    LIMIT $5
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE idemgate_records r SET
    probe_attempts = CASE WHEN r.probe_generation = r.generation THEN r.probe_attempts ELSE 0 END,
    probe_generation = r.generation, next_probe_at = NULL,
    probe_token = $3, probe_until = now() + $4::int8 * interval '1 microsecond'
FROM due d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key
  AND CASE r.state WHEN 'unknown' THEN true ELSE false END
RETURNING {}, now(), r.request, r.probe_attempts",
        &*PROBE_DUE,
        prefixed(RECORD_COLUMNS, "r."),
    )
});

/// Where `TAKE_PROBES`'s (and the Citus take's) own columns are, after the
/// record's and the clock ([`NOW`]).
const PROBE_REQUEST: usize = NOW + 1;
const PROBE_ATTEMPTS: usize = PROBE_REQUEST + 1;

/// Which `unknown` records (`r`, of a route `ro` with its `settle_us` and
/// `at_upstream_us`) are due for a probe: settled, their attempt no longer
/// possibly at the upstream, not backing off after an inconclusive probe and
/// not marked by a live one. The probe's take and, on Citus, its list of
/// tenants (`citus_sql::CITUS_TENANTS_TO_PROBE`) apply the same test.
pub(super) static PROBE_DUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "r.state = 'unknown'
      AND r.updated_at <= now() - ro.settle_us * interval '1 microsecond'
      -- The attempt's time at the upstream, as the attempt recorded it,
      -- ended at least settle ago: it cannot be running (see ProbeRoute).
      AND CASE
            WHEN r.at_upstream_until IS NOT NULL THEN r.at_upstream_until
            WHEN r.operation_id IS NULL THEN greatest(r.lease_expires_at, r.created_at + ro.at_upstream_us * interval '1 microsecond')
            ELSE coalesce(r.sent_at, r.created_at) + greatest(ro.at_upstream_us, {unrecorded}) * interval '1 microsecond'
          END <= now() - ro.settle_us * interval '1 microsecond'
      AND (r.probe_generation IS DISTINCT FROM r.generation
           OR ((r.next_probe_at IS NULL OR r.next_probe_at <= now()) AND (r.probe_until IS NULL OR r.probe_until <= now())))",
        unrecorded = micros(UNRECORDED_AT_UPSTREAM),
    )
});

pub(super) static PROBE_FAILED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET probe_attempts = probe_attempts + 1, \
         next_probe_at = now() + $7::int8 * interval '1 microsecond', probe_token = NULL, probe_until = NULL, probe_last_answer = $8 \
         WHERE {PK} AND CASE state WHEN 'unknown' THEN true ELSE false END AND generation = $5 AND probe_token = $6 RETURNING 1"
    )
});

#[async_trait]
impl Reconcile for PgStore {
    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let settles: Vec<i64> = routes.iter().map(|r| micros(r.settle)).collect();
        let at_upstream: Vec<i64> = routes.iter().map(|r| micros(r.at_upstream)).collect();
        let rows = match self.flavor {
            Flavor::Citus => self.take_probe_rows_citus(&ops, &settles, token, micros(hold), limit, &at_upstream).await?,
            Flavor::Postgres => {
                self.query(&TAKE_PROBES, &[&ops, &settles, &token, &micros(hold), &i64::from(limit), &at_upstream], true).await?
            }
        };
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter()
            .map(|row| {
                let record = decode(row)?;
                let request: Option<Vec<u8>> = row.try_get(PROBE_REQUEST).map_err(c)?;
                Ok(Probing {
                    fence: ProbeFence { generation: record.generation, token },
                    attempts: row.try_get(PROBE_ATTEMPTS).map_err(c)?,
                    request: request.map(Bytes::from),
                    record,
                })
            })
            .collect()
    }

    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration, answer: &str) -> Result<bool, StoreError> {
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let retry_in = micros(retry_in);
        let rows = self.query(&PROBE_FAILED, &[&t, &p, &o, &k, &fence.generation.0, &fence.token, &retry_in, &answer], true).await?;
        Ok(!rows.is_empty())
    }

    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
        expected: Option<Generation>,
    ) -> Result<ResolveOutcome, StoreError> {
        // A completed record may sit in replicas' replay caches: before it
        // changes, it is held out of them (`RESOLVE_HOLD`, committed) and the
        // resolution waits until every entry cached before the hold has run
        // out (see `store::cache`), then resolves in a second transaction.
        let mut held: Option<(Timestamp, Generation)> = None;
        // On Citus a resolution under a new generation draws it from the
        // tenant's counter in its own transaction; the counter's floor is
        // read (once a process) before a connection is held: a statement on
        // a second connection while the first holds the record waits for a
        // free one, and resolutions as many as the pool wait for each other.
        let floor = match self.flavor {
            Flavor::Citus => Some(self.reach.floor.get(&self.db).await?),
            Flavor::Postgres => None,
        };
        for _ in 0..3 {
            let mut conn = self.conn().await?;
            match self.resolve_round(&mut conn, scope, resolution, note, events, (fence, expected), held, floor).await? {
                Round::Done(outcome) => {
                    conn.done();
                    return Ok(outcome);
                }
                Round::Held(hold) => {
                    conn.done();
                    tokio::time::sleep(crate::store::cache::HOLD_WAIT).await;
                    held = Some(hold);
                }
            }
        }
        Err(StoreError::Unavailable("resolve: could not hold the record out of the replay caches".into()))
    }
}

impl PgStore {
    /// One transaction of `resolve`: the resolution itself, or (for a
    /// completed record not yet held, `held` false or the hold run out) the
    /// hold that keeps it out of the replay caches. Every statement runs on
    /// `conn` (on Citus, the draw of a new generation too: `floor` is the
    /// tenant counters' floor).
    #[allow(clippy::too_many_arguments)]
    async fn resolve_round(
        &self,
        conn: &mut Conn,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        (fence, expected): (Option<ProbeFence>, Option<Generation>),
        held: Option<(Timestamp, Generation)>,
        floor: Option<i64>,
    ) -> Result<Round, StoreError> {
        let w = |e| classify(e, true);
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let tx = self.db.transaction(conn).await.map_err(w)?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()];
        let rows = tx.query(self.db.text(&RESOLVE_LOCK), &params).await.map_err(w)?;
        let Some(row) = rows.first() else {
            tx.rollback().await.map_err(w)?;
            return Ok(Round::Done(ResolveOutcome::NotFound));
        };
        let record = decode(row)?;
        let now: Timestamp = row.try_get(NOW).map_err(c)?;
        if let Some(fence) = fence {
            // The row is locked: its probe mark cannot change under us.
            let token: Option<Uuid> = row.try_get(LOCK_PROBE_TOKEN).map_err(c)?;
            if record.state != State::Unknown || record.generation != fence.generation || token != Some(fence.token) {
                tx.rollback().await.map_err(w)?;
                return Ok(Round::Done(ResolveOutcome::Refused(TransitionError::Fenced)));
            }
        }
        // Our own hold, on the same generation, still in force: no replica
        // has cached this record since the hold was set (another
        // resolution's change clears the hold, a new hold replaces it).
        let hold: Option<Timestamp> = row.try_get(LOCK_CACHE_HOLD).map_err(c)?;
        let hold_in_place = hold.is_some_and(|h| h > now && held == Some((h, record.generation)));
        let at_upstream: Option<Timestamp> = row.try_get(LOCK_AT_UPSTREAM).map_err(c)?;
        let (to, generation): (Option<State>, Option<i64>) =
            match record::resolution(&record, resolution.event(), expected, at_upstream, now) {
                Err(refused) => {
                    tx.rollback().await.map_err(w)?;
                    return Ok(Round::Done(ResolveOutcome::Refused(refused)));
                }
                Ok(_) if record.state == State::Completed && !hold_in_place => {
                    let rows = tx
                        .query(
                            self.db.text(&RESOLVE_HOLD),
                            &[params[0], params[1], params[2], params[3], &micros(crate::store::cache::HOLD)],
                        )
                        .await
                        .map_err(w)?;
                    let hold: Timestamp = rows
                        .first()
                        .and_then(|r| r.try_get(0).ok())
                        .ok_or_else(|| StoreError::Corrupt("resolve: the hold was not set".into()))?;
                    tx.commit().await.map_err(w)?;
                    return Ok(Round::Held((hold, record.generation)));
                }
                Ok(Next::Deleted) => {
                    tx.execute(self.db.text(&RESOLVE_DELETE), &params).await.map_err(w)?;
                    (None, None)
                }
                Ok(Next::State { state: State::Queued, .. }) => {
                    // An async operation released: it runs again, under a new generation.
                    let rows = match self.flavor {
                        Flavor::Citus => {
                            let generation = self.draw_generation(&tx, &scope.tenant, floor).await?;
                            let with: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                                [params[0], params[1], params[2], params[3], &generation];
                            tx.query(self.db.text(&citus_sql::CITUS_RESOLVE_REQUEUE), &with).await.map_err(w)?
                        }
                        Flavor::Postgres => tx.query(&*RESOLVE_REQUEUE, &params).await.map_err(w)?,
                    };
                    let Some(row) = rows.first() else {
                        // The row is locked: only a dropped request stops the update.
                        tx.rollback().await.map_err(w)?;
                        return Ok(Round::Done(ResolveOutcome::Refused(TransitionError::RequestGone)));
                    };
                    let generation: i64 = row.try_get(0).map_err(|_| StoreError::Corrupt("resolve: no generation".into()))?;
                    (Some(State::Queued), Some(generation))
                }
                Ok(Next::State { state, .. }) => {
                    let Resolution::Complete { response, retention, .. } = resolution else {
                        return Err(StoreError::Corrupt("resolve: state machine and resolution disagree".into()));
                    };
                    let headers = encode_headers(&response.headers);
                    let body: Option<&[u8]> = response.body.as_deref();
                    let (status, retention) = (i32::from(response.status), retention_us(*retention));
                    let mut values: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
                        vec![params[0], params[1], params[2], params[3], &status, &headers, &body, &retention];
                    let generation = match self.flavor {
                        Flavor::Citus => Some(self.draw_generation(&tx, &scope.tenant, floor).await?),
                        Flavor::Postgres => None,
                    };
                    if let Some(g) = &generation {
                        values.push(g);
                    }
                    let rows = tx
                        .query(self.db.text(self.pick(&RESOLVE_COMPLETE, &citus_sql::CITUS_RESOLVE_COMPLETE)), &values)
                        .await
                        .map_err(w)?;
                    let generation: i64 =
                        rows.first().and_then(|r| r.try_get(0).ok()).ok_or_else(|| StoreError::Corrupt("resolve: no generation".into()))?;
                    (Some(state), Some(generation))
                }
            };
        tx.execute(
            self.db.text(super::trail::AUDIT_INSERT),
            &[
                &note.actor.as_str(),
                params[0],
                params[1],
                params[2],
                params[3],
                &record.state.as_str(),
                &audit::to_state(to),
                &note.reason,
                &note.forced,
                &generation,
                &note.caller.as_ref().map(|c| c.peer.as_str()),
                &note.caller.as_ref().map(|c| c.token.as_str()),
            ],
        )
        .await
        .map_err(w)?;
        // The resolution's event, in the same transaction.
        if let Some(event) = EventType::of_resolution(to).filter(|e| events.emits(&scope.operation, *e)) {
            let (status, body): (Option<i32>, Option<&[u8]>) = match resolution {
                Resolution::Complete { response, .. } => {
                    (Some(i32::from(response.status)), response.body.as_deref().filter(|_| events.include_body(&scope.operation)))
                }
                Resolution::Release { .. } => (None, None),
            };
            // A release deletes the record: its event names the generation
            // released (a scope's events are ordered by generation on Citus).
            let generation = generation.or(Some(record.generation.0));
            tx.execute(
                self.db.text(self.pick(&super::event_log::LOG_INSERT_ONE, &super::events::EVENT_INSERT_ONE)),
                &[
                    &event.as_str(),
                    params[0],
                    params[1],
                    params[2],
                    params[3],
                    &generation,
                    &status,
                    &record.operation_id,
                    &note.actor.as_str(),
                    &body,
                ],
            )
            .await
            .map_err(w)?;
        }
        tx.commit().await.map_err(w)?;
        Ok(Round::Done(ResolveOutcome::Resolved { from: record.state }))
    }
}

impl PgStore {
    /// A new generation of `tenant` (Citus), drawn from its counter in the
    /// transaction `tx` (`super::citus_sql::CITUS_GENERATIONS`, creating the
    /// counter at `floor`): on the connection that holds the record, never
    /// on a second one. A value drawn by a transaction that rolls back was
    /// never used, and may be drawn again.
    async fn draw_generation(&self, tx: &deadpool_postgres::Transaction<'_>, tenant: &str, floor: Option<i64>) -> Result<i64, StoreError> {
        let floor = floor.ok_or_else(|| StoreError::Corrupt("resolve: a generation drawn without the counters' floor".into()))?;
        super::citus::drawn(
            &tx.query(self.db.text(citus_sql::CITUS_GENERATIONS), &[&tenant, &1i64, &floor]).await.map_err(|e| classify(e, true))?,
        )
    }
}

/// What one transaction of `resolve` did.
enum Round {
    Done(ResolveOutcome),
    /// Held a completed record (of this generation) out of the replay caches
    /// until then; resolve after the wait.
    Held((Timestamp, Generation)),
}
