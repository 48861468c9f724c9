//! Transport security on the real binary: HTTPS and HTTP/2 on the proxy
//! listener, the handshake deadline, certificate reload on SIGHUP, HTTPS on
//! the admin listener, and configuration errors naming file and TOML path.
//! Certificates come from a private CA generated per test (rcgen).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::process::Command;
use std::time::Duration;

use idemgate::idempotency::record::State;
use support::tls::{Alg, Issued, Pki, h1_send, h2, h2_send};
use support::*;
use tokio::io::AsyncReadExt;

on_both_stores!(h2_streams_of_one_key_over_one_connection_execute_once);

const ORDER: &str = r#"{"item":"book","qty":1}"#;

fn tls_section(section: &str, cert: &Issued, extra: &str) -> String {
    format!("[{section}.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n{extra}\n", cert.cert_file.display(), cert.key_file.display())
}

fn order_headers(key: &str) -> Vec<(&'static str, String)> {
    vec![
        ("authorization", "Bearer test-key".to_owned()),
        ("content-type", "application/json".to_owned()),
        ("idempotency-key", key.to_owned()),
    ]
}

fn borrowed<'a>(h: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    h.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// First, concurrent duplicates, replay and mismatch, all as streams of one
/// HTTP/2 connection: exactly one side effect.
async fn h2_streams_of_one_key_over_one_connection_execute_once(backend: Backend) {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).tail(&tls_section("server", &cert, "")));
    let store = backend.open().await;
    let url = format!("https://localhost:{}/v1/orders", gw.addr.port());
    let sender = h2(gw.addr, pki.client_config(None, &[b"h2", b"http/1.1"])).await;

    let headers = order_headers("k-h2");
    let mut streams = Vec::new();
    for _ in 0..10 {
        let (mut s, url, h) = (sender.clone(), url.clone(), headers.clone());
        streams.push(tokio::spawn(async move {
            let mut h = borrowed(&h);
            h.push(("x-test-sleep-ms", "300"));
            h2_send(&mut s, "POST", &url, &h, ORDER).await
        }));
    }
    let mut forwarded = 0;
    for s in streams {
        let r = s.await.unwrap();
        match r.status {
            201 if r.replayed() => {}
            201 => forwarded += 1,
            409 => assert_eq!(r.problem(), "request-in-progress"),
            other => panic!("unexpected answer {other}: {r:?}"),
        }
    }
    assert_eq!(forwarded, 1, "exactly one stream was forwarded");
    assert_eq!(up.total(), 1, "exactly one side effect");
    // HTTP/2 names the host in `:authority`: over HTTP/1.1 the upstream gets
    // it as `Host`, as an HTTP/1.1 client's own (not the upstream's address).
    let hosts: Vec<String> =
        up.requests().iter().map(|r| r.headers.get("host").and_then(|h| h.to_str().ok()).unwrap_or_default().to_owned()).collect();
    assert_eq!(hosts, vec![format!("localhost:{}", gw.addr.port())]);
    assert_eq!(up.side_effects(&derived("k-h2")), 1);
    let rec = settled_record(&store, "k-h2").await.expect("record");
    assert_eq!(rec.state, State::Completed);

    // Replay and mismatch on the same connection.
    let mut s = sender.clone();
    let again = h2_send(&mut s, "POST", &url, &borrowed(&headers), ORDER).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(Some(&again.body[..]), rec.response.as_ref().and_then(|r| r.body.as_deref()));
    let changed = h2_send(&mut s, "POST", &url, &borrowed(&headers), r#"{"item":"pen","qty":2}"#).await;
    assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"), "{changed:?}");
    assert_eq!(up.total(), 1, "neither the replay nor the mismatch reached the upstream");

    let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains(r#"idemgate_tls_handshakes_total{listener="proxy",result="ok"} 1"#), "{text}");
    let h2: f64 = text
        .lines()
        .filter(|l| l.starts_with(r#"idemgate_http_requests_total{listener="proxy","#) && l.contains(r#"protocol="h2""#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(h2, 12.0, "{text}");
    assert!(
        text.contains(r#"idemgate_http_requests_total{listener="proxy",operation="create_order",protocol="h2",code_class="2xx"}"#),
        "{text}"
    );
    let expiry: i64 = text
        .lines()
        .find_map(|l| l.strip_prefix(r#"idemgate_tls_certificate_expiry_timestamp_seconds{listener="proxy"} "#))
        .expect("the expiry gauge")
        .parse()
        .unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    assert!(expiry > now, "the certificate's notAfter: {expiry}");
}

/// RSA and Ed25519 keys work as well as ECDSA; a client offering only
/// http/1.1 is served HTTP/1.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rsa_and_ed25519_certificates_serve_http1_over_tls() {
    let pki = Pki::new("test CA");
    for alg in [Alg::Rsa2048, Alg::Ed25519] {
        let cert = pki.server(alg);
        let up = TestUpstream::start().await;
        let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).tail(&tls_section("server", &cert, "")));
        let config = pki.client_config(None, &[b"http/1.1"]);
        let h = order_headers("k-h1");
        let first = h1_send(gw.addr, config.clone(), "POST", "/v1/orders", &borrowed(&h), ORDER).await.unwrap();
        assert_eq!(first.status, 201, "{alg:?}: {first:?}");
        let again = h1_send(gw.addr, config, "POST", "/v1/orders", &borrowed(&h), ORDER).await.unwrap();
        assert!(again.replayed(), "{alg:?}");
        assert_eq!(up.total(), 1, "{alg:?}");
        // Plain HTTP on the TLS listener gets no answer.
        assert!(send("GET", &gw.url("/v1/orders"), &[], "").await.is_err(), "{alg:?}");
    }
}

/// A client that opens a connection and never finishes the handshake is cut
/// at handshake_timeout, counted, and never reaches a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_handshake_is_cut_at_its_deadline() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw =
        Gateway::start(GatewayConfig::new(backend.clone(), up.url()).tail(&tls_section("server", &cert, "handshake_timeout = \"300ms\"")));
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(20), sock.read(&mut buf)).await.expect("the server closes the connection");
    assert!(matches!(read, Ok(0) | Err(_)), "closed without an answer: {read:?}");
    assert!(eventually(Duration::from_secs(10), || async { gw.log_count("TLS handshake failed") == 1 }).await, "{}", gw.logs());
    let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains(r#"idemgate_tls_handshakes_total{listener="proxy",result="timeout"} 1"#), "{text}");
    assert_eq!(up.total(), 0);
    assert!(backend.open().await.stats().await.unwrap().is_empty(), "nothing was claimed");
}

fn served_certificate(conn: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> Vec<u8> {
    conn.get_ref().1.peer_certificates().expect("server certificate")[0].as_ref().to_vec()
}

fn der(pem: &str) -> Vec<u8> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes()).unwrap().as_ref().to_vec()
}

/// SIGHUP re-reads the certificate: new connections get the new one, an open
/// HTTP/2 connection keeps working; a broken file keeps the one in use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_certificate_without_dropping_connections() {
    let pki = Pki::new("test CA");
    let first = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).tail(&tls_section("server", &first, "")));
    let config = pki.client_config(None, &[b"h2"]);
    let before = support::tls::connect(gw.addr, config.clone()).await.unwrap();
    assert_eq!(served_certificate(&before), der(&first.cert_pem));
    drop(before);
    let url = format!("https://localhost:{}/v1/orders", gw.addr.port());
    let mut open = h2(gw.addr, config.clone()).await;
    assert_eq!(h2_send(&mut open, "POST", &url, &borrowed(&order_headers("a")), ORDER).await.status, 201);

    let second = pki.server(Alg::Ed25519);
    std::fs::write(&first.cert_file, &second.cert_pem).unwrap();
    std::fs::write(&first.key_file, &second.key_pem).unwrap();
    gw.signal("HUP");
    assert!(eventually(Duration::from_secs(10), || async { gw.log_count("TLS certificate reloaded") == 1 }).await, "{}", gw.logs());
    let after = support::tls::connect(gw.addr, config.clone()).await.unwrap();
    assert_eq!(served_certificate(&after), der(&second.cert_pem), "new connections get the new certificate");
    assert_eq!(h2_send(&mut open, "POST", &url, &borrowed(&order_headers("b")), ORDER).await.status, 201, "the open connection lives on");

    std::fs::write(&first.cert_file, "not a certificate").unwrap();
    gw.signal("HUP");
    assert!(eventually(Duration::from_secs(10), || async { gw.log_count("TLS certificate reload failed") == 1 }).await, "{}", gw.logs());
    assert!(gw.logs().contains("server.tls.cert_file"), "the log names the TOML path");
    let still = support::tls::connect(gw.addr, config).await.unwrap();
    assert_eq!(served_certificate(&still), der(&second.cert_pem), "a broken file keeps the certificate in use");
    assert_eq!(up.total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_speaks_https() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).tail(&tls_section("admin", &cert, "")));
    let admin = gw.admin.expect("admin listener");
    let r = h1_send(admin, pki.client_config(None, &[b"http/1.1"]), "GET", "/healthz", &[], "").await.unwrap();
    assert_eq!(r.status, 200);
    assert!(send("GET", &gw.admin_url("/healthz"), &[], "").await.is_err(), "no plain HTTP on the admin listener");
    // The proxy listener stays plain.
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    // Neither listener speaks HTTP/2 (the admin listener offers only
    // http/1.1): no h2 series.
    let m = h1_send(admin, pki.client_config(None, &[b"http/1.1"]), "GET", "/metrics", &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&m.body);
    assert!(
        text.contains(r#"idemgate_http_requests_total{listener="admin",operation="healthz",protocol="h1",code_class="2xx"} 1"#),
        "{text}"
    );
    assert!(!text.contains(r#"protocol="h2""#), "{text}");
}

fn check_config(text: &str, dir: &std::path::Path) -> (bool, String) {
    let path = dir.join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check-config", "--config"])
        .arg(&path)
        .env("IDEMGATE_LOG", "warn")
        .output()
        .unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout))
}

