//! The PostgreSQL store's statement catalog, the fragments its statements
//! share, and the session settings it sends them with. Each statement lives
//! beside the code that sends it, in its concern's file (`records.rs`,
//! `queue.rs`, `reconcile.rs`, `events.rs`, `trail.rs`, `lifecycle.rs`);
//! [`catalog`] lists them all.
//!
//! # Plans that do not depend on statistics
//!
//! idemgate's sessions plan every statement once per connection as a generic
//! plan (`plan_cache_mode = force_generic_plan`), often while the tables are
//! empty and never analyzed. Left to costs, the planner then picks whatever
//! the missing statistics make look cheap, a hash join over a sequential
//! scan or a partial index that happens to match a `state` test, and keeps
//! that plan for the connection's life while the table grows. Two rules make
//! the plans the same whatever the statistics:
//!
//! - **Session settings** ([`SESSION_SETTINGS`]): no sequential scans, hash
//!   joins or merge joins. Every statement here has an index that serves it,
//!   so these only remove the wrong choices; a batch's elements are looked up
//!   one by one through the primary key (a nested loop), which is what a
//!   batch of up to 128 keys should cost against a table of any size.
//! - **Statement shape**: a statement that finds its row by the primary key
//!   tests `state` (or an event's `delivery`) with `CASE`
//!   (`CASE state WHEN ... THEN true ELSE false END`), which the planner can neither use as
//!   an index condition nor use to prove a partial index's predicate. So the
//!   primary key is the only index such a statement can use, and a table full
//!   of dead `in_flight` entries in the `open` index cannot be scanned
//!   instead.
//!
//! [`catalog`] lists every statement with the indexes it may use;
//! `tests/pg_plans.rs` runs `EXPLAIN` on each of them, with these session
//! settings, on an empty never-analyzed table, a populated one and after a
//! mass delete, and fails on any sequential scan or any other index.

use super::events::{
    EVENT_FAILED, EVENT_INSERT_ONE, EVENT_STATS, EVENTS, EVENTS_BY_DELIVERY, EVENTS_DELIVERED, REDELIVER, SWEEP_EVENTS, TAKE_EVENTS,
};
use super::lifecycle::{PROBE_WRITE, SETTING};
use super::queue::{FAIL, HEARTBEAT, MARK_SENT, OPERATION, REQUEUE, TAKE};
use super::reconcile::{PROBE_FAILED, RESOLVE_COMPLETE, RESOLVE_DELETE, RESOLVE_HOLD, RESOLVE_LOCK, RESOLVE_REQUEUE, TAKE_PROBES};
use super::records::{
    ABANDON, BY_SCOPE_ID, CLAIM, CLAIM_BATCH, COMPLETE, COMPLETE_BATCH, FOREVER_COUNTS, GET, ListShape, MARK_UNKNOWN, REAP_LEASES, RELEASE,
    STATS, SWEEP, WRITE_BATCH,
};
use super::trail::{AUDIT_INSERT, AUDIT_LIST, AUDIT_OF_SCOPE, INSPECT};

/// `name=value` settings of every idemgate session (sent at connect time),
/// besides `statement_timeout`. See the module documentation.
pub const SESSION_SETTINGS: &[(&str, &str)] = &[
    // The batched statements take arrays; left to itself PostgreSQL keeps
    // re-planning them per execution (custom plans), which doubled their
    // cost in the benchmark. With the settings below the generic plan is
    // always the index plan.
    ("plan_cache_mode", "force_generic_plan"),
    ("enable_seqscan", "off"),
    ("enable_hashjoin", "off"),
    ("enable_mergejoin", "off"),
];

/// The record columns every reading statement returns, in `decode`'s order.
pub(super) const COLUMNS: &str = "tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner, \
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at, \
     operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source";
/// How many columns `COLUMNS` has: the next column of a row is at this index.
pub(super) const NCOLS: usize = 23;

/// The primary key from `$1`..`$4`: the scope id, computed by the database
/// (migration 0011), leads it.
pub(super) const PK: &str =
    "scope_id = idemgate_scope_id($1, $2, $3, $4) AND idempotency_key = $4 AND tenant = $1 AND principal = $2 AND operation = $3";

/// A fenced async write: the attempt's generation and token, `processing`.
pub(super) const FENCE: &str = "generation = $5 AND claim_token = $6 AND CASE state WHEN 'processing' THEN true ELSE false END";

/// `expires_at` from a retention parameter (`retention_us`) at `$7`, `$8`, `$9`:
/// NULL (forever) becomes `'infinity'`.
pub(super) const EXPIRES_7: &str = "coalesce(now() + $7::int8 * interval '1 microsecond', 'infinity')";
pub(super) const EXPIRES_8: &str = "coalesce(now() + $8::int8 * interval '1 microsecond', 'infinity')";
pub(super) const EXPIRES_9: &str = "coalesce(now() + $9::int8 * interval '1 microsecond', 'infinity')";

/// The columns of an event row as written (`INSERT INTO idemgate_events {EVENT_INSERT} ...`).
pub(super) const EVENT_INSERT: &str =
    "(event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, body)";

/// The columns of an event row as read (`decode_event`).
pub(super) const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, \
     operation_id, actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

/// `a, b` with `prefix` before each column: `r.a, r.b`.
pub(super) fn prefixed(columns: &str, prefix: &str) -> String {
    columns.split(',').map(|c| format!("{prefix}{}", c.trim())).collect::<Vec<_>>().join(", ")
}

/// One statement of the catalog: what it is called, its text, and the
/// indexes of `idemgate_records` and `idemgate_events` it may use (any other
/// access to those tables, a sequential scan above all, is a wrong plan).
#[derive(Debug, Clone)]
pub struct Statement {
    pub name: String,
    pub sql: String,
    pub indexes: &'static [&'static str],
}

const PKEY: &[&str] = &["idemgate_records_pkey"];

/// Every statement the store sends during operation (migrations aside),
/// with the indexes each may use. `tests/pg_plans.rs` checks their plans.
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
        s("requeue", &REQUEUE, PKEY),
        s("fail", &FAIL, PKEY),
        s("operation", &OPERATION, &["idemgate_records_operation_id"]),
        s(
            "take_events",
            &TAKE_EVENTS,
            &["idemgate_events_pending", "idemgate_events_scope", "idemgate_events_parked", "idemgate_events_pkey"],
        ),
        s("events_delivered", EVENTS_DELIVERED, &["idemgate_events_pkey"]),
        s("event_failed", EVENT_FAILED, &["idemgate_events_pkey"]),
        s("events", &EVENTS, &["idemgate_events_pkey"]),
        s("events_by_delivery", &EVENTS_BY_DELIVERY, &["idemgate_events_pkey"]),
        s("redeliver", REDELIVER, &["idemgate_events_event_id"]),
        s("sweep_events", SWEEP_EVENTS, &["idemgate_events_sent", "idemgate_events_pkey"]),
        // Pending events through either of the indexes that hold just them.
        s("event_stats", EVENT_STATS, &["idemgate_events_pending", "idemgate_events_scope", "idemgate_events_parked"]),
        s("stats", STATS, &["idemgate_records_open"]),
        s("forever_counts", FOREVER_COUNTS, &["idemgate_records_forever"]),
        s("take_probes", &TAKE_PROBES, &["idemgate_records_open", "idemgate_records_pkey"]),
        s("probe_failed", &PROBE_FAILED, PKEY),
    ];
    for shape in ListShape::all() {
        all.push(Statement { name: format!("list {shape:?}"), sql: shape.sql(), indexes: shape.indexes() });
    }
    all
}
