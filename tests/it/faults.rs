//! Faults, injected for real: kill -9, SIGSTOP/SIGCONT, PostgreSQL stopped and
//! restarted, two replicas racing, the sweeper during a request, abusive
//! clients. Each test checks the record's final state, what the client got,
//! and the upstream's side-effect ledger. docs/faults.md is the matrix.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::idempotency::record::State;
use support::postgres::PgServer;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ORDER: &str = r#"{"item":"book","qty":1}"#;

fn private_pg() -> (PgServer, Backend) {
    let pg = PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database("faults").expect("create database");
    (pg, Backend::Postgres { url })
}

/// A private PostgreSQL with a fresh database, and a fault proxy in front of
/// it: (server, proxy, direct URL, URL through the proxy).
async fn pg_behind_proxy(db: &str) -> (PgServer, support::faultproxy::FaultProxy, String, String) {
    let pg = PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database(db).expect("create database");
    let proxy = support::faultproxy::FaultProxy::start(format!("127.0.0.1:{}", pg.port()).parse().unwrap()).await;
    let proxied = url.replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port()));
    (pg, proxy, url, proxied)
}

async fn metric(gw: &Gateway, name: &str) -> f64 {
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    let text = String::from_utf8_lossy(&m.body).into_owned();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())).sum()
}

/// Killed after forwarding, before recording: the upstream acted once; the
/// claim's lease expires and the record becomes `unknown`, never re-executed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_after_forward_before_record_ends_unknown() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    // Whichever comes first after the lease, the retry finding the expired
    // claim or the reaper woken at its expiry, it becomes unknown and is never
    // forwarded again. (The read-side expiry alone is the store conformance
    // case expire_lease_only_turns_expired_in_flight_into_unknown.)
    let mut gw =
        Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("lease = \"1s\"").sweep_interval("1h"));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let url = gw.url("/v1/orders");
    let u = url.clone();
    let client = tokio::spawn(async move {
        send(
            "POST",
            &u,
            &[
                ("authorization", "Bearer test-key"),
                ("content-type", "application/json"),
                ("idempotency-key", "k"),
                ("x-test-sleep-ms", "300"),
            ],
            ORDER,
        )
        .await
    });
    received.recv().await.unwrap();
    gw.kill9();
    assert!(client.await.unwrap().is_err(), "the client lost its answer");
    assert_eq!(record(&store, "k").await.unwrap().state, State::InFlight, "killed mid-forward: the claim stays");
    gw.restart();
    // Within the lease a retry is told to wait; after it, the outcome is unknown.
    let early = post(&url, "k", ORDER, &[]).await;
    assert_eq!(early.problem(), "request-in-progress");
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = post(&url, "k", ORDER, &[]).await;
    assert_eq!((late.status, late.problem().as_str()), (409, "outcome-unknown"));
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Unknown);
    assert_eq!(up.total(), 1, "never forwarded twice");
}

/// A replica killed mid-forward, and nobody retries: another replica turns
/// the abandoned claim `unknown` (so the backlog, alerts and the reconciler
/// see it) within moments of its lease's expiry, not at the next sweep
/// (`sweep_interval` is an hour here). Never forwarded again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replicas_claim_turns_unknown_when_its_lease_runs_out() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let cfg = || GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("lease = \"1s\"").sweep_interval("1h");
    let mut a = Gateway::start(cfg());
    let b = Gateway::start(cfg());
    let store = backend.open().await;
    let mut received = up.subscribe();
    let u = a.url("/v1/orders");
    let headers = [
        ("authorization", "Bearer test-key"),
        ("content-type", "application/json"),
        ("idempotency-key", "orphan"),
        ("x-test-sleep-ms", "300"),
    ];
    let client = tokio::spawn(async move { send("POST", &u, &headers, ORDER).await });
    received.recv().await.unwrap();
    a.kill9();
    let killed = std::time::Instant::now();
    assert!(client.await.unwrap().is_err(), "the client lost its answer");
    assert_eq!(record(&store, "orphan").await.unwrap().state, State::InFlight, "killed mid-forward: the claim stays");
    // Lease 1 s: unknown within about a second of its expiry (an hour before
    // the next sweep).
    let unknown = eventually(Duration::from_secs(10), || async { record(&store, "orphan").await.unwrap().state == State::Unknown }).await;
    assert!(unknown, "still {:?} {:?} after the kill:\n{}", record(&store, "orphan").await.unwrap().state, killed.elapsed(), b.logs());
    eprintln!("unknown {:?} after the kill", killed.elapsed());
    assert!(metric(&b, "idemgate_expired_leases_total").await >= 1.0, "the survivor's reaper turned it");
    assert_eq!(up.total(), 1, "never forwarded again");
}

