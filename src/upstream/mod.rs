//! Talking to upstreams: a pooled client per upstream (HTTP/1.1, or HTTP/2
//! when an https upstream offers it by ALPN; plain `http://` upstreams use
//! the leaner per-event-loop pool of `pool`), and an error
//! that says, as a typed fact, whether the upstream may have acted on the
//! request. That fact alone decides between releasing a key and recording
//! `unknown`.
//!
//! The exchange has two phases, and only the second can have side effects:
//! establishing a connection (name resolution, TCP connect and, for https,
//! the TLS handshake, bounded as a whole by the upstream's `connect_timeout`), and, once the request was
//! handed to a connection, waiting for the answer (bounded by `timeout`). A
//! failure or timeout of the first phase is "never sent"; configuration
//! requires `connect_timeout < timeout`, so the connect phase always ends
//! before the exchange's deadline and a timeout can only mean "may have
//! executed".

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{PathAndQuery, Uri};
use http::{HeaderValue, Method, Request, Response, Version, request};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::telemetry::metrics::UpstreamErrorKind;
use crate::upstream::body::Body;
use crate::upstream::headers::strip_hop_by_hop;

pub mod body;
pub mod headers;
pub mod limit;
mod pool;
pub mod side_client;

pub use crate::upstream::body::ResponseBody;

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    pub name: String,
    /// `http://host:port` or `https://...` plus an optional path prefix
    /// prepended to request paths.
    pub url: http::Uri,
    /// https upstreams: the TLS client configuration (roots, client certificate).
    pub tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    pub connect_timeout: Duration,
    /// Whole-response timeout; expiry after the request was sent means the
    /// outcome is unknown.
    pub timeout: Duration,
    pub pool_idle_timeout: Duration,
    pub pool_max_idle: usize,
    /// Admission under overload (`max_in_flight`, `adaptive`, `queue_timeout`).
    pub limit: limit::LimitPolicy,
}

/// Whether the upstream may have executed the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Executed {
    /// The request never left idemgate (connection refused, DNS, connect
    /// timeout, a connection that closed before taking the request), or the
    /// upstream said it did not process it (an HTTP/2 refusal or GOAWAY, a
    /// refused client certificate): releasing the key is safe.
    No,
    /// The request was handed to a connection: the upstream may have acted.
    Maybe,
}

#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to upstream {upstream}: {detail}")]
    Connect { upstream: String, detail: String, kind: UpstreamErrorKind },
    /// The request was handed over but provably not processed: a connection
    /// that closed before it took the request (nothing was written), an
    /// HTTP/2 stream the upstream refused or left past its GOAWAY, or a
    /// client certificate the upstream refused (see [`unprocessed`]).
    #[error("upstream {upstream} did not process the request: {detail}")]
    NotSent { upstream: String, detail: String, kind: UpstreamErrorKind },
    #[error("upstream {upstream} did not answer within {timeout:?}")]
    Timeout { upstream: String, timeout: Duration },
    #[error("exchange with upstream {upstream} failed: {detail}")]
    Broken { upstream: String, detail: String, kind: UpstreamErrorKind },
    #[error("invalid upstream request: {0}")]
    InvalidRequest(String),
}

impl UpstreamError {
    /// What kind of failure it was (`idemgate_upstream_errors_total{kind}`).
    pub fn kind(&self) -> UpstreamErrorKind {
        match self {
            UpstreamError::Connect { kind, .. } | UpstreamError::Broken { kind, .. } | UpstreamError::NotSent { kind, .. } => *kind,
            UpstreamError::Timeout { .. } => UpstreamErrorKind::Timeout,
            UpstreamError::InvalidRequest(_) => UpstreamErrorKind::Other,
        }
    }

    pub fn executed(&self) -> Executed {
        match self {
            UpstreamError::Connect { .. } | UpstreamError::NotSent { .. } | UpstreamError::InvalidRequest(_) => Executed::No,
            UpstreamError::Timeout { .. } | UpstreamError::Broken { .. } => Executed::Maybe,
        }
    }

    pub fn may_have_executed(&self) -> bool {
        self.executed() == Executed::Maybe
    }
}

