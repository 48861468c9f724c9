//! The statements a Citus coordinator gets where PostgreSQL's cannot be
//! router queries on one shard, or where Citus refuses what PostgreSQL
//! accepts (see `citus.rs` and docs/scaling.md): each is PostgreSQL's
//! statement of the same name, changed as its comment says. [`for_citus`]
//! gives the text a Citus session sends for any statement;
//! [`catalog_for`] lists the statements of either flavor for the plan tests.

use std::sync::LazyLock;

use super::catalog::{PKEY, Statement, catalog};
use super::events::*;
use super::queue::*;
use super::reconcile::*;
use super::records::*;
use super::sql::*;

/// [`EXPIRES_7`]-style expiry from `$n` for Citus, which refuses `now()`
/// inside `coalesce` (or `CASE`) in a distributed `UPDATE`: `greatest`
/// ignores the NULL of a forever retention and of the parameter-only `CASE`.
fn citus_expires(n: usize) -> String {
    format!("greatest(now() + ${n}::int8 * interval '1 microsecond', CASE WHEN ${n}::int8 IS NULL THEN 'infinity'::timestamptz END)")
}

/// Citus's claim: the take-over branch of [`CLAIM`] needs a new generation,
/// and Citus refuses a volatile function (`nextval`) in a distributed
/// `UPDATE` and a stable one (`now()`) inside `CASE` in one; its data-modifying
/// CTEs are planned step by step. So on Citus a claim is up to three router
/// statements on the scope's shard, each naming its tenant as a constant
/// ([`for_tenant`]): the read ([`TENANT_CLAIM_READ`], from this text; a
/// replay ends here), the insert ([`tenant_claim_insert`], after its
/// generation is drawn from the tenant's counter in the same transaction; a
/// first write ends here), and, for a record that `record::may_take_over`
/// allows, the take-over ([`TENANT_TAKE_OVER`]), which re-checks that
/// condition on the latest row version. A lost insert is
/// `RawClaim::Conflict`, as with the batch (the facade reads the winner).
/// Where `CITUS_CLAIM_READ` and `TENANT_CLAIM_READ_BATCH` return whether
/// the row seen may be cached: after the record's columns and the clock
/// ([`NOW`]).
pub(super) const SEEN_CACHEABLE: usize = NOW + 1;

pub(super) static CITUS_CLAIM_READ: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {RECORD_COLUMNS}, now(), NOT coalesce(cache_hold_until > now(), false) FROM idemgate_records WHERE {PK}")
});

/// See [`CITUS_CLAIM_READ`]. `$9`: the key the claim may re-forward under
/// (`record::may_take_over`), `$14`: the one it keeps, `$15` the digest of
/// its fingerprint settings. The new generation is `$13`, drawn before from
/// the tenant's counter ([`CITUS_GENERATIONS`]; Citus refuses a volatile
/// function in a distributed `UPDATE`, and a `SELECT` CTE drawing it would
/// be a subplan whose result Citus may send to every node); it never goes
/// below the record's own (`greatest`), whatever the counter does.
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
    sent_at = NULL, last_status = NULL, maybe_executed = false, key_source = $12,
    reforward_key = $14::text || ':' || $6::uuid::text, fingerprint_spec = $15::text || ':' || $6::uuid::text
WHERE {PK}
  AND ((r.state IN ('completed', 'failed_retryable') AND r.expires_at <= now())
       OR (r.state = 'unknown' AND r.reforward_key = $9::text || ':' || r.claim_token::text AND r.request_hash = $5 AND r.operation_id IS NULL)
       OR (r.state = 'in_flight' AND r.reforward_key = $9::text || ':' || r.claim_token::text AND r.request_hash = $5 AND (r.lease_expires_at IS NULL OR r.lease_expires_at <= now())))
RETURNING r.generation, r.lease_expires_at, r.updated_at"
    )
});

/// Where a per-tenant statement names its tenant: replaced by the tenant as
/// a SQL literal ([`for_tenant`]).
const TENANT: &str = "{tenant}";

