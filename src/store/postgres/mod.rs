//! The PostgreSQL backend: every protocol step is one short autocommit
//! statement; no transaction is ever held across an upstream call.

use std::time::Duration;

use bytes::Bytes;
use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};
use tokio_postgres::config::TargetSessionAttrs;
use tokio_postgres::types::{FromSql, Type};
use tokio_postgres::{NoTls, Row};
use uuid::Uuid;

use super::codec::{RecordRow, col, encode_headers};
use super::contract::Events;
use super::migrations::{DERIVED_KEY_SECRET, POSTGRES};
use super::{Claim, ClaimRequest, EventStats, Pooler, RawClaim, StoreError};
use crate::idempotency::key::{IdempotencyKey, Scope};
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Attempt, Generation, Record, ReforwardKey, StoredResponse, Timestamp};
use crate::outbox::{Delivery, EventType, OutboxEvent};
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

// One file per concern of the store contract, one impl each.
mod event_log;
mod events;
mod lifecycle;
mod queue;
mod reconcile;
mod records;
mod replan;
mod trail;

mod batch;
pub mod catalog;
pub mod citus;
mod citus_batch;
mod citus_route;
pub mod citus_sql;
mod failover;
pub(crate) use failover::one_host;
mod pooler;
pub mod sql;

pub use citus::Flavor;

use batch::{Batcher, Emit, WriteItem, WriteOut};
use failover::{Flush, HostWalk, SessionFate};
use records::{CLAIM_CACHEABLE, CLAIM_INSERTED_GENERATION, CLAIM_INSERTED_LEASE, CLAIM_TAKEN_GENERATION, CLAIM_TAKEN_LEASE};
use sql::NOW;

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
    /// Marked when a table whose statistics say it is tiny doubles in
    /// pages: connections plan their statements again (see `replan`).
    replan: Arc<replan::Replan>,
    /// PostgreSQL or a Citus coordinator: on Citus every statement is sent
    /// as `sql::for_citus` writes it.
    flavor: Flavor,
    /// The session settings, and how statements are sent (directly or
    /// behind a pooler, see `pooler`).
    sessions: Arc<pooler::Sessions>,
}

