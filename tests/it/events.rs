//! The outbox through the real binary (CONTRACT section 9): a real webhook
//! receiver that records every delivery. Events of final state changes are
//! delivered signed, at least once, in order per scope, with a stable id;
//! a receiver that is down gets everything later; a relay killed between a
//! delivery and its marking re-delivers the same id; two relays never
//! deliver one event at the same time; parked events can be redelivered.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::time::Duration;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use support::webhook::Webhook;
use support::*;

on_both_stores!(
    final_state_changes_are_delivered_signed_once_each,
    a_receiver_that_is_down_gets_everything_later_in_order,
    a_relay_killed_before_marking_redelivers_the_same_id,
    parked_events_are_kept_listed_and_redelivered,
    batched_deliveries_carry_several_events_in_order_per_scope,
    a_failing_receiver_does_not_make_another_receivers_events_go_twice,
    a_receiver_that_asks_to_wait_is_left_alone_that_long,
    a_batch_refused_as_too_large_is_sent_again_in_halves,
    a_redirecting_receiver_is_named_in_the_events_error,
);

const ORDER: &str = r#"{"item":"book","qty":1}"#;

fn with_events(c: GatewayConfig, hook: &Webhook, extra: &str) -> GatewayConfig {
    c.route(&format!(
        "events.url = \"{}\"\nevents.secret_env = \"{}\"\nevents.timeout = \"300ms\"\n{extra}",
        hook.url(),
        support::gateway::TEST_SECRET_ENV
    ))
}

async fn setup(backend: Backend, extra: &str) -> (TestUpstream, Webhook, Gateway, idemgate::store::Store) {
    let up = TestUpstream::start().await;
    let hook = Webhook::start().await;
    let gw = Gateway::start(with_events(GatewayConfig::new(backend.clone(), up.url()).timeout("500ms"), &hook, extra));
    let store = backend.open().await;
    (up, hook, gw, store)
}

async fn delivered(hook: &Webhook, n: usize) -> bool {
    eventually(Duration::from_secs(20), || async { hook.distinct().len() >= n }).await
}

fn verify_signature(d: &support::webhook::Delivery) {
    let sig = d.signature.as_deref().expect("a signature");
    let (t, v1) = sig.split_once(',').expect("t=...,v1=...");
    let t = t.strip_prefix("t=").expect("t=");
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(TEST_SECRET.as_bytes()).unwrap();
    mac.update(format!("{t}.").as_bytes());
    mac.update(&d.body);
    assert_eq!(v1.strip_prefix("v1=").expect("v1="), hex::encode(mac.finalize().into_bytes()), "the HMAC of t.body");
}

pub(crate) async fn final_state_changes_are_delivered_signed_once_each(backend: Backend) {
    let (up, hook, gw, store) = setup(backend, "").await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "k1", ORDER, &[]).await.status, 201);
    assert!(post(&url, "k1", ORDER, &[]).await.replayed(), "a replay changes nothing: no event");
    assert_eq!(post(&url, "slow", ORDER, &[("x-test-sleep-ms", "1500")]).await.status, 504);
    assert!(delivered(&hook, 2).await, "{}", gw.logs());
    let (code, _, err) = cli_keys(&gw, "resolve", "slow", &["--release", "--reason", "not in the ledger"]);
    assert_eq!(code, 0, "{err}");
    assert!(delivered(&hook, 3).await, "{}", gw.logs());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let all = hook.deliveries();
    assert_eq!(all.len(), 3, "each event once: {all:?}");
    for d in &all {
        verify_signature(d);
    }
    let docs: Vec<serde_json::Value> = all.iter().map(|d| d.json()).collect();
    let summary: Vec<(&str, &str)> = docs.iter().map(|d| (d["type"].as_str().unwrap(), d["actor"].as_str().unwrap_or("gateway"))).collect();
    assert_eq!(
        summary,
        vec![("idemgate.record.completed", "gateway"), ("idemgate.record.unknown", "gateway"), ("idemgate.record.released", "cli")]
    );
    assert_eq!(docs[0]["status"], 201);
    assert_eq!(docs[0]["scope"]["tenant"], TENANT);
    assert!(docs[0]["scope"].get("key").is_none(), "no client key unless include_key");
    assert!(docs[0].get("body_base64").is_none(), "no body unless include_body");
    assert_eq!(docs[0]["id"], all[0].id.as_str(), "the id in the body is the header's");
    let rec = settled_record(&store, "k1").await.unwrap();
    assert_eq!(docs[0]["generation"], rec.generation.0);
    assert_eq!(up.total(), 2);
    let pending = store.event_stats().await.unwrap();
    assert_eq!((pending.pending, pending.parked), (0, 0), "all marked sent");
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&m.body).into_owned();
    assert!(text.contains("idemgate_event_deliveries_total{outcome=\"delivered\"} 3"), "{text}");
}

