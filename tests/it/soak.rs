//! The chaos soak: N clients retry their keys with jitter against two replicas
//! on one PostgreSQL while a nemesis rotates faults: gateway kill -9 and
//! restart, SIGSTOP past the lease (the event receiver failing meanwhile),
//! PostgreSQL immediate restart, network
//! blackhole to PostgreSQL, and, aimed at a slow async request while it is at
//! the upstream, SIGSTOP (2.5 s, past its lease) or kill -9 of the replica
//! that sent it. Once, both replicas reload a changed configuration; from
//! then on only replica 0 is killed. The last round kills replica 0 while its
//! request is at the upstream and leaves it down until the check. A checker then reads the upstream's ledger and the
//! store and prints
//! `soak: keys=N side_effects=M duplicates=D lost=L stuck=S unknown=U reconciled=R
//! async=A events=E events_missing=X redeliveries=Y async_stuck=Z at_upstream=P`;
//! D, L, S, U and X must be 0.
//!
//! Routes, on two upstreams of one test server (its by-key lookup is every
//! route's reconciliation probe; a slow write commits at the end of its work,
//! so the lookup answers 404 while the work runs, as a real service's would):
//! - `POST /v1/orders` (synchronous, lease 2 s, upstream timeout 1 s);
//! - `POST /v1/jobs` (async, lease 1 s, upstream timeout 8 s on replica 0 and
//!   6 s on replica 1, as during a rolling change of `timeout`; probe settle 1 s);
//! - `POST /v1/idem-jobs` (the same, `upstream_idempotent = true`: the
//!   upstream deduplicates that path);
//! - the reload, 40% into the run: `/v1/jobs`' lease becomes 1.5 s,
//!   `/v1/idem-jobs` turns `upstream_idempotent = false` (2 s later the
//!   upstream stops deduplicating it), and a new async route `POST /v1/reports`
//!   (`upstream_idempotent = true`, deduplicated) appears, which clients use
//!   from then on.
//!
//! A third of the async requests ask the upstream to work 2-5 s: longer than
//! the lease, shorter than the timeout. A third replica, the prober, runs the
//! same routes without workers and with a 2 s timeout for the async routes'
//! upstream: its reconciler probes the others' attempts, and must wait for
//! the bound each attempt recorded when it was sent (8 s or 6 s), not for its
//! own 2 s plus settle, which ends while slow work still runs (a probe that
//! asks then finds nothing, releases the operation, and it runs twice). It is
//! reloaded with the others and never a victim. Replica 0 runs its lease reaper every
//! 200 ms, replica 1 every IDEMGATE_SOAK_SWEEP (default 1 s). Take-over of
//! an attempt that may run again is the workers' (a lease bounds it); a sent
//! attempt on a plain upstream and a synchronous `in_flight` record still
//! turn `unknown` only at a reaper's pass (issue 27's open part): with
//! IDEMGATE_SOAK_SWEEP=1h and replica 0 killed last, those stay open and
//! the soak counts them stuck. What the faults at the upstream catch:
//! a probe that asks while the attempt may still be at the upstream finds
//! nothing, releases the operation and a worker sends it again (a
//! duplicate); a re-forward to an upstream the reload declared
//! non-deduplicating (a duplicate); an operation of a dead replica that
//! nobody takes over or declares unknown in time, or of an added route that no
//! worker serves (stuck).
//!
//! D counts keys the upstream acted on twice (all routes); L keys a client
//! got a 2xx or an accepted operation for whose record is missing, not final
//! or differs at the end; S counts synchronous records in flight past their
//! lease at the end plus Z: accepted operations still `queued` or
//! `processing` (not final; `unknown` counts as final here, the probes settle
//! it later) lease + upstream timeout + 5 s (14.5 s) after the clients
//! stopped sending writes. Then replica 0 restarts, and the checker waits
//! for the reconcilers to settle every `unknown` record, so U must be 0 too;
//! R is the number of records they settled (audit rows by the reconciler). A
//! counts accepted async operations (all routes); every final record has its
//! event at the webhook receiver, each scope's received in order (X counts
//! those missing, and those first received after a later one of their
//! scope) and Y counts
//! redeliveries (after crashes). P counts the faults at the upstream that
//! found their request. Each duplicate is listed with the generations the
//! upstream saw and when.
//!
//! On Citus (`citus_soak`, `scripts/soak --citus`): the same soak on a
//! coordinator and two workers, the replicas on `kind = "citus"` entering
//! through different nodes at once (replica 0 the coordinator, replica 1
//! worker 1, each through its fault proxy; the prober every node, a
//! multi-host URL); the clients' keys spread over six
//! tenants, three on each worker's shards (a tenant's records live on one
//! worker), and the restart round takes the nodes in turn (worker 1, the
//! coordinator, worker 2), a worker staying down 3.5 s (past every lease)
//! while the other worker's tenants' requests, async operations, probes and
//! events go on. Before the replicas start, 34 more tenants (more than the 32
//! a background round lists) are seeded with work that cannot proceed: a
//! parked event with a pending one held behind it, and an `unknown` record
//! backing off after an inconclusive probe, older than anything the clients
//! do; a tenant list that counted them would starve the clients' events and
//! probes (events missing, unknown records left). They are deleted before the
//! final check. A second line `citus: nodes=3 keys=N ...` repeats the closing
//! line's fields; the same counts must be 0.
//!
//! Not part of the default test run: `scripts/soak` (60 s of traffic) or
//! `scripts/soak --long` (10 min). Tunables: IDEMGATE_SOAK_SECS,
//! IDEMGATE_SOAK_CLIENTS, IDEMGATE_SOAK_ASYNC_PERCENT (share of the clients
//! on the async routes; default 25), IDEMGATE_SOAK_SWEEP (replica 1's
//! `store.sweep_interval`), IDEMGATE_SOAK_RELOAD=0 (no reload, no
//! `/v1/reports`).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use idemgate::store::{ListFilter, Store};
use support::citus::{self, CitusCluster};
use support::faultproxy::{Fault, FaultProxy};
use support::postgres::PgServer;
use support::soak::{
    AsyncLoad, AsyncVerdict, Posting, SeenAsync, SeenAsyncMap, Tenants, check, check_async, env_u64, open_operations, rss_kib,
    spawn_async_clients, spawn_clients,
};
use support::webhook::Webhook;
use support::*;

