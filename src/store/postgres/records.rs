//! PostgreSQL: the claim, fenced results, reads, lists, retention and leases (the [`Records`] part of the store's contract).

use super::batch::{BatchClaim, BatchWrite, ClaimItem, CompleteItem, Emit, WriteItem, WriteOut};
use super::citus::Flavor;
use super::sql::NOW;
use super::sql::{EXPIRES_9, PK, RECORD_COLUMNS, log_append, prefixed};
use super::{PgStore, citus_sql, decode, retention_us};
use crate::idempotency::key::{Scope, ScopeId};
use crate::idempotency::record::{Attempt, Record, Retention, State, StoredResponse, Timestamp, may_take_over};
use crate::outbox::{EventPolicies, EventType};
use crate::store::codec::encode_headers;
use crate::store::contract::Records;
use crate::store::{Claim, ClaimRequest, ForeverCount, ListFilter, RawClaim, Reaped, StateCount, StoreError};
use async_trait::async_trait;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;
use uuid::Uuid;

/// The claim: one statement, autocommitted. It reads the scope's row, takes it
/// over if `record::may_take_over` allows (an UPDATE that re-checks the
/// condition on the latest row version), or inserts when there is none
/// (`ON CONFLICT DO NOTHING`). At most one of the two writes acts. When neither
/// does, nothing is written or locked, so a replay or a duplicate costs no
/// commit; the row seen is returned with the database clock.
///
/// With an operation id (`$10`) it is an async acceptance: the record starts
/// `queued` (due now, no lease) and keeps the request (`$11`) for the workers.
///
/// Returned: the row seen (`RECORD_COLUMNS`), `now()`, the inserted row's generation
/// and lease, the taken-over row's, and whether the row seen may be cached
/// (no resolution holds it out of the replay caches).
pub(super) static CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH cur AS (
    SELECT {RECORD_COLUMNS}, cache_hold_until
    FROM idemgate_records
    WHERE {PK}
), taken AS (
    UPDATE idemgate_records r SET
        request_hash = $5, state = CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END,
        generation = nextval('idemgate_generation'), claim_token = $6, owner = $7,
        lease_expires_at = CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), updated_at = now(), expires_at = now() + $8::int8 * interval '1 microsecond',
        operation_id = $10, request = $11, attempts = 0,
        next_attempt_at = CASE WHEN $10::text IS NOT NULL THEN now() END, sent_at = NULL, last_status = NULL, maybe_executed = false,
        key_source = $12, reforward_key = $13::text || ':' || $6::uuid::text, fingerprint_spec = $14::text || ':' || $6::uuid::text
    WHERE {PK}
      AND CASE r.state
            WHEN 'completed' THEN r.expires_at <= now()
            WHEN 'failed_retryable' THEN r.expires_at <= now()
            WHEN 'unknown' THEN r.reforward_key = $9::text || ':' || r.claim_token::text AND r.request_hash = $5 AND r.operation_id IS NULL
            WHEN 'in_flight' THEN r.reforward_key = $9::text || ':' || r.claim_token::text AND r.request_hash = $5 AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
            ELSE false
          END
    RETURNING r.generation, coalesce(r.lease_expires_at, now())
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id, reforward_key, fingerprint_spec)
    SELECT $1, $2, $3, $4, $5, CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), $6, $7,
           CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END, now(), now(),
           now() + $8::int8 * interval '1 microsecond', $10, $11, CASE WHEN $10::text IS NOT NULL THEN now() END, $12,
           idemgate_scope_id($1, $2, $3, $4), $13::text || ':' || $6::uuid::text, $14::text || ':' || $6::uuid::text
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
    RETURNING generation, coalesce(lease_expires_at, now())
)
SELECT {}, now(),
       (SELECT generation FROM inserted), (SELECT coalesce FROM inserted),
       (SELECT generation FROM taken), (SELECT coalesce FROM taken),
       NOT coalesce(cur.cache_hold_until > now(), false)
FROM (SELECT 1) AS one LEFT JOIN cur ON true",
        prefixed(RECORD_COLUMNS, "cur.")
    )
});