impl Db {
    /// A pool of sessions to `config`'s hosts (the first writable one, see
    /// `failover`), each given `sessions`' settings when opened, and dropped
    /// on return after a failover (`flush`) or a re-plan mark (`replan`).
    fn open(
        config: &tokio_postgres::Config,
        tls: Option<&rustls::ClientConfig>,
        pool_size: usize,
        timeout: Duration,
        flavor: Flavor,
        sessions: Arc<pooler::Sessions>,
    ) -> Result<Db, deadpool_postgres::BuildError> {
        let recycling = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        let manager = match tls {
            Some(tls) => {
                let walk = HostWalk::new(config, timeout, tokio_postgres_rustls::MakeRustlsConnect::new(tls.clone()));
                Manager::from_connect(config.clone(), walk, recycling)
            }
            None => Manager::from_connect(config.clone(), HostWalk::new(config, timeout, NoTls), recycling),
        };
        let flush = Arc::new(Flush::default());
        let replan = Arc::new(replan::Replan::default());
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(timeout))
            .create_timeout(Some(timeout))
            .recycle_timeout(Some(timeout))
            .pre_recycle(Flush::hook(flush.clone()))
            .pre_recycle(replan::Replan::hook(replan.clone()))
            .post_create(pooler::Sessions::hook(sessions.clone()))
            .build()?;
        Ok(Db { pool, timeout, flush, replan, flavor, sessions })
    }

    /// `sql` as this flavor sends it.
    fn text<'a>(&self, sql: &'a str) -> &'a str {
        if self.flavor == Flavor::Citus { citus_sql::for_citus(sql) } else { sql }
    }

    async fn conn(&self) -> Result<Conn, StoreError> {
        match self.pool.get().await {
            Ok(c) => Ok(Conn(Some(c))),
            Err(e) => Err(StoreError::Unavailable(format!("no database connection: {}", ErrorChain(&e)))),
        }
    }

    /// Runs one statement on a pooled connection and returns its rows. A
    /// statement refused because the schema changed under the connection's
    /// prepared statements (`SessionFate::Stale`: it did not run) runs once more
    /// on a new connection.
    async fn query(&self, sql: &str, params: &[&(dyn tokio_postgres::types::ToSql + Sync)], write: bool) -> Result<Vec<Row>, StoreError> {
        match self.query_once(sql, params, write).await {
            Err((_, SessionFate::Stale)) => self.query_once(sql, params, write).await.map_err(|(e, _)| e),
            r => r.map_err(|(e, _)| e),
        }
    }

    /// Runs a statement that cannot be prepared (a utility statement such
    /// as `ANALYZE`) on a pooled connection.
    async fn utility(&self, sql: &str) -> Result<(), StoreError> {
        let conn = self.conn().await?;
        match conn.client().batch_execute(sql).await {
            Ok(()) => {
                conn.done();
                Ok(())
            }
            Err(e) => Err(self.failed(conn, e, false).0),
        }
    }

    async fn query_once(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<Row>, (StoreError, SessionFate)> {
        self.query_text(self.text(sql), params, write).await
    }

    /// A statement whose text names its tenant (`citus_sql::for_tenant`),
    /// sent as it is: one text per tenant, so it is not memoized as the
    /// store's fixed statements are (`citus_sql::for_citus`), and a
    /// connection keeps at most [`MAX_PREPARED`] prepared statements (past
    /// that its cache starts again; the server closes each one dropped).
    async fn query_tenant(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<Row>, StoreError> {
        match self.query_text(sql, params, write).await {
            Err((_, SessionFate::Stale)) => self.query_text(sql, params, write).await.map_err(|(e, _)| e),
            r => r.map_err(|(e, _)| e),
        }
    }

    async fn query_text(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<Row>, (StoreError, SessionFate)> {
        let conn = self.conn().await.map_err(|e| (e, SessionFate::Keep))?;
        if self.flavor == Flavor::Citus && conn.client().statement_cache.size() >= MAX_PREPARED {
            conn.client().statement_cache.clear();
        }
        if self.sessions.per_transaction() {
            return match self.sessions.query(conn.client(), sql, params).await {
                Ok(rows) => {
                    conn.done();
                    Ok(rows)
                }
                Err(e) => Err(self.failed(conn, e, write)),
            };
        }
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

    /// Begins one of the store's own transactions on `conn`, with the
    /// session settings when a transaction-mode pooler leaves them to each
    /// transaction. Statements prepared inside it are closed as soon as they
    /// have run (tokio-postgres closes a statement it prepared for one
    /// query), so none outlives it.
    async fn transaction<'c>(&self, conn: &'c mut Conn) -> Result<deadpool_postgres::Transaction<'c>, tokio_postgres::Error> {
        let tx = conn.client_mut().transaction().await?;
        if let Some(local) = self.sessions.local() {
            tx.batch_execute(local).await?;
        }
        Ok(tx)
    }

    /// What a failed statement means for its connection (kept, discarded, or
    /// discarded with every connection to a server that may no longer be the
    /// primary; see `failover`), and for the caller (`classify`).
    fn failed(&self, conn: Conn, e: tokio_postgres::Error, write: bool) -> (StoreError, SessionFate) {
        let fate = failover::fate(&e);
        match fate {
            SessionFate::Keep => conn.done(),
            SessionFate::Discard => drop(conn),
            SessionFate::Failover | SessionFate::Stale => {
                drop(conn);
                self.flush.now(&self.pool, &ErrorChain(&e).to_string());
            }
        }
        (classify(e, write), fate)
    }
}

#[derive(Debug)]
pub struct PgStore {
    db: Db,
    /// Concurrent claims and result writes share one statement and one
    /// commit (see `batch`).
    writes: Batcher<WriteItem, WriteOut>,
    /// Concurrent async attempts about to send share one `mark_sent`
    /// statement and commit (see `queue`); single-row on Citus.
    sends: Option<Batcher<queue::Sending, bool>>,
    /// PostgreSQL or a Citus coordinator (see `citus`).
    flavor: Flavor,
    /// On Citus: each tenant's concurrent claims share statements (see `citus_batch`).
    citus_claims: citus_batch::TenantClaims,
    /// On Citus: where each tenant's statements go (see `citus_route`).
    reach: citus_batch::Reach,
}

/// Bound on a readiness ping: `/readyz` must answer within about a second
/// even when the primary went silent (the operation timeout is longer).
const PING_BOUND: Duration = Duration::from_millis(800);

/// Most requests one batched statement carries.
const MAX_BATCH: usize = 128;
/// Most statements a Citus connection keeps prepared: its statements name
/// their tenant (`Db::query_tenant`), so a connection would otherwise keep
/// one per tenant it served.
const MAX_PREPARED: usize = 256;
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
        // The server answered with an error: the statement did not take
        // effect, unless the error says that the session, or the Citus
        // worker behind it, went away around the commit.
        if write && citus::write_may_have_committed(db) {
            return StoreError::Ambiguous(describe(db));
        }
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
    if *db.code() == SqlState::INVALID_SQL_STATEMENT_NAME {
        return format!("database error {code}: {message}: {POOLER_HINT}");
    }
    format!("database error {code}: {message}")
}

