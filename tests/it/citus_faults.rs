//! Faults of a Citus cluster under the real gateway (`kind = "citus"`, the
//! coordinator's URL) and a real upstream that counts side effects: a worker
//! stopped and restarted while requests are in flight, the coordinator
//! restarted while a request is at the upstream, a gateway replica killed
//! while its requests are at the upstream. Each test checks what the clients
//! got, the upstream's side effects per key and the records the store ends
//! with. docs/scaling.md ("When a node fails") says what each means for
//! clients; docs/faults.md lists them.
//!
//! Tenants are picked by where their shard lives (asked of the cluster), and
//! identified by the trusted headers the test gateways accept from loopback.
//! Each test steps aside, with one line on stderr, when Citus is not installed.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::{Duration, Instant};

use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::{Record, State};
use idemgate::store::Store;
use support::citus::{self, CitusCluster};
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// A cluster of its own (a coordinator and two workers) with database `db`
/// migrated, and `per_worker` tenants on each worker.
async fn cluster(db: &str, per_worker: usize) -> (CitusCluster, Backend, Store, Vec<Vec<String>>) {
    let cluster = tokio::task::block_in_place(|| CitusCluster::start(2)).expect("a Citus cluster of its own");
    eprintln!("cluster started in {:?}", cluster.startup_time());
    let url = tokio::task::block_in_place(|| cluster.create_database(db)).expect("database");
    let backend = Backend::Citus { url };
    let store = backend.open().await;
    let tenants = tokio::task::block_in_place(|| cluster.tenants_on_workers(db, per_worker)).expect("tenants on every worker");
    (cluster, backend, store, tenants)
}

fn scope_of(tenant: &str, key: &str) -> Scope {
    Scope { tenant: tenant.into(), principal: PRINCIPAL.into(), operation: "create_order".into(), key: IdempotencyKey::new(key).unwrap() }
}

/// The key the upstream sees for `key` of `tenant`.
fn derived_of(tenant: &str, key: &str) -> String {
    scope_of(tenant, key).derived_key(Some(TEST_SECRET.as_bytes()))
}

async fn record_of(store: &Store, tenant: &str, key: &str) -> Option<Record> {
    store.get(&scope_of(tenant, key)).await.expect("store get").map(|(r, _)| r)
}

/// POST an order for `key` as `tenant` (trusted headers), the upstream
/// working `sleep_ms`.
async fn order(url: &str, tenant: &str, key: &str, sleep_ms: u64) -> Result<Resp, String> {
    let sleep = sleep_ms.to_string();
    let headers = [
        ("x-tenant-id", tenant),
        ("x-principal-id", PRINCIPAL),
        ("content-type", "application/json"),
        ("idempotency-key", key),
        ("x-test-sleep-ms", sleep.as_str()),
    ];
    send("POST", url, &headers, ORDER).await
}

