//! The store on a Citus cluster (issue 30, CONTRACT.md section 10): the
//! test cluster itself, what `idemgate migrate` creates there, and the
//! start-up errors of a store kind that does not match the server.
//!
//! Every test steps aside, with one line on stderr, when Citus is not
//! installed (`IDEMGATE_TEST_CITUS=required` makes that a failure).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::store::{Access, Store, StoreError};
use support::citus;

fn config(backend: StoreBackend) -> StoreConfig {
    StoreConfig {
        backend,
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: Duration::from_secs(30),
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    }
}

fn citus_store(url: &str) -> StoreConfig {
    config(StoreBackend::Citus { url: Secret::new(url.to_owned()), pool_size: 2, pooler: Default::default() })
}

fn postgres_store(url: &str) -> StoreConfig {
    config(StoreBackend::Postgres { url: Secret::new(url.to_owned()), pool_size: 2, pooler: Default::default() })
}

async fn migrate(config: &StoreConfig) -> Result<Vec<String>, StoreError> {
    Store::open(config, Access::Migrate).await?.migrate().await
}

async fn client(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    client
}

/// The harness: a coordinator and two workers, each test database with the
/// extension on every node and both workers active.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_test_cluster_has_a_coordinator_and_two_active_workers() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    eprintln!("cluster started in {:?}", cluster.startup_time());
    let url = cluster.create_unique_database("harness").expect("database");
    let db = client(&url).await;
    let workers: Vec<i64> =
        db.query("SELECT node_port FROM citus_get_active_worker_nodes() ORDER BY 1", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    let mut expected: Vec<i64> = cluster.workers.iter().map(|w| i64::from(w.port())).collect();
    expected.sort();
    assert_eq!(workers, expected);
    let version: String = db.query_one("SELECT extversion FROM pg_extension WHERE extname = 'citus'", &[]).await.unwrap().get(0);
    assert!(version.starts_with("13."), "{version}");
    // Citus's defaults: TLS on every node, with the certificate it made,
    // and between the nodes.
    for node in cluster.nodes() {
        let name = url.rsplit('/').next().unwrap();
        let rows = node.simple_query(name, "SELECT current_setting('ssl'), current_setting('citus.node_conninfo')").unwrap();
        assert_eq!(rows[0], [Some("on".to_owned()), Some("sslmode=require".to_owned())], "node on port {}", node.port());
    }
    // The store, given the coordinator's URL without sslmode, speaks TLS to it.
    let store = Store::open(&citus_store(&url), Access::Migrate).await.expect("store");
    store.migrate().await.expect("migrate over TLS, with Citus's own certificate");
    store.ping().await.expect("ping");
    let encrypted: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE s.ssl AND a.application_name = 'idemgate'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(encrypted >= 1, "the store's sessions to the coordinator are encrypted");
}

