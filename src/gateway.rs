//! The request path: route, identify, validate, fingerprint, claim, then
//! forward-and-record on a tracked task — or answer from the record.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, Version, request};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::{Notify, oneshot};
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::body::{Body, Streamed};
use crate::config::Config;
use crate::fingerprint::{self, RequestParts};
use crate::headers::{self, strip_hop_by_hop};
use crate::identity::Identifier;
use crate::metrics::{Metrics, Outcome};
use crate::problem::{self, GatewayError};
use crate::record::{Decision, StoredResponse, decide};
use crate::replay::replay;
use crate::route::{ForwardKey, InFlightPolicy, Route, RouteMatch, Router, UpstreamId};
use crate::scope::{IdempotencyKey, KeyError, Scope};
use crate::store::{Claim, ClaimOutcome, ClaimRequest, Store, WriteOutcome};
use crate::upstream::{Upstream, UpstreamError, error_chain};

/// Retry-After for a duplicate of an in-flight request.
const IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Poll interval bounds while waiting for an in-flight result (`in_flight = "wait"`).
const WAIT_POLL_MIN: Duration = Duration::from_millis(10);
const WAIT_POLL_MAX: Duration = Duration::from_millis(200);
/// A claim that keeps finding expired records (swept or released in between)
/// gives up after this many rounds.
const MAX_CLAIM_ROUNDS: usize = 8;

/// Everything the request path needs, shared by all connections.
#[derive(Debug)]
pub struct Gateway {
    router: Router,
    identifier: Identifier,
    upstreams: Vec<Upstream>,
    store: Store,
    metrics: Arc<Metrics>,
    /// Forwards run here, not in the connection's future, so a client that
    /// disconnects never cancels a forward or the recording of its result.
    tracker: TaskTracker,
    replica_id: Arc<str>,
    max_request_body: u64,
    request_body_timeout: Duration,
    /// Wakes local waiters (`in_flight = "wait"`) when a result is recorded;
    /// waiters also poll, which covers results recorded by other replicas.
    waiters: Arc<Waiters>,
    /// HMAC key for the derived `Idempotency-Key`, if configured.
    derived_key_secret: Option<Arc<[u8]>>,
}

impl Gateway {
    pub fn new(config: &Config, store: Store, metrics: Arc<Metrics>, tracker: TaskTracker) -> Gateway {
        Gateway {
            router: Router::new(config.routes.clone(), config.server.default_upstream),
            identifier: Identifier::new(config.identity.clone()),
            upstreams: config.upstreams.iter().cloned().map(Upstream::new).collect(),
            store,
            metrics,
            tracker,
            replica_id: config.server.replica_id.as_str().into(),
            max_request_body: config.server.max_request_body,
            request_body_timeout: config.server.request_body_timeout,
            waiters: Arc::new(Waiters::new()),
            derived_key_secret: config.server.derived_key_secret.as_ref().map(|s| Arc::from(s.expose().as_bytes())),
        }
    }

