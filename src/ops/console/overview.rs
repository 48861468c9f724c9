//! `GET /admin/overview`: what the console's first page shows. Records by
//! operation and state (the store's count behind the `idemgate_records`
//! gauge: every state but `completed`), the unknown backlog by age, the
//! async queue, the outbox backlog, this replica's refused reloads and
//! fenced writes since it started, and its upstreams' concurrency limits.

use std::time::Duration;

use serde_json::{Value, json};

use crate::idempotency::record::{State, Timestamp};
use crate::store::{Store, StoreError};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::stats::StateCount;

/// The unknown backlog's age buckets: where each but the first starts, and
/// their labels. The store counts them in one statement.
const BOUNDS: [Duration; 3] = [Duration::from_secs(300), Duration::from_secs(3600), Duration::from_secs(86_400)];
const LABELS: [&str; 4] = ["under 5 minutes", "5 to 60 minutes", "1 to 24 hours", "over 24 hours"];

/// The overview document.
pub async fn overview(store: &Store, metrics: &Metrics) -> Result<Value, StoreError> {
    let now = store.now().await?;
    let counts = store.stats().await?;
    let events = store.event_stats().await?;
    let ages = store.unknown_by_age(&BOUNDS).await?;
    let (refused_reloads, fenced_writes) = metrics.refusals();
    let records: Vec<Value> = counts
        .iter()
        .map(|c| {
            json!({
                "operation": c.operation,
                "state": c.state.as_str(),
                "count": c.count,
                "oldest_age_seconds": age_of(c, now),
            })
        })
        .collect();
    let total = |state: State| counts.iter().filter(|c| c.state == state).map(|c| c.count).sum::<i64>();
    let oldest = |state: State| {
        counts.iter().filter(|c| c.state == state).map(|c| age_of(c, now)).fold(None, |m: Option<f64>, a| Some(m.map_or(a, |m| m.max(a))))
    };
    let totals: serde_json::Map<String, Value> =
        State::ALL.iter().filter(|s| **s != State::Completed).map(|s| (s.as_str().to_owned(), json!(total(*s)))).collect();
    Ok(json!({
        "now": now.to_string(),
        "records": records,
        "totals": totals,
        "unknown_by_age": LABELS.iter().zip(ages).map(|(label, n)| json!({ "age": label, "count": n })).collect::<Vec<_>>(),
        "async": {
            "queued": total(State::Queued),
            "processing": total(State::Processing),
            "oldest_queued_age_seconds": oldest(State::Queued),
            "oldest_processing_age_seconds": oldest(State::Processing),
        },
        "events": {
            "pending": events.pending,
            "parked": events.parked,
            "held": events.held,
            "oldest_pending_age_seconds": events.oldest_pending_at.map(|at| at.until(now).as_secs_f64()),
        },
        "this_replica": { "refused_reloads": refused_reloads, "fenced_writes": fenced_writes },
        // Admission under overload, on this replica: each upstream's
        // concurrency limit now, the slots held and the refusals since start.
        "upstreams": metrics.limits().into_iter().map(|l| json!({
            "upstream": l.upstream,
            "limit": l.limit,
            "in_flight": l.in_flight,
            "refusals": l.refusals,
        })).collect::<Vec<_>>(),
    }))
}

/// As `idemgate_oldest_record_age_seconds`: queued records since
/// acceptance, the others since their last change.
fn age_of(c: &StateCount, now: Timestamp) -> f64 {
    let since = if c.state == State::Queued { c.oldest_created_at } else { c.oldest_updated_at };
    since.until(now).as_secs_f64()
}
