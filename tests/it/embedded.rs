//! The embedded store as a one-replica deployment: durable claims across a
//! SIGKILL, one gateway per file, and the default location when `[store]` is
//! absent. (Every HTTP scenario also runs on SQLite in tests/it/proxy.rs.)
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::process::Command;
use std::time::Duration;

use idemgate::idempotency::record::State;
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
    // below must run before it ends); the wait after it is measured from the
    // claim. The timeout leaves this test's thread 3 s to kill the gateway.
    let mut gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("3s").route("lease = \"4s\""));
    let mut received = up.subscribe();
    let url = gw.url("/v1/orders");
    let u = url.clone();
    // The upstream answers long after the kill: the gateway dies with the
    // attempt in flight however slowly this test's thread is scheduled.
    let client = tokio::spawn(async move { try_post(&u, "k", ORDER, &[("x-test-sleep-ms", "5000")]).await });
    received.recv().await.unwrap();
    let claimed = std::time::Instant::now();
    gw.kill9();
    let died = client.await.unwrap();
    assert!(died.is_err(), "the client's connection dies with the gateway: {:?}", died.map(|r| r.status));
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

/// Runs `idemgate serve --config <dir>/<name>` with `toml` until it exits, at
/// most `bound` (then it is killed): its exit status (`None`: it was still
/// running), its stderr and the config file's path.
fn serve_until_exit(dir: &std::path::Path, name: &str, toml: &str, bound: Duration) -> (Option<std::process::ExitStatus>, String, String) {
    let config = dir.join(name);
    std::fs::write(&config, toml).unwrap();
    let log = dir.join(format!("{name}.stderr"));
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + bound;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(&log).unwrap_or_default(), config.display().to_string())
}

/// One gateway per port: a second `serve` on the port of a running one, with
/// a SQLite file of its own, would split the port's connections (and one
/// key's retries) between two stores. It refuses to start, naming the
/// setting and the file, for the proxy and the admin listener alike; with
/// `server.reuse_port = true` on both, sharing is deliberate and allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_on_a_taken_port_is_refused_unless_both_opt_in() {
    let up = TestUpstream::start().await;
    let first = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let dir = first.dir().to_owned();
    let mut second = GatewayConfig::new(sqlite_backend(), up.url());
    second.listen = first.addr;
    let (status, err, file) =
        tokio::task::block_in_place(|| serve_until_exit(&dir, "second.toml", &second.toml(), Duration::from_secs(30)));
    let status = status.unwrap_or_else(|| panic!("the second gateway started on the first one's port:\n{err}"));
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err.lines().find(|l| l.starts_with("idemgate: ")).unwrap_or_else(|| panic!("no error line:\n{err}"));
    for needle in ["server.listen", &first.addr.to_string(), &file, "in use", "server.reuse_port"] {
        assert!(line.contains(needle), "{needle:?} missing: {line}");
    }

    // The admin listener's port likewise.
    let admin = first.admin.expect("admin listener");
    let toml = GatewayConfig::new(sqlite_backend(), up.url())
        .toml()
        .replace("[admin]\nlisten = \"127.0.0.1:0\"", &format!("[admin]\nlisten = \"{admin}\""));
    let (status, err, file) = tokio::task::block_in_place(|| serve_until_exit(&dir, "third.toml", &toml, Duration::from_secs(30)));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{err}");
    let line = err.lines().find(|l| l.starts_with("idemgate: ")).unwrap_or_else(|| panic!("no error line:\n{err}"));
    for needle in ["admin.listen", &admin.to_string(), &file, "in use"] {
        assert!(line.contains(needle), "{needle:?} missing: {line}");
    }
    assert_eq!(post(&first.url("/v1/orders"), "k", ORDER, &[]).await.status, 201, "the first gateway serves on");
    assert_eq!(up.total(), 1);

    // Opted in on both: the second starts on the same port.
    let shared = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server("reuse_port = true"));
    let mut joining = GatewayConfig::new(sqlite_backend(), up.url()).server("reuse_port = true");
    joining.listen = shared.addr;
    let joined = Gateway::start(joining);
    assert_eq!(joined.addr, shared.addr);
    // Only one side opted in: refused.
    let mut one_sided = GatewayConfig::new(sqlite_backend(), up.url());
    one_sided.listen = shared.addr;
    let (status, err, _) =
        tokio::task::block_in_place(|| serve_until_exit(&dir, "fourth.toml", &one_sided.toml(), Duration::from_secs(30)));
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{err}");
}

