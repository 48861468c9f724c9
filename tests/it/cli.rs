//! `idemgate check-config`, run as a user runs it: the real binary, its output and
//! its exit code. With `--connect` it also reaches the store (a private PostgreSQL,
//! or an SQLite file) and every upstream.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_idemgate");
const KEY_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn check_config(config: &Path, connect: bool) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("check-config").arg("--config").arg(config).env_remove("IDEMGATE_CONFIG").env("IDEMGATE_LOG", "warn");
    if connect {
        cmd.arg("--connect");
    }
    cmd.output().expect("run idemgate")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A config with `store` as its `[store]` section and one upstream per `(name, url)`,
/// each with a route.
fn config(store: &str, upstreams: &[(&str, String)]) -> String {
    let mut s = format!(
        "{store}\n[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{KEY_HASH}\", tenant = \"t\", principal = \"p\" }} ]\n"
    );
    for (name, url) in upstreams {
        s.push_str(&format!("\n[[upstreams]]\nname = \"{name}\"\nurl = \"{url}\"\nconnect_timeout = \"2s\"\n"));
        s.push_str(&format!("\n[[routes]]\noperation = \"op_{name}\"\nmethod = \"POST\"\npath = \"/{name}\"\nupstream = \"{name}\"\n"));
    }
    s
}

fn write(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, body).expect("write config");
    path
}

/// A port on 127.0.0.1 where nothing listens (bound, then released).
fn refused_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn sqlite_store(dir: &Path) -> String {
    format!("[store]\nkind = \"sqlite\"\npath = \"{}\"\n", dir.join("data").join("idemgate.db").display())
}

/// Several fields of the wrong type (or unknown) in one entry: each is
/// printed in the same run, not only the first the entry stopped at.
#[test]
fn every_field_of_the_wrong_type_in_one_entry_is_printed() {
    let dir = tempfile::tempdir().unwrap();
    let body = config("", &[("orders", "http://127.0.0.1:9000".into())]).replace(
        "upstream = \"orders\"",
        "upstream = \"orders\"\nrelease_on_status = [\"429\"]\nretention = 5\nkey_required = \"yes\"\ncolour = 1",
    );
    let file = write(dir.path(), "bad.toml", &body);
    let out = check_config(&file, false);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let name = file.display().to_string();
    for path in ["routes[0].release_on_status[0]", "routes[0].retention", "routes[0].key_required", "routes[0].colour"] {
        assert!(err.lines().any(|l| l.starts_with(&format!("{name}: {path}: ")) && l.contains("(line ")), "missing {path} in:\n{err}");
    }
    assert!(err.contains("4 error(s)"), "{err}");
}

#[test]
fn every_error_in_three_sections_is_printed_with_its_path_and_exit_is_1() {
    let dir = tempfile::tempdir().unwrap();
    let body = config("[server]\nshutdown_grace = \"soon\"\n", &[("orders", "http://127.0.0.1:9000".into())])
        .replace("connect_timeout = \"2s\"", "connect_timeout = 2")
        .replace("upstream = \"orders\"", "upstream = \"orders\"\nretention = \"0s\"\ncolour = \"blue\"");
    let file = write(
        dir.path(),
        "bad.toml",
        &(body + "\n[[routes]]\noperation = \"op_orders\"\nmethod = \"PUT\"\npath = \"/x\"\nupstream = \"orders\"\n"),
    );
    let out = check_config(&file, false);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let name = file.display().to_string();
    for path in ["server.shutdown_grace", "upstreams[0].connect_timeout", "routes[0].colour", "routes[1].operation"] {
        assert!(err.lines().any(|l| l.starts_with(&format!("{name}: {path}: "))), "missing {path} in:\n{err}");
    }
    assert!(err.contains("4 error(s)"), "{err}");
    assert!(text(&out.stdout).is_empty());
}

#[test]
fn an_empty_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "empty.toml", "");
    let out = check_config(&file, false);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("nothing to serve"), "{}", text(&out.stderr));
}

#[test]
fn a_valid_file_is_ok_and_connect_is_not_attempted_without_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let file =
        write(dir.path(), "ok.toml", &config(&sqlite_store(dir.path()), &[("orders", format!("http://127.0.0.1:{}", refused_port()))]));
    let out = check_config(&file, false);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains(": ok (1 route(s), 1 upstream(s))"), "{stdout}");
    assert!(!stdout.contains("upstream orders"), "{stdout}");
}

#[test]
fn connect_reports_each_upstream_and_fails_on_a_refused_one() {
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let up = listener.local_addr().unwrap().port();
    let down = refused_port();
    let ok_url = format!("http://127.0.0.1:{up}");
    let bad_url = format!("http://127.0.0.1:{down}");
    let file = write(dir.path(), "c.toml", &config(&sqlite_store(dir.path()), &[("orders", ok_url.clone()), ("billing", bad_url.clone())]));
    let out = check_config(&file, true);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{}", text(&out.stderr));
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.contains(&format!("upstream orders ({ok_url}): ok").as_str()), "{stdout}");
    let billing = lines.iter().find(|l| l.starts_with(&format!("upstream billing ({bad_url}): "))).expect("billing line");
    assert!(billing.contains("refused"), "{billing}");
    // The SQLite file does not exist yet; serve would create it (store.migrate).
    assert!(lines.iter().any(|l| l.starts_with("store: ok")), "{stdout}");
    assert!(!dir.path().join("data").exists(), "--connect created nothing");

    // All reachable: exit 0.
    let file = write(dir.path(), "ok.toml", &config(&sqlite_store(dir.path()), &[("orders", ok_url)]));
    let out = check_config(&file, true);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    drop(listener);
}

