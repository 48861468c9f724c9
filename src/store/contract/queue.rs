//! The async queue: workers take operations, heartbeat, send, retry and fail them.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use uuid::Uuid;

use super::records::Claim;
use crate::idempotency::key::Scope;
use crate::idempotency::record::Retention;
use crate::idempotency::record::{Attempt, Record, Timestamp};
use crate::outbox::EventPolicies;
use crate::store::StoreError;

/// An async operation route a worker serves, with the lease its attempts get.
#[derive(Debug, Clone)]
pub struct WorkerRoute {
    pub operation: Arc<str>,
    pub lease: Duration,
    /// The route's upstream deduplicates (`upstream_idempotent`): an attempt
    /// whose lease ran out after it was sent may be taken over and sent again.
    pub reforwardable: bool,
    /// `Some(timeout)`: the route's upstream deduplicates, so its attempts
    /// need no never-sent proof (`mark_sent`): the take itself records the
    /// send (`sent_at`, and `at_upstream_until` this timeout after the take),
    /// and the attempt is sent without a write of its own. A store that
    /// cannot leaves `sent_at` empty and the worker marks the send as usual.
    pub sent_on_take: Option<Duration>,
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

/// The async queue: workers take operations, heartbeat, send, retry and fail them.
#[async_trait]
pub trait Queue: Send + Sync + std::fmt::Debug {
    /// Async: takes the oldest due `queued` operations of `routes`, at most
    /// one per token of `claim_tokens` and perhaps fewer (never one another
    /// worker is taking: `FOR UPDATE SKIP LOCKED` or the single writer),
    /// draws a new generation for each, and makes each `processing` under
    /// its own token (the `i`-th taken gets `claim_tokens[i]`) and its
    /// route's lease. One commit for all of them.
    async fn take(&self, routes: &[WorkerRoute], owner: &str, claim_tokens: &[Uuid]) -> Result<Vec<Taken>, StoreError>;

    /// Async: renews the attempt's lease; `false` when fenced (lost it).
    async fn heartbeat(&self, scope: &Scope, attempt: Attempt, lease: Duration) -> Result<bool, StoreError>;

    /// Async: records that the attempt is about to send (`sent_at`) and
    /// what bounds its time at the upstream: `at_upstream` (the timeout it
    /// is sent with) from now, kept as the record's `at_upstream_until` (the
    /// latest of its attempts'; the reconciler probes only past it). `false`
    /// when fenced or when its lease has run out (then it must not send).
    async fn mark_sent(&self, scope: &Scope, attempt: Attempt, at_upstream: Duration) -> Result<bool, StoreError>;

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

    /// Async: the operation with this id in this tenant.
    async fn operation(&self, tenant: &str, operation_id: &str) -> Result<Option<(Record, Timestamp)>, StoreError>;
}
