//! The PostgreSQL backend: every protocol step is one short autocommit
//! statement; no transaction is ever held across an upstream call.

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::types::{FromSql, Type};
use tokio_postgres::{NoTls, Row};
use uuid::Uuid;

use super::codec::{decode_headers, encode_headers};
use super::migrations::{DERIVED_KEY_SECRET, PG_LOCK_KEY, POSTGRES, fresh_secret};
use super::{
    Acceptance, Claim, ClaimRequest, EventStats, ForeverCount, ListFilter, ProbeFence, ProbeRoute, Probing, RawClaim, Reaped, RecordStore,
    Resolution, ResolveOutcome, RetryNote, StateCount, StoreError, Taken, WorkerRoute,
};
use crate::audit::{self, AuditEntry, AuditNote};
use crate::fingerprint::Fingerprint;
use crate::logging::ErrorChain;
use crate::outbox::{Delivery, EventPolicies, EventType, OutboxEvent};
use crate::record::{Attempt, Generation, Next, Record, Refused, State, StoredResponse, Timestamp, may_take_over, transition};
use crate::route::Retention;
use crate::scope::{IdempotencyKey, Scope, ScopeId};
use async_trait::async_trait;
use std::sync::Arc;

/// Microseconds between the Unix epoch and PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

impl<'a> FromSql<'a> for Timestamp {
    fn from_sql(_: &Type, raw: &'a [u8]) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let bytes: [u8; 8] = raw.try_into().map_err(|_| "timestamptz must be 8 bytes")?;
        Ok(Timestamp(i64::from_be_bytes(bytes).saturating_add(PG_EPOCH_OFFSET_MICROS)))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::TIMESTAMPTZ
    }
}

const COLUMNS: &str = "tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner, \
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at, \
     operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source";
/// How many columns `COLUMNS` has: the next column of a row is at this index.
const NCOLS: usize = 23;

/// The claim: one statement, autocommitted. It reads the scope's row, takes it
/// over if `record::may_take_over` allows (an UPDATE that re-checks the
/// condition on the latest row version), or inserts when there is none
/// (`ON CONFLICT DO NOTHING`). At most one of the two writes acts. When neither
/// does, nothing is written or locked, so a replay or a duplicate costs no
/// commit; the row seen is returned with the database clock.
///
/// With an operation id (`$10`) it is an async acceptance: the record starts
/// `queued` (due now, no lease) and keeps the request (`$11`) for the workers.
const CLAIM: &str = "\
WITH cur AS (
    SELECT tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
           lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at,
           operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source
    FROM idemgate_records
    WHERE tenant = $1 AND principal = $2 AND operation = $3 AND idempotency_key = $4
), taken AS (
    UPDATE idemgate_records r SET
        request_hash = $5, state = CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END,
        generation = nextval('idemgate_generation'), claim_token = $6, owner = $7,
        lease_expires_at = CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), updated_at = now(), expires_at = now() + $8::int8 * interval '1 microsecond',
        operation_id = $10, request = $11, attempts = 0,
        next_attempt_at = CASE WHEN $10::text IS NOT NULL THEN now() END, sent_at = NULL, last_status = NULL, maybe_executed = false,
        key_source = $12,
        scope_id = $13
    WHERE r.tenant = $1 AND r.principal = $2 AND r.operation = $3 AND r.idempotency_key = $4
      AND ((r.state IN ('completed', 'failed_retryable') AND r.expires_at <= now())
           OR ($9::bool AND r.request_hash = $5
               AND (r.state = 'unknown' OR (r.state = 'in_flight' AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())))))
    RETURNING r.generation, coalesce(r.lease_expires_at, now())
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id)
    SELECT $1, $2, $3, $4, $5, CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), $6, $7,
           CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END, now(), now(),
           now() + $8::int8 * interval '1 microsecond', $10, $11, CASE WHEN $10::text IS NOT NULL THEN now() END, $12, $13
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (tenant, principal, operation, idempotency_key) DO NOTHING
    RETURNING generation, coalesce(lease_expires_at, now())
)
SELECT cur.*, now(),
       (SELECT generation FROM inserted), (SELECT coalesce FROM inserted),
       (SELECT generation FROM taken), (SELECT coalesce FROM taken)
FROM (SELECT 1) AS one LEFT JOIN cur ON true";

/// A worker takes the oldest due operation of its routes: the row is locked
/// with `SKIP LOCKED` (a concurrent worker takes the next one), drawn a new
/// generation and token, and leased for its route's lease.
const TAKE: &str = "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[]) AS ro(operation, lease_us)
), next AS (
    SELECT r.tenant, r.principal, r.operation, r.idempotency_key
    FROM idemgate_records r
    WHERE r.state = 'queued' AND r.next_attempt_at <= now() AND r.operation = ANY($1::text[])
    ORDER BY r.next_attempt_at
    LIMIT 1
    FOR UPDATE SKIP LOCKED
)
UPDATE idemgate_records r SET
    state = 'processing', generation = nextval('idemgate_generation'), claim_token = $3, owner = $4,
    lease_expires_at = now() + ro.lease_us * interval '1 microsecond', attempts = r.attempts + 1, sent_at = NULL,
    next_attempt_at = NULL, updated_at = now()
FROM next n, routes ro
WHERE r.tenant = n.tenant AND r.principal = n.principal AND r.operation = n.operation AND r.idempotency_key = n.idempotency_key
  AND ro.operation = r.operation
RETURNING r.tenant, r.principal, r.operation, r.idempotency_key, r.request_hash, r.state, r.generation, r.claim_token, r.owner,
          r.lease_expires_at, r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.expires_at,
          r.operation_id, r.attempts, r.next_attempt_at, r.sent_at, r.last_status, r.maybe_executed, r.key_source, now(), r.request";

/// A fenced async write: the attempt's generation and token, `processing`.
const FENCE: &str = "generation = $5 AND claim_token = $6 AND state = 'processing'";

const KIND: &str = "postgres";

const PK: &str = "tenant = $1 AND principal = $2 AND operation = $3 AND idempotency_key = $4";

mod batch;
mod failover;

use batch::Batcher;
use failover::{Flush, HostWalk, Verdict};

/// The pool, shared by the store and its batchers.
#[derive(Debug, Clone)]
struct Db {
    pool: Pool,
    /// Bound on a batched statement. (Single statements are bounded by the
    /// `Store` facade; a batch outlives any one caller, so it bounds itself:
    /// past this its connection is discarded, never returned to the pool.)
    timeout: Duration,
    /// Set when a statement shows the server is no longer the writable
    /// primary: connections opened before are not reused (see `failover`).
    flush: Arc<Flush>,
}

impl Db {
    async fn conn(&self) -> Result<Conn, StoreError> {
        match self.pool.get().await {
            Ok(c) => Ok(Conn(Some(c))),
            Err(e) => Err(StoreError::Unavailable(format!("no database connection: {}", ErrorChain(&e)))),
        }
    }

