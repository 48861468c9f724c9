//! Claims on Citus, batched per tenant (issue 30), each tenant's sent to
//! the node that holds its shard (issue 47, `citus_route`).
//!
//! On Citus every statement pays a fixed cost on the coordinator and the
//! worker (distributed planning, routing, the worker's own planning) that is
//! large beside a primary-key lookup, so, as on PostgreSQL, concurrent claims
//! share statements. A batch must name one tenant to stay a router query on
//! one shard (a batch whose arrays mix tenants is sent to every shard), so
//! each tenant has its own two queues: reads (`TENANT_CLAIM_READ_BATCH`:
//! `tenant = '<tenant>' AND scope_id = ANY($1)`) and inserts (a multi-row
//! `INSERT ... VALUES ... ON CONFLICT DO NOTHING`,
//! [`citus_sql::tenant_claim_insert`], after the batch's generations are
//! drawn from the tenant's counter in the same transaction),
//! each running one statement at a time while the next batch fills
//! ([`Batcher`]). A queue of one claim sends the single-row statement. A
//! tenant's slow or failed shard holds only that tenant's queues: other
//! tenants' claims go on.
//!
//! The claim's logic is unchanged (`PgStore::claim_citus`): read; no row:
//! insert (a lost insert is `RawClaim::Conflict`); a row: replay, or take it
//! over when the rules allow (single-row, re-checked on the latest version).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tokio_postgres::Row;
use tokio_postgres::types::{ToSql, Type};
use uuid::Uuid;

use super::batch::{Batcher, ClaimItem};
use super::citus_route::Router;
use super::citus_sql::SEEN_CACHEABLE;
use super::citus_sql::{self, for_tenant};
use super::sql::NOW;
use super::{Conn, Db, classify, decode};
use crate::idempotency::key::Scope;
use crate::idempotency::record::{Record, Timestamp};
use crate::store::StoreError;

/// Most claims one batched statement carries.
const MAX_BATCH: usize = 64;
/// Tenants with queues at once; past this every queue is dropped and made
/// again on use (a dropped queue finishes the batches it holds).
const MAX_TENANTS: usize = 4096;

/// A record the read found: the row, the database clock, and whether it may
/// be cached (as `CITUS_CLAIM_READ` returns them).
#[derive(Debug, Clone)]
pub(super) struct Seen {
    pub(super) record: Record,
    pub(super) now: Timestamp,
    pub(super) cacheable: bool,
}

/// What an insert wrote: generation, lease end (none for a queued
/// acceptance) and the row's `updated_at`.
pub(super) type Inserted = (i64, Option<Timestamp>, Timestamp);

type Queues<I, O> = Mutex<HashMap<Arc<str>, Arc<Batcher<I, O>>>>;

/// Where a tenant's statements go: the store's pool, and the nodes' pools
/// when the URL lists several nodes (`citus_route`).
#[derive(Debug, Clone)]
pub(super) struct Reach {
    pub(super) main: Db,
    pub(super) route: Option<Arc<Router>>,
    pub(super) floor: Arc<Floor>,
}

impl Reach {
    /// The pool for `tenant`'s statements: its node's, or the store's.
    pub(super) async fn db(&self, tenant: &Arc<str>) -> &Db {
        match &self.route {
            Some(r) => r.node_of(&self.main, tenant).await.unwrap_or(&self.main),
            None => &self.main,
        }
    }

    /// A connection for migrations, and whether it may change the schema:
    /// the coordinator's when the URL lists several nodes and one of them
    /// says it is the coordinator (schema changes are refused on a worker,
    /// and the store's pool keeps the first host that answers, which may
    /// be one); otherwise the store's, which may only find the schema up to
    /// date when the URL lists several nodes and none said it is the
    /// coordinator (the first host that answers may be a node not yet
    /// added, where Citus would build a cluster of its own).
    pub(super) async fn conn_for_migrations(&self) -> Result<(Conn, bool), StoreError> {
        let Some(router) = &self.route else { return Ok((self.main.conn().await?, true)) };
        if let Some(db) = router.coordinator().await {
            match db.conn().await {
                Ok(conn) => return Ok((conn, true)),
                Err(e) => tracing::warn!(error = %e, "the Citus coordinator's pool could not connect"),
            }
        }
        Ok((self.main.conn().await?, false))
    }
}

