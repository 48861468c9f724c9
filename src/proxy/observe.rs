//! Observe mode (`mode = "observe"` on a route): a rollout step before
//! enforcing. Every request passes through untouched, like pass-through (the
//! upstream's answer, streamed, is the client's answer: never a 409, never a
//! replay), while idemgate works out what enforcing would have done:
//!
//! 1. It admits the request by enforcing's own steps
//!    ([`crate::proxy::admission`]: identity, key, fingerprint, scope, claim
//!    request), reading the body within `server.max_request_body` (a larger
//!    or slower body passes on unobserved).
//! 2. It claims the scope as an ordinary synchronous claim would, on a tracked
//!    task, and waits for the claim at most the route's `observe_budget`. A
//!    claim that finds a record is decided by [`crate::idempotency::record::decide`] and
//!    counted in `idemgate_observe_would_total{would}` with a log line (the
//!    scope hashed, never the key). Over budget or store down: the request
//!    passes and `idemgate_observe_skipped_total` counts it.
//! 3. A request whose claim succeeded (even after the budget) has the
//!    upstream's answer classified by the executor's own classifier
//!    ([`crate::executor::classify`]) and recorded as it would be: completed
//!    (the body kept up to `max_stored_response`), released (a
//!    `release_on_status` status, `Idempotency-Policy: no-store`, or a request
//!    that never left), or `unknown` (sent, answer lost). The answer is copied
//!    as it streams to the client (`Tee`) and written by the tracked task
//!    afterwards, so recording never delays the client either. Switching the
//!    route to enforcing later finds these records as valid history.
//!
//! Requests enforcing would refuse before any claim (no identity, missing or
//! invalid key, a body the fingerprint refuses) are counted in
//! `idemgate_observe_would_refuse_total{reason}`.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, Response, request};
use http_body_util::BodyExt;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, oneshot};
use tokio_util::task::TaskTracker;

use crate::executor::classify::{self, Class, SyncWrite};
use crate::idempotency::outcome::Would;
use crate::idempotency::record::{Decision, Record, StoredResponse, Timestamp};
use crate::problem::{self, GatewayError};
use crate::proxy::admission::{self, Admitted, Front, Held, Stop, decide_with_legacy};
use crate::proxy::passthrough;
use crate::proxy::state::{Configured, Shared};
use crate::request::identity::Identity;
use crate::request::route::Route;
use crate::store::{Claim, ClaimOutcome, ClaimRequest, Store, WriteOutcome};
use crate::telemetry::metrics::Metrics;
use crate::upstream::Upstream;
use crate::upstream::body::{Body, BoxError, Streamed};
use crate::upstream::headers;

/// What the claim found, as the request path learns it.
#[derive(Debug)]
enum Decided {
    /// This request holds the claim: its answer is to be recorded.
    Claimed,
    /// Another record holds the scope (read at the store's time); enforcing
    /// would have answered from it.
    Found(Box<(Record, Timestamp)>),
    /// The store could not be reached (nothing is held).
    Failed,
}

/// The upstream's answer to an observed request that holds a claim, as the
/// executor would classify it.
#[derive(Debug)]
enum Captured {
    /// Status, storable headers, and the body if it was read whole within
    /// `max_stored_response` (else `None`, as for an oversized response).
    Answered(StoredResponse),
    /// A `release_on_status` status or `Idempotency-Policy: no-store`.
    Declined,
    /// The request never left idemgate.
    NotSent,
    /// It was sent, and the answer is lost (timeout, broken connection).
    MaybeExecuted,
}

impl Captured {
    /// The executor's class of this answer.
    fn class(&self) -> Class {
        match self {
            Captured::Answered(_) => Class::Answered,
            Captured::Declined => Class::Declined { no_store: false },
            Captured::NotSent => Class::NotSent,
            Captured::MaybeExecuted => Class::MaybeExecuted,
        }
    }
}

/// Observe mode's phases of admission (see [`crate::proxy::admission`]):
/// no authorizer is asked (observe mode changes no answer), the body is read
/// within `server.max_request_body` and `request_body_timeout` (past either
/// the request passes on unobserved), and under load an observation needs
/// one of this process's slots.
struct Observe<'a> {
    shared: &'a Shared,
    configured: &'a Configured,
}

/// Why observe mode stopped observing a request.
#[derive(Debug)]
enum Skip {
    /// Passed on unobserved.
    Unobserved(&'static str),
    /// The client's body broke off: pass-through would have failed the same way.
    Broken,
}

impl Front for Observe<'_> {
    type Slot = OwnedSemaphorePermit;
    type Halt = Skip;