    /// Runs one statement on a pooled connection and returns its rows.
    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)], write: bool) -> Result<Vec<Row>, StoreError> {
        let conn = self.conn().await?;
        let stmt = match conn.client().prepare_cached(sql).await {
            Ok(stmt) => stmt,
            Err(e) => return Err(self.failed(conn, e, false)),
        };
        match conn.client().query(&stmt, params).await {
            Ok(rows) => {
                conn.done();
                Ok(rows)
            }
            Err(e) => Err(self.failed(conn, e, write)),
        }
    }

    /// What a failed statement means for its connection (kept, discarded, or
    /// discarded with every connection to a server that may no longer be the
    /// primary; see `failover`), and for the caller (`classify`).
    fn failed(&self, conn: Conn, e: tokio_postgres::Error, write: bool) -> StoreError {
        match failover::verdict(&e) {
            Verdict::Keep => conn.done(),
            Verdict::Discard => drop(conn),
            Verdict::Failover => {
                drop(conn);
                self.flush.now(&self.pool, &e.to_string());
            }
        }
        classify(e, write)
    }
}

#[derive(Debug)]
pub struct PgStore {
    db: Db,
    /// Concurrent claims share one INSERT (see `batch`).
    claims: Batcher<ClaimItem, BatchClaim>,
    /// Concurrent result writes share one UPDATE.
    completes: Batcher<CompleteItem, BatchWrite>,
}

/// Bound on a readiness ping: `/readyz` must answer within about a second
/// even when the primary went silent (the operation timeout is longer).
const PING_BOUND: Duration = Duration::from_millis(800);

/// Most requests one batched statement carries.
const MAX_BATCH: usize = 128;
/// Batched statements of one kind running at once.
const BATCH_CONCURRENCY: usize = 4;

/// A pooled connection that is discarded, not returned to the pool, unless the
/// operation using it finished cleanly: after a timeout or I/O error the
/// connection may be blackholed or mid-protocol.
struct Conn(Option<Object>);

impl Conn {
    fn client(&self) -> &Object {
        // Always Some until `Drop`.
        self.0.as_ref().unwrap_or_else(|| unreachable!("connection used after drop"))
    }

    fn client_mut(&mut self) -> &mut Object {
        self.0.as_mut().unwrap_or_else(|| unreachable!("connection used after drop"))
    }

    fn done(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            drop(Object::take(obj));
        }
    }
}

fn classify(e: tokio_postgres::Error, write: bool) -> StoreError {
    if let Some(db) = e.as_db_error() {
        // The server answered with an error: the statement did not take effect.
        return StoreError::Unavailable(format!("database error {}: {}", db.code().code(), db.message()));
    }
    let text = ErrorChain(&e).to_string();
    if write { StoreError::Ambiguous(text) } else { StoreError::Unavailable(text) }
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A retention as the statements take it: microseconds, or NULL for
/// forever. `now() + NULL * interval` is NULL, which the `EXPIRES_*`
/// expressions turn into `'infinity'` (later than any `now()`, so every
/// `expires_at <= now()` test stays false: never taken over, never swept).
fn retention_us(r: Retention) -> Option<i64> {
    r.finite().map(micros)
}

/// `expires_at` from a retention parameter (`retention_us`) at `$7`, `$8`, `$9`.
const EXPIRES_7: &str = "coalesce(now() + $7::int8 * interval '1 microsecond', 'infinity')";
const EXPIRES_8: &str = "coalesce(now() + $8::int8 * interval '1 microsecond', 'infinity')";
const EXPIRES_9: &str = "coalesce(now() + $9::int8 * interval '1 microsecond', 'infinity')";

impl PgStore {
    pub fn connect(url: &str, pool_size: usize, timeout: Duration) -> Result<PgStore, StoreError> {
        // sslmode and sslrootcert as libpq reads them (see crate::tls::postgres).
        let parsed =
            crate::tls::postgres::parse(url).map_err(|e| StoreError::Unavailable(format!("invalid database URL: {}", ErrorChain(&e))))?;
        let tls = parsed.tls;
        let mut pg = parsed.config;
        if pg.get_application_name().is_none() {
            pg.application_name("idemgate");
        }
        // The batched statements take arrays; left to itself PostgreSQL keeps
        // re-planning them per execution (custom plans), which doubled their
        // cost in the benchmark. Every statement idemgate sends is a prepared
        // primary-key or index access, so the generic plan is always right.
        //
        // statement_timeout: a statement the gateway gave up on (its operation
        // timed out, so it answered and may have abandoned a claim) must not
        // go on and commit later; the server cancels it at the same bound.
        let ours = format!("-c plan_cache_mode=force_generic_plan -c statement_timeout={}", timeout.as_millis().max(1));
        let options = match pg.get_options() {
            Some(o) if !o.is_empty() => format!("{o} {ours}"),
            _ => ours,
        };
        pg.options(&options);
        // Only a primary will do (see `failover`): a standby, or a primary
        // fenced read-only, refuses the session when it is opened.
        pg.target_session_attrs(TargetSessionAttrs::ReadWrite);
        let recycling = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match tls {
            Some(tls) => {
                let walk = HostWalk::new(&pg, timeout, tokio_postgres_rustls::MakeRustlsConnect::new(tls));
                Manager::from_connect(pg, walk, recycling)
            }
            None => Manager::from_connect(pg.clone(), HostWalk::new(&pg, timeout, NoTls), recycling),
        };
        let flush = Arc::new(Flush::default());
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .pre_recycle(Flush::hook(flush.clone()))
            .build()
            .map_err(|e| StoreError::Unavailable(format!("cannot build the connection pool: {e}")))?;
        let db = Db { pool, timeout, flush };
        let claims = {
            let db = db.clone();
            Batcher::start("claims", MAX_BATCH, BATCH_CONCURRENCY, move |items| {
                let db = db.clone();
                async move { db.claim_batch(items).await }
            })
        };
        let completes = {
            let db = db.clone();
            Batcher::start("completes", MAX_BATCH, BATCH_CONCURRENCY, move |items| {
                let db = db.clone();
                async move { db.complete_batch(items).await }
            })
        };
        Ok(PgStore { db, claims, completes })
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        self.db.conn().await
    }

    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)], write: bool) -> Result<Vec<Row>, StoreError> {
        self.db.query(sql, params, write).await
    }

    /// The single-row claim: used when a batch found a record that may be taken over.
    async fn claim_one(&self, req: &ClaimRequest, token: Uuid) -> Result<RawClaim, StoreError> {
        let s = &req.scope;
        let rows = self
            .query(
                CLAIM,
                &[
                    &&*s.tenant,
                    &&*s.principal,
                    &&*s.operation,
                    &s.key.as_str(),
                    &&req.request_hash.0[..],
                    &token,
                    &&*req.owner,
                    &micros(req.lease),
                    &(req.upstream_idempotent && req.acceptance.is_none()),
                    &req.acceptance.as_ref().map(|a| a.operation_id.as_str()),
                    &req.acceptance.as_ref().map(|a| &a.request[..]).or(req.request_head.as_deref()),
                    &&*req.key_source,
                    &s.scope_id().to_i64(),
                ],
                true,
            )
            .await?;
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("claim returned no row".into()))?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let claimed = |generation: i64, lease: Timestamp, took_over: bool| {
            RawClaim::Claimed(Claim {
                scope: s.clone(),
                generation: Generation(generation),
                claim_token: token,
                lease_expires_at: lease,
                took_over,
            })
        };
        let pair = |i: usize| -> Result<Option<(i64, Timestamp)>, StoreError> {
            Ok(row.try_get::<_, Option<i64>>(i).map_err(c)?.zip(row.try_get::<_, Option<Timestamp>>(i + 1).map_err(c)?))
        };
        if let Some((g, lease)) = pair(NCOLS + 1)? {
            return Ok(claimed(g, lease, false));
        }
        if let Some((g, lease)) = pair(NCOLS + 3)? {
            return Ok(claimed(g, lease, true));
        }
        if row.try_get::<_, Option<&str>>(0).map_err(c)?.is_none() {
            return Ok(RawClaim::Conflict);
        }
        let now: Timestamp = row.try_get(NCOLS).map_err(c)?;
        Ok(RawClaim::Existing(decode(row)?, now))
    }

    /// The single-row result write: used when a batched statement deadlocked.
    async fn complete_one(
        &self,
        scope: &Scope,
        attempt: Attempt,
        response: &StoredResponse,
        retention: Retention,
        emit: Emit,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "WITH upd AS (UPDATE idemgate_records SET state = 'completed', response_status = $6, response_headers = $7, \
             response_body = $8, lease_expires_at = NULL, updated_at = now(), expires_at = {EXPIRES_9} \
             WHERE {PK} AND generation = $5 AND claim_token = $10 AND state IN ('in_flight', 'processing') \
             RETURNING tenant, principal, operation, idempotency_key, generation, response_status, operation_id, response_body), \
             ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
             SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL, \
             CASE WHEN $12 THEN response_body END FROM upd WHERE $11) \
             SELECT 1 FROM upd"
        );
        let headers = encode_headers(&response.headers);
        let body: Option<&[u8]> = response.body.as_deref();
        let rows = self
            .query(
                &sql,
                &[
                    &&*scope.tenant,
                    &&*scope.principal,
                    &&*scope.operation,
                    &scope.key.as_str(),
                    &attempt.generation.0,
                    &i32::from(response.status),
                    &headers,
                    &body,
                    &retention_us(retention),
                    &attempt.claim_token,
                    &emit.event,
                    &emit.body,
                ],
                true,
            )
            .await?;
        Ok(!rows.is_empty())
    }
}

