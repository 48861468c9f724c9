//! The external authorizer (`[routes.authorize]`) through the real binary,
//! on both stores: asked before every request (replays, conflicts and polls
//! included); a principal revoked after its request completed never gets the
//! stored answer while another principal's replay still works; an authorizer
//! that is down or slow fails closed with nothing claimed; positive decisions
//! may be cached for a configured delay.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use support::*;

on_both_stores!(
    a_revoked_principal_never_gets_the_stored_answer,
    an_authorizer_that_is_down_or_slow_fails_closed,
    allowed_decisions_may_be_cached_for_a_documented_delay,
    a_cached_decision_counts_only_for_the_credential_it_was_asked_with,
);

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// Allows every principal but the denied ones; records what it was asked.
#[derive(Default)]
struct Policy {
    denied: Mutex<HashSet<String>>,
    /// Credentials (`Authorization` values) denied whoever they name.
    denied_credentials: Mutex<HashSet<String>>,
    asked: Mutex<Vec<(serde_json::Value, Option<String>)>>,
    calls: AtomicU64,
    down: AtomicBool,
    slow: AtomicBool,
}

async fn authorizer(policy: Arc<Policy>) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    support::serve::spawn(listener, tokio_util::sync::CancellationToken::new(), move |req: Request<Incoming>| {
        let policy = policy.clone();
        async move {
            policy.calls.fetch_add(1, Ordering::SeqCst);
            let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
            let body: serde_json::Value = serde_json::from_slice(&req.into_body().collect().await.unwrap().to_bytes()).unwrap();
            if policy.slow.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            let denied = policy.denied.lock().unwrap().contains(body["principal"].as_str().unwrap_or_default())
                || auth.as_ref().is_some_and(|a| policy.denied_credentials.lock().unwrap().contains(a));
            policy.asked.lock().unwrap().push((body, auth));
            let status = if policy.down.load(Ordering::SeqCst) {
                StatusCode::INTERNAL_SERVER_ERROR
            } else if denied {
                StatusCode::FORBIDDEN
            } else {
                StatusCode::NO_CONTENT
            };
            let mut r = Response::new(Full::new(Bytes::new()));
            *r.status_mut() = status;
            Ok::<_, std::convert::Infallible>(r)
        }
    });
    addr
}

async fn setup(backend: Backend, extra: &str) -> (TestUpstream, Arc<Policy>, Gateway, idemgate::store::Store) {
    setup_with(backend, extra, |c| c).await
}

async fn setup_with(
    backend: Backend,
    extra: &str,
    more: impl FnOnce(GatewayConfig) -> GatewayConfig,
) -> (TestUpstream, Arc<Policy>, Gateway, idemgate::store::Store) {
    let up = TestUpstream::start().await;
    let policy = Arc::new(Policy::default());
    let addr = authorizer(policy.clone()).await;
    let cfg = GatewayConfig::new(backend.clone(), up.url())
        .route(&format!("authorize.url = \"http://{addr}/check\"\nauthorize.timeout = \"500ms\"\n{extra}"));
    let gw = Gateway::start(more(cfg));
    let store = backend.open().await;
    (up, policy, gw, store)
}

async fn post_as(gw: &Gateway, api_key: &str, key: &str, body: &str) -> Resp {
    send(
        "POST",
        &gw.url("/v1/orders"),
        &[("authorization", &format!("Bearer {api_key}")), ("idempotency-key", key), ("content-type", "application/json")],
        body.to_owned(),
    )
    .await
    .unwrap()
}

