//! Every statement the PostgreSQL store sends, in one place, and the session
//! settings it sends them with.
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
//!   ([`state_is`]-style text below), which the planner can neither use as
//!   an index condition nor use to prove a partial index's predicate. So the
//!   primary key is the only index such a statement can use, and a table full
//!   of dead `in_flight` entries in the `open` index cannot be scanned
//!   instead.
//!
//! [`catalog`] lists every statement with the indexes it may use;
//! `tests/pg_plans.rs` runs `EXPLAIN` on each of them, with these session
//! settings, on an empty never-analyzed table, a populated one and after a
//! mass delete, and fails on any sequential scan or any other index.

use std::sync::LazyLock;

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

/// [`SESSION_SETTINGS`] as a store of `flavor` sends them. Citus plans a
/// statement with data-modifying CTEs for one shard only once its
/// parameters are known (a generic plan of one is refused: "could not
/// create distributed plan"), so its sessions plan each execution; the
/// shard's own plan is made on the worker, for the statement with its values.
pub fn session_settings(flavor: super::Flavor) -> Vec<(&'static str, &'static str)> {
    SESSION_SETTINGS
        .iter()
        .map(|&(name, value)| match (flavor, name) {
            (super::Flavor::Citus, "plan_cache_mode") => (name, "force_custom_plan"),
            _ => (name, value),
        })
        .collect()
}

/// The record columns every reading statement returns, in `decode`'s order.
pub(super) const COLUMNS: &str = "tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner, \
     lease_expires_at, response_status, response_headers, response_body, created_at, updated_at, expires_at, \
     operation_id, attempts, next_attempt_at, sent_at, last_status, maybe_executed, key_source";
/// How many columns `COLUMNS` has: the next column of a row is at this index.
pub(super) const NCOLS: usize = 23;

/// The primary key from `$1`..`$4`: the scope id, computed by the database
/// (migration 0011), leads it.
const PK: &str =
    "scope_id = idemgate_scope_id($1, $2, $3, $4) AND idempotency_key = $4 AND tenant = $1 AND principal = $2 AND operation = $3";

/// A fenced async write: the attempt's generation and token, `processing`.
const FENCE: &str = "generation = $5 AND claim_token = $6 AND CASE state WHEN 'processing' THEN true ELSE false END";

/// `expires_at` from a retention parameter (`retention_us`) at `$7`, `$8`, `$9`:
/// NULL (forever) becomes `'infinity'`.
const EXPIRES_7: &str = "coalesce(now() + $7::int8 * interval '1 microsecond', 'infinity')";
const EXPIRES_8: &str = "coalesce(now() + $8::int8 * interval '1 microsecond', 'infinity')";
const EXPIRES_9: &str = "coalesce(now() + $9::int8 * interval '1 microsecond', 'infinity')";

/// [`EXPIRES_7`]-style expiry from `$n` for Citus, which refuses `now()`
/// inside `coalesce` (or `CASE`) in a distributed `UPDATE`: `greatest`
/// ignores the NULL of a forever retention and of the parameter-only `CASE`.
fn citus_expires(n: usize) -> String {
    format!("greatest(now() + ${n}::int8 * interval '1 microsecond', CASE WHEN ${n}::int8 IS NULL THEN 'infinity'::timestamptz END)")
}

/// The columns of an event row as written (`INSERT INTO idemgate_events {EVENT_INSERT} ...`).
const EVENT_INSERT: &str = "(event_type, tenant, principal, operation, idempotency_key, generation, status, operation_id, actor, body)";

/// The columns of an event row as read (`decode_event`).
pub(super) const EVENT_COLUMNS: &str = "seq, event_id, event_type, tenant, principal, operation, idempotency_key, generation, status, \
     operation_id, actor, at, body, delivery, attempts, next_attempt_at, last_error, sent_at";

/// The claim: one statement, autocommitted. It reads the scope's row, takes it
/// over if `record::may_take_over` allows (an UPDATE that re-checks the
/// condition on the latest row version), or inserts when there is none
/// (`ON CONFLICT DO NOTHING`). At most one of the two writes acts. When neither
/// does, nothing is written or locked, so a replay or a duplicate costs no
/// commit; the row seen is returned with the database clock.
///
/// With an operation id (`$10`) it is an async acceptance: the record starts
/// `queued` (due now, no lease) and keeps the request (`$11`) for the workers.
///
/// Returned: the row seen (`COLUMNS`), `now()`, the inserted row's generation
/// and lease, the taken-over row's, and whether the row seen may be cached
/// (no resolution holds it out of the replay caches).
pub(super) static CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH cur AS (
    SELECT {COLUMNS}, cache_hold_until
    FROM idemgate_records
    WHERE {PK}
), taken AS (
    UPDATE idemgate_records r SET
        request_hash = $5, state = CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END,
        generation = nextval('idemgate_generation'), claim_token = $6, owner = $7,
        lease_expires_at = CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END,
        response_status = NULL, response_headers = NULL, response_body = NULL,
        created_at = now(), updated_at = now(), expires_at = now() + $8::int8 * interval '1 microsecond',
        operation_id = $10, request = $11, attempts = 0,
        next_attempt_at = CASE WHEN $10::text IS NOT NULL THEN now() END, sent_at = NULL, last_status = NULL, maybe_executed = false,
        key_source = $12
    WHERE {PK}
      AND CASE r.state
            WHEN 'completed' THEN r.expires_at <= now()
            WHEN 'failed_retryable' THEN r.expires_at <= now()
            WHEN 'unknown' THEN $9::bool AND r.request_hash = $5
            WHEN 'in_flight' THEN $9::bool AND r.request_hash = $5 AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
            ELSE false
          END
    RETURNING r.generation, coalesce(r.lease_expires_at, now())
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id)
    SELECT $1, $2, $3, $4, $5, CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), $6, $7,
           CASE WHEN $10::text IS NULL THEN now() + $8::int8 * interval '1 microsecond' END, now(), now(),
           now() + $8::int8 * interval '1 microsecond', $10, $11, CASE WHEN $10::text IS NOT NULL THEN now() END, $12,
           idemgate_scope_id($1, $2, $3, $4)
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
    RETURNING generation, coalesce(lease_expires_at, now())
)
SELECT {}, now(),
       (SELECT generation FROM inserted), (SELECT coalesce FROM inserted),
       (SELECT generation FROM taken), (SELECT coalesce FROM taken),
       NOT coalesce(cur.cache_hold_until > now(), false)
FROM (SELECT 1) AS one LEFT JOIN cur ON true",
        prefixed(COLUMNS, "cur.")
    )
});

/// Citus's claim: the take-over branch of [`CLAIM`] needs a new generation,
/// and Citus refuses a volatile function (`nextval`) in a distributed
/// `UPDATE` and a stable one (`now()`) inside `CASE` in one; its data-modifying
/// CTEs are planned step by step. So on Citus a claim is up to three router
/// statements on the scope's shard, each autocommitted, with the parameters
/// of `CLAIM` (the read only `$1`..`$4`; the insert returns `$9` so that its
/// parameters are those of `CLAIM`): [`CITUS_CLAIM_READ`] (a replay ends here),
/// [`CITUS_CLAIM_INSERT`] (a first write ends here), and, for a record that
/// `record::may_take_over` allows, [`CITUS_TAKE_OVER`], which re-checks that
/// condition on the latest row version. A lost insert is `RawClaim::Conflict`,
/// as with the batch (the facade reads the winner).
pub(super) static CITUS_CLAIM_READ: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {COLUMNS}, now(), NOT coalesce(cache_hold_until > now(), false) FROM idemgate_records WHERE {PK}"));

