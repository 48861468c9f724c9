//! The store's contract: the interface both backends implement, one trait
//! per concern ([`Lifecycle`], [`Records`], [`Queue`], [`Reconcile`],
//! [`Events`], [`Trail`]; [`RecordStore`] is their sum), and the types it
//! speaks. Which concern covers what, and the files each backend has for
//! them: `docs/architecture.md`.
//!
//! A backend implements single protocol steps, each one atomic statement (or
//! one short transaction) against its database, deciding with the pure rules
//! of [`crate::idempotency::record`]. Every write is atomic and committed (or
//! certainly not) when it returns `Ok`; an `Err(StoreError::Ambiguous)` means
//! the caller must read the row back. Fenced writes return whether they
//! applied (`false`: another attempt holds the record). What must not differ
//! between backends lives once, in [`super::Store`].
//! `tests/it/store_conformance/` holds every backend to the same answers,
//! one file per trait.

mod events;
mod lifecycle;
mod queue;
mod reconcile;
mod records;
mod trail;

pub use events::{Events, reached};
pub use lifecycle::{Lifecycle, SessionReport};
pub use queue::{Queue, RetryNote, Taken, WorkerRoute};
pub use reconcile::{ProbeFence, ProbeRoute, Probing, Reconcile, Resolution, ResolveOutcome, UNRECORDED_AT_UPSTREAM};
pub use records::{Acceptance, Claim, ClaimOutcome, ClaimRequest, ListCursor, ListFilter, RawClaim, Reaped, Records, WriteOutcome};
pub use trail::{Inspection, Trail};

/// The whole store: every concern's trait. Backends implement the six
/// traits; this one comes with them.
pub trait RecordStore: Lifecycle + Records + Queue + Reconcile + Events + Trail {}

impl<T: Lifecycle + Records + Queue + Reconcile + Events + Trail> RecordStore for T {}
