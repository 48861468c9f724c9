//! Conformance of `Events` (the outbox, CONTRACT section 9): events written
//! with final states, leased to relays, delivered, parked; on every backend.

use std::collections::BTreeSet;
use std::time::Duration;

use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::State;
use idemgate::outbox::Delivery;
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{Resolution, ResolveOutcome, RetryNote, WriteOutcome};
use uuid::Uuid;

use super::{
    LONG, PAST_SHORT, SHORT, accept_req, all_events, claim, key, open_with_events, raw_sql, req, response, row, scope, take, worker_route,
};
use crate::support::postgres as pg;
use crate::support::{self, Backend};

on_both_stores!(
    final_state_changes_write_their_events_and_nothing_else_does,
    a_failed_post_records_its_first_attempts_together,
    small_takes_deliver_every_event_of_many_scopes_once,
    a_take_that_says_nothing_is_left_leaves_nothing_to_take,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    a_parked_event_holds_the_later_events_of_its_scope,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones
);

on_pgbouncer!(
    final_state_changes_write_their_events_and_nothing_else_does,
    a_failed_post_records_its_first_attempts_together,
    small_takes_deliver_every_event_of_many_scopes_once,
    a_take_that_says_nothing_is_left_leaves_nothing_to_take,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    a_parked_event_holds_the_later_events_of_its_scope,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones
);

on_citus!(
    final_state_changes_write_their_events_and_nothing_else_does,
    a_failed_post_records_its_first_attempts_together,
    small_takes_deliver_every_event_of_many_scopes_once,
    a_take_that_says_nothing_is_left_leaves_nothing_to_take,
    a_change_and_its_event_commit_or_fail_together,
    relays_hold_each_event_alone_in_order_per_scope,
    a_parked_event_holds_the_later_events_of_its_scope,
    events_held_back_beyond_any_window_do_not_hide_deliverable_ones
);

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
    // An operator redelivers an event delivered on its first attempt (on
    // PostgreSQL, one of the log's): pending again, with its id.
    assert!(store.redeliver(first[1].id).await.unwrap(), "a delivered event can be redelivered");
    let again = store.take_events(&ops, 10, LONG, r1).await.unwrap();
    assert_eq!(again.iter().map(|e| (e.id, e.event_type.as_str())).collect::<Vec<_>>(), vec![(first[1].id, "completed")]);
    assert_eq!(store.events_delivered(&[again[0].seq], r1).await.unwrap(), vec![again[0].seq]);
    // An id no event has is no event, not an error (the log's form of id too).
    let unknown: Uuid = "00000000-0560-8000-8000-000000000001".parse().unwrap();
    assert!(!store.redeliver(unknown).await.unwrap());
    assert!(!store.redeliver(Uuid::new_v4()).await.unwrap());
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

