//! Conformance of `Records`: the claim, fenced results, reads, lists,
//! retention and leases, on every backend.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::idempotency::key::Scope;
use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{self, Generation, Record, State, StoredResponse, Timestamp};
use idemgate::store::{Claim, ClaimOutcome, ClaimRequest, ListFilter, Reaped, Resolution, ResolveOutcome, RetryNote, Store, WriteOutcome};
use idemgate::telemetry::metrics::Metrics;
use uuid::Uuid;

use super::{
    LONG, PAST_SHORT, RELEASE, SHORT, accept_req, all, claim, claimed_at, existing, fp, get, key, key_set, keys_of, note, open, req,
    response, row, scope, set, worker_route,
};
use crate::support::{self, Backend};

on_both_stores!(
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
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
    one_pass_serves_every_tenant_with_work_due,
    fingerprint_specs_are_kept_once_each,
    facts_of_an_earlier_life_do_not_count,
    list_filters_orders_and_limits,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    stats_count_records_that_are_not_completed,
    unknown_records_are_counted_by_age_in_one_grouped_count,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once
);

on_pgbouncer!(
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
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
    one_pass_serves_every_tenant_with_work_due,
    fingerprint_specs_are_kept_once_each,
    list_filters_orders_and_limits,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    stats_count_records_that_are_not_completed,
    unknown_records_are_counted_by_age_in_one_grouped_count,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once
);

