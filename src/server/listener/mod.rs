//! The accept loop every listener runs: plain TCP or TLS, under a connection
//! limit, each connection served by hyper on the caller's tracker and asked
//! to finish its current request when the stop token fires.
//!
//! Plain connections speak HTTP/1.1 (hyper's http1 server, with the header
//! read timeout). TLS connections are served by hyper-util's auto builder:
//! HTTP/2 when the client's first bytes are its preface, HTTP/1.1 otherwise.
//! The TLS handshake has its own deadline and happens before hyper reads
//! anything, so a client stuck in it never reaches a request or a claim.
//! After it, the header timeout bounds the time to the first request and
//! between requests on either protocol (`activity`); HTTP/2 connections
//! are also pinged, and closed when a ping goes unanswered.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::telemetry::metrics::{Metrics, RouteSeries};
use crate::tls::server::TlsListener;
use crate::upstream::body::Body;

mod activity;

use activity::{Activity, Tracked};

/// The connection limit shared by a listener's workers.
#[derive(Debug, Clone)]
pub struct ConnectionLimit {
    permits: Arc<Semaphore>,
    max: usize,
    /// Set while the limit is reached (logged once per episode).
    saturated: Arc<AtomicBool>,
}

impl ConnectionLimit {
    pub fn new(max: usize) -> ConnectionLimit {
        ConnectionLimit { permits: Arc::new(Semaphore::new(max)), max, saturated: Arc::default() }
    }

    /// A permit for one more connection; at the limit this waits and says so
    /// once per episode.
    async fn acquire(&self, listener: &'static str) -> Option<OwnedSemaphorePermit> {
        if let Ok(p) = self.permits.clone().try_acquire_owned() {
            self.saturated.store(false, Ordering::Relaxed);
            return Some(p);
        }
        if !self.saturated.swap(true, Ordering::Relaxed) {
            tracing::warn!(listener, max_connections = self.max, "connection limit reached: new connections wait until one closes");
        }
        self.permits.clone().acquire_owned().await.ok()
    }
}

/// A bound listener: its socket, TLS (if any) and connection limit.
pub struct Listener {
    /// `proxy`, `admin` or `demo`, for logs and metrics.
    pub name: &'static str,
    pub tcp: TcpListener,
    pub tls: Option<Arc<TlsListener>>,
    pub limit: ConnectionLimit,
}

/// How connections are served: HTTP/1.1 for plain ones, the auto builder
/// (HTTP/2 or HTTP/1.1) for TLS ones.
#[derive(Clone)]
pub struct Http {
    h1: http1::Builder,
    auto: auto::Builder<TokioExecutor>,
    /// For TLS listeners that do not offer HTTP/2 (the admin listener): an
    /// HTTP/2 preface is refused rather than served.
    auto_h1: auto::Builder<TokioExecutor>,
    /// The time to a connection's first request, and between requests.
    header_timeout: Duration,
}

/// HTTP/2 PING cadence unless configured otherwise.
const DEFAULT_H2_KEEP_ALIVE: Duration = Duration::from_secs(20);

impl Http {
    /// `header_timeout`: a client must send its request headers within it,
    /// the first request's from the connection's start (after the TLS
    /// handshake), each later one's from the end of the one before (hyper
    /// enforces it on HTTP/1.1 with a timer, which is set here; the
    /// listener on the rest).
    pub fn new(header_timeout: Duration) -> Http {
        let mut h1 = http1::Builder::new();
        h1.timer(TokioTimer::new()).header_read_timeout(header_timeout).keep_alive(true);
        let auto = auto::Builder::new(TokioExecutor::new());
        Http { h1, auto_h1: auto.clone(), auto, header_timeout }.http2_keep_alive(DEFAULT_H2_KEEP_ALIVE)
    }

    /// HTTP/2 connections are pinged every `interval`; one whose client does
    /// not answer within the same time is closed.
    pub fn http2_keep_alive(mut self, interval: Duration) -> Http {
        let mut auto = auto::Builder::new(TokioExecutor::new());
        auto.http1().timer(TokioTimer::new()).header_read_timeout(self.header_timeout).keep_alive(true);
        auto.http2().timer(TokioTimer::new()).max_concurrent_streams(256).keep_alive_interval(Some(interval)).keep_alive_timeout(interval);
        self.auto_h1 = auto.clone().http1_only();
        self.auto = auto;
        self
    }
}

