//! Operating the gateway (issue 12), end to end with the real binary: the
//! access log, request ids and trace context, metrics present from the start,
//! the drain that load balancers see, `idemgate healthcheck`, and finding a
//! log line's record by its scope id.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::HashSet;
use std::time::Duration;

use idemgate::idempotency::record::State;
use support::*;

on_both_stores!(keys_show_finds_a_log_lines_record_by_scope_id);

const API_KEY_SECRET: &str = "test-key";
const BODY_SECRET: &str = "card-4111111111111111";
const QUERY_SECRET: &str = "query-token-5e3a";

/// The access-log line of the request with this id, parsed.
async fn access_line(gw: &Gateway, request_id: &str) -> serde_json::Value {
    let found = eventually(Duration::from_secs(5), || async { access_lines(gw).iter().any(|l| l["request_id"] == request_id) }).await;
    assert!(found, "no access-log line for request {request_id}:\n{}", gw.logs());
    let lines: Vec<serde_json::Value> = access_lines(gw).into_iter().filter(|l| l["request_id"] == request_id).collect();
    assert_eq!(lines.len(), 1, "exactly one line per request: {lines:?}");
    lines.into_iter().next().unwrap_or_default()
}

fn access_lines(gw: &Gateway) -> Vec<serde_json::Value> {
    gw.logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "idemgate::access")
        .collect()
}

fn request_id(r: &Resp) -> String {
    r.header("x-request-id").unwrap_or_else(|| panic!("no X-Request-Id on {r:?}")).to_owned()
}

