//! Store conformance (CONTRACT.md section 4): one suite of store-level cases,
//! written once against the library `Store` API and run against PostgreSQL
//! and the embedded SQLite store. Then PostgreSQL-only cases with a TCP fault
//! proxy between the `Store` and the server (ambiguous commits, an
//! unreachable or hung store, a server restart), and tests of the proxy.
//!
//! Leases and retention are 150 ms with sleeps just past them; "live" ones
//! are a minute, so no case depends on how fast this machine is.
// Real processes, real sockets: these tests wait on the wall clock.
#![allow(clippy::disallowed_types)]

use crate::support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use idemgate::config::{Secret, StoreBackend, StoreConfig};
use idemgate::idempotency::fingerprint::Fingerprint;
use idemgate::idempotency::key::{IdempotencyKey, Scope};
use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{self, Generation, Record, State, StoredResponse, Timestamp, TransitionError};
use idemgate::outbox::{Delivery, EventPolicies, EventType, EventsConfig, OutboxEvent};
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{
    Acceptance, Claim, ClaimOutcome, ClaimRequest, ListFilter, ProbeRoute, Reaped, Resolution, ResolveOutcome, RetryNote, Store,
    StoreError, Taken, WorkerRoute, WriteOutcome,
};
use idemgate::telemetry::metrics::Metrics;
use support::Backend;
use support::faultproxy::{Fault, FaultProxy};
use support::postgres::{self as pg, PgServer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use uuid::Uuid;

on_both_stores!(
    a_take_for_a_deduplicating_upstream_records_the_send,
    only_a_store_whose_sessions_keep_plans_has_a_plan_keeper,
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
    resolve_of_a_completed_record_needs_force_and_is_audited,
    concurrent_claims_have_exactly_one_winner,
    scopes_never_see_each_other,
    tenants_with_quotes_and_backslashes_are_data,
    complete_round_trips_the_response_exactly,
    writes_under_another_generation_are_fenced,
    take_over_fences_the_previous_generation,
    take_over_follows_may_take_over,
    expire_lease_only_turns_expired_in_flight_into_unknown,
    sweep_deletes_only_expired_completed_records_in_batches,
    reap_leases_turns_only_expired_in_flight_into_unknown,
    list_filters_orders_and_limits,
    resolve_releases_completes_and_refuses_live_claims,
    times_come_from_the_store_clock,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    stats_count_records_that_are_not_completed,
    unknown_records_are_counted_by_age_in_one_grouped_count,
    final_state_changes_write_their_events_and_nothing_else_does,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    the_reaper_decides_from_the_row_it_locked,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    probes_wait_for_the_bound_the_attempt_recorded,
    an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route,
    a_released_operation_starts_a_fresh_attempt_budget,
    a_parked_event_holds_the_later_events_of_its_scope,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
    a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff,
);

// The same cases through PgBouncer in transaction mode (store.pooler =
// "transaction"): every statement and transaction of the store crosses the
// pooler; the tests' own SQL goes to PostgreSQL directly.
on_pgbouncer!(
    only_a_store_whose_sessions_keep_plans_has_a_plan_keeper,
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
    resolve_of_a_completed_record_needs_force_and_is_audited,
    concurrent_claims_have_exactly_one_winner,
    scopes_never_see_each_other,
    tenants_with_quotes_and_backslashes_are_data,
    complete_round_trips_the_response_exactly,
    writes_under_another_generation_are_fenced,
    take_over_fences_the_previous_generation,
    take_over_follows_may_take_over,
    expire_lease_only_turns_expired_in_flight_into_unknown,
    sweep_deletes_only_expired_completed_records_in_batches,
    reap_leases_turns_only_expired_in_flight_into_unknown,
    list_filters_orders_and_limits,
    resolve_releases_completes_and_refuses_live_claims,
    times_come_from_the_store_clock,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    stats_count_records_that_are_not_completed,
    unknown_records_are_counted_by_age_in_one_grouped_count,
    final_state_changes_write_their_events_and_nothing_else_does,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    the_reaper_decides_from_the_row_it_locked,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    a_released_operation_starts_a_fresh_attempt_budget,
    a_parked_event_holds_the_later_events_of_its_scope,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
);

// The same cases on a Citus cluster (issue 30). Not here:
// the_reaper_decides_from_the_row_it_locked, which holds the reaper inside
// its statement with a trigger waiting on an advisory lock and watches
// pg_locks of the server it connects to; on Citus the reaper's statement
// runs on a worker, where that lock is taken.
on_citus!(
    only_a_store_whose_sessions_keep_plans_has_a_plan_keeper,
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
    resolve_of_a_completed_record_needs_force_and_is_audited,
    concurrent_claims_have_exactly_one_winner,
    scopes_never_see_each_other,
    tenants_with_quotes_and_backslashes_are_data,
    complete_round_trips_the_response_exactly,
    writes_under_another_generation_are_fenced,
    take_over_fences_the_previous_generation,
    take_over_follows_may_take_over,
    expire_lease_only_turns_expired_in_flight_into_unknown,
    sweep_deletes_only_expired_completed_records_in_batches,
    reap_leases_turns_only_expired_in_flight_into_unknown,
    list_filters_orders_and_limits,
    resolve_releases_completes_and_refuses_live_claims,
    times_come_from_the_store_clock,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    stats_count_records_that_are_not_completed,
    final_state_changes_write_their_events_and_nothing_else_does,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    probes_wait_for_the_bound_the_attempt_recorded,
    an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route,
    a_released_operation_starts_a_fresh_attempt_budget,
    a_parked_event_holds_the_later_events_of_its_scope,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
    unknown_records_are_counted_by_age_in_one_grouped_count,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones,
    a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff,
);

// ---------------------------------------------------------------------------
// Helpers

/// A lease or retention that ends within the test.
const SHORT: Duration = Duration::from_millis(150);
/// Sleep this long to be past `SHORT` (sleeps last at least this long, and
/// both stores' clocks are this machine's).
const PAST_SHORT: Duration = Duration::from_millis(250);
/// A lease or retention that does not end within the test.
const LONG: Duration = Duration::from_secs(60);
/// The upstream timeout async attempts are marked sent with.
const AT_UPSTREAM: Duration = Duration::from_secs(1);

fn store_config(backend: &Backend, timeout: Duration, pool_size: usize) -> StoreConfig {
    let backend = match backend {
        Backend::Postgres { url } => StoreBackend::Postgres { url: Secret::new(url.clone()), pool_size, pooler: Default::default() },
        Backend::Citus { url } => StoreBackend::Citus { url: Secret::new(url.clone()), pool_size, pooler: Default::default() },
        Backend::Pooled { url, pooler, .. } => {
            StoreBackend::Postgres { url: Secret::new(url.clone()), pool_size, pooler: support::gateway::pooler_named(pooler) }
        }
        Backend::Sqlite { path, .. } => StoreBackend::Sqlite { path: path.clone() },
    };
    StoreConfig {
        backend,
        migrate: true,
        unreachable_at_start: Default::default(),
        operation_timeout: timeout,
        sweep_interval: Duration::from_secs(1),
        sweep_batch: 100,
        events_retention: Duration::from_secs(3600),
    }
}

async fn open_with(backend: &Backend, timeout: Duration, pool_size: usize) -> Store {
    let store = Store::open(&store_config(backend, timeout, pool_size), idemgate::store::Access::Migrate).await.expect("open store");
    store.migrate().await.expect("migrate");
    store
}

async fn open(backend: &Backend) -> Store {
    open_with(backend, Duration::from_secs(5), 8).await
}

fn scope(tenant: &str, principal: &str, operation: &str, key: &str) -> Scope {
    Scope { tenant: tenant.into(), principal: principal.into(), operation: operation.into(), key: IdempotencyKey::new(key).unwrap() }
}

fn key(k: &str) -> Scope {
    scope("acme", "billing", "create_order", k)
}

fn fp(b: u8) -> Fingerprint {
    Fingerprint([b; 32])
}

fn req(scope: &Scope, hash: u8, lease: Duration, upstream_idempotent: bool) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        request_hash: fp(hash),
        owner: "replica-a".into(),
        lease,
        upstream_idempotent,
        claim_token: Uuid::new_v4(),
        acceptance: None,
        key_source: "header:idempotency-key".into(),
        request_head: None,
    }
}

/// An async acceptance of `scope` (operation id derived from the key).
fn accept_req(scope: &Scope, hash: u8) -> ClaimRequest {
    ClaimRequest {
        acceptance: Some(Acceptance { operation_id: format!("op_{}", scope.key.as_str()), request: Bytes::from_static(b"stored request") }),
        ..req(scope, hash, LONG, false)
    }
}

fn worker_route(operation: &str, lease: Duration) -> WorkerRoute {
    WorkerRoute { operation: operation.into(), lease, reforwardable: false, sent_on_take: None }
}

fn response(status: u16, body: &'static [u8]) -> StoredResponse {
    StoredResponse { status, headers: vec![("content-type".into(), b"application/json".to_vec())], body: Some(Bytes::from_static(body)) }
}

async fn claim(store: &Store, r: &ClaimRequest) -> Claim {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(c) => c,
        ClaimOutcome::Existing { record, .. } => panic!("expected to claim {:?}, found {record:?}", r.scope),
    }
}

async fn existing(store: &Store, r: &ClaimRequest) -> (Record, Timestamp) {
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Existing { record, now } => (record, now),
        ClaimOutcome::Claimed(c) => panic!("expected an existing record for {:?}, claimed {c:?}", r.scope),
    }
}

async fn get(store: &Store, s: &Scope) -> Option<Record> {
    store.get(s).await.expect("get").map(|(r, _)| r)
}

async fn row(store: &Store, s: &Scope) -> Record {
    get(store, s).await.unwrap_or_else(|| panic!("no row for {s:?}"))
}

async fn all(store: &Store) -> Vec<Record> {
    store.list(&ListFilter { limit: 1000, ..ListFilter::default() }).await.expect("list")
}

fn keys_of(records: &[Record]) -> Vec<String> {
    records.iter().map(|r| r.scope.key.as_str().to_owned()).collect()
}

fn key_set(records: &[Record]) -> BTreeSet<String> {
    keys_of(records).into_iter().collect()
}

fn set(keys: &[&str]) -> BTreeSet<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

fn micros(d: Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap()
}

/// The store clock at which a claim was made (a claim's lease is "now + lease").
fn claimed_at(c: &Claim, lease: Duration) -> Timestamp {
    Timestamp(c.lease_expires_at.0 - micros(lease))
}

// ---------------------------------------------------------------------------
// The suite, run on both stores

async fn claim_inserts_and_second_claim_sees_the_winner(backend: Backend) {
    let store = open(&backend).await;
    let s = key("first");
    let winner = claim(&store, &req(&s, 1, LONG, false)).await;
    assert_eq!(winner.scope, s);
    assert!(winner.generation > Generation(0));
    assert!(!winner.took_over);

    let rec = row(&store, &s).await;
    assert_eq!(rec.scope, s);
    assert_eq!(rec.state, State::InFlight);
    assert_eq!(rec.generation, winner.generation);
    assert_eq!(rec.claim_token, winner.claim_token);
    assert_eq!(rec.owner, "replica-a");
    assert_eq!(rec.request_hash, fp(1));
    assert_eq!(rec.response, None);
    assert_eq!(rec.lease_expires_at, Some(winner.lease_expires_at));
    assert_eq!(winner.lease_expires_at, rec.created_at.plus(LONG), "the lease is the claim's time plus the lease");
    assert_eq!(rec.updated_at, rec.created_at);

    // A second claim, from another replica, same or different request, may
    // take nothing over: it sees the winner's record, unchanged.
    for (hash, idempotent) in [(1, false), (1, true), (2, false), (2, true)] {
        let mut second = req(&s, hash, LONG, idempotent);
        second.owner = "replica-b".into();
        let (seen, now) = existing(&store, &second).await;
        assert_eq!(seen, rec, "hash {hash}, idempotent {idempotent}");
        assert_eq!(seen.claim_token, winner.claim_token);
        assert!(now >= rec.created_at);
    }
    assert_eq!(keys_of(&all(&store).await), vec!["first"]);
}

async fn concurrent_claims_have_exactly_one_winner(backend: Backend) {
    const N: usize = 32;
    let store = open(&backend).await;
    let s = key("race");
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (store, barrier) = (store.clone(), barrier.clone());
        let mut r = req(&s, 1, LONG, false);
        r.owner = format!("replica-{i}").into();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.claim(&r).await
        }));
    }
    let mut claimed = Vec::new();
    let mut seen = Vec::new();
    for t in tasks {
        match t.await.expect("task").expect("claim") {
            ClaimOutcome::Claimed(c) => claimed.push(c),
            ClaimOutcome::Existing { record, .. } => seen.push(record),
        }
    }
    assert_eq!(claimed.len(), 1, "exactly one winner");
    assert_eq!(seen.len(), N - 1);
    let winner = &claimed[0];
    for r in &seen {
        assert_eq!(r.claim_token, winner.claim_token, "every loser sees the winner's claim");
        assert_eq!((r.state, r.generation), (State::InFlight, winner.generation));
    }
    let rows = all(&store).await;
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].claim_token, winner.claim_token);
}

/// A tenant is whatever the identity says (a header, a JWT claim): quotes,
/// backslashes, `$1` and SQL are data. (On Citus the request path's
/// statements name the tenant as a quoted constant.) Each such scope is
/// claimed, completed and replayed on its own, and nothing else is touched.
async fn tenants_with_quotes_and_backslashes_are_data(backend: Backend) {
    let store = open(&backend).await;
    let tenants = ["o'brien", "back\\slash", "x'); DROP TABLE idemgate_records; --", "$1", "e'\\'", "\\'; SELECT 1; --", "''"];
    let mut claims = Vec::new();
    for t in tenants {
        let s = scope(t, "p", "o", "k");
        let c = claim(&store, &req(&s, 1, LONG, false)).await;
        claims.push((s, c));
    }
    for (i, (s, c)) in claims.iter().enumerate() {
        let answer = StoredResponse { body: Some(Bytes::from(format!("tenant {i}"))), ..response(201, b"") };
        assert_eq!(store.complete(c, &answer, Retention::For(LONG)).await.unwrap(), WriteOutcome::Written, "{s:?}");
    }
    for (i, (s, _)) in claims.iter().enumerate() {
        let r = row(&store, s).await;
        assert_eq!((&r.scope, r.state), (s, State::Completed));
        let (seen, _) = existing(&store, &req(s, 1, LONG, false)).await;
        assert_eq!(seen.response.and_then(|r| r.body), Some(Bytes::from(format!("tenant {i}"))), "{s:?} replays its own answer");
    }
    // A second scope of each such tenant is its own, and a release removes only it.
    let other = scope(tenants[0], "p", "o", "k2");
    let c = claim(&store, &req(&other, 2, LONG, false)).await;
    assert_eq!(store.release(&c).await.unwrap(), WriteOutcome::Written);
    assert_eq!(get(&store, &other).await, None);
    let mut listed: Vec<String> = all(&store).await.into_iter().map(|r| r.scope.tenant.to_string()).collect();
    listed.sort();
    let mut expected: Vec<String> = tenants.iter().map(|t| (*t).to_owned()).collect();
    expected.sort();
    assert_eq!(listed, expected, "every record kept, none added, the tables intact");
}

