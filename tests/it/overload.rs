//! Admission under overload (contract section 12): a request over an
//! upstream's concurrency limit, or an async route's queue bound, is refused
//! before its claim (503 `overloaded`, `Retry-After`), claims nothing and
//! never reaches the upstream; so an overload no longer turns into `unknown`
//! records. Counts decide, not timings: what the upstream executed, what the
//! store recorded, what each client was told.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use support::overloaded::OverloadedUpstream;
use support::{Gateway, GatewayConfig, TestUpstream, derived, post, record, send, sqlite_backend};

/// The load runs take the machine's cores, and the tests that wait for a
/// background task need it to run on time: one at a time (a test binary
/// runs its tests in parallel).
static LOAD: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the clients of a load run were told, by key.
#[derive(Default)]
struct Told {
    /// Keys answered 201.
    created: Vec<String>,
    /// Keys refused 503 `overloaded` with a `Retry-After`.
    refused: Vec<String>,
    /// Keys answered 504 `outcome-unknown`.
    unknown: Vec<String>,
    /// Anything else: (key, status, body).
    other: Vec<(String, u16, String)>,
}

/// `clients` clients, each sending first writes with fresh keys one after
/// another until `run` has passed; a refused client waits `pause` before its
/// next request (real clients back off; this keeps the load bounded).
async fn load(gw: &Gateway, clients: usize, run: Duration, pause: Duration) -> (Told, Duration) {
    let told = Arc::new(std::sync::Mutex::new(Told::default()));
    let started = Instant::now();
    let url = gw.url("/v1/orders");
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (told, url) = (told.clone(), url.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while started.elapsed() < run {
                    n += 1;
                    let key = format!("c{c}-{n}-{}", uuid::Uuid::new_v4());
                    let resp = post(&url, &key, r#"{"item":"book"}"#, &[]).await;
                    let refused = {
                        let mut t = told.lock().unwrap();
                        match resp.status {
                            201 => t.created.push(key),
                            503 if resp.problem() == "overloaded" && resp.header("retry-after").is_some() => t.refused.push(key),
                            504 if resp.problem() == "outcome-unknown" => t.unknown.push(key),
                            status => t.other.push((key, status, String::from_utf8_lossy(&resp.body).into_owned())),
                        }
                        resp.status == 503
                    };
                    if refused {
                        tokio::time::sleep(pause).await;
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("client task");
    }
    let elapsed = started.elapsed();
    let told = std::mem::take(&mut *told.lock().unwrap());
    (told, elapsed)
}

/// The issue's scenario, shortened: an upstream that serves 4 requests at a
/// time in 100 ms each (40 per second), a 1 s upstream timeout, and 64
/// clients (about 15 times what it can do) on the embedded store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_upstream_gets_refusals_before_the_claim_not_unknown_records() {
    let _alone = LOAD.lock().await;
    let up = OverloadedUpstream::start(4, Duration::from_millis(100)).await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("1s"));
    let store = backend.open().await;
    let run = Duration::from_secs(6);
    let (told, elapsed) = load(&gw, 64, run, Duration::from_millis(100)).await;
    assert!(told.other.is_empty(), "answers other than 201, 503 overloaded and 504: {:?}", &told.other[..told.other.len().min(5)]);

    // Every refusal claimed nothing and reached nothing.
    let executions = up.executions();
    for key in &told.refused {
        assert!(record(&store, key).await.is_none(), "a refused request left a record: {key}");
        assert!(!executions.contains_key(&derived(key)), "a refused request reached the upstream: {key}");
    }
    // Every execution is recorded, once; none is lost or doubled.
    let mut states: HashMap<State, usize> = HashMap::new();
    for key in told.created.iter().chain(&told.unknown) {
        let rec = support::settled_record(&store, key).await.unwrap_or_else(|| panic!("no record for answered key {key}"));
        *states.entry(rec.state).or_default() += 1;
    }
    let executed = up.executed();
    assert!(executions.values().all(|&n| n == 1), "an operation executed twice");
    let (completed, unknown) = (states.get(&State::Completed).copied().unwrap_or(0), states.get(&State::Unknown).copied().unwrap_or(0));
    eprintln!(
        "overload: {elapsed:?}, executed={executed} completed={completed} unknown={unknown} refused={} capacity={:.0}",
        told.refused.len(),
        40.0 * run.as_secs_f64()
    );
    // Forwarded requests whose client got an answer are all accounted for.
    assert_eq!(completed + unknown, told.created.len() + told.unknown.len());
    assert!(executed >= completed as u64, "recorded more than executed");
    assert!(unknown as u64 * 100 <= executed, "unknown {unknown} is more than 1% of {executed} executed");
    // Goodput: the upstream was kept busy with requests that completed
    // (over the run; the last requests sent finish a little after it).
    let capacity = 40.0 * run.as_secs_f64();
    assert!(completed as f64 >= 0.8 * capacity, "completed {completed}, less than 0.8 of the upstream's capacity {capacity:.0}");
    assert!(!told.refused.is_empty(), "15 times the capacity and nothing refused");
}

/// At the upstream's capacity (as many clients as it serves at a time),
/// nothing is refused: the limit costs the normal case nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_capacity_nothing_is_refused() {
    let _alone = LOAD.lock().await;
    let up = OverloadedUpstream::start(4, Duration::from_millis(50)).await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("1s"));
    let (told, _) = load(&gw, 4, Duration::from_secs(3), Duration::ZERO).await;
    assert!(told.refused.is_empty() && told.unknown.is_empty() && told.other.is_empty(), "refused {}", told.refused.len());
    assert_eq!(up.executed(), told.created.len() as u64);
    assert!(told.created.len() >= 40, "only {} requests in 3 s", told.created.len());
}

