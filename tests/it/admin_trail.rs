//! Who did what, through the real binary: an admin API change (a forced
//! rewrite of a completed record included) is audited with the caller's
//! address and a label of the token it used, on both stores; every admin API
//! call, failed logins included, gets an access-log line; `keys resolve`
//! requires a reason, as the API does; and `serve --pid-file` writes its pid
//! file without following a symlink or taking over another user's file.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemgate::idempotency::record::State;
use sha2::{Digest, Sha256};
use support::*;

on_both_stores!(a_forced_admin_rewrite_is_audited_with_the_peer_and_the_token_label);

const ORDER: &str = r#"{"item":"book","qty":1}"#;
const TOKEN: &str = "admin-token-0123456789abcdef0123456789abcdef";

async fn setup(backend: Backend) -> (TestUpstream, Gateway, idemgate::store::Store, tempfile::TempDir) {
    let up = TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let cfg = GatewayConfig::new(backend.clone(), up.url()).admin(&format!("token_file = \"{}\"", token_file.display()));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    (up, gw, store, dir)
}

async fn admin(gw: &Gateway, method: &str, path: &str, token: Option<&str>, body: &str) -> Resp {
    support::admin::request(gw, method, path, token, body).await
}

/// The label the audit trail and the access log give `TOKEN`: a keyed hash
/// (the deployment's derived-key secret keys it), not a bare SHA-256 prefix
/// that a word list turns back into the token offline.
fn label() -> String {
    let label = idemgate::store::audit::token_label(TOKEN, TEST_SECRET.as_bytes());
    assert!(label.starts_with("hmac:") && label.len() == 17, "{label}");
    assert!(!label.contains(&hex::encode(Sha256::digest(TOKEN.as_bytes()))[..8]), "not the bare SHA-256 prefix");
    label
}

async fn a_forced_admin_rewrite_is_audited_with_the_peer_and_the_token_label(backend: Backend) {
    let (up, gw, store, _dir) = setup(backend).await;
    assert_eq!(post(&gw.url("/v1/orders"), "k-force", ORDER, &[]).await.status, 201);
    assert_eq!(settled_record(&store, "k-force").await.unwrap().state, State::Completed);
    let body = r#"{"action":"complete","status":200,"body_base64":"e30=","reason":"refund issued by hand","force":true}"#;
    let r = admin(&gw, "POST", "/admin/records/acme/billing/create_order/k-force/resolve", Some(TOKEN), body).await;
    assert_eq!(r.status, 200, "{r:?}");

    let doc = admin(&gw, "GET", "/admin/audit?limit=10", Some(TOKEN), "").await.json();
    let entry = &doc["entries"][0];
    assert_eq!((entry["actor"].as_str(), entry["forced"].as_bool()), (Some("admin"), Some(true)), "{doc}");
    let peer = entry["peer"].as_str().unwrap_or_else(|| panic!("the row names the caller's address: {doc}"));
    assert!(peer.starts_with("127.0.0.1:"), "{peer}");
    assert_eq!(entry["token"].as_str(), Some(label().as_str()), "{doc}");
    assert!(!doc.to_string().contains(TOKEN), "the token itself is never stored");

    // The store's own row (read back as the CLI reads it).
    let rows = store.audit(10).await.unwrap();
    assert_eq!(rows[0].peer.as_deref(), Some(peer));
    assert_eq!(rows[0].token.as_deref(), Some(label().as_str()));
    let (code, out, err) = cli(&gw, &["keys", "audit", "--json"]);
    assert_eq!(code, 0, "{err}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed["entries"][0]["peer"].as_str(), Some(peer));

    // A CLI resolution has neither (it came from no network peer).
    let slow = post(&gw.url("/v1/orders"), "k-cli", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(slow.problem(), "outcome-unknown");
    let (code, _, err) = cli_keys(&gw, "resolve", "k-cli", &["--release", "--reason", "checked"]);
    assert_eq!(code, 0, "{err}");
    let rows = store.audit(10).await.unwrap();
    assert_eq!((rows[0].actor.as_str(), rows[0].peer.as_deref(), rows[0].token.as_deref()), ("cli", None, None));
    assert_eq!(up.side_effects(&derived("k-force")), 1);
}

/// One access-log line per admin API call, with the caller's address and
/// which token it presented: none, an invalid one, or the configured one's
/// label. Failed logins included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_call_is_in_the_access_log_failed_logins_included() {
    let (_up, gw, _store, _dir) = setup(sqlite_backend()).await;
    let calls = [
        ("GET", "/admin/records", None, 401, "none"),
        ("GET", "/admin/records", Some("guess"), 401, "invalid"),
        ("POST", "/admin/records/a/b/c/d/resolve", Some("guess"), 401, "invalid"),
        ("GET", "/admin/audit", Some(TOKEN), 200, "label"),
        ("GET", "/admin/nothing-here", Some(TOKEN), 404, "label"),
        ("GET", "/admin/records/acme/billing/create_order/SECRET-KEY-123", Some(TOKEN), 404, "label"),
        ("POST", "/admin/records/acme/billing/create_order/SECRET-KEY-123/resolve", Some("guess"), 401, "invalid"),
    ];
    for (method, path, token, status, _) in calls {
        assert_eq!(admin(&gw, method, path, token, "{}").await.status, status, "{method} {path}");
    }
    let admin_lines = || -> Vec<serde_json::Value> {
        gw.logs()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "idemgate::access" && v["route"] == "admin")
            .collect()
    };
    assert!(eventually(Duration::from_secs(5), || async { admin_lines().len() >= calls.len() }).await, "{}", gw.logs());
    let lines = admin_lines();
    // A path naming a scope is logged with the scope's id, never the key.
    let scope_id = scope_for(PRINCIPAL, "create_order", "SECRET-KEY-123").scope_id().to_string();
    for (method, path, _, status, token) in calls {
        let token = if token == "label" { label() } else { token.to_owned() };
        let abcd = idemgate::idempotency::key::Scope {
            tenant: "a".into(),
            principal: "b".into(),
            operation: "c".into(),
            key: idemgate::idempotency::key::IdempotencyKey::new("d").unwrap(),
        }
        .scope_id()
        .to_string();
        let (path, scope) = match (
            path.strip_prefix("/admin/records/acme/billing/create_order/SECRET-KEY-123"),
            path.strip_prefix("/admin/records/a/b/c/d"),
        ) {
            (Some(action), _) => (format!("/admin/records/{{scope}}{action}"), Some(scope_id.as_str())),
            (_, Some(action)) => (format!("/admin/records/{{scope}}{action}"), Some(abcd.as_str())),
            _ => (path.to_owned(), None),
        };
        assert!(
            scope.is_none() || lines.iter().any(|l| l["path"] == path.as_str() && l["scope"] == scope.unwrap_or_default()),
            "no line names scope {scope:?} for {path}: {lines:?}"
        );
        assert!(
            lines.iter().any(|l| l["method"] == method
                && l["path"] == path
                && l["status"] == status
                && l["token"] == token.as_str()
                && l["client"].as_str().is_some_and(|c| c.starts_with("127.0.0.1"))),
            "no access line for {method} {path} {status} token={token}: {lines:?}"
        );
    }
    assert!(!gw.logs().contains(TOKEN) && !gw.logs().contains("Bearer guess"), "tokens are never logged");
    assert!(!gw.logs().contains("SECRET-KEY-123"), "keys are never logged");
}

