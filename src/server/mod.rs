//! Listeners, connections and the drain: one cancellation root, every
//! connection and forward on one `TaskTracker`, background tasks supervised
//! beside them, and a bounded drain on shutdown.

pub mod apply;
pub mod listener;
pub mod reload;
pub mod route_tasks;
pub mod signals;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::background::housekeeping;
use crate::config::Config;
use crate::ops::admin::Admin;
use crate::proxy::state::Shared;
use crate::secret::DerivedKeySecret;
use crate::server::apply::{Applier, WorkerGateway};
use crate::server::listener::{ConnectionLimit, Http, Listener, accept_loop};
use crate::server::reload::Reloader;
use crate::server::route_tasks::RouteTasks;
use crate::store::{Access, Retry, StartError, Store, StoreError, UnreachableAtStart};
use crate::telemetry::metrics::Metrics;
use crate::tls::server::{LoadError, TlsListener};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{setting} = {addr}: cannot listen on {addr}: {error}{}", bind_hint(setting, error, *reuse_port))]
    Bind {
        /// `server.listen` or `admin.listen`.
        setting: &'static str,
        addr: SocketAddr,
        error: std::io::Error,
        /// `server.reuse_port` (the proxy listener only).
        reuse_port: bool,
    },
    #[error("{section}.tls.{}: {source}", source.key)]
    Tls { section: &'static str, source: LoadError },
    #[error(transparent)]
    Start(#[from] StartError),
}

/// A bound, ready gateway; [`Server::run`] serves until shutdown.
pub struct Server {
    config: Config,
    /// What outlives every configuration applied (see [`crate::server::apply`]).
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    /// One listener per worker: clones of one socket (its connections go to
    /// whichever worker accepts first), or, with `server.reuse_port`, sockets
    /// of their own on the same address (SO_REUSEPORT: the kernel spreads
    /// connections over them).
    proxy: Vec<TcpListener>,
    admin: Option<TcpListener>,
    /// `[server.tls]` and `[admin.tls]`, loaded.
    proxy_tls: Option<Arc<TlsListener>>,
    admin_tls: Option<Arc<TlsListener>>,
    /// SIGHUP events: TLS listeners re-read their certificates.
    hangups: Option<watch::Receiver<u64>>,
    tracker: TaskTracker,
    /// The derived-key secret (the reconciler's `{derived_key}`, the admin API).
    secret: DerivedKeySecret,
    /// Where SIGHUP reloads the configuration from, and the SIGHUP events.
    reload: Option<(PathBuf, watch::Receiver<u64>)>,
    /// PostgreSQL could not be reached at start: brings the store up later.
    store_retry: Option<Retry>,
}

impl Server {
    /// Opens the store (taking the embedded store's lock), applies migrations
    /// unless `store.migrate = false`, and binds the listeners. PostgreSQL
    /// unreachable: see `store.unreachable_at_start` (`store::startup`).
    pub async fn bind(config: Config) -> Result<Server, ServeError> {
        let metrics = Arc::new(Metrics::new());
        let store = Store::open(&config.store, Access::Serve).await?.with_metrics(metrics.clone());
        // The key derived for the upstream is an HMAC under the configured
        // secret, else under the one `migrate` generated for this deployment
        // (the same for every replica).
        let secret = match &config.server.derived_key_secret {
            Some(s) => DerivedKeySecret::known(s.expose().as_bytes()),
            None => DerivedKeySecret::default(),
        };
        let store_retry = match store.bring_up(config.store.migrate, &secret).await {
            Ok(()) => None,
            Err(e)
                if e.unreachable()
                    && matches!(store.kind(), "postgres" | "citus")
                    && config.store.unreachable_at_start == UnreachableAtStart::Retry =>
            {
                tracing::warn!(error = %e, "the store cannot be reached: starting anyway; idempotent routes answer 503 and pass-through is served until it answers (store.unreachable_at_start = \"exit\" exits instead)");
                store.hold();
                Some(Retry { store: store.clone(), migrate: config.store.migrate, secret: secret.clone() })
            }
            Err(e) => return Err(e.into()),
        };
        let tls = |listener: &'static str, settings: &Option<crate::tls::server::ListenerTls>, alpn: Vec<&'static [u8]>| {
            settings
                .clone()
                .map(|t| {
                    TlsListener::new(listener, t, alpn)
                        .map(Arc::new)
                        .map_err(|source| ServeError::Tls { section: TlsListener::section_of(listener), source })
                })
                .transpose()
        };
        let proxy_tls = tls("proxy", &config.server.tls, vec![b"h2", b"http/1.1"])?;
        let admin_tls = tls("admin", &config.admin.as_ref().and_then(|a| a.tls.clone()), vec![b"http/1.1"])?;
        let proxy = bind_workers(config.server.listen, config.server.workers, config.server.reuse_port)?;
        let admin = match &config.admin {
            Some(a) => Some(bind("admin.listen", a.listen)?),
            None => None,
        };
        let tracker = TaskTracker::new();
        let shared = Arc::new(Shared::new(&config, store, metrics.clone(), tracker.clone(), secret.clone()));
        Ok(Server {
            config,
            shared,
            metrics,
            proxy,
            admin,
            proxy_tls,
            admin_tls,
            hangups: None,
            tracker,
            secret,
            reload: None,
            store_retry,
        })
    }

    /// Reloads the configuration from `path` on each SIGHUP event (see
    /// [`crate::server::reload`]).
    pub fn reload_from(mut self, path: PathBuf, hangups: watch::Receiver<u64>) -> Server {
        self.reload = Some((path, hangups));
        self
    }

    /// SIGHUP events (from [`crate::server::signals::Signals::hangups`]): TLS
    /// listeners re-read their certificate and key files on each; open
    /// connections keep the certificate they were accepted with. Without a
    /// TLS listener the receiver is not kept.
    pub fn with_hangups(mut self, hangups: watch::Receiver<u64>) -> Server {
        if self.proxy_tls.is_some() || self.admin_tls.is_some() {
            self.hangups = Some(hangups);
        }
        self
    }

    /// Whether the proxy listener speaks TLS.
    pub fn proxy_tls(&self) -> bool {
        self.proxy_tls.is_some()
    }

    pub fn proxy_addr(&self) -> Option<SocketAddr> {
        self.proxy.first().and_then(|l| l.local_addr().ok())
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|l| l.local_addr().ok())
    }

    pub fn store(&self) -> &Store {
        self.shared.store()
    }

    /// Serves until `shutdown` fires, then stops accepting, lets connections
    /// finish their current request, and waits up to `shutdown_grace` for
    /// forwards to be recorded.
    ///
    /// Proxy connections are served by `server.workers` threads, each with
    /// its own single-threaded event loop, listener and upstream pools: a
    /// request, its upstream exchange and its response stay on one thread, as
    /// in nginx's worker model, instead of being handed between threads. The
    /// admin listener, the background tasks and the store's batchers run on
    /// the main runtime.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ServeError> {
        let Server { config, shared, metrics, proxy, admin, proxy_tls, admin_tls, hangups, tracker, secret, reload, store_retry } = self;
        tracing::info!(
            addr = %proxy.first().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
            admin = %admin.as_ref().and_then(|a| a.local_addr().ok()).map(|a| a.to_string()).unwrap_or_default(),
            tls = proxy_tls.is_some(),
            admin_tls = admin_tls.is_some(),
            store = shared.store().kind(),
            replica = %config.server.replica_id,
            workers = proxy.len(),
            "listening"
        );
        let background = TaskTracker::new();
        if let Some(retry) = store_retry {
            background.spawn(retry.run(shutdown.clone()));
        }
        let leases = housekeeping::LeaseWatch::new();
        housekeeping::spawn_all(&background, shared.store().clone(), metrics.clone(), &config.store, leases.clone(), shutdown.clone());
        // The lease reaper, the outbox relay, the reconciler and the async
        // workers follow the routes in force: a reload restarts them. Workers
        // run on this runtime, on the connections' tracker: the drain waits
        // for the attempts they hold.
        let tasks = RouteTasks::new(metrics.clone(), secret.clone(), background.clone(), tracker.clone(), leases, shutdown.clone());
        // Every consumer of the configuration, built from it (every series
        // exists before the admin listener serves its first scrape); a
        // reload applies the next one the same way.
        let applier = Applier::start(shared.clone(), tasks, background.clone(), shutdown.clone(), &config);
        let live = applier.live().clone();
        let in_force = applier.admin();
        if let Some((path, hangups)) = reload {
            let reloader = Reloader { path, running: config.clone(), applier, metrics: metrics.clone() };
            background.spawn(reloader.run(hangups, shutdown.clone()));
        }
        let tls_listeners: Vec<Arc<TlsListener>> = proxy_tls.iter().chain(admin_tls.iter()).cloned().collect();
        for t in &tls_listeners {
            metrics.declare_tls_listener(t.name);
            metrics.set_certificate_expiry(t.name, t.expires());
        }
        if let Some(hangups) = hangups {
            background.spawn(reload_on_hangup(hangups, tls_listeners, metrics.clone(), shutdown.clone()));
        }
        let http = Http::new(config.server.request_header_timeout).http2_keep_alive(config.server.http2_keep_alive_interval);
        // The admin listener outlives the proxy's drain (so `/readyz` can say
        // 503 and `/metrics` can be scraped while it runs); it has its own
        // stop and tracker.
        let admin_stop = CancellationToken::new();
        let admin_conns = TaskTracker::new();
        if let Some(admin) = admin {
            let admin_state = Arc::new(
                Admin::new(in_force, metrics.clone(), config.admin.as_ref().and_then(|a| a.token.clone()))
                    .with_derived_key_secret(secret.clone())
                    .with_settings(
                        config.admin.as_ref().and_then(|a| a.token_label.clone()),
                        config.admin.as_ref().map(|a| a.masked_query_params.clone()).unwrap_or_default(),
                    )
                    .with_draining(shutdown.clone()),
            );
            let http = http.clone();
            let (stop, conns) = (admin_stop.clone(), admin_conns.clone());
            let admin = Listener { name: "admin", tcp: admin, tls: admin_tls, limit: ConnectionLimit::new(ADMIN_MAX_CONNECTIONS) };
            let admin_metrics = Some(metrics.clone());
            admin_conns.spawn(async move {
                accept_loop(admin, stop, conns, http, admin_metrics, move |req, peer| {
                    let admin = admin_state.clone();
                    async move { admin.handle(req, peer).await }
                })
                .await
            });
        }
        // Fired `drain_delay` after the shutdown signal: the proxy listeners
        // stop accepting and open connections finish their current request.
        let stop = CancellationToken::new();
        let grace = config.server.shutdown_grace;
        let mut workers = Vec::new();
        let limit = ConnectionLimit::new(config.server.max_connections);
        for (i, listener) in proxy.into_iter().enumerate() {
            let worker = Worker {
                gateway: live.for_worker(),
                http: http.clone(),
                tls: proxy_tls.clone(),
                limit: limit.clone(),
                metrics: metrics.clone(),
                shutdown: shutdown.clone(),
                stop: stop.clone(),
                tracker: tracker.clone(),
                grace: grace + config.server.drain_delay,
            };
            let err = |error| ServeError::Bind { setting: "server.listen", addr: config.server.listen, error, reuse_port: false };
            let listener = listener.into_std().map_err(err)?;
            let handle =
                std::thread::Builder::new().name(format!("idemgate-worker-{i}")).spawn(move || worker.run(listener)).map_err(err)?;
            workers.push(handle);
        }

        shutdown.cancelled().await;
        // Drain, as load balancers see it: /readyz answers 503 from now on
        // while the listener keeps accepting for `drain_delay` (the balancer
        // notices and stops sending); then no new connections, open ones
        // finish their request, forwards already running are recorded.
        metrics.set_draining(true);
        let delay = config.server.drain_delay;
        if !delay.is_zero() {
            tracing::info!(drain_delay = ?delay, "draining: readyz answers 503; still accepting for the drain delay");
            tokio::time::sleep(delay).await;
        }
        stop.cancel();
        tracker.close();
        background.close();
        tracing::info!(grace = ?grace, open = tracker.len(), "shutting down: draining connections and in-flight forwards");
        if tokio::time::timeout(grace, tracker.wait()).await.is_err() {
            tracing::warn!(left = tracker.len(), "shutdown grace expired; unfinished claims will expire to unknown");
        }
        let _ = tokio::task::spawn_blocking(move || {
            for w in workers {
                let _ = w.join();
            }
        })
        .await;
        let _ = tokio::time::timeout(Duration::from_secs(5), background.wait()).await;
        admin_stop.cancel();
        admin_conns.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), admin_conns.wait()).await;
        tracing::info!("stopped");
        Ok(())
    }
}