/// The primary key of a per-tenant statement: `$1` is the scope id the
/// gateway computed (`Scope::scope_id`, the same function as
/// `idemgate_scope_id`), `$2`..`$4` as in [`PK`].
const PK_OF_TENANT: &str = "tenant = {tenant} AND scope_id = $1::int8 AND idempotency_key = $4 AND principal = $2 AND operation = $3";

/// `sql` (a Citus statement whose primary key is [`PK`]) as a per-tenant
/// template: the tenant a literal, `$1` the scope id (see [`for_tenant`]).
fn tenant_template(sql: &str) -> String {
    let text = for_citus(sql);
    assert!(text.contains(PK), "no primary key to name the tenant in: {text}");
    text.replace(PK, PK_OF_TENANT)
}

/// `template` for `tenant`. On Citus the cheapest statement names its tenant
/// as a constant (docs/performance-notes.md, "Citus: what a statement costs"):
/// with a parameter, Citus prunes shards at each execution, deparses the
/// statement for the shard and plans it again; with a constant, the node
/// that holds the shard plans the shard's statement once per connection
/// (a generic plan) and runs that plan. The literal is quoted as
/// `quote_literal` does with `standard_conforming_strings = on` (a Citus
/// session sets it): quotes doubled, and a string holding a backslash
/// written `E'...'` with backslashes doubled.
pub fn for_tenant(template: &str, tenant: &str) -> String {
    template.replace(TENANT, &literal(tenant))
}

/// `s` as a SQL string literal (see [`for_tenant`]).
pub(super) fn literal(s: &str) -> String {
    let quoted = s.replace('\'', "''");
    if quoted.contains('\\') { format!("E'{}'", quoted.replace('\\', "\\\\")) } else { format!("'{quoted}'") }
}

/// [`CITUS_CLAIM_READ`] for one tenant ([`for_tenant`]; `$1` the scope id).
pub(super) static TENANT_CLAIM_READ: LazyLock<String> = LazyLock::new(|| tenant_template(&CITUS_CLAIM_READ));

/// [`CITUS_CLAIM_READ`] for several claims of one tenant: `$1` their scope
/// ids, `$2` their keys; the caller matches rows to claims by their whole scope.
pub(super) static TENANT_CLAIM_READ_BATCH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS}, now(), NOT coalesce(cache_hold_until > now(), false) FROM idemgate_records \
         WHERE tenant = {TENANT} AND scope_id = ANY($1::int8[]) AND idempotency_key = ANY($2::text[])"
    )
});

/// [`CITUS_TAKE_OVER`] for one tenant ([`for_tenant`]; `$1` the scope id).
pub(super) static TENANT_TAKE_OVER: LazyLock<String> = LazyLock::new(|| tenant_template(&CITUS_TAKE_OVER));

/// [`CITUS_COMPLETE`] for one tenant ([`for_tenant`]; `$1` the scope id).
pub(super) static TENANT_COMPLETE: LazyLock<String> = LazyLock::new(|| tenant_template(&CITUS_COMPLETE));

/// Draws `$1` generations for one tenant: its counter (migration
/// `citus_0002`) raised by `$1` on the tenant's shard; the new value is the
/// last one drawn. No row for a new tenant: [`TENANT_GENERATIONS_START`],
/// then this again.
pub(super) const TENANT_GENERATIONS: &str =
    "UPDATE idemgate_generations SET generation = generation + $1::int8 WHERE tenant = {tenant} RETURNING generation";

/// A new tenant's counter, at the floor (`$1`, the old sequence's last value,
/// `idemgate_settings.citus_generation_floor`); a concurrent start wins.
pub(super) const TENANT_GENERATIONS_START: &str =
    "INSERT INTO idemgate_generations (tenant, generation) VALUES ({tenant}, $1::int8) ON CONFLICT (tenant) DO NOTHING";

/// Draws `$2` generations for tenant `$1` on its shard, creating its counter
/// at the floor `$3` if there is none: for the statements that send the
/// tenant as a parameter (take-overs, takes, resolutions). Returns the last
/// value drawn.
pub(super) const CITUS_GENERATIONS: &str = "INSERT INTO idemgate_generations AS g (tenant, generation) VALUES ($1::text, $3::int8 + $2::int8) \
     ON CONFLICT (tenant) DO UPDATE SET generation = g.generation + $2::int8 RETURNING g.generation";

