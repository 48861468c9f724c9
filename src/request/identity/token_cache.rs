//! The cache of verified JWTs (issue 32): verifying an RS256 signature costs
//! tens of microseconds of CPU on every request, while a client sends the same
//! token again and again until it expires.
//!
//! An entry is keyed by the SHA-256 of the whole token (header, claims and
//! signature): a token that differs in one byte, a changed signature
//! included, is never a hit. It holds what a verification of that token
//! found, and is served only while a verification now would give the same
//! answer:
//!
//! - inside the token's time window as the verifier checks it (`nbf` and
//!   `exp`, with the configured leeway), by the same wall clock;
//! - while the key that verified it is still the one the key set gives for
//!   its `kid` (checked by the caller against the key set in force: a key
//!   removed from the JWKS or replaced under the same `kid` makes every
//!   entry it verified a miss at once; [`TokenCache::retain_signers`] also
//!   drops them after a refresh).
//!
//! Everything else a verification checks (the algorithm allow-list, issuer,
//! audience, `crit`, the claims read) depends only on the token's bytes and on
//! the source's configuration, which is fixed for the verifier that owns the
//! cache (a reload builds a new verifier, with an empty cache).
//!
//! At most [`CAPACITY`] entries; when full, the entry inserted first goes.
//! Only successful verifications are cached.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use sha2::{Digest, Sha256};

use crate::idempotency::key::Identity;

/// Most verified tokens remembered per JWT source (about 200 bytes each).
pub const CAPACITY: usize = 10_000;

/// SHA-256 of a token's bytes.
pub type TokenDigest = [u8; 32];

pub fn digest(token: &str) -> TokenDigest {
    digest_bytes(token.as_bytes())
}

pub fn digest_bytes(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// What verified a token: the configured HMAC secret (fixed for the
/// verifier), or a key of the key set, named by the token's `kid` and its
/// algorithm family and identified by the fingerprint of its JWK.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Signer<F> {
    Secret,
    Jwk { kid: Option<String>, family: F, fingerprint: [u8; 32] },
}

/// A verified token: who it names, by what key, and the seconds since the
/// epoch in which a verification accepts it (leeway included, both ends).
#[derive(Debug, Clone)]
pub struct Verified<F> {
    pub identity: Identity,
    pub signer: Signer<F>,
    pub valid_from: u64,
    pub valid_until: u64,
}

struct Inner<F> {
    entries: HashMap<TokenDigest, Verified<F>>,
    /// Insertion order of the keys of `entries` (each once).
    order: VecDeque<TokenDigest>,
}

/// A bounded map of verified tokens; see the module documentation.
pub struct TokenCache<F> {
    inner: Mutex<Inner<F>>,
    capacity: usize,
    hits: AtomicU64,
}

impl<F: Clone> TokenCache<F> {
    pub fn new(capacity: usize) -> TokenCache<F> {
        TokenCache {
            inner: Mutex::new(Inner { entries: HashMap::new(), order: VecDeque::new() }),
            capacity: capacity.max(1),
            hits: AtomicU64::new(0),
        }
    }

    /// The identity of the token with this digest if it was verified, `now`
    /// (seconds since the epoch) is inside its window, and `signed_by_current`
    /// says its signer is still the key in force.
    pub fn get(&self, digest: &TokenDigest, now: u64, signed_by_current: impl Fn(&Signer<F>) -> bool) -> Option<Identity> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let entry = inner.entries.get(digest)?;
        if now < entry.valid_from || now > entry.valid_until || !signed_by_current(&entry.signer) {
            return None;
        }
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(entry.identity.clone())
    }

    /// Remembers a verification (replacing an earlier one of the same token).
    pub fn insert(&self, digest: TokenDigest, verified: Verified<F>) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(entry) = inner.entries.get_mut(&digest) {
            *entry = verified;
            return;
        }
        while inner.entries.len() >= self.capacity {
            let Some(oldest) = inner.order.pop_front() else { break };
            inner.entries.remove(&oldest);
        }
        inner.entries.insert(digest, verified);
        inner.order.push_back(digest);
    }

    /// Drops the entries whose signer `keep` refuses (after the key set
    /// changed) and those past their window.
    pub fn retain_signers(&self, now: u64, keep: impl Fn(&Signer<F>) -> bool) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Inner { entries, order } = &mut *inner;
        entries.retain(|_, e| now <= e.valid_until && keep(&e.signer));
        order.retain(|d| entries.contains_key(d));
    }

    /// Tokens answered from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    pub fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verified(principal: &str, from: u64, until: u64) -> Verified<u8> {
        Verified {
            identity: Identity { tenant: "t".into(), principal: principal.into() },
            signer: Signer::Jwk { kid: Some("k".into()), family: 0, fingerprint: [7; 32] },
            valid_from: from,
            valid_until: until,
        }
    }

    #[test]
    fn served_only_inside_the_window_and_while_the_signer_stands() {
        let cache = TokenCache::new(4);
        let d = digest("a.b.c");
        cache.insert(d, verified("p", 100, 200));
        let any = |_: &Signer<u8>| true;
        assert_eq!(cache.get(&d, 99, any), None, "before nbf - leeway");
        assert_eq!(cache.get(&d, 100, any).map(|i| i.principal), Some("p".into()));
        assert_eq!(cache.get(&d, 200, any).map(|i| i.principal), Some("p".into()));
        assert_eq!(cache.get(&d, 201, any), None, "after exp + leeway");
        assert_eq!(cache.get(&d, 150, |_| false), None, "its key is no longer in force");
        assert_eq!(cache.get(&digest("a.b.d"), 150, any), None, "another signature");
        assert_eq!(cache.hits(), 2);
    }

    #[test]
    fn bounded_oldest_first() {
        let cache = TokenCache::new(3);
        let tokens: Vec<TokenDigest> = (0..5).map(|i| digest(&format!("t.{i}.s"))).collect();
        for (i, d) in tokens.iter().enumerate() {
            cache.insert(*d, verified(&i.to_string(), 0, 10));
            // Re-verifying a cached token replaces it in place.
            cache.insert(*d, verified(&i.to_string(), 0, 10));
        }
        assert_eq!(cache.len(), 3);
        let present: Vec<bool> = tokens.iter().map(|d| cache.get(d, 5, |_| true).is_some()).collect();
        assert_eq!(present, [false, false, true, true, true]);
    }

    #[test]
    fn retain_drops_refused_signers_and_expired_entries() {
        let cache = TokenCache::new(8);
        cache.insert(digest("a"), verified("a", 0, 10));
        cache.insert(digest("b"), verified("b", 0, 100));
        let mut other = verified("c", 0, 100);
        other.signer = Signer::Jwk { kid: Some("gone".into()), family: 0, fingerprint: [1; 32] };
        cache.insert(digest("c"), other);
        cache.retain_signers(50, |s| matches!(s, Signer::Jwk { kid: Some(k), .. } if k == "k"));
        assert_eq!(cache.len(), 1);
        assert!(cache.get(&digest("b"), 50, |_| true).is_some());
        // The order follows: inserting up to the capacity keeps "b" until it is the oldest.
        for i in 0..7 {
            cache.insert(digest(&i.to_string()), verified("n", 0, 100));
        }
        assert!(cache.get(&digest("b"), 50, |_| true).is_some());
        cache.insert(digest("x"), verified("n", 0, 100));
        assert!(cache.get(&digest("b"), 50, |_| true).is_none());
    }
}