/// Same crash on a route whose upstream honours Idempotency-Key: the retry
/// after the lease re-forwards with the same derived key and completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_on_idempotent_upstream_is_reforwarded_with_same_key() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let mut gw =
        Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("lease = \"1s\"\nupstream_idempotent = true"));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let url = gw.url("/v1/orders");
    let u = url.clone();
    let client = tokio::spawn(async move {
        send(
            "POST",
            &u,
            &[
                ("authorization", "Bearer test-key"),
                ("content-type", "application/json"),
                ("idempotency-key", "k"),
                ("x-test-sleep-ms", "300"),
            ],
            ORDER,
        )
        .await
    });
    received.recv().await.unwrap();
    gw.kill9();
    let _ = client.await;
    gw.restart();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let retry = post(&url, "k", ORDER, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    let reqs = up.requests();
    assert_eq!(reqs.len(), 2, "forwarded again");
    assert_eq!(reqs[0].key, reqs[1].key, "with the same derived key");
    let gens: Vec<i64> = reqs.iter().map(|r| r.generation.as_deref().unwrap().parse().unwrap()).collect();
    assert!(gens[1] > gens[0], "the take-over carries a larger generation: {gens:?}");
    assert_eq!(up.side_effects(&derived("k")), 1, "the upstream deduplicated: one side effect");
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!((rec.state, rec.generation.0), (State::Completed, gens[1]));
}

/// The store down when claiming: 503 store-unavailable, nothing forwarded,
/// nothing left behind; the gateway recovers when PostgreSQL is back, and a
/// restart of PostgreSQL mid-run needs no gateway restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_at_claim_then_restarted() {
    let (mut pg, backend) = private_pg();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "before", ORDER, &[]).await.status, 201);
    let written = backend.open().await;
    assert_eq!(settled_record(&written, "before").await.unwrap().state, State::Completed, "its result write returned");
    drop(written);

    pg.stop_immediate().unwrap();
    let r = post(&url, "k", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
    assert!(r.header("retry-after").is_some());
    assert_eq!(r.json()["retryable"], true);
    assert_eq!(send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status, 503);
    assert_eq!(up.total(), 1, "nothing forwarded without a committed claim");

    pg.start_again().unwrap();
    let store = backend.open().await;
    assert!(settled_record(&store, "k").await.is_none(), "the failed claim left nothing behind");
    let ok = eventually(Duration::from_secs(10), || {
        let u = url.clone();
        async move { post(&u, "k", ORDER, &[]).await.status == 201 }
    })
    .await;
    assert!(ok, "the gateway recovered without a restart:\n{}", gw.logs());
    assert_eq!(send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status, 200);
    assert_eq!(up.side_effects(&derived("k")), 1);
    assert!(post(&url, "before", ORDER, &[]).await.replayed(), "records survived the restart");

    // An immediate restart between requests: the pool replaces dead connections.
    pg.restart_immediate().unwrap();
    let ok = eventually(Duration::from_secs(10), || {
        let u = url.clone();
        async move { post(&u, "after-restart", ORDER, &[]).await.status == 201 }
    })
    .await;
    assert!(ok);
    assert_eq!(up.side_effects(&derived("after-restart")), 1);
}

/// PostgreSQL goes down while the upstream works on a claimed request and
/// comes back within the lease: the result write is retried in the background
/// and the record ends completed (not unknown); the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_during_the_result_write_is_recorded_when_it_returns() {
    let (mut pg, backend) = private_pg();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("lease = \"8s\""));
    let url = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let u = url.clone();
    let client = tokio::spawn(async move { post(&u, "k", ORDER, &[("x-test-sleep-ms", "400")]).await });
    received.recv().await.unwrap();
    pg.stop_immediate().unwrap();
    let r = client.await.unwrap();
    assert_eq!((r.status, r.replayed()), (201, false), "the client has the upstream's answer");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    pg.start_again().unwrap();
    let store = backend.open().await;
    let recorded =
        eventually(Duration::from_secs(10), || async { settled_record(&store, "k").await.is_some_and(|r| r.state == State::Completed) })
            .await;
    assert!(recorded, "recorded once the store came back: {:?}\n{}", settled_record(&store, "k").await, gw.logs());
    assert!(post(&url, "k", ORDER, &[]).await.replayed());
    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// Two replicas on one PostgreSQL, 20 concurrent requests with one key split