async fn a_revoked_principal_never_gets_the_stored_answer(backend: Backend) {
    let (up, policy, gw, store) = setup(backend, "").await;
    let first = post_as(&gw, "test-key", "k", ORDER).await;
    assert_eq!(first.status, 201);
    let theirs = post_as(&gw, "other-key", "k", ORDER).await;
    assert_eq!(theirs.status, 201, "another principal, its own scope");
    // The authorizer was told who asked what, with the caller's credentials.
    let (asked, auth) = policy.asked.lock().unwrap()[0].clone();
    assert_eq!(
        (
            asked["method"].as_str(),
            asked["path"].as_str(),
            asked["operation"].as_str(),
            asked["tenant"].as_str(),
            asked["principal"].as_str()
        ),
        (Some("POST"), Some("/v1/orders"), Some("create_order"), Some(TENANT), Some(PRINCIPAL))
    );
    assert_eq!(auth.as_deref(), Some("Bearer test-key"));

    // Revoked after its request completed: no replay, no conflict, nothing.
    policy.denied.lock().unwrap().insert(PRINCIPAL.to_owned());
    let before = settled_record(&store, "k").await.unwrap();
    let replay = post_as(&gw, "test-key", "k", ORDER).await;
    assert_eq!((replay.status, replay.problem().as_str()), (403, "forbidden"));
    assert!(!replay.replayed());
    assert!(!String::from_utf8_lossy(&replay.body).contains("\"order\""), "no stored body");
    assert_eq!(post_as(&gw, "test-key", "k", r#"{"other":1}"#).await.problem(), "forbidden", "not even whether the key was used");
    assert_eq!(post_as(&gw, "test-key", "new-key", ORDER).await.problem(), "forbidden");
    assert_eq!(settled_record(&store, "k").await.unwrap(), before, "the record is untouched");
    assert!(settled_record(&store, "new-key").await.is_none(), "nothing claimed");
    // Still authorized: its replay works.
    assert!(post_as(&gw, "other-key", "k", ORDER).await.replayed());
    assert_eq!(up.side_effects(&derived("k")), 1);
    assert_eq!(up.total(), 2);
}

async fn an_authorizer_that_is_down_or_slow_fails_closed(backend: Backend) {
    let (up, policy, gw, store) = setup(backend, "").await;
    policy.down.store(true, Ordering::SeqCst);
    let r = post_as(&gw, "test-key", "k", ORDER).await;
    assert_eq!((r.status, r.problem().as_str()), (503, "authorizer-unavailable"));
    assert!(r.header("retry-after").is_some());
    policy.down.store(false, Ordering::SeqCst);
    policy.slow.store(true, Ordering::SeqCst);
    let r = post_as(&gw, "test-key", "k", ORDER).await;
    assert_eq!((r.status, r.problem().as_str()), (503, "authorizer-unavailable"), "a timeout refuses too");
    assert!(settled_record(&store, "k").await.is_none(), "nothing claimed");
    assert_eq!(up.total(), 0, "nothing forwarded");
    policy.slow.store(false, Ordering::SeqCst);
    assert_eq!(post_as(&gw, "test-key", "k", ORDER).await.status, 201);
}

async fn allowed_decisions_may_be_cached_for_a_documented_delay(backend: Backend) {
    let (_up, policy, gw, _store) = setup(backend, "authorize.cache = \"1500ms\"").await;
    assert_eq!(post_as(&gw, "test-key", "k", ORDER).await.status, 201);
    assert!(post_as(&gw, "test-key", "k", ORDER).await.replayed());
    assert_eq!(policy.calls.load(Ordering::SeqCst), 1, "the second decision came from the cache");
    policy.denied.lock().unwrap().insert(PRINCIPAL.to_owned());
    assert!(post_as(&gw, "test-key", "k", ORDER).await.replayed(), "within the cache delay the revocation is not seen yet");
    tokio::time::sleep(Duration::from_millis(1700)).await;
    assert_eq!(post_as(&gw, "test-key", "k", ORDER).await.problem(), "forbidden", "after it, it is");
}

/// A cached allow is for the credential the authorizer was asked with: a
/// second credential naming the same tenant and principal (a narrower
/// delegated token, another API key of the same client) is asked about on
/// its own, not allowed by the first one's decision.
async fn a_cached_decision_counts_only_for_the_credential_it_was_asked_with(backend: Backend) {
    use sha2::{Digest, Sha256};
    let keys: Vec<String> = ["test-key", "narrow-key"]
        .iter()
        .map(|k| {
            format!("{{ sha256 = \"{}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }}", hex::encode(Sha256::digest(k.as_bytes())))
        })
        .collect();
    let identity = format!("[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {} ]\n", keys.join(", "));
    let (up, policy, gw, store) = setup_with(backend, "authorize.cache = \"10s\"", |c| c.identity(&identity)).await;
    policy.denied_credentials.lock().unwrap().insert("Bearer narrow-key".to_owned());
    assert_eq!(post_as(&gw, "test-key", "k1", ORDER).await.status, 201);
    let narrow = post_as(&gw, "narrow-key", "k2", ORDER).await;
    assert_eq!(narrow.status, 403, "the narrow credential rode on the cached allow: {:?}", narrow.body);
    assert_eq!(narrow.problem(), "forbidden");
    assert_eq!(policy.calls.load(Ordering::SeqCst), 2, "the authorizer was asked about the second credential");
    assert!(settled_record(&store, "k2").await.is_none(), "nothing claimed");
    assert_eq!(up.total(), 1);
    // The first credential's own decision is still cached.
    assert!(post_as(&gw, "test-key", "k1", ORDER).await.replayed());
    assert_eq!(policy.calls.load(Ordering::SeqCst), 2);
}
