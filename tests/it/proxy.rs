//! The HTTP contract (CONTRACT.md section 3), end to end: the real gateway
//! binary, a real upstream that counts side effects, and each store. Every
//! scenario runs against PostgreSQL and against the embedded SQLite store.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::idempotency::record::State;
use support::*;

on_both_stores!(
    first_request_is_forwarded_recorded_and_replayed,
    unauthenticated_requests_claim_nothing,
    bad_keys_and_bodies_claim_nothing,
    changed_request_under_same_key_is_409_and_original_still_replays,
    mismatch_status_can_be_422,
    integers_beyond_64_bits_are_compared_exactly,
    duplicate_while_in_flight_gets_409_with_retry_after,
    in_flight_wait_returns_the_result,
    twenty_concurrent_duplicates_execute_once,
    client_disconnect_does_not_cancel_forward_or_record,
    upstream_timeout_is_unknown_until_resolved,
    unknown_record_released_by_operator_can_be_retried,
    refused_upstream_releases_the_key,
    release_on_status_frees_the_key,
    no_store_policy_passes_through_and_releases,
    server_errors_are_stored_and_replayed,
    oversized_response_reaches_client_but_replays_as_problem,
    completed_record_past_retention_is_a_first_request,
    scopes_are_isolated_by_principal,
    fingerprint_exclusions_and_defaults_apply,
    pass_through_and_not_found,
    sigterm_drains_in_flight_requests,
    metrics_and_health,
    derived_key_secret_keys_the_forwarded_key,
    generated_secret_keys_the_forwarded_key_and_survives_restarts,
    clients_cannot_forge_idemgate_headers,
    keys_resolve_refuses_completed_records_without_force,
    generations_grow_across_lives_at_the_upstream,
    tenant_scope_is_shared_by_the_tenants_principals,
    refetch_replays_read_the_resource_again_with_the_callers_credentials,
);

async fn setup(backend: Backend, f: impl FnOnce(GatewayConfig) -> GatewayConfig) -> (TestUpstream, Gateway, idemgate::store::Store) {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(f(GatewayConfig::new(backend.clone(), upstream.url())));
    let store = backend.open().await;
    (upstream, gw, store)
}

const ORDER: &str = r#"{"item":"book","qty":1}"#;

async fn first_request_is_forwarded_recorded_and_replayed(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    // curl sends `Expect: 100-continue` before a body over 1 KB.
    let first = post(&url, "k1", ORDER, &[("expect", "100-continue")]).await;
    assert_eq!(first.status, 201, "{:?}", first);
    assert!(!first.replayed());
    assert_eq!(first.header("set-cookie"), Some("session=upstream-secret"), "the first answer is the upstream's own");
    assert_eq!(up.side_effects(&derived("k1")), 1);

    // The upstream got the scope-derived key and the attempt's generation.
    let seen = up.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key, derived("k1"));
    let generation = settled_record(&store, "k1").await.expect("record").generation;
    assert_eq!(seen[0].generation, Some(generation.to_string()), "the attempt's generation");
    assert_eq!(seen[0].body, ORDER.as_bytes());
    // The gateway answered the expectation itself (it reads the body); an
    // upstream that answers 417 to expectations is never asked.
    assert_eq!(seen[0].headers.get("expect"), None);

    let rec = settled_record(&store, "k1").await.expect("record");
    assert_eq!(rec.state, State::Completed);
    let stored = rec.response.expect("stored response");
    assert_eq!(stored.status, 201);
    assert_eq!(stored.body.as_deref(), Some(&first.body[..]));
    assert!(stored.headers.iter().all(|(n, _)| n != "set-cookie" && n != "date"));

    let again = post(&url, "k1", ORDER, &[]).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("set-cookie"), None, "Set-Cookie is never replayed");
    assert_eq!(again.header("content-length"), Some(first.body.len().to_string().as_str()));
    assert_eq!(up.side_effects(&derived("k1")), 1, "the retry did not reach the upstream");

    // A quoted structured-field key is the same key.
    let quoted = post(&url, "\"k1\"", ORDER, &[]).await;
    assert!(quoted.replayed());
    assert_eq!(up.total(), 1);
}

async fn unauthenticated_requests_claim_nothing(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    for auth in [None, Some("Bearer wrong-key")] {
        let mut h = vec![("idempotency-key", "k1"), ("content-type", "application/json")];
        if let Some(a) = auth {
            h.push(("authorization", a));
        }
        let r = send("POST", &url, &h, ORDER).await.unwrap();
        assert_eq!(r.status, 401);
        assert_eq!(r.problem(), "unauthenticated");
        assert_eq!(r.header("content-type"), Some("application/problem+json"));
    }
    // Identity headers from a trusted peer (the test runs on 127.0.0.1) do identify.
    let h = [("x-tenant-id", TENANT), ("x-principal-id", "svc"), ("idempotency-key", "k2")];
    let r = send("POST", &url, &h, ORDER).await.unwrap();
    assert_eq!(r.status, 201);
    assert_eq!(up.total(), 1);
    assert!(settled_record(&store, "k1").await.is_none());
    assert!(store.get(&scope_for("svc", "create_order", "k2")).await.unwrap().is_some());
}

