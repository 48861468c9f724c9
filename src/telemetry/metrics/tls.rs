//! Transport metrics: TLS handshakes by result and the served certificates'
//! expiry.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Metrics;
use crate::tls::server::HandshakeFailure;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandshakeLabels {
    listener: &'static str,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Default)]
pub(super) struct TlsMetrics {
    handshakes: Family<HandshakeLabels, Counter>,
    expiry: Family<ListenerLabels, Gauge>,
}

impl TlsMetrics {
    pub(super) fn register(registry: &mut Registry) -> TlsMetrics {
        let m = TlsMetrics::default();
        registry.register(
            "tls_handshakes",
            "TLS handshakes on a listener by result (ok, or why it failed: timeout, no_client_certificate, bad_certificate, incompatible, closed, protocol)",
            m.handshakes.clone(),
        );
        registry.register(
            "tls_certificate_expiry_timestamp_seconds",
            "When the certificate a TLS listener serves expires (seconds since the epoch)",
            m.expiry.clone(),
        );
        m
    }
}

impl Metrics {
    /// Creates a TLS listener's series at zero.
    pub fn declare_tls_listener(&self, listener: &'static str) {
        let _ = self.tls.handshakes.get_or_create(&HandshakeLabels { listener, result: "ok" });
        for f in HandshakeFailure::ALL {
            let _ = self.tls.handshakes.get_or_create(&HandshakeLabels { listener, result: f.as_str() });
        }
    }

    pub fn tls_handshake_ok(&self, listener: &'static str) {
        self.tls.handshakes.get_or_create(&HandshakeLabels { listener, result: "ok" }).inc();
    }

    pub fn tls_handshake_failed(&self, listener: &'static str, reason: HandshakeFailure) {
        self.tls.handshakes.get_or_create(&HandshakeLabels { listener, result: reason.as_str() }).inc();
    }

    pub fn set_certificate_expiry(&self, listener: &'static str, not_after: Option<i64>) {
        self.tls.expiry.get_or_create(&ListenerLabels { listener }).set(not_after.unwrap_or(0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_series() {
        let m = Metrics::new();
        m.declare_tls_listener("proxy");
        m.tls_handshake_ok("proxy");
        m.tls_handshake_failed("proxy", HandshakeFailure::Timeout);
        m.set_certificate_expiry("proxy", Some(1_900_000_000));
        let text = m.encode();
        for line in [
            r#"idemgate_tls_handshakes_total{listener="proxy",result="ok"} 1"#,
            r#"idemgate_tls_handshakes_total{listener="proxy",result="timeout"} 1"#,
            r#"idemgate_tls_handshakes_total{listener="proxy",result="bad_certificate"} 0"#,
            r#"idemgate_tls_certificate_expiry_timestamp_seconds{listener="proxy"} 1900000000"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
