//! SQLite: the claim, fenced results, reads, lists, retention and leases (the [`Records`] part of the store's contract).

use super::{
    NewEvent, RECORD_COLUMNS, SqliteStore, decode, delete, err, get_conn, get_tx, insert_event, next_generation, now, pk, set_unknown,
    update_state, write_response,
};
use crate::idempotency::key::{IdempotencyKey, Scope, ScopeId};
use crate::idempotency::record::{Attempt, Event, Next, Record, Retention, State, StoredResponse, Timestamp, may_take_over, transition};
use crate::outbox::{EventPolicies, EventType};
use crate::store::codec::this_life;
use crate::store::contract::Records;
use crate::store::{Claim, ClaimRequest, ForeverCount, ListFilter, RawClaim, Reaped, StateCount, StoreError};
use async_trait::async_trait;
use rusqlite::params;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

#[async_trait]
impl Records for SqliteStore {
    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let scope = scope.clone();
        self.write(move |conn, now| Ok(get_conn(conn, &scope)?.map(|r| (r, now)))).await
    }

    async fn claim(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError> {
        let req = req.clone();
        let token = req.claim_token;
        self.write(move |tx, now| {
            let lease = now.plus(req.lease);
            // An async acceptance starts queued (due now, no lease) with its request.
            let (state, lease_col, due, operation_id, request, idempotent) = match &req.acceptance {
                None => ("in_flight", Some(lease.0), None, None, req.request_head.as_deref(), req.reforward),
                Some(a) => ("queued", None, Some(now.0), Some(a.operation_id.as_str()), Some(&a.request[..]), None),
            };
            let existing = get_tx(tx, &req.scope)?;
            let took_over = match existing {
                None => false,
                Some(record) if may_take_over(&record, &req.request_hash, now, idempotent) => {
                    delete(tx, &req.scope)?;
                    true
                }
                Some(record) => return Ok(RawClaim::Existing(record, now)),
            };
            let generation = next_generation(tx)?;
            let sql = "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, \
                       claim_token, owner, lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, \
                       key_source, scope_id, reforward_key, fingerprint_spec) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19)";
            let [t, p, o, k] = pk(&req.scope);
            tx.prepare_cached(sql)
                .and_then(|mut st| {
                    st.execute(params![
                        t,
                        p,
                        o,
                        k,
                        &req.request_hash.0[..],
                        state,
                        generation.0,
                        token.as_bytes(),
                        &*req.owner,
                        lease_col,
                        now.0,
                        lease.0,
                        operation_id,
                        request,
                        due,
                        &*req.key_source,
                        req.scope.scope_id().to_i64(),
                        this_life(req.recorded_key(), token),
                        this_life(&req.fingerprint_spec, token)
                    ])
                })
                .map_err(err)?;
            // An acceptance has no lease yet: its claim carries the time it was accepted.
            let lease_expires_at = if req.acceptance.is_some() { now } else { lease };
            Ok(RawClaim::Claimed(Claim {
                scope: req.scope.clone(),
                generation,
                claim_token: token,
                lease_expires_at,
                took_over,
                asked_at: tokio::time::Instant::now(),
            }))
        })
        .await
    }

    async fn abandon(&self, scope: &Scope, token: Uuid) -> Result<bool, StoreError> {
        let scope = scope.clone();
        self.write(move |tx, _| {
            let Some(record) = get_tx(tx, &scope)? else { return Ok(false) };
            if record.claim_token != token || record.state != State::InFlight {
                return Ok(false);
            }
            delete(tx, &scope)?;
            Ok(true)
        })
        .await
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: Attempt,
        response: &StoredResponse,
        retention: Retention,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let response = response.clone();
        let (emit, with_body) = (events.emits(&scope.operation, EventType::Completed), events.include_body(&scope.operation));
        self.fenced(scope, Event::Complete { attempt }, move |tx, now, _, record| {
            write_response(tx, &s, &response, now, retention, None)?;
            if emit {
                let body = response.body.as_deref().filter(|_| with_body);
                let ev = NewEvent { kind: EventType::Completed, record, status: Some(response.status), actor: None, body };
                insert_event(tx, &ev, Some(record.generation), now)?;
            }
            Ok(())
        })
        .await
    }

    async fn release(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let s = scope.clone();
        self.fenced(scope, Event::Release { attempt }, move |tx, _, _, _| delete(tx, &s)).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        attempt: Attempt,
        only_if_lease_expired: bool,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let s = scope.clone();
        let scope2 = scope.clone();
        let emit = events.emits(&scope.operation, EventType::Unknown);
        // Both conditions (our generation, and for a reader the lease expiry)
        // are checked against the same row under the write lock.
        self.write(move |tx, now| {
            let Some(record) = get_tx(tx, &scope2)? else { return Ok(false) };
            let mine = transition(&record, Event::MarkUnknown { attempt }, now).is_ok();
            let expired = !only_if_lease_expired || transition(&record, Event::LeaseExpired { reforwardable: false }, now).is_ok();
            if mine && expired {
                set_unknown(tx, &s, now)?;
                if emit {
                    insert_event(
                        tx,
                        &NewEvent { kind: EventType::Unknown, record: &record, status: None, actor: None, body: None },
                        Some(record.generation),
                        now,
                    )?;
                }
                Ok(true)
            } else {
                Ok(false)
            }
        })
        .await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        let filter = filter.clone();
        self.write(move |conn, _| {
            // Keyset pagination: after the cursor's record in the list's
            // order (updated_at descending, then the primary key ascending).
            let sql = format!(
                "SELECT {RECORD_COLUMNS} FROM idemgate_records \
                 WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR tenant = ?2) AND (?3 IS NULL OR operation = ?3) \
                 AND (NOT ?5 OR expires_at = 9223372036854775807) \
                 AND (?6 IS NULL OR updated_at < ?6 \
                      OR (updated_at = ?6 AND (tenant, principal, operation, idempotency_key) > (?7, ?8, ?9, ?10))) \
                 ORDER BY updated_at DESC, tenant, principal, operation, idempotency_key LIMIT ?4"
            );
            let mut st = conn.prepare_cached(&sql).map_err(err)?;
            let c = filter.cursor.as_ref();
            let mut rows = st
                .query(params![
                    filter.state.map(State::as_str),
                    filter.tenant,
                    filter.operation,
                    i64::from(filter.limit),
                    filter.forever,
                    c.map(|c| c.updated_at.0),
                    c.map(|c| &*c.scope.tenant),
                    c.map(|c| &*c.scope.principal),
                    c.map(|c| &*c.scope.operation),
                    c.map(|c| c.scope.key.as_str())
                ])
                .map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let swept = self
            .write(move |tx, now| {
                let n = tx.execute(SWEEP, params![now.0, i64::from(batch)]).map_err(err)?;
                Ok(n as u64)
            })
            .await?;
        // The WAL keeps every page image written since its last reset,
        // stored requests (credentials) included after they were set to
        // NULL or deleted: copy it into the database (whose freed content
        // `secure_delete` zeroes) and truncate it, once per sweep.
        self.with(|conn| {
            conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).map_err(err)?;
            Ok(())
        })
        .await?;
        Ok(swept)
    }

    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError> {
        let reforwardable: Vec<Arc<str>> = reforwardable.to_vec();
        let events = events.clone();
        self.write(move |tx, now| {
            let stale: Vec<Record> = {
                let mut st = tx.prepare_cached(&REAP_STALE).map_err(err)?;
                let mut rows = st.query(params![now.0, i64::from(batch)]).map_err(err)?;
                let mut out = Vec::new();
                while let Some(row) = rows.next().map_err(err)? {
                    out.push(decode(row)?);
                }
                out
            };
            let mut reaped = Reaped::default();
            for record in stale {
                let reforward = reforwardable.iter().any(|o| **o == *record.scope.operation);
                match transition(&record, Event::LeaseExpired { reforwardable: reforward }, now) {
                    Ok(Next::State { state: State::Queued, .. }) => {
                        // Re-queued although it was sent: it may have executed.
                        let assignments = if record.sent_at.is_some() {
                            "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5, maybe_executed = 1"
                        } else {
                            "state = 'queued', lease_expires_at = NULL, sent_at = NULL, next_attempt_at = ?5"
                        };
                        update_state(tx, &record.scope, assignments, now, None)?;
                        reaped.requeued += 1;
                    }
                    Ok(Next::State { state: State::Unknown, .. }) => {
                        set_unknown(tx, &record.scope, now)?;
                        if events.emits(&record.scope.operation, EventType::Unknown) {
                            let ev = NewEvent { kind: EventType::Unknown, record: &record, status: None, actor: None, body: None };
                            insert_event(tx, &ev, Some(record.generation), now)?;
                        }
                        reaped.unknown += 1;
                    }
                    _ => {}
                }
            }
            Ok(reaped)
        })
        .await
    }

    async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn.prepare_cached(STATS).map_err(err)?;
            let mut rows = st.query([]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                let state: String = row.get(1).map_err(c)?;
                out.push(StateCount {
                    operation: row.get(0).map_err(c)?,
                    state: State::parse(&state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?,
                    count: row.get(2).map_err(c)?,
                    oldest_created_at: Timestamp(row.get(3).map_err(c)?),
                    oldest_updated_at: Timestamp(row.get(4).map_err(c)?),
                    earliest_lease_expiry: row.get::<_, Option<i64>>(5).map_err(c)?.map(Timestamp),
                });
            }
            Ok(out)
        })
        .await
    }

    async fn unknown_by_age(&self, bounds: &[Duration]) -> Result<Vec<u64>, StoreError> {
        let n = bounds.len();
        // The oldest change each bucket but the last takes in, in bucket
        // order: `CASE WHEN updated_at > ?1 THEN 0 WHEN updated_at > ?2 ...`.
        let whens: String = (0..n).map(|i| format!(" WHEN updated_at > ?{} THEN {i}", i + 1)).collect();
        let bucket = if n == 0 { "0".to_owned() } else { format!("CASE{whens} ELSE {n} END") };
        let sql = unknown_by_age_sql(&bucket);
        let cutoffs: Vec<i64> = {
            let now = now();
            bounds.iter().map(|b| now.0.saturating_sub(i64::try_from(b.as_micros()).unwrap_or(i64::MAX))).collect()
        };
        self.write(move |conn, _| {
            let mut st = conn.prepare(&sql).map_err(err)?;
            let mut rows = st.query(rusqlite::params_from_iter(cutoffs.iter())).map_err(err)?;
            let mut counts = vec![0u64; n + 1];
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                let (bucket, count): (i64, i64) = (row.get(0).map_err(c)?, row.get(1).map_err(c)?);
                counts[usize::try_from(bucket).unwrap_or(0).min(n)] += u64::try_from(count).unwrap_or(0);
            }
            Ok(counts)
        })
        .await
    }

    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        self.write(move |conn, _| {
            // The literal matches the partial index's predicate.
            let mut st = conn
                .prepare_cached(
                    "SELECT operation, count(*) FROM idemgate_records WHERE expires_at = 9223372036854775807 GROUP BY operation",
                )
                .map_err(err)?;
            let mut rows = st.query([]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                out.push(ForeverCount { operation: row.get(0).map_err(c)?, count: row.get(1).map_err(c)? });
            }
            Ok(out)
        })
        .await
    }

    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn.prepare_cached(&format!("SELECT {RECORD_COLUMNS} FROM idemgate_records WHERE scope_id = ?1")).map_err(err)?;
            let mut rows = st.query(params![id.to_i64()]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                out.push(decode(row)?);
            }
            Ok(out)
        })
        .await
    }

    async fn scopes_without_id(&self, after: Option<&Scope>, limit: u32) -> Result<Vec<Scope>, StoreError> {
        let after = after.cloned();
        self.write(move |conn, _| {
            let sql = "SELECT tenant, principal, operation, idempotency_key FROM idemgate_records \
                       WHERE scope_id IS NULL AND (?5 = 0 OR (tenant, principal, operation, idempotency_key) > (?1, ?2, ?3, ?4)) \
                       ORDER BY tenant, principal, operation, idempotency_key LIMIT ?6";
            let [t, p, o, k] = after.as_ref().map_or(["", "", "", ""], pk);
            let mut st = conn.prepare_cached(sql).map_err(err)?;
            let mut rows = st.query(params![t, p, o, k, after.is_some(), i64::from(limit)]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                let (t, p, o, k): (String, String, String, String) =
                    (row.get(0).map_err(c)?, row.get(1).map_err(c)?, row.get(2).map_err(c)?, row.get(3).map_err(c)?);
                let key = IdempotencyKey::new(&k).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
                out.push(Scope { tenant: t.into(), principal: p.into(), operation: o.into(), key });
            }
            Ok(out)
        })
        .await
    }

    async fn add_fingerprint_specs(&self, specs: &[(String, String)]) -> Result<(), StoreError> {
        let specs = specs.to_vec();
        self.write(move |tx, now| {
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO idemgate_fingerprint_specs (operation, spec, registered_at) VALUES (?1, ?2, ?3) ON CONFLICT DO NOTHING",
                )
                .map_err(err)?;
            for (operation, spec) in &specs {
                st.execute(params![operation, spec, now.0]).map_err(err)?;
            }
            Ok(())
        })
        .await
    }

    async fn fingerprint_specs(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.write(move |conn, _| {
            let mut st = conn
                .prepare_cached("SELECT operation, spec FROM idemgate_fingerprint_specs ORDER BY registered_at, operation, spec")
                .map_err(err)?;
            let mut rows = st.query([]).map_err(err)?;
            let mut out = Vec::new();
            while let Some(row) = rows.next().map_err(err)? {
                let c = |e: rusqlite::Error| StoreError::Corrupt(e.to_string());
                out.push((row.get(0).map_err(c)?, row.get(1).map_err(c)?));
            }
            Ok(out)
        })
        .await
    }
}

