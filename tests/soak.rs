//! The chaos soak: N clients retry their keys with jitter against two replicas
//! on one PostgreSQL while a nemesis rotates faults (gateway kill -9 and
//! restart, SIGSTOP past the lease, PostgreSQL immediate restart, network
//! blackhole to PostgreSQL). A checker then reads the upstream's ledger and the
//! store and prints
//! `soak: keys=N side_effects=M duplicates=D lost=L stuck=S unknown=U reconciled=R
//! async=A events=E events_missing=X redeliveries=Y`; D, L, S and X must be 0.
//! The routes have a reconciliation probe (the test upstream's by-key
//! lookup): after the run the checker waits for the reconcilers to settle
//! every `unknown` record, so U must be 0 too; R is the number of records
//! they settled (audit rows by the reconciler).
//!
//! A quarter of the clients (IDEMGATE_SOAK_ASYNC_PERCENT; `scripts/soak --async`:
//! three quarters) use an async route (`POST /v1/jobs`, mode =
//! "async"): they get a 202 (the same operation id on every retry), poll the
//! operation to a final state and read its result; A counts accepted
//! operations, and every one must end final (lost otherwise), executed at
//! most once. Both routes send completion events to a webhook receiver: at
//! the end every final record has its event there (X counts those missing),
//! every event row is delivered, and Y counts redeliveries (after crashes).
//!
//! Not part of the default test run: `scripts/soak` (60 s) or
//! `scripts/soak --long` (10 min). Tunables: IDEMGATE_SOAK_SECS,
//! IDEMGATE_SOAK_CLIENTS.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::record::State;
use idemgate::store::ListFilter;
use support::faultproxy::{Fault, FaultProxy};
use support::postgres::PgServer;
use support::soak::{Seen, SeenAsync, check, check_async, env_u64, rss_kib, spawn_async_clients, spawn_clients};
use support::webhook::Webhook;
use support::*;

