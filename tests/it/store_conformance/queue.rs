//! Conformance of `Queue` (async operations, CONTRACT section 6): workers
//! take operations, heartbeat, send, retry and fail them, and the lease
//! reaper decides what an expired attempt becomes; on every backend.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idemgate::idempotency::key::Scope;
use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{self, Generation, State, TransitionError};
use idemgate::outbox::EventType;
use idemgate::store::{Claim, Reaped, Resolution, ResolveOutcome, RetryNote, WorkerRoute, WriteOutcome};
use uuid::Uuid;

use super::{
    AT_UPSTREAM, LONG, PAST_SHORT, SHORT, accept_req, all_events, claim, existing, fp, get, key, note, open, open_with_events, req,
    response, row, scope, set, take, worker_route,
};
use crate::support::{self, Backend};

on_both_stores!(
    a_take_for_a_deduplicating_upstream_records_the_send,
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    the_reaper_decides_from_the_row_it_locked,
    an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
    a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff
);

on_pgbouncer!(
    a_take_for_a_deduplicating_upstream_records_the_send,
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    the_reaper_decides_from_the_row_it_locked,
    an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
    a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff
);

// Not on Citus: a_take_for_a_deduplicating_upstream_records_the_send (a
// Citus coordinator's take does not record the send: its workers mark it as
// on other routes, docs/async.md); and the_reaper_decides_from_the_row_it_locked, which holds the
// reaper inside its statement with a trigger waiting on an advisory lock and
// watches pg_locks of the server it connects to; on Citus the reaper's
// statement runs on a worker, where that lock is taken.
on_citus!(
    acceptance_queues_the_operation_with_its_request,
    racing_workers_take_one_operation_once_each_under_a_new_generation,
    a_take_for_several_workers_draws_each_operation_once_and_their_sends_are_fenced_each,
    a_worker_whose_lease_was_taken_over_cannot_act,
    lease_expiry_requeues_what_was_never_sent_or_may_run_again,
    retries_wait_their_backoff_then_fail_and_are_swept_after_retention,
    an_operation_that_may_have_executed_runs_again_only_on_a_reforwardable_route,
    workers_take_over_expired_attempts_that_may_run_again,
    stored_requests_are_dropped_once_the_operation_is_final,
    a_requeue_that_may_have_executed_keeps_the_fact_and_its_backoff
);

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
    // Forced: its attempt may still be at the upstream (until AT_UPSTREAM
    // after its send), which an unforced release waits for.
    assert_eq!(
        store.resolve(&unsure, &Resolution::Release { force: true }, &note("not in the ledger")).await.unwrap(),
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
