//! Async workers: each takes the oldest due `queued` operation of this
//! replica's async routes (under a lease, with a new generation), runs one
//! attempt through the [`Executor`], and takes the next. Any replica's workers
//! may take any operation; the store guarantees one holder per generation.
//! Idle workers poll with a growing interval, and are woken at once when this
//! replica accepts an operation.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::executor::Executor;
use crate::request::route::Route;
use crate::retry::Backoff;
use crate::store::{Store, WorkerRoute};

/// The poll interval of an idle worker.
const IDLE: Backoff = Backoff::new(Duration::from_millis(20), Duration::from_millis(500));
/// Pause after a store error before taking again.
const ERROR_PAUSE: Duration = Duration::from_secs(1);

/// What every worker of a replica shares.
#[derive(Debug)]
pub struct AsyncWorkers {
    routes: Vec<Arc<Route>>,
    take: Vec<WorkerRoute>,
    store: Store,
    owner: Arc<str>,
    /// Notified when this replica accepts an operation.
    wake: Arc<Notify>,
}

impl AsyncWorkers {
    /// `routes`: the routes whose operations may be async (`mode = "async"`
    /// or `allow_async`).
    pub fn new(routes: Vec<Arc<Route>>, store: Store, owner: Arc<str>, wake: Arc<Notify>) -> AsyncWorkers {
        let take = routes
            .iter()
            .map(|r| WorkerRoute { operation: r.operation.clone(), lease: r.lease, reforwardable: r.upstream_idempotent })
            .collect();
        AsyncWorkers { routes, take, store, owner, wake }
    }

    /// Starts `count` workers on `tracker`; they stop taking work when
    /// `shutdown` fires and finish the attempt they hold (the drain waits).
    pub fn spawn(self, count: usize, executor: &Executor, tracker: &TaskTracker, shutdown: CancellationToken) {
        if self.take.is_empty() || count == 0 {
            return;
        }
        let shared = Arc::new(self);
        for i in 0..count {
            let (shared, executor, shutdown) = (shared.clone(), executor.with_own_pools(), shutdown.clone());
            tracker.spawn(async move { shared.run(i, executor, shutdown).await });
        }
    }

    async fn run(&self, index: usize, executor: Executor, shutdown: CancellationToken) {
        tracing::debug!(worker = index, "async worker started");
        let mut idle_rounds = 1;
        while !shutdown.is_cancelled() {
            match self.store.take(&self.take, &self.owner).await {
                Ok(Some(taken)) => {
                    idle_rounds = 1;
                    let Some(route) = self.routes.iter().find(|r| r.operation == taken.record.scope.operation) else { continue };
                    tracing::debug!(worker = index, route = %route.operation, scope = %taken.claim.scope.log_id(),
                        generation = %taken.claim.generation, attempt = taken.record.attempts, "took an operation");
                    executor.run_async(route, &taken).await;
                }
                Ok(None) => {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = self.wake.notified() => idle_rounds = 1,
                        _ = tokio::time::sleep(IDLE.after(idle_rounds)) => idle_rounds += 1,
                    }
                }
                Err(e) => {
                    tracing::warn!(worker = index, error = %e, "could not take an operation");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(ERROR_PAUSE) => {}
                    }
                }
            }
        }
        tracing::debug!(worker = index, "async worker stopped");
    }
}
