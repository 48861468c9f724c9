//! Plans made while a table's statistics say it is tiny (docs/performance-notes.md,
//! "Plans made on an emptied table").
//!
//! Every session plans each statement once (generic plans, see `sql`) and
//! keeps the plan until the table's statistics change. When the statistics
//! say a table holds almost nothing (a VACUUM of an emptied table leaves zero
//! pages and zero tuples in `pg_class`; an ANALYZE of a table of a few dozen
//! rows says as much), every index read costs about the same, and the
//! planner may join by a filter over a whole index. Such a plan stays while
//! the table fills, until autovacuum's next ANALYZE, up to a minute later.
//! The relay's take so planned took 19.8 s with 15,000 events pending.
//!
//! Each look (`Lifecycle::refresh_plans`, every second) reads each table's
//! statistics, size and changes since its last ANALYZE, and:
//!
//! - **analyzes** a table the statistics call tiny once it has changed
//!   enough (`ANALYZE (SKIP_LOCKED)`, when the gateway's role may: the
//!   owner's). New statistics invalidate every session's plans of that table,
//!   on every replica; PostgreSQL plans them again with the table's real size.
//! - otherwise, **discards** the plans of every pooled connection at its
//!   next checkout (`DISCARD PLANS`; the statements stay prepared) each time
//!   such a table doubles in pages: the planner scales the statistics' rows
//!   per page by the pages the table has now (or estimates rows per page from
//!   the row width when the statistics have no pages). This is what a runtime
//!   role that does not own the tables gets.

// The pool's metrics are `std::time::Instant`s; marks must be comparable
// with them, so this module keeps std's `Instant` (as `failover` does).
#![allow(clippy::disallowed_types)]

use std::sync::{Arc, Mutex};
use std::time::Instant;

use deadpool_postgres::{Hook, HookError};

/// The tables whose statistics are watched.
pub(super) const TABLES: [&str; 2] = ["idemgate_records", "idemgate_events"];

/// Per table of [`TABLES`]: its name, its statistics' rows
/// (`reltuples`; -1 before its first VACUUM or ANALYZE), its pages now,
/// rows changed since its last ANALYZE, and whether this role may ANALYZE it.
pub(super) const TABLE_LOOK: &str = "\
SELECT c.relname::text, c.reltuples::float8, (pg_relation_size(c.oid) / current_setting('block_size')::int8)::int8,
       coalesce(s.n_mod_since_analyze, 0)::int8, pg_has_role(c.relowner, 'USAGE')
FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE c.oid IN (to_regclass('idemgate_records'), to_regclass('idemgate_events'))";

/// Statistics of fewer rows than this call the table tiny. Generic plans
/// checked by `tests/it/pg_plans.rs`' rules on tables VACUUM ANALYZEd with a
/// few rows (docs/performance-notes.md): statistics of 2 rows gave ten statements
/// a whole-index join, of 20 and 60 rows one (`mark_sent_batch`), of 200
/// rows and more none.
const TINY_ROWS: f64 = 1000.0;

/// Rows changed since the last ANALYZE after which a tiny table is analyzed.
const ANALYZE_AFTER_CHANGES: i64 = 100;

/// One look at one table (a row of [`TABLE_LOOK`]).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Look {
    pub(super) table: String,
    pub(super) rows: f64,
    pub(super) pages: i64,
    pub(super) changed: i64,
    pub(super) may_analyze: bool,
}

impl Look {
    /// Statistics that say the table is tiny. Before a table's first
    /// VACUUM or ANALYZE (`rows` -1) the planner assumes ten pages of
    /// rows, and plans right (`tests/it/pg_plans.rs`).
    fn tiny(&self) -> bool {
        (0.0..TINY_ROWS).contains(&self.rows)
    }

    /// The table's pages as a power of two (0 for no pages), while its
    /// statistics say it is tiny; 0 otherwise.
    fn level(&self) -> u32 {
        if self.tiny() { u64::BITS - (self.pages.max(0) as u64).leading_zeros() } else { 0 }
    }
}

#[derive(Debug, Default)]
pub(super) struct Replan {
    /// Connections last handed out before this discard their plans.
    since: Mutex<Option<Instant>>,
    /// Per table of [`TABLES`]: its `Look::level` at the last look.
    levels: Mutex<[u32; 2]>,
}