/// Where `CLAIM`'s own columns are in its row, after the record's and the
/// clock ([`NOW`]), in the order of its last `SELECT`.
pub(super) const CLAIM_INSERTED_GENERATION: usize = NOW + 1;
pub(super) const CLAIM_INSERTED_LEASE: usize = CLAIM_INSERTED_GENERATION + 1;
pub(super) const CLAIM_TAKEN_GENERATION: usize = CLAIM_INSERTED_LEASE + 1;
pub(super) const CLAIM_TAKEN_LEASE: usize = CLAIM_TAKEN_GENERATION + 1;
pub(super) const CLAIM_CACHEABLE: usize = CLAIM_TAKEN_LEASE + 1;

/// The claims of a batch as rows (`$1`..`$14`, one array per column),
/// inserted first: a new scope costs the insert's own primary-key descents
/// only, and only the claims that were not inserted read the row they met
/// (the statement's snapshot, so a row committed by another batch since is
/// neither read nor inserted: `BatchClaim::Conflict`). A claim of an
/// existing scope pays one descent more than a read alone would, and takes
/// a generation number it does not use. The inserted scope id is the
/// database's own (`idemgate_scope_id`); the gateway's (`$12`, the same
/// hash) only finds rows. The conflict names the key, not its columns.
const CLAIM_INPUT: &str = "\
input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::uuid[], $7::text[], $8::int8[],
                         $9::text[], $10::bytea[], $11::text[], $12::int8[], $13::text[], $14::text[])
        WITH ORDINALITY AS i(tenant, principal, operation, idempotency_key, request_hash, claim_token, owner, lease_us,
                             operation_id, request, key_source, scope_id, reforward_key, fingerprint_spec, ord)
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id, reforward_key, fingerprint_spec)
    SELECT i.tenant, i.principal, i.operation, i.idempotency_key, i.request_hash,
           CASE WHEN i.operation_id IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), i.claim_token, i.owner,
           CASE WHEN i.operation_id IS NULL THEN now() + i.lease_us * interval '1 microsecond' END, now(), now(),
           now() + i.lease_us * interval '1 microsecond', i.operation_id, i.request,
           CASE WHEN i.operation_id IS NOT NULL THEN now() END, i.key_source,
           idemgate_scope_id(i.tenant, i.principal, i.operation, i.idempotency_key),
           i.reforward_key || ':' || i.claim_token::text, i.fingerprint_spec || ':' || i.claim_token::text
    FROM input i
    ORDER BY i.scope_id, i.idempotency_key, i.tenant, i.principal, i.operation
    ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
    RETURNING claim_token, generation, coalesce(lease_expires_at, now()) AS lease
), cur AS (
    SELECT i.ord, r.tenant, r.principal, r.operation, r.idempotency_key, r.request_hash, r.state, r.generation, r.claim_token,
           r.owner, r.lease_expires_at, r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.expires_at,
           r.operation_id, r.attempts, r.next_attempt_at, r.sent_at, r.last_status, r.maybe_executed, r.key_source, r.reforward_key, r.fingerprint_spec, r.cache_hold_until
    FROM input i JOIN idemgate_records r
      ON r.scope_id = i.scope_id AND r.idempotency_key = i.idempotency_key
     AND r.tenant = i.tenant AND r.principal = i.principal AND r.operation = i.operation
    WHERE NOT EXISTS (SELECT 1 FROM inserted ins WHERE ins.claim_token = i.claim_token)
)";

/// What the batched claim returns per claim, in input order: the row seen
/// (`RECORD_COLUMNS`), `now()`, the inserted row's generation and lease, and whether
/// the row seen may be cached (as in `CLAIM`).
static CLAIM_OUTPUT: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {}, now(), ins.generation, ins.lease, NOT coalesce(c.cache_hold_until > now(), false)", prefixed(RECORD_COLUMNS, "c."))
});

/// Where `CLAIM_OUTPUT`'s own columns are, after the record's and the clock
/// ([`NOW`]); `WRITE_BATCH` adds the ordinals of the result writes that took
/// effect.
pub(super) const BATCH_INSERTED_GENERATION: usize = NOW + 1;
pub(super) const BATCH_INSERTED_LEASE: usize = BATCH_INSERTED_GENERATION + 1;
pub(super) const BATCH_CACHEABLE: usize = BATCH_INSERTED_LEASE + 1;
pub(super) const BATCH_WRITTEN: usize = BATCH_CACHEABLE + 1;

const CLAIM_FROM: &str = "\
FROM input i
LEFT JOIN cur c ON c.ord = i.ord
LEFT JOIN inserted ins ON ins.claim_token = i.claim_token
ORDER BY i.ord";

