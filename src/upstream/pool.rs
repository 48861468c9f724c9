//! The keep-alive pool of a plain `http://` upstream: HTTP/1.1 connections
//! from `hyper::client::conn::http1`, driven on the task of the request that
//! uses them.
//!
//! hyper-util's legacy client hands each request through a channel to a task
//! of its own per connection, hashes a pool key on every checkout and check
//! in, and spawns a task per request to put the connection back. Here a
//! connection is its `SendRequest` handle and its `Connection` future side
//! by side: whoever sends a request polls the `Connection` until the response
//! head is there, then the response body ([`ResponseBody`]) polls it while
//! the body streams, and puts both back into the pool when the exchange ended
//! cleanly (the body read to its end and hyper ready for the next request).
//! Nothing crosses a thread: each event loop has its own `Upstream` (see
//! `Executor::with_own_pools`), so the pool's lock is never contended.
//!
//! What was sent is what hyper reports. A request that `try_send_request`
//! hands back was never written: the connection closed first. That happens
//! when the upstream closed an idle keep-alive connection just before it was
//! reused; the request is then tried on another connection (it never left,
//! so this cannot run it twice). A fresh connection that hands the request
//! back is [`super::UpstreamError::NotSent`]. Any other failure after the
//! hand-over may have executed, as with the legacy client.

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Waker};
use std::time::Duration;

use http::header::HOST;
use http::uri::{PathAndQuery, Uri};
use http::{HeaderValue, Request, Response};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::{BoundedConnect, UpstreamError, error_chain};
use crate::upstream::body::{Body, Lent, ResponseBody};

/// A request handed back unsent by a reused connection is tried on another
/// one; this bounds the tries (each costs a closed connection).
const MAX_UNSENT_RETRIES: usize = 4;

/// One HTTP/1.1 connection: the handle requests are sent through and the
/// future that does the connection's I/O.
struct Conn {
    sender: SendRequest<Body>,
    driver: http1::Connection<TokioIo<TcpStream>, Body>,
    /// The upstream's address on this connection (for the access log).
    peer: Option<std::net::SocketAddr>,
}

impl Conn {
    /// Lets the connection do what it can; `false` once it has ended
    /// (closed by either side, or failed): it cannot be used again.
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        Pin::new(&mut self.driver).poll(cx).is_pending()
    }

    /// Whether an idle connection can take a request: still open (an
    /// upstream's close is seen here when the event loop already saw the
    /// socket readable; no system call otherwise) and ready for the next
    /// request.
    fn reusable(&mut self) -> bool {
        self.drive(&mut Context::from_waker(Waker::noop())) && self.sender.is_ready()
    }
}

/// Connections are boxed: a response body carries one, and bodies are moved
/// from future to future on their way to the client.
struct Idle {
    conn: Box<Conn>,
    since: Instant,
}

/// The idle connections of one upstream on one event loop.
struct Shared {
    idle: Mutex<Vec<Idle>>,
    /// Whether a task is closing connections idle for too long.
    sweeping: AtomicBool,
    max_idle: usize,
    idle_timeout: Duration,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Vec<Idle>> {
        // Never held across an await nor around code that panics; a poisoned
        // list is still a valid list.
        self.idle.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The most recently used idle connection that can take a request;
    /// closed and expired ones met on the way are dropped.
    fn take(&self) -> Option<Box<Conn>> {
        let mut idle = self.lock();
        while let Some(Idle { mut conn, since }) = idle.pop() {
            if since.elapsed() <= self.idle_timeout && conn.reusable() {
                return Some(conn);
            }
        }
        None
    }

    /// Keeps `conn` for the next request, unless the pool is full.
    fn put(self: &Arc<Self>, conn: Box<Conn>) {
        {
            let mut idle = self.lock();
            if idle.len() >= self.max_idle {
                return;
            }
            idle.push(Idle { conn, since: Instant::now() });
        }
        if !self.sweeping.swap(true, Ordering::AcqRel) {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(sweep(Arc::downgrade(self), self.idle_timeout))),
                // No event loop (a body dropped outside of one): the next
                // check-in on one starts the sweeper.
                Err(_) => self.sweeping.store(false, Ordering::Release),
            }
        }
    }

    /// Closes connections idle for longer than the idle timeout; how many
    /// are left.
    fn sweep(&self) -> usize {
        let mut idle = self.lock();
        idle.retain(|i| i.since.elapsed() <= self.idle_timeout);
        if idle.is_empty() {
            // Under the lock: a check-in after this point starts a new sweeper.
            self.sweeping.store(false, Ordering::Release);
        }
        idle.len()
    }
}

/// Closes idle connections past the idle timeout while the pool has any and
/// its upstream exists.
async fn sweep(pool: Weak<Shared>, idle_timeout: Duration) {
    let period = (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(15));
    loop {
        tokio::time::sleep(period).await;
        let Some(pool) = pool.upgrade() else { return };
        if pool.sweep() == 0 {
            return;
        }
    }
}

/// The pool and how new connections are opened.
#[derive(Clone)]
pub(super) struct Http1Pool {
    shared: Arc<Shared>,
    connector: BoundedConnect<HttpConnector>,
    /// The upstream's base URL (what the connector dials).
    base: Uri,
    /// `Host` for requests that arrive without one, as hyper-util's client
    /// sets it: the host, and the port unless it is the default.
    host: Option<HeaderValue>,
}

