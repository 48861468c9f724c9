//! The request path's state: what outlives every configuration
//! ([`Shared`], made once at start) and what one configuration decides
//! ([`Configured`], built by [`crate::server::apply`] for each configuration
//! applied and replaced whole by a reload). Each event loop's
//! [`Gateway`](crate::proxy::gateway::Gateway) adds what it owns: its
//! upstream pools and authorizer clients.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use tokio::sync::{Notify, Semaphore};
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::executor::waiters::Waiters;
use crate::proxy::access::{REQUEST_ID, RequestIds, RequestSeries};
use crate::proxy::fingerprints::FingerprintHistory;
use crate::request::authorize::Authorizer;
use crate::request::identity::{Identifier, IdentitySource};
use crate::request::key_source::KeySource;
use crate::request::route::{Route, Router};
use crate::secret::DerivedKeySecret;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use crate::upstream::Upstream;
use crate::upstream::headers::HeaderScreen;
use crate::upstream::limit::{Limit, LimitPolicy, Limits};

/// Observations (claim, then recording) running at once in this process;
/// beyond it observe mode passes requests on unobserved. Bounds the tasks
/// and the answers held for recording when the store is slow.
const MAX_OBSERVATIONS: usize = 1024;

/// What outlives every configuration: made once at start, and handed to
/// each configuration applied after it (see [`Configured::new`]).
#[derive(Debug)]
pub struct Shared {
    /// The store as opened (a configuration adds its routes' event policies).
    pub(super) store: Store,
    pub(super) metrics: Arc<Metrics>,
    /// Forwards run here, not in the connection's future, so a client that
    /// disconnects never cancels a forward or the recording of its result.
    pub(super) tracker: TaskTracker,
    /// Keys the `Idempotency-Key` sent upstream.
    pub(super) derived_key_secret: DerivedKeySecret,
    /// Where duplicates wait for an in-flight result (`in_flight = "wait"`);
    /// the executor wakes them.
    pub(super) waiters: Arc<Waiters>,
    /// Wakes this replica's async workers when an operation is accepted.
    pub(super) wake_workers: Arc<Notify>,
    /// Request ids (one counter per process; `server.trusted_proxies` is
    /// restart-only).
    pub(super) request_ids: Arc<RequestIds>,
    /// Observations running at once, over every configuration (observe mode).
    pub(super) observations: Arc<Semaphore>,
    /// Each upstream's concurrency limit and each route's cap, by name, over
    /// every configuration: a reload reconfigures them, and the slots held
    /// under the earlier configuration still count.
    pub(super) limits: Limits,
    /// The fingerprint settings each operation has had, over every
    /// configuration and replica.
    pub(super) fingerprints: Arc<FingerprintHistory>,
}

impl Shared {
    /// The store as opened (without any configuration's event policies).
    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn new(config: &Config, store: Store, metrics: Arc<Metrics>, tracker: TaskTracker, derived_key_secret: DerivedKeySecret) -> Shared {
        Shared {
            store,
            metrics,
            tracker,
            derived_key_secret,
            waiters: Arc::new(Waiters::new()),
            wake_workers: Arc::new(Notify::new()),
            request_ids: Arc::new(RequestIds::new(config.server.trusted_proxies.clone())),
            observations: Arc::new(Semaphore::new(MAX_OBSERVATIONS)),
            limits: Limits::default(),
            fingerprints: Arc::new(FingerprintHistory::default()),
        }
    }
}

