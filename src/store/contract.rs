//! The store's contract: the one interface both backends implement
//! ([`RecordStore`]), and the types it speaks.
//!
//! A backend implements single protocol steps, each one atomic statement (or
//! one short transaction) against its database, deciding with the pure rules
//! of [`crate::idempotency::record`]. What must not differ between backends (bounded
//! operation time, reading a row back after an ambiguous write, metrics)
//! lives once, in [`super::Store`]. `tests/store_conformance.rs` holds both
//! implementations to the same answers.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use uuid::Uuid;

use super::StoreError;
use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::{Scope, ScopeId};
use crate::idempotency::record::{Attempt, Generation, Record, Refused, State, StoredResponse, Timestamp};
use crate::outbox::{Delivery, EventPolicies, OutboxEvent};
use crate::request::route::Retention;
use crate::store::audit::{AuditEntry, AuditNote};
use crate::telemetry::stats::{EventStats, ForeverCount, StateCount};

/// Everything a claim needs.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub scope: Scope,
    pub request_hash: Fingerprint,
    /// Replica id, for the `owner` column.
    pub owner: Arc<str>,
    pub lease: Duration,
    /// May an expired in-flight or unknown record with the same fingerprint be
    /// taken over (the upstream deduplicates by the derived key)?
    pub upstream_idempotent: bool,
    /// Identifies this request's claim; read back after an ambiguous commit,
    /// and used to abandon a claim whose fate could not be learned.
    pub claim_token: Uuid,
    /// Async: accept the operation (state `queued`, the request stored for
    /// the workers) instead of claiming it for this request to forward.
    pub acceptance: Option<Acceptance>,
    /// Which of the route's key sources gave the key (`header:<name>` or
    /// `body:<JSON Pointer>`), kept in the record.
    pub key_source: Arc<str>,
    /// Sync claims on a route whose reconciliation probe needs path
    /// parameters: the request line (`operation::StoredRequest` with method,
    /// path and query only), kept in the record's `request` column so the
    /// reconciler can rebuild the probe. (An acceptance stores the whole
    /// request there instead.)
    pub request_head: Option<Bytes>,
}

/// What an async acceptance stores besides the claim.
#[derive(Debug, Clone)]
pub struct Acceptance {
    /// The id clients poll.
    pub operation_id: String,
    /// The request to run, encoded (`operation::StoredRequest::encode`).
    pub request: Bytes,
}

/// An async operation route a worker serves, with the lease its attempts get.
#[derive(Debug, Clone)]
pub struct WorkerRoute {
    pub operation: Arc<str>,
    pub lease: Duration,
    /// The route's upstream deduplicates (`upstream_idempotent`): an attempt
    /// whose lease ran out after it was sent may be taken over and sent again.
    pub reforwardable: bool,
}

/// An operation a worker took: the record (now `processing` under the new
/// attempt), the stored request to run, and the attempt's claim.
///
/// A take serves due `queued` operations and, first, takes over attempts
/// whose lease ran out and that may run again (never sent, or sent to a
/// deduplicating upstream): the workers' polling takes an operation over
/// within moments of its lease's expiry, without waiting for the lease
/// reaper's next pass.
#[derive(Debug, Clone)]
pub struct Taken {
    pub record: Record,
    pub request: Bytes,
    pub claim: Claim,
    /// Taken over from an attempt whose lease ran out (not from the queue).
    pub lease_expired: bool,
}

/// Why an async attempt is retried (or failed).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RetryNote {
    /// The upstream's status, if it answered (a `release_on_status`).
    pub last_status: Option<u16>,
    /// The attempt was sent and its answer lost.
    pub maybe_executed: bool,
}

/// What one pass of the lease reaper did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Attempts whose outcome is now unknown.
    pub unknown: u64,
    /// Async attempts put back in the queue (never sent, or re-forwardable).
    pub requeued: u64,
}

