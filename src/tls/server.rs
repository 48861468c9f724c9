//! TLS on a listener: the settings of `[server.tls]` / `[admin.tls]`, the
//! rustls server configuration built from them, swapped whole on SIGHUP
//! (connections already open keep the configuration they were accepted
//! with), and the handshake with its own deadline.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::server::WebPkiClientVerifier;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

pub use super::LoadError;
use super::{TlsError, at, certificates, not_after, private_key, provider, roots};

/// Whether (and how) the listener asks for client certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// No `client_ca_file`: no certificate is asked for.
    Off,
    /// A certificate is verified when presented; clients without one are served.
    Optional,
    /// The handshake fails without a certificate the CA signed.
    Required,
}

/// `[server.tls]` or `[admin.tls]` after validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub client_ca_file: Option<PathBuf>,
    pub client_auth: ClientAuth,
    /// A client must finish the handshake within this time.
    pub handshake_timeout: Duration,
}

/// A rustls server configuration from the settings: TLS 1.2 and 1.3 with
/// rustls' safe defaults (no renegotiation exists in rustls), `alpn` offered
/// in order.
pub fn build(settings: &ListenerTls, alpn: &[&[u8]]) -> Result<(Arc<rustls::ServerConfig>, Option<i64>), LoadError> {
    let chain = certificates(&settings.cert_file).map_err(at("cert_file"))?;
    let key = private_key(&settings.key_file).map_err(at("key_file"))?;
    let expires = chain.first().and_then(not_after);
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| at("cert_file")(e.into()))?;
    let builder = match (&settings.client_ca_file, settings.client_auth) {
        (Some(ca), ClientAuth::Optional | ClientAuth::Required) => {
            let roots = Arc::new(roots(ca).map_err(at("client_ca_file"))?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider());
            let verifier = if settings.client_auth == ClientAuth::Optional { verifier.allow_unauthenticated() } else { verifier };
            let verifier =
                verifier.build().map_err(|e| at("client_ca_file")(TlsError::Invalid { file: ca.clone(), detail: e.to_string() }))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        at("key_file")(TlsError::Invalid {
            file: settings.key_file.clone(),
            detail: format!("does not fit the certificate in {}: {e}", settings.cert_file.display()),
        })
    })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok((Arc::new(config), expires))
}

/// A listener's TLS side: the current configuration, replaced by [`reload`](Self::reload).
#[derive(Debug)]
pub struct TlsListener {
    /// `proxy` or `admin`, for logs and metrics.
    pub name: &'static str,
    pub settings: ListenerTls,
    alpn: Vec<&'static [u8]>,
    current: RwLock<Arc<rustls::ServerConfig>>,
    /// The certificate's notAfter (seconds since the epoch; 0: unknown).
    expires: AtomicI64,
}

/// Why a handshake did not complete, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandshakeFailure {
    /// Not finished within `handshake_timeout`.
    Timeout,
    /// mTLS required and no certificate was presented.
    NoClientCertificate,
    /// A presented certificate (ours, by the client, or theirs) was refused.
    BadCertificate,
    /// No protocol version, cipher suite or ALPN protocol in common.
    Incompatible,
    /// The client closed the connection during the handshake.
    Closed,
    /// Anything else (not TLS at all, malformed messages, I/O errors).
    Protocol,
}

impl HandshakeFailure {
    pub const ALL: [HandshakeFailure; 6] = [
        HandshakeFailure::Timeout,
        HandshakeFailure::NoClientCertificate,
        HandshakeFailure::BadCertificate,
        HandshakeFailure::Incompatible,
        HandshakeFailure::Closed,
        HandshakeFailure::Protocol,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            HandshakeFailure::Timeout => "timeout",
            HandshakeFailure::NoClientCertificate => "no_client_certificate",
            HandshakeFailure::BadCertificate => "bad_certificate",
            HandshakeFailure::Incompatible => "incompatible",
            HandshakeFailure::Closed => "closed",
            HandshakeFailure::Protocol => "protocol",
        }
    }

    fn of(e: &std::io::Error) -> HandshakeFailure {
        if e.kind() == std::io::ErrorKind::UnexpectedEof || e.kind() == std::io::ErrorKind::ConnectionReset {
            return HandshakeFailure::Closed;
        }
        match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
            Some(rustls::Error::NoCertificatesPresented) => HandshakeFailure::NoClientCertificate,
            Some(rustls::Error::InvalidCertificate(_)) => HandshakeFailure::BadCertificate,
            Some(rustls::Error::AlertReceived(alert)) => match alert {
                rustls::AlertDescription::BadCertificate
                | rustls::AlertDescription::UnknownCA
                | rustls::AlertDescription::CertificateExpired
                | rustls::AlertDescription::CertificateUnknown
                | rustls::AlertDescription::UnsupportedCertificate
                | rustls::AlertDescription::CertificateRevoked => HandshakeFailure::BadCertificate,
                rustls::AlertDescription::ProtocolVersion
                | rustls::AlertDescription::HandshakeFailure
                | rustls::AlertDescription::NoApplicationProtocol => HandshakeFailure::Incompatible,
                _ => HandshakeFailure::Protocol,
            },
            Some(rustls::Error::PeerIncompatible(_) | rustls::Error::NoApplicationProtocol) => HandshakeFailure::Incompatible,
            _ => HandshakeFailure::Protocol,
        }
    }
}

