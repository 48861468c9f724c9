//! What the record a claim found means for this request: shared by the
//! enforcing path ([`crate::proxy::gateway`]) and observe mode ([`crate::proxy::observe`]),
//! so both read a record the same way.

use crate::idempotency::fingerprint::{self, RequestParts};
use crate::idempotency::record::{Decision, Record, decide};
use crate::request::route::Route;

/// [`decide`], recognising a record written by fingerprint version 1 for this
/// request: its hash is compared with the request's version-1 fingerprint,
/// computed only when the current one differs (see `fingerprint::legacy_fingerprint`).
pub fn decide_with_legacy(
    route: &Route,
    record: &Record,
    request_hash: &fingerprint::Fingerprint,
    request: &RequestParts<'_>,
    now: crate::idempotency::record::Timestamp,
) -> Decision {
    match decide(record, request_hash, now) {
        Decision::Mismatch if fingerprint::legacy_fingerprint(&route.fingerprint, request).is_ok_and(|v1| v1 == record.request_hash) => {
            tracing::debug!(route = %route.operation, scope = %record.scope.log_id(), "the record has this request's version-1 fingerprint");
            decide(record, &record.request_hash, now)
        }
        decision => decision,
    }
}
