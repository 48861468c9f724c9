//! Request tracing: a request id for every request, and one access-log line
//! per answer.
//!
//! The id is taken from `X-Request-Id` when the peer is one of
//! `server.trusted_proxies` (an edge proxy that already assigned one), else
//! generated. It goes to the upstream as `X-Request-Id` (unless the client
//! sent one: that reaches the upstream unchanged), back to the client on
//! every answer, and into problem bodies as
//! `instance = "urn:idemgate:request:<id>"`. `traceparent` (W3C Trace
//! Context) is forwarded unchanged like any other end-to-end header.
//!
//! The access log is one line per request with target `idemgate::proxy::access`:
//! it follows `IDEMGATE_LOG_FORMAT` (JSON or text) and can be filtered
//! (`IDEMGATE_LOG=info,idemgate::proxy::access=off`) like any other line. The
//! `idemgate` binary formats it by hand and writes it in batches
//! ([`line`](mod@line), [`crate::telemetry::logging::batched`]); elsewhere (a library user's
//! subscriber, a terminal with colour) it is a `tracing` event. It never
//! carries keys, tokens, bodies or query strings: the scope appears as its
//! id ([`crate::idempotency::key::ScopeId`]), the path without its query.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, Uri, Version};
use hyper::body::{Frame, SizeHint};
use ipnet::IpNet;

use crate::idempotency::key::ScopeId;
use crate::idempotency::outcome::RequestOutcome;
use crate::telemetry::logging;
use crate::telemetry::metrics::{Metrics, RouteSeries};
use crate::upstream::body::{Body, BoxError};
use crate::upstream::{UpstreamAddr, UpstreamLatency};

pub mod line;

/// The request id header, in and out.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest request id kept from a trusted proxy.
const MAX_ID_LEN: usize = 128;

/// Assigns request ids: a trusted proxy's, or a fresh one.
#[derive(Debug)]
pub struct RequestIds {
    trusted: Vec<IpNet>,
    /// 48 random bits per process, so ids of replicas and restarts differ.
    prefix: u64,
    /// Then a counter: unique within the process, and no syscall per request.
    next: AtomicU64,
}

impl RequestIds {
    pub fn new(trusted: Vec<IpNet>) -> RequestIds {
        let random = uuid::Uuid::new_v4().as_u64_pair().0;
        RequestIds { trusted, prefix: random & 0xffff_ffff_ffff, next: AtomicU64::new(1) }
    }

    /// Whether `peer` is one of `server.trusted_proxies`.
    pub fn trusts(&self, peer: IpAddr) -> bool {
        !self.trusted.is_empty() && self.trusted.iter().any(|n| n.contains(&canonical(peer)))
    }

    /// The id for a request from `peer` with `headers`.
    pub fn assign(&self, headers: &HeaderMap, peer: IpAddr) -> HeaderValue {
        if self.trusts(peer) {
            let mut values = headers.get_all(&REQUEST_ID).iter();
            if let (Some(v), None) = (values.next(), values.next())
                && valid_id(v.as_bytes())
            {
                return v.clone();
            }
        }
        self.generate()
    }

    /// 24 hex digits: the process's prefix, then its counter.
    pub fn generate(&self) -> HeaderValue {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        // Written by hand: `format!` costs over a thousand instructions on
        // every request.
        let digits = (u128::from(self.prefix) << 48) | u128::from(n & 0xffff_ffff_ffff);
        let mut id = [0u8; 24];
        for (i, b) in id.iter_mut().enumerate() {
            *b = b"0123456789abcdef"[((digits >> (4 * (23 - i))) & 0xf) as usize];
        }
        // Hex digits are always a valid header value.
        HeaderValue::from_bytes(&id).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }
}

