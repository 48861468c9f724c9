//! The background work that follows the routes in force: the async workers,
//! the lease reaper (its list of routes whose upstream deduplicates), the
//! reconciler and the outbox relay.
//!
//! Each is built from a gateway and its configuration. A reload that
//! replaces the gateway restarts them from the new one ([`RouteTasks::follow`]):
//! the previous set is cancelled (a worker finishes the attempt it holds,
//! with the route it took it under, then stops; a relay finishes its round;
//! a reconciler's taken records stay marked until their hold runs out) and a
//! new set starts with the new routes. So an async route added by SIGHUP is
//! served at once, and a route whose `upstream_idempotent` was turned off is
//! never re-forwarded by a take-over or the reaper after the reload. Store
//! upkeep that does not depend on routes (the sweeper, the gauges) is not
//! restarted (see [`crate::background::housekeeping`]).

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::background::async_worker::AsyncWorkers;
use crate::background::housekeeping::{self, LeaseWatch};
use crate::background::outbox_relay::Relay;
use crate::background::reconciler::Reconciler;
use crate::config::Config;
use crate::proxy::gateway::Gateway;
use crate::secret::DerivedKeySecret;
use crate::telemetry::metrics::Metrics;

/// The route-dependent tasks of one replica, restartable on reload.
#[derive(Debug)]
pub struct RouteTasks {
    metrics: Arc<Metrics>,
    /// The derived-key secret (the reconciler's `{derived_key}`).
    secret: DerivedKeySecret,
    /// Where the reaper, the reconciler and the relay run.
    background: TaskTracker,
    /// Where the workers run: the connections' tracker, so the drain waits
    /// for the attempts they hold.
    attempts: TaskTracker,
    /// The record counter's word on live leases, for the reaper.
    leases: Arc<LeaseWatch>,
    /// The process's cancellation root.
    shutdown: CancellationToken,
    /// Cancels the set running now (a child of `shutdown`).
    current: CancellationToken,
}

impl RouteTasks {
    pub fn new(
        metrics: Arc<Metrics>,
        secret: DerivedKeySecret,
        background: TaskTracker,
        attempts: TaskTracker,
        leases: Arc<LeaseWatch>,
        shutdown: CancellationToken,
    ) -> RouteTasks {
        let current = shutdown.child_token();
        RouteTasks { metrics, secret, background, attempts, leases, shutdown, current }
    }

    /// Stops the running set, if any, and starts one for `gateway` (built
    /// from `config`).
    pub fn follow(&mut self, gateway: &Gateway, config: &Config) {
        self.current.cancel();
        self.current = self.shutdown.child_token();
        let stop = self.current.clone();
        let store = gateway.store().clone();
        self.leases.set_shortest_lease(gateway.routes().iter().map(|r| r.record.lease).min());
        housekeeping::spawn_reaper(
            &self.background,
            store.clone(),
            self.metrics.clone(),
            &config.store,
            gateway.reforwardable_operations(),
            self.leases.clone(),
            stop.clone(),
        );
        if let Some(relay) = Relay::new(&gateway.routes(), gateway.executor().upstreams(), store.clone(), self.metrics.clone()) {
            self.background.spawn(relay.run(stop.clone()));
        }
        if let Some(reconciler) = Reconciler::new(config, gateway.executor(), store.clone(), self.metrics.clone(), self.secret.clone()) {
            reconciler.spawn(&self.background, stop.clone());
        }
        let (history, routes, plain) = (gateway.fingerprint_history(), gateway.routes(), store.clone());
        let until = stop.clone();
        self.background.spawn(async move { history.add(&plain, &routes, until).await });
        let replica: Arc<str> = config.server.replica_id.as_str().into();
        AsyncWorkers::new(gateway.routes(), store, replica, gateway.wake_workers()).spawn(
            config.workers.count,
            gateway.executor(),
            &self.attempts,
            stop,
        );
    }
}