#[test]
fn tls_configuration_errors_name_the_file_and_the_toml_path() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let other = pki.server(Alg::EcdsaP256);
    let base = "[store]\nkind = \"sqlite\"\npath = \"x.db\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:1\"\n[server]\ndefault_upstream = \"u\"\n";
    let dir = pki.dir.path();

    let (ok, out) = check_config(
        &format!("{base}[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n", cert.cert_file.display(), cert.key_file.display()),
        dir,
    );
    assert!(ok, "{out}");

    let missing = dir.join("missing.pem");
    let (ok, out) = check_config(
        &format!("{base}[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n", missing.display(), cert.key_file.display()),
        dir,
    );
    assert!(!ok);
    assert!(out.contains("server.tls.cert_file") && out.contains(&missing.display().to_string()), "{out}");

    // A key that is not the certificate's.
    let (ok, out) = check_config(
        &format!("{base}[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n", cert.cert_file.display(), other.key_file.display()),
        dir,
    );
    assert!(!ok);
    assert!(out.contains("server.tls.key_file") && out.contains(&other.key_file.display().to_string()), "{out}");

    // A certificate where the key belongs.
    let (ok, out) = check_config(
        &format!(
            "{base}[admin]\nlisten = \"127.0.0.1:0\"\n[admin.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n",
            cert.cert_file.display(),
            cert.cert_file.display()
        ),
        dir,
    );
    assert!(!ok);
    assert!(out.contains("admin.tls.key_file") && out.contains("no PEM private key"), "{out}");

    let (ok, out) = check_config(
        &format!(
            "{base}[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\nclient_auth = \"required\"\nciphers = \"all\"\n",
            cert.cert_file.display(),
            cert.key_file.display()
        ),
        dir,
    );
    assert!(!ok);
    assert!(out.contains("server.tls.ciphers"), "{out}");
}