/// `migrate` with kind = "citus": records, events and audit distributed by
/// tenant and colocated, settings a reference table, the events and audit
/// keys with the tenant; a second run applies nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_distributes_the_schema_by_tenant() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("migrate").expect("database");
    let applied = migrate(&citus_store(&url)).await.expect("migrate");
    assert!(applied.iter().any(|m| m == "citus_0001_distribute"), "{applied:?}");
    assert_eq!(migrate(&citus_store(&url)).await.expect("second migrate"), Vec::<String>::new());

    let db = client(&url).await;
    let tables: Vec<(String, String, Option<String>, i32)> = db
        .query(
            "SELECT table_name::text, citus_table_type, distribution_column, colocation_id FROM citus_tables \
             WHERE table_name::text LIKE 'idemgate%' ORDER BY 1",
            &[],
        )
        .await
        .expect("citus_tables")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let names: Vec<&str> = tables.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(
        names,
        [
            "idemgate_audit",
            "idemgate_events",
            "idemgate_generations",
            "idemgate_records",
            "idemgate_schema_migrations",
            "idemgate_settings"
        ],
        "{tables:?}"
    );
    let records = tables.iter().find(|t| t.0 == "idemgate_records").expect("records").3;
    for (name, kind, column, colocation) in &tables {
        if name == "idemgate_settings" || name == "idemgate_schema_migrations" {
            assert_eq!(kind, "reference", "{name}");
        } else {
            assert_eq!((kind.as_str(), column.as_deref()), ("distributed", Some("tenant")), "{name}");
            assert_eq!(*colocation, records, "{name} is colocated with the records");
        }
    }
    // The generation sequence is gone (each tenant's counter replaces it).
    let sequence: Option<String> = db.query_one("SELECT to_regclass('idemgate_generation')::text", &[]).await.expect("regclass").get(0);
    assert_eq!(sequence, None);
    // The unique keys of the outbox and the audit trail contain the tenant.
    let keys: Vec<(String, String)> = db
        .query(
            "SELECT c.relname::text, pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             JOIN pg_class t ON t.oid = i.indrelid WHERE i.indisunique AND t.relname IN ('idemgate_events', 'idemgate_audit') ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(keys.len(), 3, "{keys:?}");
    for (name, def) in &keys {
        assert!(def.contains("tenant"), "{name}: {def}");
    }
    // The migrations' bookkeeping is on every node (a reference table: a
    // replica on a worker finds the schema up to date), and so is what a
    // worker needs to tell so: each worker reads the Citus migrations as applied.
    for w in &citus::shared().workers {
        let on_worker = client(&w.url(url.rsplit('/').next().expect("database"))).await;
        let versions: i64 = on_worker
            .query_one("SELECT count(*) FROM idemgate_schema_migrations WHERE name LIKE 'citus_%'", &[])
            .await
            .expect("migrations on a worker")
            .get(0);
        assert_eq!(versions, 2, "worker {}", w.port());
    }
}

/// A schema distributed by an earlier version gets the later PostgreSQL
/// migrations on its distributed tables (Citus propagates their `ALTER
/// TABLE` to every shard): migration 14's column, dropped and forgotten here
/// to stand for a cluster migrated before it existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn later_migrations_reach_an_already_distributed_schema() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("upgrade").expect("database");
    migrate(&citus_store(&url)).await.expect("migrate");
    let db = client(&url).await;
    db.batch_execute("ALTER TABLE idemgate_records DROP COLUMN at_upstream_until").await.expect("drop the column");
    db.execute("DELETE FROM idemgate_schema_migrations WHERE version = 14", &[]).await.expect("forget migration 14");
    assert_eq!(migrate(&citus_store(&url)).await.expect("migrate again"), ["0014_attempt_bound"]);
    let on_every_shard: bool = db
        .query_one(
            "SELECT bool_and(success) AND count(*) > 1 FROM run_command_on_shards('idemgate_records', \
             $$SELECT count(at_upstream_until) FROM %s$$)",
            &[],
        )
        .await
        .expect("run_command_on_shards")
        .get(0);
    assert!(on_every_shard, "the column is on every shard");
}

/// A URL that lists every node, a worker first (the store's pool keeps the
/// first host that answers, here a worker, where schema changes are
/// refused): `migrate` runs on the host that says it is the coordinator,
/// and the schema is distributed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_listing_a_worker_first_migrates_on_the_coordinator() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let url = cluster.create_unique_database("worker_first").expect("database");
    let workers_first = cluster.nodes_url(&url, &[&cluster.workers[0], &cluster.workers[1], &cluster.coordinator]);
    let applied = migrate(&citus_store(&workers_first)).await.expect("migrate through a URL listing a worker first");
    assert!(applied.iter().any(|m| m.starts_with("citus_0001")), "the Citus migrations ran: {applied:?}");
    assert_distributed(&url).await;
    assert!(migrate(&citus_store(&workers_first)).await.expect("migrate again").is_empty(), "nothing left to apply");
}

