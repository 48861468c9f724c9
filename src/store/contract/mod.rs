//! The store's contract: the interface both backends implement, split by
//! concern, and the types it speaks.
//!
//! | Trait | File | What it covers |
//! |---|---|---|
//! | [`Lifecycle`] | `lifecycle.rs` | kind, migrations, health, the store's clock, the derived-key secret |
//! | [`Records`] | `records.rs` | the claim, fenced results, reads and lists, retention, leases, counts |
//! | [`Queue`] | `queue.rs` | async operations: take, heartbeat, sent, retry, fail, lookup by id |
//! | [`Reconcile`] | `reconcile.rs` | the probe's take and bookkeeping, resolutions |
//! | [`Events`] | `events.rs` | the outbox: lease, deliver, park, redeliver, sweep |
//! | [`Trail`] | `trail.rs` | the audit trail and one scope's inspection |
//!
//! Each backend has the same files (`postgres/`, `sqlite/`), one `impl` of
//! one trait each, with its statements beside the code that sends them.
//! [`RecordStore`] is all of them together: the one object the gateway holds.
//!
//! A backend implements single protocol steps, each one atomic statement (or
//! one short transaction) against its database, deciding with the pure rules
//! of [`crate::idempotency::record`]. Every write is atomic and committed (or
//! certainly not) when it returns `Ok`; an `Err(StoreError::Ambiguous)` means
//! the caller must read the row back. Fenced writes return whether they
//! applied (`false`: another attempt holds the record). What must not differ
//! between backends (bounded operation time, reading a row back after an
//! ambiguous write, metrics) lives once, in [`super::Store`].
//! `tests/store_conformance.rs` holds every backend to the same answers.

mod events;
mod lifecycle;
mod queue;
mod reconcile;
mod records;
mod trail;

pub use events::Events;
pub use lifecycle::{Lifecycle, SessionReport};
pub use queue::{Queue, RetryNote, Taken, WorkerRoute};
pub use reconcile::{ProbeFence, ProbeRoute, Probing, Reconcile, Resolution, ResolveOutcome, UNRECORDED_AT_UPSTREAM};
pub use records::{Acceptance, Claim, ClaimOutcome, ClaimRequest, ListCursor, ListFilter, RawClaim, Reaped, Records, WriteOutcome};
pub use trail::{Inspection, Trail};

/// The whole store: every concern's trait. Backends implement the six
/// traits; this one comes with them.
pub trait RecordStore: Lifecycle + Records + Queue + Reconcile + Events + Trail {}

impl<T: Lifecycle + Records + Queue + Reconcile + Events + Trail> RecordStore for T {}