/// between them: exactly one forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_race_on_one_key() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let a = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let b = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let store = backend.open().await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let u = if i % 2 == 0 { a.url("/v1/orders") } else { b.url("/v1/orders") };
        tasks.push(tokio::spawn(async move { post(&u, "race", ORDER, &[("x-test-sleep-ms", "300")]).await }));
    }
    let mut forwarded = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match (r.status, r.replayed()) {
            (201, false) => forwarded += 1,
            (201, true) => {}
            (409, _) => assert_eq!(r.problem(), "request-in-progress"),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(forwarded, 1);
    assert_eq!(up.total(), 1);
    let rec = settled_record(&store, "race").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(up.requests()[0].generation, Some(rec.generation.to_string()), "the one attempt's generation holds the record");
    // Both replicas replay it afterwards.
    assert!(post(&a.url("/v1/orders"), "race", ORDER, &[]).await.replayed());
    assert!(post(&b.url("/v1/orders"), "race", ORDER, &[]).await.replayed());
}

/// A replica paused (SIGSTOP) past its lease while another takes the key over:
/// when it resumes, its stale result write is fenced off and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_replica_is_fenced_after_takeover() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let cfg = |b: &Backend| GatewayConfig::new(b.clone(), up.url()).timeout("500ms").route("lease = \"1s\"\nupstream_idempotent = true");
    let a = Gateway::start(cfg(&backend));
    let b = Gateway::start(cfg(&backend));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let ua = a.url("/v1/orders");
    let first = tokio::spawn(async move { post(&ua, "k", ORDER, &[("x-test-sleep-ms", "100")]).await });
    received.recv().await.unwrap();
    a.signal("STOP");
    tokio::time::sleep(Duration::from_millis(1300)).await; // A's lease runs out while it is frozen
    let taken = post(&b.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((taken.status, taken.replayed()), (201, false), "{taken:?}");
    let a_gen: i64 = up.requests()[0].generation.as_deref().unwrap().parse().unwrap();
    let b_gen: i64 = taken.json()["generation"].as_str().unwrap().parse().unwrap();
    assert!(b_gen > a_gen, "B took over with a larger generation");
    a.signal("CONT");
    let _ = first.await.unwrap(); // A answers its client whatever it is
    let fenced = eventually(Duration::from_secs(5), || {
        let a = &a;
        async move { metric(a, "idemgate_fenced_writes_total").await >= 1.0 }
    })
    .await;
    assert!(fenced, "A's stale write was fenced and counted:\n{}", a.logs());
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!((rec.state, rec.generation.0), (State::Completed, b_gen));
    let body: serde_json::Value = serde_json::from_slice(rec.response.unwrap().body.as_deref().unwrap()).unwrap();
    assert_eq!(body["generation"], b_gen.to_string(), "B's result survives; A did not overwrite it");
    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// The sweeper never deletes an in-flight record, even with the shortest retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeper_spares_in_flight_records() {
    for backend in [postgres_backend(), sqlite_backend()] {
        let up = TestUpstream::start().await;
        let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("retention = \"1s\""));
        let store = backend.open().await;
        let mut received = up.subscribe();
        let u = gw.url("/v1/orders");
        let client = tokio::spawn(async move { post(&u, "k", ORDER, &[("x-test-sleep-ms", "900")]).await });
        received.recv().await.unwrap();
        tokio::time::sleep(Duration::from_millis(700)).await; // several sweeps (every 200ms in tests)
        assert_eq!(record(&store, "k").await.map(|r| r.state), Some(State::InFlight), "{backend:?}");
        assert_eq!(client.await.unwrap().status, 201);
        let gone = eventually(Duration::from_secs(5), || {
            let s = store.clone();
            async move { record(&s, "k").await.is_none() }
        })
        .await;
        assert!(gone, "once completed with retention 1s it is swept");
        assert_eq!(up.total(), 1);
    }
}

