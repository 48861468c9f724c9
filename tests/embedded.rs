//! The embedded store as a one-replica deployment: durable claims across a
//! SIGKILL, one gateway per file, and the default location when `[store]` is
//! absent. (Every HTTP scenario also runs on SQLite in tests/proxy.rs.)

mod support;

use std::process::Command;
use std::time::Duration;

use idemgate::record::State;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// SIGKILL right after the claim is acknowledged (the upstream has the
/// request, so the claim was committed before forwarding): after a restart the
/// claim is still there, and the key is never executed twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_survives_sigkill() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    // The lease covers a restart on a busy machine (the in-progress check
    // below must run before it ends); the wait after it is measured from the claim.
    let mut gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms").route("lease = \"4s\""));
    let mut received = up.subscribe();
    let url = gw.url("/v1/orders");
    let u = url.clone();
    let client = tokio::spawn(async move { post(&u, "k", ORDER, &[("x-test-sleep-ms", "300")]).await });
    received.recv().await.unwrap();
    let claimed = std::time::Instant::now();
    gw.kill9();
    let _ = client.await; // the client's connection died with the gateway
    gw.restart();
    let store = backend.open().await;
    let rec = record(&store, "k").await.expect("the acknowledged claim survived the kill");
    assert_eq!((rec.state, rec.generation.0), (State::InFlight, 1));
    assert_eq!(post(&url, "k", ORDER, &[]).await.problem(), "request-in-progress");
    tokio::time::sleep((claimed + Duration::from_millis(4100)).saturating_duration_since(std::time::Instant::now())).await;
    assert_eq!(post(&url, "k", ORDER, &[]).await.problem(), "outcome-unknown");
    assert_eq!(up.total(), 1);
    // A completed record survives a kill too.
    assert_eq!(post(&url, "done", ORDER, &[]).await.status, 201);
    // (Its result is written just after the answer: a kill before that
    // write is the case above. Wait for it, then kill.)
    assert_eq!(settled_record(&store, "done").await.unwrap().state, State::Completed);
    gw.restart();
    assert!(post(&url, "done", ORDER, &[]).await.replayed());
    assert_eq!(up.total(), 2);
}

/// SQLite serves one replica: a second gateway on the same file refuses to
/// start, naming the file and what to do instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_gateway_on_one_file_is_refused() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let first = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let config = first.dir().join("second.toml");
    let toml = GatewayConfig::new(backend.clone(), up.url()).toml();
    std::fs::write(&config, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another idemgate process") && err.contains("PostgreSQL"), "{err}");
    // The CLI still reads the file beside the running gateway.
    assert_eq!(post(&first.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    let (code, stdout, stderr) = cli(&first, &["keys", "list"]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("1 record(s)"), "{stdout}");
    // Once the first gateway is gone, the file is free again.
    drop(first);
    let again = Gateway::start(GatewayConfig::new(backend, up.url()));
    assert!(post(&again.url("/v1/orders"), "k", ORDER, &[]).await.replayed());
}

/// Without `[store]` the gateway runs on SQLite at data/idemgate.db, relative
/// to its working directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_store_is_embedded_sqlite() {
    let workdir = tempfile::tempdir().unwrap();
    let up = TestUpstream::start().await;
    let mut cfg = GatewayConfig::new(sqlite_backend(), up.url());
    cfg.store_section = Some(String::new());
    cfg.workdir = Some(workdir.path().to_owned());
    let gw = Gateway::start(cfg);
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    assert!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.replayed());
    assert!(workdir.path().join("data/idemgate.db").exists());
    assert!(workdir.path().join("data/idemgate.db.lock").exists());
    let default = Backend::Sqlite { path: workdir.path().join("data/idemgate.db"), dir: None };
    let store = default.open().await;
    assert_eq!(settled_record(&store, "k").await.unwrap().state, State::Completed);
}

/// A mistyped store path must not become a new, empty database that `keys`
/// then reports as holding no records: operator commands refuse a store that
/// does not exist (or is not an idemgate store), and create nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_commands_refuse_a_missing_store() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("typo").join("idemgate.db");
    let not_ours = dir.path().join("other.db");
    std::fs::write(&not_ours, b"").unwrap();
    for path in [&missing, &not_ours] {
        let cfg = GatewayConfig::new(Backend::Sqlite { path: path.clone(), dir: None }, "http://127.0.0.1:9".into());
        let config = dir.path().join("cfg.toml");
        std::fs::write(&config, cfg.toml()).unwrap();
        for args in [
            vec!["keys", "list"],
            vec!["keys", "show", "--tenant", "t", "--principal", "p", "--operation", "create_order", "--key", "k"],
            vec![
                "keys",
                "resolve",
                "--tenant",
                "t",
                "--principal",
                "p",
                "--operation",
                "create_order",
                "--key",
                "k",
                "--release",
                "--reason",
                "r",
            ],
            vec!["keys", "audit"],
        ] {
            let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
                .args(&args)
                .arg("--config")
                .arg(&config)
                .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{args:?} on {}: {err}", path.display());
            assert!(err.contains("no idemgate store at") && err.contains("store.path"), "{err}");
        }
    }
    assert!(!missing.exists() && !missing.parent().unwrap().exists(), "nothing was created");
    assert_eq!(std::fs::metadata(&not_ours).unwrap().len(), 0, "a foreign file is left alone");
    // `migrate` does create it, and then the commands work.
    let cfg = GatewayConfig::new(Backend::Sqlite { path: missing.clone(), dir: None }, "http://127.0.0.1:9".into());
    let config = dir.path().join("cfg.toml");
    std::fs::write(&config, cfg.toml()).unwrap();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(args)
            .arg("--config")
            .arg(&config)
            .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
            .output()
            .unwrap()
    };
    assert_eq!(run(&["migrate"]).status.code(), Some(0));
    let out = run(&["keys", "list"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("0 record(s)"));
}
