//! Async mode (CONTRACT section 6) through the real binary, on both stores:
//! acceptance (202, Location, Retry-After, the status document), polling,
//! the result replayed exactly like a synchronous replay, scope isolation of
//! operation ids, retries with backoff ending `failed_retryable`, timeouts
//! ending `unknown` (or re-run on a deduplicating upstream). Every case checks
//! the upstream's side-effect ledger and the final record.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::idempotency::record::State;
use support::*;

on_both_stores!(
    async_route_accepts_runs_and_replays_the_result,
    prefer_respond_async_on_a_route_that_allows_it,
    refused_and_declined_attempts_back_off_then_fail_retryable,
    timeout_after_send_is_unknown_unless_the_upstream_deduplicates,
    the_acceptance_document_carries_the_time_of_acceptance,
    an_operation_past_its_retention_is_gone_before_the_sweeper_comes,
);

/// A front replica shares a PostgreSQL store with replicas that run workers
/// (the embedded store, one replica, refuses `workers.count = 0` with an
/// async route: nothing would ever run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_front_replica_without_workers_only_accepts_on_postgres() {
    a_front_replica_without_workers_only_accepts(postgres_backend()).await
}

const ORDER: &str = r#"{"item":"book","qty":1}"#;

async fn setup(backend: Backend, f: impl FnOnce(GatewayConfig) -> GatewayConfig) -> (TestUpstream, Gateway, idemgate::store::Store) {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(f(GatewayConfig::new(backend.clone(), upstream.url()).route("mode = \"async\"")));
    let store = backend.open().await;
    (upstream, gw, store)
}

fn auth(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    let mut h = vec![("authorization", "Bearer test-key")];
    h.extend_from_slice(extra);
    h
}

async fn get(gw: &Gateway, path: &str, headers: &[(&str, &str)]) -> Resp {
    send("GET", &gw.url(path), headers, "").await.expect("GET")
}

/// Polls the operation until its state is final; returns the last document.
async fn wait_final(gw: &Gateway, location: &str) -> serde_json::Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = get(gw, location, &auth(&[])).await;
        assert_eq!(r.status, 200, "{r:?}");
        let doc = r.json();
        let pending = matches!(doc["state"].as_str(), Some("queued" | "processing"));
        assert_eq!(r.header("retry-after").is_some(), pending, "Retry-After while not final: {doc}");
        if !pending {
            return doc;
        }
        assert!(std::time::Instant::now() < deadline, "the operation did not finish: {doc}\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn async_route_accepts_runs_and_replays_the_result(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.route("poll_interval = \"2s\"")).await;
    let url = gw.url("/v1/orders");
    let accepted = post(&url, "a1", ORDER, &[]).await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    let doc = accepted.json();
    let id = doc["id"].as_str().expect("an operation id").to_owned();
    let location = format!("/_idemgate/operations/{id}");
    assert_eq!(accepted.header("location"), Some(location.as_str()));
    assert_eq!(accepted.header("retry-after"), Some("2"));
    assert_eq!(
        (doc["operation"].as_str(), doc["poll_interval_s"].as_u64(), doc["retention_s"].as_u64()),
        (Some("create_order"), Some(2), Some(86400))
    );
    assert!(matches!(doc["state"].as_str(), Some("queued")), "{doc}");

    let done = wait_final(&gw, &location).await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["attempts"], 1);
    assert_eq!(done["result"]["status"], 201);
    let href = done["result"]["href"].as_str().unwrap().to_owned();
    assert_eq!(href, format!("{location}/result"));

    // The result replays the upstream's answer exactly like a sync replay.
    let result = get(&gw, &href, &auth(&[])).await;
    assert_eq!((result.status, result.replayed()), (201, true));
    assert_eq!(result.json()["key"], derived("a1"), "the upstream got the derived key");
    assert_eq!(result.header("set-cookie"), None, "Set-Cookie is never replayed");
    assert_eq!(up.side_effects(&derived("a1")), 1);
    let rec = settled_record(&store, "a1").await.unwrap();
    assert_eq!((rec.state, rec.attempts, rec.operation_id.as_deref()), (State::Completed, 1, Some(id.as_str())));
    assert_eq!(up.requests()[0].generation, Some(rec.generation.to_string()), "the attempt's generation, fenced");

    // Retry with the same key and request: the same 202 and id, nothing runs again.
    let again = post(&url, "a1", ORDER, &[]).await;
    assert_eq!(again.status, 202);
    assert_eq!(again.json()["id"], id.as_str());
    assert_eq!(again.json()["state"], "completed");
    // A changed request under the key: 409.
    let changed = post(&url, "a1", r#"{"item":"pen"}"#, &[]).await;
    assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"));
    // Another scope never sees the operation: 404, never 403; no identity: 401.
    let other = get(&gw, &location, &[("authorization", "Bearer other-key")]).await;
    assert_eq!((other.status, other.problem().as_str()), (404, "not-found"));
    assert_eq!(get(&gw, &href, &[("authorization", "Bearer other-key")]).await.status, 404);
    assert_eq!(get(&gw, &location, &[]).await.status, 401);
    assert_eq!(get(&gw, "/_idemgate/operations/op_nope", &auth(&[])).await.status, 404);
    assert_eq!(up.total(), 1);
}

