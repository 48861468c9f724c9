//! The listeners' series, as operators chart them for nginx, Envoy or
//! Traefik: requests by operation, protocol and status class, request
//! duration by operation, open connections beside their limit, and upstream
//! errors by kind.
//!
//! `operation` is the label that names a route everywhere (records, async
//! attempts, requests): the route's operation, or, for requests that are on
//! none, `passthrough`, `operation_status` (async polls) or `not_found`; on
//! the admin listener the endpoint (`healthz`, `readyz`, `metrics`,
//! `admin_api`, `not_found`). A listener that cannot speak HTTP/2 (plain, or
//! the admin listener) has no `protocol="h2"` series.
//!
//! The proxy's series are resolved once per route ([`Metrics::route_series`])
//! so a request touches a histogram and a counter, never the families' maps.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{HistogramFamily, Metrics, latency_histogram};

/// The status classes of `code_class`.
const CODE_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    listener: &'static str,
    operation: String,
    protocol: &'static str,
    code_class: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DurationLabels {
    listener: &'static str,
    operation: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamErrorLabels {
    upstream: String,
    kind: &'static str,
}

/// Why an exchange with an upstream failed, as counted in
/// `idemgate_upstream_errors_total{kind}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// The connection was refused (nothing listens, or a firewall rejects).
    Refused,
    /// No connection within `connect_timeout`, or no answer within `timeout`.
    Timeout,
    /// The TLS handshake failed (certificate, protocol).
    Tls,
    /// The connection was reset or closed before the answer was complete.
    Reset,
    /// Anything else (name resolution, a malformed answer, ...).
    Other,
}

impl UpstreamErrorKind {
    pub const ALL: [UpstreamErrorKind; 5] = [
        UpstreamErrorKind::Refused,
        UpstreamErrorKind::Timeout,
        UpstreamErrorKind::Tls,
        UpstreamErrorKind::Reset,
        UpstreamErrorKind::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            UpstreamErrorKind::Refused => "refused",
            UpstreamErrorKind::Timeout => "timeout",
            UpstreamErrorKind::Tls => "tls",
            UpstreamErrorKind::Reset => "reset",
            UpstreamErrorKind::Other => "other",
        }
    }
}

#[derive(Debug)]
pub(super) struct HttpMetrics {
    requests: Family<RequestLabels, Counter>,
    duration: HistogramFamily<DurationLabels>,
    open: Family<ListenerLabels, Gauge>,
    max: Family<ListenerLabels, Gauge>,
    upstream_errors: Family<UpstreamErrorLabels, Counter>,
}

impl HttpMetrics {
    pub(super) fn register(registry: &mut Registry) -> HttpMetrics {
        let m = HttpMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            open: Family::default(),
            max: Family::default(),
            upstream_errors: Family::default(),
        };
        registry.register(
            "http_requests",
            "Requests answered, by listener, operation (the route's, or passthrough, operation_status, not_found; admin: the endpoint), protocol (h1, h2) and status class; a client gone before its answer counts as 4xx",
            m.requests.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's head to its response's head, by listener and operation",
            m.duration.clone(),
        );
        registry.register("open_connections", "Connections a listener is serving", m.open.clone());
        registry.register(
            "max_connections",
            "The most connections a listener serves at once (server.max_connections for the proxy)",
            m.max.clone(),
        );
        registry.register(
            "upstream_errors",
            "Exchanges with an upstream that failed, by upstream and kind (refused, timeout, tls, reset, other), on every route",
            m.upstream_errors.clone(),
        );
        m
    }
}

/// One listener's and route's series: a request is counted and timed here.
#[derive(Debug, Clone)]
pub struct RouteSeries {
    duration: Histogram,
    h1: [Counter; 5],
    /// `None` on a listener that cannot speak HTTP/2.
    h2: Option<[Counter; 5]>,
}

impl RouteSeries {
    /// A request with `version` answered `status` after `elapsed`.
    pub fn record(&self, version: http::Version, status: u16, elapsed: Duration) {
        self.duration.observe(elapsed.as_secs_f64());
        let counters = match (&self.h2, version) {
            (Some(h2), http::Version::HTTP_2) => h2,
            _ => &self.h1,
        };
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        counters[class].inc();
    }
}

impl Metrics {
    /// The series of `operation` on `listener`, created at zero; `h2`: the
    /// listener can speak HTTP/2.
    pub fn route_series(&self, listener: &'static str, operation: &str, h2: bool) -> RouteSeries {
        let counters = |protocol: &'static str| {
            CODE_CLASSES.map(|code_class| {
                self.http.requests.get_or_create(&RequestLabels { listener, operation: operation.to_owned(), protocol, code_class }).clone()
            })
        };
        RouteSeries {
            duration: self.http.duration.get_or_create(&DurationLabels { listener, operation: operation.to_owned() }).clone(),
            h1: counters("h1"),
            h2: h2.then(|| counters("h2")),
        }
    }

    /// The open-connections gauge of `listener`, with `max` beside it.
    pub fn connections(&self, listener: &'static str, max: usize) -> Gauge {
        self.http.max.get_or_create(&ListenerLabels { listener }).set(i64::try_from(max).unwrap_or(i64::MAX));
        self.http.open.get_or_create(&ListenerLabels { listener }).clone()
    }

    /// Creates an upstream's error series at zero.
    pub(super) fn declare_upstream_errors(&self, upstream: &str) {
        for kind in UpstreamErrorKind::ALL {
            let _ = self.http.upstream_errors.get_or_create(&UpstreamErrorLabels { upstream: upstream.to_owned(), kind: kind.as_str() });
        }
    }

    /// An exchange with `upstream` failed.
    pub fn upstream_error(&self, upstream: &str, kind: UpstreamErrorKind) {
        self.http.upstream_errors.get_or_create(&UpstreamErrorLabels { upstream: upstream.to_owned(), kind: kind.as_str() }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_series_count_by_protocol_and_class() {
        let m = Metrics::new();
        let plain = m.route_series("admin", "readyz", false);
        plain.record(http::Version::HTTP_11, 503, Duration::from_millis(3));
        let tls = m.route_series("proxy", "create_order", true);
        tls.record(http::Version::HTTP_2, 201, Duration::from_millis(5));
        tls.record(http::Version::HTTP_11, 499, Duration::from_millis(5));
        let open = m.connections("proxy", 64);
        open.inc();
        m.declare_upstream_errors("orders");
        m.upstream_error("orders", UpstreamErrorKind::Refused);
        let text = m.encode();
        for line in [
            r#"idemgate_http_requests_total{listener="admin",operation="readyz",protocol="h1",code_class="5xx"} 1"#,
            r#"idemgate_http_requests_total{listener="admin",operation="readyz",protocol="h1",code_class="2xx"} 0"#,
            r#"idemgate_http_requests_total{listener="proxy",operation="create_order",protocol="h2",code_class="2xx"} 1"#,
            r#"idemgate_http_requests_total{listener="proxy",operation="create_order",protocol="h1",code_class="4xx"} 1"#,
            r#"idemgate_http_request_duration_seconds_count{listener="proxy",operation="create_order"} 2"#,
            r#"idemgate_open_connections{listener="proxy"} 1"#,
            r#"idemgate_max_connections{listener="proxy"} 64"#,
            r#"idemgate_upstream_errors_total{upstream="orders",kind="refused"} 1"#,
            r#"idemgate_upstream_errors_total{upstream="orders",kind="tls"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(!text.contains(r#"listener="admin",operation="readyz",protocol="h2""#), "no h2 series on a listener without HTTP/2");
    }
}
