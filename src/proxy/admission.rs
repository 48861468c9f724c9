//! Admission: one step, shared by every front (enforcing, async acceptance
//! and observe mode), from a request to either an admitted request (the
//! claim request: its scope and fingerprint) or the reason
//! enforcing refuses it before any claim. Enforcing answers the refusal;
//! observe mode counts it and passes the request on. Both read the same
//! rules here, so a change to them changes both modes.
//!
//! The steps run in the order a request meets them, with the front's own
//! work between them (the authorizer, and reading the body, which enforcing
//! bounds with errors and observe mode with a fall-back to pass-through):
//!
//! 1. [`identified`]: who sends it.
//! 2. [`key_in_headers`]: a key in a header is known before the body is read.
//! 3. [`admit`]: the key from the body if it is there, the fingerprint, the
//!    scope and the claim request (an acceptance on an async route).
//!
//! Then, once a claim finds a record, [`decide_with_legacy`] says what the
//! record means for this request.

use std::sync::Arc;

use bytes::Bytes;
use http::request;
use uuid::Uuid;

use crate::idempotency::fingerprint::{self, RequestParts};
use crate::idempotency::key::Scope;
use crate::idempotency::outcome::Refusal;
use crate::idempotency::record::{Decision, Record, decide};
use crate::problem::GatewayError;
use crate::request::async_op::{StoredRequest, new_operation_id, prefers_async, request_head};
use crate::request::identity::Identity;
use crate::request::key_source::{FoundKey, FromHeaders, KeySourceError};
use crate::request::route::{Route, RouteMode, ScopeMode};
use crate::store::{Acceptance, ClaimRequest};

/// Why a request is not admitted to a claim.
#[derive(Debug)]
pub enum NotAdmitted {
    /// No key, and the route does not require one: no idempotency applies
    /// (the request passes through).
    NoKey,
    /// Enforcing refuses it before any claim.
    Refused(Refused),
}

/// A refusal before any claim: the answer enforcing gives, and the reason
/// observe mode counts (`idemgate_observe_would_refuse_total{reason}`).
#[derive(Debug)]
pub struct Refused {
    pub reason: Refusal,
    pub error: GatewayError,
}

impl From<Refused> for NotAdmitted {
    fn from(r: Refused) -> NotAdmitted {
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

/// Step 1: a request no identity source recognised is refused (401).
pub fn identified(identity: Option<Identity>) -> Result<Identity, Refused> {
    identity.ok_or(Refused { reason: Refusal::Unauthenticated, error: GatewayError::Unauthenticated })
}

/// Step 2: the key, if a header source has it; `None` when the body decides.
pub fn key_in_headers(route: &Route, headers: &http::HeaderMap) -> Result<Option<FoundKey>, NotAdmitted> {
    match route.key_from.from_headers(headers) {
        Ok(FromHeaders::Found(found)) => Ok(Some(found)),
        Ok(FromHeaders::NeedBody) => Ok(None),
        Ok(FromHeaders::Absent) => Err(no_key(route)),
        Err(e) => Err(Refused { reason: Refusal::InvalidKey, error: GatewayError::InvalidKey(e) }.into()),
    }
}

/// Step 3: with the body read, the key (from the body, unless `early` has
/// it), the fingerprint and the scope: the claim request the request is
/// admitted with. `owner` is this replica. An async route's claim is an
/// acceptance carrying the request.
pub fn admit(
    route: &Route,
    identity: &Identity,
    early: Option<FoundKey>,
    owner: Arc<str>,
    params: &[(String, String)],
    parts: &request::Parts,
    body: &Bytes,
) -> Result<ClaimRequest, NotAdmitted> {
    let found = match early {
        Some(found) => found,
        None => match route.key_from.from_request(&parts.headers, body) {
            Ok(Some(found)) => found,
            Ok(None) => return Err(no_key(route)),
            Err(KeySourceError::Key(e)) => return Err(Refused { reason: Refusal::InvalidKey, error: GatewayError::InvalidKey(e) }.into()),
            Err(KeySourceError::Body(e)) => return Err(invalid_body(e.to_string()).into()),
        },
    };
    let request_hash = fingerprint::fingerprint(&route.fingerprint, &request_parts(route, params, parts, body))
        .map_err(|e| invalid_body(e.to_string()))?;
    let scope = match route.scope {
        ScopeMode::Principal => Scope::new(identity, &route.operation, found.key),
        ScopeMode::Tenant => Scope::tenant_wide(identity, &route.operation, found.key),
    };
    // Async: the claim accepts the operation and stores the request for the
    // workers. (An observe route is never async: the configuration refuses
    // `allow_async` there.)
    let is_async = route.mode == RouteMode::Async || (route.allow_async && prefers_async(&parts.headers));
    let acceptance =
        is_async.then(|| Acceptance { operation_id: new_operation_id(), request: StoredRequest::capture(parts, body).encode().into() });
    Ok(ClaimRequest {
        scope,
        request_hash,
        owner,
        lease: route.lease,
        upstream_idempotent: route.upstream_idempotent,
        claim_token: Uuid::new_v4(),
        acceptance,
        key_source: found.source,
        request_head: request_head(route, parts),
    })
}

/// No key: refused if the route requires one, else no idempotency applies.
fn no_key(route: &Route) -> NotAdmitted {
    if route.key_required {
        Refused { reason: Refusal::MissingKey, error: GatewayError::MissingKey { header: route.key_from.describe() } }.into()
    } else {
        NotAdmitted::NoKey
    }
}

fn invalid_body(detail: String) -> Refused {
    Refused { reason: Refusal::InvalidBody, error: GatewayError::InvalidBody(detail) }
}

/// [`decide`], recognising a record written by an earlier fingerprint version
/// for this request: its hash is compared with the request's version-2, then
/// version-1 fingerprint, computed only when the current one differs (see
/// `fingerprint::legacy_fingerprints`).
pub fn decide_with_legacy(
    route: &Route,
    record: &Record,
    request_hash: &fingerprint::Fingerprint,
    request: &RequestParts<'_>,
    now: crate::idempotency::record::Timestamp,
) -> Decision {
    match decide(record, request_hash, now) {
        Decision::Mismatch
            if fingerprint::legacy_fingerprints(&route.fingerprint, request)
                .any(|earlier| earlier.is_ok_and(|earlier| earlier == record.request_hash)) =>
        {
            tracing::debug!(route = %route.operation, scope = %record.scope.log_id(), "the record has this request's fingerprint of an earlier version");
            decide(record, &record.request_hash, now)
        }
        decision => decision,
    }
}