async fn bad_keys_and_bodies_claim_nothing(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.server("max_request_body = \"1KiB\"")).await;
    let url = gw.url("/v1/orders");
    let auth = ("authorization", "Bearer test-key");
    let json = ("content-type", "application/json");

    let r = send("POST", &url, &[auth, json], ORDER).await.unwrap();
    assert_eq!((r.status, r.problem().as_str()), (400, "missing-idempotency-key"));

    let long = "k".repeat(256);
    let huge = "k".repeat(10_000);
    for bad in ["", "\"\"", long.as_str(), huge.as_str(), "has space", "\"unterminated"] {
        let r = send("POST", &url, &[auth, json, ("idempotency-key", bad)], ORDER).await.unwrap();
        assert_eq!((r.status, r.problem().as_str()), (400, "invalid-idempotency-key"), "key {bad:?}");
    }
    let r = send("POST", &url, &[auth, json, ("idempotency-key", "a"), ("idempotency-key", "b")], ORDER).await.unwrap();
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-idempotency-key"));

    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(2048));
    let r = post(&url, "big", &big, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (413, "request-too-large"));

    let r = post(&url, "dup", r#"{"a":1,"a":2}"#, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));
    let deep65 = format!("{}{}", "[".repeat(65), "]".repeat(65));
    let r = post(&url, "deep", &deep65, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));
    let deep64 = format!("{}{}", "[".repeat(64), "]".repeat(64));
    let r = post(&url, "deep-ok", &deep64, &[]).await;
    assert_eq!(r.status, 201, "64 levels are allowed");
    let r = post(&url, "broken", "{not json", &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));

    // An encoded body: the gateway would compare (and scan) the encoding's
    // bytes, not what the upstream decodes. `identity` is no coding.
    for coding in ["gzip", "deflate, identity", "br"] {
        let r = post(&url, "coded", ORDER, &[("content-encoding", coding)]).await;
        assert_eq!((r.status, r.problem().as_str()), (415, "unsupported-content-encoding"), "{coding}");
        assert_eq!(r.header("accept-encoding"), Some("identity"));
    }
    assert_eq!(post(&url, "identity", ORDER, &[("content-encoding", "identity")]).await.status, 201);
    // A transfer coding besides chunked: hyper undoes only the chunking.
    let mut raw = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = "POST /v1/orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\nIdempotency-Key: te\r\n\
                Content-Type: application/json\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n";
    tokio::io::AsyncWriteExt::write_all(&mut raw, head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
    assert!(answer.contains("unsupported-transfer-coding"), "{answer}");

    assert_eq!(up.total(), 2, "only the valid requests reached the upstream");
    let all = store.list(&idemgate::store::ListFilter { limit: 100, ..Default::default() }).await.unwrap();
    assert_eq!(all.len(), 2, "nothing else was claimed: {all:?}");
}

async fn changed_request_under_same_key_is_409_and_original_still_replays(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let first = post(&url, "k1", ORDER, &[]).await;
    assert_eq!(first.status, 201);
    let changed = post(&url, "k1", r#"{"item":"book","qty":2}"#, &[]).await;
    assert_eq!(changed.status, 409);
    assert_eq!(changed.problem(), "idempotency-key-reused");
    assert_eq!(changed.json()["retryable"], false);
    assert_eq!(up.total(), 1, "no second side effect");
    // Same content, other member order and spacing: the same request.
    let reordered = post(&url, "k1", r#"{ "qty": 1.0, "item": "book" }"#, &[]).await;
    assert!(reordered.replayed(), "{reordered:?}");
    assert_eq!(reordered.body, first.body);
    let rec = settled_record(&store, "k1").await.unwrap();
    assert_eq!((rec.state, rec.generation.0), (State::Completed, 1));
}

/// Issue 8 item 6: integers outside 64 bits used to go through a double, so these two
/// amounts had one fingerprint and the second request was replayed the first answer.
async fn integers_beyond_64_bits_are_compared_exactly(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let first = post(&url, "big", r#"{"amount":18446744073709551616}"#, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let hash = settled_record(&store, "big").await.expect("record").request_hash;
    let other = post(&url, "big", r#"{"amount":18446744073709551617}"#, &[]).await;
    assert!(!other.replayed(), "the other amount was answered from the first record: {other:?}");
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"));
    // The same amount spelt with other whitespace is the same request.
    let same = post(&url, "big", r#"{ "amount" : 18446744073709551616 }"#, &[]).await;
    assert!(same.replayed(), "{same:?}");
    assert_eq!(up.side_effects(&derived("big")), 1);
    assert_eq!(up.total(), 1);
    let rec = settled_record(&store, "big").await.expect("record");
    assert_eq!((rec.state, rec.generation.0, rec.request_hash), (State::Completed, 1, hash));
}

async fn mismatch_status_can_be_422(backend: Backend) {
    let (up, gw, _store) = setup(backend, |c| c.route("mismatch_status = 422")).await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k1", ORDER, &[]).await.status, 201);
    let r = post(&url, "k1", r#"{"other":true}"#, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (422, "idempotency-key-reused"));
    assert_eq!(up.total(), 1);
}

async fn duplicate_while_in_flight_gets_409_with_retry_after(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, "k1", ORDER, &[("x-test-sleep-ms", "800")]).await });
    received.recv().await.unwrap();
    assert_eq!(record(&store, "k1").await.unwrap().state, State::InFlight);
    let dup = post(&url, "k1", ORDER, &[("x-test-sleep-ms", "800")]).await;
    assert_eq!(dup.status, 409);
    assert_eq!(dup.problem(), "request-in-progress");
    assert_eq!(dup.json()["retryable"], true);
    assert!(dup.header("retry-after").is_some_and(|v| v.parse::<u64>().is_ok()));
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let later = post(&url, "k1", ORDER, &[("x-test-sleep-ms", "800")]).await;
    assert!(later.replayed());
    assert_eq!(up.total(), 1);
}

async fn in_flight_wait_returns_the_result(backend: Backend) {
    let (up, gw, _store) = setup(backend, |c| c.route("in_flight = \"wait\"\nin_flight_wait = \"5s\"")).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let first = tokio::spawn(async move { post(&u, "k1", ORDER, &[("x-test-sleep-ms", "500")]).await });
    received.recv().await.unwrap();
    let waited = post(&url, "k1", ORDER, &[("x-test-sleep-ms", "500")]).await;
    assert_eq!(waited.status, 201);
    assert!(waited.replayed(), "the waiter got the first request's result");
    let first = first.await.unwrap();
    assert_eq!(waited.body, first.body);
    assert_eq!(up.total(), 1);

    // A wait that runs out still answers 409 in-progress.
    let (up2, gw2, _s) = setup(sqlite_backend(), |c| c.timeout("5s").route("in_flight = \"wait\"\nin_flight_wait = \"200ms\"")).await;
    let url2 = gw2.url("/v1/orders");
    let mut rx = up2.subscribe();
    let u = url2.clone();
    let slow = tokio::spawn(async move { post(&u, "k2", ORDER, &[("x-test-sleep-ms", "1500")]).await });
    rx.recv().await.unwrap();
    let r = post(&url2, "k2", ORDER, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "request-in-progress"));
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(up2.total(), 1);
}

async fn twenty_concurrent_duplicates_execute_once(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let mut tasks = Vec::new();
    for _ in 0..20 {
        let u = url.clone();
        tasks.push(tokio::spawn(async move { post(&u, "same", ORDER, &[("x-test-sleep-ms", "300")]).await }));
    }
    let mut forwarded = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            201 if r.replayed() => {}
            201 => forwarded += 1,
            409 => assert_eq!(r.problem(), "request-in-progress"),
            other => panic!("unexpected answer {other}: {r:?}"),
        }
    }
    assert_eq!(forwarded, 1, "exactly one request was forwarded");
    assert_eq!(up.total(), 1, "exactly one side effect");
    assert_eq!(up.side_effects(&derived("same")), 1);
    assert_eq!(settled_record(&store, "same").await.unwrap().state, State::Completed);
}