/// How long the upstream took to answer with its response head, carried in
/// the response's extensions for the access log.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamLatency(pub Duration);

/// The address of the upstream connection a response came on, carried in
/// the response's extensions for the access log.
#[derive(Debug, Clone, Copy)]
pub struct UpstreamAddr(pub std::net::SocketAddr);

/// What kind of failure an error and its sources describe: the first
/// I/O error, TLS error, connect timeout or closed connection met along the
/// chain decides.
pub fn kind_of(e: &(dyn std::error::Error + 'static)) -> UpstreamErrorKind {
    use std::io::ErrorKind as Io;
    let mut next = Some(e);
    while let Some(e) = next {
        if e.is::<ConnectTimedOut>() {
            return UpstreamErrorKind::Timeout;
        }
        if e.is::<rustls::Error>() {
            return UpstreamErrorKind::Tls;
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            // An I/O error hides what it wraps from `source()`.
            if io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) {
                return UpstreamErrorKind::Tls;
            }
            match io.kind() {
                Io::ConnectionRefused => return UpstreamErrorKind::Refused,
                Io::ConnectionReset | Io::ConnectionAborted | Io::BrokenPipe | Io::UnexpectedEof => return UpstreamErrorKind::Reset,
                Io::TimedOut => return UpstreamErrorKind::Timeout,
                _ => {}
            }
        }
        if let Some(h) = e.downcast_ref::<hyper::Error>() {
            if h.is_timeout() {
                return UpstreamErrorKind::Timeout;
            }
            if h.is_incomplete_message() || h.is_closed() || h.is_canceled() {
                return UpstreamErrorKind::Reset;
            }
        }
        next = e.source();
    }
    UpstreamErrorKind::Other
}

/// Whether an exchange's error proves that the upstream did not process the
/// request, from typed facts along its chain (never from its text):
/// - hyper handed the request back unwritten (`is_canceled`: the connection
///   closed or was not ready before it took the request);
/// - HTTP/2: a GOAWAY from the upstream whose last stream id is below the
///   request's stream (h2 gives that error to those streams only, and to
///   requests that had no stream yet), or the upstream reset the stream with
///   `REFUSED_STREAM`: either means "not processed" (RFC 9113, sections 6.8
///   and 8.7);
/// - the upstream refused idemgate's client certificate: a TLS alert about
///   the certificate. In TLS 1.3 it arrives after the client considers the
///   handshake done, where the response would; but the upstream's TLS stack
///   refused the handshake, so nothing sent after it reached the service.
///
/// Anything else after the hand-over may have executed.
pub fn unprocessed(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_canceled) {
            return true;
        }
        if let Some(h2) = e.downcast_ref::<h2::Error>() {
            let refused = h2.is_reset() && h2.reason() == Some(h2::Reason::REFUSED_STREAM);
            if h2.is_remote() && (h2.is_go_away() || refused) {
                return true;
            }
            // An I/O error under h2 is not its `source()`.
            if h2.get_io().is_some_and(refused_certificate) {
                return true;
            }
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && refused_certificate(io)
        {
            return true;
        }
        if e.downcast_ref::<rustls::Error>().is_some_and(certificate_alert) {
            return true;
        }
        next = e.source();
    }
    false
}

/// An I/O error that carries (hidden from `source()`) a TLS alert refusing
/// our certificate. Over HTTP/2 the error reaches a request through h2,
/// which keeps an I/O error's inner error as its text only (it hands a copy
/// to every stream): then the text must be, exactly, how rustls writes one
/// of those alerts, on an error of the kind rustls's I/O errors have.
fn refused_certificate(io: &std::io::Error) -> bool {
    let Some(inner) = io.get_ref() else { return false };
    if let Some(tls) = inner.downcast_ref::<rustls::Error>() {
        return certificate_alert(tls);
    }
    io.kind() == std::io::ErrorKind::InvalidData && {
        let text = inner.to_string();
        CERTIFICATE_REFUSALS.iter().any(|a| rustls::Error::AlertReceived(*a).to_string() == text)
    }
}

