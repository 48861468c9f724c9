//! Plans made on an emptied table (docs/performance.md, "Plans made on an
//! emptied table").
//!
//! Every session plans each statement once (generic plans, see `sql`) and
//! keeps the plan until the table's statistics change. A VACUUM of an emptied
//! table leaves zero pages and zero tuples in `pg_class`, which the planner
//! believes, and invalidates every session's plans: the next use of each
//! statement plans it for an empty table (nested loops that join by a filter
//! over a whole index), and that plan stays while the table fills, until
//! autovacuum's next ANALYZE, about a minute later. The relay's take so
//! planned took 19.8 s with 15,000 events pending.
//!
//! The record counter (`Lifecycle::refresh_plans`) asks every few seconds whether the statistics of a
//! table still say "empty" while it has pages again. When one starts to, every
//! pooled connection discards its cached plans at its next checkout
//! (`DISCARD PLANS`; the statements stay prepared), so they are planned again
//! with the table's real size (the planner reads the current number of pages
//! when the statistics have none).

// The pool's metrics are `std::time::Instant`s; marks must be comparable
// with them, so this module keeps std's `Instant` (as `failover` does).
#![allow(clippy::disallowed_types)]

use std::sync::{Arc, Mutex};
use std::time::Instant;

use deadpool_postgres::{Hook, HookError};

/// `[records, events]`: whether `pg_class` says the table is empty (zero
/// pages, zero tuples) while it has pages.
pub(super) const BELIEVED_EMPTY: &str = "\
SELECT coalesce(bool_or(c.relname = 'idemgate_records'), false), coalesce(bool_or(c.relname = 'idemgate_events'), false)
FROM pg_class c
WHERE c.oid IN (to_regclass('idemgate_records'), to_regclass('idemgate_events'))
  AND c.relpages = 0 AND c.reltuples = 0 AND pg_relation_size(c.oid) > 0";

#[derive(Debug, Default)]
pub(super) struct Replan {
    /// Connections last handed out before this discard their plans.
    since: Mutex<Option<Instant>>,
    /// What the last look saw, per table.
    believed_empty: Mutex<[bool; 2]>,
}

impl Replan {
    /// What the record counter's look found (`[records, events]`). A table
    /// that starts being believed empty while it has pages makes every
    /// connection's plans stale.
    pub(super) fn saw(&self, now: [bool; 2]) {
        let Ok(mut last) = self.believed_empty.lock() else { return };
        let started = last.iter().zip(now).any(|(was, is)| !*was && is);
        *last = now;
        if started && let Ok(mut since) = self.since.lock() {
            *since = Some(Instant::now());
            tracing::info!(
                records = now[0],
                events = now[1],
                "a table's statistics say it is empty but it is filling: pooled connections plan their statements again"
            );
        }
    }

    fn stale(&self, last_handed_out: Instant) -> bool {
        self.since.lock().ok().and_then(|s| *s).is_some_and(|mark| last_handed_out <= mark)
    }

    /// The pool hook: a connection last handed out before the mark discards
    /// its cached plans before it is handed out again.
    pub(super) fn hook(replan: Arc<Replan>) -> Hook {
        Hook::async_fn(move |client, metrics| {
            let stale = replan.stale(metrics.recycled.unwrap_or(metrics.created));
            Box::pin(async move {
                if stale {
                    client.batch_execute("DISCARD PLANS").await.map_err(HookError::Backend)?;
                }
                Ok(())
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_table_starting_to_be_believed_empty_marks_the_plans_stale() {
        let r = Replan::default();
        let before = Instant::now();
        r.saw([false, false]);
        assert!(!r.stale(before), "nothing seen yet");
        r.saw([false, true]);
        assert!(r.stale(before), "the events table is believed empty while it has pages");
        let after = Instant::now();
        r.saw([false, true]);
        assert!(!r.stale(after), "still believed empty: connections handed out since planned with its pages");
        r.saw([false, false]);
        r.saw([true, false]);
        assert!(r.stale(after), "the records table starts to be");
    }
}
