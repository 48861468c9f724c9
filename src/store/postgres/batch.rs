//! Group commit for the two writes every first request makes: concurrent
//! claims share one INSERT statement, concurrent result writes one UPDATE.
//!
//! Each statement is still one autocommitted statement, and each request still
//! learns its own outcome before it goes on (a claim before its forward), but
//! N requests pay for one commit instead of N. Batches form naturally: while
//! `concurrency` statements are running, new requests queue, and the next
//! statement takes all of them (up to `max_batch`). At low load a batch is one
//! request and nothing waits.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{Semaphore, mpsc, oneshot};

use super::records::{BATCH_CACHEABLE, BATCH_INSERTED_GENERATION, BATCH_INSERTED_LEASE, BATCH_WRITTEN};
use super::sql::NOW;
use super::{Db, decode, micros};
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::Scope;
use crate::idempotency::record::{Attempt, Generation, Record, Timestamp};
use crate::outbox::{EventPolicies, EventType};
use crate::store::codec::col;
use crate::store::{Acceptance, ClaimRequest, StoreError};
use bytes::Bytes;
use tokio_postgres::Row;
use uuid::Uuid;

struct Job<I, O> {
    item: I,
    reply: oneshot::Sender<Result<O, StoreError>>,
}

/// Queues items for `exec`, which runs one statement for a whole batch and
/// returns one result per item, in order.
pub(super) struct Batcher<I, O> {
    tx: mpsc::UnboundedSender<Job<I, O>>,
}

impl<I, O> std::fmt::Debug for Batcher<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Batcher")
    }
}

impl<I: Send + 'static, O: Send + 'static> Batcher<I, O> {
    /// Starts the batching task. It ends when the batcher is dropped (the
    /// store goes away), after finishing the batches already taken, so
    /// results of a draining gateway are still written.
    pub(super) fn start<F, Fut>(name: &'static str, max_batch: usize, concurrency: usize, exec: F) -> Batcher<I, O>
    where
        F: Fn(Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<O>, StoreError>> + Send + 'static,
    {
        let (tx, mut rx) = mpsc::unbounded_channel::<Job<I, O>>();
        let exec = Arc::new(exec);
        let slots = Arc::new(Semaphore::new(concurrency.max(1)));
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                // Wait for a free slot first: meanwhile the queue fills up.
                let Ok(slot) = slots.clone().acquire_owned().await else { break };
                let mut jobs = vec![first];
                while jobs.len() < max_batch {
                    match rx.try_recv() {
                        Ok(job) => jobs.push(job),
                        Err(_) => break,
                    }
                }
                // A caller that stopped waiting (its operation timed out and it
                // answered, or it is reading the row back) must not have its
                // statement run behind its back: skip it.
                jobs.retain(|job| !job.reply.is_closed());
                if jobs.is_empty() {
                    continue;
                }
                let exec = exec.clone();
                tokio::spawn(async move {
                    let (items, replies): (Vec<I>, Vec<_>) = jobs.into_iter().map(|j| (j.item, j.reply)).unzip();
                    let n = items.len();
                    match exec(items).await {
                        Ok(results) if results.len() == n => {
                            for (reply, result) in replies.into_iter().zip(results) {
                                let _ = reply.send(Ok(result));
                            }
                        }
                        Ok(results) => {
                            let e = StoreError::Corrupt(format!("{name}: batch of {n} returned {} results", results.len()));
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                        Err(e) => {
                            for reply in replies {
                                let _ = reply.send(Err(e.clone()));
                            }
                        }
                    }
                    drop(slot);
                });
            }
            tracing::debug!(batcher = name, "batcher stopped");
        });
        Batcher { tx }
    }

