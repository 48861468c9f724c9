//! Repeated query and form fields on the real binary: the order of one name's
//! values is part of the request (frameworks read them as ordered lists), the
//! order of different names is not; nor is the body's media type (the same
//! bytes as `application/json` and `application/merge-patch+json` are two
//! requests). Records of earlier fingerprint versions replay their retries.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

fn json_headers(key: &str) -> Vec<(&str, &str)> {
    vec![("authorization", "Bearer test-key"), ("content-type", "application/json"), ("idempotency-key", key)]
}

fn form_headers(key: &str) -> Vec<(&str, &str)> {
    vec![("authorization", "Bearer test-key"), ("content-type", "application/x-www-form-urlencoded"), ("idempotency-key", key)]
}

async fn send_ok(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    send(method, url, headers, body.to_owned()).await.unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_field_in_another_order_is_another_request() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;

    // Query: `tag=a&tag=b` and `tag=b&tag=a` are two lists.
    let first = send_ok("POST", &gw.url("/v1/orders?tag=a&tag=b&x=1"), &json_headers("q"), ORDER).await;
    assert_eq!(first.status, 201);
    let hash = settled_record(&store, "q").await.expect("record").request_hash;
    let reordered = send_ok("POST", &gw.url("/v1/orders?tag=b&tag=a&x=1"), &json_headers("q"), ORDER).await;
    assert_eq!((reordered.status, reordered.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", reordered.body);
    // Other names in another order: the same request.
    let same = send_ok("POST", &gw.url("/v1/orders?x=1&tag=a&tag=b"), &json_headers("q"), ORDER).await;
    assert_eq!(same.status, 201);
    assert!(same.replayed());
    assert_eq!(up.side_effects(&derived("q")), 1);
    assert_eq!(record(&store, "q").await.expect("record").request_hash, hash);

    // Form bodies: the same rule.
    let first = send_ok("POST", &gw.url("/v1/orders"), &form_headers("f"), "tag=a&tag=b&x=1").await;
    assert_eq!(first.status, 201);
    let hash = settled_record(&store, "f").await.expect("record").request_hash;
    let reordered = send_ok("POST", &gw.url("/v1/orders"), &form_headers("f"), "tag=b&x=1&tag=a").await;
    assert_eq!((reordered.status, reordered.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", reordered.body);
    let same = send_ok("POST", &gw.url("/v1/orders"), &form_headers("f"), "x=1&tag=a&tag=b").await;
    assert_eq!(same.status, 201);
    assert!(same.replayed());
    assert_eq!(up.side_effects(&derived("f")), 1);
    assert_eq!(record(&store, "f").await.expect("record").request_hash, hash);
    assert_eq!(up.total(), 2);
}

/// A completed record with the hash fingerprint version 1 gave `query` and
/// `body` (as the previous release wrote it), answered `{"seeded":<n>}`.
async fn seed_v1(store: &idemgate::store::Store, key: &str, content_type: &str, query: &str, body: &[u8], n: u32) {
    seed(store, key, content_type, query, body, n, 1).await
}

/// The same, with the hash of fingerprint `version` (1, 2 or 3).
async fn seed(store: &idemgate::store::Store, key: &str, content_type: &str, query: &str, body: &[u8], n: u32, version: usize) {
    use idemgate::idempotency::fingerprint::{FingerprintSpec, RequestParts, legacy_fingerprints};
    use idemgate::idempotency::record::Retention;
    use idemgate::idempotency::record::StoredResponse;
    use idemgate::store::{ClaimOutcome, ClaimRequest};
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", content_type.parse().unwrap());
    let parts = RequestParts {
        method: &http::Method::POST,
        operation: "create_order",
        path_params: &[],
        query: Some(query),
        headers: &headers,
        body,
    };
    let req = ClaimRequest {
        scope: scope(key),
        request_hash: legacy_fingerprints(&FingerprintSpec::default(), &parts)
            .nth(3 - version)
            .expect("a version")
            .expect("an earlier fingerprint"),
        owner: "previous-release".into(),
        lease: std::time::Duration::from_secs(60),
        reforward: None,
        sent: idemgate::idempotency::record::ReforwardKey::Derived,
        fingerprint_spec: "test-settings".into(),
        claim_token: uuid::Uuid::new_v4(),
        acceptance: None,
        key_source: "header:idempotency-key".into(),
        request_head: None,
    };
    let ClaimOutcome::Claimed(claim) = store.claim(&req).await.expect("claim") else { panic!("not claimed") };
    let response = StoredResponse {
        status: 201,
        headers: vec![("content-type".to_owned(), b"application/json".to_vec())],
        body: Some(bytes::Bytes::from(format!(r#"{{"seeded":{n}}}"#))),
    };
    store.complete(&claim, &response, Retention::For(std::time::Duration::from_secs(3600))).await.expect("complete");
}

/// Records written before the fingerprint's version 2 (pairs sorted by name
/// and value) still replay their own retries: the gateway recognises their
/// version-1 hash. Version 1 cannot tell one name's values apart by order, so
/// for those records a reordered retry is still replayed; new records refuse it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_fingerprint_version_1_still_replay_their_own_retries() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;
    seed_v1(&store, "old-q", "application/json", "tag=b&tag=a&x=1", ORDER.as_bytes(), 1).await;
    seed_v1(&store, "old-f", "application/x-www-form-urlencoded", "", b"tag=b&tag=a", 2).await;
    let hash = |key: &'static str| {
        let store = store.clone();
        async move { record(&store, key).await.expect("seeded record").request_hash }
    };
    let (hash_q, hash_f) = (hash("old-q").await, hash("old-f").await);

    let retry = send_ok("POST", &gw.url("/v1/orders?tag=b&tag=a&x=1"), &json_headers("old-q"), ORDER).await;
    assert_eq!((retry.status, retry.replayed(), retry.json()["seeded"].as_u64()), (201, true, Some(1)), "{:?}", retry.body);
    let reordered = send_ok("POST", &gw.url("/v1/orders?x=1&tag=a&tag=b"), &json_headers("old-q"), ORDER).await;
    assert_eq!((reordered.status, reordered.replayed()), (201, true), "version 1 did not keep the order: {:?}", reordered.body);
    let other = send_ok("POST", &gw.url("/v1/orders?tag=b&tag=c&x=1"), &json_headers("old-q"), ORDER).await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"));

    let retry = send_ok("POST", &gw.url("/v1/orders"), &form_headers("old-f"), "tag=b&tag=a").await;
    assert_eq!((retry.status, retry.replayed(), retry.json()["seeded"].as_u64()), (201, true, Some(2)), "{:?}", retry.body);
    let other = send_ok("POST", &gw.url("/v1/orders"), &form_headers("old-f"), "tag=b").await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"));

    assert_eq!(up.total(), 0, "nothing was executed again");
    assert_eq!((hash("old-q").await, hash("old-f").await), (hash_q, hash_f), "the records keep their version-1 hash");
}

/// The body's media type is part of the request: the same bytes and key as
/// `application/json` and then as `application/merge-patch+json` are refused
/// as a reused key (they were one request: the second was replayed the first
/// one's answer), while `Application/JSON; charset=utf-8` is the first again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_bytes_as_another_media_type_are_another_request() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;
    let with = |ct: &'static str| vec![("authorization", "Bearer test-key"), ("content-type", ct), ("idempotency-key", "m")];
    let first = send_ok("POST", &gw.url("/v1/orders"), &with("application/json"), ORDER).await;
    assert_eq!(first.status, 201);
    let patch = send_ok("POST", &gw.url("/v1/orders"), &with("application/merge-patch+json"), ORDER).await;
    assert_eq!((patch.status, patch.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", patch.body);
    let same = send_ok("POST", &gw.url("/v1/orders"), &with("Application/JSON; charset=utf-8"), ORDER).await;
    assert_eq!((same.status, same.replayed()), (201, true), "{:?}", same.body);
    assert_eq!(up.side_effects(&derived("m")), 1);
    assert_eq!(settled_record(&store, "m").await.expect("record").state, idemgate::idempotency::record::State::Completed);
}

/// Records written by fingerprint version 3 (numbers with a fraction compared
/// as doubles) replay their own retries after the upgrade to version 4. For
/// those records an amount that is the same double is still replayed; a new
/// record tells the two apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_fingerprint_version_3_still_replay_their_own_retries() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;
    let exact = r#"{"amount":1.000000000000000001}"#;
    seed(&store, "v3", "application/json", "", exact.as_bytes(), 3, 3).await;
    // The hash the previous release wrote, by version 3's documented layout
    // (its canonical JSON has the double `1`), not by the code under test.
    let v3 = {
        use sha2::{Digest, Sha256};
        let mut s = Vec::new();
        for field in [&b"idemgate-fp-v3"[..], b"POST", b"create_order"] {
            s.extend_from_slice(&(field.len() as u64).to_be_bytes());
            s.extend_from_slice(field);
        }
        s.extend_from_slice(&[0u8; 24]);
        for field in [&b"application/json"[..], b"json"] {
            s.extend_from_slice(&(field.len() as u64).to_be_bytes());
            s.extend_from_slice(field);
        }
        s.extend_from_slice(br#"{"amount":1}"#);
        <[u8; 32]>::from(Sha256::digest(&s))
    };
    assert_eq!(record(&store, "v3").await.expect("seeded").request_hash.0, v3, "the seed is version 3's hash");
    let retry = send_ok("POST", &gw.url("/v1/orders"), &json_headers("v3"), exact).await;
    assert_eq!((retry.status, retry.replayed(), retry.json()["seeded"].as_u64()), (201, true, Some(3)), "{:?}", retry.body);
    let same_double = send_ok("POST", &gw.url("/v1/orders"), &json_headers("v3"), r#"{"amount":1}"#).await;
    assert_eq!((same_double.status, same_double.replayed()), (201, true), "version 3 compared doubles: {:?}", same_double.body);
    assert_eq!(up.total(), 0, "nothing was executed again");
    // Written now: the two amounts are two requests.
    assert_eq!(send_ok("POST", &gw.url("/v1/orders"), &json_headers("v4"), exact).await.status, 201);
    let other = send_ok("POST", &gw.url("/v1/orders"), &json_headers("v4"), r#"{"amount":1}"#).await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", other.body);
    assert_eq!(up.total(), 1);
}

/// Records written by fingerprint version 2 (no media type) replay their own
/// retries after the upgrade to version 3. Version 2 could not tell media
/// types apart, so for those records a retry as another media type is still
/// replayed; new records refuse it (above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_fingerprint_version_2_still_replay_their_own_retries() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;
    seed(&store, "v2", "application/json", "tag=b&tag=a", ORDER.as_bytes(), 7, 2).await;
    let retry = send_ok("POST", &gw.url("/v1/orders?tag=b&tag=a"), &json_headers("v2"), ORDER).await;
    assert_eq!((retry.status, retry.replayed(), retry.json()["seeded"].as_u64()), (201, true, Some(7)), "{:?}", retry.body);
    let patch = vec![("authorization", "Bearer test-key"), ("content-type", "application/merge-patch+json"), ("idempotency-key", "v2")];
    let other_type = send_ok("POST", &gw.url("/v1/orders?tag=b&tag=a"), &patch, ORDER).await;
    assert_eq!((other_type.status, other_type.replayed()), (201, true), "version 2 did not hash the media type: {:?}", other_type.body);
    // Version 2 kept one name's values in order.
    let reordered = send_ok("POST", &gw.url("/v1/orders?tag=a&tag=b"), &json_headers("v2"), ORDER).await;
    assert_eq!((reordered.status, reordered.problem().as_str()), (409, "idempotency-key-reused"));
    assert_eq!(up.total(), 0, "nothing was executed again");
}

/// What clients send at their defaults: a multipart upload with a new
/// boundary on every call (curl `-F`, Python requests' `files=`), and JSON
/// under the form type (curl `-d` without a type). An identical retry of the
/// upload is replayed; two JSON bodies a form decoding would equate (`+`
/// and a space) are two requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_and_form_typed_json_are_compared_as_sent() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let upload = |boundary: &'static str| {
        let ct = format!("multipart/form-data; boundary={boundary}");
        let body =
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"doc\"; filename=\"a.txt\"\r\n\r\nhello\r\n--{boundary}--\r\n");
        (ct, body)
    };
    let (ct, body) = upload("------------------------d74496d66958873e");
    let h = [("authorization", "Bearer test-key"), ("content-type", ct.as_str()), ("idempotency-key", "up")];
    assert_eq!(send_ok("POST", &gw.url("/v1/orders"), &h, &body).await.status, 201);
    let (ct, body) = upload("------------------------0b1c2e6a5f4d3c2b");
    let h = [("authorization", "Bearer test-key"), ("content-type", ct.as_str()), ("idempotency-key", "up")];
    let retry = send_ok("POST", &gw.url("/v1/orders"), &h, &body).await;
    assert_eq!((retry.status, retry.replayed()), (201, true), "the same upload under another boundary: {:?}", retry.body);
    assert_eq!(up.side_effects(&derived("up")), 1);
    // The boundary inside a line is content: `pay--Xnow` and `pay--Ynow` are two memos.
    let memo = |b: &'static str| {
        (
            format!("multipart/form-data; boundary={b}"),
            format!("--{b}\r\nContent-Disposition: form-data; name=\"memo\"\r\n\r\npay--{b}now\r\n--{b}--\r\n"),
        )
    };
    let (ct, body) = memo("X");
    let h = [("authorization", "Bearer test-key"), ("content-type", ct.as_str()), ("idempotency-key", "memo")];
    assert_eq!(send_ok("POST", &gw.url("/v1/orders"), &h, &body).await.status, 201);
    let (ct, body) = memo("Y");
    let h = [("authorization", "Bearer test-key"), ("content-type", ct.as_str()), ("idempotency-key", "memo")];
    let other = send_ok("POST", &gw.url("/v1/orders"), &h, &body).await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", other.body);

    let first = send_ok("POST", &gw.url("/v1/orders"), &form_headers("fj"), r#"{"memo":"pay 100+tip"}"#).await;
    assert_eq!(first.status, 201);
    let other = send_ok("POST", &gw.url("/v1/orders"), &form_headers("fj"), r#"{"memo":"pay 100 tip"}"#).await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"), "{:?}", other.body);
    let same = send_ok("POST", &gw.url("/v1/orders"), &form_headers("fj"), r#"{"memo":"pay 100+tip"}"#).await;
    assert_eq!((same.status, same.replayed()), (201, true));
    assert_eq!(up.total(), 3);
}
