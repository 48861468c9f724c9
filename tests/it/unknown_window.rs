//! Closing the unknown window (issue 11), through the real binary and a real
//! upstream with a by-key lookup:
//! - a reconciliation probe settles `unknown` records: executed → completed
//!   (the retry replays `found_as`), never executed → released (the retry
//!   runs once), an inconclusive probe → still unknown, probed again with
//!   backoff; two replicas never probe-and-write one record twice;
//! - a request that never reached the upstream (a connect that hangs) is
//!   "never sent": 503 and released, never `unknown`.
//!
//! Every case checks the record, the audit trail and the upstream's ledger.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::idempotency::record::State;
use idemgate::store::Store;
use support::faultproxy::{Fault, FaultProxy};
use support::*;

on_both_stores!(
    executed_but_timed_out_is_completed_by_its_probe,
    never_executed_is_released_and_the_retry_runs_once,
    an_inconclusive_probe_leaves_it_unknown_and_backs_off,
    a_connect_that_hangs_is_never_sent_and_releases_the_key,
    a_full_batch_of_found_probes_settles_at_once,
    an_observed_record_is_not_probed_under_the_derived_key,
);

on_citus!(a_full_batch_of_found_probes_settles_at_once);

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// The `create_order` route with a fast probe (tests wait on it).
fn probed(extra: &str) -> String {
    format!(
        "lease = \"1s\"\n{extra}\n[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{{derived_key}}\"\nfound_as = 201\n\
         settle = \"300ms\"\ninterval = \"100ms\""
    )
}

async fn metric(gw: &Gateway, series: &str) -> f64 {
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    let text = String::from_utf8_lossy(&m.body).into_owned();
    text.lines().filter(|l| l.starts_with(series)).filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())).sum()
}

fn probes(outcome: &str) -> String {
    format!("idemgate_probes_total{{operation=\"create_order\",outcome=\"{outcome}\"}}")
}

/// The record's state once a result write after an answer returned.
async fn state(store: &Store, key: &str) -> Option<State> {
    settled_record(store, key).await.map(|r| r.state)
}

async fn wait_state(store: &Store, key: &str, want: Option<State>, gw: &Gateway) {
    let reached = eventually(Duration::from_secs(20), || async { state(store, key).await == want }).await;
    assert!(reached, "{key} did not become {want:?} (is {:?}):\n{}", state(store, key).await, gw.logs());
}

/// Executed upstream, answer lost to the timeout: `unknown`, then the probe
/// finds the order and records it; the client's retry replays it as 201.
async fn executed_but_timed_out_is_completed_by_its_probe(backend: Backend) {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed("")));
    let store = backend.open().await;
    let r = post(&gw.url("/v1/orders"), "k1", ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}");

    wait_state(&store, "k1", Some(State::Completed), &gw).await;
    let rec = settled_record(&store, "k1").await.unwrap();
    let stored = rec.response.clone().unwrap();
    assert_eq!(stored.status, 201, "recorded as found_as, not the probe's 200");
    let order: serde_json::Value = serde_json::from_slice(stored.body.as_deref().unwrap()).unwrap();
    assert_eq!((order["key"].as_str(), order["order"].as_u64()), (Some(derived("k1").as_str()), Some(1)));
    let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert!(names.contains(&"x-upstream") && !names.contains(&"connection"), "hop-by-hop headers are not stored: {names:?}");

    let again = post(&gw.url("/v1/orders"), "k1", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true), "{again:?}");
    assert_eq!(again.body, stored.body.unwrap());
    assert_eq!(up.side_effects(&derived("k1")), 1, "the retry never re-executed it");
    assert_eq!(up.probes_of(&derived("k1")), 1);

    let trail = store.audit(10).await.unwrap();
    assert_eq!(trail.len(), 1, "{trail:?}");
    let a = &trail[0];
    assert_eq!((a.actor.as_str(), a.from_state.as_str(), a.to_state.as_str()), ("reconciler", "unknown", "completed"));
    assert_eq!(a.scope, scope("k1"));
    assert!(a.reason.contains("200 (found)") && a.reason.contains("201"), "{}", a.reason);
    assert_eq!(a.generation, Some(rec.generation));
    assert_eq!(metric(&gw, &probes("found")).await, 1.0);
    assert_eq!(metric(&gw, &probes("absent")).await, 0.0, "series exist from the start");
}

