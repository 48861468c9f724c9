//! Async mode under faults, with the real binary: a worker killed mid-forward
//! (re-run by another replica with the same derived key and a higher
//! generation on a deduplicating upstream; `unknown` with one execution
//! otherwise), a worker paused past its lease (its late result dropped and
//! counted), PostgreSQL restarted with operations queued, and every replica
//! killed with operations queued (all finish after the restart). Each test
//! checks the final records and the upstream's side-effect ledger.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

mod support;

use std::time::Duration;

use idemgate::idempotency::record::State;
use support::postgres::PgServer;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// An async route with a short lease (heartbeats every ~330 ms) and one worker.
fn async_config(backend: &Backend, upstream: &TestUpstream, idempotent: bool, workers: usize) -> GatewayConfig {
    GatewayConfig::new(backend.clone(), upstream.url())
        .timeout("5s")
        .route(&format!("mode = \"async\"\nlease = \"1s\"\nupstream_idempotent = {idempotent}\nretry.backoff = \"50ms\""))
        .tail(&format!("[workers]\ncount = {workers}"))
}

async fn metric(gw: &Gateway, name: &str) -> f64 {
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    let text = String::from_utf8_lossy(&m.body).into_owned();
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())).sum()
}

async fn state_of(store: &idemgate::store::Store, key: &str) -> Option<State> {
    record(store, key).await.map(|r| r.state)
}

/// Waits until the record of `key` is in a final state; returns it.
async fn wait_final(store: &idemgate::store::Store, key: &str, within: Duration) -> idemgate::idempotency::record::Record {
    let done = eventually(within, || async {
        matches!(state_of(store, key).await, Some(State::Completed | State::Unknown | State::FailedRetryable))
    })
    .await;
    let rec = record(store, key).await.expect("record");
    assert!(done, "{key} did not reach a final state: {rec:?}");
    rec
}

fn generation(r: &support::upstream::Received) -> i64 {
    r.generation.as_deref().expect("a generation").parse().expect("numeric")
}

/// A worker killed -9 while its request is with a deduplicating upstream:
/// after the lease runs out another replica runs the operation again, with
/// the same derived key and a higher generation; the upstream acts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_is_taken_over_on_a_deduplicating_upstream() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let mut a = Gateway::start(async_config(&backend, &up, true, 1));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "k", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.kill9();
    let b = Gateway::start(async_config(&backend, &up, true, 1));
    let rec = wait_final(&store, "k", Duration::from_secs(15)).await;
    assert_eq!(rec.state, State::Completed, "{}", b.logs());
    let reqs = up.requests();
    assert_eq!(reqs.len(), 2, "run again once");
    assert_eq!((reqs[0].key.as_str(), reqs[1].key.as_str()), (derived("k").as_str(), derived("k").as_str()), "the same derived key");
    assert!(generation(&reqs[1]) > generation(&reqs[0]), "a higher generation");
    assert_eq!(rec.generation.0, generation(&reqs[1]));
    assert_eq!(up.side_effects(&derived("k")), 1, "the upstream acted once");
    assert_eq!(rec.attempts, 2);
    assert!(metric(&b, "idemgate_requeued_leases_total").await >= 1.0);
}

/// The same kill on an upstream that does not deduplicate: the request was
/// sent, so the operation becomes `unknown`; it is never run twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_on_a_plain_upstream_ends_unknown_with_one_execution() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let mut a = Gateway::start(async_config(&backend, &up, false, 1));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "k", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.kill9();
    let b = Gateway::start(async_config(&backend, &up, false, 1));
    let rec = wait_final(&store, "k", Duration::from_secs(15)).await;
    assert_eq!(rec.state, State::Unknown, "{}", b.logs());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(up.total(), 1, "never run again");
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Unknown);
    let doc = send("GET", &b.url(accepted.header("location").unwrap()), &[("authorization", "Bearer test-key")], "").await.unwrap();
    assert_eq!(doc.json()["state"], "unknown", "the client can tell unknown apart");
}

