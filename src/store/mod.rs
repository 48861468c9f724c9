//! The store: one contract ([`contract`]), two backends ([`postgres`] for
//! several replicas, [`sqlite`] embedded for one), and [`Store`] here, the
//! facade the rest of the gateway sees: what must not differ between the
//! backends (bounded operation time, reading a row back after an ambiguous
//! write, the replay cache, metrics), each operation named once in [`op`].
//! How the concerns are laid out, and where a new statement goes:
//! `docs/architecture.md`.

pub mod audit;
pub mod cache;
pub mod codec;
pub mod contract;
mod error;
mod health;
pub mod migrations;
pub mod op;
pub mod postgres;
pub mod resolution;
pub mod sqlite;
mod startup;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use tokio_util::task::TaskTracker;
use uuid::Uuid;

pub use crate::telemetry::stats::{EventStats, ForeverCount, StateCount};
pub use contract::{
    Acceptance, Claim, ClaimOutcome, ClaimRequest, Events, Inspection, Lifecycle, ListCursor, ListFilter, ProbeFence, ProbeRoute, Probing,
    Queue, RawClaim, Reaped, Reconcile, RecordStore, Records, Resolution, ResolveOutcome, RetryNote, SessionReport, Taken, Trail,
    UNRECORDED_AT_UPSTREAM, WorkerRoute, WriteOutcome,
};
pub use error::StoreError;
pub use health::NotReady;
pub use startup::{Retry, StartError};

use crate::idempotency::key::{Scope, ScopeId};
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Attempt, Generation, Record, State, StoredResponse, Timestamp};
use crate::outbox::{Delivery, EventPolicies, OutboxEvent};
use crate::secret::Secret;
use crate::store::audit::{AuditEntry, AuditNote};
use crate::store::op::StoreOp;
use crate::telemetry::metrics::Metrics;

#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub backend: StoreBackend,
    /// Whether `serve` applies pending migrations at start.
    pub migrate: bool,
    /// What `serve` does when PostgreSQL cannot be reached at start.
    pub unreachable_at_start: UnreachableAtStart,
    /// Bound on any single store operation; past it the operation counts as
    /// failed (and, for a claim or result write, ambiguous).
    pub operation_timeout: Duration,
    /// How often the sweeper and the lease reaper run.
    pub sweep_interval: Duration,
    /// Records deleted (or reaped) per statement.
    pub sweep_batch: u32,
    /// How long delivered events are kept before the sweeper deletes them
    /// (pending and parked events are never deleted).
    pub events_retention: Duration,
}

/// `store.unreachable_at_start`: what `serve` does when PostgreSQL cannot
/// be reached at start (the embedded store's errors always stop it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnreachableAtStart {
    /// Start anyway: pass-through is served, idempotent routes answer 503
    /// `store-unavailable`, `/readyz` 503; the store is retried with
    /// backoff and, once it answers, migrated (with `store.migrate`) and used.
    #[default]
    Retry,
    /// Exit 1, as a supervisor that restarts the process expects.
    Exit,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StoreBackend {
    Postgres {
        url: Secret,
        pool_size: usize,
        pooler: Pooler,
    },
    /// A Citus coordinator (`store.kind = "citus"`): the PostgreSQL backend
    /// with the Citus flavor (see `postgres::citus`).
    Citus {
        url: Secret,
        pool_size: usize,
        pooler: Pooler,
    },
    Sqlite {
        path: PathBuf,
    },
}

/// `store.pooler`: what sits between the store and PostgreSQL (see
/// `postgres::pooler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pooler {
    /// A direct connection: session settings and prepared statements are
    /// kept for the connection's life.
    #[default]
    None,
    /// A pooler in session mode (PgBouncer `pool_mode = session`): the same
    /// as a direct connection.
    Session,
    /// A pooler in transaction mode: nothing is left on a server session
    /// past one transaction (settings per transaction, unnamed statements).
    Transaction,
}

