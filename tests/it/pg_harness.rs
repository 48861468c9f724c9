//! Tests of the private-PostgreSQL harness in `tests/it/support/postgres.rs`.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::io::{BufRead, BufReader};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::postgres::{self, PgServer};
use tokio_postgres::{Client, NoTls};

async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

fn refused(port: u16) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    matches!(
        TcpStream::connect_timeout(&addr, Duration::from_secs(1)),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

/// Exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').map(|i| s[i + 1..].trim_start().starts_with(|c| c != 'Z' && c != 'X')))
        .unwrap_or(false)
}

fn eventually(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !check() {
        assert!(Instant::now() < deadline, "timed out after {timeout:?} waiting for: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn own_cluster_serves_two_isolated_databases() {
    let pg = PgServer::start().expect("start cluster");
    eprintln!("own cluster started in {:?} on port {}", pg.startup_time(), pg.port());
    assert!(pg.log_tail().contains("ready to accept connections"), "log:\n{}", pg.log_tail());

    let url_a = pg.create_database("alpha").unwrap();
    let url_b = pg.create_database("beta").unwrap();
    assert_eq!(url_a, format!("postgres://idemgate@127.0.0.1:{}/alpha", pg.port()));
    assert_eq!(url_b, pg.url("beta"));
    assert!(pg.create_database("alpha").is_err(), "creating a database twice must fail");
    assert!(pg.create_database("bad name\"; --").is_err());

    for (url, value) in [(&url_a, "in alpha"), (&url_b, "in beta")] {
        let client = connect(url).await.unwrap();
        client.batch_execute("CREATE TABLE t (v text NOT NULL)").await.unwrap();
        client.execute("INSERT INTO t (v) VALUES ($1)", &[&value]).await.unwrap();
    }
    for (url, value) in [(&url_a, "in alpha"), (&url_b, "in beta")] {
        let client = connect(url).await.unwrap();
        let rows = client.query("SELECT v FROM t", &[]).await.unwrap();
        let values: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        assert_eq!(values, [value]);
        let db: String = client.query_one("SELECT current_database()", &[]).await.unwrap().get(0);
        assert_eq!(url.rsplit('/').next(), Some(db.as_str()));
    }

    let settings = pg
        .simple_query("alpha", "SELECT current_setting('fsync'), current_setting('max_connections'), current_setting('listen_addresses')")
        .unwrap();
    assert_eq!(settings, [[Some("on".into()), Some("200".into()), Some("127.0.0.1".into())]]);

    let (pid, base) = (pg.postmaster_pid().unwrap(), pg.base_dir().to_path_buf());
    let port = pg.port();
    drop(pg);
    assert!(!alive(pid), "postmaster {pid} survived drop");
    assert!(refused(port));
    assert!(!base.exists(), "{} survived drop", base.display());
}

#[tokio::test]
async fn stop_immediate_refuses_and_start_again_keeps_committed_rows() {
    let mut pg = PgServer::start().expect("start cluster");
    let port = pg.port();
    let url = pg.create_database("durable").unwrap();
    let client = connect(&url).await.unwrap();
    client.batch_execute("CREATE TABLE t (v int NOT NULL); INSERT INTO t VALUES (42)").await.unwrap();

    let pid = pg.postmaster_pid().unwrap();
    let began = Instant::now();
    pg.stop_immediate().unwrap();
    eprintln!("stop_immediate took {:?}", began.elapsed());
    assert!(!alive(pid));
    assert!(refused(port), "port {port} still open after stop_immediate");
    let err = connect(&url).await.expect_err("connecting to a stopped server must fail");
    let io = std::error::Error::source(&err).and_then(|s| s.downcast_ref::<std::io::Error>());
    assert_eq!(io.map(|e| e.kind()), Some(std::io::ErrorKind::ConnectionRefused), "{err:?}");
    // The old connection is dead too.
    assert!(client.query_one("SELECT 1", &[]).await.is_err());
    pg.stop_immediate().unwrap(); // idempotent

    let began = Instant::now();
    pg.start_again().unwrap();
    eprintln!("start_again (with crash recovery) took {:?}", began.elapsed());
    assert_eq!(pg.port(), port);
    assert!(pg.start_again().is_err(), "start_again on a running server must fail");
    let client = connect(&url).await.unwrap();
    let v: i32 = client.query_one("SELECT v FROM t", &[]).await.unwrap().get(0);
    assert_eq!(v, 42);
    client.batch_execute("INSERT INTO t VALUES (43)").await.unwrap();

    pg.restart_immediate().unwrap();
    assert_eq!(pg.port(), port);
    let client = connect(&url).await.unwrap();
    let n: i64 = client.query_one("SELECT count(*) FROM t", &[]).await.unwrap().get(0);
    assert_eq!(n, 2);
    assert!(pg.log_tail().contains("database system was interrupted"), "expected crash recovery in log:\n{}", pg.log_tail());
}

/// Two tasks use two databases of the shared cluster at the same time, and the
/// server sees both connections at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_cluster_serves_concurrent_clients() {
    let pg = postgres::shared();
    let mut clients = Vec::new();
    for tag in ["shared_a", "shared_b"] {
        let url = pg.create_unique_database(tag).unwrap();
        let client = connect(&url).await.unwrap();
        client.batch_execute("CREATE TABLE t (v text); INSERT INTO t VALUES ('x')").await.unwrap();
        clients.push(client);
    }
    let (a, b) = (&clients[0], &clients[1]);
    let (ra, rb) = tokio::join!(a.query_one("SELECT v FROM t", &[]), b.query_one("SELECT v FROM t", &[]));
    assert_eq!(ra.unwrap().get::<_, String>(0), "x");
    assert_eq!(rb.unwrap().get::<_, String>(0), "x");
    let dbs: Vec<String> = a
        .query("SELECT datname::text FROM pg_stat_activity WHERE datname LIKE 'shared\\_%' AND backend_type = 'client backend'", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(dbs.len() >= 2, "expected both clients connected at once, saw {dbs:?}");
}

#[test]
fn shared_cluster_from_sync_code() {
    let pg = postgres::shared();
    let url = pg.create_unique_database("sync").unwrap();
    let db = url.rsplit('/').next().unwrap();
    pg.simple_query(db, "CREATE TABLE t (v int); INSERT INTO t VALUES (7)").unwrap();
    assert_eq!(pg.simple_query(db, "SELECT v FROM t").unwrap(), [[Some("7".to_string())]]);
    assert!(pg.simple_query(db, "SELECT * FROM missing").is_err());
}

// ---- orphan prevention: a child process (this binary) holds the shared cluster ----

const CHILD_MODE: &str = "IDEMGATE_PG_HARNESS_CHILD";

/// Not a real test: the body run in a child process by the tests below.
#[test]
#[ignore = "helper run in a child process by the orphan tests"]
fn child_process_holds_shared_cluster() {
    let Ok(mode) = std::env::var(CHILD_MODE) else {
        return;
    };
    let pg = postgres::shared();
    println!("CLUSTER {} {} {} {}", pg.port(), pg.postmaster_pid().unwrap(), pg.watchdog_pid().unwrap(), pg.base_dir().display());
    if mode == "hang" {
        std::thread::sleep(Duration::from_secs(120));
    }
    // mode "exit": return; the process exits without dropping the static.
}

/// The child's test as the test binary names it: its module path without the
/// crate's name (the tests are modules of one binary, `tests/it`).
fn child_test_name() -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    if module.is_empty() {
        "child_process_holds_shared_cluster".to_owned()
    } else {
        format!("{module}::child_process_holds_shared_cluster")
    }
}

struct ChildCluster {
    child: Child,
    port: u16,
    postmaster: u32,
    watchdog: u32,
    base: PathBuf,
}

/// A directory of its own for the child's cluster, so that no other test's sweep can
/// clean up after it (and hide a failure of the watchdog).
fn private_parent_dir() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::Builder::new().prefix("pgh-parent-").tempdir().unwrap();
    // Like /tmp: the server account must traverse it and remove its own entry.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    dir
}

