//! Transport security (contract section 8) with rustls on the ring provider:
//! [`server`] terminates TLS on the proxy and admin listeners (ALPN, client
//! certificates, reload on SIGHUP); [`client`] is the one client
//! configuration for everything idemgate reaches over `https://`.
//!
//! PEM files are read here; every failure names the file, and configuration
//! adds the TOML path it came from.

pub mod client;
pub mod postgres;
pub mod server;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {}: {source}", file.display())]
    Read { file: PathBuf, source: std::io::Error },
    #[error("{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", file.display())]
    NoCertificate { file: PathBuf },
    #[error("{} holds no PEM private key (PKCS#8, PKCS#1 RSA or SEC1 EC)", file.display())]
    NoKey { file: PathBuf },
    #[error("{}: {detail}", file.display())]
    Invalid { file: PathBuf, detail: String },
    #[error("{0}")]
    Rustls(#[from] rustls::Error),
    #[error(
        "no system root certificates were found{detail}: install the system's CA certificates (Debian and Ubuntu: \
         apt-get install ca-certificates; the container image has them) or {remedy}"
    )]
    NoSystemRoots { detail: String, remedy: &'static str },
}

/// A problem with one of a TLS section's files; `key` is its TOML key.
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct LoadError {
    pub key: &'static str,
    pub error: TlsError,
}

fn at(key: &'static str) -> impl FnOnce(TlsError) -> LoadError {
    move |error| LoadError { key, error }
}

/// The process's one crypto provider (ring), named explicitly so that no
/// dependency's feature choice can make rustls' default ambiguous.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(file: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(file).map_err(|source| TlsError::Read { file: file.to_owned(), source })
}

/// Every certificate in a PEM file, in order (a chain: leaf first).
pub fn certificates(file: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(file)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Invalid { file: file.to_owned(), detail: e.to_string() })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { file: file.to_owned() });
    }
    Ok(certs)
}

/// The first private key in a PEM file (PKCS#8 — RSA, ECDSA or Ed25519 —,
/// PKCS#1 RSA or SEC1 EC).
pub fn private_key(file: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let pem = read(file)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey { file: file.to_owned() },
        e => TlsError::Invalid { file: file.to_owned(), detail: e.to_string() },
    })
}

/// A root store of every certificate in a PEM file.
pub fn roots(file: &Path) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    for cert in certificates(file)? {
        store.add(cert).map_err(|e| TlsError::Invalid { file: file.to_owned(), detail: format!("not a usable CA certificate: {e}") })?;
    }
    Ok(store)
}

/// What else fixes an empty trust store where the system roots are used:
/// the setting that names a CA of one's own there.
pub mod remedy {
    /// An upstream: its `ca_file`.
    pub const CA_FILE: &str = "set ca_file to your CA's PEM file";
    /// PostgreSQL: the connection string's `sslrootcert`.
    pub const SSLROOTCERT: &str = "add sslrootcert=<your CA's PEM file> to the connection string";
    /// Webhooks, JWKS URLs, authorizers: no setting of their own.
    pub const SSL_CERT_FILE: &str = "point SSL_CERT_FILE at a PEM bundle (this URL has no ca_file of its own)";
}

/// The system's root certificates (rustls-native-certs: the platform store,
/// or `SSL_CERT_FILE` / `SSL_CERT_DIR`). Unreadable entries are skipped; none
/// at all is an error that says to install the CA roots or, as `remedy`
/// (one of [`remedy`]), to name a CA file.
pub fn system_roots(remedy: &'static str) -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (_added, _ignored) = store.add_parsable_certificates(found.certs);
    if store.is_empty() {
        let detail = found.errors.first().map(|e| format!(" ({e})")).unwrap_or_default();
        return Err(TlsError::NoSystemRoots { detail, remedy });
    }
    Ok(store)
}

/// The end of a certificate's validity, in seconds since the epoch.
pub fn not_after(cert: &CertificateDer<'_>) -> Option<i64> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    Some(parsed.validity().not_after.timestamp())
}
