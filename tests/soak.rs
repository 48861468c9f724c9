//! The chaos soak: N clients retry their keys with jitter against two replicas
//! on one PostgreSQL while a nemesis rotates faults (gateway kill -9 and
//! restart, SIGSTOP past the lease, PostgreSQL immediate restart, network
//! blackhole to PostgreSQL). A checker then reads the upstream's ledger and the
//! store and prints
//! `soak: keys=N side_effects=M duplicates=D lost=L stuck=S unknown=U`;
//! D, L and S must be 0.
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
use support::*;

/// What one client saw for one key.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// The first successful answer (status, body), replayed or not.
    first: Option<(u16, bytes::Bytes)>,
    /// The first answer came straight from the upstream (not a replay).
    first_forwarded: bool,
    /// Replays that differed from the first answer.
    replay_mismatches: u32,
    replays: u32,
    unknown: bool,
    gave_up: bool,
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// A tiny deterministic PRNG (xorshift), so runs need no extra crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const LEASE_MS: u64 = 2000;

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
        let cfg = GatewayConfig::new(Backend::Postgres { url: proxied }, up.url())
            .timeout("1s")
            .route(&format!("lease = \"{LEASE_MS}ms\"\nretention = \"1h\""));
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
    let mut tasks = Vec::new();
    for c in 0..clients {
        let urls = urls.clone();
        let seen = seen.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
            let mut n = 0u64;
            while Instant::now() < deadline {
                n += 1;
                let key = format!("c{c}-{n}");
                let body = format!(r#"{{"client":{c},"n":{n},"item":"book"}}"#);
                let mut s = Seen::default();
                // 3% of requests are slower than the upstream timeout: honest unknowns.
                let slow = rng.below(100) < 3;
                let mut attempts = 0;
                let mut verify_replay = rng.below(100) < 20;
                loop {
                    attempts += 1;
                    if attempts > 60 {
                        s.gave_up = true;
                        break;
                    }
                    let url = &urls[rng.below(urls.len() as u64) as usize];
                    let sleep = if slow && attempts == 1 { "1500".to_owned() } else { rng.below(30).to_string() };
                    let r = send(
                        "POST",
                        url,
                        &[
                            ("authorization", "Bearer test-key"),
                            ("content-type", "application/json"),
                            ("idempotency-key", &key),
                            ("x-test-sleep-ms", &sleep),
                        ],
                        body.clone(),
                    )
                    .await;
                    let retry_pause = Duration::from_millis(20 + rng.below(200));
                    let r = match r {
                        Ok(r) => r,
                        Err(_) => {
                            tokio::time::sleep(retry_pause).await;
                            continue;
                        }
                    };
                    match r.status {
                        200..=299 => {
                            match &s.first {
                                None => {
                                    s.first = Some((r.status, r.body.clone()));
                                    s.first_forwarded = !r.replayed();
                                }
                                Some((st, b)) => {
                                    s.replays += 1;
                                    if !r.replayed() || *st != r.status || *b != r.body {
                                        s.replay_mismatches += 1;
                                    }
                                }
                            }
                            if verify_replay {
                                verify_replay = false;
                                continue;
                            }
                            break;
                        }
                        409 | 504 if r.problem() == "outcome-unknown" => {
                            s.unknown = true;
                            break;
                        }
                        409 if r.problem() == "request-in-progress" => {}
                        503 | 408 | 502 => {}
                        other => panic!("unexpected answer {other} for {key}: {:?}", String::from_utf8_lossy(&r.body)),
                    }
                    tokio::time::sleep(retry_pause).await;
                }
                seen.lock().unwrap().insert(key, s);
            }
        }));
    }

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

    // The checker.
    let seen = seen.lock().unwrap().clone();
    let ledger = up.ledger();
    let mut duplicates = Vec::new();
    let mut lost = Vec::new();
    let mut replay_mismatch = 0;
    let mut answered = 0;
    let mut unknown_after_answer = 0;
    let mut gave_up = 0;
    for (key, s) in &seen {
        let effects = ledger.get(&derived(key)).copied().unwrap_or(0);
        if effects > 1 {
            duplicates.push((key.clone(), effects));
        }
        replay_mismatch += s.replay_mismatches;
        gave_up += u32::from(s.gave_up);
        if let Some((status, body)) = &s.first {
            answered += 1;
            match record(&store, key).await {
                None => lost.push(format!("{key}: answered {status} but no record")),
                Some(r) if r.state == State::Completed => {
                    let stored = r.response.as_ref().and_then(|resp| resp.body.clone());
                    if stored.as_ref() != Some(body) || r.response.as_ref().map(|x| x.status) != Some(*status) {
                        lost.push(format!("{key}: stored answer differs from what the client got"));
                    }
                }
                Some(r) if r.state == State::Unknown && s.first_forwarded => unknown_after_answer += 1,
                Some(r) => lost.push(format!("{key}: answered {status} but record is {}", r.state)),
            }
        }
    }
    let now = store.now().await.unwrap();
    let in_flight = store.list(&ListFilter { state: Some(State::InFlight), limit: 100_000, ..Default::default() }).await.unwrap();
    let stuck: Vec<_> = in_flight.iter().filter(|r| r.lease_expires_at.is_none_or(|l| l <= now)).collect();
    let unknown = store.list(&ListFilter { state: Some(State::Unknown), limit: 100_000, ..Default::default() }).await.unwrap();
    let completed = store.list(&ListFilter { state: Some(State::Completed), limit: 1_000_000, ..Default::default() }).await.unwrap();

    println!("soak: {secs}s, {clients} clients, 2 replicas, nemesis rounds={rounds} (PostgreSQL restarts={pg_restarts})");
    for l in &log {
        println!("  nemesis: {l}");
    }
    println!("  keys attempted:            {}", seen.len());
    println!("  side effects:              {} (max per key {})", up.total(), ledger.values().max().copied().unwrap_or(0));
    println!("  keys answered 2xx:         {answered}");
    println!("  keys with a stored answer: {}", completed.len());
    println!("  replays checked:           {} (differing: {replay_mismatch})", seen.values().map(|s| s.replays).sum::<u32>());
    println!("  unknown records:           {} (client had the answer for {unknown_after_answer})", unknown.len());
    for r in unknown.iter().take(20) {
        println!("    unknown: {} (owner {}, generation {})", r.scope.key.as_str(), r.owner, r.generation);
    }
    println!("  clients that gave up:      {gave_up}");
    println!("  in flight at end:          {} (stuck past lease: {})", in_flight.len(), stuck.len());
    for (i, g) in replicas.iter().enumerate() {
        let pid = g.lock().unwrap().pid();
        let now_rss = rss_kib(pid).unwrap_or(0);
        let started = start_rss.iter().find(|(p, _)| *p == pid).map(|(_, r)| *r);
        match started {
            Some(s) => println!("  replica {i} RSS: {s} KiB -> {now_rss} KiB (growth {} KiB)", now_rss as i64 - s as i64),
            None => println!("  replica {i} RSS: {now_rss} KiB (restarted during the run)"),
        }
    }
    for d in &duplicates {
        println!("  DUPLICATE: {} executed {} times", d.0, d.1);
    }
    for l in &lost {
        println!("  LOST: {l}");
    }
    println!(
        "soak: keys={} side_effects={} duplicates={} lost={} stuck={} unknown={}",
        seen.len(),
        up.total(),
        duplicates.len(),
        lost.len() + replay_mismatch as usize,
        stuck.len(),
        unknown.len()
    );
    assert!(duplicates.is_empty(), "duplicates");
    assert!(lost.is_empty() && replay_mismatch == 0, "lost or differing answers");
    assert!(stuck.is_empty(), "stuck records");
    assert!(seen.len() > 100, "the soak made progress");
}