async fn scopes_never_see_each_other(backend: Backend) {
    let store = open(&backend).await;
    let base = scope("t1", "p1", "o1", "k1");
    let others = [
        scope("t2", "p1", "o1", "k1"),
        scope("t1", "p2", "o1", "k1"),
        scope("t1", "p1", "o2", "k1"),
        scope("t1", "p1", "o1", "k2"),
        // Components are not concatenated: these differ from base and each other.
        scope("t1p", "1", "o1", "k1"),
        scope("t1", "p1o", "1", "k1"),
    ];
    let c = claim(&store, &req(&base, 1, LONG, false)).await;
    let mut claims = Vec::new();
    for s in &others {
        // Same fingerprint, same key text: still a first claim in its own scope.
        let o = claim(&store, &req(s, 1, LONG, false)).await;
        assert!(!o.took_over, "{s:?}");
        // One sequence on PostgreSQL and SQLite; on Citus a counter per
        // tenant (docs/scaling.md, "Generations"): distinct and growing
        // within a tenant, not across tenants.
        if !matches!(backend, Backend::Citus { .. }) || s.tenant == base.tenant {
            assert!(o.generation > c.generation, "{s:?}: generations come from one growing sequence");
        }
        assert_ne!(o.claim_token, c.claim_token);
        claims.push(o);
    }
    assert_eq!(store.complete(&c, &response(201, b"base"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(store.release(&claims[0]).await.unwrap(), WriteOutcome::Written);

    assert_eq!(row(&store, &base).await.state, State::Completed);
    assert_eq!(get(&store, &others[0]).await, None);
    for (s, o) in others.iter().zip(&claims).skip(1) {
        let r = row(&store, s).await;
        assert_eq!(&r.scope, s);
        assert_eq!((r.state, r.claim_token, r.response.as_ref()), (State::InFlight, o.claim_token, None), "{s:?}");
    }
    // Another request in base's scope replays base; in a neighbour's scope it sees the neighbour.
    let (seen, _) = existing(&store, &req(&base, 1, LONG, false)).await;
    assert_eq!(seen.response, Some(response(201, b"base")));
    let (seen, _) = existing(&store, &req(&others[1], 2, LONG, false)).await;
    assert_eq!((seen.scope.clone(), seen.claim_token), (others[1].clone(), claims[1].claim_token));
    // The released neighbour can be claimed afresh; base is untouched by it.
    let again = claim(&store, &req(&others[0], 1, LONG, false)).await;
    assert!(again.generation > claims[0].generation, "a new life of a scope gets a new, larger generation");
    if !matches!(backend, Backend::Citus { .. }) {
        assert!(again.generation > claims.last().unwrap().generation, "generations come from one growing sequence");
    }
    assert_eq!(row(&store, &base).await.generation, c.generation);
    assert_eq!(all(&store).await.len(), 7);
    let t2 = store.list(&ListFilter { tenant: Some("t2".into()), limit: 100, ..ListFilter::default() }).await.unwrap();
    assert_eq!(t2.iter().map(|r| r.scope.clone()).collect::<Vec<_>>(), vec![others[0].clone()]);
}

async fn complete_round_trips_the_response_exactly(backend: Backend) {
    let store = open(&backend).await;
    let full = StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), b"application/json".to_vec()),
            // Not UTF-8, with a NUL: must come back byte for byte.
            ("x-bin".into(), vec![0xff, 0x00, 0x80, b'\t', b'a', 0xfe]),
            // Repeated names keep their order; empty values survive.
            ("x-dup".into(), b"2".to_vec()),
            ("x-dup".into(), b"1".to_vec()),
            ("x-empty".into(), Vec::new()),
        ],
        body: Some(Bytes::from_static(b"{\"id\":1}\x00\xff\xfe binary tail")),
    };
    // The body exceeded max_stored_response: status and headers only.
    let no_body = StoredResponse { status: 200, headers: vec![("etag".into(), b"\"v1\"".to_vec())], body: None };
    // An empty body is not an absent one.
    let empty_body = StoredResponse { status: 204, headers: Vec::new(), body: Some(Bytes::new()) };
    let server_error = StoredResponse { status: 599, headers: Vec::new(), body: Some(Bytes::from_static(b"oops")) };

    for (i, resp) in [full, no_body, empty_body, server_error].into_iter().enumerate() {
        let s = key(&format!("resp-{i}"));
        let c = claim(&store, &req(&s, 1, LONG, false)).await;
        let claimed = row(&store, &s).await;
        assert_eq!(store.complete(&c, &resp, Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
        let done = row(&store, &s).await;
        assert_eq!(done.state, State::Completed);
        assert_eq!(done.response.as_ref(), Some(&resp), "response {i} round-trips exactly");
        assert_eq!((done.generation, done.claim_token), (c.generation, c.claim_token));
        assert_eq!(done.lease_expires_at, None, "a completed record holds no lease");
        assert_eq!(done.created_at, claimed.created_at);
        assert_eq!(done.expires_at, done.updated_at.plus(LONG), "replayed for the retention from completion");
        // What a later request reads through claim is the same response.
        let (seen, _) = existing(&store, &req(&s, 1, LONG, false)).await;
        assert_eq!(seen, done);
    }
}

async fn writes_under_another_generation_are_fenced(backend: Backend) {
    let metrics = Arc::new(Metrics::new());
    let store = open(&backend).await.with_metrics(metrics.clone());
    let s = key("fenced");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    let before = row(&store, &s).await;
    let others = [
        Claim { generation: Generation(c.generation.0 - 1), ..c.clone() },
        Claim { generation: Generation(c.generation.0 + 1), ..c.clone() },
    ];
    for other in &others {
        assert_eq!(store.complete(other, &response(500, b"wrong"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
        assert_eq!(store.release(other).await.unwrap(), WriteOutcome::Fenced);
        assert_eq!(store.mark_unknown(other).await.unwrap(), WriteOutcome::Fenced);
        assert_eq!(row(&store, &s).await, before, "nothing written under generation {}", other.generation);
    }

    // The owner completes; afterwards even the owner cannot overwrite, release
    // or mark the record: it is no longer in flight.
    assert_eq!(store.complete(&c, &response(201, b"right"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    let done = row(&store, &s).await;
    assert_eq!(done.response, Some(response(201, b"right")));
    assert_eq!(store.complete(&c, &response(500, b"second"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.release(&c).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.mark_unknown(&c).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, done);

    // Own release deletes; own mark_unknown keeps the generation and then fences completion.
    let r = key("released");
    let rc = claim(&store, &req(&r, 1, LONG, false)).await;
    assert_eq!(store.release(&rc).await.unwrap(), WriteOutcome::Written);
    assert_eq!(get(&store, &r).await, None);
    assert_eq!(store.release(&rc).await.unwrap(), WriteOutcome::Fenced, "a second release finds nothing of its own");
    let u = key("unknown");
    let uc = claim(&store, &req(&u, 1, LONG, false)).await;
    assert_eq!(store.mark_unknown(&uc).await.unwrap(), WriteOutcome::Written);
    let unknown = row(&store, &u).await;
    assert_eq!((unknown.state, unknown.generation, unknown.claim_token), (State::Unknown, uc.generation, uc.claim_token));
    assert_eq!(store.complete(&uc, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.release(&uc).await.unwrap(), WriteOutcome::Fenced);
    let still = row(&store, &u).await;
    assert_eq!((still.state, still.response), (State::Unknown, None));

    // Every refusal above was counted: 2 + 1 + 1 completes, 2 + 1 + 1 + 1 releases, 2 + 1 marks.
    let text = metrics.encode();
    for (op, n) in [("complete", 4), ("release", 5), ("mark_unknown", 3)] {
        let line = format!("idemgate_fenced_writes_total{{op=\"{op}\"}} {n}");
        assert!(text.contains(&line), "missing {line:?} in\n{text}");
    }
}

async fn take_over_fences_the_previous_generation(backend: Backend) {
    let store = open(&backend).await;
    let s = key("takeover");
    let g1 = claim(&store, &req(&s, 1, SHORT, true)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let g2 = claim(&store, &req(&s, 1, LONG, true)).await;
    assert!(g2.took_over);
    assert!(g2.generation > g1.generation);
    assert_ne!(g2.claim_token, g1.claim_token);
    let taken = row(&store, &s).await;
    assert_eq!((taken.state, taken.generation, taken.claim_token), (State::InFlight, g2.generation, g2.claim_token));

    // The first attempt comes back late: every write it tries is fenced off.
    assert_eq!(store.complete(&g1, &response(201, b"g1"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.mark_unknown(&g1).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.release(&g1).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, taken);

    assert_eq!(store.complete(&g2, &response(201, b"g2"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    let done = row(&store, &s).await;
    assert_eq!((done.state, done.generation), (State::Completed, g2.generation));
    assert_eq!(done.response, Some(response(201, b"g2")));
    assert_eq!(store.complete(&g1, &response(201, b"g1"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, done);
}

/// Claims `r.scope` again and holds the store's answer to
/// `record::may_take_over` evaluated on the record as it was, at the store's
/// clock. Returns whether the claim took the record over.
async fn try_take_over(store: &Store, r: &ClaimRequest) -> bool {
    let before = row(store, &r.scope).await;
    match store.claim(r).await.expect("claim") {
        ClaimOutcome::Claimed(c) => {
            let at = claimed_at(&c, r.lease);
            assert!(
                record::may_take_over(&before, &r.request_hash, at, r.upstream_idempotent),
                "the store took over {before:?} at {at} although may_take_over says no"
            );
            assert!(c.took_over);
            assert!(c.generation > before.generation, "a take-over draws a larger generation");
            let after = row(store, &r.scope).await;
            assert_eq!((after.state, after.generation, after.claim_token), (State::InFlight, c.generation, c.claim_token));
            assert_eq!((after.request_hash, after.response), (r.request_hash, None));
            assert_eq!(after.lease_expires_at, Some(c.lease_expires_at));
            true
        }
        ClaimOutcome::Existing { record, now } => {
            assert_eq!(record, before, "a refused take-over changes nothing");
            assert!(
                !record::may_take_over(&record, &r.request_hash, now, r.upstream_idempotent),
                "the store refused to take over {record:?} at {now} although may_take_over says yes"
            );
            false
        }
    }
}

async fn take_over_follows_may_take_over(backend: Backend) {
    let store = open(&backend).await;
    let (done_old, done_live) = (key("completed-expired"), key("completed-live"));
    let (flight_old, flight_live) = (key("in-flight-expired"), key("in-flight-live"));
    let unknown = key("unknown");
    let c = claim(&store, &req(&done_old, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"old"), Retention::For(SHORT)).await.unwrap();
    let c = claim(&store, &req(&done_live, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"live"), Retention::For(LONG)).await.unwrap();
    claim(&store, &req(&flight_old, 1, SHORT, false)).await;
    claim(&store, &req(&flight_live, 1, LONG, false)).await;
    let c = claim(&store, &req(&unknown, 1, LONG, false)).await;
    store.mark_unknown(&c).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;

    // Completed past retention: anyone may take it over, whatever the request.
    assert!(try_take_over(&store, &req(&done_old, 2, LONG, false)).await);
    // Completed within retention: never.
    assert!(!try_take_over(&store, &req(&done_live, 1, LONG, true)).await);
    assert!(!try_take_over(&store, &req(&done_live, 2, LONG, true)).await);
    // In flight, lease expired: only for an idempotent upstream and the same request.
    assert!(!try_take_over(&store, &req(&flight_old, 1, LONG, false)).await);
    assert!(!try_take_over(&store, &req(&flight_old, 2, LONG, true)).await);
    assert!(try_take_over(&store, &req(&flight_old, 1, LONG, true)).await);
    // In flight, lease running: never.
    assert!(!try_take_over(&store, &req(&flight_live, 1, LONG, true)).await);
    // Unknown: like an expired in-flight record.
    assert!(!try_take_over(&store, &req(&unknown, 1, LONG, false)).await);
    assert!(!try_take_over(&store, &req(&unknown, 2, LONG, true)).await);
    assert!(try_take_over(&store, &req(&unknown, 1, LONG, true)).await);

    // The three taken over hold generations drawn after every first claim.
    let rows = all(&store).await;
    let gen_of = |k: &str| rows.iter().find(|r| r.scope.key.as_str() == k).map(|r| r.generation).unwrap();
    let first_claims = ["completed-live", "in-flight-live"].map(gen_of);
    for taken in ["completed-expired", "in-flight-expired", "unknown"] {
        assert!(first_claims.iter().all(|g| gen_of(taken) > *g), "{taken} was taken over with a new generation");
    }
}

async fn expire_lease_only_turns_expired_in_flight_into_unknown(backend: Backend) {
    let store = open(&backend).await;
    let (live, expired, moved, done, late) = (key("live"), key("expired"), key("moved"), key("done"), key("late"));
    claim(&store, &req(&live, 1, LONG, false)).await;
    let e = claim(&store, &req(&expired, 1, SHORT, false)).await;
    claim(&store, &req(&moved, 1, SHORT, true)).await;
    let d = claim(&store, &req(&done, 1, SHORT, false)).await;
    store.complete(&d, &response(201, b"done"), Retention::For(LONG)).await.unwrap();
    let l = claim(&store, &req(&late, 1, SHORT, false)).await;
    tokio::time::sleep(PAST_SHORT).await;

    let rec = row(&store, &live).await;
    assert_eq!(store.expire_lease(&rec).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &live).await, rec, "a live lease is left alone");

    let rec = row(&store, &expired).await;
    assert_eq!(store.expire_lease(&rec).await.unwrap(), WriteOutcome::Written);
    let unknown = row(&store, &expired).await;
    assert_eq!((unknown.state, unknown.generation, unknown.claim_token), (State::Unknown, e.generation, e.claim_token));
    assert!(unknown.updated_at >= rec.updated_at);
    assert_eq!(store.expire_lease(&rec).await.unwrap(), WriteOutcome::Fenced, "already unknown");
    assert_eq!(row(&store, &expired).await, unknown);

    // A reader holding a stale copy cannot expire the generation that replaced it.
    let stale = row(&store, &moved).await;
    let g2 = claim(&store, &req(&moved, 1, LONG, true)).await;
    assert_eq!(store.expire_lease(&stale).await.unwrap(), WriteOutcome::Fenced);
    let now_moved = row(&store, &moved).await;
    assert_eq!((now_moved.state, now_moved.generation, now_moved.claim_token), (State::InFlight, g2.generation, g2.claim_token));
    assert!(g2.generation > stale.generation);

    let rec = row(&store, &done).await;
    assert_eq!(store.expire_lease(&rec).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &done).await, rec);

    // Until someone expires it, the owner of an expired lease may still record its result.
    assert_eq!(store.complete(&l, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    let rec = row(&store, &late).await;
    assert_eq!(rec.state, State::Completed);
    assert_eq!(store.expire_lease(&rec).await.unwrap(), WriteOutcome::Fenced);
}

async fn sweep_deletes_only_expired_completed_records_in_batches(backend: Backend) {
    let store = open(&backend).await;
    for i in 0..5 {
        let c = claim(&store, &req(&key(&format!("old-{i}")), 1, LONG, false)).await;
        store.complete(&c, &response(201, b"old"), Retention::For(SHORT)).await.unwrap();
    }
    let c = claim(&store, &req(&key("live-completed"), 1, LONG, false)).await;
    store.complete(&c, &response(201, b"live"), Retention::For(LONG)).await.unwrap();
    // Expired leases and unknown outcomes have an expires_at in the past too:
    // they must survive the sweeper.
    claim(&store, &req(&key("expired-in-flight"), 1, SHORT, false)).await;
    let c = claim(&store, &req(&key("unknown"), 1, SHORT, false)).await;
    store.mark_unknown(&c).await.unwrap();
    claim(&store, &req(&key("live-in-flight"), 1, LONG, false)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let survivors = set(&["live-completed", "expired-in-flight", "unknown", "live-in-flight"]);
    let before: Vec<Record> = all(&store).await.into_iter().filter(|r| survivors.contains(r.scope.key.as_str())).collect();
    assert_eq!(before.len(), 4);

    assert_eq!(store.sweep(2).await.unwrap(), 2, "the batch size bounds each sweep");
    assert_eq!(all(&store).await.len(), 7);
    assert_eq!(store.sweep(2).await.unwrap(), 2);
    assert_eq!(store.sweep(2).await.unwrap(), 1);
    assert_eq!(store.sweep(2).await.unwrap(), 0);
    let after = all(&store).await;
    assert_eq!(key_set(&after), survivors);
    for r in &before {
        assert_eq!(row(&store, &r.scope).await, *r, "survivors are untouched");
    }
}

async fn reap_leases_turns_only_expired_in_flight_into_unknown(backend: Backend) {
    let store = open(&backend).await;
    let mut stale = Vec::new();
    for i in 0..3 {
        let s = key(&format!("stale-{i}"));
        stale.push((s.clone(), claim(&store, &req(&s, 1, SHORT, false)).await));
    }
    claim(&store, &req(&key("live"), 1, LONG, false)).await;
    let c = claim(&store, &req(&key("completed"), 1, SHORT, false)).await;
    store.complete(&c, &response(201, b"done"), Retention::For(SHORT)).await.unwrap();
    let c = claim(&store, &req(&key("unknown"), 1, SHORT, false)).await;
    store.mark_unknown(&c).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    let untouched: Vec<Record> = all(&store).await.into_iter().filter(|r| !r.scope.key.as_str().starts_with("stale-")).collect();
    assert_eq!(untouched.len(), 3);

    let unknown = |n| Reaped { unknown: n, requeued: 0 };
    assert_eq!(store.reap_leases(2, &[]).await.unwrap(), unknown(2), "the batch size bounds each pass");
    assert_eq!(store.reap_leases(2, &[]).await.unwrap(), unknown(1));
    assert_eq!(store.reap_leases(2, &[]).await.unwrap(), unknown(0));
    for (s, c) in &stale {
        let r = row(&store, s).await;
        assert_eq!((r.state, r.generation, r.claim_token), (State::Unknown, c.generation, c.claim_token), "{s:?}");
        // The reaped attempt is fenced off from recording a result now.
        assert_eq!(store.complete(c, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    }
    for r in &untouched {
        assert_eq!(row(&store, &r.scope).await, *r, "only expired in-flight records are reaped");
    }
    assert_eq!(all(&store).await.len(), 6, "reaping deletes nothing");
}

async fn list_filters_orders_and_limits(backend: Backend) {
    let store = open(&backend).await;
    let pause = || tokio::time::sleep(Duration::from_millis(3));
    // Created in this order, so most recently updated first is e, d, c, b, a.
    let a = claim(&store, &req(&scope("t1", "p", "o1", "a"), 1, LONG, false)).await;
    store.complete(&a, &response(201, b"a"), Retention::For(LONG)).await.unwrap();
    pause().await;
    claim(&store, &req(&scope("t1", "p", "o2", "b"), 1, LONG, false)).await;
    pause().await;
    let c = claim(&store, &req(&scope("t2", "p", "o1", "c"), 1, LONG, false)).await;
    store.mark_unknown(&c).await.unwrap();
    pause().await;
    let d = claim(&store, &req(&scope("t2", "p", "o2", "d"), 1, LONG, false)).await;
    store.complete(&d, &response(201, b"d"), Retention::For(LONG)).await.unwrap();
    pause().await;
    claim(&store, &req(&scope("t1", "q", "o1", "e"), 1, LONG, false)).await;

    let list = |state: Option<State>, tenant: Option<&str>, operation: Option<&str>, limit: u32| {
        let store = store.clone();
        let filter =
            ListFilter { state, tenant: tenant.map(Into::into), operation: operation.map(Into::into), forever: false, limit, cursor: None };
        async move { keys_of(&store.list(&filter).await.expect("list")) }
    };
    assert_eq!(list(None, None, None, 100).await, ["e", "d", "c", "b", "a"]);
    assert_eq!(list(Some(State::Completed), None, None, 100).await, ["d", "a"]);
    assert_eq!(list(Some(State::InFlight), None, None, 100).await, ["e", "b"]);
    assert_eq!(list(Some(State::Unknown), None, None, 100).await, ["c"]);
    assert_eq!(list(None, Some("t1"), None, 100).await, ["e", "b", "a"]);
    assert_eq!(list(None, None, Some("o1"), 100).await, ["e", "c", "a"]);
    assert_eq!(list(None, Some("t2"), Some("o2"), 100).await, ["d"]);
    assert_eq!(list(Some(State::Completed), Some("t1"), None, 100).await, ["a"]);
    assert_eq!(list(Some(State::Unknown), Some("t1"), None, 100).await, Vec::<String>::new());
    assert_eq!(list(None, Some("nobody"), None, 100).await, Vec::<String>::new());
    assert_eq!(list(None, None, None, 2).await, ["e", "d"]);
    assert_eq!(list(Some(State::InFlight), None, None, 1).await, ["e"]);
    // The rows listed are whole records.
    let full = store.list(&ListFilter { state: Some(State::Completed), limit: 1, ..ListFilter::default() }).await.unwrap();
    assert_eq!(full, vec![row(&store, &scope("t2", "p", "o2", "d")).await]);
}

fn note(reason: &str) -> AuditNote {
    AuditNote { actor: Actor::Cli, reason: reason.into(), forced: false, caller: None }
}

const RELEASE: Resolution = Resolution::Release { force: false };

async fn resolve_releases_completes_and_refuses_live_claims(backend: Backend) {
    let store = open(&backend).await;
    let complete = |status| Resolution::Complete { response: response(status, b"by hand"), retention: Retention::For(LONG), force: false };
    let n = note("checked the upstream's ledger");

    // No row: nothing to resolve, and nothing is created.
    let absent = key("absent");
    assert_eq!(store.resolve(&absent, &RELEASE, &n).await.unwrap(), ResolveOutcome::NotFound);
    assert_eq!(store.resolve(&absent, &complete(200), &n).await.unwrap(), ResolveOutcome::NotFound);
    assert_eq!(get(&store, &absent).await, None);

    // A live claim may still record its result: operators are refused, even by force.
    let live = key("live");
    let lc = claim(&store, &req(&live, 1, LONG, false)).await;
    let before = row(&store, &live).await;
    assert_eq!(store.resolve(&live, &RELEASE, &n).await.unwrap(), ResolveOutcome::Refused(TransitionError::LeaseLive));
    assert_eq!(store.resolve(&live, &complete(200), &n).await.unwrap(), ResolveOutcome::Refused(TransitionError::LeaseLive));
    assert_eq!(
        store.resolve(&live, &Resolution::Release { force: true }, &n).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::LeaseLive)
    );
    assert_eq!(row(&store, &live).await, before);
    assert_eq!(store.complete(&lc, &response(201, b"own"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);

    // Unknown, completed by hand: the response is recorded under a new
    // generation, which fences off the original attempt.
    let unknown = key("unknown");
    let uc = claim(&store, &req(&unknown, 1, LONG, false)).await;
    store.mark_unknown(&uc).await.unwrap();
    assert_eq!(store.resolve(&unknown, &complete(202), &n).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });
    let resolved = row(&store, &unknown).await;
    assert_eq!(resolved.state, State::Completed);
    assert!(resolved.generation > uc.generation);
    assert_eq!(resolved.response, Some(response(202, b"by hand")));
    assert_eq!(resolved.lease_expires_at, None);
    assert_eq!(resolved.expires_at, resolved.updated_at.plus(LONG));
    assert_eq!(store.complete(&uc, &response(500, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &unknown).await, resolved);
    // A later request with the same fingerprint replays the operator's response.
    let (seen, now) = existing(&store, &req(&unknown, 1, LONG, false)).await;
    assert_eq!(record::decide(&seen, &fp(1), now), record::Decision::Replay);

    // Expired in flight, released: the key is free again, under a new generation.
    let expired = key("expired");
    let ec = claim(&store, &req(&expired, 1, SHORT, false)).await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.resolve(&expired, &RELEASE, &n).await.unwrap(), ResolveOutcome::Resolved { from: State::InFlight });
    assert_eq!(get(&store, &expired).await, None);
    assert_eq!(store.complete(&ec, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(get(&store, &expired).await, None, "a fenced write never recreates a row");
    let again = claim(&store, &req(&expired, 1, LONG, false)).await;
    assert!(!again.took_over);
    assert!(again.generation > ec.generation);

    // A completed record is refused without force (see the next case).
    assert_eq!(store.resolve(&live, &RELEASE, &n).await.unwrap(), ResolveOutcome::Refused(TransitionError::NotAllowed(State::Completed)));
    assert_eq!(key_set(&all(&store).await), set(&["live", "unknown", "expired"]));
}

/// A completed record is the answer every retry is replayed: releasing it
/// lets the next retry execute again. Only `force` (with a reason, which the
/// CLI and API demand) changes it, and every resolution leaves an audit row
/// in the same transaction.
async fn resolve_of_a_completed_record_needs_force_and_is_audited(backend: Backend) {
    let store = open(&backend).await;
    let done = key("done");
    let c = claim(&store, &req(&done, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"order 1"), Retention::For(LONG)).await.unwrap();
    let before = row(&store, &done).await;
    let plain = note("looks wrong");
    assert_eq!(
        store.resolve(&done, &RELEASE, &plain).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::NotAllowed(State::Completed))
    );
    let complete = Resolution::Complete { response: response(200, b"other"), retention: Retention::For(LONG), force: false };
    assert_eq!(
        store.resolve(&done, &complete, &plain).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::NotAllowed(State::Completed))
    );
    assert_eq!(row(&store, &done).await, before, "nothing changed");
    assert!(store.audit(10).await.unwrap().is_empty(), "refusals leave no audit row");

    let forced = AuditNote { actor: Actor::Admin, reason: "customer refunded by hand".into(), forced: true, caller: None };
    let fix = Resolution::Complete { response: response(200, b"corrected"), retention: Retention::For(LONG), force: true };
    assert_eq!(store.resolve(&done, &fix, &forced).await.unwrap(), ResolveOutcome::Resolved { from: State::Completed });
    let fixed = row(&store, &done).await;
    assert_eq!(fixed.response, Some(response(200, b"corrected")));
    assert_eq!(
        store.resolve(&done, &Resolution::Release { force: true }, &forced).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Completed }
    );
    assert_eq!(get(&store, &done).await, None);

    // An unknown record resolved by the reconciler, for the trail's variety.
    let u = key("unknown");
    let uc = claim(&store, &req(&u, 1, LONG, false)).await;
    store.mark_unknown(&uc).await.unwrap();
    let by_probe = AuditNote { actor: Actor::Reconciler, reason: "probe: 404".into(), forced: false, caller: None };
    assert_eq!(store.resolve(&u, &RELEASE, &by_probe).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });

    let trail = store.audit(10).await.unwrap();
    let summary: Vec<_> =
        trail.iter().map(|a| (a.actor.as_str(), a.scope.key.as_str(), a.from_state.as_str(), a.to_state.as_str(), a.forced)).collect();
    assert_eq!(
        summary,
        vec![
            ("reconciler", "unknown", "unknown", "released", false),
            ("admin", "done", "completed", "released", true),
            ("admin", "done", "completed", "completed", true),
        ],
        "newest first"
    );
    assert_eq!(trail[2].generation, Some(fixed.generation));
    assert_eq!(trail[1].generation, None);
    assert_eq!(trail[1].reason, "customer refunded by hand");
    assert_eq!(trail[0].scope, u);
    assert!(trail[0].at >= trail[2].at);
    assert_eq!(store.audit(1).await.unwrap().len(), 1, "limit applies");
}

/// Generations come from one store-wide sequence: every life of a scope
/// (after a release, a resolution or a take-over) gets a larger one, so an
/// upstream that fences on X-Idempotency-Generation can tell them apart.
async fn generations_grow_across_lives_of_a_scope(backend: Backend) {
    let store = open(&backend).await;
    let k = key("many-lives");
    let mut seen = Vec::new();
    // Released by its own attempt, claimed again.
    let c1 = claim(&store, &req(&k, 1, LONG, false)).await;
    seen.push(c1.generation);
    store.release(&c1).await.unwrap();
    let c2 = claim(&store, &req(&k, 1, SHORT, true)).await;
    seen.push(c2.generation);
    // Taken over after its lease expired.
    tokio::time::sleep(PAST_SHORT).await;
    let c3 = claim(&store, &req(&k, 1, LONG, true)).await;
    seen.push(c3.generation);
    // Completed, swept past retention, claimed again.
    store.complete(&c3, &response(201, b"x"), Retention::For(SHORT)).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.sweep(10).await.unwrap(), 1);
    let c4 = claim(&store, &req(&k, 2, LONG, false)).await;
    seen.push(c4.generation);
    // Unknown, completed by an operator.
    store.mark_unknown(&c4).await.unwrap();
    let done = Resolution::Complete { response: response(201, b"y"), retention: Retention::For(LONG), force: false };
    store.resolve(&k, &done, &note("confirmed")).await.unwrap();
    seen.push(row(&store, &k).await.generation);
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "strictly increasing: {seen:?}");
    // Another scope's claims in between do not break the order either.
    let other = claim(&store, &req(&key("neighbour"), 1, LONG, false)).await;
    assert!(other.generation > *seen.last().unwrap());
}

/// PostgreSQL sessions keep generic plans, which the plan keeper keeps fit
/// for the tables' sizes (`store::postgres::replan`); SQLite and Citus plan
/// each statement as it runs, so their gateways run no plan keeper, and
/// its look does nothing there.
async fn only_a_store_whose_sessions_keep_plans_has_a_plan_keeper(backend: Backend) {
    let store = open(&backend).await;
    assert_eq!(store.caches_plans(), matches!(backend, Backend::Postgres { .. }), "{backend:?}");
    store.refresh_plans().await.expect("a look");
}

async fn times_come_from_the_store_clock(backend: Backend) {
    let store = open(&backend).await;
    let t0 = store.now().await.unwrap();
    let system = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let skew = (t0.0 - micros(system)).abs();
    assert!(skew < 5_000_000, "store clock {t0} is {skew} us from this machine's: wrong epoch or unit?");

    let s = key("clock");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    let t1 = store.now().await.unwrap();
    let rec = row(&store, &s).await;
    assert!(t0 <= rec.created_at && rec.created_at <= t1, "{t0} <= {} <= {t1}", rec.created_at);
    assert_eq!(rec.updated_at, rec.created_at);
    assert_eq!(c.lease_expires_at, rec.created_at.plus(LONG));
    assert_eq!(claimed_at(&c, LONG), rec.created_at);

    // Readers get the store's clock with the record.
    let (_, seen_at) = existing(&store, &req(&s, 1, LONG, false)).await;
    let (_, got_at) = store.get(&s).await.unwrap().unwrap();
    let t2 = store.now().await.unwrap();
    assert!(t1 <= seen_at && seen_at <= got_at && got_at <= t2, "{t1} <= {seen_at} <= {got_at} <= {t2}");
    assert_eq!(record::decide(&rec, &fp(1), seen_at), record::Decision::InProgress { lease_left: seen_at.until(c.lease_expires_at) });

    tokio::time::sleep(Duration::from_millis(20)).await;
    let t3 = store.now().await.unwrap();
    assert!(t3.0 - t2.0 >= 20_000, "the store clock advanced by {} us over a 20 ms sleep", t3.0 - t2.0);
    store.complete(&c, &response(201, b"t"), Retention::For(SHORT)).await.unwrap();
    let t4 = store.now().await.unwrap();
    let done = row(&store, &s).await;
    assert!(t3 <= done.updated_at && done.updated_at <= t4, "{t3} <= {} <= {t4}", done.updated_at);
    assert_eq!(done.created_at, rec.created_at, "completion keeps the claim's creation time");
    assert_eq!(done.expires_at, done.updated_at.plus(SHORT));
    // Retention runs on the store's clock: replayed now, expired just after.
    let (seen, now) = existing(&store, &req(&s, 1, LONG, false)).await;
    assert_eq!(record::decide(&seen, &fp(1), now), record::Decision::Replay);
    tokio::time::sleep(PAST_SHORT).await;
    let (seen, now) = store.get(&s).await.unwrap().unwrap();
    assert!(now >= seen.expires_at);
    assert_eq!(record::decide(&seen, &fp(1), now), record::Decision::Expired);
}

async fn claim_resent_with_the_same_token_is_recognised_as_ours(backend: Backend) {
    // What an ambiguous claim's retry meets when the earlier attempt committed
    // after the read-back found nothing: a row holding its own token. "My
    // token means the write happened": it is this request's claim.
    let store = open(&backend).await;
    let s = key("resent");
    let r = req(&s, 1, LONG, false);
    let c = claim(&store, &r).await;
    match store.claim(&r).await.unwrap() {
        ClaimOutcome::Claimed(again) => {
            assert_eq!((again.generation, again.claim_token, again.took_over), (c.generation, c.claim_token, false));
            assert_eq!(again.lease_expires_at, c.lease_expires_at);
        }
        ClaimOutcome::Existing { record, .. } => panic!("our own claim reported as another's: {record:?}"),
    }
    // Another request (another token) sees it as the first request's.
    let (seen, _) = existing(&store, &req(&s, 1, LONG, false)).await;
    assert_eq!((seen.generation, seen.claim_token), (c.generation, c.claim_token));

    // Likewise after a take-over: the taker re-sending its claim holds the new generation.
    let t = key("resent-take-over");
    claim(&store, &req(&t, 1, SHORT, true)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let taker = req(&t, 1, LONG, true);
    let g2 = claim(&store, &taker).await;
    match store.claim(&taker).await.unwrap() {
        ClaimOutcome::Claimed(again) => assert_eq!((again.generation, again.claim_token), (g2.generation, g2.claim_token)),
        ClaimOutcome::Existing { record, .. } => panic!("our own take-over reported as another's: {record:?}"),
    }
    // Once our claim is completed, re-sending it claims nothing.
    store.complete(&g2, &response(201, b"done"), Retention::For(LONG)).await.unwrap();
    let (seen, _) = existing(&store, &taker).await;
    assert_eq!((seen.state, seen.generation), (State::Completed, g2.generation));
    assert_eq!(key_set(&all(&store).await), set(&["resent", "resent-take-over"]));
}

async fn abandon_deletes_only_an_in_flight_claim_with_its_token(backend: Backend) {
    let store = open(&backend).await;
    let (mine, done, unknown, taken, absent) = (key("mine"), key("done"), key("unknown"), key("taken"), key("absent"));
    let m = claim(&store, &req(&mine, 1, LONG, false)).await;
    let d = claim(&store, &req(&done, 1, LONG, false)).await;
    store.complete(&d, &response(201, b"done"), Retention::For(LONG)).await.unwrap();
    let u = claim(&store, &req(&unknown, 1, LONG, false)).await;
    store.mark_unknown(&u).await.unwrap();
    let first = claim(&store, &req(&taken, 1, SHORT, true)).await;
    tokio::time::sleep(PAST_SHORT).await;
    let second = claim(&store, &req(&taken, 1, LONG, true)).await;

    let before = row(&store, &mine).await;
    assert!(!store.abandon(&mine, Uuid::new_v4()).await.unwrap(), "another token abandons nothing");
    assert_eq!(row(&store, &mine).await, before);
    assert!(store.abandon(&mine, m.claim_token).await.unwrap());
    assert_eq!(get(&store, &mine).await, None);
    assert!(!store.abandon(&mine, m.claim_token).await.unwrap(), "nothing left to abandon");

    // A claim that got as far as a result, or an unknown outcome, is not abandoned.
    let (done_before, unknown_before) = (row(&store, &done).await, row(&store, &unknown).await);
    assert!(!store.abandon(&done, d.claim_token).await.unwrap());
    assert!(!store.abandon(&unknown, u.claim_token).await.unwrap());
    assert_eq!(row(&store, &done).await, done_before);
    assert_eq!(row(&store, &unknown).await, unknown_before);
    // Nor one that another attempt has taken over since.
    assert!(!store.abandon(&taken, first.claim_token).await.unwrap());
    let t = row(&store, &taken).await;
    assert_eq!((t.state, t.generation, t.claim_token), (State::InFlight, second.generation, second.claim_token));
    assert!(!store.abandon(&absent, Uuid::new_v4()).await.unwrap());
    // Nor an async acceptance: a retry may already have read it back and
    // answered 202 with its operation id, so it is an accepted operation
    // from the moment it committed (the soak once lost one this way).
    let queued = key("queued");
    let q = claim(&store, &accept_req(&queued, 1)).await;
    let queued_before = row(&store, &queued).await;
    assert!(!store.abandon(&queued, q.claim_token).await.unwrap(), "an acceptance is never abandoned");
    assert_eq!(row(&store, &queued).await, queued_before);
    assert_eq!(key_set(&all(&store).await), set(&["done", "unknown", "taken", "queued"]));
}

// ---------------------------------------------------------------------------
// Async operations (CONTRACT section 6), on both stores

/// The `request` column of a record, read from outside the store: `None`
/// when the row is missing, `Some(None)` when the column is NULL.
async fn stored_request(backend: &Backend, s: &Scope) -> Option<Option<Vec<u8>>> {
    let k = s.key.as_str().to_owned();
    match backend {
        Backend::Postgres { url } | Backend::Citus { url } | Backend::Pooled { direct: url, .. } => {
            let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
            let task = tokio::spawn(conn);
            let rows = client.query("SELECT request FROM idemgate_records WHERE idempotency_key = $1", &[&k]).await.expect("select");
            drop(client);
            let _ = task.await;
            rows.first().map(|r| r.get(0))
        }
        Backend::Sqlite { path, .. } => {
            let conn = rusqlite::Connection::open(path).expect("open sqlite");
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            let mut st = conn.prepare("SELECT request FROM idemgate_records WHERE idempotency_key = ?1").unwrap();
            let mut rows = st.query([&k]).unwrap();
            rows.next().unwrap().map(|r| r.get(0).unwrap())
        }
    }
}

/// An async operation's stored request carries the client's headers
/// (`Authorization` among them) and body: it is kept while the operation may
/// still run (queued, processing, and `unknown`, which an operator's release
/// re-queues and whose path a probe reads) and dropped once the operation is
/// final: completed (by its worker or by hand) or `failed_retryable`. A
/// synchronous claim's request line, kept for probes, likewise. A completed
/// operation whose request is gone cannot be released to run again.
async fn stored_requests_are_dropped_once_the_operation_is_final(backend: Backend) {
    let store = open(&backend).await;
    let routes = [worker_route("create_order", LONG)];
    let stored = Some(Some(b"stored request".to_vec()));
    let lost = RetryNote { last_status: None, maybe_executed: true };

    // Completed by its worker.
    let done = key("req-done");
    claim(&store, &accept_req(&done, 1)).await;
    assert_eq!(stored_request(&backend, &done).await, stored, "queued: kept");
    let t = take(&store, &routes, "w").await.unwrap();
    assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    assert_eq!(stored_request(&backend, &done).await, stored, "processing: kept");
    assert_eq!(store.complete(&t.claim, &response(201, b"done"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &done).await.state, State::Completed);
    assert_eq!(stored_request(&backend, &done).await, Some(None), "completed: dropped");

    // Retries used up, never executed: failed_retryable.
    let failed = key("req-failed");
    claim(&store, &accept_req(&failed, 1)).await;
    let t = take(&store, &routes, "w").await.unwrap();
    assert_eq!(store.fail(&t.claim, Retention::For(LONG), RetryNote::default()).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &failed).await.state, State::FailedRetryable);
    assert_eq!(stored_request(&backend, &failed).await, Some(None), "failed_retryable: dropped");

    // Unknown: kept. An operator's release runs it again with the request
    // byte for byte; completed by hand later, it is dropped.
    let unsure = key("req-unknown");
    claim(&store, &accept_req(&unsure, 1)).await;
    let t = take(&store, &routes, "w").await.unwrap();
    assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    assert_eq!(store.fail(&t.claim, Retention::For(LONG), lost).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &unsure).await.state, State::Unknown);
    assert_eq!(stored_request(&backend, &unsure).await, stored, "unknown: kept");
    assert_eq!(
        store.resolve(&unsure, &RELEASE, &note("not in the ledger")).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Unknown }
    );
    let again = take(&store, &routes, "w").await.expect("re-queued");
    assert_eq!(again.request, Bytes::from_static(b"stored request"));
    assert_eq!(store.mark_sent(&again.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    assert_eq!(store.fail(&again.claim, Retention::For(LONG), lost).await.unwrap(), WriteOutcome::Written);
    let by_hand = Resolution::Complete { response: response(201, b"by hand"), retention: Retention::For(LONG), force: false };
    assert_eq!(
        store.resolve(&unsure, &by_hand, &note("found in the ledger")).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Unknown }
    );
    assert_eq!(stored_request(&backend, &unsure).await, Some(None), "completed by hand: dropped");

    // Completed and its request gone: a forced release cannot re-queue it.
    let before = row(&store, &done).await;
    let forced = Resolution::Release { force: true };
    assert_eq!(store.resolve(&done, &forced, &note("run it again")).await.unwrap(), ResolveOutcome::Refused(TransitionError::RequestGone));
    assert_eq!(row(&store, &done).await, before, "unchanged");
    assert!(take(&store, &routes, "w").await.is_none(), "nothing was queued");

    // A synchronous claim's request line, kept for probes: dropped on completion.
    let sync = key("req-sync");
    let mut r = req(&sync, 1, LONG, false);
    r.request_head = Some(Bytes::from_static(b"request line"));
    let c = claim(&store, &r).await;
    assert_eq!(stored_request(&backend, &sync).await, Some(Some(b"request line".to_vec())));
    assert_eq!(store.complete(&c, &response(201, b"sync"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(stored_request(&backend, &sync).await, Some(None), "completed: dropped");
}

async fn take(store: &Store, routes: &[WorkerRoute], owner: &str) -> Option<Taken> {
    store.take(routes, owner).await.expect("take")
}

async fn acceptance_queues_the_operation_with_its_request(backend: Backend) {
    let store = open(&backend).await;
    let s = key("async-1");
    let r = accept_req(&s, 1);
    let c = claim(&store, &r).await;
    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation, rec.claim_token), (State::Queued, c.generation, r.claim_token));
    assert_eq!(c.lease_expires_at, rec.created_at, "an acceptance has no lease: its claim carries the time it was accepted");
    assert_eq!(rec.operation_id.as_deref(), Some("op_async-1"));
    assert_eq!((rec.attempts, rec.lease_expires_at, rec.sent_at), (0, None, None));
    assert!(rec.next_attempt_at.is_some(), "due at once");
    // The same request again: the record, untouched (the gateway answers the same 202).
    let (seen, now) = existing(&store, &accept_req(&s, 1)).await;
    assert_eq!(seen, rec);
    assert_eq!(record::decide(&seen, &fp(1), now), record::Decision::Accepted);
    assert_eq!(record::decide(&seen, &fp(2), now), record::Decision::Mismatch);
    // A synchronous request with the same key gets the acceptance too, never a second execution.
    let (seen, _) = existing(&store, &req(&s, 1, LONG, true)).await;
    assert_eq!(seen, rec);
    // Looked up by id within its tenant only.
    assert_eq!(store.operation("acme", "op_async-1").await.unwrap().map(|(r, _)| r), Some(rec.clone()));
    assert_eq!(store.operation("other-tenant", "op_async-1").await.unwrap(), None);
    assert_eq!(store.operation("acme", "op_nope").await.unwrap(), None);
    // The stored request comes back byte for byte to the worker that takes it.
    let t = take(&store, &[worker_route("create_order", LONG)], "w1").await.expect("a due operation");
    assert_eq!(t.request, Bytes::from_static(b"stored request"));
    assert_eq!((t.record.state, t.record.attempts, t.record.owner.as_str()), (State::Processing, 1, "w1"));
    assert!(t.claim.generation > c.generation, "taking draws a new generation");
    assert_eq!(row(&store, &s).await, t.record);
    // A worker of another operation takes nothing.
    let other = key("async-2");
    claim(&store, &accept_req(&other, 1)).await;
    assert!(take(&store, &[worker_route("another_op", LONG)], "w2").await.is_none());
}

async fn racing_workers_take_one_operation_once_each_under_a_new_generation(backend: Backend) {
    const N: usize = 16;
    let store = open(&backend).await;
    let mut accepted = Vec::new();
    for i in 0..3 {
        accepted.push(claim(&store, &accept_req(&key(&format!("race-{i}")), 1)).await);
    }
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for i in 0..N {
        let (store, barrier) = (store.clone(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            store.take(&[worker_route("create_order", LONG)], &format!("worker-{i}")).await.expect("take")
        }));
    }
    let mut taken = Vec::new();
    for t in tasks {
        taken.extend(t.await.unwrap());
    }
    assert_eq!(taken.len(), 3, "each operation taken exactly once");
    let keys: BTreeSet<String> = taken.iter().map(|t| t.record.scope.key.as_str().to_owned()).collect();
    assert_eq!(keys.len(), 3);
    let generations: BTreeSet<Generation> = taken.iter().map(|t| t.claim.generation).collect();
    assert_eq!(generations.len(), 3, "never two holders of one generation");
    for t in &taken {
        let r = row(&store, &t.record.scope).await;
        assert_eq!((r.state, r.generation, r.claim_token), (State::Processing, t.claim.generation, t.claim.claim_token));
    }
}

/// One take draws for several idle workers (on Citus one operation per
/// take): oldest first, each operation once, each with its own generation and
/// token. Their `mark_sent`s, sent at once (on PostgreSQL they share one
/// statement), are fenced each by its own attempt.
async fn a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each(backend: Backend) {
    const N: usize = 9;
    let store = open(&backend).await;
    let citus = matches!(backend, Backend::Citus { .. });
    let routes = [worker_route("create_order", LONG)];
    let mut accepted = Vec::new();
    for i in 0..N {
        let s = key(&format!("many-{i}"));
        claim(&store, &accept_req(&s, 1)).await;
        accepted.push(s.key.as_str().to_owned());
    }
    // The first take: the three oldest, in order.
    let first = store.take_up_to(&routes, "w0", 3).await.expect("take");
    let keys: Vec<&str> = first.iter().map(|t| t.record.scope.key.as_str()).collect();
    if citus {
        assert_eq!(keys, &accepted[..1], "one per take on Citus");
    } else {
        assert_eq!(keys, &accepted[..3], "the oldest due, oldest first");
    }
    // Racing takes of up to four drain the rest: nothing taken twice.
    let mut tasks = Vec::new();
    for w in 1..=4 {
        let (store, routes) = (store.clone(), routes.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = store.take_up_to(&routes, &format!("w{w}"), 4).await.expect("take");
                assert!(got.len() <= 4);
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got);
            }
        }));
    }
    let mut taken = first;
    for t in tasks {
        taken.extend(t.await.unwrap());
    }
    let keys: BTreeSet<&str> = taken.iter().map(|t| t.record.scope.key.as_str()).collect();
    assert_eq!((taken.len(), keys.len()), (N, N), "every operation taken exactly once");
    let generations: BTreeSet<Generation> = taken.iter().map(|t| t.claim.generation).collect();
    let tokens: BTreeSet<Uuid> = taken.iter().map(|t| t.claim.claim_token).collect();
    assert_eq!((generations.len(), tokens.len()), (N, N), "a generation and a token of its own each");
    for t in &taken {
        let r = row(&store, &t.record.scope).await;
        assert_eq!((r.state, r.generation, r.claim_token, r.attempts), (State::Processing, t.claim.generation, t.claim.claim_token, 1));
        assert_eq!(r, t.record);
    }
    // Every taken attempt sends at once, and two that must not: one under a
    // generation that is not the record's, one whose lease ran out.
    let stale = key("many-stale");
    claim(&store, &accept_req(&stale, 1)).await;
    let short = take(&store, &[worker_route("create_order", SHORT)], "w5").await.expect("due");
    tokio::time::sleep(PAST_SHORT).await;
    let mut forged = taken[N / 2].claim.clone();
    forged.generation = Generation(forged.generation.0 + 1_000_000);
    let mut claims: Vec<Claim> = taken.iter().map(|t| t.claim.clone()).collect();
    claims.push(forged);
    claims.push(short.claim.clone());
    let sent = futures_util::future::join_all(claims.iter().map(|c| store.mark_sent(c, AT_UPSTREAM))).await;
    for (i, (c, outcome)) in claims.iter().zip(&sent).enumerate() {
        let expected = if i < N { WriteOutcome::Written } else { WriteOutcome::Fenced };
        assert_eq!(outcome.as_ref().expect("mark_sent"), &expected, "{}", c.scope.key.as_str());
    }
    for t in &taken {
        assert!(row(&store, &t.record.scope).await.sent_at.is_some(), "sent: {}", t.record.scope.key.as_str());
    }
    assert_eq!(row(&store, &stale).await.sent_at, None, "a lease that ran out does not send");
}

async fn a_worker_whose_lease_was_taken_over_cannot_act(backend: Backend) {
    let store = open(&backend).await;
    let s = key("paused");
    claim(&store, &accept_req(&s, 1)).await;
    let routes_short = [worker_route("create_order", SHORT)];
    let a = take(&store, &routes_short, "worker-a").await.unwrap();
    // Worker A is paused past its lease before sending; the reaper re-queues
    // the operation (it never sent), and worker B takes it over.
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 0, requeued: 1 });
    let b = take(&store, &[worker_route("create_order", LONG)], "worker-b").await.unwrap();
    assert!(b.claim.generation > a.claim.generation);
    let held = row(&store, &s).await;
    // A wakes up: nothing it tries applies.
    assert_eq!(store.heartbeat(&a.claim, LONG).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.mark_sent(&a.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.complete(&a.claim, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.requeue(&a.claim, Duration::ZERO, RetryNote::default()).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.fail(&a.claim, Retention::For(LONG), RetryNote::default()).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.mark_unknown(&a.claim).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, held, "B's attempt is untouched");
    // B heartbeats, sends and completes.
    assert_eq!(store.heartbeat(&b.claim, LONG).await.unwrap(), WriteOutcome::Written);
    assert_eq!(store.mark_sent(&b.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    assert!(row(&store, &s).await.sent_at.is_some());
    assert_eq!(store.complete(&b.claim, &response(201, b"done"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    let done = row(&store, &s).await;
    assert_eq!((done.state, done.attempts, done.response), (State::Completed, 2, Some(response(201, b"done"))));
    assert_eq!(done.operation_id.as_deref(), Some("op_paused"), "the id survives every attempt");
    // A worker whose lease ran out (not yet reaped) must not send.
    let late = key("late-sender");
    claim(&store, &accept_req(&late, 1)).await;
    let l = take(&store, &routes_short, "worker-c").await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.mark_sent(&l.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &late).await.sent_at, None);
}

async fn lease_expiry_requeues_what_was_never_sent_or_may_run_again(backend: Backend) {
    let store = open(&backend).await;
    let (sent, unsent, dedup) =
        (key("sent"), scope("acme", "billing", "create_order", "unsent"), scope("acme", "billing", "charge", "dedup"));
    for s in [&sent, &unsent, &dedup] {
        claim(&store, &accept_req(s, 1)).await;
    }
    // Leases of a second, not SHORT: the live-lease checks below must not
    // see a lease run out on a loaded machine (with 150 ms they did).
    let lease = Duration::from_secs(1);
    let routes = [worker_route("create_order", lease), worker_route("charge", lease)];
    let mut held = Vec::new();
    while let Some(t) = take(&store, &routes, "w").await {
        if t.record.scope != unsent {
            assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
        }
        held.push(t);
    }
    assert_eq!(held.len(), 3);
    // A live lease is left alone.
    assert_eq!(store.reap_leases(10, &["charge".into()]).await.unwrap(), Reaped::default());
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    // `charge` deduplicates upstream: its sent attempt may run again.
    assert_eq!(store.reap_leases(10, &["charge".into()]).await.unwrap(), Reaped { unknown: 1, requeued: 2 });
    assert_eq!(row(&store, &sent).await.state, State::Unknown, "sent to an upstream that does not deduplicate");
    for s in [&unsent, &dedup] {
        let r = row(&store, s).await;
        assert_eq!((r.state, r.lease_expires_at, r.sent_at), (State::Queued, None, None), "{s:?}");
    }
    assert!(row(&store, &dedup).await.maybe_executed, "re-queued although sent: it may have executed");
    assert!(!row(&store, &unsent).await.maybe_executed);
    // The re-queued ones are due at once and taken again, attempt 2.
    let again = take(&store, &routes, "w2").await.unwrap();
    assert_eq!(again.record.attempts, 2);
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped::default(), "nothing else expired");
    // One that may have executed never ends failed_retryable: used-up retries end unknown.
    while let Some(t) = take(&store, &routes, "w3").await {
        let ended = store.fail(&t.claim, Retention::For(LONG), RetryNote::default()).await.unwrap();
        assert_eq!(ended, WriteOutcome::Written);
        let expected = if t.record.maybe_executed { State::Unknown } else { State::FailedRetryable };
        assert_eq!(row(&store, &t.record.scope).await.state, expected, "{:?}", t.record.scope);
    }
    let again_sent = row(&store, &again.record.scope).await;
    store.fail(&again.claim, Retention::For(LONG), RetryNote { last_status: None, maybe_executed: true }).await.unwrap();
    assert_eq!(row(&store, &again.record.scope).await.state, State::Unknown, "this attempt's answer was lost: unknown ({again_sent:?})");
}

async fn retries_wait_their_backoff_then_fail_and_are_swept_after_retention(backend: Backend) {
    let store = open(&backend).await;
    let s = key("retried");
    claim(&store, &accept_req(&s, 1)).await;
    let routes = [worker_route("create_order", LONG)];
    let t1 = take(&store, &routes, "w").await.unwrap();
    let busy = RetryNote { last_status: Some(503), maybe_executed: false };
    assert_eq!(store.requeue(&t1.claim, Duration::from_millis(400), busy).await.unwrap(), WriteOutcome::Written);
    let queued = row(&store, &s).await;
    assert_eq!((queued.state, queued.last_status, queued.lease_expires_at), (State::Queued, Some(503), None));
    assert!(take(&store, &routes, "w").await.is_none(), "not due before its backoff");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t2 = take(&store, &routes, "w").await.expect("due after the backoff");
    assert_eq!(t2.record.attempts, 2);
    // Used up: failed_retryable, kept for the retention, then swept.
    assert_eq!(
        store.fail(&t2.claim, Retention::For(SHORT), RetryNote { last_status: Some(429), maybe_executed: false }).await.unwrap(),
        WriteOutcome::Written
    );
    let failed = row(&store, &s).await;
    assert_eq!((failed.state, failed.last_status), (State::FailedRetryable, Some(429)));
    let (seen, now) = existing(&store, &accept_req(&s, 1)).await;
    assert_eq!(record::decide(&seen, &fp(1), now), record::Decision::Accepted, "within retention: the same operation");
    assert_eq!(store.complete(&t2.claim, &response(201, b"late"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    tokio::time::sleep(PAST_SHORT).await;
    // Past retention a retry starts a new operation (new id), before or after the sweep.
    let fresh = key("retried-again");
    claim(&store, &accept_req(&fresh, 1)).await;
    let f = take(&store, &routes, "w").await.unwrap();
    store.fail(&f.claim, Retention::For(SHORT), RetryNote::default()).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    let mut renewed = accept_req(&fresh, 1);
    renewed.acceptance.as_mut().unwrap().operation_id = "op_renewed".into();
    let c = claim(&store, &renewed).await;
    assert!(c.took_over);
    assert_eq!(row(&store, &fresh).await.operation_id.as_deref(), Some("op_renewed"));
    assert_eq!(store.sweep(10).await.unwrap(), 1, "the expired failed operation is swept");
    assert_eq!(get(&store, &s).await, None);
}

/// A re-queue of an attempt that may have executed (an `upstream_idempotent`
/// route's retry after a lost answer) records that fact and waits its
/// backoff like any other retry.
async fn a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff(backend: Backend) {
    let store = open(&backend).await;
    let s = key("requeued-maybe");
    claim(&store, &accept_req(&s, 1)).await;
    let routes = [worker_route("create_order", LONG)];
    let t1 = take(&store, &routes, "w").await.unwrap();
    assert_eq!(store.mark_sent(&t1.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    let lost = RetryNote { last_status: Some(504), maybe_executed: true };
    assert_eq!(store.requeue(&t1.claim, Duration::from_millis(400), lost).await.unwrap(), WriteOutcome::Written);
    let queued = row(&store, &s).await;
    assert_eq!((queued.state, queued.last_status, queued.sent_at), (State::Queued, Some(504), None));
    assert!(queued.maybe_executed, "the lost answer is remembered");
    assert!(take(&store, &routes, "w").await.is_none(), "not due before its backoff");
}

async fn stats_count_records_that_are_not_completed(backend: Backend) {
    let store = open(&backend).await;
    claim(&store, &accept_req(&key("q1"), 1)).await;
    claim(&store, &accept_req(&key("q2"), 1)).await;
    let u = claim(&store, &req(&scope("acme", "billing", "refund", "u"), 1, LONG, false)).await;
    store.mark_unknown(&u).await.unwrap();
    let d = claim(&store, &req(&key("done"), 1, LONG, false)).await;
    store.complete(&d, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
    let before = store.now().await.unwrap();
    let mut stats: Vec<(String, State, i64)> = store.stats().await.unwrap().into_iter().map(|c| (c.operation, c.state, c.count)).collect();
    stats.sort_by_key(|(o, s, _)| (o.clone(), s.as_str()));
    assert_eq!(stats, vec![("create_order".into(), State::Queued, 2), ("refund".into(), State::Unknown, 1)]);
    for c in store.stats().await.unwrap() {
        assert!(c.oldest_created_at <= before && c.oldest_updated_at <= before);
    }
}

async fn unknown_records_are_counted_by_age_in_one_grouped_count(backend: Backend) {
    let store = open(&backend).await;
    let unknown = |k: &str| {
        let (store, k) = (&store, k.to_owned());
        async move {
            let c = claim(store, &req(&key(&k), 1, LONG, false)).await;
            store.mark_unknown(&c).await.unwrap();
        }
    };
    let bounds = [Duration::from_millis(400), Duration::from_secs(3600)];
    assert_eq!(store.unknown_by_age(&bounds).await.unwrap(), vec![0, 0, 0], "nothing unknown yet");
    unknown("old-1").await;
    unknown("old-2").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    unknown("young").await;
    // Neither an in-flight nor a completed record is counted.
    claim(&store, &req(&key("in-flight"), 1, LONG, false)).await;
    let d = claim(&store, &req(&key("done"), 1, LONG, false)).await;
    store.complete(&d, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
    assert_eq!(store.unknown_by_age(&bounds).await.unwrap(), vec![1, 2, 0]);
    assert_eq!(store.unknown_by_age(&[]).await.unwrap(), vec![3], "no bounds: one bucket");
    assert_eq!(store.unknown_by_age(&[Duration::ZERO]).await.unwrap(), vec![0, 3], "every age reaches zero");
}

async fn records_kept_forever_are_never_taken_over_swept_or_expired(backend: Backend) {
    let store = open(&backend).await;
    let kept = key("kept");
    let c = claim(&store, &req(&kept, 1, SHORT, false)).await;
    assert_eq!(store.complete(&c, &response(201, b"kept"), Retention::Forever).await.unwrap(), WriteOutcome::Written);
    let rec = row(&store, &kept).await;
    assert_eq!((rec.state, rec.expires_at), (State::Completed, Timestamp::FOREVER), "'infinity' reads back as FOREVER");
    let brief = key("brief");
    let c = claim(&store, &req(&brief, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"brief"), Retention::For(SHORT)).await.unwrap();
    // Another operation's forever record, made by an operator's resolution.
    let refund = scope("acme", "billing", "refund", "r1");
    let rc = claim(&store, &req(&refund, 1, LONG, false)).await;
    store.mark_unknown(&rc).await.unwrap();
    let by_hand = Resolution::Complete { response: response(200, b"by hand"), retention: Retention::Forever, force: false };
    assert!(matches!(store.resolve(&refund, &by_hand, &note("found it")).await.unwrap(), ResolveOutcome::Resolved { .. }));
    assert_eq!(row(&store, &refund).await.expires_at, Timestamp::FOREVER);
    // An async operation that failed, kept forever too.
    claim(&store, &accept_req(&key("op"), 1)).await;
    let t = store.take(&[worker_route("create_order", LONG)], "w").await.unwrap().expect("taken");
    assert_eq!(store.fail(&t.claim, Retention::Forever, RetryNote::default()).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &key("op")).await.expires_at, Timestamp::FOREVER);

    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.sweep(100).await.unwrap(), 1, "only the brief record is past retention");
    assert_eq!(get(&store, &brief).await, None);
    assert_eq!(store.reap_leases(100, &[]).await.unwrap(), Reaped::default());
    // Retries are replayed or refused, never taken over, even where the
    // upstream deduplicates; the read side agrees.
    for (hash, decision) in [(1, record::Decision::Replay), (2, record::Decision::Mismatch)] {
        let (found, now) = existing(&store, &req(&kept, hash, LONG, true)).await;
        assert_eq!(found, rec);
        assert_eq!(record::decide(&found, &fp(hash), now), decision);
        assert!(!record::may_take_over(&found, &fp(hash), now, true));
    }
    let mut counts: Vec<(String, i64)> = store.forever_counts().await.unwrap().into_iter().map(|c| (c.operation, c.count)).collect();
    counts.sort();
    assert_eq!(counts, vec![("create_order".into(), 2), ("refund".into(), 1)]);
    let listed = store.list(&ListFilter { forever: true, limit: 100, ..ListFilter::default() }).await.unwrap();
    assert_eq!(key_set(&listed), set(&["kept", "op", "r1"]));
    let one_op = ListFilter { forever: true, operation: Some("refund".into()), limit: 100, ..ListFilter::default() };
    assert_eq!(keys_of(&store.list(&one_op).await.unwrap()), ["r1"]);
}

async fn key_source_is_kept_by_claims_and_take_overs(backend: Backend) {
    let store = open(&backend).await;
    let from = |source: &str, s: &Scope, lease| ClaimRequest { key_source: source.into(), ..req(s, 1, lease, false) };
    // Concurrent claims go through the batched statement on PostgreSQL.
    let scopes: Vec<Scope> = (0..8).map(|i| key(&format!("k{i}"))).collect();
    let claims = futures_util::future::join_all(scopes.iter().map(|s| {
        let r = from(&format!("body:/order/{}", s.key.as_str()), s, SHORT);
        let store = store.clone();
        async move { store.claim(&r).await.unwrap() }
    }))
    .await;
    assert!(claims.iter().all(|c| matches!(c, ClaimOutcome::Claimed(_))));
    for s in &scopes {
        assert_eq!(row(&store, s).await.key_source.as_deref(), Some(format!("body:/order/{}", s.key.as_str()).as_str()));
    }
    // A completed record past retention taken over by a claim from another source.
    let ClaimOutcome::Claimed(c) = &claims[0] else { unreachable!() };
    store.complete(c, &response(201, b"x"), Retention::For(SHORT)).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    let again = claim(&store, &from("header:x-client-order-id", &scopes[0], LONG)).await;
    assert!(again.took_over);
    assert_eq!(row(&store, &scopes[0]).await.key_source.as_deref(), Some("header:x-client-order-id"));
    // Accepted async operations keep it too.
    claim(&store, &ClaimRequest { key_source: "body:/id".into(), ..accept_req(&key("op"), 1) }).await;
    assert_eq!(row(&store, &key("op")).await.key_source.as_deref(), Some("body:/id"));
}

/// Keyset pagination (`keys::list`, the CLI's and the admin API's): pages of
/// any size, concatenated, are the whole list in its order, each record once
/// (records written by one batch share `updated_at`: the primary key breaks
/// the tie), and the last page has no cursor.
async fn list_pages_with_a_cursor_cover_every_record_once(backend: Backend) {
    let store = open(&backend).await;
    // Concurrent claims land in shared batches (equal timestamps).
    let mut claims = Vec::new();
    for i in 0..23 {
        let store = store.clone();
        let s = scope("acme", if i % 3 == 0 { "p0" } else { "p1" }, "create_order", &format!("k{i:02}"));
        claims.push(tokio::spawn(async move { claim(&store, &req(&s, 1, LONG, false)).await }));
    }
    for c in claims {
        c.await.unwrap();
    }
    let whole = keys_of(&store.list(&ListFilter { limit: 1000, ..ListFilter::default() }).await.unwrap());
    assert_eq!(whole.len(), 23);
    for size in [1, 5, 10, 23, 50] {
        let mut seen = Vec::new();
        let mut filter = ListFilter { limit: size, ..ListFilter::default() };
        loop {
            let page = idemgate::ops::keys::list(&store, &filter).await.unwrap();
            assert!(page.records.len() <= size as usize);
            seen.extend(keys_of(&page.records));
            match page.next_cursor {
                Some(c) => filter.cursor = Some(idemgate::ops::keys::decode_cursor(&c).unwrap()),
                None => break,
            }
        }
        assert_eq!(seen, whole, "pages of {size}");
    }
    // Filters apply on every page.
    let first =
        idemgate::ops::keys::list(&store, &ListFilter { limit: 3, state: Some(State::InFlight), ..ListFilter::default() }).await.unwrap();
    let cursor = idemgate::ops::keys::decode_cursor(first.next_cursor.as_deref().unwrap()).unwrap();
    let filter = ListFilter { limit: 100, tenant: Some("acme".into()), cursor: Some(cursor), ..ListFilter::default() };
    let rest = idemgate::ops::keys::list(&store, &filter).await.unwrap();
    assert_eq!(rest.records.len(), 20);
    assert!(rest.next_cursor.is_none());
    assert!(idemgate::ops::keys::decode_cursor("not a cursor").is_err());
}

fn probe_route(operation: &str, settle: Duration) -> ProbeRoute {
    ProbeRoute { operation: operation.into(), settle, at_upstream: Duration::ZERO }
}

/// A synchronous attempt that timed out: `unknown`. Its claim's lease
/// (`SHORT`) bounds its time at the upstream: probes take it once that has
/// run out (sleep `PAST_SHORT`).
async fn unknown(store: &Store, s: &Scope) -> Claim {
    let c = claim(store, &req(s, 1, SHORT, false)).await;
    store.mark_unknown(&c).await.unwrap();
    c
}

/// The reconciler's protocol: only `unknown` records of probed operations,
/// settled, due and not marked by a live probe are taken; a taken record is
/// marked (nobody else takes it until the hold runs out); its result write
/// needs the record unknown, at the generation probed, still marked by the
/// probe; an inconclusive probe backs it off; a new life starts afresh.
async fn probes_take_due_unknown_records_and_their_writes_are_fenced(backend: Backend) {
    let store = open(&backend).await;
    let routes = [probe_route("create_order", Duration::ZERO)];
    let by_probe = AuditNote { actor: Actor::Reconciler, reason: "probe".into(), forced: false, caller: None };
    let complete = Resolution::Complete { response: response(201, b"found"), retention: Retention::For(LONG), force: false };
    let (u1, u2) = (key("u1"), key("u2"));
    let c1 = unknown(&store, &u1).await;
    unknown(&store, &u2).await;
    claim(&store, &req(&key("live"), 1, LONG, false)).await;
    unknown(&store, &scope("acme", "billing", "not_probed", "u")).await;
    // Their claims' leases bound their attempts: wait them out.
    tokio::time::sleep(PAST_SHORT).await;

    // Not settled yet: nothing.
    assert!(store.take_probes(&[probe_route("create_order", LONG)], LONG, 10).await.unwrap().is_empty());
    let taken = store.take_probes(&routes, LONG, 10).await.unwrap();
    assert_eq!(key_set(&taken.iter().map(|t| t.record.clone()).collect::<Vec<_>>()), set(&["u1", "u2"]));
    assert!(taken.iter().all(|t| t.attempts == 0 && t.fence.generation == t.record.generation));
    assert_eq!(taken.iter().find(|t| t.record.scope == u1).unwrap().fence.generation, c1.generation);
    // Marked: a second taker gets nothing.
    assert!(store.take_probes(&routes, LONG, 10).await.unwrap().is_empty());
    let f1 = taken.iter().find(|t| t.record.scope == u1).unwrap().fence;
    let f2 = taken.iter().find(|t| t.record.scope == u2).unwrap().fence;

    // Inconclusive: due again after the backoff, with the attempt counted.
    assert_eq!(store.probe_failed(&u1, f1, SHORT, "probe answered 503").await.unwrap(), WriteOutcome::Written);
    assert!(store.take_probes(&routes, LONG, 10).await.unwrap().is_empty(), "backing off");
    tokio::time::sleep(PAST_SHORT).await;
    let again = store.take_probes(&routes, LONG, 10).await.unwrap();
    assert_eq!(keys_of(&again.iter().map(|t| t.record.clone()).collect::<Vec<_>>()), ["u1"]);
    assert_eq!(again[0].attempts, 1);
    let f1b = again[0].fence;
    assert_ne!(f1b.token, f1.token);
    // The first probe's mark is gone: its writes are fenced off.
    assert_eq!(store.resolve_probed(&u1, &complete, &by_probe, f1).await.unwrap(), ResolveOutcome::Refused(TransitionError::Fenced));
    assert_eq!(store.probe_failed(&u1, f1, SHORT, "probe answered 503").await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.resolve_probed(&u1, &complete, &by_probe, f1b).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });
    assert_eq!(row(&store, &u1).await.state, State::Completed);
    assert_eq!(
        store.resolve_probed(&u1, &RELEASE, &by_probe, f1b).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::Fenced),
        "once"
    );

    // An operator's resolution in between wins.
    assert_eq!(store.resolve(&u2, &RELEASE, &note("checked by hand")).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });
    assert_eq!(store.resolve_probed(&u2, &complete, &by_probe, f2).await.unwrap(), ResolveOutcome::NotFound);
    assert_eq!(store.probe_failed(&u2, f2, SHORT, "probe answered 503").await.unwrap(), WriteOutcome::Fenced);
    // A new life of the key (claimed again, unknown again): the old probe
    // cannot write to it, and it is due at once.
    let c2 = unknown(&store, &u2).await;
    assert_eq!(store.resolve_probed(&u2, &complete, &by_probe, f2).await.unwrap(), ResolveOutcome::Refused(TransitionError::Fenced));
    tokio::time::sleep(PAST_SHORT).await;
    let fresh = store.take_probes(&routes, LONG, 10).await.unwrap();
    assert_eq!((fresh.len(), fresh[0].record.generation, fresh[0].attempts), (1, c2.generation, 0));

    // A probe whose hold ran out (its replica died): another takes it, and
    // the first one's late write is fenced off.
    let u3 = key("u3");
    unknown(&store, &u3).await;
    tokio::time::sleep(PAST_SHORT).await;
    let first = store.take_probes(&routes, SHORT, 10).await.unwrap();
    assert_eq!(keys_of(&first.iter().map(|t| t.record.clone()).collect::<Vec<_>>()), ["u3"]);
    tokio::time::sleep(PAST_SHORT).await;
    let second = store.take_probes(&routes, LONG, 10).await.unwrap();
    assert_eq!(keys_of(&second.iter().map(|t| t.record.clone()).collect::<Vec<_>>()), ["u3"]);
    assert_eq!(
        store.resolve_probed(&u3, &RELEASE, &by_probe, first[0].fence).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::Fenced)
    );
    assert_eq!(
        store.resolve_probed(&u3, &RELEASE, &by_probe, second[0].fence).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Unknown }
    );

    // What the trail shows: the two probe resolutions and the operator's.
    let trail: Vec<_> =
        store.audit(10).await.unwrap().into_iter().map(|a| (a.actor, a.scope.key.as_str().to_owned(), a.to_state)).collect();
    assert_eq!(
        trail,
        vec![
            ("reconciler".to_owned(), "u3".to_owned(), "released".to_owned()),
            ("cli".to_owned(), "u2".to_owned(), "released".to_owned()),
            ("reconciler".to_owned(), "u1".to_owned(), "completed".to_owned()),
        ]
    );
}

/// Two reconcilers taking at once never take one record both.
async fn racing_reconcilers_take_each_record_once(backend: Backend) {
    let store = open(&backend).await;
    for i in 0..30 {
        unknown(&store, &key(&format!("r{i:02}"))).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    let routes = [probe_route("create_order", Duration::ZERO)];
    let taker = |store: Store| {
        let routes = routes.clone();
        tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = store.take_probes(&routes, LONG, 4).await.unwrap();
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.into_iter().map(|t| t.record.scope.key.as_str().to_owned()));
            }
        })
    };
    let (a, b) = (taker(store.clone()), taker(open(&backend).await));
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    let (sa, sb): (BTreeSet<_>, BTreeSet<_>) = (a.iter().cloned().collect(), b.iter().cloned().collect());
    assert_eq!(sa.len() + sb.len(), 30, "a: {a:?}\nb: {b:?}");
    assert!(sa.is_disjoint(&sb), "a: {a:?}\nb: {b:?}");
}

// ---------------------------------------------------------------------------
// The outbox (CONTRACT section 9), on both stores

fn events_config(include_body: bool) -> EventsConfig {
    EventsConfig {
        url: "http://127.0.0.1:9/hook".parse().unwrap(),
        secret: None,
        timeout: Duration::from_secs(1),
        max_attempts: 3,
        emit: EventType::ALL.to_vec(),
        include_key: false,
        include_body,
        batch: 1,
    }
}

/// A store whose `create_order` and `charge` operations emit events (charge with bodies).
async fn open_with_events(backend: &Backend) -> Store {
    let (plain, with_body) = (events_config(false), events_config(true));
    let (op, charge): (Arc<str>, Arc<str>) = ("create_order".into(), "charge".into());
    open(backend).await.with_events(EventPolicies::new([(&op, &plain), (&charge, &with_body)]))
}

async fn all_events(store: &Store) -> Vec<OutboxEvent> {
    store.events(None, 1000).await.expect("events")
}

async fn final_state_changes_write_their_events_and_nothing_else_does(backend: Backend) {
    let store = open_with_events(&backend).await;
    // Completed by its attempt.
    let done = key("done");
    let c = claim(&store, &req(&done, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"order"), Retention::For(LONG)).await.unwrap();
    // Unknown by its attempt.
    let lost = key("lost");
    let c = claim(&store, &req(&lost, 1, LONG, false)).await;
    store.mark_unknown(&c).await.unwrap();
    // Released by its attempt (upstream refused): not a final state, no event.
    let refused = key("refused");
    let c = claim(&store, &req(&refused, 1, LONG, false)).await;
    store.release(&c).await.unwrap();
    // An operation without [routes.events]: nothing.
    let quiet = scope("acme", "billing", "quiet_op", "q");
    let c = claim(&store, &req(&quiet, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
    // Resolutions by an operator.
    let n = AuditNote { actor: Actor::Admin, reason: "checked".into(), forced: false, caller: None };
    store.resolve(&lost, &Resolution::Release { force: false }, &n).await.unwrap();
    // Lease expired in flight, reaped.
    let reaped = key("reaped");
    claim(&store, &req(&reaped, 1, SHORT, false)).await;
    // Async: failed, and failed after an attempt that may have run (unknown).
    let failed = scope("acme", "billing", "charge", "failed");
    claim(&store, &accept_req(&failed, 1)).await;
    let t = take(&store, &[worker_route("charge", LONG)], "w").await.unwrap();
    store.fail(&t.claim, Retention::For(LONG), RetryNote { last_status: Some(503), maybe_executed: false }).await.unwrap();
    let charged = scope("acme", "billing", "charge", "charged");
    claim(&store, &accept_req(&charged, 1)).await;
    let t = take(&store, &[worker_route("charge", LONG)], "w").await.unwrap();
    store.complete(&t.claim, &response(200, b"receipt"), Retention::For(LONG)).await.unwrap();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.reap_leases(10, &[]).await.unwrap().unknown, 1);

    let events = all_events(&store).await;
    let summary: Vec<(&str, &str, Option<u16>, Option<&str>)> =
        events.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str(), e.status, e.actor.as_deref())).collect();
    assert_eq!(
        summary,
        vec![
            ("done", "completed", Some(201), None),
            ("lost", "unknown", None, None),
            ("lost", "released", None, Some("admin")),
            ("failed", "failed_retryable", Some(503), None),
            ("charged", "completed", Some(200), None),
            ("reaped", "unknown", None, None),
        ]
    );
    assert!(events.iter().all(|e| e.delivery == Delivery::Pending && e.attempts == 0));
    let ids: BTreeSet<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(ids.len(), events.len(), "every event has its own id");
    assert_eq!(events[0].generation, Some(row(&store, &done).await.generation));
    assert!(events[1].generation.is_some());
    assert_eq!(events[2].generation, events[1].generation, "released: names the generation released");
    assert_eq!(events[0].body, None, "create_order events carry no body");
    assert_eq!(events[4].body.as_deref(), Some(&b"receipt"[..]), "charge events carry the body (include_body)");
    assert_eq!(events[4].operation_id.as_deref(), Some("op_charged"));
    assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));
}

async fn a_change_and_its_event_commit_or_fail_together(backend: Backend) {
    let store = open_with_events(&backend).await;
    let s = key("atomic");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    let before = row(&store, &s).await;
    // Make every event insert fail, from outside the store.
    let (fail, heal) = match &backend {
        // (On Citus the test cluster allows triggers on distributed tables.)
        Backend::Citus { .. } => (
            "CREATE FUNCTION idemgate_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$;
             CREATE TRIGGER idemgate_test_fail BEFORE INSERT ON idemgate_events FOR EACH ROW EXECUTE FUNCTION idemgate_test_fail();",
            "DROP TRIGGER idemgate_test_fail ON idemgate_events; DROP FUNCTION idemgate_test_fail();",
        ),
        // PostgreSQL writes its events to the log.
        Backend::Postgres { .. } | Backend::Pooled { .. } => (
            "CREATE FUNCTION idemgate_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'injected'; END $$;
             CREATE TRIGGER idemgate_test_fail BEFORE INSERT ON idemgate_event_log FOR EACH ROW EXECUTE FUNCTION idemgate_test_fail();",
            "DROP TRIGGER idemgate_test_fail ON idemgate_event_log; DROP FUNCTION idemgate_test_fail();",
        ),
        Backend::Sqlite { .. } => (
            "CREATE TRIGGER idemgate_test_fail BEFORE INSERT ON idemgate_events BEGIN SELECT RAISE(ABORT, 'injected'); END;",
            "DROP TRIGGER idemgate_test_fail;",
        ),
    };
    raw_sql(&backend, fail).await;
    let out = store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await;
    assert!(out.is_err(), "the change fails with its event: {out:?}");
    assert_eq!(row(&store, &s).await, before, "no state change without its event");
    let u = claim(&store, &req(&key("atomic-u"), 1, LONG, false)).await;
    assert!(store.mark_unknown(&u).await.is_err());
    assert_eq!(row(&store, &key("atomic-u")).await.state, State::InFlight);
    raw_sql(&backend, heal).await;
    assert!(all_events(&store).await.is_empty(), "no event without its change");
    // Healed: both commit together.
    assert_eq!(store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &s).await.state, State::Completed);
    assert_eq!(all_events(&store).await.len(), 1);
}

/// Runs SQL against the backend's database from outside the store.
async fn raw_sql(backend: &Backend, sql: &str) {
    match backend {
        Backend::Postgres { url } | Backend::Citus { url } | Backend::Pooled { direct: url, .. } => {
            let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
            let task = tokio::spawn(conn);
            if matches!(backend, Backend::Citus { .. }) {
                // Citus propagates DDL statement by statement, not from a
                // multi-statement query: one statement per line, or per
                // `; ` outside a function body.
                for line in sql.lines().filter(|l| !l.trim().is_empty()) {
                    let statements: Vec<&str> = if line.contains("$$") { vec![line] } else { line.split("; ").collect() };
                    for statement in statements {
                        client.batch_execute(statement).await.expect("raw sql");
                    }
                }
            } else {
                client.batch_execute(sql).await.expect("raw sql");
            }
            drop(client);
            let _ = task.await;
        }
        Backend::Sqlite { path, .. } => {
            let conn = rusqlite::Connection::open(path).expect("open sqlite");
            conn.busy_timeout(Duration::from_secs(5)).unwrap();
            conn.execute_batch(sql).expect("raw sql");
        }
    }
}

async fn relays_hold_each_event_alone_in_order_per_scope(backend: Backend) {
    let store = open_with_events(&backend).await;
    let (a, b) = (key("a"), key("b"));
    // Two events of scope a (unknown, then released), one of scope b.
    let c = claim(&store, &req(&a, 1, LONG, false)).await;
    store.mark_unknown(&c).await.unwrap();
    let c = claim(&store, &req(&b, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"b"), Retention::For(LONG)).await.unwrap();
    let n = AuditNote { actor: Actor::Cli, reason: "r".into(), forced: false, caller: None };
    store.resolve(&a, &Resolution::Release { force: false }, &n).await.unwrap();
    let ops = ["create_order"];
    let (r1, r2) = (Uuid::new_v4(), Uuid::new_v4());
    let first = store.take_events(&ops, 10, LONG, r1).await.unwrap();
    let taken: Vec<(&str, &str)> = first.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str())).collect();
    assert_eq!(taken, vec![("a", "unknown"), ("b", "completed")], "a's second event waits for its first");
    assert!(store.take_events(&ops, 10, LONG, r2).await.unwrap().is_empty(), "leased events are not taken twice");
    assert!(store.events_delivered(&[first[0].seq], r2).await.unwrap().is_empty(), "only the holder marks it");
    // One statement marks a round's deliveries; a seq not held (or unknown) is left out.
    let marked = store.events_delivered(&[first[0].seq, first[1].seq, i64::MAX], r1).await.unwrap();
    assert_eq!(marked.len(), 2);
    assert!(marked.contains(&first[0].seq) && marked.contains(&first[1].seq));
    assert!(store.events_delivered(&[first[0].seq], r1).await.unwrap().is_empty(), "a sent event is not marked twice");
    let second = store.take_events(&ops, 10, LONG, r2).await.unwrap();
    assert_eq!(second.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str())).collect::<Vec<_>>(), vec![("a", "released")]);
    // A failed delivery backs off; after max attempts the event is parked, not dropped.
    assert!(store.event_failed(second[0].seq, r2, "answered 500", Duration::from_millis(200), false).await.unwrap());
    assert!(store.take_events(&ops, 10, LONG, r2).await.unwrap().is_empty(), "not due before its backoff");
    tokio::time::sleep(PAST_SHORT).await;
    let again = store.take_events(&ops, 10, LONG, r1).await.unwrap();
    assert_eq!((again.len(), again[0].id, again[0].attempts), (1, second[0].id, 1), "the same event, the same id");
    assert!(store.event_failed(again[0].seq, r1, "answered 500", Duration::ZERO, true).await.unwrap());
    let parked = store.events(Some(Delivery::Parked), 10).await.unwrap();
    assert_eq!((parked.len(), parked[0].last_error.as_deref()), (1, Some("answered 500")));
    assert_eq!(store.event_stats().await.unwrap().parked, 1);
    assert!(store.take_events(&ops, 10, LONG, r1).await.unwrap().is_empty(), "parked events are not delivered");
    assert!(store.redeliver(parked[0].id).await.unwrap());
    // A lease that runs out (a relay crashed after delivering) hands the
    // event to another relay, with the same id; the first relay's late mark
    // is fenced.
    let held = store.take_events(&ops, 10, SHORT, r1).await.unwrap();
    assert_eq!((held.len(), held[0].id, held[0].attempts), (1, parked[0].id, 0), "redelivered from its first attempt");
    tokio::time::sleep(PAST_SHORT).await;
    let stolen = store.take_events(&ops, 10, LONG, r2).await.unwrap();
    assert_eq!(stolen.iter().map(|e| e.id).collect::<Vec<_>>(), vec![held[0].id]);
    assert!(store.events_delivered(&[held[0].seq], r1).await.unwrap().is_empty(), "the first relay's late mark is fenced");
    assert_eq!(store.events_delivered(&[held[0].seq], r2).await.unwrap(), vec![held[0].seq]);
    let stats = store.event_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked, stats.oldest_pending_at), (0, 0, None));
    // Delivered events are swept after their retention.
    tokio::time::sleep(PAST_SHORT).await;
    let swept = store.sweep_events(10, SHORT).await.unwrap();
    match backend {
        // The log goes by TRUNCATE of a slot: the count is the table's estimate.
        Backend::Postgres { .. } | Backend::Pooled { .. } => assert!(swept > 0, "{swept}"),
        Backend::Sqlite { .. } | Backend::Citus { .. } => assert_eq!(swept, 3),
    }
    assert!(store.events(None, 10).await.unwrap().is_empty());
}

// ---------------------------------------------------------------------------
// PostgreSQL only: a fault proxy between the Store and the server

/// Store operation timeout for the fault cases: long enough that nothing
/// times out by accident on a busy 2-core machine, short enough to wait for.
const FAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// A fresh database on the shared cluster, and a `Store` (pool of
/// `pool_size`) that reaches it only through a fault proxy.
async fn pg_behind_proxy(pool_size: usize) -> (FaultProxy, Store) {
    let server = pg::shared();
    let direct = server.create_unique_database("conformance").expect("create database");
    let proxy = FaultProxy::start(SocketAddr::from(([127, 0, 0, 1], server.port()))).await;
    let url = direct.replace(&format!("127.0.0.1:{}/", server.port()), &format!("127.0.0.1:{}/", proxy.port()));
    assert_ne!(url, direct);
    let store = open_with(&Backend::Postgres { url }, FAULT_TIMEOUT, pool_size).await;
    (proxy, store)
}

/// The relay reads the log in batches bounded by transaction snapshots: an
/// event whose transaction commits after a later event was delivered (a
/// slow transaction that took its seq first) is still delivered. A relay
/// that kept only the highest seq it delivered would skip it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_event_committed_after_later_ones_were_delivered_is_still_delivered() {
    let url = pg::shared().create_unique_database("conformance").expect("create database");
    let store = open_with_events(&Backend::Postgres { url: url.clone() }).await;
    let (slow, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    // A key in the same lane of the log as "fast" (lanes split by key).
    let slow_key: String = slow
        .query_one(
            "SELECT 'slow-' || g FROM generate_series(1, 1000) g \
             WHERE (hashtextextended('slow-' || g, 0) & 15) = (hashtextextended('fast', 0) & 15) LIMIT 1",
            &[],
        )
        .await
        .expect("a key in the lane")
        .get(0);
    // The slow transaction writes its event first (the smaller seq) and stays open.
    slow.batch_execute("BEGIN").await.unwrap();
    slow.execute(
        "INSERT INTO idemgate_event_log (event_type, tenant, principal, operation, idempotency_key) \
         VALUES ('completed', 'acme', 'billing', 'create_order', $1)",
        &[&slow_key],
    )
    .await
    .unwrap();
    // A later event commits, and a relay delivers it.
    let c = claim(&store, &req(&key("fast"), 1, LONG, false)).await;
    store.complete(&c, &response(201, b"fast"), Retention::For(LONG)).await.unwrap();
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let first = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(first.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec!["fast"]);
    assert_eq!(store.events_delivered(&[first[0].seq], relay).await.unwrap(), vec![first[0].seq]);
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty(), "the slow event is not committed yet");
    assert_eq!(store.event_stats().await.unwrap().pending, 0);
    slow.batch_execute("COMMIT").await.unwrap();
    // Committed now: delivered, although a later seq was delivered before it.
    let late = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(late.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![slow_key.as_str()], "the late commit is delivered");
    assert!(late[0].seq < first[0].seq, "its seq was drawn before the delivered event's");
    assert_eq!(store.event_stats().await.unwrap().pending, 1);
    assert_eq!(store.events_delivered(&[late[0].seq], relay).await.unwrap(), vec![late[0].seq]);
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty());
    let stats = store.event_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked), (0, 0));
    let listed = store.events(Some(Delivery::Sent), 10).await.unwrap();
    assert_eq!(listed.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![late[0].seq, first[0].seq], "both delivered, listed by seq");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_claim_whose_reply_is_lost_is_read_back_as_claimed() {
    let (proxy, store) = pg_behind_proxy(1).await;
    // One pooled connection, with the claim statement already prepared on it,
    // so the next claim's first bytes on the wire are the statement itself.
    claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    assert_eq!(proxy.connections(), 1);
    let s = key("ambiguous");
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_downstream(), 1);
    let started = Instant::now();
    let r = req(&s, 1, LONG, false);
    let out = store.claim(&r).await.expect("the read-back resolves the ambiguity");
    let took = started.elapsed();
    let ClaimOutcome::Claimed(c) = out else { panic!("expected Claimed, got {out:?}") };
    assert!(took >= FAULT_TIMEOUT, "the first reply was lost, so the claim waited for its timeout ({took:?})");
    assert_eq!((c.took_over, c.claim_token), (false, r.claim_token));

    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation, rec.claim_token), (State::InFlight, c.generation, c.claim_token));
    assert!(
        rec.created_at < before.plus(FAULT_TIMEOUT / 2),
        "the row was written by the attempt whose reply was lost ({} vs {before}), not by a retry",
        rec.created_at
    );
    assert_eq!(key_set(&all(&store).await), set(&["warm-up", "ambiguous"]));
    // The broken connection was discarded, not returned to the pool.
    assert!(proxy.wait_connections(1, Duration::from_secs(5)).await, "{} connections", proxy.connections());
    assert_eq!(store.complete(&c, &response(201, b"ok"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_claim_that_never_arrived_is_retried() {
    let (proxy, store) = pg_behind_proxy(1).await;
    claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    let s = key("lost");
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_upstream(), 1);
    let started = Instant::now();
    let r = req(&s, 1, LONG, false);
    let out = store.claim(&r).await.expect("no row on read-back: the claim is retried");
    let took = started.elapsed();
    let ClaimOutcome::Claimed(c) = out else { panic!("expected Claimed, got {out:?}") };
    assert!(took >= FAULT_TIMEOUT, "{took:?}");
    assert_eq!(c.claim_token, r.claim_token);
    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation, rec.claim_token), (State::InFlight, c.generation, c.claim_token));
    assert!(rec.created_at >= before.plus(FAULT_TIMEOUT * 9 / 10), "the row was written by the retry ({} vs {before})", rec.created_at);
    assert_eq!(key_set(&all(&store).await), set(&["warm-up", "lost"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_complete_whose_reply_is_lost_is_read_back_as_written() {
    let (proxy, store) = pg_behind_proxy(1).await;
    // Prepare the complete statement on the one pooled connection.
    let warm = claim(&store, &req(&key("warm-up"), 1, LONG, false)).await;
    store.complete(&warm, &response(200, b"warm"), Retention::For(LONG)).await.unwrap();
    let s = key("ambiguous-complete");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    let before = store.now().await.unwrap();

    assert_eq!(proxy.blackhole_existing_downstream(), 1);
    let started = Instant::now();
    let written = store.complete(&c, &response(201, b"kept"), Retention::For(LONG)).await.expect("the read-back resolves the ambiguity");
    let took = started.elapsed();
    assert_eq!(written, WriteOutcome::Written);
    assert!(took >= FAULT_TIMEOUT, "{took:?}");
    let rec = row(&store, &s).await;
    assert_eq!((rec.state, rec.generation), (State::Completed, c.generation));
    assert_eq!(rec.response, Some(response(201, b"kept")));
    assert!(rec.updated_at < before.plus(FAULT_TIMEOUT / 2), "written by the attempt whose reply was lost");
    // The write happened once: a repeat is fenced, the response is unchanged.
    assert_eq!(store.complete(&c, &response(500, b"again"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(row(&store, &s).await, rec);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_unreachable_store_fails_the_claim_and_writes_nothing() {
    let (proxy, store) = pg_behind_proxy(2).await;
    let s = key("unreachable");
    proxy.set(Fault::Refuse);
    proxy.reset_all();
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await);

    let started = Instant::now();
    let out = store.claim(&req(&s, 1, LONG, false)).await;
    assert!(matches!(out, Err(StoreError::Unavailable(_) | StoreError::Ambiguous(_))), "{out:?}");
    assert!(started.elapsed() < FAULT_TIMEOUT * 4, "failing is bounded: {:?}", started.elapsed());
    assert!(store.get(&s).await.is_err());
    assert!(store.ping().await.is_err());

    proxy.set(Fault::None);
    assert_eq!(get(&store, &s).await, None, "nothing was committed");
    assert_eq!(all(&store).await.len(), 0);
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    assert!(!c.took_over, "the same Store works once the store is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_hung_store_fails_the_claim_within_its_timeout_and_writes_nothing() {
    let (proxy, store) = pg_behind_proxy(2).await;
    let s = key("hung");
    proxy.set(Fault::BlackholeUpstream);
    let started = Instant::now();
    let out = store.claim(&req(&s, 1, LONG, false)).await;
    let took = started.elapsed();
    // The claim timed out and so did its read-back: the outcome cannot be known.
    assert!(matches!(out, Err(StoreError::Ambiguous(_))), "{out:?}");
    assert!(took >= FAULT_TIMEOUT && took < FAULT_TIMEOUT * 4, "{took:?}");

    proxy.set(Fault::None);
    assert_eq!(get(&store, &s).await, None, "no statement reached the server");
    let c = claim(&store, &req(&s, 1, LONG, false)).await;
    assert!(!c.took_over, "a first claim: nothing was there to take over");
    assert_eq!(key_set(&all(&store).await), set(&["hung"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_restart_is_survived_by_the_same_store() {
    let mut server = tokio::task::spawn_blocking(PgServer::start).await.unwrap().expect("start private cluster");
    let url = server.create_database("conformance").expect("create database");
    let store = open_with(&Backend::Postgres { url }, Duration::from_secs(2), 4).await;
    let first = key("before-crash");
    let c1 = claim(&store, &req(&first, 1, LONG, false)).await;

    let mut server = tokio::task::spawn_blocking(move || server.stop_immediate().map(|()| server)).await.unwrap().expect("stop_immediate");
    let down = store.claim(&req(&key("while-down"), 1, LONG, false)).await;
    assert!(matches!(down, Err(StoreError::Unavailable(_) | StoreError::Ambiguous(_))), "{down:?}");
    assert!(store.ping().await.is_err());

    let server = tokio::task::spawn_blocking(move || server.start_again().map(|()| server)).await.unwrap().expect("start_again");
    // The same Store, not recreated: dead pooled connections are dropped and
    // the first operation after the restart succeeds.
    let second = key("after-restart");
    let c2 = claim(&store, &req(&second, 1, LONG, false)).await;
    assert!(c2.generation > c1.generation, "the generation sequence survived the restart");
    let rec = row(&store, &first).await;
    assert_eq!(
        (rec.state, rec.generation, rec.claim_token),
        (State::InFlight, c1.generation, c1.claim_token),
        "the committed claim survived"
    );
    assert_eq!(get(&store, &key("while-down")).await, None);
    assert_eq!(store.complete(&c1, &response(201, b"after"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(key_set(&all(&store).await), set(&["before-crash", "after-restart"]));
    drop(server);
}

// ---------------------------------------------------------------------------
// The fault proxy itself, in front of an echo server

async fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

async fn roundtrip(c: &mut TcpStream, msg: &[u8]) -> Vec<u8> {
    c.write_all(msg).await.unwrap();
    let mut buf = vec![0; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut buf)).await.expect("echo within 5s").unwrap();
    buf
}

/// Nothing arrives on `c` within a little while.
async fn silent(c: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    tokio::time::timeout(Duration::from_millis(200), c.read(&mut buf)).await.is_err()
}

fn is_reset<T: std::fmt::Debug>(r: &std::io::Result<T>) -> bool {
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset)
}

/// A connection to `addr` is reset: either while connecting (the RST came
/// before the handshake was seen complete) or on the first read.
async fn refused(addr: SocketAddr) -> bool {
    match TcpStream::connect(addr).await {
        Ok(mut s) => {
            let mut buf = [0u8; 8];
            is_reset(&tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await.expect("reset within 5s"))
        }
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_forwards_delays_and_blackholes() {
    let proxy = FaultProxy::start(echo_server().await).await;
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut c, b"hello").await, b"hello");
    assert_eq!(proxy.connections(), 1);

    proxy.set(Fault::Delay(Duration::from_millis(150)));
    let t = Instant::now();
    assert_eq!(roundtrip(&mut c, b"slow").await, b"slow");
    assert!(t.elapsed() >= Duration::from_millis(300), "delayed each way: {:?}", t.elapsed());

    proxy.set(Fault::BlackholeDownstream);
    c.write_all(b"dropped-down").await.unwrap();
    assert!(silent(&mut c).await);
    proxy.set(Fault::None);
    assert_eq!(roundtrip(&mut c, b"after").await, b"after", "the dropped reply never shows up later");

    proxy.set(Fault::BlackholeUpstream);
    c.write_all(b"dropped-up").await.unwrap();
    assert!(silent(&mut c).await);
    // A connection opened under the fault is affected too.
    let mut fresh = TcpStream::connect(proxy.addr()).await.unwrap();
    fresh.write_all(b"x").await.unwrap();
    assert!(silent(&mut fresh).await);
    proxy.set(Fault::None);
    assert_eq!(roundtrip(&mut c, b"again").await, b"again");
    assert_eq!(roundtrip(&mut fresh, b"y").await, b"y");
    assert_eq!(proxy.connections(), 2);

    // Blackholing only the existing connections lets new ones through.
    assert_eq!(proxy.blackhole_existing_downstream(), 2);
    let mut later = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut later, b"new").await, b"new");
    c.write_all(b"old").await.unwrap();
    assert!(silent(&mut c).await);
    assert_eq!(proxy.fault(), Fault::None);

    drop((c, fresh, later));
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await, "closed connections leave the registry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_proxy_resets_refuses_and_closes() {
    let proxy = FaultProxy::start(echo_server().await).await;
    let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut a, b"a").await, b"a");
    assert_eq!(roundtrip(&mut b, b"b").await, b"b");
    assert_eq!(proxy.reset_all(), 2);
    let mut buf = [0u8; 8];
    assert!(is_reset(&a.read(&mut buf).await), "reset, not closed");
    assert!(is_reset(&b.read(&mut buf).await));
    assert!(proxy.wait_connections(0, Duration::from_secs(5)).await);

    proxy.set(Fault::Refuse);
    let accepted = proxy.accepted();
    assert!(refused(proxy.addr()).await, "a new connection is reset");
    assert_eq!(proxy.accepted(), accepted + 1);
    assert_eq!(proxy.connections(), 0);

    // CloseAfter counts from when it is set.
    proxy.set(Fault::None);
    let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut c, b"12345678").await, b"12345678");
    proxy.set(Fault::CloseAfter { bytes_down: 4 });
    c.write_all(b"abcdefgh").await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut got)).await.unwrap().unwrap();
    assert_eq!(got, b"abcd");

    // A proxy whose target is down resets its clients.
    let dead = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    let to_dead = FaultProxy::start(dead).await;
    assert!(refused(to_dead.addr()).await);
    assert_eq!(to_dead.accepted(), 1);
}

/// A record released by an operator and claimed again: the old attempt,
/// waking up late, must be fenced off (by its generation, and independently by
/// its claim token), and must not delete the new claim.
async fn attempts_from_an_earlier_life_of_a_record_are_fenced(backend: Backend) {
    let store = open(&backend).await;
    let k = key("relived");
    let lease = Duration::from_millis(150);
    let old = claim(&store, &req(&k, 1, lease, false)).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(store.resolve(&k, &RELEASE, &note("released")).await.unwrap(), ResolveOutcome::Resolved { from: State::InFlight });
    let new = claim(&store, &req(&k, 1, Duration::from_secs(60), false)).await;
    assert!(new.generation > old.generation, "the new life has a larger generation");
    assert_ne!(old.claim_token, new.claim_token);
    // Even an attempt that claimed the old generation's number with the new
    // token could not exist; one with the new generation but the old token is
    // still refused.
    let forged = Claim { generation: new.generation, ..old.clone() };
    assert_eq!(
        store.complete(&forged, &response(201, b"forged"), Retention::For(Duration::from_secs(60))).await.unwrap(),
        WriteOutcome::Fenced
    );

    assert_eq!(
        store.complete(&old, &response(201, b"stale"), Retention::For(Duration::from_secs(60))).await.unwrap(),
        WriteOutcome::Fenced
    );
    assert_eq!(store.release(&old).await.unwrap(), WriteOutcome::Fenced);
    assert_eq!(store.mark_unknown(&old).await.unwrap(), WriteOutcome::Fenced);
    let live = row(&store, &k).await;
    assert_eq!((live.state, live.claim_token), (State::InFlight, new.claim_token), "the new claim is untouched");

    assert_eq!(
        store.complete(&new, &response(201, b"fresh"), Retention::For(Duration::from_secs(60))).await.unwrap(),
        WriteOutcome::Written
    );
    let done = row(&store, &k).await;
    assert_eq!(done.response.and_then(|r| r.body), Some(Bytes::from_static(b"fresh")));
}

// ---------------------------------------------------------------------------
// The lease reaper decides from the row it locked (issue 27, item 1)

/// On PostgreSQL, a hold for the lease reaper inside its statement: a trigger
/// makes the reaper's update of `first` wait on advisory lock 4242 while the
/// returned session holds it (`SELECT pg_advisory_lock(4242)`). The reaper has
/// then taken its snapshot and locked `first`, but not yet the rows after it.
/// `pg_advisory_unlock(4242)` lets it go on. Installed before the test locks
/// any row (`CREATE TRIGGER` waits for every open transaction on the table).
async fn hold_the_reaper_after(url: &str, first: &str) -> (tokio_postgres::Client, tokio::task::JoinHandle<()>) {
    let (gate, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    gate.batch_execute(&format!(
        "CREATE FUNCTION idemgate_test_hold_reaper() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF OLD.idempotency_key = '{first}' AND OLD.state = 'processing' AND NEW.state IN ('queued', 'unknown') THEN
                 PERFORM pg_advisory_xact_lock_shared(4242);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER idemgate_test_hold_reaper BEFORE UPDATE ON idemgate_records
             FOR EACH ROW EXECUTE FUNCTION idemgate_test_hold_reaper();"
    ))
    .await
    .expect("install the reaper's hold");
    (gate, task)
}

/// Waits until some session waits for an advisory lock (the held reaper).
async fn until_an_advisory_lock_is_awaited(db: &tokio_postgres::Client) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 =
            db.query_one("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted", &[]).await.expect("pg_locks").get(0);
        if n > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "the reaper never reached its hold");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A worker's `mark_sent` that began while its lease was valid commits while
/// the reaper's statement, begun after the lease ran out, is already running.
/// The reaper must see the attempt as sent (it is at the upstream): on a route
/// whose upstream does not deduplicate, the record becomes `unknown` with its
/// event, and is never re-queued for a second send. Deciding from the
/// statement's snapshot instead of the locked row re-queued it.
async fn the_reaper_decides_from_the_row_it_locked(backend: Backend) {
    let store = open_with_events(&backend).await;
    let (first, sent) = (key("reaped-first"), key("sent-late"));
    for s in [&first, &sent] {
        claim(&store, &accept_req(s, 1)).await;
    }
    // A lease long enough that mark_sent surely starts inside it on a loaded
    // machine (an UPDATE whose WHERE already fails never waits for the row).
    let lease = Duration::from_secs(1);
    let routes = [worker_route("create_order", lease)];
    let t_first = take(&store, &routes, "w1").await.expect("first");
    let t_sent = take(&store, &routes, "w2").await.expect("second");
    assert_eq!((t_first.record.scope.clone(), t_sent.record.scope.clone()), (first.clone(), sent.clone()));
    match &backend {
        Backend::Postgres { url } | Backend::Citus { url } | Backend::Pooled { direct: url, .. } => {
            let (gate, gate_task) = hold_the_reaper_after(url, "reaped-first").await;
            // The worker's row is busy (a lock held from outside) when its
            // mark_sent starts, inside the lease.
            let (busy, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
            let busy_task = tokio::spawn(async move {
                let _ = conn.await;
            });
            busy.batch_execute("BEGIN; SELECT 1 FROM idemgate_records WHERE idempotency_key = 'sent-late' FOR UPDATE")
                .await
                .expect("lock the row");
            let marking = {
                let store = store.clone();
                let claim = t_sent.claim.clone();
                tokio::spawn(async move { store.mark_sent(&claim, AT_UPSTREAM).await })
            };
            // mark_sent is waiting for the row; its clock says the lease is valid.
            until_a_lock_is_awaited(&busy, "transactionid").await;
            tokio::time::sleep(lease + Duration::from_millis(100)).await;
            // The reaper starts after both leases ran out, and is held after `first`.
            gate.batch_execute("SELECT pg_advisory_lock(4242)").await.expect("hold the reaper");
            let reaping = {
                let store = store.clone();
                tokio::spawn(async move { store.reap_leases(10, &[]).await })
            };
            until_an_advisory_lock_is_awaited(&gate).await;
            // Now mark_sent commits: the worker will send.
            busy.batch_execute("COMMIT").await.expect("commit");
            let marked = marking.await.unwrap().expect("mark_sent");
            assert_eq!(marked, WriteOutcome::Written, "marked within its lease: {:?}", row(&store, &sent).await);
            gate.batch_execute("SELECT pg_advisory_unlock(4242)").await.expect("release the reaper");
            let reaped = reaping.await.unwrap().expect("reap");
            assert_eq!(reaped, Reaped { unknown: 1, requeued: 1 });
            gate.batch_execute("DROP TRIGGER idemgate_test_hold_reaper ON idemgate_records").await.expect("drop trigger");
            drop((busy, gate));
            let _ = (busy_task.await, gate_task.await);
        }
        Backend::Sqlite { .. } => {
            // One writer: mark_sent and the reaper cannot interleave; the
            // same decision from the order they commit in.
            assert_eq!(store.mark_sent(&t_sent.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
            tokio::time::sleep(lease + Duration::from_millis(100)).await;
            assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 1, requeued: 1 });
        }
    }
    let r = row(&store, &sent).await;
    assert_eq!(r.state, State::Unknown, "sent to an upstream that does not deduplicate: never queued again ({r:?})");
    assert!(r.sent_at.is_some(), "the send is remembered");
    assert_eq!(row(&store, &first).await.state, State::Queued, "never sent: queued again");
    assert!(take(&store, &routes, "w3").await.map(|t| t.record.scope) != Some(sent.clone()), "no worker sends it again");
    let unknown_events: Vec<_> =
        all_events(&store).await.into_iter().filter(|e| e.event_type == EventType::Unknown && e.scope == sent).collect();
    assert_eq!(unknown_events.len(), 1, "the unknown outcome is announced");
}

/// Waits until `db`'s cluster has a session waiting for a lock of `kind`.
async fn until_a_lock_is_awaited(db: &tokio_postgres::Client, kind: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 =
            db.query_one("SELECT count(*) FROM pg_locks WHERE locktype = $1 AND NOT granted", &[&kind]).await.expect("pg_locks").get(0);
        if n > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "nobody waits for a {kind} lock");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A record is probed only once its attempt cannot be at the upstream any
/// more: `at_upstream + settle` after it was sent (async: `sent_at`) or
/// claimed (sync: `created_at`), however early it turned `unknown`.
async fn probes_wait_until_the_attempt_cannot_be_at_the_upstream(backend: Backend) {
    let store = open(&backend).await;
    let (sync, queued) = (key("sync"), key("async"));
    let at_upstream = Duration::from_millis(1200);
    let route = ProbeRoute { operation: "create_order".into(), settle: Duration::ZERO, at_upstream };
    // A synchronous attempt whose lease (150 ms) ran out: unknown at once.
    claim(&store, &req(&sync, 1, SHORT, false)).await;
    // An async attempt marked sent, then its lease ran out: unknown too.
    claim(&store, &accept_req(&queued, 1)).await;
    let t = take(&store, &[worker_route("create_order", SHORT)], "w").await.expect("taken");
    assert_eq!(store.mark_sent(&t.claim, at_upstream).await.unwrap(), WriteOutcome::Written);
    // The last send: both attempts may be at the upstream until
    // `at_upstream` after it (measured from here, not from before the
    // claims: on a slower store those take a noticeable part of it).
    let sent = Instant::now();
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 2, requeued: 0 });
    assert!(store.take_probes(std::slice::from_ref(&route), SHORT, 10).await.unwrap().is_empty(), "both may still be at the upstream");
    tokio::time::sleep(at_upstream.saturating_sub(sent.elapsed()) + Duration::from_millis(100)).await;
    let taken = store.take_probes(&[route], SHORT, 10).await.unwrap();
    assert_eq!(key_set(&taken.iter().map(|p| p.record.clone()).collect::<Vec<_>>()), set(&["sync", "async"]));
}

/// What bounds an attempt's time at the upstream is what the attempt
/// recorded (async: the timeout it was marked sent with; synchronous: its
/// claim's lease), not the probing replica's timeout: a prober whose own
/// timeout is far shorter (a rolling change of `timeout`) waits for the
/// recorded bound. An async record sent without a bound (before it was
/// recorded) waits at least `UNRECORDED_AT_UPSTREAM`.
async fn probes_wait_for_the_bound_the_attempt_recorded(backend: Backend) {
    let store = open(&backend).await;
    let (sync, queued, legacy) = (key("sync"), key("async"), key("legacy"));
    let recorded = Duration::from_millis(1500);
    // The prober's own timeout and settle: nothing.
    let route = ProbeRoute { operation: "create_order".into(), settle: Duration::ZERO, at_upstream: Duration::ZERO };
    // A synchronous attempt under a lease as long as its sender's timeout, timed out: unknown.
    let c = claim(&store, &req(&sync, 1, recorded, false)).await;
    assert_eq!(store.mark_unknown(&c).await.unwrap(), WriteOutcome::Written);
    // Async attempts sent with that timeout, their leases run out: unknown.
    for s in [&queued, &legacy] {
        claim(&store, &accept_req(s, 1)).await;
    }
    for _ in 0..2 {
        let t = take(&store, &[worker_route("create_order", SHORT)], "w").await.expect("taken");
        assert_eq!(store.mark_sent(&t.claim, recorded).await.unwrap(), WriteOutcome::Written);
    }
    let sent = Instant::now();
    // The legacy record: sent by a version that recorded no bound.
    raw_sql(&backend, "UPDATE idemgate_records SET at_upstream_until = NULL WHERE idempotency_key = 'legacy'").await;
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 2, requeued: 0 });
    assert!(store.take_probes(std::slice::from_ref(&route), SHORT, 10).await.unwrap().is_empty(), "all may still be at the upstream");
    tokio::time::sleep(recorded.saturating_sub(sent.elapsed()) + Duration::from_millis(200)).await;
    let taken = store.take_probes(std::slice::from_ref(&route), SHORT, 10).await.unwrap();
    assert_eq!(key_set(&taken.iter().map(|p| p.record.clone()).collect::<Vec<_>>()), set(&["sync", "async"]));
    assert_eq!(idemgate::store::UNRECORDED_AT_UPSTREAM, Duration::from_secs(3600), "the legacy record waits an hour");
}

/// An operation that may have executed (an earlier attempt's answer was
/// lost on a route that then deduplicated upstream) runs again only while
/// the route in force is `upstream_idempotent`: once a reload turned that
/// off, an expired attempt of it is neither taken over nor re-queued, even
/// when that attempt itself never sent; the reaper makes it `unknown`.
async fn an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route(backend: Backend) {
    let store = open(&backend).await;
    let s = key("flipped");
    claim(&store, &accept_req(&s, 1)).await;
    let idempotent = [WorkerRoute { operation: "create_order".into(), lease: LONG, reforwardable: true, sent_on_take: None }];
    let t1 = take(&store, &idempotent, "w").await.unwrap();
    assert_eq!(store.mark_sent(&t1.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    let lost = RetryNote { last_status: None, maybe_executed: true };
    assert_eq!(store.requeue(&t1.claim, Duration::ZERO, lost).await.unwrap(), WriteOutcome::Written);
    // The reload: the route no longer deduplicates. A worker takes the
    // operation (its attempt decides not to send it) and dies before
    // writing anything.
    let plain = [WorkerRoute { operation: "create_order".into(), lease: SHORT, reforwardable: false, sent_on_take: None }];
    let t2 = take(&store, &plain, "w2").await.unwrap();
    assert!(t2.record.maybe_executed);
    assert!(!record::may_forward(&t2.record, false), "the attempt must not send it");
    assert!(record::may_forward(&t2.record, true));
    tokio::time::sleep(PAST_SHORT).await;
    assert!(take(&store, &plain, "w3").await.is_none(), "not taken over");
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 1, requeued: 0 });
    assert_eq!(row(&store, &s).await.state, State::Unknown);
}

/// An operator (or a probe's "absent") who releases an async operation says
/// "it did not happen, run it": the operation goes back to the queue with a
/// fresh attempt budget. Keeping the used-up count failed it at the next take
/// without running it.
async fn a_released_operation_starts_a_fresh_attempt_budget(backend: Backend) {
    let store = open(&backend).await;
    let s = key("released");
    claim(&store, &accept_req(&s, 1)).await;
    let routes = [worker_route("create_order", LONG)];
    let t = take(&store, &routes, "w").await.expect("taken");
    assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    let timed_out = RetryNote { last_status: None, maybe_executed: true };
    assert_eq!(store.fail(&t.claim, Retention::For(LONG), timed_out).await.unwrap(), WriteOutcome::Written);
    assert_eq!((row(&store, &s).await.state, row(&store, &s).await.attempts), (State::Unknown, 1));
    let released = store.resolve(&s, &RELEASE, &note("did not happen, run it again")).await.unwrap();
    assert!(matches!(released, ResolveOutcome::Resolved { .. }), "{released:?}");
    let queued = row(&store, &s).await;
    assert_eq!((queued.state, queued.attempts, queued.maybe_executed, queued.sent_at), (State::Queued, 0, false, None));
    let again = take(&store, &routes, "w").await.expect("runs again");
    assert_eq!(again.record.attempts, 1, "the first attempt of a fresh budget");
}

/// The relay's take may look at the oldest due events first (PostgreSQL
/// reads a window of a few batches): more held-back events than that at the
/// front of the queue must not hide a deliverable one behind them.
async fn events_held_back_beyond_any_window_do_not_hide_deliverable_ones(backend: Backend) {
    let store = open_with_events(&backend).await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let n = AuditNote { actor: Actor::Cli, reason: "it happened".into(), forced: false, caller: None };
    // 12 scopes, each an `unknown` event parked and a later `completed` held behind it.
    for i in 0..12 {
        let k = key(&format!("held-{i}"));
        let c = claim(&store, &req(&k, 1, LONG, false)).await;
        store.mark_unknown(&c).await.unwrap();
        let first = store.take_events(&ops, 1, LONG, relay).await.unwrap();
        assert_eq!(first.len(), 1);
        assert!(store.event_failed(first[0].seq, relay, "answered 500", Duration::ZERO, true).await.unwrap(), "parked");
        let done = Resolution::Complete { response: response(201, b"x"), retention: Retention::For(LONG), force: false };
        assert!(matches!(store.resolve(&k, &done, &n).await.unwrap(), ResolveOutcome::Resolved { .. }));
    }
    // Then one scope nothing holds back.
    let free = key("free");
    let c = claim(&store, &req(&free, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"f"), Retention::For(LONG)).await.unwrap();
    let taken = store.take_events(&ops, 1, LONG, relay).await.unwrap();
    let seen: Vec<(&str, &str)> = taken.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str())).collect();
    assert_eq!(seen, vec![("free", "completed")], "12 held-back events ahead of it, a batch of 1");
    assert_eq!(store.event_stats().await.unwrap().held, 12);
}