/// A record observed (`mode = "observe"`) whose answer was lost, then the
/// route enforced with a probe that asks about `{derived_key}`. Observe mode
/// passed the client's request through as it was, so the upstream never saw
/// that key, and its "absent" would release a request that ran: the record
/// is not probed, stays `unknown` for an operator, and a retry is refused,
/// not run a second time.
async fn an_observed_record_is_not_probed_under_the_derived_key(backend: Backend) {
    let up = TestUpstream::start().await;
    let observer = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("mode = \"observe\""));
    let store = backend.open().await;
    post(&observer.url("/v1/orders"), "observed", ORDER, &[("x-test-sleep-ms", "900")]).await;
    wait_state(&store, "observed", Some(State::Unknown), &observer).await;
    drop(observer);
    assert!(eventually(Duration::from_secs(5), || async { up.total() == 1 }).await, "the upstream ran it once");

    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed("")));
    let refused = eventually(Duration::from_secs(10), || async { metric(&gw, &probes("error")).await >= 1.0 }).await;
    assert!(refused, "the probe is refused as an error:\n{}", gw.logs());
    assert!(gw.log_count("not probed: the probe asks about {derived_key}") >= 1, "{}", gw.logs());
    assert_eq!(up.probes_of(&derived("observed")), 0, "no lookup was sent");
    assert_eq!(state(&store, "observed").await, Some(State::Unknown));
    let retry = post(&gw.url("/v1/orders"), "observed", ORDER, &[]).await;
    assert_eq!((retry.status, retry.problem().as_str()), (409, "outcome-unknown"), "{retry:?}");
    assert_eq!(up.total(), 1, "the retry did not run it again");
    assert!(store.audit(10).await.unwrap().is_empty(), "nothing was resolved");
}

/// Twelve requests executed upstream whose answers were lost to the timeout,
/// at once: the reconciler settles up to eight probes at a time, and each
/// settlement is a resolution that must hold one of the store's connections
/// (eight here), not two. On Citus a resolution drew its new generation on a
/// second connection: eight at once waited for each other until the
/// operation timeout, and, taken again together, never settled.
async fn a_full_batch_of_found_probes_settles_at_once(backend: Backend) {
    let up = TestUpstream::start().await;
    // Room for the twelve at once, and for eight probes beside them.
    let cfg = GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").upstream("max_in_flight = 32").route(&probed(""));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    let keys: Vec<String> = (0..12).map(|i| format!("batch-{i}")).collect();
    let url = gw.url("/v1/orders");
    for r in futures_util::future::join_all(keys.iter().map(|k| post(&url, k, ORDER, &[("x-test-sleep-ms", "900")]))).await {
        assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}");
    }
    for k in &keys {
        wait_state(&store, k, Some(State::Completed), &gw).await;
        assert_eq!(up.side_effects(&derived(k)), 1, "{k}");
    }
    let trail = store.audit(100).await.unwrap();
    assert_eq!(trail.iter().filter(|a| a.actor == "reconciler" && a.to_state == "completed").count(), keys.len(), "{trail:?}");
    assert_eq!(metric(&gw, &probes("found")).await, keys.len() as f64, "each record probed once: none taken again after a failed write");
}