/// The verified client certificate of a connection, as identity sources read
/// it (request extension). Only certificates rustls verified against
/// `client_ca_file` ever become one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClientCertificate {
    pub san_uris: Vec<String>,
    pub san_dns: Vec<String>,
    pub subject_cn: Option<String>,
}

impl ClientCertificate {
    fn parse(der: &[u8]) -> Option<ClientCertificate> {
        use x509_parser::extensions::GeneralName;
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let mut out = ClientCertificate::default();
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::URI(u) => out.san_uris.push((*u).to_owned()),
                    GeneralName::DNSName(d) => out.san_dns.push((*d).to_owned()),
                    _ => {}
                }
            }
        }
        out.subject_cn = cert.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).map(str::to_owned);
        Some(out)
    }
}

/// What a completed handshake hands to the connection.
pub struct Accepted {
    pub stream: TlsStream<TcpStream>,
    /// `true` when ALPN chose `h2`.
    pub h2: bool,
    pub client: Option<Arc<ClientCertificate>>,
}

impl TlsListener {
    /// The TOML section of a listener's settings (`proxy`: `server`).
    pub fn section_of(listener: &str) -> &'static str {
        if listener == "admin" { "admin" } else { "server" }
    }

    /// Reads the files and builds the first configuration.
    pub fn new(name: &'static str, settings: ListenerTls, alpn: Vec<&'static [u8]>) -> Result<TlsListener, LoadError> {
        let (config, expires) = build(&settings, &alpn)?;
        Ok(TlsListener { name, settings, alpn, current: RwLock::new(config), expires: AtomicI64::new(expires.unwrap_or(0)) })
    }

    /// Reads the files again; on success new connections use the new
    /// certificate (open ones keep theirs), on failure nothing changes.
    pub fn reload(&self) -> Result<(), LoadError> {
        let (config, expires) = build(&self.settings, &self.alpn)?;
        match self.current.write() {
            Ok(mut current) => *current = config,
            Err(poisoned) => *poisoned.into_inner() = config,
        }
        self.expires.store(expires.unwrap_or(0), Ordering::Relaxed);
        Ok(())
    }

    /// The served certificate's notAfter (seconds since the epoch), if known.
    /// Whether the listener offers HTTP/2 (by ALPN).
    pub fn speaks_h2(&self) -> bool {
        self.alpn.contains(&&b"h2"[..])
    }

    pub fn expires(&self) -> Option<i64> {
        Some(self.expires.load(Ordering::Relaxed)).filter(|t| *t != 0)
    }

    fn acceptor(&self) -> TlsAcceptor {
        match self.current.read() {
            Ok(c) => TlsAcceptor::from(c.clone()),
            Err(poisoned) => TlsAcceptor::from(poisoned.into_inner().clone()),
        }
    }

    /// The TLS handshake, bounded by `handshake_timeout`: a client that
    /// stalls here never reaches a request, let alone a claim.
    pub async fn handshake(&self, sock: TcpStream) -> Result<Accepted, (HandshakeFailure, String)> {
        let accepting = self.acceptor().accept(sock);
        let stream = match tokio::time::timeout(self.settings.handshake_timeout, accepting).await {
            Err(_) => return Err((HandshakeFailure::Timeout, format!("no handshake within {:?}", self.settings.handshake_timeout))),
            Ok(Err(e)) => return Err((HandshakeFailure::of(&e), e.to_string())),
            Ok(Ok(s)) => s,
        };
        let conn = stream.get_ref().1;
        let h2 = conn.alpn_protocol() == Some(b"h2");
        let client = conn.peer_certificates().and_then(|c| c.first()).and_then(|c| ClientCertificate::parse(c.as_ref())).map(Arc::new);
        Ok(Accepted { stream, h2, client })
    }
}
