//! Citus: the PostgreSQL backend on a Citus coordinator, every table
//! distributed by `tenant` (docs/scaling.md).
//!
//! Citus speaks PostgreSQL's protocol, so this is the PostgreSQL backend with
//! a [`Flavor`]: the same pool, failover handling and statements, except
//! where Citus needs a statement of another shape (kept beside the
//! PostgreSQL statement in `sql`), plus what `migrate` does here: the schema
//! of the PostgreSQL migrations, then [`CITUS`], which distributes it.

use tokio_postgres::{Row, Transaction};
use uuid::Uuid;

use super::super::migrations::Migration;
use super::super::{Claim, ClaimRequest, RawClaim, Records, StoreError};
use super::batch::ClaimItem;
use super::citus_batch::{Inserted, Seen};
use super::{citus_sql, classify, micros};
use crate::idempotency::record::{Generation, ReforwardKey, may_take_over};
use crate::outbox::EventType;

/// Which server the PostgreSQL backend talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Flavor {
    /// One PostgreSQL (with standbys): `store.kind = "postgres"`.
    #[default]
    Postgres,
    /// A Citus coordinator: `store.kind = "citus"`.
    Citus,
}

impl Flavor {
    /// `store.kind`, as logs and metrics name the store.
    pub fn kind(self) -> &'static str {
        match self {
            Flavor::Postgres => "postgres",
            Flavor::Citus => "citus",
        }
    }
}

/// Citus's migrations, applied after every PostgreSQL migration, recorded in
/// the same `idemgate_schema_migrations` under versions of their own.
pub const CITUS: &[Migration] = &[
    Migration { version: 1_000_001, name: "citus_0001_distribute", sql: include_str!("../../../migrations/citus/0001_distribute.sql") },
    Migration {
        version: 1_000_002,
        name: "citus_0002_generations_per_tenant",
        sql: include_str!("../../../migrations/citus/0002_generations_per_tenant.sql"),
    },
];

/// Whether a coordinator's error is about a node behind it (a worker it
/// sent the statement to), not about the coordinator's own session: Citus
/// reports a worker it cannot reach or lost mid-statement as "connection to
/// the remote node ... failed" (08006), relays a worker's own error with
/// the context "while executing command on host:port", and reports a commit
/// that failed on a worker as "could not commit transaction for shard".
/// The coordinator's session is fine after such an error (see
/// `failover::fate`).
pub(super) fn remote_node_error(db: &tokio_postgres::error::DbError) -> bool {
    let message = db.message();
    message.starts_with("connection to the remote node")
        || message.starts_with("could not commit transaction for shard")
        || db.where_().is_some_and(|w| w.contains("while executing command on"))
}

/// Whether a write that failed with `db` may still have taken effect: the
/// session ended around it (a FATAL error: a backend terminated while it
/// waited for a synchronous standby after committing locally), or a Citus
/// worker went away around it (its connection broke, 08xxx, or it was shut
/// down, 57P01/57P02, or its commit failed after the statement ran): the
/// worker may have committed before the coordinator lost it. The caller
/// reads the row back.
pub(super) fn write_may_have_committed(db: &tokio_postgres::error::DbError) -> bool {
    use tokio_postgres::error::{Severity, SqlState};
    if matches!(db.parsed_severity(), Some(Severity::Fatal | Severity::Panic)) {
        return true;
    }
    let code = db.code();
    remote_node_error(db)
        && (code.code().starts_with("08")
            || *code == SqlState::ADMIN_SHUTDOWN
            || *code == SqlState::CRASH_SHUTDOWN
            || db.message().starts_with("could not commit transaction for shard"))
}

/// What the server and the database hold, for the checks at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found {
    /// The Citus extension is created in this database.
    pub extension: bool,
    /// `idemgate_records` exists.
    pub records: bool,
    /// `idemgate_records` is a Citus distributed table.
    pub distributed: bool,
}

/// Reads [`Found`]. Plain SQL on any PostgreSQL: `pg_dist_partition` is only
/// looked at when the extension exists.
pub async fn inspect(client: &tokio_postgres::Client) -> Result<Found, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus'), to_regclass('idemgate_records') IS NOT NULL", &[])
        .await?;
    let (extension, records): (bool, bool) = (row.get(0), row.get(1));
    let distributed = if extension && records {
        client
            .query_one("SELECT EXISTS (SELECT 1 FROM pg_dist_partition WHERE logicalrelid = 'idemgate_records'::regclass)", &[])
            .await?
            .get(0)
    } else {
        false
    };
    Ok(Found { extension, records, distributed })
}

