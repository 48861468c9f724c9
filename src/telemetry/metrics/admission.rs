//! Admission under overload: each upstream's concurrency limit, the requests
//! holding a slot, and the requests refused for want of one.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Metrics;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct UpstreamLabels {
    upstream: String,
}

#[derive(Debug, Default)]
pub(super) struct AdmissionMetrics {
    limit: Family<UpstreamLabels, Gauge>,
    in_flight: Family<UpstreamLabels, Gauge>,
    refusals: Family<UpstreamLabels, Counter>,
}

impl AdmissionMetrics {
    pub(super) fn register(registry: &mut Registry) -> AdmissionMetrics {
        let m = AdmissionMetrics::default();
        registry.register(
            "upstream_limit",
            "Requests this replica lets be in flight to an upstream at once (adaptive or max_in_flight; absent: no limit)",
            m.limit.clone(),
        );
        registry.register(
            "upstream_in_flight",
            "Requests holding a slot of an upstream's limit now (forwards, async attempts, probes, event deliveries)",
            m.in_flight.clone(),
        );
        registry.register(
            "upstream_refusals",
            "Requests refused before their claim because an upstream's limit was reached (503 overloaded), and background work deferred for it",
            m.refusals.clone(),
        );
        m
    }
}

/// One upstream's series, updated by its limit as slots are taken and freed.
#[derive(Debug, Clone, Default)]
pub struct LimitGauges {
    pub limit: Option<Gauge>,
    pub in_flight: Gauge,
    pub refusals: Counter,
}

impl Metrics {
    /// The series of `upstream`'s limit (created at zero); `limited`: whether
    /// it has one (`idemgate_upstream_limit` exists only then).
    pub fn limit_gauges(&self, upstream: &str, limited: bool) -> LimitGauges {
        let labels = UpstreamLabels { upstream: upstream.to_owned() };
        LimitGauges {
            limit: limited.then(|| self.admission.limit.get_or_create(&labels).clone()),
            in_flight: self.admission.in_flight.get_or_create(&labels).clone(),
            refusals: self.admission.refusals.get_or_create(&labels).clone(),
        }
    }
}
