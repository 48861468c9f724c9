//! Conformance of `Lifecycle`: the store's clock and its plan keeping, on
//! every backend.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idemgate::idempotency::record;
use idemgate::idempotency::record::Retention;

use super::{LONG, PAST_SHORT, SHORT, claim, claimed_at, existing, fp, key, micros, open, req, response, row};
use crate::support::{self, Backend};

on_both_stores!(only_a_store_whose_sessions_keep_plans_has_a_plan_keeper, times_come_from_the_store_clock);

on_pgbouncer!(only_a_store_whose_sessions_keep_plans_has_a_plan_keeper, times_come_from_the_store_clock);

on_citus!(only_a_store_whose_sessions_keep_plans_has_a_plan_keeper, times_come_from_the_store_clock);

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