/// A listener on a free port and the TLS that a test upstream speaks on it:
/// `cert`, client certificates required from `client_ca` when given, ALPN
/// `alpn`.
async fn tls_upstream_listener(
    cert: &Issued,
    client_ca: Option<&std::path::Path>,
    alpn: Vec<&'static [u8]>,
) -> (tokio::net::TcpListener, std::net::SocketAddr, std::sync::Arc<idemgate::tls::server::TlsListener>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let client_auth =
        if client_ca.is_some() { idemgate::tls::server::ClientAuth::Required } else { idemgate::tls::server::ClientAuth::Off };
    let settings = idemgate::tls::server::ListenerTls {
        cert_file: cert.cert_file.clone(),
        key_file: cert.key_file.clone(),
        client_ca_file: client_ca.map(std::path::Path::to_owned),
        client_auth,
        handshake_timeout: Duration::from_secs(5),
    };
    (listener, addr, std::sync::Arc::new(idemgate::tls::server::TlsListener::new("test", settings, alpn).unwrap()))
}

/// A TLS server that completes no handshake: `stall` accepts and never
/// answers; otherwise it presents `cert` (a CA the gateway does not trust).
async fn broken_tls_upstream(stall: bool, cert: Issued) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let (listener, addr, tls) = tls_upstream_listener(&cert, None, vec![b"http/1.1"]).await;
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let Ok((sock, _)) = listener.accept().await else { return };
            if stall {
                held.push(sock);
            } else {
                let tls = tls.clone();
                tokio::spawn(async move {
                    let _ = tls.handshake(sock).await;
                });
            }
        }
    });
    (addr, task)
}

/// An https upstream verified against a private CA, reached over HTTP/2
/// (the upstream here is a second gateway with [server.tls], which offers
/// h2): one side effect, replays stay at the first gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_with_a_private_ca_is_reached_over_h2() {
    let pki = Pki::new("upstream CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let inner = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).tail(&tls_section("server", &cert, "")));
    let outer = Gateway::start(
        GatewayConfig::new(sqlite_backend(), format!("https://localhost:{}", inner.addr.port()))
            .upstream(&format!("ca_file = \"{}\"", pki.ca_file.display())),
    );
    let first = post(&outer.url("/v1/orders"), "k-up", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{first:?}\n{}", outer.logs());
    let again = post(&outer.url("/v1/orders"), "k-up", ORDER, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.total(), 1);
    let metrics = send("GET", &inner.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(r#"idemgate_http_requests_total{listener="proxy",operation="create_order",protocol="h2",code_class="2xx"} 1"#),
        "the upstream hop was HTTP/2:\n{text}"
    );
}

/// A TLS handshake with the upstream that fails (a certificate from a CA it
/// does not trust) or stalls (cut at connect_timeout) is "never sent": 503
/// and the key released, never `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_stalled_upstream_handshake_releases_the_key() {
    let trusted = Pki::new("trusted CA");
    let stranger = Pki::new("unknown CA");
    for stall in [false, true] {
        let (addr, task) = broken_tls_upstream(stall, stranger.server(Alg::EcdsaP256)).await;
        let backend = sqlite_backend();
        let gw = Gateway::start(
            GatewayConfig::new(backend.clone(), format!("https://localhost:{}", addr.port()))
                .upstream(&format!("ca_file = \"{}\"", trusted.ca_file.display())),
        );
        let r = post(&gw.url("/v1/orders"), "k-fail", ORDER, &[]).await;
        assert_eq!(r.status, 503, "stall={stall}: {r:?}");
        assert_eq!(r.problem(), "upstream-unavailable", "stall={stall}");
        let store = backend.open().await;
        assert!(settled_record(&store, "k-fail").await.is_none(), "stall={stall}: the key was released, not unknown");
        task.abort();
    }
}

fn mtls_section(cert: &Issued, ca: &std::path::Path, auth: &str) -> String {
    tls_section("server", cert, &format!("client_ca_file = \"{}\"\nclient_auth = \"{auth}\"", ca.display()))
}

const MTLS_IDENTITY: &str = r#"[[identity.sources]]
kind = "mtls"
tenant_from = "san_uri"
tenant_regex = "^spiffe://([^/]+)/"
principal_from = "subject_cn"
"#;

/// client_auth = "required": a client without a certificate, or with one
/// from another CA, never gets a request through; the refusal is counted by
/// reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_required_refuses_clients_without_a_valid_certificate_at_the_handshake() {
    let server_pki = Pki::new("server CA");
    let client_pki = Pki::new("client CA");
    let stranger = Pki::new("stranger CA");
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).identity(MTLS_IDENTITY).tail(&mtls_section(
        &server_pki.server(Alg::EcdsaP256),
        &client_pki.ca_file,
        "required",
    )));
    let h = [("content-type", "application/json"), ("idempotency-key", "k")];
    let without = h1_send(gw.addr, server_pki.client_config(None, &[b"http/1.1"]), "POST", "/v1/orders", &h, ORDER).await;
    assert!(without.is_err(), "no certificate, no answer: {without:?}");
    let foreign = stranger.client("mallory", Some("spiffe://acme.test/x"), None);
    let with_foreign = h1_send(gw.addr, server_pki.client_config(Some(&foreign), &[b"http/1.1"]), "POST", "/v1/orders", &h, ORDER).await;
    assert!(with_foreign.is_err(), "a certificate of another CA is refused: {with_foreign:?}");
    assert_eq!(up.total(), 0);

    for line in [
        r#"idemgate_tls_handshakes_total{listener="proxy",result="no_client_certificate"} 1"#,
        r#"idemgate_tls_handshakes_total{listener="proxy",result="bad_certificate"} 1"#,
    ] {
        let counted = eventually(Duration::from_secs(10), || async {
            let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
            String::from_utf8_lossy(&metrics.body).contains(line)
        });
        assert!(counted.await, "{line} missing");
    }

    let alice = client_pki.client("alice", Some("spiffe://acme.test/payments"), None);
    let ok = h1_send(gw.addr, server_pki.client_config(Some(&alice), &[b"http/1.1"]), "POST", "/v1/orders", &h, ORDER).await.unwrap();
    assert_eq!(ok.status, 201, "{ok:?}");
    assert_eq!(up.total(), 1);
}

