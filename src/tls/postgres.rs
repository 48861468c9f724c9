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
//!
//! `sslrootcert=system` (libpq 16+) verifies against the system's roots and
//! makes `verify-full` the default; a weaker `sslmode` with it is refused, as
//! libpq does. With `hostaddr` and no `host`, the address is the TLS name up
//! to `verify-ca`; `verify-full` then has no name to compare and is refused.
//! `target_session_attrs` takes libpq's values: `any`, `read-write` and
//! `primary` (the store always asks for read-write); `standby`, `read-only`
//! and `prefer-standby` are refused, as the store needs a writable primary.
//!
//! The rest of the string goes to tokio-postgres as written: a URL's other
//! query pairs byte for byte, key=value pairs read with libpq's grammar and
//! written again (quoted where needed).

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
    #[error(
        "sslmode={mode}{origin} may not be used with sslrootcert=system{root_origin} (as in libpq: anyone can get a \
         publicly trusted certificate for a name of their own, so only verify-full protects): use sslmode=verify-full, \
         or name your CA's file in sslrootcert"
    )]
    WeakWithSystemRoots {
        mode: String,
        origin: &'static str,
        /// `" (from PGSSLROOTCERT)"` when the environment gave it, else empty.
        root_origin: &'static str,
    },
    #[error(
        "sslmode=verify-full compares the certificate with the host name, and the connection string has only hostaddr: add host=<the name in the certificate>"
    )]
    NoHostName,
    #[error(
        "target_session_attrs={0:?}: the store writes, so it needs a writable primary (use read-write, primary or any; \
         idemgate always asks for read-write)"
    )]
    SessionAttrs(String),
    #[error("not a valid PostgreSQL connection string: {0}")]
    Syntax(&'static str),
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

/// libpq's `sslrootcert=system` (16+): the system's roots, and `verify-full` only.
const SYSTEM: &str = "system";

/// [`parse`], with the environment looked up through `env`.
pub fn parse_with(url: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<PgConnect, PgTlsError> {
    let Taken { rest, mode, root, session_attrs } = take_ssl_params(url)?;
    let from_env = |name: &str| env(name).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    let origin = if mode.is_none() { " (from PGSSLMODE)" } else { "" };
    let root_origin = if root.is_none() { " (from PGSSLROOTCERT)" } else { "" };
    let mode = mode.or_else(|| from_env("PGSSLMODE"));
    let root = root.or_else(|| from_env("PGSSLROOTCERT"));
    // As libpq 16: the system's roots make verify-full the default and refuse any weaker mode.
    let system = root.as_deref() == Some(SYSTEM);
    let written = mode.clone().unwrap_or_default();
    let mode = match mode.as_deref() {
        None if system => SslMode::VerifyFull,
        None | Some("prefer") => SslMode::Prefer,
        Some("disable") => SslMode::Disable,
        Some("require") if root.is_some() => SslMode::VerifyCa,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => return Err(PgTlsError::Mode { mode: other.to_owned(), origin }),
    };
    if system && mode != SslMode::VerifyFull {
        return Err(PgTlsError::WeakWithSystemRoots { mode: written, origin, root_origin });
    }
    // `system` names no file: `client_config` takes the system's roots where no file is given.
    let root = root.filter(|_| !system).map(PathBuf::from);
    let mut config: tokio_postgres::Config = rest.parse().map_err(PgTlsError::Config)?;
    match session_attrs.as_deref() {
        None => {}
        Some("any") => {
            config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::Any);
        }
        Some("read-write" | "primary") => {
            config.target_session_attrs(tokio_postgres::config::TargetSessionAttrs::ReadWrite);
        }
        Some(other) => return Err(PgTlsError::SessionAttrs(other.to_owned())),
    }
    // The TLS handshake needs a name; with only `hostaddr`, the address is
    // the name where nothing compares it with the certificate (as libpq).
    if config.get_hosts().is_empty() && !config.get_hostaddrs().is_empty() {
        match mode {
            SslMode::Disable => {}
            SslMode::Prefer | SslMode::Require | SslMode::VerifyCa => {
                for addr in config.get_hostaddrs().to_vec() {
                    config.host(addr.to_string());
                }
            }
            SslMode::VerifyFull => return Err(PgTlsError::NoHostName),
        }
    }
    let tls = match mode {
        SslMode::Disable => {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
            None
        }
        SslMode::Prefer => {
            config.ssl_mode(tokio_postgres::config::SslMode::Prefer);
            Some(client_config(mode, None).map_err(PgTlsError::Roots)?)
        }
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            config.ssl_mode(tokio_postgres::config::SslMode::Require);
            Some(client_config(mode, root).map_err(PgTlsError::Roots)?)
        }
    };
    Ok(PgConnect { config, mode, tls })
}