#[async_trait]
impl RecordStore for PgStore {
    fn kind(&self) -> &'static str {
        KIND
    }

    async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        let tx = conn.client_mut().transaction().await.map_err(|e| StoreError::Migration(ErrorChain(&e).to_string()))?;
        let m = |e: tokio_postgres::Error| StoreError::Migration(ErrorChain(&e).to_string());
        // Migrations may take longer than one protocol statement.
        tx.batch_execute("SET LOCAL statement_timeout = 0").await.map_err(m)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PG_LOCK_KEY]).await.map_err(m)?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS idemgate_schema_migrations (
                version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .map_err(m)?;
        let done: Vec<i64> =
            tx.query("SELECT version FROM idemgate_schema_migrations", &[]).await.map_err(m)?.iter().map(|r| r.get(0)).collect();
        let mut applied = Vec::new();
        for mig in POSTGRES.iter().filter(|mig| !done.contains(&mig.version)) {
            tx.batch_execute(mig.sql).await.map_err(|e| StoreError::Migration(format!("{}: {}", mig.name, ErrorChain(&e))))?;
            tx.execute("INSERT INTO idemgate_schema_migrations (version, name) VALUES ($1, $2)", &[&mig.version, &mig.name])
                .await
                .map_err(m)?;
            applied.push(mig.name.to_owned());
        }
        // The derived-key secret, once per deployment: every replica reads
        // the same row.
        tx.execute(
            "INSERT INTO idemgate_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            &[&DERIVED_KEY_SECRET, &fresh_secret()],
        )
        .await
        .map_err(m)?;
        tx.commit().await.map_err(m)?;
        conn.done();
        Ok(applied)
    }

    /// Ready means connected to a primary that takes writes, within
    /// `PING_BOUND`. A ping that runs out of time, or reaches a read-only
    /// server, lets go of the pooled connections (see `failover`).
    async fn ping(&self) -> Result<(), StoreError> {
        let probe = self.query("SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'", &[], false);
        let Ok(rows) = tokio::time::timeout(PING_BOUND, probe).await else {
            self.db.flush.now(&self.db.pool, "the database did not answer a ping in time");
            return Err(StoreError::Unavailable(format!("the database did not answer a ping within {PING_BOUND:?}")));
        };
        let rows = rows?;
        let read_only: bool = rows.first().and_then(|r| r.try_get(0).ok()).unwrap_or(true);
        if read_only {
            self.db.flush.now(&self.db.pool, "the server is read-only");
            return Err(StoreError::Unavailable("connected to a read-only server (a standby, or a fenced primary)".into()));
        }
        Ok(())
    }

    async fn now(&self) -> Result<Timestamp, StoreError> {
        let rows = self.query("SELECT now()", &[], false).await?;
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("SELECT now() returned no row".into()))?;
        row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))
    }

    /// Claims through the batcher: one INSERT for all concurrent claims. A
    /// record that the batch found and that may be taken over goes through the
    /// single-row statement, which re-checks and takes it over atomically.
    async fn claim(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError> {
        let token = req.claim_token;
        let s = &req.scope;
        let item = ClaimItem {
            scope: s.clone(),
            request_hash: req.request_hash,
            token,
            owner: req.owner.clone(),
            lease_us: micros(req.lease),
            acceptance: req.acceptance.clone(),
            key_source: req.key_source.clone(),
            request_head: req.request_head.clone(),
        };
        match self.claims.submit(item).await? {
            BatchClaim::Inserted { generation, lease_expires_at } => {
                Ok(RawClaim::Claimed(Claim { scope: s.clone(), generation, claim_token: token, lease_expires_at, took_over: false }))
            }
            BatchClaim::Existing(record, now) if may_take_over(&record, &req.request_hash, now, req.upstream_idempotent) => {
                self.claim_one(req, token).await
            }
            BatchClaim::Existing(record, now) => Ok(RawClaim::Existing(*record, now)),
            BatchClaim::Conflict => Ok(RawClaim::Conflict),
            BatchClaim::Retry => self.claim_one(req, token).await,
        }
    }

    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let sql = format!("SELECT {COLUMNS}, now() FROM idemgate_records WHERE {PK}");
        let rows = self.query(&sql, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()], false).await?;
        match rows.first() {
            None => Ok(None),
            Some(row) => {
                let now: Timestamp = row.try_get(NCOLS).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Some((decode(row)?, now)))
            }
        }
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
        let item = CompleteItem {
            scope: scope.clone(),
            attempt,
            status: i32::from(response.status),
            headers: encode_headers(&response.headers),
            body: response.body.clone(),
            retention_us: retention_us(retention),
            emit,
        };
        match self.completes.submit(item).await? {
            BatchWrite::Written => Ok(true),
            BatchWrite::Fenced => Ok(false),
            BatchWrite::Retry => self.complete_one(scope, attempt, response, retention, emit).await,
        }
    }

    async fn release(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let sql =
            format!("DELETE FROM idemgate_records WHERE {PK} AND generation = $5 AND claim_token = $6 AND state = 'in_flight' RETURNING 1");
        let rows = self
            .query(
                &sql,
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

    async fn abandon(&self, scope: &Scope, token: Uuid) -> Result<bool, StoreError> {
        let sql = format!("DELETE FROM idemgate_records WHERE {PK} AND claim_token = $5 AND state = 'in_flight' RETURNING 1");
        let rows = self.query(&sql, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str(), &token], true).await?;
        Ok(!rows.is_empty())
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        attempt: Attempt,
        only_if_lease_expired: bool,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "WITH upd AS (UPDATE idemgate_records SET state = 'unknown', updated_at = now() \
             WHERE {PK} AND generation = $5 AND claim_token = $7 AND state IN ('in_flight', 'processing') \
             AND (NOT $6::bool OR lease_expires_at IS NULL OR lease_expires_at <= now()) \
             RETURNING tenant, principal, operation, idempotency_key, generation, operation_id), \
             ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
             SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL FROM upd WHERE $8) \
             SELECT 1 FROM upd"
        );
        let emit = events.emits(&scope.operation, EventType::Unknown);
        let rows = self
            .query(
                &sql,
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
        // (updated_at descending, then the primary key ascending).
        let sql = format!(
            "SELECT {COLUMNS} FROM idemgate_records \
             WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR tenant = $2) AND ($3::text IS NULL OR operation = $3) \
             AND (NOT $5::bool OR expires_at = 'infinity') \
             AND ($6::int8 IS NULL OR updated_at < 'epoch'::timestamptz + $6::int8 * interval '1 microsecond' \
                  OR (updated_at = 'epoch'::timestamptz + $6::int8 * interval '1 microsecond' \
                      AND (tenant, principal, operation, idempotency_key) > ($7::text, $8::text, $9::text, $10::text))) \
             ORDER BY updated_at DESC, tenant, principal, operation, idempotency_key LIMIT $4"
        );
        let state = filter.state.map(State::as_str);
        let limit = i64::from(filter.limit);
        let c = filter.cursor.as_ref();
        let at = c.map(|c| c.updated_at.0);
        let (t, p, o, k) =
            (c.map(|c| &*c.scope.tenant), c.map(|c| &*c.scope.principal), c.map(|c| &*c.scope.operation), c.map(|c| c.scope.key.as_str()));
        let rows =
            self.query(&sql, &[&state, &filter.tenant, &filter.operation, &limit, &filter.forever, &at, &t, &p, &o, &k], false).await?;
        rows.iter().map(decode).collect()
    }

    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
    ) -> Result<ResolveOutcome, StoreError> {
        let mut conn = self.conn().await?;
        let w = |e| classify(e, true);
        let tx = conn.client_mut().transaction().await.map_err(w)?;
        let sql = format!("SELECT {COLUMNS}, now() FROM idemgate_records WHERE {PK} FOR UPDATE");
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()];
        let rows = tx.query(&sql, &params).await.map_err(w)?;
        let Some(row) = rows.first() else {
            tx.rollback().await.map_err(w)?;
            conn.done();
            return Ok(ResolveOutcome::NotFound);
        };
        let record = decode(row)?;
        let now: Timestamp = row.try_get(NCOLS).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        if let Some(fence) = fence {
            // The row is locked: its probe mark cannot change under us.
            let marks = tx.query(&format!("SELECT probe_token FROM idemgate_records WHERE {PK}"), &params).await.map_err(w)?;
            let token: Option<Uuid> =
                marks.first().map(|r| r.try_get(0)).transpose().map_err(|e| StoreError::Corrupt(e.to_string()))?.flatten();
            if record.state != State::Unknown || record.generation != fence.generation || token != Some(fence.token) {
                tx.rollback().await.map_err(w)?;
                conn.done();
                return Ok(ResolveOutcome::Refused(Refused::Fenced));
            }
        }
        let (to, generation): (Option<State>, Option<i64>) = match transition(&record, resolution.event(), now) {
            Err(refused) => {
                tx.rollback().await.map_err(w)?;
                conn.done();
                return Ok(ResolveOutcome::Refused(refused));
            }
            Ok(Next::Deleted) => {
                tx.execute(&format!("DELETE FROM idemgate_records WHERE {PK}"), &params).await.map_err(w)?;
                (None, None)
            }
            Ok(Next::State { state: State::Queued, .. }) => {
                // An async operation released: it runs again, under a new generation.
                let update = format!(
                    "UPDATE idemgate_records SET state = 'queued', generation = nextval('idemgate_generation'), lease_expires_at = NULL, \
                     sent_at = NULL, next_attempt_at = now(), maybe_executed = false, response_status = NULL, response_headers = NULL, \
                     response_body = NULL, updated_at = now() WHERE {PK} RETURNING generation"
                );
                let rows = tx.query(&update, &params).await.map_err(w)?;
                let generation: i64 =
                    rows.first().and_then(|r| r.try_get(0).ok()).ok_or_else(|| StoreError::Corrupt("resolve: no generation".into()))?;
                (Some(State::Queued), Some(generation))
            }
            Ok(Next::State { state, .. }) => {
                let Resolution::Complete { response, retention, .. } = resolution else {
                    return Err(StoreError::Corrupt("resolve: state machine and resolution disagree".into()));
                };
                let headers = encode_headers(&response.headers);
                let body: Option<&[u8]> = response.body.as_deref();
                let update = format!(
                    "UPDATE idemgate_records SET state = 'completed', generation = nextval('idemgate_generation'), response_status = $5, \
                     response_headers = $6, response_body = $7, lease_expires_at = NULL, updated_at = now(), \
                     expires_at = {EXPIRES_8} WHERE {PK} RETURNING generation"
                );
                let rows = tx
                    .query(
                        &update,
                        &[
                            params[0],
                            params[1],
                            params[2],
                            params[3],
                            &i32::from(response.status),
                            &headers,
                            &body,
                            &retention_us(*retention),
                        ],
                    )
                    .await
                    .map_err(w)?;
                let generation: i64 =
                    rows.first().and_then(|r| r.try_get(0).ok()).ok_or_else(|| StoreError::Corrupt("resolve: no generation".into()))?;
                (Some(state), Some(generation))
            }
        };
        tx.execute(
            "INSERT INTO idemgate_audit (actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
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
            tx.execute(
                &format!("INSERT INTO idemgate_events {EVENT_INSERT} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"),
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
        conn.done();
        Ok(ResolveOutcome::Resolved { from: record.state })
    }

    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self
            .query(
                "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation \
                 FROM idemgate_audit ORDER BY id DESC LIMIT $1",
                &[&i64::from(limit)],
                false,
            )
            .await?;
        rows.iter().map(decode_audit).collect()
    }

    async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query("SELECT value FROM idemgate_settings WHERE name = $1", &[&DERIVED_KEY_SECRET], false).await;
        match rows {
            Ok(rows) => rows.first().map(|r| r.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))).transpose(),
            // Before migration 2 the table does not exist: no secret yet.
            Err(StoreError::Unavailable(m)) if m.contains("42P01") => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        let sql = "WITH doomed AS (
                SELECT tenant, principal, operation, idempotency_key FROM idemgate_records
                WHERE state IN ('completed', 'failed_retryable') AND expires_at <= now()
                ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
            DELETE FROM idemgate_records r USING doomed d
            WHERE r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
              AND r.idempotency_key = d.idempotency_key AND r.state IN ('completed', 'failed_retryable') AND r.expires_at <= now()
            RETURNING 1";
        Ok(self.query(sql, &[&i64::from(batch)], true).await?.len() as u64)
    }

    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError> {
        // record::transition's LeaseExpired, in SQL: sync attempts become
        // unknown; async ones go back to the queue when they never sent (no
        // sent_at) or their upstream deduplicates, else unknown.
        let sql = "WITH stale AS (
                SELECT tenant, principal, operation, idempotency_key FROM idemgate_records
                WHERE state IN ('in_flight', 'processing') AND (lease_expires_at IS NULL OR lease_expires_at <= now())
                ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
            ), decided AS (
                SELECT s.*, (r.state = 'processing' AND (r.sent_at IS NULL OR r.operation = ANY($2::text[]))) AS requeue
                FROM stale s JOIN idemgate_records r USING (tenant, principal, operation, idempotency_key)
            ), upd AS (
            UPDATE idemgate_records r SET
                state = CASE WHEN d.requeue THEN 'queued' ELSE 'unknown' END,
                lease_expires_at = CASE WHEN d.requeue THEN NULL ELSE r.lease_expires_at END,
                next_attempt_at = CASE WHEN d.requeue THEN now() ELSE r.next_attempt_at END,
                sent_at = CASE WHEN d.requeue THEN NULL ELSE r.sent_at END,
                -- Re-queued although it was sent: it may have executed.
                maybe_executed = r.maybe_executed OR (d.requeue AND r.sent_at IS NOT NULL),
                updated_at = now()
            FROM decided d
            WHERE r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
              AND r.idempotency_key = d.idempotency_key AND r.state IN ('in_flight', 'processing')
              AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
            RETURNING d.requeue, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.operation_id
            ), ev AS (
                INSERT INTO idemgate_events (event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, body)
                SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL
                FROM upd WHERE NOT requeue AND operation = ANY($3::text[])
            )
            SELECT requeue FROM upd";
        let ops: Vec<&str> = reforwardable.iter().map(|o| &**o).collect();
        let emitting = events.operations_emitting(EventType::Unknown);
        let rows = self.query(sql, &[&i64::from(batch), &ops, &emitting], true).await?;
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

    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_token: Uuid) -> Result<Option<Taken>, StoreError> {
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let leases: Vec<i64> = routes.iter().map(|r| micros(r.lease)).collect();
        let rows = self.query(TAKE, &[&ops, &leases, &claim_token, &owner], true).await?;
        let Some(row) = rows.first() else { return Ok(None) };
        let record = decode(row)?;
        let request: Vec<u8> = row.try_get(NCOLS + 1).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let claim = Claim {
            scope: record.scope.clone(),
            generation: record.generation,
            claim_token: record.claim_token,
            lease_expires_at: record.lease_expires_at.unwrap_or(record.updated_at),
            took_over: true,
        };
        Ok(Some(Taken { record, request: request.into(), claim }))
    }

    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE idemgate_records SET lease_expires_at = now() + $7::int8 * interval '1 microsecond' WHERE {PK} AND {FENCE} RETURNING 1"
        );
        self.fenced_update(&sql, scope, attempt, &[&micros(lease)]).await
    }

    async fn mark_sent(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        let sql = format!("UPDATE idemgate_records SET sent_at = now() WHERE {PK} AND {FENCE} AND lease_expires_at > now() RETURNING 1");
        self.fenced_update(&sql, scope, attempt, &[]).await
    }

    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE idemgate_records SET state = 'queued', lease_expires_at = NULL, sent_at = NULL, \
             next_attempt_at = now() + $7::int8 * interval '1 microsecond', last_status = $8, \
             maybe_executed = maybe_executed OR $9, updated_at = now() WHERE {PK} AND {FENCE} RETURNING 1"
        );
        self.fenced_update(&sql, scope, attempt, &[&micros(delay), &retry.last_status.map(i32::from), &retry.maybe_executed]).await
    }

    async fn fail(
        &self,
        scope: &Scope,
        attempt: Attempt,
        retention: Retention,
        retry: RetryNote,
        events: &EventPolicies,
    ) -> Result<bool, StoreError> {
        // record::transition's Fail: never "failed_retryable" once an attempt may have run.
        let sql = format!(
            "WITH upd AS (UPDATE idemgate_records SET \
             state = CASE WHEN maybe_executed OR $9 THEN 'unknown' ELSE 'failed_retryable' END, \
             maybe_executed = maybe_executed OR $9, lease_expires_at = NULL, \
             expires_at = {EXPIRES_7}, last_status = $8, updated_at = now() \
             WHERE {PK} AND {FENCE} \
             RETURNING tenant, principal, operation, idempotency_key, generation, state, last_status, operation_id), \
             ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
             SELECT state, tenant, principal, operation, idempotency_key, generation, last_status, operation_id, NULL, NULL FROM upd \
             WHERE (state = 'unknown' AND $10) OR (state = 'failed_retryable' AND $11)) \
             SELECT 1 FROM upd"
        );
        let (unknown, failed) =
            (events.emits(&scope.operation, EventType::Unknown), events.emits(&scope.operation, EventType::FailedRetryable));
        self.fenced_update(
            &sql,
            scope,
            attempt,
            &[&retention_us(retention), &retry.last_status.map(i32::from), &retry.maybe_executed, &unknown, &failed],
        )
        .await
    }

    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let sql = format!("SELECT {COLUMNS}, now() FROM idemgate_records WHERE tenant = $1 AND operation_id = $2");
        let rows = self.query(&sql, &[&tenant, &operation_id], false).await?;
        match rows.first() {
            None => Ok(None),
            Some(row) => {
                let now: Timestamp = row.try_get(NCOLS).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Some((decode(row)?, now)))
            }
        }
    }

    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        let sql = format!(
            "WITH due AS (
                SELECT e.seq FROM idemgate_events e
                WHERE e.delivery = 'pending' AND e.next_attempt_at <= now() AND (e.lease_until IS NULL OR e.lease_until <= now())
                  AND e.operation = ANY($1::text[])
                  AND NOT EXISTS (SELECT 1 FROM idemgate_events p
                                  WHERE p.delivery = 'pending' AND p.tenant = e.tenant AND p.principal = e.principal
                                    AND p.operation = e.operation AND p.idempotency_key = e.idempotency_key AND p.seq < e.seq)
                ORDER BY e.next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED)
            UPDATE idemgate_events e SET lease_token = $3, lease_until = now() + $4::int8 * interval '1 microsecond'
            FROM due WHERE e.seq = due.seq
            RETURNING {}",
            EVENT_COLUMNS.split(", ").map(|c| format!("e.{}", c.trim())).collect::<Vec<_>>().join(", ")
        );
        self.events_where(&sql, &[&operations, &i64::from(limit), &token, &micros(lease)], true).await
    }

    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError> {
        let sql = "UPDATE idemgate_events SET delivery = 'sent', sent_at = now(), lease_token = NULL, lease_until = NULL \
                   WHERE seq = ANY($1::int8[]) AND lease_token = $2 AND delivery = 'pending' RETURNING seq";
        let rows = self.query(sql, &[&seqs, &token], true).await?;
        Ok(rows.iter().map(|r| r.get::<_, i64>(0)).collect())
    }

    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError> {
        let sql = "UPDATE idemgate_events SET attempts = attempts + 1, last_error = $3, \
                   next_attempt_at = now() + $4::int8 * interval '1 microsecond', \
                   delivery = CASE WHEN $5 THEN 'parked' ELSE 'pending' END, lease_token = NULL, lease_until = NULL \
                   WHERE seq = $1 AND lease_token = $2 AND delivery = 'pending' RETURNING 1";
        Ok(!self.query(sql, &[&seq, &token, &error, &micros(retry_after), &park], true).await?.is_empty())
    }

    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        let sql =
            format!("SELECT {EVENT_COLUMNS} FROM idemgate_events WHERE ($1::text IS NULL OR delivery = $1) ORDER BY seq DESC LIMIT $2");
        // The newest `limit`, oldest first (events_where sorts by seq).
        self.events_where(&sql, &[&delivery.map(Delivery::as_str), &i64::from(limit)], false).await
    }

    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError> {
        let sql = "UPDATE idemgate_events SET delivery = 'pending', attempts = 0, next_attempt_at = now(), lease_token = NULL, \
                   lease_until = NULL, last_error = NULL, sent_at = NULL WHERE event_id = $1 RETURNING 1";
        Ok(!self.query(sql, &[&event_id], true).await?.is_empty())
    }

    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError> {
        let sql = "DELETE FROM idemgate_events WHERE seq IN (
                       SELECT seq FROM idemgate_events
                       WHERE delivery = 'sent' AND sent_at <= now() - $2::int8 * interval '1 microsecond'
                       ORDER BY sent_at LIMIT $1)
                   RETURNING 1";
        Ok(self.query(sql, &[&i64::from(batch), &micros(older_than)], true).await?.len() as u64)
    }

    async fn event_stats(&self) -> Result<EventStats, StoreError> {
        let rows = self
            .query(
                "SELECT count(*) FILTER (WHERE delivery = 'pending'), count(*) FILTER (WHERE delivery = 'parked'), \
                 min(at) FILTER (WHERE delivery = 'pending') FROM idemgate_events WHERE delivery <> 'sent'",
                &[],
                false,
            )
            .await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("event stats returned no row".into()))?;
        Ok(EventStats {
            pending: row.try_get(0).map_err(c)?,
            parked: row.try_get(1).map_err(c)?,
            oldest_pending_at: row.try_get(2).map_err(c)?,
        })
    }

    async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = self
            .query(
                "SELECT operation, state, count(*), min(created_at), min(updated_at) FROM idemgate_records \
                 WHERE state <> 'completed' GROUP BY operation, state",
                &[],
                false,
            )
            .await?;
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
                })
            })
            .collect()
    }

    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM idemgate_records WHERE scope_id = $1");
        let rows = self.query(&sql, &[&id.to_i64()], false).await?;
        rows.iter().map(decode).collect()
    }

    async fn scopes_without_id(&self, after: Option<&Scope>, limit: u32) -> Result<Vec<Scope>, StoreError> {
        let sql = "SELECT tenant, principal, operation, idempotency_key FROM idemgate_records \
                   WHERE scope_id IS NULL AND (NOT $5::bool OR (tenant, principal, operation, idempotency_key) > ($1, $2, $3, $4)) \
                   ORDER BY tenant, principal, operation, idempotency_key LIMIT $6";
        let [t, p, o, k]: [&str; 4] = after.map_or(["", "", "", ""], |s| [&s.tenant, &s.principal, &s.operation, s.key.as_str()]);
        let rows = self.query(sql, &[&t, &p, &o, &k, &after.is_some(), &i64::from(limit)], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter()
            .map(|row| {
                let key: &str = row.try_get(3).map_err(c)?;
                let key = IdempotencyKey::new(key).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
                let (t, p, o): (&str, &str, &str) = (row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?, row.try_get(2).map_err(c)?);
                Ok(Scope { tenant: t.into(), principal: p.into(), operation: o.into(), key })
            })
            .collect()
    }

    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        // The literal matches the partial index's predicate, so this counts
        // over that index alone.
        let rows = self
            .query("SELECT operation, count(*) FROM idemgate_records WHERE expires_at = 'infinity' GROUP BY operation", &[], false)
            .await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter().map(|row| Ok(ForeverCount { operation: row.try_get(0).map_err(c)?, count: row.try_get(1).map_err(c)? })).collect()
    }

    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let settles: Vec<i64> = routes.iter().map(|r| micros(r.settle)).collect();
        let rows = self.query(TAKE_PROBES, &[&ops, &settles, &token, &micros(hold), &i64::from(limit)], true).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter()
            .map(|row| {
                let record = decode(row)?;
                let request: Option<Vec<u8>> = row.try_get(NCOLS + 1).map_err(c)?;
                Ok(Probing {
                    fence: ProbeFence { generation: record.generation, token },
                    attempts: row.try_get(NCOLS + 2).map_err(c)?,
                    request: request.map(Bytes::from),
                    record,
                })
            })
            .collect()
    }

    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE idemgate_records SET probe_attempts = probe_attempts + 1, \
             next_probe_at = now() + $7::int8 * interval '1 microsecond', probe_token = NULL, probe_until = NULL \
             WHERE {PK} AND state = 'unknown' AND generation = $5 AND probe_token = $6 RETURNING 1"
        );
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let rows = self.query(&sql, &[&t, &p, &o, &k, &fence.generation.0, &fence.token, &micros(retry_in)], true).await?;
        Ok(!rows.is_empty())
    }
}