/// Two certificates map to two scopes: the same key from each is a first
/// request of its own, and neither replays the other's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_identities_of_two_certificates_never_see_each_others_records() {
    let server_pki = Pki::new("server CA");
    let client_pki = Pki::new("client CA");
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).identity(MTLS_IDENTITY).tail(&mtls_section(
        &server_pki.server(Alg::EcdsaP256),
        &client_pki.ca_file,
        "optional",
    )));
    let alice = client_pki.client("alice", Some("spiffe://acme.test/payments"), None);
    let bob = client_pki.client("bob", Some("spiffe://globex.test/payments"), None);
    let h = [("content-type", "application/json"), ("idempotency-key", "shared-key")];
    let send_as = |who: Option<&Issued>, body: &'static str| {
        let config = server_pki.client_config(who, &[b"h2"]);
        let url = format!("https://localhost:{}/v1/orders", gw.addr.port());
        async move {
            let mut s = h2(gw.addr, config).await;
            h2_send(&mut s, "POST", &url, &h, body).await
        }
    };
    let a = send_as(Some(&alice), ORDER).await;
    let b = send_as(Some(&bob), r#"{"item":"pen","qty":9}"#).await;
    assert_eq!((a.status, a.replayed()), (201, false), "{a:?}");
    assert_eq!((b.status, b.replayed()), (201, false), "bob's first request is his own, not a mismatch of alice's: {b:?}");
    assert_eq!(up.total(), 2);
    let a2 = send_as(Some(&alice), ORDER).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body, "alice replays her own answer");
    assert_eq!(up.total(), 2);

    // optional: a client without a certificate is served, but identifies no one.
    let anon = send_as(None, ORDER).await;
    assert_eq!((anon.status, anon.problem().as_str()), (401, "unauthenticated"), "{anon:?}");

    let store = backend.open().await;
    let key = idemgate::idempotency::key::IdempotencyKey::new("shared-key").unwrap();
    for (tenant, principal) in [("acme.test", "alice"), ("globex.test", "bob")] {
        let scope = idemgate::idempotency::key::Scope {
            tenant: tenant.into(),
            principal: principal.into(),
            operation: "create_order".into(),
            key: key.clone(),
        };
        let (rec, _) = store.get(&scope).await.unwrap().unwrap_or_else(|| panic!("a record in {tenant}/{principal}"));
        assert_eq!(rec.state, State::Completed);
    }
}

/// PostgreSQL with ssl = on and a certificate from a private CA:
/// `sslmode=verify-full` with `sslrootcert` carries the idempotent flow over
/// TLS; the wrong CA is refused; `verify-ca` ignores the host name that
/// `verify-full` checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_tls_honours_sslmode_and_sslrootcert() {
    let pki = Pki::new("database CA");
    let stranger = Pki::new("stranger CA");
    let cert = pki.server(Alg::EcdsaP256);
    let pg = support::postgres::PgServer::start_with_ssl(&cert.cert_pem, &cert.key_pem).expect("a PostgreSQL cluster with ssl = on");
    let plain = pg.create_database("tls_store").unwrap();
    let ca = pki.ca_file.display().to_string();
    let url = format!("{plain}?sslmode=verify-full&sslrootcert={ca}");

    let up = TestUpstream::start().await;
    let backend = Backend::Postgres { url: url.clone() };
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let first = post(&gw.url("/v1/orders"), "k-pg", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{first:?}\n{}", gw.logs());
    assert!(post(&gw.url("/v1/orders"), "k-pg", ORDER, &[]).await.replayed());
    assert_eq!(up.total(), 1);
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "k-pg").await.unwrap().state, State::Completed);
    let tls_sessions = pg
        .simple_query(
            "tls_store",
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE s.ssl AND a.application_name = 'idemgate'",
        )
        .unwrap();
    let n: u64 = tls_sessions[0][0].as_deref().unwrap().parse().unwrap();
    assert!(n >= 1, "the gateway's sessions are encrypted");

    let open = open_store;
    let foreign = format!("{plain}?sslmode=verify-full&sslrootcert={}", stranger.ca_file.display());
    assert!(open(foreign).await.is_err(), "a server certificate of another CA is refused");
    let foreign_require = format!("{plain}?sslmode=require&sslrootcert={}", stranger.ca_file.display());
    assert!(open(foreign_require).await.is_err(), "require with sslrootcert verifies the chain, as libpq does");
    assert!(open(format!("{plain}?sslmode=require")).await.is_ok(), "require alone only encrypts");

    // The certificate names localhost and 127.0.0.1; reach it under another name.
    let port = pg.port();
    let renamed = |mode: &str| {
        format!("host=db.invalid hostaddr=127.0.0.1 port={port} user=idemgate dbname=tls_store sslmode={mode} sslrootcert={ca}")
    };
    assert!(open(renamed("verify-full")).await.is_err(), "verify-full checks the host name");
    assert!(open(renamed("verify-ca")).await.is_ok(), "verify-ca checks only the chain");
}