/// `root`: a CA file; `None`: the system's roots.
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

/// What [`take_ssl_params`] takes out of a connection string.
#[derive(Debug, PartialEq, Eq)]
struct Taken {
    /// The string without them, for tokio-postgres's parser.
    rest: String,
    mode: Option<String>,
    root: Option<String>,
    /// libpq's spellings, which tokio-postgres does not all know.
    session_attrs: Option<String>,
}

/// Removes `sslmode`, `sslrootcert` and `target_session_attrs` from a
/// connection string, returning the rest and their values. Errors name no
/// value: the string may hold a password.
fn take_ssl_params(url: &str) -> Result<Taken, PgTlsError> {
    let mut taken = Taken { rest: String::new(), mode: None, root: None, session_attrs: None };
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    if is_url {
        // tokio-postgres percent-decodes keys and values (never `+`): the
        // pairs it is given are left exactly as written.
        let Some((base, query)) = url.split_once('?') else {
            return Ok(Taken { rest: url.to_owned(), ..taken });
        };
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|s| s.into_owned())
                .map_err(|_| PgTlsError::Syntax("a query parameter is not percent-encoded UTF-8"))
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            match &*decode(key).unwrap_or_default() {
                "sslmode" => taken.mode = Some(decode(value)?),
                "sslrootcert" => taken.root = Some(decode(value)?),
                "target_session_attrs" => taken.session_attrs = Some(decode(value)?),
                _ => kept.push(pair),
            }
        }
        taken.rest = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
        return Ok(taken);
    }
    let mut rest = Vec::new();
    for (key, value) in key_value_pairs(url)? {
        match key {
            "sslmode" => taken.mode = Some(value),
            "sslrootcert" => taken.root = Some(value),
            "target_session_attrs" => taken.session_attrs = Some(value),
            _ => rest.push(format!("{key}={}", quoted(&value))),
        }
    }
    taken.rest = rest.join(" ");
    Ok(taken)
}

/// C's `isspace`, which libpq's parser uses.
fn is_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}

/// libpq's key=value grammar (`conninfo_parse`): pairs separated by
/// whitespace, `key [ws] = [ws] value`, the value bare up to whitespace or
/// in single quotes, a backslash taking the next character as it is in both.
fn key_value_pairs(s: &str) -> Result<Vec<(&str, String)>, PgTlsError> {
    let mut pairs = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start_matches(is_space);
        if rest.is_empty() {
            return Ok(pairs);
        }
        let end = rest.find(|c: char| c == '=' || is_space(c)).unwrap_or(rest.len());
        let key = &rest[..end];
        rest = rest[end..].trim_start_matches(is_space);
        let Some(after) = rest.strip_prefix('=') else {
            return Err(PgTlsError::Syntax("a key is not followed by \"=\" (a value with spaces is written in quotes: key='a value')"));
        };
        if key.is_empty() {
            return Err(PgTlsError::Syntax("\"=\" with no key before it"));
        }
        rest = after.trim_start_matches(is_space);
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let quoted = rest.starts_with('\'');
        if quoted {
            chars.next();
        }
        let mut end = rest.len();
        let mut closed = !quoted;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, c)| c)),
                '\'' if quoted => {
                    (end, closed) = (i + 1, true);
                    break;
                }
                c if !quoted && is_space(c) => {
                    end = i;
                    break;
                }
                c => value.push(c),
            }
        }
        if !closed {
            return Err(PgTlsError::Syntax("a quoted value has no closing quote"));
        }
        rest = &rest[end..];
        pairs.push((key, value));
    }
}