/// A raw HTTP/1.1 order under idempotency key `key` that the test upstream
/// works on for `sleep_ms` before answering (for a client that leaves).
fn slow_order(key: &str, sleep_ms: u64) -> String {
    format!(
        "POST /v1/orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-key\r\nidempotency-key: {key}\r\n\
         content-type: application/json\r\nx-test-sleep-ms: {sleep_ms}\r\ncontent-length: {}\r\n\r\n{ORDER}",
        ORDER.len()
    )
}

async fn client_disconnect_does_not_cancel_forward_or_record(backend: Backend) {
    use tokio::io::AsyncWriteExt;
    let (up, gw, store) = setup(backend, |c| c).await;
    let mut received = up.subscribe();
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    sock.write_all(slow_order("gone", 400).as_bytes()).await.unwrap();
    received.recv().await.unwrap();
    drop(sock); // the client gives up while the upstream is working
    let done = eventually(Duration::from_secs(5), || {
        let store = store.clone();
        async move { settled_record(&store, "gone").await.is_some_and(|r| r.state == State::Completed) }
    })
    .await;
    assert!(done, "the record reached completed after the client left");
    let retry = post(&gw.url("/v1/orders"), "gone", ORDER, &[("x-test-sleep-ms", "400")]).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(up.total(), 1);
}

async fn upstream_timeout_is_unknown_until_resolved(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.timeout("300ms")).await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "slow", ORDER, &[("x-test-sleep-ms", "1000")]).await;
    assert_eq!(r.status, 504);
    assert_eq!(r.problem(), "outcome-unknown");
    assert_eq!(settled_record(&store, "slow").await.unwrap().state, State::Unknown);
    tokio::time::sleep(Duration::from_millis(900)).await; // the upstream finishes its work meanwhile
    assert_eq!(up.total(), 1);
    for _ in 0..2 {
        let retry = post(&url, "slow", ORDER, &[]).await;
        assert_eq!(retry.status, 409);
        assert_eq!(retry.problem(), "outcome-unknown");
    }
    assert_eq!(up.total(), 1, "retries of an unknown outcome never reach the upstream");

    let (code, out, _) = cli(&gw, &["keys", "list", "--state", "unknown"]);
    assert_eq!(code, 0);
    assert!(out.contains("slow") && out.contains("1 record(s)"), "{out}");

    // The operator learns the order was created and records the answer.
    let body_file = gw.dir().join("resolved.json");
    std::fs::write(&body_file, r#"{"order":1,"resolved":true}"#).unwrap();
    let (code, out, err) = cli_keys(
        &gw,
        "resolve",
        "slow",
        &[
            "--complete",
            "--status",
            "201",
            "--body-file",
            body_file.to_str().unwrap(),
            "--header",
            "content-type: application/json",
            "--reason",
            "found it in the ledger",
        ],
    );
    assert_eq!(code, 0, "{out}{err}");
    let rec = settled_record(&store, "slow").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    let first_attempt: i64 = up.requests()[0].generation.as_deref().unwrap().parse().unwrap();
    assert!(rec.generation.0 > first_attempt, "the resolution's new generation fences off the first attempt");
    let replay = post(&url, "slow", ORDER, &[]).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.json()["resolved"], true);
    assert_eq!(replay.header("content-type"), Some("application/json"));
    assert_eq!(up.total(), 1);
}

async fn unknown_record_released_by_operator_can_be_retried(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.timeout("300ms")).await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[("x-test-abort", "1")]).await.problem(), "outcome-unknown");
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Unknown);
    let (code, _, err) = cli_keys(&gw, "show", "k", &[]);
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = cli_keys(&gw, "resolve", "k", &["--release", "--reason", "checked the ledger"]);
    assert_eq!(code, 0, "{err}");
    assert!(settled_record(&store, "k").await.is_none());
    let r = post(&url, "k", ORDER, &[]).await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
    assert_eq!(up.side_effects(&derived("k")), 2, "the operator decided the first did not count");
    // Resolving a record that does not exist is an error.
    let (code, _, _) = cli_keys(&gw, "resolve", "nope", &["--release", "--reason", "r"]);
    assert_eq!(code, 1);
}

async fn refused_upstream_releases_the_key(backend: Backend) {
    // An address reserved (bound, so no other test can take it) but not
    // listening: connections to it are refused.
    let reserved = tokio::net::TcpSocket::new_v4().unwrap();
    reserved.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = reserved.local_addr().unwrap();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{addr}")));
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "k", ORDER, &[]).await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem(), "upstream-unavailable");
    assert_eq!(r.json()["retryable"], true);
    assert!(r.header("retry-after").is_some());
    assert!(settled_record(&store, "k").await.is_none(), "the key was released");
    drop(reserved);
    let up = TestUpstream::start_on(addr).await;
    let r = post(&url, "k", ORDER, &[]).await;
    assert_eq!(r.status, 201);
    assert_eq!(up.total(), 1);
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Completed);
}

