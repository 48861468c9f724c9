//! High availability: idemgate on a PostgreSQL primary with a streaming
//! standby, through failovers done the way an orchestrator does them.
//!
//! Real binaries on this machine: a primary, a standby built with
//! `pg_basebackup` and named in the primary's `synchronous_standby_names`,
//! promotion with `pg_ctl promote`, and the real gateway with a store URL that
//! lists both hosts.
//!
//! - `failover_to_a_synchronous_standby_loses_nothing`: the soak's clients and
//!   ledger (`support::soak`) against two replicas while the primary is killed
//!   (`SIGKILL` to every process of the server) with its standby a little
//!   behind, the standby promoted, a fresh standby built on the dead node's
//!   address, and again. Ends with
//!   `ha: failovers=N keys=… side_effects=… duplicates=0 lost=0 stuck=0 unknown=…`.
//!   Tunables: IDEMGATE_HA_SECS (24), IDEMGATE_HA_FAILOVERS (2),
//!   IDEMGATE_HA_CLIENTS (8), IDEMGATE_HA_LAG_MS (300: how long the primary's
//!   WAL sender is paused before the primary dies). `scripts/soak
//!   --failover` runs a longer one.
//! - `failover_to_an_asynchronous_standby` (ignored; `scripts/soak --failover
//!   --async`): the same with an asynchronous standby, to show what it loses.
//! - `readyz_follows_the_primary`: `/readyz` is 503 within a second of the
//!   primary going silent, requests fail closed, and it is ready again after
//!   the promotion, with the silent host still listed first in the URL.
//! - `a_fenced_primary_is_left_for_the_new_one`: an old primary that is alive
//!   but read-only (SQLSTATE 25006): its refusals are not ambiguous, and the
//!   pool lets go of every connection to it.
//!
//! Skipped, with a message, only when the PostgreSQL server binaries are
//! missing (`scripts/test` installs them).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::record::State;
use idemgate::store::{ClaimOutcome, ClaimRequest, StoreError};
use support::faultproxy::{Fault, FaultProxy};
use support::postgres::{PgServer, SUPERUSER, replication_binaries};
use support::soak::{Seen, Tenants, Verdict, check, env_u64, spawn_clients};
use support::*;
use uuid::Uuid;

const DB: &str = "ha";
/// The route's lease, as in the soak.
const LEASE_MS: u64 = 2000;
/// How long the "orchestrator" takes to promote after the primary died.
const PROMOTE_AFTER: Duration = Duration::from_millis(500);

/// False, with a message saying why, when the server binaries are missing.
fn have_binaries(test: &str) -> bool {
    match replication_binaries() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("{test}: SKIPPED: PostgreSQL server binaries not found ({e}); scripts/test installs them");
            false
        }
    }
}

fn name(slot: usize) -> String {
    format!("node{slot}")
}

/// Two nodes: slot 0 and slot 1, each with a fixed port for its life and
/// its replacements' (a rebuilt node takes the dead one's address, as a
/// replaced machine keeps its host name).
struct Cluster {
    nodes: [Option<PgServer>; 2],
    ports: [u16; 2],
    primary: usize,
    sync: bool,
}

impl Cluster {
    /// `node0` primary with database `ha`, `node1` its standby: synchronous
    /// (`synchronous_standby_names = 'node1'`) or asynchronous.
    fn start(sync: bool) -> io::Result<Cluster> {
        let primary = PgServer::start()?;
        primary.create_database(DB)?;
        let standby = PgServer::start_standby(&primary, &name(1), None)?;
        if sync {
            primary.set_and_reload("synchronous_standby_names", &name(1))?;
        }
        primary.wait_for_standby(&name(1), if sync { "sync" } else { "async" }, Duration::from_secs(30))?;
        let ports = [primary.port(), standby.port()];
        Ok(Cluster { nodes: [Some(primary), Some(standby)], ports, primary: 0, sync })
    }

    fn node(&self, slot: usize) -> &PgServer {
        self.nodes[slot].as_ref().expect("node present")
    }

    fn primary(&self) -> &PgServer {
        self.node(self.primary)
    }

    fn standby_slot(&self) -> usize {
        1 - self.primary
    }

