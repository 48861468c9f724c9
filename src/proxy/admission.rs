//! Admission: one pipeline, shared by every front (enforcing, async
//! acceptance and observe mode), from a request to either an admitted
//! request (the claim request: its scope and fingerprint) or where and why it
//! stopped before any claim. The phases run in a fixed order, as pingora's
//! `ProxyHttp` fixes its phases; a [`Front`] supplies the three where the
//! fronts differ, and decides what a stop means (enforcing answers a refusal;
//! observe mode counts it and passes the request on) and what to do with the
//! claim:
//!
//! 1. identify: who sends it ([`crate::request::identity::Identifier::identify_and_strip`]);
//! 2. authorize: [`Front::authorize`] (enforcing asks the route's
//!    authorizer; observe mode changes no answer and asks none);
//! 3. key: a key in a header is known before the body is read;
//! 4. body: [`Front::read_body`] (enforcing bounds it with errors, observe
//!    mode with a fall-back to pass-through);
//! 5. claim request: the key from the body if it is there, the fingerprint,
//!    the scope (an acceptance on an async route);
//! 6. load: [`Front::load`], admission under overload (enforcing takes a slot
//!    of the upstream's and the route's limits, or a place in the async
//!    queue; observe mode one of its observation slots).
//!
//! A new admission step is a phase here (or a hook of [`Front`] when the
//! fronts differ at it). Once a claim finds a record,
//! [`decide_with_legacy`] says what the record means for this request.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, request};
use hyper::body::Incoming;
use uuid::Uuid;

use crate::idempotency::fingerprint::{self, FingerprintSpec, RequestParts};
use crate::idempotency::key::Scope;
use crate::idempotency::outcome::RefusalReason;
use crate::idempotency::record::{Decision, Record, ReforwardKey, decide};
use crate::problem::GatewayError;
use crate::request::async_op::{StoredRequest, new_operation_id, prefers_async, request_head};
use crate::request::identity::{Identifier, Identity};
use crate::request::key_source::{FoundKey, FromHeaders, KeySourceError};
use crate::request::route::{ForwardKey, Mode, Route, ScopeMode};
use crate::store::{Acceptance, ClaimRequest};
use crate::upstream::body::Body;

/// What differs between the fronts at the phases of admission.
pub trait Front {
    /// What the load phase hands on to the claim.
    type Slot;
    /// How this front stops a request at a phase of its own.
    type Halt;

    /// Phase 2: whether `identity` may make the request.
    fn authorize(
        &mut self,
        route: &Route,
        req: &Request<Incoming>,
        identity: &Identity,
    ) -> impl Future<Output = Result<(), Self::Halt>> + Send;

    /// Phase 4: the body, whole; or a stop with the request as far as it was read.
    fn read_body(
        &mut self,
        route: &Route,
        parts: request::Parts,
        body: Incoming,
    ) -> impl Future<Output = Result<(request::Parts, Bytes), (Self::Halt, Held)>> + Send;

    /// Phase 6: room for the admitted request under load.
    fn load(&mut self, route: &Route, claim: &ClaimRequest) -> impl Future<Output = Result<Self::Slot, Self::Halt>> + Send;
}

/// A request admitted to its claim.
#[derive(Debug)]
pub struct Admitted {
    pub identity: Identity,
    pub claim: ClaimRequest,
    /// The route's path parameters.
    pub params: Vec<(String, String)>,
    pub parts: request::Parts,
    pub body: Bytes,
}

/// Where admission stopped a request before any claim.
#[derive(Debug)]
pub enum Stop<H> {
    /// No key, and the route does not require one: no idempotency applies
    /// (the request passes through).
    NoKey(Held),
    /// Enforcing refuses it; observe mode counts why.
    Refused(Refusal, Held),
    /// The front stopped it at a phase of its own.
    Halted(H, Held),
}

/// The request as far as admission read it, for a front that passes it on.
#[derive(Debug)]
pub enum Held {
    /// The body not read.
    Unread(Request<Incoming>),
    /// The body read, whole or in part (the part and the rest of the stream).
    Read(request::Parts, Body),
    /// Admitted, and stopped at the load phase.
    Admitted(Box<Admitted>),
}