/// The result writes of a batch as rows (from `$n` on, one array per
/// column; the scope ids last), each fenced by its own attempt, and their
/// events.
fn complete_parts(first: usize) -> String {
    let p = |i: usize| format!("${}", first + i);
    format!(
        "\
v AS (
    SELECT * FROM unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::int8[], {}::int4[], {}::bytea[], {}::bytea[],
                         {}::int8[], {}::uuid[], {}::bool[], {}::bool[], {}::int8[])
        WITH ORDINALITY AS v(tenant, principal, operation, idempotency_key, generation, status, headers, body, retention_us, claim_token,
                             emit, with_body, scope_id, ord)
), upd AS (
    UPDATE idemgate_records r SET
        state = 'completed', response_status = v.status, response_headers = v.headers, response_body = v.body,
        lease_expires_at = NULL, updated_at = now(), request = NULL,
        expires_at = coalesce(now() + v.retention_us * interval '1 microsecond', 'infinity')
    FROM v
    WHERE r.scope_id = v.scope_id AND r.idempotency_key = v.idempotency_key
      AND r.tenant = v.tenant AND r.principal = v.principal AND r.operation = v.operation
      AND r.generation = v.generation AND r.claim_token = v.claim_token
      AND CASE r.state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END
    RETURNING v.ord, v.emit, v.with_body, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.response_status,
              r.operation_id, r.response_body
), ev AS (
    {}
)",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4),
        p(5),
        p(6),
        p(7),
        p(8),
        p(9),
        p(10),
        p(11),
        p(12),
        log_append(
            "SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL, \
             CASE WHEN with_body THEN response_body END FROM upd WHERE emit ORDER BY ord"
        ),
    )
}

/// The batched claim: like `CLAIM` for many scopes at once, but without the
/// take-over branch (the single-row statement does that). Rows are inserted
/// in primary-key order so that two batches never wait on each other in a
/// cycle; the answer comes back in input order.
pub(super) static CLAIM_BATCH: LazyLock<String> = LazyLock::new(|| format!("WITH {CLAIM_INPUT}\n{}\n{CLAIM_FROM}", *CLAIM_OUTPUT));

/// The batched result write (`$1`..`$13`), each row fenced by its own attempt.
pub(super) static COMPLETE_BATCH: LazyLock<String> = LazyLock::new(|| format!("WITH {}\nSELECT ord FROM upd", complete_parts(1)));

/// One commit for a batch of claims (`$1`..`$14`) and a batch of result
/// writes (`$15`..`$27`): the claims' rows as `CLAIM_BATCH` returns them,
/// each with the ordinals of the result writes that took effect.
pub(super) static WRITE_BATCH: LazyLock<String> = LazyLock::new(|| {
    format!("WITH {CLAIM_INPUT}, {}\n{}, (SELECT array_agg(ord) FROM upd)\n{CLAIM_FROM}", complete_parts(15), *CLAIM_OUTPUT)
});

/// The single-row result write: used when a batched statement deadlocked.
pub(super) static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET state = 'completed', response_status = $6, response_headers = $7, \
         response_body = $8, lease_expires_at = NULL, updated_at = now(), expires_at = {EXPIRES_9}, request = NULL \
         WHERE {PK} AND generation = $5 AND claim_token = $10 \
         AND CASE state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END \
         RETURNING tenant, principal, operation, idempotency_key, generation, response_status, operation_id, response_body), \
         ev AS ({}) \
         SELECT 1 FROM upd",
        log_append(
            "SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL, \
             CASE WHEN $12 THEN response_body END FROM upd WHERE $11"
        )
    )
});

pub(super) static GET: LazyLock<String> = LazyLock::new(|| format!("SELECT {RECORD_COLUMNS}, now() FROM idemgate_records WHERE {PK}"));

pub(super) static RELEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idemgate_records WHERE {PK} AND generation = $5 AND claim_token = $6 \
         AND CASE state WHEN 'in_flight' THEN true ELSE false END RETURNING 1"
    )
});

pub(super) static ABANDON: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idemgate_records WHERE {PK} AND claim_token = $5 \
         AND CASE state WHEN 'in_flight' THEN true ELSE false END RETURNING 1"
    )
});