/// The generation a tenant's first counter starts at (migration
/// `citus_0002`: the old sequence's last value), read once.
#[derive(Debug, Default)]
pub(super) struct Floor(OnceLock<i64>);

impl Floor {
    pub(super) async fn get(&self, db: &Db) -> Result<i64, StoreError> {
        if let Some(f) = self.0.get() {
            return Ok(*f);
        }
        let rows = db
            .query("SELECT convert_from(value, 'UTF8')::int8 FROM idemgate_settings WHERE name = 'citus_generation_floor'", &[], false)
            .await?;
        let floor: i64 = rows.first().and_then(|r| r.try_get(0).ok()).ok_or_else(|| {
            StoreError::Unavailable(
                "idemgate_settings has no citus_generation_floor: this database has not been migrated for this version; run `idemgate migrate`".into(),
            )
        })?;
        Ok(*self.0.get_or_init(|| floor))
    }
}

/// The per-tenant queues of a Citus store.
#[derive(Default)]
pub(super) struct TenantClaims {
    reads: Queues<Scope, Option<Seen>>,
    inserts: Queues<ClaimItem, Option<Inserted>>,
}

impl std::fmt::Debug for TenantClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TenantClaims")
    }
}

/// The tenant's queue in `queues`, started on first use.
fn queue<I: Send + 'static, O: Send + 'static>(
    queues: &Queues<I, O>,
    tenant: &Arc<str>,
    start: impl FnOnce() -> Batcher<I, O>,
) -> Arc<Batcher<I, O>> {
    let mut map = queues.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(q) = map.get(tenant) {
        return q.clone();
    }
    if map.len() >= MAX_TENANTS {
        map.clear();
    }
    let q = Arc::new(start());
    map.insert(tenant.clone(), q.clone());
    q
}

impl TenantClaims {
    /// The scope's record, read in a batch of its tenant's claims.
    pub(super) async fn read(&self, reach: &Reach, scope: &Scope) -> Result<Option<Seen>, StoreError> {
        let q = queue(&self.reads, &scope.tenant, || {
            let reach = reach.clone();
            let tenant = scope.tenant.clone();
            Batcher::start("citus claim reads", MAX_BATCH, 1, move |scopes| {
                let (reach, tenant) = (reach.clone(), tenant.clone());
                async move { read_batch(&reach, &tenant, scopes).await }
            })
        });
        q.submit(scope.clone()).await
    }

    /// Inserts the claim's record in a batch of its tenant's claims; `None`:
    /// the scope's row exists (inserted by another claim since the read).
    pub(super) async fn insert(&self, reach: &Reach, item: ClaimItem) -> Result<Option<Inserted>, StoreError> {
        let q = queue(&self.inserts, &item.scope.tenant, || {
            let reach = reach.clone();
            let tenant = item.scope.tenant.clone();
            Batcher::start("citus claim inserts", MAX_BATCH, 1, move |items| {
                let (reach, tenant) = (reach.clone(), tenant.clone());
                async move {
                    let db = reach.db(&tenant).await;
                    match tokio::time::timeout(db.timeout, insert_batch(db, &reach.floor, &tenant, items)).await {
                        Ok(r) => r,
                        Err(_) => Err(StoreError::Ambiguous(format!("batched claim insert timed out after {:?}", db.timeout))),
                    }
                }
            })
        });
        q.submit(item).await
    }
}

fn corrupt(e: tokio_postgres::Error) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn col<'a, T: tokio_postgres::types::FromSql<'a>>(row: &'a Row, i: usize) -> Result<T, StoreError> {
    row.try_get(i).map_err(corrupt)
}