/// Whether a store of `flavor` may use a database holding `found`; if not,
/// the start-up error saying which.
pub fn check(flavor: Flavor, found: Found) -> Result<(), StoreError> {
    match flavor {
        Flavor::Postgres if found.distributed => Err(StoreError::Migration(
            "store.kind = \"postgres\", but this database's idemgate schema is distributed by Citus \
             (idemgate_records is a distributed table): set store.kind = \"citus\""
                .into(),
        )),
        Flavor::Citus if !found.extension => Err(StoreError::Migration(
            "store.kind = \"citus\", but this server has no Citus extension in this database: \
             the URL must name a Citus coordinator's database with `CREATE EXTENSION citus` done and its workers added \
             (docs/scaling.md), or set store.kind = \"postgres\""
                .into(),
        )),
        Flavor::Citus if found.records && !found.distributed => Err(StoreError::Migration(
            "store.kind = \"citus\", but this database holds an idemgate schema that is not distributed \
             (idemgate_records is a plain table, migrated as kind = \"postgres\"): idemgate does not convert a \
             single-node store; migrate an empty database on the coordinator with kind = \"citus\" (docs/scaling.md)"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// Citus's part of `migrate`, inside the migration's transaction (after the
/// PostgreSQL migrations): the migrations of [`CITUS`] not yet in `done`.
/// Returns the names applied.
pub async fn migrate(tx: &Transaction<'_>, done: &[i64]) -> Result<Vec<String>, (String, tokio_postgres::Error)> {
    let mut applied = Vec::new();
    for mig in CITUS.iter().filter(|mig| !done.contains(&mig.version)) {
        tx.batch_execute(mig.sql).await.map_err(|e| (mig.name.to_owned(), e))?;
        tx.execute("INSERT INTO idemgate_schema_migrations (version, name) VALUES ($1, $2)", &[&mig.version, &mig.name])
            .await
            .map_err(|e| (mig.name.to_owned(), e))?;
        applied.push(mig.name.to_owned());
    }
    Ok(applied)
}

impl super::PgStore {
    /// The claim on Citus (see `super::citus_sql::CITUS_CLAIM_READ`): read, insert, or
    /// take over, each a router statement on the scope's shard, sent to the
    /// node that holds it when the URL lists the nodes (`super::citus_route`);
    /// the reads and inserts of a tenant's concurrent claims share
    /// statements (`super::citus_batch`).
    pub(super) async fn claim_citus(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError> {
        let s = &req.scope;
        let claimed = |(generation, lease, updated): Inserted, took_over: bool| {
            RawClaim::Claimed(Claim {
                scope: s.clone(),
                generation: Generation(generation),
                claim_token: req.claim_token,
                lease_expires_at: lease.unwrap_or(updated),
                took_over,
                asked_at: tokio::time::Instant::now(),
            })
        };
        let Some(Seen { record, now, cacheable }) = self.citus_claims.read(&self.reach, s).await? else {
            return Ok(match self.citus_claims.insert(&self.reach, ClaimItem::of(req, req.claim_token)).await? {
                Some(inserted) => claimed(inserted, false),
                // Inserted concurrently by another claim since the read.
                None => RawClaim::Conflict,
            });
        };
        if !may_take_over(&record, &req.request_hash, now, req.reforward) {
            return Ok(if cacheable { RawClaim::Cacheable(record, now) } else { RawClaim::Existing(record, now) });
        }
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let lease = micros(req.lease);
        let may_take = req.reforward.filter(|_| req.acceptance.is_none()).map(ReforwardKey::as_str);
        let keeps = Some(req.recorded_key());
        let operation_id = req.acceptance.as_ref().map(|a| a.operation_id.as_str());
        let request = req.acceptance.as_ref().map(|a| &a.request[..]).or(req.request_head.as_deref());
        let generation = self.next_generation(&s.tenant).await?;
        let scope_id = s.scope_id().to_i64();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 15] = [
            &scope_id,
            &&*s.principal,
            &&*s.operation,
            &s.key.as_str(),
            &&req.request_hash.0[..],
            &req.claim_token,
            &&*req.owner,
            &lease,
            &may_take,
            &operation_id,
            &request,
            &&*req.key_source,
            &generation,
            &keeps,
            &&*req.fingerprint_spec,
        ];
        let db = self.reach.db(&s.tenant).await;
        let rows = db.query_tenant(&citus_sql::for_tenant(&citus_sql::TENANT_TAKE_OVER, &s.tenant), &params, true).await?;
        if let Some(row) = rows.first() {
            return Ok(claimed((row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?, row.try_get(2).map_err(c)?), true));
        }
        // Moved on since the read: what it is now.
        match self.get(s).await? {
            Some((record, now)) => Ok(RawClaim::Existing(record, now)),
            None => Ok(RawClaim::Conflict),
        }
    }
}

/// How many tenants one round of background work looks at, the longest
/// waiting first. A round that finds nothing to do in these ends; the next
/// round asks again, so a tenant whose work became due is reached once the
/// ones before it are served.
const TENANTS_PER_ROUND: i64 = 32;

/// A tenant list's parameter: bound as itself, or written into the text a
/// node runs when the list is read node by node.
#[derive(Debug, Clone, Copy)]
enum Param<'a> {
    Texts(&'a [&'a str]),
    Ints(&'a [i64]),
    Int(i64),
}

impl Param<'_> {
    fn bound(&self) -> &(dyn tokio_postgres::types::ToSql + Sync) {
        match self {
            Param::Texts(v) => v,
            Param::Ints(v) => v,
            Param::Int(n) => n,
        }
    }

    /// The value as PostgreSQL reads it from text (an array literal for an
    /// array); quoted as a literal where it is used (`%L`).
    fn text(&self) -> String {
        match self {
            Param::Texts(v) => {
                let quoted: Vec<String> = v.iter().map(|s| format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))).collect();
                format!("{{{}}}", quoted.join(","))
            }
            Param::Ints(v) => format!("{{{}}}", v.iter().map(i64::to_string).collect::<Vec<_>>().join(",")),
            Param::Int(n) => n.to_string(),
        }
    }
}