/// Runs the phases of admission for `req` on `route`, as `front` has them.
/// `owner` is this replica (the claim's owner).
pub async fn admit<F: Front>(
    front: &mut F,
    identifier: &Identifier,
    owner: &Arc<str>,
    route: &Route,
    params: Vec<(String, String)>,
    mut req: Request<Incoming>,
    peer: SocketAddr,
) -> Result<(Box<Admitted>, F::Slot), Stop<F::Halt>> {
    let Some(identity) = identify(identifier, &mut req, peer).await else {
        return Err(Stop::Refused(
            Refusal { reason: RefusalReason::Unauthenticated, error: GatewayError::Unauthenticated },
            Held::Unread(req),
        ));
    };
    if let Err(halt) = front.authorize(route, &req, &identity).await {
        return Err(Stop::Halted(halt, Held::Unread(req)));
    }
    // A key in a header is known before the body is read: a request
    // without one costs no body read.
    let early = match key_in_headers(route, req.headers()) {
        Ok(early) => early,
        Err(NotAdmitted::NoKey) => return Err(Stop::NoKey(Held::Unread(req))),
        Err(NotAdmitted::Refused(r)) => return Err(Stop::Refused(r, Held::Unread(req))),
    };
    let (parts, body) = req.into_parts();
    let (parts, body) = front.read_body(route, parts, body).await.map_err(|(halt, held)| Stop::Halted(halt, held))?;
    let claim = match claim_request(route, &identity, early, owner.clone(), &params, &parts, &body) {
        Ok(claim) => claim,
        Err(NotAdmitted::NoKey) => return Err(Stop::NoKey(Held::Read(parts, Body::full(body)))),
        Err(NotAdmitted::Refused(r)) => return Err(Stop::Refused(r, Held::Read(parts, Body::full(body)))),
    };
    let admitted = Box::new(Admitted { identity, claim, params, parts, body });
    match front.load(route, &admitted.claim).await {
        Ok(slot) => Ok((admitted, slot)),
        Err(halt) => Err(Stop::Halted(halt, Held::Admitted(admitted))),
    }
}

/// Phase 1: identifies the request and removes the headers of every other
/// identity source (see [`Identifier::identify_and_strip`]), before anything is
/// forwarded, stored, or shown to an authorizer. Also what a request on a
/// pass-through path or a poll of an operation is identified by.
pub async fn identify(identifier: &Identifier, req: &mut Request<Incoming>, peer: SocketAddr) -> Option<Identity> {
    let cert = req.extensions().get::<Arc<crate::tls::server::ClientCertificate>>().cloned();
    identifier.identify_and_strip(req.headers_mut(), peer.ip(), cert.as_deref()).await
}

/// Why a request is not admitted to a claim.
#[derive(Debug)]
enum NotAdmitted {
    /// No key, and the route does not require one.
    NoKey,
    /// Enforcing refuses it before any claim.
    Refused(Refusal),
}

/// A refusal before any claim: the answer enforcing gives, and the reason
/// observe mode counts (`idemgate_observe_would_refuse_total{reason}`).
#[derive(Debug)]
pub struct Refusal {
    pub reason: RefusalReason,
    pub error: GatewayError,
}

impl From<Refusal> for NotAdmitted {
    fn from(r: Refusal) -> NotAdmitted {
        NotAdmitted::Refused(r)
    }
}

/// The request as the fingerprint reads it (and [`decide_with_legacy`] after it).
pub fn request_parts<'a>(route: &'a Route, params: &'a [(String, String)], parts: &'a request::Parts, body: &'a Bytes) -> RequestParts<'a> {
    RequestParts {
        method: &parts.method,
        operation: &route.operation,
        path_params: params,
        query: parts.uri.query(),
        headers: &parts.headers,
        body,
    }
}

/// Phase 3: the key, if a header source has it; `None` when the body decides.
fn key_in_headers(route: &Route, headers: &http::HeaderMap) -> Result<Option<FoundKey>, NotAdmitted> {
    match route.key.from.from_headers(headers) {
        Ok(FromHeaders::Found(found)) => Ok(Some(found)),
        Ok(FromHeaders::NeedBody) => Ok(None),
        Ok(FromHeaders::Absent) => Err(no_key(route)),
        Err(e) => Err(Refusal { reason: RefusalReason::InvalidKey, error: GatewayError::InvalidKey(e) }.into()),
    }
}

