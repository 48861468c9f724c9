//! PostgreSQL set up as docs/operations.md tells a DBA to: the blocks marked
//! `runnable postgres` there (SQL pasted into psql as a superuser, then the
//! shell lines that migrate as the owner role and check as the runtime role)
//! are run here against a private cluster, so the document and this test
//! cannot drift. Then the runtime role serves with only the privileges the
//! document grants; `check-config --connect` names missing migrations and
//! missing privileges instead of saying "ok"; errors before `migrate` say to
//! run it; and a start logs no PostgreSQL NOTICE.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use support::postgres::{PgServer, SUPERUSER};

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");
/// The role and database names the document uses.
const OWNER: &str = "idemgate_owner";
const APP: &str = "idemgate_app";
const DB: &str = "idemgate";
/// sha256 of "pg-roles-key".
const KEY: &str = "pg-roles-key";

struct Block {
    info: String,
    body: String,
}

/// The fenced blocks of operations.md marked `runnable postgres`, in order.
fn dba_blocks() -> Vec<Block> {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md")).unwrap();
    let mut out = Vec::new();
    let mut open: Option<(String, usize, Vec<String>)> = None;
    for line in doc.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim_start();
        match &mut open {
            None => {
                if let Some(info) = trimmed.strip_prefix("```") {
                    open = Some((info.trim().to_owned(), indent, Vec::new()));
                }
            }
            Some((info, fence, body)) => {
                if trimmed.starts_with("```") {
                    let words: Vec<&str> = info.split_whitespace().collect();
                    if words.contains(&"runnable") && words.contains(&"postgres") {
                        out.push(Block { info: info.clone(), body: body.join("\n") });
                    }
                    open = None;
                } else {
                    body.push(line[indent.min(*fence)..].to_owned());
                }
            }
        }
    }
    out
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Pastes SQL into psql as the cluster's superuser, stopping at the first error.
fn psql(pg: &PgServer, db: &str, sql: &str) -> Output {
    let bindir = support::postgres::replication_binaries().expect("PostgreSQL binaries");
    let mut child = Command::new(bindir.join("psql"))
        .args(["-X", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p", &pg.port().to_string(), "-U", SUPERUSER, "-d", db, "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run psql");
    std::io::Write::write_all(child.stdin.as_mut().unwrap(), sql.as_bytes()).unwrap();
    drop(child.stdin.take());
    child.wait_with_output().unwrap()
}

/// A configuration for the documented setup: PostgreSQL through
/// IDEMGATE_DATABASE_URL, one route to `upstream`.
fn write_config(dir: &Path, upstream: &str, migrate: bool) -> PathBuf {
    let path = dir.join(if migrate { "migrating.toml" } else { "idemgate.toml" });
    let hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(KEY.as_bytes()));
    std::fs::write(
        &path,
        format!(
            r#"[server]
listen = "127.0.0.1:0"
[store]
kind = "postgres"
url_env = "IDEMGATE_DATABASE_URL"
migrate = {migrate}
[admin]
listen = "127.0.0.1:0"
[[upstreams]]
name = "orders"
url = "{upstream}"
[[identity.sources]]
kind = "api_key"
keys = [ {{ sha256 = "{hash}", tenant = "acme", principal = "billing" }} ]
[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "orders"
"#
        ),
    )
    .unwrap();
    path
}

fn url(pg: &PgServer, role: &str, db: &str) -> String {
    format!("postgres://{role}:change-me@127.0.0.1:{}/{db}", pg.port())
}

fn idemgate(args: &[&str], config: &Path, db_url: &str) -> Output {
    Command::new(BIN)
        .args(args)
        .arg("--config")
        .arg(config)
        .env("IDEMGATE_DATABASE_URL", db_url)
        .env("IDEMGATE_LOG_FORMAT", "json")
        .env_remove("IDEMGATE_LOG")
        .output()
        .expect("run idemgate")
}

/// `serve` until ready; its stderr (JSON logs) after SIGTERM, and whether it served.
fn serve_once(config: &Path, db_url: &str, during: impl FnOnce(std::net::SocketAddr)) -> (bool, String) {
    use std::io::BufRead as _;
    let mut child = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(config)
        .env("IDEMGATE_DATABASE_URL", db_url)
        .env("IDEMGATE_LOG_FORMAT", "json")
        .env_remove("IDEMGATE_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let sink = lines.clone();
    let err = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        for l in std::io::BufReader::new(err).lines().map_while(Result::ok) {
            sink.lock().unwrap().push(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let addr = loop {
        let found = lines.lock().unwrap().iter().find_map(|l| support::gateway::listening_addr(l));
        if let Some(a) = found {
            break Some(a);
        }
        if child.try_wait().unwrap().is_some() || Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Some(a) = addr {
        during(a);
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
    }
    let _ = child.wait();
    let _ = reader.join();
    let logs = lines.lock().unwrap().join("\n");
    (addr.is_some(), logs)
}

/// A POST through the gateway with curl: status line and body.
fn post(addr: std::net::SocketAddr, key: &str) -> String {
    let out = Command::new("curl")
        .args(["-si", "--max-time", "20", "-X", "POST", &format!("http://{addr}/v1/orders")])
        .args(["-H", &format!("Authorization: Bearer {KEY}"), "-H", &format!("Idempotency-Key: {key}"), "-d", "{}"])
        .env("NO_PROXY", "*")
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privilege_roles_migrate_check_and_serve() {
    let pg = PgServer::start().expect("start PostgreSQL");
    let up = support::TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &up.url(), false);
    let blocks = dba_blocks();
    assert!(blocks.iter().any(|b| b.info.starts_with("sql")), "operations.md has the DBA's SQL");
    assert!(blocks.iter().any(|b| b.info.starts_with("sh")), "and the shell lines that migrate and check");

    // 1. The DBA pastes the SQL (as a superuser, in psql).
    for b in blocks.iter().filter(|b| b.info.starts_with("sql")) {
        let out = psql(&pg, "postgres", &b.body);
        assert!(out.status.success(), "the documented SQL failed in psql:\n{}\n---\n{}", b.body, text(&out));
    }
    let app = url(&pg, APP, DB);

    // 2. Before `idemgate migrate`: check-config --connect says so, by migration name, and fails.
    let out = tokio::task::block_in_place(|| idemgate(&["check-config", "--connect"], &config, &app));
    let said = text(&out);
    eprintln!("{said}");
    assert_eq!(out.status.code(), Some(1), "an unmigrated database is not ok:\n{said}");
    assert!(said.contains("0001_records") && said.contains("run `idemgate migrate`"), "{said}");
    // ... and so do the commands that read the store.
    let out = tokio::task::block_in_place(|| idemgate(&["keys", "list"], &config, &app));
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("run `idemgate migrate`") && !said.contains("relation \"idemgate_records\" does not exist"), "{said}");

    // 3. The documented shell lines: migrate as the owner, then check as the runtime role.
    let bindir = Path::new(BIN).parent().unwrap().display().to_string();
    for b in blocks.iter().filter(|b| b.info.starts_with("sh")) {
        let script = b
            .body
            .replace("db.internal:5432", &format!("127.0.0.1:{}", pg.port()))
            .replace("/etc/idemgate/idemgate.toml", &config.display().to_string());
        let out = tokio::task::block_in_place(|| {
            Command::new("bash")
                .arg("-c")
                .arg(format!("set -euo pipefail\n{script}"))
                .env("PATH", format!("{bindir}:{}", std::env::var("PATH").unwrap_or_default()))
                .env_remove("IDEMGATE_DATABASE_URL")
                .output()
                .unwrap()
        });
        let said = text(&out);
        eprintln!("{said}");
        assert!(out.status.success(), "the documented shell block failed:\n{script}\n---\n{said}");
        assert!(said.contains("applied 0001_records"), "migrated as the owner:\n{said}");
        assert!(said.lines().any(|l| l.starts_with("store schema: ok")), "{said}");
        assert!(said.lines().any(|l| l.starts_with("store privileges: ok")), "{said}");
    }
    // The owner owns the tables; the runtime role owns nothing.
    let owners = pg.simple_query(DB, "SELECT DISTINCT tableowner FROM pg_tables WHERE tablename LIKE 'idemgate%'").unwrap();
    assert_eq!(owners, vec![vec![Some(OWNER.to_owned())]]);

    // 4. The runtime role serves, with store.migrate = false as documented
    //    and with the default (true: nothing is pending, so nothing is changed).
    for migrate in [false, true] {
        let config = write_config(dir.path(), &up.url(), migrate);
        let key = format!("order-{migrate}");
        let (served, logs) = tokio::task::block_in_place(|| {
            serve_once(&config, &app, |addr| {
                let first = post(addr, &key);
                assert!(first.starts_with("HTTP/1.1 201"), "{first}");
                let again = post(addr, &key);
                assert!(again.starts_with("HTTP/1.1 201") && again.to_lowercase().contains("idempotent-replayed: true"), "{again}");
            })
        });
        assert!(served, "serve as {APP} (store.migrate = {migrate}):\n{logs}");
        let rows = pg.simple_query(DB, &format!("SELECT state FROM idemgate_records WHERE idempotency_key = '{key}'")).unwrap();
        assert_eq!(rows, vec![vec![Some("completed".to_owned())]]);
        // No PostgreSQL NOTICE in the log, nor file paths of the build machine.
        for line in logs.lines() {
            assert!(!line.contains("NOTICE") && !line.contains(".cargo/registry"), "{line}");
        }
    }
    assert_eq!(up.total(), 2, "each key executed once");

    // 5. A role with less than serve needs is named, with what it lacks.
    let limited = "CREATE ROLE idemgate_readonly LOGIN PASSWORD 'change-me';\n\
                   GRANT CONNECT ON DATABASE idemgate TO idemgate_readonly;\n\
                   \\connect idemgate\n\
                   GRANT SELECT ON ALL TABLES IN SCHEMA public TO idemgate_readonly;\n";
    let out = psql(&pg, "postgres", limited);
    assert!(out.status.success(), "{}", text(&out));
    let out = tokio::task::block_in_place(|| idemgate(&["check-config", "--connect"], &config, &url(&pg, "idemgate_readonly", DB)));
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    let line = said.lines().find(|l| l.starts_with("store privileges:")).unwrap_or_else(|| panic!("{said}"));
    eprintln!("{line}");
    assert!(line.contains("INSERT") && line.contains("idemgate_records") && line.contains("idemgate_generation"), "{line}");

    // 6. The PostgreSQL 15 trap: GRANT ALL ON DATABASE does not let a role
    //    create tables in schema public; the error says what to do.
    let naive = "CREATE ROLE naive LOGIN PASSWORD 'change-me';\nCREATE DATABASE naive_db;\nGRANT ALL ON DATABASE naive_db TO naive;\n";
    let out = psql(&pg, "postgres", naive);
    assert!(out.status.success(), "{}", text(&out));
    let out = tokio::task::block_in_place(|| idemgate(&["migrate"], &config, &url(&pg, "naive", "naive_db")));
    let said = text(&out);
    assert_eq!(out.status.code(), Some(1), "{said}");
    eprintln!("{said}");
    assert!(said.contains("permission denied for schema public") && said.contains("docs/operations.md"), "{said}");
}

/// Starting on an already migrated database changes nothing and logs no
/// PostgreSQL NOTICE (`relation ... already exists, skipping`) with the build
/// machine's file paths.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_on_a_migrated_database_logs_no_postgres_notice() {
    let url = support::postgres::shared().create_database("notice_check").unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), &format!("http://{}", listener.local_addr().unwrap()), true);
    for _ in 0..2 {
        let (served, logs) = tokio::task::block_in_place(|| serve_once(&config, &url, |_| {}));
        assert!(served, "{logs}");
        for line in logs.lines() {
            assert!(!line.contains("NOTICE") && !line.contains(".cargo/registry") && !line.contains("log.file"), "{line}");
        }
    }
}
