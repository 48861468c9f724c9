//! Applying a configuration: the one place where a validated [`Config`]
//! becomes everything that follows it, at start and on every reload alike.
//!
//! [`Applier::apply`] builds, from the one value, the request path's
//! [`Configured`] (routes, identity sources, authorizers, upstreams with
//! their limits), which every proxy worker copies with pools of its own
//! ([`WorkerGateway`]); the admin API's and the console's [`InForce`] (the
//! routes' retention, the credential headers to mask); the background tasks
//! that follow the routes ([`RouteTasks`]), the JWT key refreshers, and the
//! metrics' series. What outlives a configuration ([`Shared`]: the store,
//! metrics, trackers, waiters, request ids, the derived-key secret) is made
//! once at start. A reload swaps one `Arc` per consumer and copies nothing
//! field by field; a new consumer of configuration is added here, once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::idempotency::record::Retention;
use crate::ops::admin::InForce;
use crate::proxy::gateway::Gateway;
use crate::proxy::state::{Configured, Shared};
use crate::request::identity::jwt::JwtVerifier;
use crate::server::route_tasks::RouteTasks;
use crate::store::op;

/// Applies configurations: holds what outlives them and where each
/// consumer finds the one in force.
#[derive(Debug)]
pub struct Applier {
    shared: Arc<Shared>,
    /// The request path's configuration in force, for the proxy workers.
    live: Arc<LiveGateway>,
    /// The admin API's and the console's.
    admin: watch::Sender<Arc<InForce>>,
    /// The workers, reaper, reconciler and relay: restarted with each configuration.
    tasks: RouteTasks,
    /// Where the JWT key refreshers run.
    background: TaskTracker,
    shutdown: CancellationToken,
}

impl Applier {
    /// Applies the configuration the process starts with.
    pub fn start(shared: Arc<Shared>, tasks: RouteTasks, background: TaskTracker, shutdown: CancellationToken, config: &Config) -> Applier {
        let applied = Applied::build(&shared, config);
        let mut applier = Applier {
            live: LiveGateway::new(shared.clone(), applied.gateway.clone()),
            admin: watch::Sender::new(applied.admin.clone()),
            shared,
            tasks,
            background,
            shutdown,
        };
        applier.follow(&applied, config);
        applier
    }

    /// Applies `config` (a reload): requests from the next one on, the admin
    /// API's next call and the background tasks follow it; a request already
    /// running finishes with the configuration it started on.
    pub fn apply(&mut self, config: &Config) {
        let applied = Applied::build(&self.shared, config);
        self.live.replace(applied.gateway.clone());
        self.admin.send_replace(applied.admin.clone());
        self.follow(&applied, config);
    }

    /// What runs beside the consumers: the metrics' series, the JWT key
    /// refreshers and the tasks that follow the routes.
    fn follow(&mut self, applied: &Applied, config: &Config) {
        declare(&self.shared, config);
        for verifier in applied.gateway.jwks_sources() {
            self.background.spawn(JwtVerifier::keep_fresh(Arc::downgrade(&verifier), self.shutdown.clone()));
        }
        // The background tasks run on this runtime: a gateway with pools of its own.
        self.tasks.follow(&Gateway::new(self.shared.clone(), applied.gateway.clone()), config);
    }

    /// The proxy workers' view of the configuration in force.
    pub fn live(&self) -> &Arc<LiveGateway> {
        &self.live
    }

    /// The admin API's and the console's view of the configuration in force.
    pub fn admin(&self) -> watch::Receiver<Arc<InForce>> {
        self.admin.subscribe()
    }
}

/// One configuration, built for each of its consumers.
struct Applied {
    gateway: Arc<Configured>,
    admin: Arc<InForce>,
}

impl Applied {
    fn build(shared: &Shared, config: &Config) -> Applied {
        let gateway = Arc::new(Configured::new(config, shared));
        let admin = Arc::new(InForce::new(gateway.store().clone(), &config.routes, &config.identity));
        Applied { gateway, admin }
    }
}

/// Every series a configuration names exists before the admin listener
/// serves a scrape of it.
fn declare(shared: &Shared, config: &Config) {
    let metrics = shared.metrics();
    metrics.declare_upstreams(config.upstreams.iter().map(|u| u.name.as_str()));
    metrics.declare_operations(config.routes.iter().map(|r| (&*r.operation, r.may_run_async())));
    metrics.declare_observed(config.routes.iter().filter(|r| r.is_observed()).map(|r| &*r.operation));
    metrics.declare_forever(config.routes.iter().filter(|r| r.record.retention == Retention::Forever).map(|r| &*r.operation));
    if config.routes.iter().any(|r| r.may_run_async()) {
        metrics.declare_store_ops(op::names(&op::OF_ASYNC_ROUTES), op::names(&op::FENCED_ASYNC));
    }
    let _ = metrics.connections("proxy", config.server.max_connections);
}

/// The request path's configuration in force, replaced whole by a reload.
#[derive(Debug)]
pub struct LiveGateway {
    shared: Arc<Shared>,
    current: RwLock<Arc<Configured>>,
    /// Bumped after each replacement; workers compare it on every request.
    version: AtomicU64,
}

impl LiveGateway {
    fn new(shared: Arc<Shared>, configured: Arc<Configured>) -> Arc<LiveGateway> {
        Arc::new(LiveGateway { shared, current: RwLock::new(configured), version: AtomicU64::new(0) })
    }

    fn current(&self) -> Arc<Configured> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, configured: Arc<Configured>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = configured;
        self.version.fetch_add(1, Ordering::Release);
    }

    /// The view of one worker thread, with its own upstream pools.
    pub fn for_worker(self: &Arc<LiveGateway>) -> WorkerGateway {
        let version = self.version.load(Ordering::Acquire);
        let gateway = Arc::new(Gateway::new(self.shared.clone(), self.current()));
        WorkerGateway { live: self.clone(), local: Mutex::new((version, gateway)) }
    }
}

/// One worker thread's gateway for the configuration in force, rebuilt
/// (with its own pools) when a reload has replaced it.
#[derive(Debug)]
pub struct WorkerGateway {
    live: Arc<LiveGateway>,
    local: Mutex<(u64, Arc<Gateway>)>,
}

impl WorkerGateway {
    /// The gateway for the next request: one atomic load when nothing changed.
    pub fn get(&self) -> Arc<Gateway> {
        let version = self.live.version.load(Ordering::Acquire);
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if local.0 != version {
            *local = (version, Arc::new(Gateway::new(self.live.shared.clone(), self.live.current())));
        }
        local.1.clone()
    }
}
