//! The outbox relay: on every replica, takes deliverable events under a lease
//! (never one another relay holds; in order per scope), POSTs each to its
//! route's `[routes.events] url` with a stable `Idemgate-Event-Id` and an
//! HMAC signature, and marks it sent only after a 2xx. A failure backs the
//! event and its destination off exponentially; after `max_attempts` the
//! event is parked (kept, listed, redeliverable), never dropped. A crash
//! between a delivery and its marking re-delivers the same id. A destination
//! that is one of the upstreams shares that upstream's concurrency limit.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::join_all;
use http::{HeaderValue, Method, Request, Uri};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::outbox::{EventsConfig, OutboxEvent, batch_payload, payload, signature};
use crate::request::route::Route;
use crate::retry::Backoff;
use crate::store::Store;
use crate::telemetry::metrics::Metrics;
use crate::upstream::Upstream;
use crate::upstream::body::Body;
use crate::upstream::limit::{Limit, Permit};
use crate::upstream::side_client::{self, SideClient};
use tokio::sync::Semaphore;

/// POSTs per round at most (they go out at once): a round takes this many
/// POSTs' worth of events, `batch` events each for the route with the
/// smallest `batch`.
const POSTS: u32 = 256;
/// Events taken per round at most. Each round costs the store a take, a
/// lease and a settling whatever it carries, so a round of many events
/// costs less per event: a relay behind its writers takes full rounds.
const MOST: u32 = 1024;
/// The pause after a round that took less than half a batch: the relay is
/// caught up, and its next take waits for a few more events (fewer
/// statements, commits and posts per event); a relay whose take left events
/// behind takes again at once.
const LINGER: Duration = Duration::from_millis(25);
/// The poll interval while nothing is deliverable.
const IDLE: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
/// The wait of an event (and its destination) after a failure, jittered:
/// relays of several replicas do not return to a receiver in step.
const RETRY: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(60));

/// The longest wait a receiver's `Retry-After` is followed for: a longer
/// one (a date far ahead, a mistyped number) is cut to it.
const RETRY_AFTER_MOST: Duration = Duration::from_secs(15 * 60);

/// The most of a redirect's `Location` a delivery's error quotes.
const LOCATION_MOST: usize = 200;

/// Why a receiver's answer other than 2xx failed a delivery: its status,
/// and for a redirect where it points (redirects are not followed: a
/// framework that redirects `/hook` to `/hook/`, or http to https, would
/// otherwise fail every delivery with a bare "answered 308").
fn answered(status: http::StatusCode, headers: &http::HeaderMap) -> String {
    let location = headers.get(http::header::LOCATION).and_then(|v| v.to_str().ok()).filter(|_| status.is_redirection());
    match location {
        Some(to) => {
            let to: String = to.chars().take(LOCATION_MOST).collect();
            format!("answered {}, a redirect to {to} (not followed: set [routes.events] url to where it points)", status.as_u16())
        }
        None => format!("answered {}", status.as_u16()),
    }
}

/// How long a receiver's answer asks to be left alone (`Retry-After`,
/// RFC 9110: seconds, or an HTTP date, from `now`), at most
/// [`RETRY_AFTER_MOST`]; `None` without one, or with one not understood.
fn retry_after(headers: &http::HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(http::header::RETRY_AFTER)?.to_str().ok()?.trim();
    let wait = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        httpdate::parse_http_date(value).ok()?.duration_since(now).unwrap_or_default()
    };
    Some(wait.min(RETRY_AFTER_MOST))
}

pub struct Relay {
    store: Store,
    metrics: Arc<Metrics>,
    /// Routes that emit events, by operation.
    routes: HashMap<Arc<str>, Arc<EventsConfig>>,
    client: SideClient,
    /// Destinations that failed lately.
    backoff: Backoffs,
    /// Per receiver, its POSTs in flight ([`EventsConfig::concurrency`], the
    /// smallest of the routes posting there); none for a receiver that is
    /// one of the upstreams (its limit paces it).
    receivers: HashMap<Uri, Arc<Semaphore>>,
    /// Routes whose destination is one of the upstreams (same scheme, host
    /// and port): deliveries there count against that upstream's
    /// concurrency limit, so events never add to its overload.
    limits: HashMap<Arc<str>, Arc<Limit>>,
    /// Receivers that refused a POST as too large.
    caps: Caps,
}