/// Parameters per row of [`tenant_claim_insert`].
pub(super) const PER_ROW: usize = 14;

/// The claims' `INSERT` of `n` rows of one tenant ([`for_tenant`]): one
/// multi-row `INSERT`, which Citus routes to the tenant's shard. Fourteen
/// parameters per row: principal, operation, key, request hash, claim
/// token, owner, lease (us), operation id, request, key source, scope id
/// (the gateway's, `Scope::scope_id`), generation (drawn before, in the
/// same transaction, from the tenant's counter), the key it may be
/// re-forwarded under, the digest of its fingerprint settings. Returns the claim token of
/// each row inserted, its generation, lease end and `updated_at`. The
/// caller sends the rows in primary-key order, so that two batches never
/// wait on each other in a cycle. Sent unnamed (`query_typed`): Citus
/// prunes an `INSERT` at each execution, and a prepared one it keeps would
/// add a plan to its cache at every execution (docs/performance-notes.md).
pub(super) fn tenant_claim_insert(n: usize) -> String {
    let rows: Vec<String> = (0..n)
        .map(|k| {
            let p = |i: usize| format!("${}", PER_ROW * k + i);
            let (op_id, lease, tok) = (p(8), p(7), p(5));
            format!(
                "({TENANT}, {}::text, {}::text, {}::text, {}::bytea, CASE WHEN {op_id}::text IS NULL THEN 'in_flight' ELSE 'queued' END, \
                 {}::int8, {}::uuid, {}::text, \
                 now() + (CASE WHEN {op_id}::text IS NULL THEN {lease}::int8 END) * interval '1 microsecond', now(), now(), \
                 now() + {lease}::int8 * interval '1 microsecond', {op_id}::text, {}::bytea, \
                 now() + (CASE WHEN {op_id}::text IS NOT NULL THEN 0 END) * interval '1 microsecond', {}::text, {}::int8, \
                 {}::text || ':' || {tok}::uuid::text, {}::text || ':' || {tok}::uuid::text)",
                p(1),
                p(2),
                p(3),
                p(4),
                p(12),
                p(5),
                p(6),
                p(9),
                p(10),
                p(11),
                p(13),
                p(14),
            )
        })
        .collect();
    format!(
        "INSERT INTO idemgate_records
        (tenant, principal, operation, idempotency_key, request_hash, state, generation, claim_token, owner,
         lease_expires_at, created_at, updated_at, expires_at, operation_id, request, next_attempt_at, key_source, scope_id, reforward_key, fingerprint_spec)
     VALUES {}
     ON CONFLICT ON CONSTRAINT idemgate_records_pkey DO NOTHING
     RETURNING claim_token, generation, lease_expires_at, updated_at",
        rows.join(",\n            ")
    )
}

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

/// [`RESOLVE_REQUEUE`] on Citus: the new generation is `$5` (see [`CITUS_TAKE_OVER`]).
pub(super) static CITUS_RESOLVE_REQUEUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemgate_records r SET state = 'queued', generation = greatest($5::int8, r.generation + 1), lease_expires_at = NULL, \
         sent_at = NULL, next_attempt_at = now(), attempts = 0, maybe_executed = false, response_status = NULL, response_headers = NULL, \
         response_body = NULL, updated_at = now(), cache_hold_until = NULL WHERE {PK} AND request IS NOT NULL RETURNING r.generation"
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

