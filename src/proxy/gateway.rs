//! The request path (the synchronous front): route, identify, validate,
//! fingerprint, claim — then hand the claimed attempt to the
//! [`Executor`] on a tracked task, or answer from
//! the record the claim found.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, request};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::{Notify, oneshot};

use crate::executor::{Executor, ResultWrite, refetch};
use crate::idempotency::fingerprint::{Fingerprint, RequestParts};
use crate::idempotency::outcome::RequestOutcome;
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Decision, Record, State, StoredResponse, Timestamp, decide};
use crate::problem::{self, GatewayError};
use crate::proxy::access::{self, Pending, REQUEST_ID, RouteLabel, Trace};
use crate::proxy::admission::{self, Admitted, Front, Held, Stop, decide_with_legacy};
use crate::proxy::fingerprints::FingerprintHistory;
use crate::proxy::observe;
use crate::proxy::passthrough;
use crate::proxy::replay::replay;
use crate::proxy::state::{Configured, Shared};
use crate::request::async_op::{OPERATIONS_PATH, status_document};
use crate::request::authorize::{Authorization, Authorizer};
use crate::request::identity::Identity;
use crate::request::route::method_override;
use crate::request::route::{InFlightPolicy, InvalidRequest, Mode, ReplayMode, Route, RouteMatch, UpstreamId};
use crate::store::{Claim, ClaimOutcome, ClaimRequest, Store, WriteOutcome};
use crate::upstream::Upstream;
use crate::upstream::body::Body;
use crate::upstream::limit::{Overloaded, Slot};

/// Retry-After for a duplicate of an in-flight request.
const IN_PROGRESS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// A claim that keeps finding expired records (swept or released in between)
/// gives up after this many rounds.
const MAX_CLAIM_ROUNDS: usize = 8;

/// What a claim came to: an answer from the record it found, or a claim
/// of this replica's to forward.
enum Claimed {
    Answered((Response<Body>, RequestOutcome)),
    Run(Claim),
}

/// The request path of one event loop: what outlives configurations, the
/// configuration in force, and what this thread owns (its upstream pools
/// and authorizer clients).
#[derive(Debug)]
pub struct Gateway {
    shared: Arc<Shared>,
    configured: Arc<Configured>,
    /// Forwards and records claimed attempts; owns this thread's upstream pools.
    executor: Executor,
    /// The routes' authorizers, with this thread's clients.
    authorizers: HashMap<Arc<str>, Authorizer>,
}

impl Gateway {
    /// The gateway of one event loop for the configuration `configured`:
    /// its own upstream pools and authorizer clients, everything else shared.
    pub fn new(shared: Arc<Shared>, configured: Arc<Configured>) -> Gateway {
        let executor = Executor::new(
            configured.upstreams.iter().map(Upstream::with_own_pool).collect(),
            configured.store.clone(),
            shared.metrics.clone(),
            shared.tracker.clone(),
            shared.waiters.clone(),
            shared.derived_key_secret.clone(),
        );
        let authorizers = configured.authorizers.iter().map(|(op, a)| (op.clone(), a.with_own_pool())).collect();
        Gateway { shared, configured, executor, authorizers }
    }

    /// The route's authorizer, if it has one: `forbidden` or
    /// `authorizer-unavailable` unless it allows the request.
    async fn authorized(
        &self,
        operation: &str,
        method: &Method,
        path: &str,
        identity: &Identity,
        headers: &HeaderMap,
    ) -> Result<(), GatewayError> {
        let Some(authorizer) = self.authorizers.get(operation) else { return Ok(()) };
        match authorizer.check(method, path, operation, identity, headers).await {
            Authorization::Allowed => Ok(()),
            Authorization::Denied => Err(GatewayError::Forbidden),
            Authorization::Unavailable => Err(GatewayError::AuthorizerUnavailable),
        }
    }

    /// The executor of this gateway (its upstream pools are this thread's).
    /// The executor of this gateway (its upstream pools are this thread's).
    pub fn executor(&self) -> &Executor {
        &self.executor
    }

    /// The fingerprint settings each operation has had (a configuration
    /// adds its own: [`crate::server::route_tasks`]).
    pub fn fingerprint_history(&self) -> Arc<FingerprintHistory> {
        self.shared.fingerprints.clone()
    }

    /// What async workers are woken with when an operation is accepted.
    pub fn wake_workers(&self) -> Arc<Notify> {
        self.shared.wake_workers.clone()
    }

    pub fn routes(&self) -> Vec<Arc<Route>> {
        self.configured.routes().to_vec()
    }