/// A new generation, on the coordinator (see [`CITUS_TAKE_OVER`]).
pub(super) const CITUS_NEXT_GENERATION: &str = "SELECT nextval('idemgate_generation')";

/// See [`CITUS_CLAIM_READ`]. The generation is drawn in the `INSERT`'s
/// values, which Citus evaluates on the coordinator; the lease and the due
/// time are `now()` plus an interval that a parameter-only `CASE` makes NULL
/// (Citus refuses `now()` inside a `CASE` of a modification).
pub(super) static CITUS_CLAIM_INSERT: LazyLock<String> = LazyLock::new(|| {
    "INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id)
     VALUES ($1, $2, $3, $4, $5, CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), $6, $7,
             now() + (CASE WHEN $10::text IS NULL THEN $8::int8 END) * interval '1 microsecond', now(), now(),
             now() + $8::int8 * interval '1 microsecond', $10, $11, now() + (CASE WHEN $10::text IS NOT NULL THEN 0 END) * interval '1 microsecond',
             $12, idemgate_scope_id($1, $2, $3, $4))
     ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
     RETURNING generation, lease_expires_at, updated_at, $9::bool"
        .to_owned()
});

/// See [`CITUS_CLAIM_READ`]. The new generation is `$13`, drawn before by
/// [`CITUS_NEXT_GENERATION`] (Citus refuses `nextval()` in a distributed
/// `UPDATE`, and a `SELECT` CTE drawing it would be a subplan whose result
/// Citus may send to every node); it never goes below the record's own
/// (`greatest`), whatever the counter does.
pub(super) static CITUS_TAKE_OVER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
UPDATE idemgate_records r SET
    request_hash = $5, state = CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END,
    generation = greatest($13::int8, r.generation + 1), claim_token = $6, owner = $7,
    lease_expires_at = now() + (CASE WHEN $10::text IS NULL THEN $8::int8 END) * interval '1 microsecond',
    response_status = NULL, response_headers = NULL, response_body = NULL,
    created_at = now(), updated_at = now(), expires_at = now() + $8::int8 * interval '1 microsecond',
    operation_id = $10, request = $11, attempts = 0,
    next_attempt_at = now() + (CASE WHEN $10::text IS NOT NULL THEN 0 END) * interval '1 microsecond',
    sent_at = NULL, last_status = NULL, maybe_executed = false, key_source = $12
WHERE {PK}
  AND ((r.state IN ('completed', 'failed_retryable') AND r.expires_at <= now())
       OR (r.state = 'unknown' AND $9::bool AND r.request_hash = $5)
       OR (r.state = 'in_flight' AND $9::bool AND r.request_hash = $5 AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())))
RETURNING r.generation, r.lease_expires_at, r.updated_at"
    )
});

/// The claims of a batch as rows (`$1`..`$12`, one array per column),
/// inserted first: a new scope costs the insert's own primary-key descents
/// only, and only the claims that were not inserted read the row they met
/// (the statement's snapshot, so a row committed by another batch since is
/// neither read nor inserted: `BatchClaim::Conflict`). A claim of an
/// existing scope pays one descent more than a read alone would, and takes
/// a generation number it does not use. The inserted scope id is the
/// database's own (`idemgate_scope_id`); the gateway's (`$12`, the same
/// hash) only finds rows. The conflict names the key, not its columns.
const CLAIM_INPUT: &str = "\
input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::uuid[], $7::text[], $8::int8[],
                         $9::text[], $10::bytea[], $11::text[], $12::int8[])
        WITH ORDINALITY AS i(tenant, principal, operation, idempotency_key, request_hash, claim_token, owner, lease_us,
                             operation_id, request, key_source, scope_id, ord)
), inserted AS (
    INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id)
    SELECT i.tenant, i.principal, i.operation, i.idempotency_key, i.request_hash,
           CASE WHEN i.operation_id IS NULL THEN 'in_flight' ELSE 'queued' END, nextval('idemgate_generation'), i.claim_token, i.owner,
           CASE WHEN i.operation_id IS NULL THEN now() + i.lease_us * interval '1 microsecond' END, now(), now(),
           now() + i.lease_us * interval '1 microsecond', i.operation_id, i.request,
           CASE WHEN i.operation_id IS NOT NULL THEN now() END, i.key_source,
           idemgate_scope_id(i.tenant, i.principal, i.operation, i.idempotency_key)
    FROM input i
    ORDER BY i.scope_id, i.idempotency_key, i.tenant, i.principal, i.operation
    ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
    RETURNING claim_token, generation, coalesce(lease_expires_at, now()) AS lease
), cur AS (
    SELECT i.ord, r.tenant, r.principal, r.operation, r.idempotency_key, r.request_hash, r.state, r.generation, r.claim_token,
           r.owner, r.lease_expires_at, r.response_status, r.response_headers, r.response_body, r.created_at, r.updated_at, r.expires_at,
           r.operation_id, r.attempts, r.next_attempt_at, r.sent_at, r.last_status, r.maybe_executed, r.key_source, r.cache_hold_until
    FROM input i JOIN idemgate_records r
      ON r.scope_id = i.scope_id AND r.idempotency_key = i.idempotency_key
     AND r.tenant = i.tenant AND r.principal = i.principal AND r.operation = i.operation
    WHERE NOT EXISTS (SELECT 1 FROM inserted ins WHERE ins.claim_token = i.claim_token)
)";

/// What the batched claim returns per claim, in input order: the row seen
/// (`COLUMNS`), `now()`, the inserted row's generation and lease, and whether
/// the row seen may be cached (as in `CLAIM`).
const CLAIM_OUTPUT: &str = "\
SELECT c.tenant, c.principal, c.operation, c.idempotency_key, c.request_hash, c.state, c.generation, c.claim_token,
       c.owner, c.lease_expires_at, c.response_status, c.response_headers, c.response_body, c.created_at, c.updated_at,
       c.expires_at, c.operation_id, c.attempts, c.next_attempt_at, c.sent_at, c.last_status, c.maybe_executed, c.key_source, now(),
       ins.generation, ins.lease, NOT coalesce(c.cache_hold_until > now(), false)";

const CLAIM_FROM: &str = "\
FROM input i
LEFT JOIN cur c ON c.ord = i.ord
LEFT JOIN inserted ins ON ins.claim_token = i.claim_token
ORDER BY i.ord";

/// The result writes of a batch as rows (from `$n` on, one array per
/// column; the scope ids last), each fenced by its own attempt, and their
/// events.
fn complete_parts(first: usize) -> String {
    let p = |i: usize| format!("${}", first + i);
    format!(
        "\
v AS (
    SELECT * FROM unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::int8[], {}::int4[], {}::bytea[], {}::bytea[],
                         {}::int8[], {}::uuid[], {}::bool[], {}::bool[], {}::int8[])
        WITH ORDINALITY AS v(tenant, principal, operation, idempotency_key, generation, status, headers, body, retention_us, claim_token,
                             emit, with_body, scope_id, ord)
), upd AS (
    UPDATE idemgate_records r SET
        state = 'completed', response_status = v.status, response_headers = v.headers, response_body = v.body,
        lease_expires_at = NULL, updated_at = now(), request = NULL,
        expires_at = coalesce(now() + v.retention_us * interval '1 microsecond', 'infinity')
    FROM v
    WHERE r.scope_id = v.scope_id AND r.idempotency_key = v.idempotency_key
      AND r.tenant = v.tenant AND r.principal = v.principal AND r.operation = v.operation
      AND r.generation = v.generation AND r.claim_token = v.claim_token
      AND CASE r.state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END
    RETURNING v.ord, v.emit, v.with_body, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.response_status,
              r.operation_id, r.response_body
), ev AS (
    INSERT INTO idemgate_events {EVENT_INSERT}
    SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL,
           CASE WHEN with_body THEN response_body END
    FROM upd WHERE emit ORDER BY ord
)",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4),
        p(5),
        p(6),
        p(7),
        p(8),
        p(9),
        p(10),
        p(11),
        p(12),
    )
}