/// `[admin] token_label`: the operator names the token; the access log and
/// the audit trail use that name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_configured_token_label_names_the_token() {
    let up = TestUpstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin-token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let backend = sqlite_backend();
    let cfg = GatewayConfig::new(backend.clone(), up.url())
        .admin(&format!("token_file = \"{}\"\ntoken_label = \"oncall-2026\"", token_file.display()));
    let gw = Gateway::start(cfg);
    let store = backend.open().await;
    let slow = post(&gw.url("/v1/orders"), "k-label", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(slow.problem(), "outcome-unknown");
    let body = r#"{"action":"release","reason":"not in the ledger"}"#;
    let r = admin(&gw, "POST", "/admin/records/acme/billing/create_order/k-label/resolve", Some(TOKEN), body).await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(store.audit(1).await.unwrap()[0].token.as_deref(), Some("oncall-2026"));
    assert!(eventually(Duration::from_secs(5), || async { gw.logs().contains("\"token\":\"oncall-2026\"") }).await, "{}", gw.logs());
}

/// A resolution reason with a control character (an escape sequence that
/// would erase a line or forge a row on an operator's terminal) is refused
/// with 400 by the API and by `keys resolve`, and nothing is resolved; rows
/// written before the check are printed escaped by `keys audit`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_characters_in_reasons_are_refused_and_escaped_where_printed() {
    let backend = sqlite_backend();
    let (_up, gw, store, _dir) = setup(backend).await;
    let slow = post(&gw.url("/v1/orders"), "k-esc", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(slow.problem(), "outcome-unknown");
    let forged = "ok\u{1b}[2K\r2026-01-01 cli released acme/billing/create_order/other";
    let body = serde_json::json!({ "action": "release", "reason": forged }).to_string();
    let r = admin(&gw, "POST", "/admin/records/acme/billing/create_order/k-esc/resolve", Some(TOKEN), &body).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "invalid-request"), "{r:?}");
    let scope = ["--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", "k-esc"];
    let mut args = vec!["keys", "resolve"];
    args.extend_from_slice(&scope);
    args.extend_from_slice(&["--release", "--reason", "line one\nline two"]);
    let (code, _, err) = cli(&gw, &args);
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("control character"), "{err}");
    assert_eq!(record(&store, "k-esc").await.unwrap().state, State::Unknown, "nothing resolved");

    // A row from before the check: written to the store directly.
    use idemgate::store::audit::{Actor, AuditNote};
    let note = AuditNote { actor: Actor::Cli, reason: forged.to_owned(), forced: false, caller: None };
    let resolved =
        store.resolve(&scope_for(PRINCIPAL, "create_order", "k-esc"), &idemgate::store::Resolution::Release { force: false }, &note).await;
    assert!(matches!(resolved, Ok(idemgate::store::ResolveOutcome::Resolved { .. })), "{resolved:?}");
    let (code, out, err) = cli(&gw, &["keys", "audit"]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains('\u{1b}') && !out.contains('\r'), "printed raw: {out:?}");
    assert!(out.contains("ok\\u{1b}[2K\\r2026-01-01"), "printed escaped: {out}");
}

