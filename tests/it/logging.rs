//! Logging never affects a request or a signal, and its settings are checked
//! at start. The real binary runs with its stderr on a pipe the test closes:
//! mid-run (after the `listening` line) or before the first line. Either way
//! a request is forwarded once and recorded, its retry is a replay, and
//! SIGTERM drains and exits 0.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::io::{BufRead, BufReader, PipeReader, Read as _};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemgate::idempotency::record::State;
use idemgate::store::Store;
use support::gateway::{ServeProcess, TEST_SECRET_ENV, free_local_addr, listening_addr};
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// Log levels that put lines on the request path itself: hyper-util logs
/// "connecting to ..." at debug while a claimed request is being forwarded.
const CHATTY: (&str, &str) = ("IDEMGATE_LOG", "info,idemgate=debug,hyper_util=debug");

/// Reads log lines until the `listening` one; returns the proxy address and
/// the still-open reader.
async fn wait_listening(reader: PipeReader) -> (std::net::SocketAddr, BufReader<PipeReader>) {
    tokio::task::spawn_blocking(move || {
        let mut reader = BufReader::new(reader);
        let mut seen = Vec::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => panic!("the gateway closed its log before listening:\n{}", seen.join("")),
                Ok(_) => {}
            }
            if let Some(addr) = listening_addr(&line) {
                return (addr, reader);
            }
            seen.push(line);
        }
    })
    .await
    .unwrap()
}