async fn a_receiver_that_is_down_gets_everything_later_in_order(backend: Backend) {
    let (_up, hook, gw, store) = setup(backend, "").await;
    hook.answer(503);
    let url = gw.url("/v1/orders");
    // Per scope: unknown, then released by an operator; plus other keys.
    assert_eq!(post(&url, "a", ORDER, &[("x-test-sleep-ms", "1500")]).await.status, 504);
    let (code, _, err) = cli_keys(&gw, "resolve", "a", &["--release", "--reason", "not in the ledger"]);
    assert_eq!(code, 0, "{err}");
    for k in ["b", "c", "d"] {
        assert_eq!(post(&url, k, ORDER, &[]).await.status, 201);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(hook.deliveries().iter().all(|d| !d.id.is_empty()));
    let stats = store.event_stats().await.unwrap();
    assert_eq!(stats.pending, 5, "nothing is marked sent while the receiver fails");
    assert!(stats.oldest_pending_at.is_some());
    hook.answer(200);
    let healed = eventually(Duration::from_secs(30), || async { store.event_stats().await.unwrap().pending == 0 }).await;
    assert!(healed, "{}", gw.logs());
    assert_eq!(hook.distinct().len(), 5);
    // Order per scope: a's unknown was delivered (2xx) before a's release was ever sent.
    let all = hook.deliveries();
    let last_unknown = all
        .iter()
        .rposition(|d| d.json()["scope"]["operation"] == "create_order" && d.json()["type"] == "idemgate.record.unknown")
        .unwrap();
    let first_release = all.iter().position(|d| d.json()["type"] == "idemgate.record.released").unwrap();
    assert!(last_unknown < first_release, "in order per scope");
}

/// A receiver that answers 503 with `Retry-After: 2` is not tried again for
/// two seconds (the relay's own backoff would try after about 200 ms), and
/// then gets the event, the same one.
async fn a_receiver_that_asks_to_wait_is_left_alone_that_long(backend: Backend) {
    let (_up, hook, gw, store) = setup(backend, "").await;
    hook.answer(503);
    hook.retry_after(Some("2"));
    assert_eq!(post(&gw.url("/v1/orders"), "wait", ORDER, &[]).await.status, 201);
    assert!(eventually(Duration::from_secs(10), || async { !hook.deliveries().is_empty() }).await, "{}", gw.logs());
    // The first delivery has its answer by now.
    tokio::time::sleep(Duration::from_millis(150)).await;
    hook.answer(200);
    let sent = eventually(Duration::from_secs(20), || async { store.event_stats().await.unwrap().pending == 0 }).await;
    assert!(sent, "{}", gw.logs());
    let all = hook.deliveries();
    assert_eq!(all.len(), 2, "refused once, then delivered: {all:?}");
    assert_eq!(all[0].id, all[1].id);
    let gap = all[1].at - all[0].at;
    assert!(gap >= Duration::from_millis(1900), "tried again {gap:?} after a Retry-After of 2 s");
}

async fn a_relay_killed_before_marking_redelivers_the_same_id(backend: Backend) {
    let (_up, hook, mut gw, store) = setup(backend, "").await;
    hook.hold(Duration::from_secs(3));
    let mut arrivals = hook.subscribe();
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    let first = tokio::time::timeout(Duration::from_secs(10), arrivals.recv()).await.expect("delivered").unwrap();
    // The receiver has the event; the gateway dies before it can mark it sent.
    gw.kill9();
    hook.hold(Duration::ZERO);
    gw.restart();
    let again = tokio::time::timeout(Duration::from_secs(15), arrivals.recv()).await.expect("redelivered").unwrap();
    assert_eq!(again.id, first.id, "the same event id");
    assert_eq!(again.json()["id"], first.json()["id"]);
    let sent = eventually(Duration::from_secs(10), || async { store.event_stats().await.unwrap().pending == 0 }).await;
    assert!(sent);
    assert_eq!(hook.distinct().len(), 1, "one event, delivered twice because of the crash");
}

async fn parked_events_are_kept_listed_and_redelivered(backend: Backend) {
    let up = TestUpstream::start().await;
    let hook = Webhook::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, "admin-token\n").unwrap();
    let cfg = with_events(GatewayConfig::new(backend.clone(), up.url()), &hook, "events.max_attempts = 2")
        .admin(&format!("token_file = \"{}\"", token_file.display()));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    let admin = |method: &'static str, path: &str| {
        let url = gw.admin_url(path);
        async move { send(method, &url, &[("authorization", "Bearer admin-token")], "").await.unwrap() }
    };
    hook.answer(500);
    assert_eq!(post(&gw.url("/v1/orders"), "k", ORDER, &[]).await.status, 201);
    let parked = eventually(Duration::from_secs(15), || async { store.event_stats().await.unwrap().parked == 1 }).await;
    assert!(parked, "{}", gw.logs());
    assert_eq!(hook.deliveries().len(), 2, "max_attempts deliveries, then parked");
    let (code, out, err) = cli(&gw, &["events", "list", "--parked", "--json"]);
    assert_eq!(code, 0, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1);
    assert_eq!((list[0]["delivery"].as_str(), list[0]["last_error"].as_str()), (Some("parked"), Some("answered 500")));
    let id = list[0]["id"].as_str().unwrap().to_owned();
    // The admin API shows the same backlog.
    let listed = admin("GET", "/admin/events?delivery=parked").await;
    assert_eq!(listed.status, 200);
    assert_eq!((listed.json()["parked"].as_i64(), listed.json()["events"][0]["id"].as_str()), (Some(1), Some(id.as_str())));
    hook.answer(200);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(hook.deliveries().len(), 2, "parked events wait for an operator");
    let (code, _, err) = cli(&gw, &["events", "redeliver", &id]);
    assert_eq!(code, 0, "{err}");
    let sent = eventually(Duration::from_secs(10), || async { store.event_stats().await.unwrap() == Default::default() }).await;
    assert!(sent, "{}", gw.logs());
    assert_eq!(hook.deliveries().last().unwrap().id, id);
    assert_eq!(cli(&gw, &["events", "redeliver", "00000000-0000-0000-0000-000000000000"]).0, 1);
    // And redelivers through the API, with the same id again.
    assert_eq!(admin("POST", &format!("/admin/events/{id}/redeliver")).await.status, 200);
    let again = eventually(Duration::from_secs(10), || async { hook.deliveries().iter().filter(|d| d.id == id).count() == 4 }).await;
    assert!(again, "{:?}", hook.counts());
    assert_eq!(admin("POST", "/admin/events/00000000-0000-0000-0000-000000000000/redeliver").await.status, 404);
    // An event delivered on its first attempt (on PostgreSQL, read from the
    // log and never copied anywhere) is redelivered too, with its id.
    assert_eq!(post(&gw.url("/v1/orders"), "k2", ORDER, &[]).await.status, 201);
    let delivered = eventually(Duration::from_secs(10), || async { hook.distinct().len() == 2 }).await;
    assert!(delivered, "{:?}", hook.counts());
    let marked = eventually(Duration::from_secs(10), || async { store.event_stats().await.unwrap() == Default::default() }).await;
    assert!(marked, "{}", gw.logs());
    let id2 = hook.deliveries().last().unwrap().id.clone();
    assert_ne!(id2, id);
    let (code, _, err) = cli(&gw, &["events", "redeliver", &id2]);
    assert_eq!(code, 0, "{err}");
    let again = eventually(Duration::from_secs(10), || async { hook.deliveries().iter().filter(|d| d.id == id2).count() == 2 }).await;
    assert!(again, "{:?}", hook.counts());
    // An id of the log's form that no event has: no event, not a store error.
    let (code, _, err) = cli(&gw, &["events", "redeliver", "00000000-0000-8000-8000-000000000999"]);
    assert_eq!(code, 1);
    assert!(err.contains("no event"), "{err}");
}