/// The reconciler takes due `unknown` records of its routes (each past its
/// route's settle time, not in backoff, not marked by a live probe), marks
/// them with its token until the hold runs out, and gets them back with their
/// stored request and the inconclusive probes of this generation so far.
/// `SKIP LOCKED`: two replicas never take one record.
const TAKE_PROBES: &str = "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[]) AS ro(operation, settle_us)
), due AS (
    SELECT r.tenant, r.principal, r.operation, r.idempotency_key
    FROM idemgate_records r JOIN routes ro ON ro.operation = r.operation
    WHERE r.state = 'unknown'
      AND r.updated_at <= now() - ro.settle_us * interval '1 microsecond'
      AND (r.probe_generation IS DISTINCT FROM r.generation
           OR ((r.next_probe_at IS NULL OR r.next_probe_at <= now()) AND (r.probe_until IS NULL OR r.probe_until <= now())))
    ORDER BY r.updated_at
    LIMIT $5
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE idemgate_records r SET
    probe_attempts = CASE WHEN r.probe_generation = r.generation THEN r.probe_attempts ELSE 0 END,
    probe_generation = r.generation, next_probe_at = NULL,
    probe_token = $3, probe_until = now() + $4::int8 * interval '1 microsecond'
FROM due d
WHERE r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation AND r.idempotency_key = d.idempotency_key
  AND r.state = 'unknown'
RETURNING r.tenant, r.principal, r.operation, r.idempotency_key, r.request_hash, r.state, r.generation, r.claim_token, r.owner,
          r.lease_expires_at, r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.expires_at,
          r.operation_id, r.attempts, r.next_attempt_at, r.sent_at, r.last_status, r.maybe_executed, r.key_source, now(), r.request,
          r.probe_attempts";

impl PgStore {
    async fn events_where(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<OutboxEvent>, StoreError> {
        let rows = self.query(sql, params, write).await?;
        let mut events = rows.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
        events.sort_by_key(|e| e.seq);
        Ok(events)
    }

    /// An async write fenced by the attempt (`$5` generation, `$6` token,
    /// state `processing`); `extra` are `$7...`.
    async fn fenced_update(
        &self,
        sql: &str,
        scope: &Scope,
        attempt: Attempt,
        extra: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<bool, StoreError> {
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![&t, &p, &o, &k, &attempt.generation.0, &attempt.claim_token];
        params.extend_from_slice(extra);
        Ok(!self.query(sql, &params, true).await?.is_empty())
    }
}

/// One claim waiting for its batch.
struct ClaimItem {
    scope: Scope,
    request_hash: Fingerprint,
    token: Uuid,
    owner: Arc<str>,
    lease_us: i64,
    acceptance: Option<Acceptance>,
    key_source: Arc<str>,
    request_head: Option<Bytes>,
}

/// What the batched claim found for one item.
enum BatchClaim {
    Inserted {
        generation: Generation,
        lease_expires_at: Timestamp,
    },
    Existing(Box<Record>, Timestamp),
    /// Inserted concurrently by another statement, after this one's snapshot.
    Conflict,
    /// The batch statement deadlocked with another: use the single-row path.
    Retry,
}

/// One result write waiting for its batch.
struct CompleteItem {
    scope: Scope,
    attempt: Attempt,
    status: i32,
    headers: Vec<u8>,
    body: Option<Bytes>,
    /// NULL: forever (see `retention_us`).
    retention_us: Option<i64>,
    emit: Emit,
}

enum BatchWrite {
    Written,
    Fenced,
    Retry,
}

/// The batched claim: like `CLAIM` for many scopes at once, but without the
/// take-over branch (the single-row statement does that). Rows are inserted
/// in primary-key order so that two batches never wait on each other in a
/// cycle; the answer comes back in input order.
const CLAIM_BATCH: &str = "\
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::uuid[], $7::text[], $8::int8[],
                         $9::text[], $10::bytea[], $11::text[], $12::int8[])
        WITH ORDINALITY AS i(tenant, principal, operation, idempotency_key, request_hash, claim_token, owner, lease_us,
                             operation_id, request, key_source, scope_id, ord)
), cur AS (
    SELECT i.ord, r.tenant, r.principal, r.operation, r.idempotency_key, r.request_hash, r.state, r.generation, r.claim_token,
           r.owner, r.lease_expires_at, r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.expires_at,
           r.operation_id, r.attempts, r.next_attempt_at, r.sent_at, r.last_status, r.maybe_executed, r.key_source
    FROM input i JOIN idemgate_records r
      ON r.tenant = i.tenant AND r.principal = i.principal AND r.operation = i.operation AND r.idempotency_key = i.idempotency_key
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id)
    SELECT i.tenant, i.principal, i.operation, i.idempotency_key, i.request_hash,
           CASE WHEN i.operation_id IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), i.claim_token, i.owner,
           CASE WHEN i.operation_id IS NULL THEN now() + i.lease_us * interval '1 microsecond' END, now(), now(),
           now() + i.lease_us * interval '1 microsecond', i.operation_id, i.request,
           CASE WHEN i.operation_id IS NOT NULL THEN now() END, i.key_source, i.scope_id
    FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM cur c WHERE c.ord = i.ord)
    ORDER BY i.tenant, i.principal, i.operation, i.idempotency_key
    ON CONFLICT (tenant, principal, operation, idempotency_key) DO NOTHING
    RETURNING claim_token, generation, coalesce(lease_expires_at, now()) AS lease
)
SELECT c.tenant, c.principal, c.operation, c.idempotency_key, c.request_hash, c.state, c.generation, c.claim_token,
       c.owner, c.lease_expires_at, c.response_status, c.response_headers, c.response_body, c.created_at, c.updated_at,
       c.expires_at, c.operation_id, c.attempts, c.next_attempt_at, c.sent_at, c.last_status, c.maybe_executed, c.key_source, now(),
       ins.generation, ins.lease
