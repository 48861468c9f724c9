//! Identity: who is asking, as the gateway can prove it.
//!
//! The tenant and principal of a key's scope come only from here, never from
//! anything the client can set freely: an API key the operator listed (by its
//! SHA-256), or headers set by a trusted peer (a sidecar or an edge proxy whose
//! address is in `trusted_peers`), or a JWT verified against the issuer's keys
//! (see [`crate::request::identity::jwt`]), or a client certificate the TLS listener verified
//! ([`mtls`]). Sources are tried in order; the first that matches wins.
//!
//! What the upstream (and a route's authorizer) learns about the caller
//! comes from the same source: [`Identifier::identify_and_strip`] removes every header
//! another configured source reads (a trusted header asserting a tenant, a
//! second API key header, a credential that identified no one), so an
//! upstream never sees an identity the scope does not carry. A header any
//! source reads, given more than once, is ambiguous:
//! [`Identifier::ambiguous`] says so and the request is refused with 401.

pub mod jwt;
pub mod mtls;
pub mod token_cache;

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use ipnet::IpNet;
use sha2::{Digest, Sha256};

pub use crate::idempotency::key::Identity;
use crate::request::identity::jwt::JwtVerifier;
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
    /// The request header this source reads a credential from, if any (a
    /// trusted header names an identity, not a secret; mTLS reads none).
    pub fn credential_header(&self) -> Option<&HeaderName> {
        match self {
            IdentitySource::ApiKey { header, .. } => Some(header),
            IdentitySource::Jwt(verifier) => Some(&verifier.config.header),
            IdentitySource::TrustedHeader { .. } | IdentitySource::Mtls(_) => None,
        }
    }

    /// The request headers this source reads.
    fn headers(&self) -> Vec<&HeaderName> {
        match self {
            IdentitySource::ApiKey { header, .. } => vec![header],
            IdentitySource::TrustedHeader { tenant_header, principal_header, .. } => vec![tenant_header, principal_header],
            IdentitySource::Jwt(verifier) => vec![&verifier.config.header],
            IdentitySource::Mtls(_) => Vec::new(),
        }
    }

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
    /// Every header some source reads, with the indices of the sources
    /// that read it (one name may serve several: `authorization`).
    read: Vec<(HeaderName, Vec<usize>)>,
}

impl Identifier {
    pub fn new(sources: Vec<IdentitySource>) -> Identifier {
        let mut read: Vec<(HeaderName, Vec<usize>)> = Vec::new();
        for (i, source) in sources.iter().enumerate() {
            for name in source.headers() {
                match read.iter_mut().find(|(n, _)| n == name) {
                    Some((_, readers)) => readers.push(i),
                    None => read.push((name.clone(), vec![i])),
                }
            }
        }
        Identifier { sources, read }
    }

    /// `cert`: the connection's verified client certificate, if any (a
    /// request extension set by the TLS listener, see [`client_certificate`]).
    pub async fn identify(&self, headers: &HeaderMap, peer: IpAddr, cert: Option<&ClientCertificate>) -> Option<Identity> {
        self.identify_by(headers, peer, cert).await.map(|(identity, _)| identity)
    }

    /// The identity and the index of the source that gave it.
    async fn identify_by(&self, headers: &HeaderMap, peer: IpAddr, cert: Option<&ClientCertificate>) -> Option<(Identity, usize)> {
        for (i, s) in self.sources.iter().enumerate() {
            if let Some(identity) = s.identify(headers, peer, cert).await {
                return Some((identity, i));
            }
        }
        None
    }

    /// Identifies the request, then removes from `headers` every header
    /// that a source other than the identifying one reads (all of them when
    /// no source identified the request): what is forwarded, stored for an
    /// async worker or shown to an authorizer carries no identity but the
    /// one the request is scoped by.
    pub async fn identify_and_strip(&self, headers: &mut HeaderMap, peer: IpAddr, cert: Option<&ClientCertificate>) -> Option<Identity> {
        let found = self.identify_by(headers, peer, cert).await;
        let by = found.as_ref().map(|(_, i)| *i);
        for (name, readers) in &self.read {
            if by.is_none_or(|i| !readers.contains(&i)) {
                headers.remove(name);
            }
        }
        found.map(|(identity, _)| identity)
    }

