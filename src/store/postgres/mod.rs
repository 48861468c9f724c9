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
    Acceptance, Claim, ClaimRequest, EventStats, ForeverCount, Inspection, ListFilter, ProbeFence, ProbeRoute, Probing, RawClaim, Reaped,
    RecordStore, Resolution, ResolveOutcome, RetryNote, StateCount, StoreError, Taken, WorkerRoute,
};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::{IdempotencyKey, Scope, ScopeId};
use crate::idempotency::record::{Attempt, Generation, Next, Record, Refused, State, StoredResponse, Timestamp, may_take_over, transition};
use crate::outbox::{Delivery, EventPolicies, EventType, OutboxEvent};
use crate::request::route::Retention;
use crate::store::audit::{self, AuditEntry, AuditNote};
use crate::telemetry::logging::ErrorChain;
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

mod batch;
pub mod citus;
mod failover;
pub mod sql;

pub use citus::Flavor;

use batch::Batcher;
use failover::{Flush, HostWalk, Verdict};
use sql::NCOLS;

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
    /// PostgreSQL or a Citus coordinator: on Citus every statement is sent
    /// as `sql::for_citus` writes it.
    flavor: Flavor,
}

impl Db {
    /// `sql` as this flavor sends it.
    fn text<'a>(&self, sql: &'a str) -> &'a str {
        if self.flavor == Flavor::Citus { sql::for_citus(sql) } else { sql }
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        match self.pool.get().await {
            Ok(c) => Ok(Conn(Some(c))),
            Err(e) => Err(StoreError::Unavailable(format!("no database connection: {}", ErrorChain(&e)))),
        }
    }

    /// Runs one statement on a pooled connection and returns its rows. A
    /// statement refused because the schema changed under the connection's
    /// prepared statements (`Verdict::Stale`: it did not run) runs once more
    /// on a new connection.
    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)], write: bool) -> Result<Vec<Row>, StoreError> {
        match self.query_once(sql, params, write).await {
            Err((_, Verdict::Stale)) => self.query_once(sql, params, write).await.map_err(|(e, _)| e),
            r => r.map_err(|(e, _)| e),
        }
    }

    async fn query_once(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<Row>, (StoreError, Verdict)> {
        let conn = self.conn().await.map_err(|e| (e, Verdict::Keep))?;
        let stmt = match conn.client().prepare_cached(self.text(sql)).await {
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
    fn failed(&self, conn: Conn, e: tokio_postgres::Error, write: bool) -> (StoreError, Verdict) {
        let verdict = failover::verdict(&e);
        match verdict {
            Verdict::Keep => conn.done(),
            Verdict::Discard => drop(conn),
            Verdict::Failover | Verdict::Stale => {
                drop(conn);
                self.flush.now(&self.pool, &ErrorChain(&e).to_string());
            }
        }
        (classify(e, write), verdict)
    }
}

#[derive(Debug)]
pub struct PgStore {
    db: Db,
    /// Concurrent claims and result writes share one statement and one
    /// commit (see `batch`).
    writes: Batcher<WriteItem, WriteOut>,
    /// PostgreSQL or a Citus coordinator (see `citus`).
    flavor: Flavor,
}

/// Bound on a readiness ping: `/readyz` must answer within about a second
/// even when the primary went silent (the operation timeout is longer).
const PING_BOUND: Duration = Duration::from_millis(800);

/// Most requests one batched statement carries.
const MAX_BATCH: usize = 128;
/// Batched statements running at once. One: while it commits, the next
/// batch fills, so batches are as full as the load makes them, and
/// PostgreSQL's cost is mostly per statement (and two statements at once
/// contend for the same index pages). Alternating runs on two cores, first
/// writes per second with one against two: 1.9-2.0k against 1.8-1.9k at 2
/// connections, 3.1-3.3k against 2.8-2.9k at 4, 8.3-8.6k against 6.2-7.0k
/// at 16, 14.6-14.7k against 12.0-12.6k at 64, with less CPU per write in
/// both processes at every load (`IDEMGATE_PG_BATCH_CONCURRENCY` overrides
/// it, for measuring).
const BATCH_CONCURRENCY: usize = 1;

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
        return StoreError::Unavailable(describe(db));
    }
    let text = ErrorChain(&e).to_string();
    if write { StoreError::Ambiguous(text) } else { StoreError::Unavailable(text) }
}