/// Retries `key` (as a client would after a 503 or a 409 in progress) until
/// a 2xx or a final problem; returns the last answer.
async fn retry_until_final(url: &str, tenant: &str, key: &str, within: Duration) -> Resp {
    let deadline = Instant::now() + within;
    loop {
        let r = order(url, tenant, key, 0).await;
        let again = match &r {
            Ok(r) => r.status == 503 || (r.status == 409 && r.problem() == "request-in-progress"),
            Err(_) => true,
        };
        if !again || Instant::now() > deadline {
            return r.unwrap_or_else(|e| panic!("{tenant}/{key}: {e}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `key`'s record is no longer `in_flight` (its result write
/// returned, or it turned unknown); returns it.
async fn settled(store: &Store, tenant: &str, key: &str, within: Duration) -> Option<Record> {
    let deadline = Instant::now() + within;
    loop {
        let r = record_of(store, tenant, key).await;
        if r.as_ref().is_none_or(|r| r.state != State::InFlight) || Instant::now() > deadline {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A worker stopped (immediate shutdown) while requests of tenants on both
/// workers are at the upstream, then started again:
/// - the in-flight requests are answered with the upstream's answer; the
///   dead worker's tenants' results are written once it is back (the
///   background retry of the result write, within the lease);
/// - while it is down, a claim of a tenant on it fails closed (503
///   `store-unavailable`, nothing forwarded, no record), and the tenants on
///   the other worker are served (201, forwarded once);
/// - after the restart a retry of every key ends completed (a replay, or the
///   first forward of a key refused during the outage), and every key reached
///   the upstream exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_stopped_mid_request_fails_its_tenants_closed_and_the_others_keep_serving() {
    if citus::skip_unless_installed() {
        return;
    }
    let (mut cluster, backend, store, on) = cluster("worker_down", 2).await;
    let (dead, alive) = (&on[0], &on[1]);
    let up = TestUpstream::start().await;
    // A result write that fails is retried in the background until the
    // lease would run out: a long one outlasts the worker's restart even on a
    // loaded machine (the test takes as long as the restart, not the lease).
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("lease = \"20s\""));
    let url = gw.url("/v1/orders");

    // One slow request per tenant at the upstream when the worker stops.
    let mut received = up.subscribe();
    let mut in_flight = Vec::new();
    for t in dead.iter().chain(alive) {
        let (u, t) = (url.clone(), t.clone());
        in_flight.push((t.clone(), tokio::spawn(async move { order(&u, &t, "in-flight", 800).await })));
    }
    for _ in 0..in_flight.len() {
        tokio::time::timeout(Duration::from_secs(10), received.recv()).await.expect("every request reaches the upstream").unwrap();
    }
    tokio::task::block_in_place(|| cluster.workers[0].stop_immediate()).expect("stop worker 1");
    let stopped = Instant::now();
    for (t, client) in in_flight {
        let r = client.await.unwrap().unwrap_or_else(|e| panic!("{t}: the in-flight request lost its answer: {e}"));
        assert_eq!((r.status, r.replayed()), (201, false), "{t}: the upstream's answer, whichever worker its record is on");
    }

    // While the worker is down: its tenants' claims fail closed, the others
    // are served.
    for t in dead {
        let r = order(&url, t, "during", 0).await.expect("an answer");
        assert_eq!(r.status, 503, "{t}: a claim on the stopped worker's shard must fail closed: {:?}", r.body);
        assert_eq!(r.problem(), "store-unavailable", "{t}");
        assert!(r.header("retry-after").is_some(), "{t}: told when to retry");
        assert_eq!(r.json()["retryable"], true);
        assert_eq!(up.side_effects(&derived_of(t, "during")), 0, "{t}: nothing forwarded without a claim");
    }
    for t in alive {
        let r = order(&url, t, "during", 0).await.expect("an answer");
        assert_eq!((r.status, r.replayed()), (201, false), "{t}: served while the other worker is down: {:?}", r.body);
        assert_eq!(up.side_effects(&derived_of(t, "during")), 1, "{t}");
        let rec = settled(&store, t, "during", Duration::from_secs(5)).await.expect("its record");
        assert_eq!(rec.state, State::Completed, "{t}");
    }
    eprintln!("worker 1 down for {:?}", stopped.elapsed());

    tokio::task::block_in_place(|| cluster.workers[0].start_again()).expect("start worker 1 again");
    for t in dead {
        assert!(record_of(&store, t, "during").await.is_none(), "{t}: the refused claim left no record");
    }
    // Every key, retried: completed, and at the upstream exactly once.
    for t in dead.iter().chain(alive) {
        for key in ["in-flight", "during"] {
            let r = retry_until_final(&url, t, key, Duration::from_secs(25)).await;
            assert_eq!(r.status, 201, "{t}/{key}: {:?}\n{}", r.body, gw.logs());
            let first_forward = dead.contains(t) && key == "during";
            assert_eq!(r.replayed(), !first_forward, "{t}/{key}: replayed unless it was refused before");
            let rec = settled(&store, t, key, Duration::from_secs(5)).await.expect("its record");
            assert_eq!(rec.state, State::Completed, "{t}/{key}");
            assert_eq!(up.side_effects(&derived_of(t, key)), 1, "{t}/{key}: exactly once at the upstream");
        }
    }
    assert_eq!(up.total(), 2 * (dead.len() + alive.len()) as u64);
}

/// The coordinator restarted (immediate) while a request is at the upstream:
/// the client has the upstream's answer, the record ends `completed` (its
/// result write retried once the coordinator is back) or `unknown` (never in
/// flight forever, never sent twice); a retry after the restart is replayed,
/// or told the outcome is unknown. One side effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_restarted_while_a_request_is_at_the_upstream_sends_it_once() {
    if citus::skip_unless_installed() {
        return;
    }
    let (mut cluster, backend, store, on) = cluster("coordinator_restart", 1).await;
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("lease = \"6s\""));
    let url = gw.url("/v1/orders");
    // A tenant on each worker: the result writes go to both.
    let tenants = [on[0][0].clone(), on[1][0].clone()];
    let mut received = up.subscribe();
    let mut clients = Vec::new();
    for t in &tenants {
        let (u, t) = (url.clone(), t.clone());
        clients.push(tokio::spawn(async move { order(&u, &t, "k", 1000).await }));
    }
    for _ in 0..clients.len() {
        tokio::time::timeout(Duration::from_secs(10), received.recv()).await.expect("at the upstream").unwrap();
    }
    tokio::task::block_in_place(|| cluster.coordinator.restart_immediate()).expect("restart the coordinator");
    let mut answers = Vec::new();
    for (t, client) in tenants.iter().zip(clients) {
        let r = client.await.unwrap().unwrap_or_else(|e| panic!("{t}: {e}"));
        assert_eq!((r.status, r.replayed()), (201, false), "{t}: the client has the upstream's answer");
        answers.push(r);
    }
    for (t, first) in tenants.iter().zip(&answers) {
        let rec = settled(&store, t, "k", Duration::from_secs(15)).await.expect("its record survived the restart");
        assert!(matches!(rec.state, State::Completed | State::Unknown), "{t}: {}\n{}", rec.state, gw.logs());
        let r = retry_until_final(&url, t, "k", Duration::from_secs(10)).await;
        match rec.state {
            State::Completed => {
                assert_eq!((r.status, r.replayed()), (201, true), "{t}: a replay");
                assert_eq!(r.body, first.body, "{t}: the answer the client had");
            }
            _ => assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "{t}"),
        }
        eprintln!("{t}: the record ended {}", rec.state);
        assert_eq!(up.side_effects(&derived_of(t, "k")), 1, "{t}: sent once");
    }
    assert_eq!(up.total(), 2);
}

/// Two replicas on the cluster; one is killed (-9) while its requests, of a
/// tenant on each worker, are at the (plain, non-deduplicating) upstream.
/// The survivor's lease reaper turns both records `unknown` once the lease
/// runs out (its sweep is an hour away: the reaper works across the shards
/// of both workers), and a retry through the survivor is told so instead of
/// sending them again. One side effect per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_at_the_upstream_leaves_unknown_records_the_survivor_never_resends() {
    if citus::skip_unless_installed() {
        return;
    }
    let (_cluster, backend, store, on) = cluster("replica_killed", 1).await;
    let up = TestUpstream::start().await;
    let cfg = || GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("lease = \"1s\"").sweep_interval("1h");
    let mut a = Gateway::start(cfg());
    let b = Gateway::start(cfg());
    let tenants = [on[0][0].clone(), on[1][0].clone()];
    let mut received = up.subscribe();
    let mut clients = Vec::new();
    for t in &tenants {
        let (u, t) = (a.url("/v1/orders"), t.clone());
        clients.push(tokio::spawn(async move { order(&u, &t, "orphan", 400).await }));
    }
    for _ in 0..clients.len() {
        tokio::time::timeout(Duration::from_secs(10), received.recv()).await.expect("at the upstream").unwrap();
    }
    tokio::task::block_in_place(|| a.kill9());
    let killed = Instant::now();
    for (t, client) in tenants.iter().zip(clients) {
        assert!(client.await.unwrap().is_err(), "{t}: the client lost its answer with its replica");
        assert_eq!(record_of(&store, t, "orphan").await.expect("the claim").state, State::InFlight, "{t}: killed mid-forward");
    }
    for t in &tenants {
        let turned =
            eventually(Duration::from_secs(10), || async { record_of(&store, t, "orphan").await.unwrap().state == State::Unknown }).await;
        let rec = record_of(&store, t, "orphan").await.unwrap();
        assert!(turned, "{t}: still {} {:?} after the kill:\n{}", rec.state, killed.elapsed(), b.logs());
        eprintln!("{t}: unknown {:?} after the kill", killed.elapsed());
    }
    let survivor = b.url("/v1/orders");
    for t in &tenants {
        let r = order(&survivor, t, "orphan", 0).await.expect("an answer");
        assert_eq!((r.status, r.problem().as_str()), (409, "outcome-unknown"), "{t}");
        assert_eq!(record_of(&store, t, "orphan").await.unwrap().state, State::Unknown, "{t}: a retry does not reopen it");
        assert_eq!(up.side_effects(&derived_of(t, "orphan")), 1, "{t}: never sent again");
    }
    assert_eq!(up.total(), 2);
}

/// The worker commits a claim and its connection from the coordinator then
/// breaks: the worker waited for a synchronous standby after committing
/// locally (`synchronous_standby_names` naming one that never comes) and its
/// backend was terminated. The coordinator reports the remote node's
/// failure as an error; for a write that is ambiguous, so the store reads
/// the row back, finds its own claim, and the request is forwarded once:
/// 201, not 503 "not forwarded" with an `in_flight` claim nobody forwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_committed_on_a_worker_whose_connection_then_broke_is_read_back_and_forwarded() {
    if citus::skip_unless_installed() {
        return;
    }
    let (cluster, backend, store, on) = cluster("remote_commit", 1).await;
    let tenant = on[0][0].clone();
    let worker = &cluster.workers[0];
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("lease = \"20s\""));
    let url = gw.url("/v1/orders");
    tokio::task::block_in_place(|| worker.set_and_reload("synchronous_standby_names", "nobody")).expect("wait for a standby");
    // The upstream works a second, so that the standby setting is gone
    // before the result is written.
    let client = {
        let (u, t) = (url.clone(), tenant.clone());
        tokio::spawn(async move { order(&u, &t, "k", 1000).await })
    };
    let waiting = "SELECT pid FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = tokio::task::block_in_place(|| worker.simple_query("postgres", waiting)).expect("pg_stat_activity");
        if !rows.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the claim never waited for the standby on the worker");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::task::block_in_place(|| {
        worker.simple_query("postgres", "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")?;
        worker.set_and_reload("synchronous_standby_names", "")
    })
    .expect("terminate the waiting backend");
    let r = client.await.unwrap().expect("an answer");
    assert_eq!((r.status, r.replayed()), (201, false), "the claim was committed: forwarded once: {:?}\n{}", r.body, gw.logs());
    assert_eq!(up.side_effects(&derived_of(&tenant, "k")), 1);
    let rec = settled(&store, &tenant, "k", Duration::from_secs(10)).await.expect("its record");
    assert_eq!(rec.state, State::Completed);
    let again = order(&url, &tenant, "k", 0).await.expect("an answer");
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(up.side_effects(&derived_of(&tenant, "k")), 1);
}

