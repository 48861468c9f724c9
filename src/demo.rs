//! `idemgate demo`: a small order service and the real gateway in front of it,
//! on the embedded store, plus a script of curl lines to paste into a shell.
//!
//! The order service is an ordinary upstream: it knows nothing of
//! idempotency and creates one order per POST it receives. Its slow endpoint
//! takes longer than the gateway's upstream timeout, so the demo can show an
//! honest `outcome-unknown`. The gateway is the real [`Server`], built from a
//! generated TOML config that is also written to `<data>/idemgate.toml`, so
//! `idemgate keys ... --config <data>/idemgate.toml` inspects the same store
//! while the demo runs and after it stops.
//!
//! Every start deletes the files the previous demo left in `<data>` (its
//! SQLite database with `-wal`/`-shm`/`.lock`, and its config) so the script
//! gives the same answers each run. Nothing else in `<data>` is touched.

use std::borrow::Cow;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use http::header::{CONTENT_TYPE, LOCATION};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::server::Server;
use crate::server::listener::{ConnectionLimit, Http, Listener, accept_loop};
use crate::store::sqlite::lock_path;

/// The demo's API key. Printed for the curl lines; the config holds only its sha256.
pub const DEMO_API_KEY: &str = "demo-key";
/// Who the demo key identifies.
const TENANT: &str = "demo";
const PRINCIPAL: &str = "demo-client";
/// The gateway's whole-response timeout for the order service...
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// ...which the slow endpoint exceeds before it creates its order anyway.
const SLOW_ORDER_DELAY: Duration = Duration::from_secs(3);
/// The demo's database, config and admin token inside `--data`: the only files it deletes.
const DB_FILE: &str = "demo.db";
const CONFIG_FILE: &str = "idemgate.toml";
const TOKEN_FILE: &str = "admin-token";
/// Largest order the order service reads.
const MAX_ORDER_BYTES: usize = 64 * 1024;
/// How long the order service waits, once the gateway has drained, for open
/// connections and slow orders already accepted.
const ORDER_SERVICE_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Where the gateway listens (port 0: any free port; the printed lines use the real one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Where the demo order service (the upstream) listens.
    #[arg(long, default_value = "127.0.0.1:9000")]
    pub upstream_listen: SocketAddr,
    /// Where the admin listener (health, metrics, admin API, console) listens.
    #[arg(long, default_value = "127.0.0.1:9090")]
    pub admin_listen: SocketAddr,
    /// Directory for the demo's SQLite store and its generated config
    /// (both deleted and recreated at every start).
    #[arg(long, default_value = "data/demo")]
    pub data: PathBuf,
    /// Run only the order service (on --upstream-listen), as the upstream of
    /// gateways started elsewhere (deploy/compose.yaml). No store, no gateway.
    #[arg(long)]
    pub upstream_only: bool,
}

