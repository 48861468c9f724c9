//! The fragments the PostgreSQL store's statements share, and the session
//! settings it sends them with. Each statement lives beside the code that
//! sends it, in its concern's file (`records.rs`, `queue.rs`, `reconcile.rs`,
//! `events.rs`, `trail.rs`, `lifecycle.rs`); [`super::catalog`] lists them all.
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
//! - **Session settings** ([`SESSION_SETTINGS`]): no sequential scans, bitmap
//!   scans, hash joins or merge joins. Every statement here has an index that serves it,
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
//! [`super::catalog`] lists every statement with the indexes it may use;
//! `tests/it/pg_plans.rs` runs `EXPLAIN` on each of them, with these session
//! settings, on an empty never-analyzed table, a populated one and after a
//! mass delete, and fails on any sequential scan or any other index.

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
    // A bitmap scan reads every entry its condition matches before anything
    // is sorted or limited: the relay's window over the pending events
    // ("the oldest 512") read all 40,000 of a backlog and sorted them
    // (48 ms, and growing with the backlog) where the index read in order
    // stops after 512 (16 ms, whatever the backlog).
    ("enable_bitmapscan", "off"),
    // With sequential scans off, a plan that has one anyway (a statement
    // inside a SQL function, a tiny table read whole) is costed past
    // `jit_above_cost`, and PostgreSQL compiles it: hundreds of
    // milliseconds to seconds, at every execution of a function's query.
    // No statement here is large enough for JIT to pay.
    ("jit", "off"),
];

/// [`SESSION_SETTINGS`] as a store of `flavor` sends them. Citus plans a
/// statement with data-modifying CTEs for one shard only once its
/// parameters are known (a generic plan of one is refused: "could not
/// create distributed plan"), so its sessions plan each execution; the
/// shard's own plan is made on the worker, for the statement with its values.
/// Citus sessions also have [`CITUS_SETTINGS`].
pub fn session_settings(flavor: super::Flavor) -> Vec<(&'static str, &'static str)> {
    let mut settings: Vec<(&'static str, &'static str)> = SESSION_SETTINGS
        .iter()
        .map(|&(name, value)| match (flavor, name) {
            (super::Flavor::Citus, "plan_cache_mode") => (name, "force_custom_plan"),
            _ => (name, value),
        })
        .collect();
    if flavor == super::Flavor::Citus {
        settings.extend_from_slice(CITUS_SETTINGS);
    }
    settings
}

/// What every Citus session of the store adds to [`SESSION_SETTINGS`]:
/// - `standard_conforming_strings` (PostgreSQL's default) fixed: the
///   per-tenant statements write the tenant as a literal
///   (`citus_sql::for_tenant`), quoted for it;
/// - one connection per node for a statement over many shards (the record
///   and event gauges, the lists of tenants with work due, the relay's
///   follow-up writes by `seq`, the events' sweep and redelivery, the
///   console's event lists). With Citus's default (16) its executor opens
///   more connections to a node while the node's shard tasks wait, and
///   closes all but one when the statement ends, so every gauge round
///   forked and authenticated new backends on the nodes
///   (docs/performance-notes.md, "Citus: the idle cost"). Such a statement
///   now runs a node's tasks one after another; the request path's
///   statements each touch one shard and are not affected. Migrations set
///   Citus's default back for their own transaction.
pub const CITUS_SETTINGS: &[(&str, &str)] = &[("standard_conforming_strings", "on"), ("citus.max_adaptive_executor_pool_size", "1")];

/// The settings of a session a Citus store opens to a node for the
/// statements of the tenants whose shards that node holds
/// (`citus_route`): those of PostgreSQL's sessions, generic plans included
/// (each statement names its tenant as a constant, so Citus plans it for the
/// node's shard once per connection), and [`CITUS_SETTINGS`].
pub fn routed_session_settings() -> Vec<(&'static str, &'static str)> {
    let mut settings = SESSION_SETTINGS.to_vec();
    settings.extend_from_slice(CITUS_SETTINGS);
    settings
}

/// The record columns every reading statement returns first (the row codec
/// shared with SQLite, `store::codec`).
pub(super) use crate::store::codec::RECORD_COLUMNS;
/// Where a statement that returns the database clock returns it: right after
/// the record's columns.
pub(super) const NOW: usize = crate::store::codec::col::END;

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

/// Appends to the event log the events `select` produces: a query of the
/// ten columns of [`EVENT_INSERT`], in that order (a `NULL` may be of any
/// type; the query may be ordered). The slot is read once per statement,
/// not once per event (the column's default is a function call per row),
/// and the event's id is computed from its transaction and seq (migration
/// 0016), not from random bytes. The transaction has its id before an event
/// draws its seq (the `CASE` evaluates its condition first): a relay's
/// floor on seq relies on it (migration 0017).
pub(super) fn log_append(select: &str) -> String {
    format!(
        "INSERT INTO idemgate_event_log (slot, seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, \
         operation_id, actor, body) \
         SELECT (SELECT r.slot FROM idemgate_event_rotation r WHERE r.one), a.seq, idemgate_log_event_id(a.seq), a.event_type::text, \
         a.tenant::text, a.principal::text, a.operation::text, a.idempotency_key::text, a.generation::int8, a.status::int4, \
         a.operation_id::text, a.actor::text, a.body::bytea \
         FROM (SELECT CASE WHEN pg_current_xact_id() IS NOT NULL THEN nextval('idemgate_events_seq_seq') END AS seq, x.* FROM ({select}) AS x(event_type, tenant, principal, operation, \
         idempotency_key, generation, status, operation_id, actor, body)) a"
    )
}

/// The columns of an event row as read (`decode_event`).
pub(super) const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, \
     operation_id, actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

/// `a, b` with `prefix` before each column: `r.a, r.b`.
pub(super) fn prefixed(columns: &str, prefix: &str) -> String {
    columns.split(',').map(|c| format!("{prefix}{}", c.trim())).collect::<Vec<_>>().join(", ")
}
