//! Readiness tells the truth about writes: a store that answers reads but
//! cannot take a write (a full filesystem under the embedded store, a
//! database role that lost its privileges) makes `/readyz`, and with it
//! `idemgate healthcheck`, answer 503 until writes work again.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idemgate::idempotency::record::State;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

async fn readyz(gw: &Gateway) -> (u16, String) {
    match send("GET", &gw.admin_url("/readyz"), &[], "").await {
        Ok(r) => (r.status, String::from_utf8_lossy(&r.body).trim().to_owned()),
        Err(e) => (0, e),
    }
}

/// Waits up to 10 s for `/readyz` to answer `status`.
async fn readyz_becomes(gw: &Gateway, status: u16) -> bool {
    eventually(Duration::from_secs(10), || async { readyz(gw).await.0 == status }).await
}

fn healthcheck(gw: &Gateway) -> i32 {
    let admin = gw.admin.expect("admin listener").to_string();
    tokio::task::block_in_place(|| cli(gw, &["healthcheck", "--addr", &admin]).0)
}

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    /// `None` where this process may not mount (not root).
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::Builder::new().prefix("idemgate-tmpfs-").tempdir().expect("tempdir");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the filesystem: a file grows until the next write fails with
    /// ENOSPC. Returns its path.
    fn fill(&self) -> PathBuf {
        use std::io::Write;
        let path = self.path().join("filler");
        let mut f = std::fs::File::create(&path).expect("create filler");
        let chunk = vec![0u8; 4096];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(28) => break,
                Err(e) => panic!("filling the tmpfs: {e}"),
            }
        }
        // Whatever is left (a partial page) too.
        while f.write(&[0u8]).is_ok_and(|n| n > 0) {}
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// The embedded store on a filesystem that fills up: reads still work (the
/// old readiness check passed), writes fail. `/readyz` and the healthcheck
/// turn 503/1 and back once space is freed; nothing is forwarded meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_503_while_the_embedded_store_cannot_write() {
    let Some(fs) = Tmpfs::mount("2m") else {
        eprintln!("skipped: mounting a tmpfs needs root");
        return;
    };
    let backend = Backend::Sqlite { path: fs.path().join("idemgate.db"), dir: None };
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let url = gw.url("/v1/orders");
    assert_eq!(readyz(&gw).await.0, 200);
    assert_eq!(post(&url, "before", ORDER, &[]).await.status, 201);

    let filler = fs.fill();
    // Writes fail: the claim is refused, nothing reaches the upstream.
    let refused = post(&url, "during", ORDER, &[]).await;
    assert_eq!(refused.status, 503, "{:?}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.problem(), "store-unavailable");
    assert_eq!(up.side_effects(&derived("during")), 0);
    assert!(readyz_becomes(&gw, 503).await, "readyz still says {:?} while writes fail:\n{}", readyz(&gw).await, gw.logs());
    assert_eq!(readyz(&gw).await.1, "store not writable");
    assert_eq!(healthcheck(&gw), 1, "the healthcheck follows readiness");

    std::fs::remove_file(&filler).expect("free the space");
    assert!(readyz_becomes(&gw, 200).await, "readyz did not recover: {:?}\n{}", readyz(&gw).await, gw.logs());
    assert_eq!(healthcheck(&gw), 0);
    let resp = post(&url, "during", ORDER, &[]).await;
    assert_eq!(resp.status, 201, "{:?}", String::from_utf8_lossy(&resp.body));
    assert_eq!(up.side_effects(&derived("during")), 1);
    // The answer reaches the client as it is recorded: read the record while
    // the gateway runs (dropping it kills it, perhaps before the commit).
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "during").await.map(|r| r.state), Some(State::Completed));
    drop(gw);
}

