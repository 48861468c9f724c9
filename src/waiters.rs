//! Local wake-ups for duplicates waiting on an in-flight result
//! (`in_flight = "wait"`). Sharded; a spurious wake-up only costs a poll, and
//! waiters also poll, which covers results recorded by other replicas.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use tokio::sync::Notify;

use crate::scope::Scope;

/// Poll interval bounds while waiting for an in-flight result.
const WAIT_POLL_MIN: Duration = Duration::from_millis(10);
const WAIT_POLL_MAX: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub struct Waiters {
    shards: Vec<Notify>,
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters::new()
    }
}

impl Waiters {
    const SHARDS: usize = 64;

    pub fn new() -> Waiters {
        Waiters { shards: (0..Self::SHARDS).map(|_| Notify::new()).collect() }
    }

    fn shard(&self, scope: &Scope) -> &Notify {
        let mut h = DefaultHasher::new();
        scope.hash(&mut h);
        &self.shards[(h.finish() as usize) % Self::SHARDS]
    }

    /// Wakes whoever waits on `scope` (and its shard neighbours).
    pub fn wake(&self, scope: &Scope) {
        self.shard(scope).notify_waiters();
    }

    /// Sleeps until woken, a poll interval passes (growing with `round`), or the deadline.
    pub async fn wait(&self, scope: &Scope, round: usize, deadline: tokio::time::Instant) {
        let poll = WAIT_POLL_MIN.saturating_mul(1 << round.min(5)).min(WAIT_POLL_MAX);
        let until = (tokio::time::Instant::now() + poll).min(deadline);
        tokio::select! {
            _ = self.shard(scope).notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}
