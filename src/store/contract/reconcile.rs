//! Reconciliation: the probe's take and bookkeeping, and resolutions (the reconciler's and operators').

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use uuid::Uuid;

use crate::idempotency::key::Scope;
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Generation, Record, State, StoredResponse, TransitionError};
use crate::outbox::EventPolicies;
use crate::store::StoreError;
use crate::store::audit::AuditNote;

/// A route whose `unknown` records the reconciler probes, and how long a
/// record must have been unknown first.
///
/// A record is probed only once its attempt can no longer be at the
/// upstream: `settle` after it became unknown, and `settle` after the end of
/// the attempt's time at the upstream as the attempt itself recorded it (not
/// as the probing replica's configuration says: a replica with a shorter
/// timeout, during a rolling change, would probe an attempt another replica
/// sent with a longer one while it still runs). An async lease may be far
/// shorter than the upstream's timeout, so a record can turn unknown while
/// the upstream is still working on it; an "absent" answer then would
/// release an operation that is about to happen, and the retry would run it
/// twice. What bounds the attempt:
///
/// - async: `at_upstream_until`, written with `sent_at` (the send's time
///   plus the timeout it was sent with; the latest of the record's attempts);
/// - synchronous: the claim's lease (`lease_expires_at`, set by the replica
///   that claimed and sent it, whose configuration makes a synchronous lease
///   outlast its upstream's timeout), and at least `at_upstream` after the
///   claim (`created_at`);
/// - an async record sent before `at_upstream_until` existed: the send (or
///   the claim) plus the longer of `at_upstream` and
///   [`UNRECORDED_AT_UPSTREAM`].
#[derive(Debug, Clone)]
pub struct ProbeRoute {
    pub operation: Arc<str>,
    pub settle: Duration,
    /// The probing replica's whole-response timeout for the route's
    /// upstream: only ever lengthens the wait (see above).
    pub at_upstream: Duration,
}

/// How long an async attempt sent without a recorded bound (by a version
/// before `at_upstream_until`) is taken to be possibly at the upstream, at
/// least: an hour, longer than any sensible upstream timeout. Such records
/// are probed an hour after their send at the earliest.
pub const UNRECORDED_AT_UPSTREAM: Duration = Duration::from_secs(3600);

/// What a probe's result write must still find: the record `unknown` at the
/// generation that was probed, and marked by this probe (`token`). An
/// operator's resolution in between, a new life of the key, or another
/// replica that took the record over after this probe's hold ran out all
/// fence the write off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeFence {
    pub generation: Generation,
    pub token: Uuid,
}

/// An `unknown` record taken for probing (marked with the fence's token
/// until the hold runs out; no other replica takes it meanwhile).
#[derive(Debug, Clone)]
pub struct Probing {
    pub record: Record,
    /// The stored request (async) or request line (sync), if any.
    pub request: Option<Bytes>,
    /// Inconclusive probes of this generation so far.
    pub attempts: i32,
    pub fence: ProbeFence,
}

/// A manual reconciliation.
#[derive(Debug, Clone)]
pub enum Resolution {
    /// Delete the record; the client may retry the key.
    Release { force: bool },
    /// Record this response; it is replayed for `retention`.
    Complete { response: StoredResponse, retention: Retention, force: bool },
}

impl Resolution {
    /// The state machine's event for this resolution.
    pub fn event(&self) -> crate::idempotency::record::Event {
        match *self {
            Resolution::Release { force } => crate::idempotency::record::Event::ResolveRelease { force },
            Resolution::Complete { force, .. } => crate::idempotency::record::Event::ResolveComplete { force },
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolveOutcome {
    /// Applied; the record was in `from` before.
    Resolved {
        from: State,
    },
    NotFound,
    Refused(TransitionError),
}

/// Reconciliation: the probe's take and bookkeeping, and resolutions (the reconciler's and operators').
#[async_trait]
pub trait Reconcile: Send + Sync + std::fmt::Debug {
    /// The reconciler takes up to `limit` `unknown` records of `routes` that
    /// have been unknown for at least their route's `settle`, are due (their
    /// backoff has passed) and are not being probed by anyone (no live mark):
    /// each is marked with `token` until `hold` from now, atomically (`FOR
    /// UPDATE SKIP LOCKED`, or the single writer), so two replicas never
    /// probe one record at once. Bookkeeping of an earlier generation is
    /// ignored (a new life of the key starts afresh).
    async fn take_probes(&self, routes: &[ProbeRoute], token: Uuid, hold: Duration, limit: u32) -> Result<Vec<Probing>, StoreError>;

    /// An inconclusive probe: counts it, clears the mark and makes the
    /// record due again after `retry_in`. Fenced like a probe's resolution.
    async fn probe_failed(&self, scope: &Scope, fence: ProbeFence, retry_in: Duration, answer: &str) -> Result<bool, StoreError>;

    /// An operator's (or the reconciler's) resolution, decided by
    /// `record::transition`, written together with its audit row in one
    /// transaction. The generation of a completed resolution is drawn anew.
    /// With a `fence` (the reconciler), it applies only to the record the
    /// probe took: `unknown`, same generation, same probe token; else
    /// `Refused(Fenced)`. With an `expected` generation (an operator who
    /// named the one they looked at), only to the record at that
    /// generation; else `Refused(Fenced)`.
    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
        expected: Option<Generation>,
    ) -> Result<ResolveOutcome, StoreError>;
}
