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

/// A client configuration that trusts exactly one certificate, the leaf of
/// `cert_file`, whatever name it is reached by: for `idemgate healthcheck`,
/// which reaches its own admin listener on a loopback address its
/// certificate does not name. The certificate file is public (no key is
/// read); the handshake's signatures are still checked against that leaf.
pub fn pinned(cert_file: &std::path::Path) -> Result<Arc<rustls::ClientConfig>, super::TlsError> {
    let leaf = certificates(cert_file)?.into_iter().next().ok_or_else(|| super::TlsError::NoCertificate { file: cert_file.to_owned() })?;
    let provider = provider();
    let verifier = Arc::new(Pinned { leaf, algorithms: provider.signature_verification_algorithms });
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| super::TlsError::Invalid { file: cert_file.to_owned(), detail: e.to_string() })?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Arc::new(config))
}

/// [`pinned`]'s verifier: the server's certificate must be the pinned leaf.
#[derive(Debug)]
struct Pinned {
    leaf: rustls::pki_types::CertificateDer<'static>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        _intermediates: &[rustls::pki_types::CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.leaf.as_ref() {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