/// The batched claim: like `CLAIM` for many scopes at once, but without the
/// take-over branch (the single-row statement does that). Rows are inserted
/// in primary-key order so that two batches never wait on each other in a
/// cycle; the answer comes back in input order.
pub(super) static CLAIM_BATCH: LazyLock<String> = LazyLock::new(|| format!("WITH {CLAIM_INPUT}\n{CLAIM_OUTPUT}\n{CLAIM_FROM}"));

/// The batched result write (`$1`..`$13`), each row fenced by its own attempt.
pub(super) static COMPLETE_BATCH: LazyLock<String> = LazyLock::new(|| format!("WITH {}\nSELECT ord FROM upd", complete_parts(1)));

/// One commit for a batch of claims (`$1`..`$12`) and a batch of result
/// writes (`$13`..`$25`): the claims' rows as `CLAIM_BATCH` returns them,
/// each with the ordinals of the result writes that took effect.
pub(super) static WRITE_BATCH: LazyLock<String> =
    LazyLock::new(|| format!("WITH {CLAIM_INPUT}, {}\n{CLAIM_OUTPUT}, (SELECT array_agg(ord) FROM upd)\n{CLAIM_FROM}", complete_parts(13)));

/// The single-row result write: used when a batched statement deadlocked.
pub(super) static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET state = 'completed', response_status = $6, response_headers = $7, \
         response_body = $8, lease_expires_at = NULL, updated_at = now(), expires_at = {EXPIRES_9}, request = NULL \
         WHERE {PK} AND generation = $5 AND claim_token = $10 \
         AND CASE state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END \
         RETURNING tenant, principal, operation, idempotency_key, generation, response_status, operation_id, response_body), \
         ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
         SELECT 'completed', tenant, principal, operation, idempotency_key, generation, response_status, operation_id, NULL, \
         CASE WHEN $12 THEN response_body END FROM upd WHERE $11) \
         SELECT 1 FROM upd"
    )
});

/// [`COMPLETE`] on Citus (`$1`..`$10`): `expires_at` without `now()` inside
/// `coalesce` (refused in a distributed `UPDATE`): `greatest` of the finite
/// expiry (NULL for forever) and `'infinity'` when the retention is forever.
/// The `UPDATE` alone, returning what its event needs: an `INSERT ...
/// SELECT` from a CTE would run as subplans whose results Citus may send to
/// every node, so a completion would fail while any worker is down. The
/// event is written in the same (single-shard) transaction by
/// `citus::write_with_event`.
pub(super) static CITUS_COMPLETE: LazyLock<String> = LazyLock::new(|| {
    citus_update_only(
        &COMPLETE.replace(EXPIRES_9, &citus_expires(9)),
        "tenant, principal, operation, idempotency_key, generation, response_status, operation_id, response_body, state",
    )
});

pub(super) static GET: LazyLock<String> = LazyLock::new(|| format!("SELECT {COLUMNS}, now() FROM idemgate_records WHERE {PK}"));

pub(super) static RELEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idemgate_records WHERE {PK} AND generation = $5 AND claim_token = $6 \
         AND CASE state WHEN 'in_flight' THEN true ELSE false END RETURNING 1"
    )
});

pub(super) static ABANDON: LazyLock<String> = LazyLock::new(|| {
    format!(
        "DELETE FROM idemgate_records WHERE {PK} AND claim_token = $5 \
         AND CASE state WHEN 'in_flight' THEN true ELSE false END RETURNING 1"
    )
});

pub(super) static MARK_UNKNOWN: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET state = 'unknown', updated_at = now() \
         WHERE {PK} AND generation = $5 AND claim_token = $7 \
         AND CASE state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END \
         AND (NOT $6::bool OR lease_expires_at IS NULL OR lease_expires_at <= now()) \
         RETURNING tenant, principal, operation, idempotency_key, generation, operation_id), \
         ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
         SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL FROM upd WHERE $8) \
         SELECT 1 FROM upd"
    )
});

/// Which filters a listing has; each combination is its own statement, so
/// that each is planned for its own index (a `$n IS NULL OR ...` test would
/// leave the planner no index to use).
///
/// - One of the open states (`in_flight`, `unknown`, ...): the records in that
///   state through the partial index of open states (the working set, small
///   whatever the table's size), then sorted. The sort key is written so that
///   no index provides it, which keeps the planner on that index.
/// - Otherwise: the newest records first through `idemgate_records_recent`,
///   skipping those the filters reject, until the page is full. Every other
///   filter is written so that no other index can serve it. A filter that
///   matches few of many records walks far: filter by state for those.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ListShape {
    /// `None`: any state; `Some(true)`: `completed`; `Some(false)`: one of the open states.
    pub state: Option<bool>,
    pub tenant: bool,
    pub operation: bool,
    pub forever: bool,
    pub cursor: bool,
}

/// `cond`, in a form the planner can neither use as an index condition nor
/// use to prove a partial index's predicate.
fn opaque(cond: &str) -> String {
    format!("CASE WHEN {cond} THEN true ELSE false END")
}

impl ListShape {
    /// Every combination, for the plan test.
    pub fn all() -> Vec<ListShape> {
        let mut all = Vec::new();
        for state in [None, Some(true), Some(false)] {
            for bits in 0..16u8 {
                all.push(ListShape {
                    state,
                    tenant: bits & 1 != 0,
                    operation: bits & 2 != 0,
                    forever: bits & 4 != 0,
                    cursor: bits & 8 != 0,
                });
            }
        }
        all
    }

    /// The statement. Its parameters, numbered in this order, only those the
    /// shape uses: the state, the tenant, the operation, the cursor
    /// (`updated_at` in microseconds since the epoch, then the four primary
    /// key columns), and last the limit.
    pub fn sql(self) -> String {
        let mut n = 0;
        let mut next = || {
            n += 1;
            format!("${n}")
        };
        let open = self.state == Some(false);
        let mut conds: Vec<String> = Vec::new();
        if let Some(_state) = self.state {
            let p = next();
            conds.push(if open { format!("state = {p}::text AND state <> 'completed'") } else { opaque(&format!("state = {p}::text")) });
        }
        if self.tenant {
            conds.push(opaque(&format!("tenant = {}::text", next())));
        }
        if self.operation {
            conds.push(opaque(&format!("operation = {}::text", next())));
        }
        if self.forever {
            conds.push(opaque("expires_at = 'infinity'"));
        }
        if self.cursor {
            let at = format!("'epoch'::timestamptz + {}::int8 * interval '1 microsecond'", next());
            let (t, p, o, k) = (next(), next(), next(), next());
            let after = format!(
                "updated_at < {at} OR (tenant, principal, operation, idempotency_key) > ({t}::text, {p}::text, {o}::text, {k}::text)"
            );
            // Newest first: the recent index seeks to the cursor.
            conds.push(if open {
                opaque(&format!("updated_at <= {at} AND ({after})"))
            } else {
                format!("updated_at <= {at} AND ({after})")
            });
        }
        let mut sql = format!("SELECT {COLUMNS} FROM idemgate_records");
        if !conds.is_empty() {
            sql.push_str(" WHERE ");
            sql.push_str(&conds.join(" AND "));
        }
        let newest = if open { "updated_at + interval '0 seconds'" } else { "updated_at" };
        sql.push_str(&format!(" ORDER BY {newest} DESC, tenant, principal, operation, idempotency_key LIMIT {}::int8", next()));
        sql
    }