/// PostgreSQL presenting a self-signed X.509 version 1 certificate (what
/// `CREATE EXTENSION citus` generates): `prefer` (no sslmode at all) and
/// `require` connect over TLS as libpq does, under TLS 1.3 and TLS 1.2;
/// `verify-ca` and `verify-full` refuse it, even with the certificate itself
/// as `sslrootcert`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_with_a_version_1_certificate_is_served_with_prefer_and_require() {
    let dir = tempfile::tempdir().unwrap();
    let cert = support::tls::version_1_self_signed(dir.path());
    let pg = support::postgres::PgServer::start_with_ssl(&cert.cert_pem, &cert.key_pem).expect("a PostgreSQL cluster with ssl = on");
    let plain = pg.create_database("v1_store").unwrap();
    let root = cert.cert_file.display().to_string();
    let encrypted = || {
        let rows = pg
            .simple_query(
                "v1_store",
                "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE s.ssl AND a.application_name = 'idemgate'",
            )
            .unwrap();
        rows[0][0].as_deref().unwrap().parse::<u64>().unwrap()
    };
    let versions = || {
        let rows = pg
            .simple_query("v1_store", "SELECT DISTINCT s.version FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE s.ssl AND a.application_name = 'idemgate'")
            .unwrap();
        rows.into_iter().map(|r| r[0].clone().unwrap_or_default()).collect::<Vec<_>>()
    };

    // The gateway, with the URL a user writes (no sslmode: prefer).
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: plain.clone() }, up.url()));
    let first = post(&gw.url("/v1/orders"), "k-v1", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{first:?}\n{}", gw.logs());
    assert!(post(&gw.url("/v1/orders"), "k-v1", ORDER, &[]).await.replayed());
    assert_eq!(up.total(), 1);
    assert!(encrypted() >= 1, "prefer encrypts when the server offers TLS");
    drop(gw);

    for version in ["TLSv1.3", "TLSv1.2"] {
        pg.set_and_reload("ssl_max_protocol_version", version).unwrap();
        for mode in ["prefer", "require"] {
            let opened = opened_store(format!("{plain}?sslmode={mode}")).await;
            assert!(opened.is_ok(), "{mode} over {version} accepts the version 1 certificate: {:?}", opened.err());
            // (Sessions of the previous round may not have ended yet.)
            assert!(versions().iter().any(|v| v == version), "{mode}: a session speaks {version}: {:?}", versions());
        }
        for mode in ["verify-ca", "verify-full"] {
            let opened = open_store(format!("{plain}?sslmode={mode}&sslrootcert={root}")).await;
            assert!(opened.is_err(), "{mode} over {version} refuses the version 1 certificate");
        }
    }
}

/// Opens an existing PostgreSQL store with one connection and pings it.
async fn open_store(url: String) -> Result<(), String> {
    opened_store(url).await.map(drop)
}

/// [`open_store`], keeping the store (and its connection) open.
async fn opened_store(url: String) -> Result<idemgate::store::Store, String> {
    use idemgate::config::{Secret, StoreBackend, StoreConfig};
    let config = StoreConfig {
        backend: StoreBackend::Postgres { url: Secret::new(url), pool_size: 1, pooler: Default::default() },
        migrate: false,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(3),
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 10,
        events_retention: Duration::from_secs(60),
    };
    let store = idemgate::store::Store::open(&config, idemgate::store::Access::Existing).await.map_err(|e| e.to_string())?;
    store.ping().await.map_err(|e| e.to_string())?;
    Ok(store)
}

/// server.max_connections: past the limit a new connection waits (in the
/// accept queue) until an open one closes, and the limit is logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_max_connections_wait_for_a_free_slot() {
    use http_body_util::{BodyExt, Full};
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server("max_connections = 1"));
    // Connection A: one request answered, then held open (keep-alive).
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut held, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await.unwrap();
    let driver = tokio::spawn(conn);
    let req = http::Request::get("/healthz-nothing").header("host", "localhost").body(Full::new(bytes::Bytes::new())).unwrap();
    let answered = held.send_request(req).await.unwrap();
    let _ = answered.into_body().collect().await;

    // Connection B waits while A is open ...
    let url = gw.url("/v1/orders");
    let mut b = tokio::spawn(async move { post(&url, "k-limit", ORDER, &[]).await });
    assert!(eventually(Duration::from_secs(10), || async { gw.log_count("connection limit reached") >= 1 }).await, "{}", gw.logs());
    assert!(tokio::time::timeout(Duration::from_millis(500), &mut b).await.is_err(), "B is not served while A holds the only slot");
    assert_eq!(up.total(), 0);
    // ... and is served once A closes.
    drop(held);
    driver.abort();
    let r = tokio::time::timeout(Duration::from_secs(20), b).await.expect("B served after A closed").unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(up.total(), 1);
}

/// `check-config --connect` completes the TLS handshake with https upstreams,
/// so an untrusted certificate shows before serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_shakes_hands_with_https_upstreams() {
    let pki = Pki::new("upstream CA");
    let stranger = Pki::new("stranger CA");
    for (cert, ok) in [(pki.server(Alg::EcdsaP256), true), (stranger.server(Alg::EcdsaP256), false)] {
        let (addr, task) = broken_tls_upstream(false, cert).await;
        let text = format!(
            "[store]\nkind = \"sqlite\"\npath = \"{}\"\n[server]\ndefault_upstream = \"u\"\n[[upstreams]]\nname = \"u\"\nurl = \"https://localhost:{}\"\nca_file = \"{}\"\n",
            pki.dir.path().join("check.db").display(),
            addr.port(),
            pki.ca_file.display()
        );
        let path = pki.dir.path().join("check.toml");
        std::fs::write(&path, text).unwrap();
        let out = tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_idemgate")).args(["check-config", "--connect", "--config"]).arg(&path).output().unwrap()
        })
        .await
        .unwrap();
        let all = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.success(), ok, "{all}");
        let needle = if ok { "TLS handshake ok" } else { "TLS handshake:" };
        assert!(all.contains(needle) && all.contains("https://localhost"), "{all}");
        task.abort();
    }
}

// ---------------------------------------------------------------------------
// Silent and idle connections on TLS listeners (issue 28, item 2)

/// The HTTP/2 client connection preface and an empty SETTINGS frame.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
/// A HEADERS frame on stream 1 (`:method GET`, HPACK index 2) without
/// END_HEADERS: the server must wait for a CONTINUATION that never comes.
const H2_HEADERS_UNFINISHED: &[u8] = b"\x00\x00\x01\x01\x00\x00\x00\x00\x01\x82";