on_citus!(
    attempts_from_an_earlier_life_of_a_record_are_fenced,
    claim_inserts_and_second_claim_sees_the_winner,
    generations_grow_across_lives_of_a_scope,
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
    one_pass_serves_every_tenant_with_work_due,
    fingerprint_specs_are_kept_once_each,
    list_filters_orders_and_limits,
    claim_resent_with_the_same_token_is_recognised_as_ours,
    abandon_deletes_only_an_in_flight_claim_with_its_token,
    stats_count_records_that_are_not_completed,
    records_kept_forever_are_never_taken_over_swept_or_expired,
    key_source_is_kept_by_claims_and_take_overs,
    list_pages_with_a_cursor_cover_every_record_once,
    unknown_records_are_counted_by_age_in_one_grouped_count
);

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
                record::may_take_over(&before, &r.request_hash, at, r.reforward),
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
                !record::may_take_over(&record, &r.request_hash, now, r.reforward),
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
    claim(&store, &req(&flight_old, 1, SHORT, true)).await;
    claim(&store, &req(&flight_live, 1, LONG, true)).await;
    let c = claim(&store, &req(&unknown, 1, LONG, true)).await;
    store.mark_unknown(&c).await.unwrap();
    // Sent under another key than a take-over would send: the client's
    // (`forward_key = "client"` before a rollout), or none (observe mode, a
    // route that did not deduplicate).
    let under = |scope: &Scope, lease, reforward| ClaimRequest { reforward, ..req(scope, 1, lease, false) };
    let (flight_client, unknown_client, unknown_observed) = (key("in-flight-client"), key("unknown-client"), key("unknown-observed"));
    claim(&store, &under(&flight_client, SHORT, Some(record::ReforwardKey::Client))).await;
    let c = claim(&store, &under(&unknown_client, LONG, Some(record::ReforwardKey::Client))).await;
    store.mark_unknown(&c).await.unwrap();
    let c = claim(&store, &under(&unknown_observed, LONG, None)).await;
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
    // Only under the key the upstream got: an upstream that deduplicates by
    // key would act again on the same request under another one.
    assert!(!try_take_over(&store, &req(&flight_client, 1, LONG, true)).await);
    assert!(!try_take_over(&store, &req(&unknown_client, 1, LONG, true)).await);
    assert!(!try_take_over(&store, &req(&unknown_observed, 1, LONG, true)).await);
    assert!(try_take_over(&store, &under(&unknown_client, LONG, Some(record::ReforwardKey::Client))).await);
    assert_eq!(row(&store, &unknown_client).await.reforward_key, Some(record::ReforwardKey::Client), "a take-over keeps its key");
    // An unknown async operation stays its operation whatever the upstream:
    // a synchronous retry of its key is answered with its acceptance (its
    // id is what its client polls), never takes it over.
    let operation = key("unknown-operation");
    claim(&store, &accept_req(&operation, 1)).await;
    let t = super::take(&store, &[worker_route("create_order", LONG)], "w").await.expect("taken");
    assert_eq!(store.mark_sent(&t.claim, super::AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    let timed_out = RetryNote { last_status: None, maybe_executed: true };
    assert_eq!(store.fail(&t.claim, Retention::For(LONG), timed_out).await.unwrap(), WriteOutcome::Written);
    assert_eq!(row(&store, &operation).await.state, State::Unknown);
    assert!(!try_take_over(&store, &req(&operation, 1, LONG, true)).await);
    assert_eq!(row(&store, &operation).await.operation_id.as_deref(), Some("op_unknown-operation"));

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

/// A sweep or a reap with room in its batch ends everything due, however
/// many tenants it is spread over (Citus serves tenants a round at a time:
/// with 40 due, a call that served the first round of 32 and stopped left 8
/// for the next `sweep_interval`).
async fn one_pass_serves_every_tenant_with_work_due(backend: Backend) {
    let store = open(&backend).await;
    const TENANTS: usize = 40;
    for i in 0..TENANTS {
        let done = claim(&store, &req(&scope(&format!("t{i}"), "p", "o", "done"), 1, LONG, false)).await;
        store.complete(&done, &response(201, b"old"), Retention::For(SHORT)).await.unwrap();
        claim(&store, &req(&scope(&format!("t{i}"), "p", "o", "stale"), 1, SHORT, false)).await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    assert_eq!(store.reap_leases(100, &[]).await.unwrap(), Reaped { unknown: TENANTS as u64, requeued: 0 });
    assert_eq!(store.sweep(100).await.unwrap(), TENANTS as u64);
    let left = all(&store).await;
    assert_eq!(left.len(), TENANTS, "only the reaped records are left");
    assert!(left.iter().all(|r| r.state == State::Unknown && r.scope.key.as_str() == "stale"), "{left:?}");
}

/// The fingerprint settings operations have had: each pair kept once,
/// listed oldest first, whatever the text holds.
async fn fingerprint_specs_are_kept_once_each(backend: Backend) {
    let store = open(&backend).await;
    assert_eq!(store.fingerprint_specs().await.unwrap(), Vec::<(String, String)>::new());
    let pair = |o: &str, s: &str| (o.to_owned(), s.to_owned());
    let first = [pair("create_order", r#"{"exclude":[]}"#), pair("refund", "x 'quoted' \\ text")];
    store.add_fingerprint_specs(&first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    store.add_fingerprint_specs(&[pair("create_order", r#"{"exclude":["/t"]}"#), first[0].clone()]).await.unwrap();
    store.add_fingerprint_specs(&[]).await.unwrap();
    let listed = store.fingerprint_specs().await.unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert_eq!(listed.last(), Some(&pair("create_order", r#"{"exclude":["/t"]}"#)), "oldest first: {listed:?}");
    assert!(first.iter().all(|p| listed.contains(p)), "{listed:?}");
}

/// What a claim wrote about a record's life (the key it was sent under,
/// its fingerprint settings) counts only while its claim token is the
/// record's: a replica of an earlier version that takes the record over
/// writes a new token and leaves those columns as they were, and the
/// record then says nothing of them (never taken over by a key it names).
async fn facts_of_an_earlier_life_do_not_count(backend: Backend) {
    let store = open(&backend).await;
    let s = key("relived");
    claim(&store, &req(&s, 1, SHORT, true)).await;
    let before = row(&store, &s).await;
    assert_eq!(before.reforward_key, Some(record::ReforwardKey::Derived));
    assert_eq!(before.fingerprint_spec.as_deref(), Some("test-settings"));
    // An earlier version's take-over: a new claim token, the columns untouched.
    let token = match &backend {
        Backend::Sqlite { .. } => "randomblob(16)",
        _ => "gen_random_uuid()",
    };
    super::raw_sql(&backend, &format!("UPDATE idemgate_records SET claim_token = {token} WHERE idempotency_key = 'relived'")).await;
    let after = row(&store, &s).await;
    assert_ne!(after.claim_token, before.claim_token);
    assert_eq!((after.reforward_key, after.fingerprint_spec), (None, None));
    tokio::time::sleep(PAST_SHORT).await;
    assert!(!try_take_over(&store, &req(&s, 1, LONG, true)).await, "sent under a key this version cannot know");
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
        assert!(!record::may_take_over(&found, &fp(hash), now, Some(record::ReforwardKey::Derived)));
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