/// The alerts by which a peer refuses the certificate we presented.
const CERTIFICATE_REFUSALS: [rustls::AlertDescription; 7] = [
    rustls::AlertDescription::CertificateRequired,
    rustls::AlertDescription::BadCertificate,
    rustls::AlertDescription::UnsupportedCertificate,
    rustls::AlertDescription::CertificateRevoked,
    rustls::AlertDescription::CertificateExpired,
    rustls::AlertDescription::CertificateUnknown,
    rustls::AlertDescription::UnknownCA,
];

/// A fatal alert from the peer saying it refused the certificate we presented.
fn certificate_alert(e: &rustls::Error) -> bool {
    matches!(e, rustls::Error::AlertReceived(a) if CERTIFICATE_REFUSALS.contains(a))
}

/// One configured upstream and its connection pool.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub config: UpstreamConfig,
    /// Where failed exchanges are counted (`idemgate_upstream_errors_total`).
    errors: Option<std::sync::Arc<crate::telemetry::metrics::Metrics>>,
    /// https upstreams (HTTP/2 by ALPN), and CONNECT requests.
    client: Client<BoundedConnect<HttpsConnector<HttpConnector>>, Body>,
    /// Plain `http://` upstreams.
    http1: Option<pool::Http1Pool>,
    /// The concurrency limit, shared by every copy of this upstream (each
    /// worker thread's, the async workers', the reconciler's).
    limit: std::sync::Arc<limit::Limit>,
}

impl Upstream {
    pub fn new(config: UpstreamConfig) -> Upstream {
        let limit = limit::Limit::new(config.limit);
        Upstream::with_limit(config, None, limit)
    }

    /// An upstream admitted under `limit` (kept across reloads: see
    /// [`limit::Limits`]), whose policy is `config.limit`'s.
    pub fn limited_by(config: UpstreamConfig, limit: std::sync::Arc<limit::Limit>) -> Upstream {
        Upstream::with_limit(config, None, limit)
    }

    /// A copy with its own connection pools (for another event loop),
    /// counting errors where this one does and sharing its concurrency limit.
    pub fn with_own_pool(&self) -> Upstream {
        Upstream::with_limit(self.config.clone(), self.errors.clone(), self.limit.clone())
    }