/// Attempts whose lease ran out (or, in flight, that have none), oldest
/// first (`state <> 'completed'`: see `queue::TAKE_OVERS`).
pub(super) static REAP_STALE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS} FROM idemgate_records WHERE state IN ('in_flight', 'processing') AND state <> 'completed' \
         AND (lease_expires_at IS NULL OR lease_expires_at <= ?1) ORDER BY lease_expires_at LIMIT ?2"
    )
});

/// `unknown` records counted by `bucket` (`state <> 'completed'`: see `queue::TAKE_OVERS`).
pub(super) fn unknown_by_age_sql(bucket: &str) -> String {
    format!("SELECT {bucket}, count(*) FROM idemgate_records WHERE state = 'unknown' AND state <> 'completed' GROUP BY 1")
}

/// Expired completed and failed records, oldest first, `?2` of them.
pub(super) const SWEEP: &str = "DELETE FROM idemgate_records WHERE (tenant, principal, operation, idempotency_key) IN (
    SELECT tenant, principal, operation, idempotency_key FROM idemgate_records
    WHERE state IN ('completed', 'failed_retryable') AND expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

/// Records not yet completed, counted by operation and state.
pub(super) const STATS: &str = "SELECT operation, state, count(*), min(created_at), min(updated_at), min(lease_expires_at) \
    FROM idemgate_records WHERE state <> 'completed' GROUP BY operation, state";
