//! Background tasks: the sweeper (deletes completed records past retention),
//! the lease reaper (turns in-flight records whose lease expired into
//! `unknown`) and the record counters. Each is named, takes the shutdown token, survives store errors
//! (it logs and tries again next tick) and runs on a supervised tracker.
//!
//! The reaper runs every `sweep_interval`, and also just after the earliest
//! live lease the record counter last saw runs out ([`LeaseWatch`]): a lease
//! is the bound on take-over, not the sweep interval, and with no attempt
//! in flight nothing extra is asked of the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::idempotency::record::Timestamp;
use crate::store::StoreConfig;
use crate::store::{Reaped, Store, StoreError};
use crate::telemetry::metrics::Metrics;

/// What the record counter learns about live leases, for the reaper.
///
/// The counter already reads every open record's state every few seconds; it
/// also reads the earliest lease expiry of the `in_flight` and `processing`
/// records (the same index scan) and publishes it here. The reaper wakes just
/// after that expiry. The counter reads at least once per the shortest lease
/// of the routes in force, so an attempt whose replica died is seen before its
/// lease runs out, whichever replica claimed it.
#[derive(Debug)]
pub struct LeaseWatch {
    /// The earliest live lease's expiry, on this process's clock.
    next_expiry: watch::Sender<Option<Instant>>,
    /// The shortest lease of the routes in force, in microseconds (0: none).
    shortest_lease_us: AtomicU64,
}

/// How long after a lease's expiry the reaper passes (the store's clock
/// decides; this covers the rounding between the two clocks).
const REAP_GRACE: Duration = Duration::from_millis(200);
/// The counter never reads more often than this, however short a lease.
const COUNTER_FLOOR: Duration = Duration::from_millis(500);

impl LeaseWatch {
    pub fn new() -> Arc<LeaseWatch> {
        Arc::new(LeaseWatch { next_expiry: watch::Sender::new(None), shortest_lease_us: AtomicU64::new(0) })
    }

    /// The routes in force changed: their shortest lease (if any route).
    pub fn set_shortest_lease(&self, lease: Option<Duration>) {
        let us = lease.map_or(0, |l| u64::try_from(l.as_micros()).unwrap_or(u64::MAX).max(1));
        self.shortest_lease_us.store(us, Ordering::Relaxed);
    }

    /// How often the counter reads: `base`, or the shortest lease if shorter.
    fn counter_interval(&self, base: Duration) -> Duration {
        match self.shortest_lease_us.load(Ordering::Relaxed) {
            0 => base,
            us => base.min(Duration::from_micros(us).max(COUNTER_FLOOR)),
        }
    }

    /// The counter read `earliest` (the store's clock) at the store's `now`.
    fn saw(&self, earliest: Option<Timestamp>, now: Timestamp) {
        self.next_expiry.send_replace(earliest.map(|e| Instant::now() + now.until(e)));
    }
}

/// Starts the sweeper and the record counters (the lease reaper, which
/// depends on the routes, is [`spawn_reaper`]).
pub fn spawn_all(
    tracker: &TaskTracker,
    store: Store,
    metrics: Arc<Metrics>,
    config: &StoreConfig,
    leases: Arc<LeaseWatch>,
    shutdown: CancellationToken,
) {
    let (interval, batch, events_retention) = (config.sweep_interval, config.sweep_batch, config.events_retention);
    {
        let (store, metrics, shutdown) = (store.clone(), metrics.clone(), shutdown.clone());
        tracker.spawn(periodic("sweeper", interval, shutdown, move || {
            let (store, metrics) = (store.clone(), metrics.clone());
            async move {
                let n = drain_batches(batch, || store.sweep(batch)).await?;
                metrics.swept(n);
                // Delivered outbox events past their retention (pending and
                // parked ones are never deleted).
                let events = drain_batches(batch, || store.sweep_events(batch, events_retention)).await?;
                Ok(n + events)
            }
        }));
    }
    // Records kept forever, by operation: a count over their partial index,
    // less often than the other gauges (it grows with the business, not with
    // the backlog).
    {
        let (store, metrics, shutdown) = (store.clone(), metrics.clone(), shutdown.clone());
        tracker.spawn(periodic("forever_counter", FOREVER_STATS_INTERVAL.min(interval), shutdown, move || {
            let (store, metrics) = (store.clone(), metrics.clone());
            async move {
                metrics.set_forever_counts(&store.forever_counts().await?);
                Ok(0)
            }
        }));
    }
    // Tables whose statistics say they are tiny while they fill: analyzed,
    // or their plans made again (PostgreSQL; see `store::postgres::replan`).
    if store.caches_plans() {
        let (store, shutdown) = (store.clone(), shutdown.clone());
        tracker.spawn(periodic("plan_keeper", PLAN_LOOK_INTERVAL, shutdown, move || {
            let store = store.clone();
            async move {
                // Every second: its failures are thinned, as a request's are
                // (the other background passes say that the store is down).
                if let Err(e) = store.refresh_plans().await {
                    crate::telemetry::throttle::warn_throttled!(error = %e, "looking at the tables' statistics failed");
                }
                Ok(0)
            }
        }));
    }
    // The record gauges (unknown backlog, queue depth, oldest ages): a grouped
    // count over the records that are not completed (a partial index). It
    // also tells the reaper when the earliest live lease runs out.
    let every = {
        let leases = leases.clone();
        move || leases.counter_interval(STATS_INTERVAL.min(interval))
    };
    tracker.spawn(periodic_every("record_counter", every, shutdown, move || {
        let (store, metrics, leases) = (store.clone(), metrics.clone(), leases.clone());
        async move {
            let (counts, events, now) = (store.stats().await?, store.event_stats().await?, store.now().await?);
            leases.saw(crate::telemetry::stats::earliest_live_lease(&counts), now);
            metrics.set_record_counts(&counts, now);
            metrics.set_event_stats(&events, now);
            Ok(0)
        }
    }));
}