/// A server error as an operator should read it. A missing idemgate table
/// means the database was never migrated (for this version); a refused
/// privilege points at the documented roles. The SQLSTATE stays first.
fn describe(db: &tokio_postgres::error::DbError) -> String {
    use tokio_postgres::error::SqlState;
    let code = db.code().code();
    let message = db.message();
    if *db.code() == SqlState::UNDEFINED_TABLE && message.contains("idemgate_") {
        let table = message.split('"').nth(1).unwrap_or("an idemgate table");
        return format!(
            "database error {code}: table {table} is missing: this database has not been migrated for this version; run `idemgate migrate` (as the role that owns the schema)"
        );
    }
    if *db.code() == SqlState::INSUFFICIENT_PRIVILEGE {
        return format!("database error {code}: {message}: {PRIVILEGES_HINT}");
    }
    format!("database error {code}: {message}")
}

/// What a permission error says to do.
const PRIVILEGES_HINT: &str = "the database role lacks a privilege idemgate needs; `idemgate check-config --connect` names what is \
     missing, and \"PostgreSQL roles\" in docs/operations.md has the grants";

/// A migration's failure; a permission error says how schema changes are meant to be made.
fn migration_error(context: &str, e: &tokio_postgres::Error) -> StoreError {
    let text = ErrorChain(e).to_string();
    let at = if context.is_empty() { String::new() } else { format!("{context}: ") };
    match e.as_db_error() {
        Some(db) if *db.code() == tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE => StoreError::Migration(format!(
            "{at}{text}: this role may not create or change tables here (on PostgreSQL 15 and later GRANT ALL ON DATABASE \
             does not include CREATE on schema public). Run `idemgate migrate` as the role that owns the schema: see \
             \"PostgreSQL roles\" in docs/operations.md"
        )),
        _ => StoreError::Migration(format!("{at}{text}")),
    }
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

impl PgStore {
    pub fn connect(url: &str, pool_size: usize, timeout: Duration) -> Result<PgStore, StoreError> {
        PgStore::connect_as(url, pool_size, timeout, Flavor::Postgres)
    }

    /// [`connect`](Self::connect) to a server of this flavor.
    pub fn connect_as(url: &str, pool_size: usize, timeout: Duration, flavor: Flavor) -> Result<PgStore, StoreError> {
        // sslmode and sslrootcert as libpq reads them (see crate::tls::postgres).
        let parsed =
            crate::tls::postgres::parse(url).map_err(|e| StoreError::Unavailable(format!("invalid database URL: {}", ErrorChain(&e))))?;
        let tls = parsed.tls;
        let mut pg = parsed.config;
        if pg.get_application_name().is_none() {
            pg.application_name("idemgate");
        }
        // The session settings that keep every plan on its index whatever the
        // statistics say (see `sql`).
        //
        // statement_timeout: a statement the gateway gave up on (its operation
        // timed out, so it answered and may have abandoned a claim) must not
        // go on and commit later; the server cancels it at the same bound.
        let mut ours: String = sql::session_settings(flavor).iter().map(|(name, value)| format!("-c {name}={value} ")).collect();
        ours.push_str(&format!("-c statement_timeout={}", timeout.as_millis().max(1)));
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
        let db = Db { pool, timeout, flush, flavor };
        let writes = {
            let db = db.clone();
            let concurrency = std::env::var("IDEMGATE_PG_BATCH_CONCURRENCY").ok().and_then(|v| v.parse().ok()).unwrap_or(BATCH_CONCURRENCY);
            Batcher::start("writes", MAX_BATCH, concurrency, move |items| {
                let db = db.clone();
                async move { db.write_batch(items).await }
            })
        };
        Ok(PgStore { db, writes, flavor })
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
                &sql::CLAIM,
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
        let cacheable: bool = row.try_get(NCOLS + 5).map_err(c)?;
        let record = decode(row)?;
        Ok(if cacheable { RawClaim::Cacheable(record, now) } else { RawClaim::Existing(record, now) })
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
        let headers = encode_headers(&response.headers);
        let body: Option<&[u8]> = response.body.as_deref();
        if self.flavor == Flavor::Citus {
            let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
            let (status, retention) = (i32::from(response.status), retention_us(retention));
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] =
                [&t, &p, &o, &k, &attempt.generation.0, &status, &headers, &body, &retention, &attempt.claim_token];
            return self.write_with_event(&sql::CITUS_COMPLETE, &params, emit.event, |_| Some(EventType::Completed), emit.body).await;
        }
        let rows = self
            .query(
                &sql::COMPLETE,
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

/// Whether every migration of this version is applied and the derived-key
/// secret exists: reads only, so any role that may read the tables can ask.
async fn up_to_date(conn: &Conn, flavor: Flavor) -> Result<bool, StoreError> {
    let m = |e: tokio_postgres::Error| migration_error("", &e);
    let client = conn.client();
    let row = client
        .query_one("SELECT to_regclass('idemgate_schema_migrations') IS NOT NULL AND to_regclass('idemgate_settings') IS NOT NULL", &[])
        .await
        .map_err(m)?;
    if !row.try_get::<_, bool>(0).map_err(m)? {
        return Ok(false);
    }
    let done: Vec<i64> =
        client.query("SELECT version FROM idemgate_schema_migrations", &[]).await.map_err(m)?.iter().map(|r| r.get(0)).collect();
    if POSTGRES.iter().any(|mig| !done.contains(&mig.version)) {
        return Ok(false);
    }
    if flavor == Flavor::Citus && citus::CITUS.iter().any(|mig| !done.contains(&mig.version)) {
        return Ok(false);
    }
    let secret = client.query("SELECT 1 FROM idemgate_settings WHERE name = $1", &[&DERIVED_KEY_SECRET]).await.map_err(m)?;
    Ok(!secret.is_empty())
}

#[async_trait]
impl RecordStore for PgStore {
    fn kind(&self) -> &'static str {
        self.flavor.kind()
    }

    async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        let mut conn = self.conn().await?;
        // The right kind of server and schema for this flavor, or the
        // start-up error that says which (see `citus`).
        let found = citus::inspect(conn.client()).await.map_err(|e| migration_error("", &e))?;
        citus::check(self.flavor, found)?;
        // Up to date: nothing is locked, created or written, so a runtime
        // role without the right to change the schema starts (and the server
        // sends no "already exists, skipping" notice at every start).
        if up_to_date(&conn, self.flavor).await? {
            conn.done();
            return Ok(Vec::new());
        }
        let tx = conn.client_mut().transaction().await.map_err(|e| migration_error("", &e))?;
        let m = |e: tokio_postgres::Error| migration_error("", &e);
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
            tx.batch_execute(mig.sql).await.map_err(|e| migration_error(mig.name, &e))?;
            tx.execute("INSERT INTO idemgate_schema_migrations (version, name) VALUES ($1, $2)", &[&mig.version, &mig.name])
                .await
                .map_err(m)?;
            applied.push(mig.name.to_owned());
        }
        if self.flavor == Flavor::Citus {
            applied.extend(citus::migrate(&tx, &done).await.map_err(|(name, e)| migration_error(&name, &e))?);
        }
        // The derived-key secret, once per deployment: every replica reads
        // the same row.
        let secret = fresh_secret()?;
        tx.execute(
            "INSERT INTO idemgate_settings (name, value) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
            &[&DERIVED_KEY_SECRET, &&secret[..]],
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

    /// One autocommit statement that takes a transaction id (so its commit
    /// is written and flushed like a claim's) and asks whether this role may
    /// write the records.
    async fn probe_write(&self) -> Result<(), StoreError> {
        let rows = self.query(sql::PROBE_WRITE, &[], true).await?;
        let may_write: bool = rows.first().and_then(|r| r.try_get(1).ok()).unwrap_or(false);
        if !may_write {
            return Err(StoreError::Unavailable(
                "the database role may not insert, update and delete in idemgate_records (see the grants in docs/operations.md)".into(),
            ));
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
        if self.flavor == Flavor::Citus {
            return self.claim_citus(req).await;
        }
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
        let WriteOut::Claim(out) = self.writes.submit(WriteItem::Claim(item)).await? else {
            return Err(StoreError::Corrupt("batched write: a claim answered as a result write".into()));
        };
        match out {
            BatchClaim::Inserted { generation, lease_expires_at } => {
                Ok(RawClaim::Claimed(Claim { scope: s.clone(), generation, claim_token: token, lease_expires_at, took_over: false }))
            }
            BatchClaim::Existing(record, now, _) if may_take_over(&record, &req.request_hash, now, req.upstream_idempotent) => {
                self.claim_one(req, token).await
            }
            BatchClaim::Existing(record, now, true) => Ok(RawClaim::Cacheable(*record, now)),
            BatchClaim::Existing(record, now, false) => Ok(RawClaim::Existing(*record, now)),
            BatchClaim::Conflict => Ok(RawClaim::Conflict),
            BatchClaim::Retry => self.claim_one(req, token).await,
        }
    }

    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let rows = self.query(&sql::GET, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()], false).await?;
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
        if self.flavor == Flavor::Citus {
            // Not batched across scopes on Citus (see `sql::catalog_for`).
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
                &sql::RELEASE,
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
        let rows = self
            .query(&sql::ABANDON, &[&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str(), &token], true)
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
            return self.write_with_event(&sql::CITUS_MARK_UNKNOWN, &params, emit, |_| Some(EventType::Unknown), false).await;
        }
        let rows = self
            .query(
                &sql::MARK_UNKNOWN,
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
        // statement per combination of filters (see `sql::ListShape`).
        let shape = sql::ListShape {
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

    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
    ) -> Result<ResolveOutcome, StoreError> {
        // A completed record may sit in replicas' replay caches: before it
        // changes, it is held out of them (`RESOLVE_HOLD`, committed) and the
        // resolution waits until every entry cached before the hold has run
        // out (see `store::cache`), then resolves in a second transaction.
        let mut held: Option<(Timestamp, Generation)> = None;
        for _ in 0..3 {
            let mut conn = self.conn().await?;
            match self.resolve_round(&mut conn, scope, resolution, note, events, fence, held).await? {
                Round::Done(outcome) => {
                    conn.done();
                    return Ok(outcome);
                }
                Round::Held(hold) => {
                    conn.done();
                    tokio::time::sleep(super::cache::HOLD_WAIT).await;
                    held = Some(hold);
                }
            }
        }
        Err(StoreError::Unavailable("resolve: could not hold the record out of the replay caches".into()))
    }

    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        let rows = self.query(sql::AUDIT_LIST, &[&i64::from(limit)], false).await?;
        rows.iter().map(decode_audit).collect()
    }

    async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError> {
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let rows = self.query(&sql::INSPECT, &[&t, &p, &o, &k], false).await?;
        let Some(row) = rows.first() else { return Ok(None) };
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let record = decode(row)?;
        let now: Timestamp = row.try_get(NCOLS).map_err(c)?;
        let request: Option<Vec<u8>> = row.try_get(NCOLS + 1).map_err(c)?;
        let probe_attempts: i32 = row.try_get(NCOLS + 2).map_err(c)?;
        let next_probe_at: Option<Timestamp> = row.try_get(NCOLS + 3).map_err(c)?;
        let probe_last_answer: Option<String> = row.try_get(NCOLS + 4).map_err(c)?;
        let rows = self.query(sql::AUDIT_OF_SCOPE, &[&t, &p, &o, &k, &i64::from(audit_limit)], false).await?;
        let audit = rows.iter().map(decode_audit).collect::<Result<Vec<_>, _>>()?;
        Ok(Some(Inspection { record, now, request: request.map(Bytes::from), probe_attempts, next_probe_at, probe_last_answer, audit }))
    }

    async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError> {
        let rows = self.query(sql::SETTING, &[&DERIVED_KEY_SECRET], false).await;
        match rows {
            Ok(rows) => rows.first().map(|r| r.try_get(0).map_err(|e| StoreError::Corrupt(e.to_string()))).transpose(),
            // Before migration 2 the table does not exist: no secret yet.
            Err(StoreError::Unavailable(m)) if m.contains("42P01") => Ok(None),
            Err(e) => Err(e),
        }
    }

    async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        if self.flavor == Flavor::Citus {
            return self.sweep_citus(batch).await;
        }
        Ok(self.query(sql::SWEEP, &[&i64::from(batch)], true).await?.len() as u64)
    }

    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError> {
        let ops: Vec<&str> = reforwardable.iter().map(|o| &**o).collect();
        let emitting = events.operations_emitting(EventType::Unknown);
        let rows = match self.flavor {
            Flavor::Citus => self.reap_rows_citus(batch, &ops, &emitting).await?,
            Flavor::Postgres => self.query(&sql::REAP_LEASES, &[&i64::from(batch), &ops, &emitting], true).await?,
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

    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_token: Uuid) -> Result<Option<Taken>, StoreError> {
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let leases: Vec<i64> = routes.iter().map(|r| micros(r.lease)).collect();
        let reforwardable: Vec<&str> = routes.iter().filter(|r| r.reforwardable).map(|r| &*r.operation).collect();
        let rows = match self.flavor {
            Flavor::Citus => self.take_rows_citus(&ops, &leases, claim_token, owner, &reforwardable).await?,
            Flavor::Postgres => self.query(&sql::TAKE, &[&ops, &leases, &claim_token, &owner, &reforwardable], true).await?,
        };
        let Some(row) = rows.first() else { return Ok(None) };
        let record = decode(row)?;
        let request: Vec<u8> = row.try_get(NCOLS + 1).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let lease_expired: bool = row.try_get(NCOLS + 2).map_err(|e| StoreError::Corrupt(e.to_string()))?;
        let claim = Claim {
            scope: record.scope.clone(),
            generation: record.generation,
            claim_token: record.claim_token,
            lease_expires_at: record.lease_expires_at.unwrap_or(record.updated_at),
            took_over: true,
        };
        Ok(Some(Taken { record, request: request.into(), claim, lease_expired }))
    }

    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError> {
        self.fenced_update(&sql::HEARTBEAT, scope, attempt, &[&micros(lease)]).await
    }

    async fn mark_sent(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError> {
        self.fenced_update(&sql::MARK_SENT, scope, attempt, &[]).await
    }

    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError> {
        self.fenced_update(&sql::REQUEUE, scope, attempt, &[&micros(delay), &retry.last_status.map(i32::from), &retry.maybe_executed]).await
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
            return self.write_with_event(&sql::CITUS_FAIL, &params, unknown || failed, event, false).await;
        }
        self.fenced_update(
            &sql::FAIL,
            scope,
            attempt,
            &[&retention_us(retention), &retry.last_status.map(i32::from), &retry.maybe_executed, &unknown, &failed],
        )
        .await
    }

    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        let rows = self.query(&sql::OPERATION, &[&tenant, &operation_id], false).await?;
        match rows.first() {
            None => Ok(None),
            Some(row) => {
                let now: Timestamp = row.try_get(NCOLS).map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Some((decode(row)?, now)))
            }
        }
    }

    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        if self.flavor == Flavor::Citus {
            let rows = self.take_event_rows_citus(operations, limit, micros(lease), token).await?;
            let mut events = rows.iter().map(decode_event).collect::<Result<Vec<_>, _>>()?;
            events.sort_by_key(|e| e.seq);
            return Ok(events);
        }
        self.events_where(&sql::TAKE_EVENTS, &[&operations, &i64::from(limit), &token, &micros(lease)], true).await
    }

    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError> {
        let rows = self.query(sql::EVENTS_DELIVERED, &[&seqs, &token], true).await?;
        rows.iter().map(|r| r.try_get::<_, i64>(0).map_err(|e| StoreError::Corrupt(e.to_string()))).collect()
    }

    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError> {
        Ok(!self.query(sql::EVENT_FAILED, &[&seq, &token, &error, &micros(retry_after), &park], true).await?.is_empty())
    }

    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        let limit = i64::from(limit);
        match delivery {
            Some(d) => self.events_where(&sql::EVENTS_BY_DELIVERY, &[&d.as_str(), &limit], false).await,
            None => self.events_where(&sql::EVENTS, &[&limit], false).await,
        }
    }

    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError> {
        Ok(!self.query(sql::REDELIVER, &[&event_id], true).await?.is_empty())
    }

    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError> {
        Ok(self.query(sql::SWEEP_EVENTS, &[&i64::from(batch), &micros(older_than)], true).await?.len() as u64)
    }

    async fn event_stats(&self) -> Result<EventStats, StoreError> {
        let rows = self.query(sql::EVENT_STATS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let row = rows.first().ok_or_else(|| StoreError::Corrupt("event stats returned no row".into()))?;
        Ok(EventStats {
            pending: row.try_get(0).map_err(c)?,
            parked: row.try_get(1).map_err(c)?,
            oldest_pending_at: row.try_get(2).map_err(c)?,
            held: row.try_get(3).map_err(c)?,
        })
    }

    async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        let rows = self.query(sql::STATS, &[], false).await?;
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

    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        let rows = self.query(&sql::BY_SCOPE_ID, &[&id.to_i64()], false).await?;
        rows.iter().map(decode).collect()
    }

    /// None: migration 0011 gave every record its scope id (`NOT NULL`).
    async fn scopes_without_id(&self, _after: Option<&Scope>, _limit: u32) -> Result<Vec<Scope>, StoreError> {
        Ok(Vec::new())
    }

    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        let rows = self.query(sql::FOREVER_COUNTS, &[], false).await?;
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        rows.iter().map(|row| Ok(ForeverCount { operation: row.try_get(0).map_err(c)?, count: row.try_get(1).map_err(c)? })).collect()
    }

    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        let ops: Vec<&str> = routes.iter().map(|r| &*r.operation).collect();
        let settles: Vec<i64> = routes.iter().map(|r| micros(r.settle)).collect();
        let at_upstream: Vec<i64> = routes.iter().map(|r| micros(r.at_upstream)).collect();
        let rows = match self.flavor {
            Flavor::Citus => self.take_probe_rows_citus(&ops, &settles, token, micros(hold), limit, &at_upstream).await?,
            Flavor::Postgres => {
                self.query(&sql::TAKE_PROBES, &[&ops, &settles, &token, &micros(hold), &i64::from(limit), &at_upstream], true).await?
            }
        };
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

    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration, answer: &str) -> Result<bool, StoreError> {
        let (t, p, o, k) = (&*scope.tenant, &*scope.principal, &*scope.operation, scope.key.as_str());
        let retry_in = micros(retry_in);
        let rows = self.query(&sql::PROBE_FAILED, &[&t, &p, &o, &k, &fence.generation.0, &fence.token, &retry_in, &answer], true).await?;
        Ok(!rows.is_empty())
    }
}