/// The synchronous route's lease.
const LEASE_MS: u64 = 2000;
/// The synchronous route's probe waits this long after a record became
/// unknown: longer than the nemesis's longest pause after a lease ran out
/// (SIGSTOP for LEASE_MS + 1000 ms), so a request still on its way when its
/// record became unknown has arrived (or never will) before the probe asks.
/// (A synchronous request is not fenced between its claim and its send.)
const SETTLE: &str = "5s";
/// The async routes' lease, and `/v1/jobs`' after the reload.
const ASYNC_LEASE_MS: u64 = 1000;
const RELOADED_LEASE_MS: u64 = 1500;
/// The async routes' upstream timeout: far longer than their lease. The
/// longest of the replicas' (replica 0's; see [`JOBS_TIMEOUTS_MS`]).
const JOBS_TIMEOUT_MS: u64 = 8000;
/// Each replica's timeout for the async routes' upstream: they differ (a
/// rolling change of `timeout`), both longer than the slowest work.
const JOBS_TIMEOUTS_MS: [u64; 2] = [JOBS_TIMEOUT_MS, 6000];
/// The prober's timeout for that upstream: shorter than the slow work. The
/// prober is a third replica without workers (it never sends an async
/// attempt, so its short timeout never cuts one short): its reconciler must
/// wait for the bound each attempt recorded with its send, not for its own
/// timeout plus settle (which ends while a slow request is still worked on).
const PROBER_JOBS_TIMEOUT_MS: u64 = 2000;
/// Slow async requests make the upstream work this long (ms): past the lease,
/// within the timeout.
const SLOW_MS: (u64, u64) = (2000, 5000);
/// The async routes' probe settle, short on purpose. An async attempt cannot
/// start sending once its lease ran out (`sent_at` is written under the
/// lease); a sender frozen after that write sends at most a pause (2.5-3 s)
/// late, so the upstream's work (at most 5 s) ends before sent + timeout
/// (8 s). A probe timed from `unknown` plus settle, though, would ask while a
/// slow request is still being worked on.
const ASYNC_SETTLE: &str = "1s";
/// How long the Citus soak keeps a worker down: past every lease.
const WORKER_DOWN: Duration = Duration::from_millis(LEASE_MS + 1500);
/// "Paused at the upstream": the sender is frozen this long, past its lease.
const PAUSE_AT_UPSTREAM_MS: u64 = ASYNC_LEASE_MS + 1500;
/// Accepted operations must be final this long after traffic stops: the
/// longest async lease + the upstream timeout + 5 s.
const FINAL_WITHIN: Duration = Duration::from_millis(RELOADED_LEASE_MS + JOBS_TIMEOUT_MS + 5000);

const PROBE: &str = "probe = \"GET /v1/orders/by-key/{derived_key}\"\nfound_as = 201\ninterval = \"500ms\"";

/// The async routes, their upstream and (after the reload) the added route.
struct AsyncRoutes {
    up: String,
    hook: String,
}

impl AsyncRoutes {
    fn route(&self, operation: &str, path: &str, lease_ms: u64, idempotent: bool) -> String {
        format!(
            "[[routes]]\noperation = \"{operation}\"\nmethod = \"POST\"\npath = \"{path}\"\nupstream = \"jobs\"\nmode = \"async\"\n\
             lease = \"{lease_ms}ms\"\nupstream_idempotent = {idempotent}\nretention = \"1h\"\n\
             [routes.reconcile]\n{PROBE}\nsettle = \"{ASYNC_SETTLE}\"\n\
             [routes.events]\nurl = \"{}\"\ntimeout = \"1s\"\ninclude_key = true\n",
            self.hook
        )
    }

    /// The `tail` of a replica's config, before or after the reload, with
    /// the replica's timeout for the async routes' upstream.
    fn tail(&self, reloaded: bool, timeout_ms: u64) -> String {
        let mut t =
            format!("[[upstreams]]\nname = \"jobs\"\nurl = \"{}\"\nconnect_timeout = \"500ms\"\ntimeout = \"{timeout_ms}ms\"\n\n", self.up);
        t.push_str(&self.route("create_job", "/v1/jobs", if reloaded { RELOADED_LEASE_MS } else { ASYNC_LEASE_MS }, false));
        t.push_str(&self.route("create_idem_job", "/v1/idem-jobs", ASYNC_LEASE_MS, !reloaded));
        if reloaded {
            t.push_str(&self.route("create_report", "/v1/reports", ASYNC_LEASE_MS, true));
        }
        t
    }
}

/// Clients' load on one async route: a third of the keys are slow.
fn load(path: &str, prefix: &str, tenants: &Tenants) -> AsyncLoad {
    AsyncLoad { path: path.to_owned(), prefix: prefix.to_owned(), slow_percent: 33, slow_ms: SLOW_MS, tenants: tenants.clone() }
}

/// What the soak's store runs on.
enum Db {
    /// One PostgreSQL server.
    Postgres(PgServer),
    /// A Citus coordinator and two workers; the gateways reach the coordinator.
    Citus(CitusCluster),
}