/// Runs the demo until `shutdown` fires, then drains the gateway, stops the
/// order service and returns.
pub async fn run(args: DemoArgs, shutdown: CancellationToken) -> anyhow::Result<()> {
    if args.upstream_only {
        let orders = OrderService::bind(args.upstream_listen).await?;
        tracing::info!(addr = %orders.addr, "demo order service running (upstream only); SIGTERM or Ctrl-C to stop");
        orders.run(shutdown).await;
        return Ok(());
    }
    std::fs::create_dir_all(&args.data).with_context(|| format!("creating {}", args.data.display()))?;
    let data = std::fs::canonicalize(&args.data).with_context(|| format!("resolving {}", args.data.display()))?;
    let db_path = data.join(DB_FILE);
    let config_path = data.join(CONFIG_FILE);
    let token_path = data.join(TOKEN_FILE);
    reset(&db_path, &config_path, &token_path)?;
    // The admin API is on, with a fresh token each run, printed below.
    let token = uuid::Uuid::new_v4().simple().to_string();
    write_private(&token_path, token.as_bytes())?;

    let orders = OrderService::bind(args.upstream_listen).await?;
    let upstream = orders.addr;

    let requested = Addrs { gateway: args.listen, admin: args.admin_listen, upstream };
    let toml = config_toml(&requested, &db_path, &token_path)?;
    let config = Config::from_toml(&toml, &config_path.display().to_string(), &|_| None)
        .map_err(|e| anyhow!("the demo's generated config is invalid (a bug in idemgate):\n{e}"))?;
    let server = Server::bind(config).await.context("starting the gateway")?;
    let bound = Addrs {
        gateway: server.proxy_addr().context("the gateway listener has no local address")?,
        admin: server.admin_addr().context("the admin listener has no local address")?,
        upstream,
    };
    // The file says what really runs: the bound ports, not port 0.
    std::fs::write(&config_path, config_toml(&bound, &db_path, &token_path)?)
        .with_context(|| format!("writing {}", config_path.display()))?;

    print_stdout(&script(&bound, &db_path, &config_path, &Admin { token: &token, file: &token_path }));
    tracing::info!(gateway = %bound.gateway, upstream = %bound.upstream, admin = %bound.admin, data = %data.display(), "demo running; Ctrl-C to stop");

    // The gateway drains first (its forwards may still be waiting on the
    // order service); the order service stops after it.
    let orders_stop = CancellationToken::new();
    let gateway = async {
        let result = server.run(shutdown.clone()).await;
        orders_stop.cancel();
        result
    };
    let (gateway, ()) = tokio::join!(gateway, orders.run(orders_stop.clone()));
    gateway.context("gateway")?;

    tracing::info!("demo stopped");
    print_stdout(&format!("\nDemo stopped. Its store and config stay in {} until the next `idemgate demo`.\n", data.display()));
    Ok(())
}

/// Deletes what a previous demo left, after making sure no running
/// idemgate still holds the store.
fn reset(db_path: &Path, config_path: &Path, token_path: &Path) -> anyhow::Result<()> {
    let lock = lock_path(db_path);
    match std::fs::OpenOptions::new().read(true).write(true).open(&lock) {
        Ok(file) => {
            if file.try_lock().is_err() {
                bail!(
                    "{} is in use by another idemgate process (is a demo already running?); stop it or pass another --data",
                    db_path.display()
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("opening {}", lock.display())),
    }
    let mut files = vec![config_path.to_owned(), token_path.to_owned(), lock];
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = db_path.as_os_str().to_owned();
        p.push(suffix);
        files.push(PathBuf::from(p));
    }
    for f in files {
        match std::fs::remove_file(&f) {
            Ok(()) => tracing::debug!(file = %f.display(), "removed the previous demo's file"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("removing {}", f.display())),
        }
    }
    Ok(())
}

/// Writes `contents` to a new file only its owner may read (the admin token).
fn write_private(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(contents).with_context(|| format!("writing {}", path.display()))
}

/// The admin API's token, and the file the config names for it.
struct Admin<'a> {
    token: &'a str,
    file: &'a Path,
}

/// The three listeners, as requested or as bound.
struct Addrs {
    gateway: SocketAddr,
    admin: SocketAddr,
    upstream: SocketAddr,
}

/// The gateway's configuration: the order service as the one upstream, two
/// idempotent routes, the demo key as the identity source.
fn config_toml(addrs: &Addrs, db_path: &Path, token_path: &Path) -> anyhow::Result<String> {
    // TOML basic strings, escaped as TOML needs.
    let toml_path = |p: &Path| -> anyhow::Result<String> {
        let s = p.to_str().with_context(|| format!("{} is not valid UTF-8; pass another --data", p.display()))?;
        Ok(toml::Value::String(s.to_owned()).to_string())
    };
    let (db, token_file) = (toml_path(db_path)?, toml_path(token_path)?);
    let key_hash = hex::encode(Sha256::digest(DEMO_API_KEY.as_bytes()));
    Ok(format!(
        r#"# Generated by `idemgate demo`; deleted and rewritten at every start.
# For a configuration to start from, see config/idemgate.toml.

[server]
listen = "{gateway}"
shutdown_grace = "5s"

[store]
kind = "sqlite"
path = {db}

[admin]
listen = "{admin}"
token_file = {token_file}                    # the admin API's bearer token (printed when the demo starts)

[[upstreams]]
name = "orders"
url = "http://{upstream}"
connect_timeout = "1s"
timeout = "{timeout}"                    # /v1/orders/slow takes {slow}: its outcome is unknown

[[identity.sources]]
kind = "api_key"
header = "authorization"
# sha256 of the demo's API key (printed when the demo starts, never stored)
keys = [ {{ sha256 = "{key_hash}", tenant = "{TENANT}", principal = "{PRINCIPAL}" }} ]

[[routes]]
operation = "create_order"
method = "POST"
path = "/v1/orders"
upstream = "orders"

[[routes]]
operation = "create_order_slow"
method = "POST"
path = "/v1/orders/slow"
upstream = "orders"
"#,
        gateway = addrs.gateway,
        admin = addrs.admin,
        upstream = addrs.upstream,
        timeout = humantime::format_duration(UPSTREAM_TIMEOUT),
        slow = humantime::format_duration(SLOW_ORDER_DELAY),
    ))
}