    /// Every header some source reads.
    pub fn read_headers(&self) -> impl Iterator<Item = &HeaderName> {
        self.read.iter().map(|(name, _)| name)
    }

    /// The first header some source reads that the request carries more
    /// than once: which value identifies it is ambiguous (and the upstream
    /// would get both), so such a request is refused.
    pub fn ambiguous(&self, headers: &HeaderMap) -> Option<&HeaderName> {
        self.read.iter().map(|(name, _)| name).find(|name| headers.get_all(*name).iter().nth(1).is_some())
    }

    /// The JWT sources whose keys come from a URL (refreshed in the background).
    pub fn jwks_urls(&self) -> Vec<Arc<JwtVerifier>> {
        self.sources
            .iter()
            .filter_map(|s| match s {
                IdentitySource::Jwt(v) if matches!(v.config.keys, crate::request::identity::jwt::JwksSource::Url(_)) => Some(v.clone()),
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
    async fn identify_and_strip_keeps_only_the_identifying_sources_headers() {
        let mut keys = HashMap::new();
        keys.insert(Sha256::digest(b"side").into(), ident("side", "robot"));
        let mut sources = identifier().sources;
        sources.push(IdentitySource::ApiKey { header: HeaderName::from_static("x-api-key"), keys });
        let id = Identifier::new(sources);
        let names = |h: &HeaderMap| {
            let mut n = h.keys().map(|n| n.as_str().to_owned()).collect::<Vec<_>>();
            n.sort();
            n
        };
        let trusted: IpAddr = "10.1.2.3".parse().unwrap();
        let all = [("authorization", "s3cret"), ("x-tenant-id", "t1"), ("x-principal-id", "p1"), ("x-api-key", "side"), ("x-other", "1")];

        let mut h = headers(&all);
        assert_eq!(id.identify_and_strip(&mut h, trusted, None).await, Some(ident("acme", "billing")));
        assert_eq!(names(&h), ["authorization", "x-other"]);

        let mut h = headers(&[("authorization", "wrong"), ("x-tenant-id", "t1"), ("x-principal-id", "p1"), ("x-api-key", "side")]);
        assert_eq!(id.identify_and_strip(&mut h, trusted, None).await, Some(ident("t1", "p1")));
        assert_eq!(names(&h), ["x-principal-id", "x-tenant-id"]);

        let mut h = headers(&[("x-tenant-id", "t1"), ("x-principal-id", "p1"), ("x-api-key", "side")]);
        assert_eq!(id.identify_and_strip(&mut h, "192.0.2.1".parse().unwrap(), None).await, Some(ident("side", "robot")));
        assert_eq!(names(&h), ["x-api-key"]);

        let mut h = headers(&all[1..]);
        h.insert("x-api-key", HeaderValue::from_static("nobody"));
        assert_eq!(id.identify_and_strip(&mut h, "192.0.2.1".parse().unwrap(), None).await, None);
        assert_eq!(names(&h), ["x-other"], "no identity: every source's headers go");
    }

    #[test]
    fn a_credential_header_given_twice_is_ambiguous() {
        let id = identifier();
        assert_eq!(id.ambiguous(&headers(&[("authorization", "a"), ("x-tenant-id", "t"), ("x-other", "1"), ("x-other", "2")])), None);
        assert_eq!(
            id.ambiguous(&headers(&[("authorization", "a"), ("authorization", "b")])).map(HeaderName::as_str),
            Some("authorization")
        );
        assert_eq!(
            id.ambiguous(&headers(&[("x-principal-id", "a"), ("x-principal-id", "a")])).map(HeaderName::as_str),
            Some("x-principal-id")
        );
        assert_eq!(Identifier::new(Vec::new()).ambiguous(&headers(&[("authorization", "a"), ("authorization", "b")])), None);
    }

    #[tokio::test]
    async fn first_matching_source_wins() {
        let id = identifier();
        let h = headers(&[("authorization", "s3cret"), ("x-tenant-id", "t1"), ("x-principal-id", "p1")]);
        assert_eq!(id.identify(&h, "10.1.2.3".parse().unwrap(), None).await, Some(ident("acme", "billing")));
    }
}