/// A fixed limit (`max_in_flight`): the request over it is refused at once
/// (no `queue_timeout` wait), claims nothing, and its retry with the same key
/// runs once a slot is free. The limit and the refusal are metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fixed_limit_refuses_the_request_over_it_and_its_retry_runs_once() {
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).upstream("max_in_flight = 1\nqueue_timeout = \"0s\""));
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    let slow = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "first", r#"{"n":1}"#, &[("x-test-sleep-ms", "1500")]).await }
    });
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 1 }).await, "the first request never arrived");
    let over = post(&url, "second", r#"{"n":2}"#, &[]).await;
    assert_eq!((over.status, over.problem().as_str()), (503, "overloaded"), "{:?}", over.body);
    assert_eq!(over.header("retry-after"), Some("1"));
    assert_eq!(over.json()["retryable"], true);
    assert!(record(&store, "second").await.is_none(), "the refused request was claimed");
    assert_eq!(up.total(), 1, "the refused request reached the upstream");

    let metrics = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics");
    let text = String::from_utf8_lossy(&metrics.body);
    for line in [
        r#"idemgate_upstream_limit{upstream="orders"} 1"#,
        r#"idemgate_upstream_in_flight{upstream="orders"} 1"#,
        r#"idemgate_upstream_refusals_total{upstream="orders"} 1"#,
        r#"idemgate_requests_total{operation="create_order",outcome="overloaded"} 1"#,
    ] {
        assert!(text.contains(line), "{line} missing from\n{text}");
    }

    assert_eq!(slow.await.expect("first").status, 201);
    let retry = post(&url, "second", r#"{"n":2}"#, &[]).await;
    assert_eq!(retry.status, 201);
    assert_eq!(up.side_effects(&derived("second")), 1);
    assert_eq!(support::settled_record(&store, "second").await.map(|r| r.state), Some(State::Completed));
}

/// `adaptive = false` without `max_in_flight`: no limit at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_limit_when_adaptation_is_off_and_no_maximum_is_set() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()).upstream("adaptive = false"));
    let url = gw.url("/v1/orders");
    let keys: Vec<String> = (0..30).map(|i| format!("k{i}")).collect();
    let answers = futures_util::future::join_all(keys.iter().map(|k| post(&url, k, r#"{"n":1}"#, &[("x-test-sleep-ms", "300")]))).await;
    assert!(answers.iter().all(|r| r.status == 201));
    let text = String::from_utf8_lossy(&send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics").body).into_owned();
    assert!(!text.contains("idemgate_upstream_limit{"), "{text}");
}

/// A route's own cap (`routes.max_in_flight`) within its upstream's limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_routes_own_cap_refuses_before_the_claim() {
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).upstream("queue_timeout = \"0s\"").route("max_in_flight = 1"));
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    let slow = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "first", r#"{"n":1}"#, &[("x-test-sleep-ms", "1000")]).await }
    });
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 1 }).await);
    let over = post(&url, "second", r#"{"n":2}"#, &[]).await;
    assert_eq!((over.status, over.problem().as_str()), (503, "overloaded"));
    assert!(record(&store, "second").await.is_none());
    assert_eq!(slow.await.expect("first").status, 201);
    assert_eq!(up.total(), 1);
}

