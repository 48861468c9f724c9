//! The chaos soak: N clients retry their keys with jitter against two replicas
//! on one PostgreSQL while a nemesis rotates faults (gateway kill -9 and
//! restart, SIGSTOP past the lease, PostgreSQL immediate restart, network
//! blackhole to PostgreSQL). A checker then reads the upstream's ledger and the
//! store and prints
//! `soak: keys=N side_effects=M duplicates=D lost=L stuck=S unknown=U reconciled=R`;
//! D, L and S must be 0. The route has a reconciliation probe (the test
//! upstream's by-key lookup): after the run the checker waits for the
//! reconcilers to settle every `unknown` record, so U must be 0 too; R is the
//! number of records they settled (audit rows by the reconciler).
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
use support::soak::{Seen, check, env_u64, rss_kib, spawn_clients};
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

    // Each replica reaches PostgreSQL through its own fault proxy.
    let mut proxies = Vec::new();
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let proxy = FaultProxy::start(pg_addr).await;
        let proxied = url.replace(&format!(":{}/", pg.port()), &format!(":{}/", proxy.port()));
        let cfg = GatewayConfig::new(Backend::Postgres { url: proxied }, up.url()).timeout("1s").route(&format!(
            "lease = \"{LEASE_MS}ms\"\nretention = \"1h\"\n[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{{derived_key}}\"\n\
                 found_as = 201\nsettle = \"{SETTLE}\"\ninterval = \"500ms\""
        ));
        let gw = Gateway::start(cfg);
        proxies.push(proxy);
        replicas.push(Arc::new(Mutex::new(gw)));
    }
    let urls: Vec<String> = replicas.iter().map(|g| g.lock().unwrap().url("/v1/orders")).collect();
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

    // Clients.
    let tasks = spawn_clients(clients, &urls, deadline, &seen);

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
    let reconciled = store.audit(1_000_000).await.unwrap().iter().filter(|a| a.actor == "reconciler").count();

    // The checker.
    let seen = seen.lock().unwrap().clone();
    let verdict = check(&seen, &up, &store).await;

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
    verdict.print_findings();
    println!("soak: {} reconciled={reconciled}", verdict.line());
    verdict.assert_clean();
    assert!(verdict.unknown.is_empty(), "unknown records left after reconciliation");
    assert!(seen.len() > 100, "the soak made progress");
}