FROM input i
LEFT JOIN cur c ON c.ord = i.ord
LEFT JOIN inserted ins ON ins.claim_token = i.claim_token
ORDER BY i.ord";

/// The batched result write, each row fenced by its own attempt.
const COMPLETE_BATCH: &str = "\
WITH v AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::int4[], $7::bytea[], $8::bytea[], $9::int8[],
                         $10::uuid[], $11::bool[], $12::bool[])
        WITH ORDINALITY AS v(tenant, principal, operation, idempotency_key, generation, status, headers, body, retention_us, claim_token,
                             emit, with_body, ord)
), upd AS (
    UPDATE idemgate_records r SET
        state = 'completed', response_status = v.status, response_headers = v.headers, response_body = v.body,
        lease_expires_at = NULL, updated_at = now(),
        expires_at = coalesce(now() + v.retention_us * interval '1 microsecond', 'infinity')
    FROM v
    WHERE r.tenant = v.tenant AND r.principal = v.principal AND r.operation = v.operation
      AND r.idempotency_key = v.idempotency_key AND r.generation = v.generation AND r.claim_token = v.claim_token
      AND r.state IN ('in_flight', 'processing')
    RETURNING v.ord, v.emit, v.with_body, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.response_status,
              r.operation_id, r.response_body
), ev AS (
    INSERT INTO idemgate_events (event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, body)
    SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL,
           CASE WHEN with_body THEN response_body END
    FROM upd WHERE emit ORDER BY ord
)
SELECT ord FROM upd";