/// [`REAP_LEASES`] on Citus, for one tenant (`$4`, see [`CITUS_SWEEP`]); the
/// re-queue's due time is the locking read's `now()` (Citus refuses `now()`
/// inside a `CASE` of a distributed `UPDATE`). Without the events' insert:
/// an `INSERT ... SELECT` from a modifying CTE runs through the coordinator,
/// which sends the CTE's rows to every node, so one worker down failed the
/// reaper for every tenant. It returns the rows ended and whether each
/// writes an `unknown` event (of the operations `$3`); the reaper inserts
/// those events in the same transaction, on the tenant's shard.
pub(super) static CITUS_REAP_LEASES: LazyLock<String> = LazyLock::new(|| {
    let ev_start = REAP_LEASES.find("), ev AS (").unwrap_or(REAP_LEASES.len());
    let without_events = format!(
        "{})\nSELECT requeue, tenant, principal, operation, idempotency_key, generation, operation_id, \
         NOT requeue AND operation = ANY($3::text[]) AS emit FROM upd",
        &REAP_LEASES[..ev_start]
    );
    citus_replace(
        &without_events,
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
      AND ((r.sent_at IS NULL AND NOT r.maybe_executed) OR r.operation = ANY($5::text[]))
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
        prefixed(RECORD_COLUMNS, "r.")
    )
});

/// The tenants with operations due for the workers (`$1` the routes'
/// operations, `$2` those that may run again after a lost lease), the
/// longest waiting first (`$3` of them).
pub(super) const CITUS_TENANTS_TO_TAKE: &str = "SELECT tenant FROM idemgate_records \
     WHERE operation = ANY($1::text[]) AND ((state = 'queued' AND next_attempt_at <= now()) \
        OR (state = 'processing' AND lease_expires_at <= now() AND ((sent_at IS NULL AND NOT maybe_executed) OR operation = ANY($2::text[])))) \
     GROUP BY tenant ORDER BY min(CASE WHEN state = 'queued' THEN next_attempt_at ELSE lease_expires_at END) LIMIT $3";

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

/// [`TAKE_EVENTS`] on Citus, for one tenant (`$5`, see [`CITUS_SWEEP`]). A
/// scope's events sit on its tenant's shard, and are held back in the order
/// of their generations ([`not_held_back_by_generation`]).
pub(super) static CITUS_TAKE_EVENTS: LazyLock<String> = LazyLock::new(|| {
    let (by_seq, by_generation) = (not_held_back("e"), not_held_back_by_generation("e"));
    citus_replace(
        &TAKE_EVENTS,
        &[
            (&by_seq, &by_generation),
            ("WHERE e.delivery = 'pending' AND e.next_attempt_at", "WHERE e.tenant = $5 AND e.delivery = 'pending' AND e.next_attempt_at"),
            ("FROM due WHERE e.seq = due.seq", "FROM due WHERE e.tenant = $5 AND e.seq = due.seq"),
            // The order checks name the shard too: a subquery correlated only
            // through `e.tenant` makes the statement a multi-shard one, which
            // refuses FOR UPDATE.
            ("p.tenant = e.tenant", "p.tenant = $5"),
            ("q.tenant = e.tenant", "q.tenant = $5"),
        ],
    )
});

/// The tenants with deliverable events of these operations (`$1`), the
/// longest waiting first (`$2` of them): due, unleased, and held back by no
/// earlier pending or parked event of their scope (the relay's take's own
/// test). A pending event behind a parked one keeps its old due time: a list
/// that counted it would put its tenant first in every round.
pub(super) static CITUS_TENANTS_WITH_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT e.tenant FROM idemgate_events e \
         WHERE e.delivery = 'pending' AND e.next_attempt_at <= now() AND (e.lease_until IS NULL OR e.lease_until <= now()) \
           AND e.operation = ANY($1::text[]) AND {} \
         GROUP BY e.tenant ORDER BY min(e.next_attempt_at) LIMIT $2",
        not_held_back_by_generation("e")
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

/// The tenants with `unknown` records due for a probe (of the routes `$1`
/// with their settle `$2` and timeout `$3`, by the probe take's own test,
/// [`PROBE_DUE`]: settled, not backing off, not held by a live probe), the
/// longest unknown first (`$4` of them). Records that cannot be probed now
/// must not fill the list: a tenant whose records all back off after
/// inconclusive probes would come first in every round.
pub(super) static CITUS_TENANTS_TO_PROBE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH routes AS (SELECT * FROM unnest($1::text[], $2::int8[], $3::int8[]) AS ro(operation, settle_us, at_upstream_us)) \
         SELECT r.tenant FROM idemgate_records r JOIN routes ro ON ro.operation = r.operation \
         WHERE {} GROUP BY r.tenant ORDER BY min(r.updated_at) LIMIT $4",
        &*PROBE_DUE
    )
});

