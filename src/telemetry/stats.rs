//! What the store counts for the operator: records by state, records kept
//! forever, the outbox backlog. The store computes them; the metrics show
//! them as gauges.

use crate::idempotency::record::{State, Timestamp};

/// How many records of an operation are in a state that is not `completed`,
/// and since when the oldest is (for gauges and alerts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateCount {
    pub operation: String,
    pub state: State,
    pub count: i64,
    pub oldest_created_at: Timestamp,
    pub oldest_updated_at: Timestamp,
    /// The earliest lease expiry among these records (in-flight and
    /// processing records hold leases; other states may carry a stale one).
    pub earliest_lease_expiry: Option<Timestamp>,
}

/// When the earliest live lease (an `in_flight` or `processing` record's)
/// runs out, if any record holds one.
pub fn earliest_live_lease(counts: &[StateCount]) -> Option<Timestamp> {
    counts.iter().filter(|c| c.state.is_attempt()).filter_map(|c| c.earliest_lease_expiry).min()
}

/// The outbox's backlog.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventStats {
    pub pending: i64,
    pub parked: i64,
    /// Pending events waiting behind a parked event of their scope (order
    /// per scope is kept: they go once the parked one is redelivered).
    pub held: i64,
    pub oldest_pending_at: Option<Timestamp>,
}

/// How many records of an operation are kept forever (`retention = "forever"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForeverCount {
    pub operation: String,
    pub count: i64,
}