/// The columns of an event row as written (`INSERT INTO idemgate_events {EVENT_INSERT} ...`).
const EVENT_INSERT: &str = "(event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, body)";

/// The columns of an event row as read (`decode_event`).
const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, \
     actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

/// Whether a change writes its event, and with the response body.
#[derive(Debug, Clone, Copy)]
struct Emit {
    event: bool,
    body: bool,
}

impl Emit {
    fn of(events: &EventPolicies, operation: &str, event: EventType) -> Emit {
        let on = events.emits(operation, event);
        Emit { event: on, body: on && events.include_body(operation) }
    }
}

/// The primary-key columns of a batch, as the arrays its statement unnests.
struct PkColumns<'a> {
    tenants: Vec<&'a str>,
    principals: Vec<&'a str>,
    operations: Vec<&'a str>,
    keys: Vec<&'a str>,
}

impl<'a> PkColumns<'a> {
    fn of(scopes: impl ExactSizeIterator<Item = &'a Scope>) -> PkColumns<'a> {
        let mut c = PkColumns {
            tenants: Vec::with_capacity(scopes.len()),
            principals: Vec::with_capacity(scopes.len()),
            operations: Vec::with_capacity(scopes.len()),
            keys: Vec::with_capacity(scopes.len()),
        };
        for s in scopes {
            c.tenants.push(&s.tenant);
            c.principals.push(&s.principal);
            c.operations.push(&s.operation);
            c.keys.push(s.key.as_str());
        }
        c
    }
}

/// PostgreSQL's "deadlock detected": the statement was rolled back.
fn is_deadlock(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(m) if m.contains("40P01"))
}

