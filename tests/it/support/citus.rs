//! A private Citus cluster for integration tests: a coordinator and two
//! workers, each a private PostgreSQL cluster of `support::postgres` (fresh
//! `initdb` as an unprivileged account when root, loopback ports, the pipe
//! watchdog that stops it when the test process goes away) started with
//! `shared_preload_libraries = 'citus'`, and otherwise Citus's defaults:
//! `CREATE EXTENSION citus` turns `ssl` on with the self-signed (X.509
//! version 1) certificate it generates, the nodes reach each other over TLS
//! (`citus.node_conninfo = 'sslmode=require'`), and the URLs the tests hand
//! idemgate name no `sslmode` (libpq's default, `prefer`: TLS).
//!
//! * [`installed`] says whether the Citus extension is installed for the
//!   PostgreSQL the harness uses; [`skip_unless_installed`] is how a test
//!   steps aside when it is not (loudly, and never when
//!   `IDEMGATE_TEST_CITUS=required`, which CI sets after installing Citus).
//! * [`shared()`] is one cluster per test binary, started lazily, like
//!   `postgres::shared()`. Tests isolate themselves with
//!   [`CitusCluster::create_database`]: Citus keeps its metadata (the nodes,
//!   the shards) per database, so each test database gets the extension on
//!   every node and its own `citus_set_coordinator_host` / `citus_add_node`.
//! * [`CitusCluster::start`] gives a test a cluster of its own (for tests
//!   that stop or kill a node).
#![allow(dead_code)] // each test binary uses a different part of this module

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::postgres::{PgServer, pkglibdir};

/// Settings of every node. Shards per distributed table: 8 by default here
/// (Citus's default is 32) so that each test database's migration stays
/// short; `IDEMGATE_TEST_CITUS_SHARDS` overrides it.
fn settings() -> Vec<String> {
    let shards = std::env::var("IDEMGATE_TEST_CITUS_SHARDS").ok().and_then(|v| v.parse::<u32>().ok()).unwrap_or(8);
    vec![
        "shared_preload_libraries=citus".to_owned(),
        format!("citus.shard_count={shards}"),
        // The conformance case whose change must fail with its event injects
        // the failure with a trigger, which Citus allows on a distributed
        // table only when told to (idemgate itself uses no triggers).
        "citus.enable_unsafe_triggers=on".to_owned(),
    ]
}

/// What to run to install Citus (for skip messages).
pub const INSTALL_HINT: &str =
    "install Citus for this PostgreSQL (Citus's own packages; on the project's test machines `bash ../shared/vendor/citus/build`)";

/// Whether the Citus extension is installed for the PostgreSQL the harness runs.
pub fn installed() -> bool {
    pkglibdir().is_ok_and(|dir| dir.join("citus.so").is_file())
}

/// `true` (after one line on stderr) when Citus is not installed and not
/// required: the calling test returns at once. Panics when
/// `IDEMGATE_TEST_CITUS=required` and Citus is missing.
pub fn skip_unless_installed() -> bool {
    if installed() {
        return false;
    }
    if std::env::var("IDEMGATE_TEST_CITUS").is_ok_and(|v| v == "required") {
        panic!("IDEMGATE_TEST_CITUS=required but Citus is not installed: {INSTALL_HINT}");
    }
    eprintln!("SKIPPED: Citus is not installed; {INSTALL_HINT}");
    true
}

/// A coordinator and its workers.
pub struct CitusCluster {
    pub coordinator: PgServer,
    pub workers: Vec<PgServer>,
    startup: Duration,
}

impl CitusCluster {
    /// The worker holding the shard of `tenant`'s records, as `coordinator`
    /// (a session on this cluster's coordinator) reads the placement.
    pub async fn worker_holding(&self, coordinator: &tokio_postgres::Client, tenant: &str) -> &PgServer {
        let holder: String = coordinator
            .query_one(
                "SELECT nodeport::text FROM pg_dist_shard_placement WHERE shardid = get_shard_id_for_distribution_column('idemgate_records', $1::text)",
                &[&tenant],
            )
            .await
            .unwrap_or_else(|e| panic!("placement of {tenant}: {e}"))
            .get(0);
        self.workers.iter().find(|w| w.port().to_string() == holder).unwrap_or_else(|| panic!("no worker holds {tenant} (port {holder})"))
    }

    /// Starts a coordinator and `workers` workers (each `initdb` + start).
    pub fn start(workers: usize) -> io::Result<CitusCluster> {
        if !installed() {
            return Err(io::Error::new(io::ErrorKind::NotFound, format!("Citus is not installed: {INSTALL_HINT}")));
        }
        let began = Instant::now();
        let settings = settings();
        let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
        // The nodes start one after the other: on two cores, parallel initdbs
        // gain little and make a slow start slower to read in the logs.
        let coordinator = PgServer::start_with_settings(&settings)?;
        let mut nodes = Vec::with_capacity(workers);
        for _ in 0..workers {
            nodes.push(PgServer::start_with_settings(&settings)?);
        }
        Ok(CitusCluster { coordinator, workers: nodes, startup: began.elapsed() })
    }

    /// How long `start` took.
    pub fn startup_time(&self) -> Duration {
        self.startup
    }

    /// Every node: the coordinator first.
    pub fn nodes(&self) -> impl Iterator<Item = &PgServer> {
        std::iter::once(&self.coordinator).chain(self.workers.iter())
    }

    /// Creates database `name` on every node with the Citus extension, makes
    /// the workers this database's worker nodes, and returns the
    /// coordinator's URL for it.
    pub fn create_database(&self, name: &str) -> io::Result<String> {
        let all: Vec<usize> = (0..self.workers.len()).collect();
        self.create_database_adding(name, &all)
    }