/// Order per scope survives parking: once an event is parked, the later
/// events of its scope wait behind it (other scopes go on); redelivered, it
/// is delivered first, then the rest. A receiver never sees `unknown` after
/// the final state.
async fn a_parked_event_holds_the_later_events_of_its_scope(backend: Backend) {
    let store = open_with_events(&backend).await;
    let (a, b) = (key("a"), key("b"));
    let c = claim(&store, &req(&a, 1, LONG, false)).await;
    store.mark_unknown(&c).await.unwrap();
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let first = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(first.iter().map(|e| e.event_type.as_str()).collect::<Vec<_>>(), vec!["unknown"]);
    assert!(store.event_failed(first[0].seq, relay, "answered 500", Duration::ZERO, true).await.unwrap(), "parked");
    // The record is settled afterwards: a later event of the same scope.
    let n = AuditNote { actor: Actor::Cli, reason: "it happened".into(), forced: false, caller: None };
    let done = Resolution::Complete { response: response(201, b"a"), retention: Retention::For(LONG), force: false };
    assert!(matches!(store.resolve(&a, &done, &n).await.unwrap(), ResolveOutcome::Resolved { .. }));
    let c = claim(&store, &req(&b, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"b"), Retention::For(LONG)).await.unwrap();
    let taken = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    let seen: Vec<(&str, &str)> = taken.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str())).collect();
    assert_eq!(seen, vec![("b", "completed")], "a's completion waits behind its parked unknown");
    store.events_delivered(&taken.iter().map(|e| e.seq).collect::<Vec<_>>(), relay).await.unwrap();
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty(), "still held");
    let stats = store.event_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked, stats.held), (1, 1, 1), "one pending event, held behind the parked one");
    assert!(store.redeliver(first[0].id).await.unwrap());
    let again = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(
        again.iter().map(|e| (e.id, e.event_type.as_str())).collect::<Vec<_>>(),
        vec![(first[0].id, "unknown")],
        "the earlier state first"
    );
    store.events_delivered(&[again[0].seq], relay).await.unwrap();
    let last = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(last.iter().map(|e| (e.scope.key.as_str(), e.event_type.as_str())).collect::<Vec<_>>(), vec![("a", "completed")]);
}