/// An async route's queue bound (`max_queued`): past it an acceptance is
/// refused before anything is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_async_queue_refuses_acceptances_before_the_claim() {
    let up = TestUpstream::start().await;
    let backend = support::postgres_backend();
    // No workers (a pure front replica): accepted operations stay queued.
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url()).route("mode = \"async\"\nmax_queued = 2").tail("[workers]\ncount = 0"),
    );
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    for key in ["a", "b"] {
        assert_eq!(post(&url, key, r#"{"n":1}"#, &[]).await.status, 202);
    }
    let full = post(&url, "c", r#"{"n":1}"#, &[]).await;
    assert_eq!((full.status, full.problem().as_str()), (503, "overloaded"), "{:?}", full.body);
    assert!(full.header("retry-after").is_some());
    assert!(record(&store, "c").await.is_none(), "the refused acceptance was claimed");
    assert_eq!(up.total(), 0);
}

/// The soak's shape under overload: two replicas on one PostgreSQL in front
/// of an upstream that serves 4 at a time, 48 clients that each retry their
/// key (alternating replicas, backing off on a retryable answer) until it is
/// answered for good. Nothing runs twice, nothing executed is lost, and
/// `unknown` stays within 1% of what the upstream executed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrying_clients_on_two_replicas_under_overload_run_each_operation_once() {
    let _alone = LOAD.lock().await;
    let up = OverloadedUpstream::start(4, Duration::from_millis(100)).await;
    let backend = support::postgres_backend();
    let config = GatewayConfig::new(backend.clone(), up.url()).timeout("1s");
    let replicas = [Gateway::start(config.clone()), Gateway::start(config)];
    let store = backend.open().await;
    let urls: Arc<Vec<String>> = Arc::new(replicas.iter().map(|g| g.url("/v1/orders")).collect());
    let started = Instant::now();
    let run = Duration::from_secs(8);
    // (key, final status, problem) per operation.
    let done = Arc::new(std::sync::Mutex::new(Vec::<(String, u16, String)>::new()));
    let clients: Vec<_> = (0..48)
        .map(|c| {
            let (urls, done) = (urls.clone(), done.clone());
            tokio::spawn(async move {
                let mut n = 0;
                while started.elapsed() < run {
                    n += 1;
                    let key = format!("soak-{c}-{n}");
                    for attempt in 0usize.. {
                        let url = &urls[(c + attempt) % urls.len()];
                        let resp = post(url, &key, r#"{"item":"book"}"#, &[]).await;
                        let problem = if resp.status >= 400 { resp.problem() } else { String::new() };
                        if resp.status == 201 || !resp.json()["retryable"].as_bool().unwrap_or(false) {
                            done.lock().unwrap().push((key.clone(), resp.status, problem));
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            })
        })
        .collect();
    for c in clients {
        c.await.expect("client");
    }
    let done = std::mem::take(&mut *done.lock().unwrap());
    let executions = up.executions();
    let duplicates = executions.values().filter(|&&n| n > 1).count();
    let mut lost = 0;
    let mut unknown = 0;
    for (key, status, problem) in &done {
        let rec = support::settled_record(&store, key).await;
        match (status, rec.as_ref().map(|r| r.state)) {
            (201, Some(State::Completed)) => {
                if executions.get(&derived(key)).copied() != Some(1) {
                    lost += 1;
                }
            }
            (_, Some(State::Unknown)) => unknown += 1,
            other => panic!("key {key}: answered {status} {problem}, record {other:?}"),
        }
    }
    let executed = up.executed();
    println!(
        "overload soak: keys={} executed={executed} duplicates={duplicates} lost={lost} unknown={unknown} ({:.1}% of executed)",
        done.len(),
        100.0 * unknown as f64 / executed.max(1) as f64
    );
    assert_eq!((duplicates, lost), (0, 0));
    assert!(unknown as u64 * 100 <= executed, "unknown {unknown} is more than 1% of {executed} executed");
    assert!(done.len() >= 100, "only {} operations answered", done.len());
}

/// Two slow requests that hold both slots of an upstream limited to 2
/// (each takes `hold_ms`; the upstream's timeout is 3 s).
fn hold_both_slots(url: &str, hold_ms: &'static str) -> Vec<tokio::task::JoinHandle<support::Resp>> {
    (0..2)
        .map(|i| {
            let url = url.to_owned();
            tokio::spawn(async move { post(&url, &format!("holder-{i}"), r#"{"n":1}"#, &[("x-test-sleep-ms", hold_ms)]).await })
        })
        .collect()
}

/// A record made `unknown` by an upstream that answers after the timeout.
async fn unknown_record(url: &str, key: &str) {
    let resp = post(url, key, r#"{"n":1}"#, &[("x-test-sleep-ms", "3500")]).await;
    assert_eq!((resp.status, resp.problem().as_str()), (504, "outcome-unknown"));
}

/// Reconcile probes count against the upstream's limit: none is sent while
/// requests hold every slot, and the probe goes once one is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_wait_while_the_upstream_is_at_its_limit() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url()).timeout("3s").upstream("max_in_flight = 2\nqueue_timeout = \"0s\"").route(
            "[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{derived_key}\"\nfound_as = 201\nsettle = \"300ms\"\ninterval = \"100ms\"",
        ),
    );
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    unknown_record(&url, "lost").await;
    // The probe may go 300 ms after the timeout; the slots are taken first.
    let holders = hold_both_slots(&url, "2500");
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 3 }).await, "the holders never arrived");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(up.probes_of(&derived("lost")), 0, "a probe was sent while the upstream was at its limit");
    for h in holders {
        assert_eq!(h.await.expect("holder").status, 201);
    }
    let settled = support::eventually(Duration::from_secs(10), || async {
        record(&store, "lost").await.is_some_and(|r| r.state == State::Completed)
    })
    .await;
    assert!(settled, "the probe never went once a slot was free:\n{}", gw.logs());
    assert_eq!(up.probes_of(&derived("lost")), 1);
}

/// A probe holds its slot while it is at the upstream: with the one slot
/// taken by a slow probe, a first write is refused before its claim, not
/// sent beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_holds_its_slot_while_it_is_at_the_upstream() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url()).timeout("3s").upstream("max_in_flight = 1\nqueue_timeout = \"0s\"").route(
            "[routes.reconcile]\nprobe = \"GET /v1/orders/by-key/{derived_key}\"\nfound_as = 201\nsettle = \"300ms\"\ninterval = \"100ms\"",
        ),
    );
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    up.set_probe_delay_ms(2500);
    unknown_record(&url, "lost").await;
    assert!(
        support::eventually(Duration::from_secs(10), || async { up.probes_of(&derived("lost")) == 1 }).await,
        "no probe was sent:\n{}",
        gw.logs()
    );
    let writes = up.total();
    let resp = post(&url, "beside-the-probe", r#"{"n":1}"#, &[]).await;
    assert_eq!(resp.status, 503, "a write went beside the probe: {:?}", resp.body);
    assert_eq!(resp.problem(), "overloaded");
    assert_eq!(up.total(), writes, "the upstream ran a write while the probe held its only slot");
    assert!(record(&store, "beside-the-probe").await.is_none(), "a refused request claimed its key");
    let settled = support::eventually(Duration::from_secs(10), || async {
        record(&store, "lost").await.is_some_and(|r| r.state == State::Completed)
    })
    .await;
    assert!(settled, "the probe's answer was not applied:\n{}", gw.logs());
    assert_eq!(up.probes_of(&derived("lost")), 1);
}

/// Event deliveries to an upstream's address count against its limit: an
/// event made while requests hold every slot waits for a free one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_deliveries_to_an_upstream_wait_while_it_is_at_its_limit() {
    let _alone = LOAD.lock().await;
    let (up, gw, store, _dir) = support::admin::setup(sqlite_backend(), "admin-token-overload", |c| {
        let events = format!("events.url = \"http://{}/events\"\nevents.timeout = \"2s\"", c.upstream_url.trim_start_matches("http://"));
        c.timeout("3s").upstream("max_in_flight = 2\nqueue_timeout = \"0s\"").route(&events)
    })
    .await;
    let url = gw.url("/v1/orders");
    let events = || up.requests().iter().filter(|r| r.path == "/events").count();
    unknown_record(&url, "lost").await;
    assert!(support::eventually(Duration::from_secs(5), || async { events() == 1 }).await, "the unknown event was not delivered");
    let holders = hold_both_slots(&url, "2500");
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 4 }).await, "the holders never arrived");
    // An operator releases the record: its event is written at once.
    let path = support::admin::record_path(support::TENANT, support::PRINCIPAL, "create_order", "lost");
    let body = serde_json::json!({ "action": "release", "reason": "checked: never happened" }).to_string();
    let released = support::admin::request(&gw, "POST", &format!("{path}/resolve"), Some("admin-token-overload"), &body).await;
    assert_eq!(released.status, 200, "{:?}", released.body);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(events(), 1, "an event was delivered while the upstream was at its limit");
    for h in holders {
        assert_eq!(h.await.expect("holder").status, 201);
    }
    // The release's event, then the holders' completions.
    assert!(support::eventually(Duration::from_secs(10), || async { events() >= 2 }).await, "the event never went once a slot was free");
    assert!(record(&store, "lost").await.is_none());
}