impl PgStore {
    /// One transaction of `resolve`: the resolution itself, or (for a
    /// completed record not yet held, `held` false or the hold run out) the
    /// hold that keeps it out of the replay caches.
    #[allow(clippy::too_many_arguments)]
    async fn resolve_round(
        &self,
        conn: &mut Conn,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
        held: Option<(Timestamp, Generation)>,
    ) -> Result<Round, StoreError> {
        let w = |e| classify(e, true);
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let tx = conn.client_mut().transaction().await.map_err(w)?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&&*scope.tenant, &&*scope.principal, &&*scope.operation, &scope.key.as_str()];
        let rows = tx.query(self.db.text(&sql::RESOLVE_LOCK), &params).await.map_err(w)?;
        let Some(row) = rows.first() else {
            tx.rollback().await.map_err(w)?;
            return Ok(Round::Done(ResolveOutcome::NotFound));
        };
        let record = decode(row)?;
        let now: Timestamp = row.try_get(NCOLS).map_err(c)?;
        if let Some(fence) = fence {
            // The row is locked: its probe mark cannot change under us.
            let token: Option<Uuid> = row.try_get(NCOLS + 1).map_err(c)?;
            if record.state != State::Unknown || record.generation != fence.generation || token != Some(fence.token) {
                tx.rollback().await.map_err(w)?;
                return Ok(Round::Done(ResolveOutcome::Refused(Refused::Fenced)));
            }
        }
        // Our own hold, on the same generation, still in force: no replica
        // has cached this record since the hold was set (another
        // resolution's change clears the hold, a new hold replaces it).
        let hold: Option<Timestamp> = row.try_get(NCOLS + 2).map_err(c)?;
        let hold_in_place = hold.is_some_and(|h| h > now && held == Some((h, record.generation)));
        let (to, generation): (Option<State>, Option<i64>) = match transition(&record, resolution.event(), now) {
            Err(refused) => {
                tx.rollback().await.map_err(w)?;
                return Ok(Round::Done(ResolveOutcome::Refused(refused)));
            }
            Ok(_) if record.state == State::Completed && !hold_in_place => {
                let rows = tx
                    .query(self.db.text(&sql::RESOLVE_HOLD), &[params[0], params[1], params[2], params[3], &micros(super::cache::HOLD)])
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
                tx.execute(self.db.text(&sql::RESOLVE_DELETE), &params).await.map_err(w)?;
                (None, None)
            }
            Ok(Next::State { state: State::Queued, .. }) => {
                // An async operation released: it runs again, under a new generation.
                let rows = match self.flavor {
                    Flavor::Citus => {
                        let generation = self.next_generation().await?;
                        let with: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                            [params[0], params[1], params[2], params[3], &generation];
                        tx.query(self.db.text(&sql::CITUS_RESOLVE_REQUEUE), &with).await.map_err(w)?
                    }
                    Flavor::Postgres => tx.query(&*sql::RESOLVE_REQUEUE, &params).await.map_err(w)?,
                };
                let Some(row) = rows.first() else {
                    // The row is locked: only a dropped request stops the update.
                    tx.rollback().await.map_err(w)?;
                    return Ok(Round::Done(ResolveOutcome::Refused(Refused::RequestGone)));
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
                    Flavor::Citus => Some(self.next_generation().await?),
                    Flavor::Postgres => None,
                };
                if let Some(g) = &generation {
                    values.push(g);
                }
                let rows =
                    tx.query(self.db.text(self.pick(&sql::RESOLVE_COMPLETE, &sql::CITUS_RESOLVE_COMPLETE)), &values).await.map_err(w)?;
                let generation: i64 =
                    rows.first().and_then(|r| r.try_get(0).ok()).ok_or_else(|| StoreError::Corrupt("resolve: no generation".into()))?;
                (Some(state), Some(generation))
            }
        };
        tx.execute(
            self.db.text(sql::AUDIT_INSERT),
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
            tx.execute(
                self.db.text(&sql::EVENT_INSERT_ONE),
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

/// What one transaction of `resolve` did.
enum Round {
    Done(ResolveOutcome),
    /// Held a completed record (of this generation) out of the replay caches
    /// until then; resolve after the wait.
    Held((Timestamp, Generation)),
}

impl PgStore {
    /// The statement of this flavor: PostgreSQL's, or Citus's where it differs.
    fn pick<'a>(&self, postgres: &'a str, citus: &'a str) -> &'a str {
        if self.flavor == Flavor::Citus { citus } else { postgres }
    }

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
    /// The row seen, the database clock, and whether it may be cached.
    Existing(Box<Record>, Timestamp, bool),
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

/// A claim or a result write waiting for its batch.
enum WriteItem {
    Claim(ClaimItem),
    Complete(CompleteItem),
}

enum WriteOut {
    Claim(BatchClaim),
    Complete(BatchWrite),
}

enum BatchWrite {
    Written,
    Fenced,
    Retry,
}

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
    /// The primary key's first column (`Scope::scope_id`).
    scope_ids: Vec<i64>,
}

impl<'a> PkColumns<'a> {
    fn of(scopes: impl ExactSizeIterator<Item = &'a Scope>) -> PkColumns<'a> {
        let mut c = PkColumns {
            tenants: Vec::with_capacity(scopes.len()),
            principals: Vec::with_capacity(scopes.len()),
            operations: Vec::with_capacity(scopes.len()),
            keys: Vec::with_capacity(scopes.len()),
            scope_ids: Vec::with_capacity(scopes.len()),
        };
        for s in scopes {
            c.tenants.push(&s.tenant);
            c.principals.push(&s.principal);
            c.operations.push(&s.operation);
            c.keys.push(s.key.as_str());
            c.scope_ids.push(s.scope_id().to_i64());
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

    /// One statement, one commit, for a batch of claims and result writes:
    /// `CLAIM_BATCH`, `COMPLETE_BATCH`, or both in `WRITE_BATCH`. A result
    /// write of one request and the claim of the next then share a commit.
    async fn write_batch(&self, items: Vec<WriteItem>) -> Result<Vec<WriteOut>, StoreError> {
        let n = items.len();
        let mut claims: Vec<(usize, ClaimItem)> = Vec::new();
        let mut completes: Vec<(usize, CompleteItem)> = Vec::new();
        for (i, item) in items.into_iter().enumerate() {
            match item {
                WriteItem::Claim(c) => claims.push((i, c)),
                WriteItem::Complete(c) => completes.push((i, c)),
            }
        }
        let claim_cols = ClaimColumns::of(claims.iter().map(|(_, c)| c));
        let complete_cols = CompleteColumns::of(completes.iter().map(|(_, c)| c));
        let (statement, params): (&str, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) = match (claims.is_empty(), completes.is_empty()) {
            (_, true) => (&sql::CLAIM_BATCH, claim_cols.params()),
            (true, false) => (&sql::COMPLETE_BATCH, complete_cols.params()),
            (false, false) => (&sql::WRITE_BATCH, claim_cols.params().into_iter().chain(complete_cols.params()).collect()),
        };
        let rows = match self.bounded_query(statement, &params).await {
            Ok(rows) => rows,
            Err(e) if is_deadlock(&e) => {
                let mut out: Vec<WriteOut> = (0..n).map(|_| WriteOut::Complete(BatchWrite::Retry)).collect();
                for (i, _) in &claims {
                    out[*i] = WriteOut::Claim(BatchClaim::Retry);
                }
                return Ok(out);
            }
            Err(e) => return Err(e),
        };
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let mut out: Vec<WriteOut> = (0..n).map(|_| WriteOut::Complete(BatchWrite::Fenced)).collect();
        // The ordinals (from 1) of the result writes that took effect.
        let written: Vec<i64> = match (claims.is_empty(), completes.is_empty()) {
            (_, true) => Vec::new(),
            (true, false) => rows.iter().map(|row| row.try_get::<_, i64>(0)).collect::<Result<_, _>>().map_err(c)?,
            (false, false) => match rows.first() {
                Some(row) => row.try_get::<_, Option<Vec<i64>>>(NCOLS + 4).map_err(c)?.unwrap_or_default(),
                None => return Err(StoreError::Corrupt("batched write returned no rows".into())),
            },
        };
        for ord in written {
            if let Some((i, _)) = usize::try_from(ord).ok().and_then(|o| o.checked_sub(1)).and_then(|o| completes.get(o)) {
                out[*i] = WriteOut::Complete(BatchWrite::Written);
            }
        }
        if !claims.is_empty() {
            if rows.len() != claims.len() {
                return Err(StoreError::Corrupt(format!("batched claim of {} returned {} rows", claims.len(), rows.len())));
            }
            for ((i, _), row) in claims.iter().zip(&rows) {
                out[*i] = WriteOut::Claim(decode_batch_claim(row)?);
            }
        }
        Ok(out)
    }
}

/// One claim's row of `CLAIM_BATCH` / `WRITE_BATCH`.
fn decode_batch_claim(row: &Row) -> Result<BatchClaim, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let generation: Option<i64> = row.try_get(NCOLS + 1).map_err(c)?;
    let lease: Option<Timestamp> = row.try_get(NCOLS + 2).map_err(c)?;
    if let (Some(g), Some(lease)) = (generation, lease) {
        return Ok(BatchClaim::Inserted { generation: Generation(g), lease_expires_at: lease });
    }
    if row.try_get::<_, Option<&str>>(0).map_err(c)?.is_none() {
        return Ok(BatchClaim::Conflict);
    }
    let now: Timestamp = row.try_get(NCOLS).map_err(c)?;
    let cacheable: bool = row.try_get::<_, Option<bool>>(NCOLS + 3).map_err(c)?.unwrap_or(false);
    Ok(BatchClaim::Existing(Box::new(decode(row)?), now, cacheable))
}

/// The claims of a batch as the arrays `CLAIM_INPUT` unnests.
struct ClaimColumns<'a> {
    pk: PkColumns<'a>,
    hashes: Vec<&'a [u8]>,
    tokens: Vec<Uuid>,
    owners: Vec<&'a str>,
    leases: Vec<i64>,
    operation_ids: Vec<Option<&'a str>>,
    requests: Vec<Option<&'a [u8]>>,
    key_sources: Vec<&'a str>,
}

impl<'a> ClaimColumns<'a> {
    fn of(items: impl ExactSizeIterator<Item = &'a ClaimItem> + Clone) -> ClaimColumns<'a> {
        ClaimColumns {
            pk: PkColumns::of(items.clone().map(|i| &i.scope)),
            hashes: items.clone().map(|i| &i.request_hash.0[..]).collect(),
            tokens: items.clone().map(|i| i.token).collect(),
            owners: items.clone().map(|i| &*i.owner).collect(),
            leases: items.clone().map(|i| i.lease_us).collect(),
            operation_ids: items.clone().map(|i| i.acceptance.as_ref().map(|a| a.operation_id.as_str())).collect(),
            requests: items.clone().map(|i| i.acceptance.as_ref().map(|a| &a.request[..]).or(i.request_head.as_deref())).collect(),
            key_sources: items.map(|i| &*i.key_source).collect(),
        }
    }

    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        vec![
            &self.pk.tenants,
            &self.pk.principals,
            &self.pk.operations,
            &self.pk.keys,
            &self.hashes,
            &self.tokens,
            &self.owners,
            &self.leases,
            &self.operation_ids,
            &self.requests,
            &self.key_sources,
            &self.pk.scope_ids,
        ]
    }
}

/// The result writes of a batch as the arrays `complete_parts` unnests.
struct CompleteColumns<'a> {
    pk: PkColumns<'a>,
    generations: Vec<i64>,
    statuses: Vec<i32>,
    headers: Vec<&'a [u8]>,
    bodies: Vec<Option<&'a [u8]>>,
    retentions: Vec<Option<i64>>,
    tokens: Vec<Uuid>,
    emit: Vec<bool>,
    with_body: Vec<bool>,
}

impl<'a> CompleteColumns<'a> {
    fn of(items: impl ExactSizeIterator<Item = &'a CompleteItem> + Clone) -> CompleteColumns<'a> {
        CompleteColumns {
            pk: PkColumns::of(items.clone().map(|i| &i.scope)),
            generations: items.clone().map(|i| i.attempt.generation.0).collect(),
            statuses: items.clone().map(|i| i.status).collect(),
            headers: items.clone().map(|i| &i.headers[..]).collect(),
            bodies: items.clone().map(|i| i.body.as_deref()).collect(),
            retentions: items.clone().map(|i| i.retention_us).collect(),
            tokens: items.clone().map(|i| i.attempt.claim_token).collect(),
            emit: items.clone().map(|i| i.emit.event).collect(),
            with_body: items.map(|i| i.emit.body).collect(),
        }
    }

    fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
        vec![
            &self.pk.tenants,
            &self.pk.principals,
            &self.pk.operations,
            &self.pk.keys,
            &self.generations,
            &self.statuses,
            &self.headers,
            &self.bodies,
            &self.retentions,
            &self.tokens,
            &self.emit,
            &self.with_body,
            &self.pk.scope_ids,
        ]
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
        peer: row.try_get(12).map_err(c)?,
        token: row.try_get(13).map_err(c)?,
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