    async fn authorize(&mut self, _: &Route, _: &Request<Incoming>, _: &Identity) -> Result<(), Skip> {
        Ok(())
    }

    async fn read_body(&mut self, _: &Route, parts: request::Parts, body: Incoming) -> Result<(request::Parts, Bytes), (Skip, Held)> {
        let c = self.configured;
        match read_within(body, &parts.headers, c.max_request_body, c.request_body_timeout).await {
            Read::Whole(bytes) => Ok((parts, bytes)),
            Read::Partial(body) => {
                Err((Skip::Unobserved("request body over max_request_body or slower than request_body_timeout"), Held::Read(parts, body)))
            }
            Read::Broken => Err((Skip::Broken, Held::Read(parts, Body::empty()))),
        }
    }

    async fn load(&mut self, _: &Route, _: &ClaimRequest) -> Result<OwnedSemaphorePermit, Skip> {
        self.shared.observations.clone().try_acquire_owned().map_err(|_| Skip::Unobserved("too many observations running"))
    }
}

/// Passes the request through to `upstream` and observes it, waiting for
/// the claim at most `budget` (the route's `observe_budget`). Never answers
/// anything the upstream (or plain pass-through) would not.
#[allow(clippy::too_many_arguments)]
pub async fn observe(
    shared: &Shared,
    configured: &Configured,
    upstream: &Upstream,
    budget: Duration,
    route: &Arc<Route>,
    params: Vec<(String, String)>,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    // The same admission as enforcing: what it would refuse is counted and
    // passed on.
    let mut front = Observe { shared, configured };
    let (admitted, slot) =
        match admission::admit(&mut front, &configured.identifier, &configured.replica_id, route, params, req, peer).await {
            Ok(admitted) => admitted,
            Err(stop) => return pass_on(shared, configured, route, upstream, stop).await,
        };
    let Admitted { claim, params, parts, body, .. } = *admitted;
    let metrics = &shared.metrics;
    let request_hash = claim.request_hash;
    let request = admission::request_parts(route, &params, &parts, &body);
    let log_id = claim.scope.log_id();
    let (decided_tx, decided_rx) = oneshot::channel();
    let (captured_tx, captured_rx) = oneshot::channel();
    let (store, tracker) = (configured.store.clone(), shared.tracker.clone());
    shared.tracker.spawn(observation(store, tracker, route.clone(), claim, decided_tx, captured_rx, slot));
    let capture = match tokio::time::timeout(budget, decided_rx).await {
        Ok(Ok(Decided::Claimed)) => true,
        Ok(Ok(Decided::Found(found))) => {
            let (record, now) = *found;
            // A mismatch is looked at under the settings the record was
            // written under too, as enforcing does (from the list in memory:
            // the request waits for nothing more). Settings not in memory
            // (another replica's, added since) are read in the background, at
            // most once a second, for the observations after this one.
            let decision = match decide_with_legacy(route, &record, &request_hash, &request, now, None) {
                Decision::Mismatch => {
                    let digest = record.fingerprint_spec.as_deref();
                    let spec = digest.and_then(|d| shared.fingerprints.known(d));
                    if let (None, Some(digest)) = (&spec, digest) {
                        let (history, store, digest) = (shared.fingerprints.clone(), configured.store.clone(), digest.to_owned());
                        shared.tracker.spawn(async move { history.find(&store, &digest).await });
                    }
                    decide_with_legacy(route, &record, &request_hash, &request, now, spec.as_deref())
                }
                decision => decision,
            };
            match would(decision) {
                Some(would) => {
                    metrics.observe_would(&route.operation, would);
                    tracing::info!(route = %route.operation, scope = %log_id, would = would.as_str(),
                        "observe: enforcing would have answered differently; passed through");
                }
                None => skipped(metrics, route, "the record belongs to another mode"),
            }
            false
        }
        Ok(Ok(Decided::Failed) | Err(_)) => {
            skipped(metrics, route, "store unavailable");
            false
        }
        // The claim goes on in the background: if it is made after all,
        // the answer captured below is recorded under it.
        Err(_) => {
            skipped(metrics, route, "the claim took longer than observe_budget");
            true
        }
    };
    let capture = capture.then(|| Capture { tx: Some(captured_tx), sent: false });
    forward(route, upstream, parts, Body::full(body), capture).await
}