/// Six clients sending first writes to `url` until `run` has passed, each
/// held 100 ms at the upstream: with the upstream limited to two at a time,
/// three times what the limit lets through, so requests always wait for a
/// slot. Each client's statuses.
fn steady_clients(url: &str, run: Duration) -> Vec<tokio::task::JoinHandle<Vec<u16>>> {
    let started = Instant::now();
    (0..6)
        .map(|c| {
            let url = url.to_owned();
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut n = 0;
                while started.elapsed() < run {
                    n += 1;
                    let r = post(&url, &format!("steady-{c}-{n}"), r#"{"n":1}"#, &[("x-test-sleep-ms", "100")]).await;
                    statuses.push(r.status);
                }
                statuses
            })
        })
        .collect()
}

/// The statuses of [`steady_clients`], once they are done; every request
/// waited for its slot and ran.
async fn all_answered(clients: Vec<tokio::task::JoinHandle<Vec<u16>>>) -> Vec<u16> {
    let mut statuses = Vec::new();
    for c in clients {
        statuses.extend(c.await.expect("client"));
    }
    assert!(statuses.iter().all(|s| *s == 201), "every request ran: {statuses:?}");
    statuses
}

/// Requests that keep an upstream at its limit do not hold its events until
/// the load ends: the relay waits its turn for a slot beside the waiting
/// requests (with one free slot looked for, none was ever free under a
/// steady load, and every event of the run was delivered after it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_are_delivered_while_requests_keep_the_upstream_at_its_limit() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let events = format!("events.url = \"{}/events\"", up.url());
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url()).timeout("8s").upstream("max_in_flight = 2\nqueue_timeout = \"3s\"").route(&events),
    );
    let clients = steady_clients(&gw.url("/v1/orders"), Duration::from_secs(4));
    let delivered = || up.requests().iter().filter(|r| r.path == "/events").count();
    // Half-way through, the first 2 s of completions have had their chance.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = delivered();
    let statuses = all_answered(clients).await;
    eprintln!("events delivered during the load: {during}");
    assert!(during >= 3, "{during} events delivered in 3 s of load, {} requests answered in all:\n{}", statuses.len(), gw.logs());
    // And every event is delivered in the end, each once.
    let all = support::eventually(Duration::from_secs(20), || async { delivered() >= statuses.len() }).await;
    assert!(all, "{} of {} events delivered", delivered(), statuses.len());
}

