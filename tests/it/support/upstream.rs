//! A real HTTP upstream for tests that keeps a ledger of side effects.
//!
//! Every POST/PUT/PATCH/DELETE is one side effect, counted under the
//! `Idempotency-Key` it arrived with *before* anything can lose the response.
//! Methods are read case-insensitively (`post` is a POST), as frameworks that
//! upper-case the method do, and the path each write arrived on is kept.
//! Request headers steer the answer (they reach the upstream unchanged):
//! - `x-test-status: N`      answer with status N
//! - `x-test-sleep-ms: N`    wait N ms after the side effect, then answer
//! - `x-test-abort: 1`       after the side effect, close the connection with no answer
//! - `x-test-no-store: 1`    answer with `Idempotency-Policy: no-store`
//! - `x-test-body-bytes: N`  answer with an N-byte body
//! - `x-test-answer-header: name=value`  answer with that header too
//!
//! With `dedupe` on, the upstream honours `Idempotency-Key` itself: a key it
//! has seen is answered again at once (no sleep, no abort) without a new side
//! effect. [`TestUpstream::set_dedupe_path`] turns that on for the writes of
//! one path only.
//!
//! A by-key lookup answers reconciliation probes: `GET .../by-key/{key}` is
//! `200` with the response of the first side effect under that
//! `Idempotency-Key` (the same body the write answered, so a probe records
//! exactly what the client would have got), `404` if there was none, or the
//! status set with [`TestUpstream::set_probe_status`]. Every lookup is counted
//! per key and its path kept. With [`TestUpstream::set_commit_at_end`] a slow
//! write (`x-test-sleep-ms`) commits its order only when its work is done, as
//! a real service does: the lookup answers `404` while the work runs, and the
//! work finishes (and commits) even if the caller hangs up or is killed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

/// What the upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Received {
    pub key: String,
    /// The path and query the write arrived on, exactly as sent.
    pub path: String,
    pub generation: Option<String>,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// When it arrived.
    pub at: std::time::Instant,
    /// It was a side effect (not answered from the upstream's own deduplication).
    pub executed: bool,
}

#[derive(Default)]
struct State {
    /// `GET /v1/orders/{n}` answers with this version of the order.
    resource_version: AtomicU64,
    /// Authorization values refused (403) by `GET /v1/orders/{n}`.
    revoked: Mutex<Vec<String>>,
    ledger: Mutex<HashMap<String, u64>>,
    total: AtomicU64,
    requests: Mutex<Vec<Received>>,
    dedupe: AtomicBool,
    /// The first side effect's answer (body, Location) under each key.
    orders: Mutex<HashMap<String, (Bytes, String)>>,
    /// By-key lookups: (key, path, when), in order.
    probes: Mutex<Vec<(String, String, std::time::Instant)>>,
    /// Answer lookups with this status instead (0: normally).
    probe_status: std::sync::atomic::AtomicU16,
    /// Lookups are answered after this many ms (0: at once); counted on arrival.
    probe_delay_ms: AtomicU64,
    /// Writes on these paths are deduplicated by key (as with `dedupe`).
    dedupe_paths: Mutex<std::collections::HashSet<String>>,
    /// A slow write's order is visible to lookups only once its work is done.
    commit_at_end: AtomicBool,
}

