//! Shared test harness: a private PostgreSQL, a side-effect-counting
//! upstream, the real gateway binary, and a small client.
#![allow(dead_code, unused_imports)]
// Real processes, real sockets: the harness waits on the wall clock.
#![allow(clippy::disallowed_types)]

/// Generates, for each named `async fn(Backend)`, one test on PostgreSQL (a
/// fresh database on the shared private cluster) and one on SQLite: the same
/// scenario, never a copy. Use with `#[macro_use] mod support;`.
#[allow(unused_macros)]
macro_rules! on_both_stores {
    ($($name:ident),* $(,)?) => {
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::support::postgres_backend()).await
                }
            )*
        }
        mod on_sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::support::sqlite_backend()).await
                }
            )*
        }
    };
}

/// Runs each named `async fn(Backend)` on PostgreSQL behind PgBouncer in
/// transaction mode (`store.pooler = "transaction"`), in a module
/// `on_pgbouncer`.
#[allow(unused_macros)]
macro_rules! on_pgbouncer {
    ($($name:ident),* $(,)?) => {
        mod on_pgbouncer {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(super::support::pgbouncer_backend()).await
                }
            )*
        }
    };
}

/// Runs each named `async fn(Backend)` on a Citus cluster too (a fresh
/// database on this binary's shared cluster, `support::citus`), in a module
/// `on_citus`, beside [`on_both_stores!`]'s PostgreSQL and SQLite runs. The
/// Citus cases step aside with one line on stderr when Citus is not
/// installed (see `citus::skip_unless_installed`).
#[allow(unused_macros)]
macro_rules! on_citus {
    ($($name:ident),* $(,)?) => {
        mod on_citus {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    if super::support::citus::skip_unless_installed() {
                        return;
                    }
                    super::$name(super::support::citus_backend()).await
                }
            )*
        }
    };
}

pub mod admin;
pub mod citus;
pub mod client;
pub mod faultproxy;
pub mod gateway;
pub mod jwt;
pub mod nginx;
pub mod overloaded;
pub mod pgbouncer;
pub mod postgres;
pub mod serve;
pub mod soak;
pub mod tls;
pub mod upstream;
pub mod webhook;

use std::sync::atomic::{AtomicU64, Ordering};

use std::time::{Duration, Instant};

use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::Record;
use idemgate::store::Store;

pub use client::{Resp, post, send, try_post};
pub use gateway::{Backend, Gateway, GatewayConfig, PRINCIPAL, TENANT, TEST_SECRET};
pub use upstream::TestUpstream;

/// Whether a missing real component (a framework, gunicorn) fails its test
/// instead of skipping it: `IDEMGATE_TEST_FRAMEWORKS=required`, or in CI
/// (`CI` set), where scripts/test has installed them.
pub fn real_components_required() -> bool {
    std::env::var("IDEMGATE_TEST_FRAMEWORKS").is_ok_and(|v| v == "required")
        || std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false")
}

/// Whether `probe` (a command that loads the component) succeeds. A component
/// that is missing fails the test where real components are required
/// (scripts/test installs them); elsewhere the test says so and steps aside.
pub fn installed(mut probe: std::process::Command, what: &str) -> bool {
    use std::process::Stdio;
    let ok = probe.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    if !ok {
        assert!(!real_components_required(), "{what} is not installed; scripts/test installs it");
        eprintln!("{what} is not installed: skipped (scripts/test installs it)");
    }
    ok
}