    /// A copy for another worker thread: the same store, metrics, tracker and
    /// waiters, but its own upstream connection pools (so each worker's
    /// connections are driven by its own event loop).
    pub fn for_worker(&self) -> Gateway {
        Gateway {
            router: self.router.clone(),
            identifier: self.identifier.clone(),
            upstreams: self.upstreams.iter().map(|u| Upstream::new(u.config.clone())).collect(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            tracker: self.tracker.clone(),
            replica_id: self.replica_id.clone(),
            max_request_body: self.max_request_body,
            request_body_timeout: self.request_body_timeout,
            waiters: self.waiters.clone(),
            derived_key_secret: self.derived_key_secret.clone(),
        }
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Handles one request; never fails (errors become problem responses).
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        match self.router.route(req.method(), req.uri().path()) {
            RouteMatch::Operation { route, params } => {
                let route = route.clone();
                // Boxed: the idempotent path's future is large; pass-through requests
                // should not carry (and move) it.
                let (resp, outcome) = match Box::pin(self.operation(&route, params, req, peer)).await {
                    Ok(answer) => answer,
                    Err(e) => (problem::response(&e), e.outcome()),
                };
                self.metrics.request(&route.operation, outcome);
                resp
            }
            RouteMatch::PassThrough { upstream } => self.pass_through(upstream, req).await,
            RouteMatch::NotFound => problem::response(&GatewayError::NotFound),
        }
    }

    async fn operation(
        self: &Arc<Self>,
        route: &Arc<Route>,
        params: Vec<(String, String)>,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        let identity = self.identifier.identify(req.headers(), peer.ip()).ok_or(GatewayError::Unauthenticated)?;
        let key = match key_from(req.headers(), route) {
            Ok(Some(key)) => key,
            Ok(None) if !route.key_required => {
                return Ok((self.pass_through(route.upstream, req).await, Outcome::PassThrough));
            }
            Ok(None) => return Err(GatewayError::MissingKey { header: route.key_header.to_string() }),
            Err(e) => return Err(GatewayError::InvalidKey(e)),
        };
        let (parts, body) = req.into_parts();
        let body = read_body(body, &parts.headers, self.max_request_body, self.request_body_timeout).await?;
        let request_hash = fingerprint::fingerprint(
            &route.fingerprint,
            &RequestParts {
                method: &parts.method,
                operation: &route.operation,
                path_params: &params,
                query: parts.uri.query(),
                headers: &parts.headers,
                body: &body,
            },
        )
        .map_err(|e| GatewayError::InvalidBody(e.to_string()))?;
        let scope = Scope::new(&identity, &route.operation, key);
        let claim = ClaimRequest {
            scope,
            request_hash,
            owner: self.replica_id.clone(),
            lease: route.lease,
            upstream_idempotent: route.upstream_idempotent,
            claim_token: Uuid::new_v4(),
        };
        // From the claim on, the work runs on the tracker: a client that goes
        // away can no longer cancel it between a committed claim and its
        // forward, nor between the forward and the recording of its result.
        let (tx, rx) = oneshot::channel();
        let gw = self.clone();
        let route = route.clone();
        self.tracker.spawn(async move {
            let out = gw.claim_and_forward(&route, claim, parts, body).await;
            // The client may be gone; the record is written either way.
            let _ = tx.send(out);
        });
        rx.await.unwrap_or(Err(GatewayError::Internal))
    }

    /// Claims the scope and forwards, or answers from the record it found.
    async fn claim_and_forward(
        &self,
        route: &Route,
        claim: ClaimRequest,
        parts: request::Parts,
        body: Bytes,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        let request_hash = claim.request_hash;
        let wait_until = match route.in_flight {
            InFlightPolicy::Wait(d) => Some(tokio::time::Instant::now() + d),
            InFlightPolicy::Reject => None,
        };
        let (mut expired_rounds, mut wait_rounds) = (0, 0);
        loop {
            let claim_started = Instant::now();
            let outcome = match self.store.claim(&claim).await {
                Ok(outcome) => outcome,
                Err(e) => {
                    tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "claim failed; nothing forwarded");
                    if e.is_ambiguous() {
                        self.abandon_later(&claim, route.lease);
                    }
                    return Err(GatewayError::StoreUnavailable);
                }
            };
            let (record, now) = match outcome {
                ClaimOutcome::Claimed(c) => {
                    // The lease began when the claim committed, at most this
                    // long ago. If what is left cannot cover the upstream's
                    // timeout (the claim took long: retries, read-backs), the
                    // result could not be recorded in time: give the key back
                    // instead of forwarding.
                    let upstream_timeout = self.upstreams[route.upstream].config.timeout;
                    if claim_started.elapsed() + upstream_timeout >= route.lease {
                        tracing::warn!(route = %route.operation, scope = %c.scope.log_id(), "claim took too long to leave room for the upstream; released, nothing forwarded");
                        self.release(route, &c).await;
                        return Err(GatewayError::StoreUnavailable);
                    }
                    return self.forward_and_record(route, c, parts, body).await;
                }
                ClaimOutcome::Existing { record, now } => (record, now),
            };
            match decide(&record, &request_hash, now) {
                Decision::Replay => {
                    let stored = record.response.as_ref().ok_or(GatewayError::Internal)?;
                    return replay(stored).map(|r| (r, Outcome::Replayed));
                }
                Decision::Mismatch => return Err(GatewayError::KeyReused { status: route.mismatch_status }),
                Decision::Unknown => return Err(GatewayError::RecordUnknown),
                Decision::LeaseExpired => {
                    match self.store.expire_lease(&record).await {
                        Ok(WriteOutcome::Written) => {
                            self.metrics.reaped(1);
                            tracing::warn!(route = %route.operation, scope = %record.scope.log_id(), owner = %record.owner, "lease expired without a result; record is now unknown");
                        }
                        // The record moved on since it was read (its attempt
                        // recorded a result or released it): read it again.
                        Ok(WriteOutcome::Fenced) if expired_rounds < MAX_CLAIM_ROUNDS => {
                            expired_rounds += 1;
                            continue;
                        }
                        Ok(WriteOutcome::Fenced) => {}
                        Err(e) => tracing::warn!(scope = %record.scope.log_id(), error = %e, "could not mark an expired lease unknown"),
                    }
                    return Err(GatewayError::RecordUnknown);
                }
                Decision::InProgress { .. } => {
                    let Some(deadline) = wait_until.filter(|d| tokio::time::Instant::now() < *d) else {
                        return Err(GatewayError::InProgress { retry_after: IN_PROGRESS_RETRY_AFTER });
                    };
                    self.waiters.wait(&claim.scope, wait_rounds, deadline).await;
                    wait_rounds += 1;
                }
                Decision::Expired => {
                    expired_rounds += 1;
                    if expired_rounds >= MAX_CLAIM_ROUNDS {
                        return Err(GatewayError::StoreUnavailable);
                    }
                }
            }
        }
    }

