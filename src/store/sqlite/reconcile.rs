//! SQLite: the probe's take and bookkeeping, and resolutions (the [`Reconcile`] part of the store's contract).

use super::{NewEvent, PK, RECORD_COLUMNS, SqliteStore, decode, delete, err, get_tx, insert_event, next_generation, pk, write_response};
use crate::idempotency::key::Scope;
use crate::idempotency::record::{self, Generation, Next, Record, State, Timestamp, TransitionError};
use crate::outbox::{EventPolicies, EventType};
use crate::store::UNRECORDED_AT_UPSTREAM;
use crate::store::audit::AuditNote;
use crate::store::codec::col;
use crate::store::contract::Reconcile;
use crate::store::{ProbeFence, ProbeRoute, Probing, Resolution, ResolveOutcome, StoreError, audit};
use async_trait::async_trait;
use bytes::Bytes;
use rusqlite::{Connection, params};
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

/// Where the probe take's own columns are, after the record's.
const PROBE_REQUEST: usize = col::END;
const PROBE_ATTEMPTS: usize = PROBE_REQUEST + 1;

#[async_trait]
impl Reconcile for SqliteStore {
    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        let routes = routes.to_vec();
        // The one writer thread serializes takes: no two probes take one record.
        self.write(move |tx, now| {
            let mut taken = Vec::new();
            for route in &routes {
                let left = i64::from(limit).saturating_sub(taken.len() as i64);
                if left <= 0 {
                    break;
                }
                let ago = |d: Duration| Timestamp(now.0.saturating_sub(i64::try_from(d.as_micros()).unwrap_or(i64::MAX)));
                let settled = ago(route.settle);
                let micros = |d: Duration| i64::try_from(d.as_micros()).unwrap_or(i64::MAX);
                let (at_upstream, unrecorded) = (micros(route.at_upstream), micros(UNRECORDED_AT_UPSTREAM));
                let mut st = tx.prepare_cached(&PROBES_DUE).map_err(err)?;
                let mut rows = st.query(params![&*route.operation, settled.0, now.0, left, at_upstream, unrecorded]).map_err(err)?;
                while let Some(row) = rows.next().map_err(err)? {
                    let record = decode(row)?;
                    let request: Option<Vec<u8>> = row.get(PROBE_REQUEST).map_err(err)?;
                    let attempts: i32 = row.get(PROBE_ATTEMPTS).map_err(err)?;
                    taken.push(Probing {
                        fence: ProbeFence { generation: record.generation, token },
                        attempts,
                        request: request.map(Bytes::from),
                        record,
                    });
                }
            }
            for p in &taken {
                let [t, pr, o, k] = pk(&p.record.scope);
                tx.prepare_cached(&format!(
                    "UPDATE idemgate_records SET probe_attempts = ?5, probe_generation = generation, next_probe_at = NULL, \
                     probe_token = ?6, probe_until = ?7 WHERE {PK}"
                ))
                .and_then(|mut st| st.execute(params![t, pr, o, k, p.attempts, token.as_bytes(), now.plus(hold).0]))
                .map_err(err)?;
            }
            Ok(taken)
        })
        .await
    }

    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration, answer: &str) -> Result<bool, StoreError> {
        let scope = scope.clone();
        let answer = answer.to_owned();
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(false) };
            if !probe_holds(tx, &scope, &record, fence)? {
                return Ok(false);
            }
            let [t, p, o, k] = pk(&scope);
            tx.prepare_cached(&format!(
                "UPDATE idemgate_records SET probe_attempts = probe_attempts + 1, next_probe_at = ?5, probe_token = NULL, \
                 probe_until = NULL, probe_last_answer = ?6 WHERE {PK}"
            ))
            .and_then(|mut st| st.execute(params![t, p, o, k, now.plus(retry_in).0, answer]))
            .map_err(err)?;
            Ok(true)
        })
        .await
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
        let scope = scope.clone();
        let resolution = resolution.clone();
        let note = note.clone();
        let events = events.clone();
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(ResolveOutcome::NotFound) };
            if let Some(fence) = fence
                && !probe_holds(tx, &scope, &record, fence)?
            {
                return Ok(ResolveOutcome::Refused(TransitionError::Fenced));
            }
            let at_upstream: Option<i64> = {
                let [t, p, o, k] = pk(&scope);
                tx.query_row(&format!("SELECT at_upstream_until FROM idemgate_records WHERE {PK}"), params![t, p, o, k], |r| r.get(0))
                    .map_err(err)?
            };
            let decided = record::resolution(&record, resolution.event(), expected, at_upstream.map(Timestamp), now);
            let (to, generation) = match (decided, &resolution) {
                (Err(refused), _) => return Ok(ResolveOutcome::Refused(refused)),
                (Ok(Next::Deleted), _) => {
                    delete(tx, &scope)?;
                    (None, None)
                }
                (Ok(Next::State { state, .. }), Resolution::Complete { response, retention, .. }) => {
                    let next = next_generation(tx)?;
                    write_response(tx, &scope, response, now, *retention, Some(next))?;
                    (Some(state), Some(next))
                }
                (Ok(Next::State { state: State::Queued, .. }), Resolution::Release { .. }) => {
                    // An async operation released: it runs again, under a new
                    // generation, if its request is still kept.
                    let [t, p, o, k] = pk(&scope);
                    let kept: bool = tx
                        .query_row(&format!("SELECT request IS NOT NULL FROM idemgate_records WHERE {PK}"), params![t, p, o, k], |r| {
                            r.get(0)
                        })
                        .map_err(err)?;
                    if !kept {
                        return Ok(ResolveOutcome::Refused(TransitionError::RequestGone));
                    }
                    let next = next_generation(tx)?;
                    tx.prepare_cached(&format!(
                        "UPDATE idemgate_records SET state = 'queued', generation = ?5, lease_expires_at = NULL, sent_at = NULL, \
                         next_attempt_at = ?6, attempts = 0, maybe_executed = 0, response_status = NULL, response_headers = NULL, \
                         response_body = NULL, updated_at = ?6 WHERE {PK}"
                    ))
                    .and_then(|mut st| st.execute(params![t, p, o, k, next.0, now.0]))
                    .map_err(err)?;
                    (Some(State::Queued), Some(next))
                }
                (Ok(Next::State { .. }), Resolution::Release { .. }) => {
                    return Ok(ResolveOutcome::Refused(TransitionError::NotAllowed(record.state)));
                }
            };
            let [t, p, o, k] = pk(&scope);
            tx.prepare_cached(
                "INSERT INTO idemgate_audit (at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, \
                 forced, generation, peer, token_label) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            )
            .and_then(|mut st| {
                st.execute(params![
                    now.0,
                    note.actor.as_str(),
                    t,
                    p,
                    o,
                    k,
                    record.state.as_str(),
                    audit::to_state(to),
                    note.reason,
                    note.forced,
                    generation.map(|g| g.0),
                    note.caller.as_ref().map(|c| c.peer.as_str()),
                    note.caller.as_ref().map(|c| c.token.as_str())
                ])
            })
            .map_err(err)?;
            // The resolution's event, in the same transaction.
            if let Some(kind) = EventType::of_resolution(to).filter(|e| events.emits(&scope.operation, *e)) {
                let (status, body) = match &resolution {
                    Resolution::Complete { response, .. } => {
                        (Some(response.status), response.body.as_deref().filter(|_| events.include_body(&scope.operation)))
                    }
                    Resolution::Release { .. } => (None, None),
                };
                // A release deletes the record: its event names the generation
                // released (a scope's events are ordered by generation on Citus).
                let generation = generation.or(Some(record.generation));
                insert_event(tx, &NewEvent { kind, record: &record, status, actor: Some(note.actor.as_str()), body }, generation, now)?;
            }
            Ok(ResolveOutcome::Resolved { from: record.state })
        })
        .await
    }
}

