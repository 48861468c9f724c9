//! Every statement the PostgreSQL store sends during operation (migrations
//! aside), with the indexes each may use: `tests/it/pg_plans.rs` runs `EXPLAIN`
//! on each of them (see [`super::sql`] for why the plans must not depend on
//! statistics).

use super::event_log::{
    LEASE_LANES, LOG_EVENTS, LOG_INSERT_ONE, LOG_PENDING, LOG_REDELIVER, LOG_SENT, LOG_STATS, RETRIES_DEFERRED, ROTATE, SETTLE, TAKE_LOG,
};
use super::events::{
    EVENT_FAILED, EVENT_INSERT_ONE, EVENT_STATS, EVENTS, EVENTS_BY_DELIVERY, EVENTS_DELIVERED, EVENTS_WINDOW_FULL, REDELIVER, SWEEP_EVENTS,
    TAKE_EVENTS, TAKE_EVENTS_WINDOW,
};
use super::lifecycle::{PROBE_WRITE, SETTING};
use super::queue::{FAIL, HEARTBEAT, MARK_SENT, MARK_SENT_BATCH, OPERATION, REQUEUE, TAKE};
use super::reconcile::{PROBE_FAILED, RESOLVE_COMPLETE, RESOLVE_DELETE, RESOLVE_HOLD, RESOLVE_LOCK, RESOLVE_REQUEUE, TAKE_PROBES};
use super::records::{
    ABANDON, BY_SCOPE_ID, CLAIM, CLAIM_BATCH, COMPLETE, COMPLETE_BATCH, FOREVER_COUNTS, GET, ListShape, MARK_UNKNOWN, REAP_LEASES, RELEASE,
    STATS, SWEEP, UNKNOWN_BY_AGE, WRITE_BATCH,
};
use super::trail::{AUDIT_INSERT, AUDIT_LIST, AUDIT_OF_SCOPE, INSPECT};

/// One statement of the catalog: what it is called, its text, and the
/// indexes of `idemgate_records` and `idemgate_events` it may use (any other
/// access to those tables, a sequential scan above all, is a wrong plan).
#[derive(Debug, Clone)]
pub struct Statement {
    pub name: String,
    pub sql: String,
    pub indexes: &'static [&'static str],
}

pub(super) const PKEY: &[&str] = &["idemgate_records_pkey"];

/// The event log's index, on each of its three slots (migration 0015).
const LOG_0: &str = "idemgate_event_log_0_lane_xid_idx";
const LOG_1: &str = "idemgate_event_log_1_lane_xid_idx";
const LOG_2: &str = "idemgate_event_log_2_lane_xid_idx";
const LANES_PKEY: &str = "idemgate_event_lanes_pkey";
/// Its index by lane and seq (migration 0016), read by the take of a batch
/// under way and by settling's look-up of the events it copies.
const LOG_SEQ_0: &str = "idemgate_event_log_0_lane_seq_idx";
const LOG_SEQ_1: &str = "idemgate_event_log_1_lane_seq_idx";
const LOG_SEQ_2: &str = "idemgate_event_log_2_lane_seq_idx";