/// A node listed first whose metadata was never synced (the extension
/// created, the node not added to the cluster) is node group 0, as the
/// coordinator is; it is not taken for the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_not_yet_added_listed_first_is_not_taken_for_the_coordinator() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let name = format!("unadded_{}", std::process::id());
    let url = tokio::task::block_in_place(|| cluster.create_database_adding(&name, &[0])).expect("database, worker 1 not added");
    let group: String = client(&cluster.nodes_url(&url, &[&cluster.workers[1]]))
        .await
        .query_one("SELECT groupid::text FROM pg_dist_local_group", &[])
        .await
        .expect("its group")
        .get(0);
    assert_eq!(group, "0", "the node not added says group 0");
    let unadded_first = cluster.nodes_url(&url, &[&cluster.workers[1], &cluster.coordinator]);
    let applied = migrate(&citus_store(&unadded_first)).await.expect("migrate through a URL listing the node not added first");
    assert!(applied.iter().any(|m| m.starts_with("citus_0001")), "the Citus migrations ran: {applied:?}");
    assert_distributed(&url).await;
}

/// With the coordinator down, a store whose URL lists every node migrates
/// through a worker, which finds the schema up to date (before: the store
/// kept the coordinator's pool once a host had said it was group 0, in the
/// first migrate, and failed). A cluster of its own: its coordinator is
/// stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_coordinator_down_an_up_to_date_schema_is_found_through_a_worker() {
    if citus::skip_unless_installed() {
        return;
    }
    let mut cluster = tokio::task::block_in_place(|| citus::CitusCluster::start(2)).expect("a cluster of its own");
    let url = tokio::task::block_in_place(|| cluster.create_database("coordinator_down")).expect("database");
    let every = cluster.every_node_url(&url);
    let store = Store::open(&citus_store(&every), Access::Migrate).await.expect("open");
    assert!(!store.migrate().await.expect("migrate").is_empty(), "the first migrate applies");
    tokio::task::block_in_place(|| cluster.coordinator.stop_immediate()).expect("stop the coordinator");
    let again = store.migrate().await.expect("migrate with the coordinator down, through a worker");
    assert!(again.is_empty(), "nothing to apply: {again:?}");
}

/// With no host answering as the coordinator, a schema that needs
/// migrating is not migrated through the store's pool: its first host here
/// is a node not yet added, where Citus would build a cluster of its own
/// (it takes itself for the coordinator when its node list is empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_coordinator_answering_a_node_not_yet_added_is_not_migrated() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let name = format!("no_coordinator_{}", std::process::id());
    let url = tokio::task::block_in_place(|| cluster.create_database_adding(&name, &[0])).expect("database, worker 1 not added");
    let unadded = cluster.nodes_url(&url, &[&cluster.workers[1]]);
    // A second host where nothing listens: the coordinator, down.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port").local_addr().expect("its address").port();
    let port = cluster.workers[1].port();
    let url_of_two = unadded.replacen(&format!("127.0.0.1:{port}"), &format!("127.0.0.1:{port},127.0.0.1:{dead}"), 1);
    let refused = migrate(&citus_store(&url_of_two)).await.expect_err("no migration without the coordinator");
    assert!(refused.to_string().contains("coordinator"), "the error says why: {refused}");
    let tables: i64 = client(&unadded)
        .await
        .query_one("SELECT count(*) FROM pg_class WHERE relname = 'idemgate_records'", &[])
        .await
        .expect("pg_class")
        .get(0);
    assert_eq!(tables, 0, "nothing was built on the node not yet added");
}

/// The records are distributed, as the coordinator of `url` says.
async fn assert_distributed(url: &str) {
    let db = client(url).await;
    let distributed: i64 = db
        .query_one("SELECT count(*) FROM pg_dist_partition WHERE logicalrelid = 'idemgate_records'::regclass", &[])
        .await
        .expect("pg_dist_partition")
        .get(0);
    assert_eq!(distributed, 1, "the records are distributed, as the coordinator says");
}

/// New backends started on the nodes' database since the last call (each
/// node's `pg_stat_database.sessions`, summed; `readers` are one session
/// per node, opened before the first call so they count only once).
async fn sessions_started(readers: &[tokio_postgres::Client], db: &str) -> i64 {
    let mut sum = 0;
    for reader in readers {
        let row = reader.query_one("SELECT sessions FROM pg_stat_database WHERE datname = $1", &[&db]).await.expect("sessions");
        sum += row.get::<_, i64>(0);
    }
    sum
}

