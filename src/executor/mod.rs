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

pub mod classify;
pub mod waiters;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use bytes::Bytes;
use http::{HeaderValue, Response, request};
use tokio_util::task::TaskTracker;

use crate::executor::classify::{Class, SyncWrite};
use crate::executor::waiters::{Recording, Waiters};
use crate::idempotency::outcome::{AttemptOutcome, RequestOutcome};
use crate::idempotency::record::{StoredResponse, may_forward};
use crate::problem::GatewayError;
use crate::request::async_op::StoredRequest;
use crate::request::route::{ForwardKey, ReplayMode, Route};
use crate::retry;
use crate::secret::DerivedKeySecret;
use crate::store::{Claim, RetryNote, Store, Taken, WriteOutcome};
use crate::telemetry::metrics::Metrics;
use crate::upstream::body::{Body, Streamed};
use crate::upstream::headers::{self, strip_hop_by_hop};
use crate::upstream::limit::{Sample, Slot};
use crate::upstream::{ResponseBody, Upstream, UpstreamError, error_chain};

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
    derived_key_secret: DerivedKeySecret,
}

/// What one exchange with the upstream established, before anything is
/// recorded.
pub enum Exchange {
    /// A response whose body was read (whole, or up to the storage limit).
    Answered { head: http::response::Parts, body: UpstreamBody },
    /// The upstream answered, but asked not to be recorded
    /// (`Idempotency-Policy: no-store`) or with a `release_on_status`
    /// status. The body has not been read.
    Declined { head: http::response::Parts, body: ResponseBody, no_store: bool },
    /// The request never left idemgate: nothing can have executed.
    NotSent(UpstreamError),
    /// The request was sent; the upstream may have executed it, but its
    /// answer is lost.
    MaybeExecuted(UpstreamError),
}

impl Exchange {
    /// The classifier's word on this exchange.
    pub fn class(&self) -> Class {
        match self {
            Exchange::Answered { .. } => Class::Answered,
            Exchange::Declined { no_store, .. } => Class::Declined { no_store: *no_store },
            Exchange::NotSent(_) => Class::NotSent,
            Exchange::MaybeExecuted(_) => Class::MaybeExecuted,
        }
    }

    /// The failure, when the exchange failed.
    pub fn error(&self) -> Option<&UpstreamError> {
        match self {
            Exchange::NotSent(e) | Exchange::MaybeExecuted(e) => Some(e),
            Exchange::Answered { .. } | Exchange::Declined { .. } => None,
        }
    }

    /// What this exchange, `elapsed` long, tells the upstream's concurrency
    /// limit: an answer's latency, or a sign of overload (a timeout, a
    /// connection refused or broken, 429 or 503). A request that could not
    /// be built says nothing.
    pub fn sample(&self, elapsed: Duration) -> Option<Sample> {
        let overloaded =
            |status: http::StatusCode| matches!(status, http::StatusCode::TOO_MANY_REQUESTS | http::StatusCode::SERVICE_UNAVAILABLE);
        match self {
            Exchange::Answered { head, .. } | Exchange::Declined { head, .. } if overloaded(head.status) => Some(Sample::Dropped),
            Exchange::Answered { .. } | Exchange::Declined { .. } => Some(Sample::Answered(elapsed)),
            Exchange::NotSent(UpstreamError::InvalidRequest(_)) => None,
            Exchange::NotSent(_) | Exchange::MaybeExecuted(_) => Some(Sample::Dropped),
        }
    }
}

/// An upstream response body as read for recording.
pub enum UpstreamBody {
    Complete(Bytes),
    /// Over the storage limit: what was read so far and the rest of the stream.
    TooLarge {
        prefix: Bytes,
        rest: ResponseBody,
    },
}