/// The mode bits of `path` and its `-wal` and `-shm` files (those that exist).
fn store_file_modes(path: &std::path::Path) -> Vec<(String, u32)> {
    use std::os::unix::fs::PermissionsExt;
    ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| {
            let file = format!("{}{suffix}", path.display());
            std::fs::metadata(&file).ok().map(|m| (file, m.permissions().mode() & 0o777))
        })
        .collect()
}

/// The SQLite file and its `-wal` and `-shm` hold the derived-key secret,
/// every stored response and async requests: they are created readable and
/// writable by their owner only, whatever the umask. A file that is already
/// readable by group or others (an earlier version, a careless copy) is
/// tightened at start, with a log line saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_files_are_private_to_their_owner() {
    use std::os::unix::fs::PermissionsExt;
    let backend = sqlite_backend();
    let Backend::Sqlite { path, .. } = &backend else { unreachable!() };
    let path = path.clone();
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    let modes = store_file_modes(&path);
    assert_eq!(modes.len(), 3, "the database, its WAL and its shared memory: {modes:?}");
    for (file, mode) in &modes {
        assert_eq!(*mode, 0o600, "{file} is {mode:o}");
    }

    // The result is written after the answer: wait for it (a retry replays)
    // before the kill, so the restart finds the record completed.
    let recorded = eventually(Duration::from_secs(10), || async { post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.replayed() }).await;
    assert!(recorded, "{}", gw.logs());
    // Loosened while the gateway is down (the files stay after a kill).
    gw.kill9();
    for (file, _) in &modes {
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    gw.restart();
    assert!(gw.log_count("readable by group or others") >= 1, "{}", gw.logs());
    for (file, mode) in store_file_modes(&path) {
        assert_eq!(mode, 0o600, "{file} is {mode:o} after the restart");
    }
    assert!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.replayed(), "the record is intact");
    assert_eq!(up.total(), 1);
}

/// A completed async operation's stored request (its credentials with it) is
/// set to NULL, and a record past its retention is deleted by the sweeper;
/// with `secure_delete` the freed bytes are zeroed in the database, and the
/// sweeper's checkpoint empties the WAL of the page images that held them:
/// after a sweep, neither file has them (while other records stay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_requests_leave_the_database_files_once_done_with() {
    let backend = sqlite_backend();
    let Backend::Sqlite { path, .. } = &backend else { unreachable!() };
    let path = path.clone();
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(backend.clone(), up.url())
        .route("mode = \"async\"\nretention = \"1s\"")
        .tail("[[routes]]\noperation = \"kept\"\nmethod = \"POST\"\npath = \"/v1/kept\"\nupstream = \"orders\"\nmode = \"async\"\n")
        .sweep_interval("200ms");
    let gw = Gateway::start(config);
    let store = backend.open().await;
    let marker = format!("SECRET-MARKER-{}", uuid::Uuid::new_v4().simple());
    // Slow work, so that sweeps checkpoint the stored requests into the
    // database file while they are live; long, so that they spill onto
    // overflow pages that are freed whole.
    let padding = "p".repeat(6000);
    for i in 0..6 {
        let (path, key) = if i % 2 == 0 { ("/v1/orders", format!("k-secure-{i}")) } else { ("/v1/kept", format!("k-kept-{i}")) };
        let headers = [("x-secret-marker", marker.as_str()), ("x-padding", padding.as_str()), ("x-test-sleep-ms", "1200")];
        let r = post(&gw.url(path), &key, ORDER, &headers).await;
        assert_eq!(r.status, 202, "{r:?}");
    }
    let settled = eventually(Duration::from_secs(20), || async {
        let mut all = true;
        for i in 0..6 {
            let scope = if i % 2 == 0 { scope(&format!("k-secure-{i}")) } else { scope_for(PRINCIPAL, "kept", &format!("k-kept-{i}")) };
            let found = store.inspect(&scope, 1).await.unwrap();
            all &= match (i % 2, found) {
                // Swept once its second of retention ran out.
                (0, found) => found.is_none(),
                // Completed, its stored request set to NULL.
                (_, Some(f)) => f.record.state == State::Completed && f.request.is_none(),
                (_, None) => false,
            };
        }
        all
    })
    .await;
    assert!(settled, "the operations completed, their requests set to NULL, the short-lived ones swept: {}", gw.logs());
    assert_eq!(up.total(), 6);
    let in_files = || {
        ["", "-wal"].iter().any(|suffix| {
            std::fs::read(format!("{}{suffix}", path.display()))
                .is_ok_and(|bytes| bytes.windows(marker.len()).any(|w| w == marker.as_bytes()))
        })
    };
    let gone = eventually(Duration::from_secs(10), || async { !in_files() }).await;
    assert!(gone, "the stored requests' bytes are still in {} or its -wal", path.display());
}