impl std::fmt::Debug for Http1Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Http1Pool").field("base", &self.base).finish_non_exhaustive()
    }
}

/// How an exchange on one connection ended, short of a response.
enum Failed {
    /// The connection never took the request: it was not written.
    Unsent(Box<Request<Body>>, hyper::Error),
    /// It may have been written.
    Broken(hyper::Error),
}

impl Http1Pool {
    pub(super) fn new(connector: BoundedConnect<HttpConnector>, base: Uri, max_idle: usize, idle_timeout: Duration) -> Http1Pool {
        let host = base.host().and_then(|h| {
            let value = match base.port_u16() {
                Some(port) if port != 80 => format!("{h}:{port}"),
                _ => h.to_owned(),
            };
            HeaderValue::from_str(&value).ok()
        });
        let shared = Arc::new(Shared { idle: Mutex::new(Vec::new()), sweeping: AtomicBool::new(false), max_idle, idle_timeout });
        Http1Pool { shared, connector, base, host }
    }

    /// Sends `req` (absolute URI, as [`super::Upstream::request`] builds it)
    /// in origin form on an idle connection or a new one, and waits for the
    /// response head. The caller bounds the whole by the exchange's deadline.
    pub(super) async fn send(&self, mut req: Request<Body>, upstream: &str) -> Result<Response<ResponseBody>, UpstreamError> {
        if !req.headers().contains_key(HOST)
            && let Some(host) = &self.host
        {
            req.headers_mut().insert(HOST, host.clone());
        }
        let origin = req.uri().path_and_query().cloned().unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(origin);
        let mut retries = 0;
        loop {
            let (conn, reused) = match self.shared.take() {
                Some(conn) => (conn, true),
                None => (Box::pin(self.connect(upstream)).await?, false),
            };
            let peer = conn.peer;
            match exchange(conn, req).await {
                Ok((resp, conn)) => {
                    let (mut head, body) = resp.into_parts();
                    if let Some(addr) = peer {
                        head.extensions.insert(super::UpstreamAddr(addr));
                    }
                    let lease = conn.map(|conn| Box::new(Lease { conn, pool: self.shared.clone() }) as Box<dyn Lent>);
                    let mut body = ResponseBody::lent(body, lease);
                    if hyper::body::Body::is_end_stream(&body) {
                        // No body to stream (HEAD, 204, 304, empty): nobody
                        // will poll it, the connection goes back now.
                        body.release();
                    }
                    return Ok(Response::from_parts(head, body));
                }
                // Closed before it took the request: never written. A reused
                // connection may simply have been closed by the upstream
                // while idle: try another.
                Err(Failed::Unsent(unsent, _)) if reused && retries < MAX_UNSENT_RETRIES => {
                    retries += 1;
                    req = *unsent;
                }
                Err(Failed::Unsent(_, e)) => {
                    return Err(UpstreamError::NotSent {
                        upstream: upstream.to_owned(),
                        detail: error_chain(&e),
                        kind: super::kind_of(&e),
                    });
                }
                Err(Failed::Broken(e)) => {
                    return Err(UpstreamError::Broken { upstream: upstream.to_owned(), detail: error_chain(&e), kind: super::kind_of(&e) });
                }
            }
        }
    }

    /// A new connection: the connect phase bounded as [`BoundedConnect`]
    /// does for the legacy client; any failure is a connect error (nothing
    /// was sent).
    async fn connect(&self, upstream: &str) -> Result<Box<Conn>, UpstreamError> {
        let failed = |e: &(dyn std::error::Error + 'static)| UpstreamError::Connect {
            upstream: upstream.to_owned(),
            detail: error_chain(e),
            kind: super::kind_of(e),
        };
        let mut connector = self.connector.clone();
        poll_fn(|cx| tower_service::Service::poll_ready(&mut connector, cx)).await.map_err(|e| failed(&*e))?;
        let io = tower_service::Service::call(&mut connector, self.base.clone()).await.map_err(|e| failed(&*e))?;
        let peer = io.inner().peer_addr().ok();
        let (sender, driver) = http1::Builder::new().handshake(io).await.map_err(|e| failed(&e))?;
        Ok(Box::new(Conn { sender, driver, peer }))
    }
}

/// Hands `req` to `conn` and drives the connection until the response head
/// is there. The connection comes back with the response unless it ended.
async fn exchange(mut conn: Box<Conn>, req: Request<Body>) -> Result<(Response<Incoming>, Option<Box<Conn>>), Failed> {
    let mut sending = pin!(conn.sender.try_send_request(req));
    let mut conn = Some(conn);
    let answer = poll_fn(|cx| {
        if let Some(c) = conn.as_mut()
            && !c.drive(cx)
        {
            // Ended: dropping it hands back a request it never took.
            conn = None;
        }
        sending.as_mut().poll(cx)
    })
    .await;
    match answer {
        Ok(resp) => Ok((resp, conn)),
        Err(mut e) => match e.take_message() {
            Some(req) => Err(Failed::Unsent(Box::new(req), e.into_error())),
            None => Err(Failed::Broken(e.into_error())),
        },
    }
}

/// A connection lent to a response body, and the pool it goes back to.
struct Lease {
    conn: Box<Conn>,
    pool: Arc<Shared>,
}

impl Lent for Lease {
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        self.conn.drive(cx)
    }

    fn give_back(self: Box<Self>) {
        let Lease { mut conn, pool } = *self;
        if conn.reusable() {
            pool.put(conn);
        }
    }
}
