//! Async workers: `count` attempts at the upstream at a time, each running one due `queued`
//! operation of this replica's async routes (under a lease, with a new
//! generation) through the [`Executor`]. One taker draws operations for all
//! idle workers in one take (one statement and one commit on PostgreSQL):
//! while a take runs, the attempts that finish free their workers, and the
//! next take draws for all of them, so takes grow with the load as batched
//! claims do. Any replica's workers may take any operation; the store
//! guarantees one holder per generation. An idle taker polls with a growing
//! interval, and is woken at once when this replica accepts an operation.
//! A take draws no more operations than their upstream's concurrency limit
//! has slots free, or one when it waits its turn for a slot at the limit
//! (contract: workers count against an upstream's limit); each attempt holds
//! its slot until the upstream answers.
//!
//! A worker is free again once its upstream has answered: the attempt
//! records its outcome while the worker takes and runs its next operation,
//! so a worker's cycle is its take, its never-sent proof and its exchange,
//! and the completion's commit overlaps the next take. At most `count`
//! attempts are at the upstream (or about to be) and at most `count` more
//! are recording (a slow store holds the next take back).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::executor::Executor;
use crate::idempotency::record::State;
use crate::request::route::{Route, UpstreamId};
use crate::retry::Backoff;
use crate::store::{Store, Taken, WorkerRoute};
use crate::upstream::limit::{Permit, Slot};

/// The poll interval of an idle worker.
const IDLE: Backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
/// Most operations one take draws.
const MAX_TAKE: usize = 32;
/// Pause after a store error before taking again.
const ERROR_PAUSE: Duration = Duration::from_secs(1);

/// What every worker of a replica shares.
#[derive(Debug)]
pub struct AsyncWorkers {
    /// Every route of the configuration: an operation is run under its route.
    routes: Vec<Arc<Route>>,
    /// The routes to take from, by upstream: a take draws no more than the
    /// upstream's limit has slots free, or one with a turn waited for.
    takes: Vec<(UpstreamId, Vec<WorkerRoute>)>,
    /// The routes that do not run async (any more): taken from too when the
    /// store holds operations of theirs, accepted under an earlier
    /// configuration (a reload or a rollout removed `allow_async`), which
    /// would otherwise stay queued for good. They run with the default
    /// queueing settings (`Route::queueing`).
    former: Vec<Arc<Route>>,
    store: Store,
    owner: Arc<str>,
    /// Notified when this replica accepts an operation.
    wake: Arc<Notify>,
}

impl AsyncWorkers {
    /// `routes`: every route of the configuration; those whose operations
    /// may be async (`mode = "async"` or `allow_async`) are taken from.
    pub fn new(routes: Vec<Arc<Route>>, store: Store, owner: Arc<str>, wake: Arc<Notify>) -> AsyncWorkers {
        let (serving, former): (Vec<Arc<Route>>, Vec<Arc<Route>>) = routes.iter().cloned().partition(|r| r.may_run_async());
        let mut workers = AsyncWorkers { routes, takes: Vec::new(), former, store, owner, wake };
        for r in &serving {
            workers.take_from(r);
        }
        workers
    }

    /// Takes `route`'s operations too. (`sent_on_take` is set from the
    /// upstream's timeout in [`AsyncWorkers::sent_on_take`].)
    fn take_from(&mut self, r: &Route) {
        let take = WorkerRoute {
            operation: r.operation.clone(),
            lease: r.record.lease,
            reforwardable: r.execution.upstream_idempotent,
            sent_on_take: None,
        };
        match self.takes.iter_mut().find(|(u, _)| *u == r.upstream) {
            Some((_, list)) => list.push(take),
            None => self.takes.push((r.upstream, vec![take])),
        }
    }

    /// A route whose upstream deduplicates (by the key forwarded, the same
    /// on every attempt) is sent without a never-sent proof: the take
    /// records the send, bounded by the upstream's timeout (docs/async.md).
    fn sent_on_take(&mut self, executor: &Executor) {
        for (upstream, routes) in &mut self.takes {
            let timeout = executor.upstream(*upstream).config.timeout;
            for r in routes.iter_mut().filter(|r| r.reforwardable) {
                r.sent_on_take = Some(timeout);
            }
        }
    }

