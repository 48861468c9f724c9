//! PostgreSQL over TLS: the connection string's `sslmode` and `sslrootcert`
//! as libpq reads them, honoured with rustls (tokio-postgres-rustls).
//!
//! tokio-postgres itself knows `disable`, `prefer` and `require` and refuses
//! other keys; this module takes `sslmode` and `sslrootcert` out of the
//! string (when absent there, from `PGSSLMODE` and `PGSSLROOTCERT`, as
//! libpq does), hands tokio-postgres the mode it knows, and builds the
//! certificate check the mode asks for:
//! - `disable`: plaintext;
//! - `prefer` (the default): TLS is asked for and used when the server
//!   offers it, plaintext when it does not; the certificate is not checked
//!   (as in libpq: any certificate, of any X.509 version, self-signed ones
//!   included; the handshake's signature is checked against its key). Unlike libpq, a handshake that fails after the server
//!   agreed to TLS is not retried in plaintext;
//! - `require`: encrypted; the certificate is not checked (as in libpq),
//!   unless `sslrootcert` is given, which makes it `verify-ca` (as in libpq);
//! - `verify-ca`: the chain must lead to `sslrootcert` (else the system
//!   roots); the host name is not compared;
//! - `verify-full`: the chain and the host name.
//!
//! libpq's `allow` is not supported (it is refused, naming the modes that are).

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, SubjectPublicKeyInfoDer, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::{LoadError, at, provider, roots, system_roots};

/// `sslmode` as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

#[derive(Debug, thiserror::Error)]
pub enum PgTlsError {
    #[error("unknown sslmode {mode:?}{origin} (use disable, prefer, require, verify-ca or verify-full; allow is not supported)")]
    Mode {
        mode: String,
        /// `" (from PGSSLMODE)"` when the environment gave it, else empty.
        origin: &'static str,
    },
    #[error("sslrootcert: {0}")]
    Roots(LoadError),
    #[error("{0}")]
    Config(tokio_postgres::Error),
}

/// A parsed connection string and, when TLS is wanted, its client configuration.
pub struct PgConnect {
    pub config: tokio_postgres::Config,
    pub mode: SslMode,
    pub tls: Option<rustls::ClientConfig>,
}

/// Parses a connection string (URL or key=value pairs); `PGSSLMODE` and
/// `PGSSLROOTCERT` from the process's environment apply when it has no
/// `sslmode` / `sslrootcert`.
pub fn parse(url: &str) -> Result<PgConnect, PgTlsError> {
    parse_with(url, &|name| std::env::var(name).ok())
}

/// [`parse`], with the environment looked up through `env`.
pub fn parse_with(url: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<PgConnect, PgTlsError> {
    let (rest, mode, root) = take_ssl_params(url);
    let from_env = |name: &str| env(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    let origin = if mode.is_none() { " (from PGSSLMODE)" } else { "" };
    let mode = mode.or_else(|| from_env("PGSSLMODE"));
    let root = root.or_else(|| from_env("PGSSLROOTCERT").map(PathBuf::from));
    let mode = match mode.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        Some("require") if root.is_some() => SslMode::VerifyCa,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => return Err(PgTlsError::Mode { mode: other.to_owned(), origin }),
    };
    let mut config: tokio_postgres::Config = rest.parse().map_err(PgTlsError::Config)?;
    let tls = match mode {
        SslMode::Disable => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            None
        }
        SslMode::Prefer => {
            config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
            // The TLS handshake needs a name; with only `hostaddr`, the
            // address is the name (nothing checks it in this mode).
            if config.get_hosts().is_empty() {
                for addr in config.get_hostaddrs().to_vec() {
                    config.host(addr.to_string());
                }
            }
            Some(client_config(mode, None).map_err(PgTlsError::Roots)?)
        }
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            Some(client_config(mode, root).map_err(PgTlsError::Roots)?)
        }
    };
    Ok(PgConnect { config, mode, tls })
}