/// Gateways connected to different nodes at once (issue 47): one given the
/// coordinator, one each worker, one every node (its tenants' statements
/// sent to their shards' nodes). The same keys, of a tenant on each worker,
/// sent to all of them at once: each key reaches the upstream exactly once
/// (duplicates=0) and every one ends completed and replayed (lost=0). Then a
/// scope claimed in turn through each gateway (a route whose retention is
/// 1s), its record swept between claims: the upstream's
/// `X-Idempotency-Generation` for the scope only grows, whichever node drew it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_on_different_nodes_at_once_send_each_key_once_and_a_scopes_generations_only_grow() {
    if citus::skip_unless_installed() {
        return;
    }
    let (cluster, backend, store, on) = cluster("every_node", 1).await;
    let Backend::Citus { url } = &backend else { unreachable!("a Citus backend") };
    let db = url.rsplit('/').next().expect("database name");
    let up = TestUpstream::start().await;
    let brief = "\n[[routes]]\noperation = \"brief\"\nmethod = \"POST\"\npath = \"/v1/brief\"\nupstream = \"orders\"\nretention = \"1s\"\n";
    let urls = [url.clone(), cluster.workers[0].url(db), cluster.workers[1].url(db), cluster.every_node_url(url)];
    let gateways: Vec<Gateway> =
        urls.iter().map(|u| Gateway::start(GatewayConfig::new(Backend::Citus { url: u.clone() }, up.url()).tail(brief))).collect();
    let entries: Vec<String> = gateways.iter().map(|g| g.url("/v1/orders")).collect();
    let tenants = [on[0][0].clone(), on[1][0].clone()];

    // The same keys through every gateway at once, twice each.
    let keys: Vec<String> = (0..4).map(|i| format!("dup-{i}")).collect();
    let mut clients = Vec::new();
    for t in &tenants {
        for key in &keys {
            for entry in entries.iter().chain(&entries) {
                let (u, t, k) = (entry.clone(), t.clone(), key.clone());
                clients.push(tokio::spawn(async move { order(&u, &t, &k, 200).await }));
            }
        }
    }
    for client in clients {
        let r = client.await.unwrap().expect("an answer");
        assert!(
            r.status == 201
                || (r.status == 409 && r.problem() == "request-in-progress")
                || (r.status == 503 && r.problem() == "overloaded"),
            "a concurrent duplicate is forwarded, replayed, told it is in progress or refused unclaimed: {} {:?}",
            r.status,
            r.body
        );
    }
    let (mut duplicates, mut lost) = (0, 0);
    for t in &tenants {
        for key in &keys {
            for entry in &entries {
                let r = retry_until_final(entry, t, key, Duration::from_secs(10)).await;
                // A replay (or the first forward of a key every copy of which was refused unclaimed).
                assert_eq!(r.status, 201, "{t}/{key} at {entry}: {:?}", r.body);
            }
            assert_eq!(record_of(&store, t, key).await.map(|r| r.state), Some(State::Completed), "{t}/{key}");
            match up.side_effects(&derived_of(t, key)) {
                0 => lost += 1,
                1 => {}
                _ => duplicates += 1,
            }
        }
    }
    eprintln!("every node: keys={} duplicates={duplicates} lost={lost}", tenants.len() * keys.len());
    assert_eq!((duplicates, lost), (0, 0));

    // A scope claimed in turn through each gateway, swept between claims.
    let briefs: Vec<String> = gateways.iter().map(|g| g.url("/v1/brief")).collect();
    let scope = |t: &str| Scope { operation: "brief".into(), ..scope_of(t, "again") };
    let mut last: Vec<i64> = vec![0; tenants.len()];
    for (round, entry) in briefs.iter().chain(&briefs).enumerate() {
        for (i, t) in tenants.iter().enumerate() {
            let r = order(entry, t, "again", 0).await.expect("an answer");
            assert_eq!((r.status, r.replayed()), (201, false), "{t}, round {round}: a new life of the scope: {:?}", r.body);
            let seen: i64 = r.json()["generation"].as_str().and_then(|g| g.parse().ok()).expect("the upstream saw a generation");
            assert!(seen > last[i], "{t}, round {round} at {entry}: X-Idempotency-Generation {seen} after {}", last[i]);
            last[i] = seen;
            let derived = scope(t).derived_key(Some(TEST_SECRET.as_bytes()));
            assert_eq!(up.side_effects(&derived), round as u64 + 1, "{t}: one side effect per life");
        }
        for t in &tenants {
            let swept = eventually(Duration::from_secs(15), || async { store.get(&scope(t)).await.expect("store get").is_none() }).await;
            assert!(swept, "{t}, round {round}: the record was swept");
        }
    }
}