/// The result write of an attempt the upstream answered, run after the
/// client has its answer, on the same tracked task. The claim was committed
/// before the request left; this write is committed before any replay can
/// read the result (replays read committed records only). Until it returns,
/// a claim of the same scope on this replica waits for it (see `waiters`).
#[must_use]
pub struct ResultWrite<'a> {
    executor: &'a Executor,
    route: &'a Route,
    claim: Claim,
    stored: StoredResponse,
    _recording: Recording<'a>,
}

impl ResultWrite<'_> {
    /// Writes the result, fenced by the attempt. A fenced write (a newer
    /// attempt holds the record) is logged and counted by the store. A write
    /// that fails is retried in the background until the lease would run
    /// out. The request is counted here, as `forwarded` or `fenced`
    /// (`idemgate_requests_total`), not when it was answered.
    pub async fn finish(self) {
        let ResultWrite { executor, route, claim, stored, _recording } = self;
        let outcome = match executor.store.complete(&claim, &stored, route.record.retention).await {
            Ok(WriteOutcome::Written) => RequestOutcome::Forwarded,
            Ok(WriteOutcome::Fenced) => RequestOutcome::Fenced,
            Err(e) => {
                // The upstream acted and the client has its answer. The store
                // may be failing over: keep trying in the background until the
                // lease would run out; only then does the expiry turn it unknown.
                crate::telemetry::throttle::warn_throttled!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "could not record the result; retrying in the background");
                executor.record_later(&claim, stored, route);
                RequestOutcome::Forwarded
            }
        };
        executor.metrics.request(&route.operation, outcome);
        drop(_recording);
        executor.waiters.wake(&claim.scope);
    }
}

impl Executor {
    pub fn new(
        upstreams: Vec<Upstream>,
        store: Store,
        metrics: Arc<Metrics>,
        tracker: TaskTracker,
        waiters: Arc<Waiters>,
        derived_key_secret: DerivedKeySecret,
    ) -> Executor {
        Executor { upstreams, store, metrics, tracker, waiters, derived_key_secret }
    }

    /// A copy with its own upstream connection pools (for another event loop).
    /// The key under which the `Idempotency-Key` sent upstream is derived.
    pub fn derived_key_secret(&self) -> DerivedKeySecret {
        self.derived_key_secret.clone()
    }