    /// Both hosts, node 0 first, as idemgate's store URL.
    fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{},127.0.0.1:{}/{DB}?target_session_attrs=read-write", self.ports[0], self.ports[1])
    }

    /// The primary dies with its standby `lag` behind (its WAL sender
    /// paused); after `PROMOTE_AFTER` the standby is promoted and
    /// `synchronous_standby_names` re-pointed at the replacement, which is
    /// built from the new primary with `pg_basebackup` on the dead node's
    /// address. Returns a line for the log.
    fn failover(&mut self, lag: Duration) -> io::Result<String> {
        let began = Instant::now();
        let (old, new) = (self.primary, self.standby_slot());
        if !lag.is_zero() {
            self.node(old).signal_wal_senders("-STOP")?;
            std::thread::sleep(lag);
        }
        self.nodes[old].as_mut().expect("primary present").kill9()?;
        std::thread::sleep(PROMOTE_AFTER);
        self.node(new).promote()?;
        // Strict: no commit is acknowledged until the replacement confirms it.
        let sync_names = if self.sync { name(old) } else { String::new() };
        self.node(new).set_and_reload("synchronous_standby_names", &sync_names)?;
        let promoted = began.elapsed();
        self.primary = new;
        drop(self.nodes[old].take());
        let replacement = PgServer::start_standby(self.node(new), &name(old), Some(self.ports[old]))?;
        self.nodes[old] = Some(replacement);
        self.node(new).wait_for_standby(&name(old), if self.sync { "sync" } else { "async" }, Duration::from_secs(60))?;
        Ok(format!(
            "{} killed (standby {} ms behind), {} promoted at +{} ms, fresh standby {} streaming at +{} ms",
            name(old),
            lag.as_millis(),
            name(new),
            promoted.as_millis(),
            name(old),
            began.elapsed().as_millis()
        ))
    }
}

impl Drop for Cluster {
    /// Throw-away data: `SIGKILL` is instant, where an immediate shutdown of a
    /// replicating pair took seconds here.
    fn drop(&mut self) {
        for node in self.nodes.iter_mut().flatten() {
            let _ = node.kill9();
        }
    }
}

/// The gateway config of the soak, on `url`.
fn soak_gateway(url: &str, upstream: &TestUpstream) -> GatewayConfig {
    GatewayConfig::new(Backend::Postgres { url: url.to_owned() }, upstream.url())
        .timeout("1s")
        .route(&format!("lease = \"{LEASE_MS}ms\"\nretention = \"1h\""))
}