    /// A claim whose commit could not be confirmed may exist although nothing
    /// was forwarded: delete it by its token once the store answers again, so
    /// the client's retry is not refused. Gives up when the lease would have
    /// expired (the record then shows as `unknown`, and the logs say why).
    fn abandon_later(&self, claim: &ClaimRequest, lease: Duration) {
        let store = self.store.clone();
        let (scope, token) = (claim.scope.clone(), claim.claim_token);
        self.tracker.spawn(async move {
            // Until the lease would run out: a statement still on its way to
            // the database may yet commit the claim after a first look finds
            // nothing (the server also cancels it at the statement timeout).
            let deadline = tokio::time::Instant::now() + lease;
            while tokio::time::Instant::now() < deadline {
                if let Ok(true) = store.abandon(&scope, token).await {
                    tracing::info!(scope = %scope.log_id(), "unconfirmed claim abandoned");
                    return;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            tracing::debug!(scope = %scope.log_id(), "no unconfirmed claim appeared before its lease would have run out");
        });
    }

    async fn forward_and_record(
        &self,
        route: &Route,
        claim: Claim,
        parts: request::Parts,
        body: Bytes,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        self.metrics.forward_started();
        let out = self.exchange(route, &claim, parts, body).await;
        self.metrics.forward_finished();
        self.waiters.wake(&claim.scope);
        out
    }

    async fn exchange(
        &self,
        route: &Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
    ) -> Result<(Response<Body>, Outcome), GatewayError> {
        let upstream = &self.upstreams[route.upstream];
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + upstream.config.timeout;
        let key_value = match route.forward_key {
            ForwardKey::Derived => HeaderValue::from_str(&claim.scope.derived_key(self.derived_key_secret.as_deref())).ok(),
            ForwardKey::Client => parts.headers.get(&route.key_header).cloned(),
        };
        let stamp = key_value.map(|k| (k, HeaderValue::from(claim.generation.0)));
        let sent = match upstream_request(upstream, parts, Body::full(body), stamp) {
            Ok(req) => upstream.send(req, deadline).await,
            Err(e) => Err(e),
        };
        let resp = match sent {
            Ok(resp) => resp,
            Err(e) => {
                self.metrics.observe_upstream(upstream.name(), started.elapsed());
                return Err(self.upstream_failed(route, claim, &e).await);
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
            self.release(route, claim).await;
            tracing::debug!(scope = %claim.scope.log_id(), status = head.status.as_u16(), no_store, "key released");
            return Ok((Response::from_parts(head, Body::stream(body, upstream.config.timeout)), Outcome::Released));
        }
        let read = read_upstream_body(body, route.max_stored_response, deadline).await;
        self.metrics.observe_upstream(upstream.name(), started.elapsed());
        let (stored_body, client_body) = match read {
            Ok(UpstreamBody::Complete(bytes)) => (Some(bytes.clone()), Body::full(bytes)),
            Ok(UpstreamBody::TooLarge { prefix, rest }) => {
                tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), limit = route.max_stored_response,
                    "response larger than max_stored_response: recording status and headers only");
                (None, Body::Prefixed { prefix: Some(prefix), rest: Streamed::new(rest, upstream.config.timeout) })
            }
            Err(e) => return Err(self.upstream_failed(route, claim, &e).await),
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

    /// Frees the key. If the store cannot be reached now, keeps trying on the
    /// tracker until the lease would run out, so a request the upstream never
    /// acted on (or asked not to store) does not end up `unknown`.
    async fn release(&self, route: &Route, claim: &Claim) {
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

    /// Decides the record's fate from the typed "may have executed" fact.
    async fn upstream_failed(&self, route: &Route, claim: &Claim, e: &UpstreamError) -> GatewayError {
        if e.may_have_executed() {
            tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream outcome unknown");
            if let Err(se) = self.store.mark_unknown(claim).await {
                tracing::error!(scope = %claim.scope.log_id(), error = %se, "could not record unknown; the lease expiry will");
            }
            GatewayError::OutcomeUnknown
        } else {
            tracing::info!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream not reached; key released");
            self.release(route, claim).await;
            GatewayError::UpstreamUnavailable
        }
    }

    /// Proxies without idempotency, streaming both ways.
    async fn pass_through(&self, upstream: UpstreamId, req: Request<Incoming>) -> Response<Body> {
        let upstream = &self.upstreams[upstream];
        let (parts, body) = req.into_parts();
        let deadline = tokio::time::Instant::now() + upstream.config.timeout;
        let sent = match upstream_request(upstream, parts, Body::stream(body, self.request_body_timeout), None) {
            Ok(req) => upstream.send(req, deadline).await,
            Err(e) => Err(e),
        };
        match sent {
            Ok(resp) => {
                let (mut head, body) = resp.into_parts();
                strip_hop_by_hop(&mut head.headers);
                head.headers.remove(headers::IDEMPOTENCY_POLICY);
                Response::from_parts(head, Body::stream(body, upstream.config.timeout))
            }
            Err(e) => {
                tracing::warn!(upstream = upstream.name(), error = %error_chain(&e), "pass-through failed");
                let err = match e {
                    UpstreamError::Timeout { .. } => GatewayError::GatewayTimeout,
                    _ => GatewayError::BadGateway,
                };
                problem::response(&err)
            }
        }
    }
}

/// The key from the route's header: absent, or validated. Several values are
/// ambiguous and refused.
fn key_from(headers: &HeaderMap, route: &Route) -> Result<Option<IdempotencyKey>, KeyError> {
    let mut values = headers.get_all(&route.key_header).iter();
    let Some(first) = values.next() else { return Ok(None) };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    IdempotencyKey::parse(first).map(Some)
}

/// Reads a request body whole, within the size limit and the read deadline.
async fn read_body(body: Incoming, headers: &HeaderMap, limit: u64, timeout: Duration) -> Result<Bytes, GatewayError> {
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(GatewayError::BodyTooLarge { limit });
    }
    let limited = Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX));
    match tokio::time::timeout(timeout, limited.collect()).await {
        Err(_) => Err(GatewayError::BodyTimeout(timeout)),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => Err(GatewayError::BodyTooLarge { limit }),
        Ok(Err(_)) => Err(GatewayError::BodyRead),
    }
}

enum UpstreamBody {
    Complete(Bytes),
    /// Over the storage limit: what was read so far and the rest of the stream.
    TooLarge {
        prefix: Bytes,
        rest: Incoming,
    },
}

/// Reads an upstream response body up to `limit` bytes, within `deadline`.
/// A failure mid-body means the upstream acted but the answer is lost.
async fn read_upstream_body(mut body: Incoming, limit: u64, deadline: tokio::time::Instant) -> Result<UpstreamBody, UpstreamError> {
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

/// The request as the upstream receives it: unchanged but for hop-by-hop
/// headers, the absolute upstream URI, and (idempotent routes) the forwarded
/// key and the attempt's generation.
fn upstream_request(
    upstream: &Upstream,
    mut parts: request::Parts,
    body: Body,
    stamp: Option<(HeaderValue, HeaderValue)>,
) -> Result<Request<Body>, UpstreamError> {
    parts.uri = upstream.uri_for(parts.uri.path_and_query())?;
    parts.version = Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    if let Some((key, generation)) = stamp {
        parts.headers.insert(headers::IDEMPOTENCY_KEY, key);
        parts.headers.insert(headers::IDEMPOTENCY_GENERATION, generation);
    }
    Ok(Request::from_parts(parts, body))
}

/// Sharded wake-ups for local waiters; a spurious wake-up only costs a poll.
#[derive(Debug)]
struct Waiters {
    shards: Vec<Notify>,
}

impl Waiters {
    const SHARDS: usize = 64;

    fn new() -> Waiters {
        Waiters { shards: (0..Self::SHARDS).map(|_| Notify::new()).collect() }
    }

    fn shard(&self, scope: &Scope) -> &Notify {
        let mut h = DefaultHasher::new();
        scope.hash(&mut h);
        &self.shards[(h.finish() as usize) % Self::SHARDS]
    }

    fn wake(&self, scope: &Scope) {
        self.shard(scope).notify_waiters();
    }

    /// Sleeps until woken, a poll interval passes (growing with `round`), or the deadline.
    async fn wait(&self, scope: &Scope, round: usize, deadline: tokio::time::Instant) {
        let poll = WAIT_POLL_MIN.saturating_mul(1 << round.min(5)).min(WAIT_POLL_MAX);
        let until = (tokio::time::Instant::now() + poll).min(deadline);
        tokio::select! {
            _ = self.shard(scope).notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}
