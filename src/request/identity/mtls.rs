//! `kind = "mtls"`: tenant and principal from the client certificate the TLS
//! listener verified against `client_ca_file` (see
//! [`crate::tls::server::ClientCertificate`]); a connection without one, or
//! a listener without client authentication, identifies no one here.

use regex::Regex;

use super::Identity;
use crate::tls::server::ClientCertificate;

/// Which certificate field a value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CertField {
    SanUri,
    SanDns,
    SubjectCn,
}

impl CertField {
    pub fn parse(s: &str) -> Option<CertField> {
        match s {
            "san_uri" => Some(CertField::SanUri),
            "san_dns" => Some(CertField::SanDns),
            "subject_cn" => Some(CertField::SubjectCn),
            _ => None,
        }
    }
}

/// A field and an optional pattern: the first value of the field the pattern
/// matches gives its first capture group (or, without groups, the match).
#[derive(Debug, Clone)]
pub struct CertRule {
    pub field: CertField,
    pub pattern: Option<Regex>,
}

impl CertRule {
    fn extract(&self, cert: &ClientCertificate) -> Option<String> {
        let values: Box<dyn Iterator<Item = &String>> = match self.field {
            CertField::SanUri => Box::new(cert.san_uris.iter()),
            CertField::SanDns => Box::new(cert.san_dns.iter()),
            CertField::SubjectCn => Box::new(cert.subject_cn.iter()),
        };
        let mut found = values.filter_map(|v| match &self.pattern {
            None => Some(v.as_str()),
            Some(re) => {
                let caps = re.captures(v)?;
                caps.get(1).or_else(|| caps.get(0)).map(|m| m.as_str())
            }
        });
        let value = found.next()?.trim();
        (!value.is_empty() && value.len() <= 255 && !value.chars().any(char::is_control)).then(|| value.to_owned())
    }
}

/// One `kind = "mtls"` source.
#[derive(Debug, Clone)]
pub struct MtlsSource {
    pub tenant: CertRule,
    pub principal: CertRule,
}

impl MtlsSource {
    pub fn identify(&self, cert: Option<&ClientCertificate>) -> Option<Identity> {
        let cert = cert?;
        let tenant = self.tenant.extract(cert)?;
        let principal = self.principal.extract(cert)?;
        Some(Identity { tenant: tenant.into(), principal: principal.into() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cert() -> ClientCertificate {
        ClientCertificate {
            san_uris: vec!["https://example.com/x".into(), "spiffe://acme.test/billing/worker".into()],
            san_dns: vec!["worker.billing.acme.test".into()],
            subject_cn: Some("billing-worker".into()),
        }
    }

    fn rule(field: CertField, pattern: Option<&str>) -> CertRule {
        CertRule { field, pattern: pattern.map(|p| Regex::new(p).unwrap()) }
    }

    #[test]
    fn fields_and_captures() {
        let spiffe = MtlsSource {
            tenant: rule(CertField::SanUri, Some("^spiffe://([^/]+)/")),
            principal: rule(CertField::SanUri, Some("^spiffe://[^/]+/(.+)$")),
        };
        let id = spiffe.identify(Some(&cert())).unwrap();
        assert_eq!((&*id.tenant, &*id.principal), ("acme.test", "billing/worker"));

        let dns_cn =
            MtlsSource { tenant: rule(CertField::SanDns, Some(r"[^.]+\.acme\.test$")), principal: rule(CertField::SubjectCn, None) };
        let id = dns_cn.identify(Some(&cert())).unwrap();
        assert_eq!((&*id.tenant, &*id.principal), ("billing.acme.test", "billing-worker"));

        assert!(spiffe.identify(None).is_none(), "no certificate, no identity");
        let no_match = MtlsSource { tenant: rule(CertField::SanUri, Some("^urn:")), principal: rule(CertField::SubjectCn, None) };
        assert!(no_match.identify(Some(&cert())).is_none());
        let empty = ClientCertificate { subject_cn: Some("only-cn".into()), ..Default::default() };
        assert!(dns_cn.identify(Some(&empty)).is_none(), "a missing field identifies no one");
    }
}
