//! What the upstream believes the request is (issue 42), as a differential
//! test against real frameworks: the gateway fronts Flask (on the standard
//! library's WSGI server), Express (with `method-override` from npm) and
//! Rack (with `Rack::MethodOverride`, on WEBrick, routing paths as Rails
//! does), each recording what it dispatched to: the handler, the method it
//! ran, and the tenant, principal, idempotency key and generation it read
//! (as the framework reads them: CGI-style servers fold `X_Tenant_Id` into
//! `HTTP_X_TENANT_ID`). A corpus of request spellings (methods, override
//! headers and `_method`, format suffixes and trailing junk, letter case,
//! `_` header spellings, HEAD) goes through the gateway, without credentials
//! and then with an API key and an idempotency key. For every dispatch:
//!
//! - to a handler of a protected operation: the request carried credentials,
//!   the gateway claimed exactly that operation (a record under the scope's
//!   key), and the framework saw that scope's derived key and the record's
//!   generation;
//! - to any other handler: the framework saw no idempotency key and no
//!   generation;
//! - always: no tenant or principal header (no identity source here forwards
//!   one; the client's, in any spelling, must not arrive).
//!
//! The frameworks are installed by scripts/test (pip, npm, apt-get). Without
//! them this test says so and steps aside, except when
//! `IDEMGATE_TEST_FRAMEWORKS=required` or in CI (`CI` set), where a missing
//! framework fails it.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use sha2::{Digest, Sha256};
use support::gateway::API_KEY;
use support::*;

/// The gateway's routes: (operation, method, path template).
/// Each literal route has a `{param}` route of its method beside it, as the
/// frameworks' routers are usually written (the literal first, or chosen by
/// specificity).
const ROUTES: [(&str, &str, &str); 7] = [
    ("create_order", "POST", "/v1/orders"),
    ("replace_order", "PUT", "/v1/orders/{id}"),
    ("delete_order", "DELETE", "/v1/orders/{id}"),
    ("cancel_order", "POST", "/v1/orders/{id}/cancel"),
    ("read_report", "GET", "/v1/reports/{id}"),
    ("cancel_all", "POST", "/v1/orders/all/cancel"),
    ("replace_all", "PUT", "/v1/orders/all"),
];

/// Paths as clients may spell them.
const PATHS: [&str; 24] = [
    "/v1/orders",
    "/v1/orders/42",
    "/v1/orders/42/cancel",
    "/v1/reports/7",
    "/v1/orders.json",
    "/v1/orders/42.json",
    "/v1/orders/42/cancel.json",
    "/v1/reports/7.json",
    "/v1/orders/",
    "/v1/orders/42/",
    "/V1/Orders",
    "/v1/orders.",
    "/v1/orders%20",
    "/v1/orders%09",
    "/v1/orders/42/cancel%20",
    "/v1/elsewhere",
    "/v1/elsewhere.json",
    // A parameter's value that a framework reads as the literal beside it
    // (letter case, a format suffix, `;` parameters).
    "/v1/orders/all/cancel",
    "/v1/orders/ALL/cancel",
    "/v1/orders/all;x/cancel",
    "/v1/orders/all%3Bx/cancel",
    "/v1/orders/all",
    "/v1/orders/ALL",
    "/v1/orders/all.json",
];

const METHODS: [&str; 6] = ["POST", "PUT", "DELETE", "PATCH", "GET", "HEAD"];

/// A signal besides method and path: extra headers, and the body with its
/// content type (`None`: a JSON order).
struct Signal {
    name: &'static str,
    headers: &'static [(&'static str, &'static str)],
    query: &'static str,
    body: Option<(Option<&'static str>, &'static str)>,
}