impl Replan {
    /// What a look found. Returns the tables to ANALYZE; a tiny table that
    /// doubled in pages since the last look makes every connection's plans
    /// stale.
    pub(super) fn saw(&self, looks: &[Look]) -> Vec<&'static str> {
        let Ok(mut levels) = self.levels.lock() else { return Vec::new() };
        let mut analyze = Vec::new();
        let mut grew = Vec::new();
        for look in looks {
            let Some(i) = TABLES.iter().position(|t| *t == look.table) else { continue };
            let level = look.level();
            if level > levels[i] {
                grew.push(TABLES[i]);
            }
            levels[i] = level;
            if look.tiny() && look.may_analyze && look.changed >= ANALYZE_AFTER_CHANGES {
                analyze.push(TABLES[i]);
            }
        }
        if !grew.is_empty()
            && let Ok(mut since) = self.since.lock()
        {
            *since = Some(Instant::now());
            tracing::info!(tables = ?grew, "statistics say a table is tiny while it fills: pooled connections plan their statements again");
        }
        analyze
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

    fn look(table: &str, rows: f64, pages: i64, changed: i64, may_analyze: bool) -> Look {
        Look { table: table.into(), rows, pages, changed, may_analyze }
    }

    #[test]
    fn a_tiny_table_doubling_in_pages_marks_the_plans_stale() {
        let r = Replan::default();
        let before = Instant::now();
        r.saw(&[look("idemgate_records", 5000.0, 300, 0, false), look("idemgate_events", 0.0, 0, 0, false)]);
        assert!(!r.stale(before), "nothing tiny has pages");
        r.saw(&[look("idemgate_events", 0.0, 1, 10, false)]);
        assert!(r.stale(before), "the events' statistics say empty while the table has a page");
        let after = Instant::now();
        r.saw(&[look("idemgate_events", 0.0, 1, 10, false)]);
        assert!(!r.stale(after), "no new page: connections handed out since planned with it");
        r.saw(&[look("idemgate_events", 0.0, 3, 10, false)]);
        assert!(r.stale(after), "two pages more: the table doubled");
        let after = Instant::now();
        r.saw(&[look("idemgate_events", 0.0, 3, 10, false)]);
        r.saw(&[look("idemgate_records", -1.0, 4000, 0, false)]);
        assert!(!r.stale(after), "no doubling, and statistics never taken are not tiny");
        r.saw(&[look("idemgate_records", 999.0, 4000, 0, false)]);
        assert!(r.stale(after), "the records' statistics say 999 rows of 4,000 pages");
        let after = Instant::now();
        r.saw(&[look("idemgate_records", 1000.0, 8000, 0, false)]);
        assert!(!r.stale(after), "1,000 rows are not tiny");
        r.saw(&[look("idemgate_records", 0.0, 0, 0, false)]);
        r.saw(&[look("idemgate_records", 0.0, 1, 0, false)]);
        assert!(r.stale(after), "emptied, truncated and filling again");
    }

    #[test]
    fn a_tiny_table_that_changed_enough_is_analyzed_by_a_role_that_may() {
        let r = Replan::default();
        assert!(r.saw(&[look("idemgate_records", 0.0, 9, 99, true)]).is_empty(), "99 changes");
        assert_eq!(r.saw(&[look("idemgate_records", 0.0, 9, 100, true)]), ["idemgate_records"]);
        assert_eq!(r.saw(&[look("idemgate_records", 999.0, 9, 5000, true)]), ["idemgate_records"]);
        assert!(r.saw(&[look("idemgate_records", 0.0, 9, 100, false)]).is_empty(), "not the owner");
        assert!(r.saw(&[look("idemgate_records", 1000.0, 9, 5000, true)]).is_empty(), "not tiny");
        assert!(r.saw(&[look("idemgate_records", -1.0, 9, 5000, true)]).is_empty(), "never analyzed: not tiny");
        assert!(r.saw(&[look("idemgate_other", 0.0, 9, 5000, true)]).is_empty(), "not ours");
        let both = r.saw(&[look("idemgate_records", 10.0, 9, 500, true), look("idemgate_events", 0.0, 0, 100, true)]);
        assert_eq!(both, ["idemgate_records", "idemgate_events"]);
    }
}
