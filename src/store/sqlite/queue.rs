//! SQLite: the async queue (the [`Queue`] part of the store's contract).

use super::{NewEvent, PK, RECORD_COLUMNS, SqliteStore, decode, err, get_tx, insert_event, next_generation, pk, touch, update_state};
use crate::idempotency::key::Scope;
use crate::idempotency::record::may_forward;
use crate::idempotency::record::{Attempt, Event, Next, Record, Retention, State, Timestamp, transition};
use crate::outbox::{EventPolicies, EventType};
use crate::store::codec::col;
use crate::store::contract::Queue;
use crate::store::{Claim, RetryNote, StoreError, Taken, WorkerRoute};
use async_trait::async_trait;
use rusqlite::{Connection, params};
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

/// Where the takes' (`TAKE_OVERS`, `TAKE_DUE`) request is, after the record's columns.
const TAKE_REQUEST: usize = col::END;

#[async_trait]
impl Queue for SqliteStore {
    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_tokens: &[Uuid]) -> Result<Vec<Taken>, StoreError> {
        let routes = routes.to_vec();
        let owner = owner.to_owned();
        let claim_tokens = claim_tokens.to_vec();
        self.write(move |tx, now| {
            // The one writer thread serializes takes: no two workers can take
            // one operation.
            let mut all = Vec::with_capacity(claim_tokens.len());
            for claim_token in claim_tokens {
                match take_one(tx, now, &routes, &owner, claim_token)? {
                    Some(taken) => all.push(taken),
                    None => break,
                }
            }
            Ok(all)
        })
        .await
    }

    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Heartbeat { attempt }, move |tx, now, _, _| {
            update_state(tx, &s, "lease_expires_at = ?5", now.plus(lease), None)
        })
        .await
    }

    async fn mark_sent(&self, scope: &Scope, attempt: Attempt, at_upstream: Duration) -> Result<bool, StoreError> {
        let s = scope.clone();
        let at_upstream = i64::try_from(at_upstream.as_micros()).unwrap_or(i64::MAX);
        self.fenced(scope, Event::MarkSent { attempt }, move |tx, now, _, _| {
            // The latest bound of the record's attempts.
            let assignments = format!("sent_at = ?5, at_upstream_until = max(coalesce(at_upstream_until, 0), ?5 + {at_upstream})");
            update_state(tx, &s, &assignments, now, None)
        })
        .await
    }

    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Requeue { attempt }, move |tx, now, _, _| {
            // One statement binding ?5 and ?6 (an assignment using neither
            // fails to bind them); the fact only ever turns on.
            let assignments = format!(
                "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5, last_status = ?6, \
                 maybe_executed = max(maybe_executed, {})",
                i32::from(retry.maybe_executed)
            );
            update_state(tx, &s, &assignments, now.plus(delay), retry.last_status)?;
            touch(tx, &s, now)
        })
        .await
    }

    async fn fail(
        &self,
        scope: &Scope,
        attempt: Attempt,
        retention: Retention,
        retry: RetryNote,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let (scope, retry_note) = (scope.clone(), retry);
        let events = events.clone();
        self.write(move |tx, now| {
            let Some(mut record) = get_tx(tx, &scope)? else { return Ok(false) };
            record.maybe_executed |= retry_note.maybe_executed;
            let Ok(Next::State { state, .. }) = transition(&record, Event::Fail { attempt }, now) else { return Ok(false) };
            // Final (failed_retryable): the stored request is dropped; an
            // unknown one keeps it (a release runs it again).
            let assignments = format!(
                "state = '{}', maybe_executed = {}, lease_expires_at = NULL, expires_at = ?5, last_status = ?6{}",
                state.as_str(),
                i32::from(record.maybe_executed),
                if state == State::FailedRetryable { ", request = NULL" } else { "" }
            );
            update_state(tx, &s, &assignments, retention.expires_at(now), retry_note.last_status)?;
            touch(tx, &s, now)?;
            if let Some(kind) = EventType::of(Some(state)).filter(|e| events.emits(&scope.operation, *e)) {
                let ev = NewEvent { kind, record: &record, status: retry_note.last_status, actor: None, body: None };
                insert_event(tx, &ev, Some(record.generation), now)?;
            }
            Ok(true)
        })
        .await
    }

    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let (tenant, operation_id) = (tenant.to_owned(), operation_id.to_owned());
        self.write(move |conn, now| {
            let sql = format!("SELECT {RECORD_COLUMNS} FROM idemgate_records WHERE tenant = ?1 AND operation_id = ?2");
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let mut rows = st.query(params![tenant, operation_id]).map_err(err)?;
            match rows.next().map_err(err)? {
                Some(row) => Ok(Some((decode(row)?, now))),
                None => Ok(None),
            }
        })
        .await
    }
}