    /// Adds `item` to the next batch and waits for its result.
    pub(super) async fn submit(&self, item: I) -> Result<O, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Job { item, reply }).map_err(|_| StoreError::Unavailable("store is shutting down".into()))?;
        // A dropped reply means the batch task died: the statement may or may
        // not have run.
        rx.await.unwrap_or_else(|_| Err(StoreError::Ambiguous("batch task ended without an answer".into())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_items_share_batches_and_get_their_own_results() {
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        let batcher = Arc::new(Batcher::start("test", 64, 1, move |items: Vec<u32>| {
            let c = c.clone();
            async move {
                c.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(items.into_iter().map(|i| i * 10).collect())
            }
        }));
        let mut tasks = Vec::new();
        for i in 0..100u32 {
            let b = batcher.clone();
            tasks.push(tokio::spawn(async move { (i, b.submit(i).await) }));
        }
        for t in tasks {
            let (i, r) = t.await.unwrap();
            assert_eq!(r.unwrap(), i * 10);
        }
        let n = calls.load(Ordering::SeqCst);
        assert!((2..100).contains(&n), "100 items took {n} statements");
    }

    #[tokio::test]
    async fn a_failed_batch_fails_every_item() {
        let batcher = Batcher::start("test", 8, 1, |_items: Vec<u32>| async { Err::<Vec<u32>, _>(StoreError::Ambiguous("lost".into())) });
        assert!(matches!(batcher.submit(1).await, Err(StoreError::Ambiguous(_))));
    }
}

/// One claim waiting for its batch.
pub(super) struct ClaimItem {
    pub(super) scope: Scope,
    pub(super) request_hash: Fingerprint,
    pub(super) token: Uuid,
    pub(super) owner: Arc<str>,
    pub(super) lease_us: i64,
    pub(super) acceptance: Option<Acceptance>,
    pub(super) key_source: Arc<str>,
    /// [`ClaimRequest::recorded_key`].
    pub(super) recorded_key: &'static str,
    pub(super) fingerprint_spec: Arc<str>,
    pub(super) request_head: Option<Bytes>,
}

impl ClaimItem {
    /// `req`'s claim under `token` (the claim's own token, or a fresh one for a retry).
    pub(super) fn of(req: &ClaimRequest, token: Uuid) -> ClaimItem {
        ClaimItem {
            scope: req.scope.clone(),
            request_hash: req.request_hash,
            token,
            owner: req.owner.clone(),
            lease_us: micros(req.lease),
            acceptance: req.acceptance.clone(),
            key_source: req.key_source.clone(),
            recorded_key: req.recorded_key(),
            fingerprint_spec: req.fingerprint_spec.clone(),
            request_head: req.request_head.clone(),
        }
    }

    /// The operation id of an async acceptance.
    pub(super) fn operation_id(&self) -> Option<&str> {
        self.acceptance.as_ref().map(|a| a.operation_id.as_str())
    }

    /// What the row keeps of the request: an acceptance's whole request, or
    /// a synchronous claim's request line for probes.
    pub(super) fn stored_request(&self) -> Option<&[u8]> {
        self.acceptance.as_ref().map(|a| &a.request[..]).or(self.request_head.as_deref())
    }
}

/// What the batched claim found for one item.
pub(super) enum BatchClaim {
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
pub(super) struct CompleteItem {
    pub(super) scope: Scope,
    pub(super) attempt: Attempt,
    pub(super) status: i32,
    pub(super) headers: Vec<u8>,
    pub(super) body: Option<Bytes>,
    /// NULL: forever (see `retention_us`).
    pub(super) retention_us: Option<i64>,
    pub(super) emit: Emit,
}

/// A claim or a result write waiting for its batch.
pub(super) enum WriteItem {
    Claim(ClaimItem),
    Complete(CompleteItem),
}

pub(super) enum WriteOut {
    Claim(BatchClaim),
    Complete(BatchWrite),
}

pub(super) enum BatchWrite {
    Written,
    Fenced,
    Retry,
}

/// Whether a change writes its event, and with the response body.
#[derive(Debug, Clone, Copy)]
pub(super) struct Emit {
    pub(super) event: bool,
    pub(super) body: bool,
}

impl Emit {
    pub(super) fn of(events: &EventPolicies, operation: &str, event: EventType) -> Emit {
        let on = events.emits(operation, event);
        Emit { event: on, body: on && events.include_body(operation) }
    }
}

/// The primary-key columns of a batch, as the arrays its statement unnests.
pub(super) struct PkColumns<'a> {
    pub(super) tenants: Vec<&'a str>,
    pub(super) principals: Vec<&'a str>,
    pub(super) operations: Vec<&'a str>,
    pub(super) keys: Vec<&'a str>,
    /// The primary key's first column (`Scope::scope_id`).
    pub(super) scope_ids: Vec<i64>,
}

impl<'a> PkColumns<'a> {
    pub(super) fn of(scopes: impl ExactSizeIterator<Item = &'a Scope>) -> PkColumns<'a> {
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
pub(super) fn is_deadlock(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(m) if m.contains("40P01"))
}

impl Db {
    /// A batched statement under the batch timeout (a batch outlives any one
    /// caller): a write that timed out is ambiguous, a read unavailable.
    pub(super) async fn bounded_query(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        write: bool,
    ) -> Result<Vec<Row>, StoreError> {
        match tokio::time::timeout(self.timeout, self.query(sql, params, write)).await {
            Ok(r) => r,
            // A write that timed out may have committed; a read changed nothing.
            Err(_) if write => Err(StoreError::Ambiguous(format!("batched statement timed out after {:?}", self.timeout))),
            Err(_) => Err(StoreError::Unavailable(format!("batched read timed out after {:?}", self.timeout))),
        }
    }

    /// One statement, one commit, for a batch of claims and result writes:
    /// `CLAIM_BATCH`, `COMPLETE_BATCH`, or both in `WRITE_BATCH`. A result
    /// write of one request and the claim of the next then share a commit.
    pub(super) async fn write_batch(&self, items: Vec<WriteItem>) -> Result<Vec<WriteOut>, StoreError> {
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
            (_, true) => (&super::records::CLAIM_BATCH, claim_cols.params()),
            (true, false) => (&super::records::COMPLETE_BATCH, complete_cols.params()),
            (false, false) => (&super::records::WRITE_BATCH, claim_cols.params().into_iter().chain(complete_cols.params()).collect()),
        };
        let rows = match self.bounded_query(statement, &params, true).await {
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
                Some(row) => row.try_get::<_, Option<Vec<i64>>>(BATCH_WRITTEN).map_err(c)?.unwrap_or_default(),
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
pub(super) fn decode_batch_claim(row: &Row) -> Result<BatchClaim, StoreError> {
    let c = |e: tokio_postgres::Error| StoreError::Corrupt(e.to_string());
    let generation: Option<i64> = row.try_get(BATCH_INSERTED_GENERATION).map_err(c)?;
    let lease: Option<Timestamp> = row.try_get(BATCH_INSERTED_LEASE).map_err(c)?;
    if let (Some(g), Some(lease)) = (generation, lease) {
        return Ok(BatchClaim::Inserted { generation: Generation(g), lease_expires_at: lease });
    }
    if row.try_get::<_, Option<&str>>(col::TENANT).map_err(c)?.is_none() {
        return Ok(BatchClaim::Conflict);
    }
    let now: Timestamp = row.try_get(NOW).map_err(c)?;
    let cacheable: bool = row.try_get::<_, Option<bool>>(BATCH_CACHEABLE).map_err(c)?.unwrap_or(false);
    Ok(BatchClaim::Existing(Box::new(decode(row)?), now, cacheable))
}

/// The claims of a batch as the arrays `CLAIM_INPUT` unnests.
pub(super) struct ClaimColumns<'a> {
    pub(super) pk: PkColumns<'a>,
    pub(super) hashes: Vec<&'a [u8]>,
    pub(super) tokens: Vec<Uuid>,
    pub(super) owners: Vec<&'a str>,
    pub(super) leases: Vec<i64>,
    pub(super) operation_ids: Vec<Option<&'a str>>,
    pub(super) requests: Vec<Option<&'a [u8]>>,
    pub(super) key_sources: Vec<&'a str>,
    pub(super) reforward_keys: Vec<Option<&'static str>>,
    pub(super) fingerprint_specs: Vec<&'a str>,
}

impl<'a> ClaimColumns<'a> {
    pub(super) fn of(items: impl ExactSizeIterator<Item = &'a ClaimItem> + Clone) -> ClaimColumns<'a> {
        ClaimColumns {
            pk: PkColumns::of(items.clone().map(|i| &i.scope)),
            hashes: items.clone().map(|i| &i.request_hash.0[..]).collect(),
            tokens: items.clone().map(|i| i.token).collect(),
            owners: items.clone().map(|i| &*i.owner).collect(),
            leases: items.clone().map(|i| i.lease_us).collect(),
            operation_ids: items.clone().map(ClaimItem::operation_id).collect(),
            requests: items.clone().map(ClaimItem::stored_request).collect(),
            key_sources: items.clone().map(|i| &*i.key_source).collect(),
            reforward_keys: items.clone().map(|i| Some(i.recorded_key)).collect(),
            fingerprint_specs: items.map(|i| &*i.fingerprint_spec).collect(),
        }
    }

    pub(super) fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
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
            &self.reforward_keys,
            &self.fingerprint_specs,
        ]
    }
}

/// The result writes of a batch as the arrays `complete_parts` unnests.
pub(super) struct CompleteColumns<'a> {
    pub(super) pk: PkColumns<'a>,
    pub(super) generations: Vec<i64>,
    pub(super) statuses: Vec<i32>,
    pub(super) headers: Vec<&'a [u8]>,
    pub(super) bodies: Vec<Option<&'a [u8]>>,
    pub(super) retentions: Vec<Option<i64>>,
    pub(super) tokens: Vec<Uuid>,
    pub(super) emit: Vec<bool>,
    pub(super) with_body: Vec<bool>,
}

impl<'a> CompleteColumns<'a> {
    pub(super) fn of(items: impl ExactSizeIterator<Item = &'a CompleteItem> + Clone) -> CompleteColumns<'a> {
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

    pub(super) fn params(&self) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
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