/// A tenant list read node by node, for when one read of every shard fails
/// (a worker down): `$2`, a list's text as [`by_node`] writes it, run on
/// each node over the union of that node's shards of table `$1`, with the
/// list's parameters `$3` (as text) in place of its own; each node answers
/// on its own connection (`master_run_on_worker`), and a node that cannot be
/// reached answers `success = false` without failing the others. Returns
/// each node's answer: a JSON array of tenants, in the list's order.
pub(super) const CITUS_TENANTS_BY_NODE: &str = "\
WITH placements AS (
    SELECT n.nodename, n.nodeport, shard_name($1::text::regclass, s.shardid) AS shard
    FROM pg_dist_shard s
    JOIN pg_dist_placement pl ON pl.shardid = s.shardid
    JOIN pg_dist_node n ON n.groupid = pl.groupid AND n.noderole = 'primary' AND n.isactive
    WHERE s.logicalrelid = $1::text::regclass
), nodes AS (
    SELECT nodename, nodeport,
           format($2::text, VARIADIC ARRAY[string_agg(format('SELECT * FROM %s', shard), ' UNION ALL ')] || $3::text[]) AS command
    FROM placements GROUP BY nodename, nodeport
)
SELECT r.node_name, r.node_port, r.success, r.result
FROM master_run_on_worker(
    ARRAY(SELECT nodename FROM nodes ORDER BY nodename, nodeport),
    ARRAY(SELECT nodeport FROM nodes ORDER BY nodename, nodeport),
    ARRAY(SELECT command FROM nodes ORDER BY nodename, nodeport),
    true) r";

/// A tenant list (one of the `CITUS_TENANTS_*` texts, reading `table`) as a
/// template for [`CITUS_TENANTS_BY_NODE`]: every `FROM table` reads the
/// node's shards (`%1$s`), each parameter `$n` becomes the literal `%{n+1}$L`,
/// and the answer is one JSON array of the listed tenants.
pub(super) fn by_node(list: &str, table: &str) -> String {
    let from = format!("FROM {table} ");
    let mut text = String::with_capacity(list.len() + 64);
    let mut rest = list;
    while let Some(at) = rest.find(&from) {
        text.push_str(&rest[..at]);
        let after = &rest[at + from.len()..];
        let next = after.split_whitespace().next().unwrap_or("");
        if ["WHERE", "GROUP", "JOIN", "ORDER", "LIMIT"].contains(&next) {
            text.push_str(&format!("FROM (%1$s) AS {table} "));
        } else {
            text.push_str("FROM (%1$s) AS ");
        }
        rest = after;
    }
    text.push_str(rest);
    for n in (1..=9).rev() {
        text = text.replace(&format!("${n}"), &format!("%{}$L", n + 1));
    }
    format!("SELECT coalesce(json_agg(l.tenant), '[]')::text FROM ({text}) l")
}