fn found(row: &Row) -> Result<Seen, StoreError> {
    Ok(Seen { record: decode(row)?, now: row.try_get(NOW).map_err(corrupt)?, cacheable: row.try_get(SEEN_CACHEABLE).map_err(corrupt)? })
}

/// One tenant's reads: one statement for all of them, on the tenant's node.
async fn read_batch(reach: &Reach, tenant: &Arc<str>, scopes: Vec<Scope>) -> Result<Vec<Option<Seen>>, StoreError> {
    let db = reach.db(tenant).await;
    let bounded = |sql: String, ids: Vec<i64>, keys: Vec<String>, one: Option<Scope>| async move {
        let run = async {
            match &one {
                Some(s) => {
                    let pk: [&(dyn ToSql + Sync); 4] = [&ids[0], &&*s.principal, &&*s.operation, &s.key.as_str()];
                    db.query_tenant(&sql, &pk, false).await
                }
                None => db.query_tenant(&sql, &[&ids, &keys], false).await,
            }
        };
        match tokio::time::timeout(db.timeout, run).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Unavailable(format!("batched read timed out after {:?}", db.timeout))),
        }
    };
    let ids: Vec<i64> = scopes.iter().map(|s| s.scope_id().to_i64()).collect();
    if let [s] = &scopes[..] {
        let rows = bounded(for_tenant(&citus_sql::TENANT_CLAIM_READ, tenant), ids, Vec::new(), Some(s.clone())).await?;
        return Ok(vec![rows.first().map(found).transpose()?]);
    }
    let keys: Vec<String> = scopes.iter().map(|s| s.key.as_str().to_owned()).collect();
    let rows = bounded(for_tenant(&citus_sql::TENANT_CLAIM_READ_BATCH, tenant), ids, keys, None).await?;
    let found: Vec<Seen> = rows.iter().map(found).collect::<Result<_, _>>()?;
    // Rows are matched to claims by their whole scope (the ids and keys
    // match as two lists, not as pairs).
    Ok(scopes
        .iter()
        .map(|s| {
            found
                .iter()
                .find(|f| {
                    let r = &f.record.scope;
                    r.principal == s.principal && r.operation == s.operation && r.key == s.key
                })
                .cloned()
        })
        .collect())
}

/// Draws `n` generations from `tenant`'s counter on `tx`'s shard (creating
/// it at `floor` for a new tenant): returns the last one drawn; the batch's
/// are the `n` values up to it. The counter's update is prepared once per
/// connection and kept when `keep`; otherwise (behind a transaction-mode
/// pooler, where the next transaction may run on another server session)
/// it is prepared for this draw and closed before the transaction ends.
pub(super) async fn draw(
    tx: &deadpool_postgres::Transaction<'_>,
    tenant: &str,
    n: i64,
    floor: i64,
    keep: bool,
) -> Result<i64, tokio_postgres::Error> {
    let sql = for_tenant(citus_sql::TENANT_GENERATIONS, tenant);
    let update = if keep { tx.prepare_cached(&sql).await? } else { tx.prepare(&sql).await? };
    if let Some(row) = tx.query(&update, &[&n]).await?.first() {
        return row.try_get(0);
    }
    // A new tenant: its counter (an `INSERT`, sent unnamed: see
    // `citus_sql::tenant_claim_insert`), then the draw.
    tx.query_typed(&for_tenant(citus_sql::TENANT_GENERATIONS_START, tenant), &[(&floor, Type::INT8)]).await?;
    tx.query_one(&update, &[&n]).await?.try_get(0)
}