impl Db {
    fn start(on_citus: bool) -> Db {
        if on_citus {
            Db::Citus(CitusCluster::start(2).expect("a Citus coordinator and two workers"))
        } else {
            Db::Postgres(PgServer::start().expect("PostgreSQL"))
        }
    }

    /// The server replica `i` connects to (through its fault proxy): on
    /// Citus each replica enters through another node (replica 0 the
    /// coordinator, replica 1 worker 1), as gateways given different nodes do.
    fn entry(&self, i: usize) -> &PgServer {
        match self {
            Db::Postgres(pg) => pg,
            Db::Citus(cluster) => cluster.nodes().nth(i % (1 + cluster.workers.len())).unwrap_or(&cluster.coordinator),
        }
    }

    /// The URL of database `db` as `url` names it, with every node listed
    /// on Citus (a multi-host URL, the store's statements sent to their
    /// shards' nodes); `url` itself on PostgreSQL.
    fn every_node(&self, url: &str) -> String {
        match self {
            Db::Postgres(_) => url.to_owned(),
            Db::Citus(cluster) => {
                let hosts: Vec<String> = cluster.nodes().map(|n| format!("127.0.0.1:{}", n.port())).collect();
                url.replacen(&format!("127.0.0.1:{}", cluster.coordinator.port()), &hosts.join(","), 1)
            }
        }
    }

    fn create_database(&self, name: &str) -> String {
        match self {
            Db::Postgres(pg) => pg.create_database(name),
            Db::Citus(cluster) => cluster.create_database(name),
        }
        .expect("database")
    }

    fn backend(&self, url: String) -> Backend {
        match self {
            Db::Postgres(_) => Backend::Postgres { url },
            Db::Citus(_) => Backend::Citus { url },
        }
    }

    fn node_names(&self) -> Vec<&'static str> {
        match self {
            Db::Postgres(_) => vec!["PostgreSQL"],
            Db::Citus(cluster) => ["coordinator", "worker 1", "worker 2"].into_iter().take(1 + cluster.workers.len()).collect(),
        }
    }

    /// The nemesis's restart round `n`: an immediate restart of the server,
    /// or on Citus of the next node in turn: worker 1, the coordinator,
    /// worker 2. (A worker first: the short soak of CI has time for one
    /// restart round, 60 s for two, `--long` for all.) A Citus worker stays
    /// down [`WORKER_DOWN`], longer than every lease, while the other
    /// worker's tenants' requests, async operations, probes and events go
    /// on. Returns the node's index in [`node_names`](Self::node_names).
    fn restart_immediate(&mut self, n: u64) -> usize {
        match self {
            Db::Postgres(pg) => {
                pg.restart_immediate().expect("restart PostgreSQL");
                0
            }
            Db::Citus(cluster) => {
                let i = [1, 0, 2][(n % 3) as usize].min(cluster.workers.len());
                if i == 0 {
                    cluster.coordinator.restart_immediate().unwrap_or_else(|e| panic!("restart the Citus coordinator: {e}"));
                } else {
                    let worker = &mut cluster.workers[i - 1];
                    worker.stop_immediate().unwrap_or_else(|e| panic!("stop Citus worker {i}: {e}"));
                    std::thread::sleep(WORKER_DOWN);
                    worker.start_again().unwrap_or_else(|e| panic!("start Citus worker {i} again: {e}"));
                }
                i
            }
        }
    }
}