    /// The index a listing of this shape uses.
    pub fn indexes(self) -> &'static [&'static str] {
        if self.state == Some(false) { &["idemgate_records_open"] } else { &["idemgate_records_recent"] }
    }
}

/// The resolution's row, locked.
pub(super) static RESOLVE_LOCK: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {COLUMNS}, now(), probe_token, cache_hold_until FROM idemgate_records WHERE {PK} FOR UPDATE"));

/// A completed record about to be resolved is first held out of the
/// replicas' replay caches (see `store::cache`): replicas that read it from
/// now on do not cache it, until `$5` microseconds from now.
pub(super) static RESOLVE_HOLD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET cache_hold_until = now() + $5::int8 * interval '1 microsecond' \
         WHERE {PK} AND CASE state WHEN 'completed' THEN true ELSE false END RETURNING cache_hold_until"
    )
});

/// An async operation released: it runs again, under a new generation (no
/// row: its stored request was dropped when it completed).
pub(super) static RESOLVE_REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'queued', generation = nextval('idemgate_generation'), lease_expires_at = NULL, \
         sent_at = NULL, next_attempt_at = now(), attempts = 0, maybe_executed = false, response_status = NULL, response_headers = NULL, \
         response_body = NULL, updated_at = now(), cache_hold_until = NULL WHERE {PK} AND request IS NOT NULL RETURNING generation"
    )
});

/// [`RESOLVE_REQUEUE`] on Citus: the new generation is `$5` (see [`CITUS_TAKE_OVER`]).
pub(super) static CITUS_RESOLVE_REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records r SET state = 'queued', generation = greatest($5::int8, r.generation + 1), lease_expires_at = NULL, \
         sent_at = NULL, next_attempt_at = now(), attempts = 0, maybe_executed = false, response_status = NULL, response_headers = NULL, \
         response_body = NULL, updated_at = now(), cache_hold_until = NULL WHERE {PK} AND request IS NOT NULL RETURNING r.generation"
    )
});

/// The records a log line's scope id names (`$1`), through the primary
/// key's first column.
pub(super) static BY_SCOPE_ID: LazyLock<String> = LazyLock::new(|| format!("SELECT {COLUMNS} FROM idemgate_records WHERE scope_id = $1"));

pub(super) static RESOLVE_DELETE: LazyLock<String> = LazyLock::new(|| format!("DELETE FROM idemgate_records WHERE {PK}"));

pub(super) static RESOLVE_COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'completed', generation = nextval('idemgate_generation'), response_status = $5, \
         response_headers = $6, response_body = $7, lease_expires_at = NULL, updated_at = now(), \
         expires_at = {EXPIRES_8}, cache_hold_until = NULL, request = NULL WHERE {PK} RETURNING generation"
    )
});

/// [`RESOLVE_COMPLETE`] on Citus: the new generation is `$9` (see
/// [`CITUS_TAKE_OVER`]), the expiry as in [`CITUS_COMPLETE`].
pub(super) static CITUS_RESOLVE_COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records r SET state = 'completed', generation = greatest($9::int8, r.generation + 1), response_status = $5, \
         response_headers = $6, response_body = $7, lease_expires_at = NULL, updated_at = now(), \
         expires_at = {}, cache_hold_until = NULL, request = NULL WHERE {PK} RETURNING r.generation",
        citus_expires(8)
    )
});

pub(super) const AUDIT_INSERT: &str = "INSERT INTO idemgate_audit \
     (actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, forced, generation, peer, token_label) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";

pub(super) static EVENT_INSERT_ONE: LazyLock<String> =
    LazyLock::new(|| format!("INSERT INTO idemgate_events {EVENT_INSERT} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"));

pub(super) const AUDIT_LIST: &str = "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, reason, \
     forced, generation, peer, token_label FROM idemgate_audit ORDER BY id DESC LIMIT $1";

/// The operator console's record page: the record, the store's clock, the
/// stored request and the probes of this generation.
pub(super) static INSPECT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS}, now(), request, CASE WHEN probe_generation = generation THEN probe_attempts ELSE 0 END, next_probe_at, \
         CASE WHEN probe_generation = generation THEN probe_last_answer END FROM idemgate_records WHERE {PK}"
    )
});

/// The audit rows of one scope, newest first (the console's record page).
pub(super) const AUDIT_OF_SCOPE: &str = "SELECT id, at, actor, tenant, principal, operation, idempotency_key, from_state, to_state, \
     reason, forced, generation, peer, token_label FROM idemgate_audit \
     WHERE tenant = $1 AND principal = $2 AND operation = $3 AND idempotency_key = $4 ORDER BY id DESC LIMIT $5";

pub(super) const SETTING: &str = "SELECT value FROM idemgate_settings WHERE name = $1";

/// The readiness write probe: `txid_current()` takes a transaction id, so
/// the statement's commit is written and flushed (the write path of every
/// claim, without a row), and the grants a claim needs are read.
pub(super) const PROBE_WRITE: &str = "SELECT txid_current(), \
     has_table_privilege('idemgate_records', 'INSERT') \
     AND has_table_privilege('idemgate_records', 'UPDATE') \
     AND has_table_privilege('idemgate_records', 'DELETE')";

pub(super) const SWEEP: &str = "\
WITH doomed AS (
    SELECT scope_id, tenant, principal, operation, idempotency_key FROM idemgate_records
    WHERE state IN ('completed', 'failed_retryable') AND expires_at <= now()
    ORDER BY expires_at LIMIT $1 FOR UPDATE SKIP LOCKED)
DELETE FROM idemgate_records r USING doomed d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key AND r.expires_at <= now()
  AND CASE r.state WHEN 'completed' THEN true WHEN 'failed_retryable' THEN true ELSE false END
RETURNING 1";

/// [`SWEEP`] on Citus, for one tenant (`$2`): `FOR UPDATE SKIP LOCKED` and a
/// `LIMIT` run on one shard only, so the sweeper goes tenant by tenant
/// ([`CITUS_TENANTS_TO_SWEEP`]), each statement a router query.
pub(super) static CITUS_SWEEP: LazyLock<String> = LazyLock::new(|| {
    citus_replace(
        SWEEP,
        &[
            (
                "    WHERE state IN ('completed', 'failed_retryable')",
                "    WHERE tenant = $2 AND state IN ('completed', 'failed_retryable')",
            ),
            ("WHERE r.scope_id = d.scope_id", "WHERE r.tenant = $2 AND r.scope_id = d.scope_id"),
        ],
    )
});

/// The tenants with records to sweep, the longest expired first (`$1` of
/// them): a read of every shard without locks (Citus groups by the
/// distribution column on each shard).
pub(super) const CITUS_TENANTS_TO_SWEEP: &str = "SELECT tenant FROM idemgate_records \
     WHERE state IN ('completed', 'failed_retryable') AND expires_at <= now() GROUP BY tenant ORDER BY min(expires_at) LIMIT $1";