/// Phase 5: with the body read, the key (from the body, unless `early` has
/// it), the fingerprint and the scope: the claim request the request is
/// admitted with. `owner` is this replica. An async route's claim is an
/// acceptance carrying the request.
fn claim_request(
    route: &Route,
    identity: &Identity,
    early: Option<FoundKey>,
    owner: Arc<str>,
    params: &[(String, String)],
    parts: &request::Parts,
    body: &Bytes,
) -> Result<ClaimRequest, NotAdmitted> {
    // An encoded body is not what the upstream reads once it decodes it:
    // its fingerprint and its key would be the encoding's.
    if !body.is_empty() && crate::upstream::headers::content_coded(&parts.headers) {
        return Err(Refusal { reason: RefusalReason::InvalidBody, error: GatewayError::ContentEncoded }.into());
    }
    let found = match early {
        Some(found) => found,
        None => match route.key.from.from_request(&parts.headers, body) {
            Ok(Some(found)) => found,
            Ok(None) => return Err(no_key(route)),
            Err(KeySourceError::Key(e)) => {
                return Err(Refusal { reason: RefusalReason::InvalidKey, error: GatewayError::InvalidKey(e) }.into());
            }
            Err(KeySourceError::Body(e)) => return Err(invalid_body(e.to_string()).into()),
        },
    };
    let request_hash = fingerprint::fingerprint(&route.key.fingerprint, &request_parts(route, params, parts, body))
        .map_err(|e| invalid_body(e.to_string()))?;
    let scope = match route.key.scope {
        ScopeMode::Principal => Scope::new(identity, &route.operation, found.key),
        ScopeMode::Tenant => Scope::tenant_wide(identity, &route.operation, found.key),
    };
    // Async: the claim accepts the operation and stores the request for the
    // workers. (An observe route is never async: the configuration refuses
    // `allow_async` there.)
    let is_async = match &route.execution.mode {
        Mode::Async(_) => true,
        Mode::Sync { respond_async } => respond_async.is_some() && prefers_async(&parts.headers),
        Mode::Observe { .. } => false,
    };
    let acceptance =
        is_async.then(|| Acceptance { operation_id: new_operation_id(), request: StoredRequest::capture(parts, body).encode().into() });
    let sent = sent_key(route, &parts.headers);
    Ok(ClaimRequest {
        scope,
        request_hash,
        owner,
        lease: route.record.lease,
        reforward: route.execution.upstream_idempotent.then_some(sent),
        sent,
        fingerprint_spec: route.key.fingerprint_digest.clone(),
        claim_token: Uuid::new_v4(),
        acceptance,
        key_source: found.source,
        request_head: request_head(route, parts),
    })
}

/// The key a claim of `route` sends its request to the upstream under; the
/// one it may re-forward an earlier attempt under, when its upstream
/// deduplicates. Observe mode sends none of idemgate's (it passes every
/// request through as it is, and takes over only what it observed itself).
/// The client's key is forwarded as its header spells it: a quoted and a
/// bare spelling are one key to idemgate, two to an upstream that compares
/// the header, so each takes over only its own.
fn sent_key(route: &Route, headers: &http::HeaderMap) -> ReforwardKey {
    match (&route.execution.mode, route.key.forward) {
        (Mode::Observe { .. }, _) => ReforwardKey::NoKey,
        (_, ForwardKey::Derived) => ReforwardKey::Derived,
        (_, ForwardKey::Client) if headers.get(&route.key.header).is_some_and(|v| v.as_bytes().starts_with(b"\"")) => {
            ReforwardKey::ClientQuoted
        }
        (_, ForwardKey::Client) => ReforwardKey::Client,
    }
}

/// No key: refused if the route requires one, else no idempotency applies.
fn no_key(route: &Route) -> NotAdmitted {
    if route.key.required {
        Refusal { reason: RefusalReason::MissingKey, error: GatewayError::MissingKey { header: route.key.from.describe() } }.into()
    } else {
        NotAdmitted::NoKey
    }
}

fn invalid_body(detail: String) -> Refusal {
    Refusal { reason: RefusalReason::InvalidBody, error: GatewayError::InvalidBody(detail) }
}

/// [`decide`], recognising a record written for this request by an earlier
/// fingerprint version, or under other fingerprint settings (`recorded`:
/// the record's own, [`crate::proxy::fingerprints`]): its hash is compared
/// with the request's version-3, version-2, then version-1 fingerprint, then with its
/// fingerprint under `recorded`, computed only when the current one differs
/// (see `fingerprint::legacy_fingerprints`). A record recognised so is
/// answered as the request's own (replayed, in progress, unknown); it is not
/// taken over (the claim compares the current hash).
pub fn decide_with_legacy(
    route: &Route,
    record: &Record,
    request_hash: &fingerprint::Fingerprint,
    request: &RequestParts<'_>,
    now: crate::idempotency::record::Timestamp,
    recorded: Option<&FingerprintSpec>,
) -> Decision {
    match decide(record, request_hash, now) {
        Decision::Mismatch
            if fingerprint::legacy_fingerprints(&route.key.fingerprint, request)
                .any(|earlier| earlier.is_ok_and(|earlier| earlier == record.request_hash)) =>
        {
            tracing::debug!(route = %route.operation, scope = %record.scope.log_id(), "the record has this request's fingerprint of an earlier version");
            decide(record, &record.request_hash, now)
        }
        Decision::Mismatch
            if recorded.is_some_and(|spec| fingerprint::fingerprint(spec, request).is_ok_and(|h| h == record.request_hash)) =>
        {
            tracing::info!(route = %route.operation, scope = %record.scope.log_id(),
                "the record has this request's fingerprint under the fingerprint settings it was written under; answered as its request");
            decide(record, &record.request_hash, now)
        }
        decision => decision,
    }
}
