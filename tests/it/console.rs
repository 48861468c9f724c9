//! The operator console (contract section 11) in a real browser: Chromium
//! headless, driven through chromedriver (WebDriver) with fantoccini, against
//! the real gateway binary and an upstream that counts side effects.
//!
//! The browser tests log in with the token, find an unknown record made by a
//! timed-out request, open it, resolve it with a reason (complete, and
//! release), and check the record, the audit row (actor `console`, the
//! token's label) and the client's next retry against the upstream's ledger.
//! A wrong token is refused; stored script in bodies and headers never runs.
//! The plain-HTTP tests check the console's headers, that it is absent when
//! the admin API is off, and the admin API endpoints the console added.
//!
//! Needs `chromium` and `chromedriver` (Debian: `chromium`, `chromium-driver`;
//! `scripts/test` installs them). With `IDEMGATE_CONSOLE_SCREENSHOTS=<dir>`
//! the resolve test also writes `overview.png` and `record.png` there
//! (`scripts/console-screenshots` regenerates `docs/console/`).
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use idemgate::idempotency::record::State;
use serde_json::json;
use support::admin::enc;
use support::gateway::free_local_addr;
use support::*;

on_both_stores!(the_admin_api_endpoints_the_console_reads, an_inconclusive_probe_shows_its_last_answer_and_the_request_line);

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const TOKEN: &str = "console-token-7c1e";
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
                   frame-ancestors 'none'; base-uri 'none'; form-action 'none'";

// ---------- harness: gateway with the admin API on, and a browser ----------

/// A gateway whose admin API is on (token in a file), and its store.
async fn setup(
    backend: Backend,
    f: impl FnOnce(GatewayConfig) -> GatewayConfig,
) -> (TestUpstream, Gateway, idemgate::store::Store, tempfile::TempDir) {
    support::admin::setup(backend, TOKEN, f).await
}

/// A timed-out request: the upstream executed it, the gateway could not
/// say so (504 outcome-unknown), and the record is `unknown`.
async fn unknown_record(gw: &Gateway, store: &idemgate::store::Store, key: &str) {
    let r = post(&gw.url("/v1/orders"), key, ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}");
    assert_eq!(settled_record(store, key).await.unwrap().state, State::Unknown);
}

async fn admin(gw: &Gateway, method: &str, path: &str, body: &str) -> Resp {
    support::admin::request(gw, method, path, Some(TOKEN), body).await
}

fn record_path(key: &str) -> String {
    support::admin::record_path(TENANT, PRINCIPAL, "create_order", key)
}

/// chromedriver on a free loopback port, and one headless Chromium session
/// through it. Both end when this is dropped (or `close`d).
struct Browser {
    client: Client,
    driver: Child,
}

/// A test that fails before `close` still stops chromedriver (and with it
/// the browser it started).
impl Drop for Browser {
    fn drop(&mut self) {
        // chromedriver leads its own process group, Chromium's processes included.
        if let Some(group) = i32::try_from(self.driver.id()).ok().and_then(rustix::process::Pid::from_raw) {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    async fn start() -> Browser {
        let port = free_local_addr().port();
        let driver = Command::new(chromedriver())
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver (Debian package chromium-driver; scripts/test installs it)");
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        let deadline = Instant::now() + Duration::from_secs(20);
        while tokio::net::TcpStream::connect(addr).await.is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen on {addr}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({ "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,943",
                             "--hide-scrollbars", "--force-device-scale-factor=1"] }),
        );
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(caps)
            .connect(&format!("http://{addr}"))
            .await
            .expect("a Chromium session through chromedriver");
        Browser { client, driver }
    }

    async fn close(self) {
        let _ = self.client.clone().close().await;
    }

    async fn css(&self, selector: &str) -> fantoccini::elements::Element {
        self.client
            .wait()
            .at_most(Duration::from_secs(15))
            .for_element(Locator::Css(selector))
            .await
            .unwrap_or_else(|e| panic!("no {selector}: {e}"))
    }

    async fn text(&self, selector: &str) -> String {
        self.css(selector).await.text().await.unwrap()
    }