/// Abusive clients are refused before any claim and the gateway stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abusive_clients_are_refused_before_claiming() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url())
            .server("max_request_body = \"32KiB\"\nrequest_header_timeout = \"500ms\"\nrequest_body_timeout = \"500ms\"")
            .route("max_stored_response = \"1KiB\""),
    );
    let store = backend.open().await;
    let url = gw.url("/v1/orders");

    // Slowloris: headers trickle in and never finish.
    let mut slow = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /v1/orders HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the server cut the slow client off");

    // A body that stalls after the headers: 408, nothing claimed.
    let mut stall = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    stall
        .write_all(b"POST /v1/orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-key\r\nidempotency-key: stall\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"a\":")
        .await
        .unwrap();
    let mut resp = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), stall.read(&mut resp)).await.unwrap().unwrap();
    let head = String::from_utf8_lossy(&resp[..n]);
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");

    // 10,000 levels (20 KB, within the 32 KiB limit): parsed and refused, no stack overflow.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    let r = post(&url, "deep", &deep, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));
    let deep_objects = format!("{}1{}", "{\"a\":".repeat(5_000), "}".repeat(5_000));
    let r = post(&url, "deep-objects", &deep_objects, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-body"));
    let key = "k".repeat(10 * 1024);
    let r = post(&url, &key, ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-idempotency-key"));
    let big = format!("{{\"pad\":\"{}\"}}", "x".repeat(64 * 1024));
    let r = post(&url, "big", &big, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (413, "request-too-large"));

    let all = store.list(&idemgate::store::ListFilter { limit: 10, ..Default::default() }).await.unwrap();
    assert!(all.is_empty(), "nothing was claimed: {all:?}");
    assert_eq!(up.total(), 0);

    // Oversized response: delivered, recorded without body, never re-executed.
    let r = post(&url, "resp", ORDER, &[("x-test-body-bytes", "100000")]).await;
    assert_eq!((r.status, r.body.len()), (201, 100_000));
    assert_eq!(post(&url, "resp", ORDER, &[]).await.problem(), "response-not-stored");
    // Still healthy.
    assert_eq!(send("GET", &gw.admin_url("/healthz"), &[], "").await.unwrap().status, 200);
    assert_eq!(post(&url, "fine", ORDER, &[]).await.status, 201);
    assert_eq!(up.total(), 2);
}

/// The PostgreSQL reply to the claim is lost (the statement committed): the
/// gateway reads the row back on a new connection, finds its claim_token, and
/// goes on — one forward, one record, no 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_reply_lost_is_resolved_by_claim_token() {
    let (_pg, proxy, url, proxied) = pg_behind_proxy("claimlost").await;
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).sweep_interval("1h"));
    let store = Backend::Postgres { url }.open().await;
    let target = gw.url("/v1/orders");
    assert_eq!(post(&target, "warm", ORDER, &[]).await.status, 201);
    assert_eq!(settled_record(&store, "warm").await.unwrap().state, State::Completed, "warm's result write returned");
    let broken = proxy.blackhole_existing_downstream();
    assert!(broken > 0, "the pool had open connections to break");
    let r = post(&target, "k", ORDER, &[]).await;
    assert_eq!((r.status, r.replayed()), (201, false), "{r:?}\n{}", gw.logs());
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(up.requests()[1].generation, Some(rec.generation.to_string()), "recorded under the claim that was read back");
    assert_eq!(up.side_effects(&derived("k")), 1);
    assert!(gw.log_count("reading the row back") >= 1, "the read-back path ran:\n{}", gw.logs());
    assert!(post(&target, "k", ORDER, &[]).await.replayed());
    assert_eq!(up.total(), 2);
}