impl Db {
    /// A write statement under the batch timeout; a timeout is ambiguous.
    async fn bounded_query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)]) -> Result<Vec<Row>, StoreError> {
        match tokio::time::timeout(self.timeout, self.query(sql, params, true)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Ambiguous(format!("batched statement timed out after {:?}", self.timeout))),
        }
    }

    async fn claim_batch(&self, items: Vec<ClaimItem>) -> Result<Vec<BatchClaim>, StoreError> {
        let n = items.len();
        let PkColumns { tenants, principals, operations, keys } = PkColumns::of(items.iter().map(|i| &i.scope));
        let hashes: Vec<&[u8]> = items.iter().map(|i| &i.request_hash.0[..]).collect();
        let tokens: Vec<Uuid> = items.iter().map(|i| i.token).collect();
        let leases: Vec<i64> = items.iter().map(|i| i.lease_us).collect();
        let owners: Vec<&str> = items.iter().map(|i| &*i.owner).collect();
        let operation_ids: Vec<Option<&str>> = items.iter().map(|i| i.acceptance.as_ref().map(|a| a.operation_id.as_str())).collect();
        let requests: Vec<Option<&[u8]>> =
            items.iter().map(|i| i.acceptance.as_ref().map(|a| &a.request[..]).or(i.request_head.as_deref())).collect();
        let key_sources: Vec<&str> = items.iter().map(|i| &*i.key_source).collect();
        let scope_ids: Vec<i64> = items.iter().map(|i| i.scope.scope_id().to_i64()).collect();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 12] = [
            &tenants,
            &principals,
            &operations,
            &keys,
            &hashes,
            &tokens,
            &owners,
            &leases,
            &operation_ids,
            &requests,
            &key_sources,
            &scope_ids,
        ];
        let rows = match self.bounded_query(CLAIM_BATCH, &params).await {
            Ok(rows) => rows,
            Err(e) if is_deadlock(&e) => return Ok((0..n).map(|_| BatchClaim::Retry).collect()),
            Err(e) => return Err(e),
        };
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter()
            .map(|row| {
                let generation: Option<i64> = row.try_get(NCOLS + 1).map_err(c)?;
                let lease: Option<Timestamp> = row.try_get(NCOLS + 2).map_err(c)?;
                if let (Some(g), Some(lease)) = (generation, lease) {
                    return Ok(BatchClaim::Inserted { generation: Generation(g), lease_expires_at: lease });
                }
                if row.try_get::<_, Option<&str>>(0).map_err(c)?.is_none() {
                    return Ok(BatchClaim::Conflict);
                }
                let now: Timestamp = row.try_get(NCOLS).map_err(c)?;
                Ok(BatchClaim::Existing(Box::new(decode(row)?), now))
            })
            .collect()
    }

    async fn complete_batch(&self, items: Vec<CompleteItem>) -> Result<Vec<BatchWrite>, StoreError> {
        let n = items.len();
        let PkColumns { tenants, principals, operations, keys } = PkColumns::of(items.iter().map(|i| &i.scope));
        let generations: Vec<i64> = items.iter().map(|i| i.attempt.generation.0).collect();
        let tokens: Vec<Uuid> = items.iter().map(|i| i.attempt.claim_token).collect();
        let statuses: Vec<i32> = items.iter().map(|i| i.status).collect();
        let headers: Vec<&[u8]> = items.iter().map(|i| &i.headers[..]).collect();
        let bodies: Vec<Option<&[u8]>> = items.iter().map(|i| i.body.as_deref()).collect();
        let retentions: Vec<Option<i64>> = items.iter().map(|i| i.retention_us).collect();
        let emit: Vec<bool> = items.iter().map(|i| i.emit.event).collect();
        let with_body: Vec<bool> = items.iter().map(|i| i.emit.body).collect();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 12] = [
            &tenants,
            &principals,
            &operations,
            &keys,
            &generations,
            &statuses,
            &headers,
            &bodies,
            &retentions,
            &tokens,
            &emit,
            &with_body,
        ];
        let rows = match self.bounded_query(COMPLETE_BATCH, &params).await {
            Ok(rows) => rows,
            Err(e) if is_deadlock(&e) => return Ok((0..n).map(|_| BatchWrite::Retry).collect()),
            Err(e) => return Err(e),
        };
        let mut out: Vec<BatchWrite> = (0..n).map(|_| BatchWrite::Fenced).collect();
        for row in &rows {
            let ord: i64 = row.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            if let Some(slot) = usize::try_from(ord).ok().and_then(|o| o.checked_sub(1)).and_then(|o| out.get_mut(o)) {
                *slot = BatchWrite::Written;
            }
        }
        Ok(out)
    }
}

