//! Identity: who is asking, as the gateway can prove it.
//!
//! The tenant and principal of a key's scope come only from here, never from
//! anything the client can set freely: an API key the operator listed (by its
//! SHA-256), or headers set by a trusted peer (a sidecar or an edge proxy whose
//! address is in `trusted_peers`), or a JWT verified against the issuer's keys
//! (see [`crate::jwt`]), or a client certificate the TLS listener verified
//! ([`mtls`]). Sources are tried in order; the first that matches wins.

pub mod mtls;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::jwt::JwtVerifier;
pub use crate::scope::Identity;
use crate::tls::server::ClientCertificate;

/// One `[[identity.sources]]` entry after validation.
#[derive(Debug, Clone)]
pub enum IdentitySource {
    ApiKey {
        header: HeaderName,
        /// SHA-256 of the presented key -> identity.
        keys: HashMap<[u8; 32], Identity>,
    },
    TrustedHeader {
        tenant_header: HeaderName,
        principal_header: HeaderName,
        trusted_peers: Vec<IpNet>,
    },
    /// A bearer JWT: signature, expiry, issuer and audience verified; tenant
    /// and principal from its claims.
    Jwt(Arc<JwtVerifier>),
    /// The connection's verified client certificate.
    Mtls(mtls::MtlsSource),
}

impl IdentitySource {
    async fn identify(&self, headers: &HeaderMap, peer: IpAddr, cert: Option<&ClientCertificate>) -> Option<Identity> {
        match self {
            IdentitySource::Mtls(source) => source.identify(cert),
            IdentitySource::ApiKey { header, keys } => {
                let value = headers.get(header)?.to_str().ok()?.trim();
                let presented = match value.split_once(' ') {
                    Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
                    Some(_) => return None,
                    None => value,
                };
                if presented.is_empty() {
                    return None;
                }
                let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
                keys.get(&digest).cloned()
            }
            IdentitySource::TrustedHeader { tenant_header, principal_header, trusted_peers } => {
                let peer = canonical_ip(peer);
                if !trusted_peers.iter().any(|net| net.contains(&peer)) {
                    return None;
                }
                let tenant = single_value(headers, tenant_header)?;
                let principal = single_value(headers, principal_header)?;
                Some(Identity { tenant: tenant.into(), principal: principal.into() })
            }
            IdentitySource::Jwt(verifier) => {
                let token = verifier.token(headers)?;
                match verifier.verify(token).await {
                    Ok(identity) => Some(identity),
                    Err(e) => {
                        // The reason goes to the log, never the token or its claims.
                        tracing::debug!(error = %e, "JWT refused");
                        None
                    }
                }
            }
        }
    }
}

/// The verified client certificate a TLS listener attached to a request.
pub fn client_certificate(extensions: &http::Extensions) -> Option<&ClientCertificate> {
    extensions.get::<Arc<ClientCertificate>>().map(|c| &**c)
}

/// An IPv4-mapped IPv6 peer (`::ffff:127.0.0.1`) is matched as IPv4.
fn canonical_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// Exactly one non-empty, visible-ASCII value; several values are ambiguous and
/// do not identify anyone.
fn single_value<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let s = value.to_str().ok()?.trim();
    if s.is_empty() || s.len() > 255 { None } else { Some(s) }
}

/// Tries each source in order.
#[derive(Debug, Clone, Default)]
pub struct Identifier {
    sources: Vec<IdentitySource>,
}

impl Identifier {
    pub fn new(sources: Vec<IdentitySource>) -> Identifier {
        Identifier { sources }
    }

    /// `cert`: the connection's verified client certificate, if any (a
    /// request extension set by the TLS listener, see [`client_certificate`]).
    pub async fn identify(&self, headers: &HeaderMap, peer: IpAddr, cert: Option<&ClientCertificate>) -> Option<Identity> {
        for s in &self.sources {
            if let Some(identity) = s.identify(headers, peer, cert).await {
                return Some(identity);
            }
        }
        None
    }

    /// The JWT sources whose keys come from a URL (refreshed in the background).
    pub fn jwks_urls(&self) -> Vec<Arc<JwtVerifier>> {
        self.sources
            .iter()
            .filter_map(|s| match s {
                IdentitySource::Jwt(v) if matches!(v.config.keys, crate::jwt::KeySource::Url(_)) => Some(v.clone()),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn ident(t: &str, p: &str) -> Identity {
        Identity { tenant: t.into(), principal: p.into() }
    }

    fn identifier() -> Identifier {
        let mut keys = HashMap::new();
        keys.insert(Sha256::digest(b"s3cret").into(), ident("acme", "billing"));
        Identifier::new(vec![
            IdentitySource::ApiKey { header: HeaderName::from_static("authorization"), keys },
            IdentitySource::TrustedHeader {
                tenant_header: HeaderName::from_static("x-tenant-id"),
                principal_header: HeaderName::from_static("x-principal-id"),
                trusted_peers: vec!["10.0.0.0/8".parse().unwrap()],
            },
        ])
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[tokio::test]
    async fn api_key_bearer_and_bare() {
        let id = identifier();
        let peer: IpAddr = "192.0.2.1".parse().unwrap();
        assert_eq!(id.identify(&headers(&[("authorization", "Bearer s3cret")]), peer, None).await, Some(ident("acme", "billing")));
        assert_eq!(id.identify(&headers(&[("authorization", "bearer  s3cret ")]), peer, None).await, Some(ident("acme", "billing")));
        assert_eq!(id.identify(&headers(&[("authorization", "s3cret")]), peer, None).await, Some(ident("acme", "billing")));
        assert_eq!(id.identify(&headers(&[("authorization", "Basic s3cret")]), peer, None).await, None);
        assert_eq!(id.identify(&headers(&[("authorization", "Bearer wrong")]), peer, None).await, None);
        assert_eq!(id.identify(&headers(&[]), peer, None).await, None);
    }

    #[tokio::test]
    async fn trusted_header_only_from_trusted_peers() {
        let id = identifier();
        let h = headers(&[("x-tenant-id", "t1"), ("x-principal-id", "p1")]);
        assert_eq!(id.identify(&h, "10.1.2.3".parse().unwrap(), None).await, Some(ident("t1", "p1")));
        assert_eq!(id.identify(&h, "::ffff:10.1.2.3".parse().unwrap(), None).await, Some(ident("t1", "p1")));
        assert_eq!(id.identify(&h, "11.1.2.3".parse().unwrap(), None).await, None);
        let missing = headers(&[("x-tenant-id", "t1")]);
        assert_eq!(id.identify(&missing, "10.1.2.3".parse().unwrap(), None).await, None);
        let doubled = headers(&[("x-tenant-id", "t1"), ("x-tenant-id", "t2"), ("x-principal-id", "p1")]);
        assert_eq!(id.identify(&doubled, "10.1.2.3".parse().unwrap(), None).await, None);
    }

    #[tokio::test]
    async fn first_matching_source_wins() {
        let id = identifier();
        let h = headers(&[("authorization", "s3cret"), ("x-tenant-id", "t1"), ("x-principal-id", "p1")]);
        assert_eq!(id.identify(&h, "10.1.2.3".parse().unwrap(), None).await, Some(ident("acme", "billing")));
    }
}
