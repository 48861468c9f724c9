//! Live revocation (SIGHUP and `idemgate reload`) through the real binary:
//! a removed API key gets 401 from its very next request (on a keep-alive
//! connection opened before the reload too) and never the stored answer,
//! while a still-valid principal's replay works and the upstream executed
//! once; routes and upstreams reload with identity; an invalid file is
//! refused and the configuration in force keeps serving; `idemgate reload`
//! validates before it signals; `serve --pid-file` writes and removes its pid.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use support::*;

const ORDER: &str = r#"{"item":"book","qty":1}"#;

/// The harness's identity with only the second API key ("other-key").
fn only_other_key() -> String {
    format!(
        "[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{}\", tenant = \"{TENANT}\", principal = \"other\" }} ]\n",
        hex::encode(Sha256::digest(b"other-key"))
    )
}

fn order_headers<'a>(token: &'a str, key: &'a str) -> Vec<(&'static str, String)> {
    vec![("authorization", format!("Bearer {token}")), ("content-type", "application/json".into()), ("idempotency-key", key.into())]
}

async fn post_as(gw: &Gateway, token: &str, key: &str) -> Resp {
    let h = order_headers(token, key);
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    send("POST", &gw.url("/v1/orders"), &h, ORDER).await.expect("gateway answers")
}

/// `idemgate_config_reloads_total{result}` as the admin listener reports it.
async fn reloads(gw: &Gateway, result: &str) -> u64 {
    let text = send("GET", &gw.admin_url("/metrics"), &[], "").await.expect("metrics").body;
    let needle = format!("idemgate_config_reloads_total{{result=\"{result}\"}} ");
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&needle).and_then(|v| v.trim().parse().ok()))
        .expect("the reload counter is exported")
}