/// Requests that keep an upstream at its limit do not hold the async
/// operations of its routes until the load ends: the workers wait their turn
/// for a slot beside the waiting requests, as the relay does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_operations_run_while_requests_keep_the_upstream_at_its_limit() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url())
            .timeout("8s")
            .upstream("max_in_flight = 2\nqueue_timeout = \"3s\"")
            .route("allow_async = true"),
    );
    let store = backend.open().await;
    let clients = steady_clients(&gw.url("/v1/orders"), Duration::from_secs(4));
    // Once the load is on, four operations are accepted (202, no slot needed).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let keys: Vec<String> = (0..4).map(|i| format!("async-{i}")).collect();
    for key in &keys {
        let accepted = post(&gw.url("/v1/orders"), key, r#"{"n":2}"#, &[("prefer", "respond-async")]).await;
        assert_eq!(accepted.status, 202, "{accepted:?}");
    }
    let ran = || keys.iter().filter(|k| up.side_effects(&derived(k)) > 0).count();
    // Two and a half seconds of load later, the workers have had their turns.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let during = ran();
    let statuses = all_answered(clients).await;
    eprintln!("async operations run during the load: {during} of {}", keys.len());
    assert!(during >= 3, "{during} of 4 operations ran in 2.5 s of load, {} requests answered:\n{}", statuses.len(), gw.logs());
    // And every operation completes in the end, each executed once.
    let completed = support::eventually(Duration::from_secs(20), || async {
        let mut all = true;
        for key in &keys {
            all &= record(&store, key).await.is_some_and(|r| r.state == State::Completed);
        }
        all
    })
    .await;
    assert!(completed, "not every operation completed:\n{}", gw.logs());
    for key in &keys {
        assert_eq!(up.side_effects(&derived(key)), 1, "{key} executed once");
    }
}