/// Starts the lease reaper: attempts whose lease ran out become `unknown`,
/// or go back to the queue (async, never sent or on a route in
/// `reforwardable`, whose upstream deduplicates by the derived key).
pub fn spawn_reaper(
    tracker: &TaskTracker,
    store: Store,
    metrics: Arc<Metrics>,
    config: &StoreConfig,
    reforwardable: Vec<Arc<str>>,
    leases: Arc<LeaseWatch>,
    shutdown: CancellationToken,
) {
    let (interval, batch) = (config.sweep_interval, config.sweep_batch);
    let reforwardable = Arc::new(reforwardable);
    let pass = move || {
        let (store, metrics, reforwardable) = (store.clone(), metrics.clone(), reforwardable.clone());
        async move {
            // Like drain_batches: until a batch comes back short.
            let mut total = Reaped::default();
            loop {
                let r = store.reap_leases(batch, &reforwardable).await?;
                total.unknown += r.unknown;
                total.requeued += r.requeued;
                if r.unknown + r.requeued < u64::from(batch) {
                    break;
                }
                tokio::task::yield_now().await;
            }
            if total.unknown > 0 {
                tracing::warn!(records = total.unknown, "attempts lost their lease and are now unknown; reconcile with `idemgate keys`");
            }
            if total.requeued > 0 {
                tracing::info!(operations = total.requeued, "async attempts lost their lease before sending (or may run again); re-queued");
            }
            metrics.reaped(total.unknown);
            metrics.requeued(total.requeued);
            Ok(total.unknown + total.requeued)
        }
    };
    tracker.spawn(reap_when_due(interval, leases, shutdown, pass));
}

/// The reaper's loop: a pass every `interval`, and one just after each lease
/// expiry `leases` reports (each expiry once: a later report of the same or an
/// earlier time, already passed, wakes nothing).
async fn reap_when_due<F, Fut>(interval: Duration, leases: Arc<LeaseWatch>, shutdown: CancellationToken, pass: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    tracing::debug!(task = "lease_reaper", ?interval, "background task started");
    let mut expiries = leases.next_expiry.subscribe();
    let mut next_sweep = Instant::now() + interval;
    let mut last_pass = Instant::now();
    loop {
        let due = match *expiries.borrow_and_update() {
            Some(expiry) if expiry + REAP_GRACE > last_pass => (expiry + REAP_GRACE).min(next_sweep),
            _ => next_sweep,
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            // `leases` is held here, so its sender outlives this loop.
            Ok(()) = expiries.changed() => continue,
            _ = tokio::time::sleep_until(due) => {}
        }
        match pass().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(task = "lease_reaper", records = n, "background pass done"),
            Err(e) => tracing::warn!(task = "lease_reaper", error = %e, "background pass failed; retrying next interval"),
        }
        last_pass = Instant::now();
        if last_pass >= next_sweep {
            next_sweep = last_pass + interval;
        }
    }
    tracing::debug!(task = "lease_reaper", "background task stopped");
}

/// How often the record gauges are refreshed (at most).
const STATS_INTERVAL: Duration = Duration::from_secs(5);
/// How often the tables' statistics are looked at for plans made on a tiny
/// table: a plan made while a table's statistics said it was empty is used
/// at most this long after the table starts to fill (plus one statement).
const PLAN_LOOK_INTERVAL: Duration = Duration::from_secs(1);
/// How often `idemgate_forever_records` is refreshed (at most).
const FOREVER_STATS_INTERVAL: Duration = Duration::from_secs(60);