/// record::transition's LeaseExpired, in SQL: sync attempts become unknown;
/// async ones go back to the queue when they never sent (no sent_at) or
/// their upstream deduplicates, else unknown.
///
/// The decision is made in the `UPDATE`, from `r`: the row `stale` locked, in
/// its latest committed version. Nothing may decide from a second read of
/// the table in this statement: that read sees the statement's starting
/// snapshot, which misses a `mark_sent` that committed between the start and
/// the lock, and re-queued an attempt already at the upstream (a second send).
/// `requeue` is told by the state the row was given.
pub(super) static REAP_LEASES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH stale AS (
    SELECT scope_id, tenant, principal, operation, idempotency_key FROM idemgate_records
    WHERE state IN ('in_flight', 'processing') AND (lease_expires_at IS NULL OR lease_expires_at <= now())
    ORDER BY lease_expires_at LIMIT $1 FOR UPDATE SKIP LOCKED
), upd AS (
UPDATE idemgate_records r SET
    state = CASE WHEN {REQUEUE_IF} THEN 'queued' ELSE 'unknown' END,
    lease_expires_at = CASE WHEN {REQUEUE_IF} THEN NULL ELSE r.lease_expires_at END,
    next_attempt_at = CASE WHEN {REQUEUE_IF} THEN now() ELSE r.next_attempt_at END,
    sent_at = CASE WHEN {REQUEUE_IF} THEN NULL ELSE r.sent_at END,
    -- Re-queued although it was sent: it may have executed.
    maybe_executed = r.maybe_executed OR ({REQUEUE_IF} AND r.sent_at IS NOT NULL),
    updated_at = now()
FROM stale d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key
  AND CASE r.state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END
  AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())
RETURNING r.state = 'queued' AS requeue, r.tenant, r.principal, r.operation, r.idempotency_key, r.generation, r.operation_id
), ev AS (
    INSERT INTO idemgate_events {EVENT_INSERT}
    SELECT 'unknown', tenant, principal, operation, idempotency_key, generation, NULL, operation_id, NULL, NULL
    FROM upd WHERE NOT requeue AND operation = ANY($3::text[])
)
SELECT requeue FROM upd"
    )
});

/// [`REAP_LEASES`] on Citus, for one tenant (`$4`, see [`CITUS_SWEEP`]); the
/// re-queue's due time is the locking read's `now()` (Citus refuses `now()`
/// inside a `CASE` of a distributed `UPDATE`).
pub(super) static CITUS_REAP_LEASES: LazyLock<String> = LazyLock::new(|| {
    citus_replace(
        &REAP_LEASES,
        &[
            (
                "SELECT scope_id, tenant, principal, operation, idempotency_key FROM idemgate_records\n    WHERE state IN ('in_flight', 'processing')",
                "SELECT scope_id, tenant, principal, operation, idempotency_key, now() AS now FROM idemgate_records\n    WHERE tenant = $4 AND state IN ('in_flight', 'processing')",
            ),
            ("THEN now() ELSE r.next_attempt_at END", "THEN d.now ELSE r.next_attempt_at END"),
            ("FROM stale d\nWHERE r.scope_id", "FROM stale d\nWHERE r.tenant = $4 AND r.scope_id"),
        ],
    )
});

/// The tenants with attempts whose lease ran out, the longest expired first (`$1` of them).
pub(super) const CITUS_TENANTS_TO_REAP: &str = "SELECT tenant FROM idemgate_records \
     WHERE state IN ('in_flight', 'processing') AND (lease_expires_at IS NULL OR lease_expires_at <= now()) \
     GROUP BY tenant ORDER BY min(lease_expires_at) NULLS FIRST LIMIT $1";

/// The reaper's re-queue rule on the row being updated (`r`, its values
/// before the update): an async attempt that never reached the upstream, or
/// one whose upstream deduplicates (`$2`, the re-forwardable operations).
const REQUEUE_IF: &str = "(r.state = 'processing' AND (r.sent_at IS NULL OR r.operation = ANY($2::text[])))";

/// A worker takes the oldest due operation of its routes: the row is locked
/// with `SKIP LOCKED` (a concurrent worker takes the next one), drawn a new
/// generation and token, and leased for its route's lease.
pub(super) static TAKE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[]) AS ro(operation, lease_us)
), expired AS (
    -- A take-over: an attempt whose lease ran out (its worker died or is
    -- frozen) and that may run again: it never sent, or its upstream
    -- deduplicates ($5). Sent attempts of other routes are the reaper's
    -- (they become unknown). The locking read rechecks all this on the
    -- latest row version.
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           (SELECT max(ro.lease_us) FROM routes ro WHERE ro.operation = r.operation) AS lease_us, true AS took_over
    FROM idemgate_records r
    WHERE r.state = 'processing' AND r.lease_expires_at <= now() AND r.operation = ANY($1::text[])
      AND (r.sent_at IS NULL OR r.operation = ANY($5::text[]))
    ORDER BY r.lease_expires_at
    LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
), due AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           (SELECT max(ro.lease_us) FROM routes ro WHERE ro.operation = r.operation) AS lease_us, false AS took_over
    FROM idemgate_records r
    WHERE r.state = 'queued' AND r.next_attempt_at <= now() AND r.operation = ANY($1::text[])
    ORDER BY r.next_attempt_at
    LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
), next AS (
    -- Take-overs first; `due` is not read (nor locked) when one is found.
    SELECT * FROM expired UNION ALL SELECT * FROM due LIMIT 1
)
-- The route's lease comes with the row found: joining the routes here would
-- let the planner look rows up by their operation alone.
UPDATE idemgate_records r SET
    state = 'processing', generation = nextval('idemgate_generation'), claim_token = $3, owner = $4,
    lease_expires_at = now() + n.lease_us * interval '1 microsecond', attempts = r.attempts + 1, sent_at = NULL,
    -- Taken over although it was sent: it may have executed.
    maybe_executed = r.maybe_executed OR (r.state = 'processing' AND r.sent_at IS NOT NULL),
    next_attempt_at = NULL, updated_at = now()
FROM next n
WHERE r.scope_id = n.scope_id AND r.tenant = n.tenant AND r.principal = n.principal AND r.operation = n.operation
  AND r.idempotency_key = n.idempotency_key
RETURNING {}, now(), r.request, n.took_over",
        prefixed(COLUMNS, "r.")
    )
});

/// [`TAKE`] on Citus, for one tenant (`$6`, see [`CITUS_SWEEP`]): the new
/// generation is `$7` (see [`CITUS_TAKE_OVER`]), the lease's end
/// computed by the locking reads (Citus refuses `now()` applied to a column
/// in a distributed `UPDATE`), and the row's `updated_at` where `TAKE`
/// returns `now()` (Citus refuses `now()` in a modification's `RETURNING`).
pub(super) static CITUS_TAKE: LazyLock<String> = LazyLock::new(|| {
    let lease = "(SELECT max(ro.lease_us) FROM routes ro WHERE ro.operation = r.operation)";
    format!(
        "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[]) AS ro(operation, lease_us)
), expired AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           now() + {lease} * interval '1 microsecond' AS lease_until, true AS took_over
    FROM idemgate_records r
    WHERE r.tenant = $6 AND r.state = 'processing' AND r.lease_expires_at <= now() AND r.operation = ANY($1::text[])
      AND (r.sent_at IS NULL OR r.operation = ANY($5::text[]))
    ORDER BY r.lease_expires_at
    LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
), due AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key,
           now() + {lease} * interval '1 microsecond' AS lease_until, false AS took_over
    FROM idemgate_records r
    WHERE r.tenant = $6 AND r.state = 'queued' AND r.next_attempt_at <= now() AND r.operation = ANY($1::text[])
    ORDER BY r.next_attempt_at
    LIMIT 1
    FOR UPDATE OF r SKIP LOCKED
), next AS (
    SELECT * FROM expired UNION ALL SELECT * FROM due LIMIT 1
)
UPDATE idemgate_records r SET
    state = 'processing', generation = greatest($7::int8, r.generation + 1), claim_token = $3, owner = $4,
    lease_expires_at = n.lease_until, attempts = r.attempts + 1, sent_at = NULL,
    maybe_executed = r.maybe_executed OR (r.state = 'processing' AND r.sent_at IS NOT NULL),
    next_attempt_at = NULL, updated_at = now()