/// What a permission error says to do.
const PRIVILEGES_HINT: &str = "the database role lacks a privilege idemgate needs; `idemgate check-config --connect` names what is \
     missing, and \"PostgreSQL roles\" in docs/operations.md has the grants";

/// What a prepared statement gone missing says to do: it happens behind a
/// pooler in transaction mode, which hands each transaction another server
/// session.
const POOLER_HINT: &str = "a statement prepared on this connection is gone from its server session: a connection pooler in \
     transaction mode sits between idemgate and PostgreSQL; set store.pooler = \"transaction\" (\"Behind a connection pooler\" \
     in docs/operations.md)";

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
    pub fn connect(url: &str, pool_size: usize, timeout: Duration, pooler: Pooler) -> Result<PgStore, StoreError> {
        PgStore::connect_as(url, pool_size, timeout, pooler, Flavor::Postgres)
    }

    /// [`connect`](Self::connect) to a server of this flavor.
    pub fn connect_as(url: &str, pool_size: usize, timeout: Duration, pooler: Pooler, flavor: Flavor) -> Result<PgStore, StoreError> {
        // sslmode and sslrootcert as libpq reads them (see crate::tls::postgres).
        let parsed =
            crate::tls::postgres::parse(url).map_err(|e| StoreError::Unavailable(format!("invalid database URL: {}", ErrorChain(&e))))?;
        let tls = parsed.tls;
        let mut pg = parsed.config;
        if pg.get_application_name().is_none() {
            pg.application_name("idemgate");
        }
        // The session settings that keep every plan on its index whatever the
        // statistics say (see `sql`), and statement_timeout: set on each new
        // connection, or in each transaction behind a transaction-mode
        // pooler, never as the `options` startup parameter that poolers
        // refuse (see `pooler`).
        let sessions = Arc::new(pooler::Sessions::new(pooler, flavor, timeout));
        // Only a primary will do (see `failover`): a standby, or a primary
        // fenced read-only, refuses the session when it is opened.
        pg.target_session_attrs(TargetSessionAttrs::ReadWrite);
        let db = Db::open(&pg, tls.as_ref(), pool_size, timeout, flavor, sessions)
            .map_err(|e| StoreError::Unavailable(format!("cannot build the connection pool: {e}")))?;
        let writes = {
            let db = db.clone();
            let concurrency = std::env::var("IDEMGATE_PG_BATCH_CONCURRENCY").ok().and_then(|v| v.parse().ok()).unwrap_or(BATCH_CONCURRENCY);
            Batcher::start("writes", MAX_BATCH, concurrency, move |items| {
                let db = db.clone();
                async move { db.write_batch(items).await }
            })
        };
        let sends = (flavor == Flavor::Postgres).then(|| {
            let db = db.clone();
            Batcher::start("sends", MAX_BATCH, BATCH_CONCURRENCY, move |items| {
                let db = db.clone();
                async move { db.mark_sent_batch(items).await }
            })
        });
        // On Citus with several nodes listed: a pool per node for the
        // statements of the tenants whose shards it holds.
        let route = match flavor {
            Flavor::Citus => citus_route::Router::start(&pg, tls.as_ref(), pool_size, timeout, pooler, &db)?,
            Flavor::Postgres => None,
        };
        let reach = citus_batch::Reach { main: db.clone(), route, floor: Default::default() };
        Ok(PgStore { db, writes, sends, flavor, citus_claims: Default::default(), reach })
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
                &records::CLAIM,
                &[
                    &&*s.tenant,
                    &&*s.principal,
                    &&*s.operation,
                    &s.key.as_str(),
                    &&req.request_hash.0[..],
                    &token,
                    &&*req.owner,
                    &micros(req.lease),
                    &req.reforward.filter(|_| req.acceptance.is_none()).map(ReforwardKey::as_str),
                    &req.acceptance.as_ref().map(|a| a.operation_id.as_str()),
                    &req.acceptance.as_ref().map(|a| &a.request[..]).or(req.request_head.as_deref()),
                    &&*req.key_source,
                    &Some(req.recorded_key()),
                    &&*req.fingerprint_spec,
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
                asked_at: tokio::time::Instant::now(),
            })
        };
        let pair = |generation: usize, lease: usize| -> Result<Option<(i64, Timestamp)>, StoreError> {
            Ok(row.try_get::<_, Option<i64>>(generation).map_err(c)?.zip(row.try_get::<_, Option<Timestamp>>(lease).map_err(c)?))
        };
        if let Some((g, lease)) = pair(CLAIM_INSERTED_GENERATION, CLAIM_INSERTED_LEASE)? {
            return Ok(claimed(g, lease, false));
        }
        if let Some((g, lease)) = pair(CLAIM_TAKEN_GENERATION, CLAIM_TAKEN_LEASE)? {
            return Ok(claimed(g, lease, true));
        }
        if row.try_get::<_, Option<&str>>(col::TENANT).map_err(c)?.is_none() {
            return Ok(RawClaim::Conflict);
        }
        let now: Timestamp = row.try_get(NOW).map_err(c)?;
        let cacheable: bool = row.try_get(CLAIM_CACHEABLE).map_err(c)?;
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
            // On the tenant's node, naming the tenant (see `citus_route`): `$1` the scope id.
            let (id, p, o, k) = (scope.scope_id().to_i64(), &*scope.principal, &*scope.operation, scope.key.as_str());
            let (status, retention) = (i32::from(response.status), retention_us(retention));
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 10] =
                [&id, &p, &o, &k, &attempt.generation.0, &status, &headers, &body, &retention, &attempt.claim_token];
            let db = self.reach.db(&scope.tenant).await;
            let update = citus_sql::for_tenant(&citus_sql::TENANT_COMPLETE, &scope.tenant);
            return citus::write_with_event_on(db, &update, &params, emit.event, |_| Some(EventType::Completed), emit.body).await;
        }
        let rows = self
            .query(
                &records::COMPLETE,
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
    if flavor == Flavor::Postgres && lifecycle::log_skipped(client, &done).await.map_err(m)? {
        return Ok(false);
    }
    let secret = client.query("SELECT 1 FROM idemgate_settings WHERE name = $1", &[&DERIVED_KEY_SECRET]).await.map_err(m)?;
    Ok(!secret.is_empty())
}