async fn wait_reloads(gw: &Gateway, result: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while reloads(gw, result).await < n {
        assert!(Instant::now() < deadline, "no {result} reload counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn reload_cli(gw: &Gateway, pid_file: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["reload", "--config"])
        .arg(gw.config_path())
        .arg("--pid-file")
        .arg(pid_file)
        .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
        .output()
        .expect("run idemgate reload")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_api_key_is_refused_from_its_next_request_and_never_replayed() {
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    let store = gw.config.backend.open().await;

    // Both principals complete a request.
    let first = post_as(&gw, "test-key", "k-revoked").await;
    assert_eq!(first.status, 201);
    let other = post_as(&gw, "other-key", "k-kept").await;
    assert_eq!(other.status, 201);
    assert_eq!(up.total(), 2);

    // A keep-alive connection opened before the reload.
    let stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut conn, driver) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.unwrap();
    tokio::spawn(driver);
    let on_conn = |key: &'static str| {
        let mut b = Request::post(format!("http://{}/v1/orders", gw.addr))
            .header("host", gw.addr.to_string())
            .header("authorization", "Bearer test-key")
            .header("content-type", "application/json");
        b = b.header("idempotency-key", key);
        b.body(Full::new(Bytes::from_static(ORDER.as_bytes()))).unwrap()
    };
    let before = conn.send_request(on_conn("k-revoked")).await.unwrap();
    assert_eq!(before.status(), 201, "a replay before the reload");
    assert_eq!(before.headers().get("idempotent-replayed").map(|v| v.to_str().unwrap()), Some("true"));
    let _ = before.into_body().collect().await;

    // Revoke "test-key": a new file, then `idemgate reload` (pid file) sends SIGHUP.
    gw.config = gw.config.clone().identity(&only_other_key());
    std::fs::write(gw.config_path(), gw.config.toml()).unwrap();
    let pid_file = gw.dir().join("idemgate.pid");
    std::fs::write(&pid_file, format!("{}\n", gw.pid())).unwrap();
    let out = reload_cli(&gw, &pid_file);
    assert!(out.status.success(), "reload: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("sent SIGHUP to process {}", gw.pid())));
    wait_reloads(&gw, "applied", 1).await;

    // The very next request of the revoked key, on the old connection and a new one: 401, no stored body.
    let after = conn.send_request(on_conn("k-revoked")).await.unwrap();
    assert_eq!(after.status(), 401, "the old keep-alive connection sees the reload");
    let body = after.into_body().collect().await.unwrap().to_bytes();
    assert!(!String::from_utf8_lossy(&body).contains("book"), "never the stored answer");
    let fresh = post_as(&gw, "test-key", "k-revoked").await;
    assert_eq!(fresh.status, 401);
    assert!(!fresh.replayed());
    let new_key = post_as(&gw, "test-key", "k-new").await;
    assert_eq!(new_key.status, 401, "nothing new either");
    assert_eq!(store.get(&scope("k-new")).await.unwrap(), None, "a refused request claims nothing");

    // The principal that kept its key still gets its replay; the upstream executed each once.
    let kept = post_as(&gw, "other-key", "k-kept").await;
    assert_eq!((kept.status, kept.replayed()), (201, true));
    assert_eq!(kept.body, other.body);
    assert_eq!(up.total(), 2);
    let revoked = store.get(&scope("k-revoked")).await.unwrap().expect("the revoked principal's record stays").0;
    assert_eq!(revoked.state, idemgate::idempotency::record::State::Completed);
    assert_eq!(gw.log_count("configuration reloaded"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_file_is_refused_and_the_configuration_in_force_stays() {
    let up = TestUpstream::start().await;
    let mut gw = Gateway::start(GatewayConfig::new(sqlite_backend(), up.url()));
    assert_eq!(post_as(&gw, "test-key", "k1").await.status, 201);

    // `idemgate reload` refuses an invalid file itself: nothing is sent.
    let good = gw.config.toml();
    let bad = good.replace("[[routes]]\noperation = \"create_order\"", "[[routes]]\noperation = \"create_order\"\nretention = \"soon\"");
    assert_ne!(bad, good);
    std::fs::write(gw.config_path(), &bad).unwrap();
    let pid_file = gw.dir().join("idemgate.pid");
    std::fs::write(&pid_file, format!("{}\n", gw.pid())).unwrap();
    let out = reload_cli(&gw, &pid_file);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("idemgate.toml") && err.contains("routes[0].retention"), "names the file and the path: {err}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!((reloads(&gw, "applied").await, reloads(&gw, "refused").await), (0, 0), "nothing was signalled");

    // A SIGHUP sent some other way (kill -HUP) with the same bad file: refused, logged, still serving.
    gw.signal("HUP");
    wait_reloads(&gw, "refused", 1).await;
    // The counter moves before the warning reaches the log file: wait for it.
    assert!(eventually(Duration::from_secs(5), || async { gw.log_count("reload refused") >= 1 }).await, "{}", gw.logs());
    assert_eq!(gw.log_count("reload refused"), 1, "one refusal, logged once");
    let replay = post_as(&gw, "test-key", "k1").await;
    assert_eq!((replay.status, replay.replayed()), (201, true));
    assert_eq!(post_as(&gw, "test-key", "k2").await.status, 201);
    assert_eq!(up.total(), 2);

    // Fixed, and a route added: applied; the new route is idempotent from its first request.
    gw.config = gw
        .config
        .clone()
        .tail("[[routes]]\noperation = \"create_refund\"\nmethod = \"POST\"\npath = \"/v1/refunds\"\nupstream = \"orders\"\n");
    std::fs::write(gw.config_path(), gw.config.toml()).unwrap();
    gw.signal("HUP");
    wait_reloads(&gw, "applied", 1).await;
    let h = order_headers("test-key", "r1");
    let h: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let refund = send("POST", &gw.url("/v1/refunds"), &h, ORDER).await.unwrap();
    assert_eq!((refund.status, refund.replayed()), (201, false));
    let again = send("POST", &gw.url("/v1/refunds"), &h, ORDER).await.unwrap();
    assert_eq!((again.status, again.replayed()), (201, true));
    assert_eq!(up.total(), 3);
    let store = gw.config.backend.open().await;
    assert!(store.get(&scope_for(PRINCIPAL, "create_refund", "r1")).await.unwrap().is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstreams_reload_and_restart_only_sections_are_kept() {
    let (old_up, new_up) = (TestUpstream::start().await, TestUpstream::start().await);
    let gw = Gateway::start(GatewayConfig::new(sqlite_backend(), old_up.url()));
    assert_eq!(post_as(&gw, "test-key", "u1").await.status, 201);

    // The upstream's URL changes, and so does [server] (which needs a restart).
    let mut next = gw.config.clone().server("access_log = false");
    next.upstream_url = new_up.url();
    std::fs::write(gw.config_path(), next.toml()).unwrap();
    gw.signal("HUP");
    wait_reloads(&gw, "applied", 1).await;
    assert_eq!(post_as(&gw, "test-key", "u2").await.status, 201);
    let replay = post_as(&gw, "test-key", "u1").await;
    assert!(replay.replayed(), "records made before the reload replay after it");
    assert_eq!((old_up.total(), new_up.total()), (1, 1), "the new request went to the new upstream");
    assert!(gw.logs().contains("need a restart"), "the changed [server] section is named in the log");
    // ... and was kept: the access log is still written.
    let lines = gw.log_count("idemgate::access");
    post_as(&gw, "test-key", "u3").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while gw.log_count("idemgate::access") == lines {
        assert!(Instant::now() < deadline, "the access log stayed on");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_writes_its_pid_file_and_removes_it_on_exit() {
    let up = TestUpstream::start().await;
    let cfg = GatewayConfig::new(sqlite_backend(), up.url());
    let dir = tempfile::tempdir().unwrap();
    let (config, pid_file) = (dir.path().join("idemgate.toml"), dir.path().join("run").join("idemgate.pid"));
    std::fs::create_dir_all(pid_file.parent().unwrap()).unwrap();
    std::fs::write(&config, cfg.toml()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(&config)
        .arg("--pid-file")
        .arg(&pid_file)
        .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pid_file.exists() {
        assert!(Instant::now() < deadline, "no pid file written");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(std::fs::read_to_string(&pid_file).unwrap().trim(), child.id().to_string());
    assert!(Command::new("kill").arg("-TERM").arg(child.id().to_string()).status().unwrap().success());
    let status = tokio::task::block_in_place(|| child.wait()).unwrap();
    assert!(status.success(), "drained and exited: {status:?}");
    assert!(!pid_file.exists(), "removed on exit");

    // A pid file that does not hold a pid is refused without signalling anything.
    let reload = || {
        Command::new(env!("CARGO_BIN_EXE_idemgate"))
            .args(["reload", "--config"])
            .arg(&config)
            .arg("--pid-file")
            .arg(&pid_file)
            .env(support::gateway::TEST_SECRET_ENV, TEST_SECRET)
            .output()
            .unwrap()
    };
    std::fs::write(&pid_file, "-1\n").unwrap();
    let out = reload();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not a process id"));

    // A stale pid file (the gateway was killed) naming another program's
    // process: refused, and that process lives on.
    let mut bystander = Command::new("sleep").arg("30").spawn().unwrap();
    std::fs::write(&pid_file, format!("{}\n", bystander.id())).unwrap();
    let out = reload();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("stale") && stderr.contains("\"sleep\""), "{stderr}");
    assert!(bystander.try_wait().unwrap().is_none(), "the other process was not signalled");
    bystander.kill().unwrap();
    bystander.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwt_key_removed_from_the_jwks_file_is_refused_after_sighup() {
    use support::jwt;
    let up = TestUpstream::start().await;
    let (old_key, new_key) = (jwt::rs256("old"), jwt::rs256("new"));
    let dir = tempfile::tempdir().unwrap();
    let jwks = dir.path().join("jwks.json");
    std::fs::write(&jwks, jwt::jwks(&[&old_key, &new_key]).to_string()).unwrap();
    let cfg = GatewayConfig::new(sqlite_backend(), up.url()).identity(&format!(
        "[[identity.sources]]\nkind = \"jwt\"\njwks_file = \"{}\"\nissuer = \"iss\"\naudience = \"aud\"\n",
        jwks.display()
    ));
    let gw = Gateway::start(cfg);
    let claims = jwt::claims(TENANT, PRINCIPAL, "iss", "aud");
    let (old_token, new_token) = (jwt::token(&old_key, &claims), jwt::token(&new_key, &claims));
    assert_eq!(post_as(&gw, &old_token, "j1").await.status, 201);
    let replay = post_as(&gw, &new_token, "j1").await;
    assert_eq!((replay.status, replay.replayed()), (201, true), "the same principal under the other key");

    // The old key leaves the file; SIGHUP re-reads it.
    std::fs::write(&jwks, jwt::jwks(&[&new_key]).to_string()).unwrap();
    gw.signal("HUP");
    wait_reloads(&gw, "applied", 1).await;
    let refused = post_as(&gw, &old_token, "j1").await;
    assert_eq!(refused.status, 401);
    assert!(!refused.replayed());
    assert!(!String::from_utf8_lossy(&refused.body).contains(&old_token), "the problem never echoes the token");
    let still = post_as(&gw, &new_token, "j1").await;
    assert_eq!((still.status, still.replayed()), (201, true));
    assert_eq!(up.total(), 1);
}

/// Background work follows the configuration in force: an async route added
/// by SIGHUP is served by the workers (not only accepted by the front).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_route_added_by_a_reload_is_run_by_the_workers() {
    let up = TestUpstream::start().await;
    let backend = sqlite_backend();
    let gw = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    assert_eq!(post_as(&gw, "test-key", "sync-1").await.status, 201);
    let next = gw.config.clone().route("mode = \"async\"");
    std::fs::write(gw.config_path(), next.toml()).unwrap();
    gw.signal("HUP");
    wait_reloads(&gw, "applied", 1).await;
    let accepted = post_as(&gw, "test-key", "async-1").await;
    assert_eq!(accepted.status, 202, "{accepted:?}");
    let store = backend.open().await;
    let done = eventually(Duration::from_secs(15), || async {
        settled_record(&store, "async-1").await.is_some_and(|r| r.state == idemgate::idempotency::record::State::Completed)
    })
    .await;
    assert!(done, "accepted after the reload but never run: {:?}\n{}", record(&store, "async-1").await, gw.logs());
    assert_eq!(up.side_effects(&derived("async-1")), 1);
}

/// A reload that removes `allow_async` while an operation it accepted waits
/// in the queue (its first attempt answered 503, a `release_on_status`):
/// the workers still run it, with the default queueing settings, instead
/// of leaving it queued for good with its client polling forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_accepted_before_a_reload_removed_allow_async_still_runs() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let cfg = |extra: &str| GatewayConfig::new(backend.clone(), up.url()).route(&format!("release_on_status = [503]\n{extra}"));
    let mut gw = Gateway::start(cfg("allow_async = true\nretry.backoff = \"2s\""));
    let accepted = post(&gw.url("/v1/orders"), "queued", ORDER, &[("prefer", "respond-async"), ("x-test-status", "503")]).await;
    assert_eq!(accepted.status, 202);
    let store = backend.open().await;
    let requeued = eventually(Duration::from_secs(10), || async {
        record(&store, "queued").await.is_some_and(|r| r.state == idemgate::idempotency::record::State::Queued && r.attempts == 1)
    })
    .await;
    assert!(requeued, "{:?}\n{}", record(&store, "queued").await, gw.logs());
    assert_eq!(up.total(), 1);
    tokio::task::block_in_place(|| gw.reload(cfg(""), Duration::from_secs(10))).expect("the reload is applied");
    let ran = eventually(Duration::from_secs(15), || async { up.total() >= 2 }).await;
    assert!(ran, "never run after the reload: {:?}\n{}", record(&store, "queued").await, gw.logs());
    assert!(record(&store, "queued").await.is_some_and(|r| r.attempts >= 2));
}

/// `upstream_idempotent` turned off by a reload: from then on, an attempt
/// whose lease runs out after it was sent is never sent again (it becomes
/// unknown), even by a replica that started while the route said otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_idempotent_turned_off_by_a_reload_stops_re_forwarding() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let cfg = |idempotent: bool| {
        GatewayConfig::new(backend.clone(), up.url())
            .timeout("10s")
            .route(&format!("mode = \"async\"\nlease = \"3s\"\nupstream_idempotent = {idempotent}"))
            .tail("[workers]\ncount = 1")
    };
    let a = Gateway::start(cfg(false));
    let store = backend.open().await;
    let mut received = up.subscribe();
    let accepted = post(&a.url("/v1/orders"), "flip", ORDER, &[("x-test-sleep-ms", "6000")]).await;
    assert_eq!(accepted.status, 202);
    received.recv().await.unwrap();
    a.signal("STOP");
    // B starts believing the upstream deduplicates, then learns otherwise
    // before A's lease runs out.
    let b = Gateway::start(cfg(true));
    std::fs::write(b.config_path(), cfg(false).toml()).unwrap();
    b.signal("HUP");
    wait_reloads(&b, "applied", 1).await;
    let unknown = eventually(Duration::from_secs(15), || async {
        record(&store, "flip").await.is_some_and(|r| r.state == idemgate::idempotency::record::State::Unknown)
    })
    .await;
    assert!(unknown, "{:?}\n{}", record(&store, "flip").await, b.logs());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(up.total(), 1, "sent once: the reload said the upstream does not deduplicate\n{}", b.logs());
    a.signal("CONT");
}

/// The admin listener follows the configuration in force as the proxy does:
/// after a reload that adds a route and an identity source, a hand-made
/// completion of the new route's record keeps it for that route's retention
/// (not the day of a route the admin API never heard of), and the record
/// page masks the credential header the new source reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_and_the_console_follow_a_reload() {
    const TOKEN: &str = "reload-admin-token";
    const CLIENT_KEY: &str = "client-key-9";
    let (_up, mut gw, store, _dir) = support::admin::setup(sqlite_backend(), TOKEN, |c| c.timeout("500ms").route("lease = \"1s\"")).await;

    // The reload: a sync route kept 30 days, an async route whose upstream
    // is down (its operations stay queued with their stored request), and
    // a second API key source reading `x-client-id`.
    let down = support::gateway::free_local_addr();
    let sources = format!(
        "[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n\n\
         [[identity.sources]]\nkind = \"api_key\"\nheader = \"x-client-id\"\n\
         keys = [ {{ sha256 = \"{}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n",
        hex::encode(Sha256::digest(support::gateway::API_KEY.as_bytes())),
        hex::encode(Sha256::digest(CLIENT_KEY.as_bytes())),
    );
    let next = gw.config.clone().identity(&sources).tail(&format!(
        "[[routes]]\noperation = \"create_refund\"\nmethod = \"POST\"\npath = \"/v1/refunds\"\nupstream = \"orders\"\n\
         lease = \"1s\"\nretention = \"30d\"\n\n\
         [[upstreams]]\nname = \"down\"\nurl = \"http://{down}\"\nconnect_timeout = \"300ms\"\ntimeout = \"1s\"\n\n\
         [[routes]]\noperation = \"queue_order\"\nmethod = \"POST\"\npath = \"/v1/queued\"\nupstream = \"down\"\n\
         mode = \"async\"\nretry.max_attempts = 10\nretry.backoff = \"1h\"\n"
    ));
    tokio::task::block_in_place(|| gw.reload(next, Duration::from_secs(10))).expect("the reload is applied");

    // A refund the upstream executed after the gateway gave up: unknown.
    let r = send(
        "POST",
        &gw.url("/v1/refunds"),
        &[
            ("authorization", "Bearer test-key"),
            ("content-type", "application/json"),
            ("idempotency-key", "r1"),
            ("x-test-sleep-ms", "900"),
        ],
        ORDER,
    )
    .await
    .unwrap();
    assert_eq!((r.status, r.problem().as_str()), (504, "outcome-unknown"), "{r:?}");
    let refund = scope_for(PRINCIPAL, "create_refund", "r1");
    let unknown = eventually(Duration::from_secs(5), || async {
        store.get(&refund).await.unwrap().is_some_and(|(r, _)| r.state == idemgate::idempotency::record::State::Unknown)
    })
    .await;
    assert!(unknown, "the refund's record is unknown");

    // Completed by hand without a retention: the new route's 30 days.
    let resolve = support::admin::request(
        &gw,
        "POST",
        &format!("{}/resolve", support::admin::record_path(TENANT, PRINCIPAL, "create_refund", "r1")),
        Some(TOKEN),
        r#"{"action":"complete","status":201,"reason":"the ledger shows the refund"}"#,
    )
    .await;
    assert_eq!(resolve.status, 200, "{resolve:?}");
    let (done, _) = store.get(&refund).await.unwrap().expect("the record stays");
    assert_eq!(done.state, idemgate::idempotency::record::State::Completed);
    let kept = Duration::from_micros(u64::try_from(done.expires_at.0 - done.updated_at.0).unwrap_or(0));
    assert!(kept > Duration::from_secs(29 * 24 * 3600), "kept for the new route's retention, not a day: {kept:?}");

    // An operation sent with the new source's credential: masked on the record page.
    let q = send(
        "POST",
        &gw.url("/v1/queued"),
        &[("x-client-id", CLIENT_KEY), ("content-type", "application/json"), ("idempotency-key", "q1")],
        ORDER,
    )
    .await
    .unwrap();
    assert_eq!(q.status, 202, "{q:?}");
    let page = support::admin::request(
        &gw,
        "GET",
        &format!("{}/inspect", support::admin::record_path(TENANT, PRINCIPAL, "queue_order", "q1")),
        Some(TOKEN),
        "",
    )
    .await;
    assert_eq!(page.status, 200, "{page:?}");
    let headers = page.json()["request"]["headers"].as_array().cloned().unwrap_or_default();
    assert!(headers.contains(&serde_json::json!(["x-client-id", "(masked: 12 bytes)"])), "{headers:?}");
    assert!(!page.body.windows(CLIENT_KEY.len()).any(|w| w == CLIENT_KEY.as_bytes()), "the credential is never in the answer");
}

/// A reload keeps each upstream's concurrency limit and the slots held
/// under it: with `max_in_flight = 1` and a slow request in flight, a
/// reload (the same file) must not hand out a second slot beside it, and a
/// reload that raises the limit lets one more through at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_slots_held_under_an_upstreams_limit() {
    let up = TestUpstream::start().await;
    let config = GatewayConfig::new(sqlite_backend(), up.url()).timeout("10s").upstream("max_in_flight = 1\nqueue_timeout = \"0s\"");
    let mut gw = Gateway::start(config);
    let slow = {
        let url = gw.url("/v1/orders");
        tokio::spawn(async move {
            let h = [
                ("authorization", "Bearer test-key"),
                ("content-type", "application/json"),
                ("idempotency-key", "slow"),
                ("x-test-sleep-ms", "3000"),
            ];
            send("POST", &url, &h, ORDER).await.expect("gateway answers")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while up.total() == 0 {
        assert!(Instant::now() < deadline, "the slow request never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let same = gw.config.clone();
    tokio::task::block_in_place(|| gw.reload(same, Duration::from_secs(10))).expect("the reload is applied");
    let beside = post_as(&gw, "test-key", "beside").await;
    assert_eq!(beside.status, 503, "a second request went beside the one in flight after a reload: {:?}", beside.body);
    assert_eq!(up.total(), 1, "the upstream ran two at once under max_in_flight = 1");
    // Raised to two: one more goes at once, beside the slow one.
    let mut raised = gw.config.clone();
    raised.upstream_extra = "max_in_flight = 2\nqueue_timeout = \"0s\"\n".into();
    tokio::task::block_in_place(|| gw.reload(raised, Duration::from_secs(10))).expect("the reload is applied");
    assert_eq!(post_as(&gw, "test-key", "second").await.status, 201);
    assert_eq!(slow.await.expect("slow").status, 201);
    assert_eq!(up.total(), 2);
}

/// A reload that changes a route's fingerprint settings (here: a field
/// left out from now on) changes what an identical request fingerprints
/// as. A retry of a request recorded before it is still recognised (under
/// the settings it was recorded with) and replayed, not refused as a
/// changed request with the advice to use a new key; a request that
/// differs under those settings too is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_is_recognised_after_a_reload_changed_the_fingerprint_settings() {
    for backend in [sqlite_backend(), postgres_backend()] {
        let up = TestUpstream::start().await;
        let cfg = |extra: &str| GatewayConfig::new(backend.clone(), up.url()).route(extra);
        let mut gw = Gateway::start(cfg(""));
        let url = gw.url("/v1/orders");
        const TRACED: &str = r#"{"item":"book","qty":1,"trace_id":"t-1"}"#;
        let first = post(&url, "fp", TRACED, &[]).await;
        assert_eq!(first.status, 201);
        let store = backend.open().await;
        assert!(settled_record(&store, "fp").await.is_some_and(|r| r.state == idemgate::idempotency::record::State::Completed));
        tokio::task::block_in_place(|| gw.reload(cfg("fingerprint.exclude = [\"/trace_id\"]"), Duration::from_secs(10))).expect("reloaded");
        let retry = post(&url, "fp", TRACED, &[]).await;
        assert_eq!((retry.status, retry.replayed(), &retry.body), (201, true, &first.body), "{}", gw.logs());
        let changed = post(&url, "fp", r#"{"item":"pen","qty":1,"trace_id":"t-1"}"#, &[]).await;
        assert_eq!((changed.status, changed.problem().as_str()), (409, "idempotency-key-reused"));
        // A request made under the new settings is one record as before.
        assert_eq!(post(&url, "fp-new", TRACED, &[]).await.status, 201);
        assert!(post(&url, "fp-new", r#"{"item":"book","qty":1,"trace_id":"t-2"}"#, &[]).await.replayed());
        assert_eq!(up.total(), 2);
    }
}

/// Two replicas mid-rollout with different fingerprint settings for one
/// operation (a header entering the fingerprint on one only): a client's
/// identical retry that lands on the other replica is replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_on_a_replica_with_other_fingerprint_settings_is_replayed() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let a = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("fingerprint.headers = [\"api-version\"]"));
    let headers = [("api-version", "2026-01-01")];
    let first = post(&a.url("/v1/orders"), "rolled", ORDER, &headers).await;
    assert_eq!(first.status, 201);
    let b = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let retry = post(&b.url("/v1/orders"), "rolled", ORDER, &headers).await;
    assert_eq!((retry.status, retry.replayed(), &retry.body), (201, true, &first.body), "{}", b.logs());
    // And the other way round: recorded by B, retried on A, which learns
    // of B's settings when it reads the list again (at most every second).
    let first = post(&b.url("/v1/orders"), "back", ORDER, &headers).await;
    assert_eq!(first.status, 201);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let retry = post(&a.url("/v1/orders"), "back", ORDER, &headers).await;
    assert_eq!((retry.status, retry.replayed()), (201, true), "{}", a.logs());
    assert_eq!(up.total(), 2);
}

/// A replica serves under a new configuration as soon as it applies, and
/// adds its fingerprint settings to the store's list just after. A retry
/// landing on another replica in between misses the list and is refused
/// (the settings are not there). Another retry within the second after that
/// read waits for the next read and is replayed once the settings are
/// there; it used to be refused for that whole second. Here the settings'
/// row is taken out and put back to stand for the add that commits late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_within_a_second_of_a_miss_waits_for_the_next_read_of_the_settings() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let b = Gateway::start(GatewayConfig::new(backend.clone(), up.url()));
    let a = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("fingerprint.headers = [\"api-version\"]"));
    let Backend::Postgres { url } = &backend else { unreachable!() };
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    let listed = || async {
        let n: i64 =
            db.query_one("SELECT count(*) FROM idemgate_fingerprint_specs WHERE spec LIKE '%api-version%'", &[]).await.unwrap().get(0);
        n == 1
    };
    assert!(eventually(Duration::from_secs(10), listed).await, "A adds its settings once it serves");
    let rows =
        db.query("DELETE FROM idemgate_fingerprint_specs WHERE spec LIKE '%api-version%' RETURNING operation, spec", &[]).await.unwrap();
    assert_eq!(rows.len(), 1, "A's settings are listed once");
    let (operation, spec): (String, String) = (rows[0].get(0), rows[0].get(1));
    let headers = [("api-version", "2026-01-01")];
    let first = post(&a.url("/v1/orders"), "early", ORDER, &headers).await;
    assert_eq!(first.status, 201);
    let missed = post(&b.url("/v1/orders"), "early", ORDER, &headers).await;
    assert_eq!(missed.status, 409, "A's settings are not listed yet: {}", b.logs());
    db.execute("INSERT INTO idemgate_fingerprint_specs (operation, spec) VALUES ($1, $2)", &[&operation, &spec]).await.unwrap();
    let retry = post(&b.url("/v1/orders"), "early", ORDER, &headers).await;
    assert_eq!((retry.status, retry.replayed(), &retry.body), (201, true, &first.body), "{}", b.logs());
    assert_eq!(up.total(), 1);
}

/// An observing replica started before another replica's fingerprint
/// settings existed learns them in the background: its first look at a
/// retry of a record written under them counts a conflict (the request waits
/// for no store read), the looks after it count the replay enforcing would
/// answer. Before, it never read the list again and counted conflicts until
/// restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observing_replica_learns_fingerprint_settings_added_after_it_started() {
    let backend = postgres_backend();
    let up = TestUpstream::start().await;
    let observer = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("mode = \"observe\""));
    let a = Gateway::start(GatewayConfig::new(backend.clone(), up.url()).route("fingerprint.headers = [\"api-version\"]"));
    let headers = [("api-version", "2026-01-01")];
    assert_eq!(post(&a.url("/v1/orders"), "rolled", ORDER, &headers).await.status, 201);
    let would = |what: &'static str| {
        let url = observer.admin_url("/metrics");
        async move {
            let m = send("GET", &url, &[], "").await.expect("metrics");
            let series = format!("idemgate_observe_would_total{{operation=\"create_order\",would=\"{what}\"}} ");
            String::from_utf8_lossy(&m.body).lines().find_map(|l| l.strip_prefix(series.as_str())?.parse::<f64>().ok()).unwrap_or(0.0)
        }
    };
    let mut looks = 0;
    while would("replay").await == 0.0 {
        looks += 1;
        assert!(looks <= 10, "never counted as a replay: {} conflicts; {}", would("conflict").await, observer.logs());
        assert_eq!(post(&observer.url("/v1/orders"), "rolled", ORDER, &headers).await.status, 201, "observe mode passes it through");
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    assert!(would("conflict").await <= 2.0, "{}", would("conflict").await);
}

/// Only the settings a record was written under count: a route that once
/// left `/coupon` out and no longer does refuses a request that differs
/// from a record made since by a coupon (it would be answered as that
/// record's request under the old settings), while a record made under the
/// old settings still recognises its retry whatever its coupon says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_settings_a_record_was_written_under_recognise_a_retry() {
    let backend = sqlite_backend();
    let up = TestUpstream::start().await;
    let cfg = |extra: &str| GatewayConfig::new(backend.clone(), up.url()).route(extra);
    let mut gw = Gateway::start(cfg("fingerprint.exclude = [\"/coupon\"]"));
    let url = gw.url("/v1/orders");
    assert_eq!(post(&url, "old", r#"{"item":"book","coupon":"A"}"#, &[]).await.status, 201);
    tokio::task::block_in_place(|| gw.reload(cfg(""), Duration::from_secs(10))).expect("reloaded");
    assert!(post(&url, "old", r#"{"item":"book","coupon":"B"}"#, &[]).await.replayed(), "recorded with the coupon left out");
    assert_eq!(post(&url, "new", r#"{"item":"book"}"#, &[]).await.status, 201);
    let other = post(&url, "new", r#"{"item":"book","coupon":"X"}"#, &[]).await;
    assert_eq!((other.status, other.problem().as_str()), (409, "idempotency-key-reused"), "{}", gw.logs());
    assert_eq!(up.total(), 2);
}