/// Expired attempts, oldest lease first. (`state <> 'completed'` repeats
/// the open records' partial index's condition: SQLite uses a partial
/// index only when the query states its condition, and otherwise scans
/// the whole table for every take.)
pub(super) static TAKE_OVERS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS}, request FROM idemgate_records WHERE state = 'processing' AND state <> 'completed' \
         AND lease_expires_at <= ?1 ORDER BY lease_expires_at"
    )
});

/// Due queued operations, oldest first.
pub(super) static TAKE_DUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS}, request FROM idemgate_records WHERE state = 'queued' AND next_attempt_at <= ?1 ORDER BY next_attempt_at"
    )
});

/// The next due operation of `routes` (take-overs first, then the queue),
/// taken under `claim_token` within the writer's transaction.
fn take_one(tx: &Connection, now: Timestamp, routes: &[WorkerRoute], owner: &str, claim_token: Uuid) -> Result<Option<Taken>, StoreError> {
    let mut found: Option<(Record, Vec<u8>)> = None;
    // Take-overs first (an expired attempt that may run again: never
    // sent, or its upstream deduplicates), then the queue.
    for sql in [&*TAKE_OVERS, &*TAKE_DUE] {
        let mut st = tx.prepare_cached(sql).map_err(err)?;
        let mut rows = st.query(params![now.0]).map_err(err)?;
        while let Some(row) = rows.next().map_err(err)? {
            let record = decode(row)?;
            let Some(route) = routes.iter().find(|r| *r.operation == *record.scope.operation) else { continue };
            // An expired attempt that may not run again is the reaper's.
            if record.state == State::Processing && !may_forward(&record, route.reforwardable) {
                continue;
            }
            let request: Vec<u8> = row.get(TAKE_REQUEST).map_err(err)?;
            found = Some((record, request));
            break;
        }
        if found.is_some() {
            break;
        }
    }
    let Some((record, request)) = found else { return Ok(None) };
    let lease_expired = record.state == State::Processing;
    // Taken over although it was sent: it may have executed.
    let maybe_executed = record.maybe_executed || (lease_expired && record.sent_at.is_some());
    let route = routes.iter().find(|r| *r.operation == *record.scope.operation);
    let lease = route.map_or(Duration::ZERO, |r| r.lease);
    // A route whose upstream deduplicates: the take records the send (see `WorkerRoute::sent_on_take`).
    let sent_on_take = route.and_then(|r| r.sent_on_take);
    let (sent_at, at_upstream_until) = match sent_on_take {
        Some(timeout) => (Some(now.0), Some(now.plus(timeout).0)),
        None => (None, None),
    };
    let generation = next_generation(tx)?;
    let [t, p, o, k] = pk(&record.scope);
    tx.prepare_cached(&format!(
        "UPDATE idemgate_records SET state = 'processing', generation = ?5, claim_token = ?6, owner = ?7, lease_expires_at = ?8, \
         attempts = attempts + 1, sent_at = ?11, \
         at_upstream_until = CASE WHEN ?12 IS NULL THEN at_upstream_until ELSE max(coalesce(at_upstream_until, 0), ?12) END, next_attempt_at = NULL, \
         updated_at = ?9, maybe_executed = ?10 WHERE {PK}"
    ))
    .and_then(|mut st| {
        st.execute(params![
            t,
            p,
            o,
            k,
            generation.0,
            claim_token.as_bytes(),
            owner,
            now.plus(lease).0,
            now.0,
            maybe_executed,
            sent_at,
            at_upstream_until
        ])
    })
    .map_err(err)?;
    let record = get_tx(tx, &record.scope)?.ok_or_else(|| StoreError::Corrupt("taken operation vanished".into()))?;
    let claim = Claim {
        scope: record.scope.clone(),
        generation,
        claim_token,
        lease_expires_at: now.plus(lease),
        took_over: true,
        asked_at: tokio::time::Instant::now(),
    };
    Ok(Some(Taken { record, request: request.into(), claim, lease_expired }))
}
