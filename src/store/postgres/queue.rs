//! PostgreSQL: the async queue (the [`Queue`] part of the store's contract).

use super::batch::{PkColumns, is_deadlock};
use super::citus::Flavor;
use super::sql::NOW;
use super::sql::{EXPIRES_7, FENCE, PK, RECORD_COLUMNS, log_append, prefixed};
use super::{Db, PgStore, citus_sql, decode, micros, retention_us};
use crate::idempotency::key::Scope;
use crate::idempotency::record::{Attempt, Record, Retention, Timestamp};
use crate::outbox::{EventPolicies, EventType};
use crate::store::contract::Queue;
use crate::store::{Claim, RetryNote, StoreError, Taken, WorkerRoute};
use async_trait::async_trait;
use std::sync::LazyLock;
use std::time::Duration;
use tokio_postgres::Row;
use uuid::Uuid;

/// Workers take the oldest due operations of their routes, up to `$6` in
/// one statement and one commit: each row is locked with `SKIP LOCKED` (a
/// concurrent take takes the next ones), drawn a new generation and its own
/// token (`$3[i]` for the `i`-th row taken), and leased for its route's lease.
pub(super) static TAKE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[], $7::int8[]) AS ro(operation, lease_us, sent_us)
), expired AS (
    -- A take-over: an attempt whose lease ran out (its worker died or is
    -- frozen) and that may run again (record::may_forward): nothing it was
    -- sent as may have executed, or the route in force deduplicates
    -- upstream ($5). The others are the reaper's (they become unknown). The
    -- locking read rechecks all this on the latest row version.
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           (SELECT max(ro.lease_us) FROM routes ro WHERE ro.operation = r.operation) AS lease_us,
           (SELECT max(ro.sent_us) FROM routes ro WHERE ro.operation = r.operation) AS sent_us, true AS took_over
    FROM idemgate_records r
    WHERE r.state = 'processing' AND r.lease_expires_at <= now() AND r.operation = ANY($1::text[])
      AND ((r.sent_at IS NULL AND NOT r.maybe_executed) OR r.operation = ANY($5::text[]))
    ORDER BY r.lease_expires_at
    LIMIT $6
    FOR UPDATE OF r SKIP LOCKED
), due AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           (SELECT max(ro.lease_us) FROM routes ro WHERE ro.operation = r.operation) AS lease_us,
           (SELECT max(ro.sent_us) FROM routes ro WHERE ro.operation = r.operation) AS sent_us, false AS took_over
    FROM idemgate_records r
    WHERE r.state = 'queued' AND r.next_attempt_at <= now() AND r.operation = ANY($1::text[])
    ORDER BY r.next_attempt_at
    LIMIT $6
    FOR UPDATE OF r SKIP LOCKED
), next AS (
    -- Take-overs first; `due` is not read (nor locked) when they fill the take.
    SELECT x.*, row_number() OVER () AS ord FROM (SELECT * FROM expired UNION ALL SELECT * FROM due LIMIT $6) x
)
-- The route's lease comes with the row found: joining the routes here would
-- let the planner look rows up by their operation alone.
UPDATE idemgate_records r SET
    state = 'processing', generation = nextval('idemgate_generation'), claim_token = ($3::uuid[])[n.ord], owner = $4,
    lease_expires_at = now() + n.lease_us * interval '1 microsecond', attempts = r.attempts + 1,
    -- A route whose upstream deduplicates is sent without a proof of its
    -- own: the take records the send and bounds its time at the upstream
    -- (`WorkerRoute::sent_on_take`, docs/async.md).
    sent_at = CASE WHEN n.sent_us IS NULL THEN NULL ELSE now() END,
    at_upstream_until = CASE WHEN n.sent_us IS NULL THEN r.at_upstream_until
                             ELSE greatest(r.at_upstream_until, now() + n.sent_us * interval '1 microsecond') END,
    -- Taken over although it was sent: it may have executed.
    maybe_executed = r.maybe_executed OR (r.state = 'processing' AND r.sent_at IS NOT NULL),
    next_attempt_at = NULL, updated_at = now()
FROM next n
WHERE r.scope_id = n.scope_id AND r.tenant = n.tenant AND r.principal = n.principal AND r.operation = n.operation
  AND r.idempotency_key = n.idempotency_key
RETURNING {}, now(), r.request, n.took_over",
        prefixed(RECORD_COLUMNS, "r.")
    )
});

/// Where `TAKE`'s (and `CITUS_TAKE`'s) own columns are, after the record's
/// and the clock ([`NOW`]).
pub(super) const TAKE_REQUEST: usize = NOW + 1;
pub(super) const TAKE_TOOK_OVER: usize = TAKE_REQUEST + 1;

