//! Records: the claim, fenced results, reads, lists, retention and leases.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use uuid::Uuid;

use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::{Scope, ScopeId};
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Attempt, Generation, Record, ReforwardKey, State, StoredResponse, Timestamp};
use crate::outbox::EventPolicies;
use crate::store::StoreError;
use crate::telemetry::stats::{ForeverCount, StateCount};

/// Everything a claim needs.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub scope: Scope,
    pub request_hash: Fingerprint,
    /// Replica id, for the `owner` column.
    pub owner: Arc<str>,
    pub lease: Duration,
    /// The key the route sends its requests under when its upstream
    /// deduplicates (`upstream_idempotent`), `None` otherwise: kept in the
    /// record, and an expired in-flight or unknown record with the same
    /// fingerprint is taken over only by a claim that names the key it was
    /// sent under (`record::may_take_over`).
    pub reforward: Option<ReforwardKey>,
    /// The key the request is sent to the upstream under, whatever the
    /// route's idempotence (equal to `reforward` when that is set).
    pub sent: ReforwardKey,
    /// The digest of the fingerprint settings `request_hash` was computed
    /// under (`FingerprintSpec::digest`), kept in the record.
    pub fingerprint_spec: Arc<str>,
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

impl ClaimRequest {
    /// What the record's `reforward_key` column keeps for this claim: the
    /// key it is sent under, spelled so that only a claim to an upstream
    /// that deduplicates may take the record over (`ReforwardKey::sent_only`).
    pub fn recorded_key(&self) -> &'static str {
        match self.reforward {
            Some(key) => key.as_str(),
            None => self.sent.sent_only(),
        }
    }
}

/// What an async acceptance stores besides the claim.
#[derive(Debug, Clone)]
pub struct Acceptance {
    /// The id clients poll.
    pub operation_id: String,
    /// The request to run, encoded (`operation::StoredRequest::encode`).
    pub request: Bytes,
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
    /// When this replica asked for the claim, on its own clock: no later
    /// than the start of the lease (the database's clock read in the claim's
    /// statement). A synchronous attempt's exchange ends by this plus the
    /// lease, so it never sends after its lease may have run out, however
    /// late it learned of its claim or long it was stopped before sending.
    pub asked_at: tokio::time::Instant,
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

/// What one pass of the lease reaper did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reaped {
    /// Attempts whose outcome is now unknown.
    pub unknown: u64,
    /// Async attempts put back in the queue (never sent, or re-forwardable).
    pub requeued: u64,
}

/// Records: the claim, fenced results, reads, lists, retention and leases.
#[async_trait]
pub trait Records: Send + Sync + std::fmt::Debug {
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

    /// Deletes up to `batch` completed records past retention.
    async fn sweep(&self, batch: u32) -> Result<u64, StoreError>;

    /// Ends up to `batch` attempts whose lease expired (`record::transition`'s
    /// `LeaseExpired`): synchronous ones become `unknown`; async ones are
    /// re-queued if they were never sent or their operation is in
    /// `reforwardable`, else `unknown`.
    async fn reap_leases(&self, batch: u32, reforwardable: &[Arc<str>], events: &EventPolicies) -> Result<Reaped, StoreError>;

    /// Records that are not `completed`, counted by operation and state.
    async fn stats(&self) -> Result<Vec<StateCount>, StoreError>;

    /// `unknown` records counted by how long ago they last changed, in
    /// `bounds.len() + 1` buckets: younger than `bounds[0]`, then from each
    /// bound (included) to the next, then `bounds[last]` or older. `bounds`
    /// ascend. One count over the open states' index, however long the
    /// backlog.
    async fn unknown_by_age(&self, bounds: &[Duration]) -> Result<Vec<u64>, StoreError>;

    /// Records kept forever, counted by operation (a partial index holds
    /// exactly these rows).
    async fn forever_counts(&self) -> Result<Vec<ForeverCount>, StoreError>;

    /// The records whose stored scope id is `id` (normally one).
    async fn by_scope_id(&self, id: ScopeId) -> Result<Vec<Record>, StoreError>;

    /// Up to `limit` scopes of records stored without a scope id (claimed
    /// before migration 0005), in primary-key order after `after`. On
    /// PostgreSQL there are none after migration 0011, which computes them.
    async fn scopes_without_id(&self, after: Option<&Scope>, limit: u32) -> Result<Vec<Scope>, StoreError>;

    /// Adds `(operation, spec)` pairs (the text of a route's fingerprint
    /// settings) to the settings the operations have had; a pair already
    /// there is left as it is.
    async fn add_fingerprint_specs(&self, specs: &[(String, String)]) -> Result<(), StoreError>;

    /// Every `(operation, spec)` pair added, oldest first.
    async fn fingerprint_specs(&self) -> Result<Vec<(String, String)>, StoreError>;
}
