//! The fingerprint settings each operation has had, as the store lists them
//! (migration 0019). A rollout or a reload that changes a route's
//! `fingerprint.*` settings changes what an identical request fingerprints
//! as: a request whose fingerprint differs from its record's is also
//! fingerprinted under each of the operation's other settings
//! ([`crate::proxy::admission::decide_with_legacy`]), so that a retry of the
//! recorded request is answered as one, not refused as a changed request.
//!
//! Every replica adds its routes' settings when a configuration is applied
//! and keeps the list in memory; a mismatch reads it again when it is older
//! than [`REREAD`] (another replica may have added settings since). Nothing
//! on the path of a first write or a replay reads it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::idempotency::fingerprint::FingerprintSpec;
use crate::request::route::Route;
use crate::retry::Backoff;
use crate::store::{Store, StoreError};

/// How old the list may be when a mismatch reads it.
const REREAD: Duration = Duration::from_secs(1);

/// The most settings of one operation a mismatch is compared under (the
/// latest ones): each costs a fingerprint of the request.
const MOST: usize = 16;

/// Between tries to add a configuration's settings while the store is away.
const RETRY: Backoff = Backoff::new(Duration::from_millis(500), Duration::from_secs(30));

#[derive(Debug, Default)]
pub struct FingerprintHistory {
    known: RwLock<Known>,
}

#[derive(Debug, Default)]
struct Known {
    by_operation: HashMap<String, Vec<Arc<FingerprintSpec>>>,
    read_at: Option<Instant>,
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

    /// Reads the list again if it was read longer ago than [`REREAD`] (or
    /// never). A store that cannot answer leaves the list as it was.
    pub async fn reread_if_stale(&self, store: &Store) {
        let fresh = self.known.read().is_ok_and(|k| k.read_at.is_some_and(|at| at.elapsed() < REREAD));
        if !fresh && let Err(e) = self.read(store).await {
            tracing::debug!(error = %e, "could not read the fingerprint settings the operations have had");
        }
    }

    /// The settings `operation` has had other than `current`, the latest
    /// [`MOST`] of them.
    pub fn earlier(&self, operation: &str, current: &FingerprintSpec) -> Vec<Arc<FingerprintSpec>> {
        let Ok(known) = self.known.read() else { return Vec::new() };
        let Some(specs) = known.by_operation.get(operation) else { return Vec::new() };
        specs.iter().rev().filter(|s| ***s != *current).take(MOST).cloned().collect()
    }

    async fn read(&self, store: &Store) -> Result<(), StoreError> {
        let mut by_operation: HashMap<String, Vec<Arc<FingerprintSpec>>> = HashMap::new();
        for (operation, text) in store.fingerprint_specs().await? {
            match FingerprintSpec::from_text(&text) {
                Ok(spec) => by_operation.entry(operation).or_default().push(Arc::new(spec)),
                Err(e) => tracing::warn!(%operation, error = %e, "unreadable fingerprint settings in the store's list; skipped"),
            }
        }
        if let Ok(mut known) = self.known.write() {
            *known = Known { by_operation, read_at: Some(Instant::now()) };
        }
        Ok(())
    }
}