/// One POST of events never attempted before failed: the relay records
/// them together (on PostgreSQL's log, one settling copies them to be
/// retried). Each is due again after the backoff with one attempt made and
/// the error, or parked; only the relay holding them records them; the
/// round's delivered events are not touched.
async fn a_failed_post_records_its_first_attempts_together(backend: Backend) {
    // Long enough that the steps between the failure and the take below
    // stay inside it on a loaded Citus cluster (200 ms did not, once).
    const BACKOFF: Duration = Duration::from_secs(1);
    let store = open_with_events(&backend).await;
    let ops = ["create_order"];
    let (relay, other) = (Uuid::new_v4(), Uuid::new_v4());
    for i in 0..23 {
        let c = claim(&store, &req(&key(&format!("post-{i}")), 1, LONG, false)).await;
        store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
    }
    let taken = store.take_events(&ops, 50, LONG, relay).await.unwrap();
    assert_eq!(taken.len(), 23);
    assert!(taken.iter().all(|e| e.attempts == 0));
    let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
    let (sent, failed, parked) = (&seqs[..5], &seqs[5..20], &seqs[20..]);
    assert_eq!(store.events_delivered(sent, relay).await.unwrap().len(), 5);
    let not_held = store.first_attempts_failed(failed, other, "answered 503", BACKOFF, false).await.unwrap();
    assert!(not_held.is_empty(), "only the relay holding them records them: {not_held:?}");
    let mut asked = failed.to_vec();
    asked.push(i64::MAX);
    let mut recorded = store.first_attempts_failed(&asked, relay, "answered 503", BACKOFF, false).await.unwrap();
    recorded.sort_unstable();
    let mut expected = failed.to_vec();
    expected.sort_unstable();
    assert_eq!(recorded, expected, "the failed ones this relay held, and no other");
    let mut gone = store.first_attempts_failed(parked, relay, "answered 410", Duration::ZERO, true).await.unwrap();
    gone.sort_unstable();
    assert_eq!(gone, parked.to_vec());
    assert!(store.take_events(&ops, 50, LONG, relay).await.unwrap().is_empty(), "not due before the backoff, parked never");
    let stats = store.event_stats().await.unwrap();
    assert_eq!((stats.pending, stats.parked), (15, 3));
    let listed = store.events(Some(Delivery::Parked), 10).await.unwrap();
    assert!(listed.iter().all(|e| e.attempts == 1 && e.last_error.as_deref() == Some("answered 410")), "{listed:?}");
    tokio::time::sleep(BACKOFF + Duration::from_millis(100)).await;
    let again = store.take_events(&ops, 50, LONG, relay).await.unwrap();
    let mut again_seqs: Vec<i64> = again.iter().map(|e| e.seq).collect();
    again_seqs.sort_unstable();
    assert_eq!(again_seqs, expected, "the failed ones again, and none delivered before");
    assert!(again.iter().all(|e| e.attempts == 1 && e.last_error.as_deref() == Some("answered 503")), "{again:?}");
    let ids: BTreeSet<Uuid> = taken[5..20].iter().map(|e| e.id).collect();
    assert_eq!(again.iter().map(|e| e.id).collect::<BTreeSet<_>>(), ids, "with the same ids");
}

/// Events of more tenants than a Citus take asks in one round (32), more
/// than SQLite leases in one take (256): each take is as large as the relay
/// asks, or the store's bound, and a take that says nothing deliverable is
/// left behind (`more` false, after which a relay waits a moment) leaves
/// nothing that the next take finds at once. Every event is delivered once.
async fn a_take_that_says_nothing_is_left_leaves_nothing_to_take(backend: Backend) {
    let store = open_with_events(&backend).await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let (tenants, per_tenant): (u32, u32) = (40, 8);
    for t in 0..tenants {
        for i in 0..per_tenant {
            let s = scope(&format!("bound-{t}"), "p", "create_order", &format!("k-{i}"));
            let c = claim(&store, &req(&s, 1, LONG, false)).await;
            store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
        }
    }
    let most = store.most_per_take();
    let mut delivered: Vec<i64> = Vec::new();
    let mut takes = 0;
    loop {
        let (taken, more) = store.take_events_more(&ops, 1024, LONG, relay).await.unwrap();
        takes += 1;
        assert!(takes <= 50, "a take per round, and rounds end");
        assert!(taken.len() <= most as usize, "{} taken, the store's bound is {most}", taken.len());
        let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
        assert_eq!(store.events_delivered(&seqs, relay).await.unwrap().len(), seqs.len());
        delivered.extend(seqs);
        if !more {
            let (after, _) = store.take_events_more(&ops, 1024, LONG, relay).await.unwrap();
            assert!(
                after.is_empty(),
                "take {takes} said nothing was left, and the next take found {} events ({} delivered before)",
                after.len(),
                delivered.len()
            );
            break;
        }
    }
    let all = tenants * per_tenant;
    if most < all {
        assert!(takes > 1, "a store that leases at most {most} a take took {all} in one");
    }
    let unique: BTreeSet<i64> = delivered.iter().copied().collect();
    assert_eq!((delivered.len(), unique.len()), (all as usize, all as usize), "every event once");
    assert_eq!(store.event_stats().await.unwrap().pending, 0);
}