/// Over the limit, a request whose key has a record is answered from it as
/// ever (nothing is claimed or forwarded either way): a duplicate of one in
/// flight 409 `request-in-progress`, a replay, a changed request 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_limit_a_key_with_a_record_is_answered_from_it() {
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).upstream("max_in_flight = 1\nqueue_timeout = \"0s\""));
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "done", r#"{"n":1}"#, &[]).await.status, 201);
    let slow = tokio::spawn({
        let url = url.clone();
        async move { post(&url, "slow", r#"{"n":1}"#, &[("x-test-sleep-ms", "1500")]).await }
    });
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 2 }).await);
    let duplicate = post(&url, "slow", r#"{"n":1}"#, &[]).await;
    assert_eq!((duplicate.status, duplicate.problem().as_str()), (409, "request-in-progress"));
    let replay = post(&url, "done", r#"{"n":1}"#, &[]).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    let changed = post(&url, "done", r#"{"n":2}"#, &[]).await;
    assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"));
    let fresh = post(&url, "fresh", r#"{"n":1}"#, &[]).await;
    assert_eq!((fresh.status, fresh.problem().as_str()), (503, "overloaded"));
    assert_eq!(slow.await.expect("slow").status, 201);
    assert_eq!(up.total(), 2);
}

/// A relay round whose events all go to an upstream's address takes no more
/// of them than its free slots carry: the rest wait in the log. Taking a
/// round's worth (256 here) with one slot free delivered one event and set
/// the others aside, each copied on PostgreSQL into the table of events
/// being retried (the write per event the log exists to avoid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_takes_no_more_events_than_its_upstreams_free_slots_carry() {
    let _alone = LOAD.lock().await;
    let backend = support::postgres_backend();
    let support::Backend::Postgres { url: db } = &backend else { panic!("a PostgreSQL backend") };
    let (up, hooks) = (TestUpstream::start().await, TestUpstream::start().await);
    let gw = Gateway::start(
        GatewayConfig::new(backend.clone(), up.url())
            .route(&format!("events.url = \"{}/events\"", hooks.url()))
            .tail(&format!("[[upstreams]]\nname = \"hooks\"\nurl = \"{}\"\nmax_in_flight = 1\n", hooks.url())),
    );
    // The relay finds nothing for a while and polls less often: the events
    // below are all written before its next take.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let url = gw.url("/v1/orders");
    let writes: Vec<_> = (0..40)
        .map(|i| {
            let url = url.clone();
            tokio::spawn(async move { post(&url, &format!("slots-{i}"), r#"{"n":1}"#, &[]).await.status })
        })
        .collect();
    for w in writes {
        assert_eq!(w.await.expect("write"), 201);
    }
    let delivered = || hooks.requests().iter().filter(|r| r.path == "/events").count();
    assert!(support::eventually(Duration::from_secs(20), || async { delivered() >= 40 }).await, "{} of 40 delivered", delivered());
    let (client, conn) = tokio_postgres::connect(db, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    let copies: i64 = client.query_one("SELECT count(*) FROM idemgate_events", &[]).await.expect("count").get(0);
    assert_eq!(copies, 0, "events set aside for want of a slot:\n{}", gw.logs());
}

/// At the limit, a retry of a completed key is answered from its record at
/// once: it needs no slot, and does not wait `queue_timeout` for one it
/// would not use (here the slot's holder is still at the upstream when the
/// replay comes back; before, the replay waited until the holder was done).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_limit_a_replay_does_not_wait_for_a_slot() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw =
        Gateway::start(GatewayConfig::new(backend.clone(), up.url()).timeout("10s").upstream("max_in_flight = 1\nqueue_timeout = \"4s\""));
    let store = backend.open().await;
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "done", r#"{"n":1}"#, &[]).await.status, 201);
    assert!(record(&store, "done").await.is_some_and(|r| r.state == State::Completed));
    let holder = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "holder", r#"{"n":1}"#, &[("x-test-sleep-ms", "2500")]).await })
    };
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 2 }).await, "the holder never arrived");
    let replay = post(&url, "done", r#"{"n":1}"#, &[]).await;
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert!(!holder.is_finished(), "the replay waited for the holder's slot");
    assert_eq!(holder.await.expect("holder").status, 201);
    assert_eq!(up.total(), 2, "nothing forwarded for the replay");
}

/// A duplicate waiting for its key's result (`in_flight = "wait"`) gives
/// its upstream slot back while it waits: with two slots, a slow first
/// request holding one and its duplicate waiting, a request for a new key
/// is forwarded, not refused `overloaded`; the duplicate still gets the
/// first's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_leaves_its_slot_to_a_new_key() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url())
            .timeout("10s")
            .upstream("max_in_flight = 2\nqueue_timeout = \"200ms\"")
            .route("in_flight = \"wait\"\nin_flight_wait = \"5s\""),
    );
    let url = gw.url("/v1/orders");
    let spawn = |key: &'static str, sleep: &'static str| {
        let url = url.clone();
        tokio::spawn(async move { post(&url, key, r#"{"n":1}"#, &[("x-test-sleep-ms", sleep)]).await })
    };
    let first = spawn("slow", "2000");
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 1 }).await, "the first never arrived");
    let duplicate = spawn("slow", "2000");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let other = post(&url, "other", r#"{"n":1}"#, &[]).await;
    assert_eq!(other.status, 201, "a new key beside a waiting duplicate: {:?}\n{}", other.body, gw.logs());
    let duplicate = duplicate.await.expect("duplicate");
    assert_eq!((duplicate.status, duplicate.replayed()), (201, true), "{:?}", duplicate.body);
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!((up.side_effects(&derived("slow")), up.side_effects(&derived("other"))), (1, 1));
}