fn client_config(mode: SslMode, root: Option<PathBuf>) -> Result<rustls::ClientConfig, LoadError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| at("sslrootcert")(e.into()))?;
    let roots = |root: Option<PathBuf>| -> Result<RootCertStore, LoadError> {
        match root {
            Some(file) => roots(&file).map_err(at("sslrootcert")),
            None => system_roots(super::remedy::SSLROOTCERT).map_err(at("sslrootcert")),
        }
    };
    let config = match mode {
        SslMode::VerifyFull => builder.with_root_certificates(roots(root)?).with_no_client_auth(),
        SslMode::VerifyCa => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots(root)?), provider())
                .build()
                .map_err(|e| at("sslrootcert")(super::TlsError::Rustls(rustls::Error::General(e.to_string()))))?;
            builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly(inner))).with_no_client_auth()
        }
        _ => builder.dangerous().with_custom_certificate_verifier(Arc::new(Unchecked(provider()))).with_no_client_auth(),
    };
    Ok(config)
}

/// Removes `sslmode` and `sslrootcert` from a connection string, returning
/// the rest and their values.
fn take_ssl_params(url: &str) -> (String, Option<String>, Option<PathBuf>) {
    let (mut mode, mut root) = (None, None);
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if is_url {
        let Some((base, query)) = url.split_once('?') else { return (url.to_owned(), None, None) };
        let mut kept = form_urlencoded::Serializer::new(String::new());
        for (k, v) in form_urlencoded::parse(query.as_bytes()) {
            match &*k {
                "sslmode" => mode = Some(v.into_owned()),
                "sslrootcert" => root = Some(PathBuf::from(v.into_owned())),
                _ => {
                    kept.append_pair(&k, &v);
                }
            }
        }
        let kept = kept.finish();
        let rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{kept}") };
        return (rest, mode, root);
    }
    // key=value pairs: values of these two keys hold no spaces or quotes.
    let mut rest = Vec::new();
    for token in url.split(' ') {
        match token.split_once('=') {
            Some(("sslmode", v)) => mode = Some(v.to_owned()),
            Some(("sslrootcert", v)) => root = Some(PathBuf::from(v)),
            _ => rest.push(token),
        }
    }
    (rest.join(" "), mode, root)
}

