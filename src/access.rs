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
//! The access log is one line per request with target `idemgate::access`:
//! it follows `IDEMGATE_LOG_FORMAT` (JSON or text) and can be filtered
//! (`IDEMGATE_LOG=info,idemgate::access=off`) like any other line. The
//! `idemgate` binary formats it by hand and writes it in batches
//! ([`line`], [`crate::logging::batched`]); elsewhere (a library user's
//! subscriber, a terminal with colour) it is a `tracing` event. It never
//! carries keys, tokens, bodies or query strings: the scope appears as its
//! id ([`crate::scope::ScopeId`]), the path without its query.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use ipnet::IpNet;

use crate::logging;
use crate::metrics::Outcome;
use crate::scope::ScopeId;

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

    /// The id for a request from `peer` with `headers`.
    pub fn assign(&self, headers: &HeaderMap, peer: IpAddr) -> HeaderValue {
        if !self.trusted.is_empty() && self.trusted.iter().any(|n| n.contains(&canonical(peer))) {
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
fn canonical(ip: IpAddr) -> IpAddr {
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
    pub outcome: Option<Outcome>,
    /// The scope, once identity and key were established.
    pub scope: Option<ScopeId>,
    /// The problem type, when the answer is a problem.
    pub problem: Option<&'static str>,
}

/// Status logged for a request whose client went away before its answer was
/// ready (nginx's convention). An idempotent request's work goes on and is
/// recorded regardless.
pub const CLIENT_CLOSED: u16 = 499;

/// A request on its way: its access-log line is written by [`Pending::finish`]
/// with the answer, or, if the request's future is dropped first (the client
/// closed the connection), with status 499 when it is dropped. Either way
/// exactly once.
pub struct Pending {
    /// `server.access_log`.
    enabled: bool,
    method: Method,
    uri: Uri,
    peer: IpAddr,
    started: Instant,
    request_id: HeaderValue,
    /// What the inner path learns; the counters read it too.
    pub trace: Trace,
    done: bool,
}

impl Pending {
    pub fn new(enabled: bool, method: &Method, uri: &Uri, peer: IpAddr, request_id: HeaderValue) -> Pending {
        // Method and URI are cheap to keep (shared bytes).
        Pending {
            enabled,
            method: method.clone(),
            uri: uri.clone(),
            peer,
            started: Instant::now(),
            request_id,
            trace: Trace::default(),
            done: false,
        }
    }

    pub fn request_id(&self) -> &HeaderValue {
        &self.request_id
    }

    /// Logs the answer.
    pub fn finish(mut self, status: u16, upstream_latency: Option<Duration>) {
        self.done = true;
        self.write(status, upstream_latency);
    }

    fn write(&self, status: u16, upstream_latency: Option<Duration>) {
        if !self.enabled {
            return;
        }
        log(&AccessLine {
            method: &self.method,
            path: self.uri.path(),
            peer: self.peer,
            status,
            latency: self.started.elapsed(),
            upstream_latency,
            request_id: &self.request_id,
            trace: &self.trace,
        });
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.done {
            self.write(CLIENT_CLOSED, None);
        }
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
        outcome = t.outcome.map(Outcome::as_str),
        status = line.status,
        latency_ms = millis(line.latency),
        upstream_ms = line.upstream_latency.map(millis),
        scope = t.scope.map(tracing::field::display),
        problem = t.problem,
        request_id = line.request_id.to_str().unwrap_or_default(),
        client = %line.peer,
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
    fn problem_instance_is_a_urn() {
        assert_eq!(problem_instance(&HeaderValue::from_static("abc")).unwrap(), "urn:idemgate:request:abc");
    }
}
