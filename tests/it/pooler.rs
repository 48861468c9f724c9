//! The store behind PgBouncer as a user installs it (Debian's package, its
//! configuration file with only the lines a user must add: see
//! `support::pgbouncer`), in transaction mode and in session mode, with the
//! real binary: `migrate`, `check-config --connect`, first writes, replays,
//! a mismatch, concurrent first writes, a load of 64 clients, and
//! PostgreSQL restarted behind PgBouncer. The upstream sees each operation
//! once, and the gateway logs no store error.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::pgbouncer::{PgBouncer, PoolMode};
use support::postgres::PgServer;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_in_transaction_mode_every_request_answers_as_on_a_direct_connection() {
    behind_pgbouncer(PoolMode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_pgbouncer_in_session_mode_every_request_answers_as_on_a_direct_connection() {
    behind_pgbouncer(PoolMode::Session).await;
}

/// `idemgate <args> --config <file>`: (exit code, stdout and stderr).
fn idemgate(args: &[&str], config: &Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env(gateway::TEST_SECRET_ENV, TEST_SECRET)
        .env("IDEMGATE_LOG", "warn")
        .output()
        .expect("run idemgate");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// Each of `clients` clients posts its share of `keys`, one after another;
/// returns every (key, status, replayed).
async fn concurrent_posts(url: &str, keys: Vec<String>, clients: usize) -> Vec<(String, u16, bool)> {
    let shares: Vec<Vec<String>> = (0..clients).map(|c| keys.iter().skip(c).step_by(clients).cloned().collect()).collect();
    let tasks: Vec<_> = shares
        .into_iter()
        .map(|share| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let mut out = Vec::new();
                for k in share {
                    let r = post(&url, &k, ORDER, &[]).await;
                    out.push((k, r.status, r.replayed()));
                }
                out
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("client task"));
    }
    all
}

/// The gateway's warnings and errors, but for the configuration's hardening
/// advice (the test's URL holds PgBouncer's password inline).
fn complaints(gw: &Gateway) -> Vec<String> {
    gw.logs()
        .lines()
        .filter(|l| l.contains(r#""level":"WARN""#) || l.contains(r#""level":"ERROR""#))
        .filter(|l| !l.contains(r#""hardening":"#))
        .map(str::to_owned)
        .collect()
}

async fn behind_pgbouncer(mode: PoolMode) {
    let mut pg = PgServer::start().expect("a private PostgreSQL");
    let direct = pg.create_database("pooled").expect("database");
    let bouncer = PgBouncer::start(&pg, mode).expect("PgBouncer");
    let backend = Backend::Pooled { url: bouncer.url("pooled"), direct: direct.clone(), pooler: mode.name() };
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(backend.clone(), up.url());

    // migrate and check-config --connect, through PgBouncer.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, config.toml()).unwrap();
    let (code, out) = idemgate(&["migrate"], &file);
    assert_eq!(code, 0, "migrate through PgBouncer ({mode:?}):\n{out}\n{}", bouncer.log_tail());
    let (code, out) = idemgate(&["check-config", "--connect"], &file);
    assert_eq!(code, 0, "check-config --connect ({mode:?}):\n{out}");
    assert!(out.contains("store sessions: ok") && out.contains("statement_timeout=2000ms in force"), "{out}");

    let gw = Gateway::start(config);
    let url = gw.url("/v1/orders");
    for i in 0..40 {
        let r = post(&url, &format!("w{i}"), ORDER, &[]).await;
        assert_eq!((r.status, r.replayed()), (201, false), "first write w{i} ({mode:?}): {r:?}\n{}", gw.logs());
    }
    for i in 0..40 {
        let r = post(&url, &format!("w{i}"), ORDER, &[]).await;
        assert_eq!((r.status, r.replayed()), (201, true), "replay of w{i} ({mode:?}): {r:?}");
    }
    let mismatch = post(&url, "w0", r#"{"item":"lamp","qty":2}"#, &[]).await;
    assert_eq!(mismatch.status, 409, "another request under w0: {mismatch:?}");

    // 200 first writes from 16 clients, then 256 from 64 clients.
    for (prefix, n, clients) in [("c", 200, 16), ("l", 256, 64)] {
        let keys: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        for (k, status, replayed) in concurrent_posts(&url, keys, clients).await {
            assert_eq!((status, replayed), (201, false), "{k} of {clients} clients ({mode:?}):\n{}", gw.logs());
        }
    }

    assert_eq!(complaints(&gw), Vec::<String>::new(), "warnings or errors logged ({mode:?})");

    // PostgreSQL restarted behind PgBouncer, between requests: once every
    // answered request's result is recorded (a client has its answer before
    // its result write commits; one cut by the restart is retried only
    // within its lease, and would end `unknown` if the restart outlasted it).
    let completed = || pg.simple_query("pooled", "SELECT count(*) FROM idemgate_records WHERE state = 'completed'").unwrap();
    let all_recorded = eventually(Duration::from_secs(20), || async { completed() == vec![vec![Some("496".to_owned())]] }).await;
    assert!(all_recorded, "results not recorded ({mode:?}): {:?}", completed());
    pg.restart_immediate().expect("restart PostgreSQL");
    let recovered = eventually(Duration::from_secs(20), || {
        let u = url.clone();
        async move { post(&u, "after-restart", ORDER, &[]).await.status == 201 }
    })
    .await;
    assert!(recovered, "served again after PostgreSQL restarted ({mode:?}):\n{}", gw.logs());
    assert!(post(&url, "c7", ORDER, &[]).await.replayed(), "records survived the restart");

    // Each operation once at the upstream, each recorded once, completed.
    let ledger = up.ledger();
    assert_eq!(ledger.len(), 40 + 200 + 256 + 1, "operations forwarded ({mode:?})");
    assert!(ledger.values().all(|n| *n == 1), "an operation ran twice: {:?}", ledger.iter().filter(|(_, n)| **n != 1).collect::<Vec<_>>());
    let rows = pg.simple_query("pooled", "SELECT state, count(*) FROM idemgate_records GROUP BY state").unwrap();
    if rows != vec![vec![Some("completed".to_owned()), Some("497".to_owned())]] {
        let open = pg
            .simple_query("pooled", "SELECT idempotency_key, state, generation::text FROM idemgate_records WHERE state <> 'completed'")
            .unwrap();
        panic!("records ({mode:?}): {rows:?}; not completed: {open:?}\n{}", gw.logs());
    }
    drop(gw);
    drop(bouncer);
}

/// `store.pooler` left at `none` in front of PgBouncer in transaction mode:
/// `check-config --connect` and `serve` say the session settings cannot be
/// in force and what to set, instead of running without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_pooler_behind_pooler_none_is_reported() {
    let pg = PgServer::start().expect("a private PostgreSQL");
    let direct = pg.create_database("unsaid").expect("database");
    let bouncer = PgBouncer::start(&pg, PoolMode::Transaction).expect("PgBouncer");
    let up = TestUpstream::start().await;
    let backend = Backend::Pooled { url: bouncer.url("unsaid"), direct, pooler: "none" };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("idemgate.toml");
    std::fs::write(&file, GatewayConfig::new(backend, up.url()).toml()).unwrap();
    let (code, out) = idemgate(&["check-config", "--connect"], &file);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("store sessions: error") && out.contains("store.pooler = \"transaction\""), "{out}");
    let (code, out) = idemgate(&["serve"], &file);
    assert_ne!(code, 0, "serve refuses to start: {out}");
    assert!(out.contains("store.pooler = \"transaction\""), "{out}");
    assert_eq!(up.total(), 0);
}

/// A Citus store behind PgBouncer in transaction mode leaves nothing on a
/// server session past a transaction: a tenant's first claim draws its
/// generations with a statement prepared in the claim's transaction, and a
/// later claim that PgBouncer gives another server session (the first is
/// busy with another client's transaction, as PgBouncer hands out the
/// session used last) must not look for that statement there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_citus_store_behind_a_transaction_pooler_keeps_no_statement_past_a_transaction() {
    use idemgate::config::{Pooler, Secret, StoreBackend};
    use idemgate::idempotency::fingerprint::Fingerprint;
    use idemgate::idempotency::key::{IdempotencyKey, Scope};
    use idemgate::store::{Access, ClaimOutcome, ClaimRequest, Store};
    if support::citus::skip_unless_installed() {
        return;
    }
    let cluster = support::citus::shared();
    let direct = cluster.create_unique_database("citus_txpool").expect("database");
    let db = direct.rsplit('/').next().expect("database name").to_owned();
    let config = |url: &str, pooler: Pooler| {
        support::gateway::store_config(StoreBackend::Citus { url: Secret::new(url.to_owned()), pool_size: 1, pooler })
    };
    let migrated = Store::open(&config(&direct, Pooler::None), Access::Migrate).await.expect("open directly");
    migrated.migrate().await.expect("migrate");
    drop(migrated);
    let bouncer = PgBouncer::start(&cluster.coordinator, PoolMode::Transaction).expect("start PgBouncer");
    let store = Store::open(&config(&bouncer.url(&db), Pooler::Transaction), Access::Migrate).await.expect("open through PgBouncer");
    let claim = |key: &str| ClaimRequest {
        scope: Scope {
            tenant: "acme".into(),
            principal: "billing".into(),
            operation: "create_order".into(),
            key: IdempotencyKey::new(key).unwrap(),
        },
        request_hash: Fingerprint([7; 32]),
        owner: "replica-a".into(),
        lease: Duration::from_secs(60),
        reforward: None,
        sent: idemgate::idempotency::record::ReforwardKey::Derived,
        fingerprint_spec: "test-settings".into(),
        claim_token: uuid::Uuid::new_v4(),
        acceptance: None,
        key_source: "header:idempotency-key".into(),
        request_head: None,
    };
    let first = store.claim(&claim("first")).await.unwrap_or_else(|e| panic!("first claim: {e}\n{}", bouncer.log_tail()));
    assert!(matches!(first, ClaimOutcome::Claimed(_)), "{first:?}");
    // Another client takes the server session the claim used, and keeps it.
    let (pin, connection) = tokio_postgres::connect(&bouncer.url(&db), tokio_postgres::NoTls).await.expect("connect through PgBouncer");
    tokio::spawn(connection);
    pin.batch_execute("BEGIN; SELECT 1").await.expect("a transaction left open");
    for key in ["second", "third"] {
        let next =
            store.claim(&claim(key)).await.unwrap_or_else(|e| panic!("claim {key} on another server session: {e}\n{}", bouncer.log_tail()));
        assert!(matches!(next, ClaimOutcome::Claimed(_)), "{key}: {next:?}");
    }
    pin.batch_execute("COMMIT").await.expect("commit");
    let generations: Vec<i64> = {
        let mut g = Vec::new();
        for key in ["first", "second", "third"] {
            let (record, _) = store.get(&claim(key).scope).await.expect("get").expect("a record");
            g.push(record.generation.0);
        }
        g
    };
    assert!(generations.windows(2).all(|w| w[0] < w[1]), "generations drawn in order: {generations:?}");
}
