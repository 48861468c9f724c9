//! The outbox relay: on every replica, takes deliverable events under a lease
//! (never one another relay holds; in order per scope), POSTs each to its
//! route's `[routes.events] url` with a stable `Idemgate-Event-Id` and an
//! HMAC signature, and marks it sent only after a 2xx. A failure backs the
//! event and its destination off exponentially; after `max_attempts` the
//! event is parked (kept, listed, redeliverable), never dropped. A crash
//! between a delivery and its marking re-delivers the same id.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use http::{HeaderValue, Method, Request, Uri};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outbox::{EventsConfig, OutboxEvent, payload, signature};
use crate::request::route::Route;
use crate::retry::Backoff;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use crate::upstream::body::Body;
use crate::upstream::side_client::{self, SideClient};

/// Events taken per round.
const BATCH: u32 = 128;
/// The poll interval while nothing is deliverable.
const IDLE: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
/// The wait of an event (and its destination) after a failure, jittered:
/// relays of several replicas do not return to a receiver in step.
const RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(60));

pub struct Relay {
    store: Store,
    metrics: Arc<Metrics>,
    /// Routes that emit events, by operation.
    routes: HashMap<Arc<str>, Arc<EventsConfig>>,
    client: SideClient,
    /// Destinations that failed lately: not tried before the instant.
    backoff: HashMap<Uri, (tokio::time::Instant, u32)>,
}

impl Relay {
    /// `None` when no route emits events.
    pub fn new(routes: &[Arc<Route>], store: Store, metrics: Arc<Metrics>) -> Option<Relay> {
        let routes: HashMap<Arc<str>, Arc<EventsConfig>> =
            routes.iter().filter_map(|r| r.events.as_ref().map(|e| (r.operation.clone(), Arc::new(e.clone())))).collect();
        if routes.is_empty() {
            return None;
        }
        let client = side_client::build(Duration::from_secs(5));
        Some(Relay { store, metrics, routes, client, backoff: HashMap::new() })
    }

    /// Delivers until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        tracing::debug!(routes = self.routes.len(), "outbox relay started");
        let token = Uuid::new_v4();
        // Long enough for a delivery and its marking; short enough that a
        // crashed relay's events are soon delivered by another.
        let timeout = self.routes.values().map(|e| e.timeout).max().unwrap_or(Duration::from_secs(5));
        let lease = timeout + timeout.max(Duration::from_secs(1));
        let mut idle_rounds = 1;
        while !shutdown.is_cancelled() {
            let now = tokio::time::Instant::now();
            self.backoff.retain(|_, (until, _)| *until > now);
            let ready: Vec<&str> = self.routes.iter().filter(|(_, e)| !self.backoff.contains_key(&e.url)).map(|(op, _)| &**op).collect();
            let taken = if ready.is_empty() { Ok(Vec::new()) } else { self.store.take_events(&ready, BATCH, lease, token).await };
            match taken {
                Ok(events) if !events.is_empty() => {
                    idle_rounds = 1;
                    // At most one event per scope is deliverable at a time, so the
                    // batch can go out concurrently without reordering a scope.
                    let outcomes = join_all(events.iter().map(|e| self.deliver(e))).await;
                    // The delivered ones are marked in one statement (one
                    // commit per round, not one per event); failures one by one.
                    let mut delivered = Vec::new();
                    for (event, outcome) in events.iter().zip(outcomes) {
                        match outcome {
                            Ok(()) => delivered.push(event),
                            Err(why) => self.failed(event, why, token).await,
                        }
                    }
                    self.mark_delivered(&delivered, token).await;
                }
                Ok(_) => {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(IDLE.after(idle_rounds)) => idle_rounds += 1,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "outbox relay could not take events");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(IDLE.max) => {}
                    }
                }
            }
        }
        tracing::debug!("outbox relay stopped");
    }

    /// One delivery: `Ok(())` on a 2xx, else why not.
    async fn deliver(&self, event: &OutboxEvent) -> Result<(), String> {
        let Some(dest) = self.routes.get(&event.scope.operation) else {
            return Err("the route no longer has [routes.events]".into());
        };
        let body = payload(event, dest.include_key).to_string();
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(dest.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header("idemgate-event-id", event.id.to_string())
            .header(http::header::USER_AGENT, concat!("idemgate/", env!("CARGO_PKG_VERSION")));
        if let Some(secret) = &dest.secret {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let sig = signature(secret.expose().as_bytes(), now, body.as_bytes());
            if let Ok(v) = HeaderValue::from_str(&sig) {
                req = req.header("idemgate-signature", v);
            }
        }
        let req = req.body(Body::full(body)).map_err(|e| format!("invalid request: {e}"))?;
        match tokio::time::timeout(dest.timeout, self.client.request(req)).await {
            Err(_) => Err(format!("no answer within {}", humantime::format_duration(dest.timeout))),
            Ok(Err(e)) => Err(crate::upstream::error_chain(&e)),
            Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
            Ok(Ok(resp)) => Err(format!("answered {}", resp.status().as_u16())),
        }
    }

    /// Marks events sent after their 2xx. One that cannot be marked (lease
    /// lost: another relay took it over; store down: its lease runs out)
    /// stays pending and is delivered again with the same id: at least once.
    async fn mark_delivered(&self, delivered: &[&OutboxEvent], token: Uuid) {
        if delivered.is_empty() {
            return;
        }
        for _ in delivered {
            self.metrics.event_delivery("delivered");
        }
        let seqs: Vec<i64> = delivered.iter().map(|e| e.seq).collect();
        match self.store.events_delivered(&seqs, token).await {
            Ok(marked) => {
                for event in delivered.iter().filter(|e| !marked.contains(&e.seq)) {
                    tracing::warn!(event = %event.id, "event lease lost before it was marked");
                }
            }
            Err(e) => tracing::warn!(events = delivered.len(), error = %e, "could not mark delivered events; they will be delivered again"),
        }
    }

    async fn failed(&mut self, event: &OutboxEvent, why: String, token: Uuid) {
        let Some(dest) = self.routes.get(&event.scope.operation).cloned() else { return };
        let attempts = u32::try_from(event.attempts).unwrap_or(0) + 1;
        let park = attempts >= dest.max_attempts;
        let retry_after = RETRY.jittered(attempts);
        let failures = self.backoff.get(&dest.url).map_or(0, |(_, n)| *n) + 1;
        self.backoff.insert(dest.url.clone(), (tokio::time::Instant::now() + RETRY.jittered(failures), failures));
        tracing::warn!(event = %event.id, scope = %event.scope.log_id(), error = %why, attempts, park, "event delivery failed");
        self.metrics.event_delivery(if park { "parked" } else { "failed" });
        match self.store.event_failed(event.seq, token, &why, retry_after, park).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(event = %event.id, "event lease lost before it was marked"),
            Err(e) => tracing::warn!(event = %event.id, error = %e, "could not mark the event"),
        }
    }
}