async fn release_on_status_frees_the_key(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("release_on_status = [429, 503]")).await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "k", ORDER, &[("x-test-status", "503")]).await;
    assert_eq!(r.status, 503);
    assert!(!r.replayed());
    assert!(settled_record(&store, "k").await.is_none());
    let r = post(&url, "k", ORDER, &[]).await;
    assert_eq!((r.status, r.replayed()), (201, false));
    assert_eq!(up.side_effects(&derived("k")), 2);
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Completed);
}

async fn no_store_policy_passes_through_and_releases(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "k", ORDER, &[("x-test-no-store", "1")]).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.header("idempotency-policy"), None, "the control header never reaches the client");
    assert!(settled_record(&store, "k").await.is_none());
    assert_eq!(up.total(), 1);
}

async fn server_errors_are_stored_and_replayed(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "k", ORDER, &[("x-test-status", "500")]).await;
    assert_eq!(r.status, 500);
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Completed);
    let again = post(&url, "k", ORDER, &[("x-test-status", "500")]).await;
    assert_eq!((again.status, again.replayed()), (500, true));
    assert_eq!(again.body, r.body);
    assert_eq!(up.total(), 1);
}

async fn oversized_response_reaches_client_but_replays_as_problem(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("max_stored_response = \"1KiB\"")).await;
    let url = gw.url("/v1/orders");
    let r = post(&url, "k", ORDER, &[("x-test-body-bytes", "5000")]).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body.len(), 5000, "the client got the whole body");
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    let stored = rec.response.unwrap();
    assert_eq!((stored.status, stored.body.is_none()), (201, true));
    let again = post(&url, "k", ORDER, &[("x-test-body-bytes", "5000")]).await;
    assert_eq!((again.status, again.problem().as_str()), (409, "response-not-stored"));
    assert_eq!(again.json()["original_status"], 201);
    assert!(again.replayed());
    assert_eq!(up.total(), 1, "never re-executed");
}

async fn completed_record_past_retention_is_a_first_request(backend: Backend) {
    // 1s is the shortest retention the configuration accepts.
    let (up, gw, store) = setup(backend, |c| c.route("retention = \"1s\"")).await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[]).await.status, 201);
    assert!(post(&url, "k", ORDER, &[]).await.replayed());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // Expired records count as absent even if the sweeper has not run yet;
    // either way a changed request is now allowed too.
    let r = post(&url, "k", r#"{"item":"pen"}"#, &[]).await;
    assert_eq!((r.status, r.replayed()), (201, false));
    assert_eq!(up.side_effects(&derived("k")), 2);
    let rec = settled_record(&store, "k").await;
    // Either freshly completed again (generation 2: taken over), or already swept.
    if let Some(rec) = rec {
        assert!(rec.generation.0 >= 1);
    }
    // The sweeper (every 200ms in tests) removes it after retention.
    let swept = eventually(Duration::from_secs(5), || {
        let store = store.clone();
        async move { settled_record(&store, "k").await.is_none() }
    })
    .await;
    assert!(swept, "the sweeper deleted the expired record");
}

async fn scopes_are_isolated_by_principal(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let a = post(&url, "shared", ORDER, &[]).await;
    let b = send(
        "POST",
        &url,
        &[("authorization", "Bearer other-key"), ("idempotency-key", "shared"), ("content-type", "application/json")],
        r#"{"different":1}"#,
    )
    .await
    .unwrap();
    assert_eq!((a.status, a.replayed()), (201, false));
    assert_eq!((b.status, b.replayed()), (201, false), "another principal's key is another scope");
    assert_ne!(a.body, b.body);
    assert_eq!(up.total(), 2);
    assert_eq!(up.side_effects(&derived("shared")), 1);
    assert_eq!(up.side_effects(&scope_for("other", "create_order", "shared").derived_key(Some(TEST_SECRET.as_bytes()))), 1);
    assert!(store.get(&scope_for("other", "create_order", "shared")).await.unwrap().is_some());
}