#[test]
fn connect_checks_the_sqlite_file_without_touching_it() {
    let dir = tempfile::tempdir().unwrap();
    let up = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstreams = [("orders", format!("http://{}", up.local_addr().unwrap()))];
    let db = dir.path().join("data").join("idemgate.db");
    std::fs::create_dir_all(db.parent().unwrap()).unwrap();

    // Not a database.
    std::fs::write(&db, "this is not sqlite, it is a text file with enough bytes").unwrap();
    let file = write(dir.path(), "c.toml", &config(&sqlite_store(dir.path()), &upstreams));
    let out = check_config(&file, true);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("store: ") && l.contains("not an SQLite database")), "{stdout}");

    // A real database (made by migrate) is fine and stays as it was, with no lock file.
    std::fs::remove_file(&db).unwrap();
    let migrate = Command::new(BIN).arg("migrate").arg("--config").arg(&file).output().unwrap();
    assert!(migrate.status.success(), "{}", text(&migrate.stderr));
    let before = std::fs::read(&db).unwrap();
    let entries = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        v.sort();
        v
    };
    let listing = entries(db.parent().unwrap());
    let out = check_config(&file, true);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).lines().any(|l| l.starts_with("store: ok")));
    assert_eq!(std::fs::read(&db).unwrap(), before);
    assert_eq!(entries(db.parent().unwrap()), listing, "no lock, journal or probe file left behind");

    // Missing, with store.migrate = false: serve could not start on it.
    let file = write(
        dir.path(),
        "nomigrate.toml",
        &config(
            &sqlite_store(dir.path()).replace("idemgate.db", "missing.db").replace("[store]\n", "[store]\nmigrate = false\n"),
            &upstreams,
        ),
    );
    let out = check_config(&file, true);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    assert!(text(&out.stdout).lines().any(|l| l.starts_with("store: ") && l.contains("does not exist")), "{}", text(&out.stdout));
}

#[test]
fn connect_reaches_postgres_and_never_prints_the_url() {
    let dir = tempfile::tempdir().unwrap();
    let up = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstreams = [("orders", format!("http://{}", up.local_addr().unwrap()))];
    let support::gateway::Backend::Postgres { url } = support::postgres_backend() else { unreachable!() };
    let pg = |url: &str| format!("[store]\nkind = \"postgres\"\nurl = \"{url}\"\n");

    let file = write(dir.path(), "pg.toml", &config(&pg(&url), &upstreams));
    let out = check_config(&file, true);
    assert_eq!(out.status.code(), Some(0), "{}\n{}", text(&out.stdout), text(&out.stderr));
    assert!(text(&out.stdout).lines().any(|l| l.starts_with("store: ok")), "{}", text(&out.stdout));

    // Nothing listens there: the store line says so, without the URL or its password.
    let bad = format!("postgres://idemgate:hunter2@127.0.0.1:{}/nowhere", refused_port());
    let file = write(dir.path(), "pgbad.toml", &config(&pg(&bad), &upstreams));
    let out = check_config(&file, true);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("store: ") && !l.starts_with("store: ok")), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("upstream orders (") && l.ends_with(": ok")), "{stdout}");
    let all = stdout + &text(&out.stderr);
    assert!(!all.contains("hunter2") && !all.contains("nowhere"), "{all}");
}

/// `store connections`: the most sessions the replica opens (its
/// `pool_size`) against what the server allows (`max_connections` less the
/// superusers' reserve) and has open now, and how many such replicas fit; a
/// pool larger than the server allows at all is an error (exit 1).
#[test]
fn connect_counts_a_replicas_sessions_against_what_the_server_allows() {
    let dir = tempfile::tempdir().unwrap();
    let up = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstreams = [("orders", format!("http://{}", up.local_addr().unwrap()))];
    let support::gateway::Backend::Postgres { url } = support::postgres_backend() else { unreachable!() };
    let pg = |pool: u32| format!("[store]\nkind = \"postgres\"\nurl = \"{url}\"\npool_size = {pool}\n");

    let file = write(dir.path(), "pg16.toml", &config(&pg(16), &upstreams));
    let out = check_config(&file, true);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", text(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("store connections: ok (")).unwrap_or_else(|| panic!("{stdout}"));
    // "host:port: A allowed, O open now, this replica up to about 16; room for R replica(s) ..."
    let number = |after: &str| -> i64 {
        let rest = &line[line.find(after).unwrap_or_else(|| panic!("{after:?} in {line}")) + after.len()..];
        rest.split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"))
    };
    // The server as it names itself (host:port), then what it allows.
    let server = line.trim_start_matches("store connections: ok (").split(": ").next().unwrap_or_default();
    assert!(server.starts_with("127.0.0.1:"), "{line}");
    let (allowed, open, room) = (number(&format!("{server}: ")), number("allowed, "), number("room for "));
    assert!(line.contains("this replica up to about 16;"), "{line}");
    assert!(open >= 1 && open < allowed, "{line}");
    assert_eq!(room, (allowed - open) / 16, "{line}");

    let file = write(dir.path(), "pg1024.toml", &config(&pg(1024), &upstreams));
    let out = check_config(&file, true);
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.lines().any(|l| l.starts_with("store connections: error: 127.0.0.1:")
            && l.contains(&format!(" allows {allowed} sessions"))
            && l.contains("fewer than this replica alone may open there (1024)")),
        "{stdout}"
    );
}