/// A claim this attempt holds: the right to forward and record a result under
/// `generation`.
#[derive(Debug, Clone)]
pub struct Claim {
    pub scope: Scope,
    pub generation: Generation,
    pub claim_token: Uuid,
    /// When the lease runs out; for an async acceptance, which has no lease
    /// until a worker takes it, the time it was accepted.
    pub lease_expires_at: Timestamp,
    /// The claim replaced an expired record rather than inserting a new one.
    pub took_over: bool,
}

impl Claim {
    /// The attempt this claim identifies: its generation and token.
    pub fn attempt(&self) -> Attempt {
        Attempt { generation: self.generation, claim_token: self.claim_token }
    }
}

/// What a claim found.
#[derive(Debug, Clone)]
// A record is a few hundred bytes and is moved once per request: boxing it
// would cost an allocation on every replay for no gain.
#[allow(clippy::large_enum_variant)]
pub enum ClaimOutcome {
    Claimed(Claim),
    /// Another record holds the scope; `now` is the store's clock when read.
    Existing {
        record: Record,
        now: Timestamp,
    },
}

/// What one claim statement found, before the protocol's read-back logic.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum RawClaim {
    /// Inserted, or took over an expired record.
    Claimed(Claim),
    /// The statement saw this record and left it alone.
    Existing(Record, Timestamp),
    /// The same, and no resolution holds the record out of the replay caches
    /// (see `store::cache`): a completed record may be kept for replays.
    Cacheable(Record, Timestamp),
    /// A concurrent insert won after the statement's snapshot: read it in a new statement.
    Conflict,
}

/// Whether a fenced write (result, release, unknown) took effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    Written,
    /// The record belongs to another attempt now (or was resolved): nothing
    /// was overwritten.
    Fenced,
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
    Refused(Refused),
}

/// Filters for `keys list` and `GET /admin/records`.
#[derive(Debug, Clone, Default)]
pub struct ListFilter {
    pub state: Option<State>,
    pub tenant: Option<String>,
    pub operation: Option<String>,
    /// Only records kept forever (`keys list --retention forever`).
    pub forever: bool,
    pub limit: u32,
    /// Keyset pagination: only records after this one in the list's order.
    pub cursor: Option<ListCursor>,
}

/// A position in the list's order (`updated_at` newest first, then the
/// primary key ascending): the last record of the previous page. Clients see
/// it only encoded (`keys::encode_cursor`), as an opaque string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListCursor {
    pub updated_at: Timestamp,
    pub scope: Scope,
}

impl ListCursor {
    /// The cursor that continues after `record`.
    pub fn after(record: &Record) -> ListCursor {
        ListCursor { updated_at: record.updated_at, scope: record.scope.clone() }
    }
}

/// A route whose `unknown` records the reconciler probes, and how long a
/// record must have been unknown first.
///
/// A record is probed only once its attempt can no longer be at the
/// upstream: `settle` after it became unknown, and `at_upstream + settle`
/// after the attempt was sent (`sent_at`; a synchronous attempt is sent as
/// soon as it is claimed, `created_at`). An async lease may be far shorter
/// than the upstream's timeout, so a record can turn unknown while the
/// upstream is still working on it; an "absent" answer then would release an
/// operation that is about to happen, and the retry would run it twice.
#[derive(Debug, Clone)]
pub struct ProbeRoute {
    pub operation: Arc<str>,
    pub settle: Duration,
    /// How long an attempt may be at the upstream: its whole-response timeout.
    pub at_upstream: Duration,
}

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

/// What the operator console's record page reads of one scope besides the
/// record: the stored request (async) or request line (sync, probed routes),
/// the reconciler's inconclusive probes of this generation, and the scope's
/// audit rows (newest first).
#[derive(Debug, Clone)]
pub struct Inspection {
    pub record: Record,
    /// The store's clock when the record was read.
    pub now: Timestamp,
    pub request: Option<Bytes>,
    pub probe_attempts: i32,
    pub next_probe_at: Option<Timestamp>,
    /// What the last of those probes said (`None` before the first).
    pub probe_last_answer: Option<String>,
    pub audit: Vec<AuditEntry>,
}

