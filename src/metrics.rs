//! Prometheus metrics, served in text format on the admin listener.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// How a request on an idempotent route ended, as counted in
/// `idemgate_requests_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// First request: claimed, forwarded, recorded.
    Forwarded,
    /// Answered from a completed record.
    Replayed,
    /// Same key, different request.
    Mismatch,
    /// Same key while the first is in flight.
    InFlight,
    /// The outcome is unknown (timeout after send, lease expired, or the record is `unknown`).
    Unknown,
    /// The key was freed (`release_on_status`, `no-store`, upstream unreachable).
    Released,
    /// The result write was fenced off by a newer attempt.
    Fenced,
    /// Refused before any claim (identity, key, body).
    Rejected,
    /// The store could not be reached; nothing was forwarded.
    StoreUnavailable,
    /// No idempotency applied (other method, key not required and absent, default upstream).
    PassThrough,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Forwarded => "forwarded",
            Outcome::Replayed => "replayed",
            Outcome::Mismatch => "mismatch",
            Outcome::InFlight => "in_flight",
            Outcome::Unknown => "unknown",
            Outcome::Released => "released",
            Outcome::Fenced => "fenced",
            Outcome::Rejected => "rejected",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::PassThrough => "passthrough",
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 100 us .. ~26 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

/// All of idemgate's metrics; one instance per process, shared by reference.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    store_latency: HistogramFamily<OpLabels>,
    store_errors: Family<OpLabels, Counter>,
    upstream_latency: HistogramFamily<UpstreamLabels>,
    fenced: Family<OpLabels, Counter>,
    swept: Counter,
    reaped: Counter,
    in_flight: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("idemgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "Requests on idempotent routes by route and outcome", requests.clone());
        let store_latency: HistogramFamily<OpLabels> = Family::new_with_constructor(latency_histogram);
        registry.register("store_duration_seconds", "Store operation latency", store_latency.clone());
        let store_errors = Family::<OpLabels, Counter>::default();
        registry.register("store_errors", "Failed store operations", store_errors.clone());
        let upstream_latency: HistogramFamily<UpstreamLabels> = Family::new_with_constructor(latency_histogram);
        registry.register("upstream_duration_seconds", "Upstream exchange latency (request to full response)", upstream_latency.clone());
        let fenced = Family::<OpLabels, Counter>::default();
        registry.register("fenced_writes", "Result writes fenced off because a newer attempt holds the record", fenced.clone());
        let swept = Counter::default();
        registry.register("swept_records", "Completed records deleted after retention", swept.clone());
        let reaped = Counter::default();
        registry.register("expired_leases", "In-flight records whose lease expired and became unknown", reaped.clone());
        let in_flight = Gauge::default();
        registry.register("forwards_in_flight", "Forwards currently running on this replica", in_flight.clone());
        Metrics { registry, requests, store_latency, store_errors, upstream_latency, fenced, swept, reaped, in_flight }
    }

    pub fn request(&self, route: &str, outcome: Outcome) {
        self.requests.get_or_create(&RequestLabels { route: route.to_owned(), outcome: outcome.as_str() }).inc();
    }

    pub fn observe_store(&self, op: &'static str, elapsed: Duration, ok: bool) {
        self.store_latency.get_or_create(&OpLabels { op }).observe(elapsed.as_secs_f64());
        if !ok {
            self.store_errors.get_or_create(&OpLabels { op }).inc();
        }
    }

    pub fn observe_upstream(&self, upstream: &str, elapsed: Duration) {
        self.upstream_latency.get_or_create(&UpstreamLabels { upstream: upstream.to_owned() }).observe(elapsed.as_secs_f64());
    }

    pub fn fenced_write(&self, op: &'static str) {
        self.fenced.get_or_create(&OpLabels { op }).inc();
    }

    pub fn swept(&self, n: u64) {
        self.swept.inc_by(n);
    }

    pub fn reaped(&self, n: u64) {
        self.reaped.inc_by(n);
    }

    pub fn forward_started(&self) {
        self.in_flight.inc();
    }

    pub fn forward_finished(&self) {
        self.in_flight.dec();
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_contains_counters_and_histograms() {
        let m = Metrics::new();
        m.request("create_order", Outcome::Replayed);
        m.request("create_order", Outcome::Replayed);
        m.observe_store("claim", Duration::from_millis(2), true);
        m.observe_upstream("orders", Duration::from_millis(20));
        m.fenced_write("complete");
        let text = m.encode();
        assert!(text.contains(r#"idemgate_requests_total{route="create_order",outcome="replayed"} 2"#), "{text}");
        assert!(text.contains(r#"idemgate_store_duration_seconds_count{op="claim"} 1"#), "{text}");
        assert!(text.contains(r#"idemgate_upstream_duration_seconds_count{upstream="orders"} 1"#), "{text}");
        assert!(text.contains(r#"idemgate_fenced_writes_total{op="complete"} 1"#), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }
}