/// Two replicas relaying one store: every event is delivered, none by two
/// relays at once, and (without a crash) none twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_never_deliver_one_event_at_once() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let hook = Webhook::start().await;
    hook.hold(Duration::from_millis(100));
    let cfg = || with_events(GatewayConfig::new(backend.clone(), up.url()), &hook, "");
    let (a, b) = (Gateway::start(cfg()), Gateway::start(cfg()));
    let store = backend.open().await;
    for i in 0..30 {
        let gw = if i % 2 == 0 { &a } else { &b };
        assert_eq!(post(&gw.url("/v1/orders"), &format!("k{i}"), ORDER, &[]).await.status, 201);
    }
    let all = eventually(Duration::from_secs(30), || async { store.event_stats().await.unwrap().pending == 0 }).await;
    assert!(all, "{}\n{}", a.logs(), b.logs());
    assert_eq!(hook.distinct().len(), 30);
    assert_eq!(hook.overlaps(), 0, "no event delivered by two relays at once");
    assert!(hook.counts().values().all(|n| *n == 1), "no duplicates without a crash: {:?}", hook.counts());
}

async fn batched_deliveries_carry_several_events_in_order_per_scope(backend: Backend) {
    let (up, hook, gw, store) = setup(backend, "events.batch = 50\nevents.max_attempts = 1000").await;
    hook.answer(503);
    let url = gw.url("/v1/orders");
    // Two events of one scope (unknown, then released by an operator) and
    // twelve of other scopes, while the receiver fails.
    assert_eq!(post(&url, "a", ORDER, &[("x-test-sleep-ms", "1500")]).await.status, 504);
    let (code, _, err) = cli_keys(&gw, "resolve", "a", &["--release", "--reason", "not in the ledger"]);
    assert_eq!(code, 0, "{err}");
    for k in 0..12 {
        assert_eq!(post(&url, &format!("k{k}"), ORDER, &[]).await.status, 201);
    }
    let refused = eventually(Duration::from_secs(10), || async { hook.deliveries().iter().any(|d| d.events().len() > 1) }).await;
    assert!(refused, "a batch reached the failing receiver: {}", gw.logs());
    // A client has its answer before its result (and the event written with
    // it) commits, so the last events may still be on their way: all 14 are
    // pending once they are written, and none is marked sent meanwhile.
    let all_pending = eventually(Duration::from_secs(10), || async { store.event_stats().await.unwrap().pending == 14 }).await;
    assert!(all_pending, "nothing is marked sent while the receiver fails: {:?}", store.event_stats().await.unwrap());
    hook.answer(200);
    let healed = eventually(Duration::from_secs(30), || async { store.event_stats().await.unwrap().pending == 0 }).await;
    assert!(healed, "{}", gw.logs());
    let all = hook.deliveries();
    let mut ids = std::collections::HashSet::new();
    for d in &all {
        verify_signature(d);
        assert!(d.id.is_empty(), "a batched delivery has no Idemgate-Event-Id");
        let events = d.events();
        assert!((1..=50).contains(&events.len()), "{} events in one POST", events.len());
        assert_eq!(d.count.as_deref(), Some(&*events.len().to_string()), "Idemgate-Event-Count");
        let in_post: std::collections::HashSet<String> = events.iter().map(|e| e["id"].as_str().unwrap().to_owned()).collect();
        assert_eq!(in_post.len(), events.len(), "each event once per POST");
        ids.extend(in_post);
    }
    assert_eq!(ids.len(), 14, "every event arrived");
    // Order per scope: a's unknown was in an earlier POST than its release
    // (never in one POST: at most one event of a scope is deliverable).
    let a_released = all.iter().position(|d| d.events().iter().any(|e| e["type"] == "idemgate.record.released")).unwrap();
    let a_unknown = all.iter().rposition(|d| d.events().iter().any(|e| e["type"] == "idemgate.record.unknown")).unwrap();
    assert!(a_unknown < a_released, "in order per scope");
    assert_eq!(up.total(), 13);
    let m = send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap();
    let text = String::from_utf8_lossy(&m.body).into_owned();
    assert!(text.contains("idemgate_event_deliveries_total{outcome=\"delivered\"} 14"), "{text}");
}