/// A route whose upstream deduplicates is sent without a never-sent proof:
/// its take records the send (`sent_on_take`), so an attempt whose lease
/// runs out is taken over as one that may have executed; a route with the
/// proof is taken unsent, as ever.
async fn a_take_for_a_deduplicating_upstream_records_the_send(backend: Backend) {
    let store = open(&backend).await;
    let (dedup, plain) = (scope("acme", "billing", "charge", "dedup"), key("plain"));
    claim(&store, &accept_req(&dedup, 1)).await;
    claim(&store, &accept_req(&plain, 1)).await;
    let routes = [
        WorkerRoute { operation: "charge".into(), lease: SHORT, reforwardable: true, sent_on_take: Some(LONG) },
        WorkerRoute { operation: "create_order".into(), lease: LONG, reforwardable: false, sent_on_take: None },
    ];
    let before = store.now().await.unwrap();
    let mut first = Vec::new();
    while let Some(t) = take(&store, &routes, "w1").await {
        first.push(t);
    }
    assert_eq!(first.len(), 2);
    for t in &first {
        let expected = if t.record.scope == dedup { Some(true) } else { Some(false) };
        assert_eq!(Some(t.record.sent_at.is_some()), expected, "{t:?}");
        assert!(!t.record.maybe_executed);
    }
    let sent = first.iter().find(|t| t.record.scope == dedup).unwrap();
    assert!(sent.record.sent_at.unwrap() >= before, "sent at the take");
    // Its worker dies: the lease runs out, and the take-over knows it may have executed.
    tokio::time::sleep(PAST_SHORT).await;
    let again = take(&store, &routes, "w2").await.expect("taken over");
    assert_eq!((again.record.scope.clone(), again.lease_expired), (dedup.clone(), true));
    assert!(again.record.maybe_executed, "taken over although it looked sent");
    assert!(again.record.sent_at.is_some(), "the new attempt is recorded as sent too");
    assert!(again.claim.generation > sent.claim.generation);
    assert_eq!(store.complete(&again.claim, &response(201, b"once"), Retention::For(LONG)).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &dedup).await.state, State::Completed);
}