    /// Waits until the element's text contains `needle`; returns the text.
    async fn wait_text(&self, selector: &str, needle: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(e) = self.client.find(Locator::Css(selector)).await
                && let Ok(t) = e.text().await
                && t.contains(needle)
            {
                return t;
            }
            assert!(Instant::now() < deadline, "{selector} never showed {needle:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn js(&self, script: &str) -> serde_json::Value {
        self.client.execute(script, vec![]).await.unwrap()
    }

    async fn type_into(&self, selector: &str, text: &str) {
        let e = self.css(selector).await;
        e.clear().await.unwrap();
        e.send_keys(text).await.unwrap();
    }

    async fn click(&self, selector: &str) {
        self.css(selector).await.click().await.unwrap();
    }

    /// Opens the console and logs in with `token`.
    async fn log_in(&self, gw: &Gateway, token: &str) {
        self.client.goto(&gw.admin_url("/console/")).await.unwrap();
        self.type_into("#token", token).await;
        self.click("#login-button").await;
    }

    async fn screenshot(&self, name: &str) {
        if let Some(dir) = std::env::var_os("IDEMGATE_CONSOLE_SCREENSHOTS") {
            let png = self.client.screenshot().await.unwrap();
            std::fs::write(std::path::Path::new(&dir).join(name), png).unwrap();
        }
    }
}

fn chromedriver() -> String {
    std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".into())
}

/// Opens the record of `key` from the list of unknown records, as an
/// operator would: overview, the unknown tile, the row's Open button.
async fn open_unknown_record(b: &Browser, key: &str) {
    b.click("#total-unknown").await;
    let rows = b.wait_text("table.records", key).await;
    assert!(rows.contains("unknown"), "{rows}");
    let opened = b
        .js(&format!(
            "for (const tr of document.querySelectorAll('tr.record-row')) {{ \
               if (tr.textContent.includes({key:?})) {{ tr.querySelector('button.open').click(); return true; }} }} return false;"
        ))
        .await;
    assert_eq!(opened, json!(true));
    b.wait_text("#scope-key", key).await;
}

// ---------- browser tests ----------

/// Log in, find the unknown record, complete it with a reason; the audit row
/// names the console and the token's label, and the client's retry gets the
/// recorded answer without the upstream executing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_completes_an_unknown_record_in_the_browser() {
    let (up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    for i in 0..3 {
        assert_eq!(post(&gw.url("/v1/orders"), &format!("order-{i}"), ORDER, &[]).await.status, 201);
    }
    unknown_record(&gw, &store, "order-lost").await;
    let executed = up.side_effects(&derived("order-lost"));
    assert_eq!(executed, 1, "the timed-out request did reach the upstream");

    let b = Browser::start().await;
    b.log_in(&gw, TOKEN).await;
    assert_eq!(b.wait_text("#total-unknown", "unknown").await.lines().next(), Some("1"));
    assert_eq!(b.js("return sessionStorage.getItem('idemgate.console.token')").await, json!(TOKEN));
    assert_eq!(b.js("return document.cookie").await, json!(""), "no cookies");
    b.screenshot("overview.png").await;

    open_unknown_record(&b, "order-lost").await;
    assert_eq!(b.text("#record-state").await, "unknown");
    assert!(b.text("#view").await.contains("Not stored"), "a sync record without a probe keeps no request");
    let executed = b.text("#may-have-executed").await;
    assert!(executed.starts_with("yes"), "an unknown record may have executed: {executed}");
    b.screenshot("record.png").await;
    // No reason: refused in the page, nothing sent.
    b.click("#resolve-review").await;
    b.wait_text("#resolve-out", "reason is required").await;
    b.type_into("#resolve-status", "201").await;
    b.type_into("#resolve-body", r#"{"order":"found by hand"}"#).await;
    b.type_into("#resolve-reason", "order 4711 is in the upstream's ledger").await;
    b.click("#resolve-review").await;
    let consequence = b.text("#consequence").await;
    assert!(consequence.contains("status 201") && consequence.contains("will not run again"), "{consequence}");
    assert_eq!(settled_record(&store, "order-lost").await.unwrap().state, State::Unknown, "nothing before confirming");
    b.click("#confirm-yes").await;
    b.wait_text("#resolved", "unknown → completed").await;
    assert_eq!(b.text("#record-state").await, "completed");
    let trail = b.wait_text("#record-audit", "console").await;
    assert!(trail.contains("order 4711 is in the upstream's ledger"), "{trail}");
    b.close().await;

    let rec = settled_record(&store, "order-lost").await.unwrap();
    assert_eq!(rec.state, State::Completed);
    let resp = rec.response.unwrap();
    assert_eq!((resp.status, resp.body.as_deref()), (201, Some(&br#"{"order":"found by hand"}"#[..])));
    let audit = store.audit(10).await.unwrap();
    assert_eq!(audit.len(), 1);
    let row = &audit[0];
    assert_eq!((row.actor.as_str(), row.from_state.as_str(), row.to_state.as_str()), ("console", "unknown", "completed"));
    assert_eq!(row.token.as_deref(), Some(idemgate::store::audit::token_label(TOKEN, TEST_SECRET.as_bytes()).as_str()));
    assert_eq!(row.reason, "order 4711 is in the upstream's ledger");
    assert!(row.peer.as_deref().is_some_and(|p| p.starts_with("127.0.0.1:")), "{row:?}");

    let retry = post(&gw.url("/v1/orders"), "order-lost", ORDER, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(&retry.body[..], br#"{"order":"found by hand"}"#);
    assert_eq!(up.side_effects(&derived("order-lost")), 1, "the retry did not execute again");
}

/// Release: the confirmation says the retry runs the operation again, and it
/// does (the upstream's ledger shows a second side effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_releases_an_unknown_record_and_the_retry_runs_again() {
    let (up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    unknown_record(&gw, &store, "never-happened").await;

    let b = Browser::start().await;
    b.log_in(&gw, TOKEN).await;
    b.wait_text("#total-unknown", "unknown").await;
    open_unknown_record(&b, "never-happened").await;
    b.click("#action-release").await;
    b.type_into("#resolve-reason", "no such order upstream").await;
    b.click("#resolve-review").await;
    let consequence = b.text("#consequence").await;
    assert!(consequence.contains("the client's retry will run the operation again"), "{consequence}");
    b.click("#confirm-yes").await;
    b.wait_text("#resolved", "unknown → released").await;
    b.close().await;

    assert!(settled_record(&store, "never-happened").await.is_none(), "released: the record is gone");
    let audit = store.audit(10).await.unwrap();
    assert_eq!((audit[0].actor.as_str(), audit[0].to_state.as_str()), ("console", "released"));
    assert_eq!(audit[0].token.as_deref(), Some(idemgate::store::audit::token_label(TOKEN, TEST_SECRET.as_bytes()).as_str()));
    let before = up.side_effects(&derived("never-happened"));
    let retry = post(&gw.url("/v1/orders"), "never-happened", ORDER, &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(up.side_effects(&derived("never-happened")), before + 1, "the retry ran the operation again");
    assert_eq!(settled_record(&store, "never-happened").await.unwrap().state, State::Completed);
}

/// A refused resolution shows the API's problem detail: the record was
/// resolved elsewhere (the CLI) after the page was loaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_resolution_shows_the_problem_detail() {
    let (up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    unknown_record(&gw, &store, "raced").await;
    let b = Browser::start().await;
    b.log_in(&gw, TOKEN).await;
    b.wait_text("#total-unknown", "unknown").await;
    open_unknown_record(&b, "raced").await;
    let done = admin(
        &gw,
        "POST",
        &format!("{}/resolve", record_path("raced")),
        &json!({ "action": "complete", "status": 200, "reason": "someone else" }).to_string(),
    )
    .await;
    assert_eq!(done.status, 200, "{done:?}");
    b.click("#action-release").await;
    b.type_into("#resolve-reason", "late").await;
    b.click("#resolve-review").await;
    b.click("#confirm-yes").await;
    let shown = b.wait_text("#problem", "409").await;
    // The page sent the generation it showed: the record moved on since.
    assert!(shown.contains("Record not resolvable") && shown.contains("moved on"), "{shown}");
    b.close().await;
    assert_eq!(settled_record(&store, "raced").await.unwrap().state, State::Completed);
    assert_eq!(store.audit(10).await.unwrap().len(), 1, "only the API's resolution");
    assert_eq!(up.side_effects(&derived("raced")), 1);
}

/// A wrong token: an error, no data, nothing kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_shows_no_data() {
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    unknown_record(&gw, &store, "secret-order").await;
    let b = Browser::start().await;
    b.log_in(&gw, &format!("{TOKEN}-wrong")).await;
    let error = b.wait_text("#login-error", "refused").await;
    assert!(error.contains("401"), "{error}");
    assert_eq!(b.js("return document.getElementById('view').childElementCount").await, json!(0));
    assert_eq!(b.js("return document.getElementById('nav').hidden").await, json!(true));
    assert_eq!(b.js("return sessionStorage.length").await, json!(0));
    let source = b.client.source().await.unwrap();
    assert!(!source.contains("secret-order"), "no record data in the page");
    // Navigating straight to a page still asks for the token.
    b.client.goto(&format!("{}#/records?state=unknown", gw.admin_url("/console/"))).await.unwrap();
    b.css("#login:not([hidden])").await;
    assert!(!b.client.source().await.unwrap().contains("secret-order"));
    b.close().await;
}

/// Stored bodies and headers are attacker-controlled: a `<script>` body, an
/// `<img onerror>` and `javascript:` header values, on a completed record and
/// on a queued async one, are shown as text, and nothing they hold runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_script_is_shown_as_text_and_never_runs() {
    let queued_route = queued_route();
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"").tail(&queued_route)).await;
    let script = "<script>window.__pwned='script'</script>";
    let img = "<img src=x onerror=\"window.__pwned='img'\">";
    let link = "javascript:window.__pwned='link'";
    // 1. A record resolved by hand with hostile headers and body.
    unknown_record(&gw, &store, "hostile").await;
    let body = format!("{script}{img}");
    let resolved = admin(
        &gw,
        "POST",
        &format!("{}/resolve", record_path("hostile")),
        &json!({
            "action": "complete", "status": 200, "reason": format!("reason {img}"),
            "headers": { "location": link, "x-note": img, "content-type": "text/html" },
            "body_base64": base64_of(body.as_bytes()),
        })
        .to_string(),
    )
    .await;
    assert_eq!(resolved.status, 200, "{resolved:?}");
    // 2. A queued async operation: its stored request keeps the client's
    // headers, the credential among them.
    let q = post(&gw.url("/v1/queued"), "queued-hostile", &format!("{{\"note\":{script:?}}}"), &[("x-evil", link), ("x-img", img)]).await;
    assert_eq!(q.status, 202, "{q:?}");
    requeued(&store, "queued-hostile").await;

    let b = Browser::start().await;
    b.log_in(&gw, TOKEN).await;
    b.wait_text("#total-unknown", "unknown").await;
    b.client.goto(&format!("{}#/record/{}/{}/create_order/hostile", gw.admin_url("/console/"), enc(TENANT), enc(PRINCIPAL))).await.unwrap();
    b.wait_text("#scope-key", "hostile").await;
    // (An onerror handler runs once the image fails to load: give it time.)
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.js("return window.__pwned === undefined ? null : String(window.__pwned)").await, json!(null), "nothing ran");
    assert_eq!(b.text("#response-body").await, body, "the body is shown literally");
    let headers = b.text("#response-headers").await;
    assert!(headers.contains(link) && headers.contains(img), "{headers}");
    assert!(b.text("#record-audit").await.contains(&format!("reason {img}")));
    assert_eq!(b.js("return window.__pwned === undefined").await, json!(true), "nothing ran");
    assert_eq!(b.js("return document.querySelectorAll('#view img, #view script, #view a, #view iframe').length").await, json!(0));

    b.client
        .goto(&format!("{}#/record/{}/{}/queue_order/queued-hostile", gw.admin_url("/console/"), enc(TENANT), enc(PRINCIPAL)))
        .await
        .unwrap();
    b.wait_text("#scope-key", "queued-hostile").await;
    let request = b.text("#request-headers").await;
    assert!(request.contains(link) && request.contains(img), "{request}");
    assert!(request.contains("authorization") && request.contains("(masked: 15 bytes)"), "{request}");
    assert!(!b.client.source().await.unwrap().contains("test-key"), "the client's credential is never shown");
    assert_eq!(b.js("return window.__pwned === undefined").await, json!(true), "nothing ran");
    assert_eq!(b.js("return document.querySelectorAll('#view img, #view script, #view a, #view iframe').length").await, json!(0));
    b.close().await;
}

/// Events: a parked event with its last error, redelivered from the page;
/// the webhook then gets it, under the same event id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_events_show_their_error_and_are_redelivered() {
    let hook = support::webhook::Webhook::start().await;
    hook.answer(500);
    let events = format!(
        "events.url = \"{}\"\nevents.secret_env = \"{}\"\nevents.timeout = \"1s\"\nevents.max_attempts = 1",
        hook.url(),
        support::gateway::TEST_SECRET_ENV
    );
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.route(&events)).await;
    assert_eq!(post(&gw.url("/v1/orders"), "evented", ORDER, &[]).await.status, 201);
    assert!(
        eventually(Duration::from_secs(20), || async { store.event_stats().await.is_ok_and(|s| s.parked == 1) }).await,
        "the event is parked"
    );
    let id = hook.deliveries()[0].id.clone();
    let b = Browser::start().await;
    b.log_in(&gw, TOKEN).await;
    b.wait_text("#total-unknown", "unknown").await;
    b.click("#nav-events").await;
    let parked = b.wait_text("table.events", "evented").await;
    assert!(parked.contains(&id) && parked.contains("500"), "the parked event and its last error: {parked}");
    hook.answer(200);
    b.click("button.redeliver").await;
    b.wait_text("#events-out", "will be delivered again").await;
    b.close().await;
    assert!(
        eventually(Duration::from_secs(20), || async { store.event_stats().await.is_ok_and(|s| s.parked == 0 && s.pending == 0) }).await,
        "delivered"
    );
    let counts = hook.counts();
    assert_eq!((counts.len(), counts.get(&id)), (1, Some(&2)), "one event, delivered twice under its id: {counts:?}");
}

/// An async route whose upstream is down: its operations stay `queued`
/// (retried an hour later) with their stored request.
fn queued_route() -> String {
    format!(
        "[[upstreams]]\nname = \"down\"\nurl = \"http://{}\"\nconnect_timeout = \"300ms\"\ntimeout = \"1s\"\n\n\
         [[routes]]\noperation = \"queue_order\"\nmethod = \"POST\"\npath = \"/v1/queued\"\nupstream = \"down\"\n\
         mode = \"async\"\nretry.max_attempts = 10\nretry.backoff = \"1h\"\n",
        free_local_addr()
    )
}

/// Waits until the worker's first attempt failed and `key` is back in the queue.
async fn requeued(store: &idemgate::store::Store, key: &str) {
    let scope = scope_for(PRINCIPAL, "queue_order", key);
    let back = eventually(Duration::from_secs(20), || async {
        store.get(&scope).await.unwrap().is_some_and(|(r, _)| r.state == State::Queued && r.attempts == 1)
    })
    .await;
    assert!(back, "{key} is queued again after its first attempt");
}

fn base64_of(b: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(b)
}

// ---------- plain HTTP: headers, off without a token, the API additions ----------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_with_strict_headers() {
    let (_up, gw, _store, _dir) = setup(sqlite_backend(), |c| c).await;
    for (path, kind) in [("/console/", "text/html"), ("/console/console.js", "text/javascript"), ("/console/console.css", "text/css")] {
        let r = send("GET", &gw.admin_url(path), &[], "").await.unwrap();
        assert_eq!(r.status, 200, "{path}");
        assert!(r.header("content-type").unwrap().starts_with(kind), "{path}: {r:?}");
        assert_eq!(r.header("content-security-policy"), Some(CSP), "{path}");
        assert_eq!(r.header("x-frame-options"), Some("DENY"), "{path}");
        assert_eq!(r.header("x-content-type-options"), Some("nosniff"), "{path}");
        assert_eq!(r.header("referrer-policy"), Some("no-referrer"), "{path}");
        assert!(r.header("set-cookie").is_none());
    }
    let page = send("GET", &gw.admin_url("/console/"), &[], "").await.unwrap();
    let html = String::from_utf8_lossy(&page.body);
    assert!(html.contains(r#"<script src="console.js" defer></script>"#) && !html.contains("<style"), "no inline script or style");
    let r = send("GET", &gw.admin_url("/console"), &[], "").await.unwrap();
    assert_eq!((r.status, r.header("location")), (308, Some("/console/")));
    let r = send("GET", &gw.admin_url("/console/nothing.js"), &[], "").await.unwrap();
    assert_eq!((r.status, r.header("x-frame-options")), (404, Some("DENY")));
    assert_eq!(send("POST", &gw.admin_url("/console/"), &[], "").await.unwrap().status, 405);
    // The page itself needs no token; the data does.
    assert_eq!(send("GET", &gw.admin_url("/admin/overview"), &[], "").await.unwrap().status, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_admin_token_there_is_no_console() {
    let up = TestUpstream::start().await;
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    for path in ["/console/", "/console", "/console/console.js", "/console/console.css", "/admin/overview"] {
        let r = send("GET", &gw.admin_url(path), &[], "").await.unwrap();
        assert_eq!(r.status, 404, "{path}: {r:?}");
        assert!(!String::from_utf8_lossy(&r.body).contains("<script"), "{path}");
    }
    let unknown = send("GET", &gw.admin_url("/nothing"), &[], "").await.unwrap();
    let console = send("GET", &gw.admin_url("/console/"), &[], "").await.unwrap();
    assert_eq!((console.status, &console.body), (unknown.status, &unknown.body), "the same 404 as any unknown path");
}

/// `X-Idemgate-Actor`: `console` is audited as such, anything else is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_actor_header_is_validated() {
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.timeout("500ms").route("lease = \"1s\"")).await;
    unknown_record(&gw, &store, "a1").await;
    let auth = format!("Bearer {TOKEN}");
    let release = json!({ "action": "release", "reason": "checked" }).to_string();
    let path = gw.admin_url(&format!("{}/resolve", record_path("a1")));
    for bad in ["cli", "reconciler", "admin", "console2"] {
        let r = send("POST", &path, &[("authorization", &auth), ("x-idemgate-actor", bad)], release.clone()).await.unwrap();
        assert_eq!((r.status, r.problem().as_str()), (400, "invalid-request"), "{bad}");
    }
    assert_eq!(settled_record(&store, "a1").await.unwrap().state, State::Unknown);
    let r = send("POST", &path, &[("authorization", &auth), ("x-idemgate-actor", "console")], release.clone()).await.unwrap();
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(store.audit(1).await.unwrap()[0].actor, "console");
    // Without the header: the plain API, as before.
    unknown_record(&gw, &store, "a2").await;
    let r = admin(&gw, "POST", &format!("{}/resolve", record_path("a2")), &release).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(store.audit(1).await.unwrap()[0].actor, "admin");
}

/// `GET /admin/overview` counts as the `idemgate_records` gauge does;
/// `GET .../inspect` carries the body, the stored request (masked) and the
/// scope's audit rows; the list filters by key prefix and age with cursors.
async fn the_admin_api_endpoints_the_console_reads(backend: Backend) {
    let queued_route = queued_route();
    let (_up, gw, store, _dir) = setup(backend, |c| c.timeout("500ms").route("lease = \"1s\"").tail(&queued_route)).await;
    for i in 0..7 {
        assert_eq!(post(&gw.url("/v1/orders"), &format!("keep-{i}"), ORDER, &[]).await.status, 201);
    }
    for i in 0..3 {
        assert_eq!(post(&gw.url("/v1/orders"), &format!("other-{i}"), ORDER, &[]).await.status, 201);
    }
    unknown_record(&gw, &store, "lost-1").await;
    unknown_record(&gw, &store, "lost-2").await;
    assert_eq!(post(&gw.url("/v1/queued"), "q1", ORDER, &[]).await.status, 202);
    requeued(&store, "q1").await;

    let doc = admin(&gw, "GET", "/admin/overview", "").await.json();
    assert_eq!(doc["totals"]["unknown"], 2, "{doc}");
    assert_eq!(doc["totals"]["queued"], 1, "{doc}");
    assert!(doc["totals"].get("completed").is_none(), "as the gauge: every state but completed");
    assert_eq!(doc["unknown_by_age"][0], json!({ "age": "under 5 minutes", "count": 2 }));
    let buckets: Vec<i64> = doc["unknown_by_age"].as_array().unwrap().iter().map(|b| b["count"].as_i64().unwrap()).collect();
    assert_eq!(buckets, vec![2, 0, 0, 0], "{doc}");
    assert_eq!(doc["async"]["queued"], 1);
    assert!(doc["async"]["oldest_queued_age_seconds"].as_f64().is_some());
    assert_eq!(doc["events"]["parked"], 0);
    assert_eq!(doc["this_replica"], json!({ "refused_reloads": 0, "fenced_writes": 0 }));
    // Each upstream's adaptive limit (it starts at 10; the timeouts and
    // refused connections above brought it down), and no refusal.
    let upstreams = doc["upstreams"].as_array().expect("upstreams");
    let names: Vec<&str> = upstreams.iter().filter_map(|u| u["upstream"].as_str()).collect();
    assert_eq!(names, ["orders", "down"], "{doc}");
    for u in upstreams {
        assert!(u["limit"].as_i64().is_some_and(|l| (1..10).contains(&l)), "{u}");
        assert_eq!((&u["in_flight"], &u["refusals"]), (&json!(0), &json!(0)), "{u}");
    }
    let rows: Vec<(String, String, i64)> = doc["records"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["operation"].as_str().unwrap().into(), r["state"].as_str().unwrap().into(), r["count"].as_i64().unwrap()))
        .collect();
    assert!(rows.contains(&("create_order".into(), "unknown".into(), 2)), "{rows:?}");
    // The same numbers as the gauge.
    let metrics = String::from_utf8_lossy(&send("GET", &gw.admin_url("/metrics"), &[], "").await.unwrap().body).into_owned();
    assert!(
        eventually(Duration::from_secs(20), || {
            let url = gw.admin_url("/metrics");
            async move {
                let m = String::from_utf8_lossy(&send("GET", &url, &[], "").await.unwrap().body).into_owned();
                m.contains(r#"idemgate_records{operation="create_order",state="unknown"} 2"#)
            }
        })
        .await,
        "{metrics}"
    );

    // inspect: the queued operation's stored request, masked.
    let q = admin(&gw, "GET", &format!("/admin/records/{}/{}/queue_order/q1/inspect", enc(TENANT), enc(PRINCIPAL)), "").await;
    assert_eq!(q.status, 200, "{q:?}");
    let qd = q.json();
    assert_eq!((qd["request"]["method"].as_str(), qd["request"]["path"].as_str()), (Some("POST"), Some("/v1/queued")));
    let headers = qd["request"]["headers"].as_array().unwrap();
    assert!(headers.contains(&json!(["authorization", "(masked: 15 bytes)"])), "{headers:?}");
    assert!(!q.body.windows(8).any(|w| w == b"test-key"), "the credential is never in the answer");
    assert_eq!(qd["request"]["body_bytes"], ORDER.len());
    // Refused before anything was sent: it cannot have executed.
    assert_eq!(qd["may_have_executed"], "no", "{qd}");
    // A timed-out synchronous request: unknown, so it may well have executed,
    // and a synchronous record keeps no send time.
    let lost = admin(&gw, "GET", &format!("{}/inspect", record_path("lost-2")), "").await.json();
    assert_eq!(lost["record"]["state"], "unknown", "{lost}");
    assert!(lost["may_have_executed"].as_str().is_some_and(|s| s.starts_with("yes")), "{lost}");
    assert_eq!(lost["sent_at_shown"], "not recorded for synchronous requests", "{lost}");
    // inspect: a completed record's body, and its audit rows.
    let resolve = json!({ "action": "complete", "status": 201, "reason": "by hand", "body_base64": base64_of(b"<b>done</b>") });
    assert_eq!(admin(&gw, "POST", &format!("{}/resolve", record_path("lost-1")), &resolve.to_string()).await.status, 200);
    let d = admin(&gw, "GET", &format!("{}/inspect", record_path("lost-1")), "").await.json();
    assert_eq!(d["record"]["state"], "completed");
    assert_eq!(d["record"]["response"]["body"], json!({ "text": "<b>done</b>", "bytes": 11, "truncated": false }));
    assert_eq!(d["audit"].as_array().unwrap().len(), 1);
    assert_eq!(d["audit"][0]["reason"], "by hand");
    assert_eq!(d["probe"]["attempts"], 0);
    assert_eq!(admin(&gw, "GET", &format!("{}/inspect", record_path("nobody")), "").await.status, 404);
    // The plain record endpoint still carries no body.
    assert!(admin(&gw, "GET", &record_path("lost-1"), "").await.json()["response"].get("body").is_none());

    // key_prefix with cursors: 7 "keep-" records in pages of 3.
    let mut seen = Vec::new();
    let mut path = "/admin/records?key_prefix=keep-&limit=3".to_owned();
    for _ in 0..10 {
        let doc = admin(&gw, "GET", &path, "").await.json();
        for r in doc["records"].as_array().unwrap() {
            seen.push(r["key"].as_str().unwrap().to_owned());
        }
        match doc["next_cursor"].as_str() {
            Some(c) => path = format!("/admin/records?key_prefix=keep-&limit=3&cursor={}", enc(c)),
            None => break,
        }
    }
    seen.sort();
    assert_eq!(seen, (0..7).map(|i| format!("keep-{i}")).collect::<Vec<_>>());
    let doc = admin(&gw, "GET", "/admin/records?older_than=1h", "").await.json();
    assert_eq!(doc["records"].as_array().unwrap().len(), 0, "nothing is an hour old");
    let doc = admin(&gw, "GET", "/admin/records?older_than=0s&state=unknown", "").await.json();
    assert_eq!(doc["records"].as_array().unwrap().len(), 1);
    assert_eq!(admin(&gw, "GET", "/admin/records?older_than=soon", "").await.status, 400);
}

/// A probed route keeps the request line (its probe needs a path
/// parameter); a probe that answers neither found nor absent leaves the
/// record unknown, and the record page shows how often and what it said.
async fn an_inconclusive_probe_shows_its_last_answer_and_the_request_line(backend: Backend) {
    let route = "[[routes]]\noperation = \"account_order\"\nmethod = \"POST\"\npath = \"/v1/accounts/{account}/orders\"\n\
                 upstream = \"orders\"\nlease = \"1s\"\n[routes.reconcile]\n\
                 probe = \"GET /v1/accounts/{account}/orders/by-key/{derived_key}\"\nsettle = \"300ms\"\ninterval = \"100ms\"";
    let (up, gw, store, _dir) = setup(backend, |c| c.timeout("500ms").tail(route)).await;
    up.set_probe_status(Some(503));
    let r = post(&gw.url("/v1/accounts/ac-7/orders"), "k5", ORDER, &[("x-test-sleep-ms", "900")]).await;
    assert_eq!(r.status, 504, "{r:?}");
    let path = format!("/admin/records/{}/{}/account_order/k5/inspect", enc(TENANT), enc(PRINCIPAL));
    let probed = eventually(Duration::from_secs(20), || {
        let (gw, path) = (&gw, &path);
        async move { admin(gw, "GET", path, "").await.json()["probe"]["attempts"].as_i64().is_some_and(|n| n >= 1) }
    })
    .await;
    assert!(probed, "{}", gw.logs());
    let doc = admin(&gw, "GET", &path, "").await.json();
    assert_eq!(doc["record"]["state"], "unknown", "{doc}");
    let answer = doc["probe"]["last_answer"].as_str().unwrap_or_default();
    assert!(answer.contains("answered 503") && answer.contains("neither found nor absent"), "{doc}");
    assert!(doc["probe"]["next_probe_at"].is_string(), "{doc}");
    assert_eq!((doc["request"]["method"].as_str(), doc["request"]["path"].as_str()), (Some("POST"), Some("/v1/accounts/ac-7/orders")));
    assert_eq!(doc["request"]["headers_stored"], false, "a sync record keeps the request line only");
    assert!(up.probes_of(&scope_for(PRINCIPAL, "account_order", "k5").derived_key(Some(TEST_SECRET.as_bytes()))) >= 1);
    assert_eq!(up.total(), 1, "the write ran once; probes are reads");
    assert_eq!(store.get(&scope_for(PRINCIPAL, "account_order", "k5")).await.unwrap().unwrap().0.state, State::Unknown);
}

/// A credential an identity source reads from a header of its own naming
/// (here `x-client-id`, not a credential by its name alone) is masked in the
/// stored request the record page shows, like `Authorization`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_credential_header_is_masked_on_the_record_page() {
    let key_hash = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(support::gateway::API_KEY.as_bytes()));
    let sources = format!(
        "[[identity.sources]]\nkind = \"api_key\"\nheader = \"x-client-id\"\n\
         keys = [ {{ sha256 = \"{key_hash}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n"
    );
    let queued_route = queued_route();
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.identity(&sources).tail(&queued_route)).await;
    let r = send(
        "POST",
        &gw.url("/v1/queued"),
        &[("x-client-id", support::gateway::API_KEY), ("content-type", "application/json"), ("idempotency-key", "q1")],
        ORDER.to_owned(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 202, "{r:?}");
    requeued(&store, "q1").await;
    let q = admin(&gw, "GET", &format!("/admin/records/{}/{}/queue_order/q1/inspect", enc(TENANT), enc(PRINCIPAL)), "").await;
    assert_eq!(q.status, 200, "{q:?}");
    let headers = q.json()["request"]["headers"].as_array().unwrap().clone();
    assert!(headers.contains(&json!(["x-client-id", "(masked: 8 bytes)"])), "{headers:?}");
    assert!(!q.body.windows(8).any(|w| w == support::gateway::API_KEY.as_bytes()), "the credential is never in the answer");
}