/// Two routes, two receivers: one answers 200, the other is failing. Their
/// events share the log's lanes (the same keys), so a round holds both; the
/// failures are recorded, and the lane goes on past the delivered events
/// too: each of the healthy receiver's events arrives once (before, a lane
/// stopped at a failed event marked after the delivered ones, and the
/// delivered ones behind it were taken and sent again).
async fn a_failing_receiver_does_not_make_another_receivers_events_go_twice(backend: Backend) {
    let up = TestUpstream::start().await;
    let (healthy, failing) = (Webhook::start().await, Webhook::start().await);
    failing.answer(500);
    let cfg = with_events(GatewayConfig::new(backend.clone(), up.url()), &healthy, "").tail(&format!(
        "[[routes]]\noperation = \"cancel_order\"\nmethod = \"POST\"\npath = \"/v1/cancels\"\nupstream = \"orders\"\n\
         events.url = \"{}\"\nevents.timeout = \"300ms\"\nevents.max_attempts = 100\n",
        failing.url()
    ));
    let gw = Gateway::start(cfg);
    const N: usize = 60;
    for round in 0..N / 10 {
        let posts = (0..10).map(|i| {
            let k = format!("k{}", round * 10 + i);
            let (orders, cancels) = (gw.url("/v1/orders"), gw.url("/v1/cancels"));
            async move {
                assert_eq!(post(&orders, &k, ORDER, &[]).await.status, 201);
                assert_eq!(post(&cancels, &k, ORDER, &[]).await.status, 201);
            }
        });
        futures_util::future::join_all(posts).await;
    }
    assert!(delivered(&healthy, N).await, "{}", gw.logs());
    // Rounds go on while the failing receiver's events are retried.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let twice: Vec<(String, usize)> = healthy.counts().into_iter().filter(|(_, n)| *n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once (no crash, no lost mark): {twice:?}");
    assert!(failing.deliveries().len() >= N, "the failing receiver was tried: {}", failing.deliveries().len());
}

