//! Conformance of `Reconcile`: the probes' take and their fenced writes, and
//! resolutions (the reconciler's and operators'), on every backend.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use idemgate::idempotency::key::Scope;
use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{self, State, TransitionError};
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{Claim, ProbeRoute, Reaped, Resolution, ResolveOutcome, RetryNote, Store, Taken, WriteOutcome};

use super::{
    AT_UPSTREAM, LONG, PAST_SHORT, RELEASE, SHORT, accept_req, all, claim, existing, fp, get, key, key_set, keys_of, note, open, open_with,
    raw_sql, req, response, row, scope, set, take, worker_route,
};
use crate::support::{self, Backend};

on_both_stores!(
    resolve_releases_completes_and_refuses_live_claims,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    probes_wait_for_the_bound_the_attempt_recorded,
    a_released_operation_starts_a_fresh_attempt_budget,
    resolutions_hold_one_connection_at_a_time,
    an_expired_processing_operation_is_left_to_the_reaper,
    a_resolution_of_a_generation_that_moved_on_is_refused
);

on_pgbouncer!(
    resolve_releases_completes_and_refuses_live_claims,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    probes_wait_for_the_bound_the_attempt_recorded,
    a_released_operation_starts_a_fresh_attempt_budget,
    resolutions_hold_one_connection_at_a_time,
    an_expired_processing_operation_is_left_to_the_reaper,
    a_resolution_of_a_generation_that_moved_on_is_refused
);

on_citus!(
    resolve_releases_completes_and_refuses_live_claims,
    probes_take_due_unknown_records_and_their_writes_are_fenced,
    racing_reconcilers_take_each_record_once,
    probes_wait_until_the_attempt_cannot_be_at_the_upstream,
    probes_wait_for_the_bound_the_attempt_recorded,
    a_released_operation_starts_a_fresh_attempt_budget,
    resolutions_hold_one_connection_at_a_time,
    an_expired_processing_operation_is_left_to_the_reaper,
    a_resolution_of_a_generation_that_moved_on_is_refused
);

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

/// An async operation whose attempt was sent and timed out on an upstream
/// that may have run it, its retries used up: `unknown`. Returns the attempt.
async fn unknown_async(store: &Store, s: &Scope) -> Taken {
    claim(store, &accept_req(s, 1)).await;
    let t = take(store, &[worker_route("create_order", LONG)], "w").await.expect("taken");
    assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    let timed_out = RetryNote { last_status: None, maybe_executed: true };
    assert_eq!(store.fail(&t.claim, Retention::For(LONG), timed_out).await.unwrap(), WriteOutcome::Written);
    t
}

/// An operator (or a probe's "absent") who releases an async operation says
/// "it did not happen, run it": the operation goes back to the queue with a
/// fresh attempt budget. Keeping the used-up count failed it at the next take
/// without running it.
async fn a_released_operation_starts_a_fresh_attempt_budget(backend: Backend) {
    let store = open(&backend).await;
    let s = key("released");
    let routes = [worker_route("create_order", LONG)];
    let sent = Instant::now();
    unknown_async(&store, &s).await;
    assert_eq!((row(&store, &s).await.state, row(&store, &s).await.attempts), (State::Unknown, 1));
    // Not while its attempt may still be at the upstream (sent with a
    // timeout of AT_UPSTREAM): a look-up there may miss it still running.
    let early = store.resolve(&s, &RELEASE, &note("not in the ledger yet")).await.unwrap();
    assert!(matches!(early, ResolveOutcome::Refused(TransitionError::AtUpstream(_))), "{early:?}");
    assert_eq!(row(&store, &s).await.state, State::Unknown, "refused: nothing changed");
    tokio::time::sleep(AT_UPSTREAM.saturating_sub(sent.elapsed()) + Duration::from_millis(100)).await;
    let released = store.resolve(&s, &RELEASE, &note("did not happen, run it again")).await.unwrap();
    assert!(matches!(released, ResolveOutcome::Resolved { .. }), "{released:?}");
    let queued = row(&store, &s).await;
    assert_eq!((queued.state, queued.attempts, queued.maybe_executed, queued.sent_at), (State::Queued, 0, false, None));
    let again = take(&store, &routes, "w").await.expect("runs again");
    assert_eq!(again.record.attempts, 1, "the first attempt of a fresh budget");
}

