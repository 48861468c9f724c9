//! Signals on the real binary: SIGHUP never stops `serve` (it reloads the
//! configuration, see tests/it/reload.rs) or `demo` (logged as ignored); SIGTERM
//! still drains and exits 0.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const IGNORED: &str = "SIGHUP ignored: this command does not reload; configuration unchanged";
const RELOADED: &str = "configuration reloaded";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_serve_and_never_stops_it() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));

    gw.signal("HUP");
    let logged = eventually(Duration::from_secs(10), || async { gw.log_count(RELOADED) == 1 }).await;
    assert!(logged, "the first SIGHUP reloads the (unchanged) file:\n{}", gw.logs());
    gw.signal("HUP");
    let logged = eventually(Duration::from_secs(10), || async { gw.log_count(RELOADED) == 2 }).await;
    assert!(logged, "and so does the next one:\n{}", gw.logs());
    assert_eq!(gw.log_count(IGNORED), 0);

    // Still serving, with the same behaviour.
    let url = gw.url("/v1/orders");
    let first = post(&url, "k1", ORDER, &[]).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(&url, "k1", ORDER, &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(up.side_effects(&derived("k1")), 1);
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "k1").await.expect("record").state, State::Completed);

    gw.signal("TERM");
    let status = tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(20)));
    assert!(status.success(), "SIGTERM after SIGHUP drains and exits 0, got {status:?}:\n{}", gw.logs());
    // The process has exited; its last lines may still be on their way through the pipe.
    let logged = eventually(Duration::from_secs(5), || async { gw.log_count("\"shutting down\"") == 1 }).await;
    assert!(logged, "one shutdown line:\n{}", gw.logs());
}

/// Kills the child if the test ends early.
struct Reap(std::process::Child);

impl Drop for Reap {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn sighup_is_ignored_by_the_demo() {
    let data = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["demo", "--listen", "127.0.0.1:0", "--upstream-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--data"])
        .arg(data.path())
        .env_remove("IDEMGATE_CONFIG")
        .env("IDEMGATE_LOG", "info")
        .env("IDEMGATE_LOG_FORMAT", "json")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemgate demo");
    let mut child = Reap(child);
    let child = &mut child.0;
    let logs = Arc::new(Mutex::new(Vec::<String>::new()));
    let stderr = child.stderr.take().unwrap();
    let l = logs.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            l.lock().unwrap().push(line);
        }
    });
    let pid = child.id().to_string();
    let kill = |sig: &str| assert!(Command::new("kill").arg(sig).arg(&pid).status().unwrap().success());
    let wait_log = |needle: &str, n: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while logs.lock().unwrap().iter().filter(|l| l.contains(needle)).count() < n {
            assert!(Instant::now() < deadline, "no {needle:?} in the demo's log:\n{}", logs.lock().unwrap().join("\n"));
            std::thread::sleep(Duration::from_millis(20));
        }
    };

    // The demo prints its gateway's address once it serves.
    let mut gateway = None;
    for line in BufReader::new(child.stdout.take().unwrap()).lines().map_while(Result::ok) {
        if let Some(rest) = line.trim_start().strip_prefix("gateway") {
            gateway = rest.split_whitespace().next().map(str::to_owned);
        }
        if line.contains("Press Ctrl-C to stop.") {
            break;
        }
    }
    let gateway = gateway.unwrap_or_else(|| panic!("no gateway address printed:\n{}", logs.lock().unwrap().join("\n")));

    kill("-HUP");
    wait_log(IGNORED, 1);
    assert!(child.try_wait().unwrap().is_none(), "the demo survived SIGHUP");

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let order = runtime.block_on(async {
        let h = [("authorization", "Bearer demo-key"), ("content-type", "application/json"), ("idempotency-key", "after-hup")];
        send("POST", &format!("{gateway}/v1/orders"), &h, ORDER).await
    });
    let order = order.unwrap_or_else(|e| panic!("the demo's gateway stopped serving after SIGHUP: {e}"));
    assert_eq!(order.status, 201, "{order:?}");

    kill("-TERM");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            panic!("the demo did not exit after SIGTERM:\n{}", logs.lock().unwrap().join("\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}