/// A value as tokio-postgres's parser reads it back: bare when it can be,
/// else in single quotes with `'` and `\` escaped.
fn quoted(value: &str) -> std::borrow::Cow<'_, str> {
    if !value.is_empty() && !value.contains(|c: char| c.is_whitespace() || c == '\'' || c == '\\') {
        return value.into();
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('\'');
    for c in value.chars() {
        if c == '\'' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('\'');
    out.into()
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
        let Taken { rest, mode, root, .. } =
            take_ssl_params("postgres://u@db:5432/x?sslmode=verify-full&sslrootcert=/ca.pem&application_name=a").unwrap();
        assert_eq!(rest, "postgres://u@db:5432/x?application_name=a");
        assert_eq!(mode.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/ca.pem"));
        let Taken { rest, mode, root, .. } = take_ssl_params("host=db user=u sslmode=verify-ca sslrootcert=/ca.pem dbname=x").unwrap();
        assert_eq!(rest, "host=db user=u dbname=x");
        assert_eq!((mode.as_deref(), root.as_deref()), (Some("verify-ca"), Some("/ca.pem")));
        let Taken { rest, mode, .. } = take_ssl_params("postgres://u@db/x").unwrap();
        assert_eq!((rest.as_str(), mode), ("postgres://u@db/x", None));
        // Every other pair as it was written, a quoted value quoted again.
        let Taken { rest, .. } = take_ssl_params("postgres://u@db/x?options=a+b%20c&sslmode=require&&x=%2B").unwrap();
        assert_eq!(rest, "postgres://u@db/x?options=a+b%20c&&x=%2B");
        let Taken { rest, .. } = take_ssl_params("host = db\tapplication_name='a b' sslmode=require password='it\\'s\\\\'").unwrap();
        assert_eq!(rest, "host=db application_name='a b' password='it\\'s\\\\'");
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

    /// No environment: what the string says alone.
    fn no_env(_: &str) -> Option<String> {
        None
    }

    /// The error a string must give, as the user reads it.
    fn refused(r: Result<PgConnect, PgTlsError>) -> String {
        match r {
            Ok(c) => panic!("parsed, sslmode {:?}", c.mode),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn key_value_strings_are_read_with_libpq_grammar() {
        for s in [
            "host=db sslmode = require user=u",
            "host=db\nuser=u\nsslmode=require",
            "host=db\tuser=u\r\n sslmode= require",
            "host=db user=u sslmode='require'",
        ] {
            let c = parse_with(s, &no_env).unwrap_or_else(|e| panic!("{s:?}: {e}"));
            assert_eq!(c.mode, SslMode::Require, "{s:?}");
            assert_eq!(c.config.get_user(), Some("u"), "{s:?}");
        }
        let c =
            parse_with(r"host=db sslmode=require application_name='idemgate eu' password='it\'s a \\secret' dbname=a\ b", &no_env).unwrap();
        assert_eq!(c.config.get_application_name(), Some("idemgate eu"));
        assert_eq!(c.config.get_password(), Some(&br"it's a \secret"[..]));
        assert_eq!(c.config.get_dbname(), Some("a b"));
        let e = refused(parse_with("host=db sslmode=verify-full sslrootcert='/no such dir/ca.pem'", &no_env));
        assert!(e.contains("/no such dir/ca.pem"), "{e}");
    }

    #[test]
    fn malformed_key_value_strings_are_errors_never_panics() {
        for s in [
            "host=db sslmode='require",
            "host=db sslmode",
            "host=db password=two words",
            "=x",
            "host=db '",
            "host=db \\",
            "host=db sslmode=",
            "sslmode = ",
        ] {
            let e = refused(parse_with(s, &no_env));
            assert!(!e.contains("words"), "a value is never repeated: {e}");
        }
        for s in ["", " ", "=", "'", "\\", "a\\", "a='\\", "a = 'b' = c", "sslrootcert='", "target_session_attrs"] {
            let _ = parse_with(s, &no_env);
        }
    }

    #[test]
    fn url_query_pairs_other_than_the_taken_ones_are_kept_as_written() {
        let c =
            parse_with("postgres://u@db/x?application_name=idemgate%20eu&sslmode=require&options=a+b&password=p%20w%2Bx", &no_env).unwrap();
        assert_eq!(c.mode, SslMode::Require);
        assert_eq!(c.config.get_application_name(), Some("idemgate eu"));
        assert_eq!(c.config.get_options(), Some("a+b"), "tokio-postgres does not read + as a space");
        assert_eq!(c.config.get_password(), Some(&b"p w+x"[..]));
        let e = refused(parse_with("postgres://u@db/x?sslmode=verify%2Dfull&sslrootcert=%2Fno%20such%2Fca.pem", &no_env));
        assert!(e.contains("/no such/ca.pem"), "{e}");
        let e = refused(parse_with("postgres://u@db/x?sslmode=verify-full&sslrootcert=/no/a+b.pem", &no_env));
        assert!(e.contains("/no/a+b.pem"), "+ is not a space: {e}");
        assert!(parse_with("postgres://u@db/x?sslmode=%FF", &no_env).is_err());
    }

    /// `sslrootcert=system` either loads the system roots or says there are none; it never reads a file named `system`.
    fn system_roots_or_none(r: Result<PgConnect, PgTlsError>) -> Option<SslMode> {
        match r {
            Ok(c) => Some(c.mode),
            Err(e) => {
                assert!(e.to_string().contains("no system root certificates"), "{e}");
                None
            }
        }
    }

    #[test]
    fn sslrootcert_system_uses_the_system_roots_and_only_verify_full() {
        for s in [
            "postgres://u@db/x?sslrootcert=system",
            "postgres://u@db/x?sslrootcert=system&sslmode=verify-full",
            "host=db sslrootcert=system",
        ] {
            assert!(matches!(system_roots_or_none(parse_with(s, &no_env)), None | Some(SslMode::VerifyFull)), "{s}");
        }
        let env = |mode: Option<&'static str>| {
            move |name: &str| match name {
                "PGSSLROOTCERT" => Some("system".to_owned()),
                "PGSSLMODE" => mode.map(str::to_owned),
                _ => None,
            }
        };
        assert!(matches!(system_roots_or_none(parse_with("postgres://u@db/x", &env(None))), None | Some(SslMode::VerifyFull)));
        for mode in ["disable", "prefer", "require", "verify-ca"] {
            let e = refused(parse_with(&format!("postgres://u@db/x?sslrootcert=system&sslmode={mode}"), &no_env));
            assert!(e.contains("sslrootcert=system") && e.contains("verify-full"), "{e}");
            let e = refused(parse_with(&format!("host=db sslmode={mode} sslrootcert=system"), &no_env));
            assert!(e.contains("sslrootcert=system") && e.contains("verify-full"), "{e}");
            let e = refused(parse_with("postgres://u@db/x", &env(Some(mode))));
            assert!(e.contains("sslrootcert=system") && e.contains("PGSSLMODE"), "{e}");
        }
    }

    #[test]
    fn an_address_without_a_host_name_is_the_tls_name_except_for_verify_full() {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), ca.self_signed(&key).unwrap().pem()).unwrap();
        let root = file.path().display();
        for s in [
            "hostaddr=127.0.0.1 user=u sslmode=require".to_owned(),
            format!("hostaddr=127.0.0.1 user=u sslmode=verify-ca sslrootcert={root}"),
        ] {
            let c = parse_with(&s, &no_env).unwrap();
            assert_eq!(c.config.get_hosts(), &[tokio_postgres::config::Host::Tcp("127.0.0.1".into())], "{s}");
        }
        let e = refused(parse_with(&format!("hostaddr=127.0.0.1 user=u sslmode=verify-full sslrootcert={root}"), &no_env));
        assert!(e.contains("verify-full") && e.contains("host"), "{e}");
        let c = parse_with(&format!("host=db.internal hostaddr=127.0.0.1 user=u sslmode=verify-full sslrootcert={root}"), &no_env).unwrap();
        assert_eq!(c.config.get_hosts(), &[tokio_postgres::config::Host::Tcp("db.internal".into())]);
    }

    #[test]
    fn target_session_attrs_takes_libpq_spellings_and_refuses_standbys() {
        use tokio_postgres::config::TargetSessionAttrs;
        for (value, attrs) in
            [("any", TargetSessionAttrs::Any), ("read-write", TargetSessionAttrs::ReadWrite), ("primary", TargetSessionAttrs::ReadWrite)]
        {
            for s in [format!("postgres://u@db/x?target_session_attrs={value}"), format!("host=db target_session_attrs = {value}")] {
                let c = parse_with(&s, &no_env).unwrap_or_else(|e| panic!("{s}: {e}"));
                assert_eq!(c.config.get_target_session_attrs(), attrs, "{s}");
            }
        }
        for value in ["standby", "read-only", "prefer-standby"] {
            for s in [format!("postgres://u@db/x?target_session_attrs={value}"), format!("host=db target_session_attrs={value}")] {
                let e = refused(parse_with(&s, &no_env));
                assert!(e.contains("writable primary") && e.contains(value), "{e}");
            }
        }
        let e = refused(parse_with("host=db target_session_attrs=sometimes", &no_env));
        assert!(e.contains("target_session_attrs"), "{e}");
    }
}