async fn fingerprint_exclusions_and_defaults_apply(backend: Backend) {
    let (up, gw, _store) = setup(backend, |c| {
        c.route("fingerprint.exclude = [\"/trace_id\"]\nfingerprint.defaults = { \"/currency\" = \"USD\" }\nfingerprint.headers = [\"api-version\"]")
    })
    .await;
    let url = gw.url("/v1/orders");
    let first = post(&url, "k", r#"{"amount":5,"trace_id":"a"}"#, &[("api-version", "1")]).await;
    assert_eq!(first.status, 201);
    let r = post(&url, "k", r#"{"amount":5,"trace_id":"b","currency":"USD"}"#, &[("api-version", "1")]).await;
    assert!(r.replayed(), "excluded field and explicit default do not change the fingerprint: {r:?}");
    let r = post(&url, "k", r#"{"amount":5,"currency":"EUR"}"#, &[("api-version", "1")]).await;
    assert_eq!(r.problem(), "idempotency-key-reused");
    let r = post(&url, "k", r#"{"amount":5}"#, &[("api-version", "2")]).await;
    assert_eq!(r.problem(), "idempotency-key-reused", "a listed header enters the fingerprint");
    let r = post(&url, "k", r#"{"amount":5}"#, &[("api-version", "1"), ("x-unlisted", "z")]).await;
    assert!(r.replayed(), "an unlisted header does not");
    assert_eq!(up.total(), 1);
}

async fn pass_through_and_not_found(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| {
        c.tail("[[routes]]\noperation = \"optional\"\nmethod = \"PUT\"\npath = \"/v1/things/{id}\"\nupstream = \"orders\"\nkey_required = false")
    })
    .await;
    // Another method on an idempotent path: proxied, no identity or key needed.
    let r = send("GET", &gw.url("/v1/orders?x=1"), &[], "").await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-method"), Some("GET"));
    // No key where none is required: proxied without a record.
    let r = send("PUT", &gw.url("/v1/things/7"), &[("authorization", "Bearer test-key")], "{}").await.unwrap();
    assert_eq!(r.status, 201);
    // With a key it is idempotent.
    let r = send("PUT", &gw.url("/v1/things/7"), &[("authorization", "Bearer test-key"), ("idempotency-key", "t")], "{}").await.unwrap();
    assert_eq!(r.status, 201);
    let r2 = send("PUT", &gw.url("/v1/things/7"), &[("authorization", "Bearer test-key"), ("idempotency-key", "t")], "{}").await.unwrap();
    assert!(r2.replayed());
    // Path parameters are part of the request: same key, other id, is a mismatch.
    let r3 = send("PUT", &gw.url("/v1/things/8"), &[("authorization", "Bearer test-key"), ("idempotency-key", "t")], "{}").await.unwrap();
    assert_eq!(r3.problem(), "idempotency-key-reused");
    let r = send("POST", &gw.url("/nowhere"), &[], "").await.unwrap();
    assert_eq!((r.status, r.problem().as_str()), (404, "not-found"));
    assert_eq!(up.total(), 2);
    let all = store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap();
    assert_eq!(all.len(), 1);
}

async fn sigterm_drains_in_flight_requests(backend: Backend) {
    let (up, mut gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let inflight = tokio::spawn(async move { post(&u, "k", ORDER, &[("x-test-sleep-ms", "700")]).await });
    received.recv().await.unwrap();
    gw.signal("TERM");
    let r = inflight.await.unwrap();
    assert_eq!(r.status, 201, "the in-flight request finished");
    let status = tokio::task::spawn_blocking(move || {
        let s = gw.wait_exit(Duration::from_secs(15));
        (s, gw)
    })
    .await
    .unwrap();
    assert!(status.0.success(), "exit status {:?}", status.0);
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Completed);
    assert_eq!(up.total(), 1);
    // New connections are refused after shutdown.
    assert!(send("POST", &url, &[], "").await.is_err());
}

async fn metrics_and_health(backend: Backend) {
    let (_up, gw, _store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    post(&url, "m", ORDER, &[]).await;
    post(&url, "m", ORDER, &[]).await;
    post(&url, "m", "{}", &[]).await;
    assert_eq!(send("GET", &gw.admin_url("/healthz"), &[], "").await.unwrap().status, 200);
    assert_eq!(send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status, 200);
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&m.body);
    for needle in [
        r#"idemgate_requests_total{operation="create_order",outcome="forwarded"} 1"#,
        r#"idemgate_requests_total{operation="create_order",outcome="replayed"} 1"#,
        r#"idemgate_requests_total{operation="create_order",outcome="mismatch"} 1"#,
        r#"idemgate_store_duration_seconds_count{op="claim"}"#,
        r#"idemgate_upstream_duration_seconds_count{upstream="orders"} 1"#,
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    // Logs never carry the raw key or bodies.
    assert_eq!(gw.log_count("\"m\""), 0);
    assert_eq!(gw.log_count("book"), 0);
}

async fn derived_key_secret_keys_the_forwarded_key(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let secret_file = dir.path().join("derived-key-secret");
    std::fs::write(&secret_file, "s3cret-shared-by-replicas\n").unwrap();
    let server = format!("derived_key_secret_file = \"{}\"", secret_file.display());
    let (up, gw, _store) = setup(backend, |c| c.generated_secret().server(&server)).await;
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    let seen = &up.requests()[0].key;
    assert_eq!(*seen, scope("k").derived_key(Some(b"s3cret-shared-by-replicas")), "an HMAC under the configured secret");
    assert_ne!(*seen, scope("k").derived_key(None), "not the unkeyed hash anyone could compute");
    let (code, out, err) = cli_keys(&gw, "show", "k", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(seen.as_str()), "keys show prints the key the upstream saw:\n{out}");
}

/// Without a configured secret the derived key is an HMAC under the secret
/// `migrate` generated and stored: never the unkeyed hash anyone could
/// compute, and the same after a restart (so a retry after a crash reaches an
/// idempotent upstream under the same key).
async fn generated_secret_keys_the_forwarded_key_and_survives_restarts(backend: Backend) {
    let (up, mut gw, store) = setup(backend, |c| c.generated_secret()).await;
    let secret = store.derived_key_secret().await.unwrap().expect("migrate generated a secret");
    assert_eq!(secret.len(), 32);
    assert_eq!(post(&gw.url("/v1/orders"), "a", ORDER, &[]).await.status, 201);
    gw.restart();
    assert_eq!(post(&gw.url("/v1/orders"), "b", ORDER, &[]).await.status, 201);
    let seen: Vec<String> = up.requests().into_iter().map(|r| r.key).collect();
    assert_eq!(seen, vec![scope("a").derived_key(Some(&secret)), scope("b").derived_key(Some(&secret))]);
    assert_ne!(seen[0], scope("a").derived_key(None), "not the unkeyed hash");
    assert_eq!(store.derived_key_secret().await.unwrap(), Some(secret), "migrate never replaces the secret");
    let (code, out, err) = cli_keys(&gw, "show", "a", &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(seen[0].as_str()), "keys show prints the key the upstream saw:\n{out}");
}

/// `Idempotency-Key` and `X-Idempotency-Generation` are idemgate's own
/// headers towards the upstream: what a client sends under those names never
/// reaches it, on pass-through paths or idempotent routes.
async fn clients_cannot_forge_idemgate_headers(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let forged_key = derived("victim");
    // Another method on the route's path is passed through: both headers are removed.
    let r = send("DELETE", &gw.url("/v1/orders"), &[("idempotency-key", forged_key.as_str()), ("x-idempotency-generation", "999")], "")
        .await
        .unwrap();
    assert_eq!(r.status, 201);
    // On the idempotent route the upstream sees the derived key and the real generation.
    let r = post(&gw.url("/v1/orders"), "mine", ORDER, &[("x-idempotency-generation", "999")]).await;
    assert_eq!(r.status, 201);
    let seen = up.requests();
    assert_eq!(seen.len(), 2);
    assert_eq!((seen[0].key.as_str(), seen[0].generation.as_deref()), ("<none>", None), "pass-through: nothing of ours, nothing forged");
    assert_eq!(up.side_effects(&forged_key), 0, "the victim's derived key was never presented");
    let rec = settled_record(&store, "mine").await.unwrap();
    assert_eq!(seen[1].key, derived("mine"));
    assert_eq!(seen[1].generation, Some(rec.generation.to_string()));
    assert_eq!(seen[1].headers.get_all("x-idempotency-generation").iter().count(), 1, "one generation header, ours");
}

/// Issue: `keys resolve --release` on a completed record deleted it, and the
/// client's next retry executed a second time. Only unknown records and
/// expired claims may be resolved, unless --force is given with --reason;
/// hand-made statuses must be final (200-599); every resolution is audited.
async fn keys_resolve_refuses_completed_records_without_force(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c).await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[]).await.status, 201);
    let before = settled_record(&store, "k").await.unwrap();
    let scope_args = ["--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", "k"];
    let resolve = |extra: &[&str]| {
        let mut args = vec!["keys", "resolve"];
        args.extend_from_slice(&scope_args);
        args.extend_from_slice(extra);
        cli(&gw, &args)
    };
    let (code, _, err) = resolve(&["--release", "--reason", "r"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("completed") && err.contains("--force"), "{err}");
    assert_eq!(settled_record(&store, "k").await.unwrap(), before, "nothing changed");
    let again = post(&url, "k", ORDER, &[]).await;
    assert!(again.replayed(), "the retry is still a replay");
    assert_eq!(up.side_effects(&derived("k")), 1);

    // --force needs --reason (a usage error), and statuses must be final.
    assert_eq!(resolve(&["--release", "--force"]).0, 2);
    for status in ["101", "999", "199", "600"] {
        let (code, _, err) = resolve(&["--complete", "--status", status, "--force", "--reason", "x"]);
        assert_eq!(code, 1, "status {status}: {err}");
    }
    assert_eq!(settled_record(&store, "k").await.unwrap(), before);
    assert!(store.audit(10).await.unwrap().is_empty());

    // With force and a reason it is done, and the trail says who, what and why.
    let (code, out, err) = resolve(&["--release", "--force", "--reason", "order cancelled upstream by support"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("was completed"), "{out}");
    assert!(settled_record(&store, "k").await.is_none());
    let trail = store.audit(10).await.unwrap();
    assert_eq!(trail.len(), 1);
    assert_eq!((trail[0].actor.as_str(), trail[0].from_state.as_str(), trail[0].to_state.as_str()), ("cli", "completed", "released"));
    assert_eq!((trail[0].reason.as_str(), trail[0].forced), ("order cancelled upstream by support", true));
    let (code, out, _) = cli(&gw, &["keys", "audit"]);
    assert_eq!(code, 0);
    assert!(out.contains("order cancelled upstream by support") && out.contains("[forced]"), "{out}");
    // As forced: the retry executes again.
    assert!(!post(&url, "k", ORDER, &[]).await.replayed());
    assert_eq!(up.side_effects(&derived("k")), 2);
}

/// An upstream that fences on X-Idempotency-Generation sees a larger number
/// for every new life of a key (after a release, a take-over, an operator's
/// release), never the same number twice.
async fn generations_grow_across_lives_at_the_upstream(backend: Backend) {
    let (up, gw, _store) = setup(backend, |c| c.route("release_on_status = [503]")).await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k", ORDER, &[("x-test-status", "503")]).await.status, 503);
    assert_eq!(post(&url, "k", ORDER, &[("x-test-status", "503")]).await.status, 503);
    assert_eq!(post(&url, "k", ORDER, &[]).await.status, 201);
    let generations: Vec<i64> = up.requests().iter().map(|r| r.generation.as_deref().unwrap().parse().unwrap()).collect();
    assert_eq!(generations.len(), 3);
    assert!(generations.windows(2).all(|w| w[0] < w[1]), "strictly increasing: {generations:?}");
}

/// `scope = "tenant"`: every principal of the tenant shares the key space (a
/// documented risk: one principal replays another's answer). The default keeps
/// principals apart (see scopes_are_isolated_by_principal).
async fn tenant_scope_is_shared_by_the_tenants_principals(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("scope = \"tenant\"")).await;
    let url = gw.url("/v1/orders");
    let a = post(&url, "shared", ORDER, &[]).await;
    let b = send(
        "POST",
        &url,
        &[("authorization", "Bearer other-key"), ("idempotency-key", "shared"), ("content-type", "application/json")],
        ORDER,
    )
    .await
    .unwrap();
    assert_eq!((a.status, a.replayed()), (201, false));
    assert_eq!((b.status, b.replayed()), (201, true), "the tenant's other principal replays the first answer");
    assert_eq!(b.body, a.body);
    assert_eq!(up.total(), 1);
    let shared = scope_for(idemgate::idempotency::key::TENANT_WIDE, "create_order", "shared");
    assert!(store.get(&shared).await.unwrap().is_some(), "one record for the tenant");
    assert!(store.get(&scope("shared")).await.unwrap().is_none());
}

/// `replay = "refetch"`: the record keeps only the status and Location; a
/// replay reads Location from the upstream with the caller's credentials and
/// answers with the stored status, so it shows the resource as it is now, and a
/// caller who lost access gets the upstream's refusal, never stored data.
async fn refetch_replays_read_the_resource_again_with_the_callers_credentials(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("replay = \"refetch\"")).await;
    let url = gw.url("/v1/orders");
    let first = post(&url, "k", ORDER, &[]).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!(first.json()["order"], 1, "the first answer is the upstream's own, whole");
    let stored = settled_record(&store, "k").await.unwrap().response.unwrap();
    assert_eq!((stored.status, stored.body), (201, None), "no body kept");
    assert_eq!(stored.headers, vec![("location".to_owned(), b"/v1/orders/1".to_vec())], "only where to read it again");

    let again = post(&url, "k", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true), "the stored status");
    assert_eq!((again.json()["order"].as_u64(), again.json()["version"].as_u64()), (Some(1), Some(0)));
    up.bump_resource();
    assert_eq!(post(&url, "k", ORDER, &[]).await.json()["version"], 1, "the resource as it is now");
    up.revoke("Bearer test-key");
    let refused = post(&url, "k", ORDER, &[]).await;
    assert_eq!((refused.status, refused.replayed()), (403, false), "the upstream's refusal, passed through");
    assert!(!String::from_utf8_lossy(&refused.body).contains("\"order\""), "never stored data");
    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// Issue 18: a large pass-through response flows as the upstream sends it,
/// never read whole. The upstream sends the head and 1 MiB, then holds the
/// other 63 MiB back until the client has seen body bytes (a gateway that
/// buffered the body would never deliver any: the test would time out);
/// then all 64 MiB arrive, and the gateway's peak RSS stays far below the
/// body's size.
#[tokio::test]
async fn a_large_streamed_response_is_not_buffered_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const MIB: usize = 1 << 20;
    const TOTAL: usize = 64 * MIB;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (seen_tx, seen_rx) = tokio::sync::oneshot::channel::<()>();
    let upstream = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut byte = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            assert_eq!(sock.read(&mut byte).await.unwrap(), 1, "the request head arrives");
            head.push(byte[0]);
        }
        sock.write_all(format!("HTTP/1.1 200 OK\r\ncontent-length: {TOTAL}\r\n\r\n").as_bytes()).await.unwrap();
        let chunk = vec![b'x'; MIB];
        sock.write_all(&chunk).await.unwrap();
        let held_back = tokio::time::timeout(Duration::from_secs(30), seen_rx).await;
        assert!(matches!(held_back, Ok(Ok(()))), "the client saw no body bytes while the upstream held the rest back");
        for _ in 1..TOTAL / MIB {
            sock.write_all(&chunk).await.unwrap();
        }
    });
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), format!("http://{addr}")));
    let mut client = tokio::net::TcpStream::connect(gw.url("").trim_start_matches("http://").trim_end_matches('/')).await.unwrap();
    client.write_all(b"GET /v1/orders HTTP/1.1\r\nhost: test\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 256 * 1024];
    let mut received = Vec::new();
    let body_start = loop {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "the gateway closed before the head");
        received.extend_from_slice(&buf[..n]);
        if let Some(i) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&received[..body_start]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains(&format!("content-length: {TOTAL}")), "{head}");
    let mut body = received.len() - body_start;
    while body == 0 {
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "the gateway closed before the body");
        body += n;
    }
    seen_tx.send(()).unwrap();
    while body < TOTAL {
        let n = tokio::time::timeout(Duration::from_secs(30), client.read(&mut buf)).await.unwrap().unwrap();
        assert!(n > 0, "the body ended after {body} of {TOTAL} bytes");
        body += n;
    }
    assert_eq!(body, TOTAL);
    upstream.await.unwrap();
    let status = std::fs::read_to_string(format!("/proc/{}/status", gw.pid())).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status");
    assert!(peak_kib < 48 * 1024, "the gateway's peak RSS was {peak_kib} KiB for a 64 MiB body");
}