impl Relay {
    /// `None` when no route emits events. `upstreams`: whose limits a
    /// delivery to the same origin shares.
    pub fn new(routes: &[Arc<Route>], upstreams: &[Upstream], store: Store, metrics: Arc<Metrics>) -> Option<Relay> {
        let routes: HashMap<Arc<str>, Arc<EventsConfig>> =
            routes.iter().filter_map(|r| r.background.events.as_ref().map(|e| (r.operation.clone(), Arc::new(e.clone())))).collect();
        if routes.is_empty() {
            return None;
        }
        let limits: HashMap<Arc<str>, Arc<Limit>> = routes
            .iter()
            .filter_map(|(op, e)| {
                let upstream = upstreams.iter().find(|u| same_origin(&u.config.url, &e.url))?;
                Some((op.clone(), upstream.limit().clone()))
            })
            .collect();
        let client = side_client::build(Duration::from_secs(5));
        // A receiver that is one of the upstreams is paced by that upstream's
        // limit: a POST there holds one of its slots from the take on, and a
        // turn waited for beside it would hold the slot idle, away from the
        // requests the upstream serves.
        let mut concurrency: HashMap<Uri, usize> = HashMap::new();
        for (_, e) in routes.iter().filter(|(op, _)| !limits.contains_key(*op)) {
            let n = concurrency.entry(e.url.clone()).or_insert(e.concurrency);
            *n = (*n).min(e.concurrency);
        }
        let receivers = concurrency.into_iter().map(|(url, n)| (url, Arc::new(Semaphore::new(n.max(1))))).collect();
        Some(Relay { store, metrics, routes, client, backoff: Backoffs::default(), receivers, limits, caps: Caps::default() })
    }

    /// Events taken per round: [`POSTS`] POSTs' worth for the route whose
    /// POSTs carry the fewest ([`Caps::per_post`]), at most [`MOST`].
    fn round(&self) -> u32 {
        let per_post = self.routes.values().map(|e| self.caps.per_post(e)).min().unwrap_or(1);
        u32::try_from(per_post).unwrap_or(u32::MAX).saturating_mul(POSTS).min(MOST)
    }

    /// `dest`'s receiver refused `n` events in one POST as too large, and
    /// took `taken` at most in one of the parts sent after.
    fn refused_as_too_large(&self, dest: &EventsConfig, n: usize, taken: usize) {
        if let Some(cap) = self.caps.refused(dest, n, taken) {
            tracing::warn!(
                url = %dest.url, refused = n, per_post = cap,
                "the event receiver refused a POST as too large (413): POSTs to it carry at most {cap} events until a restart \
                 or reload; set [routes.events] batch to at most that"
            );
        }
    }