/// The request was lost on its way (a blackholed connection): the upstream
/// never acted. While the upstream cannot be reached the probe fails and the
/// record stays unknown; once it can, the probe finds nothing, the key is
/// released, and the retry runs the operation exactly once.
async fn never_executed_is_released_and_the_retry_runs_once(backend: Backend) {
    let up = TestUpstream::start().await;
    let proxy = FaultProxy::start(up.addr).await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{}", proxy.addr())).timeout("500ms").route(&probed("")));
    let store = backend.open().await;
    proxy.set(Fault::BlackholeUpstream);
    let r = post(&gw.url("/v1/orders"), "k2", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}");
    assert_eq!(up.total(), 0);
    let failed = eventually(Duration::from_secs(10), || async { metric(&gw, &probes("error")).await >= 1.0 }).await;
    assert!(failed, "a probe that cannot reach the upstream is an error:\n{}", gw.logs());
    assert_eq!(state(&store, "k2").await, Some(State::Unknown), "an unanswered probe decides nothing");

    proxy.set(Fault::None);
    proxy.reset_all();
    wait_state(&store, "k2", None, &gw).await;
    let trail = store.audit(10).await.unwrap();
    assert_eq!(trail.len(), 1, "{trail:?}");
    assert_eq!((trail[0].actor.as_str(), trail[0].from_state.as_str(), trail[0].to_state.as_str()), ("reconciler", "unknown", "released"));
    assert!(trail[0].reason.contains("404 (absent)"), "{}", trail[0].reason);

    let retry = post(&gw.url("/v1/orders"), "k2", ORDER, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(up.side_effects(&derived("k2")), 1);
    assert_eq!(state(&store, "k2").await, Some(State::Completed));
    assert_eq!(metric(&gw, &probes("absent")).await, 1.0);
}

/// A probe answering 500 is neither found nor absent: the record stays
/// unknown, is probed again after `interval`, then twice that, and so on;
/// once the lookup works it is settled. Inconclusive probes leave no audit row.
async fn an_inconclusive_probe_leaves_it_unknown_and_backs_off(backend: Backend) {
    let up = TestUpstream::start().await;
    up.set_probe_status(Some(500));
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed("")));
    let store = backend.open().await;
    let r = post(&gw.url("/v1/orders"), "k3", ORDER, &[("x-test-sleep-ms", "700")]).await;
    assert_eq!(r.status, 504, "{r:?}");
    let key = derived("k3");
    let probed4 = eventually(Duration::from_secs(20), || async { up.probes_of(&key) >= 4 }).await;
    assert!(probed4, "probed again and again:\n{}", gw.logs());
    assert_eq!(state(&store, "k3").await, Some(State::Unknown));
    assert!(store.audit(10).await.unwrap().is_empty(), "nothing was decided");
    assert!(metric(&gw, &probes("inconclusive")).await >= 4.0);
    // The waits between probes double: interval (100 ms), 200 ms, 400 ms.
    let at: Vec<std::time::Instant> = up.probes().iter().filter(|(k, _, _)| *k == key).map(|(_, _, t)| *t).collect();
    for (n, min_ms) in [(1, 100u64), (2, 200), (3, 400)] {
        let gap = at[n] - at[n - 1];
        assert!(gap >= Duration::from_millis(min_ms * 9 / 10), "wait {n} was {gap:?}, backoff {min_ms} ms");
    }

    up.set_probe_status(None);
    wait_state(&store, "k3", Some(State::Completed), &gw).await;
    assert_eq!(store.audit(10).await.unwrap().len(), 1);
    assert_eq!(up.side_effects(&key), 1);
}

/// A listener whose accept queue is full: the kernel drops further SYNs and a
/// connect hangs (a dead host behind a load balancer, a blackholed route).
fn full_accept_queue() -> (std::net::SocketAddr, tokio::net::TcpListener, Vec<std::net::TcpStream>) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    let mut fillers = Vec::new();
    while let Ok(s) = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
        fillers.push(s);
        assert!(fillers.len() < 16, "the accept queue never filled");
    }
    (addr, listener, fillers)
}