/// An upstream that answers a write with both `Transfer-Encoding` and a
/// `Content-Length` (a framework's own length beside a chunked body), and
/// echoes idemgate's headers: the client gets the body with its real
/// length (the stale one would make it read the next answer on its
/// connection as the rest of this one), never the echoed derived key or a
/// replay marker on a first answer; the record keeps the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_answer_with_a_stale_length_and_echoed_headers_is_forwarded_clean() {
    let addr = answering_once(
        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ncontent-length: 100\r\n\
         idempotency-key: echoed-derived-key\r\nx-idempotency-generation: 7\r\nidempotent-replayed: true\r\n\r\n\
         7\r\n{\"id\":1\r\n1\r\n}\r\n0\r\n\r\n",
    )
    .await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{addr}")));
    let r = post(&gw.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((r.status, &r.body[..]), (201, &b"{\"id\":1}"[..]), "{}", gw.logs());
    assert_eq!(r.header("content-length"), Some("8"), "the body's own length");
    for ours in ["idempotency-key", "x-idempotency-generation", "idempotent-replayed"] {
        assert_eq!(r.header(ours), None, "{ours} reached the client");
    }
    let store = backend.open().await;
    let rec = settled_record(&store, "k").await.expect("record");
    let stored: Vec<&str> = rec.response.as_ref().unwrap().headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(stored, ["content-type"]);
    let replay = post(&gw.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((replay.replayed(), &replay.body[..], replay.header("content-length")), (true, &b"{\"id\":1}"[..], Some("8")));
}

/// An upstream that closes a keep-alive connection once it has been idle
/// for 1.5 s (gunicorn's default is 2 s, Node's 5 s): here it notices only
/// when the next request arrives and closes without answering, which is
/// what a close that crosses a reused connection's request looks like (the
/// request written, the connection gone: the outcome would be `unknown`).
/// The gateway's pool, by default, does not reuse a connection idle for
/// longer than a second, so a request after a pause goes on a fresh
/// connection and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_idle_past_the_default_pool_timeout_is_not_reused() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let executed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = executed.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = listener.accept().await.unwrap();
            let count = count.clone();
            tokio::spawn(async move {
                let mut idle_since = tokio::time::Instant::now();
                loop {
                    let mut got = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") || !got.ends_with(b"}") {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    if idle_since.elapsed() >= Duration::from_millis(1500) {
                        return;
                    }
                    count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let answer = "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                    if sock.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    idle_since = tokio::time::Instant::now();
                }
            });
        }
    });
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{addr}")).server("workers = 1"));
    assert_eq!(post(&gw.url("/v1/orders"), "before", ORDER, &[]).await.status, 201);
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let after = post(&gw.url("/v1/orders"), "after-pause", ORDER, &[]).await;
    assert_eq!(after.status, 201, "{:?}\n{}", after.body, gw.logs());
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "after-pause").await.map(|r| r.state), Some(State::Completed));
    assert_eq!(executed.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// The same answer (chunked, with a stale `Content-Length`) to a request
/// passed through without idempotency: the client gets the body with its
/// own length there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_answer_with_a_stale_length_is_passed_through_clean() {
    let addr = answering_once(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\ncontent-length: 100\r\n\r\n\
         8\r\n{\"id\":1}\r\n0\r\n\r\n",
    )
    .await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), format!("http://{addr}")));
    let r = send("GET", &gw.url("/v1/orders"), &[], "").await.expect("answered");
    assert_eq!((r.status, &r.body[..]), (200, &b"{\"id\":1}"[..]), "{}", gw.logs());
    assert_ne!(r.header("content-length"), Some("100"), "the stale length reached the client");
}