fn decode_event(row: &Row) -> Result<OutboxEvent, StoreError> {
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

fn decode_audit(row: &Row) -> Result<AuditEntry, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let key: &str = row.try_get(6).map_err(c)?;
    let key = IdempotencyKey::new(key).map_err(|e| StoreError::Corrupt(format!("audit idempotency_key: {e}")))?;
    let tenant: &str = row.try_get(3).map_err(c)?;
    let principal: &str = row.try_get(4).map_err(c)?;
    let operation: &str = row.try_get(5).map_err(c)?;
    Ok(AuditEntry {
        id: row.try_get(0).map_err(c)?,
        at: row.try_get(1).map_err(c)?,
        actor: row.try_get(2).map_err(c)?,
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        from_state: row.try_get(7).map_err(c)?,
        to_state: row.try_get(8).map_err(c)?,
        reason: row.try_get(9).map_err(c)?,
        forced: row.try_get(10).map_err(c)?,
        generation: row.try_get::<_, Option<i64>>(11).map_err(c)?.map(Generation),
    })
}

fn decode(row: &Row) -> Result<Record, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let key: &str = row.try_get(3).map_err(c)?;
    let key = IdempotencyKey::new(key).map_err(|e| StoreError::Corrupt(format!("idempotency_key: {e}")))?;
    let hash: &[u8] = row.try_get(4).map_err(c)?;
    let hash: [u8; 32] = hash.try_into().map_err(|_| StoreError::Corrupt("request_hash is not 32 bytes".into()))?;
    let state: &str = row.try_get(5).map_err(c)?;
    let state = State::parse(state).ok_or_else(|| StoreError::Corrupt(format!("unknown state {state:?}")))?;
    let status: Option<i32> = row.try_get(10).map_err(c)?;
    let headers: Option<&[u8]> = row.try_get(11).map_err(c)?;
    let body: Option<&[u8]> = row.try_get(12).map_err(c)?;
    let response = match status {
        None => None,
        Some(s) => Some(StoredResponse {
            status: u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("response_status {s}")))?,
            headers: headers.map(decode_headers).transpose()?.unwrap_or_default(),
            body: body.map(Bytes::copy_from_slice),
        }),
    };
    let tenant: &str = row.try_get(0).map_err(c)?;
    let principal: &str = row.try_get(1).map_err(c)?;
    let operation: &str = row.try_get(2).map_err(c)?;
    Ok(Record {
        scope: Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key },
        request_hash: Fingerprint(hash),
        state,
        generation: Generation(row.try_get(6).map_err(c)?),
        claim_token: row.try_get(7).map_err(c)?,
        owner: row.try_get(8).map_err(c)?,
        lease_expires_at: row.try_get(9).map_err(c)?,
        response,
        created_at: row.try_get(13).map_err(c)?,
        updated_at: row.try_get(14).map_err(c)?,
        expires_at: row.try_get(15).map_err(c)?,
        operation_id: row.try_get(16).map_err(c)?,
        attempts: row.try_get(17).map_err(c)?,
        next_attempt_at: row.try_get(18).map_err(c)?,
        sent_at: row.try_get(19).map_err(c)?,
        last_status: row
            .try_get::<_, Option<i32>>(20)
            .map_err(c)?
            .map(|s| u16::try_from(s).map_err(|_| StoreError::Corrupt(format!("last_status {s}"))))
            .transpose()?,
        maybe_executed: row.try_get(21).map_err(c)?,
        key_source: row.try_get(22).map_err(c)?,
    })
}