/// PostgreSQL: the gateway's role loses INSERT/UPDATE/DELETE on the records
/// (a reads-only grant, a botched migration by another role). Reads work,
/// claims fail; readiness says so, and recovers with the grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_turns_503_while_the_database_role_cannot_write() {
    let pg = support::postgres::shared();
    let url = pg.create_unique_database("ready_grants").expect("create database");
    let db = url.rsplit('/').next().unwrap().to_owned();
    // Migrated by the owner; the gateway runs as a role with DML only.
    Backend::Postgres { url: url.clone() }.open().await;
    let role = format!("{db}_rt");
    pg.simple_query(
        &db,
        &format!(
            "CREATE ROLE {role} LOGIN; GRANT USAGE ON SCHEMA public TO {role}; \
             GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}; \
             GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role}"
        ),
    )
    .expect("runtime role");
    let runtime_url = url.replacen(&format!("//{}@", support::postgres::SUPERUSER), &format!("//{role}@"), 1);
    let backend = Backend::Postgres { url: url.clone() };
    let up = TestUpstream::start().await;
    let mut config = GatewayConfig::new(backend.clone(), up.url());
    config.store_section = Some(format!(
        "[store]\nkind = \"postgres\"\nurl = \"{runtime_url}\"\nmigrate = false\npool_size = 4\noperation_timeout = \"2s\"\nsweep_interval = \"200ms\"\n"
    ));
    let gw = Gateway::start(config);
    let url = gw.url("/v1/orders");
    assert_eq!(readyz(&gw).await.0, 200, "{}", gw.logs());
    assert_eq!(post(&url, "before", ORDER, &[]).await.status, 201);

    pg.simple_query(&db, &format!("REVOKE INSERT, UPDATE, DELETE ON idemgate_records FROM {role}")).expect("revoke");
    let refused = post(&url, "during", ORDER, &[]).await;
    assert_eq!(refused.status, 503, "{:?}", String::from_utf8_lossy(&refused.body));
    assert_eq!(up.side_effects(&derived("during")), 0);
    assert!(readyz_becomes(&gw, 503).await, "readyz still says {:?} while writes fail:\n{}", readyz(&gw).await, gw.logs());
    assert_eq!(readyz(&gw).await.1, "store not writable");
    assert_eq!(healthcheck(&gw), 1);

    pg.simple_query(&db, &format!("GRANT INSERT, UPDATE, DELETE ON idemgate_records TO {role}")).expect("grant");
    assert!(readyz_becomes(&gw, 200).await, "readyz did not recover: {:?}\n{}", readyz(&gw).await, gw.logs());
    let resp = post(&url, "during", ORDER, &[]).await;
    assert_eq!(resp.status, 201, "{:?}", String::from_utf8_lossy(&resp.body));
    assert_eq!(up.side_effects(&derived("during")), 1);
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "during").await.map(|r| r.state), Some(State::Completed));
}

/// PostgreSQL is down when `serve` starts (an orchestrator started both at
/// once): the gateway starts anyway, serves pass-through, refuses idempotent
/// requests with 503 without forwarding them, says 503 on `/readyz`, and
/// once the database answers, migrates it, learns the derived-key secret
/// `migrate` generated and serves idempotent requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_while_postgres_is_down_and_uses_it_once_it_answers() {
    let mut pg = support::postgres::PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database("late").expect("create database");
    pg.stop_immediate().expect("stop PostgreSQL");
    let up = TestUpstream::start().await;
    let backend = Backend::Postgres { url };
    // The secret is the one `migrate` generates in the store: learned late.
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).server(r#"default_upstream = "orders""#).generated_secret());
    assert_eq!(gw.log_count("the store cannot be reached"), 1, "{}", gw.logs());
    assert_eq!(readyz(&gw).await, (503, "store unavailable".to_owned()));
    assert_eq!(healthcheck(&gw), 1);
    let passed = send("GET", &gw.url("/catalog"), &[], "").await.expect("pass-through");
    assert_eq!(passed.status, 200, "pass-through is served while the store is down");
    let refused = post(&gw.url("/v1/orders"), "early", ORDER, &[]).await;
    assert_eq!(refused.status, 503);
    assert_eq!(refused.problem(), "store-unavailable");
    assert_eq!(up.total(), 0, "nothing was forwarded");

    pg.start_again().expect("start PostgreSQL again");
    assert!(readyz_becomes(&gw, 200).await, "readyz did not turn 200: {:?}\n{}", readyz(&gw).await, gw.logs());
    assert!(gw.log_count("applied migrations") >= 1, "migrated once it answered:\n{}", gw.logs());
    assert_eq!(gw.log_count("store reached"), 1);
    let first = post(&gw.url("/v1/orders"), "early", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{:?}", String::from_utf8_lossy(&first.body));
    let again = post(&gw.url("/v1/orders"), "early", ORDER, &[]).await;
    assert!(again.replayed());
    assert_eq!(up.total(), 1);
    let store = backend.open().await;
    let record = settled_record(&store, "early").await.expect("record");
    assert_eq!(record.state, State::Completed);
    // The upstream got the key derived under the store's generated secret.
    let secret = store.derived_key_secret().await.unwrap().expect("generated secret");
    assert_eq!(up.side_effects(&scope("early").derived_key(Some(&secret))), 1);
}

/// `store.unreachable_at_start = "exit"` keeps the fail-fast start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_at_start_exit_keeps_the_fail_fast_start() {
    let mut pg = support::postgres::PgServer::start().expect("start private PostgreSQL");
    let url = pg.create_database("exit").expect("create database");
    pg.stop_immediate().expect("stop PostgreSQL");
    let backend = Backend::Postgres { url };
    let mut config = GatewayConfig::new(backend.clone(), "http://127.0.0.1:9".into());
    config.store_section = Some(format!("{}unreachable_at_start = \"exit\"\n", backend.store_toml("200ms")));
    let mut gw = support::gateway::ServeProcess::spawn(&config, std::process::Stdio::null(), &[]);
    assert_eq!(gw.wait_exit(Duration::from_secs(20)).code(), Some(1));
}