pub struct TestUpstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    received: broadcast::Sender<Received>,
    stop: CancellationToken,
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TestUpstream {
    pub async fn start() -> TestUpstream {
        TestUpstream::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    pub async fn start_on(addr: SocketAddr) -> TestUpstream {
        // A fixed address (a test that reserved a port, then freed it) may be
        // held for a moment by a connection's ephemeral end: retry briefly.
        let mut tries = 0;
        let listener = loop {
            let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4() } else { tokio::net::TcpSocket::new_v6() }.expect("socket");
            socket.set_reuseaddr(true).expect("SO_REUSEADDR");
            match socket.bind(addr).and_then(|()| socket.listen(1024)) {
                Ok(l) => break l,
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && addr.port() != 0 && tries < 50 => {
                    tries += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                }
                Err(e) => panic!("bind test upstream on {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let (received, _) = broadcast::channel(1024);
        let stop = CancellationToken::new();
        let (st, tx) = (state.clone(), received.clone());
        super::serve::spawn(listener, stop.clone(), move |req| handle(st.clone(), tx.clone(), req));
        TestUpstream { addr, state, received, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The upstream honours Idempotency-Key itself from now on.
    pub fn set_dedupe(&self, on: bool) {
        self.state.dedupe.store(on, Ordering::SeqCst);
    }

    /// Writes on `path` are deduplicated by key from now on (`false`: no longer).
    pub fn set_dedupe_path(&self, path: &str, on: bool) {
        let mut paths = self.state.dedupe_paths.lock().unwrap();
        if on {
            paths.insert(path.to_owned());
        } else {
            paths.remove(path);
        }
    }

    /// A slow write commits its order (visible to the by-key lookup) only
    /// when its work is done, whether or not its caller is still there.
    pub fn set_commit_at_end(&self, on: bool) {
        self.state.commit_at_end.store(on, Ordering::SeqCst);
    }

    /// The resource `GET /v1/orders/{n}` serves changes (a new version).
    pub fn bump_resource(&self) {
        self.state.resource_version.fetch_add(1, Ordering::SeqCst);
    }

    /// `GET /v1/orders/{n}` refuses this Authorization value from now on.
    pub fn revoke(&self, authorization: &str) {
        self.state.revoked.lock().unwrap().push(authorization.to_owned());
    }

    /// Side effects recorded under this forwarded key.
    pub fn side_effects(&self, forwarded_key: &str) -> u64 {
        self.state.ledger.lock().unwrap().get(forwarded_key).copied().unwrap_or(0)
    }

    /// All side effects.
    pub fn total(&self) -> u64 {
        self.state.total.load(Ordering::SeqCst)
    }

    pub fn ledger(&self) -> HashMap<String, u64> {
        self.state.ledger.lock().unwrap().clone()
    }

    /// Every write request received, in order.
    pub fn requests(&self) -> Vec<Received> {
        self.state.requests.lock().unwrap().clone()
    }

    /// Signals each write request the moment it is received (before answering).
    pub fn subscribe(&self) -> broadcast::Receiver<Received> {
        self.received.subscribe()
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Answer by-key lookups with `status` from now on (`None`: normally).
    pub fn set_probe_status(&self, status: Option<u16>) {
        self.state.probe_status.store(status.unwrap_or(0), Ordering::SeqCst);
    }

    /// Answer by-key lookups `ms` after they arrive from now on (0: at once).
    pub fn set_probe_delay_ms(&self, ms: u64) {
        self.state.probe_delay_ms.store(ms, Ordering::SeqCst);
    }

    /// By-key lookups of this key so far.
    pub fn probes_of(&self, key: &str) -> usize {
        self.state.probes.lock().unwrap().iter().filter(|(k, _, _)| k == key).count()
    }

    /// Every by-key lookup: (key, path, when it arrived).
    pub fn probes(&self) -> Vec<(String, String, std::time::Instant)> {
        self.state.probes.lock().unwrap().clone()
    }
}

/// `GET .../by-key/{key}`: the first side effect's answer under that key.
fn lookup(state: &State, path: &str) -> Response<Full<Bytes>> {
    let key = path.rsplit('/').next().unwrap_or_default().to_owned();
    state.probes.lock().unwrap().push((key.clone(), path.to_owned(), std::time::Instant::now()));
    let forced = state.probe_status.load(Ordering::SeqCst);
    let (status, body, location) = match state.orders.lock().unwrap().get(&key) {
        _ if forced != 0 => (StatusCode::from_u16(forced).unwrap(), Bytes::from_static(b"{\"error\":\"lookup failed\"}"), None),
        Some((body, location)) => (StatusCode::OK, body.clone(), Some(location.clone())),
        None => (StatusCode::NOT_FOUND, Bytes::from_static(b"{\"error\":\"no order under that key\"}"), None),
    };
    let mut r = Response::new(Full::new(body));
    *r.status_mut() = status;
    if let Some(location) = location {
        r.headers_mut().insert("location", location.parse().unwrap());
    }
    r.headers_mut().insert("content-type", "application/json".parse().unwrap());
    r.headers_mut().insert("x-upstream", "lookup".parse().unwrap());
    r.headers_mut().insert("connection", "keep-alive".parse().unwrap());
    r
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

async fn handle(
    state: Arc<State>,
    tx: broadcast::Sender<Received>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let h = &parts.headers;
    let write = matches!(parts.method.as_str().to_ascii_uppercase().as_str(), "POST" | "PUT" | "PATCH" | "DELETE");
    if !write && parts.uri.path().contains("/by-key/") {
        let answer = lookup(&state, parts.uri.path());
        let delay = state.probe_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        return Ok(answer);
    }
    if !write && let Some(n) = parts.uri.path().strip_prefix("/v1/orders/").and_then(|n| n.parse::<u64>().ok()) {
        // The resource a Location points to: refused to revoked credentials.
        let auth = header(h, "authorization").unwrap_or_default().to_owned();
        let (status, body) = if state.revoked.lock().unwrap().contains(&auth) {
            (StatusCode::FORBIDDEN, serde_json::json!({"error": "forbidden"}))
        } else {
            (StatusCode::OK, serde_json::json!({"order": n, "version": state.resource_version.load(Ordering::SeqCst)}))
        };
        let mut r = Response::new(Full::new(Bytes::from(body.to_string())));
        *r.status_mut() = status;
        r.headers_mut().insert("content-type", "application/json".parse().unwrap());
        return Ok(r);
    }
    if !write {
        let mut r = Response::new(Full::new(Bytes::from_static(b"{\"ok\":true,\"passthrough\":true}")));
        r.headers_mut().insert("content-type", "application/json".parse().unwrap());
        r.headers_mut().insert("x-method", parts.method.as_str().parse().unwrap());
        return Ok(r);
    }
    let key = header(h, "idempotency-key").unwrap_or("<none>").to_owned();
    let received = Received {
        key: key.clone(),
        path: parts.uri.path_and_query().map(|pq| pq.as_str().to_owned()).unwrap_or_default(),
        generation: header(h, "x-idempotency-generation").map(str::to_owned),
        headers: h.clone(),
        body: body.clone(),
        at: std::time::Instant::now(),
        executed: true,
    };
    let order = {
        let mut ledger = state.ledger.lock().unwrap();
        let seen = ledger.get(&key).copied().unwrap_or(0);
        let dedupe = state.dedupe.load(Ordering::SeqCst) || state.dedupe_paths.lock().unwrap().contains(parts.uri.path());
        if dedupe && seen > 0 && key != "<none>" {
            None
        } else {
            *ledger.entry(key.clone()).or_insert(0) += 1;
            Some(state.total.fetch_add(1, Ordering::SeqCst) + 1)
        }
    };
    let generation = received.generation.clone();
    let status =
        header(h, "x-test-status").and_then(|v| v.parse().ok()).and_then(|s| StatusCode::from_u16(s).ok()).unwrap_or(StatusCode::CREATED);
    let answer = match header(h, "x-test-body-bytes").and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => Bytes::from(vec![b'x'; n]),
        None => Bytes::from(
            serde_json::json!({
                "order": order,
                "key": key,
                "generation": generation,
                "echo": String::from_utf8_lossy(&body),
            })
            .to_string(),
        ),
    };
    let received = Received { executed: order.is_some(), ..received };
    let sleep_ms: Option<u64> = header(h, "x-test-sleep-ms").and_then(|v| v.parse().ok()).filter(|_| order.is_some());
    let location = format!("/v1/orders/{}", order.unwrap_or(0));
    let commit_at_end = state.commit_at_end.load(Ordering::SeqCst) && sleep_ms.is_some_and(|ms| ms > 0);
    if order.is_some() && !commit_at_end {
        state.orders.lock().unwrap().entry(key.clone()).or_insert((answer.clone(), location.clone()));
    }
    state.requests.lock().unwrap().push(received.clone());
    let _ = tx.send(received);
    // A deduplicated repeat is answered at once, as a deduplicating upstream
    // returns its stored answer (the first execution did the slow work).
    if let Some(ms) = sleep_ms {
        if commit_at_end {
            // The work runs on its own: a caller that hangs up does not undo it.
            let (st, key, answer) = (state.clone(), key.clone(), answer.clone());
            let work = tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                st.orders.lock().unwrap().entry(key).or_insert((answer, location));
            });
            let _ = work.await;
        } else {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
    }
    if header(h, "x-test-abort") == Some("1") && order.is_some() {
        return Err(std::io::Error::other("aborting on purpose"));
    }
    let mut r = Response::new(Full::new(answer));
    *r.status_mut() = status;
    let rh = r.headers_mut();
    rh.insert("content-type", "application/json".parse().unwrap());
    rh.insert("location", format!("/v1/orders/{}", order.unwrap_or(0)).parse().unwrap());
    rh.insert("set-cookie", "session=upstream-secret".parse().unwrap());
    rh.insert("x-upstream", "test".parse().unwrap());
    if header(h, "x-test-no-store") == Some("1") {
        rh.insert("idempotency-policy", "no-store".parse().unwrap());
    }
    if let Some((name, value)) = header(h, "x-test-answer-header").and_then(|v| v.split_once('=')) {
        rh.insert(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
    }
    Ok(r)
}