/// One proxy worker thread.
struct Worker {
    gateway: WorkerGateway,
    http: Http,
    tls: Option<Arc<TlsListener>>,
    /// Shared by all workers.
    limit: ConnectionLimit,
    metrics: Arc<Metrics>,
    /// The process's cancellation root (cancelled by this worker if it cannot start).
    shutdown: CancellationToken,
    /// Stops accepting (after the drain delay).
    stop: CancellationToken,
    tracker: TaskTracker,
    /// How long this thread's loop may run after the shutdown signal.
    grace: Duration,
}

impl Worker {
    fn run(self, listener: std::net::TcpListener) {
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a worker's event loop");
                self.shutdown.cancel();
                return;
            }
        };
        runtime.block_on(async move {
            let listener = match TcpListener::from_std(listener) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "cannot register a worker's listener");
                    self.shutdown.cancel();
                    return;
                }
            };
            let gw = Arc::new(self.gateway);
            let listener = Listener { name: "proxy", tcp: listener, tls: self.tls.clone(), limit: self.limit.clone() };
            let metrics = Some(self.metrics.clone());
            let draining = self.shutdown.clone();
            accept_loop(listener, self.stop.clone(), self.tracker.clone(), self.http, metrics, move |req, peer| {
                let http1 = req.version() < http::Version::HTTP_2;
                let answer = gw.get().handle(req, peer);
                let draining = draining.clone();
                // Boxed: hyper stores and moves the service's future; on the
                // heap it moves as a pointer instead of a few kilobytes
                // (docs/performance-notes.md, issue 32).
                Box::pin(async move {
                    let mut response = answer.await;
                    // During the drain delay keep-alive clients are told to
                    // reconnect (to a replica that is not leaving) while this
                    // one still answers; HTTP/2 clients get GOAWAY when the
                    // listener stops.
                    if http1 && draining.is_cancelled() {
                        response.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
                    }
                    response
                })
            })
            .await;
            // This thread's event loop drives its connections and forwards:
            // keep it running until they are done (the main task closes the
            // tracker and bounds the wait by the grace period).
            let _ = tokio::time::timeout(self.grace + Duration::from_secs(1), self.tracker.wait()).await;
        });
    }
}