/// An IPv4-mapped IPv6 peer (`::ffff:10.0.0.1`) is matched as IPv4.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// 1-128 characters that may appear in a URN without escaping (RFC 8141:
/// unreserved, sub-delims, `:` and `@`): UUIDs, ULIDs, hex and most
/// proxies' ids qualify; anything else is replaced by a generated id.
fn valid_id(v: &[u8]) -> bool {
    (1..=MAX_ID_LEN).contains(&v.len()) && v.iter().all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=:@".contains(b))
}

/// The URI a problem body names its occurrence with.
pub fn problem_instance(id: &HeaderValue) -> Option<String> {
    id.to_str().ok().map(|id| format!("urn:idemgate:request:{id}"))
}

/// What a request was, as the access log names it.
#[derive(Debug, Clone, Default)]
pub enum RouteLabel {
    /// An idempotent route: its operation.
    Operation(Arc<str>),
    /// Proxied without idempotency (another method on a route's path, or the
    /// default upstream).
    PassThrough,
    /// `/_idemgate/operations/...`: an async operation's status or result.
    OperationStatus,
    /// No route and no default upstream.
    #[default]
    NotFound,
}

impl RouteLabel {
    pub fn as_str(&self) -> &str {
        match self {
            RouteLabel::Operation(op) => op,
            RouteLabel::PassThrough => "passthrough",
            RouteLabel::OperationStatus => "operation_status",
            RouteLabel::NotFound => "not_found",
        }
    }
}

/// What the inner request path learned, for the access log and the counters.
#[derive(Debug, Default)]
pub struct Trace {
    pub route: RouteLabel,
    pub outcome: Option<RequestOutcome>,
    /// The scope, once identity and key were established.
    pub scope: Option<ScopeId>,
    /// The problem type, when the answer is a problem.
    pub problem: Option<&'static str>,
    /// The request body's size, when it was read whole.
    pub bytes_in: Option<u64>,
    /// ... or the bytes of a streamed request body so far.
    pub bytes_streamed_in: Option<Arc<AtomicU64>>,
}

impl Trace {
    /// A counter for a request body about to be streamed (the access log
    /// reads it when it writes the line).
    pub fn count_bytes_in(&mut self) -> Arc<AtomicU64> {
        self.bytes_streamed_in.get_or_insert_with(Arc::default).clone()
    }

    fn bytes_in(&self) -> Option<u64> {
        self.bytes_streamed_in.as_ref().map(|c| c.load(Ordering::Relaxed)).or(self.bytes_in)
    }
}

/// Status logged for a request whose client went away before its answer was
/// ready (nginx's convention). An idempotent request's work goes on and is
/// recorded regardless.
pub const CLIENT_CLOSED: u16 = 499;

/// The proxy's request series by route (see `metrics::http`), resolved
/// once per configuration.
#[derive(Debug)]
pub struct RequestSeries {
    operations: HashMap<Arc<str>, RouteSeries>,
    passthrough: RouteSeries,
    operation_status: RouteSeries,
    not_found: RouteSeries,
}

impl RequestSeries {
    /// `h2`: the proxy listener speaks HTTP/2 (TLS).
    pub fn new<'a>(metrics: &Metrics, operations: impl IntoIterator<Item = &'a Arc<str>>, h2: bool) -> RequestSeries {
        let series = |label: &str| metrics.route_series("proxy", label, h2);
        RequestSeries {
            operations: operations.into_iter().map(|op| (op.clone(), series(op))).collect(),
            passthrough: series(RouteLabel::PassThrough.as_str()),
            operation_status: series(RouteLabel::OperationStatus.as_str()),
            not_found: series(RouteLabel::NotFound.as_str()),
        }
    }

    fn of(&self, route: &RouteLabel) -> &RouteSeries {
        match route {
            RouteLabel::Operation(op) => self.operations.get(op).unwrap_or(&self.passthrough),
            RouteLabel::PassThrough => &self.passthrough,
            RouteLabel::OperationStatus => &self.operation_status,
            RouteLabel::NotFound => &self.not_found,
        }
    }
}