/// gunicorn at its defaults, serving one request at a time, as an event
/// receiver: the relay sends it no more POSTs at once than
/// `events.concurrency` (4), so none waits out its timeout in gunicorn's
/// queue to be sent again. Before, a round's POSTs all went at once: behind
/// a burst, most timed out while the receiver still worked through them,
/// and were sent again, and again, until parked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_serving_one_request_at_a_time_gets_each_event_once() {
    let Some(receiver) = Gunicorn::start() else { return };
    let up = TestUpstream::start().await;
    let cfg =
        GatewayConfig::new(sqlite_backend(), up.url()).route(&format!("events.url = \"{}/hook\"\nevents.timeout = \"1s\"", receiver.url()));
    let gw = Gateway::start(cfg);
    const N: usize = 80;
    let posts = (0..N).map(|i| {
        let url = gw.url("/v1/orders");
        async move { assert_eq!(post(&url, &format!("g{i}"), ORDER, &[]).await.status, 201) }
    });
    futures_util::future::join_all(posts).await;
    let all = eventually(Duration::from_secs(60), || async {
        receiver.received().await.iter().collect::<std::collections::HashSet<_>>().len() >= N
    })
    .await;
    let received = receiver.received().await;
    assert!(all, "{} of {N} events arrived: {}", received.len(), gw.logs());
    assert_eq!(received.len(), N, "each event once, none sent again after a timeout: {}", gw.logs());
}

/// `python3 -m gunicorn` serving tests/frameworks/gunicorn_receiver.py at its
/// defaults; killed when dropped.
struct Gunicorn {
    _child: Killed,
    port: u16,
}

/// A receiver's process, killed when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Gunicorn {
    /// `None` when gunicorn is missing and not required (scripts/test installs it).
    fn start() -> Option<Gunicorn> {
        use std::process::{Command, Stdio};
        let mut probe = Command::new("python3");
        probe.args(["-c", "import gunicorn"]);
        if !support::installed(probe, "gunicorn") {
            return None;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new("python3")
            .args(["-m", "gunicorn", "--bind", &format!("127.0.0.1:{port}"), "gunicorn_receiver:app"])
            .current_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 -m gunicorn");
        let g = Gunicorn { _child: Killed(child), port };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "gunicorn did not listen on {port}");
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(g)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Every event id the receiver got, in order.
    async fn received(&self) -> Vec<String> {
        let r = send("GET", &format!("{}/received", self.url()), &[], "").await.expect("GET /received");
        serde_json::from_slice(&r.body).expect("a JSON list")
    }
}

