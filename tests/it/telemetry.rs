//! The signals operators chart and search, scraped and read from the real
//! binary: request counts by operation, protocol and status class, request
//! duration, open connections beside their limit, upstream errors by kind;
//! request ids that are the same at the client, in the access log and at
//! the upstream; the access log's fields, and the runbook's `grep` over it.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::process::Stdio;
use std::time::Duration;

use support::gateway::{ServeProcess, free_local_addr};
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

async fn scrape(gw: &Gateway) -> String {
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    String::from_utf8_lossy(&m.body).into_owned()
}

/// The value of the series whose line starts with `series` (name and full
/// label set), or `None` if there is none.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' ')).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

fn requests(listener: &str, operation: &str, class: &str) -> String {
    format!(r#"idemgate_http_requests_total{{listener="{listener}",operation="{operation}",protocol="h1",code_class="{class}"}}"#)
}

/// A port nothing listens on: bound, never listening, so connections are refused.
fn refused_port() -> (tokio::net::TcpSocket, std::net::SocketAddr) {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = s.local_addr().unwrap();
    (s, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_chart_status_classes_durations_connections_and_upstream_errors() {
    let up = TestUpstream::start().await;
    let (_reserved, down) = refused_port();
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url()).server("max_connections = 50\ndefault_upstream = \"orders\"").tail(&format!(
            "[[upstreams]]\nname = \"down\"\nurl = \"http://{down}\"\nconnect_timeout = \"500ms\"\ntimeout = \"2s\"\n\n\
                 [[routes]]\noperation = \"pay\"\nmethod = \"POST\"\npath = \"/v1/payments\"\nupstream = \"down\"\n"
        )),
    );
    let before = scrape(&gw).await;
    assert_eq!(value(&before, &requests("proxy", "create_order", "2xx")), Some(0.0), "series exist from the start:\n{before}");
    assert_eq!(value(&before, r#"idemgate_max_connections{listener="proxy"}"#), Some(50.0), "{before}");
    assert_eq!(value(&before, r#"idemgate_upstream_errors_total{upstream="down",kind="refused"}"#), Some(0.0), "{before}");

    assert_eq!(post(&gw.url("/v1/orders"), "a", ORDER, &[]).await.status, 201);
    assert_eq!(send("GET", &gw.url("/catalog"), &[], "").await.unwrap().status, 200);
    let refused = post(&gw.url("/v1/payments"), "p", ORDER, &[]).await;
    assert_eq!(refused.status, 503, "{:?}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.problem(), "upstream-unavailable");
    assert_eq!(send("GET", &gw.admin_url("/readyz"), &[], "").await.unwrap().status, 200);

    // A request held at the upstream keeps its connection open.
    let mut received = up.subscribe();
    let url = gw.url("/v1/orders");
    let slow = tokio::spawn(async move { post(&url, "slow", ORDER, &[("x-test-sleep-ms", "1500")]).await });
    received.recv().await.unwrap();
    let during = scrape(&gw).await;
    let open = value(&during, r#"idemgate_open_connections{listener="proxy"}"#).expect("open connections");
    assert!(open >= 1.0, "{during}");
    assert_eq!(slow.await.unwrap().status, 201);
    // A forward is counted once its result is written, just after its answer.
    let forwarded = r#"idemgate_requests_total{operation="create_order",outcome="forwarded"}"#;
    assert!(eventually(Duration::from_secs(5), || async { value(&scrape(&gw).await, forwarded) == Some(2.0) }).await);

    let text = scrape(&gw).await;
    for (series, expected) in [
        (requests("proxy", "create_order", "2xx"), 2.0),
        (requests("proxy", "create_order", "5xx"), 0.0),
        (requests("proxy", "pay", "5xx"), 1.0),
        (requests("proxy", "passthrough", "2xx"), 1.0),
        (requests("admin", "readyz", "2xx"), 1.0),
        (r#"idemgate_http_request_duration_seconds_count{listener="proxy",operation="create_order"}"#.to_owned(), 2.0),
        (r#"idemgate_http_request_duration_seconds_count{listener="proxy",operation="passthrough"}"#.to_owned(), 1.0),
        (r#"idemgate_http_request_duration_seconds_count{listener="proxy",operation="pay"}"#.to_owned(), 1.0),
        (r#"idemgate_upstream_errors_total{upstream="down",kind="refused"}"#.to_owned(), 1.0),
        (r#"idemgate_upstream_errors_total{upstream="orders",kind="refused"}"#.to_owned(), 0.0),
        // One label name for the operation everywhere.
        (r#"idemgate_requests_total{operation="pay",outcome="released"}"#.to_owned(), 1.0),
        (r#"idemgate_requests_total{operation="create_order",outcome="forwarded"}"#.to_owned(), 2.0),
    ] {
        assert_eq!(value(&text, &series), Some(expected), "{series}:\n{text}");
    }
    assert!(value(&text, &requests("admin", "metrics", "2xx")).is_some_and(|n| n >= 2.0), "{text}");
    // Neither listener speaks HTTP/2 (no TLS): no h2 series at all.
    assert!(!text.contains(r#"protocol="h2""#), "{text}");
    assert!(!text.lines().any(|l| l.starts_with("idemgate_") && l.contains("route=")), "{text}");
    // Nothing reached the refusing upstream; the refusal is a warning.
    assert_eq!(up.total(), 2);
    let warned = gw.logs().lines().any(|l| l.contains("upstream not reached; key released") && l.contains(r#""level":"WARN""#));
    assert!(warned, "{}", gw.logs());
}

/// The JSON access-log line whose `request_id` is `id`, once written.
async fn access_line(gw: &Gateway, id: &str) -> serde_json::Value {
    let mut found = None;
    let seen = eventually(Duration::from_secs(5), || {
        let line = gw
            .logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["target"] == "idemgate::access" && v["request_id"] == id);
        let ok = line.is_some();
        found = line;
        async move { ok }
    })
    .await;
    assert!(seen, "no access line for {id}:\n{}", gw.logs());
    found.unwrap()
}

/// From a peer outside `server.trusted_proxies`, the client's `X-Request-Id`
/// is not used: the gateway's own id is answered, logged and sent to the
/// upstream, on idempotent routes and pass-through alike; the client's value
/// stays in the access log as `client_request_id`. The line also carries
/// the HTTP version, the bytes in and out, the upstream's address and the
/// trace id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_gets_the_request_id_the_gateway_logs_and_returns() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).server("default_upstream = \"orders\""));

    let resp = post(&gw.url("/v1/orders"), "k", ORDER, &[("x-request-id", "client-chosen-1"), ("traceparent", TRACEPARENT)]).await;
    assert_eq!(resp.status, 201);
    let id = resp.header("x-request-id").expect("an id").to_owned();
    assert_ne!(id, "client-chosen-1", "the client is not a trusted proxy");
    let upstream_saw = up.requests()[0].headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(upstream_saw.as_deref(), Some(id.as_str()), "the upstream gets the id the gateway answered with");
    let line = access_line(&gw, &id).await;
    assert_eq!(line["client_request_id"], "client-chosen-1");
    assert_eq!(line["http_version"], "HTTP/1.1");
    assert_eq!(line["bytes_in"], ORDER.len());
    assert_eq!(line["bytes_out"], resp.body.len());
    assert_eq!(line["upstream_addr"], up.addr.to_string());
    assert_eq!(line["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(line["route"], "create_order");

    // Pass-through, streamed both ways.
    let resp = send("POST", &gw.url("/elsewhere"), &[("x-request-id", "client-chosen-2")], "hello").await.unwrap();
    assert_eq!(resp.status, 201);
    let id = resp.header("x-request-id").unwrap().to_owned();
    assert_ne!(id, "client-chosen-2");
    let upstream_saw = up.requests()[1].headers.get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(upstream_saw.as_deref(), Some(id.as_str()));
    let line = access_line(&gw, &id).await;
    assert_eq!(line["route"], "passthrough");
    assert_eq!(line["client_request_id"], "client-chosen-2");
    assert_eq!(line["bytes_in"], 5);
    assert_eq!(line["bytes_out"], resp.body.len());
    assert_eq!(line["upstream_addr"], up.addr.to_string());
    assert!(line.get("trace_id").is_none(), "no traceparent, no trace id: {line}");

    // A replay had no upstream exchange; no client id, no such field.
    let replay = post(&gw.url("/v1/orders"), "k", ORDER, &[]).await;
    assert!(replay.replayed());
    let line = access_line(&gw, replay.header("x-request-id").unwrap()).await;
    assert!(line.get("client_request_id").is_none() && line.get("upstream_addr").is_none(), "{line}");
    assert_eq!(line["bytes_out"], replay.body.len());
}

/// The runbook's command to find a request's access-log line (docs/operations.md,
/// "Tracing a request"), for the text and the JSON format, run as written
/// against the real binary's output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_runbook_grep_finds_the_access_line_in_both_formats() {
    let runbook = include_str!("../../docs/operations.md");
    let section = &runbook[runbook.find("## Tracing a request").expect("the runbook section")..];
    // The two `grep '...<id>...'` commands of its first step, as written.
    let greps: Vec<&str> =
        section.split('`').filter(|s| s.contains("grep '") && s.contains("<id>")).map(|s| &s[s.find("grep '").unwrap()..]).collect();
    assert_eq!(greps.len(), 2, "{greps:?}");
    let up = TestUpstream::start().await;

    for format in ["text", "json"] {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("idemgate.log");
        let mut config = GatewayConfig::new(sqlite_backend(), up.url());
        config.listen = free_local_addr();
        let file = std::fs::File::create(&log).unwrap();
        let mut gw = ServeProcess::spawn(&config, Stdio::from(file), &[("IDEMGATE_LOG_FORMAT", format)]);
        let url = format!("http://{}/v1/orders", config.listen);
        let up_and_serving = eventually(Duration::from_secs(20), || async { send("GET", &url, &[], "").await.is_ok() }).await;
        assert!(up_and_serving, "{}", std::fs::read_to_string(&log).unwrap_or_default());
        let resp = post(&url, &format!("runbook-{format}"), ORDER, &[]).await;
        assert_eq!(resp.status, 201);
        let id = resp.header("x-request-id").unwrap().to_owned();
        // SIGTERM: the access lines still batched are written before it exits.
        gw.signal("TERM");
        assert!(tokio::task::block_in_place(|| gw.wait_exit(Duration::from_secs(20))).success());

        let matching: Vec<String> = greps
            .iter()
            .filter_map(|grep| {
                let command = format!("{} {}", grep.replace("<id>", &id), log.display());
                let out = std::process::Command::new("sh").arg("-c").arg(&command).output().unwrap();
                out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
            })
            .collect();
        assert_eq!(
            matching.len(),
            1,
            "exactly one of {greps:?} finds {id} in the {format} log:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert!(matching[0].contains("idemgate::access") && matching[0].lines().count() == 1, "{}", matching[0]);
    }
}