/// One tenant's inserts: the batch's generations drawn from the tenant's
/// counter and one `INSERT` for all of them, in one transaction on the
/// tenant's shard; each claim learns whether its own row went in (by its
/// token).
async fn insert_batch(db: &Db, floor: &Floor, tenant: &str, items: Vec<ClaimItem>) -> Result<Vec<Option<Inserted>>, StoreError> {
    let floor = floor.get(db).await?;
    // Rows in primary-key order (scope id, key, tenant, principal,
    // operation; the text columns compare bytewise): two batches inserting
    // the same scopes never wait on each other in a cycle.
    let callers: Vec<Uuid> = items.iter().map(|i| i.token).collect();
    let mut order: Vec<&ClaimItem> = items.iter().collect();
    order.sort_by(|a, b| {
        let pk = |i: &ClaimItem| {
            (
                i.scope.scope_id().to_i64(),
                i.scope.key.as_str().to_owned(),
                i.scope.tenant.clone(),
                i.scope.principal.clone(),
                i.scope.operation.clone(),
            )
        };
        pk(a).cmp(&pk(b))
    });
    let items = order;
    let n = items.len();
    let principals: Vec<&str> = items.iter().map(|i| &*i.scope.principal).collect();
    let operations: Vec<&str> = items.iter().map(|i| &*i.scope.operation).collect();
    let keys: Vec<&str> = items.iter().map(|i| i.scope.key.as_str()).collect();
    let hashes: Vec<&[u8]> = items.iter().map(|i| &i.request_hash.0[..]).collect();
    let owners: Vec<&str> = items.iter().map(|i| &*i.owner).collect();
    let operation_ids: Vec<Option<&str>> = items.iter().map(|i| i.operation_id()).collect();
    let requests: Vec<Option<&[u8]>> = items.iter().map(|i| i.stored_request()).collect();
    let key_sources: Vec<&str> = items.iter().map(|i| &*i.key_source).collect();
    let ids: Vec<i64> = items.iter().map(|i| i.scope.scope_id().to_i64()).collect();
    let reforward_keys: Vec<Option<&str>> = items.iter().map(|i| Some(i.recorded_key)).collect();
    let fingerprint_specs: Vec<&str> = items.iter().map(|i| &*i.fingerprint_spec).collect();
    let sql = for_tenant(&citus_sql::tenant_claim_insert(n), tenant);
    let read = |e| classify(e, false);
    let mut conn = db.conn().await?;
    if conn.client().statement_cache.size() >= super::MAX_PREPARED {
        conn.client().statement_cache.clear();
    }
    let tx = db.transaction(&mut conn).await.map_err(read)?;
    let last = draw(&tx, tenant, i64::try_from(n).unwrap_or(i64::MAX), floor, !db.sessions.per_transaction()).await.map_err(read)?;
    let generations: Vec<i64> = (0..n as i64).map(|k| last - n as i64 + 1 + k).collect();
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = Vec::with_capacity(n * citus_sql::PER_ROW);
    for (j, i) in items.iter().enumerate() {
        params.extend_from_slice(&[
            (&principals[j] as &(dyn ToSql + Sync), Type::TEXT),
            (&operations[j], Type::TEXT),
            (&keys[j], Type::TEXT),
            (&hashes[j], Type::BYTEA),
            (&i.token, Type::UUID),
            (&owners[j], Type::TEXT),
            (&i.lease_us, Type::INT8),
            (&operation_ids[j], Type::TEXT),
            (&requests[j], Type::BYTEA),
            (&key_sources[j], Type::TEXT),
            (&ids[j], Type::INT8),
            (&generations[j], Type::INT8),
            (&reforward_keys[j], Type::TEXT),
            (&fingerprint_specs[j], Type::TEXT),
        ]);
    }
    let rows = tx.query_typed(&sql, &params).await.map_err(read)?;
    tx.commit().await.map_err(|e| classify(e, true))?;
    conn.done();
    let mut inserted: Vec<(Uuid, Inserted)> = Vec::with_capacity(rows.len());
    for r in &rows {
        inserted.push((col(r, 0)?, (col(r, 1)?, col(r, 2)?, col(r, 3)?)));
    }
    // Back in the callers' order.
    Ok(callers.iter().map(|token| inserted.iter().find(|(t, _)| t == token).map(|(_, x)| *x)).collect())
}