/// A resolution needs one connection at a time: on a pool of one, an
/// `unknown` record completed by a probe (fenced by its mark) or by hand,
/// and an async operation released to run again (both under a new
/// generation, which Citus draws from the tenant's counter) are resolved,
/// not left waiting for a second connection. On Citus a resolution drew the
/// generation on another connection while its transaction held the record:
/// eight probes settling at once on a pool of eight waited for each other
/// until the operation timeout, every time they were taken again.
async fn resolutions_hold_one_connection_at_a_time(backend: Backend) {
    let store = open_with(&backend, Duration::from_secs(5), 1).await;
    let n = note("one connection");
    let complete = Resolution::Complete { response: response(201, b"found"), retention: Retention::For(LONG), force: false };

    // Completed by a probe, through its mark.
    let probed = key("one-conn-probed");
    let c = unknown(&store, &probed).await;
    tokio::time::sleep(PAST_SHORT).await;
    let routes = [probe_route("create_order", Duration::ZERO)];
    let taken = store.take_probes(&routes, LONG, 8).await.unwrap();
    assert_eq!(keys_of(&taken.iter().map(|p| p.record.clone()).collect::<Vec<_>>()), vec!["one-conn-probed".to_owned()]);
    let fenced = store.resolve_probed(&probed, &complete, &n, taken[0].fence).await;
    assert!(matches!(fenced, Ok(ResolveOutcome::Resolved { from: State::Unknown })), "{fenced:?}");
    let done = row(&store, &probed).await;
    assert_eq!((done.state, done.generation > c.generation), (State::Completed, true));

    // Completed by hand.
    let by_hand = key("one-conn-by-hand");
    unknown(&store, &by_hand).await;
    let resolved = store.resolve(&by_hand, &complete, &n).await;
    assert!(matches!(resolved, Ok(ResolveOutcome::Resolved { from: State::Unknown })), "{resolved:?}");
    assert_eq!(row(&store, &by_hand).await.state, State::Completed);

    // An async operation whose attempt may have run, released to run again.
    let again = key("one-conn-again");
    let t = unknown_async(&store, &again).await;
    // Forced: its attempt may still be at the upstream (this test is about
    // connections, not that wait).
    let released = store.resolve(&again, &Resolution::Release { force: true }, &n).await;
    assert!(matches!(released, Ok(ResolveOutcome::Resolved { from: State::Unknown })), "{released:?}");
    let queued = row(&store, &again).await;
    assert_eq!((queued.state, queued.generation > t.claim.generation), (State::Queued, true));
}

/// A processing operation whose lease ran out is not an operator's to
/// resolve (only `unknown` records, and expired synchronous claims, are): the
/// lease reaper decides it from its facts, `unknown` when it was sent. A
/// release erased `sent_at` and queued it again: its next attempt sent it
/// a second time.
async fn an_expired_processing_operation_is_left_to_the_reaper(backend: Backend) {
    let store = open(&backend).await;
    let s = key("stalled");
    claim(&store, &accept_req(&s, 1)).await;
    let t = take(&store, &[worker_route("create_order", SHORT)], "w").await.expect("taken");
    assert_eq!(store.mark_sent(&t.claim, AT_UPSTREAM).await.unwrap(), WriteOutcome::Written);
    tokio::time::sleep(PAST_SHORT).await;
    let n = note("the gateway is down; run it again");
    let complete = Resolution::Complete { response: response(200, b"by hand"), retention: Retention::For(LONG), force: true };
    for resolution in [&RELEASE, &complete] {
        assert_eq!(
            store.resolve(&s, resolution, &n).await.unwrap(),
            ResolveOutcome::Refused(TransitionError::NotAllowed(State::Processing))
        );
    }
    let left = row(&store, &s).await;
    assert_eq!((left.state, left.sent_at.is_some()), (State::Processing, true), "the record is as the attempt left it");
    assert_eq!(store.reap_leases(10, &[]).await.unwrap(), Reaped { unknown: 1, requeued: 0 }, "the reaper decides it");
}

/// An operator resolves the generation they looked at: by the time they
/// submit, the record may have moved on (a probe released it, the client's
/// retry claimed it again, and that attempt too ended unknown). A release
/// meant for the first generation must not free the second, whose attempt
/// may have executed.
async fn a_resolution_of_a_generation_that_moved_on_is_refused(backend: Backend) {
    let store = open(&backend).await;
    let s = key("moved-on");
    let n = note("checked the upstream's ledger");
    let first = claim(&store, &req(&s, 1, LONG, false)).await;
    store.mark_unknown(&first).await.unwrap();
    let seen = row(&store, &s).await.generation;
    assert_eq!(store.resolve_expecting(&s, &RELEASE, &n, Some(seen)).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });
    let second = claim(&store, &req(&s, 1, LONG, false)).await;
    store.mark_unknown(&second).await.unwrap();
    let now = row(&store, &s).await;
    assert_ne!(now.generation, seen);
    let complete = Resolution::Complete { response: response(201, b"by hand"), retention: Retention::For(LONG), force: true };
    for resolution in [&RELEASE, &complete] {
        assert_eq!(
            store.resolve_expecting(&s, resolution, &n, Some(seen)).await.unwrap(),
            ResolveOutcome::Refused(TransitionError::Fenced),
            "a resolution of generation {seen:?} applied to {:?}",
            now.generation
        );
    }
    assert_eq!(row(&store, &s).await, now, "the record that moved on is untouched");
    assert_eq!(
        store.resolve_expecting(&s, &RELEASE, &n, Some(now.generation)).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Unknown }
    );
    assert_eq!(get(&store, &s).await, None);
}