/// A worker frozen (SIGSTOP) past its lease while another replica takes the
/// operation over: when it resumes, its heartbeat and its late result are
/// fenced off, the newer attempt's result stays, and the loss is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_worker_is_fenced_after_a_take_over() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let a = Gateway::start(async_config(&backend, &up, true, 1));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "k", ORDER, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.signal("STOP");
    let b = Gateway::start(async_config(&backend, &up, true, 1));
    let rec = wait_final(&store, "k", Duration::from_secs(15)).await;
    assert_eq!(rec.state, State::Completed, "{}", b.logs());
    let b_gen = rec.generation;
    a.signal("CONT");
    // A wakes up with its own (deduplicated) answer on the way: everything it
    // writes is fenced off, and it counts the lost lease.
    let lost = eventually(Duration::from_secs(10), || async {
        metric(&a, "idemgate_async_attempts_total{operation=\"create_order\",outcome=\"lost_lease\"}").await >= 1.0
    })
    .await;
    assert!(lost, "A counted its lost lease:\n{}", a.logs());
    let after = settled_record(&store, "k").await.unwrap();
    assert_eq!((after.state, after.generation), (State::Completed, b_gen), "B's result survives");
    let body: serde_json::Value = serde_json::from_slice(after.response.unwrap().body.as_deref().unwrap()).unwrap();
    assert_eq!(body["generation"], b_gen.to_string());
    assert_eq!(up.side_effects(&derived("k")), 1);
}

/// PostgreSQL restarted while operations wait in the queue: nothing queued
/// is lost; every operation runs once when workers can reach it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_with_operations_queued_loses_nothing() {
    let mut pg = PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database("asyncrestart").expect("database");
    let backend = Backend::Postgres { url };
    let up = TestUpstream::start().await;
    let front = Gateway::start(async_config(&backend, &up, false, 0));
    let keys: Vec<String> = (0..5).map(|i| format!("q{i}")).collect();
    for k in &keys {
        assert_eq!(post(&front.url("/v1/orders"), k, ORDER, &[]).await.status, 202);
    }
    pg.restart_immediate().expect("restart PostgreSQL");
    let worker = Gateway::start(async_config(&backend, &up, false, 1));
    let store = backend.open().await;
    for k in &keys {
        let rec = wait_final(&store, k, Duration::from_secs(20)).await;
        assert_eq!(rec.state, State::Completed, "{k}: {}", worker.logs());
        assert_eq!(up.side_effects(&derived(k)), 1, "{k}");
    }
    assert_eq!(up.total(), 5);
    drop(front);
}

/// Every replica killed -9 with operations queued and one in flight; after a
/// restart all of them finish (on SQLite: the same replica, on PostgreSQL:
/// two new ones), each executed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_replicas_killed_with_operations_queued_then_restarted_finish_everything() {
    for backend in [sqlite_backend(), postgres_backend()] {
        let up = TestUpstream::start().await;
        up.set_dedupe(true);
        let mut a = Gateway::start(async_config(&backend, &up, true, 1));
        let mut b = match backend {
            Backend::Postgres { .. } | Backend::Citus { .. } | Backend::Pooled { .. } => {
                Some(Gateway::start(async_config(&backend, &up, true, 1)))
            }
            Backend::Sqlite { .. } => None,
        };
        let keys: Vec<String> = (0..6).map(|i| format!("op{i}")).collect();
        for k in &keys {
            assert_eq!(post(&a.url("/v1/orders"), k, ORDER, &[("x-test-sleep-ms", "400")]).await.status, 202);
        }
        let mut received = up.subscribe();
        received.recv().await.unwrap();
        a.kill9();
        if let Some(b) = b.as_mut() {
            b.kill9();
        }
        let store = backend.open().await;
        let left = keys.iter().filter(|k| up.side_effects(&derived(k)) == 0).count();
        assert!(left > 0, "operations were still queued at the kill");
        a.restart();
        if let Some(b) = b.as_mut() {
            b.restart();
        }
        for k in &keys {
            let rec = wait_final(&store, k, Duration::from_secs(30)).await;
            assert_eq!(rec.state, State::Completed, "{k} on {backend:?}: {}", a.logs());
            assert_eq!(up.side_effects(&derived(k)), 1, "{k} executed once");
        }
    }
}