/// Every statement the store sends during operation (migrations aside),
/// with the indexes each may use. `tests/it/pg_plans.rs` checks their plans.
pub fn catalog() -> Vec<Statement> {
    let s = |name: &str, sql: &str, indexes: &'static [&'static str]| Statement { name: name.to_owned(), sql: sql.to_owned(), indexes };
    let mut all = vec![
        s("claim", &CLAIM, PKEY),
        s("claim_batch", &CLAIM_BATCH, PKEY),
        s("complete_batch", &COMPLETE_BATCH, PKEY),
        s("write_batch", &WRITE_BATCH, PKEY),
        s("complete", &COMPLETE, PKEY),
        s("get", &GET, PKEY),
        s("release", &RELEASE, PKEY),
        s("abandon", &ABANDON, PKEY),
        s("mark_unknown", &MARK_UNKNOWN, PKEY),
        s("resolve_lock", &RESOLVE_LOCK, PKEY),
        s("resolve_hold", &RESOLVE_HOLD, PKEY),
        s("resolve_delete", &RESOLVE_DELETE, PKEY),
        s("resolve_complete", &RESOLVE_COMPLETE, PKEY),
        s("resolve_requeue", &RESOLVE_REQUEUE, PKEY),
        s("by_scope_id", &BY_SCOPE_ID, PKEY),
        s("audit_insert", AUDIT_INSERT, &[]),
        s("event_insert", &EVENT_INSERT_ONE, &[]),
        s("audit_list", AUDIT_LIST, &[]),
        s("inspect", &INSPECT, PKEY),
        s("audit_of_scope", AUDIT_OF_SCOPE, &["idemgate_audit_scope"]),
        s("setting", SETTING, &[]),
        s("probe_write", PROBE_WRITE, &[]),
        s("sweep", SWEEP, &["idemgate_records_sweep", "idemgate_records_pkey"]),
        s("reap_leases", &REAP_LEASES, &["idemgate_records_open", "idemgate_records_pkey"]),
        // Queued records through their own index or through the open states' index, which holds them too.
        s("take", &TAKE, &["idemgate_records_queue", "idemgate_records_open", "idemgate_records_pkey"]),
        s("heartbeat", &HEARTBEAT, PKEY),
        s("mark_sent", &MARK_SENT, PKEY),
        s("mark_sent_batch", MARK_SENT_BATCH, PKEY),
        s("requeue", &REQUEUE, PKEY),
        s("fail", &FAIL, PKEY),
        s("operation", &OPERATION, &["idemgate_records_operation_id"]),
        s(
            "take_events",
            &TAKE_EVENTS,
            &["idemgate_events_pending", "idemgate_events_scope", "idemgate_events_parked", "idemgate_events_pkey"],
        ),
        s(
            "take_events_window",
            &TAKE_EVENTS_WINDOW,
            &["idemgate_events_pending", "idemgate_events_scope", "idemgate_events_parked", "idemgate_events_pkey"],
        ),
        s("events_window_full", &EVENTS_WINDOW_FULL, &["idemgate_events_pending", "idemgate_events_scope"]),
        s("events_delivered", EVENTS_DELIVERED, &["idemgate_events_pkey"]),
        s("event_failed", EVENT_FAILED, &["idemgate_events_pkey"]),
        s("events", &EVENTS, &["idemgate_events_pkey"]),
        s("events_by_delivery", &EVENTS_BY_DELIVERY, &["idemgate_events_pkey"]),
        s("redeliver", REDELIVER, &["idemgate_events_event_id"]),
        s("sweep_events", SWEEP_EVENTS, &["idemgate_events_sent", "idemgate_events_pkey"]),
        // Pending events through either of the indexes that hold just them.
        s("event_stats", EVENT_STATS, &["idemgate_events_pending", "idemgate_events_scope", "idemgate_events_parked"]),
        // The event log: a lane's events through its index (one per slot),
        // the lanes through their primary key, copies in idemgate_events by seq.
        s("log_insert", &LOG_INSERT_ONE, &[]),
        s(
            "take_log",
            &TAKE_LOG,
            &[
                LOG_0,
                LOG_1,
                LOG_2,
                LOG_SEQ_0,
                LOG_SEQ_1,
                LOG_SEQ_2,
                LANES_PKEY,
                "idemgate_events_scope",
                "idemgate_events_pending",
                "idemgate_events_parked",
            ],
        ),
        s("lease_lanes", &LEASE_LANES, &[LOG_0, LOG_1, LOG_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("settle", &SETTLE, &[LOG_SEQ_0, LOG_SEQ_1, LOG_SEQ_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("retries_deferred", RETRIES_DEFERRED, &["idemgate_events_pkey"]),
        s("log_events", &LOG_EVENTS, &[LOG_0, LOG_1, LOG_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("log_pending", &LOG_PENDING, &[LOG_0, LOG_1, LOG_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("log_sent", &LOG_SENT, &[LOG_0, LOG_1, LOG_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("log_stats", &LOG_STATS, &[LOG_0, LOG_1, LOG_2, LANES_PKEY, "idemgate_events_pkey"]),
        s("log_redeliver", &LOG_REDELIVER, &[LOG_0, LOG_1, LOG_2]),
        s("rotate", ROTATE, &[]),
        s("stats", STATS, &["idemgate_records_open"]),
        // The look at the tables' statistics and sizes (`replan`; catalogs only).
        s("table_look", super::replan::TABLE_LOOK, &[]),
        s("unknown_by_age", UNKNOWN_BY_AGE, &["idemgate_records_open"]),
        s("forever_counts", FOREVER_COUNTS, &["idemgate_records_forever"]),
        s("take_probes", &TAKE_PROBES, &["idemgate_records_open", "idemgate_records_pkey"]),
        s("probe_failed", &PROBE_FAILED, PKEY),
    ];
    for shape in ListShape::all() {
        all.push(Statement { name: format!("list {shape:?}"), sql: shape.sql(), indexes: shape.indexes() });
    }
    all
}