/// Nothing left idemgate: 503 `upstream-unavailable`, the key released, the
/// retry gets the same answer (never 409 `outcome-unknown`). The exchange's
/// timeout (300 ms) is not what ends it: the connect phase is bounded by
/// `connect_timeout` (150 ms here), which must be shorter.
async fn a_connect_that_hangs_is_never_sent_and_releases_the_key(backend: Backend) {
    let (addr, _listener, _fillers) = tokio::task::block_in_place(full_accept_queue);
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{addr}")).timeout("300ms"));
    let store = backend.open().await;
    for attempt in 0..2 {
        let r = post(&gw.url("/v1/orders"), "hang", ORDER, &[]).await;
        assert_eq!((r.status, r.problem().as_str()), (503, "upstream-unavailable"), "attempt {attempt}: {r:?}");
        assert_eq!(r.json()["retryable"], true);
        assert_eq!(state(&store, "hang").await, None, "released, never unknown");
    }
}

/// Async: a connect that hangs is retried with backoff and ends
/// `failed_retryable` ("never executed"), never `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_operation_whose_connect_hangs_is_requeued_never_unknown() {
    let backend = sqlite_backend();
    let (addr, _listener, _fillers) = tokio::task::block_in_place(full_accept_queue);
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), format!("http://{addr}"))
            .timeout("300ms")
            .route("mode = \"async\"\nretry.max_attempts = 2\nretry.backoff = \"50ms\""),
    );
    let store = backend.open().await;
    let r = post(&gw.url("/v1/orders"), "hang-async", ORDER, &[]).await;
    assert_eq!(r.status, 202, "{r:?}");
    let ended = eventually(Duration::from_secs(20), || async { state(&store, "hang-async").await == Some(State::FailedRetryable) }).await;
    let rec = settled_record(&store, "hang-async").await.unwrap();
    assert!(ended, "ended {:?}:\n{}", rec.state, gw.logs());
    assert_eq!(rec.attempts, 2);
    assert!(!rec.maybe_executed);
}

/// Path parameters reach the probe from the request line kept at claim time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_of_the_request_reach_the_probe() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").tail(
        "[[routes]]\noperation = \"account_order\"\nmethod = \"POST\"\npath = \"/v1/accounts/{account}/orders\"\nupstream = \"orders\"\n\
         lease = \"1s\"\n[routes.reconcile]\nprobe = \"GET /v1/accounts/{account}/orders/by-key/{derived_key}\"\n\
         settle = \"300ms\"\ninterval = \"100ms\"",
    ));
    let store = backend.open().await;
    let r = post(&gw.url("/v1/accounts/ac-7/orders"), "k5", ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!(r.status, 504, "{r:?}");
    let s = scope_for(PRINCIPAL, "account_order", "k5");
    let done =
        eventually(Duration::from_secs(20), || async { store.get(&s).await.unwrap().is_some_and(|(r, _)| r.state == State::Completed) })
            .await;
    assert!(done, "{}", gw.logs());
    let derived = s.derived_key(Some(TEST_SECRET.as_bytes()));
    let seen: Vec<String> = up.probes().into_iter().map(|(_, path, _)| path).collect();
    assert_eq!(seen, vec![format!("/v1/accounts/ac-7/orders/by-key/{derived}")]);
    let (rec, _) = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.response.unwrap().status, 200, "found_as defaults to the probe's own status");
    // The create_order route has no probe: nothing else was probed.
    assert_eq!(up.probes().len(), 1);
}

/// Async operations whose attempt timed out are settled the same way; the
/// probe is built from the stored request, and the operation completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_async_operation_is_completed_by_its_probe() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed("mode = \"async\"")));
    let store = backend.open().await;
    let r = post(&gw.url("/v1/orders"), "k6", ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!(r.status, 202, "{r:?}");
    let location = r.header("location").unwrap().to_owned();
    wait_state(&store, "k6", Some(State::Completed), &gw).await;
    let doc = send("GET", &gw.url(&location), &[("authorization", "Bearer test-key")], "").await.unwrap();
    assert_eq!(doc.json()["state"], "completed", "{doc:?}");
    let result = send("GET", &gw.url(&format!("{location}/result")), &[("authorization", "Bearer test-key")], "").await.unwrap();
    assert_eq!((result.status, result.replayed()), (201, true));
    assert_eq!(result.json()["key"], derived("k6"));
    assert_eq!(up.side_effects(&derived("k6")), 1);
    assert_eq!(store.audit(10).await.unwrap()[0].actor, "reconciler");
}