/// What one configuration decides for the request path: built once per
/// configuration applied (at start and on each reload) and shared by every
/// worker's gateway. A reload replaces it whole.
#[derive(Debug)]
pub struct Configured {
    /// The store, writing events for these routes' `[routes.events]`.
    pub(super) store: Store,
    pub(super) router: Router,
    pub(super) identifier: Identifier,
    /// Header names with `_`, and other spellings of guarded headers:
    /// applied before anything reads a request.
    pub(super) header_screen: HeaderScreen,
    /// The upstreams with their concurrency limits (each worker's copies
    /// have pools of their own and share the limits).
    pub(super) upstreams: Vec<Upstream>,
    /// The routes' authorizers, by operation (each worker's copies have
    /// clients of their own).
    pub(super) authorizers: HashMap<Arc<str>, Authorizer>,
    /// Requests by route, protocol and status class, and their duration.
    pub(super) request_series: Arc<RequestSeries>,
    pub(super) replica_id: Arc<str>,
    pub(super) max_request_body: u64,
    pub(super) request_body_timeout: Duration,
    /// `server.access_log`.
    pub(super) access_log: bool,
    /// `WWW-Authenticate` of a 401, when API keys are configured.
    pub(super) challenge: Option<HeaderValue>,
    /// Operations whose key may come from `X-Request-Id` (`key_from`): their
    /// requests are forwarded without an id the client did not send.
    pub(super) request_id_is_a_key: HashSet<Arc<str>>,
    /// Routes with a `max_in_flight` of their own: their caps, shared by the
    /// worker threads (the upstreams' limits are the executor's).
    pub(super) route_limits: HashMap<Arc<str>, Arc<Limit>>,
}

impl Configured {
    /// Builds what `config` decides, on what outlives it.
    pub fn new(config: &Config, shared: &Shared) -> Configured {
        let store = shared.store.clone().with_events(crate::request::route::event_policies(&config.routes));
        let replica_id: Arc<str> = config.server.replica_id.as_str().into();
        let identifier = Identifier::new(config.identity.clone());
        let guarded: Vec<String> = identifier
            .read_headers()
            .map(|h| h.as_str().to_owned())
            .chain(config.routes.iter().flat_map(|r| {
                r.key
                    .from
                    .sources()
                    .iter()
                    .filter_map(|s| match s {
                        KeySource::Header(h) => Some(h.as_str().to_owned()),
                        _ => None,
                    })
                    .chain(std::iter::once(r.key.header.as_str().to_owned()))
            }))
            .collect();
        Configured {
            store,
            router: Router::new(config.routes.clone(), config.server.default_upstream),
            header_screen: HeaderScreen::new(config.server.headers_with_underscores, guarded.iter().map(String::as_str)),
            identifier,
            upstreams: config
                .upstreams
                .iter()
                .cloned()
                .map(|u| {
                    let limit = shared.limits.get(&format!("upstream {}", u.name), u.limit);
                    Upstream::limited_by(u, limit).counted_by(shared.metrics.clone())
                })
                .collect(),
            authorizers: config
                .routes
                .iter()
                .filter_map(|r| r.execution.authorize.as_ref().map(|a| (r.operation.clone(), Authorizer::new(a.clone()))))
                .collect(),
            // The proxy listener's series (it speaks HTTP/2 when it has TLS);
            // its workers' accept loops use the same.
            request_series: Arc::new(RequestSeries::new(
                &shared.metrics,
                config.routes.iter().map(|r| &r.operation),
                config.server.tls.is_some(),
            )),
            replica_id,
            max_request_body: config.server.max_request_body,
            request_body_timeout: config.server.request_body_timeout,
            access_log: config.server.access_log,
            challenge: config
                .identity
                .iter()
                .any(|s| matches!(s, IdentitySource::ApiKey { .. } | IdentitySource::Jwt(_)))
                .then(|| HeaderValue::from_static("Bearer realm=\"idemgate\"")),
            request_id_is_a_key: config
                .routes
                .iter()
                .filter(|r| r.key.from.sources().iter().any(|s| matches!(s, KeySource::Header(h) if h == REQUEST_ID)))
                .map(|r| r.operation.clone())
                .collect(),
            route_limits: config
                .routes
                .iter()
                .filter_map(|r| {
                    let max_in_flight = r.execution.max_in_flight?;
                    let queue_timeout = config.upstreams.get(r.upstream).map_or(Duration::ZERO, |u| u.limit.queue_timeout());
                    let cap = shared.limits.get(&format!("route {}", r.operation), LimitPolicy::Fixed { max_in_flight, queue_timeout });
                    Some((r.operation.clone(), cap))
                })
                .collect(),
        }
    }

    pub fn routes(&self) -> &[Arc<Route>] {
        self.router.routes()
    }

    /// The store, writing events for these routes' `[routes.events]`.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// JWT identity sources whose keys are fetched from a URL.
    pub fn jwks_sources(&self) -> Vec<Arc<crate::request::identity::jwt::JwtVerifier>> {
        self.identifier.jwks_urls()
    }
}