/// The table a tenant list reads.
const RECORDS: &str = "idemgate_records";
const EVENTS: &str = "idemgate_events";

/// Background work on Citus. `FOR UPDATE SKIP LOCKED` and a `LIMIT` under a
/// row lock run on one shard only ("could not run distributed query with
/// FOR UPDATE/SHARE commands" otherwise), so each of these first reads,
/// without locks, which tenants have work (one read of every shard), then
/// runs PostgreSQL's statement with a `tenant = $n` filter, a router query
/// on that tenant's shard where `SKIP LOCKED` and `LIMIT` work as on one
/// node, tenant by tenant until the batch is full.
///
/// Failing per tenant: a worker that cannot be reached fails the one read
/// of every shard; the list is then read node by node
/// ([`citus_sql::CITUS_TENANTS_BY_NODE`]), so that the tenants of the other
/// workers are served, and a tenant whose own statement fails is skipped for
/// the next one. A round reports an error only when it got nothing done and
/// something failed.
impl super::PgStore {
    async fn tenants(&self, list: &str, table: &str, params: &[Param<'_>]) -> Result<Vec<String>, StoreError> {
        let bound: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params.iter().map(Param::bound).collect();
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let e = match self.query(list, &bound, false).await {
            Ok(rows) => return rows.iter().map(|r| r.try_get::<_, String>(0).map_err(c)).collect(),
            Err(e) => e,
        };
        let texts: Vec<String> = params.iter().map(Param::text).collect();
        let template = citus_sql::by_node(list, table);
        let rows = match self.query(citus_sql::CITUS_TENANTS_BY_NODE, &[&table, &template, &texts], false).await {
            Ok(rows) => rows,
            Err(by_node) => return Err(StoreError::Unavailable(format!("{e}; node by node: {by_node}"))),
        };
        let mut lists = Vec::new();
        let mut unreachable = Vec::new();
        for row in &rows {
            let (node, port, ok, answer): (String, i32, bool, Option<String>) =
                (row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?, row.try_get(2).map_err(c)?, row.try_get(3).map_err(c)?);
            let listed = answer.as_deref().filter(|_| ok).and_then(|a| serde_json::from_str::<Vec<String>>(a).ok());
            match listed {
                Some(tenants) => lists.push(tenants),
                None => unreachable.push(format!("{node}:{port}: {}", answer.unwrap_or_default())),
            }
        }
        if lists.is_empty() {
            return Err(e);
        }
        crate::telemetry::throttle::warn_throttled!(error = %e, unreachable = ?unreachable,
            "a tenant list failed; listed node by node: the tenants of the nodes that answered are served");
        // The nodes' lists in turn, each in its own order.
        let mut merged: Vec<String> = Vec::new();
        let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
        for i in 0..longest {
            for list in &lists {
                if let Some(t) = list.get(i).filter(|t| !merged.contains(t)) {
                    merged.push(t.clone());
                }
            }
        }
        merged.truncate(usize::try_from(TENANTS_PER_ROUND).unwrap_or(usize::MAX));
        Ok(merged)
    }

    /// `TAKE`: the first due operation of the longest-waiting tenant that has one free.
    pub(super) async fn take_rows_citus(
        &self,
        ops: &[&str],
        leases: &[i64],
        claim_token: Uuid,
        owner: &str,
        reforwardable: &[&str],
    ) -> Result<Vec<Row>, StoreError> {
        let params = [Param::Texts(ops), Param::Texts(reforwardable), Param::Int(TENANTS_PER_ROUND)];
        let tenants = self.tenants(citus_sql::CITUS_TENANTS_TO_TAKE, RECORDS, &params).await?;
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        let mut failed = None;
        for tenant in tenants {
            // A new generation of this tenant, used if its take finds an operation.
            let generation = match self.next_generation(&tenant).await {
                Ok(g) => g,
                Err(e) => {
                    failed.get_or_insert(e);
                    continue;
                }
            };
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] =
                [&ops, &leases, &claim_token, &owner, &reforwardable, &tenant, &generation];
            match self.query(&citus_sql::CITUS_TAKE, &params, true).await {
                Ok(rows) if !rows.is_empty() => return Ok(rows),
                Ok(_) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        failed.map_or(Ok(Vec::new()), Err)
    }

    /// `SWEEP`, tenant by tenant until `batch` records are gone.
    pub(super) async fn sweep_citus(&self, batch: u32) -> Result<u64, StoreError> {
        let swept = self
            .tenant_rounds(citus_sql::CITUS_TENANTS_TO_SWEEP, batch, |left, tenant| async move {
                self.query(&citus_sql::CITUS_SWEEP, &[&left, &tenant], true).await
            })
            .await?;
        Ok(swept.len() as u64)
    }

    /// `REAP_LEASES`, tenant by tenant until `batch` attempts are ended.
    pub(super) async fn reap_rows_citus(&self, batch: u32, ops: &[&str], emitting: &[&str]) -> Result<Vec<Row>, StoreError> {
        self.tenant_rounds(citus_sql::CITUS_TENANTS_TO_REAP, batch, |left, tenant| async move {
            self.reap_tenant(left, ops, emitting, &tenant).await
        })
        .await
    }

    /// Runs `each` (with how many rows are still wanted) for the tenants
    /// `list` names, [`TENANTS_PER_ROUND`] at a time, the longest waiting
    /// first, until `batch` rows are done. A full round that did something
    /// is followed by another: the tenants behind it may be due too, and the
    /// caller's loop would take this call's short count for "nothing left"
    /// (with 40 tenants due, one call served 32 and the other 8 waited a
    /// whole `sweep_interval`). A round that did nothing ends the call (a
    /// tenant whose rows cannot be ended now is listed again). A tenant that
    /// fails is skipped; the call fails only when nothing was done.
    async fn tenant_rounds<F, Fut>(&self, list: &str, batch: u32, each: F) -> Result<Vec<Row>, StoreError>
    where
        F: Fn(i64, String) -> Fut,
        Fut: std::future::Future<Output = Result<Vec<Row>, StoreError>>,
    {
        let mut all = Vec::new();
        let mut failed = None;
        loop {
            let tenants = match self.tenants(list, RECORDS, &[Param::Int(TENANTS_PER_ROUND)]).await {
                Ok(tenants) => tenants,
                Err(e) => {
                    failed.get_or_insert(e);
                    break;
                }
            };
            let before = all.len();
            for tenant in &tenants {
                let left = i64::from(batch) - all.len() as i64;
                if left <= 0 {
                    break;
                }
                match each(left, tenant.clone()).await {
                    Ok(rows) => all.extend(rows),
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            let full = i64::try_from(tenants.len()).unwrap_or(i64::MAX) >= TENANTS_PER_ROUND;
            if !full || all.len() == before || all.len() >= batch as usize {
                break;
            }
        }
        let any = !all.is_empty();
        done_or(all, any, failed)
    }

    /// `TAKE_PROBES`, tenant by tenant until `limit` records are taken.
    pub(super) async fn take_probe_rows_citus(
        &self,
        ops: &[&str],
        settles: &[i64],
        token: Uuid,
        hold_us: i64,
        limit: u32,
        at_upstream: &[i64],
    ) -> Result<Vec<Row>, StoreError> {
        let mut all = Vec::new();
        let mut failed = None;
        let params = [Param::Texts(ops), Param::Ints(settles), Param::Ints(at_upstream), Param::Int(TENANTS_PER_ROUND)];
        for tenant in self.tenants(&citus_sql::CITUS_TENANTS_TO_PROBE, RECORDS, &params).await? {
            let left = i64::from(limit) - all.len() as i64;
            if left <= 0 {
                break;
            }
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [&ops, &settles, &token, &hold_us, &left, &at_upstream, &tenant];
            match self.query(&citus_sql::CITUS_TAKE_PROBES, &params, true).await {
                Ok(rows) => all.extend(rows),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let any = !all.is_empty();
        done_or(all, any, failed)
    }

    /// `TAKE_EVENTS`, tenant by tenant until `limit` events are leased.
    pub(super) async fn take_event_rows_citus(
        &self,
        operations: &[&str],
        limit: u32,
        lease_us: i64,
        token: Uuid,
    ) -> Result<(Vec<Row>, bool), StoreError> {
        let mut all = Vec::new();
        let mut failed = None;
        let params = [Param::Texts(operations), Param::Int(TENANTS_PER_ROUND)];
        let tenants = self.tenants(&citus_sql::CITUS_TENANTS_WITH_EVENTS, EVENTS, &params).await?;
        // A round that looked at as many tenants as it may: others may wait.
        let full = i64::try_from(tenants.len()).unwrap_or(i64::MAX) >= TENANTS_PER_ROUND;
        for tenant in tenants {
            let left = i64::from(limit) - all.len() as i64;
            if left <= 0 {
                break;
            }
            match self.query(&citus_sql::CITUS_TAKE_EVENTS, &[&operations, &left, &token, &lease_us, &tenant], true).await {
                Ok(rows) => all.extend(rows),
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        let any = !all.is_empty();
        done_or((all, full), any, failed)
    }
}

impl super::PgStore {
    /// `CITUS_REAP_LEASES` for one tenant and the `unknown` events of the
    /// attempts it ended, in one transaction on the tenant's shard.
    async fn reap_tenant(&self, left: i64, ops: &[&str], emitting: &[&str], tenant: &str) -> Result<Vec<Row>, StoreError> {
        if emitting.is_empty() {
            return self.query(&citus_sql::CITUS_REAP_LEASES, &[&left, &ops, &emitting, &tenant], true).await;
        }
        let w = |e| classify(e, true);
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let mut conn = self.db.conn().await?;
        let tx = self.db.transaction(&mut conn).await.map_err(w)?;
        let rows = tx.query(self.db.text(&citus_sql::CITUS_REAP_LEASES), &[&left, &ops, &emitting, &tenant]).await.map_err(w)?;
        for row in &rows {
            if !row.try_get::<_, bool>(7).map_err(c)? {
                continue;
            }
            let (t, p, o, k): (&str, &str, &str, &str) =
                (row.try_get(1).map_err(c)?, row.try_get(2).map_err(c)?, row.try_get(3).map_err(c)?, row.try_get(4).map_err(c)?);
            let (generation, operation_id): (Option<i64>, Option<&str>) = (row.try_get(5).map_err(c)?, row.try_get(6).map_err(c)?);
            let (status, actor, body): (Option<i32>, Option<&str>, Option<&[u8]>) = (None, None, None);
            tx.execute(
                self.db.text(&super::events::EVENT_INSERT_ONE),
                &[&EventType::Unknown.as_str(), &t, &p, &o, &k, &generation, &status, &operation_id, &actor, &body],
            )
            .await
            .map_err(w)?;
        }
        tx.commit().await.map_err(w)?;
        conn.done();
        Ok(rows)
    }
}

/// A round's result: what it did, or, when it did nothing and a tenant's
/// statement failed, that failure (the task logs it and tries again later).
fn done_or<T>(done: T, any: bool, failed: Option<StoreError>) -> Result<T, StoreError> {
    match failed {
        Some(e) if !any => Err(e),
        _ => Ok(done),
    }
}

/// The generation `CITUS_GENERATIONS` returns (autocommitted, or in a
/// resolution's transaction: `super::reconcile`).
pub(super) fn drawn(rows: &[Row]) -> Result<i64, StoreError> {
    rows.first()
        .and_then(|r| r.try_get::<_, i64>(0).ok())
        .ok_or_else(|| StoreError::Corrupt("the generation counter returned no value".into()))
}

impl super::PgStore {
    /// A new generation of `tenant`, drawn from its counter on its shard
    /// (`super::citus_sql::CITUS_GENERATIONS`, autocommitted: a value drawn
    /// is never drawn again, whether or not it is used).
    pub(super) async fn next_generation(&self, tenant: &str) -> Result<i64, StoreError> {
        let floor = self.reach.floor.get(&self.db).await?;
        drawn(&self.query(super::citus_sql::CITUS_GENERATIONS, &[&tenant, &1i64, &floor], true).await?)
    }

    /// A final state change and its event on Citus: `update` (one of
    /// `super::citus_sql::CITUS_COMPLETE`, `CITUS_MARK_UNKNOWN`, `CITUS_FAIL`, each
    /// returning tenant, principal, operation, key, generation, status,
    /// operation id, body and the new state), then, when `event` names one
    /// for the new state, the event row, in one transaction on the scope's
    /// shard. Without an event to write it is the `UPDATE` alone,
    /// autocommitted. Returns whether the fenced `UPDATE` matched.
    pub(super) async fn write_with_event(
        &self,
        update: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        may_emit: bool,
        event: impl Fn(&str) -> Option<EventType>,
        with_body: bool,
    ) -> Result<bool, StoreError> {
        write_with_event_on(&self.db, self.db.text(update), params, may_emit, event, with_body).await
    }
}

/// [`PgStore::write_with_event`] on `db`, `update` as it is sent (a
/// per-tenant text, `citus_sql::for_tenant`, or a fixed one as
/// `Db::text` gives it).
///
/// [`PgStore::write_with_event`]: super::PgStore::write_with_event
pub(super) async fn write_with_event_on(
    db: &super::Db,
    update: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    may_emit: bool,
    event: impl Fn(&str) -> Option<EventType>,
    with_body: bool,
) -> Result<bool, StoreError> {
    {
        if !may_emit {
            return Ok(!db.query_tenant(update, params, true).await?.is_empty());
        }
        let w = |e| classify(e, true);
        let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
        let mut conn = db.conn().await?;
        let tx = db.transaction(&mut conn).await.map_err(w)?;
        let rows = tx.query(update, params).await.map_err(w)?;
        let Some(row) = rows.first() else {
            tx.rollback().await.map_err(w)?;
            conn.done();
            return Ok(false);
        };
        let state: &str = row.try_get(8).map_err(c)?;
        if let Some(event) = event(state) {
            let (t, p, o, k): (&str, &str, &str, &str) =
                (row.try_get(0).map_err(c)?, row.try_get(1).map_err(c)?, row.try_get(2).map_err(c)?, row.try_get(3).map_err(c)?);
            let generation: Option<i64> = row.try_get(4).map_err(c)?;
            let status: Option<i32> = row.try_get(5).map_err(c)?;
            let operation_id: Option<&str> = row.try_get(6).map_err(c)?;
            let body: Option<&[u8]> = if with_body { row.try_get(7).map_err(c)? } else { None };
            let actor: Option<&str> = None;
            tx.execute(
                db.text(&super::events::EVENT_INSERT_ONE),
                &[&event.as_str(), &t, &p, &o, &k, &generation, &status, &operation_id, &actor, &body],
            )
            .await
            .map_err(w)?;
        }
        tx.commit().await.map_err(w)?;
        conn.done();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_parameters_are_written_as_postgres_reads_them() {
        assert_eq!(Param::Texts(&["a", "b\"c", "d\\e", "it's"]).text(), r#"{"a","b\"c","d\\e","it's"}"#);
        assert_eq!(Param::Texts(&[]).text(), "{}");
        assert_eq!(Param::Ints(&[1, -2]).text(), "{1,-2}");
        assert_eq!(Param::Int(32).text(), "32");
    }
}
