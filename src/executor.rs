//! The executor: where one attempt of a claimed request is executed and
//! recorded. It forwards the request once (with the derived key and the
//! attempt's generation), classifies what came back by the typed "may have
//! executed" fact, and records the outcome with a write fenced by the
//! attempt (generation and claim token).
//!
//! Both fronts call it: the synchronous request path (a client is waiting for
//! the upstream's answer) and the async workers (the client polls). What an
//! outcome means for the record differs only where the contract says so (a
//! refused connection frees a synchronous key but re-queues an async
//! operation); the exchange itself and its classification are one code path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Response, request};
use hyper::body::Incoming;
use tokio_util::task::TaskTracker;

use crate::body::{Body, Streamed};
use crate::headers::{self, strip_hop_by_hop};
use crate::metrics::{Metrics, Outcome};
use crate::problem::GatewayError;
use crate::record::StoredResponse;
use crate::route::{ForwardKey, Route};
use crate::store::{Claim, Store, WriteOutcome};
use crate::upstream::{Upstream, UpstreamError, error_chain};
use crate::waiters::Waiters;

/// Executes and records attempts. One per proxy worker thread (its upstream
/// pools are driven by that thread's event loop); the store, metrics, tracker
/// and waiters are shared.
#[derive(Debug)]
pub struct Executor {
    upstreams: Vec<Upstream>,
    store: Store,
    metrics: Arc<Metrics>,
    /// Background retries of a release run here, so shutdown waits for them.
    tracker: TaskTracker,
    /// Woken when a result is recorded (local `in_flight = "wait"` waiters).
    waiters: Arc<Waiters>,
    /// HMAC key for the derived `Idempotency-Key` (configured, or generated
    /// by `migrate` and shared by every replica through the store).
    derived_key_secret: Arc<[u8]>,
}

/// What one exchange with the upstream established, before anything is
/// recorded.
pub enum Exchange {
    /// A response whose body was read (whole, or up to the storage limit).
    Answered { head: http::response::Parts, body: UpstreamBody },
    /// The upstream answered, but asked not to be recorded
    /// (`Idempotency-Policy: no-store`) or with a `release_on_status`
    /// status. The body has not been read.
    Declined { head: http::response::Parts, body: Incoming, no_store: bool },
    /// The request never left idemgate: nothing can have executed.
    NotSent(UpstreamError),
    /// The request was sent; the upstream may have executed it, but its
    /// answer is lost.
    MaybeExecuted(UpstreamError),
}

/// An upstream response body as read for recording.
pub enum UpstreamBody {
    Complete(Bytes),
    /// Over the storage limit: what was read so far and the rest of the stream.
    TooLarge {
        prefix: Bytes,
        rest: Incoming,
    },
}

impl Executor {
    pub fn new(
        upstreams: Vec<Upstream>,
        store: Store,
        metrics: Arc<Metrics>,
        tracker: TaskTracker,
        waiters: Arc<Waiters>,
        derived_key_secret: Arc<[u8]>,
    ) -> Executor {
        Executor { upstreams, store, metrics, tracker, waiters, derived_key_secret }
    }

