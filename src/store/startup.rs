//! `serve`'s first contact with the store: pending migrations (with
//! `store.migrate`), then the derived-key secret `migrate` generated (unless
//! one is configured). Only then do requests reach the store.
//!
//! When PostgreSQL cannot be reached at start and
//! `store.unreachable_at_start = "retry"` (the default), `serve` starts
//! anyway: the store is held closed ([`Store::hold`]: every operation fails
//! at once as `Unavailable`, so idempotent routes answer 503
//! `store-unavailable` and forward nothing, `/readyz` answers 503, pass-through
//! is served), and [`Retry`] tries again with jittered exponential backoff
//! until the store answers; then the migrations run and the store opens.

use crate::retry::Backoff;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Store, StoreError};
use crate::secret::DerivedKeySecret;

/// The waits between two attempts: a quarter second doubling to ten,
/// jittered so that replicas that lost the store together do not come back in
/// step.
const RETRY: Backoff = Backoff::new(Duration::from_millis(250), Duration::from_secs(10));

/// Why the store could not be brought up.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    /// A setting the store relies on is not in force on its sessions.
    #[error("store: {0} (\"Behind a connection pooler\" in docs/operations.md)")]
    Sessions(String),
    #[error(
        "the store has no derived-key secret (it was never migrated to this version): run `idemgate migrate`, or set server.derived_key_secret_env"
    )]
    NoSecret,
}

/// What a server says when it refuses the login itself (SQLSTATE class 28:
/// bad password, unknown role; 3D000: no such database): a mistake in the
/// configuration, not an outage, so the start stops at once either way.
const REFUSED_LOGIN: [&str; 2] = ["(SQLSTATE 28", "(SQLSTATE 3D000)"];

impl StartError {
    /// The store did not answer (as opposed to answering with a problem, or
    /// refusing the login): worth trying again later.
    pub fn unreachable(&self) -> bool {
        match self {
            StartError::Store(StoreError::Unavailable(m)) => !REFUSED_LOGIN.iter().any(|code| m.contains(code)),
            StartError::Store(StoreError::Ambiguous(_)) => true,
            _ => false,
        }
    }
}

impl Store {
    /// Keeps every operation from reaching the backend (they fail as
    /// `Unavailable`) until [`Store::bring_up`] succeeds.
    pub fn hold(&self) {
        self.up.store(false, Ordering::Release);
    }

    /// Whether operations reach the backend (false while held).
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Applies pending migrations (`migrate`), learns the derived-key secret
    /// from the store unless `secret` already holds one, then opens the
    /// store to requests.
    pub async fn bring_up(&self, migrate: bool, secret: &DerivedKeySecret) -> Result<(), StartError> {
        // Before anything is written: every setting the store relies on in
        // force, or the reason why not.
        let sessions = self.check_sessions().await?;
        if !sessions.problems.is_empty() {
            return Err(StartError::Sessions(sessions.problems.join("; ")));
        }
        if !sessions.note.is_empty() {
            tracing::debug!(settings = %sessions.note, "store sessions checked");
        }
        if migrate {
            let applied = self.backend.migrate().await?;
            if !applied.is_empty() {
                tracing::info!(?applied, store = self.kind(), "applied migrations");
            }
        }
        if secret.get().is_none() {
            let read = match tokio::time::timeout(self.timeout, self.backend.derived_key_secret()).await {
                Ok(read) => read?,
                Err(_) => return Err(StoreError::Unavailable(format!("derived_key_secret timed out after {:?}", self.timeout)).into()),
            };
            secret.set(&read.ok_or(StartError::NoSecret)?);
        }
        self.up.store(true, Ordering::Release);
        Ok(())
    }
}

/// Brings a held store up in the background (see the module's comment).
#[derive(Debug)]
pub struct Retry {
    pub store: Store,
    pub migrate: bool,
    pub secret: DerivedKeySecret,
}

impl Retry {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut attempt = 0u32;
        loop {
            let wait = RETRY.jittered(attempt.saturating_add(1));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            match self.store.bring_up(self.migrate, &self.secret).await {
                Ok(()) => {
                    tracing::info!(store = self.store.kind(), attempts = attempt + 1, "store reached: idempotent routes are served");
                    return;
                }
                Err(e) => {
                    let next = RETRY.after(attempt.saturating_add(2));
                    if e.unreachable() {
                        tracing::warn!(error = %e, retry_within = ?next, "store still unreachable; idempotent routes answer 503, pass-through is served");
                    } else {
                        tracing::error!(error = %e, retry_within = ?next, "the store answers but cannot be used; retrying");
                    }
                }
            }
            attempt = attempt.saturating_add(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_logins_are_not_outages() {
        let unavailable = |m: &str| StartError::Store(StoreError::Unavailable(m.into())).unreachable();
        assert!(unavailable("no database connection: error connecting to server: Connection refused (os error 111)"));
        assert!(unavailable("no database connection: db error: FATAL: the database system is starting up (SQLSTATE 57P03)"));
        assert!(!unavailable(r#"no database connection: db error: FATAL: database "x" does not exist (SQLSTATE 3D000)"#));
        assert!(!unavailable(r#"no database connection: db error: FATAL: password authentication failed for user "u" (SQLSTATE 28P01)"#));
        assert!(!StartError::NoSecret.unreachable());
        assert!(!StartError::Sessions("statement_timeout is 0 instead of 5000".into()).unreachable());
        assert!(!StartError::Store(StoreError::Migration("0003: syntax error".into())).unreachable());
    }
}
