//! Identity headers at the edge, through the real binary: what an upstream
//! (and a route's authorizer) is told about who is asking comes only from the
//! identity source that identified the request. Headers any other configured
//! source reads (a trusted header asserting a tenant, another API key's
//! header, a credential that identified no one) never reach them, on every
//! path a request can take: idempotent, async (the stored request), observe,
//! pass-through with or without a key. A credential header given twice is
//! ambiguous and refused with 401 before anything else, nothing forwarded
//! and nothing claimed.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use sha2::{Digest, Sha256};
use support::gateway::API_KEY;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// Every header a configured identity source reads, besides `authorization`.
const FOREIGN: [&str; 3] = ["x-tenant-id", "x-principal-id", "x-api-key"];

/// An authorizer that allows everything and keeps the headers it was sent.
async fn authorizer(seen: Arc<Mutex<Vec<http::HeaderMap>>>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    support::serve::spawn(listener, tokio_util::sync::CancellationToken::new(), move |req: Request<Incoming>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(req.headers().clone());
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = http::StatusCode::NO_CONTENT;
            Ok::<_, std::convert::Infallible>(r)
        }
    });
    addr
}

/// Three sources: the test API key in `authorization`, a second API key
/// source reading `x-api-key`, and trusted headers from loopback (the test
/// client's own address, so it can assert them).
fn identity() -> String {
    let test_key = hex::encode(Sha256::digest(API_KEY.as_bytes()));
    let side_key = hex::encode(Sha256::digest(b"side-key"));
    format!(
        "[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{test_key}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n\n\
         [[identity.sources]]\nkind = \"api_key\"\nheader = \"x-api-key\"\nkeys = [ {{ sha256 = \"{side_key}\", tenant = \"side\", principal = \"robot\" }} ]\n\n\
         [[identity.sources]]\nkind = \"trusted_header\"\ntenant_header = \"x-tenant-id\"\nprincipal_header = \"x-principal-id\"\ntrusted_peers = [\"127.0.0.1/32\"]\n"
    )
}

async fn setup() -> (TestUpstream, Gateway, idemgate::store::Store, Arc<Mutex<Vec<http::HeaderMap>>>) {
    let up = TestUpstream::start().await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let authz = authorizer(seen.clone()).await;
    let backend = sqlite_backend();
    let config = GatewayConfig::new(backend.clone(), up.url())
        .identity(&identity())
        .server("default_upstream = \"orders\"")
        .route(&format!(
            "authorize.url = \"http://{authz}/check\"\nauthorize.headers = [\"authorization\", \"x-tenant-id\", \"x-principal-id\", \"x-api-key\", \"x-case\"]"
        ))
        .tail("[[routes]]\noperation = \"ship_order\"\nmethod = \"POST\"\npath = \"/v1/shipments\"\nupstream = \"orders\"\nmode = \"async\"")
        .tail("[[routes]]\noperation = \"observe_order\"\nmethod = \"POST\"\npath = \"/v1/observed\"\nupstream = \"orders\"\nmode = \"observe\"\nobserve_budget = \"2s\"")
        .tail("[[routes]]\noperation = \"optional\"\nmethod = \"PUT\"\npath = \"/v1/things/{id}\"\nupstream = \"orders\"\nkey_required = false");
    let gw = Gateway::start(config);
    let store = backend.open().await;
    (up, gw, store, seen)
}

/// The headers the upstream received with `x-case: case` (waits for async work).
async fn upstream_saw(up: &TestUpstream, case: &str) -> http::HeaderMap {
    let found = || up.requests().into_iter().find(|r| r.headers.get("x-case").is_some_and(|v| v == case));
    assert!(eventually(Duration::from_secs(20), || async { found().is_some() }).await, "the upstream never received case {case}");
    found().unwrap().headers
}

fn names(h: &http::HeaderMap) -> Vec<String> {
    h.keys().map(|n| n.as_str().to_owned()).collect()
}