/// `verify-ca`: the chain is verified, the host name is not.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain before the name: a name error means the chain is good.
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. })) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `prefer`, and `require` without `sslrootcert`: encryption only, as in
/// libpq. Whatever certificate the server presents is taken, of any X.509
/// version (webpki reads only version 3; PostgreSQL's own self-signed
/// certificates, Citus's `citus-auto-ssl` among them, are version 1), but
/// the handshake's signature is still checked against the public key the
/// certificate presents, so the peer holds that certificate's key.
#[derive(Debug)]
struct Unchecked(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // As rustls's own check: TLS 1.2 names a scheme that maps to several
        // algorithms; the first that fits the key decides.
        let spki = presented_key(cert)?;
        let key = webpki::RawPublicKeyEntity::try_from(&spki).map_err(key_error)?;
        let candidates = self.0.signature_verification_algorithms.mapping.iter().find(|(scheme, _)| *scheme == dss.scheme);
        let Some((_, algorithms)) = candidates else {
            return Err(rustls::PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme.into());
        };
        let mut unfit = None;
        for algorithm in *algorithms {
            match key.verify_signature(*algorithm, message, dss.signature()) {
                Err(e @ webpki::Error::UnsupportedSignatureAlgorithmForPublicKeyContext(_)) => unfit = Some(e),
                Err(e) => return Err(key_error(e)),
                Ok(()) => return Ok(HandshakeSignatureValid::assertion()),
            }
        }
        Err(unfit.map_or(rustls::PeerMisbehaved::SignedHandshakeWithUnadvertisedSigScheme.into(), key_error))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        let spki = presented_key(cert)?;
        rustls::crypto::verify_tls13_signature_with_raw_key(message, &spki, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// The public key (SubjectPublicKeyInfo, DER) of a certificate of any X.509
/// version, read with x509-parser.
fn presented_key<'a>(cert: &'a CertificateDer<'_>) -> Result<SubjectPublicKeyInfoDer<'a>, rustls::Error> {
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert.as_ref()).map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    Ok(SubjectPublicKeyInfoDer::from(parsed.tbs_certificate.subject_pki.raw))
}

fn key_error(e: webpki::Error) -> rustls::Error {
    match e {
        webpki::Error::InvalidSignatureForPublicKey => rustls::Error::InvalidCertificate(CertificateError::BadSignature),
        other => rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(other)))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssl_parameters_are_taken_out_of_both_forms() {
        let (rest, mode, root) = take_ssl_params("postgres://u@db:5432/x?sslmode=verify-full&sslrootcert=/ca.pem&application_name=a");
        assert_eq!(rest, "postgres://u@db:5432/x?application_name=a");
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root, Some(PathBuf::from("/ca.pem")));
        let (rest, mode, root) = take_ssl_params("host=db user=u sslmode=verify-ca sslrootcert=/ca.pem dbname=x");
        assert_eq!(rest, "host=db user=u dbname=x");
        assert_eq!((mode.as_deref(), root), (Some("verify-ca"), Some(PathBuf::from("/ca.pem"))));
        let (rest, mode, _) = take_ssl_params("postgres://u@db/x");
        assert_eq!((rest.as_str(), mode), ("postgres://u@db/x", None));
    }

    #[test]
    fn pgsslmode_applies_when_the_string_has_no_sslmode() {
        let env = |mode: &'static str| move |name: &str| (name == "PGSSLMODE").then(|| mode.to_owned());
        assert_eq!(parse_with("postgres://u@db/x", &env("require")).unwrap().mode, SslMode::Require);
        assert_eq!(parse_with("postgres://u@db/x", &env("disable")).unwrap().mode, SslMode::Disable);
        assert_eq!(parse_with("postgres://u@db/x?sslmode=disable", &env("require")).unwrap().mode, SslMode::Disable);
        assert!(matches!(parse_with("postgres://u@db/x", &env("allow")), Err(PgTlsError::Mode { .. })));
        let roots = |name: &str| match name {
            "PGSSLMODE" => Some("verify-full".to_owned()),
            "PGSSLROOTCERT" => Some("/nonexistent/env-ca.pem".to_owned()),
            _ => None,
        };
        match parse_with("postgres://u@db/x", &roots) {
            Err(PgTlsError::Roots(e)) => assert!(e.to_string().contains("/nonexistent/env-ca.pem"), "{e}"),
            other => panic!("{:?}", other.map(|c| c.mode)),
        }
    }

    /// A self-signed X.509 version 1 certificate (P-256) and its key, made
    /// with `openssl x509 -req -signkey` (no extensions: version 1).
    const V1_CERT: &str = "-----BEGIN CERTIFICATE-----
MIIBJjCBzQIUZBPbVTsKCyN0wwdDphT79pVyV8kwCgYIKoZIzj0EAwIwFTETMBEG
A1UEAwwKdjEtZml4dHVyZTAgFw0yNjEyMDQxODM3NTVaGA8yMTI2MTExMDE4Mzc1
NVowFTETMBEGA1UEAwwKdjEtZml4dHVyZTBZMBMGByqGSM49AgEGCCqGSM49AwEH
A0IABDfN4ZGWoWIdP+j2jTKnknaO0KrPgFny9KxNCx7t0aYnYmc3m5k/iyqZlC/0
m85A+njUumJcETOImyY4AV5Mvm8wCgYIKoZIzj0EAwIDSAAwRQIgR8yd7LBT+Qtb
h9xGwVqVzJEE4fhJZqkjUT4EQAaJi3cCIQC/M+8w4OvEZ/LxVJeO5F2HM1IzU5Dq
gj60Pui0W8WLfg==
-----END CERTIFICATE-----
";
    const V1_KEY: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgqpiz7Ej957vPhUjW
