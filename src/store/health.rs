//! Whether the store takes writes, for readiness.
//!
//! A store can answer reads and refuse every write: the embedded store's
//! filesystem full or read-only, a database role without write grants. A
//! read ping cannot see that, so readiness also looks at writes: every
//! failed write (a claim, a result, the sweeper's) is noted here, and
//! `/readyz` then sends a write probe of its own before it says ready again
//! (a probe also runs when none ran for [`PROBE_EVERY`], so an idle replica
//! finds out too). Only a probe clears a failure: a write that happened to
//! change nothing (a sweep with nothing to delete) succeeds even on a full
//! disk.
//!
//! Instants are kept as milliseconds since the tracker was made (plus one,
//! so zero means never), in atomics: noting a failure costs one atomic on
//! the failing path and nothing on the succeeding one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// A successful probe stands for this long while no write fails.
pub const PROBE_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
pub struct WriteHealth {
    base: Instant,
    /// When the last write failed.
    failed: AtomicU64,
    /// When the last successful probe started.
    probed: AtomicU64,
}

impl Default for WriteHealth {
    fn default() -> Self {
        WriteHealth { base: Instant::now(), failed: AtomicU64::new(0), probed: AtomicU64::new(0) }
    }
}

impl WriteHealth {
    /// The current instant, as stored.
    pub fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    /// A write failed for want of a working store.
    pub fn failed(&self) {
        self.failed.fetch_max(self.now(), Ordering::AcqRel);
    }

    /// A probe that started at `started` (from [`WriteHealth::now`]) succeeded.
    pub fn probed(&self, started: u64) {
        self.probed.fetch_max(started, Ordering::AcqRel);
    }

    /// Whether readiness must probe before saying ready: never probed, a
    /// write failed since the last successful probe began, or that probe is
    /// older than [`PROBE_EVERY`].
    pub fn needs_probe(&self) -> bool {
        let probed = self.probed.load(Ordering::Acquire);
        let failed = self.failed.load(Ordering::Acquire);
        let every = u64::try_from(PROBE_EVERY.as_millis()).unwrap_or(u64::MAX);
        probed == 0 || failed >= probed || self.now().saturating_sub(probed) > every
    }
}

/// Why the store is not ready, as `/readyz` says it.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    /// The store does not answer a read (or, PostgreSQL, only a read-only
    /// server does).
    #[error("{0}")]
    Unavailable(super::StoreError),
    /// It answers reads but a write probe failed.
    #[error("write probe failed: {0}")]
    NotWritable(super::StoreError),
}

impl NotReady {
    /// The body of `/readyz`'s 503.
    pub fn body(&self) -> &'static str {
        match self {
            NotReady::Unavailable(_) => "store unavailable\n",
            NotReady::NotWritable(_) => "store not writable\n",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_needs_a_later_probe() {
        let h = WriteHealth::default();
        assert!(h.needs_probe(), "never probed");
        let started = h.now();
        h.probed(started);
        assert!(!h.needs_probe());
        h.failed();
        assert!(h.needs_probe(), "a write failed after the probe began");
        // A probe that began before the failure does not clear it.
        h.probed(started);
        assert!(h.needs_probe());
        std::thread::sleep(Duration::from_millis(2));
        h.probed(h.now());
        assert!(!h.needs_probe());
    }
}
