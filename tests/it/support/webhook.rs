//! A webhook receiver for outbox tests: records every delivery (event id,
//! signature, body) and can be told to fail (500), to hold a delivery for a
//! while before answering, or to stop. It also notes deliveries of one event
//! id that overlap in time (two relays delivering one event at once).

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone)]
pub struct Delivery {
    /// `Idemgate-Event-Id` (empty on a batched delivery).
    pub id: String,
    pub signature: Option<String>,
    /// `Idemgate-Event-Count` (batched deliveries only).
    pub count: Option<String>,
    pub body: Bytes,
    /// When it arrived.
    pub at: std::time::Instant,
}

impl Delivery {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("event JSON")
    }

    /// The events of a batched delivery (`{"events": [...]}`).
    pub fn events(&self) -> Vec<serde_json::Value> {
        self.json()["events"].as_array().expect("a batched delivery's events").clone()
    }
}

#[derive(Default)]
struct State {
    deliveries: Mutex<Vec<Delivery>>,
    in_flight: Mutex<HashSet<String>>,
    overlaps: AtomicU64,
    /// 0: answer 200; else this status.
    status: AtomicU16,
    /// Hold each delivery this long before answering.
    hold_ms: AtomicU64,
    /// `Retry-After` on answers other than 200.
    retry_after: Mutex<Option<String>>,
}

pub struct Webhook {
    pub addr: SocketAddr,
    state: Arc<State>,
    received: broadcast::Sender<Delivery>,
    stop: CancellationToken,
}

impl Drop for Webhook {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Webhook {
    pub async fn start() -> Webhook {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind webhook");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(State::default());
        let (received, _) = broadcast::channel(4096);
        let stop = CancellationToken::new();
        let (st, tx) = (state.clone(), received.clone());
        super::serve::spawn(listener, stop.clone(), move |req| handle(st.clone(), tx.clone(), req));
        Webhook { addr, state, received, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// Answer every delivery with this status from now on (200 to heal).
    pub fn answer(&self, status: u16) {
        self.state.status.store(if status == 200 { 0 } else { status }, Ordering::SeqCst);
    }

    /// Send this `Retry-After` with every answer other than 200 (`None`: none).
    pub fn retry_after(&self, value: Option<&str>) {
        *self.state.retry_after.lock().unwrap() = value.map(str::to_owned);
    }

    pub fn hold(&self, d: Duration) {
        self.state.hold_ms.store(u64::try_from(d.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Every delivery received (whatever it was answered), in arrival order.
    pub fn deliveries(&self) -> Vec<Delivery> {
        self.state.deliveries.lock().unwrap().clone()
    }

    /// Distinct event ids received.
    pub fn distinct(&self) -> HashSet<String> {
        self.deliveries().into_iter().map(|d| d.id).collect()
    }

    /// How many times each id arrived.
    pub fn counts(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for d in self.deliveries() {
            *m.entry(d.id).or_insert(0) += 1;
        }
        m
    }

    /// Deliveries of one id that arrived while another of the same id was still open.
    pub fn overlaps(&self) -> u64 {
        self.state.overlaps.load(Ordering::SeqCst)
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Delivery> {
        self.received.subscribe()
    }
}

async fn handle(
    state: Arc<State>,
    tx: broadcast::Sender<Delivery>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let header = |n: &str| parts.headers.get(n).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let d = Delivery {
        id: header("idemgate-event-id").unwrap_or_default(),
        signature: header("idemgate-signature"),
        count: header("idemgate-event-count"),
        body,
        at: std::time::Instant::now(),
    };
    if !d.id.is_empty() && !state.in_flight.lock().unwrap().insert(d.id.clone()) {
        state.overlaps.fetch_add(1, Ordering::SeqCst);
    }
    state.deliveries.lock().unwrap().push(d.clone());
    let _ = tx.send(d.clone());
    let hold = state.hold_ms.load(Ordering::SeqCst);
    if hold > 0 {
        tokio::time::sleep(Duration::from_millis(hold)).await;
    }
    state.in_flight.lock().unwrap().remove(&d.id);
    let status = match state.status.load(Ordering::SeqCst) {
        0 => StatusCode::OK,
        s => StatusCode::from_u16(s).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
    };
    let mut r = Response::new(Full::new(Bytes::from_static(b"ok")));
    *r.status_mut() = status;
    if let (false, Some(wait)) = (status == StatusCode::OK, state.retry_after.lock().unwrap().clone()) {
        r.headers_mut().insert(http::header::RETRY_AFTER, http::HeaderValue::from_str(&wait).expect("a Retry-After value"));
    }
    Ok(r)
}