pub(super) static MARK_UNKNOWN: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET state = 'unknown', updated_at = now() \
         WHERE {PK} AND generation = $5 AND claim_token = $7 \
         AND CASE state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END \
         AND (NOT $6::bool OR lease_expires_at IS NULL OR lease_expires_at <= now()) \
         RETURNING tenant, principal, operation, idempotency_key, generation, operation_id), \
         ev AS ({}) \
         SELECT 1 FROM upd",
        log_append(
            "SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL FROM upd WHERE $8"
        )
    )
});

/// Which filters a listing has; each combination is its own statement, so
/// that each is planned for its own index (a `$n IS NULL OR ...` test would
/// leave the planner no index to use).
///
/// - One of the open states (`in_flight`, `unknown`, ...): the records in that
///   state through the partial index of open states (the working set, small
///   whatever the table's size), then sorted. The sort key is written so that
///   no index provides it, which keeps the planner on that index.
/// - Otherwise: the newest records first through `idemgate_records_recent`,
///   skipping those the filters reject, until the page is full. Every other
///   filter is written so that no other index can serve it. A filter that
///   matches few of many records walks far: filter by state for those.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ListShape {
    /// `None`: any state; `Some(true)`: `completed`; `Some(false)`: one of the open states.
    pub state: Option<bool>,
    pub tenant: bool,
    pub operation: bool,
    pub forever: bool,
    pub cursor: bool,
}

/// `cond`, in a form the planner can neither use as an index condition nor
/// use to prove a partial index's predicate.
fn opaque(cond: &str) -> String {
    format!("CASE WHEN {cond} THEN true ELSE false END")
}

impl ListShape {
    /// Every combination, for the plan test.
    pub fn all() -> Vec<ListShape> {
        let mut all = Vec::new();
        for state in [None, Some(true), Some(false)] {
            for bits in 0..16u8 {
                all.push(ListShape {
                    state,
                    tenant: bits & 1 != 0,
                    operation: bits & 2 != 0,
                    forever: bits & 4 != 0,
                    cursor: bits & 8 != 0,
                });
            }
        }
        all
    }

    /// The statement. Its parameters, numbered in this order, only those the
    /// shape uses: the state, the tenant, the operation, the cursor
    /// (`updated_at` in microseconds since the epoch, then the four primary
    /// key columns), and last the limit.
    pub fn sql(self) -> String {
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        let open = self.state == Some(false);
        let mut conds: Vec<String> = Vec::new();
        if let Some(_state) = self.state {
            let p = next();
            conds.push(if open { format!("state = {p}::text AND state <> 'completed'") } else { opaque(&format!("state = {p}::text")) });
        }
        if self.tenant {
            conds.push(opaque(&format!("tenant = {}::text", next())));
        }
        if self.operation {
            conds.push(opaque(&format!("operation = {}::text", next())));
        }
        if self.forever {
            conds.push(opaque("expires_at = 'infinity'"));
        }
        if self.cursor {
            let at = format!("'epoch'::timestamptz + {}::int8 * interval '1 microsecond'", next());
            let (t, p, o, k) = (next(), next(), next(), next());
            let after = format!(
                "updated_at < {at} OR (tenant, principal, operation, idempotency_key) > ({t}::text, {p}::text, {o}::text, {k}::text)"
            );
            // Newest first: the recent index seeks to the cursor.
            conds.push(if open {
                opaque(&format!("updated_at <= {at} AND ({after})"))
            } else {
                format!("updated_at <= {at} AND ({after})")
            });
        }
        let mut sql = format!("SELECT {RECORD_COLUMNS} FROM idemgate_records");
        if !conds.is_empty() {
            sql.push_str(" WHERE ");
            sql.push_str(&conds.join(" AND "));
        }
        let newest = if open { "updated_at + interval '0 seconds'" } else { "updated_at" };
        sql.push_str(&format!(" ORDER BY {newest} DESC, tenant, principal, operation, idempotency_key LIMIT {}::int8", next()));
        sql
    }

    /// The index a listing of this shape uses.
    pub fn indexes(self) -> &'static [&'static str] {
        if self.state == Some(false) { &["idemgate_records_open"] } else { &["idemgate_records_recent"] }
    }
}

/// The records a log line's scope id names (`$1`), through the primary
/// key's first column.
pub(super) static BY_SCOPE_ID: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {RECORD_COLUMNS} FROM idemgate_records WHERE scope_id = $1"));

