//! TLS towards upstreams and the other HTTP services idemgate calls
//! (webhooks, JWKS, the authorizer): one rustls client configuration per
//! upstream (its `ca_file` or the system roots, an optional client
//! certificate), SNI from the URL's host, ALPN h2 and http/1.1 so HTTP/2 is
//! used when the server offers it.
//!
//! The handshake is part of the connection phase: hyper-util reports its
//! failure as a connect error, and the upstream's `connect_timeout` bounds it
//! (see [`crate::upstream::BoundedConnect`]), so a handshake that fails or
//! stalls is "never sent" — the key is released, never `unknown`.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::RootCertStore;

use super::{LoadError, at, certificates, private_key, provider, roots, system_roots};

/// An upstream's TLS settings (`ca_file`, `client_cert_file`, `client_key_file`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// Trusted roots; none: the system's.
    pub ca_file: Option<PathBuf>,
    /// A client certificate (chain) and its key, both or neither.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// Builds the client configuration: TLS 1.2 and 1.3, rustls' safe defaults.
pub fn build(settings: &ClientTls) -> Result<Arc<rustls::ClientConfig>, LoadError> {
    let roots: RootCertStore = match &settings.ca_file {
        Some(ca) => roots(ca).map_err(at("ca_file"))?,
        None => system_roots(super::remedy::CA_FILE).map_err(at("ca_file"))?,
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| at("ca_file")(e.into()))?
        .with_root_certificates(roots);
    let config = match (&settings.cert_file, &settings.key_file) {
        (Some(cert), Some(key)) => {
            let chain = certificates(cert).map_err(at("client_cert_file"))?;
            let key_der = private_key(key).map_err(at("client_key_file"))?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                at("client_key_file")(super::TlsError::Invalid {
                    file: key.clone(),
                    detail: format!("does not fit the certificate in {}: {e}", cert.display()),
                })
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// The configuration for services without settings of their own (webhooks,
/// JWKS URLs, authorizers): the system roots, built once. `None` when the
/// system has no roots (configuration refuses https URLs then).
pub fn system_default() -> Option<Arc<rustls::ClientConfig>> {
    static DEFAULT: OnceLock<Option<Arc<rustls::ClientConfig>>> = OnceLock::new();
    DEFAULT.get_or_init(|| build(&ClientTls::default()).ok()).clone()
}

/// A configuration that trusts nothing: for clients that only ever reach
/// `http://` URLs (the connector still needs one).
fn trusts_nothing() -> Arc<rustls::ClientConfig> {
    static NONE: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    NONE.get_or_init(|| {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            // Not input: the ring provider supports rustls' default versions.
            .expect("the ring provider supports TLS 1.2 and 1.3");
        Arc::new(builder.with_root_certificates(RootCertStore::empty()).with_no_client_auth())
    })
    .clone()
}

/// An `http://` and `https://` connector over `http` (which must not
/// enforce the http scheme); `config` absent: https URLs fail to connect.
pub fn connector(mut http: HttpConnector, config: Option<Arc<rustls::ClientConfig>>) -> HttpsConnector<HttpConnector> {
    http.enforce_http(false);
    let config = config.unwrap_or_else(trusts_nothing);
    HttpsConnectorBuilder::new().with_tls_config((*config).clone()).https_or_http().enable_http1().enable_http2().wrap_connector(http)
}