impl PgStore {
    /// The statement of this flavor: PostgreSQL's, or Citus's where it differs.
    fn pick<'a>(&self, postgres: &'a str, citus: &'a str) -> &'a str {
        if self.flavor == Flavor::Citus { citus } else { postgres }
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

fn decode(row: &Row) -> Result<Record, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    RecordRow {
        tenant: row.try_get(col::TENANT).map_err(c)?,
        principal: row.try_get(col::PRINCIPAL).map_err(c)?,
        operation: row.try_get(col::OPERATION).map_err(c)?,
        idempotency_key: row.try_get(col::IDEMPOTENCY_KEY).map_err(c)?,
        request_hash: row.try_get(col::REQUEST_HASH).map_err(c)?,
        state: row.try_get(col::STATE).map_err(c)?,
        generation: row.try_get(col::GENERATION).map_err(c)?,
        claim_token: row.try_get(col::CLAIM_TOKEN).map_err(c)?,
        owner: row.try_get(col::OWNER).map_err(c)?,
        lease_expires_at: row.try_get(col::LEASE_EXPIRES_AT).map_err(c)?,
        response_status: row.try_get::<_, Option<i32>>(col::RESPONSE_STATUS).map_err(c)?.map(i64::from),
        response_headers: row.try_get(col::RESPONSE_HEADERS).map_err(c)?,
        response_body: row.try_get::<_, Option<&[u8]>>(col::RESPONSE_BODY).map_err(c)?.map(Bytes::copy_from_slice),
        created_at: row.try_get(col::CREATED_AT).map_err(c)?,
        updated_at: row.try_get(col::UPDATED_AT).map_err(c)?,
        expires_at: row.try_get(col::EXPIRES_AT).map_err(c)?,
        operation_id: row.try_get(col::OPERATION_ID).map_err(c)?,
        attempts: row.try_get(col::ATTEMPTS).map_err(c)?,
        next_attempt_at: row.try_get(col::NEXT_ATTEMPT_AT).map_err(c)?,
        sent_at: row.try_get(col::SENT_AT).map_err(c)?,
        last_status: row.try_get::<_, Option<i32>>(col::LAST_STATUS).map_err(c)?.map(i64::from),
        maybe_executed: row.try_get(col::MAYBE_EXECUTED).map_err(c)?,
        key_source: row.try_get(col::KEY_SOURCE).map_err(c)?,
        reforward_key: row.try_get(col::REFORWARD_KEY).map_err(c)?,
        fingerprint_spec: row.try_get(col::FINGERPRINT_SPEC).map_err(c)?,
    }
    .into_record()
}