FROM next n
WHERE r.tenant = $6 AND r.scope_id = n.scope_id AND r.tenant = n.tenant AND r.principal = n.principal AND r.operation = n.operation
  AND r.idempotency_key = n.idempotency_key
RETURNING {}, r.updated_at, r.request, n.took_over",
        prefixed(COLUMNS, "r.")
    )
});

/// The tenants with operations due for the workers (`$1` the routes'
/// operations, `$2` those that may run again after a lost lease), the
/// longest waiting first (`$3` of them).
pub(super) const CITUS_TENANTS_TO_TAKE: &str = "SELECT tenant FROM idemgate_records \
     WHERE operation = ANY($1::text[]) AND ((state = 'queued' AND next_attempt_at <= now()) \
        OR (state = 'processing' AND lease_expires_at <= now() AND (sent_at IS NULL OR operation = ANY($2::text[])))) \
     GROUP BY tenant ORDER BY min(CASE WHEN state = 'queued' THEN next_attempt_at ELSE lease_expires_at END) LIMIT $3";

pub(super) static HEARTBEAT: LazyLock<String> = LazyLock::new(|| {
    format!("UPDATE idemgate_records SET lease_expires_at = now() + $7::int8 * interval '1 microsecond' WHERE {PK} AND {FENCE} RETURNING 1")
});

pub(super) static MARK_SENT: LazyLock<String> = LazyLock::new(|| {
    format!("UPDATE idemgate_records SET sent_at = now() WHERE {PK} AND {FENCE} AND lease_expires_at > now() RETURNING 1")
});

pub(super) static REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET state = 'queued', lease_expires_at = NULL, sent_at = NULL, \
         next_attempt_at = now() + $7::int8 * interval '1 microsecond', last_status = $8, \
         maybe_executed = maybe_executed OR $9, updated_at = now() WHERE {PK} AND {FENCE} RETURNING 1"
    )
});

/// record::transition's Fail: never "failed_retryable" once an attempt may have run.
pub(super) static FAIL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH upd AS (UPDATE idemgate_records SET \
         state = CASE WHEN maybe_executed OR $9 THEN 'unknown' ELSE 'failed_retryable' END, \
         maybe_executed = maybe_executed OR $9, lease_expires_at = NULL, \
         expires_at = {EXPIRES_7}, last_status = $8, updated_at = now(), \
         request = CASE WHEN maybe_executed OR $9 THEN request END \
         WHERE {PK} AND {FENCE} \
         RETURNING tenant, principal, operation, idempotency_key, generation, state, last_status, operation_id), \
         ev AS (INSERT INTO idemgate_events {EVENT_INSERT} \
         SELECT state, tenant, principal, operation, idempotency_key, generation, last_status, operation_id, NULL, NULL FROM upd \
         WHERE (state = 'unknown' AND $10) OR (state = 'failed_retryable' AND $11)) \
         SELECT 1 FROM upd"
    )
});

/// [`FAIL`] on Citus (`$1`..`$9`): the `UPDATE` alone (see [`CITUS_COMPLETE`]),
/// the expiry as there.
pub(super) static CITUS_FAIL: LazyLock<String> = LazyLock::new(|| {
    citus_update_only(
        &FAIL.replace(EXPIRES_7, &citus_expires(7)),
        "tenant, principal, operation, idempotency_key, generation, last_status, operation_id, NULL::bytea, state",
    )
});

/// [`MARK_UNKNOWN`] on Citus (`$1`..`$7`): the `UPDATE` alone (see [`CITUS_COMPLETE`]).
pub(super) static CITUS_MARK_UNKNOWN: LazyLock<String> = LazyLock::new(|| {
    citus_update_only(
        &MARK_UNKNOWN,
        "tenant, principal, operation, idempotency_key, generation, NULL::int4, operation_id, NULL::bytea, state",
    )
});

pub(super) static OPERATION: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {COLUMNS}, now() FROM idemgate_records WHERE tenant = $1 AND operation_id = $2"));

pub(super) static TAKE_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH due AS (
            SELECT e.seq FROM idemgate_events e
            WHERE e.delivery = 'pending' AND e.next_attempt_at <= now() AND (e.lease_until IS NULL OR e.lease_until <= now())
              AND e.operation = ANY($1::text[])
              AND NOT EXISTS (SELECT 1 FROM idemgate_events p
                              WHERE p.delivery = 'pending' AND p.tenant = e.tenant AND p.principal = e.principal
                                AND p.operation = e.operation AND p.idempotency_key = e.idempotency_key AND p.seq < e.seq)
              -- A parked event holds the later ones of its scope (through the
              -- parked events' own index: there are few).
              AND NOT EXISTS (SELECT 1 FROM idemgate_events q
                              WHERE q.delivery = 'parked' AND q.seq < e.seq AND q.tenant = e.tenant AND q.principal = e.principal
                                AND q.operation = e.operation AND q.idempotency_key = e.idempotency_key)
            ORDER BY e.next_attempt_at LIMIT $2 FOR UPDATE SKIP LOCKED)
        UPDATE idemgate_events e SET lease_token = $3, lease_until = now() + $4::int8 * interval '1 microsecond'
        FROM due WHERE e.seq = due.seq
        RETURNING {}",
        prefixed(EVENT_COLUMNS, "e.")
    )
});

/// [`TAKE_EVENTS`] on Citus, for one tenant (`$5`, see [`CITUS_SWEEP`]). A
/// scope's events sit on its tenant's shard, so their order holds.
pub(super) static CITUS_TAKE_EVENTS: LazyLock<String> = LazyLock::new(|| {
    citus_replace(
        &TAKE_EVENTS,
        &[
            ("WHERE e.delivery = 'pending' AND e.next_attempt_at", "WHERE e.tenant = $5 AND e.delivery = 'pending' AND e.next_attempt_at"),
            ("FROM due WHERE e.seq = due.seq", "FROM due WHERE e.tenant = $5 AND e.seq = due.seq"),
        ],
    )
});

/// The tenants with deliverable events of these operations (`$1`), the
/// longest waiting first (`$2` of them).
pub(super) const CITUS_TENANTS_WITH_EVENTS: &str = "SELECT tenant FROM idemgate_events \
     WHERE delivery = 'pending' AND next_attempt_at <= now() AND (lease_until IS NULL OR lease_until <= now()) \
       AND operation = ANY($1::text[]) GROUP BY tenant ORDER BY min(next_attempt_at) LIMIT $2";

pub(super) const EVENTS_DELIVERED: &str = "UPDATE idemgate_events SET delivery = 'sent', sent_at = now(), lease_token = NULL, \
     lease_until = NULL WHERE seq = ANY($1::int8[]) AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END \
     RETURNING seq";