/// A receiver on Flask as its documentation writes a route (`/hook/`, with a
/// trailing slash) and a `url` without it: Flask answers 308 to `/hook/`.
/// Redirects are not followed (an event is not sent where the configuration
/// did not say), and the parked event's error says where the redirect
/// points. Before, it said only "answered 308".
async fn a_redirecting_receiver_is_named_in_the_events_error(backend: Backend) {
    use std::process::Command;
    let mut probe = Command::new("python3");
    probe.args(["-c", "import flask"]);
    if !support::installed(probe, "Flask") {
        return;
    }
    let mut receiver = Command::new("python3");
    receiver.arg("flask_receiver.py").current_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks"));
    let (_receiver, port) = listening(receiver);
    let up = TestUpstream::start().await;
    let hook = format!("http://127.0.0.1:{port}/hook");
    let cfg = GatewayConfig::new(backend.clone(), up.url()).route(&format!("events.url = \"{hook}\"\nevents.max_attempts = 1"));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    assert_eq!(post(&gw.url("/v1/orders"), "r", ORDER, &[]).await.status, 201);
    let parked = eventually(Duration::from_secs(15), || async { store.event_stats().await.unwrap().parked == 1 }).await;
    assert!(parked, "{}", gw.logs());
    let (code, out, err) = cli(&gw, &["events", "list", "--parked", "--json"]);
    assert_eq!(code, 0, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    let error = list[0]["last_error"].as_str().unwrap_or_default();
    assert!(error.starts_with("answered 308, a redirect to ") && error.contains(&format!("{hook}/")), "{error}");
    let received = send("GET", &format!("http://127.0.0.1:{port}/received"), &[], "").await.unwrap();
    assert_eq!(received.json(), serde_json::json!([]), "the redirect was not followed");
}

/// A receiver at Express's defaults (`express.json()`: bodies up to 100 kB,
/// 413 above) and batches larger than that: events with their 34 kB stored
/// bodies (45 kB in base64: two fit in 100 kB, three do not), written while the receiver
/// answers 503 with `Retry-After: 2`, so that they go out together once it
/// is open. A POST refused as too large is sent again in halves down to what
/// the receiver takes, and later POSTs carry no more than the largest part it
/// took (a second lot is never refused): every event arrives once and none
/// is parked. A third lot has one event too large on its own: it alone
/// fails (its receiver is not backed off for it), and a fourth lot still goes
/// out two events a POST. Before, the relay sent the same refused batch again and again,
/// and parked it after `max_attempts`.
async fn a_batch_refused_as_too_large_is_sent_again_in_halves(backend: Backend) {
    let Some(receiver) = Express::start() else { return };
    let up = TestUpstream::start().await;
    let cfg = GatewayConfig::new(backend.clone(), up.url()).route(&format!(
        "events.url = \"{}/hook\"\nevents.timeout = \"5s\"\nevents.batch = 20\n\
         events.include_body = true\nevents.max_attempts = 1000",
        receiver.url()
    ));
    let gw = Gateway::start(cfg);
    const N: usize = 10;
    // One lot: written while the receiver is closed (its first POST is
    // refused with a wait that holds the rest back), then let in at once.
    // `big`: the lot's first event is too large for the receiver on its own
    // (80 kB stored, 107 kB in base64).
    let lot = |name: &'static str, big: bool| {
        let (gw, receiver) = (&gw, &receiver);
        async move {
            receiver.switch("__close").await;
            let before = receiver.received().await.1.len();
            let posts = (0..N).map(|i| {
                let url = gw.url("/v1/orders");
                let bytes = if big && i == 0 { "80000" } else { "34000" };
                async move { assert_eq!(post(&url, &format!("{name}{i}"), ORDER, &[("x-test-body-bytes", bytes)]).await.status, 201) }
            });
            futures_util::future::join_all(posts).await;
            let refused = eventually(Duration::from_secs(10), || async { receiver.received().await.1.len() > before }).await;
            assert!(refused, "a POST reached the closed receiver: {}", gw.logs());
            let opened = receiver.received().await.1.len();
            receiver.switch("__open").await;
            opened
        }
    };
    let opened = lot("first", false).await;
    let (ids, answers) = receiver.all(N, &gw).await;
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), N, "{ids:?}");
    assert_eq!(ids.len(), N, "each event once: {ids:?}");
    let refused: Vec<&(u16, u64)> = answers[opened..].iter().filter(|(status, _)| *status == 413).collect();
    assert!(!refused.is_empty(), "a batch above the receiver's 100 kB reached it: {answers:?}");
    assert!(refused.iter().all(|(_, bytes)| *bytes > 100 * 1024), "{answers:?}");
    assert!(gw.logs().contains("refused a POST as too large"), "{}", gw.logs());
    let opened = lot("second", false).await;
    let (ids, answers) = receiver.all(2 * N, &gw).await;
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 2 * N, "{ids:?}");
    assert!(!answers[opened..].iter().any(|(status, _)| *status == 413), "POSTs carry what the receiver took before: {answers:?}");
    // One event too large on its own: it fails (and stays pending), the
    // others go on, and how many a POST carries is not lowered for it.
    lot("third", true).await;
    receiver.all(3 * N - 1, &gw).await;
    let opened = lot("fourth", false).await;
    let (ids, answers) = receiver.all(4 * N - 1, &gw).await;
    assert_eq!(ids.iter().collect::<std::collections::HashSet<_>>().len(), 4 * N - 1, "{ids:?}");
    assert!(
        answers[opened..].iter().any(|(status, bytes)| *status == 200 && *bytes > 60_000),
        "POSTs of two events go on after one event was refused alone: {answers:?}"
    );
    let store = backend.open().await;
    let settled = eventually(Duration::from_secs(10), || async {
        let stats = store.event_stats().await.unwrap();
        (stats.pending, stats.parked) == (1, 0)
    })
    .await;
    assert!(settled, "only the event too large for the receiver is left: {:?}", store.event_stats().await.unwrap());
    assert_eq!(up.total(), 4 * N as u64);
}