    /// The operations whose upstream deduplicates by the derived key.
    pub fn reforwardable_operations(&self) -> Vec<Arc<str>> {
        self.configured.routes().iter().filter(|r| r.execution.upstream_idempotent).map(|r| r.operation.clone()).collect()
    }

    /// The store, writing events for the routes of this configuration.
    pub fn store(&self) -> &Store {
        &self.configured.store
    }

    /// Handles one request; never fails (errors become problem responses).
    /// Every answer carries the request's id (`X-Request-Id`, also sent to
    /// the upstream) and gets exactly one access-log line.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
        let request_id = self.shared.request_ids.assign(req.headers(), peer.ip());
        // Counts the request and logs its line when finished, or with 499 if
        // the client goes away first.
        let mut pending =
            Pending::new(self.configured.access_log, &req, peer.ip(), request_id, Some(self.configured.request_series.clone()));
        let id = pending.request_id().clone();
        let head = req.method() == Method::HEAD;
        let mut resp = match self.dispatch(req, peer, pending.trace(), &id).await {
            Ok(resp) => resp,
            Err(e) => {
                let trace = pending.trace();
                trace.problem = Some(e.type_name());
                trace.outcome.get_or_insert(e.outcome());
                let resp = self.problem(&e, &id);
                // An answer to HEAD has no content (over HTTP/2 a client
                // resets a stream that has some).
                if head { resp.map(|_| Body::empty()) } else { resp }
            }
        };
        let trace = pending.trace();
        if let (Some(reason), Some(RequestOutcome::Rejected)) = (trace.problem, trace.outcome) {
            self.shared.metrics.rejected(reason);
        }
        resp.headers_mut().insert(REQUEST_ID, id);
        pending.finish(resp)
    }

    /// The request path proper: routes the request and says in `trace` what
    /// it was and how it ended.
    async fn dispatch(
        self: &Arc<Self>,
        mut req: Request<Incoming>,
        peer: SocketAddr,
        trace: &mut Trace,
        request_id: &HeaderValue,
    ) -> Result<Response<Body>, GatewayError> {
        // Everything from here on (routing, the authorizer, the fingerprint's
        // path parameters, the upstream) sees the path in normal form, or the
        // request is refused before any of it.
        let normal = self.configured.router.normalise(req.method(), req.uri().path()).map_err(GatewayError::InvalidRequest)?;
        if let Cow::Owned(normal) = normal {
            *req.uri_mut() = with_path(req.uri(), &normal)?;
        }
        // Hop-by-hop headers, and every header the client's `Connection`
        // names, are never forwarded: they go before anything reads the
        // headers, so that what is checked (the content type a body is read
        // by, the forwarding headers written next, an identity) is what the
        // upstream gets.
        if crate::upstream::headers::transfer_coded(req.headers()) {
            return Err(GatewayError::TransferCoded);
        }
        crate::upstream::headers::host_from_authority(&mut req);
        crate::upstream::headers::strip_hop_by_hop(req.headers_mut());
        // Header names with `_` (and every other spelling of a guarded
        // header) are gone before anything reads the headers.
        self.configured
            .header_screen
            .apply(req.headers_mut())
            .map_err(|_| GatewayError::InvalidRequest(InvalidRequest::UnderscoreHeader))?;
        let peer_ip = crate::proxy::access::canonical(peer.ip());
        crate::upstream::headers::write_forwarded(req.headers_mut(), peer_ip, self.shared.request_ids.trusts(peer_ip));
        // Two values of a credential: which one identifies the request is
        // ambiguous, and the upstream would get both. Refused before anything.
        if let Some(name) = self.configured.identifier.ambiguous(req.headers()) {
            tracing::debug!(header = %name, "a header identity sources read was sent more than once; refused");
            return Err(GatewayError::Unauthenticated);
        }
        if let Some(rest) = req.uri().path().strip_prefix(OPERATIONS_PATH) {
            trace.route = RouteLabel::OperationStatus;
            let rest = rest.to_owned();
            let (resp, outcome) = Box::pin(self.poll_operation(&rest, &mut req, peer)).await?;
            trace.outcome = Some(outcome);
            return Ok(resp);
        }
        let overridden = method_override::in_head(req.headers(), req.uri().query());
        match self.configured.router.route_normal(req.method(), req.uri().path(), overridden).map_err(GatewayError::InvalidRequest)? {
            RouteMatch::Operation { route, params } => {
                let route = route.clone();
                trace.route = RouteLabel::Operation(route.operation.clone());
                if self.configured.request_id_is_a_key.is_empty() || !self.configured.request_id_is_a_key.contains(&route.operation) {
                    self.send_request_id(&mut req, request_id);
                }
                // Boxed: the idempotent path's future is large; pass-through requests
                // should not carry (and move) it.
                let answer = Box::pin(self.operation(&route, params, req, peer, trace)).await;
                let outcome = match &answer {
                    Ok((_, outcome)) => *outcome,
                    Err(e) => e.outcome(),
                };
                // A forwarded request is counted when its result write
                // returned (`forwarded` or `fenced`; `ResultWrite::finish`).
                if outcome != RequestOutcome::Forwarded {
                    self.shared.metrics.request(&route.operation, outcome);
                }
                trace.outcome = Some(outcome);
                answer.map(|(resp, _)| resp)
            }
            RouteMatch::PassThrough { upstream } => {
                // No identity is required here, but the upstream gets only
                // the credentials of the source that identified the caller.
                admission::identify(&self.configured.identifier, &mut req, peer).await;
                self.send_request_id(&mut req, request_id);
                trace.route = RouteLabel::PassThrough;
                trace.outcome = Some(RequestOutcome::PassThrough);
                Box::pin(self.pass_through(upstream, req, trace)).await
            }
            RouteMatch::NotFound => Err(GatewayError::NotFound),
        }
    }

    /// The upstream gets the request id the gateway logs and answers with:
    /// a trusted proxy's, or the one generated (a client's own id from
    /// elsewhere is replaced; the access log keeps it as
    /// `client_request_id`). Not called for routes whose key comes from
    /// `X-Request-Id`: a legacy client's id is its idempotency key there, so
    /// it reaches the upstream as sent (and a request without one stays
    /// without one).
    fn send_request_id(&self, req: &mut Request<Incoming>, request_id: &HeaderValue) {
        req.headers_mut().insert(REQUEST_ID, request_id.clone());
    }

    /// The problem answer for `e`, naming this request as its `instance`;
    /// a 401 carries the challenge of the configured API keys.
    fn problem(&self, e: &GatewayError, request_id: &HeaderValue) -> Response<Body> {
        let mut resp = problem::response_with_instance(e, access::problem_instance(request_id).as_deref());
        if matches!(e, GatewayError::Unauthenticated)
            && let Some(challenge) = &self.configured.challenge
        {
            resp.headers_mut().insert(http::header::WWW_AUTHENTICATE, challenge.clone());
        }
        resp
    }

    /// An idempotent operation: admitted by the pipeline every front runs
    /// ([`admission::admit`]), then claimed and forwarded on the tracker.
    async fn operation(
        self: &Arc<Self>,
        route: &Arc<Route>,
        params: Vec<(String, String)>,
        req: Request<Incoming>,
        peer: SocketAddr,
        trace: &mut Trace,
    ) -> Result<(Response<Body>, RequestOutcome), GatewayError> {
        let (shared, configured) = (&*self.shared, &*self.configured);
        if let Mode::Observe { budget } = route.execution.mode {
            // Observe mode changes no answer: the upstream's is the client's.
            let upstream = self.executor.upstream(route.upstream);
            let resp = Box::pin(observe::observe(shared, configured, upstream, budget, route, params, req, peer)).await;
            return Ok((resp, RequestOutcome::PassThrough));
        }
        let mut front = Enforce { gateway: self, trace: &mut *trace };
        let (admitted, slot) =
            match admission::admit(&mut front, &configured.identifier, &configured.replica_id, route, params, req, peer).await {
                Ok(admitted) => admitted,
                // Boxed: rare branches that should not grow every request's future.
                Err(stop) => return Box::pin(self.stopped(route, stop, trace)).await,
            };
        trace.scope = Some(admitted.claim.scope.scope_id());
        // From the claim on, the work runs on the tracker: a client that goes
        // away can no longer cancel it between a committed claim and its
        // forward, nor between the forward and the recording of its result.
        let (tx, rx) = oneshot::channel();
        let gw = self.clone();
        let route = route.clone();
        self.shared.tracker.spawn(Box::pin(async move {
            let (out, write) = gw.claim_and_forward(&route, admitted, slot).await;
            // The client may be gone; the record is written either way. The
            // answer goes first: the result write then runs while it travels.
            let _ = tx.send(out);
            if let Some(write) = write {
                write.finish().await;
            }
        }));
        rx.await.unwrap_or(Err(GatewayError::Internal))
    }

    /// What enforcing does with a request admission stopped before its
    /// claim: a request without a key passes through; a refusal is
    /// answered; over the limit, a request whose key has a record is
    /// answered from it.
    async fn stopped(
        &self,
        route: &Route,
        stop: Stop<GatewayError>,
        trace: &mut Trace,
    ) -> Result<(Response<Body>, RequestOutcome), GatewayError> {
        let held = match stop {
            Stop::Refused(refused, _) => return Err(refused.error),
            Stop::Halted(overloaded, Held::Admitted(admitted)) => return self.answer_overloaded(route, &admitted, overloaded).await,
            Stop::Halted(error, _) => return Err(error),
            Stop::NoKey(held) => held,
        };
        let (parts, body) = match held {
            Held::Unread(req) => return Ok((self.pass_through(route.upstream, req, trace).await?, RequestOutcome::PassThrough)),
            Held::Read(parts, body) => (parts, body),
            Held::Admitted(admitted) => (admitted.parts, Body::full(admitted.body)),
        };
        let upstream = self.executor.upstream(route.upstream);
        let answer = passthrough::try_forward(upstream, parts, body).await;
        self.shared.metrics.passed_through(upstream.name(), answer.as_ref().err().map(GatewayError::type_name));
        Ok((answer?, RequestOutcome::PassThrough))
    }

    /// Admission under overload, before the claim: a refusal claims
    /// nothing, so the client's retry with the same key is safe. A forward
    /// needs a slot of its route's cap and its upstream's limit (held until
    /// the upstream answers); an acceptance needs room in its route's queue.
    async fn admitted_under_load(&self, route: &Route, claim: &ClaimRequest) -> Result<Option<Slot>, GatewayError> {
        if claim.acceptance.is_some() {
            let queued = self.shared.metrics.queued(&route.operation);
            if u64::try_from(queued).unwrap_or(0) >= route.queueing().max_queued {
                tracing::debug!(route = %route.operation, queued, max_queued = route.queueing().max_queued, "async queue full; acceptance refused");
                return Err(GatewayError::Overloaded);
            }
            return Ok(None);
        }
        let upstream = self.executor.upstream(route.upstream).limit();
        let cap = self.configured.route_limits.get(&route.operation);
        if let Some(slot) = Slot::try_now(upstream, cap) {
            return Ok(Some(slot));
        }
        // At the limit: a retry of a completed key (or of an accepted
        // operation) needs no slot, and is answered from its record at once
        // (`answer_overloaded`), not after waiting `queue_timeout` for a slot
        // it would not use. Only those: a duplicate of one in flight may wait
        // for its result (`in_flight = "wait"`), and an unknown record may be
        // taken over on an upstream that deduplicates; both go on as before.
        if let Ok(Some((record, now))) = self.configured.store.get(&claim.scope).await
            && matches!(decide(&record, &claim.request_hash, now), Decision::Replay | Decision::Accepted)
        {
            return Err(GatewayError::Overloaded);
        }
        match Slot::acquire(upstream, cap).await {
            Ok(slot) => Ok(Some(slot)),
            Err(Overloaded) => {
                tracing::debug!(route = %route.operation, limit = upstream.current(), "upstream limit reached; refused before the claim");
                Err(GatewayError::Overloaded)
            }
        }
    }

    /// Over the limit nothing may be claimed, but a request whose key already
    /// has a record is answered from it as its claim would have been: a
    /// replay, a duplicate of one in flight (409, as ever), a mismatch, an
    /// unknown outcome, an accepted operation. Only a request that would be
    /// forwarded (no record, or one a claim would take over) gets `refused`.
    async fn answer_overloaded(
        &self,
        route: &Route,
        admitted: &Admitted,
        refused: GatewayError,
    ) -> Result<(Response<Body>, RequestOutcome), GatewayError> {
        let Admitted { claim, params, parts, body, .. } = admitted;
        let request = admission::request_parts(route, params, parts, body);
        self.answer_from_record(route, claim, parts, &request, refused).await
    }

    /// [`Gateway::answer_overloaded`] for a request whose parts are read:
    /// answered from its key's record as its claim would have been, or
    /// `refused` when the claim would forward.
    async fn answer_from_record(
        &self,
        route: &Route,
        claim: &ClaimRequest,
        parts: &request::Parts,
        request: &RequestParts<'_>,
        refused: GatewayError,
    ) -> Result<(Response<Body>, RequestOutcome), GatewayError> {
        let Ok(Some((record, now))) = self.configured.store.get(&claim.scope).await else { return Err(refused) };
        match self.decide_existing(route, &record, &claim.request_hash, request, now).await {
            Decision::Replay => {
                let stored = record.response.as_ref().ok_or(GatewayError::Internal)?;
                self.answer_from(route, stored, &parts.headers).await.map(|r| (r, RequestOutcome::Replayed))
            }
            Decision::Mismatch => Err(GatewayError::KeyReused { status: route.key.mismatch_status }),
            Decision::Accepted => Ok((self.accepted(route, &record), RequestOutcome::Accepted)),
            Decision::Unknown => Err(GatewayError::RecordUnknown),
            Decision::InProgress { .. } => Err(GatewayError::InProgress { retry_after: IN_PROGRESS_RETRY_AFTER }),
            Decision::LeaseExpired | Decision::Expired => Err(refused),
        }
    }

    /// Claims the scope and forwards, or answers from the record it found.
    /// When the upstream answered, its result write is returned to be run
    /// once the client has the answer.
    async fn claim_and_forward<'a>(
        &'a self,
        route: &'a Route,
        admitted: Box<Admitted>,
        mut slot: Option<Slot>,
    ) -> (Result<(Response<Body>, RequestOutcome), GatewayError>, Option<ResultWrite<'a>>) {
        let Admitted { claim, params, parts, body, .. } = *admitted;
        // A result this replica answered and is still writing comes first:
        // its client's retry is replayed, not told "in flight".
        self.shared.waiters.settled(&claim.scope, self.configured.store.timeout()).await;
        let request = admission::request_parts(route, &params, &parts, &body);
        match self.claim_or_answer(route, &claim, &parts, &request, &mut slot).await {
            Ok(Claimed::Answered(answer)) => (Ok(answer), None),
            Ok(Claimed::Run(c)) => self.executor.run_sync(route, &c, parts, body, slot).await,
            Err(e) => (Err(e), None),
        }
    }

    /// Claims the scope, or answers from the record the claim found.
    /// `request` is what the claim's fingerprint was computed from; `slot`,
    /// the upstream slot the request was admitted with (given back while it
    /// waits for a duplicate's result, taken again before a claim that may
    /// forward).
    async fn claim_or_answer(
        &self,
        route: &Route,
        claim: &ClaimRequest,
        parts: &request::Parts,
        request: &RequestParts<'_>,
        slot: &mut Option<Slot>,
    ) -> Result<Claimed, GatewayError> {
        let request_hash = claim.request_hash;
        let wait_until = match route.record.in_flight {
            InFlightPolicy::Wait(d) => Some(tokio::time::Instant::now() + d),
            InFlightPolicy::Reject => None,
        };
        let (mut expired_rounds, mut wait_rounds) = (0, 0);
        // Whether the request was admitted with a slot: one given back for a
        // wait must be held again by any claim that forwards.
        let admitted_with_slot = slot.is_some();
        loop {
            let claim_started = Instant::now();
            let outcome = match self.configured.store.claim(claim).await {
                Ok(outcome) => outcome,
                Err(e) => {
                    crate::telemetry::throttle::warn_throttled!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "claim failed; nothing forwarded");
                    // An unconfirmed synchronous claim is deleted later (nobody
                    // forwards it); an unconfirmed acceptance stays: if it
                    // committed, a retry reads it back as accepted and a
                    // worker runs it once.
                    if e.is_ambiguous() && claim.acceptance.is_none() {
                        self.abandon_later(claim, route.record.lease);
                    }
                    return Err(GatewayError::StoreUnavailable);
                }
            };
            let (record, now) = match outcome {
                ClaimOutcome::Claimed(c) if claim.acceptance.is_some() => {
                    self.shared.metrics.accepted(&route.operation);
                    self.shared.wake_workers.notify_waiters();
                    return Ok(Claimed::Answered((self.accepted(route, &accepted_record(claim, &c)), RequestOutcome::Accepted)));
                }
                ClaimOutcome::Claimed(c) => {
                    // The lease began when the claim committed, at most this
                    // long ago. If what is left cannot cover the upstream's
                    // timeout (the claim took long: retries, read-backs), the
                    // result could not be recorded in time: give the key back
                    // instead of forwarding.
                    let upstream_timeout = self.executor.upstream(route.upstream).config.timeout;
                    if claim_started.elapsed() + upstream_timeout >= route.record.lease {
                        tracing::warn!(route = %route.operation, scope = %c.scope.log_id(), "claim took too long to leave room for the upstream; released, nothing forwarded");
                        self.executor.release(route, &c).await;
                        return Err(GatewayError::StoreUnavailable);
                    }
                    // The slot given back for a wait was not taken again
                    // (the record said the claim would answer, or could not
                    // be read, and then moved on): a free slot now, or the
                    // key goes back and nothing is forwarded.
                    if admitted_with_slot && slot.is_none() {
                        let upstream = self.executor.upstream(route.upstream).limit();
                        match Slot::try_now(upstream, self.configured.route_limits.get(&route.operation)) {
                            Some(again) => *slot = Some(again),
                            None => {
                                self.executor.release(route, &c).await;
                                return Err(GatewayError::Overloaded);
                            }
                        }
                    }
                    return Ok(Claimed::Run(c));
                }
                ClaimOutcome::Existing { record, now } => (record, now),
            };
            match self.decide_existing(route, &record, &request_hash, request, now).await {
                Decision::Replay => {
                    let stored = record.response.as_ref().ok_or(GatewayError::Internal)?;
                    return self.answer_from(route, stored, &parts.headers).await.map(|r| Claimed::Answered((r, RequestOutcome::Replayed)));
                }
                Decision::Mismatch => return Err(GatewayError::KeyReused { status: route.key.mismatch_status }),
                Decision::Accepted => return Ok(Claimed::Answered((self.accepted(route, &record), RequestOutcome::Accepted))),
                Decision::Unknown => return Err(GatewayError::RecordUnknown),
                Decision::LeaseExpired => {
                    match self.configured.store.expire_lease(&record).await {
                        Ok(WriteOutcome::Written) => {
                            self.shared.metrics.reaped(1);
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
                    // The wait holds no upstream slot: it sends nothing, and
                    // held, it would keep new keys out of a busy upstream.
                    let held = slot.take().is_some();
                    self.shared.waiters.wait(&claim.scope, wait_rounds, deadline).await;
                    wait_rounds += 1;
                    if held {
                        match self.slot_after_wait(route, claim, request, deadline, &mut wait_rounds).await {
                            Ok(again) => *slot = again,
                            Err(GatewayError::Overloaded) => {
                                let refused = GatewayError::Overloaded;
                                return self.answer_from_record(route, claim, parts, request, refused).await.map(Claimed::Answered);
                            }
                            Err(e) => return Err(e),
                        }
                    }
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

    /// What `record` means for this request ([`decide_with_legacy`]). A
    /// mismatch with a record written under other fingerprint settings is
    /// looked at again under those ([`FingerprintHistory`]): a retry of the
    /// recorded request, made before a rollout changed the settings, is
    /// answered as one.
    async fn decide_existing(
        &self,
        route: &Route,
        record: &Record,
        request_hash: &Fingerprint,
        request: &RequestParts<'_>,
        now: Timestamp,
    ) -> Decision {
        let decision = decide_with_legacy(route, record, request_hash, request, now, None);
        if decision != Decision::Mismatch {
            return decision;
        }
        let Some(digest) = record.fingerprint_spec.as_deref().filter(|d| **d != *route.key.fingerprint_digest) else { return decision };
        let Some(spec) = self.shared.fingerprints.find(self.shared.store(), digest).await else { return decision };
        decide_with_legacy(route, record, request_hash, request, now, Some(&spec))
    }

    /// After a wait for a duplicate's result, the slot a claim that may
    /// forward needs. While the key is still in flight (and the wait has
    /// time left) it waits on, without one; a record a claim would answer
    /// from (a replay, a mismatch, an acceptance) needs none; anything else
    /// (no record, an expired lease, a record that may be taken over) takes
    /// one as admission does, or is refused before the claim (`Overloaded`).
    async fn slot_after_wait(
        &self,
        route: &Route,
        claim: &ClaimRequest,
        request: &RequestParts<'_>,
        deadline: tokio::time::Instant,
        wait_rounds: &mut usize,
    ) -> Result<Option<Slot>, GatewayError> {
        loop {
            let decision = match self.configured.store.get(&claim.scope).await {
                Ok(Some((record, now))) => Some(self.decide_existing(route, &record, &claim.request_hash, request, now).await),
                Ok(None) => None,
                // The claim finds out.
                Err(_) => return Ok(None),
            };
            match decision {
                Some(Decision::InProgress { .. }) if tokio::time::Instant::now() < deadline => {
                    self.shared.waiters.wait(&claim.scope, *wait_rounds, deadline).await;
                    *wait_rounds += 1;
                }
                Some(Decision::InProgress { .. } | Decision::Replay | Decision::Mismatch | Decision::Accepted) => return Ok(None),
                _ => return self.admitted_under_load(route, claim).await,
            }
        }
    }

    /// A claim whose commit could not be confirmed may exist although nothing
    /// was forwarded: delete it by its token once the store answers again, so
    /// the client's retry is not refused. Gives up when the lease would have
    /// expired (the record then shows as `unknown`, and the logs say why).
    fn abandon_later(&self, claim: &ClaimRequest, lease: Duration) {
        self.configured.store.abandon_later(&self.shared.tracker, &claim.scope, claim.claim_token, lease);
    }

    /// A completed record's answer: the stored one, or read again from the
    /// upstream with the caller's credentials (`replay = "refetch"`).
    async fn answer_from(&self, route: &Route, stored: &StoredResponse, caller: &HeaderMap) -> Result<Response<Body>, GatewayError> {
        match route.record.replay {
            ReplayMode::Stored => replay(stored),
            ReplayMode::Refetch => refetch(self.executor.upstream(route.upstream), stored, caller).await,
        }
    }

    /// The answer to an accepted operation (and to its retries): 202, where to
    /// poll, when, and the status document.
    fn accepted(&self, route: &Route, record: &Record) -> Response<Body> {
        let doc = status_document(record, route.queueing().poll_interval, route.record.retention);
        let mut resp = json_response(StatusCode::ACCEPTED, &doc);
        let h = resp.headers_mut();
        if let Some(id) = &record.operation_id
            && let Ok(location) = HeaderValue::from_str(&format!("{OPERATIONS_PATH}{id}"))
        {
            h.insert(http::header::LOCATION, location);
        }
        h.insert(http::header::RETRY_AFTER, HeaderValue::from(route.queueing().poll_interval.as_secs().max(1)));
        resp
    }

    /// `GET /_idemgate/operations/{id}` and `.../{id}/result`: only the scope
    /// that made the request may read it (anyone else gets 404, never 403).
    async fn poll_operation(
        &self,
        rest: &str,
        req: &mut Request<Incoming>,
        peer: SocketAddr,
    ) -> Result<(Response<Body>, RequestOutcome), GatewayError> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return Err(GatewayError::NotFound);
        }
        let (id, want_result) = match rest.strip_suffix("/result") {
            Some(id) => (id, true),
            None => (rest, false),
        };
        if id.is_empty() || id.contains('/') || id.len() > 64 {
            return Err(GatewayError::NotFound);
        }
        // A refetched result goes to the upstream with the caller's headers.
        let identity = admission::identify(&self.configured.identifier, req, peer).await.ok_or(GatewayError::Unauthenticated)?;
        let record = match self.configured.store.operation(&identity.tenant, id).await {
            // Past its retention an operation is gone, as a synchronous
            // record is (`Decision::Expired`), whether or not the sweeper
            // has come by yet: a retry of its key starts a new one.
            Ok(Some((record, now))) if record.state.is_retained() && record.expires_at <= now => return Err(GatewayError::NotFound),
            Ok(Some((record, _))) if record.scope.visible_to(&identity) => record,
            Ok(_) => return Err(GatewayError::NotFound),
            Err(e) => {
                tracing::warn!(error = %e, "operation lookup failed");
                return Err(GatewayError::StoreUnavailable);
            }
        };
        // Reading a stored answer is asked again: a revoked principal gets 403.
        self.authorized(&record.scope.operation, req.method(), req.uri().path(), &identity, req.headers()).await?;
        let route = self.configured.router.route_for(&record.scope.operation);
        let (poll, retention) = route.map_or((Duration::from_secs(1), Retention::For(Duration::from_secs(24 * 3600))), |r| {
            (r.queueing().poll_interval, r.record.retention)
        });
        if want_result {
            return match (&record.state, &record.response, route) {
                (State::Completed, Some(stored), Some(route)) => {
                    self.answer_from(route, stored, req.headers()).await.map(|r| (r, RequestOutcome::Replayed))
                }
                (State::Completed, Some(stored), None) => replay(stored).map(|r| (r, RequestOutcome::Replayed)),
                _ => Err(GatewayError::OperationNotCompleted { state: record.state, retry_after: poll }),
            };
        }
        let mut resp = json_response(StatusCode::OK, &status_document(&record, poll, retention));
        if crate::request::async_op::is_pending(record.state) {
            resp.headers_mut().insert(http::header::RETRY_AFTER, HeaderValue::from(poll.as_secs().max(1)));
        }
        Ok((resp, RequestOutcome::Polled))
    }

    /// Proxies without idempotency, streaming both ways; except that on a
    /// path a route protects, a body a framework may read `_method` from is
    /// read whole first (within `max_request_body`) and a request whose
    /// body names one is refused.
    async fn pass_through(&self, upstream: UpstreamId, req: Request<Incoming>, trace: &mut Trace) -> Result<Response<Body>, GatewayError> {
        let upstream = self.executor.upstream(upstream);
        let answer = if self.body_may_override(&req) {
            let (parts, body) = req.into_parts();
            let body = read_body(body, &parts.headers, self.configured.max_request_body, self.configured.request_body_timeout).await?;
            trace.bytes_in = Some(body.len() as u64);
            // Encoded, `_method` could hide from the scan and reach a
            // framework that decodes the body.
            if !body.is_empty() && crate::upstream::headers::content_coded(&parts.headers) {
                return Err(GatewayError::ContentEncoded);
            }
            if method_override::in_body(&parts.headers, &body) {
                return Err(GatewayError::InvalidRequest(InvalidRequest::MethodOverride));
            }
            passthrough::try_forward(upstream, parts, Body::full(body)).await
        } else {
            let bytes_in = self.configured.access_log.then(|| trace.count_bytes_in());
            passthrough::try_pass_through(upstream, req, self.configured.request_body_timeout, bytes_in).await
        };
        self.shared.metrics.passed_through(upstream.name(), answer.as_ref().err().map(GatewayError::type_name));
        answer
    }

    /// Whether `req` has a body a framework could read `_method` from
    /// ([`method_override::body_read`]) on a path a route protects
    /// ([`Router::protects`]).
    fn body_may_override(&self, req: &Request<Incoming>) -> bool {
        !hyper::body::Body::is_end_stream(req.body())
            && method_override::body_read(req.headers())
            && self.configured.router.protects(req.uri().path(), None)
    }
}

/// Enforcing's phases of admission (see [`crate::proxy::admission`]): the
/// route's authorizer is asked, the body is read within its limits (a body
/// naming another method is refused), and a forward needs room under its
/// upstream's and its route's limits.
struct Enforce<'a> {
    gateway: &'a Gateway,
    trace: &'a mut Trace,
}

impl Front for Enforce<'_> {
    type Slot = Option<Slot>;
    type Halt = GatewayError;

    async fn authorize(&mut self, route: &Route, req: &Request<Incoming>, identity: &Identity) -> Result<(), GatewayError> {
        self.gateway.authorized(&route.operation, req.method(), req.uri().path(), identity, req.headers()).await
    }

    async fn read_body(
        &mut self,
        _: &Route,
        parts: request::Parts,
        body: Incoming,
    ) -> Result<(request::Parts, Bytes), (GatewayError, Held)> {
        let c = &self.gateway.configured;
        let body = match read_body(body, &parts.headers, c.max_request_body, c.request_body_timeout).await {
            Ok(body) => body,
            Err(e) => return Err((e, Held::Read(parts, Body::empty()))),
        };
        self.trace.bytes_in = Some(body.len() as u64);
        if method_override::body_read(&parts.headers) && method_override::in_body(&parts.headers, &body) {
            return Err((GatewayError::InvalidRequest(InvalidRequest::MethodOverride), Held::Read(parts, Body::empty())));
        }
        Ok((parts, body))
    }

    async fn load(&mut self, route: &Route, claim: &ClaimRequest) -> Result<Option<Slot>, GatewayError> {
        self.gateway.admitted_under_load(route, claim).await
    }
}