async fn prefer_respond_async_on_a_route_that_allows_it(backend: Backend) {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), upstream.url()).route("allow_async = true"));
    let url = gw.url("/v1/orders");
    let sync = post(&url, "s", ORDER, &[]).await;
    assert_eq!((sync.status, sync.replayed()), (201, false), "no preference: synchronous");
    let accepted = post(&url, "a", ORDER, &[("prefer", "respond-async, wait=5")]).await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    let location = accepted.header("location").unwrap().to_owned();
    let done = wait_final(&gw, &location).await;
    assert_eq!(done["state"], "completed");
    // The record decides, not the header: a sync retry of an async key gets the acceptance.
    let retry = post(&url, "a", ORDER, &[]).await;
    assert_eq!((retry.status, retry.json()["id"].clone()), (202, accepted.json()["id"].clone()));
    // And an async retry of a sync key gets the sync replay.
    let replay = post(&url, "s", ORDER, &[("prefer", "respond-async")]).await;
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!((upstream.side_effects(&derived("s")), upstream.side_effects(&derived("a"))), (1, 1));
}

async fn refused_and_declined_attempts_back_off_then_fail_retryable(backend: Backend) {
    // The upstream answers 503 (a release_on_status): three attempts, then failed.
    let (up, gw, store) =
        setup(backend.clone(), |c| c.route("release_on_status = [503]\nretry.max_attempts = 3\nretry.backoff = \"100ms\"")).await;
    let accepted = post(&gw.url("/v1/orders"), "busy", ORDER, &[("x-test-status", "503")]).await;
    assert_eq!(accepted.status, 202);
    let location = accepted.header("location").unwrap().to_owned();
    let done = wait_final(&gw, &location).await;
    assert_eq!(
        (done["state"].as_str(), done["attempts"].as_i64(), done["last_status"].as_i64()),
        (Some("failed_retryable"), Some(3), Some(503)),
        "{done}"
    );
    assert_eq!(done["result"], serde_json::Value::Null);
    assert_eq!(up.side_effects(&derived("busy")), 3, "three attempts reached the upstream, as configured");
    let reqs = up.requests();
    let gens: Vec<i64> = reqs.iter().map(|r| r.generation.as_deref().unwrap().parse().unwrap()).collect();
    assert!(gens.windows(2).all(|w| w[0] < w[1]), "every attempt has a larger generation: {gens:?}");
    assert_eq!(settled_record(&store, "busy").await.unwrap().state, State::FailedRetryable);
    let result = get(&gw, &format!("{location}/result"), &auth(&[])).await;
    assert_eq!((result.status, result.problem().as_str()), (409, "operation-not-completed"));
    drop(gw);

    // A refused connection: the request never left; retried, then failed.
    let dead = TestUpstream::start().await;
    let dead_url = dead.url();
    drop(dead);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), dead_url).route("mode = \"async\"\nretry.max_attempts = 2\nretry.backoff = \"50ms\""),
    );
    let accepted = post(&gw.url("/v1/orders"), "refused", ORDER, &[]).await;
    assert_eq!(accepted.status, 202);
    let done = wait_final(&gw, accepted.header("location").unwrap()).await;
    assert_eq!((done["state"].as_str(), done["attempts"].as_i64()), (Some("failed_retryable"), Some(2)), "{done}");
}