/// An async operation whose request never reached the upstream but timed out
/// (unknown): the probe finds it absent, and instead of deleting it (its
/// client polls the id) the operation goes back to the queue, runs again and
/// completes, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_async_operation_runs_again_under_its_id() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let proxy = FaultProxy::start(up.addr).await;
    let cfg = GatewayConfig::new(backend.clone(), format!("http://{}", proxy.addr())).timeout("500ms").route(&probed("mode = \"async\""));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    proxy.set(Fault::BlackholeUpstream);
    let r = post(&gw.url("/v1/orders"), "k7", ORDER, &[]).await;
    assert_eq!(r.status, 202, "{r:?}");
    let location = r.header("location").unwrap().to_owned();
    wait_state(&store, "k7", Some(State::Unknown), &gw).await;
    let first = settled_record(&store, "k7").await.unwrap();
    proxy.set(Fault::None);
    proxy.reset_all();
    wait_state(&store, "k7", Some(State::Completed), &gw).await;
    let done = settled_record(&store, "k7").await.unwrap();
    assert_eq!(done.operation_id, first.operation_id, "the same operation");
    assert!(done.generation > first.generation, "run again under a new generation");
    let trail = store.audit(10).await.unwrap();
    assert_eq!((trail[0].actor.as_str(), trail[0].from_state.as_str(), trail[0].to_state.as_str()), ("reconciler", "unknown", "queued"));
    let doc = send("GET", &gw.url(&location), &[("authorization", "Bearer test-key")], "").await.unwrap();
    assert_eq!(doc.json()["state"], "completed", "its client sees it finish: {doc:?}");
    assert_eq!(up.side_effects(&derived("k7")), 1);
}

/// Two replicas on one PostgreSQL, both probing: every record is probed once
/// and written once (one reconciler audit row per record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_never_probe_and_write_one_record_twice() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let cfg = GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed(""));
    let (a, b) = (Gateway::start(cfg.clone()), Gateway::start(cfg));
    let store = backend.open().await;
    let keys: Vec<String> = (0..20).map(|i| format!("race-{i}")).collect();
    let mut sends = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let url = if i % 2 == 0 { a.url("/v1/orders") } else { b.url("/v1/orders") };
        let k = k.clone();
        sends.push(tokio::spawn(async move { post(&url, &k, ORDER, &[("x-test-sleep-ms", "900")]).await }));
    }
    for s in sends {
        let r = s.await.unwrap();
        assert_eq!(r.status, 504, "{r:?}");
    }
    let all_done = eventually(Duration::from_secs(30), || async {
        let mut n = 0;
        for k in &keys {
            n += usize::from(state(&store, k).await == Some(State::Completed));
        }
        n == keys.len()
    })
    .await;
    assert!(all_done, "A:\n{}\nB:\n{}", a.logs(), b.logs());
    let trail = store.audit(1000).await.unwrap();
    let by_reconciler: Vec<_> = trail.iter().filter(|e| e.actor == "reconciler").collect();
    assert_eq!(by_reconciler.len(), keys.len(), "one reconciler row per record: {trail:?}");
    let scopes: std::collections::BTreeSet<&str> = by_reconciler.iter().map(|e| e.scope.key.as_str()).collect();
    assert_eq!(scopes.len(), keys.len());
    for k in &keys {
        assert_eq!(up.probes_of(&derived(k)), 1, "{k} was probed once");
        assert_eq!(up.side_effects(&derived(k)), 1);
    }
    let probed_by = |gw: &Gateway| gw.log_count("unknown record reconciled by its probe");
    assert_eq!(probed_by(&a) + probed_by(&b), keys.len());
}