/// Accepts until `stop`; each connection runs on `tracker`.
pub async fn accept_loop<H, F>(
    listener: Listener,
    stop: CancellationToken,
    tracker: TaskTracker,
    http: Http,
    metrics: Option<Arc<Metrics>>,
    handler: H,
) where
    H: Fn(http::Request<hyper::body::Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = http::Response<Body>> + Send + 'static,
{
    let Listener { name, tcp, tls, limit } = listener;
    let h2 = tls.as_ref().is_some_and(|t| t.speaks_h2());
    // The proxy's requests are counted by the gateway, which knows their
    // route (and counts a client that went away before its answer).
    let served = metrics.as_ref().filter(|_| name != "proxy").map(|m| Arc::new(Endpoints::new(m, name, h2)));
    let open = metrics.as_ref().map(|m| m.connections(name, limit.max));
    loop {
        let (sock, peer) = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = tcp.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // At the limit this connection waits, unserved, until one closes; the
        // loop accepts nothing meanwhile (later ones wait in the kernel's
        // queue), so at most one connection per worker is held beyond the limit.
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = limit.acquire(name) => match p {
                Some(p) => p,
                None => return,
            },
        };
        let conn = Conn { name, peer, http: http.clone(), stop: stop.clone(), metrics: metrics.clone(), served: served.clone() };
        let (tls, handler) = (tls.clone(), handler.clone());
        let open = open.clone().map(Open::new);
        tracker.spawn(async move {
            conn.serve(sock, tls, handler).await;
            drop(open);
            drop(permit);
        });
    }
}

/// A connection counted in `idemgate_open_connections` while it lives.
struct Open(prometheus_client::metrics::gauge::Gauge);