/// At the limit, a duplicate of a key in flight on a route that waits for
/// its result (`in_flight = "wait"`) still waits: for a slot as before, and
/// then gets the first request's answer, not an immediate 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_limit_a_waiting_duplicate_still_gets_the_first_answer() {
    let _alone = LOAD.lock().await;
    let up = TestUpstream::start().await;
    let gw = Gateway::start(
        GatewayConfig::new(sqlite_backend(), up.url())
            .timeout("10s")
            .upstream("max_in_flight = 1\nqueue_timeout = \"4s\"")
            .route("in_flight = \"wait\"\nin_flight_wait = \"5s\""),
    );
    let url = gw.url("/v1/orders");
    let first = {
        let url = url.clone();
        tokio::spawn(async move { post(&url, "k1", r#"{"n":1}"#, &[("x-test-sleep-ms", "1500")]).await })
    };
    assert!(support::eventually(Duration::from_secs(5), || async { up.total() == 1 }).await, "the first never arrived");
    let duplicate = post(&url, "k1", r#"{"n":1}"#, &[("x-test-sleep-ms", "1500")]).await;
    assert_eq!((duplicate.status, duplicate.replayed()), (201, true), "{:?}", duplicate.body);
    assert_eq!(first.await.expect("first").status, 201);
    assert_eq!(up.side_effects(&derived("k1")), 1);
}