/// A request on its way: counted and timed when its answer's head is ready
/// ([`Pending::finish`]), or, if the request's future is dropped first (the
/// client closed the connection), with status 499 when it is dropped. Its
/// access-log line is written once the answer's body has been sent (a body
/// of known size: at once), or with the 499. Each exactly once.
pub struct Pending {
    /// `server.access_log`.
    enabled: bool,
    started: Instant,
    series: Option<Arc<RequestSeries>>,
    line: Line,
    done: bool,
}

/// The access-log line's fields, owned until the line is written.
struct Line {
    method: Method,
    uri: Uri,
    peer: IpAddr,
    version: Version,
    request_id: HeaderValue,
    /// The client's own `X-Request-Id` when it was not kept (the peer is not
    /// a trusted proxy), at most [`MAX_ID_LEN`] characters.
    client_request_id: Option<String>,
    trace_id: Option<TraceId>,
    status: u16,
    latency: Duration,
    upstream_latency: Option<Duration>,
    upstream_addr: Option<SocketAddr>,
    trace: Trace,
}

impl Line {
    fn write(&self, bytes_out: Option<u64>) {
        log(&AccessLine {
            method: &self.method,
            path: self.uri.path(),
            peer: self.peer,
            status: self.status,
            latency: self.latency,
            upstream_latency: self.upstream_latency,
            request_id: &self.request_id,
            trace: &self.trace,
            client_request_id: self.client_request_id.as_deref(),
            http_version: version_str(self.version),
            bytes_in: self.trace.bytes_in(),
            bytes_out,
            upstream_addr: self.upstream_addr,
            trace_id: self.trace_id.as_ref().map(TraceId::as_str),
        });
    }
}

impl Pending {
    /// `request_id`: the id this request goes by (see [`RequestIds::assign`]).
    pub fn new<B>(
        enabled: bool,
        req: &http::Request<B>,
        peer: IpAddr,
        request_id: HeaderValue,
        series: Option<Arc<RequestSeries>>,
    ) -> Pending {
        let client_request_id = match req.headers().get(&REQUEST_ID) {
            Some(sent) if *sent != request_id => Some(String::from_utf8_lossy(sent.as_bytes()).chars().take(MAX_ID_LEN).collect()),
            _ => None,
        };
        // Method and URI are cheap to keep (shared bytes).
        Pending {
            enabled,
            started: Instant::now(),
            series,
            line: Line {
                method: req.method().clone(),
                uri: req.uri().clone(),
                peer,
                version: req.version(),
                request_id,
                client_request_id,
                trace_id: TraceId::of(req.headers()),
                status: CLIENT_CLOSED,
                latency: Duration::ZERO,
                upstream_latency: None,
                upstream_addr: None,
                trace: Trace::default(),
            },
            done: false,
        }
    }

    pub fn request_id(&self) -> &HeaderValue {
        &self.line.request_id
    }

    /// What the inner path learns; the counters read it too.
    pub fn trace(&mut self) -> &mut Trace {
        &mut self.line.trace
    }

    /// The answer's head is ready: counts and times the request, and logs it
    /// now (a body of known size) or once its body has been sent. The
    /// upstream's latency and address are taken from `resp`'s extensions.
    pub fn finish(mut self, mut resp: Response<Body>) -> Response<Body> {
        self.done = true;
        let ext = resp.extensions_mut();
        self.line.upstream_latency = ext.remove::<UpstreamLatency>().map(|l| l.0);
        self.line.upstream_addr = ext.remove::<UpstreamAddr>().map(|a| a.0);
        self.answered(resp.status().as_u16());
        if !self.logs() {
            return resp;
        }
        let line = std::mem::replace(&mut self.line, Line::empty());
        if let Body::Full(b) = resp.body() {
            line.write(Some(b.as_ref().map_or(0, |b| b.len() as u64)));
            return resp;
        }
        resp.map(|inner| Body::boxed(Logged { inner, line: Some(line), sent: 0 }))
    }

    fn answered(&mut self, status: u16) {
        self.line.status = status;
        self.line.latency = self.started.elapsed();
        if let Some(s) = &self.series {
            s.of(&self.line.trace.route).record(self.line.version, status, self.line.latency);
        }
    }