    /// Takes this round's events in one take: up to a batch, of the routes
    /// in `ready`. For the routes whose destination is one of the upstreams,
    /// a slot is one POST (up to the routes' `batch` events): with none free
    /// the relay first waits its turn for one, as a request would, and an
    /// upstream whose wait ends without one is left out of this round. The
    /// slots of the POSTs taken go into `slots` until the round's deliveries
    /// end; events beyond them are returned apart, to be deferred; and
    /// whether the store's take left deliverable events behind. (On
    /// PostgreSQL the log's lanes are read in order, so the events of routes
    /// left out of a take are set aside into the retry table.)
    async fn take(
        &self,
        ready: &[&str],
        lease: Duration,
        token: Uuid,
        slots: &mut Vec<Permit>,
    ) -> Result<(Vec<OutboxEvent>, Vec<OutboxEvent>, bool), crate::store::StoreError> {
        // Per upstream: its limit, how many events one POST carries (the
        // smallest `batch` of the routes sharing it), the turn waited for,
        // and whether it is in this round.
        let mut limited: Vec<(&Arc<Limit>, usize, Option<Permit>, bool)> = Vec::new();
        for op in ready {
            let Some(limit) = self.limits.get(*op) else { continue };
            let batch = self.routes.get(*op).map_or(1, |e| self.caps.per_post(e));
            match limited.iter_mut().find(|(l, ..)| Arc::ptr_eq(l, limit)) {
                Some((_, per_post, ..)) => *per_post = (*per_post).min(batch),
                None => limited.push((limit, batch, None, true)),
            }
        }
        // Free slots are looked at, not held, while the store is asked: a
        // request arriving meanwhile must not find them taken by a take that
        // may find nothing. With none free, wait a turn: for every such
        // upstream at once, so that no turn won is held idle while another
        // upstream's is waited for.
        let waits = join_all(
            limited.iter().map(|(limit, ..)| async move { if limit.available() == 0 { Some(limit.wait_turn().await) } else { None } }),
        )
        .await;
        for ((_, _, turn, serves), waited) in limited.iter_mut().zip(waits) {
            if let Some(waited) = waited {
                *serves = waited.is_some();
                *turn = waited;
            }
        }
        let serves = |op: &&str| match self.limits.get(*op) {
            None => true,
            Some(limit) => limited.iter().any(|(l, _, _, serves)| *serves && Arc::ptr_eq(l, limit)),
        };
        let ops: Vec<&str> = ready.iter().copied().filter(serves).collect();
        if ops.is_empty() {
            return Ok((Vec::new(), Vec::new(), false));
        }
        // When every route in the round posts to an upstream, the round takes
        // no more than its free slots (and the turns won) carry: events beyond
        // them would only be set aside (on PostgreSQL, copied to be retried).
        let want = if ops.iter().all(|op| self.limits.contains_key(*op)) {
            let room = limited
                .iter()
                .filter(|(.., serves)| *serves)
                .map(|(limit, per_post, turn, _)| {
                    (u64::from(limit.available()) + u64::from(turn.is_some())).saturating_mul(u64::try_from(*per_post).unwrap_or(u64::MAX))
                })
                .fold(0, u64::saturating_add);
            u32::try_from(room).unwrap_or(u32::MAX).clamp(1, self.round())
        } else {
            self.round()
        };
        let (taken, more) = self.store.take_events_more(&ops, want, lease, token).await?;
        // Events per upstream in the take's order, and room for them: one
        // POST per slot (the turn first, then slots free now; one that
        // another took meanwhile is not waited for).
        let mut room: Vec<usize> = vec![0; limited.len()];
        let (mut events, mut later) = (Vec::new(), Vec::new());
        for event in taken {
            let Some(limit) = self.limits.get(&*event.scope.operation) else {
                events.push(event);
                continue;
            };
            let Some(i) = limited.iter().position(|(l, ..)| Arc::ptr_eq(l, limit)) else {
                later.push(event);
                continue;
            };
            if room[i] == 0 {
                let (limit, per_post, turn, _) = &mut limited[i];
                if let Some(permit) = turn.take().or_else(|| limit.try_acquire()) {
                    slots.push(permit);
                    room[i] = *per_post;
                }
            }
            if room[i] == 0 {
                later.push(event);
            } else {
                room[i] -= 1;
                events.push(event);
            }
        }
        Ok((events, later, more))
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
            let ready: Vec<&str> = self.routes.iter().filter(|(_, e)| !self.backoff.waiting(&e.url, now)).map(|(op, _)| &**op).collect();
            let mut slots = Vec::new();
            let taken = if ready.is_empty() { Ok(Default::default()) } else { self.take(&ready, lease, token, &mut slots).await };
            match taken {
                Ok((events, later, more)) if !events.is_empty() || !later.is_empty() => {
                    idle_rounds = 1;
                    // Caught up: a small take that left nothing behind (on
                    // PostgreSQL a take that stopped in a lane's batch, or set
                    // events aside, e.g. a backed-off route's, did).
                    let caught_up = !more && events.len() + later.len() < self.round() as usize / 2;
                    self.defer(later.iter().map(|e| e.seq).collect(), token).await;
                    // At most one event per scope is deliverable at a time, so the
                    // deliveries can go out concurrently (and several events of
                    // different scopes share one) without reordering a scope.
                    let deliveries = group(&self.routes, &events, |dest| self.caps.per_post(dest));
                    let outcomes = join_all(deliveries.iter().map(|d| self.deliver(d))).await;
                    // A round is recorded in four steps: the first attempts
                    // that failed (one statement for each POST's), the events
                    // of POSTs that found no turn of their receiver (deferred,
                    // no attempt), then every delivered event (one statement:
                    // one commit per round, not one per event), then the
                    // retried events that failed, one by one. On PostgreSQL's
                    // log a lane goes on only over events delivered or copied
                    // to be retried, in the statement that says so: delivered
                    // events marked before an earlier failure of their lane
                    // was copied would be read again and sent twice. Retried
                    // events are in no lane, so they come last, when the
                    // round's lanes are let go. Each failing destination is
                    // backed off once a round.
                    let mut delivered = Vec::new();
                    let mut failures = Vec::new();
                    // Each failing destination, and the longest wait its
                    // answers asked for (`Retry-After`).
                    let mut failing: Vec<(Uri, Option<Duration>)> = Vec::new();
                    let mut answering: Vec<Uri> = Vec::new();
                    let mut unsent = Vec::new();
                    for (d, parts) in deliveries.iter().zip(outcomes) {
                        for (part, outcome) in parts {
                            let events = &d.events[part];
                            match outcome {
                                Sent::Delivered => {
                                    delivered.extend(events.iter().copied());
                                    answering.push(d.dest.url.clone());
                                }
                                Sent::NoTurn => unsent.extend(events.iter().map(|e| e.seq)),
                                // The receiver answers; this event is too large for it.
                                Sent::TooLarge(why) => {
                                    answering.push(d.dest.url.clone());
                                    failures.push((events, why, None));
                                }
                                Sent::Failed(why, wait) => {
                                    match failing.iter_mut().find(|(u, _)| *u == d.dest.url) {
                                        Some((_, longest)) => *longest = (*longest).max(wait),
                                        None => failing.push((d.dest.url.clone(), wait)),
                                    }
                                    failures.push((events, why, wait));
                                }
                            }
                        }
                    }
                    drop(slots);
                    let mut retried = Vec::new();
                    for (events, why, wait) in &failures {
                        let (first, again): (Vec<&OutboxEvent>, Vec<&OutboxEvent>) = events.iter().partition(|e| e.attempts == 0);
                        self.first_attempts_failed(&first, why, token, *wait).await;
                        retried.extend(again.into_iter().map(|e| (e, why, *wait)));
                    }
                    self.defer(unsent, token).await;
                    self.mark_delivered(&delivered, token).await;
                    for (event, why, wait) in retried {
                        self.failed(event, why, token, wait).await;
                    }
                    let now = tokio::time::Instant::now();
                    for url in answering.into_iter().filter(|u| !failing.iter().any(|(f, _)| f == u)) {
                        self.backoff.delivered(&url);
                    }
                    for (url, wait) in failing {
                        self.backoff.failed(url, now, wait);
                    }
                    if caught_up {
                        tokio::select! {
                            _ = shutdown.cancelled() => break,
                            _ = tokio::time::sleep(LINGER) => {}
                        }
                    }
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

    /// One delivery: a POST of its events, and how each part of them went.
    /// It waits for one of its receiver's turns first, at most half its
    /// timeout (so that a round ends within its events' lease: the wait,
    /// then the POST's own timeout); a delivery that gets none is not sent,
    /// and its events wait for a later round.
    ///
    /// A POST of several events that the receiver refuses as too large (413)
    /// is sent again as two halves, in order and in the same turn, down to
    /// one event a POST: each part's answer is its events' (a single event
    /// refused so fails, [`Sent::TooLarge`]). The halves share the POST's
    /// `timeout`: a part is sent only while half of it is left, and none
    /// after a part failed for another reason than its size (the receiver may
    /// be down, or have asked for a wait); the parts not sent wait for a
    /// later round, as without a turn, no attempt counted. Then the
    /// receiver's POSTs carry fewer events ([`Caps::refused`]), unless each
    /// refused part held an event refused alone (one event too large for the
    /// receiver says nothing of how many others it takes).
    async fn deliver(&self, d: &Delivery<'_>) -> Vec<(Range<usize>, Sent)> {
        let whole = 0..d.events.len();
        let _turn = match self.receivers.get(&d.dest.url) {
            Some(turns) => match tokio::time::timeout(d.dest.timeout / 2, turns.clone().acquire_owned()).await {
                Ok(Ok(turn)) => Some(turn),
                Ok(Err(_)) | Err(_) => return vec![(whole, Sent::NoTurn)],
            },
            None => None,
        };
        let deadline = tokio::time::Instant::now() + d.dest.timeout;
        let mut outcomes = Vec::new();
        // Parts still to send, the next one last.
        let mut parts = vec![whole];
        // The parts of several events refused as too large, the events
        // refused alone, and the largest part taken.
        let (mut refused, mut alone, mut taken) = (Vec::new(), Vec::new(), 0);
        let mut stop = false;
        while let Some(part) = parts.pop() {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if stop || (!refused.is_empty() && left < d.dest.timeout / 2) {
                outcomes.push((part, Sent::NoTurn));
                continue;
            }
            match self.post(&d.dest, &d.events[part.clone()], left).await {
                Ok(()) => {
                    taken = taken.max(part.len());
                    outcomes.push((part, Sent::Delivered));
                }
                Err(failure) if failure.too_large && part.len() > 1 => {
                    refused.push(part.clone());
                    let middle = part.start + part.len().div_ceil(2);
                    parts.push(middle..part.end);
                    parts.push(part.start..middle);
                }
                Err(failure) if failure.too_large => {
                    // One event too large for the receiver says nothing of
                    // the others, nor of the receiver.
                    alone.push(part.start);
                    outcomes.push((part, Sent::TooLarge(failure.why)));
                }
                Err(failure) => {
                    stop = true;
                    outcomes.push((part, Sent::Failed(failure.why, failure.wait)));
                }
            }
        }
        // The smallest part refused for its count, not for one of its events.
        let counted = refused.iter().filter(|part| !alone.iter().any(|i| part.contains(i))).map(|part| part.len()).min();
        if let Some(refused) = counted {
            self.refused_as_too_large(&d.dest, refused, taken);
        }
        outcomes
    }

    /// One POST of `events` to `dest`, answered within `timeout`: `Ok(())`
    /// on a 2xx, else why not.
    async fn post(&self, dest: &EventsConfig, events: &[&OutboxEvent], timeout: Duration) -> Result<(), Refused> {
        let refused = |why: String| Refused { why, wait: None, too_large: false };
        let single = match events {
            [event] if dest.batch == 1 => Some(*event),
            _ => None,
        };
        let body = match single {
            Some(event) => serde_json::to_vec(&payload(event, dest.include_key)),
            None => serde_json::to_vec(&batch_payload(events, dest.include_key)),
        }
        .map_err(|e| refused(format!("could not write the event as JSON: {e}")))?;
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(dest.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::USER_AGENT, concat!("idemgate/", env!("CARGO_PKG_VERSION")));
        req = match single {
            Some(event) => req.header("idemgate-event-id", event.id.to_string()),
            None => req.header("idemgate-event-count", events.len()),
        };
        if let Some(secret) = &dest.secret {
            let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let sig = signature(secret.expose().as_bytes(), now, &body);
            if let Ok(v) = HeaderValue::from_str(&sig) {
                req = req.header("idemgate-signature", v);
            }
        }
        let req = req.body(Body::full(body)).map_err(|e| refused(format!("invalid request: {e}")))?;
        match tokio::time::timeout(timeout, self.client.request(req)).await {
            Err(_) => Err(refused(format!(
                "no answer within {}",
                humantime::format_duration(Duration::from_millis(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)))
            ))),
            Ok(Err(e)) => Err(refused(crate::upstream::error_chain(&e))),
            Ok(Ok(resp)) if resp.status().is_success() => Ok(()),
            Ok(Ok(resp)) => Err(Refused {
                why: answered(resp.status(), resp.headers()),
                wait: retry_after(resp.headers(), SystemTime::now()),
                too_large: resp.status() == http::StatusCode::PAYLOAD_TOO_LARGE,
            }),
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

    /// Events taken that wait for a slot of their upstream, or for a turn of
    /// their receiver: due again shortly, no attempt counted.
    async fn defer(&self, seqs: Vec<i64>, token: Uuid) {
        if seqs.is_empty() {
            return;
        }
        if let Err(e) = self.store.events_deferred(&seqs, token, RETRY.first).await {
            tracing::warn!(events = seqs.len(), error = %e, "could not defer events; their lease runs out");
        }
    }

    /// Records a failed delivery of `event`: backed off, or parked after its
    /// route's `max_attempts`.
    async fn failed(&self, event: &OutboxEvent, why: &str, token: Uuid, wait: Option<Duration>) {
        let Some(dest) = self.routes.get(&event.scope.operation) else { return };
        let attempts = u32::try_from(event.attempts).unwrap_or(0) + 1;
        let park = attempts >= dest.max_attempts;
        let retry_after = RETRY.jittered(attempts).max(wait.unwrap_or_default());
        self.count_failure(event, why, attempts, park);
        match self.store.event_failed(event.seq, token, why, retry_after, park).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!(event = %event.id, "event lease lost before it was marked"),
            Err(e) => tracing::warn!(event = %event.id, error = %e, "could not mark the event"),
        }
    }

    /// Records a failed delivery of events none of which was attempted
    /// before (one POST's), as [`Self::failed`] does, in one statement where
    /// the store can.
    /// (Routes sharing a destination may park after different numbers of
    /// attempts: those parked now and those due again go apart.)
    async fn first_attempts_failed(&self, events: &[&OutboxEvent], why: &str, token: Uuid, wait: Option<Duration>) {
        let retry_after = RETRY.jittered(1).max(wait.unwrap_or_default());
        for park in [false, true] {
            let these: Vec<&OutboxEvent> = events
                .iter()
                .copied()
                .filter(|e| self.routes.get(&e.scope.operation).is_some_and(|dest| (1 >= dest.max_attempts) == park))
                .collect();
            if these.is_empty() {
                continue;
            }
            for event in &these {
                self.count_failure(event, why, 1, park);
            }
            let seqs: Vec<i64> = these.iter().map(|e| e.seq).collect();
            match self.store.first_attempts_failed(&seqs, token, why, retry_after, park).await {
                Ok(held) => {
                    for event in these.iter().filter(|e| !held.contains(&e.seq)) {
                        tracing::warn!(event = %event.id, "event lease lost before it was marked");
                    }
                }
                Err(e) => tracing::warn!(events = seqs.len(), error = %e, "could not mark the events"),
            }
        }
    }

    /// Logs and counts one failed delivery of `event` (its `attempts`th).
    fn count_failure(&self, event: &OutboxEvent, why: &str, attempts: u32, park: bool) {
        tracing::warn!(event = %event.id, scope = %event.scope.log_id(), error = %why, attempts, park, "event delivery failed");
        self.metrics.event_delivery(if park { "parked" } else { "failed" });
    }
}

/// Destinations that failed lately: one that failed in a round is not tried
/// again for a while, longer after each failing round in a row ([`RETRY`]:
/// from 200 ms, doubling, up to a minute), until a delivery there succeeds.
#[derive(Debug, Default)]
struct Backoffs(HashMap<Uri, (tokio::time::Instant, u32)>);

impl Backoffs {
    /// Whether `url` is not to be tried at `now`.
    fn waiting(&self, url: &Uri, now: tokio::time::Instant) -> bool {
        self.0.get(url).is_some_and(|(until, _)| *until > now)
    }

    /// A round's delivery to `url` failed; its receiver asked for `wait`
    /// (`Retry-After`), if it did.
    fn failed(&mut self, url: Uri, now: tokio::time::Instant, wait: Option<Duration>) {
        let failures = self.0.get(&url).map_or(0, |(_, n)| *n) + 1;
        self.0.insert(url, (now + RETRY.jittered(failures).max(wait.unwrap_or_default()), failures));
    }

    /// A delivery to `url` succeeded (and none failed in its round).
    fn delivered(&mut self, url: &Uri) {
        self.0.remove(url);
    }
}

/// Receivers that refused a POST as too large (413): the most events a POST
/// to each carries from then on, until the relay is replaced (a restart or a
/// reload).
#[derive(Debug, Default)]
struct Caps(Mutex<HashMap<Uri, usize>>);

impl Caps {
    /// The most events one POST to `dest` carries: its `batch`, or fewer
    /// once its receiver refused a POST as too large.
    fn per_post(&self, dest: &EventsConfig) -> usize {
        let cap = self.0.lock().ok().and_then(|caps| caps.get(&dest.url).copied());
        dest.batch.min(cap.unwrap_or(usize::MAX)).max(1)
    }

    /// `dest`'s receiver refused `n` events in one POST as too large (the
    /// smallest such part of a delivery), and took at most `taken` in one of
    /// its parts: POSTs there carry at most `taken` events from now on (fewer
    /// than `n`), or, when it took no part of several, half of `n` (rounded
    /// up). Returns the new cap when it is lower than before.
    fn refused(&self, dest: &EventsConfig, n: usize, taken: usize) -> Option<usize> {
        let cap = if taken > 1 { taken.min(n.saturating_sub(1)) } else { n.div_ceil(2) }.max(1);
        let mut caps = self.0.lock().ok()?;
        let now = caps.entry(dest.url.clone()).or_insert(usize::MAX);
        (cap < *now).then(|| {
            *now = cap;
            cap
        })
    }
}

/// Whether two URLs name the same server (scheme, host and port).
fn same_origin(a: &Uri, b: &Uri) -> bool {
    let port = |u: &Uri| {
        u.port_u16().or_else(|| match u.scheme_str() {
            Some("https") => Some(443),
            Some("http") => Some(80),
            _ => None,
        })
    };
    a.scheme() == b.scheme() && a.host().map(str::to_ascii_lowercase) == b.host().map(str::to_ascii_lowercase) && port(a) == port(b)
}

/// How one delivery went.
#[derive(Debug)]
enum Sent {
    /// Answered 2xx.
    Delivered,
    /// Not sent: no turn of its receiver came in time.
    NoTurn,
    /// Sent, and not answered 2xx: why, and how long the receiver asked to
    /// be left alone (`Retry-After`).
    Failed(String, Option<Duration>),
    /// One event, refused as too large (413): a failed delivery of that
    /// event, not of its receiver (which is not backed off for it).
    TooLarge(String),
}

/// A POST not answered 2xx.
#[derive(Debug)]
struct Refused {
    why: String,
    /// How long the receiver asked to be left alone (`Retry-After`).
    wait: Option<Duration>,
    /// It answered 413: the body was too large for it.
    too_large: bool,
}

/// One POST: events for one destination (one event, or up to its `batch`).
struct Delivery<'a> {
    dest: Arc<EventsConfig>,
    events: Vec<&'a OutboxEvent>,
}

/// A round's events as deliveries: those whose routes share a destination
/// ([`EventsConfig::same_destination`]) go together, up to `per_post` of it
/// (its `batch`, or fewer: [`Caps::per_post`]) per POST, in the order
/// taken. Events of a route that no longer emits are left to their lease.
fn group<'a>(
    routes: &HashMap<Arc<str>, Arc<EventsConfig>>,
    events: &'a [OutboxEvent],
    per_post: impl Fn(&EventsConfig) -> usize,
) -> Vec<Delivery<'a>> {
    let mut deliveries: Vec<Delivery<'a>> = Vec::new();
    for event in events {
        let Some(dest) = routes.get(&event.scope.operation) else { continue };
        let most = per_post(dest);
        let open = deliveries.iter_mut().rev().find(|d| d.dest.same_destination(dest) && d.events.len() < most);
        match open {
            Some(d) => d.events.push(event),
            None => deliveries.push(Delivery { dest: dest.clone(), events: vec![event] }),
        }
    }
    deliveries
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::key::{IdempotencyKey, Scope};
    use crate::idempotency::record::Timestamp;
    use crate::outbox::{Delivery as State, EventType};