/// One row of `TAKE` (or `CITUS_TAKE`): the record, the database clock, the
/// stored request and whether it was a take-over.
fn taken(row: &Row) -> Result<Taken, StoreError> {
    let record = decode(row)?;
    let request: Vec<u8> = row.try_get(TAKE_REQUEST).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let lease_expired: bool = row.try_get(TAKE_TOOK_OVER).map_err(|e| StoreError::Corrupt(e.to_string()))?;
    let claim = Claim {
        scope: record.scope.clone(),
        generation: record.generation,
        claim_token: record.claim_token,
        lease_expires_at: record.lease_expires_at.unwrap_or(record.updated_at),
        took_over: true,
        asked_at: tokio::time::Instant::now(),
    };
    Ok(Taken { record, request: request.into(), claim, lease_expired })
}

pub(super) static HEARTBEAT: LazyLock<String> = LazyLock::new(|| {
    format!("UPDATE idemgate_records SET lease_expires_at = now() + $7::int8 * interval '1 microsecond' WHERE {PK} AND {FENCE} RETURNING 1")
});

/// The send's time, and the end of its time at the upstream (`$7`, its
/// timeout, from now; the latest of the record's attempts').
pub(super) static MARK_SENT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET sent_at = now(), \
         at_upstream_until = greatest(at_upstream_until, now() + $7::int8 * interval '1 microsecond') \
         WHERE {PK} AND {FENCE} AND lease_expires_at > now() RETURNING 1"
    )
});

/// [`MARK_SENT`] for a batch of attempts (`$1`..`$8`, one array per
/// column, the scope ids then the timeouts last), each fenced by its own:
/// the ordinals (from 1) of those written. Concurrent attempts about to send
/// share one commit.
pub(super) static MARK_SENT_BATCH: &str = "\
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::uuid[], $7::int8[], $8::int8[])
        WITH ORDINALITY AS v(tenant, principal, operation, idempotency_key, generation, claim_token, scope_id, at_upstream_us, ord)
)
UPDATE idemgate_records r SET sent_at = now(),
    at_upstream_until = greatest(r.at_upstream_until, now() + v.at_upstream_us * interval '1 microsecond')
FROM v
WHERE r.scope_id = v.scope_id AND r.idempotency_key = v.idempotency_key
  AND r.tenant = v.tenant AND r.principal = v.principal AND r.operation = v.operation
  AND r.generation = v.generation AND r.claim_token = v.claim_token
  AND CASE r.state WHEN 'processing' THEN true ELSE false END AND r.lease_expires_at > now()
RETURNING v.ord";

/// An attempt about to send, and its timeout (see [`MARK_SENT`]).
#[derive(Debug)]
pub(super) struct Sending {
    pub scope: Scope,
    pub attempt: Attempt,
    pub at_upstream: Duration,
}

impl Db {
    /// `MARK_SENT_BATCH`; when it deadlocked (rolled back), each attempt by
    /// the single-row `MARK_SENT`.
    pub(super) async fn mark_sent_batch(&self, items: Vec<Sending>) -> Result<Vec<bool>, StoreError> {
        let cols = PkColumns::of(items.iter().map(|s| &s.scope));
        let generations: Vec<i64> = items.iter().map(|s| s.attempt.generation.0).collect();
        let tokens: Vec<Uuid> = items.iter().map(|s| s.attempt.claim_token).collect();
        let at_upstream: Vec<i64> = items.iter().map(|s| micros(s.at_upstream)).collect();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 8] =
            [&cols.tenants, &cols.principals, &cols.operations, &cols.keys, &generations, &tokens, &cols.scope_ids, &at_upstream];
        let rows = match self.bounded_query(MARK_SENT_BATCH, &params, true).await {
            Ok(rows) => rows,
            Err(e) if is_deadlock(&e) => {
                let mut out = Vec::with_capacity(items.len());
                for Sending { scope, attempt, at_upstream } in &items {
                    let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
                    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
                        [&t, &p, &o, &k, &attempt.generation.0, &attempt.claim_token, &micros(*at_upstream)];
                    let rows = self.bounded_query(&MARK_SENT, &params, true).await?;
                    out.push(!rows.is_empty());
                }
                return Ok(out);
            }
            Err(e) => return Err(e),
        };
        let mut out = vec![false; items.len()];
        for row in &rows {
            let ord: i64 = row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            if let Some(written) = usize::try_from(ord).ok().and_then(|o| o.checked_sub(1)).and_then(|o| out.get_mut(o)) {
                *written = true;
            }
        }
        Ok(out)
    }
}