    fn logs(&self) -> bool {
        self.enabled && tracing::enabled!(target: line::TARGET, tracing::Level::INFO)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            self.answered(CLIENT_CLOSED);
            if self.logs() {
                self.line.write(None);
            }
        }
    }
}

impl Line {
    /// What is left in a [`Pending`] whose line was handed to its body.
    fn empty() -> Line {
        Line {
            method: Method::GET,
            uri: Uri::default(),
            peer: IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
            version: Version::HTTP_11,
            request_id: HeaderValue::from_static(""),
            client_request_id: None,
            trace_id: None,
            status: 0,
            latency: Duration::ZERO,
            upstream_latency: None,
            upstream_addr: None,
            trace: Trace::default(),
        }
    }
}

/// A streamed answer's body: counts what is sent, and writes the access-log
/// line when it ends (or is dropped: the client went away mid-body).
struct Logged {
    inner: Body,
    line: Option<Line>,
    sent: u64,
}

impl Logged {
    fn done(&mut self) {
        if let Some(line) = self.line.take() {
            line.write(Some(self.sent));
        }
    }
}

impl hyper::body::Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.sent += data.len() as u64;
                }
                if hyper::body::Body::is_end_stream(&this.inner) {
                    this.done();
                }
            }
            Poll::Ready(None | Some(Err(_))) => this.done(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.done();
    }
}

/// The trace id of a valid W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`,
/// an id not all zeros), lower-case hex.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceId([u8; 32]);

impl TraceId {
    pub fn of(headers: &HeaderMap) -> Option<TraceId> {
        let v = headers.get(TRACEPARENT)?.as_bytes();
        let mut parts = v.split(|b| *b == b'-');
        let (version, id, parent, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &[u8], n: usize| s.len() == n && s.iter().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b));
        let valid = hex(version, 2) && version != b"ff" && hex(id, 32) && hex(parent, 16) && hex(flags, 2);
        // Version 00 has exactly four fields; later versions may add some.
        if !valid || (version == b"00" && parts.next().is_some()) || id.iter().all(|b| *b == b'0') {
            return None;
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(id);
        Some(TraceId(out))
    }

    pub fn as_str(&self) -> &str {
        // Checked to be ASCII hex digits.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

/// The W3C Trace Context header.
const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");

/// The request's HTTP version as the access log writes it (nginx's
/// `$server_protocol`).
fn version_str(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/1.1",
    }
}

/// One finished request, as logged.
pub struct AccessLine<'a> {
    pub method: &'a Method,
    /// Without the query string (it may carry secrets).
    pub path: &'a str,
    pub peer: IpAddr,
    pub status: u16,
    /// Until the response head was ready (a streamed body may go on).
    pub latency: Duration,
    /// Until the upstream's response head, when there was an upstream exchange.
    pub upstream_latency: Option<Duration>,
    pub request_id: &'a HeaderValue,
    pub trace: &'a Trace,
    /// The client's `X-Request-Id`, when it was not the one used.
    pub client_request_id: Option<&'a str>,
    pub http_version: &'static str,
    /// Request body bytes received, when known.
    pub bytes_in: Option<u64>,
    /// Response body bytes sent (`None`: the client went away before the answer).
    pub bytes_out: Option<u64>,
    /// The upstream connection's address, when there was an upstream exchange.
    pub upstream_addr: Option<SocketAddr>,
    /// From the request's `traceparent`.
    pub trace_id: Option<&'a str>,
}

fn millis(d: Duration) -> f64 {
    // Microsecond resolution is plenty for a log line.
    (d.as_micros() as f64) / 1000.0
}

/// Writes the access-log line, if the filter lets it through.
pub fn log(line: &AccessLine<'_>) {
    if !tracing::enabled!(target: line::TARGET, tracing::Level::INFO) {
        return;
    }
    match logging::line_format() {
        Some(format) => logging::batched(|buf| line::write(buf, format, line)),
        None => log_event(line),
    }
}