/// A first request forwarded and recorded, a replay, then SIGTERM: exit 0.
async fn request_replay_and_drain(gw: &mut ServeProcess, up: &TestUpstream, store: &Store, url: &str) {
    let first = post(url, "k1", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(up.side_effects(&derived("k1")), 1);
    let rec = settled_record(store, "k1").await.expect("record");
    assert_eq!(rec.state, State::Completed);

    let again = post(url, "k1", ORDER, &[]).await;
    assert_eq!(again.status, 201, "{again:?}");
    assert!(again.replayed(), "the retry is a replay");
    assert_eq!(again.body, first.body);
    assert_eq!(up.side_effects(&derived("k1")), 1, "the retry did not reach the upstream");
    assert_eq!(up.total(), 1);

    gw.signal("TERM");
    let status = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(20)));
    assert!(status.success(), "SIGTERM drains and exits 0, got {status:?}");
    assert_eq!(settled_record(store, "k1").await.expect("record").state, State::Completed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_reader_lost_mid_run_breaks_nothing() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(backend.clone(), up.url());
    let (reader, writer) = std::io::pipe().unwrap();
    let mut gw = ServeProcess::spawn(&config, writer.into(), &[CHATTY]);
    let (addr, reader) = wait_listening(reader).await;
    // The log reader goes away (tee exited, journald restarted): every later
    // log write fails with EPIPE.
    drop(reader);
    let store = backend.open().await;
    request_replay_and_drain(&mut gw, &up, &store, &format!("http://{addr}/v1/orders")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_pipe_closed_before_the_first_line_breaks_nothing() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let mut config = GatewayConfig::new(backend.clone(), up.url());
    // Nothing can be read from its log, so the port is chosen here.
    config.listen = free_local_addr();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let mut gw = ServeProcess::spawn(&config, writer.into(), &[CHATTY]);
    let url = format!("http://{}/v1/orders", config.listen);
    let up_and_serving = eventually(Duration::from_secs(30), || {
        let url = url.clone();
        async move { send("GET", &url, &[], "").await.is_ok() }
    })
    .await;
    assert!(up_and_serving, "the gateway never served; exit status {:?}", gw.exited());
    let store = backend.open().await;
    request_replay_and_drain(&mut gw, &up, &store, &url).await;
}

/// Runs `idemgate serve` with extra environment until it exits or is
/// interrupted after its `listening` line; returns (exit code, stderr).
fn serve_briefly(config: &GatewayConfig, env: &[(&str, &str)]) -> (i32, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    std::fs::write(&path, config.toml()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&path)
        .env_remove("IDEMGATE_LOG")
        .env_remove("IDEMGATE_LOG_FORMAT")
        .env(TEST_SECRET_ENV, TEST_SECRET)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut text = String::new();
    let mut line = String::new();
    while stderr.read_line(&mut line).unwrap_or(0) > 0 {
        text.push_str(&line);
        if line.contains("listening") {
            let _ = Command::new("kill").arg("-INT").arg(child.id().to_string()).status();
        }
        line.clear();
    }
    let _ = stderr.read_to_string(&mut text);
    let status = child.wait().unwrap();
    (status.code().unwrap_or(-1), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_settings_are_checked_at_start() {
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(sqlite_backend(), up.url());

    let run = |env: &[(&str, &str)]| tokio::task::block_in_place(|| serve_briefly(&config, env));
    let (code, err) = run(&[("IDEMGATE_LOG_FORMAT", "yaml")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("IDEMGATE_LOG_FORMAT") && err.contains("yaml"), "{err}");
    assert!(!err.contains("listening"), "it stops before serving:\n{err}");

    let (code, err) = run(&[("IDEMGATE_LOG", "idemgate=loud")]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("IDEMGATE_LOG=") && err.contains("idemgate=loud"), "{err}");
    assert!(!err.contains("listening"), "no silent fallback to a default filter:\n{err}");

    // Any case selects JSON.
    let (code, err) = run(&[("IDEMGATE_LOG_FORMAT", "JSON")]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> =
        err.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"))).collect();
    assert!(lines.iter().any(|v| v["message"] == "listening"), "{err}");

    // Text on a pipe (not a terminal): no colour codes.
    let (code, err) = run(&[("IDEMGATE_LOG_FORMAT", "Text")]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("listening"), "{err}");
    assert!(!err.contains('\u{1b}'), "no ANSI escapes when stderr is not a terminal:\n{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_errors_print_each_cause_once() {
    let up = TestUpstream::start().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = GatewayConfig::new(sqlite_backend(), up.url());
    config.listen = taken.local_addr().unwrap();
    let (code, err) = tokio::task::block_in_place(|| serve_briefly(&config, &[]));
    assert_eq!(code, 1, "{err}");
    let line = err.lines().find(|l| l.starts_with("idemgate: ")).unwrap_or_else(|| panic!("no error line:\n{err}"));
    assert!(line.contains(&format!("cannot listen on {}", config.listen)), "{line}");
    assert_eq!(line.matches("in use").count(), 1, "the cause once: {line}");
}

/// A PostgreSQL server error, formatted by the chain the logs use, carries
/// the SQLSTATE and the server's message (tokio-postgres's own Display says
/// only "db error").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_errors_show_sqlstate_and_message() {
    let pg = support::postgres::shared();
    let url = pg.url("no_such_database");
    let Err(e) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await else { panic!("connected to a database that does not exist") };
    assert_eq!(e.to_string(), "db error", "tokio-postgres alone hides the server's message");
    let text = idemgate::telemetry::logging::ErrorChain(&e).to_string();
    assert!(text.contains("SQLSTATE 3D000"), "{text}");
    assert!(text.contains(r#"database "no_such_database" does not exist"#), "{text}");
    assert_eq!(text.matches("does not exist").count(), 1, "{text}");
}

/// Runs a CLI command with stdout on a pipe nobody reads; returns (exit code, stderr).
fn cli_into_closed_stdout(config: &std::path::Path, args: &[&str]) -> (i32, String) {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .arg("--config")
        .arg(config)
        .env(TEST_SECRET_ENV, TEST_SECRET)
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_output_into_a_closed_pipe_is_an_error_not_a_panic() {
    let backend = sqlite_backend();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    // The config holds a clone of the backend, which keeps its directory alive.
    let config = GatewayConfig::new(backend, "http://127.0.0.1:9".into());
    std::fs::write(&path, config.toml()).unwrap();

    // `migrate`'s report is best effort: the migrations are applied either way.
    let (code, err) = tokio::task::block_in_place(|| cli_into_closed_stdout(&path, &["migrate"]));
    assert_eq!(code, 0, "{err}");

    // `keys list` exists to print: it cannot, so it fails (exit 1, not a panic's 101).
    let (code, err) = tokio::task::block_in_place(|| cli_into_closed_stdout(&path, &["keys", "list"]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot write to stdout"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // `check-config`'s verdict is its exit code; the line is best effort.
    let (code, err) = tokio::task::block_in_place(|| cli_into_closed_stdout(&path, &["check-config"]));
    assert_eq!(code, 0, "{err}");
}

/// A start that fails on PostgreSQL names the server's reason once, with its
/// SQLSTATE (the store formats driver errors with `logging::ErrorChain`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_start_errors_name_the_reason() {
    let pg = support::postgres::shared();
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(Backend::Postgres { url: pg.url("no_such_database") }, up.url());
    let (code, err) = tokio::task::block_in_place(|| serve_briefly(&config, &[]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(r#"database "no_such_database" does not exist (SQLSTATE 3D000)"#), "{err}");
    assert_eq!(err.matches("does not exist").count(), 1, "{err}");
}
