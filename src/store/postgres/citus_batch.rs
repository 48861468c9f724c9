//! Claims on Citus, batched per tenant (issue 30).
//!
//! On Citus every statement pays a fixed cost on the coordinator and the
//! worker (distributed planning, routing, the worker's own planning) that is
//! large beside a primary-key lookup, so, as on PostgreSQL, concurrent claims
//! share statements. A batch must name one tenant to stay a router query on
//! one shard (a batch whose arrays mix tenants is sent to every shard), so
//! each tenant has its own two queues: reads (`CITUS_CLAIM_READ_BATCH`:
//! `tenant = $1 AND scope_id = ANY($2)`) and inserts (a multi-row `INSERT
//! ... VALUES ... ON CONFLICT DO NOTHING`, [`citus_sql::claim_insert_batch`]),
//! each running one statement at a time while the next batch fills
//! ([`Batcher`]). A queue of one claim sends the single-row statement. A
//! tenant's slow or failed shard holds only that tenant's queues: other
//! tenants' claims go on.
//!
//! The claim's logic is unchanged (`PgStore::claim_citus`): read; no row:
//! insert (a lost insert is `RawClaim::Conflict`); a row: replay, or take it
//! over when the rules allow (single-row, re-checked on the latest version).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio_postgres::Row;
use uuid::Uuid;

use super::batch::{Batcher, ClaimItem};
use super::{Db, NCOLS, citus_sql, decode};
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
    pub(super) async fn read(&self, db: &Db, scope: &Scope) -> Result<Option<Seen>, StoreError> {
        let db = db.clone();
        let q = queue(&self.reads, &scope.tenant, || {
            Batcher::start("citus claim reads", MAX_BATCH, 1, move |scopes| {
                let db = db.clone();
                async move { read_batch(&db, scopes).await }
            })
        });
        q.submit(scope.clone()).await
    }

    /// Inserts the claim's record in a batch of its tenant's claims; `None`:
    /// the scope's row exists (inserted by another claim since the read).
    pub(super) async fn insert(&self, db: &Db, item: ClaimItem) -> Result<Option<Inserted>, StoreError> {
        let db = db.clone();
        let q = queue(&self.inserts, &item.scope.tenant, || {
            Batcher::start("citus claim inserts", MAX_BATCH, 1, move |items| {
                let db = db.clone();
                async move { insert_batch(&db, items).await }
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
    Ok(Seen { record: decode(row)?, now: row.try_get(NCOLS).map_err(corrupt)?, cacheable: row.try_get(NCOLS + 1).map_err(corrupt)? })
}

/// One tenant's reads: one statement for all of them.
async fn read_batch(db: &Db, scopes: Vec<Scope>) -> Result<Vec<Option<Seen>>, StoreError> {
    let Some(first) = scopes.first() else { return Ok(Vec::new()) };
    if let [s] = &scopes[..] {
        let pk: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&&*s.tenant, &&*s.principal, &&*s.operation, &s.key.as_str()];
        let rows = db.bounded_query(&citus_sql::CITUS_CLAIM_READ, &pk, false).await?;
        return Ok(vec![rows.first().map(found).transpose()?]);
    }
    let ids: Vec<i64> = scopes.iter().map(|s| s.scope_id().to_i64()).collect();
    let keys: Vec<&str> = scopes.iter().map(|s| s.key.as_str()).collect();
    let rows = db.bounded_query(&citus_sql::CITUS_CLAIM_READ_BATCH, &[&&*first.tenant, &ids, &keys], false).await?;
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

/// One tenant's inserts: one statement for all of them; each claim learns
/// whether its own row went in (by its token).
async fn insert_batch(db: &Db, items: Vec<ClaimItem>) -> Result<Vec<Option<Inserted>>, StoreError> {
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
    let tenants: Vec<&str> = items.iter().map(|i| &*i.scope.tenant).collect();
    let principals: Vec<&str> = items.iter().map(|i| &*i.scope.principal).collect();
    let operations: Vec<&str> = items.iter().map(|i| &*i.scope.operation).collect();
    let keys: Vec<&str> = items.iter().map(|i| i.scope.key.as_str()).collect();
    let hashes: Vec<&[u8]> = items.iter().map(|i| &i.request_hash.0[..]).collect();
    let owners: Vec<&str> = items.iter().map(|i| &*i.owner).collect();
    let operation_ids: Vec<Option<&str>> = items.iter().map(|i| i.operation_id()).collect();
    let requests: Vec<Option<&[u8]>> = items.iter().map(|i| i.stored_request()).collect();
    let key_sources: Vec<&str> = items.iter().map(|i| &*i.key_source).collect();
    let unused = false;
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = Vec::with_capacity(items.len() * 12);
    for (j, i) in items.iter().enumerate() {
        params.extend_from_slice(&[&tenants[j], &principals[j], &operations[j], &keys[j], &hashes[j], &i.token, &owners[j], &i.lease_us]);
        if items.len() == 1 {
            // `CITUS_CLAIM_INSERT` takes `CLAIM`'s parameters, `$9` unused.
            params.push(&unused);
        }
        params.extend_from_slice(&[&operation_ids[j], &requests[j], &key_sources[j]]);
    }
    if items.len() == 1 {
        let rows = db.bounded_query(&citus_sql::CITUS_CLAIM_INSERT, &params, true).await?;
        let inserted = match rows.first() {
            Some(r) => Some((col(r, 0)?, col(r, 1)?, col(r, 2)?)),
            None => None,
        };
        return Ok(vec![inserted]);
    }
    let rows = db.bounded_query(&citus_sql::claim_insert_batch(items.len()), &params, true).await?;
    let mut inserted: Vec<(Uuid, Inserted)> = Vec::with_capacity(rows.len());
    for r in &rows {
        inserted.push((col(r, 0)?, (col(r, 1)?, col(r, 2)?, col(r, 3)?)));
    }
    // Back in the callers' order.
    Ok(callers.iter().map(|token| inserted.iter().find(|(t, _)| t == token).map(|(_, x)| *x)).collect())
}