/// A receiver behind nginx at its defaults (`client_max_body_size 1m`,
/// refused with 413 before the body reaches the receiver): events with
/// 300 kB stored bodies (400 kB in base64: two fit in 1 MB, three do not)
/// written while the receiver answers 503 with `Retry-After: 2`. nginx's 413
/// reaches the relay as an answer (not a reset while the body is still being
/// written), the batch goes again in halves, and every event is taken once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_too_large_for_nginx_in_front_of_the_receiver_is_sent_again_in_halves() {
    let hook = Webhook::start().await;
    let Some(nginx) = support::nginx::Nginx::start(hook.addr.port()) else { return };
    let (backend, up) = (postgres_backend(), TestUpstream::start().await);
    let cfg = GatewayConfig::new(backend.clone(), up.url()).route(&format!(
        "events.url = \"http://127.0.0.1:{}/hook\"\nevents.timeout = \"3s\"\nevents.batch = 20\n\
         events.include_body = true\nevents.max_attempts = 1000",
        nginx.port
    ));
    let gw = Gateway::start(cfg);
    const N: usize = 6;
    hook.answer(503);
    hook.retry_after(Some("2"));
    let posts = (0..N).map(|i| {
        let url = gw.url("/v1/orders");
        async move { assert_eq!(post(&url, &format!("n{i}"), ORDER, &[("x-test-body-bytes", "300000")]).await.status, 201) }
    });
    futures_util::future::join_all(posts).await;
    let refused = eventually(Duration::from_secs(10), || async { !hook.deliveries().is_empty() }).await;
    assert!(refused, "a POST reached the receiver: {}", gw.logs());
    // What arrives from now on is answered 200.
    let opened = hook.deliveries().len();
    hook.answer(200);
    let store = backend.open().await;
    let settled = eventually(Duration::from_secs(60), || async {
        let stats = store.event_stats().await.unwrap();
        (stats.pending, stats.parked) == (0, 0)
    })
    .await;
    assert!(settled, "{:?}\n{}", store.event_stats().await.unwrap(), gw.logs());
    assert!(gw.logs().contains("refused a POST as too large"), "nginx answered 413 to a batch: {}", gw.logs());
    let mut taken: Vec<String> = Vec::new();
    for d in &hook.deliveries()[opened..] {
        taken.extend(d.events().iter().map(|e| e["id"].as_str().unwrap_or_default().to_owned()));
    }
    let distinct: std::collections::HashSet<&String> = taken.iter().collect();
    assert_eq!((distinct.len(), taken.len()), (N, N), "each event taken once: {taken:?}");
    assert_eq!(up.total(), N as u64);
}

/// `node receiver.js` (tests/frameworks/express): an event receiver at
/// Express's defaults; killed when dropped.
struct Express {
    _child: Killed,
    port: u16,
}

/// Starts a receiver that prints "listening <port>" once it serves: the
/// process and its port.
fn listening(mut command: std::process::Command) -> (Killed, u16) {
    use std::io::BufRead;
    use std::process::Stdio;
    // Killed if it does not start as expected too (the panic drops it).
    let mut child = Killed(command.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("start the receiver"));
    let stdout = child.0.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = std::io::BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    let port = line.trim().strip_prefix("listening ").and_then(|p| p.parse().ok());
    let port = port.unwrap_or_else(|| panic!("the receiver {command:?} did not start within 30 s: {line:?}"));
    (child, port)
}