/// The record an acceptance just wrote, for its 202 (the same document a
/// retry reads back from the store).
fn accepted_record(req: &ClaimRequest, claim: &crate::store::Claim) -> Record {
    let at = claim.lease_expires_at;
    Record {
        scope: req.scope.clone(),
        request_hash: req.request_hash,
        state: State::Queued,
        generation: claim.generation,
        claim_token: claim.claim_token,
        owner: req.owner.to_string(),
        lease_expires_at: None,
        response: None,
        created_at: at,
        updated_at: at,
        expires_at: at,
        operation_id: req.acceptance.as_ref().map(|a| a.operation_id.clone()),
        attempts: 0,
        next_attempt_at: Some(at),
        sent_at: None,
        last_status: None,
        maybe_executed: false,
        key_source: Some(req.key_source.to_string()),
        reforward_key: req.reforward,
        sent_key: Some(req.sent),
        fingerprint_spec: Some(req.fingerprint_spec.to_string()),
    }
}

/// `uri` with its path replaced by `path` (its normal form); scheme,
/// authority and query kept as they are.
fn with_path(uri: &Uri, path: &str) -> Result<Uri, GatewayError> {
    let path_and_query = match uri.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.to_owned(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(path_and_query).map_err(|e| {
        tracing::warn!(error = %e, "a normalised path does not parse");
        GatewayError::Internal
    })?);
    Uri::from_parts(parts).map_err(|e| {
        tracing::warn!(error = %e, "a normalised URI does not parse");
        GatewayError::Internal
    })
}

fn json_response(status: StatusCode, doc: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(doc.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future `f` returns, without calling it.
    fn future_size<A, F: std::future::Future>(_f: impl FnOnce(A) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every request's future is built, then moved as a whole into the
    /// worker's box. The branches a first write does not take (pass-through,
    /// the authorizer's call, observe mode) are boxed so that it stays small:
    /// inline, they made it 9.8 KB, copied several times per request
    /// (docs/performance-notes.md, issue 32).
    #[test]
    fn a_requests_future_stays_small() {
        let size = future_size(|(gw, req, peer): (Arc<Gateway>, Request<Incoming>, SocketAddr)| gw.handle(req, peer));
        assert!(size <= 4096, "Gateway::handle's future is {size} bytes");
    }
}