pub(super) const SWEEP: &str = "\
WITH doomed AS (
    SELECT scope_id, tenant, principal, operation, idempotency_key FROM idemgate_records
    WHERE state IN ('completed', 'failed_retryable') AND expires_at <= now()
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
DELETE FROM idemgate_records r USING doomed d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key AND r.expires_at <= now()
  AND CASE r.state WHEN 'completed' THEN true WHEN 'failed_retryable' THEN true ELSE false END
RETURNING 1";

/// record::transition's LeaseExpired, in SQL: sync attempts become unknown;
/// async ones go back to the queue when they never sent (no sent_at) or
/// their upstream deduplicates, else unknown.
///
/// The decision is made in the `UPDATE`, from `r`: the row `stale` locked, in
/// its latest committed version. Nothing may decide from a second read of
/// the table in this statement: that read sees the statement's starting
/// snapshot, which misses a `mark_sent` that committed between the start and
/// the lock, and re-queued an attempt already at the upstream (a second send).
/// `requeue` is told by the state the row was given.
pub(super) static REAP_LEASES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH stale AS (
    SELECT scope_id, tenant, principal, operation, idempotency_key FROM idemgate_records
    WHERE state IN ('in_flight', 'processing') AND (lease_expires_at IS NULL OR lease_expires_at <= now())
    ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
), upd AS (
UPDATE idemgate_records r SET
    state = CASE WHEN {REQUEUE_IF} THEN 'queued' ELSE 'unknown' END,
    lease_expires_at = CASE WHEN {REQUEUE_IF} THEN NULL ELSE r.lease_expires_at END,
    next_attempt_at = CASE WHEN {REQUEUE_IF} THEN now() ELSE r.next_attempt_at END,
    sent_at = CASE WHEN {REQUEUE_IF} THEN NULL ELSE r.sent_at END,
    -- Re-queued although it was sent: it may have executed.
    maybe_executed = r.maybe_executed OR ({REQUEUE_IF} AND r.sent_at IS NOT NULL),
    updated_at = now()
FROM stale d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key
  AND CASE r.state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END
  AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
RETURNING r.state = 'queued' AS requeue, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.operation_id
), ev AS (
    {}
)
SELECT requeue FROM upd",
        log_append(
            "SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL \
             FROM upd WHERE NOT requeue AND operation = ANY($3::text[])"
        )
    )
});

/// The reaper's re-queue rule on the row being updated (`r`, its values
/// before the update), `record::may_forward`: an async operation nothing of
/// which may have executed (this attempt never reached the upstream, no
/// earlier one's answer was lost), or one whose route in force deduplicates
/// upstream (`$2`, the re-forwardable operations).
const REQUEUE_IF: &str = "(r.state = 'processing' AND ((r.sent_at IS NULL AND NOT r.maybe_executed) OR r.operation = ANY($2::text[])))";

/// Records not yet completed, through the partial index of open states.
pub(super) const STATS: &str = "SELECT operation, state, count(*), min(created_at), min(updated_at), min(lease_expires_at) FROM idemgate_records \
     WHERE state <> 'completed' GROUP BY operation, state";

/// `unknown` records by age bucket (`width_bucket` over the bounds in
/// microseconds, `$1`): bucket `i` holds the records whose age reached `i`
/// bounds.
pub(super) const UNKNOWN_BY_AGE: &str = "SELECT width_bucket(extract(epoch FROM now() - updated_at) * 1000000, $1::float8[]), count(*) \
     FROM idemgate_records WHERE state = 'unknown' GROUP BY 1";

/// The literal matches the partial index's predicate, so this counts over
/// that index alone.
pub(super) const FOREVER_COUNTS: &str = "SELECT operation, count(*) FROM idemgate_records WHERE expires_at = 'infinity' GROUP BY operation";

