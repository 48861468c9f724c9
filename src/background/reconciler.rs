//! Reconciliation: ending `unknown` records without a person.
//!
//! A record is `unknown` when its request may have reached the upstream but
//! the answer was lost (a timeout after sending, a connection that broke, a
//! lease that ran out). Retrying blindly could execute it twice; releasing it
//! blindly could lose it. If the upstream can say, for a key, whether the
//! operation happened (a lookup by the derived `Idempotency-Key` it was
//! sent), a route's `[routes.reconcile]` [`Probe`] asks it:
//!
//! - the [`Reconciler`] (one background task per replica) takes `unknown`
//!   records of probed routes that have been unknown for at least `settle`
//!   (time for a request still on its way to arrive), marking each for the
//!   length of one probe so no other replica probes it meanwhile
//!   (`Store::take_probes`);
//! - it sends the probe (`GET /v1/orders/by-key/{derived_key}`) to the
//!   route's upstream and applies the answer through the one resolution path
//!   the CLI and the admin API use (`store::resolution::resolve`), as actor `reconciler`,
//!   fenced: only if the record is still `unknown`, at the generation probed,
//!   and still marked by this probe (an operator's resolution in between
//!   wins):
//!   - `found` statuses: the operation happened, the record is completed with
//!     the probe's response (status `found_as`, headers minus hop-by-hop),
//!     which retries are replayed;
//!   - `absent` statuses: it did not happen, the key is released and the
//!     client's retry runs it;
//!   - anything else (another status, a refused connection, a timeout): the
//!     record stays `unknown` and is probed again after an exponential
//!     backoff (`interval`, doubling, at most an hour), counted in
//!     `idemgate_probes_total{outcome="inconclusive"|"error"}`.
//!
//! Path parameters in the probe (`{id}` of `/v1/accounts/{id}/orders`) come
//! from the request as kept in the record: the stored request of an async
//! operation, or, on synchronous routes whose probe uses them, the request
//! line kept at claim time ([`request_head`](crate::request::async_op::request_head)).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::executor::{Executor, stored_form};
use crate::idempotency::outcome::ProbeOutcome;
use crate::idempotency::record::TransitionError;
use crate::idempotency::record::{ReforwardKey, StoredResponse};
use crate::request::async_op::StoredRequest;
use crate::request::route::Route;
use crate::secret::DerivedKeySecret;
use crate::store::audit::Actor;
use crate::store::resolution::{self, ResolveAction, ResolveError, ResolveRequest};
use crate::store::{ProbeRoute, Probing, Store, StoreError, WriteOutcome};
use crate::telemetry::metrics::Metrics;
use crate::upstream::Upstream;
use crate::upstream::body::Body;
use crate::upstream::headers;
use crate::upstream::limit::Permit;

pub use crate::request::reconcile_probe::{MAX_PROBE_BACKOFF, Probe, ProbeError, ProbeFinding, ProbeTarget, ProbeValues};

/// Records taken (and probed in parallel) per store statement.
const BATCH: u32 = 8;

/// A probed route with its upstream client.
#[derive(Debug)]
struct Probed {
    route: Arc<Route>,
    probe: Arc<Probe>,
    upstream: Upstream,
    /// How long a taken record stays marked: one probe plus its two store
    /// statements, so a replica that dies mid-probe frees it soon.
    hold: Duration,
}

/// The reconciler of one replica: a background task probing the `unknown`
/// records of every route with a probe.
#[derive(Debug)]
pub struct Reconciler {
    store: Store,
    metrics: Arc<Metrics>,
    routes: Vec<Probed>,
    /// The derived-key secret (the `{derived_key}` placeholder).
    secret: DerivedKeySecret,
}

/// What one probe of one record came to.
#[derive(Debug)]
enum Answer {
    Found { status: StatusCode, response: http::response::Parts, body: Option<Bytes> },
    Absent { status: StatusCode },
    Inconclusive { status: StatusCode },
    Error(ProbeError),
}

impl Reconciler {
    /// `None` when no route has a probe: nothing to run.
    /// Probes go to the upstreams of `executor` (sharing their concurrency
    /// limits with the requests).
    pub fn new(config: &Config, executor: &Executor, store: Store, metrics: Arc<Metrics>, secret: DerivedKeySecret) -> Option<Reconciler> {
        let routes: Vec<Probed> = config
            .routes
            .iter()
            .filter_map(|r| {
                let probe = r.background.reconcile.clone()?;
                let upstream = executor.upstreams().get(r.upstream)?.with_own_pool();
                let hold = upstream.config.timeout + config.store.operation_timeout * 2 + Duration::from_secs(1);
                Some(Probed { route: Arc::new(r.clone()), probe, upstream, hold })
            })
            .collect();
        if routes.is_empty() {
            return None;
        }
        metrics.declare_probes(routes.iter().map(|p| &*p.route.operation));
        Some(Reconciler { store, metrics, routes, secret })
    }

