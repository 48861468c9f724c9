//! The fingerprint settings each operation has had, as the store lists them
//! (migration 0019). A rollout or a reload that changes a route's
//! `fingerprint.*` settings changes what an identical request fingerprints
//! as. A record keeps the digest of the settings its hash was computed under
//! (`Record::fingerprint_spec`); a request whose fingerprint differs from
//! its record's, and whose route's settings are not the record's, is also
//! fingerprinted under the record's own settings, looked up here by digest
//! ([`crate::proxy::admission::decide_with_legacy`]), so that a retry of
//! the recorded request is answered as one, not refused as a changed one.
//!
//! Every replica adds its routes' settings when a configuration is applied
//! and keeps the list in memory; a mismatch whose record names settings not
//! in the list reads it again (another replica may have added them since),
//! at most once a second: a mismatch within a second of the last read waits
//! for the next one rather than be answered from a list read before another
//! replica's settings were added (that replica serves from the moment its
//! configuration applies, and adds its settings just after). Nothing on the
//! path of a first write or a replay reads it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::idempotency::fingerprint::FingerprintSpec;
use crate::request::route::Route;
use crate::retry::Backoff;
use crate::store::{Store, StoreError};

/// How often, at most, a mismatch reads the list again.
const REREAD: Duration = Duration::from_secs(1);

/// Between tries to add a configuration's settings while the store is away.
const RETRY: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));

#[derive(Debug, Default)]
pub struct FingerprintHistory {
    by_digest: RwLock<HashMap<String, Arc<FingerprintSpec>>>,
    /// When a mismatch last asked for the list (read or not); held by the
    /// mismatch reading it, so that the others wait for that read.
    asked_at: tokio::sync::Mutex<Option<Instant>>,
}

impl FingerprintHistory {
    /// Adds `routes`' settings to the store's list and reads the list, until
    /// it works or `stop` fires (a store away at start is tried again).
    pub async fn add(&self, store: &Store, routes: &[Arc<Route>], stop: CancellationToken) {
        let specs: Vec<(String, String)> = routes.iter().map(|r| (r.operation.to_string(), r.key.fingerprint.to_text())).collect();
        let mut failures = 0;
        loop {
            let added = match store.add_fingerprint_specs(&specs).await {
                Ok(()) => self.read(store).await,
                Err(e) => Err(e),
            };
            let Err(e) = added else { return };
            failures += 1;
            tracing::warn!(error = %e, "could not add the routes' fingerprint settings to the store's list; trying again");
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(RETRY.jittered(failures)) => {}
            }
        }
    }

    /// The settings whose digest is `digest`, read from the store again if
    /// they are not known: at once if the list was last asked for longer
    /// ago than a second, else once that second is over, unless another
    /// mismatch asked for it after this one arrived. A store that cannot
    /// answer leaves the list as it was.
    pub async fn find(&self, store: &Store, digest: &str) -> Option<Arc<FingerprintSpec>> {
        if let Some(spec) = self.known(digest) {
            return Some(spec);
        }
        let arrived = Instant::now();
        let mut asked_at = self.asked_at.lock().await;
        // Read meanwhile (by a mismatch that held the lock), or since this
        // request arrived: nothing newer to wait for.
        if let Some(spec) = self.known(digest) {
            return Some(spec);
        }
        if asked_at.is_some_and(|at| at >= arrived) {
            return None;
        }
        if let Some(at) = *asked_at {
            tokio::time::sleep_until(at + REREAD).await;
        }
        *asked_at = Some(Instant::now());
        if let Err(e) = self.read(store).await {
            tracing::debug!(error = %e, "could not read the fingerprint settings the operations have had");
        }
        self.known(digest)
    }

    /// The settings whose digest is `digest`, if this replica knows them
    /// (no store read).
    pub fn known(&self, digest: &str) -> Option<Arc<FingerprintSpec>> {
        self.by_digest.read().ok()?.get(digest).cloned()
    }

    async fn read(&self, store: &Store) -> Result<(), StoreError> {
        let mut by_digest = HashMap::new();
        for (operation, text) in store.fingerprint_specs().await? {
            match FingerprintSpec::from_text(&text) {
                Ok(spec) => {
                    by_digest.insert(spec.digest(), Arc::new(spec));
                }
                Err(e) => tracing::warn!(%operation, error = %e, "unreadable fingerprint settings in the store's list; skipped"),
            }
        }
        if let Ok(mut known) = self.by_digest.write() {
            *known = by_digest;
        }
        Ok(())
    }
}