/// The gauges (`stats`, `event_stats`: statements over every shard, which
/// each replica runs every few seconds) start no backend on the nodes. With
/// Citus's default executor pool a node's shard tasks that outlast its slow
/// start (10 ms) got connections of their own, closed again when the
/// statement ended: a fork and a TLS handshake on a node per task, every
/// round, per replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gauge_rounds_start_no_backend_on_the_nodes() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let url = cluster.create_unique_database("gauges").expect("database");
    let db = url.rsplit('/').next().expect("database name").to_owned();
    migrate(&citus_store(&url)).await.expect("migrate");
    // Open records enough that a shard's task outlasts the slow start.
    client(&url)
        .await
        .batch_execute(
            "INSERT INTO idemgate_records (tenant, principal, operation, idempotency_key, request_hash, state, generation, \
             claim_token, owner, created_at, updated_at, expires_at, scope_id) \
             SELECT 't' || (g % 32), 'p', 'op', 'k' || g, '\\x00', 'unknown', g, gen_random_uuid(), 'test', now(), now(), \
             now() + interval '1 hour', g FROM generate_series(1, 200000) g",
        )
        .await
        .expect("open records");
    let every = cluster.nodes_url(&url, &[&cluster.coordinator, &cluster.workers[0], &cluster.workers[1]]);
    // One session in the store's pool: a second one would connect to the
    // nodes (Citus's cached connections) on its first gauge.
    let one_session = config(StoreBackend::Citus { url: Secret::new(every), pool_size: 1, pooler: Default::default() });
    let store = Store::open(&one_session, Access::Existing).await.expect("open the store");
    let mut readers = Vec::new();
    for node in cluster.nodes() {
        readers.push(client(&node.url(&db)).await);
    }
    // The first round connects (the store's session, and its one cached
    // connection to each node); the router's first look at the nodes opens
    // a session on each. Counted from when nothing more is starting.
    store.stats().await.expect("stats");
    store.event_stats().await.expect("event stats");
    let mut before = sessions_started(&readers, &db).await;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let now = sessions_started(&readers, &db).await;
        if now == before {
            break;
        }
        before = now;
    }
    for _ in 0..5 {
        let open: i64 = store.stats().await.expect("stats").iter().map(|c| c.count).sum();
        assert_eq!(open, 200_000, "the gauge counts every open record");
        store.event_stats().await.expect("event stats");
    }
    // Statistics of a backend that ended are in; a live one's reach the
    // shared counters within a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = sessions_started(&readers, &db).await - before;
    assert_eq!(started, 0, "backends started on the nodes by five gauge rounds");
}

/// Two `migrate`s at once on the coordinator: serialized (the advisory
/// lock), each migration applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_migrations_are_serialized_on_the_coordinator() {
    if citus::skip_unless_installed() {
        return;
    }
    let url = citus::shared().create_unique_database("race").expect("database");
    let (ca, cb) = (citus_store(&url), citus_store(&url));
    let (a, b) = tokio::join!(migrate(&ca), migrate(&cb));
    let (a, b) = (a.expect("first migrate"), b.expect("second migrate"));
    assert!(a.is_empty() != b.is_empty(), "exactly one run applies the migrations: {a:?} / {b:?}");
    let db = client(&url).await;
    let n: i64 = db.query_one("SELECT count(*) FROM idemgate_schema_migrations", &[]).await.unwrap().get(0);
    assert_eq!(n as usize, a.len().max(b.len()));
}

/// The start-up errors: kind = "citus" on a server without the extension,
/// kind = "postgres" on a distributed schema, and kind = "citus" on a
/// single-node schema (not converted), each saying which.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_kind_that_does_not_match_the_server_is_refused_at_start() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let plain = cluster.plain_database(&format!("plain_{}", std::process::id())).expect("database");
    let e = migrate(&citus_store(&plain)).await.expect_err("kind = citus without the extension");
    assert!(matches!(e, StoreError::Migration(_)), "{e:?}");
    assert!(e.to_string().contains("store.kind = \"citus\", but this server has no Citus extension"), "{e}");
    let tables: i64 =
        client(&plain).await.query_one("SELECT count(*) FROM pg_class WHERE relname LIKE 'idemgate%'", &[]).await.unwrap().get(0);
    assert_eq!(tables, 0, "nothing was created");

    let distributed = cluster.create_unique_database("dist").expect("database");
    migrate(&citus_store(&distributed)).await.expect("migrate as citus");
    let e = migrate(&postgres_store(&distributed)).await.expect_err("kind = postgres on a distributed schema");
    assert!(e.to_string().contains("store.kind = \"postgres\", but this database's idemgate schema is distributed by Citus"), "{e}");

    let single = cluster.create_unique_database("single").expect("database");
    migrate(&postgres_store(&single)).await.expect("migrate as postgres on a Citus server");
    let e = migrate(&citus_store(&single)).await.expect_err("kind = citus on a single-node schema");
    assert!(e.to_string().contains("holds an idemgate schema that is not distributed"), "{e}");
}