pub(super) const EVENT_FAILED: &str = "UPDATE idemgate_events SET attempts = attempts + 1, last_error = $3, \
     next_attempt_at = now() + $4::int8 * interval '1 microsecond', \
     delivery = CASE WHEN $5 THEN 'parked' ELSE 'pending' END, lease_token = NULL, lease_until = NULL \
     WHERE seq = $1 AND lease_token = $2 AND CASE delivery WHEN 'pending' THEN true ELSE false END RETURNING 1";

/// Events newest first, of one delivery state (`$1`) or all.
pub(super) static EVENTS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {EVENT_COLUMNS} FROM idemgate_events ORDER BY seq DESC LIMIT $1"));
pub(super) static EVENTS_BY_DELIVERY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {EVENT_COLUMNS} FROM idemgate_events \
         WHERE CASE delivery WHEN $1 THEN true ELSE false END ORDER BY seq DESC LIMIT $2"
    )
});

pub(super) const REDELIVER: &str = "UPDATE idemgate_events SET delivery = 'pending', attempts = 0, next_attempt_at = now(), \
     lease_token = NULL, lease_until = NULL, last_error = NULL, sent_at = NULL WHERE event_id = $1 RETURNING 1";

pub(super) const SWEEP_EVENTS: &str = "DELETE FROM idemgate_events WHERE seq IN (
        SELECT seq FROM idemgate_events
        WHERE delivery = 'sent' AND sent_at <= now() - $2::int8 * interval '1 microsecond'
        ORDER BY sent_at LIMIT $1)
    RETURNING 1";

/// Pending events through their index, parked ones through theirs.
pub(super) const EVENT_STATS: &str = "SELECT \
     (SELECT count(*) FROM idemgate_events WHERE delivery = 'pending'), \
     (SELECT count(*) FROM idemgate_events WHERE delivery = 'parked'), \
     (SELECT min(at) FROM idemgate_events WHERE delivery = 'pending'), \
     (SELECT count(*) FROM idemgate_events q JOIN idemgate_events e ON e.delivery = 'pending' AND e.tenant = q.tenant \
        AND e.principal = q.principal AND e.operation = q.operation AND e.idempotency_key = q.idempotency_key AND e.seq > q.seq \
      WHERE q.delivery = 'parked')";

/// Records not yet completed, through the partial index of open states.
pub(super) const STATS: &str = "SELECT operation, state, count(*), min(created_at), min(updated_at), min(lease_expires_at) FROM idemgate_records \
     WHERE state <> 'completed' GROUP BY operation, state";

/// The literal matches the partial index's predicate, so this counts over
/// that index alone.
pub(super) const FOREVER_COUNTS: &str = "SELECT operation, count(*) FROM idemgate_records WHERE expires_at = 'infinity' GROUP BY operation";

/// The reconciler takes due `unknown` records of its routes (each past its
/// route's settle time, its attempt no longer possibly at the upstream, not
/// in backoff, not marked by a live probe), marks
/// them with its token until the hold runs out, and gets them back with their
/// stored request and the inconclusive probes of this generation so far.
/// `SKIP LOCKED`: two replicas never take one record.
pub(super) static TAKE_PROBES: LazyLock<String> = LazyLock::new(|| {
    format!(
        "\
WITH routes AS (
    SELECT * FROM unnest($1::text[], $2::int8[], $6::int8[]) AS ro(operation, settle_us, at_upstream_us)
), due AS (
    SELECT r.scope_id, r.tenant, r.principal, r.operation, r.idempotency_key
    FROM idemgate_records r JOIN routes ro ON ro.operation = r.operation
    WHERE r.state = 'unknown'
      AND r.updated_at <= now() - ro.settle_us * interval '1 microsecond'
      -- The attempt was sent (async: sent_at; sync: claimed, created_at) at
      -- least the upstream's timeout plus settle ago: it cannot be running.
      AND coalesce(r.sent_at, r.created_at) <= now() - (ro.at_upstream_us + ro.settle_us) * interval '1 microsecond'
      AND (r.probe_generation IS DISTINCT FROM r.generation
           OR ((r.next_probe_at IS NULL OR r.next_probe_at <= now()) AND (r.probe_until IS NULL OR r.probe_until <= now())))
    -- Oldest first, sorted after the open states' index found them (no index
    -- provides this key, so none competes with that one).
    ORDER BY r.updated_at + interval '0 seconds'
    LIMIT $5
    FOR UPDATE OF r SKIP LOCKED
)
UPDATE idemgate_records r SET
    probe_attempts = CASE WHEN r.probe_generation = r.generation THEN r.probe_attempts ELSE 0 END,
    probe_generation = r.generation, next_probe_at = NULL,
    probe_token = $3, probe_until = now() + $4::int8 * interval '1 microsecond'
FROM due d
WHERE r.scope_id = d.scope_id AND r.tenant = d.tenant AND r.principal = d.principal AND r.operation = d.operation
  AND r.idempotency_key = d.idempotency_key
  AND CASE r.state WHEN 'unknown' THEN true ELSE false END
RETURNING {}, now(), r.request, r.probe_attempts",
        prefixed(COLUMNS, "r.")
    )
});

/// [`TAKE_PROBES`] on Citus, for one tenant (`$7`, see [`CITUS_SWEEP`]),
/// returning the row's `updated_at` where it returns `now()` (see [`CITUS_TAKE`]).
pub(super) static CITUS_TAKE_PROBES: LazyLock<String> = LazyLock::new(|| {
    citus_replace(
        &TAKE_PROBES,
        &[
            ("    WHERE r.state = 'unknown'\n", "    WHERE r.tenant = $7 AND r.state = 'unknown'\n"),
            ("FROM due d\nWHERE r.scope_id", "FROM due d\nWHERE r.tenant = $7 AND r.scope_id"),
            (", now(), r.request, r.probe_attempts", ", r.updated_at, r.request, r.probe_attempts"),
        ],
    )
});

/// The tenants with `unknown` records of these operations (`$1`) that no
/// live probe holds, the longest unknown first (`$2` of them).
pub(super) const CITUS_TENANTS_TO_PROBE: &str = "SELECT tenant FROM idemgate_records \
     WHERE state = 'unknown' AND operation = ANY($1::text[]) AND (probe_until IS NULL OR probe_until <= now()) \
     GROUP BY tenant ORDER BY min(updated_at) LIMIT $2";

pub(super) static PROBE_FAILED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records SET probe_attempts = probe_attempts + 1, \
         next_probe_at = now() + $7::int8 * interval '1 microsecond', probe_token = NULL, probe_until = NULL, probe_last_answer = $8 \
         WHERE {PK} AND CASE state WHEN 'unknown' THEN true ELSE false END AND generation = $5 AND probe_token = $6 RETURNING 1"
    )
});