    /// Takes from the [former](AsyncWorkers::former) async routes whose
    /// operations the store still holds queued or processing (one look at
    /// the records' counts, tried a few times a second apart; a store that
    /// still cannot answer is asked again at the next start or reload).
    async fn adopt_former(&mut self, shutdown: &CancellationToken) {
        const TRIES: u32 = 5;
        if self.former.is_empty() {
            return;
        }
        let mut tried = 0;
        let counts = loop {
            tried += 1;
            match self.store.stats().await {
                Ok(counts) => break counts,
                Err(e) if tried >= TRIES => {
                    tracing::warn!(error = %e, "could not look for operations of routes that no longer run async; looked again at the next start or reload");
                    return;
                }
                Err(_) => tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(ERROR_PAUSE) => {}
                },
            }
        };
        let former = std::mem::take(&mut self.former);
        for r in &former {
            let left = counts
                .iter()
                .filter(|c| *c.operation == *r.operation && matches!(c.state, State::Queued | State::Processing))
                .map(|c| c.count)
                .sum::<i64>();
            if left > 0 {
                tracing::warn!(route = %r.operation, operations = left,
                    "operations accepted while the route ran async are still queued or processing; the workers finish them with the default queueing settings");
                self.take_from(r);
            }
        }
    }

    /// Starts `count` workers on `tracker`; they stop taking work when
    /// `shutdown` fires and finish the attempts they hold (the drain waits).
    pub fn spawn(self, count: usize, executor: &Executor, tracker: &TaskTracker, shutdown: CancellationToken) {
        if count == 0 || (self.takes.is_empty() && self.former.is_empty()) {
            return;
        }
        let executor = Arc::new(executor.with_own_pools());
        let attempts = tracker.clone();
        tracker.spawn(async move {
            let mut workers = self;
            workers.adopt_former(&shutdown).await;
            if workers.takes.is_empty() {
                return;
            }
            workers.sent_on_take(&executor);
            workers.run(count, executor, attempts, shutdown).await
        });
    }

    /// The taker: waits for a free worker, takes for every free one (within
    /// each upstream's free slots), and runs each operation taken as an
    /// attempt on `attempts`.
    async fn run(self, count: usize, executor: Arc<Executor>, attempts: TaskTracker, shutdown: CancellationToken) {
        tracing::debug!(workers = count, "async workers started");
        let turns = Turns::new(count);
        let mut idle_rounds = 1;
        loop {
            let first = tokio::select! {
                _ = shutdown.cancelled() => break,
                free = turns.next() => match free {
                    Some(free) => free,
                    None => break,
                },
            };
            let mut free = vec![first];
            while free.len() < MAX_TAKE {
                match turns.try_next() {
                    Some(more) => free.push(more),
                    None => break,
                }
            }
            let (mut took, mut failed) = (false, false);
            for (upstream, take) in &self.takes {
                // Slots are looked at, not held, while the store is asked: a
                // request arriving meanwhile must not find them taken by a
                // take that may find nothing.
                // With no slot free, the workers wait their turn for one, as
                // a request would, and take one operation with it.
                let limit = executor.upstream(*upstream).limit();
                let (mut turn, n) = match free.len().min(usize::try_from(limit.available()).unwrap_or(usize::MAX)) {
                    0 => match tokio::select! {
                        _ = shutdown.cancelled() => None,
                        turn = limit.wait_turn() => turn,
                    } {
                        Some(turn) => (Some(turn), 1),
                        None => continue,
                    },
                    n => (None, n),
                };
                match self.store.take_up_to(take, &self.owner, n).await {
                    Ok(taken) => {
                        for (taken, worker) in taken.into_iter().zip(std::iter::from_fn(|| free.pop())) {
                            took = true;
                            // A slot a request took meanwhile is not waited
                            // for: the operation is taken, and runs.
                            let slot = turn.take().or_else(|| limit.try_acquire());
                            self.start(taken, worker, slot, &executor, &attempts);
                        }
                    }
                    Err(e) => {
                        failed = true;
                        tracing::warn!(error = %e, "could not take an operation");
                    }
                }
                if free.is_empty() {
                    break;
                }
            }
            // Workers left over go back.
            drop(free);
            if took {
                idle_rounds = 1;
                continue;
            }
            let pause = if failed { ERROR_PAUSE } else { IDLE.after(idle_rounds) };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.wake.notified(), if !failed => idle_rounds = 1,
                _ = tokio::time::sleep(pause) => idle_rounds += 1,
            }
        }
        tracing::debug!("async workers stopped taking");
    }

    /// Runs one attempt on a worker, which is free again once the upstream
    /// has answered (the attempt's turn to record ends with the attempt).
    fn start(&self, taken: Taken, turn: Turn, slot: Option<Permit>, executor: &Arc<Executor>, attempts: &TaskTracker) {
        let Some(route) = self.routes.iter().find(|r| r.operation == taken.record.scope.operation).cloned() else { return };
        tracing::debug!(route = %route.operation, scope = %taken.claim.scope.log_id(), generation = %taken.claim.generation,
            attempt = taken.record.attempts, "took an operation");
        let executor = executor.clone();
        attempts.spawn(async move {
            let Turn { worker, recording } = turn;
            executor.run_async(&route, &taken, slot.map(Slot::from), worker).await;
            drop(recording);
        });
    }
}

/// What an attempt holds: a worker (given back once the upstream answered)
/// and a place among the attempts alive (given back when it has recorded).
#[derive(Debug)]
struct Turn {
    worker: OwnedSemaphorePermit,
    recording: OwnedSemaphorePermit,
}

/// The workers, and the attempts alive: twice as many, so that up to
/// `count` attempts record their outcomes while `count` others run.
#[derive(Debug)]
struct Turns {
    workers: Arc<Semaphore>,
    alive: Arc<Semaphore>,
}

impl Turns {
    fn new(count: usize) -> Turns {
        Turns { workers: Arc::new(Semaphore::new(count)), alive: Arc::new(Semaphore::new(count.saturating_mul(2))) }
    }

    /// Waits for a place among the attempts alive, then for a free worker.
    async fn next(&self) -> Option<Turn> {
        let recording = self.alive.clone().acquire_owned().await.ok()?;
        let worker = self.workers.clone().acquire_owned().await.ok()?;
        Some(Turn { worker, recording })
    }

    fn try_next(&self) -> Option<Turn> {
        let recording = self.alive.clone().try_acquire_owned().ok()?;
        let worker = self.workers.clone().try_acquire_owned().ok()?;
        Some(Turn { worker, recording })
    }
}