/// A PostgreSQL store (kind = "postgres") on a database that has the Citus
/// extension but whose schema is not distributed: what Citus's Docker image
/// gives in its default database. Every final state is written and its
/// event delivered, as on plain PostgreSQL, on a database migrated afresh,
/// and on one that an earlier version migrated (it recorded the event log's
/// migrations and created nothing, so every result write failed): the next
/// `migrate` applies them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_store_on_a_database_with_the_citus_extension_writes_and_delivers() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let fresh = cluster.create_unique_database("pg_on_citus").expect("database");
    let db = client(&fresh).await;
    let extension: bool = db.query_one("SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'citus')", &[]).await.unwrap().get(0);
    assert!(extension, "the test database has the extension");
    crate::events::final_state_changes_are_delivered_signed_once_each(support::Backend::Postgres { url: fresh.clone() }).await;

    let earlier = cluster.create_unique_database("pg_on_citus_earlier").expect("database");
    migrate(&postgres_store(&earlier)).await.expect("migrate");
    // What an earlier version left: the log's migrations recorded, no log.
    let db = client(&earlier).await;
    db.batch_execute(
        "DROP TABLE idemgate_event_log, idemgate_event_lanes, idemgate_event_rotation; \
         DROP FUNCTION idemgate_event_slot(), idemgate_log_event_id(), idemgate_log_event_id(bigint), idemgate_rotate_event_log(bigint)",
    )
    .await
    .expect("drop the log");
    let recorded: i64 =
        db.query_one("SELECT count(*) FROM idemgate_schema_migrations WHERE version IN (15, 16, 17)", &[]).await.unwrap().get(0);
    assert_eq!(recorded, 3);
    let checked = check_config("postgres", &earlier);
    let line = checked.lines().find(|l| l.starts_with("store schema: ")).unwrap_or_else(|| panic!("{checked}"));
    assert!(
        line.contains("3 migration(s) not applied") && line.contains("0015_event_log, 0016_event_log_seq, 0017_event_log_floor"),
        "{line}"
    );
    let applied = migrate(&postgres_store(&earlier)).await.expect("migrate again");
    assert_eq!(applied, ["0015_event_log", "0016_event_log_seq", "0017_event_log_floor"]);
    assert_eq!(migrate(&postgres_store(&earlier)).await.expect("up to date"), Vec::<String>::new());
    let checked = check_config("postgres", &earlier);
    assert!(checked.contains("store schema: ok (all 19 migrations applied)"), "{checked}");
    crate::events::final_state_changes_are_delivered_signed_once_each(support::Backend::Postgres { url: earlier }).await;
}

/// What `idemgate check-config --connect` prints for a store of `kind` at
/// `url` (one route, its upstream a bound port nothing answers on).
fn check_config(kind: &str, url: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let upstream = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let config = format!(
        "[store]\nkind = \"{kind}\"\nurl = \"{url}\"\n\
         [[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{}\", tenant = \"t\", principal = \"p\" }} ]\n\
         [[upstreams]]\nname = \"u\"\nurl = \"http://{}\"\n\
         [[routes]]\noperation = \"op\"\nmethod = \"POST\"\npath = \"/op\"\nupstream = \"u\"\n",
        "0".repeat(64),
        upstream.local_addr().unwrap()
    );
    let path = dir.path().join("c.toml");
    std::fs::write(&path, config).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["check-config", "--connect", "--config"])
        .arg(&path)
        .env_remove("IDEMGATE_CONFIG")
        .env("IDEMGATE_LOG", "warn")
        .output()
        .expect("run idemgate");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// `check-config --connect` on kind = "citus" reports the cluster: the