impl Express {
    /// `None` when Express is missing and not required (scripts/test installs it).
    fn start() -> Option<Express> {
        use std::process::Command;
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks/express");
        let mut probe = Command::new("node");
        probe.args(["-e", "require('express')"]).current_dir(&dir);
        if !support::installed(probe, "Express") {
            return None;
        }
        let mut receiver = Command::new("node");
        receiver.arg("receiver.js").current_dir(dir);
        let (child, port) = listening(receiver);
        Some(Express { _child: child, port })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `POST /__close` or `/__open`.
    async fn switch(&self, to: &str) {
        let r = send("POST", &format!("{}/{to}", self.url()), &[], "").await.expect("the receiver's switch");
        assert_eq!(r.status, 200);
    }

    /// [`Self::received`] once `n` events arrived (within a minute).
    async fn all(&self, n: usize, gw: &Gateway) -> (Vec<String>, Vec<(u16, u64)>) {
        let all = eventually(Duration::from_secs(60), || async { self.received().await.0.len() >= n }).await;
        let (ids, answers) = self.received().await;
        assert!(all, "{} of {n} events arrived; POSTs (status, bytes): {answers:?}\n{}", ids.len(), gw.logs());
        (ids, answers)
    }

    /// The event ids it parsed, in order, and every POST's status and size.
    async fn received(&self) -> (Vec<String>, Vec<(u16, u64)>) {
        let r = send("GET", &format!("{}/received", self.url()), &[], "").await.expect("GET /received");
        let v: serde_json::Value = serde_json::from_slice(&r.body).expect("JSON");
        let ids = v["ids"].as_array().expect("ids").iter().map(|i| i.as_str().unwrap_or_default().to_owned()).collect();
        let posts =
            v["posts"].as_array().expect("posts").iter().map(|p| (p[0].as_u64().unwrap_or(0) as u16, p[1].as_u64().unwrap_or(0))).collect();
        (ids, posts)
    }
}

/// Two replicas; a receiver that answers each POST after 400 ms and takes
/// one at a time (`concurrency = 1`), and a fast one. A round waits for a
/// turn of the slow receiver at most half its timeout, so it ends within
/// its events' lease, and the other replica never takes a lane of that round
/// over to send its events again. Before, a round waited for every POST of
/// the slow receiver in turn (a second and a half for four) and outlived
/// the leases of the events it held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_does_not_hold_a_round_past_its_leases() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let (fast, slow) = (Webhook::start().await, Webhook::start().await);
    slow.hold(Duration::from_millis(400));
    let cfg = || {
        GatewayConfig::new(backend.clone(), up.url()).route(&format!("events.url = \"{}\"\nevents.timeout = \"500ms\"", fast.url())).tail(
            &format!(
                "[[routes]]\noperation = \"cancel_order\"\nmethod = \"POST\"\npath = \"/v1/cancels\"\nupstream = \"orders\"\n\
                 events.url = \"{}\"\nevents.timeout = \"500ms\"\nevents.concurrency = 1\nevents.max_attempts = 1000\n",
                slow.url()
            ),
        )
    };
    let (a, b) = (Gateway::start(cfg()), Gateway::start(cfg()));
    const N: usize = 12;
    let posts = (0..N).flat_map(|i| {
        let gw = if i % 2 == 0 { &a } else { &b };
        [(gw.url("/v1/cancels"), format!("s{i}")), (gw.url("/v1/orders"), format!("f{i}"))]
    });
    let sent = posts.map(|(url, key)| async move { assert_eq!(post(&url, &key, ORDER, &[]).await.status, 201) });
    futures_util::future::join_all(sent).await;
    let all = eventually(Duration::from_secs(60), || async { fast.distinct().len() >= N && slow.distinct().len() >= N }).await;
    assert!(all, "fast {} slow {}: {}", fast.distinct().len(), slow.distinct().len(), a.logs());
    tokio::time::sleep(Duration::from_secs(2)).await;
    for (name, hook) in [("fast", &fast), ("slow", &slow)] {
        let twice: Vec<(String, usize)> = hook.counts().into_iter().filter(|(_, n)| *n > 1).collect();
        assert!(twice.is_empty(), "{name}: delivered again after a lease ran out mid-round: {twice:?}");
    }
}
