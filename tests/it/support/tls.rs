//! Test PKI and TLS clients: a private CA (rcgen) issuing server and client
//! certificates into a temporary directory, and HTTPS clients over HTTP/1.1
//! and HTTP/2 that trust only that CA.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair, SanType};
use rustls::pki_types::ServerName;

use super::client::Resp;

/// Which key algorithm a certificate is issued for.
#[derive(Debug, Clone, Copy)]
pub enum Alg {
    EcdsaP256,
    Ed25519,
    Rsa2048,
}

fn key_pair(alg: Alg) -> KeyPair {
    match alg {
        Alg::EcdsaP256 => KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("P-256 key"),
        Alg::Ed25519 => KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("Ed25519 key"),
        Alg::Rsa2048 => {
            use rsa::pkcs8::EncodePrivateKey;
            let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, 2048).expect("RSA key");
            let pem = key.to_pkcs8_pem(rsa::pkcs8::LineEnding::LF).expect("PKCS#8");
            KeyPair::from_pkcs8_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256).expect("RSA key pair")
        }
    }
}

/// A certificate and key written as PEM files.
#[derive(Debug, Clone)]
pub struct Issued {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A self-signed X.509 **version 1** certificate and its RSA key, made as
/// Citus makes its `citus-auto-ssl` certificate (and as `openssl x509 -req`
/// without extensions does): rcgen only issues version 3. Checked with
/// `openssl x509 -text`, so a change of openssl's default fails here.
pub fn version_1_self_signed(dir: &std::path::Path) -> Issued {
    let cert_file = dir.join("v1.crt");
    let key_file = dir.join("v1.key");
    let csr = dir.join("v1.csr");
    let run = |args: &[&std::ffi::OsStr]| {
        let out =
            std::process::Command::new("openssl").args(args).output().expect("openssl (the test makes a version 1 certificate with it)");
        assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    run(&[
        os("req"),
        os("-new"),
        os("-newkey"),
        os("rsa:2048"),
        os("-nodes"),
        os("-subj"),
        os("/CN=citus-auto-ssl"),
        os("-keyout"),
        key_file.as_os_str(),
        os("-out"),
        csr.as_os_str(),
    ]);
    run(&[
        os("x509"),
        os("-req"),
        os("-days"),
        os("365"),
        os("-in"),
        csr.as_os_str(),
        os("-signkey"),
        key_file.as_os_str(),
        os("-out"),
        cert_file.as_os_str(),
    ]);
    let text = run(&[os("x509"), os("-noout"), os("-text"), os("-in"), cert_file.as_os_str()]);
    assert!(text.contains("Version: 1 (0x0)"), "a version 1 certificate:\n{text}");
    let cert_pem = std::fs::read_to_string(&cert_file).expect("read the certificate");
    let key_pem = std::fs::read_to_string(&key_file).expect("read the key");
    Issued { cert_file, key_file, cert_pem, key_pem }
}

/// A private CA and the directory its files live in.
pub struct Pki {
    pub dir: tempfile::TempDir,
    pub ca_file: PathBuf,
    ca: Certificate,
    ca_key: KeyPair,
    n: std::sync::atomic::AtomicU32,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        let dir = tempfile::Builder::new().prefix("idemgate-pki-").tempdir().expect("tempdir");
        let key = key_pair(Alg::EcdsaP256);
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("CA certificate");
        let ca_file = dir.path().join("ca.pem");
        std::fs::write(&ca_file, cert.pem()).expect("write CA");
        Pki { dir, ca_file, ca: cert, ca_key: key, n: Default::default() }
    }

    fn issue(&self, params: CertificateParams, alg: Alg, name: &str) -> Issued {
        let key = key_pair(alg);
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).expect("sign");
        let n = self.n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cert_file = self.dir.path().join(format!("{name}-{n}.crt"));
        let key_file = self.dir.path().join(format!("{name}-{n}.key"));
        std::fs::write(&cert_file, cert.pem()).expect("write cert");
        std::fs::write(&key_file, key.serialize_pem()).expect("write key");
        Issued { cert_file, key_file, cert_pem: cert.pem(), key_pem: key.serialize_pem() }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, alg: Alg) -> Issued {
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params.subject_alt_names.push(SanType::IpAddress("127.0.0.1".parse().unwrap()));
        params.distinguished_name.push(DnType::CommonName, "localhost");
        self.issue(params, alg, "server")
    }

    /// A client certificate with this subject CN and optional SAN URI / DNS name.
    pub fn client(&self, cn: &str, uri: Option<&str>, dns: Option<&str>) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(DnType::CommonName, cn);
        if let Some(u) = uri {
            params.subject_alt_names.push(SanType::URI(u.try_into().expect("URI")));
        }
        if let Some(d) = dns {
            params.subject_alt_names.push(SanType::DnsName(d.try_into().expect("DNS name")));
        }
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        self.issue(params, Alg::EcdsaP256, "client")
    }

    /// A client configuration trusting this CA, optionally presenting `identity`.
    pub fn client_config(&self, identity: Option<&Issued>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_file_iter(&self.ca_file).expect("CA file") {
            roots.add(cert.expect("CA cert")).expect("add CA");
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots);
        let mut config = match identity {
            Some(id) => {
                use rustls::pki_types::pem::PemObject;
                let certs = rustls::pki_types::CertificateDer::pem_file_iter(&id.cert_file).unwrap().map(|c| c.unwrap()).collect();
                let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&id.key_file).unwrap();
                builder.with_client_auth_cert(certs, key).expect("client cert")
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

use rustls::pki_types::pem::PemObject;

/// A TLS connection to `addr` (server name `localhost`); the error is the handshake's.
pub async fn connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(config);
    tokio::time::timeout(Duration::from_secs(10), connector.connect(ServerName::try_from("localhost").unwrap(), tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timeout"))?
}

/// An HTTP/2 connection (ALPN `h2`): clone the sender for concurrent streams.
pub async fn h2(addr: SocketAddr, config: Arc<rustls::ClientConfig>) -> http2::SendRequest<Full<Bytes>> {
    let tls = connect(addr, config).await.expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "ALPN chose h2");
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls)).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    sender
}

/// One request on an HTTP/2 connection (`url` is absolute: https://localhost:port/path).
pub async fn h2_send(
    sender: &mut http2::SendRequest<Full<Bytes>>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Resp {
    let mut b = Request::builder().method(Method::from_bytes(method.as_bytes()).unwrap()).uri(url);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    sender.ready().await.expect("h2 connection ready");
    let resp = tokio::time::timeout(Duration::from_secs(60), sender.send_request(b.body(Full::new(body.into())).unwrap()))
        .await
        .expect("h2 response in time")
        .expect("h2 response");
    assert_eq!(resp.version(), http::Version::HTTP_2);
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("h2 body").to_bytes();
    Resp { status: parts.status.as_u16(), headers: parts.headers, body }
}

/// One HTTPS request over HTTP/1.1 on a fresh connection.
pub async fn h1_send(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<Resp, String> {
    let tls = connect(addr, config).await.map_err(|e| format!("handshake: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let mut b = Request::builder().method(Method::from_bytes(method.as_bytes()).unwrap()).uri(path).header("host", "localhost");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let resp = tokio::time::timeout(Duration::from_secs(60), sender.send_request(b.body(Full::new(body.into())).unwrap()))
        .await
        .map_err(|_| "timeout".to_owned())?
        .map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Resp { status: parts.status.as_u16(), headers: parts.headers, body })
}
