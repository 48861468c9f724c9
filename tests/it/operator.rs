//! What an on-call operator meets (issue 31, item 8): keep-alive clients told
//! to go during the drain delay, an admin API that says it is disabled and how
//! to enable it, `--state` errors that name every state, and warnings that an
//! outage repeats per request or per retry, logged a few times instead of
//! flooding the log.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use support::postgres::PgServer;
use support::{Backend, Gateway, GatewayConfig, TestUpstream, eventually, post, send, sqlite_backend};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// One request on an open connection; the status, the headers (lower-case
/// names) and the body (Content-Length bodies only).
async fn exchange(conn: &mut TcpStream, request: &str) -> (u16, BTreeMap<String, String>, String) {
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut byte)).await.expect("a response").unwrap();
        assert_eq!(n, 1, "the connection closed before the response head: {:?}", String::from_utf8_lossy(&buf));
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: BTreeMap<String, String> =
        lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned())).collect();
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; len];
    conn.read_exact(&mut body).await.unwrap();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

const GET_NOWHERE: &str = "GET /nowhere HTTP/1.1\r\nHost: gateway\r\n\r\n";

fn post_order(key: &str) -> String {
    format!(
        "POST /v1/orders HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer test-key\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
    )
}

/// During `drain_delay` the proxy still answers, and every answer carries
/// `Connection: close`, so keep-alive clients reconnect (to another replica)
/// before connections are closed under them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_drain_delay_answers_carry_connection_close() {
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server(r#"drain_delay = "4s""#));
    let mut kept = TcpStream::connect(gw.addr).await.unwrap();
    let (status, headers, _) = exchange(&mut kept, GET_NOWHERE).await;
    assert_eq!(status, 404);
    assert_eq!(headers.get("connection"), None, "keep-alive before the drain: {headers:?}");

    gw.signal("TERM");
    let draining = eventually(Duration::from_secs(3), || async {
        send("GET", &gw.admin_url("/readyz"), &[], "").await.is_ok_and(|r| r.status == 503)
    })
    .await;
    assert!(draining, "the drain started");

    // The open keep-alive connection: answered, told to close, then closed.
    let (status, headers, _) = exchange(&mut kept, &post_order("drain-1")).await;
    assert_eq!(status, 201);
    assert_eq!(headers.get("connection").map(String::as_str), Some("close"), "{headers:?}");
    let mut rest = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(3), kept.read(&mut rest)).await.expect("closed by the gateway").unwrap_or(0);
    assert_eq!(n, 0, "the gateway closes the connection after that answer");

    // A new connection during the delay: served, and told the same.
    let mut fresh = TcpStream::connect(gw.addr).await.unwrap();
    let (status, headers, _) = exchange(&mut fresh, GET_NOWHERE).await;
    assert_eq!(status, 404);
    assert_eq!(headers.get("connection").map(String::as_str), Some("close"), "{headers:?}");

    // The order was executed once and recorded.
    assert_eq!(up.total(), 1);
    let status = gw.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status}");
    let store = gw.config.backend.open().await;
    assert_eq!(support::record(&store, "drain-1").await.map(|r| r.state), Some(State::Completed));
}