/// Soak clients against two replicas while the primary fails over
/// `IDEMGATE_HA_FAILOVERS` times; returns how many failovers ran and the
/// checker's verdict.
async fn failover_run(sync: bool) -> (u64, Verdict) {
    let secs = env_u64("IDEMGATE_HA_SECS", 24);
    let failovers = env_u64("IDEMGATE_HA_FAILOVERS", 2);
    let clients = env_u64("IDEMGATE_HA_CLIENTS", 8);
    let lag = Duration::from_millis(env_u64("IDEMGATE_HA_LAG_MS", 300));
    let began = Instant::now();
    let mut cluster = tokio::task::block_in_place(|| Cluster::start(sync)).expect("primary and standby");
    let url = cluster.url();
    let up = TestUpstream::start().await;
    let replicas: Vec<Gateway> = (0..2).map(|_| Gateway::start(soak_gateway(&url, &up))).collect();
    let urls: Vec<String> = replicas.iter().map(|g| g.url("/v1/orders")).collect();

    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let seen: Arc<Mutex<HashMap<String, Seen>>> = Arc::default();
    let tasks = spawn_clients(clients, &urls, deadline, &seen, &Tenants::one());

    // The orchestrator, in this task: failovers spread over the run, each
    // leaving time for the clients to go on against the new primary.
    let mut done = 0;
    let mut log = Vec::new();
    for i in 0..failovers {
        let at = start + Duration::from_secs(secs) * u32::try_from(i + 1).unwrap() / u32::try_from(failovers + 1).unwrap();
        tokio::time::sleep_until(at.into()).await;
        if Instant::now() + Duration::from_secs(5) > deadline {
            break;
        }
        let line = tokio::task::block_in_place(|| cluster.failover(lag)).expect("failover");
        log.push(line);
        done += 1;
    }
    for t in tasks {
        t.await.expect("client task");
    }
    // Quiesce: leases run out and the reaper (every 200 ms) settles them.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 1500)).await;

    let store = Backend::Postgres { url: format!("{url}&application_name=ha_checker") }.open().await;
    let seen = seen.lock().unwrap().clone();
    let verdict = check(&seen, &up, &store, &Tenants::one()).await;
    let kind = if sync { "synchronous" } else { "asynchronous" };
    println!(
        "ha: {secs}s, {clients} clients, 2 replicas, {kind} standby, failovers={done}, whole test {:.1}s",
        began.elapsed().as_secs_f64()
    );
    for l in &log {
        println!("  failover: {l}");
    }
    verdict.print_counts();
    verdict.print_findings();
    println!("ha: failovers={done} {}", verdict.line());
    drop(replicas);
    drop(cluster);
    (done, verdict)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_synchronous_standby_loses_nothing() {
    if !have_binaries("failover_to_a_synchronous_standby_loses_nothing") {
        return;
    }
    let (failovers, verdict) = failover_run(true).await;
    verdict.assert_clean();
    assert!(failovers >= 1, "at least one failover ran");
    assert!(verdict.answered > 50, "the clients made progress across the failovers");
}

/// What an asynchronous standby loses. Not asserted clean: the result is
/// recorded in docs/faults.md.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "shows the losses of an asynchronous standby; scripts/soak --failover --async-standby"]
async fn failover_to_an_asynchronous_standby() {
    if !have_binaries("failover_to_an_asynchronous_standby") {
        return;
    }
    let (failovers, verdict) = failover_run(false).await;
    assert!(failovers >= 1, "at least one failover ran");
    assert!(verdict.answered > 50, "the clients made progress across the failovers");
}

async fn readyz(g: &Gateway) -> u16 {
    match send("GET", &g.admin_url("/readyz"), &[], "").await {
        Ok(r) => r.status,
        Err(_) => 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_primary() {
    if !have_binaries("readyz_follows_the_primary") {
        return;
    }
    let cluster = tokio::task::block_in_place(|| Cluster::start(true)).expect("primary and standby");
    // The primary is reached through a fault proxy, so its host can go
    // silent (nothing arrives, nothing comes back, no reset): a host that
    // lost power or network. It stays first in the URL.
    let primary_addr: SocketAddr = format!("127.0.0.1:{}", cluster.primary().port()).parse().unwrap();
    let proxy = FaultProxy::start(primary_addr).await;
    let url = format!("postgres://{SUPERUSER}@127.0.0.1:{},127.0.0.1:{}/{DB}", proxy.port(), cluster.node(1).port());
    let up = TestUpstream::start().await;
    let mut cfg = GatewayConfig::new(Backend::Postgres { url: url.clone() }, up.url());
    // The default operation timeout: /readyz must not wait for it. No
    // sweeper or reaper: only requests and probes use the pool.
    cfg.store_section = Some(format!(
        "[store]\nkind = \"postgres\"\nurl = \"{url}\"\npool_size = 4\noperation_timeout = \"5s\"\nsweep_interval = \"1h\"\n"
    ));
    let gw = Gateway::start(cfg);
    assert_eq!(readyz(&gw).await, 200);
    let before = post(&gw.url("/v1/orders"), "before", r#"{"n":1}"#, &[]).await;
    assert!((200..300).contains(&before.status), "{before:?}");
    // Concurrent requests fill the pool with sessions through the proxy.
    let warm: Vec<_> = (0..16)
        .map(|i| {
            let url = gw.url("/v1/orders");
            tokio::spawn(async move { post(&url, &format!("warm-{i}"), r#"{"n":0}"#, &[]).await })
        })
        .collect();
    for w in warm {
        assert!((200..300).contains(&w.await.expect("request").status));
    }
    // Their result writes (made just after each answer) have returned.
    let direct = Backend::Postgres { url: format!("postgres://{SUPERUSER}@127.0.0.1:{}/{DB}", cluster.primary().port()) }.open().await;
    for i in 0..16 {
        assert_eq!(settled_record(&direct, &format!("warm-{i}")).await.map(|r| r.state), Some(State::Completed));
    }
    println!("readyz: {} pooled sessions through the proxy", proxy.connections());

    proxy.set(Fault::BlackholeUpstream);
    let lost_at = Instant::now();
    let status = readyz(&gw).await;
    let unready_after = lost_at.elapsed();
    println!("readyz: {status} {} ms after the primary went silent (operation_timeout 5 s)", unready_after.as_millis());
    assert_eq!(status, 503, "no primary: not ready");
    assert!(unready_after < Duration::from_millis(1500), "/readyz took {unready_after:?}: it must not wait for the operation timeout");
    // The probe that went unanswered let go of every pooled session on the silent host.
    assert!(proxy.wait_connections(0, Duration::from_secs(3)).await, "sessions left on the silent host: {}", proxy.connections());

    // While no primary is reachable, requests fail closed.
    let during = post(&gw.url("/v1/orders"), "during", r#"{"n":2}"#, &[]).await;
    assert_eq!(during.status, 503, "{during:?}");
    assert_eq!(during.problem(), "store-unavailable");
    assert_eq!(up.side_effects(&derived("during")), 0, "nothing forwarded without a committed claim");

    // The orchestrator promotes the standby; the old primary's host stays silent.
    tokio::task::block_in_place(|| {
        cluster.node(1).promote()?;
        cluster.node(1).set_and_reload("synchronous_standby_names", "")
    })
    .expect("promote");
    // Ready again at the first or second probe: a probe may still try the
    // silent host (and give up after its bound), but it lets go of every
    // pooled session there, and the next one starts with the other host.
    let promoted_at = Instant::now();
    let mut probes = Vec::new();
    while probes.last() != Some(&200) && probes.len() < 10 {
        probes.push(readyz(&gw).await);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("readyz: after the promotion {probes:?}, ready {} ms after it", promoted_at.elapsed().as_millis());
    assert_eq!(probes.last(), Some(&200), "ready again after the promotion:\n{}", gw.logs());
    assert!(probes.len() <= 2, "probes kept meeting sessions on the silent host: {probes:?}");

    // The claim acknowledged before the failover is on the new primary.
    let again = post(&gw.url("/v1/orders"), "before", r#"{"n":1}"#, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, before.body);
    let during = post(&gw.url("/v1/orders"), "during", r#"{"n":2}"#, &[]).await;
    assert!((200..300).contains(&during.status), "{during:?}");
    assert_eq!(up.side_effects(&derived("before")), 1);
    assert_eq!(up.side_effects(&derived("during")), 1);
    // (The result of "during" is written just after its answer.)
    let want =
        vec![vec![Some("before".to_owned()), Some("completed".to_owned())], vec![Some("during".to_owned()), Some("completed".to_owned())]];
    let query = "SELECT idempotency_key, state FROM idemgate_records WHERE idempotency_key IN ('before', 'during') ORDER BY 1";
    let on_new_primary = || cluster.node(1).simple_query(DB, query).expect("records on the new primary");
    let completed = eventually(Duration::from_secs(5), || {
        let rows = on_new_primary();
        let want = &want;
        async move { &rows == want }
    })
    .await;
    assert!(completed, "{:?}", on_new_primary());
}

/// The admin API's token in the fenced-primary test.
const ADMIN_TOKEN: &str = "ha-admin-token";

fn claim_request(key: &str) -> ClaimRequest {
    ClaimRequest {
        scope: scope(key),
        request_hash: Fingerprint([7; 32]),
        owner: "ha-test".into(),
        lease: Duration::from_secs(10),
        reforward: None,
        sent: idemgate::idempotency::record::ReforwardKey::Derived,
        fingerprint_spec: "test-settings".into(),
        claim_token: Uuid::new_v4(),
        acceptance: None,
        key_source: "header:idempotency-key".into(),
        request_head: None,
    }
}

/// Sessions of `application_name`s on `node`'s database.
fn sessions(node: &PgServer, apps: &str) -> i64 {
    let rows = node
        .simple_query("postgres", &format!("SELECT count(*) FROM pg_stat_activity WHERE application_name IN ({apps})"))
        .expect("pg_stat_activity");
    rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref()).and_then(|v| v.parse().ok()).unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_primary_is_left_for_the_new_one() {
    if !have_binaries("a_fenced_primary_is_left_for_the_new_one") {
        return;
    }
    let cluster = tokio::task::block_in_place(|| Cluster::start(true)).expect("primary and standby");
    let url = cluster.url();
    let up = TestUpstream::start().await;
    // No sweeper or reaper statements: only the requests below use the pool.
    let dir = tempfile::tempdir().expect("tempdir");
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{ADMIN_TOKEN}\n")).expect("token file");
    let gw = Gateway::start(soak_gateway(&url, &up).sweep_interval("1h").admin(&format!("token_file = \"{}\"", token_file.display())));
    let store = Backend::Postgres { url: format!("{url}&application_name=ha_checker") }.open().await;
    // Concurrent requests fill the gateway's pool with sessions on the
    // primary: first writes (their claims and results share one batched
    // statement at a time) beside admin listings (a statement each).
    let warm: Vec<_> = (0..32)
        .map(|i| {
            let (url, admin) = (gw.url("/v1/orders"), gw.admin_url("/admin/records"));
            tokio::spawn(async move {
                let (auth, key) = (format!("Bearer {ADMIN_TOKEN}"), format!("old-{i}"));
                let headers = [("authorization", auth.as_str())];
                let (write, list) = tokio::join!(post(&url, &key, r#"{"n":0}"#, &[]), send("GET", &admin, &headers, ""));
                (write, list.expect("admin listing"))
            })
        })
        .collect();
    for w in warm {
        let (write, list) = w.await.expect("request");
        assert!((200..300).contains(&write.status), "{write:?}");
        assert_eq!(list.status, 200, "{list:?}");
    }
    assert!(matches!(store.claim(&claim_request("lib-0")).await, Ok(ClaimOutcome::Claimed(_))));
    let pooled = sessions(cluster.node(0), "'idemgate'");
    println!("fenced primary: {pooled} pooled gateway sessions on it");
    assert!(pooled >= 2, "the gateway's pool holds several sessions on the primary: {pooled}");

    // The orchestrator fences the old primary: alive, but read-only for every
    // session, including the ones idemgate holds in its pool.
    tokio::task::block_in_place(|| cluster.node(0).set_and_reload("default_transaction_read_only", "on")).expect("fence");
    tokio::time::sleep(Duration::from_millis(300)).await;

    // The server refused the write: it did not take effect, so it is not
    // ambiguous (no read-back, no abandoned claim).
    match store.claim(&claim_request("lib-1")).await {
        Err(e @ StoreError::Unavailable(_)) => assert!(e.to_string().contains("25006"), "{e}"),
        other => panic!("a write refused by a read-only server must be Unavailable, not {other:?}"),
    }

    tokio::task::block_in_place(|| {
        cluster.node(1).promote()?;
        cluster.node(1).set_and_reload("synchronous_standby_names", "")
    })
    .expect("promote");

    // The same pool reaches the new primary: no restart.
    let outcome = store.claim(&claim_request("lib-1")).await;
    assert!(matches!(outcome, Ok(ClaimOutcome::Claimed(_))), "{outcome:?}");

    // Through the gateway: a request may meet one refusal before the pool
    // lets go of the old primary (503, nothing forwarded); then all pass.
    let mut refused = 0;
    for i in 0..20 {
        let key = format!("new-{i}");
        loop {
            let r = post(&gw.url("/v1/orders"), &key, r#"{"n":1}"#, &[]).await;
            if (200..300).contains(&r.status) {
                break;
            }
            assert_eq!(r.status, 503, "{r:?}");
            assert_eq!(r.problem(), "store-unavailable");
            refused += 1;
            assert!(refused <= 1, "the pool kept handing out connections to the read-only server:\n{}", gw.logs());
        }
        assert_eq!(up.side_effects(&derived(&key)), 1, "{key}");
        let rec = settled_record(&store, &key).await.expect("record on the new primary");
        assert_eq!(rec.state, State::Completed);
    }
    println!("fenced primary: {refused} request(s) refused before the pool moved to the new primary");
    assert_eq!(gw.log_count("ambiguous"), 0, "refusals are not ambiguous:\n{}", gw.logs());

    // Every pooled connection to the old primary is gone.
    let old = cluster.node(0);
    let left = eventually(Duration::from_secs(5), || async { sessions(old, "'idemgate', 'ha_checker'") == 0 }).await;
    assert!(left, "sessions still open on the old primary: {}", sessions(old, "'idemgate', 'ha_checker'"));
    let on_old = old.simple_query(DB, "SELECT count(*) FROM idemgate_records WHERE idempotency_key LIKE 'new-%'").expect("old primary");
    assert_eq!(on_old, vec![vec![Some("0".to_owned())]], "nothing was written to the fenced primary");
}
