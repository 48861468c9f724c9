//! The request's edge on the real binary: method and path spellings, and
//! the signals an upstream framework reads as another method (override
//! headers, `_method`), format suffixes and trailing junk, and HEAD. Every
//! spelling of a protected route's method or path is either refused (400
//! `invalid-request`) or routed exactly as its normal form, with identity and
//! a claim; it never reaches the upstream unidentified. The same table runs
//! over HTTP/1.1 (raw bytes, so nothing between the test and the gateway
//! rewrites the request line) and over HTTP/2, on one TLS listener with a
//! `default_upstream` (so that anything not refused or routed would be
//! passed through).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use support::tls::{Alg, Issued, Pki, connect, h2, h2_send};
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// What must become of one spelling.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// 400 `invalid-request`, nothing forwarded, with or without credentials.
    Refused,
    /// On a route's own method and path, refused once its body is read:
    /// 401 without credentials (identity comes first), 400
    /// `invalid-request` with them; nothing forwarded either way.
    RefusedAfterIdentity,
    /// Routed as `normal` (path and query the upstream must see) to
    /// `operation`: 401 without credentials, one side effect under the
    /// derived key with them.
    Routed { normal: &'static str, operation: &'static str },
    /// Not any route's spelling: passed through to the default upstream as
    /// `normal`, without a key.
    PassThrough { normal: &'static str },
}

use Expect::*;