/// What a fenced write leaves behind, for reading it back after an
/// ambiguous failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Goal {
    /// The record in this state, under our attempt.
    State(State),
    /// No record.
    Deleted,
    /// Our attempt, `processing`, with `sent_at` set.
    Sent,
    /// Cannot be told from the row (a heartbeat): retry while the attempt holds it.
    Retry,
    /// `failed_retryable` or `unknown` (a used-up async operation).
    Ended,
}

impl Goal {
    fn reached(self, r: &Record) -> bool {
        match self {
            Goal::State(s) => r.state == s,
            Goal::Sent => r.state == State::Processing && r.sent_at.is_some(),
            Goal::Ended => matches!(r.state, State::FailedRetryable | State::Unknown),
            Goal::Deleted | Goal::Retry => false,
        }
    }
}

/// How a process uses the store; matters for the embedded store, which is
/// one file that one gateway owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// `serve` and `demo`: create the store if needed and take the
    /// one-replica lock for the process's life.
    Serve,
    /// `migrate`: create the store if needed, without the lock.
    Migrate,
    /// Operator commands (`keys`, `check-config --connect`): the store must
    /// already exist; a mistyped path is an error, never a new empty file.
    /// No lock, so they work beside a running gateway.
    Existing,
}

/// The store as the rest of the gateway sees it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    backend: Arc<dyn RecordStore>,
    /// Bound on any single operation.
    timeout: Duration,
    metrics: Option<Arc<Metrics>>,
    /// Which operations write completion events with their final state changes.
    events: Arc<EventPolicies>,
    /// Completed records read in the last second (PostgreSQL; see `cache`).
    cache: Option<Arc<cache::ReplayCache>>,
    /// Failed writes and write probes, for readiness (see `health`).
    writes: Arc<health::WriteHealth>,
    /// False while `serve` waits for a store it could not reach at start:
    /// operations fail at once (see `startup`).
    up: Arc<std::sync::atomic::AtomicBool>,
}

/// What every operation of a held store fails with (see `startup`).
fn not_up() -> StoreError {
    StoreError::Unavailable("not reached since the start; retrying in the background".into())
}

/// How many times an ambiguous write is read back and retried before giving up.
const AMBIGUITY_ATTEMPTS: usize = 3;

/// Whether `record` is the claim made with `token` and still waiting for its
/// result (an operator's resolution keeps the token but not the state).
fn own_claim(record: &Record, token: Uuid) -> bool {
    record.claim_token == token && matches!(record.state, State::InFlight | State::Queued)
}

/// The claim `req` holds, learned by reading its row back.
fn claim_of(req: &ClaimRequest, record: Record, asked_at: Instant) -> Claim {
    Claim {
        scope: req.scope.clone(),
        generation: record.generation,
        claim_token: record.claim_token,
        lease_expires_at: record.lease_expires_at.unwrap_or(record.updated_at),
        // Learned by reading the row back: whether the statement inserted or
        // took over is not recorded.
        took_over: false,
        asked_at,
    }
}

impl Store {
    /// Connects (PostgreSQL: builds the pool; SQLite: opens the file, see
    /// [`Access`]).
    pub async fn open(config: &StoreConfig, access: Access) -> Result<Store, StoreError> {
        let (backend, cache): (Arc<dyn RecordStore>, _) = match &config.backend {
            StoreBackend::Postgres { url, pool_size, pooler } => {
                (Arc::new(postgres::PgStore::connect(url.expose(), *pool_size, config.operation_timeout, *pooler)?), Some(Arc::default()))
            }
            StoreBackend::Citus { url, pool_size, pooler } => (
                Arc::new(postgres::PgStore::connect_as(
                    url.expose(),
                    *pool_size,
                    config.operation_timeout,
                    *pooler,
                    postgres::Flavor::Citus,
                )?),
                Some(Arc::default()),
            ),
            // The embedded store's file can be resolved by `idemgate keys`
            // beside the gateway, outside the protocol the cache relies on.
            StoreBackend::Sqlite { path } => (Arc::new(sqlite::SqliteStore::open(path, access).await?), None),
        };
        Ok(Store {
            backend,
            timeout: config.operation_timeout,
            metrics: None,
            events: Arc::default(),
            cache,
            writes: Arc::default(),
            up: Arc::new(std::sync::atomic::AtomicBool::new(true)),
        })
    }