#[async_trait]
impl Records for PgStore {
    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let rows = self.query(&GET, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()], false).await?;
        match rows.first() {
            None => Ok(None),
            Some(row) => {
                let now: Timestamp = row.try_get(NOW).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Some((decode(row)?, now)))
            }
        }
    }

    /// Claims through the batcher: one INSERT for all concurrent claims. A
    /// record that the batch found and that may be taken over goes through the
    /// single-row statement, which re-checks and takes it over atomically.
    async fn claim(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError> {
        if self.flavor == Flavor::Citus {
            return self.claim_citus(req).await;
        }
        let token = req.claim_token;
        let s = &req.scope;
        let item = ClaimItem::of(req, token);
        let WriteOut::Claim(out) = self.writes.submit(WriteItem::Claim(item)).await? else {
            return Err(StoreError::Corrupt("batched write: a claim answered as a result write".into()));
        };
        match out {
            BatchClaim::Inserted { generation, lease_expires_at } => Ok(RawClaim::Claimed(Claim {
                scope: s.clone(),
                generation,
                claim_token: token,
                lease_expires_at,
                took_over: false,
                asked_at: tokio::time::Instant::now(),
            })),
            BatchClaim::Existing(record, now, _) if may_take_over(&record, &req.request_hash, now, req.reforward) => {
                self.claim_one(req, token).await
            }
            BatchClaim::Existing(record, now, true) => Ok(RawClaim::Cacheable(*record, now)),
            BatchClaim::Existing(record, now, false) => Ok(RawClaim::Existing(*record, now)),
            BatchClaim::Conflict => Ok(RawClaim::Conflict),
            BatchClaim::Retry => self.claim_one(req, token).await,
        }
    }

    async fn abandon(&self, scope: &Scope, token: Uuid) -> Result<bool, StoreError> {
        let rows =
            self.query(&ABANDON, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str(), &token], true).await?;
        Ok(!rows.is_empty())
    }

    /// Records a result through the batcher: one UPDATE for all concurrent
    /// result writes, each fenced by its own attempt (generation and token).
    async fn complete(
        &self,
        scope: &Scope,
        attempt: Attempt,
        response: &StoredResponse,
        retention: Retention,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let emit = Emit::of(events, &scope.operation, EventType::Completed);
        if self.flavor == Flavor::Citus {
            // Not batched across scopes on Citus (see `citus_sql::catalog_for`).
            return self.complete_one(scope, attempt, response, retention, emit).await;
        }
        let item = CompleteItem {
            scope: scope.clone(),
            attempt,
            status: i32::from(response.status),
            headers: encode_headers(&response.headers),
            body: response.body.clone(),
            retention_us: retention_us(retention),
            emit,
        };
        let WriteOut::Complete(out) = self.writes.submit(WriteItem::Complete(item)).await? else {
            return Err(StoreError::Corrupt("batched write: a result write answered as a claim".into()));
        };
        match out {
            BatchWrite::Written => Ok(true),
            BatchWrite::Fenced => Ok(false),
            BatchWrite::Retry => self.complete_one(scope, attempt, response, retention, emit).await,
        }
    }

    async fn release(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let rows = self
            .query(
                &RELEASE,
                &[
                    &&*scope.tenant,
                    &&*scope.principal,
                    &&*scope.operation,
                    &scope.key.as_str(),
                    &attempt.generation.0,
                    &attempt.claim_token,
                ],
                true,
            )
            .await?;
        Ok(!rows.is_empty())
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        attempt: Attempt,
        only_if_lease_expired: bool,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let emit = events.emits(&scope.operation, EventType::Unknown);
        if self.flavor == Flavor::Citus {
            let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
                [&t, &p, &o, &k, &attempt.generation.0, &only_if_lease_expired, &attempt.claim_token];
            return self.write_with_event(&citus_sql::CITUS_MARK_UNKNOWN, &params, emit, |_| Some(EventType::Unknown), false).await;
        }
        let rows = self
            .query(
                &MARK_UNKNOWN,
                &[
                    &&*scope.tenant,
                    &&*scope.principal,
                    &&*scope.operation,
                    &scope.key.as_str(),
                    &attempt.generation.0,
                    &only_if_lease_expired,
                    &attempt.claim_token,
                    &emit,
                ],
                true,
            )
            .await?;
        Ok(!rows.is_empty())
    }

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        // Keyset pagination: after the cursor's record in the list's order
        // (updated_at descending, then the primary key ascending). One
        // statement per combination of filters (see `ListShape`).
        let shape = ListShape {
            state: filter.state.map(|s| s == State::Completed),
            tenant: filter.tenant.is_some(),
            operation: filter.operation.is_some(),
            forever: filter.forever,
            cursor: filter.cursor.is_some(),
        };
        let state = filter.state.map(State::as_str);
        let limit = i64::from(filter.limit);
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::with_capacity(9);
        if let Some(state) = &state {
            params.push(state);
        }
        if let Some(tenant) = &filter.tenant {
            params.push(tenant);
        }
        if let Some(operation) = &filter.operation {
            params.push(operation);
        }
        let cursor = filter
            .cursor
            .as_ref()
            .map(|c| (c.updated_at.0, &*c.scope.tenant, &*c.scope.principal, &*c.scope.operation, c.scope.key.as_str()));
        if let Some((at, t, p, o, k)) = &cursor {
            params.extend_from_slice(&[at, t, p, o, k]);
        }
        params.push(&limit);
        let rows = self.query(&shape.sql(), &params, false).await?;
        rows.iter().map(decode).collect()
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        if self.flavor == Flavor::Citus {
            return self.sweep_citus(batch).await;
        }
        Ok(self.query(SWEEP, &[&i64::from(batch)], true).await?.len() as u64)
    }

    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError> {
        let ops: Vec<&str> = reforwardable.iter().map(|o| &**o).collect();
        let emitting = events.operations_emitting(EventType::Unknown);
        let rows = match self.flavor {
            Flavor::Citus => self.reap_rows_citus(batch, &ops, &emitting).await?,
            Flavor::Postgres => self.query(&REAP_LEASES, &[&i64::from(batch), &ops, &emitting], true).await?,
        };
        let mut reaped = Reaped::default();
        for row in &rows {
            if row.try_get::<_, bool>(0).map_err(|e| StoreError::Corrupt(e.to_string()))? {
                reaped.requeued += 1;
            } else {
                reaped.unknown += 1;
            }
        }
        Ok(reaped)
    }

    async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = self.query(STATS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter()
            .map(|row| {
                let state: &str = row.try_get(1).map_err(c)?;
                Ok(StateCount {
                    operation: row.try_get(0).map_err(c)?,
                    state: State::parse(state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?,
                    count: row.try_get(2).map_err(c)?,
                    oldest_created_at: row.try_get(3).map_err(c)?,
                    oldest_updated_at: row.try_get(4).map_err(c)?,
                    earliest_lease_expiry: row.try_get(5).map_err(c)?,
                })
            })
            .collect()
    }

    async fn unknown_by_age(&self, bounds: &[Duration]) -> Result<Vec<u64>, StoreError> {
        let micros: Vec<f64> = bounds.iter().map(|b| b.as_micros() as f64).collect();
        let rows = self.query(UNKNOWN_BY_AGE, &[&micros], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let mut counts = vec![0u64; bounds.len() + 1];
        for row in rows {
            let (bucket, count): (i32, i64) = (row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?);
            let slot = usize::try_from(bucket).unwrap_or(0).min(bounds.len());
            counts[slot] += u64::try_from(count).unwrap_or(0);
        }
        Ok(counts)
    }

    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        let rows = self.query(FOREVER_COUNTS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter().map(|row| Ok(ForeverCount { operation: row.try_get(0).map_err(c)?, count: row.try_get(1).map_err(c)? })).collect()
    }

    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        let rows = self.query(&BY_SCOPE_ID, &[&id.to_i64()], false).await?;
        rows.iter().map(decode).collect()
    }

    /// None: migration 0011 gave every record its scope id (`NOT NULL`).
    async fn scopes_without_id(&self, _after: Option<&Scope>, _limit: u32) -> Result<Vec<Scope>, StoreError> {
        Ok(Vec::new())
    }

    async fn add_fingerprint_specs(&self, specs: &[(String, String)]) -> Result<(), StoreError> {
        let (operations, texts): (Vec<&str>, Vec<&str>) = specs.iter().map(|(o, s)| (o.as_str(), s.as_str())).unzip();
        self.query(ADD_FINGERPRINT_SPECS, &[&operations, &texts], true).await.map(drop)
    }

    async fn fingerprint_specs(&self) -> Result<Vec<(String, String)>, StoreError> {
        let rows = self.query(FINGERPRINT_SPECS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter().map(|row| Ok((row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?))).collect()
    }
}

/// The fingerprint settings of a configuration's routes (migration 0019),
/// each pair once.
const ADD_FINGERPRINT_SPECS: &str = "INSERT INTO idemgate_fingerprint_specs (operation, spec) \
     SELECT * FROM unnest($1::text[], $2::text[]) ON CONFLICT DO NOTHING";

/// Every operation's fingerprint settings, oldest first.
const FINGERPRINT_SPECS: &str = "SELECT operation, spec FROM idemgate_fingerprint_specs ORDER BY registered_at, operation, spec";