const LEASE_MS: u64 = 2000;
/// Records are probed once unknown this long: longer than the nemesis's
/// longest pause after a lease ran out (SIGSTOP for LEASE_MS + 1000 ms), so a
/// request still on its way when its record became unknown has arrived (or
/// never will) before the probe asks.
const SETTLE: &str = "5s";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the chaos soak runs with scripts/soak"]
async fn soak() {
    let secs = env_u64("IDEMGATE_SOAK_SECS", 60);
    let clients = env_u64("IDEMGATE_SOAK_CLIENTS", 16);
    let mut pg = PgServer::start().expect("PostgreSQL");
    let url = pg.create_database("soak").expect("database");
    let pg_addr: SocketAddr = format!("127.0.0.1:{}", pg.port()).parse().unwrap();
    let up = TestUpstream::start().await;
    let hook = Webhook::start().await;
    let probe = format!(
        "[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{{derived_key}}\"\nfound_as = 201\nsettle = \"{SETTLE}\"\ninterval = \"500ms\""
    );
    let events = |op: &str| format!("[routes.events]\nurl = \"{}\"\ntimeout = \"1s\"\n# {op}", hook.url());

    // Each replica reaches PostgreSQL through its own fault proxy.
    let mut proxies = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let proxy = FaultProxy::start(pg_addr).await;
        let proxied = url.replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port()));
        let cfg = GatewayConfig::new(Backend::Postgres { url: proxied }, up.url())
            .timeout("1s")
            .route(&format!("lease = \"{LEASE_MS}ms\"\nretention = \"1h\"\n{probe}\n{}", events("orders")))
            .tail(&format!(
                "[[routes]]\noperation = \"create_job\"\nmethod = \"POST\"\npath = \"/v1/jobs\"\nupstream = \"orders\"\nmode = \"async\"\n\
                 lease = \"{LEASE_MS}ms\"\nretention = \"1h\"\n{probe}\n{}",
                events("jobs")
            ));
        let gw = Gateway::start(cfg);
        proxies.push(proxy);
        replicas.push(Arc::new(Mutex::new(gw)));
    }
    let urls: Vec<String> = replicas.iter().map(|g| g.lock().unwrap().url("/v1/orders")).collect();
    let bases: Vec<String> = replicas.iter().map(|g| g.lock().unwrap().url("")).collect();
    let store = Backend::Postgres { url: url.clone() }.open().await;
    let start_rss: Vec<(u32, u64)> = replicas
        .iter()
        .map(|g| {
            let pid = g.lock().unwrap().pid();
            (pid, rss_kib(pid).unwrap_or(0))
        })
        .collect();

    let deadline = Instant::now() + Duration::from_secs(secs);
    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();

    // Clients: three quarters synchronous, a quarter async.
    let async_clients = (clients * env_u64("IDEMGATE_SOAK_ASYNC_PERCENT", 25) / 100).clamp(1, clients - 1);
    let seen_async: Arc<Mutex<HashMap<String, SeenAsync>>> = Arc::default();
    let mut tasks = spawn_clients(clients - async_clients, &urls, deadline, &seen);
    tasks.extend(spawn_async_clients(async_clients, &bases, "/v1/jobs", deadline, &seen_async));

    // The nemesis, in this task (it owns the PostgreSQL server and the proxies).
    let mut rounds = 0u64;
    let mut pg_restarts = 0;
    let mut log = Vec::new();
    while Instant::now() + Duration::from_secs(5) < deadline {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let victim = (rounds % 2) as usize;
        match rounds % 4 {
            0 => {
                let g = replicas[victim].clone();
                tokio::task::spawn_blocking(move || {
                    let mut g = g.lock().unwrap();
                    g.kill9();
                    std::thread::sleep(Duration::from_millis(300));
                    g.restart();
                })
                .await
                .unwrap();
                log.push(format!("kill -9 replica {victim}, restart"));
            }
            1 => {
                replicas[victim].lock().unwrap().signal("STOP");
                tokio::time::sleep(Duration::from_millis(LEASE_MS + 1000)).await;
                replicas[victim].lock().unwrap().signal("CONT");
                log.push(format!("SIGSTOP replica {victim} for {} ms (past its lease)", LEASE_MS + 1000));
            }
            2 => {
                proxies[victim].set(Fault::BlackholeDownstream);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                proxies[victim].set(Fault::None);
                proxies[victim].reset_all();
                log.push(format!("blackhole PostgreSQL replies to replica {victim} for 1500 ms"));
            }
            _ => {
                let restarted = tokio::task::block_in_place(|| pg.restart_immediate());
                restarted.expect("restart PostgreSQL");
                pg_restarts += 1;
                log.push("PostgreSQL immediate restart".to_owned());
            }
        }
        rounds += 1;
    }
    for t in tasks {
        t.await.expect("client task");
    }
    for p in &proxies {
        p.set(Fault::None);
    }
    // Quiesce: leases run out and the reaper (every 200 ms) settles them.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 1500)).await;
    // Reconciliation: the probes settle every unknown record (after SETTLE).
    let unknown_left = || async {
        store.list(&ListFilter { state: Some(State::Unknown), limit: 100_000, ..Default::default() }).await.map_or(usize::MAX, |l| l.len())
    };
    let reconcile_deadline = Instant::now() + Duration::from_secs(90);
    while unknown_left().await > 0 && Instant::now() < reconcile_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Async operations still queued or processing are run to the end.
    let open_left = || async {
        let mut n = 0;
        for state in [State::Queued, State::Processing, State::InFlight] {
            n += store.list(&ListFilter { state: Some(state), limit: 100_000, ..Default::default() }).await.map_or(usize::MAX, |l| l.len());
        }
        n
    };
    let open_deadline = Instant::now() + Duration::from_secs(60);
    while open_left().await > 0 && Instant::now() < open_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    while unknown_left().await > 0 && Instant::now() < reconcile_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let reconciled = store.audit(1_000_000).await.unwrap().iter().filter(|a| a.actor == "reconciler").count();
    // The outbox drains: every event row delivered.
    let events_deadline = Instant::now() + Duration::from_secs(60);
    while store.event_stats().await.map_or(true, |s| s.pending > 0) && Instant::now() < events_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // The checker.
    let seen = seen.lock().unwrap().clone();
    let verdict = check(&seen, &up, &store).await;
    let seen_async = seen_async.lock().unwrap().clone();
    let async_verdict = check_async(&seen_async, &up, &store, "create_job").await;
    let (events_missing, events_total, redeliveries) = check_events(&hook, &store).await;

    println!("soak: {secs}s, {clients} clients, 2 replicas, nemesis rounds={rounds} (PostgreSQL restarts={pg_restarts})");
    for l in &log {
        println!("  nemesis: {l}");
    }
    verdict.print_counts();
    println!("  settled by the probes:     {reconciled}");
    for (i, g) in replicas.iter().enumerate() {
        let pid = g.lock().unwrap().pid();
        let now_rss = rss_kib(pid).unwrap_or(0);
        let started = start_rss.iter().find(|(p, _)| *p == pid).map(|(_, r)| *r);
        match started {
            Some(s) => println!("  replica {i} RSS: {s} KiB -> {now_rss} KiB (growth {} KiB)", now_rss as i64 - s as i64),
            None => println!("  replica {i} RSS: {now_rss} KiB (restarted during the run)"),
        }
    }
    println!(
        "  async operations:          {} accepted, {} completed, {} unknown, {} failed_retryable",
        async_verdict.accepted, async_verdict.completed, async_verdict.unknown, async_verdict.failed
    );
    println!("  events:                    {events_total} written, {events_missing} missing at the receiver, {redeliveries} redelivered");
    verdict.print_findings();
    for d in &async_verdict.duplicates {
        println!("  DUPLICATE (async): {} executed {} times", d.0, d.1);
    }
    for l in &async_verdict.lost {
        println!("  LOST (async): {l}");
    }
    println!(
        "soak: {} reconciled={reconciled} async={} events={events_total} events_missing={events_missing} redeliveries={redeliveries}",
        verdict.line(),
        async_verdict.accepted
    );
    verdict.assert_clean();
    assert!(async_verdict.duplicates.is_empty() && async_verdict.lost.is_empty(), "async duplicates or lost operations");
    assert_eq!(events_missing, 0, "every final state has its event at the receiver");
    assert!(verdict.unknown.is_empty(), "unknown records left after reconciliation");
    assert!(seen.len() > 100, "the soak made progress");
}