/// One protocol step per method. Every write is atomic and committed (or
/// certainly not) when it returns `Ok`; an `Err(StoreError::Ambiguous)` means
/// the caller must read the row back. Fenced writes return whether they
/// applied (`false`: another attempt holds the record).
#[async_trait]
pub trait RecordStore: Send + Sync + std::fmt::Debug {
    /// `"postgres"` or `"sqlite"`, for logs and metrics.
    fn kind(&self) -> &'static str;

    /// Applies pending migrations; returns the names applied.
    async fn migrate(&self) -> Result<Vec<String>, StoreError>;

    /// Whether the store answers (readiness).
    async fn ping(&self) -> Result<(), StoreError>;

    /// A small durable write that touches no record (readiness): it fails
    /// when a claim would fail for want of a writable store (a full or
    /// read-only filesystem, a role without write privileges on the
    /// records), and succeeds otherwise.
    async fn probe_write(&self) -> Result<(), StoreError>;

    /// The store's clock: the one that decides leases and retention.
    async fn now(&self) -> Result<Timestamp, StoreError>;

    /// The scope's record and the store's clock when it was read.
    async fn get(&self, scope: &Scope) -> Result<Option<(Record, Timestamp)>, StoreError>;

    /// The claim: one atomic statement that inserts the scope's record, takes
    /// over a record that `record::may_take_over` allows, or leaves the record
    /// it finds untouched and returns it.
    async fn claim(&self, req: &ClaimRequest) -> Result<RawClaim, StoreError>;

    /// Deletes the in-flight record made with `claim_token`, if it exists.
    /// Never a queued acceptance: once committed, a retry may have read it
    /// back and answered 202, so it is an accepted operation.
    async fn abandon(&self, scope: &Scope, claim_token: Uuid) -> Result<bool, StoreError>;

    /// Records the upstream's response, fenced by `attempt`.
    /// With its completion event when `events` says the operation emits one
    /// (here and in every final state change below: same statement).
    async fn complete(
        &self,
        scope: &Scope,
        attempt: Attempt,
        response: &StoredResponse,
        retention: Retention,
        events: &EventPolicies,
    ) -> Result<bool, StoreError>;