    pub fn with_own_pools(&self) -> Executor {
        Executor {
            upstreams: self.upstreams.iter().map(Upstream::with_own_pool).collect(),
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

    /// Every upstream, by id.
    pub fn upstreams(&self) -> &[Upstream] {
        &self.upstreams
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The synchronous attempt: forwards and returns the answer for the
    /// waiting client, with the result write still to do when the upstream
    /// answered (the caller answers the client first, then runs it). The
    /// record ends `completed` (or, for a response over the storage limit,
    /// completed without a body), released (the request never left, or the
    /// upstream declined recording), or `unknown`.
    /// `slot` is the one its admission took: freed once the upstream
    /// answered (or failed), having taught the limit what it took.
    pub async fn run_sync<'a>(
        &'a self,
        route: &'a Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
        slot: Option<Slot>,
    ) -> (Result<(Response<Body>, RequestOutcome), GatewayError>, Option<ResultWrite<'a>>) {
        self.metrics.forward_started();
        let (answer, write) = match self.sync_attempt(route, claim, parts, body, slot).await {
            Ok((response, outcome, write)) => (Ok((response, outcome)), write),
            Err(e) => (Err(e), None),
        };
        self.metrics.forward_finished();
        // Local waiters learn of the record's change now, or (a result to
        // write) when `ResultWrite::finish` has written it.
        if write.is_none() {
            self.waiters.wake(&claim.scope);
        }
        (answer, write)
    }

    async fn sync_attempt<'a>(
        &'a self,
        route: &'a Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
        slot: Option<Slot>,
    ) -> Result<(Response<Body>, RequestOutcome, Option<ResultWrite<'a>>), GatewayError> {
        let upstream_timeout = self.upstreams[route.upstream].config.timeout;
        // Never past the claim's lease: a process that learns of its claim
        // late, or is stopped between its claim and its send, sends nothing
        // once the lease may have run out (the reaper, a probe or a take-over
        // may have acted by then). Otherwise the upstream's timeout from now.
        let deadline = (tokio::time::Instant::now() + upstream_timeout).min(claim.asked_at + route.record.lease);
        let exchange = self.exchange_in(slot, route, claim, parts, body, deadline).await;
        // What the record becomes is the classifier's word (observe mode
        // writes by the same table); a completion is written after the
        // answer, by `ResultWrite`.
        let write = exchange.class().sync_write();
        match write {
            SyncWrite::Release => self.release(route, claim).await,
            SyncWrite::MarkUnknown => self.record_unknown(route, claim, exchange.error()).await,
            SyncWrite::Complete => {}
        }
        match exchange {
            Exchange::NotSent(e) => {
                tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream not reached; key released");
                Err(GatewayError::UpstreamUnavailable)
            }
            Exchange::MaybeExecuted(_) => Err(GatewayError::OutcomeUnknown),
            Exchange::Declined { head, body, no_store } => {
                tracing::debug!(scope = %claim.scope.log_id(), status = head.status.as_u16(), no_store, ?write, "upstream declined recording");
                Ok((Response::from_parts(head, Body::stream(body, upstream_timeout)), RequestOutcome::Released, None))
            }
            Exchange::Answered { head, body } => {
                let (stored_body, client_body) = match body {
                    UpstreamBody::Complete(bytes) => (Some(bytes.clone()), Body::full(bytes)),
                    UpstreamBody::TooLarge { prefix, rest } => {
                        tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), limit = route.record.max_stored_response,
                            "response larger than max_stored_response: recording status and headers only");
                        (None, Body::Prefixed { prefix: Some(prefix), rest: Streamed::new(rest, upstream_timeout) })
                    }
                };
                let stored = stored_form(
                    route,
                    StoredResponse { status: head.status.as_u16(), headers: headers::storable(&head.headers), body: stored_body },
                );
                // Listed before the client can have its answer, so that its
                // retry on this replica waits for the write.
                let result = (write == SyncWrite::Complete).then(|| ResultWrite {
                    executor: self,
                    route,
                    claim: claim.clone(),
                    stored,
                    _recording: self.waiters.recording(&claim.scope),
                });
                Ok((Response::from_parts(head, client_body), RequestOutcome::Forwarded, result))
            }
        }
    }

    /// The async attempt: a worker took the operation (`processing` under
    /// `claim`). Heartbeats renew the lease every third of it while the
    /// attempt runs; if one finds that a newer attempt holds the operation,
    /// this one stops at once and records nothing. Before the request leaves,
    /// `sent_at` is written (so an expired lease can tell "never sent" from
    /// "may have executed"). Then the outcome is recorded fenced: completed;
    /// re-queued with backoff (refused, declined by `release_on_status`, or
    /// lost on the way to a deduplicating upstream); `failed_retryable` when
    /// the retries are used up; or `unknown`.
    ///
    /// Once the attempt starts its final write, heartbeats stop deciding: a
    /// heartbeat fenced off by that very write (it ran just after it) is not
    /// a lost lease, and the write's own outcome (written or fenced) says
    /// what happened.
    /// `slot`: the upstream's slot the worker took it with, freed once the
    /// upstream answered. `worker`: the worker's turn, given back at the same
    /// point (or when the attempt ends without a send): recording the outcome
    /// does not keep the worker from its next operation.
    pub async fn run_async<W: Send>(&self, route: &Route, taken: &Taken, slot: Option<Slot>, worker: W) -> AttemptOutcome {
        let claim = &taken.claim;
        if taken.lease_expired {
            // Counted like the reaper's re-queues: an attempt that lost its lease and runs again.
            self.metrics.requeued(1);
            tracing::info!(route = %route.operation, scope = %claim.scope.log_id(), generation = %claim.generation,
                maybe_executed = taken.record.maybe_executed, "took over an attempt whose lease ran out");
        }
        let recording = AtomicBool::new(false);
        self.metrics.forward_started();
        let outcome = tokio::select! {
            outcome = self.async_attempt(route, taken, &recording, slot, worker) => outcome,
            () = self.heartbeats(claim, route.record.lease, &recording) => {
                tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), generation = %claim.generation,
                    "lost the lease to a newer attempt; this attempt stops and records nothing");
                AttemptOutcome::LostLease
            }
        };
        self.metrics.forward_finished();
        self.metrics.attempt(&route.operation, outcome);
        outcome
    }

    /// Renews the lease until a heartbeat is fenced (never returns otherwise).
    /// Renewals go on while the attempt is `recording` its outcome (a slow
    /// final write keeps its lease), but a heartbeat fenced then is not a lost
    /// lease: the final write itself may have fenced it.
    async fn heartbeats(&self, claim: &Claim, lease: Duration, recording: &AtomicBool) {
        let every = (lease / 3).max(Duration::from_millis(50));
        loop {
            tokio::time::sleep(every).await;
            match self.store.heartbeat(claim, lease).await {
                Ok(WriteOutcome::Written) => {}
                // Fenced by the attempt's own final write, perhaps: let it tell.
                Ok(WriteOutcome::Fenced) if recording.load(Ordering::Acquire) => return std::future::pending().await,
                Ok(WriteOutcome::Fenced) => return,
                // The store is unreachable: keep trying. If the lease runs out
                // meanwhile, the reaper decides and our later writes are fenced.
                Err(e) => crate::telemetry::throttle::warn_throttled!(scope = %claim.scope.log_id(), error = %e, "heartbeat failed"),
            }
        }
    }

    async fn async_attempt<W: Send>(
        &self,
        route: &Route,
        taken: &Taken,
        recording: &AtomicBool,
        slot: Option<Slot>,
        worker: W,
    ) -> AttemptOutcome {
        let claim = &taken.claim;
        let attempts = taken.record.attempts;
        let request = match StoredRequest::decode(&taken.request).and_then(|r| Ok((r.parts()?, r.body))) {
            Ok(r) => r,
            Err(e) => {
                recording.store(true, Ordering::Release);
                // Nothing is sent: the worker and the slot go back before the write (which
                // may be retried for as long as the lease holds).
                drop((worker, slot));
                // Nothing can be sent: the operation fails (it never executed).
                tracing::error!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "stored request is unreadable");
                return self
                    .record_async(route, claim, AttemptOutcome::Failed, || {
                        self.store.fail(claim, route.record.retention, RetryNote::default())
                    })
                    .await;
            }
        };
        if !may_forward(&taken.record, route.execution.upstream_idempotent) {
            // An earlier attempt may have executed and the route in force no
            // longer deduplicates upstream (a reload turned
            // `upstream_idempotent` off): never sent again, unknown.
            recording.store(true, Ordering::Release);
            // Nothing is sent: the worker and the slot go back before the write (which
            // may be retried for as long as the lease holds).
            drop((worker, slot));
            tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), generation = %claim.generation,
                "an earlier attempt may have executed and the route is not upstream_idempotent: not forwarded again; unknown");
            return self.record_async(route, claim, AttemptOutcome::Unknown, || self.store.mark_unknown(claim)).await;
        }
        if attempts > i32::try_from(route.queueing().retry.max_attempts).unwrap_or(i32::MAX) {
            // Lease expiries re-queued it after the last allowed attempt took it.
            recording.store(true, Ordering::Release);
            // Nothing is sent: the worker and the slot go back before the write (which
            // may be retried for as long as the lease holds).
            drop((worker, slot));
            return self
                .record_async(route, claim, AttemptOutcome::Failed, || self.store.fail(claim, route.record.retention, RetryNote::default()))
                .await;
        }
        // The exchange's deadline starts before the send is recorded, so
        // that the bound recorded with it (`sent_at` plus the timeout, in
        // the database's time, which is later) holds for the whole exchange,
        // however long this process takes between the two.
        let timeout = self.upstreams[route.upstream].config.timeout;
        let deadline = if taken.record.sent_at.is_some() {
            // The take recorded the send (the upstream deduplicates: no
            // never-sent proof is needed) and bounded it from before its
            // statement, where this deadline starts too.
            claim.asked_at + timeout
        } else {
            let deadline = tokio::time::Instant::now() + timeout;
            match self.store.mark_sent(claim, timeout).await {
                Ok(WriteOutcome::Written) => {}
                Ok(WriteOutcome::Fenced) => return AttemptOutcome::LostLease,
                Err(e) => {
                    // Not sent. The lease runs out and the reaper re-queues it: no
                    // sent_at proves it never left.
                    crate::telemetry::throttle::warn_throttled!(scope = %claim.scope.log_id(), error = %e, "could not record the send; not sending");
                    return AttemptOutcome::StoreUnavailable;
                }
            }
            deadline
        };
        let (parts, body) = request;
        let exchanged = self.exchange_in(slot, route, claim, parts, body, deadline).await;
        // From here on, every branch writes the attempt's outcome, and the
        // worker may take its next operation meanwhile.
        recording.store(true, Ordering::Release);
        drop(worker);
        match exchanged {
            Exchange::Answered { head, body } => {
                let body = match body {
                    UpstreamBody::Complete(bytes) => Some(bytes),
                    UpstreamBody::TooLarge { .. } => None,
                };
                let stored =
                    stored_form(route, StoredResponse { status: head.status.as_u16(), headers: headers::storable(&head.headers), body });
                self.record_async(route, claim, AttemptOutcome::Completed, || self.store.complete(claim, &stored, route.record.retention))
                    .await
            }
            // The upstream executed it but asked not to store the answer: the
            // outcome is known (completed), the body is not kept.
            Exchange::Declined { head, no_store: true, .. } => {
                let stored = StoredResponse { status: head.status.as_u16(), headers: headers::storable(&head.headers), body: None };
                self.record_async(route, claim, AttemptOutcome::Completed, || self.store.complete(claim, &stored, route.record.retention))
                    .await
            }
            Exchange::Declined { head, .. } => {
                let note = RetryNote { last_status: Some(head.status.as_u16()), maybe_executed: false };
                self.retry_later(route, claim, attempts, note).await
            }
            Exchange::NotSent(e) => {
                tracing::info!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream not reached; will retry");
                self.retry_later(route, claim, attempts, RetryNote::default()).await
            }
            Exchange::MaybeExecuted(e) if route.execution.upstream_idempotent => {
                tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e,
                    "outcome lost; the upstream deduplicates by the derived key, so the operation runs again");
                self.retry_later(route, claim, attempts, RetryNote { last_status: None, maybe_executed: true }).await
            }
            Exchange::MaybeExecuted(e) => {
                tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = %e, "upstream outcome unknown");
                self.record_async(route, claim, AttemptOutcome::Unknown, || self.store.mark_unknown(claim)).await
            }
        }
    }

    /// Back to the queue after the route's backoff, or ended once the
    /// attempts are used up (`failed_retryable`, or `unknown` if an attempt
    /// may have executed).
    async fn retry_later(&self, route: &Route, claim: &Claim, attempts: i32, note: RetryNote) -> AttemptOutcome {
        if attempts >= i32::try_from(route.queueing().retry.max_attempts).unwrap_or(i32::MAX) {
            return self.record_async(route, claim, AttemptOutcome::Failed, || self.store.fail(claim, route.record.retention, note)).await;
        }
        let delay = route.queueing().retry.delay(attempts);
        self.record_async(route, claim, AttemptOutcome::Requeued, || self.store.requeue(claim, delay, note)).await
    }

    /// Writes an attempt's `outcome` with `write`, fenced by the attempt.
    /// A write that fails is tried again until the lease would run out (the
    /// attempt's heartbeats go on meanwhile and renew it once the store is
    /// back): what the upstream answered is known and must not be left to
    /// the lease's expiry, which would call a completed operation unknown.
    async fn record_async<F, Fut>(&self, route: &Route, claim: &Claim, outcome: AttemptOutcome, write: F) -> AttemptOutcome
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<WriteOutcome, crate::store::StoreError>>,
    {
        let written = match write().await {
            Ok(written) => Some(written),
            Err(e) => {
                crate::telemetry::throttle::warn_throttled!(route = %route.operation, scope = %claim.scope.log_id(), error = %e,
                    outcome = outcome.as_str(), "could not record the attempt; retrying while its lease holds");
                let deadline = Instant::now() + route.record.lease;
                retry::while_leased(deadline, true, || async { write().await.ok() }).await
            }
        };
        match written {
            Some(WriteOutcome::Written) => outcome,
            Some(WriteOutcome::Fenced) => AttemptOutcome::LostLease,
            None => {
                tracing::error!(route = %route.operation, scope = %claim.scope.log_id(), outcome = outcome.as_str(),
                    "could not record the attempt while its lease held; its expiry will decide");
                AttemptOutcome::StoreUnavailable
            }
        }
    }

    /// [`Executor::exchange`] holding `slot` (if any), which then learns
    /// what the exchange took and is freed.
    pub async fn exchange_in(
        &self,
        slot: Option<Slot>,
        route: &Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
        deadline: tokio::time::Instant,
    ) -> Exchange {
        let started = Instant::now();
        let exchange = self.exchange(route, claim, parts, body, deadline).await;
        if let (Some(mut slot), Some(sample)) = (slot, exchange.sample(started.elapsed())) {
            slot.record(sample);
        }
        exchange
    }

    /// Forwards the claimed request once, by `deadline` (the upstream's
    /// timeout from the start of the attempt), and classifies what came
    /// back. Records nothing. A deadline already past sends nothing.
    pub async fn exchange(
        &self,
        route: &Route,
        claim: &Claim,
        parts: request::Parts,
        body: Bytes,
        deadline: tokio::time::Instant,
    ) -> Exchange {
        let upstream = &self.upstreams[route.upstream];
        let started = Instant::now();
        if tokio::time::Instant::now() >= deadline {
            let detail = "the attempt's deadline passed before its request could leave".to_owned();
            let kind = crate::telemetry::metrics::UpstreamErrorKind::Reset;
            return Exchange::NotSent(UpstreamError::NotSent { upstream: upstream.name().to_owned(), detail, kind });
        }
        let key_value = match route.key.forward {
            ForwardKey::Derived => {
                // Known before any claim can be made (see `secret::DerivedKeySecret`);
                // without it nothing may be sent.
                let Some(secret) = self.derived_key_secret.get() else {
                    return Exchange::NotSent(UpstreamError::InvalidRequest("the derived-key secret is not known yet".into()));
                };
                HeaderValue::from_str(&claim.scope.derived_key(Some(secret))).ok()
            }
            ForwardKey::Client => parts.headers.get(&route.key.header).cloned(),
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
                return failed(e);
            }
        };
        let (mut head, body) = resp.into_parts();
        if let Class::Declined { no_store } = classify::head(&route.record.release_on_status, &mut head) {
            self.metrics.observe_upstream(upstream.name(), started.elapsed());
            return Exchange::Declined { head, body, no_store };
        }
        let read = read_upstream_body(body, route.record.max_stored_response, deadline, declared_length(&head)).await;
        self.metrics.observe_upstream(upstream.name(), started.elapsed());
        match read {
            Ok(body) => Exchange::Answered { head, body },
            Err(e) => {
                upstream.count_error(&e);
                failed(e)
            }
        }
    }

    /// Frees the key. If the store cannot be reached now, keeps trying on the
    /// tracker until the lease would run out, so a request the upstream never
    /// acted on (or asked not to store) does not end up `unknown`.
    pub async fn release(&self, route: &Route, claim: &Claim) {
        if self.store.release(claim).await.is_ok() {
            return;
        }
        let (store, claim, lease) = (self.store.clone(), claim.clone(), route.record.lease);
        self.tracker.spawn(async move {
            let deadline = tokio::time::Instant::now() + lease;
            if retry::while_leased(deadline, true, || async { store.release(&claim).await.ok() }).await.is_some() {
                tracing::info!(scope = %claim.scope.log_id(), "key released after the store came back");
            } else {
                tracing::error!(scope = %claim.scope.log_id(), "could not release the key; its lease will turn it unknown");
            }
        });
    }

    /// Records a result whose write failed, on the tracker, until the claim's
    /// lease would run out (the write is fenced, so a late success can never
    /// overwrite another attempt's record).
    fn record_later(&self, claim: &Claim, stored: StoredResponse, route: &Route) {
        let (store, claim, retention) = (self.store.clone(), claim.clone(), route.record.retention);
        // The lease bounds the retries (its real expiry is on the store's
        // clock; a retry past it is fenced off, never harmful).
        let deadline = tokio::time::Instant::now() + route.record.lease;
        self.tracker.spawn(async move {
            match retry::while_leased(deadline, true, || async { store.complete(&claim, &stored, retention).await.ok() }).await {
                Some(WriteOutcome::Written) => tracing::info!(scope = %claim.scope.log_id(), "result recorded after the store came back"),
                Some(WriteOutcome::Fenced) => {}
                None => tracing::error!(scope = %claim.scope.log_id(), "could not record the result; its lease will turn it unknown"),
            }
        });
    }

    /// The upstream may have executed the request and its answer is lost.
    async fn record_unknown(&self, route: &Route, claim: &Claim, e: Option<&UpstreamError>) {
        tracing::warn!(route = %route.operation, scope = %claim.scope.log_id(), error = e.map(tracing::field::display), "upstream outcome unknown");
        if let Err(se) = self.store.mark_unknown(claim).await {
            tracing::error!(scope = %claim.scope.log_id(), error = %se, "could not record unknown; the lease expiry will");
        }
    }
}

