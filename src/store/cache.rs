//! The replay cache (PostgreSQL only): completed records this replica read
//! in the last second, so that a replay of the same key does not go to the
//! database again.
//!
//! It can serve neither stale nor foreign data:
//!
//! - **Only what the database just returned, only for a second.** An entry
//!   is a completed record that a claim statement returned, and it is served
//!   for at most [`LEASE`] after that statement was *sent* (this replica's
//!   monotonic clock), so every answer from it is one the database gave
//!   within the last [`LEASE`].
//! - **Changes wait for the leases.** A completed record changes only when it
//!   expires, or when an operator (CLI, admin API) or the reconciler resolves
//!   it. Expiry: an entry never outlives the record's `expires_at` (the
//!   database's clock, measured as a duration from the statement, less
//!   [`EXPIRY_MARGIN`]). Resolution: `PgStore::resolve` first marks the record
//!   held (`cache_hold_until`, committed), so no replica caches it from then
//!   on, then waits [`HOLD_WAIT`] (longer than [`LEASE`]), by which time every
//!   entry any replica took before the mark has run out, and only then
//!   changes the record. So when a resolution is acknowledged, no replica's
//!   cache holds the old record, and every replica's next replay reads the
//!   new one. No clocks are compared between machines: each side measures a
//!   duration on its own monotonic clock, and the entry's starts before the
//!   hold's.
//! - **Same scope, same request.** The key is the whole scope (tenant,
//!   principal, operation, key) and an entry is served only for the same
//!   request fingerprint; anything else goes to the database. The cache sits
//!   in the store's claim, after identity, the authorizer and the key, so a
//!   request that would not reach the database's claim never reaches the
//!   cache, and what the gateway does with the record (replay, `refetch`,
//!   202 for an operation) is what it does with the database's answer.
//! - **Bounded memory**: at most [`MAX_ENTRIES`] entries and [`MAX_BYTES`] of
//!   stored responses; larger responses are not cached.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

use crate::idempotency::fingerprint::Fingerprint;
use crate::idempotency::key::Scope;
use crate::idempotency::record::{Record, State, Timestamp};

/// How long after its statement was sent an entry is served.
pub const LEASE: Duration = Duration::from_secs(1);
/// How long a resolution of a completed record waits after holding it out of
/// the caches: every entry taken before the hold has run out by then.
pub const HOLD_WAIT: Duration = Duration::from_millis(1500);
/// How long the hold lasts (the database's clock): long enough for the
/// wait and the resolution's own transaction; a resolution that finds it run
/// out holds again.
pub const HOLD: Duration = Duration::from_secs(60);
/// An entry stops this long before the record's expiry.
pub const EXPIRY_MARGIN: Duration = Duration::from_secs(1);
/// At most this many entries ...
pub const MAX_ENTRIES: usize = 8192;
/// ... and this many bytes of stored responses (headers and body).
pub const MAX_BYTES: usize = 8 << 20;
/// Responses larger than this are not cached.
pub const MAX_ENTRY_BYTES: usize = 64 << 10;

const SHARDS: usize = 8;

struct Entry {
    record: Record,
    /// The database's `now()` as the statement saw it, and when (this
    /// replica's clock) the statement was sent.
    db_now: Timestamp,
    sent: Instant,
    /// Served until then.
    until: Instant,
    bytes: usize,
}

#[derive(Default)]
struct Shard {
    entries: HashMap<Scope, Entry>,
    bytes: usize,
}

/// See the module documentation.
pub struct ReplayCache {
    shards: Vec<Mutex<Shard>>,
    hasher: RandomState,
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReplayCache")
    }
}

impl Default for ReplayCache {
    fn default() -> Self {
        ReplayCache { shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(), hasher: RandomState::new() }
    }
}

fn response_bytes(record: &Record) -> usize {
    record
        .response
        .as_ref()
        .map_or(0, |r| r.body.as_ref().map_or(0, |b| b.len()) + r.headers.iter().map(|(n, v)| n.len() + v.len()).sum::<usize>())
}

impl ReplayCache {
    fn shard(&self, scope: &Scope) -> &Mutex<Shard> {
        let i = usize::try_from(self.hasher.hash_one(scope)).unwrap_or(0) % SHARDS;
        &self.shards[i]
    }

    /// The record cached for `scope` and a request with this fingerprint, and
    /// the database clock now (estimated: the statement's `now()` plus the
    /// time since it was sent, which is never earlier than the real one).
    pub fn get(&self, scope: &Scope, request_hash: &Fingerprint) -> Option<(Record, Timestamp)> {
        let at = Instant::now();
        let shard = self.shard(scope).lock().ok()?;
        let e = shard.entries.get(scope)?;
        if at >= e.until || e.record.request_hash != *request_hash {
            return None;
        }
        let since = i64::try_from(at.duration_since(e.sent).as_micros()).unwrap_or(i64::MAX);
        Some((e.record.clone(), Timestamp(e.db_now.0.saturating_add(since))))
    }

