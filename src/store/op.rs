//! The store's operations, as the facade ([`crate::store::Store`]) bounds,
//! times and counts them: each a name (the `op` label of
//! `idemgate_store_duration_seconds`, `idemgate_store_errors_total` and
//! `idemgate_fenced_writes_total`: an interface, not to be renamed) and
//! whether it writes (a write that times out is ambiguous, and counts
//! against the store's write health). The lists below are the series
//! declared before their first use; the metrics take them from here.

/// One store operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreOp {
    pub name: &'static str,
    pub write: bool,
}

const fn read(name: &'static str) -> StoreOp {
    StoreOp { name, write: false }
}

const fn write(name: &'static str) -> StoreOp {
    StoreOp { name, write: true }
}

// Lifecycle and health.
pub const PING: StoreOp = read("ping");
pub const WRITE_PROBE: StoreOp = write("write_probe");
pub const NOW: StoreOp = read("now");
pub const REFRESH_PLANS: StoreOp = read("refresh_plans");
pub const DERIVED_KEY_SECRET: StoreOp = read("derived_key_secret");
// Records: the claim, results, reads, retention, leases.
pub const GET: StoreOp = read("get");
pub const CLAIM: StoreOp = write("claim");
pub const ABANDON: StoreOp = write("abandon");
pub const COMPLETE: StoreOp = write("complete");
pub const RELEASE: StoreOp = write("release");
pub const MARK_UNKNOWN: StoreOp = write("mark_unknown");
pub const EXPIRE_LEASE: StoreOp = write("expire_lease");
pub const SWEEP: StoreOp = write("sweep");
pub const REAP_LEASES: StoreOp = write("reap_leases");
pub const STATS: StoreOp = read("stats");
pub const UNKNOWN_BY_AGE: StoreOp = read("unknown_by_age");
pub const FOREVER_COUNTS: StoreOp = read("forever_counts");
// Queue: async operations.
pub const TAKE: StoreOp = write("take");
pub const HEARTBEAT: StoreOp = write("heartbeat");
pub const MARK_SENT: StoreOp = write("mark_sent");
pub const REQUEUE: StoreOp = write("requeue");
pub const FAIL: StoreOp = write("fail");
pub const OPERATION: StoreOp = read("operation");
// Reconcile: probes and resolutions.
pub const RESOLVE: StoreOp = write("resolve");
pub const TAKE_PROBES: StoreOp = write("take_probes");
pub const PROBE_FAILED: StoreOp = write("probe_failed");
// Events: the outbox.
pub const TAKE_EVENTS: StoreOp = write("take_events");
pub const EVENTS_DELIVERED: StoreOp = write("events_delivered");
pub const EVENT_FAILED: StoreOp = write("event_failed");
pub const EVENTS_DEFERRED: StoreOp = write("events_deferred");
pub const EVENTS: StoreOp = read("events");
pub const REDELIVER: StoreOp = write("redeliver");
pub const SWEEP_EVENTS: StoreOp = write("sweep_events");
pub const EVENT_STATS: StoreOp = read("event_stats");
// Trail: the audit trail, listings and a scope's inspection.
pub const LIST: StoreOp = read("list");
pub const BY_SCOPE_ID: StoreOp = read("by_scope_id");
pub const SCOPES_WITHOUT_ID: StoreOp = read("scopes_without_id");
pub const INSPECT: StoreOp = read("inspect");
pub const AUDIT: StoreOp = read("audit");
// The fingerprint settings operations have had.
pub const ADD_FINGERPRINT_SPECS: StoreOp = write("add_fingerprint_specs");
pub const FINGERPRINT_SPECS: StoreOp = read("fingerprint_specs");

/// The operations of the request path and the background on every store:
/// their series exist from the start.
pub const OF_EVERY_STORE: [StoreOp; 13] =
    [CLAIM, GET, COMPLETE, RELEASE, MARK_UNKNOWN, EXPIRE_LEASE, ABANDON, SWEEP, REAP_LEASES, STATS, NOW, PING, WRITE_PROBE];
/// The operations only async routes use: their series exist once a route may
/// run async.
pub const OF_ASYNC_ROUTES: [StoreOp; 7] = [TAKE, HEARTBEAT, MARK_SENT, REQUEUE, FAIL, OPERATION, COMPLETE];
/// The fenced writes of synchronous attempts.
pub const FENCED: [StoreOp; 3] = [COMPLETE, RELEASE, MARK_UNKNOWN];
/// ... and of async attempts.
pub const FENCED_ASYNC: [StoreOp; 5] = [HEARTBEAT, MARK_SENT, REQUEUE, FAIL, COMPLETE];

/// The names of `ops`, as the metrics declare them.
pub fn names(ops: &[StoreOp]) -> impl Iterator<Item = &'static str> + '_ {
    ops.iter().map(|op| op.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store with metrics has the series of the operations every store
    /// runs from the start, by the names the lists above give.
    #[test]
    fn the_declared_series_are_the_listed_operations() {
        let m = crate::telemetry::metrics::Metrics::new();
        m.declare_store_ops(names(&OF_EVERY_STORE), names(&FENCED));
        let text = m.encode();
        for op in OF_EVERY_STORE {
            assert!(text.contains(&format!("idemgate_store_errors_total{{op=\"{}\"}} 0", op.name)), "{}", op.name);
        }
        for op in FENCED {
            assert!(text.contains(&format!("idemgate_fenced_writes_total{{op=\"{}\"}} 0", op.name)), "{}", op.name);
        }
        // Only writes are fenced.
        assert!(FENCED.iter().chain(&FENCED_ASYNC).all(|op| op.write));
    }
}