/// [`catalog`] as a store of `flavor` sends it: on Citus, the statements of
/// another shape in place of the PostgreSQL ones (see `citus`).
pub fn catalog_for(flavor: super::Flavor) -> Vec<Statement> {
    let mut all = catalog();
    if flavor == super::Flavor::Citus {
        // Claims and result writes are not batched across tenants on Citus
        // (a batch's arrays name tenants Citus cannot route by): the claim
        // is a read, an insert or a take-over of one tenant, or a tenant's
        // batch of reads or inserts (`citus_batch`).
        // Nor are the sends of async attempts (single-row `mark_sent`), and
        // Citus plans each execution, so nothing looks at `pg_class` for
        // stale plans (`replan`).
        // A coordinator keeps every event in `idemgate_events` (no log).
        all.retain(|s| {
            !matches!(
                s.name.as_str(),
                "claim"
                    | "claim_batch"
                    | "complete_batch"
                    | "write_batch"
                    | "mark_sent_batch"
                    | "table_look"
                    | "log_insert"
                    | "take_log"
                    | "lease_lanes"
                    | "settle"
                    | "log_events"
                    | "log_pending"
                    | "log_sent"
                    | "log_stats"
                    | "log_redeliver"
                    | "rotate"
            )
        });
        for s in &mut all {
            if let Some(sql) = citus_statement(&s.name) {
                s.sql = sql.to_owned();
            }
        }
        let pkey: &'static [&'static str] = PKEY;
        // The request path's statements name their tenant (`for_tenant`):
        // here the tenant `acme`.
        let acme = |template: &str| for_tenant(template, "acme");
        for (name, sql) in [
            ("claim_read", acme(&TENANT_CLAIM_READ)),
            ("claim_read_batch", acme(&TENANT_CLAIM_READ_BATCH)),
            ("claim_insert", acme(&tenant_claim_insert(1))),
            ("claim_insert_batch", acme(&tenant_claim_insert(3))),
            ("claim_take_over", acme(&TENANT_TAKE_OVER)),
            ("complete_of_tenant", acme(&TENANT_COMPLETE)),
            ("generations_of_tenant", acme(TENANT_GENERATIONS)),
            ("generations_start", acme(TENANT_GENERATIONS_START)),
            ("generations", CITUS_GENERATIONS.to_owned()),
        ] {
            all.push(Statement { name: name.to_owned(), sql, indexes: pkey });
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
            // The take, its update and its two order checks.
            (&*CITUS_TAKE_EVENTS, "tenant = $5", 4),
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
        // The reaper writes its events itself (no INSERT ... SELECT through the coordinator).
        assert!(
            !CITUS_REAP_LEASES.contains("idemgate_events") && CITUS_REAP_LEASES.ends_with("AS emit FROM upd"),
            "{}",
            *CITUS_REAP_LEASES
        );
    }

    /// The tenant lists apply the per-tenant takes' own tests.
    #[test]
    fn tenant_lists_apply_what_the_takes_apply() {
        assert!(CITUS_TENANTS_TO_PROBE.contains(&*PROBE_DUE) && CITUS_TAKE_PROBES.contains(&*PROBE_DUE));
        let held_back = not_held_back_by_generation("e");
        assert!(CITUS_TENANTS_WITH_EVENTS.contains(&held_back) && CITUS_TAKE_EVENTS.contains("q.tenant = $5"));
        // The take's test, with the shard named (see CITUS_TAKE_EVENTS).
        let on_shard = held_back.replacen("p.tenant = e.tenant", "p.tenant = $5", 1).replacen("q.tenant = e.tenant", "q.tenant = $5", 1);
        assert!(CITUS_TAKE_EVENTS.contains(&on_shard), "{}", *CITUS_TAKE_EVENTS);
        assert!(
            CITUS_TENANTS_TO_TAKE.contains("(sent_at IS NULL AND NOT maybe_executed)")
                && CITUS_TAKE.contains("(r.sent_at IS NULL AND NOT r.maybe_executed)")
        );
    }

    /// A list read node by node: the node's shards in place of the table
    /// (aliased or not, in subqueries too), literals in place of parameters.
    #[test]
    fn tenant_lists_are_rewritten_to_run_on_one_node() {
        let text = by_node(CITUS_TENANTS_TO_SWEEP, "idemgate_records");
        assert!(
            text.starts_with("SELECT coalesce(json_agg(l.tenant), '[]')::text FROM (SELECT tenant FROM (%1$s) AS idemgate_records WHERE"),
            "{text}"
        );
        assert!(text.contains("LIMIT %2$L") && !text.contains("$1"), "{text}");
        let events = by_node(&CITUS_TENANTS_WITH_EVENTS, "idemgate_events");
        assert_eq!(events.matches("FROM (%1$s) AS ").count(), 3, "the list and its two order checks: {events}");
        assert!(events.contains("ANY(%2$L::text[])") && events.contains("LIMIT %3$L"), "{events}");
        let probes = by_node(&CITUS_TENANTS_TO_PROBE, "idemgate_records");
        assert!(probes.contains("FROM (%1$s) AS r JOIN routes ro") && probes.contains("unnest(%2$L::text[], %3$L::int8[], %4$L::int8[])"));
        assert!(!probes.contains("idemgate_records"), "{probes}");
    }
}