/// A raw upstream that accepts one connection, reads one request (its head,
/// and its body up to a closing `}` when it has one), writes `answer` byte
/// for byte, and keeps the connection open until the gateway closes it.
async fn answering_once(answer: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                if !head.contains("content-length") || got.ends_with(b"}") {
                    break;
                }
            }
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "the request arrives");
            got.extend_from_slice(&buf[..n]);
        }
        sock.write_all(answer.as_bytes()).await.unwrap();
        let _ = sock.read(&mut buf).await;
    });
    addr
}

/// A transfer coding besides `chunked` is refused on every path, also where
/// the request would be passed through without a claim: hyper undoes only
/// the chunking, so the upstream would get the coded bytes under no
/// `Transfer-Encoding` at all. A plain chunked body still passes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transfer_coding_besides_chunked_is_refused_on_a_pass_through_path() {
    let backend = sqlite_backend();
    let (up, gw, _store) = setup(backend, |c| c.server("default_upstream = \"orders\"")).await;
    let send = |head: String| {
        let addr = gw.addr;
        async move {
            let mut raw = tokio::net::TcpStream::connect(addr).await.unwrap();
            tokio::io::AsyncWriteExt::write_all(&mut raw, head.as_bytes()).await.unwrap();
            let mut answer = Vec::new();
            tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut answer).await.unwrap();
            String::from_utf8_lossy(&answer).into_owned()
        }
    };
    for (method, coding) in [("POST", "gzip, chunked"), ("PUT", "br, chunked"), ("GET", "deflate, chunked")] {
        let answer = send(format!(
            "{method} /v1/elsewhere HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: {coding}\r\n\
             Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        ))
        .await;
        assert!(answer.starts_with("HTTP/1.1 501"), "{method} {coding}: {answer}");
        assert!(answer.contains("unsupported-transfer-coding"), "{method} {coding}: {answer}");
    }
    // Chunked not last: the body's length is unknown; hyper answers 400 itself.
    let answer = send(
        "POST /v1/elsewhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked, gzip\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            .to_owned(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(up.total(), 0, "nothing coded reached the upstream");
    let answer = send(
        "POST /v1/elsewhere HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\
         Connection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            .to_owned(),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(up.total(), 1, "a chunked body passes through");
    let passed = up.requests();
    assert_eq!((passed[0].path.as_str(), &passed[0].body[..]), ("/v1/elsewhere", &b"hello"[..]));
}

/// idemgate behind nginx at its defaults, as a first deployment puts it:
/// nginx talks HTTP/1.0 to it (`proxy_http_version 1.0`, `Connection:
/// close`), sets `Host` to the address it proxies to, and closes its
/// connection to idemgate when its client goes away (`proxy_ignore_client_abort
/// off`). Through it: a first write and its replay, a changed request (409),
/// a duplicate of one in flight (409 with `Retry-After`), and a client that
/// leaves mid-request, whose record still completes and whose retry replays.
/// Each key's side effect happens once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_nginx_at_its_defaults_every_answer_and_record_is_kept() {
    use tokio::io::AsyncWriteExt;
    let (up, gw, store) = setup(postgres_backend(), |c| c).await;
    let Some(nginx) = support::nginx::Nginx::start(gw.addr.port()) else { return };
    let url = format!("http://127.0.0.1:{}/v1/orders", nginx.port);
    let first = post(&url, "n1", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{}", gw.logs());
    let again = post(&url, "n1", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(again.body, first.body);
    let changed = post(&url, "n1", r#"{"item":"book","qty":2}"#, &[]).await;
    assert_eq!(changed.status, 409);
    assert_eq!(changed.header("content-type"), Some("application/problem+json"));
    assert_eq!(up.side_effects(&derived("n1")), 1);

    let slow = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "n2", ORDER, &[("x-test-sleep-ms", "1500")]).await }
    });
    let in_flight = eventually(Duration::from_secs(5), || async { up.total() >= 2 }).await;
    assert!(in_flight, "{}", gw.logs());
    let duplicate = post(&url, "n2", ORDER, &[]).await;
    assert_eq!(duplicate.status, 409);
    assert!(duplicate.header("retry-after").is_some(), "Retry-After passes through nginx");
    assert_eq!(slow.await.unwrap().status, 201);
    assert_eq!(up.side_effects(&derived("n2")), 1);

    let mut received = up.subscribe();
    let mut sock = tokio::net::TcpStream::connect(("127.0.0.1", nginx.port)).await.unwrap();
    sock.write_all(slow_order("n3", 600).as_bytes()).await.unwrap();
    received.recv().await.unwrap();
    drop(sock); // nginx closes its connection to idemgate too
    let done = eventually(Duration::from_secs(5), || {
        let store = store.clone();
        async move { settled_record(&store, "n3").await.is_some_and(|r| r.state == State::Completed) }
    })
    .await;
    assert!(done, "the record completed after the client and nginx left: {}", gw.logs());
    let retry = post(&url, "n3", ORDER, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(up.side_effects(&derived("n3")), 1);
    assert_eq!(up.total(), 3);
}
