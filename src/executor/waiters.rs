//! Local wake-ups for duplicates waiting on an in-flight result
//! (`in_flight = "wait"`), and the results this replica is recording.
//!
//! Wake-ups are sharded; a spurious wake-up only costs a poll, and waiters
//! also poll, which covers results recorded by other replicas.
//!
//! A first request is answered as soon as the upstream's response is read;
//! its result is written right after, on the same tracked task (see
//! `executor::ResultWrite`). Until that write returns, the scope is listed
//! here, and a claim of the same scope on this replica waits for it first
//! ([`Waiters::settled`]): a client that retries on the replica that
//! answered it is replayed the answer it got, not told "in flight".

use crate::retry::Backoff;
use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{Notify, watch};

use crate::idempotency::key::Scope;

/// Poll interval bounds while waiting for an in-flight result.
const WAIT_POLL_MIN: Duration = Duration::from_millis(10);
const WAIT_POLL_MAX: Duration = Duration::from_millis(200);

#[derive(Debug)]
pub struct Waiters {
    shards: Vec<Notify>,
    /// Result writes in progress, sharded like `shards`.
    recording: Vec<Mutex<InProgress>>,
    next_id: AtomicU64,
}

/// The result writes in progress of one shard: by the scope's hash, the
/// write's id and a receiver that sees the write's sender dropped.
type InProgress = HashMap<u64, (u64, watch::Receiver<()>)>;

/// A result write in progress (see [`Waiters::recording`]); dropping it
/// (the write returned, whatever its outcome) releases those waiting.
#[must_use]
#[derive(Debug)]
pub struct Recording<'a> {
    waiters: &'a Waiters,
    hash: u64,
    id: u64,
    _done: watch::Sender<()>,
}

impl Drop for Recording<'_> {
    fn drop(&mut self) {
        let mut shard = self.waiters.recording_shard(self.hash).lock().unwrap_or_else(|p| p.into_inner());
        if shard.get(&self.hash).is_some_and(|(id, _)| *id == self.id) {
            shard.remove(&self.hash);
        }
        // `_done` drops after this: every receiver's `changed()` then returns.
    }
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters::new()
    }
}

impl Waiters {
    const SHARDS: usize = 64;

    pub fn new() -> Waiters {
        Waiters {
            shards: (0..Self::SHARDS).map(|_| Notify::new()).collect(),
            recording: (0..Self::SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            next_id: AtomicU64::new(0),
        }
    }

    fn hash(scope: &Scope) -> u64 {
        let mut h = DefaultHasher::new();
        scope.hash(&mut h);
        h.finish()
    }

    fn shard(&self, scope: &Scope) -> &Notify {
        &self.shards[(Self::hash(scope) as usize) % Self::SHARDS]
    }

    fn recording_shard(&self, hash: u64) -> &Mutex<InProgress> {
        &self.recording[(hash as usize) % Self::SHARDS]
    }

    /// Lists `scope` as having its result written until the returned guard
    /// is dropped.
    pub fn recording(&self, scope: &Scope) -> Recording<'_> {
        let hash = Self::hash(scope);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done, rx) = watch::channel(());
        self.recording_shard(hash).lock().unwrap_or_else(|p| p.into_inner()).insert(hash, (id, rx));
        Recording { waiters: self, hash, id, _done: done }
    }

    /// Returns once no result write of `scope` is in progress on this replica
    /// (at once when none is), or after `bound`. A write of another scope
    /// with the same hash only costs a wait for that write.
    pub async fn settled(&self, scope: &Scope, bound: Duration) {
        let hash = Self::hash(scope);
        let pending = self.recording_shard(hash).lock().unwrap_or_else(|p| p.into_inner()).get(&hash).map(|(_, rx)| rx.clone());
        if let Some(mut rx) = pending {
            // Err once the sender is dropped, i.e. the write returned.
            let _ = tokio::time::timeout(bound, rx.changed()).await;
        }
    }

    /// Wakes whoever waits on `scope` (and its shard neighbours).
    pub fn wake(&self, scope: &Scope) {
        self.shard(scope).notify_waiters();
    }

    /// Sleeps until woken, a poll interval passes (growing with `round`), or the deadline.
    pub async fn wait(&self, scope: &Scope, round: usize, deadline: tokio::time::Instant) {
        let poll = Backoff::new(WAIT_POLL_MIN, WAIT_POLL_MAX).after(u32::try_from(round).unwrap_or(u32::MAX).saturating_add(1));
        let until = (tokio::time::Instant::now() + poll).min(deadline);
        tokio::select! {
            _ = self.shard(scope).notified() => {}
            _ = tokio::time::sleep_until(until) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::key::{IdempotencyKey, Identity};
    use std::sync::Arc;

    fn scope(key: &str) -> Scope {
        let identity = Identity { tenant: "t".into(), principal: "p".into() };
        Scope::new(&identity, &Arc::from("create_order"), IdempotencyKey::parse(&http::HeaderValue::from_str(key).unwrap()).unwrap())
    }

    #[tokio::test(start_paused = true)]
    async fn a_claim_waits_for_its_scopes_result_write_only() {
        let waiters = Arc::new(Waiters::new());
        // Nothing being written: at once.
        tokio::time::timeout(Duration::from_millis(1), waiters.settled(&scope("a"), Duration::from_secs(60))).await.unwrap();
        let writing = waiters.recording(&scope("a"));
        // Another scope does not wait.
        tokio::time::timeout(Duration::from_millis(1), waiters.settled(&scope("b"), Duration::from_secs(60))).await.unwrap();
        let w = waiters.clone();
        let waiting = tokio::spawn(async move { w.settled(&scope("a"), Duration::from_secs(60)).await });
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(!waiting.is_finished(), "waits while the write is in progress");
        drop(writing);
        tokio::time::timeout(Duration::from_millis(1), waiting).await.unwrap().unwrap();
        // The bound holds when a write never returns.
        let _stuck = waiters.recording(&scope("a"));
        let started = tokio::time::Instant::now();
        waiters.settled(&scope("a"), Duration::from_secs(2)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(2));
    }
}