    /// Deletes the record, fenced by `attempt`.
    async fn release(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError>;

    /// Marks the record `unknown`, fenced by `attempt` (and, for a reader that
    /// found the lease expired, only if it still is).
    async fn mark_unknown(
        &self,
        scope: &Scope,
        attempt: Attempt,
        only_if_lease_expired: bool,
        events: &EventPolicies,
    ) -> Result<bool, StoreError>;

    /// Records matching `filter`, newest first.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>, StoreError>;

    /// An operator's (or the reconciler's) resolution, decided by
    /// `record::transition`, written together with its audit row in one
    /// transaction. The generation of a completed resolution is drawn anew.
    /// With a `fence` (the reconciler), it applies only to the record the
    /// probe took: `unknown`, same generation, same probe token; else
    /// `Refused(Fenced)`.
    async fn resolve(
        &self,
        scope: &Scope,
        resolution: &Resolution,
        note: &AuditNote,
        events: &EventPolicies,
        fence: Option<ProbeFence>,
    ) -> Result<ResolveOutcome, StoreError>;

    /// The audit trail, newest first.
    async fn audit(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError>;

    /// The scope's record with what the console shows beside it (at most
    /// `audit_limit` audit rows of the scope); `None` without a record.
    async fn inspect(&self, scope: &Scope, audit_limit: u32) -> Result<Option<Inspection>, StoreError>;

    /// The deployment's derived-key secret, generated by `migrate` (`None`
    /// before the store was migrated).
    async fn derived_key_secret(&self) -> Result<Option<Vec<u8>>, StoreError>;

    /// Deletes up to `batch` completed records past retention.
    async fn sweep(&self, batch: u32) -> Result<u64, StoreError>;

    /// Ends up to `batch` attempts whose lease expired (`record::transition`'s
    /// `LeaseExpired`): synchronous ones become `unknown`; async ones are
    /// re-queued if they were never sent or their operation is in
    /// `reforwardable`, else `unknown`.
    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError>;

    /// Async: takes the oldest due `queued` operation of `routes` (never one
    /// another worker is taking: `FOR UPDATE SKIP LOCKED` or the single
    /// writer), draws a new generation for it, and makes it `processing`
    /// under `claim_token` and the route's lease.
    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_token: Uuid) -> Result<Option<Taken>, StoreError>;

    /// Async: renews the attempt's lease; `false` when fenced (lost it).
    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError>;

    /// Async: records that the attempt is about to send; `false` when fenced
    /// or when its lease has run out (then it must not send).
    async fn mark_sent(&self, scope: &Scope, attempt: Attempt) -> Result<bool, StoreError>;

    /// Async: back to the queue, due after `delay`. `maybe_executed`: this
    /// attempt's answer was lost (the operation is re-run on a deduplicating
    /// upstream); the record remembers it.
    async fn requeue(&self, scope: &Scope, attempt: Attempt, delay: Duration, retry: RetryNote) -> Result<bool, StoreError>;

    /// Async: retries used up: `failed_retryable` (kept for `retention`), or
    /// `unknown` if this or an earlier attempt may have executed.
    async fn fail(
        &self,
        scope: &Scope,
        attempt: Attempt,
        retention: Retention,
        retry: RetryNote,
        events: &EventPolicies,
    ) -> Result<bool, StoreError>;

    /// Outbox: leases up to `limit` deliverable events of `operations` to the
    /// relay holding `token` for `lease`: pending, due, not leased by another
    /// relay, and with no earlier pending event of the same scope (order per
    /// scope). `FOR UPDATE SKIP LOCKED` / the single writer: two relays never
    /// hold one event.
    async fn take_events(&self, operations: &[&str], limit: u32, lease: Duration, token: Uuid) -> Result<Vec<OutboxEvent>, StoreError>;

    /// Outbox: receivers answered 2xx to these events; marks them sent in one
    /// statement and returns the ones this relay still held (the others were
    /// taken over after their lease ran out, and will be delivered again).
    async fn events_delivered(&self, seqs: &[i64], token: Uuid) -> Result<Vec<i64>, StoreError>;

    /// Outbox: a delivery failed; due again after `retry_after`, or parked.
    async fn event_failed(&self, seq: i64, token: Uuid, error: &str, retry_after: Duration, park: bool) -> Result<bool, StoreError>;

    /// Outbox: events, newest first, optionally only those in one delivery state.
    async fn events(&self, delivery: Option<Delivery>, limit: u32) -> Result<Vec<OutboxEvent>, StoreError>;

    /// Outbox: a parked (or sent) event delivered again, from its first attempt.
    async fn redeliver(&self, event_id: Uuid) -> Result<bool, StoreError>;

    /// Outbox: deletes up to `batch` delivered events sent more than `older_than` ago.
    async fn sweep_events(&self, batch: u32, older_than: Duration) -> Result<u64, StoreError>;

    /// Outbox: pending and parked counts, and when the oldest pending was written.
    async fn event_stats(&self) -> Result<EventStats, StoreError>;

    /// Async: the operation with this id in this tenant.
    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError>;

    /// Records that are not `completed`, counted by operation and state.
    async fn stats(&self) -> Result<Vec<StateCount>, StoreError>;

    /// Records kept forever, counted by operation (a partial index holds
    /// exactly these rows).
    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError>;

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

    /// The records whose stored scope id is `id` (normally one).
    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError>;

    /// Up to `limit` scopes of records stored without a scope id (claimed
    /// before migration 0005), in primary-key order after `after`. On
    /// PostgreSQL there are none after migration 0011, which computes them.
    async fn scopes_without_id(&self, after: Option<&Scope>, limit: u32) -> Result<Vec<Scope>, StoreError>;
}