/// The printed walkthrough: what each step shows, then a line to paste.
fn script(addrs: &Addrs, db_path: &Path, config_path: &Path, api: &Admin<'_>) -> String {
    let gw = format!("http://{}", addrs.gateway);
    let up = format!("http://{}", addrs.upstream);
    let admin = format!("http://{}", addrs.admin);
    let timeout = humantime::format_duration(UPSTREAM_TIMEOUT);
    let slow = humantime::format_duration(SLOW_ORDER_DELAY);
    let post = |path: &str, key: &str, body: &str| {
        format!(
            "curl -si -X POST {gw}{path} -H 'Authorization: Bearer {DEMO_API_KEY}' -H 'Idempotency-Key: {key}' -H 'Content-Type: application/json' -d '{body}'"
        )
    };
    let first = post("/v1/orders", "order-1", r#"{"item":"book","qty":1}"#);
    let changed = post("/v1/orders", "order-1", r#"{"item":"book","qty":2}"#);
    let slow_order = post("/v1/orders/slow", "order-2", r#"{"item":"lamp","qty":1}"#);
    let config = shell_quote(&config_path.display().to_string()).into_owned();
    let exe = std::env::current_exe()
        .map(|p| shell_quote(&p.display().to_string()).into_owned())
        .unwrap_or_else(|_| "the idemgate binary".into());

    let mut s = String::new();
    let _ = writeln!(s, "idemgate demo: an order service (the upstream) and the gateway in front of it.");
    let _ = writeln!(s, "The demo's store starts empty at every start, so the steps below answer the same each run.");
    let _ = writeln!(s);
    let _ = writeln!(s, "  gateway        {gw:<28} idempotent routes: POST /v1/orders, POST /v1/orders/slow");
    let _ = writeln!(s, "  order service  {up:<28} knows nothing of idempotency: one order per POST it receives");
    let _ = writeln!(s, "  admin          {admin:<28} /healthz, /readyz, /metrics, the admin API");
    let _ = writeln!(s, "  console        {admin}/console/  (operator console: log in with the admin token)");
    let _ = writeln!(s, "  store          {} (embedded SQLite)", db_path.display());
    let _ = writeln!(s, "  config         {}", config_path.display());
    let _ = writeln!(s, "  API key        {DEMO_API_KEY} (the config holds only its sha256)");
    let _ = writeln!(s, "  admin token    {} (in {}, which the config names)", api.token, api.file.display());
    let _ = writeln!(s);
    let _ = writeln!(s, "Paste these into another shell, one at a time:");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 1. A first request: the gateway claims key order-1, forwards it, records the answer: 201, order 1.");
    let _ = writeln!(s, "{first}");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 2. The same request again, as a client retrying after a lost response: the recorded answer,");
    let _ = writeln!(s, "#    same order id, plus 'Idempotent-Replayed: true'. The order service sees nothing.");
    let _ = writeln!(s, "{first}");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 3. The same key with a different body (qty 2): 409, urn:idemgate:problem:idempotency-key-reused.");
    let _ = writeln!(s, "{changed}");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 4. The slow endpoint takes {slow}, the gateway waits {timeout}: 504, urn:idemgate:problem:outcome-unknown.");
    let _ = writeln!(s, "#    The order service still creates the order; the gateway cannot know, so it records the key as unknown.");
    let _ = writeln!(s, "{slow_order}");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 4b. Retrying that key: 409 outcome-unknown, never a second order, until an operator reconciles it.");
    let _ = writeln!(s, "{slow_order}");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 5. The unknown record, as an operator sees it (idemgate is {exe} if it is not on your PATH):");
    let _ = writeln!(s, "idemgate keys list --config {config} --state unknown");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 6. What the order service really did: 2 orders (step 1, and the slow one {slow} after step 4),");
    let _ = writeln!(s, "#    however often you retried.");
    let _ = writeln!(s, "curl -s {up}/v1/orders/count");
    let _ = writeln!(s);
    let _ = writeln!(s, "# 7. The same over HTTP: the admin API, on because the config names a token file ([admin] token_file,");
    let _ = writeln!(s, "#    or token_env; without either it is off). It also resolves records and shows the audit trail.");
    let _ = writeln!(s, "curl -s -H 'Authorization: Bearer {}' '{admin}/admin/records?state=unknown'", api.token);
    let _ = writeln!(s);
    let _ = writeln!(s, "# 8. The same in a browser: open the operator console and paste the admin token printed above.");
    let _ = writeln!(s, "#    The overview shows the unknown record of step 4: open it, read what was sent and the audit trail,");
    let _ = writeln!(s, "#    and resolve it with a reason (its audit row then names the console and the token's label).");
    let _ = writeln!(s, "#    {admin}/console/");
    let _ = writeln!(s);
    let _ = writeln!(s, "# Metrics: requests by operation and outcome (forwarded, replayed, mismatch, unknown, ...):");
    let _ = writeln!(s, "curl -s {admin}/metrics");
    let _ = writeln!(s);
    let _ = writeln!(s, "The demo is running. Press Ctrl-C to stop.");
    s
}

/// Quotes `s` for bash when it holds anything but plainly safe characters.
fn shell_quote(s: &str) -> Cow<'_, str> {
    let safe = |b: u8| b.is_ascii_alphanumeric() || b"/._-+:=@,%".contains(&b);
    if !s.is_empty() && s.bytes().all(safe) { Cow::Borrowed(s) } else { Cow::Owned(format!("'{}'", s.replace('\'', r"'\''"))) }
}

/// The script goes to stdout (logs go to stderr); a closed stdout is not
/// worth stopping the demo for.
fn print_stdout(text: &str) {
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        tracing::warn!(error = %e, "cannot write to stdout");
    }
}

/// The demo's upstream: an in-memory order service with no idempotency of its own.
struct OrderService {
    listener: TcpListener,
    addr: SocketAddr,
    orders: Arc<Orders>,
}

/// Orders created so far; an order's id is its position plus one.
#[derive(Default)]
struct Orders {
    created: Mutex<Vec<serde_json::Value>>,
    /// Slow orders being prepared: they run to completion even when the
    /// caller has hung up, as a real backend's work would.
    pending: TaskTracker,
}

impl Orders {
    fn create(&self, idempotency_key: String, order: serde_json::Value) -> serde_json::Value {
        let mut created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        let id = created.len() + 1;
        let record = json!({ "id": id, "idempotency_key": idempotency_key, "order": order });
        created.push(record.clone());
        tracing::info!(id, "order service: order created");
        record
    }

    fn count(&self) -> usize {
        self.created.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn get(&self, id: &str) -> Option<serde_json::Value> {
        let id: usize = id.parse().ok()?;
        let created = self.created.lock().unwrap_or_else(PoisonError::into_inner);
        created.get(id.checked_sub(1)?).cloned()
    }
}

impl OrderService {
    async fn bind(addr: SocketAddr) -> anyhow::Result<OrderService> {
        let listener = TcpListener::bind(addr).await.with_context(|| format!("demo order service: cannot listen on {addr}"))?;
        let addr = listener.local_addr().context("demo order service: no local address")?;
        Ok(OrderService { listener, addr, orders: Arc::default() })
    }

    /// Serves until `stop`, then lets open connections finish their request
    /// and slow orders already accepted be created, within a grace period.
    async fn run(self, stop: CancellationToken) {
        let OrderService { listener, orders, .. } = self;
        let conns = TaskTracker::new();
        // The gateway's own accept loop (plain HTTP/1.1, graceful shutdown on `stop`).
        let listener = Listener { name: "demo", tcp: listener, tls: None, limit: ConnectionLimit::new(1024) };
        let handler_orders = orders.clone();
        accept_loop(listener, stop, conns.clone(), Http::new(Duration::from_secs(10)), None, move |req, _peer| {
            let orders = handler_orders.clone();
            async move {
                let (parts, body) = handle(orders, req).await.into_parts();
                Response::from_parts(parts, crate::upstream::body::Body::boxed(body.map_err(|never: Infallible| match never {})))
            }
        })
        .await;
        conns.close();
        orders.pending.close();
        let drained = async {
            conns.wait().await;
            orders.pending.wait().await;
        };
        if tokio::time::timeout(ORDER_SERVICE_GRACE, drained).await.is_err() {
            tracing::warn!("order service: stopped with work unfinished");
        }
    }
}

async fn handle(orders: Arc<Orders>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::POST, "/v1/orders") => create(orders, req, Duration::ZERO).await,
        (Method::POST, "/v1/orders/slow") => create(orders, req, SLOW_ORDER_DELAY).await,
        (Method::GET, "/v1/orders/count") => reply(StatusCode::OK, &json!({ "count": orders.count() })),
        (Method::GET, p) => match p.strip_prefix("/v1/orders/").and_then(|id| orders.get(id)) {
            Some(order) => reply(StatusCode::OK, &order),
            None => reply(StatusCode::NOT_FOUND, &json!({ "error": "not found" })),
        },
        _ => reply(StatusCode::NOT_FOUND, &json!({ "error": "not found" })),
    }
}