    /// The routes' `[routes.events]`: their final state changes write outbox rows.
    pub fn with_events(mut self, events: EventPolicies) -> Store {
        self.events = Arc::new(events);
        self
    }

    /// Times and counts every operation in `metrics` (whose series of the
    /// operations every store runs exist from now on).
    pub fn with_metrics(mut self, metrics: Arc<Metrics>) -> Store {
        metrics.declare_store_ops(op::names(&op::OF_EVERY_STORE), op::names(&op::FENCED));
        self.metrics = Some(metrics);
        self
    }

    pub fn kind(&self) -> &'static str {
        self.backend.kind()
    }

    /// The bound on one store operation.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Runs one backend operation under the timeout; a timed-out write is
    /// ambiguous, a timed-out read is unavailable.
    async fn bounded<T>(&self, op: StoreOp, fut: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        self.bounded_by(op, self.timeout, fut).await
    }

    /// [`Store::bounded`] with a bound of its own.
    async fn bounded_by<T>(&self, op: StoreOp, bound: Duration, fut: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let start = Instant::now();
        let out = if !self.is_up() {
            Err(not_up())
        } else {
            match tokio::time::timeout(bound, fut).await {
                Ok(r) => r,
                Err(_) if op.write => Err(StoreError::Ambiguous(format!("{} timed out after {bound:?}", op.name))),
                Err(_) => Err(StoreError::Unavailable(format!("{} timed out after {bound:?}", op.name))),
            }
        };
        if let Some(m) = &self.metrics {
            m.observe_store(op.name, start.elapsed(), out.is_ok());
        }
        if op.write && matches!(out, Err(StoreError::Unavailable(_) | StoreError::Ambiguous(_))) {
            self.writes.failed();
        }
        out
    }

    pub async fn migrate(&self) -> Result<Vec<String>, StoreError> {
        self.backend.migrate().await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.bounded(op::PING, self.backend.ping()).await
    }

    /// Whether the settings the store relies on are in force on its
    /// sessions (see [`Lifecycle::check_sessions`]); run at start and by
    /// `check-config --connect`.
    pub async fn check_sessions(&self) -> Result<SessionReport, StoreError> {
        match tokio::time::timeout(self.timeout, self.backend.check_sessions()).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Unavailable(format!("the session check timed out after {:?}", self.timeout))),
        }
    }

    /// Whether this replica can serve idempotent requests: the store answers
    /// a ping, and takes writes: when a write failed since the last
    /// successful write probe, or no probe ran for `health::PROBE_EVERY`,
    /// a probe is sent now (see `health`).
    pub async fn readiness(&self) -> Result<(), NotReady> {
        self.ping().await.map_err(NotReady::Unavailable)?;
        if !self.writes.needs_probe() {
            return Ok(());
        }
        let started = self.writes.now();
        self.bounded(op::WRITE_PROBE, self.backend.probe_write()).await.map_err(NotReady::NotWritable)?;
        self.writes.probed(started);
        Ok(())
    }

    pub async fn now(&self) -> Result<Timestamp, StoreError> {
        self.bounded(op::NOW, self.backend.now()).await
    }

    pub async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError> {
        self.bounded(op::GET, self.backend.get(scope)).await
    }

    /// Claims the scope with one atomic statement, committed before this
    /// returns. After an ambiguous failure the row is read back: our token
    /// means the claim happened. Once an attempt was ambiguous, the claim
    /// fails as ambiguous whatever fails later (that attempt may still
    /// commit), so the caller deletes it by its token if it ever lands.
    pub async fn claim(&self, req: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let mut ambiguous: Option<StoreError> = None;
        self.claim_attempts(req, &mut ambiguous).await.map_err(|e| match ambiguous {
            Some(earlier) if !e.is_ambiguous() => StoreError::Ambiguous(format!("{earlier}; then: {e}")),
            _ => e,
        })
    }

    /// [`Store::claim`]'s attempts; `ambiguous` keeps the first ambiguous
    /// failure.
    async fn claim_attempts(&self, req: &ClaimRequest, ambiguous: &mut Option<StoreError>) -> Result<ClaimOutcome, StoreError> {
        if let Some((record, now)) = self.cache.as_ref().and_then(|c| c.get(&req.scope, &req.request_hash)) {
            return Ok(ClaimOutcome::Existing { record, now });
        }
        let mut last = StoreError::Unavailable("claim not attempted".into());
        let token = req.claim_token;
        // Before the first statement: whichever of them made the claim, its
        // lease started later.
        let asked_at = Instant::now();
        for _ in 0..AMBIGUITY_ATTEMPTS {
            let sent = Instant::now();
            match self.bounded(op::CLAIM, self.backend.claim(req)).await {
                Ok(RawClaim::Claimed(claim)) => return Ok(ClaimOutcome::Claimed(Claim { asked_at, ..claim })),
                Ok(RawClaim::Cacheable(record, _)) if own_claim(&record, token) => {
                    return Ok(ClaimOutcome::Claimed(claim_of(req, record, asked_at)));
                }
                Ok(RawClaim::Cacheable(record, now)) => {
                    // Kept for this request's fingerprint only (`cache::put`
                    // keeps completed records only).
                    if let Some(cache) = &self.cache
                        && record.request_hash == req.request_hash
                    {
                        cache.put(&record, now, sent);
                    }
                    return Ok(ClaimOutcome::Existing { record, now });
                }
                // Our own claim, re-sent: an earlier attempt committed late.
                Ok(RawClaim::Existing(record, _)) if own_claim(&record, token) => {
                    return Ok(ClaimOutcome::Claimed(claim_of(req, record, asked_at)));
                }
                Ok(RawClaim::Existing(record, now)) => return Ok(ClaimOutcome::Existing { record, now }),
                Ok(RawClaim::Conflict) => {
                    // Lost the insert: read the winner in a new statement. The
                    // winner may be this very request: an earlier attempt whose
                    // commit landed after its read-back found no row.
                    match self.get(&req.scope).await? {
                        Some((record, _)) if own_claim(&record, token) => {
                            return Ok(ClaimOutcome::Claimed(claim_of(req, record, asked_at)));
                        }
                        Some((record, now)) => return Ok(ClaimOutcome::Existing { record, now }),
                        // Deleted in between (released, swept): claim again.
                        None => continue,
                    }
                }
                Err(e) if e.is_ambiguous() => {
                    crate::telemetry::throttle::warn_throttled!(scope = %req.scope.log_id(), error = %e, "claim outcome ambiguous; reading the row back");
                    if ambiguous.is_none() {
                        *ambiguous = Some(StoreError::Ambiguous(e.to_string()));
                    }
                    match self.get(&req.scope).await {
                        Ok(Some((record, _))) if own_claim(&record, token) => {
                            return Ok(ClaimOutcome::Claimed(claim_of(req, record, asked_at)));
                        }
                        Ok(Some((record, now))) => return Ok(ClaimOutcome::Existing { record, now }),
                        Ok(None) => last = e,
                        // Cannot tell: the caller answers 503 and forwards nothing.
                        Err(read) => {
                            return Err(StoreError::Ambiguous(format!("{e}; read-back failed: {read}")));
                        }
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Deletes a claim this request made but never forwarded, identified by its
    /// token (after a claim whose commit could not be confirmed). Returns
    /// whether a row was deleted; `Ok(false)` also means there was none.
    pub async fn abandon(&self, scope: &Scope, claim_token: Uuid) -> Result<bool, StoreError> {
        self.bounded(op::ABANDON, self.backend.abandon(scope, claim_token)).await
    }

    /// Abandons, by its token, a claim whose commit could not be confirmed,
    /// once the store answers again: on a tracked task, retrying until the
    /// lease would have run out (a statement still on its way to the
    /// database may yet commit the claim after a first look finds nothing;
    /// the server also cancels it at the statement timeout).
    pub fn abandon_later(&self, tracker: &TaskTracker, scope: &Scope, claim_token: Uuid, lease: Duration) {
        let (store, scope) = (self.clone(), scope.clone());
        tracker.spawn(async move {
            let deadline = tokio::time::Instant::now() + lease;
            let abandoned = crate::retry::while_leased(deadline, false, || async {
                // Ok(false): nothing to abandon yet; the claim may still commit.
                store.abandon(&scope, claim_token).await.ok().filter(|deleted| *deleted)
            });
            if abandoned.await.is_some() {
                tracing::info!(scope = %scope.log_id(), "unconfirmed claim abandoned");
            } else {
                tracing::debug!(scope = %scope.log_id(), "no unconfirmed claim appeared before its lease would have run out");
            }
        });
    }

    /// Records the upstream's response under the claim's generation.
    pub async fn complete(&self, claim: &Claim, response: &StoredResponse, retention: Retention) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::COMPLETE, claim, Goal::State(State::Completed), || {
            self.backend.complete(&claim.scope, claim.attempt(), response, retention, &self.events)
        })
        .await
    }

    /// Frees the key: the request provably never reached the upstream, or the
    /// response must not be stored.
    pub async fn release(&self, claim: &Claim) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::RELEASE, claim, Goal::Deleted, || self.backend.release(&claim.scope, claim.attempt())).await
    }

    /// The request may have reached the upstream but its outcome is lost.
    pub async fn mark_unknown(&self, claim: &Claim) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::MARK_UNKNOWN, claim, Goal::State(State::Unknown), || {
            self.backend.mark_unknown(&claim.scope, claim.attempt(), false, &self.events)
        })
        .await
    }

    /// Async: renews the attempt's lease.
    pub async fn heartbeat(&self, claim: &Claim, lease: Duration) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::HEARTBEAT, claim, Goal::Retry, || self.backend.heartbeat(&claim.scope, claim.attempt(), lease)).await
    }

    /// Async: durably notes that the attempt is about to send, and that it
    /// cannot be at the upstream past `at_upstream` (its timeout) from now.
    /// `Fenced` also when the lease ran out: the attempt must not send.
    pub async fn mark_sent(&self, claim: &Claim, at_upstream: Duration) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::MARK_SENT, claim, Goal::Sent, || self.backend.mark_sent(&claim.scope, claim.attempt(), at_upstream)).await
    }

    /// Async: the attempt did not reach the upstream (or was declined, or
    /// its answer was lost on the way from a deduplicating upstream): the
    /// operation is due again after `delay`.
    pub async fn requeue(&self, claim: &Claim, delay: Duration, retry: RetryNote) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::REQUEUE, claim, Goal::State(State::Queued), || {
            self.backend.requeue(&claim.scope, claim.attempt(), delay, retry)
        })
        .await
    }

    /// Async: retries used up (`failed_retryable`, or `unknown` if an
    /// attempt may have executed).
    pub async fn fail(&self, claim: &Claim, retention: Retention, retry: RetryNote) -> Result<WriteOutcome, StoreError> {
        self.fenced_write(op::FAIL, claim, Goal::Ended, || self.backend.fail(&claim.scope, claim.attempt(), retention, retry, &self.events))
            .await
    }

    /// Async: takes the next due operation of `routes` for a worker.
    pub async fn take(&self, routes: &[WorkerRoute], owner: &str) -> Result<Option<Taken>, StoreError> {
        Ok(self.take_up_to(routes, owner, 1).await?.pop())
    }

    /// Async: takes up to `limit` due operations of `routes` in one commit,
    /// for that many idle workers (fewer when fewer are due; on Citus at
    /// most one).
    pub async fn take_up_to(&self, routes: &[WorkerRoute], owner: &str, limit: usize) -> Result<Vec<Taken>, StoreError> {
        // A take whose answer is lost leaves operations `processing` under
        // tokens nobody holds: their leases run out and the reaper re-queues
        // them (they were never sent). Reading them back is not needed.
        let tokens: Vec<Uuid> = (0..limit).map(|_| Uuid::new_v4()).collect();
        // Before the statement: an attempt whose take recorded its send
        // bounds its exchange from here (`WorkerRoute::sent_on_take`).
        let asked_at = Instant::now();
        let taken = self.bounded(op::TAKE, self.backend.take(routes, owner, &tokens)).await?;
        Ok(taken.into_iter().map(|t| Taken { claim: Claim { asked_at, ..t.claim }, ..t }).collect())
    }

    /// Async: the operation with this id in this tenant.
    pub async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError> {
        self.bounded(op::OPERATION, self.backend.operation(tenant, operation_id)).await
    }

    /// Whether the store needs a plan keeper (`Lifecycle::caches_plans`).
    pub fn caches_plans(&self) -> bool {
        self.backend.caches_plans()
    }

    /// Keeps the sessions' cached plans fit for the tables' sizes (see
    /// `Lifecycle::refresh_plans`); the plan keeper calls it every second.
    pub async fn refresh_plans(&self) -> Result<(), StoreError> {
        self.bounded(op::REFRESH_PLANS, self.backend.refresh_plans()).await
    }

    /// Adds `(operation, spec text)` pairs to the fingerprint settings the
    /// operations have had (`Records::add_fingerprint_specs`).
    pub async fn add_fingerprint_specs(&self, specs: &[(String, String)]) -> Result<(), StoreError> {
        self.bounded(op::ADD_FINGERPRINT_SPECS, self.backend.add_fingerprint_specs(specs)).await
    }

    /// Every `(operation, spec text)` pair added, oldest first.
    pub async fn fingerprint_specs(&self) -> Result<Vec<(String, String)>, StoreError> {
        self.bounded(op::FINGERPRINT_SPECS, self.backend.fingerprint_specs()).await
    }

    /// Records not yet `completed`, by operation and state.
    pub async fn stats(&self) -> Result<Vec<StateCount>, StoreError> {
        self.bounded(op::STATS, self.backend.stats()).await
    }

    /// `unknown` records by age bucket (see `Records::unknown_by_age`).
    pub async fn unknown_by_age(&self, bounds: &[Duration]) -> Result<Vec<u64>, StoreError> {
        self.bounded(op::UNKNOWN_BY_AGE, self.backend.unknown_by_age(bounds)).await
    }

    /// Records kept forever, by operation.
    pub async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError> {
        self.bounded(op::FOREVER_COUNTS, self.backend.forever_counts()).await
    }

    /// A reader found an in-flight record whose lease expired: it becomes
    /// `unknown` (unless someone moved it on meanwhile).
    pub async fn expire_lease(&self, record: &Record) -> Result<WriteOutcome, StoreError> {
        let written = self
            .bounded(
                op::EXPIRE_LEASE,
                self.backend.mark_unknown(
                    &record.scope,
                    Attempt { generation: record.generation, claim_token: record.claim_token },
                    true,
                    &self.events,
                ),
            )
            .await?;
        Ok(if written { WriteOutcome::Written } else { WriteOutcome::Fenced })
    }

    /// Shared shape of the fenced writes: on an ambiguous failure, read the
    /// row back. If it still shows our attempt holding the record (and not
    /// yet at `goal`) the write did not happen and is retried; if it shows
    /// the goal under our attempt, it did; anything else means another attempt
    /// owns the record now.
    async fn fenced_write<F, Fut>(&self, op: StoreOp, claim: &Claim, goal: Goal, attempt: F) -> Result<WriteOutcome, StoreError>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<bool, StoreError>>,
    {
        let mut last = StoreError::Unavailable(format!("{} not attempted", op.name));
        for _ in 0..AMBIGUITY_ATTEMPTS {
            match self.bounded(op, attempt()).await {
                Ok(true) => return Ok(WriteOutcome::Written),
                Ok(false) => return Ok(self.fenced(op, claim)),
                Err(e) if e.is_ambiguous() || matches!(e, StoreError::Unavailable(_)) => {
                    crate::telemetry::throttle::warn_throttled!(scope = %claim.scope.log_id(), error = %e, op = op.name, "write failed; reading the row back");
                    let ours = |r: &Record| r.generation == claim.generation && r.claim_token == claim.claim_token;
                    match self.get(&claim.scope).await {
                        Ok(Some((r, _))) if ours(&r) && goal.reached(&r) => return Ok(WriteOutcome::Written),
                        Ok(Some((r, _))) if ours(&r) && r.state.is_attempt() => last = e,
                        Ok(None) if goal == Goal::Deleted => return Ok(WriteOutcome::Written),
                        Ok(_) => return Ok(self.fenced(op, claim)),
                        Err(read) => last = StoreError::Ambiguous(format!("{e}; read-back failed: {read}")),
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    fn fenced(&self, op: StoreOp, claim: &Claim) -> WriteOutcome {
        tracing::warn!(scope = %claim.scope.log_id(), generation = %claim.generation, op = op.name, "write fenced off: the record belongs to another attempt");
        if let Some(m) = &self.metrics {
            m.fenced_write(op.name);
        }
        WriteOutcome::Fenced
    }

    pub async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError> {
        self.bounded(op::LIST, self.backend.list(filter)).await
    }

    /// The records a log line's `scope=<id>` is about: by the stored scope id
    /// (an index lookup), plus any record claimed before scope ids were
    /// stored whose scope hashes to `id` (found by a scan of those records
    /// only, in batches).
    pub async fn find_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError> {
        const BATCH: u32 = 5_000;
        let mut found = self.bounded(op::BY_SCOPE_ID, self.backend.by_scope_id(id)).await?;
        let mut after: Option<Scope> = None;
        loop {
            let scopes = self.bounded(op::SCOPES_WITHOUT_ID, self.backend.scopes_without_id(after.as_ref(), BATCH)).await?;
            for scope in scopes.iter().filter(|s| s.scope_id() == id) {
                if let Some((record, _)) = self.get(scope).await? {
                    found.push(record);
                }
            }
            if scopes.len() < BATCH as usize {
                return Ok(found);
            }
            after = scopes.into_iter().last();
        }
    }

    /// An operator's or the reconciler's resolution, with its audit row.
    /// A completed record is first held out of every replica's replay cache
    /// (see `cache`), which adds `cache::HOLD_WAIT` to its bound.
    pub async fn resolve(&self, scope: &Scope, resolution: &Resolution, note: &AuditNote) -> Result<ResolveOutcome, StoreError> {
        self.resolve_expecting(scope, resolution, note, None).await
    }

    /// [`Store::resolve`], applied only to the record at the `expected`
    /// generation when one is given (the one an operator looked at): a
    /// record that moved on since is `Refused(Fenced)`.
    pub async fn resolve_expecting(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        expected: Option<Generation>,
    ) -> Result<ResolveOutcome, StoreError> {
        let fut = self.backend.resolve(scope, resolution, note, &self.events, None, expected);
        let out = self.bounded_by(op::RESOLVE, self.timeout + cache::HOLD_WAIT * 2, fut).await;
        if let Some(cache) = &self.cache {
            cache.forget(scope);
        }
        out
    }

    /// The reconciler's resolution: like [`Store::resolve`], but only for
    /// the record its probe took (see [`ProbeFence`]).
    pub async fn resolve_probed(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        fence: ProbeFence,
    ) -> Result<ResolveOutcome, StoreError> {
        self.bounded(op::RESOLVE, self.backend.resolve(scope, resolution, note, &self.events, Some(fence), None)).await
    }

    /// Takes `unknown` records for probing (see `RecordStore::take_probes`),
    /// marked with a fresh token until `hold` from now. A take whose answer
    /// is lost leaves marks nobody holds; they run out with the hold.
    pub async fn take_probes(&self, routes: &[ProbeRoute], hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError> {
        self.bounded(op::TAKE_PROBES, self.backend.take_probes(routes, Uuid::new_v4(), hold, limit)).await
    }

    /// An inconclusive probe: due again after `retry_in`.
    pub async fn probe_failed(
        &self,
        scope: &Scope,
        fence: ProbeFence,
        retry_in: Duration,
        answer: &str,
    ) -> Result<WriteOutcome, StoreError> {
        let answer = clip(answer, MAX_PROBE_ANSWER);
        let written = self.bounded(op::PROBE_FAILED, self.backend.probe_failed(scope, fence, retry_in, answer)).await?;
        Ok(if written { WriteOutcome::Written } else { WriteOutcome::Fenced })
    }

    /// A record and what the operator console shows beside it.
    pub async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError> {
        self.bounded(op::INSPECT, self.backend.inspect(scope, audit_limit)).await
    }

    /// The audit trail, newest first.
    pub async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        self.bounded(op::AUDIT, self.backend.audit(limit)).await
    }

    /// The derived-key secret `migrate` generated for this deployment.
    pub async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.bounded(op::DERIVED_KEY_SECRET, self.backend.derived_key_secret()).await
    }

    /// Deletes up to `batch` completed records past retention; returns how many.
    pub async fn sweep(&self, batch: u32) -> Result<u64, StoreError> {
        self.bounded(op::SWEEP, self.backend.sweep(batch)).await
    }

    /// Ends up to `batch` attempts whose lease expired (see `RecordStore::reap_leases`).
    pub async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>]) -> Result<Reaped, StoreError> {
        self.bounded(op::REAP_LEASES, self.backend.reap_leases(batch, reforwardable, &self.events)).await
    }

    /// Outbox: leases deliverable events to a relay (see `RecordStore::take_events`).
    pub async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError> {
        self.bounded(op::TAKE_EVENTS, self.backend.take_events(operations, limit, lease, token)).await
    }

    /// [`take_events`](Self::take_events), and whether it left deliverable
    /// events behind (see `Events::take_events_more`).
    pub async fn take_events_more(
        &self,
        operations: &[&str],
        limit: u32,
        lease: Duration,
        token: Uuid,
    ) -> Result<(Vec<OutboxEvent>, bool), StoreError> {
        self.bounded(op::TAKE_EVENTS, self.backend.take_events_more(operations, limit, lease, token)).await
    }

    /// Outbox: events one take leases at most, whatever the relay asks for
    /// (see `Events::most_per_take`).
    pub fn most_per_take(&self) -> u32 {
        self.backend.most_per_take()
    }

    pub async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError> {
        self.bounded(op::EVENTS_DELIVERED, self.backend.events_delivered(seqs, token)).await
    }

    pub async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError> {
        self.bounded(op::EVENT_FAILED, self.backend.event_failed(seq, token, error, retry_after, park)).await
    }

    pub async fn first_attempts_failed(
        &self,
        seqs: &[i64],
        token: Uuid,
        error: &str,
        retry_after: Duration,
        park: bool,
    ) -> Result<Vec<i64>, StoreError> {
        self.bounded(op::EVENT_FAILED, self.backend.first_attempts_failed(seqs, token, error, retry_after, park)).await
    }

    pub async fn events_deferred(&self, seqs: &[i64], token: Uuid, retry_after: Duration) -> Result<Vec<i64>, StoreError> {
        self.bounded(op::EVENTS_DEFERRED, self.backend.events_deferred(seqs, token, retry_after)).await
    }

    pub async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError> {
        self.bounded(op::EVENTS, self.backend.events(delivery, limit)).await
    }

    pub async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError> {
        self.bounded(op::REDELIVER, self.backend.redeliver(event_id)).await
    }

    pub async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError> {
        self.bounded(op::SWEEP_EVENTS, self.backend.sweep_events(batch, older_than)).await
    }

    pub async fn event_stats(&self) -> Result<EventStats, StoreError> {
        self.bounded(op::EVENT_STATS, self.backend.event_stats()).await
    }
}

/// The longest probe answer kept for the console (an error chain can be long).
const MAX_PROBE_ANSWER: usize = 1000;

/// `s` cut to at most `max` bytes, at a character boundary.
fn clip(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