/// The access line as a `tracing` event.
fn log_event(line: &AccessLine<'_>) {
    let t = line.trace;
    tracing::info!(
        target: "idemgate::access",
        method = %line.method,
        path = line.path,
        route = t.route.as_str(),
        outcome = t.outcome.map(RequestOutcome::as_str),
        status = line.status,
        latency_ms = millis(line.latency),
        upstream_ms = line.upstream_latency.map(millis),
        scope = t.scope.map(tracing::field::display),
        problem = t.problem,
        request_id = %line.request_id.to_str().unwrap_or_default(),
        client = %line.peer,
        client_request_id = line.client_request_id,
        http_version = %line.http_version,
        bytes_in = line.bytes_in,
        bytes_out = line.bytes_out,
        upstream_addr = line.upstream_addr.map(tracing::field::display),
        trace_id = line.trace_id.map(tracing::field::display),
        "request"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(id: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(REQUEST_ID, HeaderValue::from_static(id));
        h
    }

    #[test]
    fn generated_ids_are_unique_hex() {
        let ids = RequestIds::new(Vec::new());
        let a = ids.generate();
        let b = ids.generate();
        assert_ne!(a, b);
        assert_eq!(a.len(), 24);
        assert!(a.as_bytes().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(RequestIds::new(Vec::new()).generate(), RequestIds::new(Vec::new()).generate(), "per-process prefixes differ");
        // The process's prefix, then its counter, 12 hex digits each.
        let ids = RequestIds { trusted: Vec::new(), prefix: 0xabc_def0_1234, next: AtomicU64::new(0x1_0000_0000_002a) };
        assert_eq!(ids.generate(), "0abcdef0123400000000002a", "the counter keeps its low 48 bits");
        assert_eq!(ids.generate(), format!("{:012x}{:012x}", 0xabc_def0_1234u64, 0x2bu64));
    }

    #[test]
    fn client_ids_are_kept_only_from_trusted_proxies() {
        let none = RequestIds::new(Vec::new());
        assert_ne!(none.assign(&headers("abc-123"), "127.0.0.1".parse().unwrap()), "abc-123", "no trusted proxies: always generated");
        let ids = RequestIds::new(vec!["10.0.0.0/8".parse().unwrap()]);
        assert_eq!(ids.assign(&headers("abc-123"), "10.1.2.3".parse().unwrap()), "abc-123");
        assert_eq!(ids.assign(&headers("abc-123"), "::ffff:10.1.2.3".parse().unwrap()), "abc-123");
        assert_ne!(ids.assign(&headers("abc-123"), "192.0.2.1".parse().unwrap()), "abc-123");
        // Unusable values are replaced.
        assert_ne!(ids.assign(&headers("has space"), "10.1.2.3".parse().unwrap()), "has space");
        assert_ne!(ids.assign(&headers("quote\"d"), "10.1.2.3".parse().unwrap()), "quote\"d");
        let mut two = headers("a");
        two.append(REQUEST_ID, HeaderValue::from_static("b"));
        let id = ids.assign(&two, "10.1.2.3".parse().unwrap());
        assert!(id != "a" && id != "b", "a repeated header is ambiguous");
    }

    #[test]
    fn trace_ids_come_from_valid_traceparents_only() {
        let of = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(TRACEPARENT, HeaderValue::from_static(v));
            TraceId::of(&h).map(|t| t.as_str().to_owned())
        };
        assert_eq!(of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
        // A later version may add fields.
        assert!(of("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra").is_some());
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "garbage",
        ] {
            assert_eq!(of(bad), None, "{bad}");
        }
        assert_eq!(TraceId::of(&HeaderMap::new()), None);
    }

    #[test]
    fn problem_instance_is_a_urn() {
        assert_eq!(problem_instance(&HeaderValue::from_static("abc")).unwrap(), "urn:idemgate:request:abc");
    }
}
