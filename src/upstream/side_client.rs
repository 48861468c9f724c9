//! The HTTP client of the gateway's side calls: JWKS fetches, the
//! authorizer and the outbox relay's webhooks. One builder, so they share
//! what a careful client needs: a connect timeout, `TCP_NODELAY` (small
//! requests are not held back by Nagle), tokio's timers for the pool and for
//! HTTP/2 keep-alive, http and https (system roots). Upstreams have their
//! own client with per-upstream settings ([`super::Upstream`]).

use std::time::Duration;

use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::body::Body;

/// A side client: http and https, pooled.
pub type SideClient = Client<HttpsConnector<HttpConnector>, Body>;

/// How long a side client keeps an idle connection: shorter than the idle
/// timeouts of common servers (gunicorn 2 s, Node 5 s), as for upstreams, so
/// that a request is not written on a connection its server is closing; and
/// a connection the pool opened but did not need (hyper finishes one raced
/// against a checkout) does not hold a thread-per-connection server's thread
/// for long.
const POOL_IDLE: Duration = Duration::from_secs(1);

/// A side client whose connections give up connecting after `connect_timeout`.
pub fn build(connect_timeout: Duration) -> SideClient {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .build(crate::tls::client::connector(connector, crate::tls::client::system_default()))
}
