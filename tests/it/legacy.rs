//! In front of legacy clients (CONTRACT.md section 6b), end to end on both
//! stores: keys taken from business identifiers (`key_from`), records kept
//! forever, and observe mode. The real binary, a real upstream that counts
//! side effects, and the store's final records.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::{Duration, Instant};

use idemgate::idempotency::record::{State, Timestamp};
use support::*;

on_both_stores!(
    legacy_client_retrying_with_the_same_business_id_is_replayed,
    two_keys_carrying_one_business_id_are_one_operation,
    a_body_without_the_business_id_is_refused_or_passed_through,
    string_integer_and_big_integer_ids,
    header_sources_and_the_first_present_source_wins,
    header_only_routes_refuse_a_missing_key_before_reading_the_body,
    forever_records_survive_the_sweeper_and_still_replay,
    max_stored_response_zero_keeps_status_and_headers_only,
    observe_mode_passes_a_duplicate_and_a_conflicting_reuse_through,
    observe_mode_passes_a_concurrent_duplicate_through,
    observe_mode_counts_requests_enforcing_would_refuse,
    observe_history_is_valid_when_the_route_switches_to_enforcing,
    observed_request_in_flight_at_the_switch_is_in_flight_then_unknown,
    an_observed_unknown_is_not_sent_again_to_a_deduplicating_upstream,
    an_unknown_sent_under_the_client_key_is_not_sent_again_under_the_derived_one,
    an_unknown_sent_under_a_quoted_key_is_not_sent_again_under_its_bare_spelling,
    sigterm_records_observed_requests_before_exiting,
);

const AUTH: (&str, &str) = ("authorization", "Bearer test-key");
const JSON: (&str, &str) = ("content-type", "application/json");
const BY_ORDER_ID: &str = "key_from = \"body:/client_order_id\"";
const ORDER: &str = r#"{"item":"book","qty":1}"#;

async fn setup(backend: Backend, f: impl FnOnce(GatewayConfig) -> GatewayConfig) -> (TestUpstream, Gateway, idemgate::store::Store) {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(f(GatewayConfig::new(backend.clone(), upstream.url())));
    let store = backend.open().await;
    (upstream, gw, store)
}

/// A legacy client's POST: an API key and a JSON body, no `Idempotency-Key`.
async fn legacy_post(url: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
    let mut h = vec![AUTH, JSON];
    h.extend_from_slice(extra);
    send("POST", url, &h, body.to_owned()).await.unwrap_or_else(|e| panic!("POST {url} failed: {e}"))
}

fn order(id: &str) -> String {
    format!(r#"{{"client_order_id":{id},"item":"book","qty":1}}"#)
}

/// The sum of the metric lines that start with `series` (name and labels).
async fn metric(gw: &Gateway, series: &str) -> f64 {
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    let text = String::from_utf8_lossy(&m.body).into_owned();
    text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())).sum()
}

