//! What a store operation's failure lets the caller conclude.

/// A store failure, classified by what the caller may conclude.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Nothing was sent to the store (no connection, pool exhausted,
    /// database refused the statement): the write certainly did not happen.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The statement may or may not have taken effect (connection lost or
    /// timed out after it was sent). Read the row back to find out.
    #[error("store write outcome unknown: {0}")]
    Ambiguous(String),
    /// The database holds something this version cannot read.
    #[error("corrupt record: {0}")]
    Corrupt(String),
    /// Another process holds the embedded store.
    #[error("{0}")]
    Locked(String),
    /// The store does not exist (a CLI command on a path that was never
    /// migrated): nothing was created.
    #[error("{0}")]
    Missing(String),
    /// Schema or migration problem.
    #[error("migration failed: {0}")]
    Migration(String),
}

impl StoreError {
    pub fn is_ambiguous(&self) -> bool {
        matches!(self, StoreError::Ambiguous(_))
    }
}