    #[test]
    fn a_receivers_retry_after_is_read_in_seconds_or_as_a_date_and_capped() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let with = |v: &str| {
            let mut h = http::HeaderMap::new();
            h.insert(http::header::RETRY_AFTER, HeaderValue::from_str(v).unwrap());
            retry_after(&h, now)
        };
        assert_eq!(retry_after(&http::HeaderMap::new(), now), None);
        assert_eq!(with("120"), Some(Duration::from_secs(120)));
        assert_eq!(with(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(with("0"), Some(Duration::ZERO));
        assert_eq!(with("99999999999999999999999"), Some(RETRY_AFTER_MOST), "beyond u64, cut");
        assert_eq!(with("86400"), Some(RETRY_AFTER_MOST), "a day, cut to the most");
        let in_90s = httpdate::fmt_http_date(now + Duration::from_secs(90));
        assert_eq!(with(&in_90s), Some(Duration::from_secs(90)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(90));
        assert_eq!(with(&past), Some(Duration::ZERO), "a date gone by: no wait");
        assert_eq!(with("soon"), None);
        assert_eq!(with("-5"), None);
        assert_eq!(with("1.5"), None);
    }

    fn dest(url: &str, batch: usize) -> Arc<EventsConfig> {
        Arc::new(EventsConfig {
            url: url.parse().unwrap(),
            secret: None,
            timeout: Duration::from_secs(1),
            max_attempts: 3,
            emit: EventType::ALL.to_vec(),
            include_key: false,
            include_body: false,
            batch,
            concurrency: 4,
        })
    }

    fn event(seq: i64, operation: &str) -> OutboxEvent {
        OutboxEvent {
            seq,
            id: Uuid::new_v4(),
            event_type: EventType::Completed,
            scope: Scope {
                tenant: "t".into(),
                principal: "p".into(),
                operation: operation.into(),
                key: IdempotencyKey::new(&format!("k{seq}")).unwrap(),
            },
            generation: None,
            status: Some(201),
            operation_id: None,
            actor: None,
            at: Timestamp(0),
            body: None,
            delivery: State::Pending,
            attempts: 0,
            next_attempt_at: Timestamp(0),
            last_error: None,
            sent_at: None,
        }
    }

    fn shape(deliveries: &[Delivery<'_>]) -> Vec<Vec<i64>> {
        deliveries.iter().map(|d| d.events.iter().map(|e| e.seq).collect()).collect()
    }

    #[test]
    fn a_redirect_says_where_it_points() {
        let mut h = http::HeaderMap::new();
        assert_eq!(answered(http::StatusCode::BAD_GATEWAY, &h), "answered 502");
        h.insert(http::header::LOCATION, HeaderValue::from_static("http://h/hook/"));
        assert_eq!(answered(http::StatusCode::INTERNAL_SERVER_ERROR, &h), "answered 500", "only a redirect's Location counts");
        assert_eq!(
            answered(http::StatusCode::PERMANENT_REDIRECT, &h),
            "answered 308, a redirect to http://h/hook/ (not followed: set [routes.events] url to where it points)"
        );
        let long = format!("http://h/{}", "a".repeat(500));
        h.insert(http::header::LOCATION, HeaderValue::from_str(&long).unwrap());
        assert!(answered(http::StatusCode::FOUND, &h).len() < LOCATION_MOST + 100);
    }

    #[test]
    fn an_origin_is_scheme_host_and_port() {
        let u = |s: &str| s.parse::<Uri>().unwrap();
        assert!(same_origin(&u("http://Orders:80/api"), &u("http://orders/hooks")));
        assert!(same_origin(&u("https://h/x"), &u("https://h:443/y")));
        assert!(!same_origin(&u("http://h:8080/"), &u("http://h:8081/")));
        assert!(!same_origin(&u("http://h/"), &u("https://h/")));
    }

    #[test]
    fn one_event_per_post_unless_the_route_batches() {
        let routes = HashMap::from([(Arc::from("a"), dest("http://h/a", 1))]);
        let events: Vec<OutboxEvent> = (1..=3).map(|s| event(s, "a")).collect();
        assert_eq!(shape(&group(&routes, &events, |d| d.batch)), vec![vec![1], vec![2], vec![3]]);
    }

    #[test]
    fn routes_sharing_a_destination_share_posts_up_to_the_batch() {
        let routes = HashMap::from([
            (Arc::from("a"), dest("http://h/hook", 2)),
            (Arc::from("b"), dest("http://h/hook", 2)),
            (Arc::from("c"), dest("http://other/hook", 2)),
        ]);
        let events = vec![event(1, "a"), event(2, "c"), event(3, "b"), event(4, "a"), event(5, "c"), event(6, "gone")];
        // 6's route emits no more: left to its lease.
        assert_eq!(shape(&group(&routes, &events, |d| d.batch)), vec![vec![1, 3], vec![2, 5], vec![4]]);
    }

    #[test]
    fn a_receiver_that_refused_a_post_as_too_large_gets_fewer_events_a_post() {
        let routes = HashMap::from([(Arc::from("a"), dest("http://h/a", 50))]);
        let events: Vec<OutboxEvent> = (1..=5).map(|s| event(s, "a")).collect();
        assert_eq!(shape(&group(&routes, &events, |d| d.batch)), vec![vec![1, 2, 3, 4, 5]]);
        assert_eq!(shape(&group(&routes, &events, |_| 2)), vec![vec![1, 2], vec![3, 4], vec![5]]);
        let caps = Caps::default();
        let (hook, other) = (dest("http://h/a", 50), dest("http://h/b", 50));
        assert_eq!(caps.per_post(&hook), 50);
        assert_eq!(caps.refused(&hook, 20, 10), Some(10), "the largest part taken");
        assert_eq!(caps.refused(&hook, 9, 1), Some(5), "without a part of several taken: half the refused count, rounded up");
        assert_eq!(caps.refused(&hook, 4, 6), Some(3), "fewer than were refused, whatever was taken");
        assert_eq!(caps.per_post(&hook), 3);
        assert_eq!(caps.refused(&hook, 9, 0), None, "a larger count refused lowers nothing");
        assert_eq!(caps.refused(&hook, 2, 0), Some(1));
        assert_eq!(caps.refused(&hook, 1, 0), None);
        assert_eq!((caps.per_post(&hook), caps.per_post(&other)), (1, 50), "per receiver");
        assert_eq!(shape(&group(&routes, &events, |d| caps.per_post(d))), vec![vec![1], vec![2], vec![3], vec![4], vec![5]]);
    }

    #[test]
    fn a_different_key_shape_or_bound_is_another_destination() {
        let mut signed = (*dest("http://h/hook", 5)).clone();
        signed.secret = Some(crate::secret::Secret::new("k".to_owned()));
        let mut keyed = (*dest("http://h/hook", 5)).clone();
        keyed.include_key = true;
        let routes = HashMap::from([
            (Arc::from("a"), dest("http://h/hook", 5)),
            (Arc::from("b"), Arc::new(signed)),
            (Arc::from("c"), Arc::new(keyed)),
            (Arc::from("d"), dest("http://h/hook", 4)),
        ]);
        let events = vec![event(1, "a"), event(2, "b"), event(3, "c"), event(4, "d"), event(5, "a")];
        assert_eq!(shape(&group(&routes, &events, |d| d.batch)), vec![vec![1, 5], vec![2], vec![3], vec![4]]);
    }

    /// A receiver that keeps failing waits longer after each failing round,
    /// also once its wait has run out (the count used to go with the wait,
    /// so every wait was the first one's), until a delivery succeeds.
    #[test]
    fn a_failing_receivers_wait_grows_until_it_answers() {
        let url: Uri = "http://h/hook".parse().unwrap();
        let mut b = Backoffs::default();
        let mut now = tokio::time::Instant::now();
        let mut waits = Vec::new();
        for _ in 0..6 {
            assert!(!b.waiting(&url, now));
            b.failed(url.clone(), now, None);
            let until = b.0[&url].0;
            waits.push(until - now);
            assert!(b.waiting(&url, now));
            now = until;
        }
        // Jittered into the upper half of 200 ms, 400 ms, ... 6.4 s.
        for (i, w) in waits.iter().enumerate() {
            let full = RETRY.after(u32::try_from(i).unwrap() + 1);
            assert!(*w >= full / 2 && *w <= full, "wait {i}: {w:?} against {full:?}");
        }
        assert!(waits[5] > Duration::from_secs(3), "{waits:?}");
        b.delivered(&url);
        b.failed(url.clone(), now, None);
        assert!(b.0[&url].0 - now <= RETRY.after(1), "a success starts the count again");
    }
}