async fn timeout_after_send_is_unknown_unless_the_upstream_deduplicates(backend: Backend) {
    let (up, gw, store) = setup(backend.clone(), |c| c.timeout("300ms").route("lease = \"2s\"")).await;
    let accepted = post(&gw.url("/v1/orders"), "slow", ORDER, &[("x-test-sleep-ms", "800")]).await;
    let done = wait_final(&gw, accepted.header("location").unwrap()).await;
    assert_eq!((done["state"].as_str(), done["attempts"].as_i64()), (Some("unknown"), Some(1)), "{done}");
    assert_eq!(up.side_effects(&derived("slow")), 1, "never run twice");
    assert_eq!(settled_record(&store, "slow").await.unwrap().state, State::Unknown);
    drop(gw);

    // An upstream that deduplicates by the derived key: the lost answer is
    // fetched by running the attempt again; one side effect.
    let dedup = TestUpstream::start().await;
    dedup.set_dedupe(true);
    let gw = Gateway::start(
        GatewayConfig::new(backend, dedup.url())
            .timeout("300ms")
            .route("mode = \"async\"\nupstream_idempotent = true\nlease = \"2s\"\nretry.backoff = \"50ms\""),
    );
    let accepted = post(&gw.url("/v1/orders"), "slow-dedup", ORDER, &[("x-test-sleep-ms", "500")]).await;
    assert_eq!(accepted.status, 202);
    let done = wait_final(&gw, accepted.header("location").unwrap()).await;
    // The first attempt times out while the upstream works; the second, with the same derived
    // key, gets the deduplicated answer at once.
    assert_eq!((done["state"].as_str(), done["attempts"].as_i64()), (Some("completed"), Some(2)), "{done}");
    assert_eq!(dedup.side_effects(&derived("slow-dedup")), 1, "the upstream deduplicated every re-run");
    assert!(dedup.requests().len() >= 2, "the attempt ran again");
    assert!(dedup.requests().iter().all(|r| r.key == derived("slow-dedup")), "with the same derived key");
}

async fn a_front_replica_without_workers_only_accepts(backend: Backend) {
    let (up, gw, store) = setup(backend, |c| c.tail("[workers]\ncount = 0")).await;
    let accepted = post(&gw.url("/v1/orders"), "queued", ORDER, &[]).await;
    assert_eq!(accepted.status, 202);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let doc = get(&gw, accepted.header("location").unwrap(), &auth(&[])).await;
    assert_eq!((doc.json()["state"].as_str(), doc.header("retry-after").is_some()), (Some("queued"), true));
    assert_eq!(up.total(), 0, "nothing runs on a pure front");
    let rec = settled_record(&store, "queued").await.unwrap();
    assert_eq!((rec.state, rec.attempts), (State::Queued, 0));
    let (code, out, err) = cli(&gw, &["keys", "list", "--state", "queued"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("queued") && out.contains("1 record(s)"), "{out}");
}

/// The 202's `created_at`/`updated_at` are the time the operation was
/// accepted, the same values the status document reads back from the store
/// (the embedded store once answered "now + lease").
async fn the_acceptance_document_carries_the_time_of_acceptance(backend: Backend) {
    let (_up, gw, store) = setup(backend, |c| c.route("lease = \"60s\"")).await;
    let accepted = post(&gw.url("/v1/orders"), "when", ORDER, &[]).await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    let doc = accepted.json();
    let rec = settled_record(&store, "when").await.expect("record");
    assert_eq!(doc["created_at"].as_str(), Some(rec.created_at.to_string().as_str()), "202 {doc} vs record {rec:?}");
    assert_eq!(doc["updated_at"], doc["created_at"], "{doc}");
}

/// An operation completed longer ago than its route's retention is gone,
/// as a synchronous record is, even while the sweeper has not come by (its
/// interval here is far longer than the retention): its status and its
/// result answer 404, not the answer kept past its time.
async fn an_operation_past_its_retention_is_gone_before_the_sweeper_comes(backend: Backend) {
    let (_up, gw, _store) = setup(backend, |c| c.route("retention = \"1s\"").sweep_interval("1h")).await;
    let accepted = post(&gw.url("/v1/orders"), "short", ORDER, &[]).await;
    assert_eq!(accepted.status, 202);
    let location = accepted.header("location").expect("location").to_owned();
    let done = wait_final(&gw, &location).await;
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(get(&gw, &format!("{location}/result"), &auth(&[])).await.status, 201, "within its retention");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for path in [location.clone(), format!("{location}/result")] {
        let r = get(&gw, &path, &auth(&[])).await;
        assert_eq!((r.status, r.problem().as_str()), (404, "not-found"), "{path}");
    }
}