/// How a silent client behaves after its TLS handshake.
#[derive(Debug, Clone, Copy)]
enum Silent {
    /// Offers no ALPN protocol and sends nothing.
    NoAlpn,
    /// ALPN chose http/1.1; nothing sent.
    Http1,
    /// ALPN chose h2; nothing sent.
    H2,
    /// ALPN h2, the connection preface alone.
    H2Preface,
    /// ALPN h2, the preface and a HEADERS frame without END_HEADERS.
    H2UnfinishedHeaders,
}

type ClientTls = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

async fn open_silent(addr: std::net::SocketAddr, pki: &Pki, kind: Silent) -> ClientTls {
    use tokio::io::AsyncWriteExt;
    let alpn: &[&[u8]] = match kind {
        Silent::NoAlpn => &[],
        Silent::Http1 => &[b"http/1.1"],
        Silent::H2 | Silent::H2Preface | Silent::H2UnfinishedHeaders => &[b"h2"],
    };
    let mut tls = support::tls::connect(addr, pki.client_config(None, alpn)).await.expect("TLS handshake");
    match kind {
        Silent::H2Preface => tls.write_all(H2_PREFACE).await.unwrap(),
        Silent::H2UnfinishedHeaders => tls.write_all(&[H2_PREFACE, H2_HEADERS_UNFINISHED].concat()).await.unwrap(),
        _ => {}
    }
    tls.flush().await.unwrap();
    tls
}

/// Reads until the server closes the connection (end of stream or an
/// error), at most `bound`; `None` if it was still open then. Returns what
/// the server sent meanwhile.
async fn until_closed(s: &mut ClientTls, bound: Duration) -> Option<Vec<u8>> {
    let mut all = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(bound, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => all.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .ok()
    .map(|()| all)
}

/// The (type, flags) of each complete HTTP/2 frame in `bytes`.
fn h2_frames(mut bytes: &[u8]) -> Vec<(u8, u8)> {
    let mut out = Vec::new();
    while bytes.len() >= 9 {
        let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        out.push((bytes[3], bytes[4]));
        bytes = bytes.get(9 + len..).unwrap_or_default();
    }
    out
}

/// After its TLS handshake a client has `request_header_timeout` to send a
/// complete request, whatever ALPN chose: one that sends nothing, an HTTP/2
/// preface alone, or a HEADERS frame it never finishes is disconnected, and
/// its slot under `max_connections` is free again. Nothing was claimed or
/// forwarded for them; a real request waiting for a slot is then served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tls_connections_are_closed_at_the_header_timeout() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let kinds = [Silent::NoAlpn, Silent::Http1, Silent::H2, Silent::H2Preface, Silent::H2UnfinishedHeaders];
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url())
            .server(&format!("max_connections = {}\nrequest_header_timeout = \"1s\"", kinds.len()))
            .tail(&tls_section("server", &cert, "")),
    );
    // Every slot held by a silent client.
    let mut silent = Vec::new();
    for kind in kinds {
        silent.push((kind, open_silent(gw.addr, &pki, kind).await));
    }
    // A real request waits for a slot.
    let (addr, config) = (gw.addr, pki.client_config(None, &[b"http/1.1"]));
    let h = order_headers("k-after-silent");
    let real = tokio::spawn(async move { h1_send(addr, config, "POST", "/v1/orders", &borrowed(&h), ORDER).await });
    for (kind, conn) in &mut silent {
        let sent = until_closed(conn, Duration::from_secs(30)).await;
        assert!(sent.is_some(), "{kind:?}: the server never closed the silent connection");
    }
    let r = tokio::time::timeout(Duration::from_secs(30), real).await.expect("the waiting request is served").unwrap().unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(up.total(), 1, "only the real request reached the upstream");
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "k-after-silent").await.expect("record").state, State::Completed);
    assert_eq!(store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap().len(), 1, "one record");
}

/// HTTP/2 keep-alive: the server pings a connection every
/// `http2_keep_alive_interval` and closes it when a ping goes unanswered
/// (here: a client that sent its preface and then stopped reading frames).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_does_not_answer_pings_is_disconnected() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url())
            .server("request_header_timeout = \"60s\"\nhttp2_keep_alive_interval = \"300ms\"")
            .tail(&tls_section("server", &cert, "")),
    );
    let mut conn = open_silent(gw.addr, &pki, Silent::H2Preface).await;
    let sent = until_closed(&mut conn, Duration::from_secs(30)).await.expect("closed after the unanswered ping");
    let frames = h2_frames(&sent);
    assert!(frames.iter().any(|&(kind, flags)| kind == 0x6 && flags & 0x1 == 0), "the server sent a PING: {frames:?}");
    assert_eq!(up.total(), 0);
}

/// An HTTP/2 connection with no request open for `request_header_timeout`
/// (its client answers pings) is closed with GOAWAY, as an idle HTTP/1.1
/// keep-alive connection is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_after_its_request() {
    use http_body_util::{BodyExt, Full};
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url()).server("request_header_timeout = \"1s\"").tail(&tls_section("server", &cert, "")),
    );
    let tls = support::tls::connect(gw.addr, pki.client_config(None, &[b"h2"])).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), hyper_util::rt::TokioIo::new(tls)).await.unwrap();
    let mut conn = tokio::spawn(conn);
    let mut req = http::Request::post(format!("https://localhost:{}/v1/orders", gw.addr.port()));
    for (k, v) in order_headers("k-idle") {
        req = req.header(k, v);
    }
    let resp = sender.send_request(req.body(Full::new(bytes::Bytes::from(ORDER))).unwrap()).await.unwrap();
    assert_eq!(resp.status(), 201);
    let _ = resp.into_body().collect().await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), &mut conn).await.expect("the idle HTTP/2 connection was never closed");
    // GOAWAY, then an orderly close: the client's connection ends without an error.
    assert!(matches!(ended, Ok(Ok(()))), "{ended:?}");
    assert_eq!(up.total(), 1);
}

