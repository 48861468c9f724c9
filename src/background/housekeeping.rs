//! Background tasks: the sweeper (deletes completed records past retention),
//! the lease reaper (turns in-flight records whose lease expired into
//! `unknown`) and the record counters. Each is named, takes the shutdown token, survives store errors
//! (it logs and tries again next tick) and runs on a supervised tracker.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::store::StoreConfig;
use crate::store::{Reaped, Store, StoreError};
use crate::telemetry::metrics::Metrics;

/// Starts the sweeper and the record counters (the lease reaper, which
/// depends on the routes, is [`spawn_reaper`]).
pub fn spawn_all(tracker: &TaskTracker, store: Store, metrics: Arc<Metrics>, config: &StoreConfig, shutdown: CancellationToken) {
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
    // The record gauges (unknown backlog, queue depth, oldest ages): a grouped
    // count over the records that are not completed (a partial index).
    tracker.spawn(periodic("record_counter", STATS_INTERVAL.min(interval), shutdown, move || {
        let (store, metrics) = (store.clone(), metrics.clone());
        async move {
            let (counts, events, now) = (store.stats().await?, store.event_stats().await?, store.now().await?);
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
    shutdown: CancellationToken,
) {
    let (interval, batch) = (config.sweep_interval, config.sweep_batch);
    let reforwardable = Arc::new(reforwardable);
    tracker.spawn(periodic("lease_reaper", interval, shutdown, move || {
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
    }));
}

/// How often the record gauges are refreshed (at most).
const STATS_INTERVAL: Duration = Duration::from_secs(5);
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
    tracing::debug!(task = name, ?interval, "background task started");
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(interval) => {}
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
}