    /// [`create_database`](Self::create_database), the extension on every
    /// node but only the workers numbered in `added` made this database's
    /// worker nodes (another is a node whose metadata was never synced: its
    /// node group says 0, as the coordinator's does).
    pub fn create_database_adding(&self, name: &str, added: &[usize]) -> io::Result<String> {
        for node in self.nodes() {
            node.create_database(name)?;
            node.simple_query(name, "CREATE EXTENSION citus")
                .map_err(|e| annotate(e, &format!("CREATE EXTENSION citus on port {}", node.port())))?;
            wait_for_tls(node, name)?;
        }
        let c = &self.coordinator;
        c.simple_query(name, &format!("SELECT citus_set_coordinator_host('127.0.0.1', {})", c.port()))?;
        for w in self.workers.iter().enumerate().filter(|(i, _)| added.contains(i)).map(|(_, w)| w) {
            // Adding a node syncs metadata over new connections to every
            // node; with many test databases set up at once on a loaded
            // machine one of them can fail ("failure on connection marked as
            // essential"). The call is idempotent: try again, for up to 10 s.
            let add = format!("SELECT citus_add_node('127.0.0.1', {})", w.port());
            let mut attempt = 0;
            loop {
                match c.simple_query(name, &add) {
                    Ok(_) => break,
                    Err(e) if attempt < 20 => {
                        attempt += 1;
                        eprintln!("citus_add_node(127.0.0.1, {}) failed, retrying: {e}", w.port());
                        std::thread::sleep(Duration::from_millis(500));
                    }
                    Err(e) => return Err(annotate(e, &format!("citus_add_node(127.0.0.1, {})", w.port()))),
                }
            }
        }
        Ok(c.url(name))
    }

    /// [`create_database`](Self::create_database) with a unique name `{prefix}_{n}`.
    pub fn create_unique_database(&self, prefix: &str) -> io::Result<String> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        self.create_database(&format!("{prefix}_{}_{n}", std::process::id()))
    }

    /// `per_worker` tenants named `tenant-NN` whose shard of
    /// `idemgate_records` is placed on each worker, in the workers' order, as
    /// the coordinator of database `db` (migrated) says
    /// (`get_shard_id_for_distribution_column` and the shard's placement).
    /// Errors when the first 256 names do not give every worker its share.
    pub fn tenants_on_workers(&self, db: &str, per_worker: usize) -> io::Result<Vec<Vec<String>>> {
        let rows = self.coordinator.simple_query(
            db,
            "SELECT s.t, p.nodeport FROM (SELECT i, 'tenant-' || lpad(i::text, 2, '0') AS t FROM generate_series(0, 255) i) s \
             JOIN pg_dist_shard_placement p ON p.shardid = get_shard_id_for_distribution_column('idemgate_records', s.t) ORDER BY s.i",
        )?;
        let mut on: Vec<Vec<String>> = vec![Vec::new(); self.workers.len()];
        for row in rows {
            let (Some(Some(tenant)), Some(Some(port))) = (row.first(), row.get(1)) else { continue };
            if let Some(w) = self.workers.iter().position(|w| w.port().to_string() == *port)
                && on[w].len() < per_worker
            {
                on[w].push(tenant.clone());
            }
        }
        if on.iter().any(|t| t.len() < per_worker) {
            return Err(io::Error::other(format!("not {per_worker} tenants on every worker among tenant-00..tenant-255: {on:?}")));
        }
        Ok(on)
    }

    /// `url` (the coordinator's, as [`create_database`](Self::create_database)
    /// returns it) listing every node, the coordinator first.
    pub fn every_node_url(&self, url: &str) -> String {
        self.nodes_url(url, &self.nodes().collect::<Vec<_>>())
    }

    /// `url` (the coordinator's) listing `nodes`, in that order.
    pub fn nodes_url(&self, url: &str, nodes: &[&PgServer]) -> String {
        let db = url.rsplit('/').next().unwrap_or_default();
        let hosts: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port())).collect();
        let one = self.coordinator.url(db);
        one.replacen(&format!("127.0.0.1:{}", self.coordinator.port()), &hosts.join(","), 1)
    }

    /// A database on the coordinator alone, without the extension (for the
    /// start-up error of `kind = "citus"` on a plain server).
    pub fn plain_database(&self, name: &str) -> io::Result<String> {
        self.coordinator.create_database(name)
    }
}

fn annotate(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// The cluster of this test binary (a coordinator and two workers), started
/// on first use and stopped by the nodes' watchdogs when the process exits.
///
/// Panics if it cannot be started, with the reason, in every test that asks.
pub fn shared() -> &'static CitusCluster {
    static SHARED: OnceLock<Result<CitusCluster, String>> = OnceLock::new();
    match SHARED.get_or_init(|| CitusCluster::start(2).map_err(|e| e.to_string())) {
        Ok(cluster) => cluster,
        Err(e) => panic!("could not start the shared test Citus cluster: {e}"),
    }
}

/// Waits until a new connection to `node` finds `ssl` on. The first
/// `CREATE EXTENSION citus` on a node turns TLS on with `ALTER SYSTEM` and
/// `pg_reload_conf()`, which the postmaster applies a moment later; until
/// then the other nodes' `sslmode=require` connections to it fail ("server
/// does not support SSL"), as they would for a user who ran
/// `citus_add_node` in that moment.
fn wait_for_tls(node: &PgServer, db: &str) -> io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = node.simple_query(db, "SHOW ssl")?;
        if rows.first().and_then(|r| r.first()).and_then(|v| v.as_deref()) == Some("on") {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(io::Error::other(format!("ssl still off on port {} 10 s after CREATE EXTENSION citus", node.port())));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