/// The admin listener bounds silent TLS clients as the proxy listener does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_tls_connection_to_the_admin_listener_is_closed() {
    let pki = Pki::new("test CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url()).server("request_header_timeout = \"1s\"").tail(&tls_section("admin", &cert, "")),
    );
    let admin = gw.admin.expect("admin listener");
    // The admin listener offers http/1.1 only.
    for kind in [Silent::NoAlpn, Silent::Http1] {
        let mut conn = open_silent(admin, &pki, kind).await;
        assert!(until_closed(&mut conn, Duration::from_secs(30)).await.is_some(), "{kind:?}: the admin listener kept it open");
    }
    let r = h1_send(admin, pki.client_config(None, &[b"http/1.1"]), "GET", "/healthz", &[], "").await.unwrap();
    assert_eq!(r.status, 200);
}

/// Sends `writes` first requests with distinct keys (`{prefix}{n}`) through
/// `url`, `concurrency` at a time; every answer with its key.
async fn distinct_writes(url: &str, prefix: &str, writes: usize, concurrency: usize) -> Vec<(String, support::Resp)> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let clients: Vec<_> = (0..concurrency)
        .map(|_| {
            let (next, url, prefix) = (next.clone(), url.to_owned(), prefix.to_owned());
            tokio::spawn(async move {
                let mut answers = Vec::new();
                loop {
                    let n = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if n >= writes {
                        return answers;
                    }
                    let key = format!("{prefix}{n}");
                    let r = post(&url, &key, ORDER, &[]).await;
                    answers.push((key, r));
                }
            })
        })
        .collect();
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap());
    }
    all
}

/// An https upstream behind nginx with HTTP/2 on, everything else at its
/// defaults: nginx ends each connection after `keepalive_requests` (1000)
/// requests with a GOAWAY, and streams idemgate opened past its last stream
/// id (or that nginx refused) never reached the upstream. Across several
/// such connections, every answer is a 2xx or a 5xx whose key was released;
/// no record is `unknown`, and the upstream ran exactly the completed ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_upstream_behind_nginx_going_away_after_1000_requests_leaves_nothing_unknown() {
    let pki = Pki::new("upstream CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let Some(nginx) = support::nginx::Nginx::start_https(up.addr.port(), &cert, None) else { return };
    let backend = postgres_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), format!("https://localhost:{}", nginx.port))
            .timeout("10s")
            .upstream(&format!("ca_file = \"{}\"", pki.ca_file.display())),
    );
    let store = backend.open().await;
    let answers = distinct_writes(&gw.url("/v1/orders"), "ga", 2600, 32).await;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    let mut kept = Vec::new();
    for (key, r) in &answers {
        *statuses.entry(r.status).or_default() += 1;
        if (200..300).contains(&r.status) {
            continue;
        }
        assert!(r.status >= 500, "{key}: {r:?}\n{}", nginx.error_log());
        if let Some(rec) = settled_record(&store, key).await {
            kept.push(format!("{key}: {} {}, record {:?}", r.status, r.problem(), rec.state));
        }
    }
    let why: Vec<String> = gw.logs().lines().filter(|l| l.contains("exchange with upstream")).take(3).map(str::to_owned).collect();
    assert!(kept.is_empty(), "answers {statuses:?}; failed writes whose key was kept: {kept:?}\n{why:#?}");
    // Result writes may still be landing after the last answer went out.
    let list = || async { store.list(&idemgate::store::ListFilter { limit: 10_000, ..Default::default() }).await.expect("list") };
    let settled = || async { list().await.iter().all(|r| r.state != State::InFlight) };
    assert!(eventually(Duration::from_secs(20), settled).await, "every record settles");
    let all = list().await;
    let count = |state: State| all.iter().filter(|r| r.state == state).count();
    let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let errors: Vec<String> = String::from_utf8_lossy(&metrics.body)
        .lines()
        .filter(|l| l.starts_with("idemgate_upstream_errors_total") || l.contains(r#"outcome="unknown""#))
        .map(str::to_owned)
        .collect();
    assert_eq!(count(State::Unknown), 0, "answers {statuses:?}; {errors:?}");
    assert_eq!(up.total() as usize, count(State::Completed), "answers {statuses:?}; {errors:?}");
    assert_eq!(all.len(), count(State::Completed), "every record is completed");
    assert!(up.ledger().values().all(|&n| n == 1), "no write ran twice");
    eprintln!("answers {statuses:?}; {errors:?}");
}

/// A rustls upstream that requires client certificates issued by
/// `client_ca`, offering `alpn`; counts the connections whose handshake it
/// accepted (no request can reach it over any other).
async fn client_certificate_upstream(
    cert: Issued,
    client_ca: &std::path::Path,
    alpn: Vec<&'static [u8]>,
) -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>, tokio::task::JoinHandle<()>) {
    let (listener, addr, tls) = tls_upstream_listener(&cert, Some(client_ca), alpn).await;
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else { return };
            let (tls, counted) = (tls.clone(), counted.clone());
            tokio::spawn(async move {
                if let Ok(conn) = tls.handshake(sock).await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    drop(conn);
                }
            });
        }
    });
    (addr, accepted, task)
}