/// Query parameters with credential names (`access_token`, `api_key`,
/// `signature`...) and those listed in `[admin] masked_query_params` are
/// masked in the stored request the record page shows; other parameters are
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_query_parameters_are_masked_on_the_record_page() {
    let queued_route = queued_route();
    let (_up, gw, store, _dir) = setup(sqlite_backend(), |c| c.admin("masked_query_params = [\"ticket\"]").tail(&queued_route)).await;
    let target = "/v1/queued?access_token=SEKRIT-TOKEN-1&page=2&ticket=SEKRIT-TICKET&X-Amz-Signature=SEKRIT-SIG";
    let r = post(&gw.url(target), "q1", ORDER, &[]).await;
    assert_eq!(r.status, 202, "{r:?}");
    requeued(&store, "q1").await;
    let q = admin(&gw, "GET", &format!("/admin/records/{}/{}/queue_order/q1/inspect", enc(TENANT), enc(PRINCIPAL)), "").await;
    assert_eq!(q.status, 200, "{q:?}");
    assert_eq!(
        q.json()["request"]["path"].as_str(),
        Some("/v1/queued?access_token=(masked: 14 bytes)&page=2&ticket=(masked: 13 bytes)&X-Amz-Signature=(masked: 10 bytes)")
    );
    assert!(!String::from_utf8_lossy(&q.body).contains("SEKRIT"), "no credential in the answer: {:?}", q.body);
}