/// (method, request target, expectation).
const CASES: &[(&str, &str, Expect)] = &[
    // Methods are case-sensitive tokens: a case variant of a route's (or a
    // standard) method is refused, never passed through.
    ("post", "/v1/orders", Refused),
    ("Post", "/v1/orders", Refused),
    ("delete", "/v1/orders/1", Refused),
    // Empty segments, dot segments (also percent-encoded, also with `;`).
    ("POST", "//v1/orders", Refused),
    ("POST", "/v1//orders", Refused),
    ("POST", "/v1/./orders", Refused),
    ("POST", "/v1/x/../orders", Refused),
    ("POST", "/v1/accounts/../orders", Refused),
    ("POST", "/v1/%2e%2e/orders", Refused),
    ("POST", "/v1/..;/orders", Refused),
    // Encoded separators.
    ("POST", "/v1/orders%2F", Refused),
    ("POST", "/v1/orders%5c", Refused),
    ("POST", "/v1\\orders", Refused),
    // Spellings another server reads as a route's path: trailing slash,
    // `;` parameters (raw or encoded), letter case.
    ("POST", "/v1/orders/", Refused),
    ("POST", "/v1/orders;x=1", Refused),
    ("POST", "/v1/orders%3Bx=1", Refused),
    ("POST", "/V1/Orders", Refused),
    ("POST", "/v1/accounts/7;x/orders", Refused),
    // Percent-encoded unreserved characters are the characters themselves.
    ("POST", "/v1/%6Frders", Routed { normal: "/v1/orders", operation: "create_order" }),
    ("POST", "/v1/%6frders?b=2&a=1", Routed { normal: "/v1/orders?b=2&a=1", operation: "create_order" }),
    ("POST", "/v1/accounts/%37/orders", Routed { normal: "/v1/accounts/7/orders", operation: "create_account_order" }),
    // The normal forms themselves.
    ("POST", "/v1/orders", Routed { normal: "/v1/orders", operation: "create_order" }),
    ("POST", "/v1/accounts/7/orders", Routed { normal: "/v1/accounts/7/orders", operation: "create_account_order" }),
    // Paths no route's spelling: passed through, normalised.
    ("POST", "/v1/elsewhere", PassThrough { normal: "/v1/elsewhere" }),
    ("POST", "/v1/elsewhere/", PassThrough { normal: "/v1/elsewhere/" }),
    ("POST", "/v1/elsewhere;x=1", PassThrough { normal: "/v1/elsewhere;x=1" }),
    ("POST", "/v1/el%73ewhere?q=%7e", PassThrough { normal: "/v1/elsewhere?q=%7e" }),
    // Another method than a route's: pass-through, as before.
    ("DELETE", "/v1/orders/", PassThrough { normal: "/v1/orders/" }),
    // Format suffixes and trailing junk that frameworks strip (Rails'
    // `(.:format)`, servers trimming whitespace): refused.
    ("POST", "/v1/orders.json", Refused),
    ("POST", "/v1/ORDERS.JSON", Refused),
    ("POST", "/v1/orders.tar.gz", Refused),
    ("POST", "/v1/orders.", Refused),
    ("POST", "/v1/orders%20", Refused),
    ("POST", "/v1/orders%09", Refused),
    ("POST", "/v1/orders%0B", Refused),
    ("POST", "/v1/orders%C2%A0", Refused),
    ("POST", "/v1/orders.json%20", Refused),
    ("POST", "/v1/orders%20.json", Refused),
    ("POST", "/v1/orders/7/cancel.json", Refused),
    ("POST", "/v1/orders/7/cancel%20", Refused),
    ("POST", "/v1/accounts/7/orders.xml/", Refused),
    // A suffix inside a `{param}` is the parameter's value: routed.
    ("PUT", "/v1/orders/7.json", Routed { normal: "/v1/orders/7.json", operation: "replace_order" }),
    // Not a suffix of a route's path: passed through.
    ("POST", "/v1/ordersx", PassThrough { normal: "/v1/ordersx" }),
    ("POST", "/v1/orders-archive.json", PassThrough { normal: "/v1/orders-archive.json" }),
    // Behind a PHP front controller (Symfony and Laravel route by PATH_INFO,
    // the path after the script) these are the protected paths.
    ("POST", "/index.php/v1/orders", Refused),
    ("DELETE", "/index.php/v1/orders/42", Refused),
    ("POST", "/app/index.php/v1/orders.json", Refused),
    ("POST", "/index.php/v1/ordersx", PassThrough { normal: "/index.php/v1/ordersx" }),
    // `{id}` matches these exactly, but a framework that ignores letter case
    // (Express, ASP.NET Core), reads a format suffix (Rails: `:id` takes no
    // dots) or cuts `;` parameters runs the literal route next to it.
    ("POST", "/v1/orders/all/cancel", Routed { normal: "/v1/orders/all/cancel", operation: "cancel_all" }),
    ("POST", "/v1/orders/7/cancel", Routed { normal: "/v1/orders/7/cancel", operation: "cancel_order" }),
    ("POST", "/v1/orders/alligator/cancel", Routed { normal: "/v1/orders/alligator/cancel", operation: "cancel_order" }),
    ("POST", "/v1/orders/ALL/cancel", Refused),
    ("POST", "/v1/orders/all;x/cancel", Refused),
    ("POST", "/v1/orders/all%3Bx/cancel", Refused),
    ("POST", "/v1/orders/all%20/cancel", Refused),
    ("PUT", "/v1/orders/all", Routed { normal: "/v1/orders/all", operation: "replace_all" }),
    ("PUT", "/v1/orders/all.json", Refused),
    ("PUT", "/v1/orders/All", Refused),
    // Only a less specific route (`{id}` of DELETE has no literal next to it).
    ("DELETE", "/v1/orders/ALL", Routed { normal: "/v1/orders/ALL", operation: "delete_order" }),
    // HEAD on a protected GET route runs the GET handler in most frameworks.
    ("HEAD", "/v1/reports/7", Refused),
    ("HEAD", "/v1/reports/7.json", Refused),
];

/// A request body other than the JSON order, with its content type.
type Body = Option<(&'static str, &'static str)>;