/// A heartbeat that runs just after its own attempt's final write (here made
/// to wait on the row while the completion commits slowly) finds the record
/// completed. That is not a lost lease: the attempt's write landed, so it
/// counts as completed and nothing says "records nothing".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_after_its_own_final_write_is_not_a_lost_lease() {
    let backend = postgres_backend();
    let Backend::Postgres { url } = &backend else { unreachable!() };
    let up = TestUpstream::start().await;
    let gw = Gateway::start(async_config(&backend, &up, false, 2));
    let store = backend.open().await;
    // Completions commit 600 ms after they start; heartbeats (every ~330 ms)
    // wait on the row meanwhile and run right after the commit.
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    db.batch_execute(
        "CREATE FUNCTION idemgate_test_slow_completion() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.state = 'completed' AND OLD.state = 'processing' THEN PERFORM pg_sleep(0.6); END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER idemgate_test_slow_completion BEFORE UPDATE ON idemgate_records
             FOR EACH ROW EXECUTE FUNCTION idemgate_test_slow_completion();",
    )
    .await
    .expect("trigger");
    let keys: Vec<String> = (0..8).map(|i| format!("hb-{i}")).collect();
    for k in &keys {
        let accepted = post(&gw.url("/v1/orders"), k, ORDER, &[]).await;
        assert_eq!(accepted.status, 202);
    }
    for k in &keys {
        assert_eq!(wait_final(&store, k, Duration::from_secs(30)).await.state, State::Completed);
    }
    let series = |outcome: &str| format!("idemgate_async_attempts_total{{operation=\"create_order\",outcome=\"{outcome}\"}}");
    let counted = eventually(Duration::from_secs(5), || async { metric(&gw, &series("completed")).await >= keys.len() as f64 }).await;
    assert!(counted, "completed: {}", metric(&gw, &series("completed")).await);
    assert_eq!(metric(&gw, &series("lost_lease")).await, 0.0, "{}", gw.logs());
    assert_eq!(gw.log_count("records nothing"), 0, "{}", gw.logs());
    assert_eq!(up.total(), keys.len() as u64);
}

/// Take-over follows the lease, not the sweep interval: with the lease
/// reaper's `sweep_interval` at 30 s, a worker killed -9 mid-forward on a
/// deduplicating upstream (lease 1 s) is taken over by another replica's
/// worker within moments of the lease's expiry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_over_follows_the_lease_not_the_sweep_interval() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    up.set_dedupe(true);
    let cfg = || async_config(&backend, &up, true, 1).sweep_interval("30s");
    let mut a = Gateway::start(cfg());
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "fast", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.kill9();
    let killed = std::time::Instant::now();
    let b = Gateway::start(cfg());
    let again = tokio::time::timeout(Duration::from_secs(10), received.recv()).await;
    assert!(again.is_ok(), "not taken over within 10 s of the kill (lease 1 s):\n{}", b.logs());
    let after = killed.elapsed();
    let rec = wait_final(&store, "fast", Duration::from_secs(15)).await;
    assert_eq!(rec.state, State::Completed);
    assert_eq!(up.side_effects(&derived("fast")), 1, "the upstream acted once");
    assert!(metric(&b, "idemgate_requeued_leases_total").await >= 1.0, "the take-over is counted");
    eprintln!("taken over {after:?} after the kill");
}

/// The same on a route whose upstream does not deduplicate: a worker killed
/// -9 after sending leaves an attempt that may have run; another replica
/// turns it `unknown` within moments of the lease's expiry (the sweep
/// interval is 30 s) and never sends it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sent_attempt_of_a_dead_worker_turns_unknown_when_its_lease_runs_out() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let cfg = || async_config(&backend, &up, false, 1).sweep_interval("30s");
    let mut a = Gateway::start(cfg());
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "sent", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.kill9();
    let killed = std::time::Instant::now();
    let b = Gateway::start(cfg());
    let rec = wait_final(&store, "sent", Duration::from_secs(10)).await;
    assert_eq!(rec.state, State::Unknown, "{}", b.logs());
    eprintln!("unknown {:?} after the kill", killed.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(up.total(), 1, "never sent again");
}