/// The listeners of `workers` worker threads on one address. By default one
/// socket, bound exclusively (a port another process listens on is refused),
/// cloned for each worker. With `reuse_port` (SO_REUSEPORT) each worker binds
/// its own socket (port 0: the first picks the port, the others join it), and
/// other processes that set it too may join the port.
fn bind_workers(addr: SocketAddr, workers: usize, reuse_port: bool) -> Result<Vec<TcpListener>, ServeError> {
    let workers = workers.max(1);
    let mut listeners = Vec::with_capacity(workers);
    let mut addr = addr;
    let err = |addr| move |error| ServeError::Bind { setting: "server.listen", addr, error, reuse_port };
    if !reuse_port {
        let one = listen(addr, false).and_then(TcpListener::into_std).map_err(err(addr))?;
        for _ in 1..workers {
            listeners.push(one.try_clone().and_then(TcpListener::from_std).map_err(err(addr))?);
        }
        listeners.insert(0, TcpListener::from_std(one).map_err(err(addr))?);
        return Ok(listeners);
    }
    for _ in 0..workers {
        let listener = listen(addr, true).map_err(err(addr))?;
        addr = listener.local_addr().map_err(err(addr))?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// A listening socket on `addr`; SO_REUSEADDR (a restart binds again at
/// once, past the old connections' TIME_WAIT), SO_REUSEPORT only if asked.
fn listen(addr: SocketAddr, reuse_port: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }?;
    socket.set_reuseaddr(true)?;
    if reuse_port {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// What a failed bind's message adds when the address is taken.
fn bind_hint(setting: &str, error: &std::io::Error, reuse_port: bool) -> String {
    if error.kind() != std::io::ErrorKind::AddrInUse {
        return String::new();
    }
    match (setting, reuse_port) {
        ("server.listen", false) => "; another process listens there (another idemgate?). Two gateways on one port would split its \
             connections, and one key's retries, between their stores; to share the port on purpose set server.reuse_port = true \
             in both"
            .to_owned(),
        ("server.listen", true) => {
            "; another process listens there without sharing it (server.reuse_port = true must be set in every gateway on the port)"
                .to_owned()
        }
        _ => "; another process listens there: every gateway needs an admin port of its own".to_owned(),
    }
}

/// Connections the admin listener serves at once.
const ADMIN_MAX_CONNECTIONS: usize = 256;

/// The admin listener, bound exclusively.
fn bind(setting: &'static str, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    listen(addr, false).map_err(|error| ServeError::Bind { setting, addr, error, reuse_port: false })
}

/// Re-reads TLS certificates on every SIGHUP; a failed reload keeps the
/// certificate in use and says why.
async fn reload_on_hangup(
    mut hangups: watch::Receiver<u64>,
    listeners: Vec<Arc<TlsListener>>,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = hangups.changed() => if changed.is_err() { return },
        }
        for l in &listeners {
            match l.reload() {
                Ok(()) => {
                    metrics.set_certificate_expiry(l.name, l.expires());
                    tracing::info!(listener = l.name, cert_file = %l.settings.cert_file.display(), "TLS certificate reloaded");
                }
                Err(e) => tracing::error!(
                    listener = l.name,
                    error = %format!("{}.tls.{}: {e}", TlsListener::section_of(l.name), e.key),
                    "TLS certificate reload failed; the previous certificate stays in use"
                ),
            }
        }
    }
}