/// Events of many scopes (on PostgreSQL, in every lane of the log) taken a
/// few at a time, each take delivered: every event is delivered exactly
/// once, and none is left. First a relay that delivers another operation
/// takes a few times, setting aside what it reads (on PostgreSQL: copied to
/// be retried, and the lanes move on past them): those are delivered too.
async fn small_takes_deliver_every_event_of_many_scopes_once(backend: Backend) {
    let store = open_with_events(&backend).await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let keys: Vec<String> = (0..80).map(|i| format!("many-{i}")).collect();
    for k in &keys {
        let c = claim(&store, &req(&key(k), 1, LONG, false)).await;
        store.complete(&c, &response(201, b"x"), Retention::For(LONG)).await.unwrap();
    }
    let other = Uuid::new_v4();
    for _ in 0..3 {
        assert!(store.take_events(&["another_operation"], 3, LONG, other).await.unwrap().is_empty());
    }
    let mut delivered: Vec<String> = Vec::new();
    for _ in 0..200 {
        let taken = store.take_events(&ops, 3, LONG, relay).await.unwrap();
        if taken.is_empty() {
            break;
        }
        assert!(taken.len() <= 3, "{}", taken.len());
        let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
        assert_eq!(store.events_delivered(&seqs, relay).await.unwrap().len(), seqs.len());
        delivered.extend(taken.iter().map(|e| e.scope.key.as_str().to_owned()));
    }
    delivered.sort();
    let mut expected = keys.clone();
    expected.sort();
    assert_eq!(delivered, expected, "every event once");
    assert_eq!(store.event_stats().await.unwrap().pending, 0);
    assert!(store.take_events(&ops, 3, LONG, relay).await.unwrap().is_empty());
}

/// A connection of the test's own to the store's database (as a writer
/// outside the store, or to look at its tables).
async fn connect(url: &str) -> tokio_postgres::Client {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.expect("connect");
    tokio::spawn(conn);
    db
}

/// A PostgreSQL store with events on a database of its own, and a session
/// of the test's on that database (for the log's rows).
async fn pg_log_store() -> (idemgate::store::Store, tokio_postgres::Client) {
    let url = pg::shared().create_unique_database("conformance").expect("create database");
    let store = open_with_events(&Backend::Postgres { url: url.clone() }).await;
    (store, connect(&url).await)
}