/// active workers and whether the schema is distributed (before and after
/// `migrate`), and the start-up error on a server without the extension.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_reports_the_nodes_and_the_distributed_schema() {
    if citus::skip_unless_installed() {
        return;
    }
    let cluster = citus::shared();
    let url = cluster.create_unique_database("check").expect("database");
    let check = |url: &str| check_config("citus", url);
    let before = check(&url);
    assert!(before.contains("store cluster: ok (a coordinator and 2 active worker node(s); no idemgate schema yet"), "{before}");
    migrate(&citus_store(&url)).await.expect("migrate");
    let after = check(&url);
    assert!(
        after.contains("store cluster: ok (a coordinator and 2 active worker node(s); the schema is distributed by tenant)"),
        "{after}"
    );
    // Given every node: the replica's pool for each node's tenants and
    // Citus's connections from its store's sessions on every node, its store
    // pool on the first too.
    let every = cluster.nodes_url(&url, &[&cluster.workers[0], &cluster.coordinator, &cluster.workers[1]]);
    let nodes = check(&every);
    let line = nodes.lines().find(|l| l.starts_with("store connections: ok (")).unwrap_or_else(|| panic!("{nodes}"));
    let [first, coordinator, second] = [cluster.workers[0].port(), cluster.coordinator.port(), cluster.workers[1].port()];
    assert!(line.contains(&format!("127.0.0.1:{first}: ")) && line.contains(&format!("127.0.0.1:{second}: ")), "{line}");
    let part = |port: u16| line.split("; ").find(|p| p.contains(&format!("127.0.0.1:{port}: "))).unwrap_or_else(|| panic!("{line}"));
    assert!(part(first).ends_with("this replica up to about 48"), "{line}");
    assert!(part(coordinator).ends_with("this replica up to about 32") && part(second).ends_with("this replica up to about 32"), "{line}");
    // A node that does not answer is named; the other lines stand.
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let with_gone = every.replacen(&format!("127.0.0.1:{second}"), &format!("127.0.0.1:{gone}"), 1);
    let out = check(&with_gone);
    assert!(out.lines().any(|l| l.starts_with(&format!("store connections: error: 127.0.0.1:{gone}: "))), "{out}");
    assert!(out.lines().any(|l| l.starts_with("store cluster: ok (")), "{out}");
    let plain = cluster.plain_database(&format!("plain_check_{}", std::process::id())).expect("database");
    let refused = check(&plain);
    assert!(refused.contains("store cluster: ") && refused.contains("has no Citus extension"), "{refused}");
}

mod isolation {
    //! A big tenant given a shard of its own and moved to another worker.
    use super::*;
    use bytes::Bytes;
    use idemgate::idempotency::fingerprint::Fingerprint;
    use idemgate::idempotency::key::{IdempotencyKey, Scope};
    use idemgate::idempotency::record::{Retention, State, StoredResponse};
    use idemgate::store::postgres::Flavor;
    use idemgate::store::postgres::citus_sql::catalog_for;
    use idemgate::store::postgres::sql::session_settings;
    use idemgate::store::{ClaimOutcome, ClaimRequest, WriteOutcome};
    use uuid::Uuid;

    const LONG: Duration = Duration::from_secs(600);

    fn scope(tenant: &str, key: &str) -> Scope {
        Scope {
            tenant: tenant.into(),
            principal: "billing".into(),
            operation: "create_order".into(),
            key: IdempotencyKey::new(key).unwrap(),
        }
    }

    fn req(scope: &Scope) -> ClaimRequest {
        ClaimRequest {
            scope: scope.clone(),
            request_hash: Fingerprint([7; 32]),
            owner: "replica-a".into(),
            lease: LONG,
            reforward: None,
            sent: idemgate::idempotency::record::ReforwardKey::Derived,
            fingerprint_spec: "test-settings".into(),
            claim_token: Uuid::new_v4(),
            acceptance: None,
            key_source: "header:idempotency-key".into(),
            request_head: None,
        }
    }