/// The tenants of the Citus soak: three whose shards are on each worker
/// (asked of the cluster), so that every worker's death is felt by clients;
/// with a line saying where they live.
fn tenants_on_every_worker(cluster: &CitusCluster) -> (Tenants, String) {
    let on = cluster.tenants_on_workers("soak", 3).expect("three tenants on each worker");
    let line = on.iter().enumerate().map(|(w, t)| format!("worker {}: {}", w + 1, t.join(", "))).collect::<Vec<_>>().join("; ");
    (Tenants::named(on.concat()), line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the chaos soak runs with scripts/soak"]
async fn soak() {
    run(false).await;
}

/// The same soak on a Citus cluster (a coordinator and two workers): the
/// replicas run `kind = "citus"` against the coordinator through their fault
/// proxies, the clients' keys are spread over six tenants (three on each
/// worker's shards), and the restart round takes the nodes in turn:
/// worker 1, the coordinator, worker 2. Ends with
/// `citus: nodes=3 keys=N ...` (the same fields as `soak:`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the Citus chaos soak runs with scripts/soak --citus"]
async fn citus_soak() {
    if citus::skip_unless_installed() {
        return;
    }
    run(true).await;
}

async fn run(on_citus: bool) {
    let secs = env_u64("IDEMGATE_SOAK_SECS", 60);
    let clients = env_u64("IDEMGATE_SOAK_CLIENTS", 16);
    let reload = env_u64("IDEMGATE_SOAK_RELOAD", 1) == 1;
    // Replica 0 runs its lease reaper every 200 ms; replica 1 every
    // IDEMGATE_SOAK_SWEEP (default 1 s).
    let slow_sweep: &'static str = Box::leak(std::env::var("IDEMGATE_SOAK_SWEEP").unwrap_or_else(|_| "1s".to_owned()).into_boxed_str());
    let sweeps = ["200ms", slow_sweep];
    let mut db = tokio::task::block_in_place(|| Db::start(on_citus));
    let url = tokio::task::block_in_place(|| db.create_database("soak"));
    let pg_port = db.entry(0).port();
    let up = TestUpstream::start().await;
    up.set_commit_at_end(true);
    up.set_dedupe_path("/v1/idem-jobs", true);
    up.set_dedupe_path("/v1/reports", true);
    let hook = Webhook::start().await;
    let probe = format!("[routes.reconcile]\n{PROBE}\nsettle = \"{SETTLE}\"");
    // With the key: the final check orders each scope's events.
    let events = |op: &str| format!("[routes.events]\nurl = \"{}\"\ntimeout = \"1s\"\ninclude_key = true\n# {op}", hook.url());
    let async_routes = AsyncRoutes { up: up.url(), hook: hook.url() };

    // On Citus, more tenants than a background round lists, whose work
    // cannot proceed (held events, backing-off probes), before anything runs.
    let seeding = Instant::now();
    let blocked = match &db {
        Db::Citus(_) => {
            let seeding = db.backend(url.clone()).open().await;
            support::soak::seed_blocked_tenants(&seeding, "create_order", &hook.url()).await
        }
        Db::Postgres(_) => Vec::new(),
    };
    let seeding = seeding.elapsed();
    // Each replica reaches PostgreSQL through its own fault proxy.
    let mut proxies = Vec::new();
    let mut replicas = Vec::new();
    for (i, sweep) in sweeps.iter().enumerate().take(2) {
        let entry: SocketAddr = format!("127.0.0.1:{}", db.entry(i).port()).parse().unwrap();
        let proxy = FaultProxy::start(entry).await;
        let proxied = url.replace(&format!(":{pg_port}/"), &format!(":{}/", proxy.port()));
        let cfg = GatewayConfig::new(db.backend(proxied), up.url())
            .timeout("1s")
            .sweep_interval(sweep)
            .server(&format!("replica_id = \"soak-{i}\""))
            .route(&format!("lease = \"{LEASE_MS}ms\"\nretention = \"1h\"\n{probe}\n{}", events("orders")))
            .tail(&async_routes.tail(false, JOBS_TIMEOUTS_MS[i]));
        let gw = Gateway::start(cfg);
        proxies.push(proxy);
        replicas.push(Arc::new(Mutex::new(gw)));
    }
    // The prober: the same routes, no workers, a shorter timeout; never a
    // victim of the nemesis, reloaded with the others.
    let prober_backend = db.backend(db.every_node(&url));
    let prober_config = |reloaded: bool| {
        GatewayConfig::new(prober_backend.clone(), up.url())
            .timeout("1s")
            .sweep_interval("1s")
            .server("replica_id = \"soak-prober\"")
            .route(&format!("lease = \"{LEASE_MS}ms\"\nretention = \"1h\"\n{probe}\n{}", events("orders")))
            .tail(&format!("{}\n[workers]\ncount = 0", async_routes.tail(reloaded, PROBER_JOBS_TIMEOUT_MS)))
    };
    let mut prober = Gateway::start(prober_config(false));
    let urls: Vec<String> = replicas.iter().map(|g| g.lock().unwrap().url("/v1/orders")).collect();
    let bases: Vec<String> = replicas.iter().map(|g| g.lock().unwrap().url("")).collect();
    let store = db.backend(url.clone()).open().await;
    let (tenants, tenants_line) = match &db {
        Db::Postgres(_) => (Tenants::one(), format!("one ({TENANT})")),
        Db::Citus(cluster) => tokio::task::block_in_place(|| tenants_on_every_worker(cluster)),
    };
    let nodes = db.node_names();
    let mut restarts = vec![0u64; nodes.len()];
    let start_rss: Vec<(u32, u64)> = replicas
        .iter()
        .map(|g| {
            let pid = g.lock().unwrap().pid();
            (pid, rss_kib(pid).unwrap_or(0))
        })
        .collect();

    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let seen: Arc<Mutex<HashMap<String, support::soak::Seen>>> = Arc::default();

    // Clients: three quarters synchronous; a quarter async, half of them on
    // /v1/jobs, half on /v1/idem-jobs; after the reload, as many again on
    // /v1/reports as on /v1/jobs.
    let async_clients = (clients * env_u64("IDEMGATE_SOAK_ASYNC_PERCENT", 25) / 100).clamp(2, clients - 1);
    let jobs_clients = async_clients.div_ceil(2);
    let posting = Arc::new(Posting::default());
    let routes: Vec<(&'static str, AsyncLoad, SeenAsyncMap)> = vec![
        ("create_job", load("/v1/jobs", "j", &tenants), Arc::default()),
        ("create_idem_job", load("/v1/idem-jobs", "i", &tenants), Arc::default()),
        ("create_report", load("/v1/reports", "r", &tenants), Arc::default()),
    ];
    let sync_tasks = spawn_clients(clients - async_clients, &urls, deadline, &seen, &tenants);
    let mut async_tasks = spawn_async_clients(jobs_clients, 0, &bases, &routes[0].1, deadline, &routes[0].2, &posting);
    async_tasks.extend(spawn_async_clients(async_clients - jobs_clients, 100, &bases, &routes[1].1, deadline, &routes[1].2, &posting));

    // The nemesis, in this task (it owns the PostgreSQL server or the Citus
    // nodes, and the proxies).
    let mut rounds = 0u64;
    let mut pg_restarts = 0;
    let mut at_upstream_faults = 0;
    let mut reloaded = false;
    let mut log = Vec::new();
    loop {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        if !reloaded && reload && started.elapsed() >= Duration::from_secs(secs * 2 / 5) {
            reloaded = true;
            let at = started.elapsed();
            for (i, g) in replicas.iter().enumerate() {
                let g = g.clone();
                let tail = async_routes.tail(true, JOBS_TIMEOUTS_MS[i]);
                let said = tokio::task::spawn_blocking(move || {
                    let mut g = g.lock().unwrap();
                    let mut cfg = g.config.clone();
                    cfg.tail = format!("{tail}\n");
                    g.reload(cfg, Duration::from_secs(10)).map(|()| g.log_count("keep their start-up routes") > 0)
                })
                .await
                .unwrap();
                match said {
                    Ok(keeps) => log.push(format!(
                        "{:5.1}s reload replica {i}: /v1/jobs lease 1.5s, /v1/idem-jobs upstream_idempotent false, /v1/reports added (upstream_idempotent){}",
                        at.as_secs_f64(),
                        if keeps { " (it logged that background work keeps its start-up routes)" } else { "" }
                    )),
                    Err(logs) => panic!("replica {i} did not reload:\n{logs}"),
                }
            }
            let reloaded_prober = prober_config(true);
            tokio::task::block_in_place(|| prober.reload(reloaded_prober, Duration::from_secs(10)))
                .unwrap_or_else(|logs| panic!("the prober did not reload:\n{logs}"));
            // Clients use the added route from now on.
            async_tasks.extend(spawn_async_clients(jobs_clients, 200, &bases, &routes[2].1, deadline, &routes[2].2, &posting));
            // The upstream stops deduplicating once every replica runs the
            // new configuration (a moment for attempts decided before it).
            tokio::time::sleep(Duration::from_secs(2)).await;
            up.set_dedupe_path("/v1/idem-jobs", false);
            log.push(format!("{:5.1}s the upstream no longer deduplicates /v1/idem-jobs", started.elapsed().as_secs_f64()));
            continue;
        }
        // The last round, once the end is near: replica 0 is killed while
        // its request is at the upstream and stays down until the check.
        if Instant::now() + Duration::from_secs(9) > deadline {
            let at = started.elapsed().as_secs_f64();
            // Preferably one on a route whose upstream deduplicates: the
            // other replica's workers must take it over within the lease.
            let idempotent = if reloaded { "create_report" } else { "create_idem_job" };
            let prefer = |a: &AtUpstream| a.victim == 0 && a.operation == idempotent;
            let found = match at_upstream(&up, &store, &routes, &tenants, Duration::from_secs(3), prefer).await {
                Some(a) => Some(a),
                None => at_upstream(&up, &store, &routes, &tenants, Duration::from_secs(2), |a| a.victim == 0).await,
            };
            let g = replicas[0].clone();
            tokio::task::spawn_blocking(move || g.lock().unwrap().kill9()).await.unwrap();
            let what = found.map_or("(no slow request of its was at the upstream)".to_owned(), |a| format!("while {a}"));
            log.push(format!("{at:5.1}s kill -9 replica 0 {what}; down until the check"));
            break;
        }
        let victim = ((rounds + rounds / 6) % 2) as usize;
        // After the reload only replica 0 is killed: replica 1 runs the
        // reloaded configuration to the end (a restart would hide background
        // work that kept the configuration it started with).
        let killable = |v: usize| !reloaded || v == 0;
        let at = started.elapsed().as_secs_f64();
        let before = log.len();
        match rounds % 6 {
            0 => {
                let victim = if killable(victim) { victim } else { 0 };
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
                // The receiver fails meanwhile and for 2 s after: the events of
                // the attempts whose leases run out (unknown) and those of their
                // resolutions wait together, so each scope's order is decided
                // by the relays, not by the pace of the writes.
                hook.answer(503);
                replicas[victim].lock().unwrap().signal("STOP");
                tokio::time::sleep(Duration::from_millis(LEASE_MS + 1000)).await;
                replicas[victim].lock().unwrap().signal("CONT");
                tokio::time::sleep(Duration::from_secs(2)).await;
                hook.answer(200);
                log.push(format!(
                    "SIGSTOP replica {victim} for {} ms (past its lease), the event receiver answering 503 until 2 s after",
                    LEASE_MS + 1000
                ));
            }
            2 => {
                proxies[victim].set(Fault::BlackholeDownstream);
                tokio::time::sleep(Duration::from_millis(1500)).await;
                proxies[victim].set(Fault::None);
                proxies[victim].reset_all();
                log.push(format!("blackhole PostgreSQL replies to replica {victim} for 1500 ms"));
            }
            3 => {
                let node = tokio::task::block_in_place(|| db.restart_immediate(pg_restarts));
                pg_restarts += 1;
                restarts[node] += 1;
                log.push(match &db {
                    Db::Postgres(_) => "PostgreSQL immediate restart".to_owned(),
                    Db::Citus(_) if node == 0 => format!("Citus {} immediate restart", nodes[node]),
                    Db::Citus(_) => {
                        format!("Citus {} stopped for {} ms (past every lease), started again", nodes[node], WORKER_DOWN.as_millis())
                    }
                });
            }
            4 => match at_upstream(&up, &store, &routes, &tenants, Duration::from_secs(4), |_| true).await {
                Some(a) => {
                    replicas[a.victim].lock().unwrap().signal("STOP");
                    tokio::time::sleep(Duration::from_millis(PAUSE_AT_UPSTREAM_MS)).await;
                    replicas[a.victim].lock().unwrap().signal("CONT");
                    let resent = resent(&up, &a);
                    log.push(format!("SIGSTOP replica {} for {PAUSE_AT_UPSTREAM_MS} ms while {a}; {resent}", a.victim));
                    at_upstream_faults += 1;
                }
                None => log.push("no slow async request reached the upstream within 4 s: nobody paused".to_owned()),
            },
            _ => match at_upstream(&up, &store, &routes, &tenants, Duration::from_secs(4), |a| killable(a.victim)).await {
                Some(a) => {
                    let g = replicas[a.victim].clone();
                    tokio::task::spawn_blocking(move || {
                        let mut g = g.lock().unwrap();
                        g.kill9();
                        std::thread::sleep(Duration::from_millis(300));
                        g.restart();
                    })
                    .await
                    .unwrap();
                    log.push(format!("kill -9 replica {} while {a}, restart", a.victim));
                    at_upstream_faults += 1;
                }
                None => log.push("no slow async request reached the upstream within 4 s: nobody killed".to_owned()),
            },
        }
        for l in &mut log[before..] {
            *l = format!("{at:5.1}s {l}");
        }
        rounds += 1;
    }
    for t in sync_tasks {
        t.await.expect("client task");
    }
    let sync_stopped = Instant::now();
    let traffic_stopped = posting.stopped().await.map_or(sync_stopped, |t| t.max(sync_stopped));
    for p in &proxies {
        p.set(Fault::None);
    }
    // Every accepted operation is final (or unknown) lease + timeout + 5 s
    // after the last write was sent.
    tokio::time::sleep((traffic_stopped + FINAL_WITHIN).saturating_duration_since(Instant::now())).await;
    let now = store.now().await.expect("store clock");
    let async_stuck = open_operations(&store).await;
    // The seeded tenants' work never proceeds (by design): out of the check.
    if !blocked.is_empty() {
        support::soak::remove_blocked_tenants(&url).await;
    }
    // Replica 0 comes back for the rest of the check.
    let g = replicas[0].clone();
    tokio::task::spawn_blocking(move || g.lock().unwrap().restart()).await.unwrap();
    let mut phases = vec![("traffic stopped", traffic_stopped.duration_since(started)), ("final check", started.elapsed())];
    for t in async_tasks {
        t.await.expect("async client task");
    }
    phases.push(("clients done", started.elapsed()));
    // Quiesce: leases run out and the reaper settles them.
    tokio::time::sleep(Duration::from_millis(LEASE_MS + 1500)).await;
    // Reconciliation: the probes settle every unknown record (after SETTLE).
    let unknown_left = || async {
        store.list(&ListFilter { state: Some(State::Unknown), limit: 100_000, ..Default::default() }).await.map_or(usize::MAX, |l| l.len())
    };
    let reconcile_deadline = Instant::now() + Duration::from_secs(90);
    // What is left after 20 s of waiting, to tell a slow settlement from a normal one.
    let mut slow = Vec::new();
    let waiting = Instant::now();
    while unknown_left().await > 0 && Instant::now() < reconcile_deadline {
        if slow.is_empty() && waiting.elapsed() > Duration::from_secs(20) {
            let now = store.now().await.expect("store clock");
            let left = store.list(&ListFilter { state: Some(State::Unknown), limit: 20, ..Default::default() }).await.unwrap_or_default();
            let at = |t: Option<idemgate::idempotency::record::Timestamp>| {
                t.map_or("-".to_owned(), |t| format!("{:+.1}s", (t.0 - now.0) as f64 / 1e6))
            };
            for r in &left {
                // The probes' side of the record: whether one was taken, what
                // it said, and when the next is due.
                let probes = match store.inspect(&r.scope, 0).await {
                    Ok(Some(i)) => format!(
                        "probes {}, next probe {}, last answer {:?}",
                        i.probe_attempts,
                        at(i.next_probe_at),
                        i.probe_last_answer.as_deref().unwrap_or("-")
                    ),
                    Ok(None) => "gone".to_owned(),
                    Err(e) => format!("inspect failed: {e}"),
                };
                slow.push(format!(
                    "{} {} {} (owner {}, generation {}, attempts {}, due {}, updated {}, created {}, lease {}; {probes})",
                    r.scope.tenant,
                    r.scope.operation,
                    r.scope.key.as_str(),
                    r.owner,
                    r.generation,
                    r.attempts,
                    at(r.next_attempt_at),
                    at(Some(r.updated_at)),
                    at(Some(r.created_at)),
                    at(r.lease_expires_at)
                ));
            }
            // What could keep a due record from its probe: transactions left
            // prepared on a node (their row locks make the take skip it), and
            // the reconcilers' own complaints.
            if let Db::Citus(cluster) = &db {
                for (name, node) in db.node_names().into_iter().zip(cluster.nodes()) {
                    let prepared = tokio::task::block_in_place(|| {
                        node.simple_query("soak", "SELECT count(*), min(prepared)::text FROM pg_prepared_xacts")
                    })
                    .map_or_else(|e| e.to_string(), |rows| format!("{rows:?}"));
                    slow.push(format!("{name}: prepared transactions (count, oldest) {prepared}"));
                }
            }
            let gateways = replicas.iter().map(|g| ("replica", g.lock().unwrap().logs())).chain([("prober", prober.logs())]);
            for (who, logs) in gateways {
                let complaints: Vec<&str> = logs
                    .lines()
                    .filter(|l| l.contains("reconciler") || l.contains("probe") || l.contains("tenant list"))
                    .filter(|l| l.contains("WARN") || l.contains("ERROR"))
                    .collect();
                slow.push(format!(
                    "{who}: {} probe warnings, the last: {:?}",
                    complaints.len(),
                    complaints.iter().rev().take(3).collect::<Vec<_>>()
                ));
            }
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    phases.push(("probes settled", started.elapsed()));
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
    phases.push(("operations run", started.elapsed()));
    while unknown_left().await > 0 && Instant::now() < reconcile_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    phases.push(("settled", started.elapsed()));
    let reconciled = store.audit(1_000_000).await.unwrap().iter().filter(|a| a.actor == "reconciler").count();
    // The outbox drains: every event row delivered.
    let events_deadline = Instant::now() + Duration::from_secs(60);
    while store.event_stats().await.map_or(true, |s| s.pending > 0) && Instant::now() < events_deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    phases.push(("events delivered", started.elapsed()));
    // The checker.
    let seen = seen.lock().unwrap().clone();
    let verdict = check(&seen, &up, &store, &tenants).await;
    let mut async_verdicts = Vec::new();
    for (operation, load, seen_async) in &routes {
        let seen_async: HashMap<String, SeenAsync> = seen_async.lock().unwrap().clone();
        let keys = seen_async.len();
        async_verdicts.push((*operation, load.path.clone(), keys, check_async(&seen_async, &up, &store, operation, &tenants).await));
    }
    let (events_missing, events_total, redeliveries) = check_events(&hook, &store).await;
    phases.push(("checked", started.elapsed()));

    let restarted = match &db {
        Db::Postgres(_) => format!("PostgreSQL restarts={pg_restarts}"),
        Db::Citus(_) => {
            let each: Vec<String> = nodes.iter().zip(&restarts).map(|(n, r)| format!("{n}: {r}")).collect();
            format!("Citus node restarts={pg_restarts}: {}", each.join(", "))
        }
    };
    println!(
        "soak: {secs}s, {clients} clients ({async_clients} async), 2 replicas (sweep_interval {} and {}), nemesis rounds={rounds} ({restarted})",
        sweeps[0], sweeps[1]
    );
    println!("  tenants:                   {tenants_line}");
    if !blocked.is_empty() {
        println!(
            "  seeded:                    {} tenants with a parked event (one held behind it) and a backing-off probe each, in {:.1}s",
            blocked.len(),
            seeding.as_secs_f64()
        );
    }
    println!(
        "  prober:                    no workers, async upstream timeout {PROBER_JOBS_TIMEOUT_MS} ms (replicas: {JOBS_TIMEOUTS_MS:?} ms)"
    );
    for l in &log {
        println!("  nemesis: {l}");
    }
    let phases: Vec<String> = phases.iter().map(|(what, at)| format!("{what} {:.1}s", at.as_secs_f64())).collect();
    println!("  after the start:           {}", phases.join(", "));
    for l in &slow {
        println!("  unknown 20 s into the settlement: {l}");
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
    for (operation, path, keys, v) in &async_verdicts {
        println!(
            "  async {path} ({operation}): {keys} keys, {} accepted, {} completed, {} unknown, {} failed_retryable",
            v.accepted, v.completed, v.unknown, v.failed
        );
    }
    println!("  not final {:.1} s after traffic stopped: {}", FINAL_WITHIN.as_secs_f64(), async_stuck.len());
    for r in async_stuck.iter().take(20) {
        let ago = |t: Option<idemgate::idempotency::record::Timestamp>| {
            t.map_or("-".to_owned(), |t| format!("{:.1}s ago", (now.0 - t.0) as f64 / 1e6))
        };
        println!(
            "    STUCK: {} {} {} (owner {}, generation {}, attempts {}, lease expired {}, sent {}, due {})",
            r.scope.operation,
            r.scope.key.as_str(),
            r.state,
            r.owner,
            r.generation,
            r.attempts,
            ago(r.lease_expires_at),
            ago(r.sent_at),
            ago(r.next_attempt_at)
        );
    }
    println!(
        "  events:                    {events_total} written, {events_missing} missing at the receiver or out of order, {redeliveries} redelivered"
    );
    verdict.print_findings();
    let requests = up.requests();
    let arrivals = |derived: String| {
        let seen: Vec<String> = requests
            .iter()
            .filter(|r| r.key == derived)
            .map(|r| {
                let how = if r.executed { "" } else { " (deduplicated)" };
                format!("generation {} at {:.1}s{how}", r.generation.as_deref().unwrap_or("-"), r.at.duration_since(started).as_secs_f64())
            })
            .collect();
        seen.join(", ")
    };
    for d in &verdict.duplicates {
        println!("    arrivals of {}: {}", d.0, arrivals(tenants.derived("create_order", &d.0)));
    }
    for (operation, _, _, v) in &async_verdicts {
        for d in &v.duplicates {
            println!("  DUPLICATE (async): {} executed {} times", d.0, d.1);
            println!("    arrivals: {}", arrivals(tenants.derived(operation, &d.0)));
        }
        for l in &v.lost {
            println!("  LOST (async): {l}");
        }
    }
    let sum = |f: &dyn Fn(&AsyncVerdict) -> usize| async_verdicts.iter().map(|(_, _, _, v)| f(v)).sum::<usize>();
    let async_keys: usize = async_verdicts.iter().map(|(_, _, k, _)| k).sum();
    let duplicates = verdict.duplicates.len() + sum(&|v| v.duplicates.len());
    let lost = verdict.lost_count() + sum(&|v| v.lost.len());
    let stuck = verdict.stuck + async_stuck.len();
    let ledger = format!(
        "keys={} side_effects={} duplicates={duplicates} lost={lost} stuck={stuck} unknown={} reconciled={reconciled} async={} \
         events={events_total} events_missing={events_missing} redeliveries={redeliveries} async_stuck={} at_upstream={at_upstream_faults}",
        verdict.keys + async_keys,
        verdict.side_effects,
        verdict.unknown.len(),
        sum(&|v| v.accepted),
        async_stuck.len()
    );
    println!("soak: {ledger}");
    if let Db::Citus(_) = &db {
        println!("citus: nodes={} {ledger} tenants={} node_restarts={pg_restarts}", nodes.len(), tenants.count());
    }
    assert!(reloaded || !reload, "the run was long enough for the reload");
    verdict.assert_clean();
    assert_eq!(duplicates, 0, "duplicates");
    assert_eq!(lost, 0, "lost or differing answers, or accepted operations not final");
    assert_eq!(stuck, 0, "stuck records or operations");
    assert_eq!(events_missing, 0, "every final state has its event at the receiver, in order per scope");
    assert!(verdict.unknown.is_empty(), "unknown records left after reconciliation");
    assert!(seen.len() > 100, "the soak made progress");
}

/// A slow async request at the upstream, and the replica that sent it.
struct AtUpstream {
    victim: usize,
    key: String,
    operation: &'static str,
    generation: i64,
    /// The key the upstream sees.
    derived: String,
    sleep_ms: u64,
    arrived: Instant,
}

impl std::fmt::Display for AtUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "its request {} ({}, generation {}) was at the upstream for {} ms",
            self.key, self.operation, self.generation, self.sleep_ms
        )
    }
}

/// Waits (up to `within`) for a slow async request to reach the upstream
/// while its attempt is processing, and finds the replica that sent it (its
/// record's owner); the first that `accept`s.
async fn at_upstream(
    up: &TestUpstream,
    store: &Store,
    routes: &[(&'static str, AsyncLoad, SeenAsyncMap)],
    tenants: &Tenants,
    within: Duration,
    accept: impl Fn(&AtUpstream) -> bool,
) -> Option<AtUpstream> {
    let mut received = up.subscribe();
    let until = Instant::now() + within;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let r = match tokio::time::timeout(left, received.recv()).await {
            Err(_) => return None,
            Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => continue,
            Ok(Err(_)) => return None,
            Ok(Ok(r)) => r,
        };
        let sleep_ms: u64 = r.headers.get("x-test-sleep-ms").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
        let Some((operation, _, _)) = routes.iter().find(|(_, l, _)| l.path == r.path) else { continue };
        if sleep_ms < SLOW_MS.0 || !r.executed {
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap_or_default();
        let Some(key) = body["key"].as_str() else { continue };
        let Ok(Some((record, _))) = store.get(&tenants.scope(operation, key)).await else { continue };
        let Some(victim) = (0..2).find(|i| record.owner == format!("soak-{i}")) else { continue };
        if record.state != State::Processing {
            continue;
        }
        let found = AtUpstream {
            victim,
            key: key.to_owned(),
            operation,
            generation: record.generation.0,
            derived: r.key.clone(),
            sleep_ms,
            arrived: r.at,
        };
        if accept(&found) {
            return Some(found);
        }
    }
}

/// Whether another attempt sent the request again since it arrived.
fn resent(up: &TestUpstream, a: &AtUpstream) -> String {
    let again: Vec<String> = up
        .requests()
        .iter()
        .filter(|r| r.key == a.derived && r.at > a.arrived)
        .map(|r| {
            format!(
                "generation {} {:.1} s later{}",
                r.generation.as_deref().unwrap_or("-"),
                r.at.duration_since(a.arrived).as_secs_f64(),
                if r.executed { "" } else { " (deduplicated)" }
            )
        })
        .collect();
    if again.is_empty() { "not sent again meanwhile".to_owned() } else { format!("sent again: {}", again.join(", ")) }
}

/// Every final record (completed, unknown, failed_retryable) has an event of
/// its state and generation at the receiver, and every event row written was
/// received: (missing, event rows, redeliveries).
async fn check_events(hook: &Webhook, store: &Store) -> (usize, usize, usize) {
    let received: HashMap<String, serde_json::Value> = hook.deliveries().into_iter().map(|d| (d.id.clone(), d.json())).collect();
    let redeliveries = hook.deliveries().len() - received.len();
    let rows = store.events(None, 10_000_000).await.expect("events");
    let mut missing = rows.iter().filter(|e| !received.contains_key(&e.id.to_string())).count();
    // (principal, operation, generation, state) of every event received.
    let delivered: std::collections::HashSet<(String, String, i64, String)> = received
        .values()
        .map(|e| {
            let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
            (text(&e["scope"]["principal"]), text(&e["scope"]["operation"]), e["generation"].as_i64().unwrap_or(-1), text(&e["state"]))
        })
        .collect();
    for state in [State::Completed, State::Unknown, State::FailedRetryable] {
        for r in store.list(&ListFilter { state: Some(state), limit: 1_000_000, ..Default::default() }).await.expect("list") {
            let event = (r.scope.principal.to_string(), r.scope.operation.to_string(), r.generation.0, state.as_str().to_owned());
            if !delivered.contains(&event) {
                println!("  MISSING EVENT: {} {} generation {}", r.scope.key.as_str(), state, r.generation);
                missing += 1;
            }
        }
    }
    missing += out_of_order(hook);
    (missing, rows.len(), redeliveries)
}

/// Events whose first delivery attempt came after that of a later event of
/// their scope (a higher generation; each is counted, and listed): events
/// are delivered in order per scope, whichever node or relay wrote and sent
/// them. Redeliveries (an id already received) are not orderings; batched
/// deliveries (none in the soak) are not read.
fn out_of_order(hook: &Webhook) -> usize {
    let mut seen: std::collections::HashSet<String> = std::collections::HashSet::new();
    let mut latest: HashMap<String, (i64, String)> = HashMap::new();
    let mut wrong = 0;
    // Every attempt counts, failed ones too: a relay attempts a scope's next
    // event only once the one before is delivered.
    for d in hook.deliveries() {
        if d.id.is_empty() || !seen.insert(d.id.clone()) {
            continue;
        }
        let e = d.json();
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
        let scope = [&e["scope"]["tenant"], &e["scope"]["principal"], &e["scope"]["operation"], &e["scope"]["key"]].map(text).join("/");
        let (generation, state) = (e["generation"].as_i64().unwrap_or(-1), text(&e["state"]));
        match latest.get(&scope) {
            Some((before, was)) if *before > generation => {
                println!("  EVENT OUT OF ORDER: {scope}: {state} generation {generation} after {was} generation {before}");
                wrong += 1;
            }
            _ => {
                latest.insert(scope, (generation, state));
            }
        }
    }
    wrong
}