    /// A copy with its own upstream connection pools (for another event loop).
    pub fn with_own_pools(&self) -> Executor {
        Executor {
            upstreams: self.upstreams.iter().map(|u| Upstream::new(u.config.clone())).collect(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            tracker: self.tracker.clone(),
            waiters: self.waiters.clone(),
            derived_key_secret: self.derived_key_secret.clone(),
        }
    }

    pub fn upstream(&self, id: usize) -> &Upstream {
        &self.upstreams[id]
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The synchronous attempt: forwards, records, and returns the answer for
    /// the waiting client. The record ends `completed` (or, for a response
    /// over the storage limit, completed without a body), released (the
    /// request never left, or the upstream declined recording), or `unknown`.
    pub async fn run_sync(
        &self,
        route: &Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        self.metrics.forward_started();
        let out = self.sync_attempt(route, claim, parts, body).await;
        self.metrics.forward_finished();
        self.waiters.wake(&claim.scope);
        out
    }

    async fn sync_attempt(
        &self,
        route: &Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        let upstream_timeout = self.upstreams[route.upstream].config.timeout;
        match self.exchange(route, claim, parts, body).await {
            Exchange::NotSent(e) => {
                tracing::info!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream not reached; key released");
                self.release(route, claim).await;
                Err(GatewayError::UpstreamUnavailable)
            }
            Exchange::MaybeExecuted(e) => {
                self.record_unknown(route, claim, &e).await;
                Err(GatewayError::OutcomeUnknown)
            }
            Exchange::Declined { head, body, no_store } => {
                self.release(route, claim).await;
                tracing::debug!(scope = %claim.scope.log_id(), status = head.status.as_u16(), no_store, "key released");
                Ok((Response::from_parts(head, Body::stream(body, upstream_timeout)), Outcome::Released))
            }
            Exchange::Answered { head, body } => {
                let (stored_body, client_body) = match body {
                    UpstreamBody::Complete(bytes) => (Some(bytes.clone()), Body::full(bytes)),
                    UpstreamBody::TooLarge { prefix, rest } => {
                        tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), limit = route.max_stored_response,
                            "response larger than max_stored_response: recording status and headers only");
                        (None, Body::Prefixed { prefix: Some(prefix), rest: Streamed::new(rest, upstream_timeout) })
                    }
                };
                let stored = StoredResponse { status: head.status.as_u16(), headers: headers::storable(&head.headers), body: stored_body };
                let outcome = match self.store.complete(claim, &stored, route.retention).await {
                    Ok(WriteOutcome::Written) => Outcome::Forwarded,
                    Ok(WriteOutcome::Fenced) => Outcome::Fenced,
                    Err(e) => {
                        // The upstream acted and the client gets its answer; the claim
                        // stays in flight and its lease expiry turns it unknown.
                        tracing::error!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "could not record the result");
                        Outcome::Forwarded
                    }
                };
                Ok((Response::from_parts(head, client_body), outcome))
            }
        }
    }

    /// Forwards the claimed request once and classifies what came back.
    /// Records nothing.
    pub async fn exchange(&self, route: &Route, claim: &Claim, parts: request::Parts, body: Bytes) -> Exchange {
        let upstream = &self.upstreams[route.upstream];
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + upstream.config.timeout;
        let key_value = match route.forward_key {
            ForwardKey::Derived => HeaderValue::from_str(&claim.scope.derived_key(Some(&self.derived_key_secret))).ok(),
            ForwardKey::Client => parts.headers.get(&route.key_header).cloned(),
        };
        let stamp = key_value.map(|k| (k, HeaderValue::from(claim.generation.0)));
        let sent = match upstream.request(parts, Body::full(body), stamp) {
            Ok(req) => upstream.send(req, deadline).await,
            Err(e) => Err(e),
        };
        let resp = match sent {
            Ok(resp) => resp,
            Err(e) => {
                self.metrics.observe_upstream(upstream.name(), started.elapsed());
                return classify(e);
            }
        };
        let (mut head, body) = resp.into_parts();
        strip_hop_by_hop(&mut head.headers);
        let no_store = head
            .headers
            .remove(headers::IDEMPOTENCY_POLICY)
            .is_some_and(|v| v.to_str().is_ok_and(|s| s.split(',').any(|t| t.trim().eq_ignore_ascii_case("no-store"))));
        if no_store || route.release_on_status.contains(&head.status) {
            self.metrics.observe_upstream(upstream.name(), started.elapsed());
            return Exchange::Declined { head, body, no_store };
        }
        let read = read_upstream_body(body, route.max_stored_response, deadline).await;
        self.metrics.observe_upstream(upstream.name(), started.elapsed());
        match read {
            Ok(body) => Exchange::Answered { head, body },
            Err(e) => classify(e),
        }
    }

    /// Frees the key. If the store cannot be reached now, keeps trying on the
    /// tracker until the lease would run out, so a request the upstream never
    /// acted on (or asked not to store) does not end up `unknown`.
    pub async fn release(&self, route: &Route, claim: &Claim) {
        if self.store.release(claim).await.is_ok() {
            return;
        }
        let (store, claim, lease) = (self.store.clone(), claim.clone(), route.lease);
        self.tracker.spawn(async move {
            let deadline = tokio::time::Instant::now() + lease;
            while tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(250)).await;
                if store.release(&claim).await.is_ok() {
                    tracing::info!(scope = %claim.scope.log_id(), "key released after the store came back");
                    return;
                }
            }
            tracing::error!(scope = %claim.scope.log_id(), "could not release the key; its lease will turn it unknown");
        });
    }

    /// The upstream may have executed the request and its answer is lost.
    async fn record_unknown(&self, route: &Route, claim: &Claim, e: &UpstreamError) {
        tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream outcome unknown");
        if let Err(se) = self.store.mark_unknown(claim).await {
            tracing::error!(scope = %claim.scope.log_id(), error = %se, "could not record unknown; the lease expiry will");
        }
    }
}

/// The typed fact decides: never sent, or may have executed.
fn classify(e: UpstreamError) -> Exchange {
    if e.may_have_executed() { Exchange::MaybeExecuted(e) } else { Exchange::NotSent(e) }
}

/// Reads an upstream response body up to `limit` bytes, within `deadline`.
/// A failure mid-body means the upstream acted but the answer is lost.
async fn read_upstream_body(mut body: Incoming, limit: u64, deadline: tokio::time::Instant) -> Result<UpstreamBody, UpstreamError> {
    use http_body_util::BodyExt;
    let mut buf = bytes::BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(UpstreamError::Timeout { upstream: "response body".into(), timeout: Duration::ZERO }),
            Ok(None) => return Ok(UpstreamBody::Complete(buf.freeze())),
            Ok(Some(Err(e))) => return Err(UpstreamError::Broken { upstream: "response body".into(), detail: error_chain(&e) }),
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            if buf.len() as u64 > limit {
                return Ok(UpstreamBody::TooLarge { prefix: buf.freeze(), rest: body });
            }
        }
    }
}