fn would(what: &str) -> String {
    format!(r#"idemgate_observe_would_total{{operation="create_order",would="{what}"}}"#)
}

const SKIPPED: &str = r#"idemgate_observe_skipped_total{operation="create_order"}"#;

/// `keys show --json` of the create_order record with key `key`.
fn show_json(gw: &Gateway, key: &str) -> serde_json::Value {
    let (code, out, err) =
        cli(gw, &["keys", "show", "--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", key, "--json"]);
    assert_eq!(code, 0, "{err}");
    serde_json::from_str(&out).expect("keys show --json")
}

async fn settled(store: &idemgate::store::Store, key: &str, state: State) -> idemgate::idempotency::record::Record {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let last = record(store, key).await;
        match last {
            Some(r) if r.state == state => return r,
            _ if Instant::now() > deadline => panic!("record {key} never became {state}: {last:?}"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

// ---------------------------------------------------------------------------
// Keys from business identifiers

async fn legacy_client_retrying_with_the_same_business_id_is_replayed(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(BY_ORDER_ID)).await;
    let url = gw.url("/v1/orders");
    let body = order("\"ORD-1001\"");
    let first = legacy_post(&url, &body, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    // The upstream saw the key derived from the scope whose key is the business id.
    assert_eq!(up.side_effects(&derived("ORD-1001")), 1);
    let again = legacy_post(&url, &body, &[]).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.total(), 1, "the upstream acted once");
    let rec = settled_record(&store, "ORD-1001").await.expect("record");
    assert_eq!(rec.state, State::Completed);
    assert_eq!(rec.key_source.as_deref(), Some("body:/client_order_id"));
    let shown = show_json(&gw, "ORD-1001");
    assert_eq!(shown["key_source"], "body:/client_order_id");
    assert_eq!(shown["state"], "completed");
}

async fn two_keys_carrying_one_business_id_are_one_operation(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(BY_ORDER_ID)).await;
    let url = gw.url("/v1/orders");
    let body = order("\"ORD-7\"");
    let first = post(&url, "transport-key-a", &body, &[]).await;
    assert_eq!(first.status, 201);
    let second = post(&url, "transport-key-b", &body, &[]).await;
    assert_eq!(second.status, 201);
    assert!(second.replayed(), "another Idempotency-Key, the same business operation");
    assert_eq!(second.body, first.body);
    assert_eq!(up.total(), 1);
    // The transport keys made no records of their own.
    assert!(settled_record(&store, "transport-key-a").await.is_none());
    assert!(settled_record(&store, "transport-key-b").await.is_none());
    // A changed order under the same business id is a conflict, whatever the transport key.
    let changed = post(&url, "transport-key-c", &order("\"ORD-7\"").replace("book", "pen"), &[]).await;
    assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"));
    assert_eq!(up.total(), 1);
}

async fn a_body_without_the_business_id_is_refused_or_passed_through(backend: Backend) {
    let optional = "\n[[routes]]\noperation = \"quote\"\nmethod = \"POST\"\npath = \"/v1/quotes\"\nupstream = \"orders\"\n\
                    key_from = \"body:/client_order_id\"\nkey_required = false\n";
    let (up, gw, store) = setup(backend, |c| c.route(BY_ORDER_ID).tail(optional)).await;
    let url = gw.url("/v1/orders");
    for body in [r#"{"item":"book"}"#, r#"{"client_order_id":null}"#, r#"{"client_order_id":{"id":1}}"#, r#"{"client_order_id":1.5}"#, ""] {
        let r = legacy_post(&url, body, &[]).await;
        assert_eq!((r.status, r.problem().as_str()), (400, "missing-idempotency-key"), "{body}");
        assert!(r.json()["detail"].as_str().unwrap().contains("/client_order_id"), "{:?}", r.json());
    }
    // Not JSON by its content type: the body is not looked into.
    let r = send("POST", &url, &[AUTH, ("content-type", "text/plain")], order("\"X\"")).await.unwrap();
    assert_eq!((r.status, r.problem().as_str()), (400, "missing-idempotency-key"));
    // Present but not a valid key: refused as such.
    let r = legacy_post(&url, &order("\"has space\""), &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-idempotency-key"));
    let r = legacy_post(&url, r#"{"client_order_id":"a","client_order_id":"b"}"#, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));
    assert_eq!(up.total(), 0);
    assert!(store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap().is_empty());

    // key_required = false: passed through as it came, twice, nothing recorded.
    let quotes = gw.url("/v1/quotes");
    let body = r#"{"item":"book"}"#;
    for _ in 0..2 {
        let r = legacy_post(&quotes, body, &[]).await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    assert_eq!(up.total(), 2);
    let seen = up.requests();
    assert!(seen.iter().all(|r| r.key == "<none>" && r.body == body.as_bytes()), "passed through unchanged");
    assert!(store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap().is_empty());
    // With the id present it is idempotent.
    let with_id = legacy_post(&quotes, &order("5"), &[]).await;
    let again = legacy_post(&quotes, &order("5"), &[]).await;
    assert!(!with_id.replayed() && again.replayed());
    assert_eq!(up.total(), 3);
}

async fn string_integer_and_big_integer_ids(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(BY_ORDER_ID)).await;
    let url = gw.url("/v1/orders");
    // An integer id is its decimal digits.
    assert_eq!(legacy_post(&url, &order("42"), &[]).await.status, 201);
    assert!(legacy_post(&url, &order("42"), &[]).await.replayed());
    assert_eq!(settled_record(&store, "42").await.expect("record").state, State::Completed);
    // The same digits as a string are the same key, but another request.
    let as_string = legacy_post(&url, &order("\"42\""), &[]).await;
    assert_eq!((as_string.status, as_string.problem().as_str()), (409, "idempotency-key-reused"));
    // Ids past 2^53 and past 2^64 are kept exactly, never rounded together.
    for id in ["9007199254740992", "9007199254740993", "123456789012345678901234567890", "123456789012345678901234567891"] {
        let r = legacy_post(&url, &order(id), &[]).await;
        assert_eq!(r.status, 201, "{id}");
        assert!(!r.replayed(), "{id} is its own operation");
        assert!(settled_record(&store, id).await.is_some(), "{id}");
    }
    assert!(legacy_post(&url, &order("123456789012345678901234567890"), &[]).await.replayed());
    // Strings are unescaped, then validated.
    assert_eq!(legacy_post(&url, &order(r#""ORD-\u0041""#), &[]).await.status, 201);
    assert!(settled_record(&store, "ORD-A").await.is_some());
    assert_eq!(up.total(), 6);
}

async fn header_sources_and_the_first_present_source_wins(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("key_from = [\"header:x-client-order-id\", \"body:/client_order_id\"]")).await;
    let url = gw.url("/v1/orders");
    // Both present: the header wins.
    let r = legacy_post(&url, &order("\"B-1\""), &[("x-client-order-id", "H-1")]).await;
    assert_eq!(r.status, 201);
    assert_eq!(settled_record(&store, "H-1").await.expect("record").key_source.as_deref(), Some("header:x-client-order-id"));
    assert!(settled_record(&store, "B-1").await.is_none());
    // No header: the body's id.
    assert_eq!(legacy_post(&url, &order("\"B-2\""), &[]).await.status, 201);
    assert_eq!(show_json(&gw, "B-2")["key_source"], "body:/client_order_id");
    assert_eq!(show_json(&gw, "H-1")["key_source"], "header:x-client-order-id");
    // The header's retry is replayed whatever the body's id (the header decided the key).
    let retry = legacy_post(&url, &order("\"B-1\""), &[("x-client-order-id", "H-1")]).await;
    assert!(retry.replayed());
    // A repeated header is ambiguous.
    let r = legacy_post(&url, &order("\"B-3\""), &[("x-client-order-id", "a"), ("x-client-order-id", "b")]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-idempotency-key"));
    assert_eq!(up.total(), 2);
    // The plain Idempotency-Key header is not a source of this route.
    let r = post(&url, "k1", r#"{"item":"book"}"#, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "missing-idempotency-key"));
}

async fn header_only_routes_refuse_a_missing_key_before_reading_the_body(backend: Backend) {
    let by_body = "\n[[routes]]\noperation = \"by_body\"\nmethod = \"POST\"\npath = \"/v1/by_body\"\nupstream = \"orders\"\n\
                   key_from = \"body:/client_order_id\"\n";
    let (up, gw, _store) =
        setup(backend, |c| c.server("max_request_body = \"1KiB\"").route("key_from = \"header:x-request-id\"").tail(by_body)).await;
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(4096));
    // The key is looked for in a header: no body is read to refuse it.
    let r = legacy_post(&gw.url("/v1/orders"), &big, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "missing-idempotency-key"));
    assert!(r.json()["detail"].as_str().unwrap().contains("x-request-id"));
    // A key in the body needs the body: an oversized one is refused as such.
    let r = legacy_post(&gw.url("/v1/by_body"), &big, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (413, "request-too-large"));
    // The header source works like Idempotency-Key.
    let h = [("x-request-id", "req-1")];
    assert_eq!(legacy_post(&gw.url("/v1/orders"), r#"{"item":"book"}"#, &h).await.status, 201);
    assert!(legacy_post(&gw.url("/v1/orders"), r#"{"item":"book"}"#, &h).await.replayed());
    assert_eq!(up.side_effects(&derived("req-1")), 1);
    assert_eq!(up.total(), 1);
}

// ---------------------------------------------------------------------------
// Durable business identity

async fn forever_records_survive_the_sweeper_and_still_replay(backend: Backend) {
    let brief = "\n[[routes]]\noperation = \"brief\"\nmethod = \"POST\"\npath = \"/v1/brief\"\nupstream = \"orders\"\nretention = \"1s\"\n";
    let (up, gw, store) =
        setup(backend, |c| c.route(BY_ORDER_ID).route("retention = \"forever\"").tail(brief).sweep_interval("100ms")).await;
    let url = gw.url("/v1/orders");
    let first = legacy_post(&url, &order("\"PAY-1\""), &[]).await;
    assert_eq!(first.status, 201);
    assert_eq!(post(&gw.url("/v1/brief"), "b1", "{}", &[]).await.status, 201);
    let kept = settled_record(&store, "PAY-1").await.expect("record");
    assert_eq!(kept.expires_at, Timestamp::FOREVER);
    // The sweeper runs every 100 ms: it removes the brief record after its
    // second, and leaves the forever record alone.
    let brief_scope = scope_for(PRINCIPAL, "brief", "b1");
    assert!(eventually(Duration::from_secs(10), || async { store.get(&brief_scope).await.unwrap().is_none() }).await, "brief swept");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(settled_record(&store, "PAY-1").await.expect("kept forever"), kept);
    let again = legacy_post(&url, &order("\"PAY-1\""), &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.total(), 2);
    let shown = show_json(&gw, "PAY-1");
    assert_eq!(shown["expires_at"], "forever");
    // Listed and counted.
    let (code, out, err) = cli(&gw, &["keys", "list", "--retention", "forever", "--json"]);
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    let keys: Vec<&str> = listed["records"].as_array().unwrap().iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["PAY-1"]);
    let (code, _, err) = cli(&gw, &["keys", "list", "--retention", "24h"]);
    assert_eq!(code, 2, "only forever is a retention filter: {err}");
    let gauge = r#"idemgate_forever_records{operation="create_order"}"#;
    assert!(eventually(Duration::from_secs(10), || async { metric(&gw, gauge).await == 1.0 }).await, "forever gauge");
}

async fn max_stored_response_zero_keeps_status_and_headers_only(backend: Backend) {
    let (up, gw, store) =
        setup(backend, |c| c.route(BY_ORDER_ID).route("retention = \"forever\"").route("max_stored_response = \"0\"")).await;
    let url = gw.url("/v1/orders");
    let first = legacy_post(&url, &order("\"PAY-2\""), &[]).await;
    assert_eq!(first.status, 201);
    assert!(!first.body.is_empty(), "the client gets the whole answer");
    let rec = settled_record(&store, "PAY-2").await.expect("record");
    let stored = rec.response.expect("response");
    assert_eq!((stored.status, stored.body), (201, None));
    assert!(stored.headers.iter().any(|(n, v)| n == "location" && v == b"/v1/orders/1"));
    let again = legacy_post(&url, &order("\"PAY-2\""), &[]).await;
    assert_eq!((again.status, again.problem().as_str()), (409, "response-not-stored"));
    assert_eq!(again.json()["original_status"], 201);
    assert!(again.replayed());
    assert_eq!(up.total(), 1, "never executed twice");
}

// ---------------------------------------------------------------------------
// Observe mode

/// Observe mode with a budget no busy test machine exceeds: these tests are
/// about what is observed; the budget itself is tested with the store down.
const OBSERVE: &str = "mode = \"observe\"\nobserve_budget = \"2s\"";

async fn observe_mode_passes_a_duplicate_and_a_conflicting_reuse_through(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(OBSERVE)).await;
    let url = gw.url("/v1/orders");
    let key = "obs-duplicate-key";
    let first = post(&url, key, ORDER, &[]).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(first.header("set-cookie"), Some("session=upstream-secret"), "the upstream's own answer");
    let rec = settled(&store, key, State::Completed).await;
    assert_eq!(rec.response.as_ref().and_then(|r| r.body.as_deref()), Some(&first.body[..]), "recorded as it streamed by");
    assert_eq!(rec.key_source.as_deref(), Some("header:idempotency-key"));

    // A duplicate: enforcing would have replayed; observed, it reaches the upstream.
    let dup = post(&url, key, ORDER, &[]).await;
    assert_eq!(dup.status, 201);
    assert!(!dup.replayed());
    assert_eq!(dup.header("set-cookie"), Some("session=upstream-secret"));
    assert_ne!(dup.body, first.body, "a second execution's answer, not a replay");
    assert_eq!(up.total(), 2);
    // A conflicting reuse: enforcing would have answered 409.
    let other = "obs-conflict-key";
    assert_eq!(post(&url, other, ORDER, &[]).await.status, 201);
    settled(&store, other, State::Completed).await;
    let changed = post(&url, other, r#"{"item":"pen","qty":2}"#, &[]).await;
    assert_eq!(changed.status, 201, "never a 409 in observe mode");
    assert_eq!(up.total(), 4);
    // The upstream got the requests untouched: no key, no generation.
    assert!(up.requests().iter().all(|r| r.key == "<none>" && r.generation.is_none()));
    // The first records stand: the duplicate and the reuse changed nothing.
    assert_eq!(record(&store, key).await.unwrap(), rec);
    assert_eq!(metric(&gw, &would("replay")).await, 1.0);
    assert_eq!(metric(&gw, &would("conflict")).await, 1.0);
    assert_eq!(metric(&gw, &would("reject_in_flight")).await, 0.0);
    assert_eq!(metric(&gw, SKIPPED).await, 0.0);
    assert_eq!(metric(&gw, r#"idemgate_requests_total{operation="create_order",outcome="passthrough"}"#).await, 4.0);
    assert_eq!(gw.log_count(r#""would":"replay""#), 1, "{}", gw.logs());
    assert_eq!(gw.log_count(r#""would":"conflict""#), 1);
    assert_eq!(gw.log_count(key) + gw.log_count(other), 0, "keys are never logged");
}

async fn observe_mode_passes_a_concurrent_duplicate_through(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(OBSERVE)).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, "k1", ORDER, &[("x-test-sleep-ms", "800")]).await });
    received.recv().await.unwrap();
    assert_eq!(record(&store, "k1").await.expect("claimed").state, State::InFlight);
    let dup = post(&url, "k1", ORDER, &[]).await;
    assert_eq!(dup.status, 201, "enforcing would have answered 409 request-in-progress");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    assert_eq!(up.total(), 2);
    let rec = settled(&store, "k1", State::Completed).await;
    assert_eq!(rec.response.and_then(|r| r.body), Some(first.body.clone()), "the claimant's answer is the record");
    assert_eq!(metric(&gw, &would("reject_in_flight")).await, 1.0);
    assert_eq!(gw.log_count(r#""would":"reject_in_flight""#), 1);
}

async fn observe_mode_counts_requests_enforcing_would_refuse(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route(OBSERVE).route(BY_ORDER_ID)).await;
    let url = gw.url("/v1/orders");
    let refused = |reason: &str| format!(r#"idemgate_observe_would_refuse_total{{operation="create_order",reason="{reason}"}}"#);
    // No business id, no identity, an invalid id, a body the fingerprint refuses: all pass.
    assert_eq!(legacy_post(&url, r#"{"item":"book"}"#, &[]).await.status, 201);
    assert_eq!(send("POST", &url, &[JSON], order("\"A\"")).await.unwrap().status, 201);
    assert_eq!(legacy_post(&url, &order("\"has space\""), &[]).await.status, 201);
    assert_eq!(legacy_post(&url, r#"{"client_order_id":"A","client_order_id":"B"}"#, &[]).await.status, 201);
    assert_eq!(up.total(), 4);
    for reason in ["missing_key", "unauthenticated", "invalid_key", "invalid_body"] {
        assert_eq!(metric(&gw, &refused(reason)).await, 1.0, "{reason}");
    }
    assert!(store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap().is_empty());
    // A body over max_request_body passes unobserved.
    let big = format!(r#"{{"client_order_id":"BIG","pad":"{}"}}"#, "x".repeat(2 * 1024 * 1024));
    let r = legacy_post(&url, &big, &[]).await;
    assert_eq!(r.status, 201);
    assert_eq!(up.requests().last().unwrap().body.len(), big.len(), "passed on whole");
    assert_eq!(metric(&gw, SKIPPED).await, 1.0);
    assert!(settled_record(&store, "BIG").await.is_none());
}

async fn observe_history_is_valid_when_the_route_switches_to_enforcing(backend: Backend) {
    let (up, mut gw, store) = setup(backend, |c| c.route(OBSERVE).route(BY_ORDER_ID)).await;
    let url = gw.url("/v1/orders");
    let first = legacy_post(&url, &order("\"ORD-9\""), &[]).await;
    assert_eq!(first.status, 201);
    settled(&store, "ORD-9", State::Completed).await;
    assert_eq!(legacy_post(&url, &order("\"ORD-10\""), &[("x-test-status", "503")]).await.status, 503);
    settled(&store, "ORD-10", State::Completed).await;
    // Enforcing now: the observed record is replayed, its changed request refused.
    gw.config.route_extra = gw.config.route_extra.replace(OBSERVE, "");
    gw.restart();
    let replayed = legacy_post(&url, &order("\"ORD-9\""), &[]).await;
    assert!(replayed.replayed());
    assert_eq!(replayed.body, first.body, "the answer observe mode recorded");
    let changed = legacy_post(&url, &order("\"ORD-9\"").replace("book", "pen"), &[]).await;
    assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"));
    // The 503 was recorded too (a server error is an answer, as in enforcing).
    let r = legacy_post(&url, &order("\"ORD-10\""), &[]).await;
    assert_eq!((r.status, r.replayed()), (503, true));
    assert_eq!(up.total(), 2);
}

async fn observed_request_in_flight_at_the_switch_is_in_flight_then_unknown(backend: Backend) {
    let (up, mut gw, store) =
        setup(backend, |c| c.route(OBSERVE).route(BY_ORDER_ID).route("lease = \"6s\"").timeout("2s").sweep_interval("200ms")).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let client = tokio::spawn(async move { send("POST", &u, &[AUTH, JSON, ("x-test-sleep-ms", "1500")], order("\"ORD-X\"")).await });
    received.recv().await.unwrap();
    assert_eq!(record(&store, "ORD-X").await.expect("claimed").state, State::InFlight);
    // The observing gateway dies with the request at the upstream; an
    // enforcing one takes its place.
    gw.kill9();
    let _ = client.await;
    gw.config.route_extra = gw.config.route_extra.replace(OBSERVE, "");
    gw.restart();
    let r = legacy_post(&url, &order("\"ORD-X\""), &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "request-in-progress"), "its lease is still running");
    let rec = settled(&store, "ORD-X", State::Unknown).await;
    assert_eq!(rec.key_source.as_deref(), Some("body:/client_order_id"));
    let r = legacy_post(&url, &order("\"ORD-X\""), &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "it may have executed: never re-forwarded blindly");
    assert_eq!(up.total(), 1);
}

/// Observe mode forwards no key. On a route whose upstream deduplicates by
/// key, a request observed timing out (`unknown`) must not be sent again
/// once the route enforces: the upstream never saw a key for the first
/// run, so the derived key would not stop it acting twice.
async fn an_observed_unknown_is_not_sent_again_to_a_deduplicating_upstream(backend: Backend) {
    let (up, mut gw, store) = setup(backend, |c| c.route(OBSERVE).route("upstream_idempotent = true").timeout("1s")).await;
    up.set_dedupe(true);
    let url = gw.url("/v1/orders");
    let r = post(&url, "k1", ORDER, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!(r.status, 504, "observed: the upstream timed out");
    let rec = settled(&store, "k1", State::Unknown).await;
    assert_eq!(rec.reforward_key, Some(idemgate::idempotency::record::ReforwardKey::NoKey), "observe mode sends no key");
    // Observed again: the request passes through (the upstream, seeing no
    // key, runs it), and the observation takes the record over to record
    // what it answered, as before this route was told apart.
    let again = post(&url, "k1", ORDER, &[]).await;
    assert_eq!(again.status, 201);
    let rec = settled(&store, "k1", State::Completed).await;
    assert_eq!(rec.reforward_key, Some(idemgate::idempotency::record::ReforwardKey::NoKey));
    assert_eq!(up.total(), 2);
    let r = post(&url, "k2", ORDER, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!(r.status, 504);
    settled(&store, "k2", State::Unknown).await;
    gw.config.route_extra = gw.config.route_extra.replace(OBSERVE, "");
    gw.restart();
    assert!(post(&url, "k1", ORDER, &[]).await.replayed(), "the answer observe mode recorded");
    let r = post(&url, "k2", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "{}", gw.logs());
    assert_eq!(up.total(), 3, "k2 executed once: {:?}", up.ledger());
}

/// The same across a change of `forward_key`: an attempt sent under the
/// client's key and lost is not sent again under the derived key (the
/// upstream would not recognise it), but still under the client's.
async fn an_unknown_sent_under_the_client_key_is_not_sent_again_under_the_derived_one(backend: Backend) {
    const CLIENT: &str = "forward_key = \"client\"";
    let (up, mut gw, store) = setup(backend, |c| c.route(CLIENT).route("upstream_idempotent = true").timeout("1s")).await;
    up.set_dedupe(true);
    let url = gw.url("/v1/orders");
    for k in ["k1", "k2"] {
        let r = post(&url, k, ORDER, &[("x-test-sleep-ms", "1500")]).await;
        assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"));
        let rec = settled(&store, k, State::Unknown).await;
        assert_eq!(rec.reforward_key, Some(idemgate::idempotency::record::ReforwardKey::Client));
    }
    // Still the client's key: the retry is sent again, and the upstream
    // recognises it.
    assert_eq!(post(&url, "k2", ORDER, &[]).await.status, 201);
    assert_eq!(up.side_effects("k2"), 1);
    gw.config.route_extra = gw.config.route_extra.replace(CLIENT, "");
    gw.restart();
    let r = post(&url, "k1", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "{}", gw.logs());
    assert_eq!(up.side_effects("k1"), 1);
    assert_eq!(up.total(), 2, "each executed once: {:?}", up.ledger());
}

/// `"k3"` and `k3` are one key to idemgate (an sf-string is unquoted), but
/// two to an upstream that compares the header it is sent: an attempt sent
/// under one spelling and lost is sent again only under the same spelling.
async fn an_unknown_sent_under_a_quoted_key_is_not_sent_again_under_its_bare_spelling(backend: Backend) {
    use idemgate::idempotency::record::ReforwardKey;
    let (up, gw, store) = setup(backend, |c| c.route("forward_key = \"client\"").route("upstream_idempotent = true").timeout("1s")).await;
    up.set_dedupe(true);
    let url = gw.url("/v1/orders");
    let r = post(&url, "\"k3\"", ORDER, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"));
    settled(&store, "k3", State::Unknown).await;
    let r = post(&url, "k3", ORDER, &[]).await;
    assert_eq!(up.total(), 1, "not sent again under another spelling: {:?}", up.ledger());
    assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "{}", gw.logs());
    assert_eq!(record(&store, "k3").await.and_then(|r| r.reforward_key), Some(ReforwardKey::ClientQuoted));
    // The spelling it was sent under: sent again, and the upstream knows it.
    assert_eq!(post(&url, "\"k3\"", ORDER, &[]).await.status, 201);
    assert_eq!(settled(&store, "k3", State::Completed).await.reforward_key, Some(ReforwardKey::ClientQuoted));
    assert_eq!(up.total(), 1, "executed once: {:?}", up.ledger());
}

async fn sigterm_records_observed_requests_before_exiting(backend: Backend) {
    let (up, mut gw, store) = setup(backend, |c| c.route(OBSERVE)).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let inflight = tokio::spawn(async move { post(&u, "k", ORDER, &[("x-test-sleep-ms", "700")]).await });
    received.recv().await.unwrap();
    gw.signal("TERM");
    let r = inflight.await.unwrap();
    assert_eq!(r.status, 201, "the observed request finished");
    let status = tokio::task::spawn_blocking(move || gw.wait_exit(Duration::from_secs(15))).await.unwrap();
    assert!(status.success(), "exit status {status:?}");
    // The drain waited for the recording: a switch by restart finds a completed record.
    let rec = settled_record(&store, "k").await.expect("record");
    assert_eq!(rec.state, State::Completed);
    assert_eq!(rec.response.and_then(|r| r.body), Some(r.body));
    assert_eq!(up.total(), 1);
}

// ---------------------------------------------------------------------------
// Observe mode with the store down or slow (PostgreSQL only)

/// Observed requests pass whatever the store does; those it could not
/// observe in time are counted as skipped. The store's operation timeout is
/// 20 s here, so a request that waited for the store instead of the 50 ms
/// budget would take that long: every request below finishes well before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_mode_passes_with_postgres_stopped_or_hung() {
    let mut pg = support::postgres::PgServer::start().expect("start private PostgreSQL");
    let direct = pg.create_database("observe").expect("create database");
    let proxy = support::faultproxy::FaultProxy::start(format!("127.0.0.1:{}", pg.port()).parse().unwrap()).await;
    let proxied = direct.replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port()));
    let up = TestUpstream::start().await;
    // The default budget: 50 ms.
    let mut config = GatewayConfig::new(Backend::Postgres { url: proxied.clone() }, up.url()).route("mode = \"observe\"");
    config.store_section = Some(format!(
        "[store]\nkind = \"postgres\"\nurl = \"{proxied}\"\npool_size = 4\noperation_timeout = \"20s\"\nsweep_interval = \"1h\"\n"
    ));
    let gw = Gateway::start(config);
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "before", ORDER, &[]).await.status, 201);
    let store = Backend::Postgres { url: direct }.open().await;
    settled(&store, "before", State::Completed).await;
    drop(store);
    // The first claim opens the pool's connection and may itself outlast the
    // 50 ms budget on a loaded machine (it is then counted as skipped and
    // recorded in the background, as it was above): count from here on.
    let skipped_before = metric(&gw, SKIPPED).await;

    // Hung: statements never get an answer.
    proxy.set(support::faultproxy::Fault::BlackholeDownstream);
    for i in 0..3 {
        let started = Instant::now();
        let r = post(&url, &format!("hung-{i}"), ORDER, &[]).await;
        assert_eq!(r.status, 201);
        assert!(started.elapsed() < Duration::from_secs(10), "waited for the store: {:?}", started.elapsed());
    }
    // Stopped: connections are refused.
    proxy.set(support::faultproxy::Fault::None);
    proxy.reset_all();
    pg.stop_immediate().expect("stop PostgreSQL");
    for i in 0..3 {
        let started = Instant::now();
        let r = post(&url, &format!("down-{i}"), ORDER, &[]).await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
        assert!(started.elapsed() < Duration::from_secs(10), "waited for the store: {:?}", started.elapsed());
    }
    assert_eq!(up.total(), 7, "every request reached the upstream");
    assert_eq!(metric(&gw, SKIPPED).await - skipped_before, 6.0, "each request with the store hung or down is skipped");
    assert_eq!(metric(&gw, r#"idemgate_observe_would_total"#).await, 0.0);
}

// ---------------------------------------------------------------------------
// The storage cost of durable business identity (a measurement, not a check:
// `cargo test --test legacy -- --ignored storage_cost --nocapture`; the
// figures are in docs/legacy.md)

/// Records of one kind per measurement.
const COST_RECORDS: usize = 20_000;

/// Fills the store with `COST_RECORDS` completed forever records the way the
/// gateway writes them (claim, then complete), with or without a body.
async fn fill(store: &idemgate::store::Store, tag: &str, body: Option<&'static [u8]>) {
    use futures_util::StreamExt;
    use idemgate::idempotency::record::Retention;
    use idemgate::idempotency::record::StoredResponse;
    use idemgate::store::{ClaimOutcome, ClaimRequest};
    let headers = vec![
        ("content-type".to_owned(), b"application/json".to_vec()),
        ("location".to_owned(), b"/v1/orders/1234567".to_vec()),
        ("x-request-id".to_owned(), b"0b5bd3c2-5c64-4d7e-9a55-2b1f0e7c9d11".to_vec()),
    ];
    futures_util::stream::iter(0..COST_RECORDS)
        .for_each_concurrent(64, |i| {
            let (store, headers) = (store.clone(), headers.clone());
            async move {
                let key = format!("ORD-{tag}-{}", uuid::Uuid::new_v4());
                let req = ClaimRequest {
                    scope: scope(&key),
                    request_hash: idemgate::idempotency::fingerprint::Fingerprint([(i % 251) as u8; 32]),
                    owner: "gateway-7f9c-1234".into(),
                    lease: Duration::from_secs(60),
                    reforward: None,
                    sent: idemgate::idempotency::record::ReforwardKey::Derived,
                    fingerprint_spec: "test-settings".into(),
                    claim_token: uuid::Uuid::new_v4(),
                    acceptance: None,
                    key_source: "body:/client_order_id".into(),
                    request_head: None,
                };
                let ClaimOutcome::Claimed(claim) = store.claim(&req).await.expect("claim") else { panic!("not claimed") };
                let response = StoredResponse { status: 201, headers, body: body.map(bytes::Bytes::from_static) };
                store.complete(&claim, &response, Retention::Forever).await.expect("complete");
            }
        })
        .await;
}

/// A 256-byte JSON answer, the size of a typical "order created" body.
const BODY_256: &[u8] = br#"{"id":"ord_7f3a9c2e1b","status":"accepted","amount":{"value":"1299.00","currency":"EUR"},"customer":"cus_4e8d1a","created_at":"2024-05-01T12:00:00Z","items":[{"sku":"BK-1001","qty":1,"price":"1299.00"}],"links":{"self":"/v1/orders/ord_7f3a9c2e1b"},"v":100}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement for docs/legacy.md, not a check"]
async fn storage_cost_per_record_on_both_stores() {
    assert!(BODY_256.len() == 256, "{}", BODY_256.len());
    // PostgreSQL: the table with its indexes and TOAST, compacted (VACUUM
    // FULL) so the figure is live data, not the dead versions a claim's
    // completion leaves until autovacuum.
    let pg = support::postgres::shared();
    let db = format!("cost_{}", std::process::id());
    let backend = Backend::Postgres { url: pg.create_database(&db).expect("database") };
    let store = backend.open().await;
    let size = |sql: &str| -> f64 { pg.simple_query(&db, sql).expect("query")[0][0].as_deref().unwrap().parse().unwrap() };
    let total = "SELECT pg_total_relation_size('idemgate_records')";
    let compact = || pg.simple_query(&db, "VACUUM FULL idemgate_records").expect("vacuum");
    let s0 = size(total);
    fill(&store, "nobody", None).await;
    let raw1 = size(total);
    compact();
    let s1 = size(total);
    fill(&store, "body", Some(BODY_256)).await;
    compact();
    let s2 = size(total);
    let n = COST_RECORDS as f64;
    let row_nobody = size("SELECT avg(pg_column_size(r.*)) FROM idemgate_records r WHERE response_body IS NULL");
    let row_body = size("SELECT avg(pg_column_size(r.*)) FROM idemgate_records r WHERE response_body IS NOT NULL");
    let indexes = size("SELECT pg_indexes_size('idemgate_records')") / (2.0 * n);
    let forever_index = size("SELECT pg_relation_size('idemgate_records_forever')") / (2.0 * n);
    println!(
        "postgres: per record {:.0} B without a body, {:.0} B with a 256 B body (table+indexes+toast, compacted); \
         before compaction {:.0} B without a body; row {:.0} B / {:.0} B; indexes {:.0} B/record of which the forever index {:.0} B",
        (s1 - s0) / n,
        (s2 - s1) / n,
        (raw1 - s0) / n,
        row_nobody,
        row_body,
        indexes,
        forever_index
    );
    drop(store);

    // SQLite: the database file after a checkpoint (the WAL folded in).
    let backend = sqlite_backend();
    let store = backend.open().await;
    let Backend::Sqlite { path, .. } = &backend else { unreachable!() };
    let file = |path: &std::path::Path| -> f64 {
        let conn = rusqlite::Connection::open(path).expect("open");
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).expect("checkpoint");
        std::fs::metadata(path).expect("size").len() as f64
    };
    let f0 = file(path);
    fill(&store, "nobody", None).await;
    let f1 = file(path);
    fill(&store, "body", Some(BODY_256)).await;
    let f2 = file(path);
    println!("sqlite: per record {:.0} B without a body, {:.0} B with a 256 B body (file growth)", (f1 - f0) / n, (f2 - f1) / n);
}