/// Whether the probe identified by `fence` still holds `record`: unknown, at
/// the generation probed, marked with the probe's token.
fn probe_holds(tx: &Connection, scope: &Scope, record: &Record, fence: ProbeFence) -> Result<bool, StoreError> {
    if record.state != State::Unknown || record.generation != fence.generation {
        return Ok(false);
    }
    let token: Option<Vec<u8>> = tx
        .prepare_cached(&format!("SELECT probe_token FROM idemgate_records WHERE {PK}"))
        .and_then(|mut st| st.query_row(pk(scope), |r| r.get(0)))
        .map_err(err)?;
    Ok(token.as_deref() == Some(fence.token.as_bytes().as_slice()))
}

/// A route's `unknown` records due for a probe, oldest change first
/// (`state <> 'completed'`: see `queue::TAKE_OVERS`): unknown since `?2`
/// (settle ago) or longer, and their attempt's time at the upstream ended by
/// then (see `ProbeRoute`; `?5` the prober's timeout, `?6`
/// `UNRECORDED_AT_UPSTREAM`).
pub(super) static PROBES_DUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS}, request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END \
         FROM idemgate_records WHERE state = 'unknown' AND state <> 'completed' AND operation = ?1 AND updated_at <= ?2 \
         AND CASE WHEN at_upstream_until IS NOT NULL THEN at_upstream_until \
                  WHEN operation_id IS NULL THEN max(coalesce(lease_expires_at, 0), created_at + ?5) \
                  ELSE coalesce(sent_at, created_at) + max(?5, ?6) END <= ?2 \
         AND (probe_generation IS NOT generation \
              OR ((next_probe_at IS NULL OR next_probe_at <= ?3) AND (probe_until IS NULL OR probe_until <= ?3))) \
         ORDER BY updated_at LIMIT ?4"
    )
});