/// The gateway learns of its claim only after the claim's lease may have run
/// out: the claim's statement takes 800 ms after it read the clock its lease
/// starts from (a trigger sleeps in it, as a commit waiting for a slow
/// synchronous standby does), lease 600 ms; this stands in for a process
/// stopped between its claim and its send. By then a reaper, a probe or a
/// take-over may have acted on the record, so it sends nothing: 503 not
/// forwarded, the key released, the upstream untouched. (The check right
/// after the claim refuses it; the exchange's deadline, never past the
/// claim's start plus its lease, covers a stop after that check.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_learned_after_its_lease_could_have_run_out_is_never_sent() {
    let (_pg, _proxy, url, proxied) = pg_behind_proxy("latelearned").await;
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).timeout("100ms").route("lease = \"600ms\"");
    let gw = Gateway::start(config.sweep_interval("1h"));
    let store = Backend::Postgres { url: url.clone() }.open().await;
    let target = gw.url("/v1/orders");
    assert_eq!(post(&target, "warm", ORDER, &[]).await.status, 201);
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    db.batch_execute(
        "CREATE FUNCTION slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.8); RETURN NEW; END $$;
         CREATE TRIGGER slow_claim BEFORE INSERT ON idemgate_records FOR EACH ROW EXECUTE FUNCTION slow_claim();",
    )
    .await
    .expect("a slow claim");
    let r = post(&target, "late", ORDER, &[]).await;
    db.batch_execute("DROP TRIGGER slow_claim ON idemgate_records").await.expect("drop the trigger");
    // Refused as soon as the claim returns (what is left of the lease cannot
    // cover the upstream's timeout); the exchange's own deadline, the claim's
    // start plus the lease, would refuse it too if the process stopped after
    // that check.
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"), "{r:?}\n{}", gw.logs());
    assert_eq!(up.side_effects(&derived("late")), 0, "nothing sent once the lease may have run out");
    assert_eq!(settled_record(&store, "late").await.map(|r| r.state), None, "released");
    let again = post(&target, "late", ORDER, &[]).await;
    assert_eq!((again.status, again.replayed()), (201, false));
    assert_eq!(up.side_effects(&derived("late")), 1);
}

/// The PostgreSQL reply to the result write is lost: the read-back sees the
/// write under our generation; the retry replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_reply_lost_is_resolved_by_read_back() {
    let (_pg, proxy, url, proxied) = pg_behind_proxy("resultlost").await;
    let up = TestUpstream::start().await;
    // No background tasks during the test: they would take the broken connections first.
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).sweep_interval("1h"));
    let store = Backend::Postgres { url }.open().await;
    let target = gw.url("/v1/orders");
    let mut received = up.subscribe();
    let t = target.clone();
    let client = tokio::spawn(async move { post(&t, "k", ORDER, &[("x-test-sleep-ms", "300")]).await });
    received.recv().await.unwrap();
    // The claim is committed and the upstream is working: break the replies
    // on every open connection, so the result's commit reply is lost.
    proxy.blackhole_existing_downstream();
    let r = client.await.unwrap();
    assert_eq!((r.status, r.replayed()), (201, false), "{r:?}");
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!(rec.state, State::Completed, "{}", gw.logs());
    assert_eq!(up.requests().last().unwrap().generation, Some(rec.generation.to_string()));
    assert!(gw.log_count("write failed; reading the row back") >= 1, "the read-back path ran:\n{}", gw.logs());
    let again = post(&target, "k", ORDER, &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, r.body);
    assert_eq!(up.total(), 1);
}