/// Without a token the admin API is off; it says so, and how to turn it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_says_it_is_disabled_and_how_to_enable_it() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let r = send("GET", &gw.admin_url("/admin/records?state=unknown"), &[("authorization", "Bearer guess")], "").await.unwrap();
    assert_eq!(r.status, 404, "{r:?}");
    let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
    assert!(detail.contains("disabled") && detail.contains("token_env") && detail.contains("token_file"), "{detail}");
    assert_eq!(r.problem(), "not-found");

    // Enabled: an unknown endpoint is a plain 404, a bad token 401, and a bad
    // `state` names every state there is.
    let dir = tempfile::tempdir().unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "operator-token-0123456789abcdef").unwrap();
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).admin(&format!("token_file = \"{}\"", token.display())));
    let auth = [("authorization", "Bearer operator-token-0123456789abcdef")];
    let r = send("GET", &gw.admin_url("/admin/nothing-here"), &auth, "").await.unwrap();
    assert_eq!((r.status, r.problem()), (404, "not-found".to_owned()));
    let r = send("GET", &gw.admin_url("/admin/records"), &[("authorization", "Bearer guess")], "").await.unwrap();
    assert_eq!(r.status, 401);
    let r = send("GET", &gw.admin_url("/admin/records?state=bogus"), &auth, "").await.unwrap();
    assert_eq!(r.status, 400);
    let detail = r.json()["detail"].as_str().unwrap_or_default().to_owned();
    for s in State::ALL {
        assert!(detail.contains(s.as_str()), "{s} missing from: {detail}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_list_state_names_every_state() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let (code, _, err) = tokio::task::block_in_place(|| support::cli(&gw, &["keys", "list", "--state", "bogus"]));
    assert_eq!(code, 2, "{err}");
    for s in State::ALL {
        assert!(err.contains(s.as_str()), "{s} missing from: {err}");
    }
    for s in State::ALL {
        let (code, _, err) = tokio::task::block_in_place(|| support::cli(&gw, &["keys", "list", "--state", s.as_str()]));
        assert_eq!(code, 0, "--state {s}: {err}");
    }
}

/// WARN lines of a JSON log, by message.
fn warnings(lines: &[&str]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for l in lines {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(l) else { continue };
        if v["level"] == "WARN" {
            *out.entry(v["message"].as_str().unwrap_or_default().to_owned()).or_default() += 1;
        }
    }
    out
}

/// A PostgreSQL outage with traffic: a result write stuck in its background
/// retries, a request every 250 ms whose claim fails, a readiness probe
/// every 250 ms. Each kind of warning is logged when it starts and then at
/// most once per window with the count it stood for, not once per attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_logs_each_warning_a_few_times_not_per_attempt() {
    let mut pg = PgServer::start().expect("start PostgreSQL");
    let url = pg.create_database("outage").unwrap();
    let up = TestUpstream::start().await;
    // The default sweep interval: background passes fail at their production pace.
    let gw = Gateway::start(GatewayConfig::new(Backend::Postgres { url }, up.url()).timeout("20s").sweep_interval("30s"));
    let target = gw.url("/v1/orders");

    // The stuck result write: PostgreSQL stops while the upstream works.
    let mut received = up.subscribe();
    let t = target.clone();
    let slow = tokio::spawn(async move { post(&t, "stuck", "{}", &[("x-test-sleep-ms", "1500")]).await });
    received.recv().await.unwrap();
    tokio::task::block_in_place(|| pg.stop_immediate()).unwrap();
    assert_eq!(slow.await.unwrap().status, 201, "the client has its answer");
    let mark = gw.logs().lines().count();

    // Ten seconds of traffic and probes against the dead store.
    let until = Instant::now() + Duration::from_secs(10);
    let (mut refused, mut probes) = (0, 0);
    let mut n = 0;
    while Instant::now() < until {
        n += 1;
        let r = post(&target, &format!("outage-{n}"), "{}", &[]).await;
        assert_eq!(r.status, 503, "{}", String::from_utf8_lossy(&r.body));
        refused += 1;
        if send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status == 503 {
            probes += 1;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(refused >= 10 && probes >= 10, "{refused} refused requests, {probes} failed probes");
    let logs = gw.logs();
    let window: Vec<&str> = logs.lines().skip(mark).collect();
    let counted = warnings(&window);
    eprintln!("{refused} refused requests, {probes} failed probes; warnings in the window: {counted:#?}");
    for (message, count) in &counted {
        assert!(*count <= 3, "{count} × {message:?} in 10 s (limit them):\n{counted:#?}");
    }
    assert!(counted.keys().any(|m| m.contains("claim failed")), "the outage still shows: {counted:#?}");
    assert!(counted.keys().any(|m| m.contains("readiness check failed")), "{counted:#?}");
    let total: usize = counted.values().sum();
    assert!(total <= 20, "{total} warnings in 10 s:\n{counted:#?}");

    // Back: the stuck result lands (its lease is 25 s) and the key was executed once.
    tokio::task::block_in_place(|| pg.start_again()).unwrap();
    let store = gw.config.backend.open().await;
    let settled = eventually(Duration::from_secs(20), || async {
        support::record(&store, "stuck").await.is_some_and(|r| r.state == State::Completed)
    })
    .await;
    assert!(settled, "{}", gw.logs());
    assert_eq!(up.side_effects(&support::derived("stuck")), 1);
}