    /// Keeps `record`, which a claim statement sent at `sent` returned with
    /// the database's clock `db_now`, and which no resolution holds out of the
    /// caches. Only completed records that stay so for a while are kept.
    pub fn put(&self, record: &Record, db_now: Timestamp, sent: Instant) {
        if record.state != State::Completed || record.response.is_none() {
            return;
        }
        let bytes = response_bytes(record);
        if bytes > MAX_ENTRY_BYTES {
            return;
        }
        let left = db_now.until(record.expires_at).saturating_sub(EXPIRY_MARGIN);
        let until = sent + left.min(LEASE);
        let now = Instant::now();
        if until <= now {
            return;
        }
        let Ok(mut shard) = self.shard(&record.scope).lock() else { return };
        if let Some(old) = shard.entries.remove(&record.scope) {
            shard.bytes -= old.bytes;
        }
        if shard.entries.len() >= MAX_ENTRIES / SHARDS || shard.bytes + bytes > MAX_BYTES / SHARDS {
            // Full: make room from entries that ran out; if none did, the
            // record is not cached (the next replay reads the database).
            let mut freed = 0;
            shard.entries.retain(|_, e| {
                let keep = e.until > now;
                if !keep {
                    freed += e.bytes;
                }
                keep
            });
            shard.bytes -= freed;
            if shard.entries.len() >= MAX_ENTRIES / SHARDS || shard.bytes + bytes > MAX_BYTES / SHARDS {
                return;
            }
        }
        shard.bytes += bytes;
        shard.entries.insert(record.scope.clone(), Entry { record: record.clone(), db_now, sent, until, bytes });
    }

    /// Drops the entry for `scope` (this replica learned the record changed).
    pub fn forget(&self, scope: &Scope) {
        if let Ok(mut shard) = self.shard(scope).lock()
            && let Some(old) = shard.entries.remove(scope)
        {
            shard.bytes -= old.bytes;
        }
    }

    /// Entries held now (expired ones included until they are swept).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map_or(0, |s| s.entries.len())).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::key::IdempotencyKey;
    use crate::idempotency::record::{Generation, StoredResponse};
    use bytes::Bytes;
    use uuid::Uuid;

    fn record(key: &str, hash: u8, expires_in: Duration) -> (Record, Timestamp) {
        let now = Timestamp(1_700_000_000_000_000);
        let expires = Timestamp(now.0 + i64::try_from(expires_in.as_micros()).unwrap());
        let scope = Scope { tenant: "t".into(), principal: "p".into(), operation: "op".into(), key: IdempotencyKey::new(key).unwrap() };
        let r = Record {
            scope,
            request_hash: Fingerprint([hash; 32]),
            state: State::Completed,
            generation: Generation(1),
            claim_token: Uuid::new_v4(),
            owner: "r".into(),
            lease_expires_at: None,
            response: Some(StoredResponse { status: 201, headers: vec![], body: Some(Bytes::from_static(b"{}")) }),
            created_at: now,
            updated_at: now,
            expires_at: expires,
            operation_id: None,
            attempts: 0,
            next_attempt_at: None,
            sent_at: None,
            last_status: None,
            maybe_executed: false,
            key_source: None,
            reforward_key: None,
            sent_key: None,
            fingerprint_spec: None,
        };
        (r, now)
    }

    #[test]
    fn serves_the_same_scope_and_fingerprint_only() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", 1, Duration::from_secs(3600));
        cache.put(&r, now, Instant::now());
        assert!(cache.get(&r.scope, &Fingerprint([1; 32])).is_some());
        assert!(cache.get(&r.scope, &Fingerprint([2; 32])).is_none(), "another request under the same key");
        let mut other = r.scope.clone();
        other.principal = "q".into();
        assert!(cache.get(&other, &Fingerprint([1; 32])).is_none(), "another principal");
    }

    #[test]
    fn entries_run_out_with_their_lease_and_before_the_record_expires() {
        let cache = ReplayCache::default();
        let (r, now) = record("k", 1, Duration::from_secs(3600));
        cache.put(&r, now, Instant::now() - LEASE);
        assert!(cache.get(&r.scope, &r.request_hash).is_none(), "an entry older than its lease");
        let (soon, now) = record("s", 1, EXPIRY_MARGIN + Duration::from_millis(10));
        cache.put(&soon, now, Instant::now() - Duration::from_millis(20));
        assert!(cache.get(&soon.scope, &soon.request_hash).is_none(), "a record about to expire");
        let (mut open, now) = record("o", 1, Duration::from_secs(3600));
        open.state = State::InFlight;
        cache.put(&open, now, Instant::now());
        assert!(cache.is_empty(), "only completed records");
    }

    #[test]
    fn the_cache_stays_within_its_bounds() {
        let cache = ReplayCache::default();
        for i in 0..(MAX_ENTRIES * 2) {
            let (r, now) = record(&format!("k{i}"), 1, Duration::from_secs(3600));
            cache.put(&r, now, Instant::now());
        }
        assert!(cache.len() <= MAX_ENTRIES, "{} entries", cache.len());
        let (mut big, now) = record("big", 1, Duration::from_secs(3600));
        big.response = Some(StoredResponse { status: 200, headers: vec![], body: Some(Bytes::from(vec![0u8; MAX_ENTRY_BYTES + 1])) });
        let cache = ReplayCache::default();
        cache.put(&big, now, Instant::now());
        assert!(cache.is_empty());
    }
}