6sa5hioNExSlp5eY/xQIFYTHVyehRANCAAQ3zeGRlqFiHT/o9o0yp5J2jtCqz4BZ
8vSsTQse7dGmJ2JnN5uZP4sqmZQv9JvOQPp41LpiXBEziJsmOAFeTL5v
-----END PRIVATE KEY-----
";

    /// `prefer`/`require` take a version 1 certificate, but the handshake's
    /// signature must be made with its key: another message, or another
    /// key, is refused, under TLS 1.3 and TLS 1.2.
    #[test]
    fn signatures_are_checked_against_the_key_of_a_version_1_certificate() {
        use rustls::pki_types::PrivateKeyDer;
        use rustls::pki_types::pem::PemObject;
        let cert = CertificateDer::from_pem_slice(V1_CERT.as_bytes()).unwrap();
        assert!(webpki::EndEntityCert::try_from(&cert).is_err(), "webpki does not read version 1");
        let verifier = Unchecked(provider());
        let sign = |key: PrivateKeyDer<'static>, message: &[u8]| {
            let key = provider().key_provider.load_private_key(key).unwrap();
            let signer = key.choose_scheme(&[SignatureScheme::ECDSA_NISTP256_SHA256]).unwrap();
            // As the server's handshake message carries it: scheme, length, signature.
            let signature = signer.sign(message).unwrap();
            let mut wire = u16::from(signer.scheme()).to_be_bytes().to_vec();
            wire.extend(u16::try_from(signature.len()).unwrap().to_be_bytes());
            wire.extend(signature);
            <DigitallySignedStruct as rustls::internal::msgs::codec::Codec>::read_bytes(&wire).unwrap()
        };
        let own = || PrivateKeyDer::from_pem_slice(V1_KEY.as_bytes()).unwrap();
        let signed = sign(own(), b"handshake");
        assert!(verifier.verify_tls13_signature(b"handshake", &cert, &signed).is_ok());
        assert!(verifier.verify_tls12_signature(b"handshake", &cert, &signed).is_ok());
        assert!(verifier.verify_tls13_signature(b"another", &cert, &signed).is_err());
        assert!(verifier.verify_tls12_signature(b"another", &cert, &signed).is_err());
        let other = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let foreign = sign(PrivateKeyDer::from_pem_slice(other.serialize_pem().as_bytes()).unwrap(), b"handshake");
        assert!(verifier.verify_tls13_signature(b"handshake", &cert, &foreign).is_err(), "a key that is not the certificate's");
        assert!(verifier.verify_tls12_signature(b"handshake", &cert, &foreign).is_err(), "a key that is not the certificate's");
        assert!(verifier.verify_tls13_signature(b"handshake", &CertificateDer::from(&b"junk"[..]), &signed).is_err());
    }

    #[test]
    fn modes() {
        let prefer = parse("postgres://u@db/x").unwrap();
        assert_eq!(prefer.mode, SslMode::Prefer);
        assert!(prefer.tls.is_some(), "prefer tries TLS");
        assert_eq!(prefer.config.get_ssl_mode(), tokio_postgres::config::SslMode::Prefer);
        let by_address = parse("hostaddr=127.0.0.1 user=u").unwrap();
        assert_eq!(by_address.config.get_hosts().len(), 1, "the address names the TLS server");
        let require = parse("postgres://u@db/x?sslmode=require").unwrap();
        assert_eq!(require.mode, SslMode::Require);
        assert!(require.tls.is_some());
        assert_eq!(require.config.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert!(matches!(parse("postgres://u@db/x?sslmode=sometimes"), Err(PgTlsError::Mode { .. })));
        match parse("postgres://u@db/x?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem") {
            Err(PgTlsError::Roots(e)) => assert!(e.to_string().contains("/nonexistent/ca.pem"), "{e}"),
            other => panic!("{:?}", other.map(|c| c.mode)),
        }
    }
}