/// `n` keys `{prefix}-<i>` whose events go to the log's lane of key `of`
/// (lanes split by key), in order of `i`.
async fn keys_in_lane_of(db: &tokio_postgres::Client, prefix: &str, of: &str, n: i64) -> Vec<String> {
    db.query(
        "SELECT $1::text || '-' || g FROM generate_series(1, 5000) g \
         WHERE (hashtextextended($1::text || '-' || g, 0) & 15) = (hashtextextended($2::text, 0) & 15) ORDER BY g LIMIT $3",
        &[&prefix, &of, &n],
    )
    .await
    .expect("keys in one lane")
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// Appends a `completed` event of `operation` for `key` to the log, with the
/// columns' defaults (as a replica of an earlier version appends).
async fn append_raw(db: &tokio_postgres::Client, key: &str, operation: &str) {
    db.execute(
        "INSERT INTO idemgate_event_log (event_type, tenant, principal, operation, idempotency_key) \
         VALUES ('completed', 'acme', 'billing', $2, $1)",
        &[&key, &operation],
    )
    .await
    .expect("event");
}

/// The relay reads the log in batches bounded by transaction snapshots: an
/// event whose transaction commits after a later event was delivered (a
/// slow transaction that took its seq first) is still delivered. A relay
/// that kept only the highest seq it delivered would skip it for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_event_committed_after_later_ones_were_delivered_is_still_delivered() {
    let (store, slow) = pg_log_store().await;
    // A key in the same lane of the log as "fast".
    let slow_key = keys_in_lane_of(&slow, "slow", "fast", 1).await.remove(0);
    // The slow transaction writes its event first (the smaller seq) and stays open.
    slow.batch_execute("BEGIN").await.unwrap();
    append_raw(&slow, &slow_key, "create_order").await;
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

/// A batch's first take reads the events above its lane's floor by seq and
/// the events of the transactions its `done` snapshot lists as running by
/// their ids (migration 0017). An event at or below the floor can only come
/// from such a transaction: here one stays open across two batches, so its
/// seq is below the floor the lane has once the second of them ends, and it
/// is still delivered when it commits. A take that read only above the
/// floor would skip it for ever. And the floor is read by the take that
/// starts a batch, before its lease draws the bound on ids: an event written
/// while the batch is under way (after its take, before it ends) is above
/// it and delivered in the next batch; a floor read when that batch ended
/// would be above that event, whose id is above the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_event_of_a_transaction_open_across_two_batches_is_delivered() {
    let url = pg::shared().create_unique_database("conformance").expect("create database");
    let store = open_with_events(&Backend::Postgres { url: url.clone() }).await;
    let (db, slow) = (connect(&url).await, connect(&url).await);
    let keys = keys_in_lane_of(&db, "floor", "floor-1", 5).await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let deliver_one = |key: String| {
        let store = &store;
        async move {
            let taken = store.take_events(&ops, 10, LONG, relay).await.unwrap();
            assert_eq!(taken.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![key.as_str()]);
            assert_eq!(store.events_delivered(&[taken[0].seq], relay).await.unwrap(), vec![taken[0].seq]);
        }
    };
    // A first batch ends: the lane keeps the sequence's value as its next floor.
    append_raw(&db, &keys[0], "create_order").await;
    deliver_one(keys[0].clone()).await;
    // The slow transaction draws its seq now, above that value, and stays open.
    slow.batch_execute("BEGIN").await.unwrap();
    append_raw(&slow, &keys[3], "create_order").await;
    let slow_seq: i64 = slow.query_one("SELECT seq FROM idemgate_event_log WHERE idempotency_key = $1", &[&keys[3]]).await.unwrap().get(0);
    // Two more batches end while it is open; the second gives `done` a floor above its seq.
    append_raw(&db, &keys[1], "create_order").await;
    deliver_one(keys[1].clone()).await;
    append_raw(&db, &keys[2], "create_order").await;
    let taken = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(taken.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![keys[2].as_str()]);
    append_raw(&db, &keys[4], "create_order").await;
    assert_eq!(store.events_delivered(&[taken[0].seq], relay).await.unwrap(), vec![taken[0].seq]);
    let floor: Option<i64> = db
        .query_one("SELECT done_floor FROM idemgate_event_lanes WHERE lane = (hashtextextended($1::text, 0) & 15)", &[&keys[3]])
        .await
        .unwrap()
        .get(0);
    assert!(floor.is_some_and(|f| f >= slow_seq), "the lane's floor ({floor:?}) is at or above the open transaction's seq ({slow_seq})");
    slow.batch_execute("COMMIT").await.unwrap();
    let last = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(
        last.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(),
        vec![keys[3].as_str(), keys[4].as_str()],
        "the late commit below the floor, and the event written during the last batch above it, in seq order"
    );
    let seqs: Vec<i64> = last.iter().map(|e| e.seq).collect();
    let mut settled = store.events_delivered(&seqs, relay).await.unwrap();
    settled.sort();
    assert_eq!(settled, seqs);
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty());
    assert_eq!(store.event_stats().await.unwrap().pending, 0);
}

/// The same through a transaction that no other one completes after before
/// the relay's take: the take's snapshot does not list it (its xmax is the
/// last completed id plus one), so below the floor it is found by the
/// bound on ids the relay's lease drew after the snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_an_event_of_a_transaction_above_the_snapshots_xmax_is_delivered() {
    // A server of its own: another test's commit would put the transaction
    // in the snapshot's list (transaction ids are the server's).
    let server = pg::PgServer::start().expect("start private PostgreSQL");
    let url = server.create_database("conformance").expect("create database");
    let store = open_with_events(&Backend::Postgres { url: url.clone() }).await;
    let (db, slow) = (connect(&url).await, connect(&url).await);
    let keys = keys_in_lane_of(&db, "xmax", "xmax-1", 3).await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let taken_keys = |taken: &[idemgate::outbox::OutboxEvent]| taken.iter().map(|e| e.scope.key.as_str().to_owned()).collect::<Vec<_>>();
    append_raw(&db, &keys[0], "create_order").await;
    let first = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(taken_keys(&first), vec![keys[0].clone()]);
    store.events_delivered(&[first[0].seq], relay).await.unwrap();
    append_raw(&db, &keys[1], "create_order").await;
    // The newest transaction: nothing completes after it before the take.
    slow.batch_execute("BEGIN").await.unwrap();
    append_raw(&slow, &keys[2], "create_order").await;
    let row = slow.query_one("SELECT seq, xid::text FROM idemgate_event_log WHERE idempotency_key = $1", &[&keys[2]]).await.unwrap();
    let (slow_seq, slow_xid): (i64, String) = (row.get(0), row.get(1));
    let second = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(taken_keys(&second), vec![keys[1].clone()]);
    let lane = "(hashtextextended($1::text, 0) & 15)";
    let row = db
        .query_one(
            &format!(
                "SELECT pg_snapshot_xmax(upto)::text, $2::text::xid8 IN (SELECT pg_snapshot_xip(upto)) FROM idemgate_event_lanes WHERE lane = {lane}"
            ),
            &[&keys[2], &slow_xid],
        )
        .await
        .unwrap();
    let (xmax, listed): (String, bool) = (row.get(0), row.get(1));
    assert!(!listed && xmax == slow_xid, "the batch's snapshot leaves the running transaction out (xmax {xmax}, its id {slow_xid})");
    store.events_delivered(&[second[0].seq], relay).await.unwrap();
    let row = db
        .query_one(&format!("SELECT done_floor, done_xid::text FROM idemgate_event_lanes WHERE lane = {lane}"), &[&keys[2]])
        .await
        .unwrap();
    let (floor, bound): (Option<i64>, Option<String>) = (row.get(0), row.get(1));
    assert!(floor.is_some_and(|f| f >= slow_seq), "its seq ({slow_seq}) is at or below the floor ({floor:?})");
    assert!(bound.is_some(), "the lane has a bound on ids");
    slow.batch_execute("COMMIT").await.unwrap();
    let last = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(taken_keys(&last), vec![keys[2].clone()], "the transaction above the snapshot's xmax is delivered");
    store.events_delivered(&[last[0].seq], relay).await.unwrap();
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty());
}