/// A fresh database on this test binary's private PostgreSQL cluster.
pub fn postgres_backend() -> Backend {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!("t{}_{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
    let url = postgres::shared().create_database(&name).expect("create test database");
    Backend::Postgres { url }
}

/// A fresh database on this test binary's private PostgreSQL cluster,
/// reached through its PgBouncer in transaction mode (`support::pgbouncer`).
pub fn pgbouncer_backend() -> Backend {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = format!("b{}_{}", std::process::id(), N.fetch_add(1, Ordering::SeqCst));
    let direct = postgres::shared().create_database(&name).expect("create test database");
    Backend::Pooled { url: pgbouncer::shared_transaction().url(&name), direct, pooler: "transaction" }
}

/// A fresh database on this test binary's private Citus cluster (Citus must
/// be installed: see `citus::skip_unless_installed`), its URL the
/// coordinator's. (Given every node, the suite fails: migrations reach a
/// worker when the store's pool walked past a slow coordinator, and the
/// outbox's `seq` comes from the sequence range of the node a statement
/// entered, so events written through different nodes are not in write
/// order; docs/scaling.md, "Gateways on every node".)
pub fn citus_backend() -> Backend {
    let url = citus::shared().create_unique_database("c").expect("create Citus test database");
    Backend::Citus { url }
}

/// The collation of each scope column (`tenant`, `principal`, `operation`,
/// `idempotency_key`) of `table`, as `(column, collation)` in column order;
/// migration 0009 makes them all `C`.
pub async fn scope_collations(db: &tokio_postgres::Client, table: &str) -> Vec<(String, String)> {
    let rows = db
        .query(
            "SELECT a.attname::text, coalesce(l.collname::text, '(none)') \
             FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid LEFT JOIN pg_collation l ON l.oid = a.attcollation \
             WHERE c.relname = $1 AND a.attname IN ('tenant', 'principal', 'operation', 'idempotency_key') ORDER BY a.attnum",
            &[&table],
        )
        .await
        .expect("pg_attribute");
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

/// The columns of the records' primary key, in the key's order.
pub async fn primary_key_columns(db: &tokio_postgres::Client) -> Vec<String> {
    let rows = db
        .query(
            "SELECT a.attname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
             CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) \
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum \
             WHERE c.relname = 'idemgate_records_pkey' ORDER BY k.n",
            &[],
        )
        .await
        .expect("pg_index");
    rows.iter().map(|r| r.get(0)).collect()
}

/// A fresh SQLite file in a temp directory that is deleted when the last
/// clone of the backend (held by the test and its gateway configs) is dropped.
pub fn sqlite_backend() -> Backend {
    let dir = tempfile::Builder::new().prefix("idemgate-sqlite-").tempdir().expect("tempdir");
    Backend::Sqlite { path: dir.path().join("idemgate.db"), dir: Some(std::sync::Arc::new(dir)) }
}

/// The scope a test client's key lands in.
pub fn scope(key: &str) -> Scope {
    scope_for(PRINCIPAL, "create_order", key)
}

pub fn scope_for(principal: &str, operation: &str, key: &str) -> Scope {
    Scope { tenant: TENANT.into(), principal: principal.into(), operation: operation.into(), key: IdempotencyKey::new(key).unwrap() }
}

/// The key the upstream sees for a client key (test gateways are configured
/// with `TEST_SECRET`).
pub fn derived(key: &str) -> String {
    scope(key).derived_key(Some(TEST_SECRET.as_bytes()))
}

pub async fn record(store: &Store, key: &str) -> Option<Record> {
    store.get(&scope(key)).await.expect("store get").map(|(r, _)| r)
}

/// The record once its result write returned: a first request is answered
/// as soon as the upstream's response is read, and its result is written
/// right after, so a record read just after the answer may still be
/// `in_flight` for a moment. Polls for up to 5 s while it is; returns what
/// it last saw.
#[allow(dead_code)]
pub async fn settled_record(store: &Store, key: &str) -> Option<Record> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let rec = record(store, key).await;
        if rec.as_ref().is_none_or(|r| r.state != idemgate::idempotency::record::State::InFlight) || Instant::now() > deadline {
            return rec;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Polls until `f` is true or the timeout passes; returns whether it became true.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `idemgate keys VERB` for one key of the test tenant and principal on
/// `create_order`, then `extra` (e.g. `--release --reason ...`).
pub fn cli_keys(gateway: &Gateway, verb: &str, key: &str, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec!["keys", verb, "--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", key];
    args.extend_from_slice(extra);
    cli(gateway, &args)
}

/// Runs an `idemgate` CLI command against a gateway's config; returns (exit code, stdout, stderr).
pub fn cli(gateway: &Gateway, args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .arg("--config")
        .arg(gateway.config_path())
        .env(gateway::TEST_SECRET_ENV, TEST_SECRET)
        .output()
        .expect("run idemgate cli");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}