/// Creates an order from a JSON body, after `delay`.
async fn create(orders: Arc<Orders>, req: Request<Incoming>, delay: Duration) -> Response<Full<Bytes>> {
    let (parts, body) = req.into_parts();
    let idempotency_key =
        parts.headers.get("idempotency-key").map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()).unwrap_or_default();
    let body = match Limited::new(body, MAX_ORDER_BYTES).collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => return reply(StatusCode::BAD_REQUEST, &json!({ "error": "unreadable or oversized order" })),
    };
    let order: serde_json::Value = match serde_json::from_slice(&body) {
        Ok(v @ serde_json::Value::Object(_)) => v,
        _ => return reply(StatusCode::BAD_REQUEST, &json!({ "error": "an order is a JSON object" })),
    };
    let created = if delay.is_zero() {
        orders.create(idempotency_key, order)
    } else {
        let (tx, rx) = oneshot::channel();
        let o = orders.clone();
        orders.pending.spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tx.send(o.create(idempotency_key, order));
        });
        match rx.await {
            Ok(created) => created,
            Err(_) => return reply(StatusCode::SERVICE_UNAVAILABLE, &json!({ "error": "shutting down" })),
        }
    };
    let mut resp = reply(StatusCode::CREATED, &created);
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/orders/{}", created["id"])) {
        resp.headers_mut().insert(LOCATION, location);
    }
    resp
}

fn reply(status: StatusCode, body: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_config_is_valid() {
        let addrs = Addrs {
            gateway: "127.0.0.1:0".parse().unwrap(),
            admin: "127.0.0.1:0".parse().unwrap(),
            upstream: "127.0.0.1:9000".parse().unwrap(),
        };
        let dir = tempfile::tempdir().unwrap();
        let token = dir.path().join("a \"quoted\" token");
        write_private(&token, b"0123456789abcdef0123456789abcdef").unwrap();
        let toml = config_toml(&addrs, Path::new("/tmp/a \"quoted\" dir/demo.db"), &token).unwrap();
        let config = Config::from_toml(&toml, "demo", &|_| None).unwrap_or_else(|e| panic!("{e}\n{toml}"));
        assert_eq!(config.routes.len(), 2);
        assert!(config.admin.is_some_and(|a| a.token.is_some()), "the admin API is on");
        assert!(!toml.contains(DEMO_API_KEY), "only the key's sha256 is stored:\n{toml}");
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(shell_quote("/data/demo/idemgate.toml"), "/data/demo/idemgate.toml");
        assert_eq!(shell_quote("/tmp/my demo/x"), "'/tmp/my demo/x'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