pub(super) static REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'queued', lease_expires_at = NULL, sent_at = NULL, \
         next_attempt_at = now() + $7::int8 * interval '1 microsecond', last_status = $8, \
         maybe_executed = maybe_executed OR $9, updated_at = now() WHERE {PK} AND {FENCE} RETURNING 1"
    )
});

/// record::transition's Fail: never "failed_retryable" once an attempt may have run.
pub(super) static FAIL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET \
         state = CASE WHEN maybe_executed OR $9 THEN 'unknown' ELSE 'failed_retryable' END, \
         maybe_executed = maybe_executed OR $9, lease_expires_at = NULL, \
         expires_at = {EXPIRES_7}, last_status = $8, updated_at = now(), \
         request = CASE WHEN maybe_executed OR $9 THEN request END \
         WHERE {PK} AND {FENCE} \
         RETURNING tenant, principal, operation, idempotency_key, generation, state, last_status, operation_id), \
         ev AS ({}) \
         SELECT 1 FROM upd",
        log_append(
            "SELECT state, tenant, principal, operation, idempotency_key, generation, last_status, operation_id, NULL, NULL FROM upd \
             WHERE (state = 'unknown' AND $10) OR (state = 'failed_retryable' AND $11)"
        )
    )
});

pub(super) static OPERATION: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {RECORD_COLUMNS}, now() FROM idemgate_records WHERE tenant = $1 AND operation_id = $2"));

#[async_trait]
impl Queue for PgStore {
    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_tokens: &[Uuid]) -> Result<Vec<Taken>, StoreError> {
        let Some(&first_token) = claim_tokens.first() else { return Ok(Vec::new()) };
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let leases: Vec<i64> = routes.iter().map(|r| micros(r.lease)).collect();
        let reforwardable: Vec<&str> = routes.iter().filter(|r| r.reforwardable).map(|r| &*r.operation).collect();
        let sent_on_take: Vec<Option<i64>> = routes.iter().map(|r| r.sent_on_take.map(micros)).collect();
        let rows = match self.flavor {
            // One operation per take on Citus: its take goes tenant by tenant.
            Flavor::Citus => self.take_rows_citus(&ops, &leases, first_token, owner, &reforwardable).await?,
            Flavor::Postgres => {
                let limit = i64::try_from(claim_tokens.len()).unwrap_or(i64::MAX);
                self.query(&TAKE, &[&ops, &leases, &claim_tokens, &owner, &reforwardable, &limit, &sent_on_take], true).await?
            }
        };
        rows.iter().map(taken).collect()
    }

    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError> {
        self.fenced_update(&HEARTBEAT, scope, attempt, &[&micros(lease)]).await
    }

    async fn mark_sent(&self, scope: &Scope, attempt: Attempt, at_upstream: Duration) -> Result<bool, StoreError> {
        match &self.sends {
            Some(sends) => sends.submit(Sending { scope: scope.clone(), attempt, at_upstream }).await,
            None => self.fenced_update(&MARK_SENT, scope, attempt, &[&micros(at_upstream)]).await,
        }
    }

    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError> {
        self.fenced_update(&REQUEUE, scope, attempt, &[&micros(delay), &retry.last_status.map(i32::from), &retry.maybe_executed]).await
    }

    async fn fail(
        &self,
        scope: &Scope,
        attempt: Attempt,
        retention: Retention,
        retry: RetryNote,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let (unknown, failed) =
            (events.emits(&scope.operation, EventType::Unknown), events.emits(&scope.operation, EventType::FailedRetryable));
        if self.flavor == Flavor::Citus {
            let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
            let (retention, last_status) = (retention_us(retention), retry.last_status.map(i32::from));
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 9] =
                [&t, &p, &o, &k, &attempt.generation.0, &attempt.claim_token, &retention, &last_status, &retry.maybe_executed];
            let event = |state: &str| match state {
                "unknown" if unknown => Some(EventType::Unknown),
                "failed_retryable" if failed => Some(EventType::FailedRetryable),
                _ => None,
            };
            return self.write_with_event(&citus_sql::CITUS_FAIL, &params, unknown || failed, event, false).await;
        }
        self.fenced_update(
            &FAIL,
            scope,
            attempt,
            &[&retention_us(retention), &retry.last_status.map(i32::from), &retry.maybe_executed, &unknown, &failed],
        )
        .await
    }

    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let rows = self.query(&OPERATION, &[&tenant, &operation_id], false).await?;
        match rows.first() {
            None => Ok(None),
            Some(row) => {
                let now: Timestamp = row.try_get(NOW).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Some((decode(row)?, now)))
            }
        }
    }
}
