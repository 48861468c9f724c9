//! The replay cache (PostgreSQL; `src/store/cache.rs`) through two real
//! gateways on one database: a replica replaying a key from its cache sees an
//! operator's resolution made through the other replica (admin API) or the
//! CLI on its very next replay, even while it replays that key without pause
//! during the resolution; cached replays still ask the authorizer and still
//! read `refetch` routes again. Each case also shows the cache was in use:
//! a cached replay makes no claim statement (the replica's store metrics).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const TOKEN: &str = "admin-token-cache";

fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

fn resolve_path(key: &str) -> String {
    format!("/admin/records/{}/{}/create_order/{}/resolve", enc(TENANT), enc(PRINCIPAL), enc(key))
}

async fn admin(gw: &Gateway, path: &str, body: serde_json::Value) -> Resp {
    support::admin::request(gw, "POST", path, Some(TOKEN), &body.to_string()).await
}

/// Claim statements this gateway has made (its store metrics).
async fn claims_made(gw: &Gateway) -> u64 {
    let text = String::from_utf8_lossy(&send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap().body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(r#"idemgate_store_duration_seconds_count{op="claim"} "#))
        .map_or(0, |v| v.trim().parse::<f64>().unwrap() as u64)
}

/// Replays `key` through `gw` and asserts the second one came from the cache.
async fn cached(gw: &Gateway, key: &str) -> Resp {
    let url = gw.url("/v1/orders");
    assert!(post(&url, key, ORDER, &[]).await.replayed());
    let before = claims_made(gw).await;
    let again = post(&url, key, ORDER, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(claims_made(gw).await, before, "a replay within a second of the last one is served from the cache");
    again
}

/// Replays `key` through `gw` without pause until stopped: (started, status, body) of each.
fn hammer(gw: &Gateway, key: &str, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<(Instant, u16, String)>> {
    let url = gw.url("/v1/orders");
    let key = key.to_owned();
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let started = Instant::now();
            let r = post(&url, &key, ORDER, &[]).await;
            seen.push((started, r.status, String::from_utf8_lossy(&r.body).into_owned()));
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolution_through_one_replica_is_seen_by_the_next_replay_on_another() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let a = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).admin(&format!("token_file = \"{}\"", token_file.display())));
    let b = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    for key in ["by-hand", "released", "cli"] {
        assert_eq!(post(&a.url("/v1/orders"), key, ORDER, &[]).await.status, 201);
    }
    let old = cached(&b, "by-hand").await;

    // Completed again by hand through A, with force, while B replays the key
    // without pause: from the acknowledgement on, B answers the new response.
    let stop = Arc::new(AtomicBool::new(false));
    let replays = hammer(&b, "by-hand", stop.clone());
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let body = serde_json::json!({
        "action": "complete", "status": 200, "headers": { "content-type": "application/json" },
        "body_base64": "eyJyZWZ1bmRlZCI6dHJ1ZX0=", "reason": "refunded by support", "force": true,
    });
    let resolved = admin(&a, &resolve_path("by-hand"), body).await;
    let acknowledged = Instant::now();
    assert_eq!(resolved.status, 200, "{resolved:?}");
    let next = post(&b.url("/v1/orders"), "by-hand", ORDER, &[]).await;
    assert_eq!((next.status, next.replayed()), (200, true), "{next:?}");
    assert_eq!(next.json(), serde_json::json!({ "refunded": true }));
    stop.store(true, Ordering::SeqCst);
    let seen = replays.await.unwrap();
    assert!(seen.len() > 10, "B kept replaying during the resolution ({} replays)", seen.len());
    assert!(
        seen.iter().any(|(_, status, body)| *status == old.status && *body == String::from_utf8_lossy(&old.body)),
        "old answers before"
    );
    for (started, status, body) in seen.iter().filter(|(started, ..)| *started > acknowledged) {
        assert_eq!(
            (*status, body.as_str()),
            (200, r#"{"refunded":true}"#),
            "a replay started {:?} after the acknowledgement",
            *started - acknowledged
        );
    }

    // Released by force through A: B's next request with the key runs again.
    cached(&b, "released").await;
    let release = serde_json::json!({ "action": "release", "reason": "order cancelled", "force": true });
    assert_eq!(admin(&a, &resolve_path("released"), release).await.status, 200);
    let again = post(&b.url("/v1/orders"), "released", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(up.side_effects(&derived("released")), 2);

    // Released by the CLI (another process): the same.
    cached(&b, "cli").await;
    let scope = ["--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", "cli"];
    let (code, _, err) = cli(&a, &[&["keys", "resolve"][..], &scope, &["--release", "--force", "--reason", "duplicate order"]].concat());
    assert_eq!(code, 0, "{err}");
    let again = post(&b.url("/v1/orders"), "cli", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(up.side_effects(&derived("cli")), 2);
    assert_eq!(up.side_effects(&derived("by-hand")), 1, "a resolution by hand runs nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_replays_still_read_refetch_routes_again() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend, up.url()).route("replay = \"refetch\""));
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[]).await.status, 201);
    let again = cached(&gw, "k").await;
    assert_eq!(again.json()["version"], 0);
    up.bump_resource();
    let before = claims_made(&gw).await;
    let now = post(&url, "k", ORDER, &[]).await;
    assert_eq!(claims_made(&gw).await, before, "from the cache");
    assert_eq!((now.status, now.replayed(), now.json()["version"].as_u64()), (201, true, Some(1)), "the resource as it is now");
    up.revoke("Bearer test-key");
    let refused = post(&url, "k", ORDER, &[]).await;
    assert_eq!((refused.status, refused.replayed()), (403, false), "the upstream's refusal, never stored data");
    assert_eq!(up.side_effects(&derived("k")), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_the_same_key_with_another_body_or_identity_is_never_served_from_the_cache() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend, up.url()));
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[]).await.status, 201);
    cached(&gw, "k").await;
    let other_body = post(&url, "k", r#"{"item":"pen","qty":2}"#, &[]).await;
    assert_eq!((other_body.status, other_body.replayed()), (409, false), "{other_body:?}");
    let theirs = send(
        "POST",
        &url,
        &[("authorization", "Bearer other-key"), ("idempotency-key", "k"), ("content-type", "application/json")],
        ORDER.to_owned(),
    )
    .await
    .unwrap();
    assert_eq!((theirs.status, theirs.replayed()), (201, false), "another principal's key space: a first write");
    assert_eq!(up.total(), 2);
}