fn spawn_child(mode: &str, parent: &Path) -> ChildCluster {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("IDEMGATE_TEST_PG_TMPDIR", parent)
        .args(["--exact", &child_test_name(), "--ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_MODE, mode)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next() {
        let line = line.unwrap();
        // The harness prints "test NAME ... " on the same line before our output.
        if let Some(rest) = line.find("CLUSTER ").map(|i| &line[i + "CLUSTER ".len()..]) {
            let f: Vec<&str> = rest.splitn(4, ' ').collect();
            let cluster = ChildCluster {
                child,
                port: f[0].parse().unwrap(),
                postmaster: f[1].parse().unwrap(),
                watchdog: f[2].parse().unwrap(),
                base: PathBuf::from(f[3]),
            };
            // Keep reading so the child's later output does not hit a broken pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return cluster;
        }
    }
    panic!("child exited without reporting its cluster: {:?}", child.wait());
}

fn assert_cluster_gone(port: u16, postmaster: u32, base: &Path) {
    eventually("postmaster exit", Duration::from_secs(15), || !alive(postmaster));
    eventually("port closed", Duration::from_secs(15), || refused(port));
    eventually("cluster dir removed", Duration::from_secs(15), || !base.exists());
}

#[test]
fn shared_cluster_stops_when_the_process_exits() {
    let parent = private_parent_dir();
    let mut c = spawn_child("exit", parent.path());
    assert!(c.child.wait().unwrap().success());
    let began = Instant::now();
    assert_cluster_gone(c.port, c.postmaster, &c.base);
    eprintln!("cluster gone {:?} after its owner exited", began.elapsed());
}

#[test]
fn shared_cluster_stops_when_the_process_is_killed() {
    let parent = private_parent_dir();
    let mut c = spawn_child("hang", parent.path());
    assert!(alive(c.postmaster) && !refused(c.port));
    c.child.kill().unwrap(); // SIGKILL: no destructors, no atexit
    c.child.wait().unwrap();
    assert_cluster_gone(c.port, c.postmaster, &c.base);
}

#[test]
fn sweep_stops_clusters_whose_watchdog_and_owner_were_killed() {
    let parent = private_parent_dir();
    let mut c = spawn_child("hang", parent.path());
    let status = Command::new("/bin/sh").args(["-c", "kill -KILL \"$1\"", "sh", &c.watchdog.to_string()]).status().unwrap();
    assert!(status.success());
    eventually("watchdog death", Duration::from_secs(5), || !alive(c.watchdog));
    c.child.kill().unwrap();
    c.child.wait().unwrap();
    // Without the watchdog nothing stops it: a true orphan.
    std::thread::sleep(Duration::from_millis(300));
    assert!(alive(c.postmaster), "the orphan should still be running before the sweep");
    assert!(!refused(c.port));

    let removed = postgres::sweep_stale_clusters_in(parent.path()).unwrap();
    assert_eq!(removed, 1, "sweep removed {removed} clusters");
    assert_cluster_gone(c.port, c.postmaster, &c.base);
}

#[test]
fn start_again_reports_a_taken_port_and_recovers_when_it_is_free() {
    let mut pg = PgServer::start().expect("start cluster");
    let port = pg.port();
    pg.stop_immediate().unwrap();
    let squatter = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
    let began = Instant::now();
    let err = pg.start_again().expect_err("the port is taken");
    eprintln!("start_again on a taken port failed after {:?}: {err}", began.elapsed());
    assert_eq!(err.kind(), std::io::ErrorKind::AddrInUse, "{err}");
    assert!(err.to_string().contains("Address already in use"), "{err}");
    assert!(!pg.is_running());
    drop(squatter);
    pg.start_again().unwrap();
    assert_eq!(pg.port(), port);
    assert_eq!(pg.simple_query("postgres", "SELECT 1").unwrap(), [[Some("1".to_string())]]);
}