const FORM: Body = Some(("application/x-www-form-urlencoded", "item=book&_method=DELETE"));
const FORM_ENCODED: Body = Some(("application/x-www-form-urlencoded; charset=utf-8", "item=book&%5Fmethod=put"));
const JSON_OVERRIDE: Body = Some(("application/json", r#"{"item":"book","_method":"DELETE"}"#));
const MULTIPART: Body =
    Some(("multipart/form-data; boundary=XyZ", "--XyZ\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n"));
const FORM_PLAIN: Body = Some(("application/x-www-form-urlencoded", "item=book&method=DELETE"));
// Spellings a review found that the gateway did not read as overrides:
// a content type frameworks cut at a comma, multipart types other than
// form-data, JSON that serde refuses and PHP decodes, Laravel's loose JSON
// types, Rack's brackets around a name, a folded part header, a part named
// by its Content-ID.
const FORM_COMMA: Body = Some(("application/x-www-form-urlencoded, x", "item=book&_method=DELETE"));
const FORM_BRACKETS: Body = Some(("application/x-www-form-urlencoded", "item=book&[_method]=DELETE"));
const MULTIPART_MIXED: Body =
    Some(("multipart/mixed; boundary=XyZ", "--XyZ\r\ncontent-disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n"));
const MULTIPART_FOLDED: Body = Some((
    "multipart/form-data; boundary=XyZ",
    "--XyZ\r\nContent-Disposition: form-data;\r\n name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n",
));
const MULTIPART_CONTENT_ID: Body = Some(("multipart/form-data; boundary=XyZ", "--XyZ\r\nContent-ID: _method\r\n\r\nDELETE\r\n--XyZ--\r\n"));
const JSON_OUT_OF_RANGE: Body = Some(("application/json", r#"{"_method":"DELETE","n":1e400}"#));
const TEXT_JSON: Body = Some(("text/json", r#"{"_method":"DELETE"}"#));
const OCTET_FORM: Body = Some(("application/octet-stream", "_method=DELETE"));
// A second review: a form that looks like JSON (Rack and PHP read its
// fields), a part named without quotes, Laravel's JSON marker anywhere in
// the type, and ASP.NET MVC 5's override field.
const FORM_LOOKS_JSON: Body = Some(("application/x-www-form-urlencoded", r#"{"a":"&_method=DELETE&"}"#));
const MULTIPART_UNQUOTED: Body =
    Some(("multipart/form-data; boundary=XyZ", "--XyZ\r\nContent-Disposition: form-data; name=_method\r\n\r\nDELETE\r\n--XyZ--\r\n"));
const OCTET_JSON_MARKER: Body = Some(("application/octet-stream; x=/json", r#"{"_method":"DELETE"}"#));
const FORM_MVC: Body = Some(("application/x-www-form-urlencoded", "item=book&X-HTTP-Method-Override=DELETE"));
const FORM_NOT_ASCII: Body = Some(("application/x-www-form-urlencoded; x=\u{ff}", "_method=DELETE"));

/// One case: method, target, extra headers, body, expectation.
type Case = (&'static str, &'static str, &'static [(&'static str, &'static str)], Body, Expect);

/// Method-override signals: (method, target, headers, body, expectation).
/// The path `/v1/orders/42` has only PUT and DELETE routes, so a POST there
/// without a signal is passed through; with one, frameworks (Rack, Laravel,
/// Symfony, Express's method-override) would run the protected method.
const OVERRIDES: &[Case] = &[
    ("POST", "/v1/orders/42", &[("x-http-method-override", "DELETE")], None, Refused),
    ("POST", "/v1/orders/42", &[("X-HTTP-Method", "PUT")], None, Refused),
    ("POST", "/v1/orders/42", &[("x-method-override", "delete")], None, Refused),
    ("POST", "/v1/orders/42?_method=PUT", &[], None, Refused),
    ("POST", "/v1/orders/42?a=1&%5Fmethod=DELETE", &[], None, Refused),
    ("POST", "/v1/orders/42", &[], FORM, Refused),
    ("POST", "/v1/orders/42", &[], FORM_ENCODED, Refused),
    ("POST", "/v1/orders/42", &[], JSON_OVERRIDE, Refused),
    ("POST", "/v1/orders/42", &[], MULTIPART, Refused),
    ("POST", "/v1/orders/42.json", &[("x-http-method-override", "DELETE")], None, Refused),
    ("POST", "/v1/orders/42", &[], FORM_COMMA, Refused),
    ("POST", "/v1/orders/42", &[], FORM_BRACKETS, Refused),
    ("POST", "/v1/orders/42", &[], MULTIPART_MIXED, Refused),
    ("POST", "/v1/orders/42", &[], MULTIPART_FOLDED, Refused),
    ("POST", "/v1/orders/42", &[], MULTIPART_CONTENT_ID, Refused),
    ("POST", "/v1/orders/42", &[], JSON_OUT_OF_RANGE, Refused),
    ("POST", "/v1/orders/42", &[], TEXT_JSON, Refused),
    ("POST", "/v1/orders/42", &[], FORM_LOOKS_JSON, Refused),
    ("POST", "/v1/orders/42", &[], MULTIPART_UNQUOTED, Refused),
    ("POST", "/v1/orders/42", &[], OCTET_JSON_MARKER, Refused),
    ("POST", "/v1/orders/42", &[], FORM_MVC, Refused),
    ("POST", "/v1/orders/42?X-HTTP-Method-Override=DELETE", &[], None, Refused),
    ("POST", "/v1/orders", &[], FORM_LOOKS_JSON, RefusedAfterIdentity),
    // PHP reads a leading `.` or space, and stops at a NUL, as `_method`.
    ("POST", "/v1/orders/42?.method=DELETE", &[], None, Refused),
    ("POST", "/v1/orders/42?%20.method=DELETE", &[], None, Refused),
    ("POST", "/v1/orders/42?_method%00x=DELETE", &[], None, Refused),
    // On a route's own method and path too: the upstream would run another.
    ("POST", "/v1/orders", &[("x-http-method-override", "PATCH")], None, Refused),
    ("POST", "/v1/orders?_method=POST", &[], None, Refused),
    ("POST", "/v1/orders", &[], JSON_OVERRIDE, RefusedAfterIdentity),
    // Without a signal, or on a path no route protects: as before.
    ("POST", "/v1/orders/42", &[], None, PassThrough { normal: "/v1/orders/42" }),
    ("POST", "/v1/orders/42", &[], FORM_PLAIN, PassThrough { normal: "/v1/orders/42" }),
    ("POST", "/v1/elsewhere", &[("x-http-method-override", "DELETE")], None, PassThrough { normal: "/v1/elsewhere" }),
    ("POST", "/v1/elsewhere?_method=DELETE", &[], FORM, PassThrough { normal: "/v1/elsewhere?_method=DELETE" }),
    // A header name with `_` is dropped (the default), so it signals nothing.
    ("POST", "/v1/orders/42", &[("x_http_method_override", "DELETE")], None, PassThrough { normal: "/v1/orders/42" }),
    // Binary media is streamed, not read: no framework parses it.
    ("POST", "/v1/orders/42", &[], OCTET_FORM, PassThrough { normal: "/v1/orders/42" }),
];

/// Cases only HTTP/1.1 can carry: a `Connection` header (HTTP/2 has none)
/// naming the content type, so that the upstream gets a body without one
/// (Rack reads it as a form), and a content type with a byte above ASCII.
const H1_ONLY: &[Case] = &[
    ("POST", "/v1/orders/42", &[("connection", "content-type")], OCTET_FORM, Refused),
    ("POST", "/v1/orders/42", &[], FORM_NOT_ASCII, Refused),
];

fn tls_section(cert: &Issued) -> String {
    format!("[server.tls]\ncert_file = \"{}\"\nkey_file = \"{}\"\n", cert.cert_file.display(), cert.key_file.display())
}

fn config(up: &TestUpstream, cert: &Issued) -> GatewayConfig {
    let route = |op: &str, method: &str, path: &str| {
        format!("[[routes]]\noperation = \"{op}\"\nmethod = \"{method}\"\npath = \"{path}\"\nupstream = \"orders\"\n")
    };
    GatewayConfig::new(sqlite_backend(), up.url())
        .server("default_upstream = \"orders\"")
        .tail(&route("create_account_order", "POST", "/v1/accounts/{id}/orders"))
        .tail(&route("replace_order", "PUT", "/v1/orders/{id}"))
        .tail(&route("delete_order", "DELETE", "/v1/orders/{id}"))
        .tail(&route("cancel_order", "POST", "/v1/orders/{id}/cancel"))
        .tail(&route("cancel_all", "POST", "/v1/orders/all/cancel"))
        .tail(&route("replace_all", "PUT", "/v1/orders/all"))
        .tail(&route("read_report", "GET", "/v1/reports/{id}"))
        .tail(&tls_section(cert))
}

/// The answer's status and problem type (if it is a problem).
#[derive(Debug)]
struct Answer {
    status: u16,
    problem: Option<String>,
}

fn problem_of(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v["type"].as_str().map(|t| t.strip_prefix("urn:idemgate:problem:").unwrap_or(t).to_owned())
}

/// One HTTP/1.1 request written byte for byte on a fresh TLS connection.
async fn h1_raw(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut tls = connect(addr, config).await.expect("TLS handshake");
    let mut head = format!("{method} {target} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    tls.write_all(head.as_bytes()).await.expect("write request");
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), tls.read_to_end(&mut raw)).await.expect("answer in time");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("no status line: {text:?}"));
    let body_at = text.find("\r\n\r\n").map_or(raw.len(), |i| i + 4);
    Answer { status, problem: problem_of(&raw[body_at..]) }
}

#[derive(Clone, Copy, Debug)]
enum Proto {
    H1,
    H2,
}

/// One request: method, target, headers, body.
type Sent<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'static str);

async fn send_one(
    proto: Proto,
    gw: &Gateway,
    pki: &Pki,
    h2_sender: &mut hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    (method, target, headers, body): Sent<'_>,
) -> Answer {
    match proto {
        Proto::H1 => h1_raw(gw.addr, pki.client_config(None, &[b"http/1.1"]), method, target, headers, body).await,
        Proto::H2 => {
            let url = format!("https://localhost:{}{target}", gw.addr.port());
            let r = h2_send(h2_sender, method, &url, headers, body).await;
            let problem = problem_of(&r.body);
            Answer { status: r.status, problem }
        }
    }
}

/// Runs every case without credentials (the attack) and then with an API key
/// and an idempotency key; returns the failures, one line each.
async fn run_table(proto: Proto) -> Vec<String> {
    let h1_only = if matches!(proto, Proto::H1) { H1_ONLY } else { &[] };
    let cases: Vec<Case> =
        CASES.iter().map(|&(m, t, e)| (m, t, &[][..], None, e)).chain(OVERRIDES.iter().copied()).chain(h1_only.iter().copied()).collect();
    let pki = Pki::new("edge CA");
    let cert = pki.server(Alg::EcdsaP256);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(config(&up, &cert));
    let mut sender = h2(gw.addr, pki.client_config(None, &[b"h2"])).await;
    let mut failures = Vec::new();
    for (i, &(method, target, extra, body, expect)) in cases.iter().enumerate() {
        let key = format!("edge-{proto:?}-{i}");
        let (content_type, body) = body.unwrap_or(("application/json", ORDER));
        let mut creds = vec![("authorization", "Bearer test-key"), ("content-type", content_type), ("idempotency-key", key.as_str())];
        let mut bare = vec![("content-type", content_type)];
        creds.extend_from_slice(extra);
        bare.extend_from_slice(extra);
        for (who, headers) in [("bare", &bare[..]), ("with credentials", &creds[..])] {
            let before = up.requests().len();
            let a = send_one(proto, &gw, &pki, &mut sender, (method, target, headers, body)).await;
            let seen = up.requests().into_iter().skip(before).collect::<Vec<_>>();
            let what = format!("{proto:?} {method} {target} {extra:?} {body:?} ({who})");
            let saw: Vec<(String, String)> = seen.iter().map(|r| (r.path.clone(), r.key.clone())).collect();
            // A HEAD answer has no body to name its problem.
            let refused = a.status == 400 && (method == "HEAD" || a.problem.as_deref() == Some("invalid-request"));
            let ok = match (expect, who) {
                (Refused, _) | (RefusedAfterIdentity, "with credentials") => refused && seen.is_empty(),
                (RefusedAfterIdentity, _) => a.status == 401 && seen.is_empty(),
                (Routed { .. }, "bare") => a.status == 401 && seen.is_empty(),
                (Routed { normal, operation }, _) => {
                    let want = scope_for(PRINCIPAL, operation, &key).derived_key(Some(TEST_SECRET.as_bytes()));
                    a.status == 201 && saw == vec![(normal.to_owned(), want)]
                }
                (PassThrough { normal }, _) => {
                    a.status == 201
                        && saw == vec![(normal.to_owned(), "<none>".to_owned())]
                        && seen.iter().all(|r| r.headers.keys().all(|n| !n.as_str().contains('_')))
                }
            };
            if !ok {
                failures.push(format!("{what}: expected {expect:?}, got {} {:?}, upstream saw {saw:?}", a.status, a.problem));
            }
        }
    }
    failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_and_path_spellings_over_http1_are_refused_or_routed_as_their_normal_form() {
    let failures = run_table(Proto::H1).await;
    assert!(
        failures.is_empty(),
        "{} of {} checks failed:\n{}",
        failures.len(),
        (CASES.len() + OVERRIDES.len() + H1_ONLY.len()) * 2,
        failures.join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn method_and_path_spellings_over_h2_are_refused_or_routed_as_their_normal_form() {
    let failures = run_table(Proto::H2).await;
    assert!(failures.is_empty(), "{} of {} checks failed:\n{}", failures.len(), (CASES.len() + OVERRIDES.len()) * 2, failures.join("\n"));
}