    /// Runs the task on `tracker` until `shutdown`.
    pub fn spawn(self, tracker: &TaskTracker, shutdown: CancellationToken) {
        tracker.spawn(self.run(shutdown));
    }

    async fn run(self, shutdown: CancellationToken) {
        tracing::debug!(task = "reconciler", routes = self.routes.len(), "background task started");
        // Every route is looked at once at start (records left unknown while
        // no replica ran), then every `interval`.
        let mut due: Vec<Instant> = vec![Instant::now(); self.routes.len()];
        loop {
            let next = due.iter().min().copied().unwrap_or_else(Instant::now);
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep_until(next) => {}
            }
            for (i, probed) in self.routes.iter().enumerate() {
                if due[i] > Instant::now() {
                    continue;
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    result = self.pass(probed) => match result {
                        Ok(0) => {}
                        Ok(n) => tracing::debug!(task = "reconciler", route = %probed.route.operation, records = n, "probe pass done"),
                        Err(e) => tracing::warn!(task = "reconciler", route = %probed.route.operation, error = %e,
                            "probe pass failed; retrying next interval"),
                    },
                }
                due[i] = Instant::now() + probed.probe.interval;
            }
        }
        tracing::debug!(task = "reconciler", "background task stopped");
    }

    /// Takes and settles the route's due records, batch after batch, until a
    /// batch comes back short.
    async fn pass(&self, probed: &Probed) -> Result<u64, StoreError> {
        let routes = [ProbeRoute {
            operation: probed.route.operation.clone(),
            settle: probed.probe.settle,
            at_upstream: probed.upstream.config.timeout,
        }];
        let mut total = 0;
        loop {
            // Probes count against the upstream's concurrency limit: a pass
            // takes no more records than it has slots free; at the limit it
            // waits its turn for one slot, as a request would, and probes one
            // record with it (none when no slot came: the next interval).
            // (Free slots are looked at, not held, while the store is asked.)
            let limit = probed.upstream.limit();
            let (mut turn, free) = match limit.available().min(BATCH) {
                0 => match limit.wait_turn().await {
                    Some(turn) => (Some(turn), 1),
                    None => {
                        tracing::debug!(task = "reconciler", route = %probed.route.operation, "the upstream is at its limit; probes wait");
                        return Ok(total);
                    }
                },
                free => (None, free),
            };
            let batch = self.store.take_probes(&routes, probed.hold, free).await?;
            let n = batch.len();
            // Each probe holds a slot while it runs (one that a request took
            // meanwhile is not waited for: the record is already taken).
            let slotted: Vec<(Probing, Option<Permit>)> =
                batch.into_iter().map(|p| (p, turn.take().or_else(|| limit.try_acquire()))).collect();
            // The slot moves into the probe's future: the closure returns
            // before the probe runs, and a permit bound in it alone would be
            // given back then.
            stream::iter(slotted)
                .for_each_concurrent(BATCH as usize, |(p, slot)| async move {
                    self.settle(probed, p).await;
                    drop(slot);
                })
                .await;
            total += n as u64;
            if n < free as usize || free < BATCH {
                return Ok(total);
            }
        }
    }

    /// Probes one record and applies the answer.
    async fn settle(&self, probed: &Probed, taken: Probing) {
        let scope = &taken.record.scope;
        let answer = self.probe(probed, &taken).await;
        let (route, probe) = (&*probed.route.operation, &probed.probe);
        let (outcome, action, reason) = match &answer {
            Answer::Found { status, response, body } => {
                let recorded = probe.found_as.unwrap_or(*status);
                // Kept as the route keeps any answer (a refetch route: the
                // status and where to read the resource again, no body).
                let full = StoredResponse { status: recorded.as_u16(), headers: headers::storable(&response.headers), body: body.clone() };
                let StoredResponse { headers, body, .. } = stored_form(&probed.route, full);
                // Retention: the route's (resolution::resolve's default below).
                let action = ResolveAction::Complete { status: recorded.as_u16(), headers, body, retention: None };
                let reason = format!("probe {} answered {} (found); recorded as {}", probe.method, status.as_u16(), recorded.as_u16());
                (ProbeOutcome::Found, Some(action), reason)
            }
            Answer::Absent { status } => (
                ProbeOutcome::Absent,
                Some(ResolveAction::Release),
                format!("probe {} answered {} (absent)", probe.method, status.as_u16()),
            ),
            Answer::Inconclusive { status } => (
                ProbeOutcome::Inconclusive,
                None,
                format!("probe {} answered {} (neither found nor absent)", probe.method, status.as_u16()),
            ),
            Answer::Error(e) => (ProbeOutcome::Error, None, format!("probe failed: {e}")),
        };
        self.metrics.probe(route, outcome);
        let Some(action) = action else {
            let attempts = taken.attempts.saturating_add(1);
            let retry_in = probe.backoff(attempts);
            tracing::warn!(route, scope = %scope.log_id(), attempts, retry_in = ?retry_in, outcome = outcome.as_str(), reason,
                "record stays unknown; probing again later");
            match self.store.probe_failed(scope, taken.fence, retry_in, &reason).await {
                Ok(WriteOutcome::Written) => {}
                Ok(WriteOutcome::Fenced) => tracing::info!(route, scope = %scope.log_id(), "the record changed while it was probed"),
                Err(e) => tracing::warn!(route, scope = %scope.log_id(), error = %e, "could not record the probe; its mark runs out"),
            }
            return;
        };
        let request = ResolveRequest {
            action,
            reason: Some(reason),
            force: false,
            actor: Actor::Reconciler,
            fence: Some(taken.fence),
            generation: None,
        };
        match resolution::resolve(&self.store, scope, request, probed.route.record.retention).await {
            Ok(_) => tracing::info!(route, scope = %scope.log_id(), outcome = outcome.as_str(), "unknown record reconciled by its probe"),
            Err(ResolveError::Refused(TransitionError::Fenced) | ResolveError::NotFound) => tracing::info!(
                route,
                scope = %scope.log_id(),
                "probe result not applied: the record changed meanwhile (resolved by an operator, or claimed again)"
            ),
            Err(e) => tracing::warn!(route, scope = %scope.log_id(), error = %e, "could not apply the probe's result; probing again later"),
        }
    }

    /// Sends the probe and reads what it says.
    async fn probe(&self, probed: &Probed, taken: &Probing) -> Answer {
        match self.exchange(probed, taken).await {
            Ok(answer) => answer,
            Err(e) => Answer::Error(e),
        }
    }

    async fn exchange(&self, probed: &Probed, taken: &Probing) -> Result<Answer, ProbeError> {
        let probe = &probed.probe;
        let scope = &taken.record.scope;
        if probe.target.uses_derived_key() {
            let sent = taken.record.sent_key;
            match sent {
                Some(ReforwardKey::Client | ReforwardKey::ClientQuoted) => {
                    return Err(ProbeError::NotSentUnderDerivedKey("under the client's own key (forward_key = \"client\")"));
                }
                Some(ReforwardKey::NoKey) => {
                    return Err(ProbeError::NotSentUnderDerivedKey("as the client sent it (observe mode)"));
                }
                // Sent under it, or claimed by a version that did not say.
                Some(ReforwardKey::Derived) | None => {}
            }
        }
        let params = if probe.target.uses_params() { path_params(&probed.route, taken.request.as_deref())? } else { Vec::new() };
        let secret = self.secret.get().ok_or_else(|| ProbeError::Target("the derived-key secret is not known yet".into()))?;
        let derived_key = scope.derived_key(Some(secret));
        let values = ProbeValues {
            derived_key: &derived_key,
            key: scope.key.as_str(),
            tenant: &scope.tenant,
            principal: &scope.principal,
            params: &params,
        };
        let pq = probe.target.render(&values)?;
        let upstream = &probed.upstream;
        let uri = upstream.uri_for(Some(&pq))?;
        let req =
            Request::builder().method(probe.method.clone()).uri(uri).body(Body::empty()).map_err(|e| ProbeError::Target(e.to_string()))?;
        let deadline = Instant::now() + upstream.config.timeout;
        let resp = upstream.send(req, deadline).await?;
        let (mut head, body) = resp.into_parts();
        let status = head.status;
        match probe.finding(status) {
            ProbeFinding::Absent => Ok(Answer::Absent { status }),
            ProbeFinding::Inconclusive => Ok(Answer::Inconclusive { status }),
            ProbeFinding::Found => {
                headers::strip_hop_by_hop(&mut head.headers);
                let limit = usize::try_from(probed.route.record.max_stored_response).unwrap_or(usize::MAX);
                let body = match tokio::time::timeout_at(deadline, Limited::new(body, limit).collect()).await {
                    Ok(Ok(collected)) => Some(collected.to_bytes()),
                    // Larger than the route stores: the outcome is known, the
                    // body cannot be replayed (as for a forwarded response).
                    Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => None,
                    Ok(Err(e)) => return Err(ProbeError::Body(e.to_string())),
                    Err(_) => return Err(ProbeError::Body("timed out".into())),
                };
                Ok(Answer::Found { status, response: head, body })
            }
        }
    }
}

/// The path parameters of the request kept in the record.
fn path_params(route: &Route, request: Option<&[u8]>) -> Result<Vec<(String, String)>, ProbeError> {
    let missing = || ProbeError::MissingParam(route.path.param_names().next().unwrap_or_default().to_owned());
    let stored = StoredRequest::decode(request.ok_or_else(missing)?).map_err(|e| ProbeError::StoredRequest(e.to_string()))?;
    let path = stored.path_and_query.split('?').next().unwrap_or_default();
    route.path.matches(path).ok_or_else(|| ProbeError::StoredRequest(format!("its path does not match {}", route.path.as_str())))
}