/// A request identified by the API key also carries a client's trusted
/// headers (`x-tenant-id: victim`, `x-principal-id: admin`) and another
/// source's credential: neither the upstream nor the authorizer sees them,
/// whichever way the request goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_of_sources_that_did_not_identify_the_request_never_reach_the_upstream() {
    let (up, gw, store, authz) = setup().await;
    let forged = |case: &'static str| -> Vec<(&'static str, &'static str)> {
        vec![
            ("authorization", "Bearer test-key"),
            ("x-tenant-id", "victim"),
            ("x-principal-id", "admin"),
            ("x-api-key", "not-a-known-key"),
            ("content-type", "application/json"),
            ("x-case", case),
        ]
    };
    let with_key = |case: &'static str, key: &'static str| {
        let mut h = forged(case);
        h.push(("idempotency-key", key));
        h
    };

    // Idempotent (sync) route, with an authorizer.
    let r = send("POST", &gw.url("/v1/orders"), &with_key("sync", "k-sync"), ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    // Async route: the worker forwards the stored request.
    let r = send("POST", &gw.url("/v1/shipments"), &with_key("async", "k-async"), ORDER).await.unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    // Observe route.
    let r = send("POST", &gw.url("/v1/observed"), &with_key("observe", "k-observe"), ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    // A route whose key is optional, without one: passed through after identity.
    let r = send("PUT", &gw.url("/v1/things/7"), &forged("optional"), ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    // Another method on a route's path, and an unrouted path (default upstream).
    let r = send("PATCH", &gw.url("/v1/orders"), &forged("other-method"), ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let r = send("DELETE", &gw.url("/v1/elsewhere"), &forged("default-upstream"), "").await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");

    for case in ["sync", "async", "observe", "optional", "other-method", "default-upstream"] {
        let h = upstream_saw(&up, case).await;
        for name in FOREIGN {
            assert!(!h.contains_key(name), "{case}: the upstream received {name}: {:?}", names(&h));
        }
        assert_eq!(h.get("authorization").unwrap(), "Bearer test-key", "{case}: the identifying credential is kept");
    }
    let asked = authz.lock().unwrap().clone();
    assert!(!asked.is_empty(), "the authorizer was asked");
    for h in &asked {
        for name in FOREIGN {
            assert!(!h.contains_key(name), "the authorizer received {name}: {:?}", names(h));
        }
        assert_eq!(h.get("authorization").unwrap(), "Bearer test-key");
    }
    // The records are the API key's, each executed once.
    assert_eq!(up.total(), 6);
    assert_eq!(settled_record(&store, "k-sync").await.unwrap().state, idemgate::idempotency::record::State::Completed);
}

/// The other way round: a request the trusted headers identify keeps them,
/// and loses the API key header that identified no one (it could name
/// another tenant to the upstream); a request the second API key identifies
/// keeps only `x-api-key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_identifying_source_keeps_its_own_headers() {
    let (up, gw, store, _authz) = setup().await;
    let h = [
        ("authorization", "Bearer someone-elses-token"),
        ("x-tenant-id", TENANT),
        ("x-principal-id", "svc"),
        ("idempotency-key", "k-trusted"),
        ("x-case", "trusted"),
    ];
    let r = send("POST", &gw.url("/v1/orders"), &h, ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let seen = upstream_saw(&up, "trusted").await;
    assert_eq!(seen.get("x-tenant-id").unwrap(), TENANT);
    assert_eq!(seen.get("x-principal-id").unwrap(), "svc");
    assert!(!seen.contains_key("authorization"), "{:?}", names(&seen));
    assert!(store.get(&scope_for("svc", "create_order", "k-trusted")).await.unwrap().is_some());

    let h = [("x-api-key", "side-key"), ("x-tenant-id", "victim"), ("x-principal-id", "admin"), ("x-case", "side")];
    let r = send("PATCH", &gw.url("/v1/orders"), &h, ORDER).await.unwrap();
    assert_eq!(r.status, 201, "{r:?}");
    let seen = upstream_saw(&up, "side").await;
    assert_eq!(seen.get("x-api-key").unwrap(), "side-key");
    assert!(!seen.contains_key("x-tenant-id") && !seen.contains_key("x-principal-id"), "{:?}", names(&seen));
}

/// Two values of any header an identity source reads are ambiguous (the
/// first would scope the request while the upstream and the authorizer got
/// both): 401 before routing, identity or the authorizer; nothing is
/// forwarded and nothing is claimed, on idempotent and pass-through paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credential_header_given_twice_is_refused() {
    let (up, gw, store, authz) = setup().await;
    type Case<'a> = (&'a str, &'a str, Vec<(&'a str, &'a str)>);
    let cases: [Case; 5] = [
        (
            "POST",
            "/v1/orders",
            vec![("authorization", "Bearer test-key"), ("authorization", "Bearer other-key"), ("idempotency-key", "k1")],
        ),
        (
            "POST",
            "/v1/orders",
            vec![("authorization", "Bearer test-key"), ("x-tenant-id", "a"), ("x-tenant-id", "b"), ("idempotency-key", "k2")],
        ),
        (
            "POST",
            "/v1/orders",
            vec![("authorization", "Bearer test-key"), ("x-api-key", "side-key"), ("x-api-key", "x"), ("idempotency-key", "k3")],
        ),
        ("PATCH", "/v1/orders", vec![("authorization", "Bearer test-key"), ("authorization", "Bearer test-key")]),
        ("DELETE", "/v1/elsewhere", vec![("x-principal-id", "a"), ("x-principal-id", "b")]),
    ];
    for (method, path, headers) in cases {
        let r = send(method, &gw.url(path), &headers, ORDER).await.unwrap();
        assert_eq!((r.status, r.problem().as_str()), (401, "unauthenticated"), "{method} {path} {headers:?}");
    }
    assert_eq!(up.total(), 0, "nothing reached the upstream");
    assert!(up.requests().is_empty());
    assert!(authz.lock().unwrap().is_empty(), "the authorizer was not asked");
    for key in ["k1", "k2", "k3"] {
        assert!(record(&store, key).await.is_none(), "{key} was not claimed");
    }
}

/// CGI-style upstreams (WSGI, Rack, PHP) read `X_Tenant_Id` as
/// `X-Tenant-Id`: header names with `_` never reach the upstream by default,
/// on an idempotent route and on a pass-through, so a client cannot assert a
/// tenant, a principal, an idempotency key or a generation under another
/// spelling. With `headers_with_underscores = "refuse"` such a request is
/// refused (400, nothing forwarded); with `"allow"` other names pass but no
/// guarded name's `_` spelling does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_and_control_headers_spelled_with_underscores_never_reach_the_upstream() {
    let spelled: [(&str, &str); 6] = [
        ("x_tenant_id", "globex"),
        ("X_Principal_Id", "root"),
        ("idempotency_key", "forged"),
        ("x_idempotency_generation", "999999"),
        ("x_forwarded_for", "10.9.9.9"),
        ("x_custom_thing", "kept-when-allowed"),
    ];
    let guarded = ["x_tenant_id", "x_principal_id", "idempotency_key", "x_idempotency_generation", "x_forwarded_for"];
    for setting in
        ["", "headers_with_underscores = \"drop\"", "headers_with_underscores = \"refuse\"", "headers_with_underscores = \"allow\""]
    {
        let up = TestUpstream::start().await;
        let backend = sqlite_backend();
        let config = GatewayConfig::new(backend.clone(), up.url()).server("default_upstream = \"orders\"").server(setting);
        let gw = Gateway::start(config);
        let store = backend.open().await;
        let request = |case: &'static str, key: Option<&'static str>| {
            let mut h: Vec<(&str, &str)> =
                vec![("authorization", "Bearer test-key"), ("content-type", "application/json"), ("x-case", case)];
            h.extend(spelled);
            h.extend(key.map(|k| ("idempotency-key", k)));
            h
        };
        let sync = send("POST", &gw.url("/v1/orders"), &request("sync", Some("k-under")), ORDER).await.unwrap();
        let pass = send("DELETE", &gw.url("/v1/elsewhere"), &request("pass", None), "").await.unwrap();
        if setting.contains("refuse") {
            for r in [&sync, &pass] {
                assert_eq!(r.status, 400, "{setting}: {r:?}");
                assert!(String::from_utf8_lossy(&r.body).contains("invalid-request"), "{r:?}");
            }
            assert_eq!(up.total(), 0, "{setting}: nothing forwarded");
            assert!(store.get(&scope_for(PRINCIPAL, "create_order", "k-under")).await.unwrap().is_none(), "nothing claimed");
            continue;
        }
        assert_eq!((sync.status, pass.status), (201, 201), "{setting}: {sync:?} {pass:?}");
        for case in ["sync", "pass"] {
            let h = upstream_saw(&up, case).await;
            for name in guarded {
                assert!(!h.contains_key(name), "{setting} {case}: the upstream received {name}: {:?}", names(&h));
            }
            assert_eq!(h.contains_key("x_custom_thing"), setting.contains("allow"), "{setting} {case}: {:?}", names(&h));
        }
        // The record is the API key's own scope, not globex's or root's.
        let record = settled_record(&store, "k-under").await.expect("claimed under the API key's scope");
        assert_eq!((&*record.scope.tenant, &*record.scope.principal), (TENANT, PRINCIPAL));
    }
}

/// Forwarding headers as a proxy writes them: from a peer that is not a
/// trusted proxy, a client's `X-Forwarded-For`, `Forwarded` and `X-Real-IP`
/// never reach the upstream, which gets the real peer in each instead; from
/// a trusted proxy the peer is appended to the chain and its `X-Real-IP` kept.
/// On an idempotent route and on a pass-through alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_name_the_real_peer() {
    let forged = [("x-forwarded-for", "203.0.113.7"), ("forwarded", "for=203.0.113.7;proto=https"), ("x-real-ip", "203.0.113.7")];
    for trusted in [false, true] {
        let up = TestUpstream::start().await;
        let mut config = GatewayConfig::new(sqlite_backend(), up.url()).server("default_upstream = \"orders\"");
        if trusted {
            config = config.server("trusted_proxies = [\"127.0.0.1/32\"]");
        }
        let gw = Gateway::start(config);
        let request = |case: &'static str, key: Option<&'static str>| {
            let mut h: Vec<(&str, &str)> =
                vec![("authorization", "Bearer test-key"), ("content-type", "application/json"), ("x-case", case)];
            h.extend(forged);
            h.extend(key.map(|k| ("idempotency-key", k)));
            h
        };
        let sync = send("POST", &gw.url("/v1/orders"), &request("sync", Some("k-fwd")), ORDER).await.unwrap();
        let pass = send("DELETE", &gw.url("/v1/elsewhere"), &request("pass", None), "").await.unwrap();
        assert_eq!((sync.status, pass.status), (201, 201), "{sync:?} {pass:?}");
        // A client's `Connection` naming the forwarding headers: they are
        // hop-by-hop then, gone before the gateway writes its own, which
        // therefore reach the upstream (before, they were written, then
        // stripped on the way out, and the upstream saw no client address).
        let mut listed = request("listed", None);
        listed.push(("connection", "X-Forwarded-For, Forwarded, X-Real-IP"));
        let listed = send("DELETE", &gw.url("/v1/elsewhere"), &listed, "").await.unwrap();
        assert_eq!(listed.status, 201, "{listed:?}");
        let h = upstream_saw(&up, "listed").await;
        let all = |name: &str| h.get_all(name).iter().map(|v| v.to_str().unwrap().to_owned()).collect::<Vec<_>>();
        assert_eq!(all("x-forwarded-for"), ["127.0.0.1"], "trusted: {trusted}");
        assert_eq!(all("forwarded"), ["for=127.0.0.1"], "trusted: {trusted}");
        assert_eq!(all("x-real-ip"), ["127.0.0.1"], "trusted: {trusted}");
        for case in ["sync", "pass"] {
            let h = upstream_saw(&up, case).await;
            let all = |name: &str| h.get_all(name).iter().map(|v| v.to_str().unwrap().to_owned()).collect::<Vec<_>>();
            if trusted {
                assert_eq!(all("x-forwarded-for"), ["203.0.113.7, 127.0.0.1"], "{case}");
                assert_eq!(all("forwarded"), ["for=203.0.113.7;proto=https, for=127.0.0.1"], "{case}");
                assert_eq!(all("x-real-ip"), ["203.0.113.7"], "{case}");
            } else {
                assert_eq!(all("x-forwarded-for"), ["127.0.0.1"], "{case}");
                assert_eq!(all("forwarded"), ["for=127.0.0.1"], "{case}");
                assert_eq!(all("x-real-ip"), ["127.0.0.1"], "{case}");
            }
        }
    }
}