/// Network faults between the gateway and the upstream: a refused connection
/// releases the key; a response cut off mid-body or delayed past the timeout
/// is an unknown outcome with one side effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_network_faults() {
    use support::faultproxy::{Fault, FaultProxy};
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let proxy = FaultProxy::start(up.addr).await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{}", proxy.addr())).timeout("500ms"));
    let store = backend.open().await;
    let target = gw.url("/v1/orders");

    proxy.set(Fault::Refuse);
    proxy.reset_all();
    let r = post(&target, "refused", ORDER, &[]).await;
    // A reset right after connecting can also look like a broken exchange to
    // the client library; either way nothing reached the upstream.
    assert_eq!(up.total(), 0);
    match r.problem().as_str() {
        "upstream-unavailable" => assert!(settled_record(&store, "refused").await.is_none()),
        "outcome-unknown" => assert_eq!(settled_record(&store, "refused").await.unwrap().state, State::Unknown),
        other => panic!("unexpected {other}"),
    }

    proxy.set(Fault::CloseAfter { bytes_down: 40 });
    let r = post(&target, "cut", ORDER, &[("x-test-body-bytes", "5000")]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"));
    assert_eq!(settled_record(&store, "cut").await.unwrap().state, State::Unknown);
    assert_eq!(
        up.side_effects(&derived("cut")),
        1,
        "ledger {:?} requests {:?}",
        up.ledger(),
        up.requests().iter().map(|r| r.key.clone()).collect::<Vec<_>>()
    );

    proxy.set(Fault::Delay(Duration::from_millis(800)));
    let r = post(&target, "late", ORDER, &[]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"));
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(settled_record(&store, "late").await.unwrap().state, State::Unknown);
    // The delayed request reaches the upstream after the gateway gave up and
    // closed; whether the upstream still acts on it is its business: at most once.
    assert!(up.side_effects(&derived("late")) <= 1);

    proxy.set(Fault::None);
    assert_eq!(post(&target, "fine", ORDER, &[]).await.status, 201);
    for key in ["cut", "late"] {
        assert_eq!(post(&target, key, ORDER, &[]).await.problem(), "outcome-unknown");
    }
    assert!(up.total() <= 3, "no retry re-executed anything");
    assert!(up.ledger().values().all(|n| *n == 1));
}

/// The first request is answered as soon as the upstream's response is read;
/// its result is written right after. While that write waits (the test holds
/// the record's row lock): the client already has its answer and the record
/// is still `in_flight`; a retry on another replica is told the request is in
/// progress (409, Retry-After); a retry on the replica that answered waits
/// for the write and is replayed the same answer. The upstream acted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_before_its_result_is_written_then_replayed() {
    let pg = PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database("early").expect("create database");
    let up = TestUpstream::start().await;
    let a = Gateway::start(GatewayConfig::new(Backend::Postgres { url: url.clone() }, up.url()).timeout("5s").sweep_interval("1h"));
    let b = Gateway::start(GatewayConfig::new(Backend::Postgres { url: url.clone() }, up.url()).timeout("5s").sweep_interval("1h"));
    let store = Backend::Postgres { url: url.clone() }.open().await;
    let (mut locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    let mut received = up.subscribe();
    let ua = a.url("/v1/orders");
    let first = tokio::spawn(async move { post(&ua, "k", ORDER, &[("x-test-sleep-ms", "300")]).await });
    // The claim is committed (the upstream has the request): hold the row so
    // that the result write waits.
    received.recv().await.unwrap();
    let lock = locker.transaction().await.unwrap();
    let held = lock.query("SELECT 1 FROM idemgate_records WHERE idempotency_key = 'k' FOR UPDATE", &[]).await.unwrap();
    assert_eq!(held.len(), 1, "the claim is there");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    assert_eq!(record(&store, "k").await.unwrap().state, State::InFlight, "the answer left before the result was written");
    let elsewhere = post(&b.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((elsewhere.status, elsewhere.problem().as_str()), (409, "request-in-progress"), "{elsewhere:?}");
    assert!(elsewhere.header("retry-after").is_some());
    let ua = a.url("/v1/orders");
    let again = tokio::spawn(async move { post(&ua, "k", ORDER, &[]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!again.is_finished(), "the retry on A waits for A's result write");
    lock.commit().await.unwrap();
    let again = again.await.unwrap();
    assert_eq!((again.status, again.replayed()), (201, true), "the replica that answered replays its answer: {again:?}");
    assert_eq!(again.body, first.body);
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(rec.response.unwrap().body.as_deref(), Some(&first.body[..]));
    let later = post(&b.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((later.status, later.replayed(), later.body.clone()), (201, true, first.body.clone()));
    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// Killed after answering its client but before the result write reached
/// PostgreSQL: the client has its answer; the record keeps the claim, and
/// when the lease runs out the outcome is `unknown` (never forwarded again),
/// exactly as for a replica killed before it could answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_answering_before_the_result_is_written_ends_unknown() {
    use support::faultproxy::Fault;
    let (_pg, path, url, proxied) = pg_behind_proxy("answered").await;
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(
        GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).timeout("500ms").route("lease = \"1s\"").sweep_interval("1h"),
    );
    let store = Backend::Postgres { url }.open().await;
    let mut received = up.subscribe();
    let target = gw.url("/v1/orders");
    let t = target.clone();
    let first = tokio::spawn(async move { post(&t, "k", ORDER, &[("x-test-sleep-ms", "200")]).await });
    received.recv().await.unwrap();
    // The result write never arrives.
    path.set(Fault::BlackholeUpstream);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    gw.kill9();
    assert_eq!(record(&store, "k").await.unwrap().state, State::InFlight);
    path.set(Fault::None);
    gw.restart();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let late = post(&target, "k", ORDER, &[]).await;
    assert_eq!((late.status, late.problem().as_str()), (409, "outcome-unknown"), "{late:?}");
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Unknown);
    assert_eq!(up.total(), 1, "never forwarded twice");
}

/// A result write that reaches PostgreSQL only after the lease expired and
/// another replica took the key over and recorded its own result: the
/// generation fence drops it, the read-back counts it as fenced, and the
/// newer result stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_result_write_after_takeover_is_fenced() {
    use support::faultproxy::Fault;
    let (_pg, slow_path, url, proxied) = pg_behind_proxy("late").await;
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let route = "lease = \"1s\"\nupstream_idempotent = true";
    // A reaches PostgreSQL through the fault proxy; B directly.
    let a =
        Gateway::start(GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).timeout("500ms").sweep_interval("1h").route(route));
    let b = Gateway::start(
        GatewayConfig::new(Backend::Postgres { url: url.clone() }, up.url()).timeout("500ms").sweep_interval("1h").route(route),
    );
    let store = Backend::Postgres { url }.open().await;
    let mut received = up.subscribe();
    let ua = a.url("/v1/orders");
    let first = tokio::spawn(async move { post(&ua, "k", ORDER, &[("x-test-sleep-ms", "50")]).await });
    received.recv().await.unwrap();
    // A's result write will sit in the network for 2.5 s: past its lease
    // (1 s) and past B's take-over and completion.
    slow_path.set(Fault::Delay(Duration::from_millis(2500)));
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let taken = post(&b.url("/v1/orders"), "k", ORDER, &[]).await;
    assert_eq!((taken.status, taken.replayed()), (201, false), "{taken:?}");
    let a_gen: i64 = up.requests()[0].generation.as_deref().unwrap().parse().unwrap();
    let b_gen: i64 = taken.json()["generation"].as_str().unwrap().parse().unwrap();
    assert!(b_gen > a_gen, "B took over with a larger generation");
    // Let the delayed statement arrive and be judged, then heal the path so
    // A's read-back can learn what happened (A answers its client after that).
    tokio::time::sleep(Duration::from_millis(2000)).await;
    slow_path.set(Fault::None);
    let _ = first.await.unwrap();
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!((rec.state, rec.generation.0), (State::Completed, b_gen));
    let body: serde_json::Value = serde_json::from_slice(rec.response.unwrap().body.as_deref().unwrap()).unwrap();
    assert_eq!(body["generation"], b_gen.to_string(), "the late write of A's generation did not overwrite B's result");
    let fenced = eventually(Duration::from_secs(10), || {
        let a = &a;
        async move { metric(a, "idemgate_fenced_writes_total").await >= 1.0 }
    })
    .await;
    assert!(fenced, "A counted its fenced write:\n{}", a.logs());
    // The request itself counts as fenced once its write returned, not as forwarded.
    let counted = eventually(Duration::from_secs(5), || {
        let a = &a;
        async move { metric(a, r#"idemgate_requests_total{operation="create_order",outcome="fenced"}"#).await == 1.0 }
    })
    .await;
    assert!(counted, "A counted its request as fenced:\n{}", a.logs());
    assert_eq!(metric(&a, r#"idemgate_requests_total{operation="create_order",outcome="forwarded"}"#).await, 0.0);

    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// Killed while the claim is on its way to PostgreSQL (it never arrives):
/// nothing is left behind and the retry is processed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_before_the_claim_commits_leaves_nothing() {
    use support::faultproxy::Fault;
    let (_pg, proxy, url, proxied) = pg_behind_proxy("precommit").await;
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).sweep_interval("1h"));
    let store = Backend::Postgres { url }.open().await;
    let target = gw.url("/v1/orders");
    proxy.set(Fault::BlackholeUpstream);
    let t = target.clone();
    let client = tokio::spawn(async move {
        send("POST", &t, &[("authorization", "Bearer test-key"), ("content-type", "application/json"), ("idempotency-key", "k")], ORDER)
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await; // the claim is stuck in the network
    gw.kill9();
    assert!(client.await.unwrap().is_err());
    proxy.set(Fault::None);
    proxy.reset_all();
    assert!(settled_record(&store, "k").await.is_none(), "nothing was claimed");
    gw.restart();
    let r = post(&target, "k", ORDER, &[]).await;
    assert_eq!((r.status, r.replayed()), (201, false));
    assert_eq!(up.total(), 1);
    let rec = settled_record(&store, "k").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(up.requests()[0].generation, Some(rec.generation.to_string()));
}

/// Killed after the claim committed but before the request reached the
/// upstream (it is stuck in the network): the gateway cannot know that, so
/// the lease expires into `unknown` — never a blind second forward. The
/// upstream acted zero times; an operator may release the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_after_claim_before_forward_ends_unknown() {
    use support::faultproxy::{Fault, FaultProxy};
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let proxy = FaultProxy::start(up.addr).await;
    let mut gw =
        Gateway::start(GatewayConfig::new(backend.clone(), format!("http://{}", proxy.addr())).timeout("500ms").route("lease = \"1s\""));
    let store = backend.open().await;
    let target = gw.url("/v1/orders");
    proxy.set(Fault::BlackholeUpstream);
    let t = target.clone();
    let client = tokio::spawn(async move {
        send("POST", &t, &[("authorization", "Bearer test-key"), ("content-type", "application/json"), ("idempotency-key", "k")], ORDER)
            .await
    });
    let claimed = eventually(Duration::from_secs(5), || {
        let s = store.clone();
        async move { record(&s, "k").await.is_some() }
    })
    .await;
    assert!(claimed);
    gw.kill9();
    let _ = client.await;
    proxy.set(Fault::None);
    proxy.reset_all();
    gw.restart();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(post(&target, "k", ORDER, &[]).await.problem(), "outcome-unknown");
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Unknown);
    assert_eq!(up.total(), 0, "the request never reached the upstream");
    let (code, _, err) = cli_keys(&gw, "resolve", "k", &["--release", "--reason", "never reached the upstream"]);
    assert_eq!(code, 0, "{err}");
    // A client retries a 503 (nothing claimed, or the key released again):
    // in a loaded full run the first try once got one. Whatever it was, the
    // upstream acts exactly once.
    let mut r = post(&target, "k", ORDER, &[]).await;
    for _ in 0..3 {
        if r.status != 503 {
            break;
        }
        eprintln!("retrying after 503 {}: {}", r.problem(), String::from_utf8_lossy(&r.body));
        tokio::time::sleep(Duration::from_millis(500)).await;
        r = post(&target, "k", ORDER, &[]).await;
    }
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(up.total(), 1);
}

/// The client goes away while its claim is being committed (the database is
/// slow): the claim, the forward and the recording still happen, so the
/// retry is a replay rather than a stuck claim that would turn `unknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_during_claim_still_forwards_and_records() {
    use support::faultproxy::Fault;
    use tokio::io::AsyncWriteExt;
    let (_pg, proxy, url, proxied) = pg_behind_proxy("gone").await;
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).sweep_interval("1h"));
    let store = Backend::Postgres { url }.open().await;
    assert_eq!(post(&gw.url("/v1/orders"), "warm", ORDER, &[]).await.status, 201);
    proxy.set(Fault::Delay(Duration::from_millis(400)));
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = format!(
        "POST /v1/orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-key\r\nidempotency-key: gone\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{ORDER}",
        ORDER.len()
    );
    sock.write_all(req.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await; // the claim is on its way
    drop(sock);
    proxy.set(Fault::None);
    let done = eventually(Duration::from_secs(10), || {
        let s = store.clone();
        async move { record(&s, "gone").await.is_some_and(|r| r.state == State::Completed) }
    })
    .await;
    assert!(done, "the request was forwarded and recorded after the client left:\n{}", gw.logs());
    assert_eq!(up.side_effects(&derived("gone")), 1);
    assert!(post(&gw.url("/v1/orders"), "gone", ORDER, &[]).await.replayed());
}

/// An upstream that sends its headers and part of a body, then stalls: the
/// pass-through response is cut off after the upstream's timeout without
/// progress instead of holding the client's connection forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_upstream_body_is_cut_off() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stall = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 4096];
        let _ = sock.read(&mut buf).await;
        sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789").await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(sock);
    });
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), format!("http://{addr}")).timeout("500ms"));
    let started = std::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(10), send("GET", &gw.url("/v1/orders"), &[], "")).await;
    let r = r.expect("the client was not left hanging");
    assert!(r.is_err(), "the truncated body ends in an error, not a short success: {r:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "cut off after the idle timeout, took {:?}", started.elapsed());
    assert_eq!(send("GET", &gw.admin_url("/healthz"), &[], "").await.unwrap().status, 200);
    stall.abort();
}