/// What observe mode does with a request admission stopped: counts what
/// enforcing would have refused, and passes it on as far as it was read. A
/// request without a key on a route that does not require one is not
/// observed (nothing to count).
async fn pass_on(shared: &Shared, configured: &Configured, route: &Route, upstream: &Upstream, stop: Stop<Skip>) -> Response<Body> {
    let metrics = &shared.metrics;
    let held = match stop {
        Stop::NoKey(held) => held,
        Stop::Refused(r, held) => {
            metrics.observe_refused(&route.operation, r.reason);
            tracing::info!(route = %route.operation, reason = r.reason.as_str(), "observe: enforcing would have refused this request; passed through");
            held
        }
        Stop::Halted(Skip::Unobserved(why), held) => {
            skipped(metrics, route, why);
            held
        }
        Stop::Halted(Skip::Broken, _) => {
            skipped(metrics, route, "request body broken off");
            return problem::response(&GatewayError::BadGateway);
        }
    };
    match held {
        Held::Unread(req) => passthrough::pass_through(upstream, req, configured.request_body_timeout).await,
        Held::Read(parts, body) => passthrough::forward(upstream, parts, body).await,
        Held::Admitted(admitted) => {
            let Admitted { parts, body, .. } = *admitted;
            passthrough::forward(upstream, parts, Body::full(body)).await
        }
    }
}

fn skipped(metrics: &Metrics, route: &Route, why: &'static str) {
    metrics.observe_skipped(&route.operation);
    tracing::debug!(route = %route.operation, why, "observe: request passed through unobserved");
}

/// What enforcing would have answered from a record it found.
fn would(decision: Decision) -> Option<Would> {
    match decision {
        Decision::Replay => Some(Would::Replay),
        Decision::Mismatch => Some(Would::Conflict),
        Decision::InProgress { .. } => Some(Would::RejectInFlight),
        Decision::LeaseExpired | Decision::Unknown => Some(Would::Unknown),
        // Past retention (a race with the claim's take-over), or an async
        // operation left from an earlier configuration: nothing to count.
        Decision::Expired | Decision::Accepted => None,
    }
}

/// The claim and the recording of the answer, on the tracker. Holds its
/// observation slot until done.
async fn observation(
    store: Store,
    tracker: TaskTracker,
    route: Arc<Route>,
    claim: ClaimRequest,
    decided: oneshot::Sender<Decided>,
    captured: oneshot::Receiver<Captured>,
    _slot: OwnedSemaphorePermit,
) {
    let held = match store.claim(&claim).await {
        Ok(ClaimOutcome::Claimed(held)) => held,
        Ok(ClaimOutcome::Existing { record, now }) => {
            let _ = decided.send(Decided::Found(Box::new((record, now))));
            return;
        }
        Err(e) => {
            tracing::debug!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "observe: claim failed");
            if e.is_ambiguous() {
                store.abandon_later(&tracker, &claim.scope, claim.claim_token, route.record.lease);
            }
            let _ = decided.send(Decided::Failed);
            return;
        }
    };
    let _ = decided.send(Decided::Claimed);
    // The claim's lease bounds the wait: past it the lease reaper marks the
    // record unknown (the request may have been sent) and a late write is fenced.
    let answer = match tokio::time::timeout(route.record.lease, captured).await {
        Ok(Ok(answer)) => answer,
        // The request path went away before it forwarded anything.
        Ok(Err(_)) => Captured::NotSent,
        Err(_) => {
            tracing::warn!(route = %route.operation, scope = %held.scope.log_id(), "observe: no answer to record within the lease");
            return;
        }
    };
    record(&store, &route, &held, answer).await;
}

/// Records an observed answer under the claim, as the executor records a
/// synchronous attempt's.
async fn record(store: &Store, route: &Route, held: &Claim, answer: Captured) {
    let scope = held.scope.log_id();
    // What the executor writes for the same class of answer.
    let written = match (&answer, answer.class().sync_write()) {
        (Captured::Answered(stored), SyncWrite::Complete) => {
            store.complete(held, &crate::executor::stored_form(route, stored.clone()), route.record.retention).await
        }
        (_, SyncWrite::MarkUnknown) => {
            tracing::warn!(route = %route.operation, scope = %scope, "observe: upstream outcome unknown; recorded as unknown");
            store.mark_unknown(held).await
        }
        (_, SyncWrite::Release | SyncWrite::Complete) => release(store, route, held).await,
    };
    match written {
        Ok(WriteOutcome::Written) => tracing::debug!(route = %route.operation, scope = %scope, ?answer, "observe: recorded"),
        Ok(WriteOutcome::Fenced) => {}
        Err(e) => tracing::warn!(route = %route.operation, scope = %scope, error = %e, "observe: could not record; the lease expiry will"),
    }
}