/// `a, b` with `prefix` before each column: `r.a, r.b`.
fn prefixed(columns: &str, prefix: &str) -> String {
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

/// [`catalog`] as a store of `flavor` sends it: on Citus, the statements of
/// another shape in place of the PostgreSQL ones (see `citus`).
pub fn catalog_for(flavor: super::Flavor) -> Vec<Statement> {
    let mut all = catalog();
    if flavor == super::Flavor::Citus {
        // Claims and result writes are not batched across scopes on Citus
        // (a batch's arrays name tenants Citus cannot route by): the claim
        // is `CITUS_CLAIM_READ`, `CITUS_CLAIM_INSERT`, `CITUS_TAKE_OVER`.
        all.retain(|s| !matches!(s.name.as_str(), "claim" | "claim_batch" | "complete_batch" | "write_batch"));
        for s in &mut all {
            if let Some(sql) = citus_statement(&s.name) {
                s.sql = sql.to_owned();
            }
        }
        let pkey: &'static [&'static str] = PKEY;
        for (name, sql) in
            [("claim_read", &*CITUS_CLAIM_READ), ("claim_insert", &*CITUS_CLAIM_INSERT), ("claim_take_over", &*CITUS_TAKE_OVER)]
        {
            all.push(Statement { name: name.to_owned(), sql: sql.clone(), indexes: pkey });
        }
        for s in &mut all {
            s.sql = for_citus(&s.sql).to_owned();
        }
    }
    all
}

/// The Citus statement that replaces the catalog's statement `name`, if any.
fn citus_statement(name: &str) -> Option<&'static str> {
    Some(match name {
        "complete" => &CITUS_COMPLETE,
        "resolve_complete" => &CITUS_RESOLVE_COMPLETE,
        "resolve_requeue" => &CITUS_RESOLVE_REQUEUE,
        "fail" => &CITUS_FAIL,
        "mark_unknown" => &CITUS_MARK_UNKNOWN,
        _ => return None,
    })
}

/// The `UPDATE` inside `WITH upd AS (UPDATE ... RETURNING ...), ev AS ...`,
/// returning `returning` instead.
fn citus_update_only(sql: &str, returning: &str) -> String {
    let start = sql.find("WITH upd AS (").map_or(0, |i| i + "WITH upd AS (".len());
    let end = sql[start..].find(" RETURNING ").map_or(sql.len(), |i| start + i);
    format!("{} RETURNING {returning}", &sql[start..end])
}

/// `sql` with each `(from, to)` replaced once. A `from` that is missing is a
/// bug in these texts; `tests::citus_variants_differ_where_they_must` catches it.
fn citus_replace(sql: &str, edits: &[(&str, &str)]) -> String {
    edits.iter().fold(sql.to_owned(), |text, (from, to)| text.replacen(from, to, 1))
}

/// A statement as a Citus store sends it: every simple `CASE col WHEN 'a'
/// THEN true ... ELSE false END` test (the PostgreSQL statements' way of
/// keeping a partial index out of a plan, see the module documentation)
/// written as `col IN ('a', ...)`. Citus mis-deparses the simple `CASE`
/// form in a modification it sends to a shard (its tested value becomes
/// `NULL::boolean`: "operator does not exist: text = boolean"); on a shard
/// the primary key serves these statements anyway. Memoized: the store's
/// statements are a fixed set.
pub fn for_citus(sql: &str) -> &'static str {
    static DONE: LazyLock<std::sync::Mutex<std::collections::HashMap<String, &'static str>>> = LazyLock::new(Default::default);
    let mut done = DONE.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(text) = done.get(sql) {
        return text;
    }
    let text: &'static str = Box::leak(rewrite_simple_cases(sql).into_boxed_str());
    done.insert(sql.to_owned(), text);
    text
}

/// See [`for_citus`]: `CASE x WHEN 'a' THEN true WHEN 'b' THEN true ELSE
/// false END` becomes `x IN ('a', 'b')`; any other `CASE` stays.
fn rewrite_simple_cases(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some(at) = rest.find("CASE ") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 5..];
        match simple_case(after) {
            Some((column, values, used)) => {
                out.push_str(&format!("{column} IN ({})", values.join(", ")));
                rest = &after[used..];
            }
            None => {
                out.push_str("CASE ");
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

/// `x WHEN 'a' THEN true ... ELSE false END` at the start of `s`: the
/// column, the quoted values, and how many bytes that took.
fn simple_case(s: &str) -> Option<(&str, Vec<&str>, usize)> {
    let column_end = s.find(' ')?;
    let column = &s[..column_end];
    if column.is_empty() || !column.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.') {
        return None;
    }
    let mut pos = column_end + 1;
    let mut values = Vec::new();
    loop {
        let tail = &s[pos..];
        if let Some(t) = tail.strip_prefix("ELSE false END") {
            let _ = t;
            return (!values.is_empty()).then_some((column, values, pos + "ELSE false END".len()));
        }
        let t = tail.strip_prefix("WHEN '")?;
        let close = t.find('\'')?;
        let value = &tail[5..5 + close + 2];
        let t = t[close + 1..].strip_prefix(" THEN true ")?;
        values.push(value);
        pos = s.len() - t.len();
    }
}

#[cfg(test)]
mod citus_tests {
    use super::*;

    #[test]
    fn simple_state_tests_become_in_lists_for_citus() {
        assert_eq!(
            rewrite_simple_cases("a AND CASE r.state WHEN 'in_flight' THEN true WHEN 'processing' THEN true ELSE false END RETURNING 1"),
            "a AND r.state IN ('in_flight', 'processing') RETURNING 1"
        );
        assert_eq!(rewrite_simple_cases("CASE delivery WHEN 'pending' THEN true ELSE false END"), "delivery IN ('pending')");
        // Anything else stays as it is.
        for kept in [
            "CASE WHEN $10::text IS NULL THEN 'in_flight' ELSE 'queued' END",
            "CASE delivery WHEN $1 THEN true ELSE false END",
            "CASE r.state WHEN 'completed' THEN r.expires_at <= now() ELSE false END",
        ] {
            assert_eq!(rewrite_simple_cases(kept), kept);
        }
        assert!(std::ptr::eq(for_citus("CASE x WHEN 'a' THEN true ELSE false END"), for_citus("CASE x WHEN 'a' THEN true ELSE false END")));
    }

    #[test]
    fn citus_variants_differ_where_they_must() {
        let tenant_filters = [
            (&*CITUS_SWEEP, "tenant = $2", 2),
            (&*CITUS_REAP_LEASES, "tenant = $4", 2),
            (&*CITUS_TAKE, "tenant = $6", 3),
            (&*CITUS_TAKE_EVENTS, "tenant = $5", 2),
            (&*CITUS_TAKE_PROBES, "tenant = $7", 2),
        ];
        for (sql, filter, n) in tenant_filters {
            assert_eq!(sql.matches(filter).count(), n, "{sql}");
        }
        assert!(CITUS_REAP_LEASES.contains("THEN d.now ELSE"));
        assert!(CITUS_TAKE_PROBES.contains(", r.updated_at, r.request, r.probe_attempts"));
        for sql in [&*CITUS_COMPLETE, &*CITUS_FAIL, &*CITUS_RESOLVE_COMPLETE] {
            assert!(sql.contains("greatest(now()") && !sql.contains("coalesce(now()"), "{sql}");
        }
        for (sql, p) in [(&*CITUS_TAKE, 7), (&*CITUS_TAKE_OVER, 13), (&*CITUS_RESOLVE_COMPLETE, 9), (&*CITUS_RESOLVE_REQUEUE, 5)] {
            assert!(sql.contains(&format!("greatest(${p}::int8, r.generation + 1)")) && !sql.contains("nextval"), "{sql}");
        }
        for sql in [&*CITUS_COMPLETE, &*CITUS_MARK_UNKNOWN, &*CITUS_FAIL] {
            assert!(
                sql.starts_with("UPDATE idemgate_records SET") && !sql.contains("idemgate_events") && sql.ends_with(", state"),
                "{sql}"
            );
        }
    }
}