/// `keys resolve` without `--reason` is a usage error (exit 2), as a
/// resolution without a reason is for the API: the record stays unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_resolve_requires_a_reason() {
    let backend = sqlite_backend();
    let (_up, gw, store, _dir) = setup(backend).await;
    let slow = post(&gw.url("/v1/orders"), "k-unknown", ORDER, &[("x-test-sleep-ms", "3000")]).await;
    assert_eq!(slow.problem(), "outcome-unknown");
    let scope = ["--tenant", TENANT, "--principal", PRINCIPAL, "--operation", "create_order", "--key", "k-unknown"];
    for action in [&["--release"][..], &["--complete", "--status", "201"][..]] {
        let mut args = vec!["keys", "resolve"];
        args.extend_from_slice(&scope);
        args.extend_from_slice(action);
        let (code, _, err) = cli(&gw, &args);
        assert_eq!(code, 2, "{action:?}: {err}");
        assert!(err.contains("--reason"), "{err}");
        assert_eq!(record(&store, "k-unknown").await.unwrap().state, State::Unknown, "{action:?}: nothing resolved");
    }
    let mut args = vec!["keys", "resolve"];
    args.extend_from_slice(&scope);
    args.extend_from_slice(&["--release", "--reason", "   "]);
    let (code, _, err) = cli(&gw, &args);
    assert_ne!(code, 0, "a blank reason is no reason: {err}");
    assert_eq!(record(&store, "k-unknown").await.unwrap().state, State::Unknown);
}

/// `serve --pid-file P` where P must not be trusted: a symlink (to a file
/// the attacker wants overwritten), or a file another user owns. `serve`
/// refuses to start and the target is untouched. A stale pid file of ours
/// (its process gone) is replaced, and the file is removed on exit.
#[test]
fn the_pid_file_is_never_followed_through_a_symlink_nor_taken_from_another_user() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("idemgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\ndefault_upstream = \"u\"\n[store]\nkind = \"sqlite\"\npath = \"{}\"\n[[upstreams]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n",
            dir.path().join("db.sqlite").display()
        ),
    )
    .unwrap();
    let victim = dir.path().join("victim");
    std::fs::write(&victim, "precious\n").unwrap();

    let link = dir.path().join("link.pid");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let err = serve_refuses(&config, &link);
    assert!(err.contains("link.pid") && err.contains("symbolic link"), "{err}");
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n", "the symlink's target is untouched");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());

    // Another user's file (root can make one; others skip this part).
    let theirs = dir.path().join("theirs.pid");
    std::fs::write(&theirs, "1\n").unwrap();
    if Command::new("chown").arg("65534").arg(&theirs).status().is_ok_and(|s| s.success()) {
        let err = serve_refuses(&config, &theirs);
        assert!(err.contains("theirs.pid") && err.contains("owned by"), "{err}");
        assert_eq!(std::fs::read_to_string(&theirs).unwrap(), "1\n");
    }

    // A stale pid file of ours: replaced, then removed on exit.
    let stale = dir.path().join("stale.pid");
    std::fs::write(&stale, "999999999\n").unwrap();
    let mut child = spawn_serve(&config, &stale);
    let deadline = Instant::now() + Duration::from_secs(20);
    let me = child.id().to_string();
    while std::fs::read_to_string(&stale).map(|s| s.trim() != me).unwrap_or(true) {
        assert!(child.try_wait().unwrap().is_none(), "serve exited: {}", stderr_of(child));
        assert!(Instant::now() < deadline, "the stale pid file was not replaced");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = Command::new("kill").arg("-TERM").arg(&me).status();
    assert!(child.wait().unwrap().success());
    assert!(!stale.exists(), "removed on exit");
}

fn spawn_serve(config: &Path, pid_file: &Path) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["serve", "--config"])
        .arg(config)
        .arg("--pid-file")
        .arg(pid_file)
        .env("IDEMGATE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn idemgate")
}

fn stderr_of(child: std::process::Child) -> String {
    String::from_utf8_lossy(&child.wait_with_output().unwrap().stderr).into_owned()
}

/// Runs `serve` with `pid_file`, which must make it exit 1; its stderr.
fn serve_refuses(config: &Path, pid_file: &Path) -> String {
    let mut child = spawn_serve(config, pid_file);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let err = stderr_of(child);
            assert_eq!(status.code(), Some(1), "{err}");
            return err;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("serve accepted {}: {}", pid_file.display(), stderr_of(child));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
