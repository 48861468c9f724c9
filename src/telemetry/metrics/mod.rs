//! Prometheus metrics, served in text format on the admin listener.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::idempotency::outcome::{AttemptOutcome, ProbeOutcome, RefusalReason, RequestOutcome, Would};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    operation: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    op: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    operation: String,
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    operation: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WouldLabels {
    operation: String,
    would: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefuseLabels {
    operation: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamReasonLabels {
    upstream: String,
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: &'static str,
}

/// Why a pass-through request failed (its problem type).
const PASSTHROUGH_FAILURES: [&str; 2] = ["bad-gateway", "gateway-timeout"];

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 100 us .. ~26 s
    Histogram::new(exponential_buckets(0.0001, 2.0, 19))
}

/// The problem types of requests refused before any claim (the errors whose
/// outcome is `rejected`): the `reason` label of `idemgate_rejections_total`,
/// every one present from the start.
pub const REJECTION_REASONS: [&str; 13] = [
    "invalid-request",
    "unauthenticated",
    "forbidden",
    "authorizer-unavailable",
    "missing-idempotency-key",
    "invalid-idempotency-key",
    "request-too-large",
    "request-timeout",
    "invalid-body",
    "unsupported-content-encoding",
    "unsupported-transfer-coding",
    "not-found",
    "operation-not-completed",
];

/// All of idemgate's metrics; one instance per process, shared by reference.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    store_latency: HistogramFamily<OpLabels>,
    store_errors: Family<OpLabels, Counter>,
    upstream_latency: HistogramFamily<UpstreamLabels>,
    fenced: Family<OpLabels, Counter>,
    /// Every fenced write, whatever its op (the console's overview).
    fenced_total: std::sync::atomic::AtomicU64,
    swept: Counter,
    reaped: Counter,
    in_flight: Gauge,
    records: Family<StateLabels, Gauge>,
    oldest: Family<StateLabels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    attempts: Family<AttemptLabels, Counter>,
    requeued: Counter,
    probes: Family<AttemptLabels, Counter>,
    /// Every `records`/`oldest` series created so far (to zero emptied ones).
    record_series: Mutex<HashSet<StateLabels>>,
    deliveries: Family<DeliveryLabels, Counter>,
    events_pending: Gauge,
    events_parked: Gauge,
    events_held: Gauge,
    events_oldest_pending: Gauge<f64, std::sync::atomic::AtomicU64>,
    observe_would: Family<WouldLabels, Counter>,
    observe_skipped: Family<OperationLabels, Counter>,
    observe_refused: Family<RefuseLabels, Counter>,
    forever: Family<OperationLabels, Gauge>,
    /// Every `forever` series created so far (to zero emptied ones).
    forever_series: Mutex<HashSet<OperationLabels>>,
    /// Requests refused before any claim, by problem type.
    rejections: Family<ReasonLabels, Counter>,
    /// Requests proxied without idempotency, by upstream.
    passthrough: Family<UpstreamLabels, Counter>,
    passthrough_failures: Family<UpstreamReasonLabels, Counter>,
    /// 1 from SIGTERM until the process exits.
    draining: Gauge,
    /// Configuration reloads (SIGHUP), applied or refused.
    reloads: Family<ResultLabels, Counter>,
    tls: tls::TlsMetrics,
    http: http::HttpMetrics,
    admission: admission::AdmissionMetrics,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeliveryLabels {
    outcome: &'static str,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        // The root holds the unprefixed `process_*` collector; everything of
        // idemgate's own is under `idemgate_`.
        let mut root = Registry::default();
        root.register_collector(Box::new(crate::telemetry::metrics::process::ProcessCollector));
        let registry = root.sub_registry_with_prefix("idemgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register("requests", "Requests on idempotent routes by operation and outcome", requests.clone());
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
        let records = Family::<StateLabels, Gauge>::default();
        registry.register(
            "records",
            "Records that are not completed, by operation and state (queued, processing, in_flight, unknown, failed_retryable)",
            records.clone(),
        );
        let oldest = Family::<StateLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
        registry.register(
            "oldest_record_age_seconds",
            "Age of the oldest record by operation and state (queued: since acceptance; others: since the last change)",
            oldest.clone(),
        );
        let attempts = Family::<AttemptLabels, Counter>::default();
        registry.register("async_attempts", "Async attempts by operation and how they ended", attempts.clone());
        let requeued = Counter::default();
        registry.register("requeued_leases", "Async attempts whose lease expired and that went back to the queue", requeued.clone());
        let deliveries = Family::<DeliveryLabels, Counter>::default();
        registry.register("event_deliveries", "Outbox event deliveries by outcome (delivered, failed, parked)", deliveries.clone());
        for outcome in ["delivered", "failed", "parked"] {
            let _ = deliveries.get_or_create(&DeliveryLabels { outcome });
        }
        let events_pending = Gauge::default();
        registry.register("events_pending", "Outbox events waiting for delivery", events_pending.clone());
        let events_parked = Gauge::default();
        registry.register("events_parked", "Outbox events parked after max_attempts failed deliveries", events_parked.clone());
        let events_held = Gauge::default();
        registry.register(
            "events_held",
            "Pending outbox events waiting behind a parked event of their scope (delivered once it is redelivered)",
            events_held.clone(),
        );
        let events_oldest_pending = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register("events_oldest_pending_age_seconds", "Age of the oldest pending outbox event", events_oldest_pending.clone());
        let observe_would = Family::<WouldLabels, Counter>::default();
        registry.register(
            "observe_would",
            "Observe mode: requests passed through whose answer enforcing would have changed, by what it would have done",
            observe_would.clone(),
        );
        let observe_skipped = Family::<OperationLabels, Counter>::default();
        registry.register(
            "observe_skipped",
            "Observe mode: requests passed through unobserved (store over budget or down, body over max_request_body, too many observations)",
            observe_skipped.clone(),
        );
        let observe_refused = Family::<RefuseLabels, Counter>::default();
        registry.register(
            "observe_would_refuse",
            "Observe mode: requests passed through that enforcing would have refused before any claim (401/400)",
            observe_refused.clone(),
        );
        let forever = Family::<OperationLabels, Gauge>::default();
        registry.register("forever_records", "Records kept forever (retention = \"forever\"), by operation", forever.clone());
        let probes = Family::<AttemptLabels, Counter>::default();
        registry.register("probes", "Reconciliation probes of unknown records by operation and what they said", probes.clone());
        let rejections = Family::<ReasonLabels, Counter>::default();
        registry.register("rejections", "Requests refused before any claim (404s included), by problem type", rejections.clone());
        let passthrough = Family::<UpstreamLabels, Counter>::default();
        registry.register("passthrough_requests", "Requests proxied without idempotency, by upstream", passthrough.clone());
        let passthrough_failures = Family::<UpstreamReasonLabels, Counter>::default();
        registry.register(
            "passthrough_failures",
            "Pass-through requests the upstream did not answer (bad-gateway, gateway-timeout)",
            passthrough_failures.clone(),
        );
        let draining = Gauge::default();
        registry.register("draining", "1 while the process drains after SIGTERM (readyz answers 503)", draining.clone());
        let reloads = Family::<ResultLabels, Counter>::default();
        registry.register("config_reloads", "Configuration reloads on SIGHUP, by result (applied, refused)", reloads.clone());
        for result in ["applied", "refused"] {
            let _ = reloads.get_or_create(&ResultLabels { result });
        }
        let tls = tls::TlsMetrics::register(registry);
        let http = http::HttpMetrics::register(registry);
        let admission = admission::AdmissionMetrics::register(registry);
        let build = prometheus_client::metrics::info::Info::new(VersionLabels { version: env!("CARGO_PKG_VERSION") });
        registry.register("build", "The running version", build);
        for reason in REJECTION_REASONS {
            let _ = rejections.get_or_create(&ReasonLabels { reason });
        }
        Metrics {
            registry: root,
            requests,
            store_latency,
            store_errors,
            upstream_latency,
            fenced,
            fenced_total: std::sync::atomic::AtomicU64::new(0),
            swept,
            reaped,
            in_flight,
            records,
            oldest,
            attempts,
            requeued,
            probes,
            record_series: Mutex::default(),
            deliveries,
            events_pending,
            events_parked,
            events_held,
            events_oldest_pending,
            observe_would,
            observe_skipped,
            observe_refused,
            forever,
            forever_series: Mutex::default(),
            rejections,
            passthrough,
            passthrough_failures,
            draining,
            reloads,
            tls,
            http,
            admission,
        }
    }

    /// Creates the observe-mode series of these operations at zero.
    pub fn declare_observed<'a>(&self, operations: impl IntoIterator<Item = &'a str>) {
        for operation in operations {
            for would in Would::ALL {
                let _ = self.observe_would.get_or_create(&WouldLabels { operation: operation.to_owned(), would: would.as_str() });
            }
            for reason in RefusalReason::ALL {
                let _ = self.observe_refused.get_or_create(&RefuseLabels { operation: operation.to_owned(), reason: reason.as_str() });
            }
            let _ = self.observe_skipped.get_or_create(&OperationLabels { operation: operation.to_owned() });
        }
    }

    /// Creates `idemgate_forever_records` of these operations at zero.
    pub fn declare_forever<'a>(&self, operations: impl IntoIterator<Item = &'a str>) {
        let mut seen = self.forever_series.lock().unwrap_or_else(|p| p.into_inner());
        for operation in operations {
            let l = OperationLabels { operation: operation.to_owned() };
            let _ = self.forever.get_or_create(&l);
            seen.insert(l);
        }
    }

    pub fn observe_would(&self, operation: &str, would: Would) {
        self.observe_would.get_or_create(&WouldLabels { operation: operation.to_owned(), would: would.as_str() }).inc();
    }

    pub fn observe_skipped(&self, operation: &str) {
        self.observe_skipped.get_or_create(&OperationLabels { operation: operation.to_owned() }).inc();
    }

    pub fn observe_refused(&self, operation: &str, reason: RefusalReason) {
        self.observe_refused.get_or_create(&RefuseLabels { operation: operation.to_owned(), reason: reason.as_str() }).inc();
    }

    /// Sets `idemgate_forever_records` from a store count; series seen before
    /// and missing from `counts` go back to zero.
    pub fn set_forever_counts(&self, counts: &[crate::telemetry::stats::ForeverCount]) {
        let mut seen = self.forever_series.lock().unwrap_or_else(|p| p.into_inner());
        let counted: HashSet<&str> = counts.iter().map(|c| c.operation.as_str()).collect();
        for l in seen.iter().filter(|l| !counted.contains(l.operation.as_str())) {
            self.forever.get_or_create(l).set(0);
        }
        for c in counts {
            let l = OperationLabels { operation: c.operation.clone() };
            self.forever.get_or_create(&l).set(c.count);
            seen.insert(l);
        }
    }

    /// Creates the per-upstream series at zero.
    pub fn declare_upstreams<'a>(&self, upstreams: impl IntoIterator<Item = &'a str>) {
        for upstream in upstreams {
            let _ = self.upstream_latency.get_or_create(&UpstreamLabels { upstream: upstream.to_owned() });
            let _ = self.passthrough.get_or_create(&UpstreamLabels { upstream: upstream.to_owned() });
            for reason in PASSTHROUGH_FAILURES {
                let _ = self.passthrough_failures.get_or_create(&UpstreamReasonLabels { upstream: upstream.to_owned(), reason });
            }
            self.declare_upstream_errors(upstream);
        }
    }

    /// A request refused before any claim; `reason` is its problem type.
    pub fn rejected(&self, reason: &'static str) {
        self.rejections.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// A request proxied without idempotency; `failure` is its problem type
    /// when the upstream did not answer.
    pub fn passed_through(&self, upstream: &str, failure: Option<&'static str>) {
        self.passthrough.get_or_create(&UpstreamLabels { upstream: upstream.to_owned() }).inc();
        if let Some(reason) = failure {
            self.passthrough_failures.get_or_create(&UpstreamReasonLabels { upstream: upstream.to_owned(), reason }).inc();
        }
    }

    /// The process started (or stopped) draining.
    pub fn set_draining(&self, draining: bool) {
        self.draining.set(i64::from(draining));
    }

    /// A configuration reload was applied (`true`) or refused.
    pub fn reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "refused" };
        self.reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// Refused configuration reloads, and result writes fenced off (every
    /// op, sync and async), since this process started: the operator
    /// console's overview shows them.
    pub fn refusals(&self) -> (u64, u64) {
        let refused = self.reloads.get(&ResultLabels { result: "refused" }).map_or(0, |c| c.get());
        (refused, self.fenced_total.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Creates the labelled series of the configured operations at zero, so
    /// they exist (and alerts can evaluate) before their first event.
    pub fn declare_operations<'a>(&self, operations: impl IntoIterator<Item = (&'a str, bool)>) {
        for (operation, is_async) in operations {
            for outcome in RequestOutcome::OF_ROUTES {
                let _ = self.requests.get_or_create(&RequestLabels { operation: operation.to_owned(), outcome: outcome.as_str() });
            }
            for state in crate::idempotency::record::State::ALL {
                if state == crate::idempotency::record::State::Completed {
                    continue;
                }
                let l = StateLabels { operation: operation.to_owned(), state: state.as_str() };
                let _ = self.records.get_or_create(&l);
                let _ = self.oldest.get_or_create(&l);
                self.record_series.lock().unwrap_or_else(|p| p.into_inner()).insert(l);
            }
            if is_async {
                for outcome in AttemptOutcome::ALL {
                    let _ = self.attempts.get_or_create(&AttemptLabels { operation: operation.to_owned(), outcome: outcome.as_str() });
                }
            }
        }
    }

    /// Sets the record gauges from a store count; every series seen before
    /// and missing from `counts` goes back to zero (a state that emptied).
    pub fn set_record_counts(&self, counts: &[crate::telemetry::stats::StateCount], now: crate::idempotency::record::Timestamp) {
        let mut seen = self.record_series.lock().unwrap_or_else(|p| p.into_inner());
        let counted: HashSet<StateLabels> =
            counts.iter().map(|c| StateLabels { operation: c.operation.clone(), state: c.state.as_str() }).collect();
        for l in seen.iter().filter(|l| !counted.contains(*l)) {
            self.records.get_or_create(l).set(0);
            self.oldest.get_or_create(l).set(0.0);
        }
        for c in counts {
            let l = StateLabels { operation: c.operation.clone(), state: c.state.as_str() };
            self.records.get_or_create(&l).set(c.count);
            let since = if c.state == crate::idempotency::record::State::Queued { c.oldest_created_at } else { c.oldest_updated_at };
            self.oldest.get_or_create(&l).set(since.until(now).as_secs_f64());
            seen.insert(l);
        }
    }

    /// The operations of `operation` waiting in the queue: the record
    /// counter's last count, plus the acceptances this replica counted since
    /// ([`Metrics::accepted`]).
    pub fn queued(&self, operation: &str) -> i64 {
        let labels = StateLabels { operation: operation.to_owned(), state: crate::idempotency::record::State::Queued.as_str() };
        self.records.get(&labels).map_or(0, |g| g.get())
    }

    /// An operation of `operation` was accepted into the queue.
    pub fn accepted(&self, operation: &str) {
        let labels = StateLabels { operation: operation.to_owned(), state: crate::idempotency::record::State::Queued.as_str() };
        self.records.get_or_create(&labels).inc();
    }

    pub fn attempt(&self, operation: &str, outcome: AttemptOutcome) {
        self.attempts.get_or_create(&AttemptLabels { operation: operation.to_owned(), outcome: outcome.as_str() }).inc();
    }

    pub fn event_delivery(&self, outcome: &'static str) {
        self.deliveries.get_or_create(&DeliveryLabels { outcome }).inc();
    }

    pub fn set_event_stats(&self, stats: &crate::telemetry::stats::EventStats, now: crate::idempotency::record::Timestamp) {
        self.events_pending.set(stats.pending);
        self.events_parked.set(stats.parked);
        self.events_held.set(stats.held);
        self.events_oldest_pending.set(stats.oldest_pending_at.map_or(0.0, |at| at.until(now).as_secs_f64()));
    }

    /// Creates the probe series of the probed operations at zero.
    pub fn declare_probes<'a>(&self, operations: impl IntoIterator<Item = &'a str>) {
        for operation in operations {
            for outcome in ProbeOutcome::ALL {
                let _ = self.probes.get_or_create(&AttemptLabels { operation: operation.to_owned(), outcome: outcome.as_str() });
            }
        }
    }

    pub fn probe(&self, operation: &str, outcome: ProbeOutcome) {
        self.probes.get_or_create(&AttemptLabels { operation: operation.to_owned(), outcome: outcome.as_str() }).inc();
    }

    pub fn requeued(&self, n: u64) {
        self.requeued.inc_by(n);
    }

    pub fn request(&self, operation: &str, outcome: RequestOutcome) {
        self.requests.get_or_create(&RequestLabels { operation: operation.to_owned(), outcome: outcome.as_str() }).inc();
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
        self.fenced_total.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Creates the series of store operations (`ops`) and of fenced writes
    /// (`fenced`) at zero; the store names them ([`crate::store::op`]).
    pub fn declare_store_ops(&self, ops: impl IntoIterator<Item = &'static str>, fenced: impl IntoIterator<Item = &'static str>) {
        for op in ops {
            let _ = self.store_latency.get_or_create(&OpLabels { op });
            let _ = self.store_errors.get_or_create(&OpLabels { op });
        }
        for op in fenced {
            let _ = self.fenced.get_or_create(&OpLabels { op });
        }
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

mod admission;
mod http;
mod process;
mod tls;
pub use admission::{LimitGauges, LimitReading};
pub use http::{RouteSeries, UpstreamErrorKind};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_exist_from_the_start() {
        let m = Metrics::new();
        m.declare_operations([("create_order", false)]);
        m.declare_upstreams(["orders"]);
        let text = m.encode();
        for series in [
            r#"idemgate_requests_total{operation="create_order",outcome="unknown"} 0"#,
            r#"idemgate_rejections_total{reason="not-found"} 0"#,
            r#"idemgate_rejections_total{reason="unauthenticated"} 0"#,
            r#"idemgate_passthrough_requests_total{upstream="orders"} 0"#,
            r#"idemgate_passthrough_failures_total{upstream="orders",reason="bad-gateway"} 0"#,
            r#"idemgate_upstream_duration_seconds_count{upstream="orders"} 0"#,
            r#"idemgate_records{operation="create_order",state="unknown"} 0"#,
            "idemgate_draining 0",
            concat!(r#"idemgate_build_info{version=""#, env!("CARGO_PKG_VERSION"), r#""} 1"#),
        ] {
            assert!(text.contains(series), "missing {series}:\n{text}");
        }
    }

    #[test]
    fn exposition_contains_counters_and_histograms() {
        let m = Metrics::new();
        m.request("create_order", RequestOutcome::Replayed);
        m.request("create_order", RequestOutcome::Replayed);
        m.observe_store("claim", Duration::from_millis(2), true);
        m.observe_upstream("orders", Duration::from_millis(20));
        m.fenced_write("complete");
        let text = m.encode();
        assert!(text.contains(r#"idemgate_requests_total{operation="create_order",outcome="replayed"} 2"#), "{text}");
        assert!(text.contains(r#"idemgate_store_duration_seconds_count{op="claim"} 1"#), "{text}");
        assert!(text.contains(r#"idemgate_upstream_duration_seconds_count{upstream="orders"} 1"#), "{text}");
        assert!(text.contains(r#"idemgate_fenced_writes_total{op="complete"} 1"#), "{text}");
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn observe_and_forever_series() {
        let m = Metrics::new();
        m.declare_observed(["create_order"]);
        m.declare_forever(["create_order", "pay"]);
        m.observe_would("create_order", Would::RejectInFlight);
        m.observe_skipped("create_order");
        m.observe_refused("create_order", RefusalReason::MissingKey);
        m.set_forever_counts(&[crate::telemetry::stats::ForeverCount { operation: "pay".into(), count: 7 }]);
        let text = m.encode();
        for line in [
            r#"idemgate_observe_would_total{operation="create_order",would="reject_in_flight"} 1"#,
            r#"idemgate_observe_would_total{operation="create_order",would="replay"} 0"#,
            r#"idemgate_observe_skipped_total{operation="create_order"} 1"#,
            r#"idemgate_observe_would_refuse_total{operation="create_order",reason="missing_key"} 1"#,
            r#"idemgate_forever_records{operation="pay"} 7"#,
            r#"idemgate_forever_records{operation="create_order"} 0"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        m.set_forever_counts(&[]);
        assert!(m.encode().contains(r#"idemgate_forever_records{operation="pay"} 0"#));
    }
}