impl Open {
    fn new(gauge: prometheus_client::metrics::gauge::Gauge) -> Open {
        gauge.inc();
        Open(gauge)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The request series of a listener whose requests are counted here (every
/// listener but the proxy): one per admin endpoint.
struct Endpoints(Vec<(&'static str, RouteSeries)>);

impl Endpoints {
    fn new(metrics: &Metrics, listener: &'static str, h2: bool) -> Endpoints {
        Endpoints(crate::ops::admin::ENDPOINTS.iter().map(|e| (*e, metrics.route_series(listener, e, h2))).collect())
    }

    /// Counts a request to `path` once its answer is ready.
    fn start(self: &Arc<Self>, path: &str, version: http::Version) -> Served {
        let endpoint = crate::ops::admin::endpoint(path);
        let i = self.0.iter().position(|(e, _)| *e == endpoint).unwrap_or(0);
        Served { endpoints: self.clone(), i, version, started: Instant::now() }
    }
}

/// A request on its way, to be counted with its status.
struct Served {
    endpoints: Arc<Endpoints>,
    i: usize,
    version: http::Version,
    started: Instant,
}

impl Served {
    fn answered(self, status: http::StatusCode) {
        if let Some((_, series)) = self.endpoints.0.get(self.i) {
            series.record(self.version, status.as_u16(), self.started.elapsed());
        }
    }
}

struct Conn {
    name: &'static str,
    peer: SocketAddr,
    http: Http,
    stop: CancellationToken,
    metrics: Option<Arc<Metrics>>,
    served: Option<Arc<Endpoints>>,
}

impl Conn {
    async fn serve<H, F>(self, sock: TcpStream, tls: Option<Arc<TlsListener>>, handler: H)
    where
        H: Fn(http::Request<hyper::body::Incoming>, SocketAddr) -> F + Send + Sync + 'static,
        F: std::future::Future<Output = http::Response<Body>> + Send + 'static,
    {
        let _ = sock.set_nodelay(true);
        let Some(tls) = tls else {
            let (peer, served) = (self.peer, self.served.clone());
            let service = service_fn(move |req: http::Request<hyper::body::Incoming>| {
                let counted = served.as_ref().map(|s| s.start(req.uri().path(), req.version()));
                let fut = handler(req, peer);
                async move {
                    let resp = fut.await;
                    if let Some(c) = counted {
                        c.answered(resp.status());
                    }
                    Ok::<_, Infallible>(resp)
                }
            });
            let conn = pin!(self.http.h1.serve_connection(TokioIo::new(sock), service));
            return self.drive(conn, |c| c.graceful_shutdown()).await;
        };
        // A TLS connection runs in a future of its own, on the heap: inline,
        // its handshake and its HTTP/2-capable connection would make every
        // plain connection's task as large (6.9 KB instead of 2.3 KB;
        // docs/performance-notes.md, issue 9's sixth pass).
        Box::pin(self.serve_tls(sock, tls, handler)).await
    }

    async fn serve_tls<H, F>(self, sock: TcpStream, tls: Arc<TlsListener>, handler: H)
    where
        H: Fn(http::Request<hyper::body::Incoming>, SocketAddr) -> F + Send + Sync + 'static,
        F: std::future::Future<Output = http::Response<Body>> + Send + 'static,
    {
        let (peer, served) = (self.peer, self.served.clone());
        let accepted = tokio::select! {
            _ = self.stop.cancelled() => return,
            a = tls.handshake(sock) => a,
        };
        let accepted = match accepted {
            Ok(a) => a,
            Err((reason, detail)) => {
                if let Some(m) = &self.metrics {
                    m.tls_handshake_failed(self.name, reason);
                }
                tracing::debug!(listener = self.name, %peer, reason = reason.as_str(), error = %detail, "TLS handshake failed");
                return;
            }
        };
        if let Some(m) = &self.metrics {
            m.tls_handshake_ok(self.name);
        }
        let client = accepted.client;
        let activity = Activity::new();
        let seen = activity.clone();
        let service = service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            // Open from here until its response body is done.
            let in_use = seen.begin();
            let counted = served.as_ref().map(|s| s.start(req.uri().path(), req.version()));
            if let Some(cert) = &client {
                req.extensions_mut().insert(cert.clone());
            }
            let fut = handler(req, peer);
            async move {
                let resp = fut.await;
                if let Some(c) = counted {
                    c.answered(resp.status());
                }
                Ok::<_, Infallible>(resp.map(|body| Tracked::new(body, in_use)))
            }
        });
        let io = TokioIo::new(accepted.stream);
        let builder = if tls.speaks_h2() { &self.http.auto } else { &self.http.auto_h1 };
        let conn = pin!(builder.serve_connection(io, service));
        self.drive_bounded(conn, &activity, |c| c.graceful_shutdown()).await
    }

    /// [`drive`](Self::drive), and: a connection that has had no request
    /// open for the header timeout (none yet since it started, or none since
    /// the last one ended) is closed. Before its first request nothing is in
    /// progress, so it is dropped at once; an idle one is asked to close
    /// (HTTP/2: GOAWAY) and given the same time again to do so.
    async fn drive_bounded<C, E>(&self, mut conn: std::pin::Pin<&mut C>, activity: &Activity, shutdown: impl FnOnce(std::pin::Pin<&mut C>))
    where
        C: std::future::Future<Output = Result<(), E>>,
        E: std::fmt::Display,
    {
        let timeout = self.http.header_timeout;
        let wake = tokio::time::sleep(timeout);
        let mut wake = pin!(wake);
        let result = loop {
            // While requests are open there is no deadline: look again later.
            let deadline = activity.deadline(timeout);
            wake.as_mut().reset(deadline.unwrap_or_else(|| tokio::time::Instant::now() + timeout));
            tokio::select! {
                r = conn.as_mut() => break r,
                _ = self.stop.cancelled() => {
                    shutdown(conn.as_mut());
                    break conn.await;
                }
                _ = wake.as_mut() => {
                    if activity.deadline(timeout).is_none_or(|d| d > tokio::time::Instant::now()) {
                        continue;
                    }
                    if !activity.any_request() {
                        tracing::debug!(listener = self.name, peer = %self.peer, ?timeout, "no request within request_header_timeout: connection closed");
                        return;
                    }
                    tracing::debug!(listener = self.name, peer = %self.peer, ?timeout, "connection idle for request_header_timeout: closing it");
                    shutdown(conn.as_mut());
                    match tokio::time::timeout(timeout, conn.as_mut()).await {
                        Ok(r) => break r,
                        Err(_) => return,
                    }
                }
            }
        };
        if let Err(e) = result {
            tracing::debug!(listener = self.name, peer = %self.peer, error = %e, "connection ended with an error");
        }
    }

    /// Runs a connection to its end; on stop, asks it to finish the current
    /// request (HTTP/2: GOAWAY, open streams complete) and waits.
    async fn drive<C, E>(&self, mut conn: std::pin::Pin<&mut C>, shutdown: impl FnOnce(std::pin::Pin<&mut C>))
    where
        C: std::future::Future<Output = Result<(), E>>,
        E: std::fmt::Display,
    {
        let result = tokio::select! {
            r = conn.as_mut() => r,
            _ = self.stop.cancelled() => {
                shutdown(conn.as_mut());
                conn.await
            }
        };
        if let Err(e) = result {
            tracing::debug!(listener = self.name, peer = %self.peer, error = %e, "connection ended with an error");
        }
    }
}