/// A take reads a little more than it delivers (events it sets aside do
/// not count). When the rows it read end exactly where its lane's batch
/// ends, and it takes them all, the batch ends: a batch left open with
/// nothing in it would keep its lane from ever being taken again. Here one
/// lane holds 16 events of an operation this relay does not deliver (set
/// aside) and then 3 it delivers, a take of 3 reads exactly those 19; a
/// later event of the lane is still delivered. Then the same with 4 to
/// deliver: the fourth, one past what the take could read, is not skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_take_that_ends_exactly_at_its_batchs_end_ends_the_batch() {
    let (store, db) = pg_log_store().await;
    let keys = keys_in_lane_of(&db, "exact", "exact-1", 40).await;
    for k in &keys[..16] {
        append_raw(&db, k, "other_operation").await;
    }
    for k in &keys[16..19] {
        append_raw(&db, k, "create_order").await;
    }
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let taken = store.take_events(&ops, 3, LONG, relay).await.unwrap();
    assert_eq!(taken.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), keys[16..19].iter().map(String::as_str).collect::<Vec<_>>());
    let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
    let mut settled = store.events_delivered(&seqs, relay).await.unwrap();
    settled.sort();
    assert_eq!(settled, seqs);
    let open: i64 = db.query_one("SELECT count(*) FROM idemgate_event_lanes WHERE upto IS NOT NULL", &[]).await.expect("lanes").get(0);
    assert_eq!(open, 0, "the batch ended with its last event");
    // A later event of the lane.
    append_raw(&db, &keys[19], "create_order").await;
    let next = store.take_events(&ops, 3, LONG, relay).await.unwrap();
    assert_eq!(next.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![keys[19].as_str()], "the lane is taken again");
    assert_eq!(store.events_delivered(&[next[0].seq], relay).await.unwrap(), vec![next[0].seq]);
    // One more than a take can read: 16 set aside, then 4 to deliver.
    for k in &keys[20..36] {
        append_raw(&db, k, "other_operation").await;
    }
    for k in &keys[36..40] {
        append_raw(&db, k, "create_order").await;
    }
    let mut delivered = Vec::new();
    for _ in 0..3 {
        let taken = store.take_events(&ops, 3, LONG, relay).await.unwrap();
        let seqs: Vec<i64> = taken.iter().map(|e| e.seq).collect();
        store.events_delivered(&seqs, relay).await.unwrap();
        delivered.extend(taken.iter().map(|e| e.scope.key.as_str().to_owned()));
    }
    assert_eq!(delivered, keys[36..40].to_vec(), "the fourth event, past the first take's read, is delivered after the first three");
}