/// Every final record (completed, unknown, failed_retryable) has an event of
/// its state and generation at the receiver, and every event row written was
/// received: (missing, event rows, redeliveries).
async fn check_events(hook: &Webhook, store: &idemgate::store::Store) -> (usize, usize, usize) {
    let received: HashMap<String, serde_json::Value> = hook.deliveries().into_iter().map(|d| (d.id.clone(), d.json())).collect();
    let redeliveries = hook.deliveries().len() - received.len();
    let rows = store.events(None, 10_000_000).await.expect("events");
    let mut missing = rows.iter().filter(|e| !received.contains_key(&e.id.to_string())).count();
    for state in [State::Completed, State::Unknown, State::FailedRetryable] {
        for r in store.list(&ListFilter { state: Some(state), limit: 1_000_000, ..Default::default() }).await.expect("list") {
            let found = received.values().any(|e| {
                e["scope"]["principal"] == *r.scope.principal
                    && e["scope"]["operation"] == *r.scope.operation
                    && e["generation"] == r.generation.0
                    && e["state"] == state.as_str()
            });
            if !found {
                println!("  MISSING EVENT: {} {} generation {}", r.scope.key.as_str(), state, r.generation);
                missing += 1;
            }
        }
    }
    (missing, rows.len(), redeliveries)
}
