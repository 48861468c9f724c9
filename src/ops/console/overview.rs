//! `GET /admin/overview`: what the console's first page shows. Records by
//! operation and state (the store's count behind the `idemgate_records`
//! gauge: every state but `completed`), the unknown backlog by age, the
//! async queue, the outbox backlog, and this replica's refused reloads and
//! fenced writes since it started.

use serde_json::{Value, json};

use crate::idempotency::record::{State, Timestamp};
use crate::ops::keys;
use crate::store::{ListFilter, Store, StoreError};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::stats::StateCount;

/// Unknown records counted by age, at most this many (the rest are reported
/// as not counted).
pub const MAX_UNKNOWN_COUNTED: usize = 10_000;
const PAGE: u32 = 500;

/// The age buckets of the unknown backlog: upper bound in seconds, label.
const BUCKETS: [(i64, &str); 4] =
    [(300, "under 5 minutes"), (3600, "5 to 60 minutes"), (86_400, "1 to 24 hours"), (i64::MAX, "over 24 hours")];

/// The overview document.
pub async fn overview(store: &Store, metrics: &Metrics) -> Result<Value, StoreError> {
    let now = store.now().await?;
    let counts = store.stats().await?;
    let events = store.event_stats().await?;
    let (ages, counted_all) = unknown_ages(store, now).await?;
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
        "unknown_by_age": BUCKETS.iter().zip(ages).map(|((_, label), n)| json!({ "age": label, "count": n })).collect::<Vec<_>>(),
        "unknown_counted_all": counted_all,
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
    }))
}

/// As `idemgate_oldest_record_age_seconds`: queued records since
/// acceptance, the others since their last change.
fn age_of(c: &StateCount, now: Timestamp) -> f64 {
    let since = if c.state == State::Queued { c.oldest_created_at } else { c.oldest_updated_at };
    since.until(now).as_secs_f64()
}

/// Unknown records per bucket (age since they last changed), and whether
/// all were counted (at most [`MAX_UNKNOWN_COUNTED`]).
async fn unknown_ages(store: &Store, now: Timestamp) -> Result<([u64; 4], bool), StoreError> {
    let mut ages = [0u64; 4];
    let mut filter = ListFilter { state: Some(State::Unknown), limit: PAGE, ..ListFilter::default() };
    let mut seen = 0usize;
    loop {
        let page = keys::list(store, &filter).await?;
        for r in &page.records {
            ages[bucket(r.updated_at.until(now).as_secs())] += 1;
        }
        seen += page.records.len();
        match (page.next_cursor, page.records.last()) {
            (Some(_), Some(last)) if seen < MAX_UNKNOWN_COUNTED => filter.cursor = Some(crate::store::ListCursor::after(last)),
            (Some(_), _) => return Ok((ages, false)),
            (None, _) => return Ok((ages, true)),
        }
    }
}

fn bucket(age_secs: u64) -> usize {
    let age = i64::try_from(age_secs).unwrap_or(i64::MAX);
    BUCKETS.iter().position(|(limit, _)| age < *limit).unwrap_or(BUCKETS.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_fall_in_buckets() {
        assert_eq!([0, 299, 300, 3599, 3600, 86_399, 86_400, u64::MAX].map(bucket), [0, 0, 1, 1, 2, 2, 3, 3]);
    }
}