/// `replay = "refetch"`: what the probe found is kept as the route keeps a
/// forwarded answer, the status and Location only; the retry reads the
/// resource again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refetch_route_keeps_only_status_and_location_of_what_the_probe_found() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route(&probed("replay = \"refetch\"")));
    let store = backend.open().await;
    let r = post(&gw.url("/v1/orders"), "k7", ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!(r.status, 504, "{r:?}");
    wait_state(&store, "k7", Some(State::Completed), &gw).await;
    let stored = settled_record(&store, "k7").await.unwrap().response.unwrap();
    assert_eq!((stored.status, stored.body), (201, None));
    assert_eq!(stored.headers, vec![("location".to_owned(), b"/v1/orders/1".to_vec())]);
    let again = post(&gw.url("/v1/orders"), "k7", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, true), "{again:?}");
    assert_eq!((again.json()["order"].as_u64(), again.json()["version"].as_u64()), (Some(1), Some(0)));
    assert_eq!(up.side_effects(&derived("k7")), 1);
}

/// An async route whose lease (1 s) is far shorter than its upstream's timeout
/// (6 s), and whose upstream commits only at the end of its work (its by-key
/// lookup answers 404 until then). Replica A sends the operation and is
/// frozen; replica B's reaper turns the record `unknown` one lease later,
/// while the upstream is still working. B must not probe it until the attempt
/// can no longer be at the upstream (sent + timeout + settle): a probe's 404
/// before then released the operation and B's worker sent it a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_waits_until_the_attempt_cannot_be_at_the_upstream() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_probe_status(Some(404));
    let cfg = || {
        GatewayConfig::new(backend.clone(), up.url())
            .timeout("6s")
            .route(
                "mode = \"async\"\nlease = \"1s\"\n[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{derived_key}\"\n\
                 found_as = 201\nsettle = \"500ms\"\ninterval = \"100ms\"",
            )
            .tail("[workers]\ncount = 1")
    };
    let a = Gateway::start(cfg());
    let store = backend.open().await;
    let mut received = up.subscribe();
    let r = post(&a.url("/v1/orders"), "slow", ORDER, &[("x-test-sleep-ms", "4000")]).await;
    assert_eq!(r.status, 202, "{r:?}");
    received.recv().await.unwrap();
    let sent = std::time::Instant::now();
    a.signal("STOP");
    let b = Gateway::start(cfg());
    wait_state(&store, "slow", Some(State::Unknown), &b).await;
    // The upstream finishes its work (4 s) and commits: from now on its
    // lookup finds the order.
    tokio::time::sleep(Duration::from_millis(4500).saturating_sub(sent.elapsed())).await;
    assert_eq!(up.total(), 1, "no second send while the first was at the upstream:\n{}", b.logs());
    up.set_probe_status(None);
    a.signal("CONT");
    wait_state(&store, "slow", Some(State::Completed), &b).await;
    let probes = up.probes();
    assert!(!probes.is_empty(), "completed by the probe");
    // Timeout and settle count from the `sent_at` the gateway commits before
    // the request leaves; `sent` is when this test heard of its arrival,
    // milliseconds later (more on a loaded machine: once 6.498 s were seen).
    // Half the settle as the margin still fails a probe that ignores the
    // settle, and one before the timeout.
    let first_probe = probes[0].2.duration_since(sent);
    assert!(first_probe >= Duration::from_millis(6500 - 250), "probed {first_probe:?} after the send: before timeout + settle");
    assert_eq!(up.total(), 1, "one execution");
    assert_eq!(up.side_effects(&derived("slow")), 1);
    let trail = store.audit(10).await.unwrap();
    assert_eq!((trail[0].actor.as_str(), trail[0].to_state.as_str()), ("reconciler", "completed"));
}