const SIGNALS: &[Signal] = &[
    Signal { name: "plain", headers: &[], query: "", body: None },
    Signal { name: "override header DELETE", headers: &[("X-HTTP-Method-Override", "DELETE")], query: "", body: None },
    Signal { name: "override header PUT", headers: &[("X-HTTP-Method-Override", "PUT")], query: "", body: None },
    Signal { name: "override header POST", headers: &[("X-HTTP-Method-Override", "POST")], query: "", body: None },
    Signal { name: "override header GET", headers: &[("X-HTTP-Method-Override", "GET")], query: "", body: None },
    Signal { name: "X-HTTP-Method", headers: &[("X-HTTP-Method", "DELETE")], query: "", body: None },
    Signal { name: "X-Method-Override", headers: &[("X-Method-Override", "PUT")], query: "", body: None },
    Signal { name: "override header with _", headers: &[("X_HTTP_Method_Override", "DELETE")], query: "", body: None },
    Signal { name: "_method query", headers: &[], query: "_method=DELETE", body: None },
    Signal { name: "_method query PUT", headers: &[], query: "x=1&_method=PUT", body: None },
    Signal {
        name: "_method form",
        headers: &[],
        query: "",
        body: Some((Some("application/x-www-form-urlencoded"), "item=book&_method=DELETE")),
    },
    Signal { name: "_method form PUT", headers: &[], query: "", body: Some((Some("application/x-www-form-urlencoded"), "_method=PUT")) },
    Signal { name: "_method form POST", headers: &[], query: "", body: Some((Some("application/x-www-form-urlencoded"), "_method=POST")) },
    Signal { name: "_method without content type", headers: &[], query: "", body: Some((None, "_method=DELETE")) },
    Signal { name: "_method JSON", headers: &[], query: "", body: Some((Some("application/json"), r#"{"_method":"DELETE"}"#)) },
    Signal {
        name: "_method multipart",
        headers: &[],
        query: "",
        body: Some((
            Some("multipart/form-data; boundary=XyZ"),
            "--XyZ\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nPUT\r\n--XyZ--\r\n",
        )),
    },
    // Spellings a review found that the gateway did not read as overrides.
    Signal {
        name: "Connection names the content type",
        headers: &[("Connection", "Content-Type")],
        query: "",
        body: Some((Some("application/octet-stream"), "_method=DELETE")),
    },
    Signal {
        name: "_method form, type before a comma",
        headers: &[],
        query: "",
        body: Some((Some("application/x-www-form-urlencoded, x"), "_method=DELETE")),
    },
    Signal { name: "[_method] form", headers: &[], query: "", body: Some((Some("application/x-www-form-urlencoded"), "[_method]=DELETE")) },
    Signal {
        name: "_method multipart/mixed",
        headers: &[],
        query: "",
        body: Some((
            Some("multipart/mixed; boundary=XyZ"),
            "--XyZ\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n",
        )),
    },
    Signal {
        name: "_method multipart, folded part header",
        headers: &[],
        query: "",
        body: Some((
            Some("multipart/form-data; boundary=XyZ"),
            "--XyZ\r\nContent-Disposition: form-data;\r\n name=\"_method\"\r\n\r\nDELETE\r\n--XyZ--\r\n",
        )),
    },
    // Express's body parsers inflate a gzip body by default: the `_method`
    // inside is read there, and not by a scan of the compressed bytes.
    Signal {
        name: "_method form, gzip",
        headers: &[("Content-Encoding", "gzip")],
        query: "",
        body: Some((Some("application/x-www-form-urlencoded"), "item=book&_method=DELETE")),
    },
    // A form that looks like JSON is still a form to Rack and Express
    // (`{"a":"` is one field's name), and Rack takes a part's name unquoted.
    Signal {
        name: "_method form that looks like JSON",
        headers: &[],
        query: "",
        body: Some((Some("application/x-www-form-urlencoded"), r#"{"a":"&_method=DELETE&"}"#)),
    },
    Signal {
        name: "_method multipart, unquoted name",
        headers: &[],
        query: "",
        body: Some((
            Some("multipart/form-data; boundary=XyZ"),
            "--XyZ\r\nContent-Disposition: form-data; name=_method\r\n\r\nDELETE\r\n--XyZ--\r\n",
        )),
    },
    Signal {
        name: "_method multipart Content-ID",
        headers: &[],
        query: "",
        body: Some((Some("multipart/form-data; boundary=XyZ"), "--XyZ\r\nContent-ID: _method\r\n\r\nDELETE\r\n--XyZ--\r\n")),
    },
];

/// Sent with every request: a tenant, a principal, a key and a generation
/// asserted by the client, in the spellings CGI-style servers fold together.
const FORGED: [(&str, &str); 6] = [
    ("X-Tenant-Id", "globex"),
    ("X_Tenant_Id", "globex"),
    ("X_Principal_Id", "root"),
    ("x-principal-id", "root"),
    ("Idempotency_Key", "forged-key"),
    ("X_Idempotency_Generation", "999999"),
];

/// `text` gzip-compressed (by Python, which the Flask upstream needs anyway).
fn gzip(text: &str) -> Vec<u8> {
    use std::io::Write;
    let mut child = Command::new("python3")
        .args(["-c", "import gzip, sys; sys.stdout.buffer.write(gzip.compress(sys.stdin.buffer.read(), mtime=0))"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 for gzip");
    child.stdin.take().expect("stdin").write_all(text.as_bytes()).expect("write to python3");
    let out = child.wait_with_output().expect("python3 gzip");
    assert!(out.status.success() && !out.stdout.windows(7).any(|w| w == b"_method"), "gzip failed or left the text readable");
    out.stdout
}

/// The protected operations' handlers have the operations' names.
fn is_protected(handler: &str) -> bool {
    ROUTES.iter().any(|(op, _, _)| *op == handler)
}

#[derive(Debug, Clone, Copy)]
enum Framework {
    Flask,
    Express,
    Rack,
}

fn frameworks_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/frameworks")
}

impl Framework {
    /// The command that serves it, or why it cannot run here.
    fn command(self) -> Result<Command, String> {
        let dir = frameworks_dir();
        let probe = |program: &str, args: &[&str], cwd: &Path| {
            Command::new(program)
                .args(args)
                .current_dir(cwd)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let (program, args, cwd, check): (&str, Vec<String>, PathBuf, Vec<&str>) = match self {
            Framework::Flask => ("python3", vec!["flask_app.py".into()], dir.clone(), vec!["-c", "import flask"]),
            Framework::Express => {
                ("node", vec!["app.js".into()], dir.join("express"), vec!["-e", "require('express'); require('method-override')"])
            }
            Framework::Rack => ("ruby", vec!["rack_app.rb".into()], dir.clone(), vec!["-e", "require 'rack'; require 'webrick'"]),
        };
        if !probe(program, &check, &cwd) {
            return Err(format!("{self:?} is not installed ({program} {})", check.join(" ")));
        }
        let mut c = Command::new(program);
        c.args(args).current_dir(cwd).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        Ok(c)
    }
}

/// A framework upstream process; killed when dropped.
struct Upstream {
    child: Child,
    port: u16,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Upstream {
    /// `None` when the framework is missing and not required.
    fn start(framework: Framework) -> Option<Upstream> {
        let mut command = match framework.command() {
            Ok(c) => c,
            Err(why) => {
                assert!(
                    !support::real_components_required(),
                    "{why}; scripts/test installs the frameworks (IDEMGATE_TEST_FRAMEWORKS=required or CI is set)"
                );
                eprintln!("SKIPPED: {why}; scripts/test installs it");
                return None;
            }
        };
        let mut child = command.spawn().unwrap_or_else(|e| panic!("start {framework:?}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).expect("read the framework's first line");
        let port = line.trim().strip_prefix("listening ").and_then(|p| p.parse().ok());
        let port = port.unwrap_or_else(|| panic!("{framework:?} did not start: {line:?}"));
        Some(Upstream { child, port })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// What the framework dispatched after its first `since` dispatches.
    async fn dispatched(&self, since: usize) -> Vec<serde_json::Value> {
        let r = send("GET", &format!("{}/__dispatched?since={since}", self.url()), &[], "").await.expect("read the dispatch log");
        r.json().as_array().cloned().unwrap_or_default()
    }
}

fn config(upstream: &Upstream, backend: &Backend) -> GatewayConfig {
    let key_hash = hex::encode(Sha256::digest(API_KEY.as_bytes()));
    // An API key, and trusted headers honoured only from a peer that is not
    // this test: the client's `X-Tenant-Id` is never an identity here.
    let identity = format!(
        "[[identity.sources]]\nkind = \"api_key\"\nkeys = [ {{ sha256 = \"{key_hash}\", tenant = \"{TENANT}\", principal = \"{PRINCIPAL}\" }} ]\n\n\
         [[identity.sources]]\nkind = \"trusted_header\"\ntenant_header = \"x-tenant-id\"\nprincipal_header = \"x-principal-id\"\ntrusted_peers = [\"192.0.2.1/32\"]\n"
    );
    let mut config =
        GatewayConfig::new(backend.clone(), upstream.url()).identity(&identity).server("default_upstream = \"orders\"").timeout("10s");
    for (op, method, path) in ROUTES.iter().skip(1) {
        config =
            config.tail(&format!("[[routes]]\noperation = \"{op}\"\nmethod = \"{method}\"\npath = \"{path}\"\nupstream = \"orders\"\n"));
    }
    config
}

/// Sends the corpus through a gateway in front of `framework`; returns the
/// dispatches that broke the rule, one line each, and how many requests
/// reached a protected handler legitimately (so the test cannot pass by
/// refusing everything).
async fn run(framework: Framework) -> Option<(Vec<String>, usize, std::collections::BTreeMap<String, usize>)> {
    let upstream = Upstream::start(framework)?;
    let backend = sqlite_backend();
    let gw = Gateway::start(config(&upstream, &backend));
    let store = backend.open().await;
    let mut failures = Vec::new();
    let mut sent = 0;
    let mut claimed = std::collections::BTreeMap::<String, usize>::new();
    let mut seen = 0;
    for path in PATHS {
        for method in METHODS {
            for signal in SIGNALS {
                for with_credentials in [false, true] {
                    sent += 1;
                    let key = format!("fw-{sent}");
                    let target = match (signal.query, path.contains('?')) {
                        ("", _) => path.to_owned(),
                        (q, false) => format!("{path}?{q}"),
                        (q, true) => format!("{path}&{q}"),
                    };
                    let (content_type, body) = signal.body.unwrap_or((Some("application/json"), r#"{"item":"book"}"#));
                    let mut headers: Vec<(&str, &str)> = FORGED.to_vec();
                    headers.extend_from_slice(signal.headers);
                    headers.extend(content_type.map(|ct| ("content-type", ct)));
                    if with_credentials {
                        headers.push(("authorization", "Bearer test-key"));
                        headers.push(("idempotency-key", &key));
                    }
                    let what = format!(
                        "{framework:?}: {method} {target} [{}]{}",
                        signal.name,
                        if with_credentials { " with credentials" } else { "" }
                    );
                    let body = if signal.headers.contains(&("Content-Encoding", "gzip")) { gzip(body) } else { body.as_bytes().to_vec() };
                    let answer = send(method, &gw.url(&target), &headers, body).await;
                    let status = answer.as_ref().map_or(0, |r| r.status);
                    let new = upstream.dispatched(seen).await;
                    seen += new.len();
                    for d in new {
                        let field = |name: &str| d[name].as_str().map(str::to_owned);
                        let handler = field("handler").unwrap_or_default();
                        let broke = |why: String| format!("{what} -> {status}: {handler} ran {}: {why}", d["method"]);
                        if field("tenant").is_some() || field("principal").is_some() {
                            failures.push(broke(format!("it read tenant {:?}, principal {:?}", field("tenant"), field("principal"))));
                        }
                        if !is_protected(&handler) {
                            if field("key").is_some() || field("generation").is_some() {
                                failures.push(broke(format!(
                                    "unclaimed, yet it read key {:?}, generation {:?}",
                                    field("key"),
                                    field("generation")
                                )));
                            }
                            continue;
                        }
                        if !with_credentials {
                            failures.push(broke("a protected operation ran without identity".into()));
                            continue;
                        }
                        let scope = scope_for(PRINCIPAL, &handler, &key);
                        let record = store.get(&scope).await.expect("store get").map(|(r, _)| r);
                        let want_key = scope.derived_key(Some(TEST_SECRET.as_bytes()));
                        match record {
                            None => failures.push(broke(format!("no record claims {handler} under this key"))),
                            Some(_) if field("key").as_deref() != Some(want_key.as_str()) => {
                                failures.push(broke(format!("it read key {:?}, not {handler}'s derived key", field("key"))))
                            }
                            Some(r) if field("generation") != Some(r.generation.to_string()) => failures.push(broke(format!(
                                "it read generation {:?}, the record's is {}",
                                field("generation"),
                                r.generation
                            ))),
                            Some(_) => *claimed.entry(handler.clone()).or_default() += 1,
                        }
                    }
                }
            }
        }
    }
    Some((failures, sent, claimed))
}

async fn check(framework: Framework) {
    let Some((failures, sent, claimed)) = run(framework).await else { return };
    eprintln!(
        "{framework:?}: {sent} requests; protected dispatches identified and claimed: {claimed:?}; {} broke the rule",
        failures.len()
    );
    for (op, _, _) in ROUTES {
        assert!(claimed.contains_key(op), "{framework:?}: {op} never ran claimed: the corpus must reach every route ({claimed:?})");
    }
    let shown: Vec<&String> = failures.iter().take(60).collect();
    assert!(
        failures.is_empty(),
        "{} dispatches broke the rule (first {}):\n{}",
        failures.len(),
        shown.len(),
        shown.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flask_runs_nothing_protected_that_the_gateway_did_not_claim() {
    check(Framework::Flask).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn express_runs_nothing_protected_that_the_gateway_did_not_claim() {
    check(Framework::Express).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rack_runs_nothing_protected_that_the_gateway_did_not_claim() {
    check(Framework::Rack).await;
}