/// A take says whether it left deliverable events behind, which a relay
/// that is caught up waits for a moment before taking: here it stops at a
/// scope's second event in its lane (said), then reads the lane's batch to
/// its end (not said), then sets another operation's events aside (said).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_take_says_whether_it_left_events_behind() {
    let (store, db) = pg_log_store().await;
    let keys = keys_in_lane_of(&db, "more", "more-1", 3).await;
    append_raw(&db, &keys[0], "create_order").await;
    append_raw(&db, &keys[0], "create_order").await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    let (first, more) = store.take_events_more(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(first.len(), 1, "one event of a scope at a time");
    assert!(more, "the scope's second event is left behind");
    assert_eq!(store.events_delivered(&[first[0].seq], relay).await.unwrap(), vec![first[0].seq]);
    let (second, more) = store.take_events_more(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(second.len(), 1, "the scope's second event");
    assert!(!more, "the take read its lane's batch to its end");
    assert_eq!(store.events_delivered(&[second[0].seq], relay).await.unwrap(), vec![second[0].seq]);
    append_raw(&db, &keys[1], "other_operation").await;
    append_raw(&db, &keys[2], "create_order").await;
    let (third, more) = store.take_events_more(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(third.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![keys[2].as_str()]);
    assert!(more, "an event was set aside");
}

/// Replicas of an earlier version lease and end batches without knowing of
/// a batch's seq bound (migration 0016), so a bound can be left over from
/// an earlier batch: it is not used for a later one. Here an earlier relay
/// ends the batch whose bound is stored and starts the next one (its
/// statements leave the bound's columns as they were); this version's
/// relay still delivers the event past the stale bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_a_seq_bound_left_by_an_earlier_batch_is_not_used() {
    let (store, db) = pg_log_store().await;
    let keys = keys_in_lane_of(&db, "bound", "bound-1", 4).await;
    append_raw(&db, &keys[0], "create_order").await;
    append_raw(&db, &keys[1], "create_order").await;
    let ops = ["create_order"];
    let relay = Uuid::new_v4();
    // This version's relay takes the batch's first event: the batch gets its bound.
    let first = store.take_events(&ops, 1, LONG, relay).await.unwrap();
    assert_eq!(first.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![keys[0].as_str()]);
    assert_eq!(store.events_delivered(&[first[0].seq], relay).await.unwrap(), vec![first[0].seq]);
    let bound: Option<i64> =
        db.query_one("SELECT upto_seq FROM idemgate_event_lanes WHERE upto IS NOT NULL", &[]).await.expect("the batch under way").get(0);
    assert!(bound.is_some(), "the batch under way has its seq bound");
    // An earlier version's relay delivers the second event and ends the
    // batch; two more events come; it starts the next batch and delivers
    // the first of them.
    db.batch_execute(
        "UPDATE idemgate_event_lanes SET done = upto, upto = NULL, after_seq = NULL, taken = NULL, taken_all = false, \
         lease_token = NULL, lease_until = NULL WHERE upto IS NOT NULL",
    )
    .await
    .expect("batch ended");
    append_raw(&db, &keys[2], "create_order").await;
    append_raw(&db, &keys[3], "create_order").await;
    db.execute(
        "UPDATE idemgate_event_lanes SET upto = pg_current_snapshot(), \
         after_seq = (SELECT seq FROM idemgate_event_log WHERE idempotency_key = $1) \
         WHERE lane = (SELECT lane FROM idemgate_event_log WHERE idempotency_key = $1)",
        &[&keys[2]],
    )
    .await
    .expect("next batch");
    let last: i64 =
        db.query_one("SELECT seq FROM idemgate_event_log WHERE idempotency_key = $1", &[&keys[3]]).await.expect("the last event").get(0);
    assert!(bound.is_some_and(|b| b < last), "the stale bound ({bound:?}) is below the undelivered event ({last})");
    // This version's relay delivers it.
    let next = store.take_events(&ops, 10, LONG, relay).await.unwrap();
    assert_eq!(next.iter().map(|e| e.scope.key.as_str()).collect::<Vec<_>>(), vec![keys[3].as_str()], "the event past the stale bound");
    assert_eq!(store.events_delivered(&[next[0].seq], relay).await.unwrap(), vec![next[0].seq]);
    assert!(store.take_events(&ops, 10, LONG, relay).await.unwrap().is_empty());
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