/// Take-over does not wait for the lease reaper: a worker's take serves,
/// before the queue, an attempt whose lease ran out and that may run again
/// (never sent, or sent to a deduplicating upstream: `maybe_executed`), under
/// a new generation that fences the old holder. A sent attempt on a plain
/// upstream is never taken (the reaper makes it unknown).
async fn workers_take_over_expired_attempts_that_may_run_again(backend: Backend) {
    let store = open(&backend).await;
    let (unsent, dedup, sent, queued) = (key("unsent"), scope("acme", "billing", "charge", "dedup"), key("sent"), key("queued-later"));
    for s in [&unsent, &dedup, &sent] {
        claim(&store, &accept_req(s, 1)).await;
    }
    // Long enough for three takes in a row on the slowest store (a take on
    // Citus is two statements), short enough to wait out.
    let lease = Duration::from_millis(600);
    let routes = [
        WorkerRoute { operation: "create_order".into(), lease, reforwardable: false, sent_on_take: None },
        WorkerRoute { operation: "charge".into(), lease, reforwardable: true, sent_on_take: None },
    ];
    let mut held = Vec::new();
    while let Some(t) = take(&store, &routes, "w1").await {
        assert!(!t.lease_expired, "from the queue");
        if t.record.scope != unsent {
            assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
        }
        held.push(t);
    }
    assert_eq!(held.len(), 3);
    claim(&store, &accept_req(&queued, 1)).await;
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let mut taken_over = BTreeSet::new();
    for _ in 0..2 {
        let t = take(&store, &routes, "w2").await.expect("an expired attempt");
        assert!(t.lease_expired, "{t:?}");
        let old = held.iter().find(|h| h.record.scope == t.record.scope).unwrap();
        assert!(t.claim.generation > old.claim.generation);
        assert_eq!((t.record.attempts, t.record.sent_at), (2, None));
        assert_eq!(t.record.maybe_executed, t.record.scope == dedup, "sent before: it may have executed");
        assert_eq!(store.mark_sent(&old.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Fenced, "the old holder is fenced");
        taken_over.insert(t.record.scope.key.as_str().to_owned());
    }
    assert_eq!(taken_over, set(&["unsent", "dedup"]));
    let next = take(&store, &routes, "w2").await.expect("the queue");
    assert_eq!((next.record.scope.clone(), next.lease_expired), (queued.clone(), false), "the sent one is not taken");
    assert_eq!(row(&store, &sent).await.state, State::Processing);
    assert_eq!(store.reap_leases(10, &["charge".into()]).await.unwrap(), Reaped { unknown: 1, requeued: 0 });
    assert_eq!(row(&store, &sent).await.state, State::Unknown);
}