    fn body(key: &str) -> Bytes {
        Bytes::from(format!("done {key}"))
    }

    /// Claims `key` of `tenant` (it must be new) and records its response.
    async fn first_write(store: &Store, tenant: &str, key: &str) {
        let claim = match store.claim(&req(&scope(tenant, key))).await.expect("claim") {
            ClaimOutcome::Claimed(c) => c,
            other => panic!("{tenant}/{key}: a new key was not claimed: {other:?}"),
        };
        let response = StoredResponse { status: 201, headers: vec![], body: Some(body(key)) };
        assert_eq!(store.complete(&claim, &response, Retention::For(LONG)).await.expect("complete"), WriteOutcome::Written);
    }

    /// The shard of `tenant`'s records and the worker port holding it.
    async fn placement(db: &tokio_postgres::Client, tenant: &str) -> (i64, i32) {
        let row = db
            .query_one(
                "SELECT s.shardid, s.nodeport FROM citus_shards s \
                 WHERE s.shardid = get_shard_id_for_distribution_column('idemgate_records', $1::text)",
                &[&tenant],
            )
            .await
            .expect("placement");
        (row.get(0), row.get(1))
    }

    /// The request path's statements for `tenant` (every text parameter
    /// `tenant`), as a gateway session plans them: each must be one task on
    /// `shard`.
    async fn assert_one_task_on(url: &str, tenant: &str, shard: i64) {
        let db = client(url).await;
        for (name, value) in session_settings(Flavor::Citus) {
            db.batch_execute(&format!("SET {name} = '{value}'")).await.expect("session setting");
        }
        let catalog = catalog_for(Flavor::Citus);
        let statements =
            ["claim_read", "claim_insert", "claim_take_over", "complete", "complete_of_tenant", "generations_of_tenant", "get"];
        for (i, name) in statements.into_iter().enumerate() {
            let s = catalog.iter().find(|s| s.name == name).expect("statement in the catalog");
            // The statements that name their tenant name `acme` in the catalog.
            let sql = s.sql.replace("'acme'", &format!("'{tenant}'"));
            db.batch_execute(&format!("PREPARE isolated_{i} AS {sql}")).await.expect("prepare");
            let types: Vec<String> = db
                .query_one(
                    "SELECT coalesce(parameter_types::text[], '{}') FROM pg_prepared_statements WHERE name = $1",
                    &[&format!("isolated_{i}")],
                )
                .await
                .expect("parameter types")
                .get(0);
            let args: Vec<String> = types
                .iter()
                .map(|t| match t.as_str() {
                    "text" => format!("'{tenant}'::text"),
                    "bigint" => "1::int8".into(),
                    "integer" => "200::int4".into(),
                    "bytea" => "'\\x00'::bytea".into(),
                    "uuid" => "'00000000-0000-0000-0000-000000000001'::uuid".into(),
                    "boolean" => "false".into(),
                    other => format!("NULL::{other}"),
                })
                .collect();
            let plan: Vec<String> = db
                .query(&format!("EXPLAIN EXECUTE isolated_{i}({})", args.join(", ")), &[])
                .await
                .expect("explain")
                .iter()
                .map(|r| r.get(0))
                .collect();
            let plan = plan.join("\n");
            let tasks: Vec<&str> = plan.lines().filter(|l| l.contains("Task Count:")).collect();
            assert!(!tasks.is_empty() && tasks.iter().all(|l| l.trim_end().ends_with("Task Count: 1")), "{name}:\n{plan}");
            let table = if name.starts_with("generations") { "idemgate_generations" } else { "idemgate_records" };
            assert!(plan.contains(&format!("{table}_")), "{name} does not run on a shard of {table}:\n{plan}");
            if table == "idemgate_records" {
                assert!(plan.contains(&format!("idemgate_records_{shard} ")), "{name} does not run on shard {shard}:\n{plan}");
            }
        }
    }