/// An https upstream that refuses idemgate's client certificate (issued by a
/// CA it does not trust). In TLS 1.3 the client's handshake is over once it
/// sent its certificate and Finished, so the refusal (a TLS alert) arrives
/// where the response would: the request went nowhere but into a handshake
/// the upstream refused. Over HTTP/1.1: 503 `upstream-unavailable`, the key
/// released, nothing reached the upstream. Over HTTP/2 the alert reaches the
/// request only when h2 hands the connection's error to its stream; when the
/// stream learns of the closed connection first, all it gets is a broken
/// pipe, which proves nothing, and the record stays `unknown` (seen in about
/// one run in four here). Either way nothing reached the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_refusing_the_client_certificate_releases_the_key() {
    let pki = Pki::new("upstream CA");
    let trusted_clients = Pki::new("clients the upstream trusts");
    let stranger = Pki::new("another CA");
    let ours = stranger.client("idemgate", None, None);
    for alpn in [vec![&b"http/1.1"[..]], vec![&b"h2"[..], &b"http/1.1"[..]]] {
        let label: Vec<_> = alpn.iter().map(|p| String::from_utf8_lossy(p).into_owned()).collect();
        let (addr, accepted, task) = client_certificate_upstream(pki.server(Alg::EcdsaP256), &trusted_clients.ca_file, alpn).await;
        let backend = sqlite_backend();
        let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("https://localhost:{}", addr.port())).upstream(&format!(
            "ca_file = \"{}\"\nclient_cert_file = \"{}\"\nclient_key_file = \"{}\"",
            pki.ca_file.display(),
            ours.cert_file.display(),
            ours.key_file.display()
        )));
        let r = post(&gw.url("/v1/orders"), "k-cert", ORDER, &[]).await;
        let store = backend.open().await;
        let rec = settled_record(&store, "k-cert").await;
        let why: Vec<String> = gw.logs().lines().filter(|l| l.contains("upstream")).take(3).map(str::to_owned).collect();
        let h2 = label.len() > 1;
        let released = (r.status, r.problem().as_str()) == (503, "upstream-unavailable") && rec.is_none();
        let unknown = (r.status, r.problem().as_str()) == (504, "outcome-unknown") && rec.as_ref().map(|r| r.state) == Some(State::Unknown);
        assert!(released || (h2 && unknown), "{label:?}: {r:?}, record {:?}\n{why:#?}", rec.map(|r| r.state));
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 0, "{label:?}: no handshake was accepted");
        task.abort();
    }
}

/// An https upstream speaking HTTP/2 that answers 201 with a
/// `Content-Length` of 100, sends the first 9 bytes of the body, then resets
/// the stream with `NO_ERROR` 300 ms later (what an HTTP/2 front does when
/// its own backend dies mid-answer). Counts the requests it received.
async fn truncating_h2_upstream(
    cert: Issued,
) -> (std::net::SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>, tokio::task::JoinHandle<()>) {
    let (listener, addr, tls) = tls_upstream_listener(&cert, None, vec![&b"h2"[..]]).await;
    let received = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = received.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else { return };
            let (tls, counted) = (tls.clone(), counted.clone());
            tokio::spawn(async move {
                let Ok(accepted) = tls.handshake(sock).await else { return };
                let Ok(mut conn) = h2::server::handshake(accepted.stream).await else { return };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let head = http::Response::builder()
                        .status(201)
                        .header("content-type", "application/json")
                        .header("content-length", "100")
                        .body(())
                        .unwrap();
                    // On its own task: the accept loop drives the connection
                    // meanwhile, so the head and the part go out first.
                    tokio::spawn(async move {
                        let Ok(mut send) = respond.send_response(head, false) else { return };
                        let _ = send.send_data(bytes::Bytes::from_static(b"{\"order\":"), false);
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        send.send_reset(h2::Reason::NO_ERROR);
                    });
                }
            });
        }
    });
    (addr, received, task)
}

/// hyper ends an HTTP/2 response body reset with `NO_ERROR` as if it were
/// complete (RFC 9113 lets a server stop a request's upload that way after a
/// complete response). A response whose body falls short of its
/// `Content-Length` is not complete: the upstream acted and its answer is
/// lost, so the record is `unknown` and a retry is refused, never answered
/// with the 9 bytes that arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_answer_cut_short_by_a_no_error_reset_is_not_recorded_as_complete() {
    let pki = Pki::new("upstream CA");
    let (addr, received, task) = truncating_h2_upstream(pki.server(Alg::EcdsaP256)).await;
    let backend = sqlite_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), format!("https://localhost:{}", addr.port()))
            .upstream(&format!("ca_file = \"{}\"", pki.ca_file.display())),
    );
    let r = post(&gw.url("/v1/orders"), "cut", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}\n{}", gw.logs());
    let store = backend.open().await;
    let rec = settled_record(&store, "cut").await.expect("a record");
    assert_eq!(rec.state, State::Unknown, "{:?}", rec.response);
    let retry = post(&gw.url("/v1/orders"), "cut", ORDER, &[]).await;
    assert_eq!((retry.status, retry.problem().as_str()), (409, "outcome-unknown"), "{retry:?}");
    assert_eq!(received.load(std::sync::atomic::Ordering::SeqCst), 1, "the retry was not sent");
    task.abort();
}

/// The same cut-short answer through a route in observe mode: the client
/// gets what came (its connection then breaks, as the body is short of its
/// `Content-Length`), and the observed record is `unknown`, not a completed
/// record of 9 bytes that enforcing would replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observed_h2_answer_cut_short_is_recorded_unknown() {
    let pki = Pki::new("upstream CA");
    let (addr, received, task) = truncating_h2_upstream(pki.server(Alg::EcdsaP256)).await;
    let backend = sqlite_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), format!("https://localhost:{}", addr.port()))
            .upstream(&format!("ca_file = \"{}\"", pki.ca_file.display()))
            .route("mode = \"observe\""),
    );
    let first = try_post(&gw.url("/v1/orders"), "cut", ORDER, &[]).await;
    assert!(first.is_err(), "the client's answer breaks off: {first:?}");
    let store = backend.open().await;
    let settled =
        eventually(Duration::from_secs(10), || async { settled_record(&store, "cut").await.is_some_and(|r| r.state != State::InFlight) })
            .await;
    let rec = settled_record(&store, "cut").await;
    assert!(settled, "{rec:?}\n{}", gw.logs());
    assert_eq!(rec.map(|r| (r.state, r.response)), Some((State::Unknown, None)));
    assert_eq!(received.load(std::sync::atomic::Ordering::SeqCst), 1);
    task.abort();
}