    fn with_limit(
        config: UpstreamConfig,
        errors: Option<std::sync::Arc<crate::telemetry::metrics::Metrics>>,
        limit: std::sync::Arc<limit::Limit>,
    ) -> Upstream {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.connect_timeout));
        connector.set_nodelay(true);
        let http1 = (config.tls.is_none() && config.url.scheme() == Some(&http::uri::Scheme::HTTP)).then(|| {
            let connect = BoundedConnect { inner: connector.clone(), timeout: config.connect_timeout };
            pool::Http1Pool::new(connect, config.url.clone(), config.pool_max_idle, config.pool_idle_timeout)
        });
        // https: the TLS handshake is part of the bounded connection phase.
        let connector = crate::tls::client::connector(connector, config.tls.clone());
        let connector = BoundedConnect { inner: connector, timeout: config.connect_timeout };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(config.pool_idle_timeout)
            .pool_max_idle_per_host(config.pool_max_idle)
            .build(connector);
        Upstream { config, errors, client, http1, limit }
    }

    /// The concurrency limit requests to this upstream are admitted under.
    pub fn limit(&self) -> &std::sync::Arc<limit::Limit> {
        &self.limit
    }

    /// Counts this upstream's failed exchanges in `metrics`.
    /// Counts this upstream's errors in `metrics`, and shows its limit there.
    pub fn counted_by(mut self, metrics: std::sync::Arc<crate::telemetry::metrics::Metrics>) -> Upstream {
        self.limit.report_to(metrics.limit_gauges(&self.config.name, self.limit.current().is_some()));
        self.errors = Some(metrics);
        self
    }

    /// A failed exchange whose error is not one `send` returned (a response
    /// body that broke off, read by the caller).
    pub fn count_error(&self, e: &UpstreamError) {
        if let Some(m) = &self.errors {
            m.upstream_error(&self.config.name, e.kind());
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The upstream URI for a request's path and query: the upstream's base
    /// URL with its path prefix prepended.
    pub fn uri_for(&self, path_and_query: Option<&PathAndQuery>) -> Result<Uri, UpstreamError> {
        let base = &self.config.url;
        let prefix = base.path().trim_end_matches('/');
        let pq = match (prefix.is_empty(), path_and_query) {
            // No prefix: the request's own path and query, shared, not copied.
            (true, Some(pq)) => pq.clone(),
            (true, None) => PathAndQuery::from_static("/"),
            (false, pq) => {
                let joined = format!("{prefix}{}", pq.map_or("/", |pq| pq.as_str()));
                joined.parse().map_err(|e| UpstreamError::InvalidRequest(format!("{e}")))?
            }
        };
        let mut parts = http::uri::Parts::default();
        parts.scheme = base.scheme().cloned();
        parts.authority = base.authority().cloned();
        parts.path_and_query = Some(pq);
        Uri::from_parts(parts).map_err(|e| UpstreamError::InvalidRequest(format!("{e}")))
    }

    /// The request as the upstream receives it: unchanged but for hop-by-hop
    /// headers, the absolute upstream URI, and idemgate's own headers. The
    /// client's `Idempotency-Key` and `X-Idempotency-Generation` never reach
    /// the upstream: on idempotent routes `stamp` replaces them with the
    /// forwarded key and the attempt's generation; elsewhere they are removed,
    /// so a client cannot pose as an attempt of some scope.
    pub fn request(
        &self,
        mut parts: request::Parts,
        body: Body,
        stamp: Option<(HeaderValue, HeaderValue)>,
    ) -> Result<Request<Body>, UpstreamError> {
        parts.uri = self.uri_for(parts.uri.path_and_query())?;
        parts.version = Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        // The client's `Expect: 100-continue` was answered here, as its body
        // was read: the upstream gets the body at once, and is not asked.
        parts.headers.remove(http::header::EXPECT);
        match stamp {
            Some((key, generation)) => {
                parts.headers.insert(headers::IDEMPOTENCY_KEY, key);
                parts.headers.insert(headers::IDEMPOTENCY_GENERATION, generation);
            }
            None => {
                parts.headers.remove(headers::IDEMPOTENCY_KEY);
                parts.headers.remove(headers::IDEMPOTENCY_GENERATION);
            }
        }
        Ok(Request::from_parts(parts, body))
    }

    /// Sends the request and waits for the response head, bounded by `deadline`.
    pub async fn send(&self, req: Request<Body>, deadline: tokio::time::Instant) -> Result<Response<ResponseBody>, UpstreamError> {
        let started = tokio::time::Instant::now();
        let sending = async {
            match &self.http1 {
                Some(pool) if req.method() != Method::CONNECT => pool.send(req, &self.config.name).await,
                _ => self.legacy(req).await,
            }
        };
        let sent = tokio::time::timeout_at(deadline, sending).await;
        let failed = match sent {
            Ok(Ok(mut resp)) => {
                resp.extensions_mut().insert(UpstreamLatency(started.elapsed()));
                return Ok(resp);
            }
            Ok(Err(e)) => e,
            Err(_) => UpstreamError::Timeout { upstream: self.config.name.clone(), timeout: self.config.timeout },
        };
        self.count_error(&failed);
        Err(failed)
    }

    /// Through hyper-util's client: https upstreams, CONNECT.
    ///
    /// An https upstream is named by its own authority, not the client's
    /// `Host`: over HTTP/2 the authority is `:authority` (the URI's), and a
    /// `Host` beside it is malformed when it differs (RFC 9113, section
    /// 8.3.1) and refused by nginx 1.22 even when equal ("client sent
    /// duplicate host header", 400, recorded as the write's answer); over
    /// HTTP/1.1 hyper-util then writes `Host` from the URI, the name the
    /// TLS handshake (SNI) used. Which protocol a request gets is only known
    /// once hyper-util picked its connection, so both drop the client's.
    async fn legacy(&self, mut req: Request<Body>) -> Result<Response<ResponseBody>, UpstreamError> {
        if req.method() != Method::CONNECT && self.config.url.scheme() == Some(&http::uri::Scheme::HTTPS) {
            req.headers_mut().remove(http::header::HOST);
        }
        match self.client.request(req).await {
            Ok(mut resp) => {
                if let Some(addr) = resp.extensions().get::<hyper_util::client::legacy::connect::HttpInfo>().map(|i| i.remote_addr()) {
                    resp.extensions_mut().insert(UpstreamAddr(addr));
                }
                Ok(resp.map(ResponseBody::from))
            }
            Err(e) if e.is_connect() => {
                Err(UpstreamError::Connect { upstream: self.config.name.clone(), detail: error_chain(&e), kind: kind_of(&e) })
            }
            Err(e) if unprocessed(&e) => {
                Err(UpstreamError::NotSent { upstream: self.config.name.clone(), detail: error_chain(&e), kind: kind_of(&e) })
            }
            Err(e) => Err(UpstreamError::Broken { upstream: self.config.name.clone(), detail: error_chain(&e), kind: kind_of(&e) }),
        }
    }
}

/// A connector whose whole connection phase — name resolution and TLS included — is
/// bounded by `timeout`. (hyper-util's own connect timeout bounds only the TCP
/// connect: a resolver that hangs would run into the exchange's `timeout` and
/// be mistaken for "may have executed".) Its errors are connect errors to the
/// client (`is_connect()`), i.e. [`Executed::No`].
#[derive(Debug, Clone)]
pub struct BoundedConnect<C> {
    inner: C,
    timeout: Duration,
}

/// The connection phase did not finish in time: nothing was sent.
#[derive(Debug, thiserror::Error)]
#[error("no connection within the connect timeout of {0:?} (name resolution and TCP connect)")]
pub struct ConnectTimedOut(pub Duration);

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<C> tower_service::Service<Uri> for BoundedConnect<C>
where
    C: tower_service::Service<Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, dst: Uri) -> Self::Future {
        let (connecting, timeout) = (self.inner.call(dst), self.timeout);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(result) => result.map_err(Into::into),
                Err(_) => Err(Box::new(ConnectTimedOut(timeout)) as BoxError),
            }
        })
    }
}