/// Frees the key, retrying while the lease runs (this is already a
/// background task), so a request that never reached the upstream does not
/// end up `unknown` because the store blinked.
async fn release(store: &Store, route: &Route, held: &Claim) -> Result<WriteOutcome, crate::store::StoreError> {
    match store.release(held).await {
        Err(_) => {}
        written => return written,
    }
    let deadline = tokio::time::Instant::now() + route.record.lease;
    let retried = crate::retry::while_leased(deadline, true, || async { store.release(held).await.ok() }).await;
    // Out of lease: one last try, whose error is the answer.
    match retried {
        Some(written) => Ok(written),
        None => store.release(held).await,
    }
}

/// Forwards the observed request like pass-through and, with `capture`,
/// copies the answer for recording.
async fn forward(route: &Route, upstream: &Upstream, parts: request::Parts, body: Body, mut capture: Option<Capture>) -> Response<Body> {
    let deadline = tokio::time::Instant::now() + upstream.config.timeout;
    let sent = match upstream.request(parts, body, None) {
        Ok(req) => {
            if let Some(c) = capture.as_mut() {
                c.sent = true;
            }
            upstream.send(req, deadline).await
        }
        Err(e) => Err(e),
    };
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) => {
            if let Some(c) = capture {
                c.finish(if classify::failure(&e) == Class::MaybeExecuted { Captured::MaybeExecuted } else { Captured::NotSent });
            }
            return passthrough::failed(upstream, &e);
        }
    };
    let (mut head, body) = resp.into_parts();
    // The executor's classification: the head is made ready to forward the same way.
    let class = classify::head(&route.record.release_on_status, &mut head);
    let body = Body::stream(body, upstream.config.timeout);
    let body = match capture {
        None => body,
        Some(c) if matches!(class, Class::Declined { .. }) => {
            c.finish(Captured::Declined);
            body
        }
        Some(c) => Body::boxed(Tee {
            inner: body,
            capture: Some(c),
            status: head.status.as_u16(),
            headers: headers::storable(&head.headers),
            buf: BytesMut::new(),
            limit: route.record.max_stored_response,
            over_limit: false,
            declared: crate::executor::declared_length(&head),
            seen: 0,
        }),
    };
    Response::from_parts(head, body)
}

/// Hands the observed answer to the recording task exactly once. Dropped
/// without an answer (the client went away mid-exchange), it reports what is
/// known: nothing left if the request was not yet handed to the upstream,
/// else it may have executed.
struct Capture {
    tx: Option<oneshot::Sender<Captured>>,
    /// The request was handed to the upstream connection.
    sent: bool,
}

impl Capture {
    fn finish(mut self, answer: Captured) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(answer);
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(if self.sent { Captured::MaybeExecuted } else { Captured::NotSent });
        }
    }
}

/// The upstream's response body on its way to the client, copied (up to the
/// storage limit) for recording. The copy goes to the recording task when the
/// stream ends; if the client stops reading first, the status and headers are
/// recorded without the body (the upstream did answer).
struct Tee {
    inner: Body,
    capture: Option<Capture>,
    status: u16,
    headers: Vec<(String, Vec<u8>)>,
    buf: BytesMut,
    limit: u64,
    over_limit: bool,
    /// The body's length as its head declares it, and how much came: a
    /// body that ends short of it is an answer lost (see the executor's
    /// `read_upstream_body`).
    declared: Option<u64>,
    seen: u64,
}

impl Tee {
    fn finish(&mut self, whole: bool) {
        if let Some(c) = self.capture.take() {
            let body = (whole && !self.over_limit).then(|| std::mem::take(&mut self.buf).freeze());
            c.finish(Captured::Answered(StoredResponse { status: self.status, headers: std::mem::take(&mut self.headers), body }));
        }
    }
}

