//! The admin HTTP API (CONTRACT section 7) through the real binary: bearer
//! authentication, listing with filters and a cursor, one record by its
//! percent-encoded scope, resolutions and their conflicts, and the audit
//! trail the CLI writes too. Every case checks the store and, where a client
//! retries, the upstream's ledger.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::BTreeSet;

use idemgate::idempotency::record::State;
use support::admin::{enc, record_path};
use support::*;

on_both_stores!(listing_pages_through_every_record_with_a_cursor, resolutions_conflicts_and_the_audit_trail,);

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const TOKEN: &str = "admin-token-3f9c";

/// A gateway whose admin API is on (token in a file), and its store.
async fn setup(
    backend: Backend,
    f: impl FnOnce(GatewayConfig) -> GatewayConfig,
) -> (TestUpstream, Gateway, idemgate::store::Store, tempfile::TempDir) {
    support::admin::setup(backend, TOKEN, f).await
}

async fn admin(gw: &Gateway, method: &str, path: &str, body: &str) -> Resp {
    support::admin::request(gw, method, path, Some(TOKEN), body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_api_is_off() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    for (method, path) in [("GET", "/admin/records"), ("GET", "/admin/audit"), ("POST", "/admin/records/a/b/c/d/resolve")] {
        let r = send(method, &gw.admin_url(path), &[("authorization", "Bearer anything")], "{}").await.unwrap();
        assert_eq!((r.status, r.problem().as_str()), (404, "not-found"), "{method} {path}: {r:?}");
    }
    // Health and metrics never needed a token.
    assert_eq!(send("GET", &gw.admin_url("/healthz"), &[], "").await.unwrap().status, 200);
    assert_eq!(send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_or_missing_token_is_401_and_never_echoed() {
    let (_up, gw, _store, _dir) = setup(sqlite_backend(), |c| c).await;
    let wrong = format!("Bearer {TOKEN}x");
    let cases: [&[(&str, &str)]; 4] =
        [&[], &[("authorization", &wrong)], &[("authorization", TOKEN)], &[("authorization", "Basic YWRtaW46YWRtaW4=")]];
    for headers in cases {
        for path in ["/admin/records", "/admin/audit", "/admin/nothing-here"] {
            let r = send("GET", &gw.admin_url(path), headers, "").await.unwrap();
            assert_eq!((r.status, r.problem().as_str()), (401, "unauthenticated"), "{headers:?} {path}");
            assert!(r.header("www-authenticate").is_some_and(|v| v.starts_with("Bearer")), "{r:?}");
            assert!(!String::from_utf8_lossy(&r.body).contains(TOKEN), "the token is never echoed");
        }
    }
    let ok = admin(&gw, "GET", "/admin/records", "").await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.json(), serde_json::json!({ "records": [], "next_cursor": null }));
    // With the token, unknown endpoints and methods are told apart.
    assert_eq!(admin(&gw, "GET", "/admin/nothing-here", "").await.status, 404);
    let wrong_method = admin(&gw, "DELETE", "/admin/records", "").await;
    assert_eq!((wrong_method.status, wrong_method.header("allow")), (405, Some("GET")));
}

/// 25 records, pages of 10: three pages, every record once, in order; filters
/// and bad parameters.
async fn listing_pages_through_every_record_with_a_cursor(backend: Backend) {
    let (_up, gw, store, _dir) = setup(backend, |c| c).await;
    for i in 0..25 {
        assert_eq!(post(&gw.url("/v1/orders"), &format!("page-{i:02}"), ORDER, &[]).await.status, 201);
    }
    for i in 0..25 {
        assert_eq!(settled_record(&store, &format!("page-{i:02}")).await.unwrap().state, State::Completed);
    }
    let mut seen = Vec::new();
    let mut pages = 0;
    let mut path = "/admin/records?limit=10&state=completed".to_owned();
    loop {
        let r = admin(&gw, "GET", &path, "").await;
        assert_eq!(r.status, 200, "{r:?}");
        let doc = r.json();
        pages += 1;
        let records = doc["records"].as_array().unwrap();
        assert!(records.len() <= 10);
        for rec in records {
            assert_eq!(rec["state"], "completed");
            assert_eq!(rec["response_status"], 201);
            assert!(rec["response_size"].as_u64().unwrap() > 0);
            assert!(rec["response"].get("body").is_none(), "bodies are never listed");
            seen.push(rec["key"].as_str().unwrap().to_owned());
        }
        match doc["next_cursor"].as_str() {
            Some(c) => path = format!("/admin/records?limit=10&state=completed&cursor={}", enc(c)),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let unique: BTreeSet<&String> = seen.iter().collect();
    assert_eq!((seen.len(), unique.len()), (25, 25));
    let mut newest_first = seen.clone();
    newest_first.sort();
    newest_first.reverse();
    assert_eq!(seen, newest_first, "created one after the other: newest first");
    // Filters.
    for (query, n) in [("tenant=acme", 25), ("tenant=nobody", 0), ("operation=create_order", 25), ("state=unknown", 0)] {
        let doc = admin(&gw, "GET", &format!("/admin/records?limit=100&{query}"), "").await.json();
        assert_eq!(doc["records"].as_array().unwrap().len(), n, "{query}");
    }
    for query in ["state=bogus", "limit=0", "limit=1001", "limit=x", "cursor=garbage", "colour=blue"] {
        let r = admin(&gw, "GET", &format!("/admin/records?{query}"), "").await;
        assert_eq!((r.status, r.problem().as_str()), (400, "invalid-request"), "{query}: {r:?}");
    }
}

/// Scope segments are percent-encoded: a key with `/` and `%`, a principal
/// with a space (identity from trusted headers). Resolved through the API,
/// the client's retry replays what the operator recorded.
/// A stored response's credential headers (a token an upstream answered a
/// create with) are masked in the API's record and listing documents, as
/// the console masks them; other headers are shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_response_credentials_are_masked_in_the_api() {
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c).await;
    let answered = post(&gw.url("/v1/orders"), "with-token", ORDER, &[("x-test-answer-header", "x-auth-token=s3cr3t-t0ken")]).await;
    assert_eq!((answered.status, answered.header("x-auth-token")), (201, Some("s3cr3t-t0ken")), "the client gets it");
    assert_eq!(settled_record(&store, "with-token").await.unwrap().state, State::Completed);
    let one = admin(&gw, "GET", &record_path(TENANT, PRINCIPAL, "create_order", "with-token"), "").await;
    let list = admin(&gw, "GET", "/admin/records?state=completed", "").await;
    for r in [&one, &list] {
        assert_eq!(r.status, 200, "{r:?}");
        let text = String::from_utf8_lossy(&r.body);
        assert!(!text.contains("s3cr3t-t0ken"), "the token in clear: {text}");
        assert!(text.contains("x-auth-token") && text.contains("(masked: 12 bytes)"), "{text}");
        assert!(text.contains("application/json"), "other headers are shown: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_addressed_by_percent_encoded_scope_segments() {
    let (up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    // Keys are visible ASCII: "/", "%" and "+" are fine; the principal has a space.
    let key = "orders/2024%7+1".to_owned();
    let (principal, url) = ("ops team", gw.url("/v1/orders"));
    let headers = [("x-tenant-id", TENANT), ("x-principal-id", principal), ("x-test-sleep-ms", "800")];
    let r = send("POST", &url, &[&headers[..], &[("idempotency-key", key.as_str())]].concat(), ORDER).await.unwrap();
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"));
    let path = record_path(TENANT, principal, "create_order", &key);
    assert!(path.contains("%2F") && path.contains("%20") && path.contains("%25"), "{path}");

    let shown = admin(&gw, "GET", &path, "").await;
    assert_eq!(shown.status, 200, "{shown:?}");
    let doc = shown.json();
    assert_eq!(
        (doc["principal"].as_str(), doc["key"].as_str(), doc["state"].as_str()),
        (Some(principal), Some(key.as_str()), Some("unknown"))
    );
    assert_eq!(doc["response_status"], serde_json::Value::Null);
    // Not decoded before splitting: a raw "/" is a separator, so this is no scope.
    let raw = format!("/admin/records/{TENANT}/{}/create_order/{}", enc(principal), key.replace('%', "%25"));
    assert_eq!(admin(&gw, "GET", &raw, "").await.status, 404);
    // Another principal's record with the same key does not exist.
    assert_eq!(admin(&gw, "GET", &record_path(TENANT, PRINCIPAL, "create_order", &key), "").await.status, 404);

    let body = serde_json::json!({
        "action": "complete",
        "status": 201,
        "headers": { "content-type": "application/json" },
        "body_base64": base64_of(br#"{"order":"by hand"}"#),
        "reason": "found order 17 in the ledger",
    });
    let resolved = admin(&gw, "POST", &format!("{path}/resolve"), &body.to_string()).await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    assert_eq!((resolved.json()["from_state"].as_str(), resolved.json()["to_state"].as_str()), (Some("unknown"), Some("completed")));
    let retry = send("POST", &url, &[("x-tenant-id", TENANT), ("x-principal-id", principal), ("idempotency-key", key.as_str())], ORDER)
        .await
        .unwrap();
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(&retry.body[..], br#"{"order":"by hand"}"#);
    assert_eq!(up.total(), 1, "the retry did not execute again");
    let s = idemgate::idempotency::key::Scope {
        tenant: TENANT.into(),
        principal: principal.into(),
        operation: "create_order".into(),
        key: idemgate::idempotency::key::IdempotencyKey::new(&key).unwrap(),
    };
    let trail = store.audit(10).await.unwrap();
    assert_eq!((trail[0].actor.as_str(), &trail[0].scope), ("admin", &s));
    assert_eq!(admin(&gw, "GET", &path, "").await.json()["response_size"], 19);
}

fn base64_of(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// What may be resolved: unknown records and expired claims; a completed one
/// only with force; a live claim never (409). A reason is required (400), a
/// missing record is 404. The trail lists every change, the CLI's included,
/// newest first, with actor and reason; `keys audit` shows the API's too.
async fn resolutions_conflicts_and_the_audit_trail(backend: Backend) {
    let (up, gw, store, _dir) = setup(backend, |c| c.timeout("2s").route("lease = \"5s\"")).await;
    let url = gw.url("/v1/orders");
    let path = |k: &str| format!("{}/resolve", record_path(TENANT, PRINCIPAL, "create_order", k));
    let release = |reason: &str| serde_json::json!({ "action": "release", "reason": reason }).to_string();

    // Completed: 409 without force, and nothing changes.
    assert_eq!(post(&url, "done", ORDER, &[]).await.status, 201);
    assert_eq!(settled_record(&store, "done").await.unwrap().state, State::Completed);
    let r = admin(&gw, "POST", &path("done"), &release("looks wrong")).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "not-resolvable"), "{r:?}");
    assert!(r.json()["detail"].as_str().unwrap().contains("force"));
    assert_eq!(settled_record(&store, "done").await.unwrap().state, State::Completed);
    // A live claim (the upstream is still working on it): 409, even by force.
    let slow = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "live", ORDER, &[("x-test-sleep-ms", "3000")]).await }
    });
    let mut received = up.subscribe();
    while received.recv().await.unwrap().key != derived("live") {}
    let forced = serde_json::json!({ "action": "release", "reason": "impatient", "force": true }).to_string();
    let r = admin(&gw, "POST", &path("live"), &forced).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "not-resolvable"), "{r:?}");
    assert!(r.json()["detail"].as_str().unwrap().contains("lease"));
    // Missing reason, missing record, bad bodies.
    let r = admin(&gw, "POST", &path("done"), r#"{"action":"release"}"#).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-request"));
    assert!(r.json()["detail"].as_str().unwrap().contains("reason"));
    assert_eq!(admin(&gw, "POST", &path("nobody"), &release("x")).await.status, 404);
    let r = admin(&gw, "POST", &path("done"), r#"{"action":"complete","status":99,"reason":"x","force":true}"#).await;
    assert_eq!(r.status, 400, "{r:?}");
    assert_eq!(admin(&gw, "GET", &path("done"), "").await.status, 405);
    assert!(store.audit(10).await.unwrap().is_empty(), "refusals leave no trail");

    // Force with a reason: done. Then an unknown record released (the live
    // claim timed out: 504 after 2 s) and one resolved with the CLI.
    let r = admin(&gw, "POST", &path("done"), &forced.replace("impatient", "refunded by support")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(slow.await.unwrap().status, 504);
    assert_eq!(settled_record(&store, "live").await.unwrap().state, State::Unknown);
    // A resolution names the generation the operator looked at: another one
    // (the record moved on since) is refused, and nothing changes.
    let seen = settled_record(&store, "live").await.unwrap().generation.0;
    let stale = serde_json::json!({ "action": "release", "reason": "checked gen before", "generation": seen - 1 }).to_string();
    let r = admin(&gw, "POST", &path("live"), &stale).await;
    assert_eq!((r.status, r.problem().as_str()), (409, "not-resolvable"), "{r:?}");
    assert!(r.json()["detail"].as_str().unwrap().contains("moved on"), "{r:?}");
    assert_eq!(settled_record(&store, "live").await.unwrap().state, State::Unknown);
    let r = admin(&gw, "POST", &path("live"), &release("upstream ledger has no such order")).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert!(settled_record(&store, "live").await.is_none());
    assert_eq!(post(&url, "cli", ORDER, &[("x-test-sleep-ms", "2500")]).await.status, 504);
    let scope_args = ["--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", "cli"];
    let (code, _, err) =
        cli(&gw, &[&["keys", "resolve"][..], &scope_args, &["--release", "--reason", "an older look", "--generation", "0"]].concat());
    assert_ne!(code, 0, "a resolution of generation 0 applied to the record: {err}");
    assert!(err.contains("moved on"), "{err}");
    assert_eq!(settled_record(&store, "cli").await.unwrap().state, State::Unknown);
    let seen = settled_record(&store, "cli").await.unwrap().generation.0.to_string();
    let (code, _, err) = cli(
        &gw,
        &[&["keys", "resolve"][..], &scope_args, &["--release", "--reason", "checked on the CLI", "--generation", &seen]].concat(),
    );
    assert_eq!(code, 0, "{err}");

    let doc = admin(&gw, "GET", "/admin/audit?limit=10", "").await.json();
    let entries = doc["entries"].as_array().unwrap();
    let summary: Vec<(&str, &str, &str, &str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["actor"].as_str().unwrap(),
                e["scope"]["key"].as_str().unwrap(),
                e["from_state"].as_str().unwrap(),
                e["to_state"].as_str().unwrap(),
                e["reason"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        vec![
            ("cli", "cli", "unknown", "released", "checked on the CLI"),
            ("admin", "live", "unknown", "released", "upstream ledger has no such order"),
            ("admin", "done", "completed", "released", "refunded by support"),
        ]
    );
    assert!(entries.iter().all(|e| e["at"].is_string() && e["scope"]["tenant"] == TENANT));
    assert_eq!(admin(&gw, "GET", "/admin/audit?limit=1", "").await.json()["entries"].as_array().unwrap().len(), 1);
    // One trail, one implementation: the CLI prints the API's document.
    let (code, out, err) = cli(&gw, &["keys", "audit", "--json"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&out).unwrap(), doc);
    let (_, table, _) = cli(&gw, &["keys", "audit"]);
    assert!(table.contains("refunded by support") && table.contains("admin") && table.contains("[forced]"), "{table}");
    // The retries: the released keys run again, once each.
    assert!(!post(&url, "live", ORDER, &[]).await.replayed());
    assert_eq!(up.side_effects(&derived("live")), 2, "released after it had executed: the operator's call");
}