/// "outer: inner: innermost", for logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(url: &str) -> Upstream {
        Upstream::new(UpstreamConfig {
            name: "u".into(),
            url: url.parse().unwrap(),
            tls: None,
            connect_timeout: Duration::from_millis(200),
            timeout: Duration::from_secs(1),
            pool_idle_timeout: Duration::from_secs(1),
            pool_max_idle: 1,
            limit: limit::LimitPolicy::Unlimited,
        })
    }

    #[tokio::test]
    async fn uri_joins_prefix_and_path() {
        let u = upstream("http://127.0.0.1:9000/api/");
        let pq: PathAndQuery = "/v1/orders?x=1".parse().unwrap();
        assert_eq!(u.uri_for(Some(&pq)).unwrap().to_string(), "http://127.0.0.1:9000/api/v1/orders?x=1");
        let bare = upstream("http://127.0.0.1:9000");
        assert_eq!(bare.uri_for(Some(&pq)).unwrap().to_string(), "http://127.0.0.1:9000/v1/orders?x=1");
    }

    /// Only an alert that refuses our certificate, a refusal from the HTTP/2
    /// peer or a request handed back proves "not processed".
    #[test]
    fn only_typed_refusals_prove_a_request_unprocessed() {
        use rustls::AlertDescription as A;
        let alert = |a| std::io::Error::other(rustls::Error::AlertReceived(a));
        for refused in [A::UnknownCA, A::CertificateRequired, A::BadCertificate, A::CertificateExpired] {
            assert!(unprocessed(&alert(refused)), "{refused:?}");
        }
        assert!(!unprocessed(&alert(A::DecryptError)));
        // As h2 hands it to a stream: the alert's text, on the same kind.
        let copied = |a| std::io::Error::new(std::io::ErrorKind::InvalidData, rustls::Error::AlertReceived(a).to_string());
        assert!(unprocessed(&copied(A::UnknownCA)));
        assert!(!unprocessed(&copied(A::DecryptError)));
        let other_kind = std::io::Error::other(rustls::Error::AlertReceived(A::UnknownCA).to_string());
        assert!(!unprocessed(&other_kind));
        assert!(!unprocessed(&alert(A::CloseNotify)));
        assert!(!unprocessed(&std::io::Error::from(std::io::ErrorKind::ConnectionReset)));
        // A reason h2 made up itself, not the upstream's RST_STREAM or GOAWAY.
        assert!(!unprocessed(&h2::Error::from(h2::Reason::REFUSED_STREAM)));
    }

    #[tokio::test]
    async fn refused_connection_is_never_executed() {
        // A bound but not listening socket: the port is ours, connections are refused.
        let reserved = tokio::net::TcpSocket::new_v4().unwrap();
        reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let u = upstream(&format!("http://{}", reserved.local_addr().unwrap()));
        let req = Request::post(u.uri_for(None).unwrap()).body(Body::empty()).unwrap();
        let err = u.send(req, tokio::time::Instant::now() + Duration::from_secs(2)).await.unwrap_err();
        assert_eq!(err.executed(), Executed::No, "{err}");
    }

    #[tokio::test]
    async fn timeout_after_send_may_have_executed() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // Accept and read, never answer.
        let hold = tokio::spawn(async move {
            let (sock, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(sock);
        });
        let u = upstream(&format!("http://{addr}"));
        let req = Request::post(u.uri_for(None).unwrap()).body(Body::full("x")).unwrap();
        let err = u.send(req, tokio::time::Instant::now() + Duration::from_millis(300)).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Timeout { .. }));
        assert_eq!(err.executed(), Executed::Maybe);
        hold.abort();
    }

    /// Reads one request head from `sock`; `None` when the connection
    /// closed first.
    async fn read_head(sock: &mut tokio::net::TcpStream) -> Option<String> {
        use tokio::io::AsyncReadExt;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = sock.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        }
        Some(String::from_utf8_lossy(&buf).into_owned())
    }

    const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";

    fn get(u: &Upstream) -> Request<Body> {
        let (parts, ()) = Request::get("/x").body(()).unwrap().into_parts();
        u.request(parts, Body::empty(), None).unwrap()
    }

    fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(5)
    }

    async fn body_of(resp: Response<ResponseBody>) -> Result<bytes::Bytes, hyper::Error> {
        http_body_util::BodyExt::collect(resp.into_body()).await.map(|c| c.to_bytes())
    }

    /// Sequential requests share one connection, sent in origin form with
    /// the upstream's Host; a response without a body (HEAD-like 204) gives
    /// its connection back too; the idle sweep closes it after
    /// pool_idle_timeout.
    #[tokio::test]
    async fn connections_are_reused_in_origin_form_then_swept() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut heads = Vec::new();
            for i in 0..3 {
                heads.push(read_head(&mut sock).await.unwrap());
                let answer: &[u8] = if i == 1 { b"HTTP/1.1 204 No Content\r\n\r\n" } else { OK };
                sock.write_all(answer).await.unwrap();
            }
            // Idle longer than pool_idle_timeout (1 s): the pool closes it.
            let mut rest = Vec::new();
            let closed = tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut rest)).await.is_ok();
            (heads, closed, listener)
        });
        let u = upstream(&format!("http://{addr}"));
        for i in 0..3 {
            let resp = u.send(get(&u), soon()).await.unwrap();
            let expected: &[u8] = if i == 1 { b"" } else { b"ok" };
            assert_eq!(&body_of(resp).await.unwrap()[..], expected);
        }
        let (heads, closed, _listener) = server.await.unwrap();
        assert!(heads.iter().all(|h| h.starts_with("GET /x HTTP/1.1\r\n")), "{heads:?}");
        assert!(heads[0].to_ascii_lowercase().contains(&format!("host: {addr}")), "{}", heads[0]);
        assert!(closed, "the idle connection was closed by the sweep");
    }

    /// The upstream closes an idle keep-alive connection: the next request
    /// goes out on a fresh connection, reaching the upstream once; the
    /// closed one never carried it.
    #[tokio::test]
    async fn a_pooled_connection_closed_while_idle_is_replaced() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.unwrap();
            read_head(&mut first).await.unwrap();
            first.write_all(OK).await.unwrap();
            // Closed while idle; whatever else arrives on it is counted.
            tokio::time::sleep(Duration::from_millis(50)).await;
            drop(first);
            let (mut second, _) = listener.accept().await.unwrap();
            let mut requests = 1;
            while read_head(&mut second).await.is_some() {
                requests += 1;
                second.write_all(OK).await.unwrap();
            }
            requests
        });
        let u = upstream(&format!("http://{addr}"));
        let resp = u.send(get(&u), soon()).await.unwrap();
        assert_eq!(&body_of(resp).await.unwrap()[..], b"ok");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let resp = u.send(get(&u), soon()).await.expect("sent on a fresh connection");
        assert_eq!(&body_of(resp).await.unwrap()[..], b"ok");
        drop(u);
        assert_eq!(server.await.unwrap(), 2, "each request reached the upstream exactly once");
    }

    /// The upstream dies in the middle of a response body: the body ends
    /// with an error (never a short body passed off as complete), and the
    /// connection is not reused.
    #[tokio::test]
    async fn upstream_closing_mid_response_is_an_error() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut connections = 0;
            while let Ok(Ok((mut sock, _))) = tokio::time::timeout(Duration::from_secs(2), listener.accept()).await {
                connections += 1;
                read_head(&mut sock).await.unwrap();
                if connections == 1 {
                    sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten..").await.unwrap();
                } else {
                    sock.write_all(OK).await.unwrap();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            connections
        });
        let u = upstream(&format!("http://{addr}"));
        let resp = u.send(get(&u), soon()).await.unwrap();
        assert!(body_of(resp).await.is_err(), "a truncated body is an error");
        let resp = u.send(get(&u), soon()).await.unwrap();
        assert_eq!(&body_of(resp).await.unwrap()[..], b"ok");
        assert_eq!(server.await.unwrap(), 2, "the broken connection was not reused");
    }

    /// A listener whose accept queue is full: the kernel drops further SYNs,
    /// so a connect hangs (as behind a dead load balancer or a blackholed
    /// route). Returns the listener and the connections that fill it.
    fn full_accept_queue() -> (tokio::net::TcpListener, Vec<std::net::TcpStream>) {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = socket.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut fillers = Vec::new();
        // Backlog 0 still queues one or two connections; fill until one hangs.
        while let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            fillers.push(s);
            assert!(fillers.len() < 16, "the accept queue never filled");
        }
        (listener, fillers)
    }

    #[tokio::test]
    async fn a_connect_that_hangs_is_never_executed() {
        let (listener, _fillers) = full_accept_queue();
        let u = upstream(&format!("http://{}", listener.local_addr().unwrap()));
        let req = Request::post(u.uri_for(None).unwrap()).body(Body::full("x")).unwrap();
        let started = tokio::time::Instant::now();
        let err = u.send(req, tokio::time::Instant::now() + Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(err, UpstreamError::Connect { .. }), "{err}");
        assert_eq!(err.executed(), Executed::No, "{err}");
        // Cut at the connect timeout (200 ms), not at the exchange's deadline.
        assert!(started.elapsed() < Duration::from_millis(900), "{:?}", started.elapsed());
    }

    /// A connection phase that never ends (a resolver that hangs is the usual
    /// cause; hyper-util's own connect timeout does not cover it) is cut at
    /// the connect timeout.
    #[tokio::test(start_paused = true)]
    async fn the_whole_connection_phase_is_bounded() {
        #[derive(Clone)]
        struct Hangs;
        impl tower_service::Service<Uri> for Hangs {
            type Response = tokio::net::TcpStream;
            type Error = std::io::Error;
            type Future = std::future::Pending<Result<tokio::net::TcpStream, std::io::Error>>;
            fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), std::io::Error>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _: Uri) -> Self::Future {
                std::future::pending()
            }
        }
        let mut c = BoundedConnect { inner: Hangs, timeout: Duration::from_millis(300) };
        let err = tower_service::Service::call(&mut c, "http://example.invalid/".parse().unwrap()).await.unwrap_err();
        assert!(err.downcast_ref::<ConnectTimedOut>().is_some(), "{err}");
    }
}