/// Runs `op` until a batch comes back short: a tick drains the whole backlog,
/// in small statements (each holds its row locks only briefly), yielding to
/// the runtime between them. (A cap per tick would let a sustained write rate
/// outgrow the sweeper: 100 batches of 500 every 30 s is only 1,667 records/s.)
async fn drain_batches<F, Fut>(batch: u32, op: F) -> Result<u64, StoreError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    let mut total = 0;
    loop {
        let n = op().await?;
        total += n;
        if n < u64::from(batch) {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// Runs `tick` every `interval` until `shutdown`.
pub async fn periodic<F, Fut>(name: &'static str, interval: Duration, shutdown: CancellationToken, tick: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    periodic_every(name, move || interval, shutdown, tick).await;
}

/// Runs `tick` until `shutdown`, waiting `every()` before each.
async fn periodic_every<I, F, Fut>(name: &'static str, every: I, shutdown: CancellationToken, tick: F)
where
    I: Fn() -> Duration,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<u64, StoreError>>,
{
    tracing::debug!(task = name, interval = ?every(), "background task started");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(every()) => {}
        }
        match tick().await {
            Ok(0) => {}
            Ok(n) => tracing::debug!(task = name, records = n, "background pass done"),
            Err(e) => tracing::warn!(task = name, error = %e, "background pass failed; retrying next interval"),
        }
    }
    tracing::debug!(task = name, "background task stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    #[tokio::test]
    async fn drains_until_a_short_batch() {
        let calls = AtomicU64::new(0);
        let n = drain_batches(10, || {
            let c = calls.fetch_add(1, Ordering::SeqCst);
            async move { Ok(if c < 3 { 10 } else { 4 }) }
        })
        .await
        .unwrap();
        assert_eq!(n, 34);
        assert_eq!(calls.load(Ordering::SeqCst), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn periodic_ticks_until_cancelled() {
        let ticks = Arc::new(AtomicU64::new(0));
        let shutdown = CancellationToken::new();
        let t = ticks.clone();
        let task = tokio::spawn(periodic("test", Duration::from_secs(10), shutdown.clone(), move || {
            let t = t.clone();
            async move {
                t.fetch_add(1, Ordering::SeqCst);
                Err(StoreError::Unavailable("down".into()))
            }
        }));
        tokio::time::sleep(Duration::from_secs(35)).await;
        shutdown.cancel();
        task.await.unwrap();
        // Errors do not stop the task: three ticks in 35 s.
        assert_eq!(ticks.load(Ordering::SeqCst), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn the_reaper_passes_once_after_each_reported_expiry() {
        let passes = Arc::new(AtomicU64::new(0));
        let (leases, shutdown) = (LeaseWatch::new(), CancellationToken::new());
        let p = passes.clone();
        let task = tokio::spawn(reap_when_due(Duration::from_secs(3600), leases.clone(), shutdown.clone(), move || {
            let p = p.clone();
            async move {
                p.fetch_add(1, Ordering::SeqCst);
                Ok(0)
            }
        }));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 0, "nothing reported, nothing due");
        // The counter saw a lease that runs out in 2 s.
        leases.saw(Some(Timestamp(10_000_000)), Timestamp(8_000_000));
        tokio::time::sleep(Duration::from_millis(1900)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 0, "not before the expiry");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 1, "just after it");
        // The same expiry reported again (now past): no second pass.
        leases.saw(Some(Timestamp(10_000_000)), Timestamp(10_500_000));
        leases.saw(None, Timestamp(10_500_000));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 1, "each expiry once; otherwise the sweep interval");
        tokio::time::sleep(Duration::from_secs(3600)).await;
        assert_eq!(passes.load(Ordering::SeqCst), 2, "the sweep interval still runs it");
        shutdown.cancel();
        task.await.unwrap();
    }

    #[test]
    fn the_counter_reads_once_per_shortest_lease_when_that_is_shorter() {
        let leases = LeaseWatch::new();
        assert_eq!(leases.counter_interval(Duration::from_secs(5)), Duration::from_secs(5));
        leases.set_shortest_lease(Some(Duration::from_secs(2)));
        assert_eq!(leases.counter_interval(Duration::from_secs(5)), Duration::from_secs(2));
        leases.set_shortest_lease(Some(Duration::from_millis(10)));
        assert_eq!(leases.counter_interval(Duration::from_secs(5)), COUNTER_FLOOR);
        leases.set_shortest_lease(Some(Duration::from_secs(30)));
        assert_eq!(leases.counter_interval(Duration::from_secs(5)), Duration::from_secs(5));
    }
}