    /// `tenant`'s completed keys replay, a new key is claimed and completed.
    async fn assert_served(store: &Store, tenant: &str, keys: &[&str], new_key: &str) {
        for key in keys {
            match store.claim(&req(&scope(tenant, key))).await.expect("claim") {
                ClaimOutcome::Existing { record, .. } => {
                    assert_eq!(record.state, State::Completed, "{tenant}/{key}");
                    assert_eq!(record.response.and_then(|r| r.body), Some(body(key)), "{tenant}/{key}");
                }
                other => panic!("{tenant}/{key}: a completed key was not replayed: {other:?}"),
            }
            let (record, _) = store.get(&scope(tenant, key)).await.expect("get").expect("record");
            assert_eq!(record.state, State::Completed);
        }
        first_write(store, tenant, new_key).await;
        let (record, _) = store.get(&scope(tenant, new_key)).await.expect("get").expect("record");
        assert_eq!((record.state, record.response.and_then(|r| r.body)), (State::Completed, Some(body(new_key))));
    }

    /// docs/scaling.md's guide: `isolate_tenant_to_new_shard` (with
    /// `CASCADE` for the colocated events and audit trail, and
    /// `shard_transfer_mode => 'block_writes'`: the default needs `wal_level =
    /// logical`) gives the tenant a shard of its own, and
    /// `citus_move_shard_placement` moves it to the other worker. Before and
    /// after each step the tenant's records replay, a new key is claimed and
    /// completed, and the request path's statements are one task on the
    /// tenant's shard; the other tenant stays where it was.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_isolated_and_moved_tenant_is_served_by_one_task_plans_on_its_shard() {
        if citus::skip_unless_installed() {
            return;
        }
        let url = citus::shared().create_unique_database("isolate").expect("database");
        let store = Store::open(&citus_store(&url), Access::Migrate).await.expect("store");
        store.migrate().await.expect("migrate");
        let keys = ["k0", "k1", "k2"];
        for tenant in ["big", "small"] {
            for key in keys {
                first_write(&store, tenant, key).await;
            }
        }
        let db = client(&url).await;
        let (shared_shard, _) = placement(&db, "big").await;
        let small_before = placement(&db, "small").await;

        let isolated: i64 = db
            .query_one(
                "SELECT isolate_tenant_to_new_shard('idemgate_records', 'big', 'CASCADE', shard_transfer_mode => 'block_writes')",
                &[],
            )
            .await
            .expect("isolate_tenant_to_new_shard")
            .get(0);
        let (shard, from) = placement(&db, "big").await;
        assert_eq!(shard, isolated);
        assert_ne!(shard, shared_shard, "the tenant has a shard of its own");
        let range =
            db.query_one("SELECT shardminvalue, shardmaxvalue FROM pg_dist_shard WHERE shardid = $1", &[&shard]).await.expect("range");
        let (min, max): (String, String) = (range.get(0), range.get(1));
        assert_eq!(min, max, "one hash value: one tenant");
        assert_served(&store, "big", &keys, "k3").await;
        assert_one_task_on(&url, "big", shard).await;

        let to = citus::shared().workers.iter().map(|w| i32::from(w.port())).find(|p| *p != from).expect("another worker");
        db.execute(
            "SELECT citus_move_shard_placement($1, '127.0.0.1', $2, '127.0.0.1', $3, shard_transfer_mode => 'block_writes')",
            &[&shard, &from, &to],
        )
        .await
        .expect("citus_move_shard_placement");
        assert_eq!(placement(&db, "big").await, (shard, to));
        assert_served(&store, "big", &["k0", "k1", "k2", "k3"], "k4").await;
        assert_one_task_on(&url, "big", shard).await;

        // (The isolation split the shared shard: the other tenant's shard has
        // a new id, on the same worker.)
        assert_eq!(placement(&db, "small").await.1, small_before.1, "the other tenant stays on its worker");
        assert_served(&store, "small", &keys, "k3").await;
        let events_and_audit: i64 = db
            .query_one(
                "SELECT count(*) FROM citus_shards WHERE table_name::text IN ('idemgate_events', 'idemgate_audit') \
                 AND nodeport = $1 AND shardid IN (SELECT shardid FROM pg_dist_shard WHERE shardminvalue = $2)",
                &[&to, &min],
            )
            .await
            .expect("colocated shards")
            .get(0);
        assert_eq!(events_and_audit, 2, "the tenant's events and audit shards moved with its records");
    }
}