/// What a route keeps of an answer: all of it, or (`replay = "refetch"`)
/// only the status and where to read the resource again.
pub(crate) fn stored_form(route: &Route, full: StoredResponse) -> StoredResponse {
    match route.record.replay {
        ReplayMode::Stored => full,
        ReplayMode::Refetch => {
            StoredResponse { status: full.status, headers: full.headers.into_iter().filter(|(n, _)| n == "location").collect(), body: None }
        }
    }
}

/// Re-reads a refetch route's stored `Location` from its upstream with the
/// caller's own headers (credentials included, hop-by-hop removed): a 2xx is
/// answered with the stored status, anything else (401, 403, 404: the caller
/// lost access or the resource is gone) is passed through as the upstream
/// said it, never replaced by stored data.
pub async fn refetch(upstream: &Upstream, stored: &StoredResponse, caller: &http::HeaderMap) -> Result<Response<Body>, GatewayError> {
    let location = stored
        .headers
        .iter()
        .find(|(n, _)| n == "location")
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|l| l.parse::<http::Uri>().ok())
        .ok_or(GatewayError::ResponseNotStored { original_status: stored.status })?;
    // Only the path and query: a refetch never leaves the route's upstream.
    let (mut parts, ()) = http::Request::get("/").body(()).map_err(|_| GatewayError::Internal)?.into_parts();
    parts.uri = location.path_and_query().map_or_else(|| http::Uri::from_static("/"), |pq| pq.as_str().parse().unwrap_or_default());
    parts.headers = caller.clone();
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts.headers.remove(http::header::CONTENT_TYPE);
    let deadline = tokio::time::Instant::now() + upstream.config.timeout;
    let req = upstream.request(parts, Body::empty(), None).map_err(|_| GatewayError::BadGateway)?;
    let resp = match upstream.send(req, deadline).await {
        Ok(resp) => resp,
        Err(UpstreamError::Timeout { .. }) => return Err(GatewayError::GatewayTimeout),
        Err(_) => return Err(GatewayError::BadGateway),
    };
    let (mut head, body) = resp.into_parts();
    strip_hop_by_hop(&mut head.headers);
    headers::strip_ours(&mut head.headers);
    if head.status.is_success() {
        head.status = http::StatusCode::from_u16(stored.status).map_err(|_| GatewayError::Internal)?;
        head.headers.insert(headers::IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(Response::from_parts(head, Body::stream(body, upstream.config.timeout)))
}

/// A failed exchange, as [`classify::failure`] says.
fn failed(e: UpstreamError) -> Exchange {
    match classify::failure(&e) {
        Class::MaybeExecuted => Exchange::MaybeExecuted(e),
        _ => Exchange::NotSent(e),
    }
}

/// The length a response's head declares for its body (`Content-Length`),
/// where it has one (not a 204 or 304, and not beside a `Transfer-Encoding`,
/// which frames the body instead).
pub(crate) fn declared_length(head: &http::response::Parts) -> Option<u64> {
    if matches!(head.status, http::StatusCode::NO_CONTENT | http::StatusCode::NOT_MODIFIED)
        || head.headers.contains_key(http::header::TRANSFER_ENCODING)
    {
        return None;
    }
    head.headers.get(http::header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// Reads an upstream response body up to `limit` bytes, within `deadline`.
/// A failure mid-body means the upstream acted but the answer is lost. So
/// does a body that ends short of the length its head declared: hyper ends
/// an HTTP/2 body reset with `NO_ERROR` as complete (RFC 9113 lets a server
/// stop a request's upload that way after a full response), and a front
/// whose own backend died mid-answer does just that.
async fn read_upstream_body(
    mut body: ResponseBody,
    limit: u64,
    deadline: tokio::time::Instant,
    declared: Option<u64>,
) -> Result<UpstreamBody, UpstreamError> {
    use http_body_util::BodyExt;
    let mut buf = bytes::BytesMut::new();
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(UpstreamError::Timeout { upstream: "response body".into(), timeout: Duration::ZERO }),
            Ok(None) => match declared {
                Some(n) if n != buf.len() as u64 => {
                    return Err(UpstreamError::Broken {
                        upstream: "response body".into(),
                        detail: format!("the body ended after {} of the {n} bytes its Content-Length declared", buf.len()),
                        kind: crate::telemetry::metrics::UpstreamErrorKind::Reset,
                    });
                }
                _ => return Ok(UpstreamBody::Complete(buf.freeze())),
            },
            Ok(Some(Err(e))) => {
                return Err(UpstreamError::Broken {
                    upstream: "response body".into(),
                    detail: error_chain(&e),
                    kind: crate::upstream::kind_of(&e),
                });
            }
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

#[cfg(test)]
mod tests {
    use super::declared_length;

    fn head(status: u16, headers: &[(&str, &str)]) -> http::response::Parts {
        let mut b = http::Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn only_a_content_length_that_frames_the_body_is_declared() {
        assert_eq!(declared_length(&head(201, &[("content-length", "100")])), Some(100));
        assert_eq!(declared_length(&head(201, &[])), None);
        assert_eq!(declared_length(&head(201, &[("content-length", "x")])), None);
        assert_eq!(declared_length(&head(204, &[("content-length", "100")])), None);
        assert_eq!(declared_length(&head(304, &[("content-length", "100")])), None);
        assert_eq!(declared_length(&head(200, &[("content-length", "100"), ("transfer-encoding", "chunked")])), None);
    }
}
