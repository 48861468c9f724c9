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
    /// The upstreams whose series exist, in the order they were declared.
    upstreams: std::sync::Mutex<Vec<String>>,
}

/// One upstream's limit as this replica sees it now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitReading {
    pub upstream: String,
    /// `None`: no limit (`adaptive = false` without `max_in_flight`).
    pub limit: Option<i64>,
    pub in_flight: i64,
    pub refusals: u64,
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
        {
            let mut known = self.admission.upstreams.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !known.iter().any(|u| u == upstream) {
                known.push(upstream.to_owned());
            }
        }
        LimitGauges {
            limit: limited.then(|| self.admission.limit.get_or_create(&labels).clone()),
            in_flight: self.admission.in_flight.get_or_create(&labels).clone(),
            refusals: self.admission.refusals.get_or_create(&labels).clone(),
        }
    }

    /// Every upstream's limit, slots held and refusals (the console's overview).
    pub fn limits(&self) -> Vec<LimitReading> {
        let known = self.admission.upstreams.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        known
            .into_iter()
            .map(|upstream| {
                let labels = UpstreamLabels { upstream };
                LimitReading {
                    limit: self.admission.limit.get(&labels).map(|g| g.get()),
                    in_flight: self.admission.in_flight.get(&labels).map_or(0, |g| g.get()),
                    refusals: self.admission.refusals.get(&labels).map_or(0, |c| c.get()),
                    upstream: labels.upstream,
                }
            })
            .collect()
    }
}