impl hyper::body::Body for Tee {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.seen += frame.data_ref().map_or(0, |d| d.len() as u64);
                if let Some(data) = frame.data_ref()
                    && !this.over_limit
                {
                    if (this.buf.len() + data.len()) as u64 > this.limit {
                        this.over_limit = true;
                        this.buf = BytesMut::new();
                    } else {
                        this.buf.extend_from_slice(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                // The upstream's answer broke off: as the executor says of a
                // body that fails mid-read, it may have executed.
                if let Some(c) = this.capture.take() {
                    c.finish(Captured::MaybeExecuted);
                }
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) if this.declared.is_some_and(|n| n != this.seen) => {
                if let Some(c) = this.capture.take() {
                    c.finish(Captured::MaybeExecuted);
                }
                Poll::Ready(None)
            }
            Poll::Ready(None) => {
                this.finish(true);
                Poll::Ready(None)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        hyper::body::Body::is_end_stream(&self.inner)
    }

    fn size_hint(&self) -> SizeHint {
        hyper::body::Body::size_hint(&self.inner)
    }
}

impl Drop for Tee {
    fn drop(&mut self) {
        // A server may never poll a body it knows is empty.
        let whole = hyper::body::Body::is_end_stream(&self.inner);
        self.finish(whole);
    }
}

/// A request body read for observation.
enum Read {
    Whole(Bytes),
    /// Over the size limit or the read deadline: what was read and the rest,
    /// to be passed on unobserved.
    Partial(Body),
    /// The client's body failed.
    Broken,
}

/// Reads a request body whole, within `limit` bytes and `timeout`; past
/// either, the part read so far and the rest of the stream are handed back so
/// the request can still be passed through.
async fn read_within(mut body: Incoming, headers: &HeaderMap, limit: u64, timeout: Duration) -> Read {
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Read::Partial(Body::stream(body, timeout));
    }
    let deadline = tokio::time::Instant::now() + timeout;
    let mut buf = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => break,
            Ok(None) => return Read::Whole(buf.freeze()),
            Ok(Some(Err(_))) => return Read::Broken,
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() as u64 > limit {
                break;
            }
        }
    }
    Read::Partial(Body::Prefixed { prefix: Some(buf.freeze()), rest: Streamed::new(body, timeout) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_map_to_what_enforcing_would_answer() {
        assert_eq!(would(Decision::Replay), Some(Would::Replay));
        assert_eq!(would(Decision::Mismatch), Some(Would::Conflict));
        assert_eq!(would(Decision::InProgress { lease_left: Duration::ZERO }), Some(Would::RejectInFlight));
        assert_eq!(would(Decision::LeaseExpired), Some(Would::Unknown));
        assert_eq!(would(Decision::Unknown), Some(Would::Unknown));
        assert_eq!(would(Decision::Expired), None);
        assert_eq!(would(Decision::Accepted), None);
    }

    #[tokio::test]
    async fn a_dropped_capture_says_whether_the_request_left() {
        for (sent, maybe) in [(false, false), (true, true)] {
            let (tx, rx) = oneshot::channel();
            drop(Capture { tx: Some(tx), sent });
            let got = rx.await.unwrap();
            assert_eq!(matches!(got, Captured::MaybeExecuted), maybe, "{got:?}");
            assert_eq!(matches!(got, Captured::NotSent), !maybe, "{got:?}");
        }
    }

    #[tokio::test]
    async fn the_tee_copies_up_to_the_limit_and_records_on_end_or_drop() {
        let tee = |body: &'static str, limit: u64| {
            let (tx, rx) = oneshot::channel();
            let tee = Tee {
                inner: Body::full(body),
                capture: Some(Capture { tx: Some(tx), sent: true }),
                status: 201,
                headers: vec![("x".into(), b"1".to_vec())],
                buf: BytesMut::new(),
                limit,
                over_limit: false,
                declared: None,
                seen: 0,
            };
            (tee, rx)
        };
        let stored = |c: Captured| match c {
            Captured::Answered(s) => s,
            other => panic!("not answered: {other:?}"),
        };
        // Read to the end: the body is kept.
        let (t, rx) = tee("hello", 5);
        assert_eq!(t.collect().await.unwrap().to_bytes(), "hello");
        let s = stored(rx.await.unwrap());
        assert_eq!((s.status, s.body.as_deref()), (201, Some(&b"hello"[..])));
        // Over the limit: the client gets it all, the record keeps no body.
        let (t, rx) = tee("hello", 4);
        assert_eq!(t.collect().await.unwrap().to_bytes(), "hello");
        assert_eq!(stored(rx.await.unwrap()).body, None);
        // Dropped unread: status and headers only.
        let (t, rx) = tee("hello", 5);
        drop(t);
        let s = stored(rx.await.unwrap());
        assert_eq!((s.status, s.body, s.headers.len()), (201, None, 1));
        // An empty body the server never polls is still whole.
        let (t, rx) = tee("", 0);
        drop(t);
        assert_eq!(stored(rx.await.unwrap()).body.as_deref(), Some(&b""[..]));
    }
}