/// Checks one line's fields and that it carries no secret.
fn check_line(line: &serde_json::Value, key: Option<&str>, route: &str, outcome: &str, status: u16) {
    let text = line.to_string();
    assert_eq!(line["message"], "request", "{text}");
    assert_eq!(line["route"], route, "{text}");
    assert_eq!(line["outcome"], outcome, "{text}");
    assert_eq!(line["status"], status, "{text}");
    assert!(line["latency_ms"].as_f64().is_some_and(|ms| ms >= 0.0), "{text}");
    assert!(line["client"].as_str().is_some_and(|c| c.starts_with("127.")), "{text}");
    assert!(line["path"].as_str().is_some_and(|p| p.starts_with('/') && !p.contains('?')), "no query string: {text}");
    for secret in [API_KEY_SECRET, BODY_SECRET, QUERY_SECRET, "Bearer"] {
        assert!(!text.contains(secret), "{secret:?} leaked into the access log: {text}");
    }
    if let Some(key) = key {
        assert_eq!(line["scope"], scope(key).log_id(), "{text}");
        assert!(!text.contains(&format!("\"{key}\"")) && !text.contains(&derived(key)), "the key leaked: {text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_has_one_line_per_outcome_and_no_secrets() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).timeout("1s").route("release_on_status = [503]"));
    let url = format!("{}?token={QUERY_SECRET}", gw.url("/v1/orders"));
    let body = format!(r#"{{"item":"book","card":"{BODY_SECRET}"}}"#);

    // forwarded, then replayed
    let first = post(&url, "secret-key-fwd-1", &body, &[]).await;
    assert_eq!(first.status, 201);
    let line = access_line(&gw, &request_id(&first)).await;
    check_line(&line, Some("secret-key-fwd-1"), "create_order", "forwarded", 201);
    assert!(line["upstream_ms"].as_f64().is_some(), "an upstream exchange: {line}");
    assert!(line.get("problem").is_none(), "{line}");

    let again = post(&url, "secret-key-fwd-1", &body, &[]).await;
    assert!(again.replayed());
    let line = access_line(&gw, &request_id(&again)).await;
    check_line(&line, Some("secret-key-fwd-1"), "create_order", "replayed", 201);
    assert!(line.get("upstream_ms").is_none(), "no upstream exchange on a replay: {line}");

    // mismatch
    let changed = post(&url, "secret-key-fwd-1", r#"{"item":"lamp"}"#, &[]).await;
    assert_eq!(changed.problem(), "idempotency-key-reused");
    let line = access_line(&gw, &request_id(&changed)).await;
    check_line(&line, Some("secret-key-fwd-1"), "create_order", "mismatch", 409);
    assert_eq!(line["problem"], "idempotency-key-reused");

    // in progress
    let mut received = up.subscribe();
    let (u, b) = (url.clone(), body.clone());
    let slow = tokio::spawn(async move { post(&u, "secret-key-slow-2", &b, &[("x-test-sleep-ms", "700")]).await });
    received.recv().await.unwrap();
    let dup = post(&url, "secret-key-slow-2", &body, &[]).await;
    assert_eq!(dup.problem(), "request-in-progress");
    check_line(&access_line(&gw, &request_id(&dup)).await, Some("secret-key-slow-2"), "create_order", "in_flight", 409);
    assert_eq!(slow.await.unwrap().status, 201);

    // unknown: the upstream answers after the 1 s timeout
    let lost = post(&url, "secret-key-lost-3", &body, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!(lost.problem(), "outcome-unknown");
    let line = access_line(&gw, &request_id(&lost)).await;
    check_line(&line, Some("secret-key-lost-3"), "create_order", "unknown", 504);

    // released: a release_on_status answer
    let declined = post(&url, "secret-key-rel-4", &body, &[("x-test-status", "503")]).await;
    assert_eq!(declined.status, 503);
    let line = access_line(&gw, &request_id(&declined)).await;
    check_line(&line, Some("secret-key-rel-4"), "create_order", "released", 503);
    assert!(line["upstream_ms"].as_f64().is_some(), "{line}");

    // rejected before any scope exists: no scope field
    let anonymous = send("POST", &url, &[("idempotency-key", "secret-key-anon-5")], body.clone()).await.unwrap();
    assert_eq!(anonymous.status, 401);
    let line = access_line(&gw, &request_id(&anonymous)).await;
    check_line(&line, None, "create_order", "rejected", 401);
    assert!(line.get("scope").is_none() && !line.to_string().contains("secret-key-anon-5"), "{line}");

    // pass-through and not found
    let get = send("GET", &format!("{}?token={QUERY_SECRET}", gw.url("/v1/orders")), &[], "").await.unwrap();
    assert_eq!(get.status, 200);
    let line = access_line(&gw, &request_id(&get)).await;
    check_line(&line, None, "passthrough", "passthrough", 200);
    assert_eq!(line["path"], "/v1/orders");
    let missing = send("GET", &gw.url("/nowhere"), &[], "").await.unwrap();
    let line = access_line(&gw, &request_id(&missing)).await;
    check_line(&line, None, "not_found", "rejected", 404);
    assert_eq!(line["problem"], "not-found");
}

/// A client that hangs up before its answer still gets its line, with 499
/// (nginx's "client closed request"), and its request is still recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_still_gets_one_line() {
    use tokio::io::AsyncWriteExt;
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let mut received = up.subscribe();
    let mut sock = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let req = "POST /v1/orders HTTP/1.1\r\nhost: x\r\nauthorization: Bearer test-key\r\nidempotency-key: gone\r\n\
               content-type: application/json\r\nx-test-sleep-ms: 500\r\ncontent-length: 2\r\n\r\n{}";
    sock.write_all(req.as_bytes()).await.unwrap();
    received.recv().await.unwrap();
    drop(sock);
    let store = backend.open().await;
    let done = eventually(Duration::from_secs(5), || {
        let store = store.clone();
        async move { settled_record(&store, "gone").await.is_some_and(|r| r.state == State::Completed) }
    })
    .await;
    assert!(done, "recorded after the client left");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lines: Vec<_> = access_lines(&gw).into_iter().filter(|l| l["scope"] == scope("gone").log_id()).collect();
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["status"], 499, "{}", lines[0]);
    assert_eq!(lines[0]["route"], "create_order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_can_be_turned_off() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server("access_log = false"));
    let r = post(&gw.url("/v1/orders"), "k", "{}", &[]).await;
    assert_eq!(r.status, 201);
    assert!(r.header("x-request-id").is_some(), "ids are independent of the log");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(access_lines(&gw).is_empty(), "{}", gw.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_echoed_sent_upstream_and_name_problems() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let url = gw.url("/v1/orders");
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    // Without an id of its own, the client's request reaches the upstream with the gateway's.
    let first = post(&url, "k1", "{}", &[("traceparent", traceparent)]).await;
    assert_eq!(first.status, 201);
    let id = request_id(&first);
    assert!(id.len() == 24 && id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
    let seen = &up.requests()[0];
    assert_eq!(seen.headers.get("x-request-id").and_then(|v| v.to_str().ok()), Some(id.as_str()), "the upstream gets the same id");
    assert_eq!(
        seen.headers.get("traceparent").and_then(|v| v.to_str().ok()),
        Some(traceparent),
        "traceparent reaches the upstream unchanged"
    );

    // A client's own X-Request-Id is not trusted by default: the gateway logs
    // and answers with its own id, and the upstream gets that one too (so
    // the upstream's logs and the gateway's meet); the access log keeps the
    // client's as `client_request_id`. (On a route whose key comes from
    // X-Request-Id the header is the key: it reaches the upstream as sent,
    // see legacy.rs.)
    let own = post(&url, "k-own", "{}", &[("x-request-id", "client-chosen")]).await;
    assert_eq!(own.status, 201);
    assert_ne!(request_id(&own), "client-chosen");
    assert_eq!(up.requests()[1].headers.get("x-request-id").and_then(|v| v.to_str().ok()), Some(request_id(&own).as_str()));
    assert_eq!(access_line(&gw, &request_id(&own)).await["client_request_id"], "client-chosen");

    // Every answer has its own id: replays and problems too.
    let replay = post(&url, "k1", "{}", &[]).await;
    assert!(replay.replayed());
    let replay_id = request_id(&replay);
    assert_ne!(replay_id, id, "a replay is another request");

    let conflict = post(&url, "k1", r#"{"other":1}"#, &[]).await;
    assert_eq!(conflict.json()["instance"], format!("urn:idemgate:request:{}", request_id(&conflict)));

    let unauthenticated = send("POST", &url, &[("idempotency-key", "k2")], "{}").await.unwrap();
    assert_eq!(unauthenticated.status, 401);
    assert_eq!(unauthenticated.header("www-authenticate"), Some(r#"Bearer realm="idemgate""#));
    assert_eq!(unauthenticated.json()["instance"], format!("urn:idemgate:request:{}", request_id(&unauthenticated)));

    let missing = send("GET", &gw.url("/nowhere"), &[], "").await.unwrap();
    assert_eq!(missing.json()["instance"], format!("urn:idemgate:request:{}", request_id(&missing)));

    let ids: HashSet<String> = [&first, &own, &replay, &conflict, &unauthenticated, &missing].iter().map(|r| request_id(r)).collect();
    assert_eq!(ids.len(), 6, "unique ids: {ids:?}");
    assert_eq!(up.total(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trusted_proxies_keep_their_request_id() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server(r#"trusted_proxies = ["127.0.0.1/32", "::1"]"#));
    let r = post(&gw.url("/v1/orders"), "k1", "{}", &[("x-request-id", "edge-7f3a-42")]).await;
    assert_eq!(request_id(&r), "edge-7f3a-42");
    assert_eq!(up.requests()[0].headers.get("x-request-id").and_then(|v| v.to_str().ok()), Some("edge-7f3a-42"));
    assert_eq!(access_line(&gw, "edge-7f3a-42").await["outcome"], "forwarded");
    // An id that cannot be carried safely is replaced even from a trusted peer.
    let odd = post(&gw.url("/v1/orders"), "k2", "{}", &[("x-request-id", "has space")]).await;
    assert_ne!(request_id(&odd), "has space");
}

/// The metric names (before any label) a PromQL expression or exposition uses.
fn metric_names(text: &str) -> HashSet<String> {
    let mut names = HashSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let starts = (text[i..].starts_with("idemgate_") || text[i..].starts_with("process_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts {
            let end = text[i..].find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(text.len(), |n| i + n);
            names.insert(text[i..end].to_owned());
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_series_is_present_from_the_start() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).tail(
        "[[routes]]\noperation = \"ship_order\"\nmethod = \"POST\"\npath = \"/v1/shipments\"\nupstream = \"orders\"\nmode = \"async\"",
    ));
    // Before any request.
    let text = String::from_utf8_lossy(&send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap().body).into_owned();
    for series in [
        r#"idemgate_requests_total{operation="create_order",outcome="forwarded"} 0"#,
        r#"idemgate_requests_total{operation="create_order",outcome="unknown"} 0"#,
        r#"idemgate_requests_total{operation="ship_order",outcome="accepted"} 0"#,
        r#"idemgate_rejections_total{reason="not-found"} 0"#,
        r#"idemgate_rejections_total{reason="unauthenticated"} 0"#,
        r#"idemgate_rejections_total{reason="invalid-body"} 0"#,
        r#"idemgate_passthrough_requests_total{upstream="orders"} 0"#,
        r#"idemgate_passthrough_failures_total{upstream="orders",reason="gateway-timeout"} 0"#,
        r#"idemgate_records{operation="create_order",state="unknown"} 0"#,
        r#"idemgate_records{operation="ship_order",state="queued"} 0"#,
        r#"idemgate_oldest_record_age_seconds{operation="create_order",state="unknown"} 0"#,
        r#"idemgate_async_attempts_total{operation="ship_order",outcome="completed"} 0"#,
        r#"idemgate_store_errors_total{op="claim"} 0"#,
        r#"idemgate_store_errors_total{op="take"} 0"#,
        r#"idemgate_fenced_writes_total{op="complete"} 0"#,
        r#"idemgate_upstream_duration_seconds_count{upstream="orders"} 0"#,
        "idemgate_swept_records_total 0",
        "idemgate_expired_leases_total 0",
        "idemgate_forwards_in_flight 0",
        "idemgate_draining 0",
        "idemgate_log_write_errors_total 0",
        concat!(r#"idemgate_build_info{version=""#, env!("CARGO_PKG_VERSION"), r#""} 1"#),
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }
    for name in
        ["process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "process_max_fds", "process_start_time_seconds"]
    {
        assert!(text.lines().any(|l| l.starts_with(name)), "missing {name} in\n{text}");
    }

    // Counted as they happen.
    send("GET", &gw.url("/nowhere"), &[], "").await.unwrap();
    send("GET", &gw.url("/v1/orders"), &[], "").await.unwrap();
    send("POST", &gw.url("/v1/orders"), &[("idempotency-key", "k")], "{}").await.unwrap();
    let text = String::from_utf8_lossy(&send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap().body).into_owned();
    for series in [
        r#"idemgate_rejections_total{reason="not-found"} 1"#,
        r#"idemgate_rejections_total{reason="unauthenticated"} 1"#,
        r#"idemgate_passthrough_requests_total{upstream="orders"} 1"#,
    ] {
        assert!(text.contains(series), "missing {series} in\n{text}");
    }

    // What the shipped alert rules and dashboard query exists.
    let exposed = metric_names(&text);
    let root = env!("CARGO_MANIFEST_DIR");
    for file in ["deploy/prometheus/alerts.yaml", "deploy/grafana/dashboards/idemgate.json"] {
        let used = metric_names(&std::fs::read_to_string(format!("{root}/{file}")).unwrap());
        assert!(!used.is_empty(), "{file} queries no metric");
        for name in used {
            if name.starts_with("idemgate_tls_") {
                continue; // needs a TLS listener: tests/it/deploy.rs checks these on a gateway with one
            }
            let base = ["_bucket", "_count", "_sum"].iter().fold(name.as_str(), |n, s| n.strip_suffix(s).unwrap_or(n));
            assert!(
                exposed.contains(&name) || exposed.iter().any(|e| e.starts_with(base)),
                "{file} uses {name}, which the gateway does not expose"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_is_503_during_the_drain_while_in_flight_requests_finish() {
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let mut gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("10s").server(r#"drain_delay = "3s""#));
    let url = gw.url("/v1/orders");
    assert_eq!(send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status, 200);
    assert_eq!(cli_healthcheck(&gw, &[]), 0, "ready");

    let mut received = up.subscribe();
    let u = url.clone();
    let slow = tokio::spawn(async move { post(&u, "slow", "{}", &[("x-test-sleep-ms", "4500")]).await });
    received.recv().await.unwrap();
    gw.signal("TERM");

    // At once: not ready, while the process still serves.
    let drained = eventually(Duration::from_secs(2), || async {
        send("GET", &gw.admin_url("/readyz"), &[], "").await.is_ok_and(|r| r.status == 503 && r.body.starts_with(b"draining"))
    })
    .await;
    assert!(drained, "readyz did not turn 503:\n{}", gw.logs());
    assert_eq!(cli_healthcheck(&gw, &[]), 1, "a draining replica is not ready");
    assert_eq!(cli_healthcheck(&gw, &["--live"]), 0, "but alive");
    let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    assert!(String::from_utf8_lossy(&metrics.body).contains("idemgate_draining 1"));

    // Within the drain delay the listener still accepts new requests.
    let late = post(&url, "late", "{}", &[]).await;
    assert_eq!(late.status, 201, "accepted during the drain delay");

    // The slow request finishes and is recorded; the process exits 0.
    let slow = slow.await.unwrap();
    assert_eq!(slow.status, 201);
    let status = tokio::task::spawn_blocking(move || {
        let s = gw.wait_exit(Duration::from_secs(30));
        (s, gw)
    })
    .await
    .unwrap();
    assert!(status.0.success(), "exit status {:?}", status.0);
    let store = backend.open().await;
    assert_eq!(settled_record(&store, "slow").await.unwrap().state, State::Completed);
    assert_eq!(settled_record(&store, "late").await.unwrap().state, State::Completed);
    assert_eq!(up.total(), 2);
}

/// `idemgate healthcheck` against a gateway's admin listener; its exit code.
/// (Test configs let the system pick the admin port, so it is passed with
/// `--addr`; `healthcheck_exit_codes` also reads it from a config.)
fn cli_healthcheck(gw: &Gateway, extra: &[&str]) -> i32 {
    let admin = gw.admin.expect("admin listener").to_string();
    let mut args = vec!["healthcheck", "--addr", &admin];
    args.extend_from_slice(extra);
    tokio::task::block_in_place(|| cli(gw, &args).0)
}

/// `idemgate healthcheck --config` with the gateway's config, its admin
/// listener at the port it got.
fn healthcheck_by_config(gw: &Gateway, admin: std::net::SocketAddr, extra: &[&str]) -> (i32, String, String) {
    let toml = std::fs::read_to_string(gw.config_path())
        .unwrap()
        .replace("[admin]\nlisten = \"127.0.0.1:0\"", &format!("[admin]\nlisten = \"{admin}\""));
    let path = gw.dir().join("healthcheck.toml");
    std::fs::write(&path, toml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .arg("healthcheck")
        .args(extra)
        .arg("--config")
        .arg(&path)
        .env("IDEMGATE_TEST_DERIVED_KEY_SECRET", TEST_SECRET)
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthcheck_exit_codes() {
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let admin = gw.admin.unwrap();
    let (code, out, err) = tokio::task::block_in_place(|| healthcheck_by_config(&gw, admin, &[]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("/readyz") && out.contains("200"), "{out}");
    assert_eq!(tokio::task::block_in_place(|| healthcheck_by_config(&gw, admin, &["--live"])).0, 0);
    assert_eq!(cli_healthcheck(&gw, &[]), 0);

    gw.kill9();
    let (code, out, _) = tokio::task::block_in_place(|| healthcheck_by_config(&gw, admin, &["--timeout", "1s"]));
    assert_eq!(code, 1, "a dead gateway is unhealthy: {out}");
    assert!(out.contains("cannot reach"), "{out}");

    // No admin listener configured: nothing to ask.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-admin.toml");
    let toml = GatewayConfig::new(sqlite_backend(), up.url()).toml().replace("[admin]\nlisten = \"127.0.0.1:0\"\n", "");
    std::fs::write(&path, toml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["healthcheck", "--config"])
        .arg(&path)
        .env("IDEMGATE_TEST_DERIVED_KEY_SECRET", TEST_SECRET)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "a configuration problem, not \"not ready\"");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no [admin] listener"), "{out:?}");

    // Usage errors are 2.
    assert_eq!(cli_healthcheck(&gw, &["--timeout", "soon"]), 2);
}

async fn keys_show_finds_a_log_lines_record_by_scope_id(backend: Backend) {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms"));
    let lost = post(&gw.url("/v1/orders"), "lost-key", "{}", &[("x-test-sleep-ms", "1000")]).await;
    assert_eq!(lost.problem(), "outcome-unknown");
    post(&gw.url("/v1/orders"), "other-key", "{}", &[]).await;

    // What an operator has: the log line.
    let line = access_line(&gw, &request_id(&lost)).await;
    let scope_id = line["scope"].as_str().expect("scope in the access log").to_owned();

    let (code, out, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", &scope_id]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("key=lost-key") && out.contains("state:       unknown"), "{out}");
    assert!(out.contains(&format!("scope id:    {scope_id}")), "{out}");
    assert!(!out.contains("other-key"), "{out}");

    let (code, out, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", &scope_id.to_uppercase(), "--json"]));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["key"], "lost-key");
    assert_eq!(v["scope_id"], scope_id);

    let (code, out, _) = tokio::task::block_in_place(|| cli(&gw, &["keys", "list"]));
    assert_eq!(code, 0);
    assert!(out.contains("SCOPE_ID") && out.contains(&scope_id), "{out}");

    let (code, _, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", "0000000000000000"]));
    assert_eq!(code, 1);
    assert!(err.contains("no record"), "{err}");
    let (code, _, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", "not-hex"]));
    assert_eq!(code, 1);
    assert!(err.contains("16 hex digits"), "{err}");
    let (code, _, _) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", &scope_id, "--key", "x"]));
    assert_eq!(code, 2, "--scope-id or the scope's parts, not both");
}

/// Records claimed before migration 0005 have no stored scope id; the lookup
/// still finds them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_by_scope_id_finds_records_from_before_the_column() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    for key in ["old-1", "old-2", "old-3"] {
        assert_eq!(post(&gw.url("/v1/orders"), key, "{}", &[]).await.status, 201);
    }
    let Backend::Sqlite { path, .. } = &backend else { unreachable!() };
    let db = rusqlite::Connection::open(path).unwrap();
    db.busy_timeout(Duration::from_secs(5)).unwrap();
    assert_eq!(db.execute("UPDATE idemgate_records SET scope_id = NULL", []).unwrap(), 3);
    drop(db);
    let id = scope("old-2").log_id();
    let (code, out, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", &id]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("key=old-2") && !out.contains("key=old-1"), "{out}");
}

/// Access lines are written in batches (every 100 ms); the ones still
/// waiting when the gateway stops are written before it exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_lines_still_batched_are_written_before_exit() {
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let r = post(&gw.url("/v1/orders"), "k", "{}", &[]).await;
    assert_eq!(r.status, 201);
    let id = request_id(&r);
    gw.signal("TERM");
    assert!(gw.wait_exit(Duration::from_secs(10)).success());
    let found = eventually(Duration::from_secs(2), || async { access_lines(&gw).iter().any(|l| l["request_id"] == id) }).await;
    assert!(found, "the last access line was lost at exit:\n{}", gw.logs());
}

/// Migrations 0009 (scope columns `COLLATE "C"`), 0010 (the primary key
/// compares the idempotency key first) and 0011 (the scope id, computed by
/// the database, leads the key) on a database that already holds records,
/// one of them from before scope ids were stored, run by `idemgate migrate`
/// while the gateway serves: the records claimed before them are still found
/// and replayed after them, the old one by its scope id too, and the
/// gateway's pooled connections, whose prepared statements the schema change
/// made stale, are replaced without a refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_before_byte_order_scopes_replay_after_the_migrations() {
    let backend = postgres_backend();
    let Backend::Postgres { url } = &backend else { unreachable!() };
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    // Back to the schema before 0009: the key in scope order, the database's
    // own collation, the scope id optional and in an index of its own (the
    // function that computes it stays: this gateway's statements call it).
    db.batch_execute(
        "ALTER TABLE idemgate_records DROP CONSTRAINT idemgate_records_pkey, \
         ADD CONSTRAINT idemgate_records_pkey PRIMARY KEY (tenant, principal, operation, idempotency_key), \
         ALTER COLUMN scope_id DROP NOT NULL; \
         CREATE INDEX idemgate_records_scope_id ON idemgate_records (scope_id); \
         CREATE INDEX idemgate_records_no_scope_id ON idemgate_records (tenant, principal, operation, idempotency_key) \
         WHERE scope_id IS NULL; \
         ALTER TABLE idemgate_records ALTER COLUMN tenant TYPE text COLLATE \"default\", \
         ALTER COLUMN principal TYPE text COLLATE \"default\", ALTER COLUMN operation TYPE text COLLATE \"default\", \
         ALTER COLUMN idempotency_key TYPE text COLLATE \"default\"; \
         DELETE FROM idemgate_schema_migrations WHERE version IN (9, 10, 11)",
    )
    .await
    .expect("undo 0009, 0010 and 0011");
    let mut first = Vec::new();
    for key in ["Zebra", "apple", "_under"] {
        let r = post(&gw.url("/v1/orders"), key, "{}", &[]).await;
        assert_eq!(r.status, 201, "{r:?}");
        first.push(r);
    }
    // "apple" as claimed before migration 0005: no scope id stored.
    let n = db.execute("UPDATE idemgate_records SET scope_id = NULL WHERE idempotency_key = 'apple'", &[]).await.expect("old record");
    assert_eq!(n, 1);

    let (code, out, err) = tokio::task::block_in_place(|| cli(&gw, &["migrate"]));
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("0009") && out.contains("0010") && out.contains("0011"), "the migrations ran again: {out}");
    let collations: Vec<String> = scope_collations(&db, "idemgate_records").await.into_iter().map(|(_, c)| c).collect();
    assert_eq!(collations, vec!["C"; 4]);
    assert_eq!(primary_key_columns(&db).await, ["scope_id", "idempotency_key", "tenant", "principal", "operation"]);
    let (code, out, err) = tokio::task::block_in_place(|| cli(&gw, &["keys", "show", "--scope-id", &scope("apple").log_id()]));
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("key=apple") && !out.contains("key=Zebra"), "{out}");

    for (key, before) in ["Zebra", "apple", "_under"].into_iter().zip(&first) {
        let again = post(&gw.url("/v1/orders"), key, "{}", &[]).await;
        assert!(again.replayed(), "{key}: {again:?}\n{}", gw.logs());
        assert_eq!(again.body, before.body, "{key}");
        assert_eq!(up.side_effects(&derived(key)), 1, "{key}");
    }
    assert_eq!(post(&gw.url("/v1/orders"), "after", "{}", &[]).await.status, 201);
    assert!(gw.log_count("cached plan must not change") >= 1, "the stale connections were flushed:\n{}", gw.logs());
    assert_eq!(gw.log_count("nothing forwarded"), 0, "no request was refused:\n{}", gw.logs());
}
